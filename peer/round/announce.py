"""Our record in the DHT: our state, and what we last said about our schedule, loss, speed and status.

Every change of state (an outer step, an adoption) and every change of what we say (syncing, downloading a state,
leaving) publishes the record at once; the transport's heartbeat refreshes it in between.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from dht.records import PeerRecord
from peer.outer.state import GlobalState


@dataclass(frozen=True)
class Identity:
    peer_id: str
    manifest_hash: str  # the run configuration this peer trains (records of other configurations are ignored)
    client_mode: bool  # it accepts no connections: it reduces no parts and serves no state
    reach: str = ""  # what the peers asked at its start found (dht/reach.py: direct, unreachable, unknown, client)


class Announcer:
    def __init__(self, transport, identity: Identity, state: GlobalState):
        self.transport, self.identity, self.state = transport, identity, state
        self.announced: dict = dict(ttl=60.0)

    def record(self, **fields) -> PeerRecord:
        """Our record at our state now, with these fields."""
        identity = self.identity
        return PeerRecord(peer_id=identity.peer_id, epoch=self.state.epoch, state_hash=self.state.hash(),
                          tokens_total=self.state.tokens_total, manifest_hash=identity.manifest_hash,
                          client_mode=identity.client_mode, reach=identity.reach, **fields)

    def announce(self, ttl: float, **fields) -> None:
        """Publish our record with these fields (schedule, loss, speed, status); re-sent after a rebase."""
        self.announced = dict(fields, ttl=ttl)
        self.republish()

    def fields(self) -> dict:
        """The fields last announced (without the ttl)."""
        return {k: v for k, v in self.announced.items() if k != "ttl"}

    def republish(self) -> None:
        """Our record again, at our state now: at once after an outer step or an adoption."""
        self.transport.publish(self.record(**self.fields()), self.announced["ttl"])

    def adopting(self, state_hash: Optional[str]) -> None:
        """Say that we are downloading the state with this hash (its holders' next group expects us), or no more."""
        fields = {k: v for k, v in self.fields().items() if k != "adopting"}
        self.announce(self.announced["ttl"], **fields, **({"adopting": state_hash} if state_hash else {}))
