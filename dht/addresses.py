"""Multiaddr checks that run before any daemon starts, so a typo is a one-line error, not a Go stack."""

from __future__ import annotations

from typing import Iterable, List

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
