"""The peer's picture of the swarm: the other peers' records as last read, kept across a failed read.

A lookup may miss records that the DHT holds only on nodes it cannot reach now (a partition): records seen before
stay known until they expire, as they would in the DHT, and a node cut off for a while may return an older
version of a record than one we hold, which is kept.

While reads time out, what we know is as of the last read that answered (``as_of``): records age only with news of
them. Judged against now, the records of peers that were alive a round ago turned unresponsive in our own view
only because our reads failed; a stalled peer with that empty view stepped alone and forked the run (16 peers on a
loaded machine, ``bench/results/scale.md``). A record still expires at its DHT expiry, so a peer cut off for
longer than that trains on alone.
"""

from __future__ import annotations

from typing import Dict, Optional

from dht.records import PeerRecord


class RecordCache:
    def __init__(self, peer_id: str):
        self.peer_id = peer_id
        self.records: Dict[str, PeerRecord] = {}
        self.lookup_failed = False  # the last read timed out: what we know may be stale
        self.read_at: Optional[float] = None  # DHT time of the last read that answered

    def update(self, fetched: Optional[Dict[str, PeerRecord]], now: float) -> Dict[str, PeerRecord]:
        """Merge a read (``None``: it timed out) into what we knew; returns the other peers' records."""
        self.lookup_failed = fetched is None
        if fetched is not None:
            self.read_at = now
        known = {pid: r for pid, r in self.records.items() if r.expires_at > now}
        for pid, record in (fetched or {}).items():
            if pid != self.peer_id and (pid not in known or record.expires_at >= known[pid].expires_at):
                known[pid] = record
        self.records = known
        return self.records

    def as_of(self, now: float) -> float:
        """The time to judge the known records' liveness at: now, or while reads time out, the last read that
        answered."""
        return self.read_at if self.lookup_failed and self.read_at is not None else now
