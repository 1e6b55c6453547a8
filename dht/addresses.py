"""Multiaddr checks that run before any daemon starts, so a typo is a one-line error, not a Go stack."""

from __future__ import annotations

import ipaddress
from typing import Iterable, List, Optional, Sequence

from hivemind.utils.multiaddr import Multiaddr
from hivemind.utils.multiaddr.exceptions import Error as MultiaddrError

from dht.errors import UserError

EXAMPLE = "/ip4/203.0.113.5/tcp/31337/p2p/12D3KooW..."


def parse_maddr(text: str, *, flag: str, need_peer_id: bool) -> Multiaddr:
    """Parse one multiaddr given on the command line; ``need_peer_id`` for addresses we dial."""
    try:
        maddr = Multiaddr(text.strip())
    except (MultiaddrError, ValueError, TypeError) as e:
        raise UserError(f"{flag}: malformed multiaddr {text!r} ({e}); expected something like {EXAMPLE}") from None
    protocols = [proto.name for proto in maddr.protocols()]
    if not {"ip4", "ip6", "dns", "dns4", "dns6"} & set(protocols):
        raise UserError(f"{flag}: multiaddr {text!r} names no host (/ip4/, /ip6/ or /dns/); expected {EXAMPLE}")
    if need_peer_id and "p2p" not in protocols:
        raise UserError(
            f"{flag}: multiaddr {text!r} lacks the /p2p/<peer id> part; copy the full address that "
            f"`python -m dht` or another peer printed, e.g. {EXAMPLE}"
        )
    return maddr


def parse_maddrs(texts: Iterable[str], *, flag: str, need_peer_id: bool) -> List[Multiaddr]:
    """Parse a list of multiaddrs; commas and whitespace both separate addresses."""
    items = [part for text in texts for part in text.replace(",", " ").split()]
    return [parse_maddr(item, flag=flag, need_peer_id=need_peer_id) for item in items]


def scope(maddr: str) -> int:
    """How far an address reaches: 0 the internet (or a DNS name), 1 a private network, 2 this machine only."""
    host = next((part for kind, part in zip(maddr.split("/")[1::2], maddr.split("/")[2::2])
                 if kind in ("ip4", "ip6")), None)
    if host is None:
        return 0
    ip = ipaddress.ip_address(host)
    return 2 if ip.is_loopback else 0 if ip.is_global else 1


def private_only_hint(maddrs: Sequence[str]) -> Optional[str]:
    """One line for a node whose every address is private or loopback: peers elsewhere on the internet cannot
    dial any of them (a cloud VM's private address, a LAN address), and the node cannot tell its public one. None
    where one is public, or where all are loopback (a swarm on one machine, by choice)."""
    if not maddrs or min(scope(m) for m in maddrs) != 1:
        return None
    port = next((m.split("/tcp/")[1].split("/")[0] for m in maddrs if "/tcp/" in m), "PORT")
    return (f"these addresses are private: peers outside this network cannot dial them. If this machine has a "
            f"public IP (a cloud VM, a forwarded port), restart with --announce-maddrs /ip4/<public ip>/tcp/{port} "
            f"and a fixed port in --host-maddrs; others then pass that address with /p2p/<peer id>")
