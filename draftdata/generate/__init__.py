"""Step 2, generate: store keys, the response store, the budget controller, the dispatcher and the backends."""
