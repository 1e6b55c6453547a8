"""Whether an expected peer can be reached now, asked of the network rather than of its DHT record.

A record says a peer is alive until its heartbeats have been missing for a few seconds (``consensus.responsive``),
so a peer killed just before a sync is still expected in its group, and the matchmaking leader waits out the
whole grace window for it. The network knows sooner: when a peer's process dies, its p2p daemon dies with it
(``dht.node``), the kernel closes its listening socket, and a dial to any address of it is refused at once.

A peer counts as gone when a dial fails fast on every address: refused, or held back by libp2p's dial backoff,
which follows any failed dial for a few seconds. Backoff counts because something else in our daemon (the DHT,
hivemind's matchmaking) usually dials a dead peer first: measured, counting refusals alone found the dead peer
only when the backoff expired, 6 s into a sync, past the default 5-s grace window. A dial that is merely slow
(a far link: past PROBE_SECONDS), an open connection, or a peer with no known address counts as alive.

A live peer can look gone: one we cannot dial right now (a link that just healed and is still in backoff, a peer
restarted on a new ``tcp/0`` port whose new address our daemon has not learned). It can still dial us and join
if it is in time; otherwise it contributes at the next group, as any late peer does. No state forks either way.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable, List, Sequence

from hivemind.p2p import P2P, PeerID

from dht import internals

logger = logging.getLogger(__name__)

PROBE_SECONDS = 2.0  # a refusal comes within a round trip; anything slower is no answer
PROBE_EVERY = 1.0  # seconds between dials to the same expected peer while a group forms


def failed_fast_everywhere(error: str) -> bool:
    """True for libp2p's "all dials failed" where every address it tried refused the connection or was in
    dial backoff."""
    if "all dials failed" not in error:
        return False
    attempts = [line for line in error.splitlines() if line.strip().startswith("* ")]
    return bool(attempts) and all("connection refused" in line or "dial backoff" in line for line in attempts)


async def gone(p2p: P2P, peer_ids: Sequence[str], timeout: float = PROBE_SECONDS) -> List[str]:
    """Those of ``peer_ids`` whose every address fails a dial at once (``failed_fast_everywhere``). A peer we
    are connected to answers at once; so does a dead one."""

    async def fails_fast(peer_id: str) -> bool:
        try:  # the daemon dials the peer's known addresses, or reuses an open connection
            await asyncio.wait_for(internals.connect(p2p, PeerID.from_base58(peer_id)), timeout)
        except asyncio.TimeoutError:
            return False
        except Exception as e:
            return failed_fast_everywhere(str(e))
        return False

    answers = await asyncio.gather(*(fails_fast(peer_id) for peer_id in peer_ids))
    return [peer_id for peer_id, failed in zip(peer_ids, answers) if failed]


async def stop_waiting_for_the_gone(matchmaking, p2p: P2P, probe: Sequence[str], current: Callable[[], bool]) -> None:
    """Through a round's matchmaking (while ``current()``), dial the expected peers in ``probe`` every PROBE_EVERY
    seconds (a live one we are connected to answers from our own daemon); each one that cannot be reached comes off
    the expected group, and a leader that then holds every expected peer closes its group at once, as hivemind's
    does when the last expected follower joins."""
    loop = asyncio.get_event_loop()
    until = loop.time() + internals.group_sizes(matchmaking)[2] + PROBE_SECONDS
    waiting = list(probe)
    while waiting and current() and loop.time() < until:
        started = loop.time()
        try:
            dead = await gone(p2p, waiting)
        except Exception as e:
            logger.debug(f"liveness probe failed: {e!r}")
            return
        if dead:
            waiting = [peer for peer in waiting if peer not in dead]
            await _expect_fewer(matchmaking, dead, current)
        await asyncio.sleep(max(0.0, PROBE_EVERY - (loop.time() - started)))


async def _expect_fewer(matchmaking, dead: List[str], current: Callable[[], bool]) -> None:
    async with internals.join_lock(matchmaking):
        if not current():
            return
        min_group, target, _ = internals.group_sizes(matchmaking)
        target = max(target - len(dead), min_group)
        internals.set_target(matchmaking, target)
        logger.info(f"not waiting for {len(dead)} peer(s) at our state that cannot be reached (every dial refused "
                    f"or in backoff): {', '.join(peer[-6:] for peer in dead)}; expecting a group of {target}")
        await internals.close_group_if_complete(matchmaking)
