"""The budget controller (controller.py) and what it learns from: completed lengths (lengths.py) and the server's
throughput against the batch (throughput.py). Pure: no I/O, so the benchmark simulates it (bench/budget.py)."""
