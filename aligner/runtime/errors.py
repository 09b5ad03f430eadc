"""The errors a user can fix: `aligner.config.run_main` ends an entry point on one of them with one
`error: ...` line and exit 2; anything else is a bug and keeps its traceback.

They live in the bottom layer so that every part of the library can raise them.
"""
from __future__ import annotations


class UserError(Exception):
    """Base of the errors a user fixes (a config value, a data file, a path, the environment); the
    message names the key, file:line or path and says what to do."""


class ConfigError(UserError, ValueError):
    """A config value, command-line argument or environment setting cannot work."""


class DataError(UserError, ValueError):
    """A data file is missing, unreadable or holds a malformed record."""
