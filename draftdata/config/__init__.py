"""The typed configuration (schema.py, no Hydra) and its composition from conf/ and params.yaml (load.py)."""
