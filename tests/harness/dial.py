"""A DHT node (``dht.node.start_dht``) that dials another one the moment a line with its multiaddr arrives on
stdin, and prints ``connected`` or ``failed: <why>`` (tests/test_netns.py).

    python -m tests.harness.dial <listen ip>
"""

import functools
import sys

from hivemind.p2p import PeerID
from hivemind.utils.multiaddr import Multiaddr

from dht import internals
from dht.node import DHTConfig, start_dht, visible_maddrs


async def dial(maddr: str, _dht, node) -> str:
    address = Multiaddr(maddr)
    peer = PeerID.from_base58(address.value_for_protocol("p2p"))
    try:
        await internals.connect(node.p2p, peer, [address.decapsulate(Multiaddr(f"/p2p/{peer}"))])
        return "connected"
    except Exception as e:
        return "failed: " + " ".join(str(e).split())


def main() -> None:
    dht = start_dht(DHTConfig(host_maddrs=(f"/ip4/{sys.argv[1]}/tcp/0",)), check_identity=False)
    try:
        print(visible_maddrs(dht)[0], flush=True)
        print(dht.run_coroutine(functools.partial(dial, sys.stdin.readline().strip())), flush=True)
    finally:
        dht.shutdown()


if __name__ == "__main__":
    main()
