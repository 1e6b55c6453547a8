"""How a peer takes its place in the swarm: the initial peers asked whether they can dial its DHT node
(``dht/reach.py``), and, if none can, the node started again relayed or in client mode (``--if-unreachable``)."""

from __future__ import annotations

import dataclasses
import logging
from typing import Tuple

from dht.addresses import parse_maddrs
from dht.node import DHTConfig, SwarmDHT, start_dht, visible_maddrs
from dht.processes import stop_process
from dht.reach import Reach, ask_to_dial_back, circuit_addresses, dialable

logger = logging.getLogger(__name__)


def reachable(dht: SwarmDHT, net: DHTConfig, validators) -> Tuple[SwarmDHT, DHTConfig, Reach]:
    """Ask the initial peers to dial our started ``dht`` back (``dht/reach.py``). A peer nobody can dial would
    stall every group that chose it to reduce a part or serve the state: by default (``--if-unreachable
    client``) it starts again in client mode, which trains and sends its work but dials out only. Returns the
    DHT it runs (``dht`` itself, or a new one with ``dht`` shut down), its config and its reach."""
    if net.client_mode or not net.initial_peers:
        return dht, net, Reach.CLIENT if net.client_mode else Reach.UNKNOWN
    reach = ask_to_dial_back(dht, [str(m["p2p"]) for m in parse_maddrs(net.initial_peers, flag="--initial-peers",
                                                                      need_peer_id=True)])
    if reach is not Reach.UNREACHABLE:
        return dht, net, reach
    addresses = " ".join(dialable(visible_maddrs(dht)))
    if net.if_unreachable == "warn":
        logger.warning(f"no peer could dial this one at {addresses}: groups that pick it to reduce a part will "
                       f"fail; forward the port and pass --announce-maddrs, or drop --if-unreachable warn")
        return dht, net, reach
    stop_process(dht)  # and again, with the same identity (ours, a moment ago): relayed, or in client mode
    why = "behind NAT or a firewall"
    if net.if_unreachable == "relay":
        relayed = dataclasses.replace(net, relayed=True)
        dht = start_dht(relayed, validators, check_identity=False)
        circuits = circuit_addresses(dht)
        if circuits:
            logger.warning(f"no peer could dial this one at {addresses} ({why}): reachable through a relay at "
                           f"{circuits[0]}")
            return dht, relayed, Reach.RELAYED
        stop_process(dht)
        why += ", and no initial peer granted it a relay slot"
    logger.warning(f"no peer could dial this one at {addresses} ({why}): going on in client mode, which trains "
                   f"and sends its work but reduces no parts and serves no state; to be a full member, forward the "
                   f"port and pass --announce-maddrs")
    net = dataclasses.replace(net, client_mode=True)
    return start_dht(net, validators, check_identity=False), net, Reach.CLIENT
