"""The peer's hivemind DecentralizedAverager: round keys, the consensus gate, and the exact all-reduce.

It runs in its own process (hivemind's design), with the pseudo-gradient buffers in shared memory.
What it adds to hivemind's averager:
- ``prepare_round`` puts only peers holding the same (epoch, state hash) under one matchmaking key
  and tells the leader how many peers to expect, so a complete group forms without waiting the
  whole grace window; an expected peer that cannot be reached (``liveness``) is no longer waited for;
- the group's leader is asked among the expected peers our records name (``leaders``), not found through the DHT;
- once a group forms, every member reads the same gathered contributions (``peer/swarm/metadata.py``) and
  refuses alike to average in a minority group (``grouping.admit``), before any tensor is sent;
- the all-reduce is ``ExactAllReduceRunner`` (members end bit-identical or the round fails), and it
  averages the inner first moment too on alignment rounds;
- every failure reaches the peer as one exception type per outcome (``failures.py``);
- ``download_state`` fetches (G, m, metadata) from several donors at once (``sharing.py``);
- the peer's waits on it end as soon as its process is found dead (``mortal.py``).
"""

from __future__ import annotations

import asyncio
import ctypes
import hashlib
import logging
import multiprocessing as mp
import os
from typing import Any, AsyncIterator, Dict, List, Optional, Sequence, Tuple

import torch
from diloco_compression import Codec
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AveragingMode
from hivemind.averaging.load_balancing import load_balance_peers
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2
from hivemind.utils import MPFuture, get_dht_time
from hivemind.utils.asyncio import achain, as_aiter, azip, enter_asynchronously

from dht import internals
from dht.node import drop_connections
from dht.processes import init_child_process
from peer.averaging.allreduce import ExactAllReduceRunner
from peer.averaging.bans import Bans
from peer.averaging.inuse import InUse
from peer.averaging.leaders import RecordLeaders
from peer.averaging.liveness import stop_waiting_for_the_gone
from peer.averaging.mortal import Mortal
from peer.averaging.pacing import CHUNK_BYTES, SMALL_BYTES, Pacer
from peer.averaging.results import MINORITY, NO_MAJORITY, READY, RoundResults, result_key
from peer.averaging.sharing import StateProvider, StateSharing
from peer.hooks import Hooks
from peer.swarm.failures import GroupLostMember, MaybeApplied, MinorityGroup, NoGroup, NoMajority
from peer.swarm.grouping import admit
from peer.swarm.metadata import Averaged, Contribution, Delegation, Gathered

try:
    from asyncio import timeout as time_limit
except ImportError:  # Python 3.10
    from async_timeout import timeout as time_limit

GROUP, CROSS = "group", "cross"  # a round's phases that average: inside a group, and across groups' delegates

logger = logging.getLogger(__name__)


def round_bits(epoch: int, state_hash: str) -> str:
    """Matchmaking key bits for a round: peers meet only if they hold the same state."""
    digest = hashlib.sha256(f"{epoch}:{state_hash}".encode()).digest()
    return format(int.from_bytes(digest[:8], "big"), "064b")


def leader_request_timeout(request_timeout: float, grace_seconds: float) -> float:
    """How long matchmaking waits for a leader's reply: the configured timeout, at most half a grace window (hivemind
    wants it below the matchmaking time)."""
    return min(request_timeout, max(grace_seconds / 2, 0.1))


class SwarmAverager(Mortal, StateSharing, RoundResults, DecentralizedAverager):
    """Averages ``delta`` (and ``moment`` on alignment rounds) with whichever peers share our state."""

    _rpc_handlers = _stub_type = None  # hivemind caches these per class: collect ours, rpc_download_slice too
    runner_type = ExactAllReduceRunner

    def __init__(self, delta: torch.Tensor, moment: Optional[torch.Tensor], dht, *, prefix: str, codec: Codec,
                 state_provider: StateProvider, quorum: int, grace_seconds: float, request_timeout: float,
                 allreduce_timeout: float, part_timeout: float, client_mode: bool, hooks: Optional[Hooks] = None,
                 part_size_bytes: Optional[int] = None, clip_factor: float = 0.0, ban_after: int = 0,
                 state_size: Optional[int] = None, max_upload_mbit: float = 0.0):
        internals.check_version()
        internals.watch_daemon_connection()  # for the daemon client its process makes (``replicate_p2p``)
        # values in G (and in m): the buffers hold one fragment of them with --fragments (peer/outer/fragments.py)
        self.state_size = delta.numel() if state_size is None else state_size
        self.codec, self.hooks, self._state_provider = codec, hooks or Hooks(), state_provider
        # robust aggregation (peer/averaging/robust.py) and bans, kept in the averager process across rounds
        self.clip_factor, self.bans = clip_factor, Bans(ban_after)
        self.exact_timeout, self.part_timeout = allreduce_timeout, part_timeout  # set per round by prepare_round
        self._traffic = mp.Array(ctypes.c_ulonglong, 2)  # written by the averager process, read by ours
        # how long past our window we still wait for a leader's group: its window ends at most one grace after ours,
        # if it reached the meeting before our window ended (``internals.wait_past_window``)
        self.patience = grace_seconds
        self.part_size_bytes = part_size_bytes  # None: sized per all-reduce (``parts.part_bytes``)
        self.max_upload_mbit = max_upload_mbit  # pace our sends below this (0: unpaced; peer/averaging/pacing.py)
        self.round_epoch = -1  # the epoch being synced, as set by prepare_round (averager process)
        self.round_phase, self.round_key = GROUP, ""  # which all-reduce this round's step runs, and the round's key
        self.round_group = -1  # which group of a round of many (-1: one group of all)
        self._rounds_prepared = 0  # prepare_round calls so far (averager process): a stale probe's round is over
        self._probe_task: Optional[asyncio.Task] = None  # this round's liveness probe (averager process)
        self._leaders: Optional[RecordLeaders] = None  # whom this round's matchmaking asks to lead (averager process)
        self._in_use = InUse()  # the peers we exchange streams with now (averager process)
        self._lingering: Dict[bytes, ExactAllReduceRunner] = {}  # finished all-reduces still answering resumes
        self.has_moment = moment is not None
        self._host_pid = os.getpid()  # the peer's process, which waits on ours
        tensors = [delta] + ([moment] if moment is not None else [])
        super().__init__(
            tensors,
            dht,
            start=False,
            prefix=prefix,
            min_group_size=max(quorum, 2),  # set per round by prepare_round
            target_group_size=None,
            min_matchmaking_time=grace_seconds,
            request_timeout=leader_request_timeout(request_timeout, grace_seconds),
            allreduce_timeout=allreduce_timeout + 5,  # a backstop: our own deadline fires first, cleanly
            sender_timeout=part_timeout,
            reducer_timeout=2 * part_timeout,
            client_mode=client_mode,
            declare_state_period=300.0,  # hivemind's donor registry; we pick donors from peer records
            shutdown_timeout=5.0,
        )

    def run(self) -> None:
        init_child_process()
        pacer = Pacer.from_mbit(self.max_upload_mbit) if self.max_upload_mbit else None
        internals.meter_streams(self._count(0), self._count(1), pace=pacer and pacer.reserve, chunk=CHUNK_BYTES,
                                small=SMALL_BYTES)
        super().run()

    def _count(self, index: int):
        """Count every byte this process writes to (0) or reads from (1) its p2p streams. This is what the process
        hands to the p2p daemon: the all-reduce, matchmaking and state transfers, measured, not estimated from
        tensor sizes. libp2p's own encryption and multiplexing headers (a few dozen bytes per 64 KiB frame) and
        TCP/IP headers come on top."""
        def count(size: int) -> None:
            with self._traffic.get_lock():
                self._traffic[index] += size

        return count

    def traffic(self) -> Tuple[int, int]:
        """(bytes sent, bytes received) through this averager's p2p streams so far."""
        return self._traffic[0], self._traffic[1]

    # ---- round control (main process -> averager process) ----
    def prepare_round(self, epoch: int, state_hash: str, min_group: int, expected_group: int,
                      allreduce_timeout: float, part_timeout: float, probe: Sequence[str] = (),
                      phase: str = GROUP, group: int = -1, patience: Optional[float] = None,
                      members: Sequence[str] = ()) -> None:
        """Use this round's matchmaking key and deadlines. A leader closes the group as soon as
        ``expected_group`` peers joined, or when its grace window ends with at least ``min_group``; below
        that, no group forms. Expected peers listed in ``probe`` are dialled meanwhile, and each one that
        cannot be reached (``liveness.gone``) is taken off the expected group. ``members``: who the expected group
        is, less us (empty: not known); a peer outside them that joins is one more, and takes nobody's place.
        ``phase``: ``GROUP`` meets the peers at our state (in ``group`` of a round of many; -1: one group of all),
        ``CROSS`` the delegates of its groups; each under a key of its own. ``patience``: how long past our window we
        wait for a leader's group (this round's window; the grace we were built with if None)."""
        future = MPFuture()
        if phase == CROSS:
            bits = round_bits(epoch, f"{state_hash}/{CROSS}")
        else:
            bits = round_bits(epoch, state_hash if group < 0 else f"{state_hash}/{GROUP}{group}")
        internals.call_in_averager(self, "_prepare_round", epoch=epoch, bits=bits, phase=phase, group=group,
                                   key=result_key(epoch, state_hash), min_group=min_group,
                                   expected_group=expected_group, allreduce_timeout=allreduce_timeout,
                                   part_timeout=part_timeout, probe=list(probe), members=list(members),
                                   patience=self.patience if patience is None else patience, future=future)
        self._answer(future, timeout=30)

    async def _prepare_round(self, epoch: int, bits: str, phase: str, group: int, key: str, min_group: int,
                             expected_group: int, allreduce_timeout: float, part_timeout: float, probe: List[str],
                             members: List[str], patience: float, future: MPFuture) -> None:
        try:
            self._rounds_prepared += 1
            self.patience = patience
            self.round_epoch, self.round_phase, self.round_key, self.round_group = epoch, phase, key, group
            if phase == CROSS:
                self._result(key)  # pending: our groupmates may ask for it from now on
            self.exact_timeout, self.part_timeout = allreduce_timeout, part_timeout
            matchmaking = internals.matchmaking(self)
            internals.raise_when_no_group(matchmaking, NoGroup)
            if self._leaders is None:
                self._leaders = RecordLeaders(self.peer_id.to_base58(), get_dht_time, client=self.client_mode)
                internals.seed_leaders(matchmaking, self._leaders.queue, self._leaders.is_expected,
                                       self._leaders.is_unexpected)
                internals.declare_in_background(matchmaking)
                internals.wait_past_window(matchmaking, lambda: self.patience)
            # our group's leader and members, from our records
            self._leaders.set_round(*((probe, members) if phase == GROUP else ((), ())))
            internals.use_round_key(matchmaking, bits)
            internals.set_group_sizes(matchmaking, min_group, max(expected_group, min_group))
            if probe:  # the event loop holds tasks weakly: keep a reference until it ends
                number = self._rounds_prepared
                self._probe_task = asyncio.create_task(stop_waiting_for_the_gone(
                    matchmaking, internals.averager_p2p(self), probe, lambda: number == self._rounds_prepared))
            future.set_result(None)
        except BaseException as e:
            future.set_exception(e)

    async def _step(self, **kwargs) -> None:
        try:
            await super()._step(**kwargs)
        except Exception as e:  # already delivered to the caller through its StepControl
            logger.debug(f"averaging step failed: {e!r}")

    def drop_connections(self, peer_ids: Sequence[str]) -> MPFuture:
        """Close our daemon's connections to these peers, which did not answer a ping (``dht.node.drop_connections``),
        except to the peers we exchange streams with (``averaging/inuse.py``: an all-reduce, a download either way) and
        to the group we are forming. A thin link's queues hold a ping for seconds, and a connection closed takes every
        stream on it: dropping busy groupmates lost 11-12 of a run's 76-89 fragment syncs on the hard row
        (bench/results/wan.md). Returns a future of those dropped; nobody needs to wait."""
        future = MPFuture()
        internals.call_in_averager(self, "_drop_connections", peer_ids=list(peer_ids), future=future)
        return future

    async def _drop_connections(self, peer_ids: List[str], future: MPFuture) -> None:
        try:
            keep = self._in_use.peers() | internals.forming_with(internals.matchmaking(self))
            future.set_result(await drop_connections(internals.averager_p2p(self), [p for p in peer_ids
                                                                                    if p not in keep]))
        except BaseException as e:
            future.set_exception(e)

    # ---- all-reduce (averager process) ----
    async def _aggregate_with_group(self, group_info, min_vector_size: int, **kwargs) -> Averaged:
        """Run the exact all-reduce in a formed group, unless the group may not apply the round."""
        with self._in_use.streaming(peer.to_base58() for peer in group_info.peer_ids):  # before any await
            return await self._aggregate_in(group_info, min_vector_size, **kwargs)

    async def _aggregate_in(self, group_info, min_vector_size: int, **kwargs) -> Averaged:
        bandwidths, mode_ids, user_bytes = zip(*map(self.serializer.loads, group_info.gathered))
        gathered = self._read_gathered(group_info.peer_ids, user_bytes)
        count = 2 if (next(iter(gathered.values())).align and self.has_moment) else 1
        modes = tuple(map(AveragingMode, mode_ids))
        size = sum(t.numel() for t in internals.averaged_tensors(self)[:count])
        download_bandwidths = [b if mode != AveragingMode.CLIENT else 0.0 for b, mode in zip(bandwidths, modes)]
        peer_fractions = await asyncio.get_event_loop().run_in_executor(
            None, load_balance_peers, size, download_bandwidths, min_vector_size
        )
        started, runner = asyncio.get_event_loop().time(), None
        try:
            async with time_limit(self.exact_timeout):
                async with enter_asynchronously(self.get_tensors()) as local_tensors:
                    local_tensors = local_tensors[:count]
                    runner = self.runner_type(
                        p2p=internals.averager_p2p(self), servicer_type=type(self), prefix=self.prefix,
                        group_id=group_info.group_id, tensors=local_tensors, weight=kwargs["weight"],
                        ordered_peer_ids=group_info.peer_ids, peer_fractions=peer_fractions, modes=modes,
                        sender_timeout=self.part_timeout, reducer_timeout=2 * self.part_timeout, codec=self.codec,
                        part_size_bytes=self.part_size_bytes, hooks=self.hooks, epoch=self.round_epoch,
                        clip_factor=self.clip_factor, banned=self.bans.banned,
                    )
                    internals.register_runner(self, group_info.group_id, runner)
                    async for tensor, averaged in azip(as_aiter(*local_tensors), runner):
                        tensor.copy_(averaged)
        except Exception as e:  # hivemind's _step only retries on its own exception types
            raise self._failure(e, runner) from None
        finally:
            if runner is not None:
                internals.retrieve_runner_error(runner)
        self._linger(group_info.group_id, runner)
        if self.round_phase == CROSS or self.round_group < 0:
            # the round's result, served: to our groupmates (from every delegate, in a round of many groups), and to
            # any peer that missed the round and replays it (``StateCatchUp``); a group's own average in a round of
            # many groups is not the round's result
            self._conclude(self.round_key, READY, runner.encoded_outputs(), info=dict(
                gathered={peer: c.to_wire() for peer, c in gathered.items()}, aligned=count == 2,
                groups=len(group_info.peer_ids),
                delegates=[peer.to_base58() for peer, mode in zip(group_info.peer_ids, modes)
                           if mode != AveragingMode.CLIENT]))
        return Averaged(gathered=gathered, aligned=count == 2, seconds=asyncio.get_event_loop().time() - started,
                        offences=self.bans.judge(runner.offences, runner.severe),
                        groups=len(group_info.peer_ids) if self.round_phase == CROSS else 1,
                        reduced=_share(peer_fractions, list(group_info.peer_ids).index(self.peer_id)))

    def _linger(self, group_id: bytes, runner: ExactAllReduceRunner) -> None:
        """Keep answering groupmates that resume a broken stream (``ExactAllReduceRunner.rpc_aggregate_part``) for
        as long as a sender may take to resume, now that our own all-reduce is over and hivemind forgets the group."""
        self._lingering[group_id] = runner
        asyncio.get_event_loop().call_later(self.part_timeout, self._lingering.pop, group_id, None)

    async def rpc_aggregate_part(self, stream: AsyncIterator[averaging_pb2.AveragingData],
                                 context: P2PContext) -> AsyncIterator[averaging_pb2.AveragingData]:
        """hivemind's routing of a groupmate's parts to its group's all-reduce, and to one that lingers. A stream's
        wait for our runner is shielded: hivemind cancels the handler of a stream whose connection resets, and that
        cancelled the group's future for every groupmate's stream and for our registration (InvalidStateError)."""
        request = await anext(stream)
        runner = self._lingering.get(request.group_id)
        registered = self._running_groups.get(request.group_id)
        if runner is None and registered is not None:
            await asyncio.shield(registered)
        route = super().rpc_aggregate_part if runner is None else runner.rpc_aggregate_part
        async for message in route(achain(as_aiter(request), stream), context):
            yield message

    def _read_gathered(self, peer_ids: Sequence[Any], user_bytes: Sequence[bytes]) -> Gathered:
        """Every member's word (a contribution; a delegation in the cross-group phase), and ``grouping.admit``'s
        checks over them. A cross-group round's groupmates learn a minority verdict from their delegate."""
        cross = self.round_phase == CROSS
        parse = Delegation.from_wire if cross else Contribution.from_wire
        try:
            words = {peer.to_base58(): parse(self.serializer.loads(data)) for peer, data in zip(peer_ids, user_bytes)}
        except ValueError as e:
            raise GroupLostMember(f"a member sent malformed group metadata: {e}") from None
        try:
            return admit(words, cross)
        except MinorityGroup as e:
            if cross:
                self._conclude(self.round_key, NO_MAJORITY if isinstance(e, NoMajority) else MINORITY,
                               info=dict(error=str(e)))
            raise

    def _failure(self, error: Exception, runner: Optional[ExactAllReduceRunner]) -> GroupLostMember:
        if isinstance(error, (TimeoutError, asyncio.TimeoutError)):  # (two types before Python 3.11)
            message = f"the all-reduce did not finish within {self.exact_timeout:.1f}s"
        else:
            message = str(error) if isinstance(error, GroupLostMember) else f"all-reduce failed: {error!r}"
        if runner is not None and runner.tensor_part_reducer.completed:
            return MaybeApplied(f"{message}, after our reducer averaged all its parts")
        return GroupLostMember(message)


def _share(part_sizes: Sequence[float], index: int) -> float:
    """The fraction of the vector that member ``index`` reduces (hivemind's load balancing gives part sizes)."""
    return part_sizes[index] / max(1.0, sum(part_sizes))
