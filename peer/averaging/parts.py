"""An all-reduce's vector cut into parts, each encoded by our codecs and reduced exactly: hivemind's partitioning,
with averages instead of deltas, and a failed member failing the whole reduction instead of being averaged around.

- ``part_bytes``: how large the parts are, from what the group agrees on alone;
- ``CodecCompression``: our pure-tensor codecs behind hivemind's compression interface;
- ``ExactPartContainer``: a member's parts out and its averaged parts in; a failed reducer fails every output;
- ``ExactPartReducer``, ``RobustPartReducer``: a reducer's sums over **all** senders, combined robustly
  (``peer/averaging/robust.py``), idempotent per sender and part so that a resumed stream may send a part again;
- ``decode_in_order``: a stream of parts decoded in threads, each against the shape its place in the stream gives.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterable, AsyncIterator, Callable, Dict, Iterable, Optional, Set, Tuple, TypeVar

import torch
from diloco_compression import Codec
from hivemind.averaging.partition import TensorPartContainer, TensorPartReducer
from hivemind.compression import CompressionBase, CompressionInfo
from hivemind.proto import runtime_pb2
from hivemind.utils.asyncio import amap_in_executor

from peer.averaging.robust import Offence, robust_mean
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


M = TypeVar("M")
R = TypeVar("R")


async def decode_in_order(decode: Callable[[M, Optional[torch.Size]], R], stream: AsyncIterable[M],
                          shapes: Iterable[torch.Size], max_prefetch: int = 1) -> AsyncIterator[R]:
    """``decode(message, shape)`` for each message of ``stream`` in the event loop's executor, where ``shape`` is the
    one its place in the stream gives it (None past the last shape); results in the stream's order.

    The shape is taken here, in the event loop, in the order messages come. The decodes run side by side in threads
    (``amap_in_executor`` starts the next while the last is awaited), and a shape taken inside one went to whichever
    thread ran first: on Python 3.13 the last part often ran first, got the first part's shape, and the member
    called a correct reducer's part malformed and failed the round."""
    shapes = iter(shapes)

    async def placed() -> AsyncIterator[Tuple[M, Optional[torch.Size]]]:
        async for message in stream:
            yield message, next(shapes, None)

    async for result in amap_in_executor(lambda pair: decode(*pair), placed(), max_prefetch=max_prefetch):
        yield result


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
        again what its broken one had sent, ``ReducerRunner.rpc_aggregate_part``) only awaits the average."""
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
