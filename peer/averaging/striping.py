"""Downloading one thing from many donors at once: each donor takes the next piece nobody has taken, and a donor that
fails is dropped and its piece goes back to the others. The state download (``sharing.py``) and a round's result
(``results.py``) both stripe this way.

A stream that is cut before its donor answered (``StreamCut``) says nothing about the donor: right after a partition
heals, the first streams to the other side were reset, on connections that one side had given up during the cut, and
the donors they went to held the state. Dropped for it, both donors of a 4-peer swarm were lost to a peer's catch-up,
which trained on its own state for another round (``tests/test_faults.py``, the split that heals)."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import Any, Awaitable, Callable, Dict, Sequence, Tuple

from hivemind.p2p.p2p_daemon_bindings.utils import ControlFailure

logger = logging.getLogger(__name__)


async def stripe(donors: Sequence[str], count: int, fetch: Callable[[str, int], Awaitable[Any]], what: str
                 ) -> Dict[int, Tuple[str, Any]]:
    """Pieces 0..count-1 from every donor at once; returns {piece: (donor, value)}, every piece unless every donor
    failed. ``fetch(donor, piece)`` raises to drop that donor; a donor whose last piece came through gets one more
    try first: a relay resets a relayed connection once it carried its data limit (``dht/reach.py``), and the next
    stream opens a fresh one. So does, once, a donor whose stream was cut before it answered (``cut``)."""
    pending, got, changed = deque(range(count)), {}, asyncio.Event()

    async def worker(donor: str) -> None:
        delivered = False  # since its last failure
        forgiven = False  # a cut stream, tried again once
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
                if delivered or cut(e) and not forgiven:
                    forgiven = forgiven or not delivered
                    delivered = False
                    logger.debug(f"{what} from {donor} failed ({e!r}); once more, on a fresh stream")
                    continue
                logger.info(f"{what} from {donor} failed ({e!r}); taking its share from the others")
                return
            got[piece] = (donor, value)
            delivered = True
            changed.set()

    await asyncio.gather(*(worker(donor) for donor in donors))
    return got


class StreamCut(ConnectionError):
    """A donor's stream ended before the donor said a word: the connection under it was reset or closed."""


def cut(error: BaseException) -> bool:
    """Was the stream cut under us (``StreamCut``, or p2pd's reset of a stream it was still opening), rather than
    the donor failing or refusing?"""
    return isinstance(error, StreamCut) or isinstance(error, ControlFailure) and "reset" in str(error)
