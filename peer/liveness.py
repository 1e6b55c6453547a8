"""Whether a peer's process is gone, asked of the network rather than of its DHT record.

A record says a peer is alive until its heartbeats have been missing for a few seconds (``consensus.responsive``),
so a peer killed just before a sync is still expected in its group, and the matchmaking leader waits out the
whole grace window for it. The network knows sooner: when a peer's process dies, its p2p daemon dies with it
(``dht.node``), the kernel closes its listening socket, and a dial to any address of it is refused at once.

Only a refusal on every address counts. A dial that times out, a peer with no known address, or one that
a previous failure put into libp2p's dial backoff says nothing: the peer may be cut off, slow, or behind a
NAT, and it keeps its place in the expected group. One live peer can look gone: one restarted on a new port
(``tcp/0``) whose new address our daemon has not learned yet, while the old one refuses. It then misses this
group and contributes at the next one, as any late peer does; no state forks.
"""

from __future__ import annotations

import asyncio
from typing import List, Sequence

from hivemind.p2p import P2P, PeerID

PROBE_SECONDS = 2.0  # a refusal comes within a round trip; anything slower is no answer
PROBE_EVERY = 1.0  # seconds between dials to the same expected peer while a group forms


def refused_everywhere(error: str) -> bool:
    """True for libp2p's "all dials failed" where every address it tried refused the connection."""
    if "all dials failed" not in error:
        return False
    attempts = [line for line in error.splitlines() if line.strip().startswith("* ")]
    return bool(attempts) and all("connection refused" in line for line in attempts)


async def gone(p2p: P2P, peer_ids: Sequence[str], timeout: float = PROBE_SECONDS) -> List[str]:
    """Those of ``peer_ids`` whose every address refuses a connection now. A peer we are connected to
    answers at once; so does a dead one."""

    async def refuses(peer_id: str) -> bool:
        try:
            # hivemind's P2P has no public connect; its daemon client does (the daemon dials the peer's known
            # addresses, or reuses an open connection)
            await asyncio.wait_for(p2p._client.connect(PeerID.from_base58(peer_id), []), timeout)
        except asyncio.TimeoutError:
            return False
        except Exception as e:
            return refused_everywhere(str(e))
        return False

    answers = await asyncio.gather(*(refuses(peer_id) for peer_id in peer_ids))
    return [peer_id for peer_id, refused in zip(peer_ids, answers) if refused]
