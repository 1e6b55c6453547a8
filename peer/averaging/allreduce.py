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
- each reducer combines a part robustly (``peer/averaging/robust.py``): a malformed part (wrong shape, dtype,
  size or bytes, or a bad weight) or a non-finite one is rejected, a part far from the others is clipped
  or rejected, and a banned sender's parts are ignored; the offenders are reported.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Callable, Dict, List, Optional, Sequence, Set, Tuple, Type

import torch
from diloco_compression import Codec
from hivemind.averaging.allreduce import AllReduceRunner, AveragingMode, GroupID
from hivemind.averaging.partition import TensorPartContainer, TensorPartReducer
from hivemind.compression import CompressionBase, CompressionInfo
from hivemind.p2p import P2P, PeerID, ServicerBase
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils.asyncio import aiter_with_timeout, amap_in_executor, attach_event_on_finished

from peer.averaging.robust import Offence, robust_mean
from peer.hooks import REDUCE, SEND, Hooks
from peer.swarm.failures import GroupLostMember

PART_BYTES = (1 << 16, 1 << 20)  # the smallest and the largest part an all-reduce streams, in nominal encoded bytes
PARTS_PER_SHARE = 8  # parts each reducer's share is cut into, where that keeps parts at least the smallest


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
        super().__init__(part_shapes, num_senders)

    def reset_accumulators(self) -> None:
        super().reset_accumulators()
        self.collected = {}

    async def accumulate_part(self, sender_index: int, part_index: int, tensor_part: Optional[torch.Tensor],
                              weight: float = 1.0) -> torch.Tensor:
        if self.finished.is_set():
            raise GroupLostMember("the reduction was aborted")
        self.num_parts_received[sender_index] += 1
        while part_index > self.current_part_index:  # wait for the earlier parts to be reduced
            await asyncio.wait({self.current_part_future, asyncio.create_task(self.finished.wait())},
                               return_when=asyncio.FIRST_COMPLETED)
            if self.finished.is_set():
                raise GroupLostMember("the reduction was aborted")
        future = self.current_part_future
        if sender_index not in self.ignored and tensor_part is not None:  # None: rejected as malformed
            self.collected[sender_index] = (tensor_part, weight)
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
        self._encoded: Dict[int, asyncio.Future] = {}
        # every averaged part as encoded by its reducer, keyed (reducer index, part index): what every member decoded
        self.outputs: Dict[Tuple[int, int], runtime_pb2.Tensor] = {}
        self.hooks, self.epoch = hooks, epoch  # a harness may strike at SEND and REDUCE of this round

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

    def _encode_once(self, part_index: int, averaged: torch.Tensor) -> asyncio.Future:
        """Encode the averaged part the first time any member asks; everyone gets those same bytes."""
        if part_index not in self._encoded:
            loop = asyncio.get_event_loop()
            self._encoded[part_index] = loop.run_in_executor(None, self.compression.compress, averaged, None)
        return self._encoded[part_index]

    async def _communicate_with_peer(self, peer_id: PeerID) -> None:
        """Send our part to ``peer_id``'s reducer and receive the averaged part back."""
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

            done_sending = asyncio.Event()
            inputs = attach_event_on_finished(self._generate_input_for_peer(peer_index), done_sending)
            stream = await self._get_peer_stub(peer_id).rpc_aggregate_part(inputs)
            if self.should_delay_results(self.peer_id):
                await done_sending.wait()

            shapes = iter([part.shape for part, _ in container._input_parts_by_peer[peer_index]])  # what it reduces

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

            part_index = 0
            async for averaged, encoded in amap_in_executor(
                decode, aiter_with_timeout(stream, self.reducer_timeout), max_prefetch=container.prefetch
            ):
                self.outputs[peer_index, part_index] = encoded
                container.register_processed_part(peer_index, part_index, averaged)
                part_index += 1
            if part_index != container.num_parts_by_peer[peer_index]:
                raise GroupLostMember(
                    f"{peer_id} sent {part_index} of {container.num_parts_by_peer[peer_index]} averaged parts"
                )
        except BaseException as e:
            container.failure = container.failure or f"lost reducer {peer_id}: {e!r}"
            container.register_failed_reducer(peer_index)
            raise

    async def _generate_input_for_peer(self, peer_index: int) -> AsyncIterator[averaging_pb2.AveragingData]:
        first = True
        async for message in super()._generate_input_for_peer(peer_index):
            yield message
            if first:
                first = False
                self._fire(SEND)  # a fault plan may strike this peer while it is sending

    async def _accumulate_parts_streaming(self, stream: AsyncIterator[averaging_pb2.AveragingData],
                                          sender_index: int) -> AsyncIterator[averaging_pb2.AveragingData]:
        """Reduce one sender's parts; reply with the shared encoding of each averaged part."""
        reducer = self.tensor_part_reducer
        part_index = 0
        shapes = iter(reducer.part_shapes)

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

        try:
            async for part, weight, malformed in amap_in_executor(decode, stream, max_prefetch=1):
                if part_index == 0:
                    self._fire(REDUCE)  # a fault plan may strike this peer while it is reducing
                if malformed is not None:  # dropped like a non-finite part; the others' average goes on
                    self._offence(Offence(sender_index, "malformed", f"part {part_index}: {malformed}"))
                averaged = await reducer.accumulate_part(sender_index, part_index, part, weight=weight)
                encoded = await self._encode_once(part_index, averaged)
                part_index += 1
                yield averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART, tensor_part=encoded)
        finally:
            if part_index != reducer.num_parts:
                await self._ban_sender(self.sender_peer_ids[sender_index])
