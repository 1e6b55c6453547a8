"""State sharing: a joiner downloads (G, m) and their metadata from several donors at once, slice by slice.

hivemind's averager downloads a state from one donor. Here a downloader asks every peer that holds the wanted
state hash, a slice from each in turn, and when a donor dies or stalls it takes that donor's slices from the
others. A donor serves every slice of one download from one snapshot of its state, so that the slices fit
together even when its state moves on meanwhile, and drops the snapshot once nobody asked for it for
SNAPSHOT_IDLE seconds. The downloader checks the state's hash (``peer/round/sync.py``).

``StateSharing`` is a mixin of ``SwarmAverager``: its RPC handler and download run in the averager process.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from typing import Any, AsyncIterator, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import MPFuture
from hivemind.utils.asyncio import aiter_with_timeout
from hivemind.utils.streaming import combine_from_streaming, split_for_streaming

from dht import internals
from peer.averaging.inuse import InUse
from peer.averaging.striping import StreamCut, stripe
from peer.hooks import DONOR

logger = logging.getLogger(__name__)

STATE_SLICE = 1 << 22  # floats per slice of a state download (16 MiB): at least two slices per donor
# from donors reachable only through a relay: a slice fits in what a stock p2pd relay carries per connection before
# it resets it (128 KiB each way, dht/reach.py), so that each slice after a reset comes through on a fresh one
RELAYED_SLICE = 1 << 14  # 64 KiB
SNAPSHOT_IDLE = 30.0  # seconds a donor keeps a state snapshot after the last slice it served from it
StateProvider = Callable[[], Tuple[Dict[str, Any], Sequence[torch.Tensor]]]


class StateSharing:
    """Serves slices of our state (``rpc_download_slice``) and downloads a state from several donors."""

    _state_provider: StateProvider
    _in_use: InUse  # the peers we stream with now (``SwarmAverager``)
    state_size: int  # values in G, and in m
    _shared: Optional[Tuple[Dict[str, Any], List[torch.Tensor]]] = None  # the snapshot donors serve
    _shared_used = 0.0

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
                metadata, tensors, _ = await internals.state_from_host(self)
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
        """Stream values [start, end) of G followed by m, from the state with the requested hash. The first message
        carries the state's metadata; if we no longer hold that state, it says so (hash None) and is the only one."""
        try:
            wanted = self.serializer.loads(request.metadata)
            wanted_hash, start, end = str(wanted["hash"]), int(wanted["start"]), int(wanted["end"])
        except Exception:
            return
        # in use from the request on: a ping of ours that timed out meanwhile (a loaded machine) must not close the
        # connection under the stream (``SwarmAverager.drop_connections``)
        with self._in_use.streaming([_context.remote_id.to_base58()]):
            snapshot = await self._snapshot(wanted_hash)
            if snapshot is None:  # said in words: a stream that ends without a word was cut (``striping.StreamCut``)
                yield averaging_pb2.DownloadData(metadata=self.serializer.dumps(dict(hash=None)))
                return
            metadata, tensors = snapshot
            if not 0 <= start < end <= sum(t.numel() for t in tensors):
                return
            piece = serialize_torch_tensor(_take(tensors, start, end))
            for index, part in enumerate(split_for_streaming(piece)):
                yield averaging_pb2.DownloadData(tensor_part=part,
                                                 metadata=self.serializer.dumps(metadata) if index == 0 else b"")
                if index == 0:
                    self.hooks.at(DONOR, int(metadata.get("epoch", 0)))  # a fault plan may strike mid-transfer

    def download_state(self, donors: Sequence[str], state_hash: str, timeout: float, part_timeout: float,
                       relayed: bool = False) -> Optional[Tuple[List[str], Dict, List[torch.Tensor]]]:
        """Download the state with ``state_hash`` from ``donors`` at once, a slice from each in turn; a donor
        that fails or stalls is dropped and its slice taken from the others. ``relayed``: the donors are reachable
        only through relays (small slices). Returns (donors used, metadata, [G, m]), or None. The caller checks the
        hash."""
        future = MPFuture()
        internals.call_in_averager(self, "_download_state", donors=list(donors), state_hash=state_hash, timeout=timeout,
                                   part_timeout=part_timeout, relayed=relayed, future=future)
        try:
            return self._answer(future, timeout=timeout + 10)
        except concurrent.futures.TimeoutError:  # the averager process is overloaded or stuck: a failed download
            logger.warning(f"the averager process did not finish a state download within {timeout + 10:.0f}s")
            future.cancel()
            return None

    async def _download_state(self, donors: List[str], state_hash: str, timeout: float, part_timeout: float,
                              relayed: bool, future: MPFuture) -> None:
        try:
            slice_size = RELAYED_SLICE if relayed else STATE_SLICE
            result = await asyncio.wait_for(self._download_striped(donors, state_hash, part_timeout, slice_size),
                                            timeout)
        except Exception as e:
            logger.info(f"state download failed: {e!r}")
            result = None
        if not future.done():
            future.set_result(result)

    async def _download_striped(self, donors: List[str], state_hash: str, part_timeout: float, slice_size: int):
        size = self.state_size  # values in G, and in m
        total = 2 * size
        count = max(2 * len(donors), -(-total // slice_size))
        bounds = [total * i // count for i in range(count + 1)]
        stubs: Dict[str, Any] = {}

        async def fetch(donor: str, index: int):
            if donor not in stubs:
                stubs[donor] = self.get_stub(internals.averager_p2p(self), PeerID.from_base58(donor),
                                             namespace=self.prefix)
            with self._in_use.streaming([donor]):
                return await self._fetch_slice(stubs[donor], state_hash, bounds[index], bounds[index + 1],
                                               part_timeout)

        got = await stripe(donors, count, fetch, "state download")
        if len(got) < count:
            return None
        used, metadata, parts = [], {}, {}
        for index in range(count):
            donor, (meta, values) = got[index]
            parts[index] = values
            metadata.update(meta)
            if donor not in used:
                used.append(donor)
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
        if metadata is None and not parts:
            raise StreamCut("the stream ended before the donor answered")
        if not isinstance(metadata, dict) or metadata.get("hash") != state_hash or not parts:
            raise ValueError("the donor no longer holds that state")
        serialized = combine_from_streaming(parts)
        if len(serialized.buffer) < 4 * (end - start):  # it said it holds the state, then the stream ended: a cut
            raise StreamCut(f"the stream ended after {len(serialized.buffer)} of the slice's {4 * (end - start)} bytes")
        values = deserialize_torch_tensor(serialized)
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
