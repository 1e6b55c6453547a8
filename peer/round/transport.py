"""What a round needs from the network, as one interface, and its real implementation over hivemind.

The round's code (``sync.py``, ``catchup.py``, ``schedule.py``) talks to the swarm only through a ``Transport``:
read and publish records, ping peers, download a state, fill the shared buffers and average them. The real one,
``SwarmTransport``, is the DHT, the record publisher and the averager process; tests run the same round code on an
in-process fake (``tests/harness/fake.py``).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from typing import Callable, ContextManager, Dict, List, Optional, Protocol, Sequence, Tuple, Union

import torch
from hivemind.utils import get_dht_time

from dht.node import reach_out
from dht.processes import LinkLost, part_died
from dht.records import PeerRecord, RecordPublisher, RecordReader
from peer.averaging.averager import CROSS, GROUP, SwarmAverager
from peer.averaging.mortal import AVERAGING_PROCESS
from peer.averaging.results import GROUP_ONLY, MINORITY, NO_MAJORITY, READY
from peer.swarm.failures import DelegateLost, MinorityGroup, NoGroup, NoMajority
from peer.swarm.metadata import Averaged, Contribution, Delegation
from peer.swarm.timing import matchmaking_window

logger = logging.getLogger(__name__)

Downloaded = Tuple[List[str], Dict, List[torch.Tensor]]  # (donors used, metadata, [G, m])


def matchmaking_timeout(window: float, grace: float, request_timeout: float) -> float:
    """How long the averager looks for our group before it fails with no group: past our window, the patience
    ``prepare_round`` gave it (a follower waits that long for a leader whose window ends after ours), a request
    timeout and a second."""
    return window + grace + request_timeout + 1.0


ABANDON_POLL = 1.0  # seconds between looks at whether a matchmaking still waited for should be given up


class Transport(Protocol):
    answered: threading.Event  # a peer gone silent answered a ping (a healed partition, say)

    def read_records(self, timeout: float) -> Optional[Dict[str, PeerRecord]]:
        """The run's peer records, or None if the lookup took longer than ``timeout``."""

    def publish(self, record: PeerRecord, ttl: float) -> None:
        """Our record, refreshed by a heartbeat until the next publish."""

    def reach_out(self, peer_ids: Sequence[str]) -> None:
        """Ping these peers now (a healed partition reconnects at once)."""

    def watch(self, silent: Sequence[str]) -> None:
        """Ping these silent peers at every heartbeat and set ``answered`` when one answers."""

    def download(self, donors: Sequence[str], state_hash: str, timeout: float, part_timeout: float,
                 relayed: bool = False) -> Optional[Downloaded]:
        """The state with ``state_hash`` from these donors, unchecked; None if none of them served it. ``relayed``:
        they are reachable only through relays."""

    def buffers(self) -> ContextManager[List[torch.Tensor]]:
        """The averaged buffers ([delta] or [delta, moment]), held: the averager does not touch them meanwhile."""

    def prepare(self, epoch: int, state_hash: str, min_group: int, expected_group: int, allreduce_timeout: float,
                part_timeout: float, probe: Sequence[str], phase: str = GROUP, group: int = -1,
                meet_at: Optional[float] = None, grace: Optional[float] = None, members: Sequence[str] = ()) -> None:
        """This attempt's group key, expected group (``members``: who, less us) and deadlines
        (``SwarmAverager.prepare_round``); ``phase``: in our group (``group``: which of a round's groups; -1: one
        group of all), or across the groups' delegates (``CROSS``); ``meet_at``: the DHT time the group planned to
        meet, from which the matchmaking window runs if it is later than now; ``grace``: that window's length (None:
        ``--grace-seconds``)."""

    def average(self, contribution: Union[Contribution, Delegation], weight: float, timeout: float,
                abandon: Callable[[], bool] = lambda: False) -> Averaged:
        """Matchmaking, then the exact all-reduce of the buffers, in place; raises a ``peer.swarm.failures``
        exception, or TimeoutError after ``timeout`` seconds. ``abandon`` is asked every ``ABANDON_POLL`` seconds
        while no all-reduce has begun; True gives the matchmaking up (``NoGroup``)."""

    def receive(self, delegate: str, epoch: int, state_hash: str, aligned: bool, timeout: float,
                part_timeout: float) -> Averaged:
        """The cross-group round's result from its delegates, into the buffers; raises ``MinorityGroup``,
        ``NoMajority`` or ``DelegateLost``."""

    def replay(self, donors: Sequence[str], epoch: int, state_hash: str, timeout: float,
               part_timeout: float) -> Optional[Averaged]:
        """The result of the round that closed state (``epoch``, ``state_hash``), into the buffers, from the first of
        ``donors`` that holds it (a member of that round, or a peer that took it from one); None if none does."""

    def give_up_result(self, epoch: int, state_hash: str) -> None:
        """As a delegate whose sync ends without the round's result: our groupmates stop waiting for it."""

    def serve_alone(self, epoch: int, state_hash: str, alone: Averaged) -> None:
        """We stepped alone from (``epoch``, ``state_hash``) on the delta in the buffers: serve it as that round's
        result, for replay."""

    def conclude_group(self, epoch: int, state_hash: str, group: Averaged) -> None:
        """As a delegate of a majority group that met no other group's: our groupmates apply our group's average,
        which they hold already."""

    def traffic(self) -> Tuple[int, int]:
        """(bytes sent, bytes received) on the transport so far."""

    def link_lost(self) -> Optional[str]:
        """What to tell the user once this node's link to the swarm has died (a helper process of it), else None.
        A call that waits on a dead helper raises ``dht.processes.LinkLost``."""

    def stop(self) -> None:
        """Stop the record heartbeat."""


class SwarmTransport:
    """The real transport: hivemind's DHT for records, our averager process for groups and downloads."""

    def __init__(self, dht, averager: SwarmAverager, namespace: str, grace_seconds: float):
        self.dht, self.averager, self.namespace, self.grace_seconds = dht, averager, namespace, grace_seconds
        self.phase = GROUP  # the phase the last ``prepare`` set up
        self.meet_at: Optional[float] = None  # and when its window starts (None: at once)
        self.grace = grace_seconds  # and how long it lasts
        self.publisher = RecordPublisher(dht, namespace, drop=averager.drop_connections)
        self.reader = RecordReader(dht, namespace)
        self.answered = self.publisher.answered

    def read_records(self, timeout: float) -> Optional[Dict[str, PeerRecord]]:
        return self.reader.read(timeout)

    def publish(self, record: PeerRecord, ttl: float) -> None:
        self.publisher.publish(record, ttl)

    def reach_out(self, peer_ids: Sequence[str]) -> None:
        reach_out(self.dht, peer_ids, drop=self.averager.drop_connections)

    def watch(self, silent: Sequence[str]) -> None:
        self.publisher.reach = tuple(silent)  # and is noticed mid-round (``RoundClock.watch``)

    def download(self, donors: Sequence[str], state_hash: str, timeout: float, part_timeout: float,
                 relayed: bool = False) -> Optional[Downloaded]:
        return self.averager.download_state(donors, state_hash, timeout=timeout, part_timeout=part_timeout,
                                            relayed=relayed)

    def buffers(self) -> ContextManager[List[torch.Tensor]]:
        return self.averager.get_tensors()

    def prepare(self, epoch: int, state_hash: str, min_group: int, expected_group: int, allreduce_timeout: float,
                part_timeout: float, probe: Sequence[str], phase: str = GROUP, group: int = -1,
                meet_at: Optional[float] = None, grace: Optional[float] = None, members: Sequence[str] = ()) -> None:
        self.meet_at, self.grace = meet_at, grace or self.grace_seconds
        self.averager.prepare_round(epoch, state_hash, min_group, expected_group, allreduce_timeout=allreduce_timeout,
                                    part_timeout=part_timeout, probe=probe, phase=phase, group=group,
                                    patience=self.grace, members=members)
        self.phase = phase

    def receive(self, delegate: str, epoch: int, state_hash: str, aligned: bool, timeout: float,
                part_timeout: float) -> Averaged:
        started = time.monotonic()
        with self.averager.get_tensors() as tensors:
            numels = [t.numel() for t in tensors[: 2 if aligned else 1]]
        info = self.averager.download_average(delegate, epoch, state_hash, numels, timeout, part_timeout)
        status = info.get("status")
        if status in (READY, GROUP_ONLY):  # (a group-only result is in the buffers already: our group's average)
            gathered = {peer: Contribution.from_wire(c) for peer, c in info["gathered"].items()}
            return Averaged(gathered=gathered, aligned=bool(info.get("aligned")), seconds=time.monotonic() - started,
                            groups=int(info.get("groups", 1)))
        error = str(info.get("error") or status)
        raise {MINORITY: MinorityGroup, NO_MAJORITY: NoMajority}.get(status, DelegateLost)(error)

    def replay(self, donors: Sequence[str], epoch: int, state_hash: str, timeout: float,
               part_timeout: float) -> Optional[Averaged]:
        deadline = time.monotonic() + timeout
        with self.averager.get_tensors() as tensors:
            numels = [t.numel() for t in tensors]
        for donor in donors:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            started = time.monotonic()
            info = self.averager.download_average(donor, epoch, state_hash, numels, left, part_timeout, wait=False)
            if info.get("status") != READY:
                logger.debug(f"round {epoch}'s result from {donor}: {info.get('error') or info.get('status')}")
                continue
            try:
                gathered = {peer: Contribution.from_wire(c) for peer, c in info["gathered"].items()}
            except (KeyError, AttributeError, ValueError):  # a stranger's malformed answer: ask the next donor
                continue
            return Averaged(gathered=gathered, aligned=bool(info.get("aligned")), seconds=time.monotonic() - started,
                            groups=int(info.get("groups", 1)))
        return None

    def give_up_result(self, epoch: int, state_hash: str) -> None:
        self.averager.give_up_result(epoch, state_hash)

    def serve_alone(self, epoch: int, state_hash: str, alone: Averaged) -> None:
        self.averager.serve_alone(epoch, state_hash, {peer: c.to_wire() for peer, c in alone.gathered.items()})

    def conclude_group(self, epoch: int, state_hash: str, group: Averaged) -> None:
        self.averager.conclude_group(epoch, state_hash, dict(
            gathered={peer: c.to_wire() for peer, c in group.gathered.items()}, aligned=group.aligned))

    def average(self, contribution: Union[Contribution, Delegation], weight: float, timeout: float,
                abandon: Callable[[], bool] = lambda: False) -> Averaged:
        now = get_dht_time()
        window = matchmaking_window(now, self.meet_at, self.grace, self.phase == CROSS)
        control = self.averager.step(
            gather=contribution.to_wire(), weight=float(weight), scheduled_time=now + window,
            timeout=matchmaking_timeout(window, self.grace, self.averager.matchmaking_kwargs["request_timeout"]),
            allow_retries=False,
            wait=False,
        )
        deadline = time.monotonic() + max(timeout, 0.1)
        while True:
            try:
                return control.result(timeout=max(min(ABANDON_POLL, deadline - time.monotonic()), 0.0))
            except concurrent.futures.TimeoutError:  # (not TimeoutError before Python 3.11: its poll)
                lost = self.link_lost()
                if lost:  # (a dead averager resolves nothing, and a dead daemon's step may wait out its timeouts)
                    control.cancel()
                    raise LinkLost(lost)
                if time.monotonic() >= deadline:
                    control.cancel()
                    raise TimeoutError("the sync deadline passed") from None
            if not control.began_allreduce and abandon():  # (never once the all-reduce runs: others count on us)
                control.cancel()
                raise NoGroup("the swarm's round ended without our group")

    def traffic(self) -> Tuple[int, int]:
        return self.averager.traffic()

    def link_lost(self) -> Optional[str]:
        """The p2p daemon, the DHT's process or the averager's died: the peer would train alone, unheard (and so would
        the other peer of a swarm of two)."""
        return self.dht.link_lost() if self.averager.is_alive() else part_died(AVERAGING_PROCESS)

    def stop(self) -> None:
        self.publisher.stop()
