"""draftdata: token-budgeted training data for speculative-decoding drafters (EAGLE-3 and kin).

Organised by pipeline step: sources, generate, tokenize, hidden; below them target (the model and its tokenizer),
config, util and errors; above them cli (the user's commands). The DVC stages in stages/ are thin users of it.
"""
