"""Errors meant for the person at the keyboard."""


class UserError(Exception):
    """Something the user can fix (a flag, an address, a file). The CLI prints ``error: <message>``
    on one line and exits non-zero, without a traceback."""


def first_line(error: BaseException, limit: int = 200) -> str:
    """An exception as one short line (p2p errors carry multi-line Go dial reports)."""
    text = (str(error).strip().splitlines() or [repr(error)])[0]
    return text if len(text) <= limit else text[: limit - 3] + "..."
