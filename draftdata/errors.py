"""Errors the user can act on: the bottom layer, imported by every other one."""

from __future__ import annotations


class UserError(Exception):
    """Bad input from the user: reported as one line and exit status 2, never a traceback."""

    exit_code = 2


class Incomplete(UserError):
    """The stage wrote its outputs, exact but short of the budget, because a request failed: one line and exit
    status 3, so that DVC records nothing and the next `dvc repro` asks the request again and goes on."""

    exit_code = 3


class ConfigError(UserError, ValueError):
    """A bad configuration value; str() is one line that starts with the offending key."""

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(f"{key}: {message}")
