"""Downloading one thing from many donors at once: each donor takes the next piece nobody has taken, and a donor that
fails is dropped and its piece goes back to the others. The state download (``sharing.py``) and a round's result
(``results.py``) both stripe this way.

A stream that is cut before its donor answered (``StreamCut``) says nothing about the donor: right after a partition
heals, the first streams to the other side were reset, on connections that one side had given up during the cut, and
the donors they went to held the state. Dropped for it, both donors of a 4-peer swarm were lost to a peer's catch-up,
which trained on its own state for another round (``tests/test_faults.py``, the split that heals).

Once every piece is asked for, a donor left idle asks too for a piece that has been in flight longer than its own
last piece took, and at least ``STALLED`` seconds (the end game; one more donor a piece): the first answer wins and
the other fetch is cancelled. A donor that went silent (frozen, or on a connection still in TCP's retransmission
backoff after a heal) thus costs a download about a piece's time, not the part timeout it takes to drop it (15 s by
default; in one healed split, two downloads waited out a silent donor's 3 s each, and the half that asked missed the
next group)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections import deque
from typing import Any, Awaitable, Callable, Dict, Optional, Sequence, Tuple

from hivemind.p2p.p2p_daemon_bindings.utils import ControlFailure

logger = logging.getLogger(__name__)

STALLED = 1.0  # seconds a piece may be in flight before an idle donor asks for it too (the end game)


async def stripe(donors: Sequence[str], count: int, fetch: Callable[[str, int], Awaitable[Any]], what: str,
                 stalled: float = STALLED) -> Dict[int, Tuple[str, Any]]:
    """Pieces 0..count-1 from every donor at once; returns {piece: (donor, value)}, every piece unless every donor
    failed. ``fetch(donor, piece)`` raises to drop that donor; a donor whose last piece came through gets one more
    try first: a relay resets a relayed connection once it carried its data limit (``dht/reach.py``), and the next
    stream opens a fresh one. So does, once, a donor whose stream was cut before it answered (``cut``). A piece in
    flight for ``stalled`` seconds is asked for again by an idle donor (the module's end game)."""
    loop = asyncio.get_running_loop()
    pending, got, changed, complete = deque(range(count)), {}, asyncio.Event(), asyncio.Event()
    asked: Dict[int, float] = {}  # piece -> when it was first asked for, while in flight and not yet got
    asking: Dict[int, int] = {}  # piece -> its fetches in flight

    def next_piece(took: float) -> Tuple[Optional[int], float]:
        """The piece to ask for now, or None and the seconds until a piece in flight is stalled by our measure."""
        if pending:
            return pending.popleft(), 0.0
        now, soonest = loop.time(), math.inf
        for piece, since in sorted(asked.items(), key=lambda item: item[1]):
            if asking[piece] > 1:  # asked of a second donor already
                continue
            ready = since + max(stalled, took)
            if ready <= now:
                logger.debug(f"{what}: piece {piece} in flight for {now - since:.1f}s; asking another donor too")
                return piece, 0.0
            soonest = min(soonest, ready - now)
        return None, soonest

    async def worker(donor: str) -> None:
        delivered = False  # since its last failure
        forgiven = False  # a cut stream, tried again once
        took = 0.0  # seconds its last piece took
        while len(got) < count:
            piece, wait = next_piece(took)
            if piece is None:
                changed.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(changed.wait(), None if math.isinf(wait) else wait)
                continue
            asked.setdefault(piece, loop.time())
            asking[piece] = asking.get(piece, 0) + 1
            began = loop.time()
            try:
                value = await fetch(donor, piece)
            except Exception as e:
                asking[piece] -= 1
                if piece not in got and not asking[piece]:  # nobody else is asking for it: back in the queue
                    del asked[piece]
                    pending.appendleft(piece)
                changed.set()
                if delivered or cut(e) and not forgiven:
                    forgiven = forgiven or not delivered
                    delivered = False
                    logger.debug(f"{what} from {donor} failed ({e!r}); once more, on a fresh stream")
                    continue
                logger.info(f"{what} from {donor} failed ({e!r}); taking its share from the others")
                return
            asking[piece] -= 1
            took, delivered = loop.time() - began, True
            if piece not in got:
                got[piece] = (donor, value)
                asked.pop(piece, None)
                if len(got) == count:
                    complete.set()
            changed.set()

    workers = [asyncio.ensure_future(worker(donor)) for donor in donors]
    finished = asyncio.ensure_future(complete.wait())
    try:  # until every piece is in (a stalled fetch is cancelled then), or every donor is done or dropped
        running = set(workers)
        while running and not finished.done():
            _, running = await asyncio.wait({*running, finished}, return_when=asyncio.FIRST_COMPLETED)
            running.discard(finished)
    finally:
        for task in (*workers, finished):
            task.cancel()
        await asyncio.gather(*workers, finished, return_exceptions=True)  # each one's end, retrieved
    return got


class StreamCut(ConnectionError):
    """A donor's stream ended before the donor said a word: the connection under it was reset or closed."""


def cut(error: BaseException) -> bool:
    """Was the stream cut under us (``StreamCut``, or p2pd's reset of a stream it was still opening), rather than
    the donor failing or refusing?"""
    return isinstance(error, StreamCut) or isinstance(error, ControlFailure) and "reset" in str(error)
