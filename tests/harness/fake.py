"""An in-process swarm for the round's code: a scripted transport, a clock that jumps when the code sleeps.

``FakePeer`` builds one peer's round parts (``peer/round/build.py`` builds the same ones over hivemind) on a
``FakeTransport`` and a ``FakeClock``. A test sets the other peers' records, the states their holders serve, and
what each averaging attempt returns or raises, then runs ``peer.synchronizer.sync`` and asserts on the result, the
state and what the transport saw. Nothing starts a process or a socket: a test takes milliseconds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections import deque
from types import SimpleNamespace
from typing import Callable, Deque, Dict, List, Optional, Sequence, Tuple, Union

import torch
from diloco_compression import get_codec
from diloco_compression.feedback import ErrorFeedback

from dht.records import HEARTBEAT_SECONDS, PeerRecord
from peer.config import RunConfig, SyncConfig
from peer.hooks import Hooks
from peer.outer.contributions import Contributions
from peer.outer.fragments import Fragments
from peer.outer.lineage import Lineage
from peer.outer.nesterov import nesterov_step
from peer.outer.state import GlobalState, merge_contributors, state_hash
from peer.round.announce import Announcer, Identity
from peer.round.catchup import StateCatchUp
from peer.round.sync import Synchronizer
from peer.swarm.clock import Clock
from peer.swarm.deadlines import Deadlines
from peer.swarm.metadata import Averaged, Contribution
from peer.swarm.records import RecordCache
from peer.train.flat import FlatLayout
from peer.train.local import LocalModel

MANIFEST = "m"


class FakeClock(Clock):
    """One timeline for monotonic and DHT time; ``sleep`` moves it on at once."""

    def __init__(self, start: float = 1000.0):
        self.now = start

    def monotonic(self) -> float:
        return self.now

    def dht_time(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


# what an averaging attempt does: raise this, or call this with (transport, contribution, weight) for its result
Script = Union[BaseException, Callable[["FakeTransport", Contribution, float], Averaged]]


class FakeTransport:
    def __init__(self, clock: FakeClock, numel: int, with_moment: bool = False, peer_id: str = "me"):
        self.clock, self.peer_id = clock, peer_id
        self.answered = threading.Event()
        self.peers: Dict[str, PeerRecord] = {}  # what a read of the records returns
        self.late = False  # reads time out
        self.served: Dict[str, Tuple[dict, List[torch.Tensor]]] = {}  # state hash -> what its holders serve
        self.scripts: Deque[Script] = deque()
        self.tensors = [torch.zeros(numel)] + ([torch.zeros(numel)] if with_moment else [])
        self.published: List[PeerRecord] = []
        self.pinged: List[Tuple[str, ...]] = []
        self.downloads: List[Tuple[Tuple[str, ...], str]] = []
        self.prepared: List[dict] = []
        self.sent: List[Tuple[Contribution, float, torch.Tensor]] = []  # each attempt's word, weight and delta
        self.watched: Tuple[str, ...] = ()
        self.received: List[str] = []  # the delegates asked for a cross-group result
        self.given_up: List[Tuple[int, str]] = []
        self.concluded: List[Tuple[int, str, Tuple[str, ...]]] = []  # majority groups applied on their own
        self.last_group: Optional[Contribution] = None  # our word in the last group formed
        # round results the other peers serve to a replay: (epoch, state hash) -> (result, its averaged buffer)
        self.results: Dict[Tuple[int, str], Tuple[Averaged, torch.Tensor]] = {}
        self.alone: Dict[Tuple[int, str], Tuple[Averaged, torch.Tensor]] = {}  # our lone steps, served
        self.replayed: List[Tuple[Tuple[str, ...], int, str]] = []  # each replay asked: donors, epoch, state hash
        self.lost: Optional[str] = None  # what link_lost says: a helper process died

    def read_records(self, timeout: float) -> Optional[Dict[str, PeerRecord]]:
        if self.late:
            return None
        now = self.clock.dht_time()
        return {pid: _seen(r, now) for pid, r in self.peers.items()}

    def publish(self, record: PeerRecord, ttl: float) -> None:
        self.published.append(record)

    def reach_out(self, peer_ids: Sequence[str]) -> None:
        self.pinged.append(tuple(peer_ids))

    def watch(self, silent: Sequence[str]) -> None:
        self.watched = tuple(silent)

    def download(self, donors, state_hash: str, timeout: float, part_timeout: float, relayed: bool = False):
        self.downloads.append((tuple(donors), state_hash))
        if state_hash not in self.served or not donors:
            return None
        metadata, tensors = self.served[state_hash]
        return list(donors), dict(metadata), [t.clone() for t in tensors]

    @contextlib.contextmanager
    def buffers(self):
        yield self.tensors

    def prepare(self, epoch, state_hash, min_group, expected_group, allreduce_timeout, part_timeout, probe,
                phase="group", group=-1, meet_at=None, grace=None, members=()) -> None:
        self.prepared.append(dict(epoch=epoch, hash=state_hash, min_group=min_group, expected=expected_group,
                                  probe=tuple(probe), phase=phase, group=group, meet_at=meet_at,
                                  grace=grace, members=tuple(members)))

    def average(self, contribution: Contribution, weight: float, timeout: float,
                abandon: Callable[[], bool] = lambda: False) -> Averaged:
        self.sent.append((contribution, weight, self.tensors[0].clone()))
        self.abandon = abandon  # a script may ask it, as the real transport does while its matchmaking waits
        script = self.scripts.popleft()
        if isinstance(script, BaseException):
            raise script
        return script(self, contribution, weight)

    def receive(self, delegate, epoch, state_hash, aligned, timeout, part_timeout) -> Averaged:
        self.received.append(delegate)
        script = self.scripts.popleft()
        if isinstance(script, BaseException):
            raise script
        return script(self, None, 0.0)

    def replay(self, donors, epoch, state_hash, timeout, part_timeout) -> Optional[Averaged]:
        self.replayed.append((tuple(donors), epoch, state_hash))
        if (epoch, state_hash) not in self.results or not donors:
            return None
        averaged, average = self.results[(epoch, state_hash)]
        self.tensors[0][: average.numel()].copy_(average)
        return averaged

    def give_up_result(self, epoch, state_hash) -> None:
        self.given_up.append((epoch, state_hash))

    def serve_alone(self, epoch, state_hash, alone) -> None:
        self.alone[(epoch, state_hash)] = (alone, self.tensors[0].clone())  # what another's replay would take

    def conclude_group(self, epoch, state_hash, group) -> None:
        self.concluded.append((epoch, state_hash, tuple(sorted(group.gathered))))

    def traffic(self) -> Tuple[int, int]:
        return 0, 0

    def link_lost(self) -> Optional[str]:
        return self.lost

    def stop(self) -> None:
        pass


def _seen(record: PeerRecord, now: float) -> PeerRecord:
    """A record as a read finds it: fresh, heartbeating, not expiring soon."""
    return dataclasses.replace(record, seen_at=now, updated_at=record.updated_at or now,
                               heartbeat=record.heartbeat or HEARTBEAT_SECONDS,
                               expires_at=record.expires_at or now + 60.0)


def record(peer_id: str, epoch: int, state: str, tokens: int, **fields) -> PeerRecord:
    return PeerRecord(peer_id=peer_id, epoch=epoch, state_hash=state, tokens_total=tokens, manifest_hash=MANIFEST,
                      **fields)


def across(members: Sequence[str], tokens: int = 100, average: Optional[torch.Tensor] = None,
           without: str = "") -> Script:
    """A cross-group all-reduce (or a delegate's answer) that merged ``members`` (besides our group, less
    ``without``) and leaves ``average`` (default: our buffer as it is) in the buffers."""

    def run(transport: FakeTransport, mine, weight: float) -> Averaged:
        group = dict(mine.members) if mine is not None else {transport.peer_id: transport.last_group}
        template = next(iter(group.values()))
        merged = dict(group, **{peer: dataclasses.replace(template, tokens=tokens) for peer in members})
        merged.pop(without, None)
        if average is not None:
            transport.tensors[0].copy_(average)
        return Averaged(gathered=merged, aligned=False, seconds=1.0, groups=2)

    return run


def with_group(*others: Tuple[str, Contribution], average: Optional[torch.Tensor] = None,
               seconds: float = 0.0) -> Script:
    """An attempt that forms a group with ``others`` (peer id, its contribution) and leaves ``average`` (default:
    the weighted mean of our delta and zeros from the others, by tokens) in the buffers, as the all-reduce would,
    ``seconds`` later on the fake clock."""

    def run(transport: FakeTransport, mine: Contribution, weight: float) -> Averaged:
        transport.clock.sleep(seconds)
        gathered = {transport.peer_id: mine, **dict(others)}
        delta = transport.tensors[0]
        if average is not None:
            delta.copy_(average)
        else:
            delta.mul_(weight / (weight + sum(c.tokens for _, c in others)))
        transport.last_group = mine
        return Averaged(gathered=gathered, aligned=mine.align, seconds=1.0)

    return run


class FakePeer:
    """One peer's round parts on a fake transport and clock: a model of ``numel`` values in two parameters."""

    def __init__(self, numel: int = 8, run: Optional[RunConfig] = None, sync: Optional[SyncConfig] = None,
                 peer_id: str = "me", codec: str = "none", hooks: Optional[Hooks] = None, seed: int = 0):
        self.run = run or RunConfig(align_every=0).resolved()
        self.sync_config = sync or SyncConfig(retries=2)
        self.clock = FakeClock()
        generator = torch.Generator().manual_seed(seed)
        g = torch.randn(numel, generator=generator)
        self.params = [torch.nn.Parameter(g[: numel // 2].clone()), torch.nn.Parameter(g[numel // 2:].clone())]
        self.trainer = SimpleNamespace(params=self.params, step_lock=threading.Lock(), touch=lambda: None)
        self.layout = FlatLayout(self.params)
        self.state = GlobalState(params=g.clone(), momentum=torch.zeros(numel), epoch=4, tokens_total=1000)
        self.transport = FakeTransport(self.clock, Fragments(numel, self.run.fragments).size,
                                       with_moment=bool(self.run.align_every), peer_id=peer_id)
        self.cache, self.local = RecordCache(peer_id), LocalModel(self.trainer, self.layout)
        self.announcer = Announcer(self.transport, Identity(peer_id, MANIFEST, False), self.state)
        wire = get_codec(codec)
        self.feedback = ErrorFeedback(wire, numel, enabled=self.run.error_feedback)
        self.lineage = Lineage(Contributions(wire, self.run.max_staleness))
        self.deadlines = Deadlines(ceiling=self.sync_config.allreduce_timeout, floor=self.sync_config.deadline_floor,
                                   factor=self.sync_config.deadline_factor, part_ceiling=self.sync_config.part_timeout)
        self.lock = threading.Lock()
        parts = dict(transport=self.transport, clock=self.clock, cache=self.cache, announcer=self.announcer,
                     state=self.state, local=self.local, layout=self.layout, lineage=self.lineage,
                     feedback=self.feedback, lock=self.lock, deadlines=self.deadlines, run=self.run,
                     sync=self.sync_config)
        self.catchup = StateCatchUp(**parts)
        self.synchronizer = Synchronizer(**parts, catchup=self.catchup, has_moment=bool(self.run.align_every),
                                         hooks=hooks or Hooks())

    @property
    def theta(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self.params])

    def train(self, step: float = 0.01) -> torch.Tensor:
        """Move theta as an inner phase would; returns the pseudo-gradient G - theta."""
        with torch.no_grad():
            for p in self.params:
                p.sub_(step)
        return self.state.params - self.theta

    def hash(self) -> str:
        return self.state.hash()

    def mine(self, **fields) -> PeerRecord:
        return self.announcer.record(**fields)

    def sync(self, tokens: int = 100, budget: Optional[float] = None, **kwargs):
        """One round's sync, with the budget a node gives it (``Synchronizer.round_budget``) unless told."""
        budget = self.synchronizer.round_budget() if budget is None else budget
        return self.synchronizer.sync(tokens, budget, **kwargs)

    def silence(self, peer_id: str, seconds: float = 60.0) -> None:
        """That peer's heartbeats stopped ``seconds`` ago (it died, froze or was cut off)."""
        self.transport.peers[peer_id] = dataclasses.replace(self.transport.peers[peer_id],
                                                            updated_at=self.clock.now - seconds)

    def serve_next_state(self, delta: torch.Tensor, contributors: Sequence[str], tokens: int,
                         holders: Sequence[str]) -> str:
        """The state one outer step from ours (with ``delta`` as the averaged pseudo-gradient), merged from
        ``contributors``: its holders publish it and serve it. Returns its hash."""
        params, momentum = self.state.params.clone(), self.state.momentum.clone()
        step = self.run.global_step(self.state.epoch)
        nesterov_step(params, momentum, delta, self.run.outer_lr_at(step), self.run.outer_momentum_at(step))
        epoch = self.state.epoch + 1
        merged = merge_contributors(self.state.merged, contributors, self.state.epoch)
        digest = state_hash(params, momentum, epoch)
        self.transport.served[digest] = (dict(epoch=epoch, tokens_total=self.state.tokens_total + tokens,
                                              merged=merged, hash=digest), [params, momentum])
        for holder in holders:
            self.transport.peers[holder] = record(holder, epoch, digest, self.state.tokens_total + tokens)
        return digest
