"""Clients of generation servers (SGLang's native API, OpenAI-compatible ones), over protocol.py."""
