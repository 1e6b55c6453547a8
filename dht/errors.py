"""Errors meant for the person at the keyboard."""


class UserError(Exception):
    """Something the user can fix (a flag, an address, a file). The CLI prints ``error: <message>``
    on one line and exits non-zero, without a traceback."""
