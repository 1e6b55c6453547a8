"""An all-reduce whose members end bit-identical, or fail together: hivemind's butterfly, made exact.

hivemind's ``AllReduceRunner`` has each reducer send every member its own delta (average - part), which
the member adds in place, so members never agree to the last bit; and when a member dies it quietly
averages over the survivors, or keeps a member's own part where a reducer vanished (a SIGKILLed peer
leaves the others with a partly averaged tensor). Here, on hivemind's own partitioning, streaming and
RPCs:

- each reducer encodes its averaged part **once** and sends the same bytes to every member, and
  decodes them for itself too, so all members decode identical bytes into identical fp32 values;
- a sender that fails, a reducer that fails or sends a malformed averaged part aborts the whole
  all-reduce with ``GroupLostMember``; the caller retries from its saved tensors, unless it is
  ``MaybeApplied``: our own reducer had finished, so other members may have applied the round;
- a stream that breaks mid-way (the p2p daemon resets a connection whose write waits too long, on a thin
  link) is not a failure yet: its sender resumes it on a new stream from the averaged parts it has, and the
  reducer, whose sums are idempotent per sender and part, answers it, for ``sender_timeout``;
- each reducer combines a part robustly (``peer/averaging/robust.py``): a malformed part (wrong shape, dtype,
  size or bytes, or a bad weight) or a non-finite one is rejected, a part far from the others is clipped
  or rejected, and a banned sender's parts are ignored; the offenders are reported.
"""

from __future__ import annotations

import asyncio
import logging
from typing import AsyncIterator, Callable, Dict, List, Optional, Sequence, Set, Tuple, Type

import torch
from diloco_compression import Codec
from hivemind.averaging.allreduce import AllReduceRunner, AveragingMode, GroupID
from hivemind.averaging.partition import TensorPartContainer, TensorPartReducer
from hivemind.compression import CompressionBase, CompressionInfo
from hivemind.p2p import P2P, P2PContext, PeerID, ServicerBase
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils.asyncio import achain, aiter_with_timeout, amap_in_executor, as_aiter, attach_event_on_finished

from peer.averaging.robust import Offence, robust_mean
from peer.hooks import REDUCE, SEND, Hooks
from peer.swarm.failures import GroupLostMember

PART_BYTES = (1 << 16, 1 << 20)  # the smallest and the largest part an all-reduce streams, in nominal encoded bytes
PARTS_PER_SHARE = 8  # parts each reducer's share is cut into, where that keeps parts at least the smallest
RESUMES = 3  # times a sender resumes its stream to one reducer in one all-reduce
RESUME_PREFIX = b"resume-from:"

logger = logging.getLogger(__name__)


def part_bytes(values: int, reducers: int, codec: Codec) -> int:
    """How large the parts of an all-reduce of ``values`` among ``reducers`` are: the largest power of two in
    ``PART_BYTES`` that cuts each reducer's share into ``PARTS_PER_SHARE`` parts, where it can.

    hivemind deals whole parts to reducers and a reducer answers part by part. With parts as large as a share, one
    reducer got 3 of a fragment's 4 shares (bench/results/wan.md: it sent 2.5 MB where the others sent 1.0 and a
    balanced share is 1.5), and a member's averaged parts came back only after it had sent all of its own. With
    several parts a share, shares are within a part of equal, and the averaged parts flow back while the rest is
    still being sent. A power of two keeps parts whole codec blocks. Every member computes the same size: it
    depends only on what the group agrees on."""
    share = values * codec.bits_per_value / 8 / max(1, reducers)
    size = PART_BYTES[1]
    while size > PART_BYTES[0] and share < PARTS_PER_SHARE * size:
        size //= 2
    return size


class CodecCompression(CompressionBase):
    """Our pure-tensor codecs behind hivemind's compression interface (used to size and encode parts)."""

    compression_type = runtime_pb2.CompressionType.NONE  # never dispatched on: both ends know the codec

    def __init__(self, codec: Codec):
        self.codec = codec

    def compress(self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False) -> runtime_pb2.Tensor:
        return runtime_pb2.Tensor(buffer=self.codec.encode(tensor.reshape(-1)), size=tensor.shape, dtype="float32")

    def extract(self, serialized: runtime_pb2.Tensor) -> torch.Tensor:
        shape = torch.Size(serialized.size)
        return self.codec.decode(serialized.buffer, shape.numel()).reshape(shape)

    def extract_expected(self, serialized: runtime_pb2.Tensor, shape: torch.Size) -> torch.Tensor:
        """Decode a part that must have ``shape``; ValueError naming what is wrong with it. Checked before
        anything is allocated, so a part claiming a huge size costs nothing."""
        if tuple(serialized.size) != tuple(shape):
            raise ValueError(f"shape {tuple(serialized.size)}, expected {tuple(shape)}")
        if serialized.dtype != "float32":
            raise ValueError(f"dtype {serialized.dtype or '(none)'}, expected float32")
        try:
            return self.codec.decode(serialized.buffer, shape.numel()).reshape(shape)
        except Exception as e:  # a codec that meets bytes it never wrote may fail in any way
            raise ValueError(f"{len(serialized.buffer)} bytes that {self.codec.name} cannot decode ({e})") from None

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        return self.codec.ratio()


class ExactPartContainer(TensorPartContainer):
    """Outputs are averages, not deltas; a failed reducer fails the whole output instead of being
    replaced by the member's own part."""

    failure: Optional[str] = None

    def register_failed_reducer(self, peer_index: int) -> None:
        self.failure = self.failure or f"reducer #{peer_index} failed"
        self.finalize()

    async def iterate_output_tensors(self) -> AsyncIterator[torch.Tensor]:
        assert not self._outputs_consumed, "output tensors are already iterated and no longer available."
        self._outputs_consumed = True
        peer_index = num_parts_processed = 0
        for tensor_index in range(len(self.local_tensors)):
            tensor_parts = []
            while len(tensor_parts) < self.num_parts_by_tensor[tensor_index]:
                if num_parts_processed >= self.num_parts_by_peer[peer_index]:
                    num_parts_processed, peer_index = 0, peer_index + 1
                    continue
                # check `finished` before every wait: hivemind's version can miss a finalize that
                # happened before it cleared the event, and then hangs until the all-reduce timeout
                while not self._output_parts_by_peer[peer_index]:
                    if self.finished.is_set():
                        raise GroupLostMember(self.failure or "all-reduce terminated")
                    self._output_part_available[peer_index].clear()
                    await self._output_part_available[peer_index].wait()
                tensor_parts.append(self._output_parts_by_peer[peer_index].popleft())
                num_parts_processed += 1
            yield torch.cat(tensor_parts).reshape(self.local_tensors[tensor_index].shape)


class ExactPartReducer(TensorPartReducer):
    """Averages a part only over **all** senders: a failed sender aborts the reduction for everyone."""

    async def accumulate_part(self, sender_index: int, part_index: int, tensor_part: torch.Tensor,
                              weight: float = 1.0) -> torch.Tensor:
        if self.finished.is_set():  # aborted: never add to (or resolve) a part that already failed
            raise GroupLostMember("the reduction was aborted")
        return await super().accumulate_part(sender_index, part_index, tensor_part, weight=weight)

    def on_sender_failed(self, sender_index: int) -> None:
        if self.finished.is_set():
            return
        if not self.current_part_future.done():
            self.current_part_future.set_exception(GroupLostMember(f"sender #{sender_index} failed"))
        self.finished.set()


class RobustPartReducer(ExactPartReducer):
    """Waits for every current sender's part, then combines them with ``robust_mean`` in sender order."""

    def __init__(self, part_shapes, num_senders: int, clip_factor: float, ignored: Set[int],
                 on_offence: Callable[[Offence], None]):
        self.collected: Dict[int, Tuple[torch.Tensor, float]] = {}
        self.clip_factor, self.ignored, self.on_offence = clip_factor, set(ignored), on_offence
        self.completed = not part_shapes  # every part of ours averaged (and so sent to whoever asked)
        self.part_futures: Dict[int, asyncio.Future] = {}  # part index -> its average, kept for resumed streams
        self.accumulated = [0] * num_senders  # how many of each sender's parts are in
        super().__init__(part_shapes, num_senders)

    def reset_accumulators(self) -> None:
        super().reset_accumulators()
        self.collected = {}
        self.part_futures.setdefault(self.current_part_index, self.current_part_future)

    async def accumulate_part(self, sender_index: int, part_index: int, tensor_part: Optional[torch.Tensor],
                              weight: float = 1.0) -> torch.Tensor:
        """Add a sender's part and await the part's average. A part that is in already (a resumed stream sends
        again what its broken one had sent, ``ExactAllReduceRunner.rpc_aggregate_part``) only awaits the average."""
        if part_index > self.accumulated[sender_index]:
            raise GroupLostMember(f"sender #{sender_index} sent part {part_index} before part "
                                  f"{self.accumulated[sender_index]}")
        if self.finished.is_set() and part_index == self.accumulated[sender_index]:
            raise GroupLostMember("the reduction was aborted")
        while part_index > self.current_part_index:  # wait for the earlier parts to be reduced
            await asyncio.wait({self.current_part_future, asyncio.create_task(self.finished.wait())},
                               return_when=asyncio.FIRST_COMPLETED)
            if self.finished.is_set():
                raise GroupLostMember("the reduction was aborted")
        if part_index < self.accumulated[sender_index]:
            return await asyncio.shield(self.part_futures[part_index])
        self.num_parts_received[sender_index] += 1
        future = self.current_part_future
        if sender_index not in self.ignored and tensor_part is not None:  # None: rejected as malformed
            self.collected[sender_index] = (tensor_part, weight)
        self.accumulated[sender_index] += 1
        self.current_part_accumulated_from += 1
        self.check_current_part_finished()
        # every sender's stream and our own part await this one future; hivemind cancels a stream handler's task
        # when its stream closes, and a cancelled awaiter would cancel the future for all of them, so that a member
        # whose connection broke showed as "lost reducer <us>: CancelledError()". Shielded, that sender's loss
        # reaches the others as itself (``on_sender_failed``: "sender #i failed").
        return await asyncio.shield(future)

    def check_current_part_finished(self) -> None:
        if self.current_part_accumulated_from < self.num_current_senders:
            return
        try:
            averaged, offences = robust_mean(self.collected, self.clip_factor)
        except ValueError as e:
            self.current_part_future.set_exception(GroupLostMember(str(e)))
            self.finished.set()
            return
        for offence in offences:
            self.on_offence(offence)
        self.completed = self.current_part_index == self.num_parts - 1
        self.current_part_future.set_result(averaged)
        self.reset_accumulators()


class ExactAllReduceRunner(AllReduceRunner):
    """Butterfly all-reduce of ``tensors`` in a formed group; iterate it to get the averaged tensors."""

    def __init__(
        self,
        *,
        p2p: P2P,
        servicer_type: Type[ServicerBase],
        prefix: Optional[str],
        group_id: GroupID,
        tensors: Sequence[torch.Tensor],
        weight: float,
        ordered_peer_ids: Sequence[PeerID],
        peer_fractions: Tuple[float, ...],
        modes: Sequence[AveragingMode],
        sender_timeout: float,
        reducer_timeout: float,
        codec: Codec,
        part_size_bytes: Optional[int] = None,
        hooks: Hooks = Hooks(),
        epoch: int = 0,
        clip_factor: float = 0.0,
        banned: Set[PeerID] = frozenset(),
    ):
        self._init_hivemind_fields(p2p, servicer_type, prefix, group_id, ordered_peer_ids, peer_fractions, modes)
        self.weight = float(weight)
        self.sender_timeout, self.reducer_timeout = sender_timeout, reducer_timeout
        self.compression = CodecCompression(codec)
        if part_size_bytes is None:
            reducers = sum(1 for fraction in peer_fractions if fraction > 0)
            part_size_bytes = part_bytes(sum(t.numel() for t in tensors), reducers, codec)
        self.tensor_part_container = ExactPartContainer(
            tensors, peer_fractions, compression=self.compression, part_size_bytes=part_size_bytes,
            return_deltas=False,
        )
        self.parts_for_local_averaging = self.tensor_part_container.get_raw_input_parts(self.my_index)
        self.offences: Dict[PeerID, Dict[str, str]] = {}  # sender -> {what its parts did wrong: first detail}
        self.severe: Set[PeerID] = set()  # senders with an offence that counts toward a ban
        self.tensor_part_reducer = RobustPartReducer(
            tuple(part.shape for part in self.parts_for_local_averaging), len(self.sender_peer_ids), clip_factor,
            ignored={i for i, peer in enumerate(self.sender_peer_ids) if peer in banned}, on_offence=self._offence,
        )
        self._encoded: Dict[int, asyncio.Future] = {}  # averaged parts we reduce, encoded once
        # every averaged part as encoded by its reducer, keyed (reducer index, part index): what every member decoded
        self.outputs: Dict[Tuple[int, int], runtime_pb2.Tensor] = {}
        self.hooks, self.epoch = hooks, epoch  # a harness may strike at SEND and REDUCE of this round
        # resumed streams (``rpc_aggregate_part``): as a sender, our encoded parts per reducer, the reducers we have
        # streamed to, and what broke a stream; as a reducer, each sender's streams
        self._inputs: Dict[int, Dict[int, asyncio.Future]] = {}
        self._streams_opened: Set[int] = set()
        self.broken: Dict[int, str] = {}
        self.senders = SenderStreams(sender_timeout, self._drop_sender)

    def _init_hivemind_fields(self, p2p: P2P, servicer_type: Type[ServicerBase], prefix: Optional[str],
                              group_id: GroupID, ordered_peer_ids: Sequence[PeerID], peer_fractions: Tuple[float, ...],
                              modes: Sequence[AveragingMode]) -> None:
        """hivemind's __init__ builds its own (inexact) container and reducer, so set its other fields here."""
        assert p2p.peer_id in ordered_peer_ids, "peer_id is not a part of the group"
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

    def _offence(self, offence: Offence) -> None:
        peer = self.sender_peer_ids[offence.sender]
        self.offences.setdefault(peer, {}).setdefault(offence.reason, offence.detail)
        if offence.severe:
            self.severe.add(peer)

    def encoded_outputs(self) -> List[runtime_pb2.Tensor]:
        """The averaged parts in order, as every member decoded them (a cross-group round's result)."""
        return [self.outputs[key] for key in sorted(self.outputs)]

    @property
    def my_index(self) -> int:
        return self.ordered_peer_ids.index(self.peer_id)

    def _fire(self, phase: str) -> None:
        self.hooks.at(phase, self.epoch)

    async def _encode_once(self, part_index: int, averaged: torch.Tensor) -> runtime_pb2.Tensor:
        """Encode the averaged part the first time any member asks; everyone gets those same bytes. Shielded: a
        stream's handler cancelled as its stream breaks would cancel the encoding for everyone else."""
        if part_index not in self._encoded:
            loop = asyncio.get_event_loop()
            self._encoded[part_index] = loop.run_in_executor(None, self.compression.compress, averaged, None)
        return await asyncio.shield(self._encoded[part_index])

    async def _communicate_with_peer(self, peer_id: PeerID) -> None:
        """Send our part to ``peer_id``'s reducer and receive the averaged part back; a stream that breaks mid-way
        (a connection reset) is resumed where it broke, up to ``RESUMES`` times."""
        peer_index = self.ordered_peer_ids.index(peer_id)
        container = self.tensor_part_container
        try:
            if peer_id == self.peer_id:
                sender_index = self.sender_peer_ids.index(peer_id)
                for part_index, part in enumerate(self.parts_for_local_averaging):
                    averaged = await self.tensor_part_reducer.accumulate_part(
                        sender_index, part_index, part, weight=self.weight
                    )
                    encoded = await self._encode_once(part_index, averaged)
                    self.outputs[peer_index, part_index] = encoded
                    container.register_processed_part(peer_index, part_index, self.compression.extract(encoded))
                return
            expected = container.num_parts_by_peer[peer_index]
            received = 0  # averaged parts registered from this reducer, over all of its streams
            for resume in range(RESUMES + 1):
                async for averaged, encoded in self._exchange(peer_id, peer_index, received):
                    self.outputs[peer_index, received] = encoded
                    container.register_processed_part(peer_index, received, averaged)
                    self._inputs.get(peer_index, {}).pop(received, None)  # never sent again
                    received += 1
                broken = self.broken.pop(peer_index, None)
                if received == expected:
                    return
                if resume == RESUMES or container.finished.is_set():
                    break
                logger.info(f"the stream to {peer_id} broke after {received} of {expected} averaged parts "
                            f"({broken or 'it ended'}); resuming it")
            raise GroupLostMember(f"{peer_id} sent {received} of {expected} averaged parts"
                                  + (f" ({broken})" if broken else ""))
        except BaseException as e:
            container.failure = container.failure or f"lost reducer {peer_id}: {e!r}"
            container.register_failed_reducer(peer_index)
            raise

    async def _exchange(self, peer_id: PeerID, peer_index: int,
                        start: int) -> AsyncIterator[Tuple[torch.Tensor, runtime_pb2.Tensor]]:
        """One stream to a reducer: our parts from ``start`` on, out; their averages, decoded, in. A stream that
        breaks ends early, with what broke it in ``broken``; a reducer that answers wrongly or not in time raises."""
        container = self.tensor_part_container
        done_sending = asyncio.Event()
        inputs = attach_event_on_finished(self._generate_input_for_peer(peer_index, start), done_sending)
        shapes = iter([part.shape for part, _ in container._input_parts_by_peer[peer_index]][start:])

        def decode(message: averaging_pb2.AveragingData) -> Tuple[torch.Tensor, runtime_pb2.Tensor]:
            if message.code != averaging_pb2.AVERAGED_PART:
                raise GroupLostMember(f"{peer_id} sent {averaging_pb2.MessageCode.Name(message.code)}")
            shape = next(shapes, None)
            if shape is None:
                raise GroupLostMember(f"{peer_id} sent more averaged parts than it reduces")
            try:
                return self.compression.extract_expected(message.tensor_part, shape), message.tensor_part
            except ValueError as e:
                raise GroupLostMember(f"{peer_id} sent a malformed averaged part: {e}") from None

        try:
            stream = await asyncio.wait_for(self._get_peer_stub(peer_id).rpc_aggregate_part(inputs),
                                            self.reducer_timeout)  # a dial to a peer gone silent does not return
            if self.should_delay_results(self.peer_id):
                await done_sending.wait()
            async for decoded in amap_in_executor(
                decode, aiter_with_timeout(stream, self.reducer_timeout), max_prefetch=container.prefetch
            ):
                yield decoded
        except (GroupLostMember, asyncio.TimeoutError):  # the reducer's own doing, or its silence: no resume
            raise
        except Exception as e:  # the stream broke: a reset connection, a closed stream, a failed dial
            self.broken[peer_index] = repr(e)

    async def _generate_input_for_peer(self, peer_index: int,
                                       start: int = 0) -> AsyncIterator[averaging_pb2.AveragingData]:
        """Our parts for one reducer, from ``start`` on. The first message names the group and, on any stream to that
        reducer after the first, where it resumes. Each part is encoded once, and kept until its average is back."""
        encoded = self._inputs.setdefault(peer_index, {})
        parts = self.tensor_part_container._input_parts_by_peer[peer_index]
        loop = asyncio.get_event_loop()
        resumed = peer_index in self._streams_opened
        self._streams_opened.add(peer_index)
        for part_index in range(start, len(parts)):
            for ahead in range(part_index, min(part_index + 1 + self.tensor_part_container.prefetch, len(parts))):
                if ahead not in encoded:
                    encoded[ahead] = loop.run_in_executor(None, self.compression.compress, *parts[ahead])
            part = await asyncio.shield(encoded[part_index])  # a broken stream's cancel must not cancel the encoding
            message = averaging_pb2.AveragingData(tensor_part=part, weight=self.weight)
            if part_index == start:
                message.code, message.group_id = averaging_pb2.PART_FOR_AVERAGING, self.group_id
                if resumed:
                    message.peer_id = resume_marker(start)
            yield message
            if part_index == start and not resumed:
                self._fire(SEND)  # a fault plan may strike this peer while it is sending

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
        shapes = iter(reducer.part_shapes[start:])

        def decode(message: averaging_pb2.AveragingData) -> Tuple[Optional[torch.Tensor], float, Optional[str]]:
            """(part, weight, None), or (None, weight, what is wrong with it); called in the order parts come."""
            shape = next(shapes, None)
            if shape is None:
                raise GroupLostMember(f"sender #{sender_index} sent more than the {reducer.num_parts} parts expected")
            if not 0 <= message.weight < float("inf"):  # 0: a member with no work this round (robust_mean)
                return None, 1.0, f"weight {message.weight}"
            try:
                return self.compression.extract_expected(message.tensor_part, shape), message.weight, None
            except ValueError as e:
                return None, message.weight, str(e)

        async for part, weight, malformed in amap_in_executor(decode, stream, max_prefetch=1):
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
