"""Per-peer progress records: how peers see the swarm without a server.

Key schema (all under the run id):
- ``{run}_manifest``                    the run manifest (manifest.py)
- ``{run}_peers`` / <peer id>[owner:…]  one ``PeerRecord`` per live peer, signed by it (validation.py),
                                        expiring unless refreshed
A record carries the peer's epoch and state hash (for catch-up and fork choice), the tokens merged
into its state, and when it plans to sync next (so joiners line their rounds up with the swarm).
A live peer refreshes its record every ``heartbeat`` seconds from a thread of its own, whatever its
training does, so that a record whose refreshes stopped tells the others within seconds that its peer
died, froze or was cut off (``peer.swarm.consensus.responsive``).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import hivemind
from hivemind.utils import get_dht_time

from dht.node import reach_out
from dht.validation import record_subkey, subkey_peer_id

logger = logging.getLogger(__name__)
HEARTBEAT_SECONDS = 2.0  # how often a live peer refreshes its record
HEARTBEAT_MISSES = 3  # heartbeats a record may miss (a slow DHT store, say) before its peer counts as gone
CLOCK_SLACK = 2.0  # seconds of clock difference between two peers' DHT times that we tolerate


def peers_key(run_id: str) -> str:
    return f"{run_id}_peers"


@dataclass(frozen=True)
class PeerRecord:
    peer_id: str
    epoch: int  # outer steps applied to this peer's global parameters
    state_hash: str  # hash(G, m, e) at that epoch
    tokens_total: int  # tokens merged into this state's lineage (fork choice: most tokens wins)
    manifest_hash: str
    status: str = "training"  # training | syncing | leaving | left
    loss: Optional[float] = None
    eval_loss: Optional[float] = None  # held-out loss of the global parameters at eval_epoch, its last evaluation
    eval_epoch: int = -1
    group_size: int = 0  # peers whose work its last applied round merged
    tokens_per_second: float = 0.0
    next_sync_at: Optional[float] = None  # DHT time this peer expects to start matchmaking
    round_seconds: Optional[float] = None  # length of its last round, compute plus sync
    busy_until: Optional[float] = None  # DHT time its current sync may last until (set while syncing)
    adopting: Optional[str] = None  # the hash of a state it is downloading now: it joins that state's next group
    client_mode: bool = False
    reach: str = ""  # whether others could dial it when it started (dht/reach.py); "" from a peer that did not say
    bytes_per_round: int = 0
    heartbeat: float = 0.0  # seconds between the refreshes its peer promises while alive (0: none promised)
    updated_at: float = 0.0
    expires_at: float = 0.0  # DHT time the record expires unless refreshed (set by fetch_records)
    seen_at: float = 0.0  # DHT time fetch_records read it: how stale it was then says whether its peer lives

    def silent(self) -> bool:
        """When it was read, the record had missed HEARTBEAT_MISSES of the heartbeats its peer promised: the peer
        is dead, frozen or cut off."""
        return self.heartbeat > 0 and self.seen_at > self.updated_at + HEARTBEAT_MISSES * self.heartbeat + CLOCK_SLACK

    @classmethod
    def from_value(cls, value: object) -> Optional["PeerRecord"]:
        if not isinstance(value, dict):
            return None
        names = {f.name for f in dataclasses.fields(cls)}
        try:
            record = cls(**{k: v for k, v in value.items() if k in names})
            int(record.epoch), int(record.tokens_total), str(record.state_hash)
        except (TypeError, ValueError):
            return None
        return record


def publish_record(dht: hivemind.DHT, run_id: str, record: PeerRecord, expiration_time: float,
                   wait: bool = True) -> bool:
    """Store ``record``. The DHT keeps, per subkey, the value that expires last: a newer record must
    expire later than the one it replaces (``RecordPublisher`` takes care of that). With ``wait=False``
    the store runs in the background: a peer cut off from part of the swarm keeps training while the
    DHT waits out its unreachable nodes."""
    value = dataclasses.asdict(dataclasses.replace(record, updated_at=get_dht_time()))
    stored = dht.store(peers_key(run_id), value, expiration_time, subkey=record_subkey(record.peer_id),
                       return_future=not wait)
    return bool(stored) if wait else True


class RecordPublisher:
    """Publishes one peer's successive records with strictly increasing expiration times, and refreshes
    the last one every ``heartbeat`` seconds from a daemon thread until ``stop``."""

    def __init__(self, dht: hivemind.DHT, run_id: str, heartbeat: float = HEARTBEAT_SECONDS,
                 drop: Optional[Callable[[Sequence[str]], Any]] = None):
        self.dht, self.run_id, self.heartbeat, self.expiration = dht, run_id, heartbeat, 0.0
        # who closes the connections to the peers that did not answer (None: the DHT, ``reach_out``)
        self.drop = drop
        self.last: Optional[tuple] = None  # (record, ttl) last published
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.thread: Optional[threading.Thread] = None
        # peers gone silent (cut off, frozen or dead), pinged at every heartbeat: one that answers is news (a
        # healed partition), and ``answered`` says so at once instead of at our next sync
        self.reach: Tuple[str, ...] = ()
        self.answered = threading.Event()

    def publish(self, record: PeerRecord, ttl: float) -> bool:
        with self.lock:
            self.last = (dataclasses.replace(record, heartbeat=self.heartbeat), ttl)
            published = self._store()
            if self.thread is None and self.heartbeat > 0:
                self.thread = threading.Thread(target=self._beat, name="record-heartbeat", daemon=True)
                self.thread.start()
        return published

    def stop(self) -> None:
        self.stopped.set()

    def _store(self) -> bool:
        record, ttl = self.last
        self.expiration = max(get_dht_time() + ttl, self.expiration + 1e-3)
        return publish_record(self.dht, self.run_id, record, self.expiration, wait=False)

    def _beat(self) -> None:
        while not self.stopped.wait(self.heartbeat):
            try:
                with self.lock:
                    self._store()
                reach = self.reach
                if reach:
                    pinged = reach_out(self.dht, reach, drop=self.drop)
                    pinged.add_done_callback(functools.partial(self._pinged, reach))
            except Exception as e:  # the DHT is shutting down under us: our peer is leaving
                logger.debug(f"record heartbeat stopped: {e!r}")
                return

    def _pinged(self, pinged: Tuple[str, ...], future) -> None:
        """A peer that answered is news once: pinged again at every heartbeat until our next sync looks (``reach`` is
        set anew there), it set ``answered`` every 2 s, and each time the round read the swarm's records again."""
        if future.cancelled() or future.exception() is not None:
            return
        answered = set(pinged) - set(future.result())
        if answered:
            self.reach = tuple(peer for peer in self.reach if peer not in answered)
            self.answered.set()


def fetch_records(dht: hivemind.DHT, run_id: str, timeout: Optional[float] = None) -> Optional[Dict[str, PeerRecord]]:
    """Live peers' records keyed by peer id; malformed entries are skipped. None if the lookup took
    longer than ``timeout`` (part of the swarm unreachable): the caller keeps what it knew."""
    try:
        found = dht.get(peers_key(run_id), latest=True, return_future=True).result(timeout=timeout)
    except (TimeoutError, concurrent.futures.TimeoutError):
        return None
    return parse_records(found, get_dht_time())


class RecordReader:
    """Reads a run's records again and again, keeping a lookup that outlasts its caller's timeout: the DHT's late
    answer is the next read's, with each record as stale as it was when the answer arrived. A read abandoned at its
    timeout wasted the lookup: on a machine loaded 20-fold every read of a peer timed out for minutes, its view of
    the swarm emptied as the records it knew expired, and it stepped alone (16 peers, ``bench/results/scale.md``).
    One lookup is in flight at a time, and one pending longer than ``abandon_after`` seconds is given up.

    A read that waits (``timeout`` > 0) wants the records as they are now: an answer that arrived before it (a poll's
    lookup, or a timed-out read's) is kept only as its fallback, while a fresh lookup goes out. A sync's first read
    took a lookup that a poll between inner steps had begun up to a second earlier, from before the others ended
    their rounds."""

    def __init__(self, dht, run_id: str, abandon_after: float = 30.0):
        self.dht, self.run_id, self.abandon_after = dht, run_id, abandon_after
        self.lock = threading.Lock()
        self.pending: Optional[concurrent.futures.Future] = None  # the lookup in flight, or answered unread
        self.started = 0.0  # monotonic time it began
        self.answered_at: Optional[float] = None  # DHT time its answer arrived

    def read(self, timeout: float) -> Optional[Dict[str, PeerRecord]]:
        """The records of the lookup in flight, or of a new one; None if it has not answered within ``timeout``.
        ``timeout`` 0 (a poll): an answer that came since the last read, or None while the lookup goes on."""
        with self.lock:
            fallback = None
            if timeout > 0 and self.pending is not None and self.pending.done():
                fallback = self._take()
            if self.pending is None or time.monotonic() - self.started > self.abandon_after and not self.pending.done():
                self._lookup()
            try:
                self.pending.result(timeout=timeout)
            except (TimeoutError, concurrent.futures.TimeoutError):
                return fallback
            except Exception:  # ``_take`` says what
                pass
            return self._take() or {}

    def _take(self) -> Optional[Dict[str, PeerRecord]]:
        """The answered lookup's records (None if the DHT failed it); the next read looks again."""
        lookup, seen_at, self.pending = self.pending, self.answered_at or get_dht_time(), None
        try:
            return parse_records(lookup.result(timeout=0), seen_at)
        except Exception as e:  # the DHT failed the lookup: the next read tries again
            logger.debug(f"records lookup failed: {e!r}")
            return None

    def _lookup(self) -> None:
        self.pending, self.started, self.answered_at = None, time.monotonic(), None
        lookup = self.dht.get(peers_key(self.run_id), latest=True, return_future=True)
        self.pending = lookup
        lookup.add_done_callback(self._answered)

    def _answered(self, lookup: concurrent.futures.Future) -> None:
        if lookup is self.pending:  # not one given up on
            self.answered_at = get_dht_time()


def parse_records(found, seen_at: float) -> Dict[str, PeerRecord]:
    """The records of a lookup's answer (``found``), read at DHT time ``seen_at``."""
    if found is None or not isinstance(found.value, dict):
        return {}
    records: Dict[str, PeerRecord] = {}
    for subkey, item in found.value.items():
        record = PeerRecord.from_value(getattr(item, "value", None))
        if record is None or record.peer_id != subkey_peer_id(subkey):
            logger.debug(f"skipping malformed peer record under {subkey!r}")
            continue
        # a restarted peer signs with a new key: its old record lingers under the old subkey until it expires
        if record.peer_id not in records or record.updated_at > records[record.peer_id].updated_at:
            records[record.peer_id] = dataclasses.replace(record, expires_at=float(item.expiration_time),
                                                          seen_at=seen_at)
    return records
