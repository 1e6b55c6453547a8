"""A round's result, served by its members: to a cross-group round's groupmates by its delegates (``peer/swarm/
grouping.py``, phase 3), and to a peer that missed a round and replays it (``peer/round/catchup.py``).

A delegate keeps what its cross-group all-reduce ended with: the encoded averaged parts, in order, exactly the bytes
every delegate decoded, and the round's merged contributions. A groupmate asks any delegate of the round for the
result's status, waits while it is pending, then takes its parts from every delegate at once, a slice from each in
turn, and decodes them as the delegates did: the same bytes, the same codec, the same fp32 values. A delegate that
fails or stalls is dropped and its slices taken from the others.

Every member of a round of one group keeps its result too, and so does a groupmate once it downloaded it: a peer
that missed a round downloads that round's result (a fragment at the wire codec's bits, not the 8 bytes a parameter
of G and m) and takes the outer step itself, bit for bit as the members did.

``RoundResults`` is a mixin of ``SwarmAverager``: it runs in the averager process.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Dict, List, Optional, Sequence

import torch
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils import MPFuture
from hivemind.utils.asyncio import aiter_with_timeout, enter_asynchronously

from dht import internals
from peer.averaging.inuse import InUse
from peer.averaging.parts import CodecCompression
from peer.averaging.striping import StreamCut, stripe

logger = logging.getLogger(__name__)

PENDING, READY, MINORITY, NO_MAJORITY, FAILED = "pending", "ready", "minority", "no_majority", "failed"
GROUP_ONLY = "group"  # a majority group whose delegate met no other group's: apply the group's own average
KEPT_ROUNDS = 8  # results a member keeps serving: its last few rounds (two periods of H at F = 4), and at most
KEPT_STATE_COPIES = 1  # as many encoded bytes as this many fp32 copies of G (fp16 whole rounds: the last 2 results)
POLL_SECONDS = 0.25  # how often a groupmate asks again while the result is pending
PARTS_PER_SLICE = 8  # parts a groupmate asks a delegate for at once
LONE_PART_VALUES = 1 << 18  # a lone step's result, in parts of this many values: a multiple of every codec's block
TAKEN_SECONDS = 5.0  # the longest a lone step's publication waits for the averager to take its result in hand


def result_key(epoch: int, state_hash: str) -> str:
    return f"{epoch}:{state_hash}"


def decode_parts(compression: CodecCompression, parts: Sequence[runtime_pb2.Tensor], numel: int) -> torch.Tensor:
    """The parts' values laid end to end, decoded as the delegates decoded them; ValueError if they do not hold
    exactly ``numel`` values (checked before each part is allocated)."""
    values, total = [], 0
    for part in parts:
        shape = torch.Size(part.size)
        total += shape.numel()
        if total > numel:
            raise ValueError(f"the result holds more than the {numel} values expected")
        values.append(compression.extract_expected(part, shape).reshape(-1))
    if total != numel:
        raise ValueError(f"the result holds {total} values, expected {numel}")
    return torch.cat(values)


def check_slice(donor: str, info: Dict[str, Any], got: int, expected: int) -> None:
    """A slice of a result's parts came whole, or why not: the donor no longer serves the result (its status says
    so: a refusal), or the stream ended after a ready status and before its parts (a cut, ``striping.StreamCut``,
    tried again on a fresh stream). Both once read "sent 0 parts" and dropped the donor: a peer replaying a lone
    survivor's steps lost its only donor, and downloaded the whole state instead."""
    if info.get("status") != READY:
        raise ValueError(f"{donor} no longer serves that result ({info.get('status')})")
    if got != expected:
        raise StreamCut(f"the stream from {donor} ended after {got} of {expected} parts")


def _encoded_bytes(results) -> int:
    return sum(len(part.buffer) for served in results for part in served.parts)


@dataclass
class Served:
    status: str = PENDING
    parts: List[runtime_pb2.Tensor] = field(default_factory=list)  # encoded averaged parts, in order
    info: Dict[str, Any] = field(default_factory=dict)  # gathered (wire), aligned, delegates
    encoding: Optional[asyncio.Event] = None  # a lone step's parts, being encoded: a request waits until it is set


class RoundResults:
    """Serves our cross-group rounds' results (``rpc_download_average``) and downloads one from its delegates."""

    _served: "OrderedDict[str, Served]"
    _in_use: InUse  # the peers we stream with now (``SwarmAverager``)

    def _result(self, key: str) -> Served:
        if not hasattr(self, "_served"):
            self._served = OrderedDict()
        if key not in self._served:
            self._served[key] = Served()
            while len(self._served) > KEPT_ROUNDS:
                self._served.popitem(last=False)
        return self._served[key]

    def _conclude(self, key: str, status: str, parts: Sequence[runtime_pb2.Tensor] = (),
                  info: Optional[Dict[str, Any]] = None) -> None:
        served = self._result(key)
        served.status, served.parts, served.info = status, list(parts), dict(info or {})
        cap = KEPT_STATE_COPIES * 4 * getattr(self, "state_size", 0)
        while len(self._served) > 1 and cap and _encoded_bytes(self._served.values()) > cap:
            self._served.popitem(last=False)

    def give_up_result(self, epoch: int, state_hash: str) -> None:
        """Main process: this delegate's sync ended without the round's result; its groupmates stop waiting."""
        internals.call_in_averager(self, "_give_up", key=result_key(epoch, state_hash))

    async def _give_up(self, key: str) -> None:  # the averager's pipe runs coroutines only
        if self._result(key).status != READY:
            self._conclude(key, FAILED)

    def serve_alone(self, epoch: int, state_hash: str, gathered: Dict[str, Any]) -> None:
        """Main process: we stepped alone on our first buffer (our delta, quantized by the wire codec); serve it as
        the round's result, encoded as a round's parts are, to the peers that replay it. A codec's re-encode of its
        own decoded values gives them back (each block keeps its largest value), in parts that start on a block's
        boundary; the replay checks the end state's hash all the same. The averager process encodes it, holding the
        buffers, so that our next round's contribution waits for it rather than overwriting it. Returns once the
        averager took the result in hand: from then on a request for it waits for its parts (a replayer that read
        our new record before they were encoded once found the round pending, and downloaded the whole state)."""
        if not self.codec.reencodes_exactly:  # a replay of it would fail its hash check: serve nothing
            return
        taken = MPFuture()
        internals.call_in_averager(self, "_serve_alone", key=result_key(epoch, state_hash), gathered=gathered,
                                   taken=taken)
        try:
            self._answer(taken, timeout=TAKEN_SECONDS)
        except concurrent.futures.TimeoutError:  # a busy averager: it still serves the step, once it gets to it
            logger.debug(f"the averager took {TAKEN_SECONDS}s and more to take our lone step's result in hand")

    async def _serve_alone(self, key: str, gathered: Dict[str, Any], taken: MPFuture) -> None:
        compression = CodecCompression(self.codec)
        served = self._result(key)
        served.encoding = asyncio.Event()
        taken.set_result(None)

        def encode() -> List[runtime_pb2.Tensor]:
            with self.get_tensors() as tensors:
                return [compression.compress(chunk, None) for chunk in tensors[0].split(LONE_PART_VALUES)]

        try:
            parts = await asyncio.get_event_loop().run_in_executor(None, encode)  # the averager serves on meanwhile
            self._conclude(key, READY, parts, info=dict(gathered=gathered, aligned=False, groups=1,
                                                         delegates=[self.peer_id.to_base58()]))
        finally:
            served.encoding.set()

    def conclude_group(self, epoch: int, state_hash: str, info: Dict[str, Any]) -> None:
        """Main process: as a majority group's delegate that met no other group's, we apply our group's average
        (``info``: its gathered contributions and alignment); our groupmates do too (they hold it already)."""
        internals.call_in_averager(self, "_conclude_group", key=result_key(epoch, state_hash), info=info)

    async def _conclude_group(self, key: str, info: Dict[str, Any]) -> None:
        self._conclude(key, GROUP_ONLY, info=info)

    async def rpc_download_average(self, request: averaging_pb2.DownloadData, _context: P2PContext
                                   ) -> AsyncIterator[averaging_pb2.DownloadData]:
        """The first message says the result's status (and, once ready, what it merged); then the encoded parts
        [start, end) follow, each in a message of its own."""
        try:
            wanted = self.serializer.loads(request.metadata)
            key, start, end = str(wanted["key"]), int(wanted["start"]), int(wanted["end"])
        except Exception:
            return
        served = self._served.get(key) if hasattr(self, "_served") else None
        if served is not None and served.encoding is not None:
            await served.encoding.wait()  # (the asker's part timeout bounds it)
        status = served.status if served is not None else PENDING
        info = dict(served.info, parts=len(served.parts)) if status in (READY, GROUP_ONLY) else {}
        with self._in_use.streaming([_context.remote_id.to_base58()]):
            yield averaging_pb2.DownloadData(metadata=self.serializer.dumps(dict(info, status=status)))
            if status == READY:
                for part in served.parts[max(start, 0):min(end, len(served.parts))]:
                    yield averaging_pb2.DownloadData(tensor_part=part)

    def download_average(self, delegate: str, epoch: int, state_hash: str, numels: Sequence[int], timeout: float,
                         part_timeout: float, wait: bool = True) -> Dict[str, Any]:
        """Main process: wait for the round's result at ``delegate``, take its parts from every delegate of the round,
        and write the decoded average into our averaged tensors (``numels``: their sizes, the first moment's last,
        left out of a result that did not align it). Returns the result's info and ``status``. ``wait``: False for a
        round long over (a replay): a result that ``delegate`` does not hold is ``PENDING`` at once."""
        future = MPFuture()
        internals.call_in_averager(self, "_download_average", delegate=delegate, key=result_key(epoch, state_hash),
                                   numels=list(numels), timeout=timeout, part_timeout=part_timeout, wait=wait,
                                   future=future)
        try:
            return self._answer(future, timeout=timeout + 10)
        except concurrent.futures.TimeoutError:  # (not TimeoutError before Python 3.11)
            future.cancel()
            return dict(status=FAILED, error="the averager process did not answer")

    async def _download_average(self, delegate: str, key: str, numels: List[int], timeout: float,
                                part_timeout: float, wait: bool, future: MPFuture) -> None:
        try:
            result = await asyncio.wait_for(self._fetch_average(delegate, key, numels, part_timeout, wait), timeout)
        except asyncio.TimeoutError:
            result = dict(status=FAILED, error=f"no result from the delegate within {timeout:.1f}s")
        except Exception as e:
            result = dict(status=FAILED, error=f"the result's download failed: {e!r}")
        if not future.done():
            future.set_result(result)

    async def _fetch_average(self, delegate: str, key: str, numels: List[int], part_timeout: float,
                             wait: bool = True) -> Dict[str, Any]:
        while True:  # the delegate's cross-group all-reduce may still be running
            info, _ = await self._ask(delegate, key, 0, 0, part_timeout)
            if info.get("status") != PENDING or not wait:
                break
            await asyncio.sleep(POLL_SECONDS)
        if info.get("status") != READY:
            return info
        numels = numels[: 2 if info.get("aligned") else 1]
        servers = list(dict.fromkeys([delegate, *(info.get("delegates") or ())]))
        parts = await self._striped(servers, key, int(info["parts"]), part_timeout)
        values = decode_parts(CodecCompression(self.codec), parts, sum(numels))
        async with enter_asynchronously(self.get_tensors()) as tensors:
            for tensor, piece in zip(tensors, values.split(list(numels))):
                tensor.copy_(piece.view_as(tensor))
        self._conclude(key, READY, parts, info=dict(info))  # we serve it on, to whoever replays the round
        return info

    async def _striped(self, delegates: List[str], key: str, count: int, part_timeout: float
                       ) -> List[runtime_pb2.Tensor]:
        starts = list(range(0, count, PARTS_PER_SLICE))

        async def fetch(donor: str, index: int):
            start = starts[index]
            info, got = await self._ask(donor, key, start, min(start + PARTS_PER_SLICE, count), part_timeout)
            check_slice(donor, info, len(got), min(PARTS_PER_SLICE, count - start))
            return got

        got = await stripe(delegates, len(starts), fetch, "result download")
        if len(got) < len(starts):
            raise ValueError("no delegate served every part of the result")
        return [part for index in range(len(starts)) for part in got[index][1]]

    async def _ask(self, donor: str, key: str, start: int, end: int, part_timeout: float):
        stub = self.get_stub(internals.averager_p2p(self), PeerID.from_base58(donor), namespace=self.prefix)
        request = averaging_pb2.DownloadData(metadata=self.serializer.dumps(dict(key=key, start=start, end=end)))
        info, parts = None, []
        with self._in_use.streaming([donor]):
            stream = await stub.rpc_download_average(request)
            async for message in aiter_with_timeout(stream, timeout=part_timeout):
                if info is None:
                    info = self.serializer.loads(message.metadata)
                else:
                    parts.append(message.tensor_part)
        if info is None:
            raise StreamCut(f"the stream from {donor} ended before it sent the result's status")
        if not isinstance(info, dict):
            raise ValueError(f"{donor} sent no status")
        return info, parts
