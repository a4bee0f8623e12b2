"""The in-process engine (`backend.kind: embedded`): the target run by slot batching on a CPU, or by transformers'
continuous batching (backend.py)."""
