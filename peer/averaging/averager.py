"""The peer's hivemind DecentralizedAverager: exact all-reduce, round keys and verified state sharing.

It runs in its own process (hivemind's design), with the pseudo-gradient buffers in shared memory.
What it adds to hivemind's averager:
- ``prepare_round`` puts only peers holding the same (epoch, state hash) under one matchmaking key
  and tells the leader how many peers to expect, so a complete group forms without waiting the
  whole grace window; an expected peer that cannot be reached (``liveness.gone``) is no longer waited for;
- the all-reduce is ``ExactAllReduceRunner`` (members end bit-identical or the round fails), and it
  averages the inner first moment too on alignment rounds;
- ``download_state`` fetches (G, m, metadata) from several donors at once, slice by slice, and
  carries on from the others when a donor dies or stalls (hivemind downloads from one donor).
"""

from __future__ import annotations

import asyncio
import ctypes
import hashlib
import logging
import multiprocessing as mp
from collections import deque
from typing import Any, AsyncIterator, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AveragingMode
from hivemind.averaging.load_balancing import load_balance_peers
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import MPFuture
from hivemind.utils.asyncio import aiter_with_timeout, as_aiter, azip, enter_asynchronously
from hivemind.utils.streaming import combine_from_streaming, split_for_streaming

from compression import Codec
from dht.node import init_child_process
from peer.averaging.allreduce import ExactAllReduceRunner, GroupLostMember, MaybeApplied, MinorityGroup, NoMajority
from peer.averaging.liveness import PROBE_EVERY, PROBE_SECONDS, gone
from peer.hooks import DONOR, Hooks
from peer.swarm.consensus import majority_elsewhere, minority

logger = logging.getLogger(__name__)

STATE_SLICE = 1 << 22  # floats per slice of a state download (16 MiB): at least two slices per donor
SNAPSHOT_IDLE = 30.0  # seconds a donor keeps a state snapshot after the last slice it served from it
StateProvider = Callable[[], Tuple[Dict[str, Any], Sequence[torch.Tensor]]]


def round_bits(epoch: int, state_hash: str) -> str:
    """Matchmaking key bits for a round: peers meet only if they hold the same state."""
    digest = hashlib.sha256(f"{epoch}:{state_hash}".encode()).digest()
    return format(int.from_bytes(digest[:8], "big"), "064b")


async def _keep_round_key(group_info) -> None:
    pass


def _meter_transport(traffic) -> None:
    """Count every byte this process writes to or reads from its p2p streams (hivemind's framing:
    a 1-byte marker and an 8-byte length per message, then the message). This is what the process
    hands to the p2p daemon: the all-reduce, matchmaking and state transfers, measured, not estimated
    from tensor sizes. libp2p's own encryption and multiplexing headers (a few dozen bytes per 64 KiB
    frame) and TCP/IP headers come on top."""
    send, receive = P2P.send_raw_data, P2P.receive_raw_data
    overhead = 1 + P2P.HEADER_LEN

    async def send_raw_data(data, writer, *args, **kwargs):
        with traffic.get_lock():
            traffic[0] += len(data) + overhead
        return await send(data, writer, *args, **kwargs)

    async def receive_raw_data(reader):
        data = await receive(reader)
        with traffic.get_lock():
            traffic[1] += len(data) + overhead
        return data

    P2P.send_raw_data, P2P.receive_raw_data = staticmethod(send_raw_data), staticmethod(receive_raw_data)


class SwarmAverager(DecentralizedAverager):
    """Averages ``delta`` (and ``moment`` on alignment rounds) with whichever peers share our state."""

    _rpc_handlers = _stub_type = None  # hivemind caches these per class: collect ours, rpc_download_slice too
    runner_type = ExactAllReduceRunner

    def __init__(
        self,
        delta: torch.Tensor,
        moment: Optional[torch.Tensor],
        dht,
        *,
        prefix: str,
        codec: Codec,
        state_provider: StateProvider,
        quorum: int,
        grace_seconds: float,
        request_timeout: float,
        allreduce_timeout: float,
        part_timeout: float,
        client_mode: bool,
        hooks: Optional[Hooks] = None,
        part_size_bytes: int = 2**20,
        clip_factor: float = 0.0,
        ban_after: int = 0,
    ):
        self.codec, self.hooks, self._state_provider = codec, hooks or Hooks(), state_provider
        # robust aggregation (peer/robust.py) and bans, kept in the averager process across rounds
        self.clip_factor, self.ban_after = clip_factor, ban_after
        self.offence_counts: Dict[PeerID, int] = {}
        self.banned: set = set()
        self.exact_timeout, self.part_timeout = allreduce_timeout, part_timeout  # set per round by prepare_round
        self._shared: Optional[Tuple[Dict[str, Any], List[torch.Tensor]]] = None  # a snapshot donors serve
        self._shared_used = 0.0
        self._traffic = mp.Array(ctypes.c_ulonglong, 2)  # written by the averager process, read by ours
        self.round_epoch = -1  # the epoch being synced, as set by prepare_round (averager process)
        self._rounds_prepared = 0  # prepare_round calls so far (averager process): a stale probe's round is over
        self._probe_task: Optional[asyncio.Task] = None  # this round's liveness probe (averager process)
        self.has_moment = moment is not None
        tensors = [delta] + ([moment] if moment is not None else [])
        super().__init__(
            tensors,
            dht,
            start=False,
            prefix=prefix,
            min_group_size=max(quorum, 2),  # set per round by prepare_round
            target_group_size=None,
            min_matchmaking_time=grace_seconds,
            request_timeout=min(request_timeout, max(grace_seconds / 2, 0.1)),
            allreduce_timeout=allreduce_timeout + 5,  # a backstop: our own deadline fires first, cleanly
            sender_timeout=part_timeout,
            reducer_timeout=2 * part_timeout,
            part_size_bytes=part_size_bytes,
            client_mode=client_mode,
            declare_state_period=300.0,  # hivemind's donor registry; we pick donors from peer records
            shutdown_timeout=5.0,
        )

    def run(self) -> None:
        init_child_process()
        _meter_transport(self._traffic)
        super().run()

    def traffic(self) -> Tuple[int, int]:
        """(bytes sent, bytes received) through this averager's p2p streams so far."""
        return self._traffic[0], self._traffic[1]

    # ---- round control (main process -> averager process) ----
    def prepare_round(self, epoch: int, state_hash: str, min_group: int, expected_group: int,
                      allreduce_timeout: float, part_timeout: float, probe: Sequence[str] = ()) -> None:
        """Use this round's matchmaking key and deadlines. A leader closes the group as soon as
        ``expected_group`` peers joined, or when its grace window ends with at least ``min_group``; below
        that, no group forms. Expected peers listed in ``probe`` are dialled meanwhile, and each one that
        cannot be reached (``liveness.gone``) is taken off the expected group."""
        future = MPFuture()
        self._outer_pipe.send(("_prepare_round", [], dict(
            epoch=epoch, bits=round_bits(epoch, state_hash), min_group=min_group, expected_group=expected_group,
            allreduce_timeout=allreduce_timeout, part_timeout=part_timeout, probe=list(probe), future=future)))
        future.result(timeout=30)

    async def _prepare_round(self, epoch: int, bits: str, min_group: int, expected_group: int,
                             allreduce_timeout: float, part_timeout: float, probe: List[str],
                             future: MPFuture) -> None:
        try:
            self._rounds_prepared += 1
            self.round_epoch = epoch
            self.exact_timeout, self.part_timeout = allreduce_timeout, part_timeout
            key_manager = self._matchmaking.group_key_manager
            key_manager.group_bits = bits
            # hivemind re-buckets the key after each group, assuming groups never exceed the target; our
            # key is set afresh every round, so skip that (it raises when a group outgrows the target)
            key_manager.update_key_on_group_assembled = _keep_round_key
            self._matchmaking.min_group_size = min_group
            self._set_target(max(expected_group, min_group))
            if probe:  # the event loop holds tasks weakly: keep a reference until it ends
                self._probe_task = asyncio.create_task(self._stop_waiting_for_the_gone(probe, self._rounds_prepared))
            future.set_result(None)
        except BaseException as e:
            future.set_exception(e)

    def _set_target(self, target: int) -> None:
        self._matchmaking.target_group_size = target
        self._matchmaking.group_key_manager.target_group_size = target
        self._matchmaking.potential_leaders.target_group_size = target

    async def _stop_waiting_for_the_gone(self, probe: List[str], round_number: int) -> None:
        """Through this round's matchmaking, dial the expected peers in ``probe`` every PROBE_EVERY seconds (a
        live one we are connected to answers from our own daemon); each one that cannot be reached comes off the
        expected group, and a leader that then holds every expected peer closes its group at once, as hivemind's
        does when the last expected follower joins."""
        loop = asyncio.get_event_loop()
        until = loop.time() + self._matchmaking.min_matchmaking_time + PROBE_SECONDS
        waiting = list(probe)
        while waiting and round_number == self._rounds_prepared and loop.time() < until:
            started = loop.time()
            try:
                dead = await gone(self._p2p, waiting)
            except Exception as e:
                logger.debug(f"liveness probe failed: {e!r}")
                return
            if dead:
                waiting = [peer for peer in waiting if peer not in dead]
                await self._expect_fewer(dead, round_number)
            await asyncio.sleep(max(0.0, PROBE_EVERY - (loop.time() - started)))

    async def _expect_fewer(self, dead: List[str], round_number: int) -> None:
        matchmaking = self._matchmaking
        async with matchmaking.lock_request_join_group:
            if round_number != self._rounds_prepared:
                return
            target = max(matchmaking.target_group_size - len(dead), matchmaking.min_group_size)
            self._set_target(target)
            logger.info(f"not waiting for {len(dead)} peer(s) at our state that cannot be reached (every dial "
                        f"refused or in backoff): {', '.join(peer[-6:] for peer in dead)}; "
                        f"expecting a group of {target}")
            if (matchmaking.is_looking_for_group and not matchmaking.client_mode and matchmaking.current_leader is None
                    and matchmaking.current_followers and not matchmaking.assembled_group.done()
                    and len(matchmaking.current_followers) + 1 >= target):
                await matchmaking.leader_assemble_group()

    async def _step(self, **kwargs) -> None:
        try:
            await super()._step(**kwargs)
        except Exception as e:  # already delivered to the caller through its StepControl
            logger.debug(f"averaging step failed: {e!r}")

    # ---- all-reduce (averager process) ----
    async def _aggregate_with_group(self, group_info, min_vector_size: int, **kwargs) -> Dict[str, Any]:
        """Run the exact all-reduce in a formed group; returns gathered metadata and byte counts."""
        bandwidths, mode_ids, user_bytes = zip(*map(self.serializer.loads, group_info.gathered))
        gathered = {peer.to_base58(): self.serializer.loads(data)
                    for peer, data in zip(group_info.peer_ids, user_bytes)}
        modes = tuple(map(AveragingMode, mode_ids))
        align = {bool(info.get("align")) for info in gathered.values()}
        if len(align) != 1:
            raise GroupLostMember("group members disagree on momentum alignment")
        why_not = minority(gathered)
        if why_not is not None:  # every member finds the same, from the same gathered data: nobody sends
            raise (MinorityGroup if majority_elsewhere(gathered) else NoMajority)(why_not)
        count = 2 if (align.pop() and self.has_moment) else 1
        size = sum(t.numel() for t in self._averaged_tensors[:count])
        download_bandwidths = [b if mode != AveragingMode.CLIENT else 0.0 for b, mode in zip(bandwidths, modes)]
        peer_fractions = await asyncio.get_event_loop().run_in_executor(
            None, load_balance_peers, size, download_bandwidths, min_vector_size
        )
        started, runner = asyncio.get_event_loop().time(), None
        try:
            async with asyncio.timeout(self.exact_timeout):
                async with enter_asynchronously(self.get_tensors()) as local_tensors:
                    local_tensors = local_tensors[:count]
                    runner = self.runner_type(
                        p2p=self._p2p, servicer_type=type(self), prefix=self.prefix, group_id=group_info.group_id,
                        tensors=local_tensors, weight=kwargs["weight"], ordered_peer_ids=group_info.peer_ids,
                        peer_fractions=peer_fractions, modes=modes, sender_timeout=self.part_timeout,
                        reducer_timeout=2 * self.part_timeout, codec=self.codec,
                        part_size_bytes=kwargs["part_size_bytes"], hooks=self.hooks, epoch=self.round_epoch,
                        clip_factor=self.clip_factor, banned=self.banned,
                    )
                    self._running_groups[group_info.group_id].set_result(runner)
                    async for tensor, averaged in azip(as_aiter(*local_tensors), runner):
                        tensor.copy_(averaged)
        except Exception as e:  # hivemind's _step only retries on its own exception types
            if isinstance(e, TimeoutError):
                message = f"the all-reduce did not finish within {self.exact_timeout:.1f}s"
            else:
                message = str(e) if isinstance(e, GroupLostMember) else f"all-reduce failed: {e!r}"
            if runner is not None and runner.tensor_part_reducer.completed:
                raise MaybeApplied(f"{message}, after our reducer averaged all its parts") from None
            raise GroupLostMember(message) from None
        finally:
            if runner is not None and runner._future.done() and not runner._future.cancelled():
                runner._future.exception()  # raised above already; else asyncio logs it as never retrieved
        return dict(gathered=gathered, aligned=count == 2, seconds=asyncio.get_event_loop().time() - started,
                    offences=self._judge(runner.offences, runner.severe))

    def _judge(self, offences: Dict[PeerID, Dict[str, str]], severe: set) -> Dict[str, List[str]]:
        """Log what each offender's parts did in this all-reduce (as this peer reduced them), count the severe
        ones, and ban a peer after ``ban_after`` such rounds: its parts are ignored from then on."""
        report = {}
        for peer, reasons in offences.items():
            self.offence_counts[peer] = self.offence_counts.get(peer, 0) + (peer in severe)
            described = [f"{reason} ({detail})" if detail else reason for reason, detail in sorted(reasons.items())]
            report[peer.to_base58()] = described
            logger.warning(f"peer {peer} sent bad parts: {', '.join(described)}; offence "
                           f"{self.offence_counts[peer]}{f' of {self.ban_after}' if self.ban_after else ''}")
            if self.ban_after and self.offence_counts[peer] >= self.ban_after and peer not in self.banned:
                self.banned.add(peer)
                logger.warning(f"banned peer {peer} for the rest of the run: its parts are ignored")
        return report

    # ---- state sharing: a downloader takes slices of (G, m) from several donors at once ----
    def get_current_state(self):
        """Called in the main process when a peer downloads our state: (metadata, [G, m], infos)."""
        metadata, tensors = self._state_provider()
        return metadata, tensors, None

    async def _snapshot(self, wanted_hash: str) -> Optional[Tuple[Dict[str, Any], List[torch.Tensor]]]:
        """Our state as (metadata, [G, m]) if its hash is ``wanted_hash``; one snapshot serves every slice
        of a download, and is dropped once no one has asked for it for SNAPSHOT_IDLE seconds."""
        async with self._snapshot_lock:
            if self._shared is None or self._shared[0].get("hash") != wanted_hash:
                self._shared = None
                metadata, tensors, _ = await self._get_current_state_from_host_process()
                metadata = self.serializer.loads(metadata)
                if not isinstance(metadata, dict) or metadata.get("hash") != wanted_hash:
                    return None
                self._shared = (metadata, list(tensors))
                asyncio.get_event_loop().call_later(SNAPSHOT_IDLE, self._drop_idle_snapshot)
            self._shared_used = asyncio.get_event_loop().time()
            return self._shared

    def _drop_idle_snapshot(self) -> None:
        idle = asyncio.get_event_loop().time() - self._shared_used
        if idle >= SNAPSHOT_IDLE:
            self._shared = None
        elif self._shared is not None:
            asyncio.get_event_loop().call_later(SNAPSHOT_IDLE - idle, self._drop_idle_snapshot)

    @property
    def _snapshot_lock(self) -> asyncio.Lock:
        if not hasattr(self, "_snapshot_lock_"):
            self._snapshot_lock_ = asyncio.Lock()  # created in the averager process, on its event loop
        return self._snapshot_lock_

    async def rpc_download_slice(self, request: averaging_pb2.DownloadData, _context: P2PContext
                                 ) -> AsyncIterator[averaging_pb2.DownloadData]:
        """Stream values [start, end) of G followed by m, from the state with the requested hash; nothing
        if we no longer hold that state. The first message carries the state's metadata."""
        try:
            wanted = self.serializer.loads(request.metadata)
            wanted_hash, start, end = str(wanted["hash"]), int(wanted["start"]), int(wanted["end"])
        except Exception:
            return
        snapshot = await self._snapshot(wanted_hash)
        if snapshot is None:
            return
        metadata, tensors = snapshot
        if not 0 <= start < end <= sum(t.numel() for t in tensors):
            return
        piece = serialize_torch_tensor(_take(tensors, start, end))
        for index, part in enumerate(split_for_streaming(piece)):
            yield averaging_pb2.DownloadData(tensor_part=part, metadata=self.serializer.dumps(metadata) if index == 0
                                             else b"")
            if index == 0:
                self.hooks.at(DONOR, int(metadata.get("epoch", 0)))  # a fault plan may strike mid-transfer

    def download_state(self, donors: Sequence[str], state_hash: str, timeout: float, part_timeout: float
                       ) -> Optional[Tuple[List[str], Dict, List[torch.Tensor]]]:
        """Download the state with ``state_hash`` from ``donors`` at once, a slice from each in turn; a donor
        that fails or stalls is dropped and its slice taken from the others. Returns (donors used,
        metadata, [G, m]), or None. The caller checks the hash."""
        future = MPFuture()
        self._outer_pipe.send(("_download_state", [], dict(
            donors=list(donors), state_hash=state_hash, timeout=timeout, part_timeout=part_timeout, future=future)))
        try:
            return future.result(timeout=timeout + 10)
        except TimeoutError:  # the averager process is overloaded or stuck: a failed download, not a crash
            logger.warning(f"the averager process did not finish a state download within {timeout + 10:.0f}s")
            future.cancel()
            return None

    async def _download_state(self, donors: List[str], state_hash: str, timeout: float, part_timeout: float,
                              future: MPFuture) -> None:
        try:
            result = await asyncio.wait_for(self._download_striped(donors, state_hash, part_timeout), timeout)
        except Exception as e:
            logger.info(f"state download failed: {e!r}")
            result = None
        if not future.done():
            future.set_result(result)

    async def _download_striped(self, donors: List[str], state_hash: str, part_timeout: float):
        size = self._averaged_tensors[0].numel()  # G and m are each as large as the pseudo-gradient
        total = 2 * size
        count = max(2 * len(donors), -(-total // STATE_SLICE))
        bounds = [total * i // count for i in range(count + 1)]
        pending, parts, used, changed = deque(range(count)), {}, [], asyncio.Event()
        metadata: Dict[str, Any] = {}

        async def worker(donor: str) -> None:
            stub = self.get_stub(self._p2p, PeerID.from_base58(donor), namespace=self.prefix)
            while len(parts) < count:
                if not pending:
                    changed.clear()
                    await changed.wait()
                    continue
                index = pending.popleft()
                try:
                    meta, values = await self._fetch_slice(stub, state_hash, bounds[index], bounds[index + 1],
                                                           part_timeout)
                except Exception as e:
                    pending.appendleft(index)
                    changed.set()
                    logger.info(f"state download from {donor} failed ({e!r}); taking its slices from the others")
                    return
                parts[index] = values
                metadata.update(meta)
                if donor not in used:
                    used.append(donor)
                changed.set()

        await asyncio.gather(*(worker(donor) for donor in donors))
        if len(parts) < count:
            return None
        flat = torch.cat([parts[i] for i in range(count)])
        return used, metadata, [flat[:size], flat[size:]]

    async def _fetch_slice(self, stub, state_hash: str, start: int, end: int, part_timeout: float
                           ) -> Tuple[Dict[str, Any], torch.Tensor]:
        request = averaging_pb2.DownloadData(metadata=self.serializer.dumps(dict(hash=state_hash, start=start,
                                                                                 end=end)))
        stream = await stub.rpc_download_slice(request)
        metadata, parts = None, []
        async for message in aiter_with_timeout(stream, timeout=part_timeout):
            if message.metadata:
                metadata = self.serializer.loads(message.metadata)
            parts.append(message.tensor_part)
        if not isinstance(metadata, dict) or metadata.get("hash") != state_hash or not parts:
            raise ValueError("the donor no longer holds that state")
        values = deserialize_torch_tensor(combine_from_streaming(parts))
        if values.dtype != torch.float32 or values.shape != (end - start,):
            raise ValueError(f"the donor sent {values.dtype} of shape {tuple(values.shape)} for a slice of "
                             f"{end - start} floats")
        return metadata, values


def _take(tensors: Sequence[torch.Tensor], start: int, end: int) -> torch.Tensor:
    """Values [start, end) of the tensors laid end to end (one copy of the slice only)."""
    pieces, offset = [], 0
    for tensor in tensors:
        flat = tensor.reshape(-1)
        lo, hi = max(start - offset, 0), min(end - offset, flat.numel())
        if lo < hi:
            pieces.append(flat[lo:hi])
        offset += flat.numel()
    return torch.cat(pieces)
