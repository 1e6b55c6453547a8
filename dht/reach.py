"""Can others dial this node? Asked of peers it already knows, when it starts, as Petals does.

A node that listens (not client mode) serves ``PROTOCOL``: given the asker's addresses, it starts a throwaway p2p
daemon of its own, which holds no connection and uses no relay, and dials the asker's peer id at those addresses
alone. A dial that succeeds proves that the address reaches that very peer from elsewhere: a bare TCP connect would
be fooled by another machine that has the asker's private address on the checker's own LAN, and the checker's own
daemon would simply reuse the connection the asker opened to ask.

A starting peer asks up to ``ASK`` of its initial peers at once (``ask_to_dial_back``). One that reaches it makes
it ``DIRECT``; if all that answered failed to, it is ``UNREACHABLE``: behind NAT or a firewall, its addresses lead
nowhere, and a group that chose it as a reducer or a state donor would wait for it in vain. Nobody answering
says nothing (``UNKNOWN``).
"""

from __future__ import annotations

import asyncio
import enum
import functools
import logging
import time
from typing import List, Sequence

import hivemind
from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import MSGPackSerializer
from hivemind.utils.multiaddr import Multiaddr

from dht import internals
from dht.addresses import scope

logger = logging.getLogger(__name__)

PROTOCOL = "diloco.DialBack"
ASK = 3  # peers asked at once
CHECKS_AT_ONCE = 4  # throwaway daemons a checker runs at once
DIAL_SECONDS = 5.0  # how long a checker's dial may take
MAX_ADDRESSES = 8  # a request names at most this many addresses (a checker dials no list a stranger makes up)


class Reach(str, enum.Enum):
    DIRECT = "direct"  # another peer dialled one of our addresses
    UNREACHABLE = "unreachable"  # every peer that answered failed to
    UNKNOWN = "unknown"  # nobody answered: no peer to ask, or none that serves the check
    CLIENT = "client"  # client mode: it dials out only, and nobody is asked
    RELAYED = "relayed"  # nobody could dial it; others reach it through a relay circuit (--if-unreachable relay)


def dialable(maddrs: Sequence[str]) -> List[str]:
    """Our addresses worth a check, without their /p2p/ part: direct ones (no relay circuit), and loopback ones
    only where there is nothing else (a swarm on one machine), since a checker's loopback is its own."""
    direct = sorted({m.split("/p2p/")[0] for m in maddrs if "/p2p-circuit" not in m})
    outside = [m for m in direct if scope(m) < 2]
    return (outside or direct)[:MAX_ADDRESSES]


# ---- the checker's side (every listening node serves it, in its DHT's process) ----
async def _dial_back(checking: asyncio.Semaphore, request: averaging_pb2.DownloadData,
                     context: P2PContext) -> averaging_pb2.DownloadData:
    try:
        addresses = [Multiaddr(m) for m in MSGPackSerializer.loads(request.metadata)["maddrs"][:MAX_ADDRESSES]]
    except Exception as e:  # a malformed request: nothing to dial
        logger.debug(f"malformed dial-back request from {context.remote_id}: {e!r}")
        addresses = []
    reached = bool(addresses) and await _dial(checking, context.remote_id, addresses)
    return averaging_pb2.DownloadData(metadata=MSGPackSerializer.dumps(dict(reached=reached)))


async def _dial(checking: asyncio.Semaphore, peer_id: PeerID, addresses: List[Multiaddr]) -> bool:
    """Can a fresh daemon, with no connection and no relay, dial ``peer_id`` at ``addresses``?"""
    async with checking:  # a few throwaway daemons at a time, however many peers start at once
        probe = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], use_relay=False, auto_nat=False,
                                 nat_port_map=False, dht_mode="client", startup_timeout=10)
        try:
            await asyncio.wait_for(internals.connect(probe, peer_id, addresses), DIAL_SECONDS)
            return True
        except Exception as e:  # refused, unroutable, timed out, or another peer id answered
            logger.debug(f"dial back to {peer_id} at {addresses} failed: {e!r}")
            return False
        finally:
            await probe.shutdown()


async def _serve(_dht, node) -> None:
    handler = functools.partial(_dial_back, asyncio.Semaphore(CHECKS_AT_ONCE))
    await internals.dht_p2p(node).add_protobuf_handler(PROTOCOL, handler, averaging_pb2.DownloadData)


def serve_dial_back(dht: hivemind.DHT) -> None:
    """Answer other peers' reachability checks (call once, on a node that listens)."""
    dht.run_coroutine(_serve)


# ---- the asker's side ----
async def _ask(peer_ids: Sequence[str], maddrs: Sequence[str], timeout: float, _dht, node) -> List[bool]:
    p2p = internals.dht_p2p(node)
    request = averaging_pb2.DownloadData(metadata=MSGPackSerializer.dumps(dict(maddrs=list(maddrs))))

    async def one(peer_id: str):
        answer = await asyncio.wait_for(p2p.call_protobuf_handler(
            PeerID.from_base58(peer_id), PROTOCOL, request, averaging_pb2.DownloadData), timeout)
        return bool(MSGPackSerializer.loads(answer.metadata)["reached"])

    answers = await asyncio.gather(*map(one, peer_ids), return_exceptions=True)
    return [answer for answer in answers if isinstance(answer, bool)]


def ask_to_dial_back(dht: hivemind.DHT, peer_ids: Sequence[str], timeout: float = 15.0) -> Reach:
    """Ask up to ``ASK`` of ``peer_ids`` (not ours) whether they can dial us at our visible addresses."""
    own = dht.peer_id.to_base58()
    peer_ids = [p for p in dict.fromkeys(peer_ids) if p != own][:ASK]
    maddrs = dialable([str(m) for m in dht.get_visible_maddrs(latest=True)])
    if not peer_ids or not maddrs:
        return Reach.UNKNOWN
    answers = dht.run_coroutine(functools.partial(_ask, peer_ids, maddrs, timeout))
    if not answers:
        return Reach.UNKNOWN
    return Reach.DIRECT if any(answers) else Reach.UNREACHABLE


def circuit_addresses(dht: hivemind.DHT, timeout: float = 15.0) -> List[str]:
    """Our relay circuit addresses once the relays granted a reservation (none within ``timeout``: no relay would)."""
    deadline = time.monotonic() + timeout
    while True:
        circuits = [str(m) for m in dht.get_visible_maddrs(latest=True) if "/p2p-circuit" in str(m)]
        if circuits or time.monotonic() > deadline:
            return circuits
        time.sleep(0.2)
