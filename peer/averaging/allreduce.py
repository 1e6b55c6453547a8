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
  reducer answers it, for ``sender_timeout`` (``peer/averaging/reducing.py``, the reducer's half);
- each reducer combines a part robustly (``peer/averaging/robust.py``): a malformed part (wrong shape, dtype,
  size or bytes, or a bad weight) or a non-finite one is rejected, a part far from the others is clipped
  or rejected, and a banned sender's parts are ignored; the offenders are reported.

This module is the sender's half: a member's parts out to each reducer, the averages back, a broken stream resumed.
``peer/averaging/parts.py`` cuts, encodes and sums the parts.
"""

from __future__ import annotations

import asyncio
import logging
from typing import AsyncIterator, Dict, List, Optional, Sequence, Set, Tuple, Type

import torch
from diloco_compression import Codec
from hivemind.averaging.allreduce import AveragingMode, GroupID
from hivemind.p2p import P2P, PeerID, ServicerBase
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils.asyncio import aiter_with_timeout, attach_event_on_finished

from peer.averaging.parts import CodecCompression, ExactPartContainer, decode_in_order, part_bytes
from peer.averaging.reducing import ReducerRunner, resume_marker
from peer.hooks import SEND, Hooks
from peer.swarm.failures import GroupLostMember

RESUMES = 3  # times a sender resumes its stream to one reducer in one all-reduce

logger = logging.getLogger(__name__)


class ExactAllReduceRunner(ReducerRunner):
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
        assert p2p.peer_id in ordered_peer_ids, "peer_id is not a part of the group"
        compression = CodecCompression(codec)
        if part_size_bytes is None:
            reducers = sum(1 for fraction in peer_fractions if fraction > 0)
            part_size_bytes = part_bytes(sum(t.numel() for t in tensors), reducers, codec)
        self.tensor_part_container = ExactPartContainer(
            tensors, peer_fractions, compression=compression, part_size_bytes=part_size_bytes, return_deltas=False,
        )
        self.parts_for_local_averaging = self.tensor_part_container.get_raw_input_parts(
            list(ordered_peer_ids).index(p2p.peer_id))
        super().__init__(
            p2p=p2p, servicer_type=servicer_type, prefix=prefix, group_id=group_id, ordered_peer_ids=ordered_peer_ids,
            peer_fractions=peer_fractions, modes=modes, compression=compression,
            part_shapes=[part.shape for part in self.parts_for_local_averaging], sender_timeout=sender_timeout,
            reducer_timeout=reducer_timeout, clip_factor=clip_factor, banned=banned, hooks=hooks, epoch=epoch,
        )
        self.weight = float(weight)
        # every averaged part as encoded by its reducer, keyed (reducer index, part index): what every member decoded
        self.outputs: Dict[Tuple[int, int], runtime_pb2.Tensor] = {}
        # resumed streams: our encoded parts per reducer, the reducers we have streamed to, and what broke a stream
        self._inputs: Dict[int, Dict[int, asyncio.Future]] = {}
        self._streams_opened: Set[int] = set()
        self.broken: Dict[int, str] = {}

    def encoded_outputs(self) -> List[runtime_pb2.Tensor]:
        """The averaged parts in order, as every member decoded them (a cross-group round's result)."""
        return [self.outputs[key] for key in sorted(self.outputs)]

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
        shapes = [part.shape for part, _ in container._input_parts_by_peer[peer_index]][start:]

        def decode(message: averaging_pb2.AveragingData,
                   shape: Optional[torch.Size]) -> Tuple[torch.Tensor, runtime_pb2.Tensor]:
            if message.code != averaging_pb2.AVERAGED_PART:
                raise GroupLostMember(f"{peer_id} sent {averaging_pb2.MessageCode.Name(message.code)}")
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
            async for decoded in decode_in_order(
                decode, aiter_with_timeout(stream, self.reducer_timeout), shapes, max_prefetch=container.prefetch
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
