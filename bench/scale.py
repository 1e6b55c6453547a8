"""Scale: the product's round code on simulated swarms of 16 to 1024 peers, one group against groups of G.

    python -m bench.scale --peers 16,64,256,1024 --group-sizes 0,8,16,32 --minutes 60 --out bench/results/scale.md

Every simulated peer runs the product's ``Synchronizer`` (its ``decide``, consensus, grouping, deadlines, lineage,
robust mean and codec) and ``RoundClock`` on ``bench/simnet.py``'s network and virtual clock; what is modelled is
listed there. The node's round loop (train until the round clock says stop, sync, account the tokens; with
``--overlap``, the peers' default, each sync runs as a task of its own while the next round trains, and its sync
time is the wait for it at that round's end, as the peers report it) is restated here in a few lines, without
torch: each peer's "model" is a small vector trained towards a shared target, so the loss of the global state says
whether training progresses, and the state hashes say whether peers agree.

The swarm: links of home peers (uplinks of 10-100 Mbit/s, downlinks 5 times that) and datacenter peers (1-10
Gbit/s), one-way latencies of 10-100 ms (RTT 20-200 ms); steps up to 10 times apart in speed; peers killed at
random moments at ``--churn`` per peer per round and restarted a round later from their last state.
"""

from __future__ import annotations

import argparse
import collections
import math
import random
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Dict, List, Optional

import torch
from diloco_compression import get_codec
from diloco_compression.feedback import ErrorFeedback

from bench.simnet import Killed, Link, NetConfig, Network, Scheduler, SimClock, SimEvent, SimFlag, SimTransport
from peer.config import NodeConfig, RunConfig, SyncConfig
from peer.hooks import Hooks
from peer.outer.contributions import Contributions
from peer.outer.lineage import Lineage
from peer.outer.state import GlobalState
from peer.round.announce import Announcer, Identity
from peer.round.catchup import StateCatchUp
from peer.round.inflight import start_overlap, sync_round
from peer.round.schedule import RoundClock
from peer.round.sync import Synchronizer
from peer.swarm.deadlines import Deadlines
from peer.swarm.records import RecordCache
from peer.train.flat import FlatLayout
from peer.train.local import LocalModel

SIZE = 32  # values in each simulated peer's model
MBIT = 1e6 / 8  # bytes per second in a Mbit/s


@dataclass
class Swarm:
    """What every simulated peer shares."""

    scheduler: Scheduler
    network: Network
    run: RunConfig
    sync: SyncConfig
    target: torch.Tensor  # what training moves towards: the loss of G is its distance to this
    tokens_per_step: int
    rows: List[dict] = field(default_factory=list)
    stopping: bool = False  # the simulated time is over: no restarts, every peer stops at its next step
    overlap: bool = True  # each round's sync runs while the next round trains (the peers' default, ``--overlap``)


class SimPeer:
    def __init__(self, swarm: Swarm, peer_id: str, link: Link, step_seconds: float, state: GlobalState):
        self.swarm, self.peer_id, self.link, self.step_seconds = swarm, peer_id, link, step_seconds
        self.alive, self.died_at, self.result_key, self.traffic = True, float("inf"), "", [0.0, 0.0]
        self.streams = 0  # peers this one exchanged parts with in the round's all-reduces and downloads
        run, sync, scheduler = swarm.run, swarm.sync, swarm.scheduler
        self.params = [torch.nn.Parameter(state.params[: SIZE // 2].clone()),
                       torch.nn.Parameter(state.params[SIZE // 2:].clone())]
        trainer = SimpleNamespace(params=self.params, step_lock=threading.Lock(), touch=lambda: None)
        layout = FlatLayout(self.params)
        self.state = state
        self.tensors = [layout.empty()]
        codec = swarm.network.codec
        self.transport = SimTransport(swarm.network, self, run.grace_seconds, sync.request_timeout)
        self.cache, self.local, self.clock = RecordCache(peer_id), LocalModel(trainer, layout), SimClock(scheduler)
        self.announcer = Announcer(self.transport, Identity(peer_id, "m", False), state)
        self.lineage = Lineage(Contributions(codec, run.max_staleness))
        feedback = ErrorFeedback(codec, layout.numel, enabled=run.error_feedback)
        deadlines = Deadlines(ceiling=sync.allreduce_timeout, floor=sync.deadline_floor, factor=sync.deadline_factor,
                              part_ceiling=sync.part_timeout)
        parts = dict(transport=self.transport, clock=self.clock, cache=self.cache, announcer=self.announcer,
                     state=state, local=self.local, layout=layout, lineage=self.lineage, feedback=feedback,
                     lock=threading.Lock(), deadlines=deadlines, run=run, sync=sync)
        self.catchup = StateCatchUp(**parts)
        self.synchronizer = Synchronizer(**parts, catchup=self.catchup, has_moment=False, hooks=Hooks())
        self.round_clock = RoundClock(run, self.catchup, self.cache, self.announcer, self.transport.answered,
                                      self.clock, lambda next_sync_at: self.publish(next_sync_at=next_sync_at))
        self.round_clock.planned = SimFlag(scheduler)
        self.overlap, self.inflight = swarm.overlap, None
        self.round_clock.sync_in_flight = lambda: self.inflight is not None and not self.inflight.done.is_set
        self.pending_tokens = self.pending_rounds = 0
        self.last_round_seconds: Optional[float] = None  # its last round's compute and sync, in its record
        self.random = random.Random(peer_id)
        self.task = None

    def publish(self, status: str = "training", next_sync_at: Optional[float] = None) -> None:
        self.announcer.announce(60.0, status=status, next_sync_at=next_sync_at, round_seconds=self.last_round_seconds)

    def train(self) -> None:
        """One inner step: towards the shared target, with noise of its own."""
        with torch.no_grad():
            for param, target in zip(self.params, self.swarm.target.split(SIZE // 2)):
                noise = torch.tensor([self.random.gauss(0.0, 0.05) for _ in range(param.numel())])
                param.sub_(0.02 * (param - target) + noise * 0.02)

    def loop(self) -> None:
        """The node's round loop (``peer/round/node.py``), on the simulated clock: with overlap, each round's sync
        runs as a task of its own while the next round trains, and is joined at that round's end."""
        scheduler, swarm = self.swarm.scheduler, self.swarm
        if self.catchup.catch_up(timeout=60.0).adopted:
            self.lineage.take_dropped_resumed()
        self.publish()
        while True:
            steps, start, done = self.round_clock.begin(), scheduler.now, 0
            while done < steps and not self.round_clock.over(done):
                if swarm.stopping:
                    raise Killed()
                scheduler.sleep(self.step_seconds)
                self.train()
                done += 1
                self.round_clock.watch(done)
            self.pending_tokens += done * swarm.tokens_per_step
            self.pending_rounds += 1
            compute = scheduler.now - start  # the steps' time, not the wait for the sync in flight below
            if self.inflight is not None:
                self.finish(self.inflight)
            self.inflight = self.launch(done, compute)
            if not self.overlap:
                self.finish(self.inflight)
                self.inflight = None

    def launch(self, steps: int, compute: float) -> SimpleNamespace:
        """Start the round's sync (``Peer._launch``): as a task of its own with overlap, else right here."""
        scheduler, clock, synchronizer, overlap = self.swarm.scheduler, self.round_clock, self.synchronizer, \
            self.overlap
        self.pending_tokens += self.lineage.take_recovered_tokens()
        job = SimpleNamespace(steps=steps, compute=compute, tokens=self.pending_tokens, rounds=self.pending_rounds,
                              started=scheduler.now, finished=scheduler.now, result=None, sent=self.traffic[0],
                              done=SimEvent(scheduler), task=None)
        budget, meet_at = synchronizer.round_budget(), clock.target
        step_seconds = clock.step_seconds or compute / max(steps, 1)

        def sync() -> None:
            self.streams = 0
            job.result = sync_round(synchronizer, clock, job.tokens, job.rounds, budget, step_seconds, meet_at, overlap)
            job.finished = scheduler.now
            job.done.set()

        if overlap:
            start_overlap(self.local, synchronizer, clock)
            job.task = scheduler.spawn(sync, f"{self.peer_id}-sync")
        else:
            sync()
        return job

    def finish(self, job: SimpleNamespace) -> None:
        """Join a round's sync and account it (``Peer._finish``). Its sync time is the wait for it with overlap,
        as the peers report it, else the whole sync."""
        scheduler, swarm, waited = self.swarm.scheduler, self.swarm, self.swarm.scheduler.now
        if not job.done.is_set:
            scheduler.block(event=job.done)
        self.local.thaw()
        result, sync = job.result, scheduler.now - (waited if self.overlap else job.started)
        self.last_round_seconds = job.compute + sync
        self.round_clock.finish(job.steps, job.compute, result.next_round_seconds,
                                anchor=result.round_end if self.overlap else None, stretch=result.stretch,
                                ended=job.finished)
        if self.lineage.take_dropped_resumed():
            self.pending_tokens = self.pending_rounds = 0
        if result.applied:
            self.pending_tokens -= job.tokens
            self.pending_rounds -= job.rounds
        elif self.pending_rounds > swarm.run.max_staleness:
            self.synchronizer.outer.drop_unmerged()
            self.pending_tokens = self.pending_rounds = 0
        swarm.rows.append(dict(peer=self.peer_id, time=scheduler.now, epoch=self.state.epoch,
                               applied=result.applied, outcome=result.outcome.value if result.outcome else None,
                               error=result.error,
                               group_size=len(result.group), groups=result.groups, hash=self.state.hash(),
                               compute=job.compute, sync=sync,
                               sync_wall=job.finished - job.started, streams=self.streams,
                               sent=self.traffic[0] - job.sent,
                               loss=float(((self.state.params - swarm.target) ** 2).mean())))
        self.publish()

    def kill(self) -> None:
        self.alive, self.died_at = False, self.swarm.scheduler.now
        for task in (self.task, self.inflight and self.inflight.task):
            if task is not None:
                self.swarm.scheduler.kill(task)


def links(rng: random.Random, count: int, home_share: float) -> List[Link]:
    made = []
    for _ in range(count):
        if rng.random() < home_share:
            up = rng.uniform(10, 100) * MBIT
            made.append(Link(up=up, down=min(5 * up, 1000 * MBIT), latency=rng.uniform(0.010, 0.100)))
        else:
            rate = rng.uniform(1000, 10000) * MBIT
            made.append(Link(up=rate, down=rate, latency=rng.uniform(0.010, 0.050)))
    return made


def simulate(peers: int, group_size: int, args, seed: int = 0) -> dict:
    """One simulated swarm; returns its per-round rows and what it cost to simulate."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    codec = get_codec(args.compression)
    bits = args.bits_per_value or codec.bits_per_value
    run = RunConfig(model="micro", inner_steps=args.inner_steps, group_size=group_size, align_every=0,
                    compression=args.compression, grace_seconds=args.grace_seconds,
                    stale_discount=0.5, max_staleness=4, seed=seed).resolved()
    sync = SyncConfig()
    scheduler = Scheduler()
    config = NetConfig(wire_bytes=args.params * bits / 8, state_bytes=args.params * 8, overhead=args.overhead,
                       per_member=args.per_member)
    network = Network(scheduler, config, codec, run.clip_factor, seed)
    swarm = Swarm(scheduler, network, run, sync, target=torch.randn(SIZE), tokens_per_step=run.batch_size * 1024,
                  overlap=args.overlap)
    start = GlobalState(params=torch.zeros(SIZE), momentum=torch.zeros(SIZE))
    speeds = [args.step_seconds * math.exp(rng.uniform(0, math.log(args.speed_spread))) for _ in range(peers)]
    if args.slow_every:  # bench.goodput's mix: every K-th peer a slower device
        speeds = [args.slow_step_seconds if i % args.slow_every == 0 else s for i, s in enumerate(speeds)]
    nodes = {}
    for index, (link, speed) in enumerate(zip(links(rng, peers, args.home_share), speeds)):
        peer_id = f"p{index:04d}"
        state = GlobalState(params=start.params.clone(), momentum=start.momentum.clone())
        node = SimPeer(swarm, peer_id, link, speed, state)
        network.peers[peer_id] = nodes[peer_id] = node
        node.task = scheduler.spawn(node.loop, peer_id, at=rng.uniform(0, args.step_seconds))
    round_seconds = args.inner_steps * statistics.median(speeds)
    if args.churn:
        churn(swarm, nodes, rng, args.churn, round_seconds, args.minutes * 60)
    started = time.monotonic()
    scheduler.run(until=args.minutes * 60)
    swarm.stopping = True
    for node in list(network.peers.values()):
        node.kill()
    scheduler.run(until=float("inf"))
    return dict(rows=swarm.rows, seconds=time.monotonic() - started, round_seconds=round_seconds)


def churn(swarm: Swarm, nodes: Dict[str, SimPeer], rng: random.Random, rate: float, round_seconds: float,
          horizon: float) -> None:
    """Each peer dies at ``rate`` per round, at random moments, and restarts a round later from its last state."""
    scheduler = swarm.scheduler
    deaths = int(rate * len(nodes) * horizon / round_seconds)
    for _ in range(deaths):
        when, victim = rng.uniform(round_seconds, horizon), rng.choice(sorted(nodes))

        def strike(victim=victim):
            node = swarm.network.peers[victim]
            if not node.alive:
                return
            node.kill()

            def restart():
                if swarm.stopping:
                    return
                state = GlobalState(params=node.state.params.clone(), momentum=node.state.momentum.clone(),
                                    epoch=node.state.epoch, tokens_total=node.state.tokens_total,
                                    merged=dict(node.state.merged))
                fresh = SimPeer(swarm, victim, node.link, node.step_seconds, state)
                swarm.network.peers[victim] = fresh
                fresh.task = scheduler.spawn(fresh.loop, victim)

            scheduler.at(scheduler.now + round_seconds, restart)

        scheduler.at(when, strike)


def summarize(result: dict, peers: int) -> dict:
    rows = result["rows"]
    by_epoch = collections.defaultdict(list)
    for row in rows:
        if row["applied"]:
            by_epoch[row["epoch"]].append(row)
    epochs = sorted(e for e in by_epoch if e > 0)
    times = [min(r["time"] for r in by_epoch[e]) for e in epochs]
    gaps = [b - a for a, b in zip(times, times[1:])]
    failed = collections.Counter(r["outcome"] for r in rows if not r["applied"])
    failed_at = collections.defaultdict(set)  # the peers whose sync of a round failed: the failure's radius
    for row in rows:
        if not row["applied"]:
            failed_at[row["epoch"]].add(row["peer"])
    worst = max(failed_at, key=lambda epoch: len(failed_at[epoch]), default=None)
    total = sum(r["compute"] + r["sync"] for r in rows) or 1
    return dict(
        peers=peers, epochs=len(epochs), round=statistics.median(gaps) if gaps else float("nan"),
        sync_share=sum(r["sync"] for r in rows) / total,
        sync_median=statistics.median(r["sync"] for r in rows) if rows else 0.0,
        applied=statistics.median(len(by_epoch[e]) for e in epochs) if epochs else 0,
        applied_share=sum(r["applied"] for r in rows) / max(len(rows), 1),
        failures=sum(failed.values()), failed=failed,
        states=max((len({r["hash"] for r in by_epoch[e]}) for e in epochs), default=0),
        forked=sum(len({r["hash"] for r in by_epoch[e]}) > 1 for e in epochs),
        sent=statistics.median(r["sent"] for r in rows) if rows else 0,
        radius=max((len(peers) for peers in failed_at.values()), default=0), worst=worst,
        worst_failed=collections.Counter(r["outcome"] for r in rows if not r["applied"] and r["epoch"] == worst),
        streams=statistics.median(r["streams"] for r in rows if r["applied"]) if epochs else 0,
        streams_max=max((r["streams"] for r in rows), default=0),
        loss=min((r["loss"] for r in rows), default=float("nan")), cost=result["seconds"],
    )


def table(summaries: List[dict]) -> str:
    lines = ["| peers | G | rounds | s per round | sync share | median sync s | peers applying a round (median) | "
             "syncs applied | most peers whose sync of one round failed | streams per peer per round (median / most) | "
             "MB sent per peer per round | states in one epoch (most) | simulated in |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in summaries:
        lines.append(f"| {s['peers']} | {s['group'] or 'one'} | {s['epochs']} | {s['round']:.1f} | "
                     f"{100 * s['sync_share']:.1f}% | {s['sync_median']:.1f} | {s['applied']:.0f} | "
                     f"{100 * s['applied_share']:.0f}% | "
                     f"{s['radius']} | {s['streams']:.0f} / {s['streams_max']} | {s['sent'] / 1e6:.1f} | "
                     f"{s['states']} | {s['cost']:.0f} s |")
    return "\n".join(lines)


def causes(failed: collections.Counter) -> str:
    """``no_group 70, missed_group 9, delegate_lost 7``: why syncs were not applied, the most common first."""
    return ", ".join(f"{outcome} {count}" for outcome, count in failed.most_common()) or "none"


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", default="16,64,256,1024", help="comma-separated swarm sizes")
    parser.add_argument("--group-sizes", default="0,16,32", help="comma-separated --group-size values (0: one group)")
    parser.add_argument("--minutes", type=float, default=60.0, help="simulated minutes per swarm")
    parser.add_argument("--inner-steps", type=int, default=100, help="H")
    parser.add_argument("--step-seconds", type=float, default=1.0, help="the fastest peer's seconds per step")
    parser.add_argument("--speed-spread", type=float, default=10.0, help="slowest / fastest step time")
    parser.add_argument("--slow-every", type=int, default=0,
                        help="every this many peers, one steps at --slow-step-seconds instead (0: none), as in "
                             "bench.goodput's real swarms")
    parser.add_argument("--slow-step-seconds", type=float, default=6.0, help="a slower device's seconds per step")
    parser.add_argument("--churn", type=float, default=0.05, help="share of peers failing per round")
    parser.add_argument("--home-share", type=float, default=0.8, help="share of peers on home links")
    parser.add_argument("--params", type=float, default=10.7e6, help="model parameters (bytes on the wire follow)")
    parser.add_argument("--compression", default="int4-huffman")
    parser.add_argument("--bits-per-value", type=float, default=3.0, help="wire bits per value (0: the codec's)")
    parser.add_argument("--grace-seconds", type=float, default=5.0)
    parser.add_argument("--overhead", type=float, default=0.3, help="fixed seconds per all-reduce")
    parser.add_argument("--per-member", type=float, default=0.02,
                        help="seconds each further member adds to an all-reduce (its streams, framing, codec)")
    parser.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=NodeConfig().overlap,
                        help="sync each round while the next one trains, as the peers do by default; the sync share "
                             "then counts only the wait for it")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="also write the table, with its command, here")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    summaries = []
    for peers in (int(n) for n in args.peers.split(",")):
        for group in (int(g) for g in args.group_sizes.split(",")):
            summary = dict(summarize(simulate(peers, group, args, args.seed), peers), group=group)
            summaries.append(summary)
            print(table([summary]).splitlines()[-1], flush=True)
    text = table(summaries) + "\n\nSyncs not applied, by outcome:\n\n" + "\n".join(
        f"- {s['peers']} peers, G = {s['group'] or 'one'}: {causes(s['failed'])}; in the worst round "
        f"(from epoch {s['worst']}): {causes(s['worst_failed'])}" for s in summaries)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(f"Command: `python -m bench.scale {' '.join(sys.argv[1:] if argv is None else argv)}`\n\n{text}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["SimPeer", "simulate", "summarize"]
