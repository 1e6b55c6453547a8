"""Catching up by replaying the rounds missed (peer/round/catchup.py): a peer a few rounds behind takes each round's
result from a peer that holds it and steps itself, instead of downloading the whole state; in-process."""

import asyncio
import concurrent.futures
import contextlib
import threading
from types import SimpleNamespace

import pytest
import torch
from diloco_compression import get_codec
from hivemind.proto import averaging_pb2
from hivemind.utils.serializer import MSGPackSerializer

from peer.averaging.inuse import InUse
from peer.averaging.parts import CodecCompression
from peer.averaging.results import LONE_PART_VALUES, READY, RoundResults, decode_parts, result_key
from peer.config import RunConfig
from peer.outer.fragments import Fragments
from peer.outer.nesterov import nesterov_step
from peer.outer.state import merge_contributors, state_hash
from peer.swarm.metadata import Averaged, Contribution
from tests.harness.fake import FakePeer, record

FOUR = RunConfig(align_every=0, inner_steps=8, fragments=4).resolved()


def swarm_rounds(peer, averages, members=("a", "b")):
    """The rounds the swarm took from the peer's state, each with one of ``averages`` as its result: served by
    "a" and "b", who hold the last state. Returns that state's hash and its (G, m, e, tokens, merged)."""
    run, fragments = peer.run, Fragments(peer.layout.numel, peer.run.fragments)
    params, momentum = peer.state.params.clone(), peer.state.momentum.clone()
    epoch, tokens, merged = peer.state.epoch, peer.state.tokens_total, dict(peer.state.merged)
    for average in averages:
        gathered = {m: Contribution(epoch=epoch, hash=state_hash(params, momentum, epoch), tokens=100) for m in members}
        peer.transport.results[(epoch, state_hash(params, momentum, epoch))] = (
            Averaged(gathered=gathered, aligned=False, seconds=1.0), average)
        part, step = fragments.of(epoch), run.global_step(epoch)
        nesterov_step(params[part], momentum[part], average, run.outer_lr_at(step), run.outer_momentum_at(step))
        merged = merge_contributors(merged, gathered, epoch)
        epoch, tokens = epoch + 1, tokens + 100 * len(members)
    digest = state_hash(params, momentum, epoch)
    for member in members:
        peer.transport.peers[member] = record(member, epoch, digest, tokens)
    return digest, (params, momentum, epoch, tokens, merged)


def test_a_peer_two_rounds_behind_replays_them_to_the_swarms_hash_without_a_download():
    peer = FakePeer(numel=8, run=FOUR)
    delta = peer.train()
    digest, (params, momentum, epoch, tokens, merged) = swarm_rounds(
        peer, [torch.tensor([0.01, -0.02]), torch.tensor([0.03, 0.04])])
    found = peer.catchup.catch_up(timeout=10.0)
    assert found.adopted and peer.hash() == digest and peer.transport.downloads == []
    assert torch.equal(peer.state.params, params) and torch.equal(peer.state.momentum, momentum)
    assert (peer.state.epoch, peer.state.tokens_total, peer.state.merged) == (epoch, tokens, merged)
    assert torch.allclose(peer.state.params - peer.theta, delta)  # our own work kept, on the new state
    assert [asked[1] for asked in peer.transport.replayed] == [4, 5]


def test_a_round_nobody_serves_falls_back_to_the_download():
    peer = FakePeer(numel=8, run=FOUR)
    peer.train()
    digest, (params, momentum, epoch, tokens, merged) = swarm_rounds(
        peer, [torch.tensor([0.01, -0.02]), torch.tensor([0.03, 0.04])])
    del peer.transport.results[(5, next(h for (e, h) in peer.transport.results if e == 5))]
    peer.transport.served[digest] = (dict(epoch=epoch, tokens_total=tokens, merged=merged, hash=digest),
                                     [params, momentum])
    found = peer.catchup.catch_up(timeout=10.0)
    assert found.adopted and peer.hash() == digest and peer.transport.downloads == [(("a", "b"), digest)]


def test_a_result_of_another_lineage_is_not_adopted():
    """The holders' state came from another round than the one served for our state (a fork): the replayed end
    state fails the hash of theirs, nothing is adopted, and the download decides."""
    peer = FakePeer(numel=8, run=FOUR)
    peer.train()
    before = peer.hash()
    digest, _ = swarm_rounds(peer, [torch.tensor([0.01, -0.02])])
    key = next(iter(peer.transport.results))
    averaged, _ = peer.transport.results[key]
    peer.transport.results[key] = (averaged, torch.tensor([0.5, 0.5]))  # what another group applied
    found = peer.catchup.catch_up(timeout=10.0)
    assert not found.adopted and peer.hash() == before and peer.transport.downloads == [(("a", "b"), digest)]


def test_a_peer_that_stepped_alone_serves_its_step_and_a_peer_behind_replays_it():
    """Its groupmate died, so a peer steps alone; the swarm had another peer, so it serves its step (its quantized
    delta) as the round's result. That peer, restarted at the state before, replays the lone step to the same hash
    instead of downloading the state. (A peer that never saw another peer's record serves nothing: no one needs it.)"""
    alone, behind = FakePeer(numel=8, peer_id="a"), FakePeer(numel=8, peer_id="b")
    assert alone.hash() == behind.hash()
    alone.transport.peers["b"] = record("b", 4, alone.hash(), 1000)
    alone.silence("b")
    alone.train()
    start = (alone.state.epoch, alone.hash())
    publish, served_by_then = alone.transport.publish, {}

    def publish_noting_what_is_served(rec, ttl):
        served_by_then[rec.epoch] = set(alone.transport.alone)
        publish(rec, ttl)

    alone.transport.publish = publish_noting_what_is_served
    result = alone.sync(tokens=100)
    assert result.applied and result.group == ("a",)
    assert list(alone.transport.alone) == [start]
    assert served_by_then[start[0] + 1] == {start}  # served before our record said we stepped: no replayer misses it
    behind.transport.results.update(alone.transport.alone)
    behind.transport.peers["a"] = record("a", alone.state.epoch, alone.hash(), alone.state.tokens_total)
    found = behind.catchup.catch_up(timeout=10.0)
    assert found.adopted and behind.hash() == alone.hash() and behind.transport.downloads == []
    assert behind.state.merged == alone.state.merged and behind.state.tokens_total == alone.state.tokens_total

    solo = FakePeer(numel=8, peer_id="s")
    solo.train()
    assert solo.sync(tokens=100).applied and solo.transport.alone == {}


@pytest.mark.parametrize("name", ["none", "fp16", "int8", "int4", "int4-huffman"])
def test_a_lone_steps_quantized_delta_survives_its_encoding_as_a_result_bit_for_bit(name):
    """What a lone peer serves is its buffer (delta + residual, quantized by the error feedback) encoded again by
    the wire codec in LONE_PART_VALUES parts; a replay decodes those parts. Each codec gives back the values it
    decoded, so the replayed step is the lone peer's to the bit (and the replay's hash check would say if not);
    int8 does not, and says so."""
    from diloco_compression.feedback import ErrorFeedback

    codec = get_codec(name)
    numel = LONE_PART_VALUES + 3 * 16384 + 100  # a last part shorter than the rest, ending mid-block
    delta = torch.randn(numel, generator=torch.Generator().manual_seed(0)) * 1e-3
    buffer = torch.empty(numel)
    ErrorFeedback(codec, numel).quantize(delta, out=buffer)
    compression = CodecCompression(codec)
    parts = [compression.compress(chunk, None) for chunk in buffer.split(LONE_PART_VALUES)]
    # int8's dynamic map is not exact near zero: it says so, and a lone peer on it serves nothing
    assert torch.equal(decode_parts(compression, parts, numel), buffer) == codec.reencodes_exactly


def test_a_replayer_that_asks_while_a_lone_step_is_encoded_waits_for_its_parts():
    """A lone peer's averager takes its step's result in hand, then encodes it, and the peer republishes its record
    in between (above). A replayer that read that record and asks before the parts are encoded waits for them; it
    once heard "pending" and downloaded the whole state instead. In-process: the real server, the encoding held."""
    buffer = torch.randn(LONE_PART_VALUES + 1000, generator=torch.Generator().manual_seed(0))
    held = threading.Event()

    class Lone(RoundResults):
        serializer, codec = MSGPackSerializer, get_codec("none")
        peer_id = SimpleNamespace(to_base58=lambda: "lone")

        def __init__(self):
            self._in_use = InUse()

        @contextlib.contextmanager
        def get_tensors(self):
            held.wait(timeout=30)  # the encoding (in the averager's executor) waits for the test
            yield [buffer]

    async def scenario():
        lone, taken, key = Lone(), concurrent.futures.Future(), result_key(6, "cafe")
        encoding = asyncio.ensure_future(lone._serve_alone(key, {"lone": {"epoch": 6}}, taken))
        await asyncio.sleep(0)  # one turn of the loop: the coroutine runs up to the encoding
        assert taken.done()  # in hand: the lone peer may republish now
        request = averaging_pb2.DownloadData(metadata=MSGPackSerializer.dumps(dict(key=key, start=0, end=2)))
        stream = lone.rpc_download_average(request, SimpleNamespace(remote_id=SimpleNamespace(
            to_base58=lambda: "replayer")))
        first = asyncio.ensure_future(stream.__anext__())
        for _ in range(3):
            await asyncio.sleep(0)
        assert not first.done()  # the asker waits, rather than hearing "pending"
        held.set()
        info = MSGPackSerializer.loads((await first).metadata)
        parts = [message.tensor_part async for message in stream]
        await encoding
        return info, parts

    try:
        info, parts = asyncio.run(scenario())
    finally:
        held.set()
    assert info["status"] == READY and info["parts"] == 2 and info["gathered"] == {"lone": {"epoch": 6}}
    assert torch.equal(decode_parts(CodecCompression(get_codec("none")), parts, buffer.numel()), buffer)
