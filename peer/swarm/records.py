"""The peer's picture of the swarm: the other peers' records as last read, kept across a failed read.

A lookup may miss records that the DHT holds only on nodes it cannot reach now (a partition): records seen before
stay known until they expire, as they would in the DHT, and a node cut off for a while may return an older
version of a record than one we hold, which is kept.

While reads time out, what we know is as of the last read that answered (``as_of``): records age only with news of
them. Judged against now, the records of peers that were alive a round ago turned unresponsive in our own view
only because our reads failed; a stalled peer with that empty view stepped alone and forked the run (16 peers on a
loaded machine, ``bench/results/scale.md``). A record still expires at its DHT expiry, so a peer cut off for
longer than that trains on alone.

A slow DHT delays every record alike, ours too: a read finds our own record as stale as the DHT's delay from a
store to a read (``lag``). Others' records are judged against that: a record counts as stale only for what it
lacks beyond our own (``seen_at`` less the lag), and its planned sync as of the lag ago (``as_of``). On a machine
loaded 20-fold, heartbeats landed seconds late, every peer saw every other go silent at once, and each stepped
alone (6 states in one epoch, 16 peers). A peer cut off from the others still reads its own record fresh, from
its side of the DHT, and sees them go silent.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Dict, Optional

from dht.records import HEARTBEAT_MISSES, PeerRecord

logger = logging.getLogger(__name__)


class RecordCache:
    def __init__(self, peer_id: str):
        self.peer_id = peer_id
        self.records: Dict[str, PeerRecord] = {}
        self.lookup_failed = False  # the last read timed out: what we know may be stale
        self.read_at: Optional[float] = None  # DHT time of the last read that answered
        self.lag = 0.0  # how stale reads find our own record: the DHT's delay from a store to a read
        self.late = False  # that delay is longer than a record may miss heartbeats (said once in the log)

    def update(self, fetched: Optional[Dict[str, PeerRecord]], now: float) -> Dict[str, PeerRecord]:
        """Merge a read (``None``: it timed out) into what we knew; returns the other peers' records."""
        self.lookup_failed = fetched is None
        if fetched is not None:
            self.read_at = now
            self._measure_lag(fetched.get(self.peer_id))
        known = {pid: r for pid, r in self.records.items() if r.expires_at > now}
        for pid, record in (fetched or {}).items():
            if pid != self.peer_id and (pid not in known or record.expires_at >= known[pid].expires_at):
                known[pid] = dataclasses.replace(record, seen_at=record.seen_at - self.lag) if self.lag else record
        self.records = known
        return self.records

    def as_of(self, now: float) -> float:
        """The DHT time to judge the known records' liveness at: now, or while reads time out the last read that
        answered, less the DHT's lag."""
        return (self.read_at if self.lookup_failed and self.read_at is not None else now) - self.lag

    def _measure_lag(self, own: Optional[PeerRecord]) -> None:
        """Our own record as the read found it (a read that missed it keeps the last measure). The measure rises at
        once and falls halfway per read: under load one read found our record 8 s late and the next on time, over
        and over, and the others' records swung with it."""
        if own is None or not own.heartbeat:
            return
        # a fresh record is up to one heartbeat old when read: only the delay beyond that is the DHT's
        lag = max(0.0, own.seen_at - own.updated_at - own.heartbeat)
        self.lag = lag if lag >= self.lag else (self.lag + lag) / 2
        late = HEARTBEAT_MISSES * own.heartbeat
        if not self.late and self.lag > late:
            logger.info(f"the DHT delivers records {self.lag:.0f} s late (our own, read back): others' records are "
                        f"judged against that")
        elif self.late and self.lag < late / 2:
            logger.info("the DHT delivers records on time again")
        self.late = self.lag > late or (self.late and self.lag >= late / 2)
