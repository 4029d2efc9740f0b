"""The error a command ends with when the world is not as it needs (a database missing, Redis down): one line for
the person at the terminal, no traceback."""

from __future__ import annotations


class CommandError(Exception):
    """The message says what is wrong and what to do about it; `tokenfleet` prints it and exits with 1."""
