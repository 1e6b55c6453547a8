"""Where this project runs: Linux (natively, under WSL2, or in docker) and, untested, macOS.

hivemind starts a Go p2p daemon that talks to Python over Unix sockets and forks its helper processes; neither
works on native Windows. The check runs when ``dht`` is first imported, before hivemind is, so that a Windows user
gets one line that says what to use instead rather than a traceback from deep inside hivemind.
"""

from __future__ import annotations

import sys
from typing import Optional


def unsupported(platform: str = sys.platform) -> Optional[str]:
    """Why ``platform`` cannot run a peer, or None where it can."""
    if platform.startswith("win") or platform in ("cygwin", "msys"):
        return ("native Windows is not supported: hivemind's p2p daemon needs Linux (or macOS). Run it under WSL2 "
                "(wsl --install, then this same command inside it) or in docker (docker/Dockerfile)")
    return None


def require_supported() -> None:
    """Exit with one line on a platform that cannot run a peer (no traceback: nothing else has started)."""
    reason = unsupported()
    if reason is not None:
        raise SystemExit(f"error: {reason}")
