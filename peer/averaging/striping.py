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
    failed. ``fetch(donor, piece)`` raises to drop that donor; a donor whose last piece came through gets one more
    try first: a relay resets a relayed connection once it carried its data limit (``dht/reach.py``), and the next
    stream opens a fresh one."""
    pending, got, changed = deque(range(count)), {}, asyncio.Event()

    async def worker(donor: str) -> None:
        delivered = False  # since its last failure
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
                if delivered:
                    delivered = False
                    logger.debug(f"{what} from {donor} failed after a piece came through ({e!r}); once more")
                    continue
                logger.info(f"{what} from {donor} failed ({e!r}); taking its share from the others")
                return
            got[piece] = (donor, value)
            delivered = True
            changed.set()

    await asyncio.gather(*(worker(donor) for donor in donors))
    return got
