"""The reducer's half of the exact all-reduce: each groupmate's stream of parts answered part by part with the
shared encoding of their average; a stream that breaks waited for and resumed; a sender late, silent or wrong
dropped, by name.

A stream that breaks mid-way (the p2p daemon resets a connection whose write waits too long, on a thin link) is a
sender gone quiet, not a sender gone: it resumes on a new stream from the averaged parts it has (its first message
carries ``resume_marker``), and the reducer, whose sums are idempotent per sender and part, answers it, for
``sender_timeout``. hivemind's handler dropped such a sender at once, and a connection reset failed the round for
the whole group.
"""

from __future__ import annotations

import asyncio
import logging
from typing import AsyncIterator, Callable, Dict, Optional, Sequence, Set, Tuple, Type

import torch
from hivemind.averaging.allreduce import AllReduceRunner, AveragingMode, GroupID
from hivemind.p2p import P2P, P2PContext, PeerID, ServicerBase
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils.asyncio import achain, aiter_with_timeout, as_aiter

from peer.averaging.parts import CodecCompression, RobustPartReducer, decode_in_order
from peer.averaging.robust import Offence
from peer.hooks import REDUCE, Hooks
from peer.swarm.failures import GroupLostMember

RESUME_PREFIX = b"resume-from:"

logger = logging.getLogger(__name__)


class ReducerRunner(AllReduceRunner):
    """hivemind's ``AllReduceRunner`` with an exact, robust reducer that waits for broken streams to resume; the
    sender's half is ``ExactAllReduceRunner``. hivemind's ``__init__`` builds its own (inexact) container and
    reducer, so this one sets hivemind's other fields itself and never calls it."""

    def __init__(self, *, p2p: P2P, servicer_type: Type[ServicerBase], prefix: Optional[str], group_id: GroupID,
                 ordered_peer_ids: Sequence[PeerID], peer_fractions: Tuple[float, ...], modes: Sequence[AveragingMode],
                 part_shapes: Sequence[torch.Size], compression: CodecCompression, sender_timeout: float,
                 reducer_timeout: float, clip_factor: float, banned: Set[PeerID], hooks: Hooks, epoch: int):
        assert any(mode != AveragingMode.CLIENT for mode in modes), "cannot run allreduce without reducers"
        self._p2p, self.peer_id = p2p, p2p.peer_id
        self._servicer_type, self._prefix = servicer_type, prefix
        self.group_id, self.ordered_peer_ids = group_id, tuple(ordered_peer_ids)
        self.modes, self.peer_fractions = tuple(modes), tuple(peer_fractions)
        self._future = asyncio.Future()
        self.sender_peer_ids = [peer for peer, mode in zip(self.ordered_peer_ids, self.modes)
                                if mode != AveragingMode.AUX]
        self.all_senders_started = asyncio.Event()
        self.banned_senders: Set[PeerID] = set()
        self.banlock = asyncio.Lock()
        self.active_senders: Set[PeerID] = {self.peer_id} if self.peer_id in self.sender_peer_ids else set()
        if len(self.active_senders) == len(self.sender_peer_ids):
            self.all_senders_started.set()

        self.compression = compression
        self.sender_timeout, self.reducer_timeout = sender_timeout, reducer_timeout
        self.hooks, self.epoch = hooks, epoch  # a harness may strike at SEND and REDUCE of this round
        self.offences: Dict[PeerID, Dict[str, str]] = {}  # sender -> {what its parts did wrong: first detail}
        self.severe: Set[PeerID] = set()  # senders with an offence that counts toward a ban
        self.tensor_part_reducer = RobustPartReducer(
            tuple(part_shapes), len(self.sender_peer_ids), clip_factor,
            ignored={i for i, peer in enumerate(self.sender_peer_ids) if peer in banned}, on_offence=self._offence,
        )
        self._encoded: Dict[int, asyncio.Future] = {}  # averaged parts we reduce, encoded once
        self.senders = SenderStreams(sender_timeout, self._drop_sender)  # each sender's streams, as resumed

    def _offence(self, offence: Offence) -> None:
        peer = self.sender_peer_ids[offence.sender]
        self.offences.setdefault(peer, {}).setdefault(offence.reason, offence.detail)
        if offence.severe:
            self.severe.add(peer)

    def _fire(self, phase: str) -> None:
        self.hooks.at(phase, self.epoch)

    async def _encode_once(self, part_index: int, averaged: torch.Tensor) -> runtime_pb2.Tensor:
        """Encode the averaged part the first time any member asks; everyone gets those same bytes. Shielded: a
        stream's handler cancelled as its stream breaks would cancel the encoding for everyone else."""
        if part_index not in self._encoded:
            loop = asyncio.get_event_loop()
            self._encoded[part_index] = loop.run_in_executor(None, self.compression.compress, averaged, None)
        return await asyncio.shield(self._encoded[part_index])

    async def rpc_aggregate_part(self, stream: AsyncIterator[averaging_pb2.AveragingData],
                                 context: P2PContext) -> AsyncIterator[averaging_pb2.AveragingData]:
        """A groupmate sends us its parts of our share; we answer each with its average. A stream that breaks mid-way
        is a sender gone quiet, not a sender gone: it has ``sender_timeout`` to resume it on a new stream, from the
        averaged parts it has, before it is dropped (and the reduction with it). hivemind's handler dropped it at once,
        and a connection reset failed the round for the whole group."""
        if context.remote_id not in self.sender_peer_ids:
            yield averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        sender_index = self.sender_peer_ids.index(context.remote_id)
        self.active_senders.add(context.remote_id)
        if len(self.active_senders) == len(self.sender_peer_ids):
            self.all_senders_started.set()
        number = self.senders.attach(sender_index)
        try:
            request = await asyncio.wait_for(anext(stream), self.sender_timeout)
            start = resumed_from(request)
            reject = self._check_reasons_to_reject(request, context, resumed=start is not None)
            if reject is None and (request.code != averaging_pb2.PART_FOR_AVERAGING or start is not None and not (
                    0 <= start <= min(self.tensor_part_reducer.accumulated[sender_index],
                                      self.tensor_part_reducer.num_parts - 1))):
                reject = averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
            if reject is not None:
                yield reject
                if reject.code == averaging_pb2.PROTOCOL_VIOLATION:
                    await self._ban_sender(context.remote_id)
                else:  # it superseded any earlier stream of this sender: that one's wait for a resume goes on
                    self.senders.detach(sender_index, number, f"refused: {averaging_pb2.MessageCode.Name(reject.code)}")
                return
            start = start or 0
            parts = aiter_with_timeout(achain(as_aiter(request), stream), self.sender_timeout)
            replies = self._accumulate_parts_streaming(parts, sender_index, start)
            if self.should_delay_results(context.remote_id):  # a client takes its averages once it has sent all
                replies = as_aiter(*[reply async for reply in replies])
            async for reply in replies:
                yield reply
                start += 1
            if start < self.tensor_part_reducer.num_parts:
                self.senders.detach(sender_index, number, "its stream ended")
        except (GroupLostMember, asyncio.TimeoutError) as e:  # its parts were wrong, or did not come in time
            self._say_dropped(sender_index, f"no part within {self.sender_timeout:.0f}s"
                              if isinstance(e, asyncio.TimeoutError) else str(e))
            await self._ban_sender(context.remote_id)
            yield averaging_pb2.AveragingData(code=averaging_pb2.INTERNAL_ERROR)
        except BaseException as e:  # the stream broke (hivemind cancels the handler of a closed stream)
            self.senders.detach(sender_index, number, repr(e))
            raise

    def _check_reasons_to_reject(self, request: averaging_pb2.AveragingData, context: P2PContext,
                                 resumed: bool = False) -> Optional[averaging_pb2.AveragingData]:
        """hivemind's checks, except that a resumed stream is still answered once our all-reduce has finished."""
        if resumed and self._future.done() and not self._future.cancelled() and self._future.exception() is None:
            return None if request.group_id == self.group_id else averaging_pb2.AveragingData(
                code=averaging_pb2.BAD_GROUP_ID)
        return super()._check_reasons_to_reject(request, context)

    async def _handle_missing_senders(self) -> None:
        """hivemind's check, saying whom it drops (it dropped them without a word): a sender whose stream has not
        started within ``reducer_timeout``, as long as a sender waits for a reducer's first answer. Members learn of
        their group from its leader one after another, and each starts once its averager process gets to it; with
        hivemind's ``sender_timeout``, a busy CI machine lost fault-free rounds to a member that started late."""
        try:
            await asyncio.wait_for(self.all_senders_started.wait(), self.reducer_timeout)
        except asyncio.TimeoutError:
            for index, peer_id in enumerate(self.sender_peer_ids):
                if peer_id not in self.active_senders and peer_id not in self.banned_senders:
                    self._say_dropped(index, f"its stream did not start within {self.reducer_timeout:.0f}s")
                    await self._ban_sender(peer_id)

    def _drop_sender(self, sender_index: int, why: str) -> None:
        self._say_dropped(sender_index, why)
        asyncio.ensure_future(self._ban_sender(self.sender_peer_ids[sender_index]))

    def _say_dropped(self, sender_index: int, why: str) -> None:
        """As a warning the sender whose failure ends this reduction (beside the "all-reduce failed" it causes); at
        DEBUG those an earlier failure ended."""
        level = logging.DEBUG if self.tensor_part_reducer.finished.is_set() else logging.WARNING
        logger.log(level, f"dropped sender #{sender_index} ({self.sender_peer_ids[sender_index]}): {why}")

    async def _accumulate_parts_streaming(self, stream: AsyncIterator[averaging_pb2.AveragingData], sender_index: int,
                                          start: int = 0) -> AsyncIterator[averaging_pb2.AveragingData]:
        """Reduce one sender's parts from ``start`` on; reply with the shared encoding of each averaged part."""
        reducer = self.tensor_part_reducer
        part_index = start

        def decode(message: averaging_pb2.AveragingData,
                   shape: Optional[torch.Size]) -> Tuple[Optional[torch.Tensor], float, Optional[str]]:
            """(part, weight, None), or (None, weight, what is wrong with it)."""
            if shape is None:
                raise GroupLostMember(f"sender #{sender_index} sent more than the {reducer.num_parts} parts expected")
            if not 0 <= message.weight < float("inf"):  # 0: a member with no work this round (robust_mean)
                return None, 1.0, f"weight {message.weight}"
            try:
                return self.compression.extract_expected(message.tensor_part, shape), message.weight, None
            except ValueError as e:
                return None, message.weight, str(e)

        async for part, weight, malformed in decode_in_order(decode, stream, reducer.part_shapes[start:]):
            if part_index == 0:
                self._fire(REDUCE)  # a fault plan may strike this peer while it is reducing
            if malformed is not None:  # dropped like a non-finite part; the others' average goes on
                self._offence(Offence(sender_index, "malformed", f"part {part_index}: {malformed}"))
            averaged = await reducer.accumulate_part(sender_index, part_index, part, weight=weight)
            encoded = await self._encode_once(part_index, averaged)
            part_index += 1
            yield averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART, tensor_part=encoded)


class SenderStreams:
    """A reducer's record of each sender's streams: the latest one carries on, and one that breaks before all its
    averages went back has ``grace`` seconds to be superseded by a resumed one before ``drop`` is called on its
    sender."""

    def __init__(self, grace: float, drop: Callable[[int, str], None]):
        self.grace, self.drop = grace, drop
        self.latest: Dict[int, int] = {}  # sender index -> the number of its latest stream
        self.waiting: Dict[int, asyncio.TimerHandle] = {}  # sender index -> its drop, unless it resumes

    def attach(self, sender: int) -> int:
        """A stream of this sender begins and supersedes any earlier one; returns its number."""
        waiting = self.waiting.pop(sender, None)
        if waiting is not None:
            waiting.cancel()
        self.latest[sender] = self.latest.get(sender, 0) + 1
        return self.latest[sender]

    def detach(self, sender: int, number: int, why: str) -> None:
        """This sender's stream ``number`` broke (or was refused): drop the sender unless it resumes in time. A later
        stream of it carries on, and then this one's end means nothing."""
        if self.latest.get(sender) != number or sender in self.waiting:
            return
        logger.debug(f"the stream from sender #{sender} broke ({why}); waiting {self.grace:.1f}s for it to resume")

        def drop() -> None:
            if self.latest.get(sender) == number:
                self.drop(sender, f"its stream broke ({why}) and did not resume within {self.grace:.1f}s")

        self.waiting[sender] = asyncio.get_event_loop().call_later(self.grace, drop)


def resume_marker(start: int) -> bytes:
    """What a resumed stream's first message carries (in ``peer_id``, which hivemind's all-reduce leaves unused)."""
    return RESUME_PREFIX + str(start).encode()


def resumed_from(message: averaging_pb2.AveragingData) -> Optional[int]:
    """The part a resumed stream starts at (None: a fresh stream; -1: a marker that names no part)."""
    if not message.peer_id.startswith(RESUME_PREFIX):
        return None
    digits = message.peer_id[len(RESUME_PREFIX):]
    return int(digits) if digits.isdigit() and len(digits) < 10 else -1
