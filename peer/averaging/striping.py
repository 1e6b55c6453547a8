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


class _Pieces:
    """A striped download's bookkeeping: the pieces nobody asked for yet, those in flight (when first asked, by how
    many donors), and those in."""

    def __init__(self, count: int, stalled: float, what: str):
        self.count, self.stalled, self.what = count, stalled, what
        self.loop = asyncio.get_running_loop()
        self.pending, self.got = deque(range(count)), {}
        self.asked: Dict[int, float] = {}  # piece -> when it was first asked for, while in flight and not yet in
        self.asking: Dict[int, int] = {}  # piece -> its fetches in flight
        self.changed, self.complete = asyncio.Event(), asyncio.Event()

    def missing(self) -> bool:
        return len(self.got) < self.count

    def next(self, took: float) -> Tuple[Optional[int], float]:
        """The piece a donor whose last piece took ``took`` seconds asks for now (and counts as in flight), or None
        and the seconds until a piece in flight is stalled by its measure."""
        piece, soonest = (self.pending.popleft(), 0.0) if self.pending else self._stalled(took)
        if piece is not None:
            self.asked.setdefault(piece, self.loop.time())
            self.asking[piece] = self.asking.get(piece, 0) + 1
        return piece, soonest

    def _stalled(self, took: float) -> Tuple[Optional[int], float]:
        now, soonest = self.loop.time(), math.inf
        for piece, since in sorted(self.asked.items(), key=lambda item: item[1]):
            if self.asking[piece] > 1:  # asked of a second donor already
                continue
            ready = since + max(self.stalled, took)
            if ready <= now:
                logger.debug(f"{self.what}: piece {piece} in flight for {now - since:.1f}s; asking another donor too")
                return piece, 0.0
            soonest = min(soonest, ready - now)
        return None, soonest

    async def wait(self, seconds: float) -> None:
        """Until the pieces change, or ``seconds`` pass (a piece in flight stalls)."""
        self.changed.clear()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.changed.wait(), None if math.isinf(seconds) else seconds)

    def failed(self, piece: int) -> None:
        self.asking[piece] -= 1
        if piece not in self.got and not self.asking[piece]:  # nobody else is asking for it: back in the queue
            del self.asked[piece]
            self.pending.appendleft(piece)
        self.changed.set()

    def came(self, piece: int, donor: str, value: Any) -> None:
        self.asking[piece] -= 1
        if piece not in self.got:  # the first answer wins
            self.got[piece] = (donor, value)
            self.asked.pop(piece, None)
            if not self.missing():
                self.complete.set()
        self.changed.set()


async def stripe(donors: Sequence[str], count: int, fetch: Callable[[str, int], Awaitable[Any]], what: str,
                 stalled: float = STALLED) -> Dict[int, Tuple[str, Any]]:
    """Pieces 0..count-1 from every donor at once; returns {piece: (donor, value)}, every piece unless every donor
    failed. ``fetch(donor, piece)`` raises to drop that donor; a donor whose last piece came through gets one more
    try first: a relay resets a relayed connection once it carried its data limit (``dht/reach.py``), and the next
    stream opens a fresh one. So does, once, a donor whose stream was cut before it answered (``cut``). A piece in
    flight for ``stalled`` seconds is asked for again by an idle donor (the module's end game)."""
    pieces = _Pieces(count, stalled, what)
    loop = pieces.loop

    async def worker(donor: str) -> None:
        delivered = False  # since its last failure
        forgiven = False  # a cut stream, tried again once
        took = 0.0  # seconds its last piece took
        while pieces.missing():
            piece, wait = pieces.next(took)
            if piece is None:
                await pieces.wait(wait)
                continue
            began = loop.time()
            try:
                value = await fetch(donor, piece)
            except Exception as e:
                pieces.failed(piece)
                if delivered or cut(e) and not forgiven:
                    forgiven = forgiven or not delivered
                    delivered = False
                    logger.debug(f"{what} from {donor} failed ({e!r}); once more, on a fresh stream")
                    continue
                logger.info(f"{what} from {donor} failed ({e!r}); taking its share from the others")
                return
            took, delivered = loop.time() - began, True
            pieces.came(piece, donor, value)

    workers = [asyncio.ensure_future(worker(donor)) for donor in donors]
    finished = asyncio.ensure_future(pieces.complete.wait())
    try:  # until every piece is in (a stalled fetch is cancelled then), or every donor is done or dropped
        running = set(workers)
        while running and not finished.done():
            _, running = await asyncio.wait({*running, finished}, return_when=asyncio.FIRST_COMPLETED)
            running.discard(finished)
    finally:
        for task in (*workers, finished):
            task.cancel()
        await asyncio.gather(*workers, finished, return_exceptions=True)  # each one's end, retrieved
    return pieces.got


class StreamCut(ConnectionError):
    """A donor's stream ended before the donor said a word: the connection under it was reset or closed."""


def cut(error: BaseException) -> bool:
    """Was the stream cut under us (``StreamCut``, or p2pd's reset of a stream it was still opening), rather than
    the donor failing or refusing?"""
    return isinstance(error, StreamCut) or isinstance(error, ControlFailure) and "reset" in str(error)
