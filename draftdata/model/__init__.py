"""The target: its tokenizer and chat template, end of turn, limits, identity, and the demo's tiny target."""
