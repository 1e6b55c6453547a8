"""Downloading one thing from many donors at once: each donor takes the next piece nobody has taken, and a donor that
fails is dropped and its piece goes back to the others. The state download (``sharing.py``) and a round's result
(``results.py``) both stripe this way."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import Any, Awaitable, Callable, Dict, Sequence, Tuple

logger = logging.getLogger(__name__)


async def stripe(donors: Sequence[str], count: int, fetch: Callable[[str, int], Awaitable[Any]], what: str
                 ) -> Dict[int, Tuple[str, Any]]:
    """Pieces 0..count-1 from every donor at once; returns {piece: (donor, value)}, every piece unless every donor
    failed. ``fetch(donor, piece)`` raises to drop that donor."""
    pending, got, changed = deque(range(count)), {}, asyncio.Event()

    async def worker(donor: str) -> None:
        while len(got) < count:
            if not pending:
                changed.clear()
                await changed.wait()
                continue
            piece = pending.popleft()
            try:
                value = await fetch(donor, piece)
            except Exception as e:
                pending.appendleft(piece)
                changed.set()
                logger.info(f"{what} from {donor} failed ({e!r}); taking its share from the others")
                return
            got[piece] = (donor, value)
            changed.set()

    await asyncio.gather(*(worker(donor) for donor in donors))
    return got
