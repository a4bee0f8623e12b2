"""Step 1, prompts: source files and datasets, their shapes adapted to chat messages, and the selection."""
