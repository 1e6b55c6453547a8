"""A simulated network and clock for the product's round code: virtual time, links, matchmaking, all-reduces.

``bench/scale.py`` runs hundreds of peers, each the product's own ``Synchronizer`` (its ``decide``, consensus,
grouping, deadlines, lineage, robust mean and codecs) and ``RoundClock``, on a ``SimTransport`` instead of hivemind.
What is modelled here, not run: hivemind's DHT (a lookup takes two round trips and sees every record published so
far), its matchmaking (a room per key; a peer joins the oldest open group below its target, or leads a new one
that closes at its target or at the end of its window, and fails below its minimum; a member gives up with no
group at the product's matchmaking timeout, ``transport.matchmaking_timeout``), and the all-reduce's duration
and bytes (a butterfly over the members' links). The averaging itself is the product's: each member's part is
encoded and decoded with the run's codec, the reducers' robust mean combines them, and the result is encoded once
and decoded by every member, so members end bit-identical exactly when the product's do.

Time is virtual. Every simulated peer is a thread, but only one runs at a time: it runs until it blocks (a sleep,
a lookup, an all-reduce, a download), and the scheduler then wakes the thread whose wake-up is due first, moving
the clock to that moment. A peer that is killed is woken with ``Killed`` raised where it blocks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import heapq
import itertools
import random
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Tuple

import torch
from diloco_compression import Codec
from diloco_compression.feedback import roundtrip

from dht.records import HEARTBEAT_SECONDS, PeerRecord
from peer.averaging.averager import leader_request_timeout
from peer.averaging.results import FAILED, GROUP_ONLY, MINORITY, NO_MAJORITY, PENDING, READY
from peer.averaging.robust import robust_mean
from peer.round.transport import ABANDON_POLL, matchmaking_timeout
from peer.swarm.clock import Clock
from peer.swarm.failures import DelegateLost, GroupLostMember, MinorityGroup, NoGroup, NoMajority
from peer.swarm.grouping import admit
from peer.swarm.metadata import Averaged, Contribution, Delegation
from peer.swarm.timing import matchmaking_window

if TYPE_CHECKING:
    from bench.scale import SimPeer

PROBE_DELAY = 1.0  # seconds before a forming group stops waiting for its expected members that are dead


class Killed(BaseException):
    """Raised in a simulated peer's thread where it blocks, once the peer is killed."""


# ---------------------------------------------------------------- virtual time
class Task:
    def __init__(self, scheduler: "Scheduler", run: Callable[[], None], name: str):
        self.scheduler, self.name, self.run = scheduler, name, run
        self.go = threading.Event()
        self.wake_id = 0  # which wake-up is current; older ones in the heap are stale
        self.killed = self.done = False
        self.thread = threading.Thread(target=self._main, name=name, daemon=True)

    def _main(self) -> None:
        self.go.wait()
        try:
            self.run()
        except Killed:
            pass
        finally:
            self.done = True
            self.scheduler._yield()


class Scheduler:
    """One simulated thread runs at a time; the clock jumps to the next wake-up when the running one blocks."""

    def __init__(self):
        self.now = 0.0
        self._heap: List[tuple] = []
        self._order = itertools.count()
        self._main = threading.Event()
        self.current: Optional[Task] = None

    def spawn(self, run: Callable[[], None], name: str, at: Optional[float] = None) -> Task:
        task = Task(self, run, name)
        task.thread.start()
        self._wake(task, self.now if at is None else at)
        return task

    def _wake(self, task: Task, at: float) -> None:
        heapq.heappush(self._heap, (at, next(self._order), task, task.wake_id))

    def at(self, when: float, action: Callable[[], None]) -> None:
        """Run ``action`` (which must not block) at virtual time ``when``."""
        self.spawn(action, "timer", at=when)

    def block(self, until: Optional[float] = None, event: Optional["SimEvent"] = None) -> bool:
        """Block the running task until ``until`` or ``event``; True if the event woke it. Raises Killed."""
        task = self.current
        task.wake_id += 1
        if until is not None:
            self._wake(task, until)
        if event is not None:
            if event.is_set:
                return True
            event.waiters.append((task, task.wake_id))
        self._yield(resume=task)
        if task.killed:
            raise Killed()
        return event is not None and event.is_set

    def sleep(self, seconds: float) -> None:
        self.block(until=self.now + max(seconds, 0.0))

    def kill(self, task: Task) -> None:
        task.killed = True
        task.wake_id += 1
        self._wake(task, self.now)

    def _yield(self, resume: Optional[Task] = None) -> None:
        """Hand the baton back to the scheduler; with ``resume``, wait until it is this task's turn again."""
        if resume is not None:
            resume.go.clear()
        self._main.set()
        if resume is not None:
            resume.go.wait()

    def run(self, until: float) -> None:
        """Run every task until the heap is empty or the clock reaches ``until``."""
        while self._heap and self._heap[0][0] <= until:
            when, _, task, wake_id = heapq.heappop(self._heap)
            if task.done or wake_id != task.wake_id:
                continue
            self.now = max(self.now, when)
            self.current = task
            self._main.clear()
            task.go.set()
            self._main.wait()
        self.current = None


class SimEvent:
    def __init__(self, scheduler: Scheduler):
        self.scheduler, self.is_set, self.waiters = scheduler, False, []

    def set(self) -> None:
        self.is_set = True
        for task, wake_id in self.waiters:
            if task.wake_id == wake_id:
                self.scheduler._wake(task, self.scheduler.now)
        self.waiters = []


class SimFlag(SimEvent):
    """A ``threading.Event`` on the virtual clock, for the product's code that waits on one (``RoundClock.planned``):
    a real wait would block the one thread that runs."""

    def clear(self) -> None:
        self.is_set = False

    def wait(self, timeout: Optional[float] = None) -> bool:
        return self.scheduler.block(until=None if timeout is None else self.scheduler.now + timeout, event=self)


class SimClock(Clock):
    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler

    def monotonic(self) -> float:
        return self.scheduler.now

    def dht_time(self) -> float:
        return self.scheduler.now

    def sleep(self, seconds: float) -> None:
        self.scheduler.sleep(seconds)


# ---------------------------------------------------------------- the network
@dataclass
class Link:
    up: float  # bytes per second
    down: float
    latency: float  # one way, seconds


@dataclass
class NetConfig:
    wire_bytes: float  # bytes of one encoded pseudo-gradient (the all-reduce's payload)
    state_bytes: float  # bytes of a state download (G and m, fp32)
    overhead: float = 0.3  # fixed seconds an all-reduce costs beyond its bytes (handshakes, encoding)
    per_member: float = 0.02  # seconds each further member adds: a stream each way, its part's framing and codec
    lookups: float = 2.0  # round trips a DHT lookup takes


@dataclass
class Member:
    peer: "SimPeer"
    word: object  # Contribution or Delegation
    weight: float
    done: SimEvent
    outcome: object = None  # Averaged or an exception
    forming: object = None  # the Forming it joined


@dataclass
class Forming:
    key: str
    target: int
    min_group: int
    deadline: float
    phase: str
    window: float  # seconds a window lasts; a leader with too few members at its end looks again for another
    expected: frozenset = frozenset()  # its leader's expected members: one outside them raises the target by one
    members: List[Member] = field(default_factory=list)
    closed: bool = False


@dataclass
class Result:
    status: str = PENDING
    average: Optional[List[torch.Tensor]] = None
    info: dict = field(default_factory=dict)
    delegates: List[str] = field(default_factory=list)
    changed: Optional[SimEvent] = None


def stamped(record: PeerRecord, **times: float) -> PeerRecord:
    """``dataclasses.replace(record, **times)`` at a twentieth of its cost: a swarm of 1024 peers reads millions of
    records, and ``replace`` (a full ``__init__`` per copy) took 60% of a 256-peer simulation's CPU. PeerRecord has
    no ``__post_init__`` to skip."""
    copy = object.__new__(PeerRecord)
    object.__setattr__(copy, "__dict__", {**record.__dict__, **times})
    return copy


class Network:
    """Everything peers share: the records, the matchmaking rooms, the round results, and the links."""

    def __init__(self, scheduler: Scheduler, config: NetConfig, codec: Codec, clip_factor: float, seed: int = 0):
        self.scheduler, self.config, self.codec, self.clip_factor = scheduler, config, codec, clip_factor
        self.records: Dict[str, PeerRecord] = {}
        self.ttls: Dict[str, float] = {}
        self.rooms: Dict[str, List[Forming]] = {}
        self.results: Dict[str, Result] = {}
        self.peers: Dict[str, "SimPeer"] = {}
        self.random = random.Random(seed)

    # ---- records
    def publish(self, record: PeerRecord, ttl: float) -> None:
        now = self.scheduler.now
        self.records[record.peer_id] = dataclasses.replace(record, updated_at=now, expires_at=now + ttl,
                                                           heartbeat=HEARTBEAT_SECONDS)
        self.ttls[record.peer_id] = ttl

    def read(self) -> Dict[str, PeerRecord]:
        """Every record as a lookup finds it now. A live peer's heartbeat refreshes its record every few seconds (it
        reads as just updated, expiring a ttl from now); a dead peer's stopped when it died."""
        now, seen = self.scheduler.now, {}
        for pid, record in self.records.items():
            peer = self.peers.get(pid)
            last = now if peer is not None and peer.alive else min(now, peer.died_at if peer is not None else now)
            if last + self.ttls[pid] <= now:
                continue
            seen[pid] = stamped(record, updated_at=last, expires_at=last + self.ttls[pid], seen_at=now)
        return seen

    # ---- matchmaking and all-reduce
    def join(self, peer: "SimPeer", key: str, target: int, min_group: int, window: float, phase: str,
             word, weight: float, probe: Tuple[str, ...], expected: Tuple[str, ...] = ()) -> Member:
        member = Member(peer, word, weight, SimEvent(self.scheduler))
        room = self.rooms.setdefault(key, [])
        forming = next((f for f in room if not f.closed and len(f.members) < f.target), None)
        if forming is None:
            forming = Forming(key, max(target, 1), min_group, self.scheduler.now + window, phase, window,
                              frozenset(expected))
            room.append(forming)
            self.scheduler.at(forming.deadline, lambda: self._deadline(forming))
            dead = [p for p in probe if p in self.peers and not self.peers[p].alive]
            if dead:  # the liveness probe: a dead expected peer refuses every dial
                self.scheduler.at(self.scheduler.now + PROBE_DELAY, lambda: self._shrink(forming, len(dead)))
        elif forming.expected and peer.peer_id not in forming.expected:
            forming.target += 1  # ``dht.internals.seed_leaders``: it takes no expected member's place
        forming.members.append(member)
        member.forming = forming
        if len(forming.members) >= forming.target:
            self._assemble(forming)
        return member

    def _shrink(self, forming: Forming, dead: int) -> None:
        if not forming.closed:
            forming.target = max(forming.target - dead, forming.min_group)
            if len(forming.members) >= forming.target:
                self._assemble(forming)

    def _deadline(self, forming: Forming) -> None:
        if forming.closed:
            return
        forming.members = [member for member in forming.members if member.peer.alive]  # the dead left it
        if len(forming.members) >= forming.min_group:
            self._assemble(forming)
        elif forming.members:  # as hivemind's leader: too few, so it sends them away and looks again, a new window
            forming.deadline = self.scheduler.now + forming.window
            self.scheduler.at(forming.deadline, lambda: self._deadline(forming))
        else:
            forming.closed = True

    def _assemble(self, forming: Forming) -> None:
        forming.closed = True
        members = forming.members
        try:
            gathered = self._gate(forming)
        except Exception as e:  # every member finds the same: nobody sends
            for member in members:
                self._finish(member, e)
            return
        seconds = self._duration(members)
        start = self.scheduler.now
        self.scheduler.at(start + seconds, lambda: self._reduced(forming, gathered, start, seconds))

    def _gate(self, forming: Forming):
        """What ``SwarmAverager`` checks before it sends: the product's ``grouping.admit`` over the same words."""
        cross = forming.phase == "cross"
        words = {member.peer.peer_id: member.word for member in forming.members}
        try:
            return admit(words, cross)
        except MinorityGroup as e:
            if cross:
                for member in forming.members:
                    self.conclude(member.peer.result_key, NO_MAJORITY if isinstance(e, NoMajority) else MINORITY,
                                  info=dict(error=str(e)))
            raise

    def _duration(self, members: List[Member]) -> float:
        """A butterfly: each member sends and receives (s-1)/s of the payload twice (its parts to the reducers, the
        averaged parts back), at its own link's rates, plus the longest round trips, a fixed overhead and a cost per
        member (every member streams to and from every other)."""
        s = len(members)
        moved = 2 * (s - 1) / s * self.config.wire_bytes
        slowest = max(max(moved / m.peer.link.up, moved / m.peer.link.down) for m in members)
        latency = max(m.peer.link.latency for m in members)
        return slowest + 4 * latency + self.config.overhead + self.config.per_member * (s - 1)

    def _reduced(self, forming: Forming, gathered, start: float, seconds: float) -> None:
        members = forming.members
        dead = [m for m in members if not m.peer.alive]
        if dead:  # a member lost mid-way fails the all-reduce for everyone
            for member in members:
                self._finish(member, GroupLostMember(f"lost {dead[0].peer.peer_id}"))
            return
        count = len(members[0].peer.tensors)
        averages = []
        for index in range(count):  # each sender's part encoded, the robust mean, the result encoded once
            parts = {i: (roundtrip(self.codec, m.peer.tensors[index].clone()), m.weight) for i, m in enumerate(members)}
            try:
                mean, _ = robust_mean(parts, self.clip_factor)
            except ValueError as e:
                for member in members:
                    self._finish(member, GroupLostMember(str(e)))
                return
            averages.append(roundtrip(self.codec, mean))
        cross = forming.phase == "cross"
        for member in members:
            for tensor, average in zip(member.peer.tensors, averages):
                tensor.copy_(average)
            member.peer.traffic[0] += 2 * (len(members) - 1) / len(members) * self.config.wire_bytes
            member.peer.streams += len(members) - 1  # a stream to and from every other member
            self._finish(member, Averaged(gathered=dict(gathered), aligned=count == 2, seconds=seconds,
                                          groups=len(members) if cross else 1))
        if cross or forming.key.endswith(":"):  # a round's result (not a group's in a round of many), served
            for member in members:
                self.conclude(member.peer.result_key, READY, average=[a.clone() for a in averages],
                              info=dict(gathered=dict(gathered), aligned=count == 2,
                                        groups=len(members) if cross else 1),
                              delegates=[m.peer.peer_id for m in members])

    def _finish(self, member: Member, outcome) -> None:
        if member.outcome is None:
            member.outcome = outcome
            member.done.set()

    # ---- cross-group results
    def result(self, key: str) -> Result:
        if key not in self.results:
            self.results[key] = Result(changed=SimEvent(self.scheduler))
        return self.results[key]

    def conclude(self, key: str, status: str, average=None, info=None, delegates=()) -> None:
        result = self.result(key)
        if result.status == READY and status != READY:
            return
        result.status, result.average, result.info = status, average, dict(info or {})
        result.delegates = list(delegates)
        changed, result.changed = result.changed, SimEvent(self.scheduler)
        changed.set()


class SimTransport:
    """``peer/round/transport.py``'s interface over the simulated network, for one peer."""

    def __init__(self, network: Network, peer: "SimPeer", grace_seconds: float, request_timeout: float):
        self.network, self.peer, self.grace = network, peer, grace_seconds
        self.request_timeout = leader_request_timeout(request_timeout, grace_seconds)
        self.answered = threading.Event()
        self.prepared: dict = {}
        self.lookup_answers: Optional[float] = None  # when the lookup a poll began answers (``read_records``)

    @property
    def scheduler(self) -> Scheduler:
        return self.network.scheduler

    def _round_trips(self, count: float) -> None:
        self.scheduler.sleep(2 * self.peer.link.latency * count)

    def read_records(self, timeout: float):
        """The records, after the lookup's round trips; with no time to wait (``timeout`` 0, a poll), those of a
        lookup begun at an earlier poll if it has answered by now, else None while it goes on (``RecordReader``)."""
        seconds = 2 * self.peer.link.latency * self.network.config.lookups
        if timeout > 0:
            self.scheduler.sleep(seconds)
            return self.network.read()
        if self.lookup_answers is None:
            self.lookup_answers = self.scheduler.now + seconds
        if self.scheduler.now < self.lookup_answers:
            return None
        self.lookup_answers = None
        return self.network.read()

    def publish(self, record: PeerRecord, ttl: float) -> None:
        if self.peer.alive:
            self.network.publish(record, ttl)

    def reach_out(self, peer_ids) -> None:
        pass

    def watch(self, silent) -> None:
        pass

    @contextlib.contextmanager
    def buffers(self):
        yield self.peer.tensors

    def download(self, donors, state_hash: str, timeout: float, part_timeout: float, relayed: bool = False):
        holders = [self.network.peers[d] for d in donors if d in self.network.peers]
        holders = [p for p in holders if p.alive and p.state.hash() == state_hash]
        self._round_trips(1)
        if not holders:
            return None
        metadata, tensors = holders[0].state.metadata(), [holders[0].state.params.clone(),
                                                           holders[0].state.momentum.clone()]
        rate = min(self.peer.link.down, sum(p.link.up for p in holders))
        seconds = self.network.config.state_bytes / rate
        if seconds > timeout:
            self.scheduler.sleep(timeout)
            return None
        self.scheduler.sleep(seconds)
        self.peer.traffic[1] += self.network.config.state_bytes
        return [p.peer_id for p in holders], metadata, tensors

    def prepare(self, epoch, state_hash, min_group, expected_group, allreduce_timeout, part_timeout, probe,
                phase="group", group=-1, meet_at=None, grace=None, members=()) -> None:
        suffix = "cross" if phase == "cross" else ("" if group < 0 else f"g{group}")
        self.prepared = dict(key=f"{epoch}:{state_hash}:{suffix}", target=expected_group, min_group=min_group,
                             phase=phase, probe=tuple(probe), meet_at=meet_at, grace=grace or self.grace,
                             members=tuple(members))
        self.peer.result_key = f"{self.peer.peer_id}/{epoch}:{state_hash}"  # each delegate serves its own
        if phase == "cross":
            self.network.result(self.peer.result_key)

    def average(self, word, weight: float, timeout: float, abandon=lambda: False) -> Averaged:
        prepared, now = self.prepared, self.scheduler.now
        window = matchmaking_window(now, prepared["meet_at"], prepared["grace"], prepared["phase"] == "cross")
        member = self.network.join(self.peer, prepared["key"], prepared["target"], prepared["min_group"], window,
                                   prepared["phase"], word, weight, prepared["probe"], prepared["members"])
        deadline = now + timeout
        looking = now + matchmaking_timeout(window, prepared["grace"], self.request_timeout)
        while not self.scheduler.block(event=member.done, until=min(
                deadline, self.scheduler.now + ABANDON_POLL, float("inf") if member.forming.closed else looking)):
            if self.scheduler.now >= min(looking, deadline) and not member.forming.closed:
                # matchmaking's own timeout: hivemind's averager finds no group
                member.forming.members.remove(member)
                raise NoGroup("could not find a group")
            if self.scheduler.now >= deadline:
                member.outcome = member.outcome or TimeoutError("the sync deadline passed")
                raise TimeoutError("the sync deadline passed")
            if not member.forming.closed and abandon():  # as the product's transport polls, until its group forms
                member.forming.members.remove(member)
                raise NoGroup("the swarm's round ended without our group")
        if isinstance(member.outcome, BaseException):
            raise member.outcome
        return member.outcome

    def receive(self, delegate: str, epoch: int, state_hash: str, aligned: bool, timeout: float,
                part_timeout: float) -> Averaged:
        deadline = self.scheduler.now + timeout
        result = self.network.result(f"{delegate}/{epoch}:{state_hash}")
        self._round_trips(1)
        while result.status == PENDING and self.scheduler.now < deadline:  # polled, as the product polls
            if not self.network.peers[delegate].alive:
                raise DelegateLost(f"{delegate} is gone")
            self.scheduler.block(until=min(deadline, self.scheduler.now + 1.0), event=result.changed)
        if result.status == READY:
            delegates = [self.network.peers[d] for d in result.delegates if self.network.peers[d].alive]
            if not delegates:
                raise DelegateLost("every delegate of the round is gone")
            seconds = self.network.config.wire_bytes / min(self.peer.link.down, sum(d.link.up for d in delegates))
            self.scheduler.sleep(seconds + 2 * self.peer.link.latency)
            for tensor, average in zip(self.peer.tensors, result.average):
                tensor.copy_(average)
            self.peer.traffic[1] += self.network.config.wire_bytes
            self.peer.streams += len(delegates)
            self.network.conclude(f"{self.peer.peer_id}/{epoch}:{state_hash}", READY, average=result.average,
                                  info=result.info, delegates=result.delegates)  # served on, as the product does
        if result.status in (READY, GROUP_ONLY):
            return Averaged(gathered=dict(result.info["gathered"]), aligned=bool(result.info.get("aligned")),
                            seconds=0.0, groups=int(result.info.get("groups", 1)))
        error = str(result.info.get("error") or result.status)
        raise {MINORITY: MinorityGroup, NO_MAJORITY: NoMajority}.get(result.status, DelegateLost)(error)

    def replay(self, donors, epoch: int, state_hash: str, timeout: float, part_timeout: float) -> Optional[Averaged]:
        """A missed round's result from the first donor that holds it, at the donor's uplink."""
        for donor in donors:
            self._round_trips(1)
            peer = self.network.peers.get(donor)
            result = self.network.results.get(f"{donor}/{epoch}:{state_hash}")
            if peer is None or not peer.alive or result is None or result.status != READY:
                continue
            self.scheduler.sleep(self.network.config.wire_bytes / min(self.peer.link.down, peer.link.up))
            for tensor, average in zip(self.peer.tensors, result.average):
                tensor.copy_(average)
            self.peer.traffic[1] += self.network.config.wire_bytes
            self.peer.streams += 1
            return Averaged(gathered=dict(result.info["gathered"]), aligned=bool(result.info.get("aligned")),
                            seconds=0.0, groups=int(result.info.get("groups", 1)))
        return None

    def give_up_result(self, epoch: int, state_hash: str) -> None:
        self.network.conclude(f"{self.peer.peer_id}/{epoch}:{state_hash}", FAILED)

    def serve_alone(self, epoch: int, state_hash: str, alone: Averaged) -> None:
        self.network.conclude(f"{self.peer.peer_id}/{epoch}:{state_hash}", READY,
                              average=[tensor.clone() for tensor in self.peer.tensors][:1],
                              info=dict(gathered=dict(alone.gathered), aligned=False), delegates=[self.peer.peer_id])

    def conclude_group(self, epoch: int, state_hash: str, group: Averaged) -> None:
        self.network.conclude(f"{self.peer.peer_id}/{epoch}:{state_hash}", GROUP_ONLY,
                              info=dict(gathered=dict(group.gathered), aligned=group.aligned))

    def traffic(self):
        return tuple(self.peer.traffic)

    def link_lost(self):
        return None  # the simulated peers' processes do not die

    def stop(self) -> None:
        pass


__all__ = ["Contribution", "Delegation", "Killed", "Link", "NetConfig", "Network", "Scheduler", "SimClock",
           "SimTransport"]
