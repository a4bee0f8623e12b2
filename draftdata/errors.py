"""Errors the user can act on: the bottom layer, imported by every other one."""

from __future__ import annotations


class UserError(Exception):
    """Bad input from the user: reported as one line and exit status 2, never a traceback."""


class ConfigError(UserError, ValueError):
    """A bad configuration value; str() is one line that starts with the offending key."""

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(f"{key}: {message}")
