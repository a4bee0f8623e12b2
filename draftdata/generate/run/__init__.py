"""One generation run over a `Plan`: what is checked before it sends (preflight.py), the backend it talks to
(connect.py), the dispatcher that admits, commits and stops (dispatcher.py) with its parts (the ledger, the budget
controller in budget/, the work queue, the meter, the fail-fast window, the exact rule as it goes in settled.py),
the progress line, and the `RunResult` it returns (generation.py)."""
