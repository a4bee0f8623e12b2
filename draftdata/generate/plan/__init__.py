"""What a run asks, before any request: one per prompt, keyed by its rendered ids (planning.py), or each conversation
walked over the turns the store holds (conversation.py walks a source's turns; conversations.py keeps each one's
place; renders.py keeps the turns' ids), and the store's rows for them (`Plan`)."""
