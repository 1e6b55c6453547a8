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
from typing import List, Sequence

from hivemind.p2p import P2P, PeerID

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
        try:
            # hivemind's P2P has no public connect; its daemon client does (the daemon dials the peer's known
            # addresses, or reuses an open connection)
            await asyncio.wait_for(p2p._client.connect(PeerID.from_base58(peer_id), []), timeout)
        except asyncio.TimeoutError:
            return False
        except Exception as e:
            return failed_fast_everywhere(str(e))
        return False

    answers = await asyncio.gather(*(fails_fast(peer_id) for peer_id in peer_ids))
    return [peer_id for peer_id, failed in zip(peer_ids, answers) if failed]
