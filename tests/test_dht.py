"""The swarm layer on real hivemind DHT nodes on loopback: manifests, records, startup errors."""

import asyncio
import concurrent.futures
import dataclasses
import functools
import gc
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import types

import pytest
from hivemind.p2p import P2P, PeerID
from hivemind.proto import dht_pb2
from hivemind.utils import get_dht_time

from dht import internals
from dht.errors import UserError
from dht.manifest import RunManifest, fetch_manifest, join_or_create, manifest_key, publish_manifest
from dht.node import LOOPBACK, DHTConfig, SwarmDHT, reach_out, start_dht
from dht.processes import LinkLost
from dht.records import PeerRecord, RecordPublisher, RecordReader, fetch_records, publish_record
from dht.validation import signing_peer_id
from tests.harness.swarm import ROOT, in_a_thread, wait_until


@pytest.fixture(scope="module")
def two_nodes():
    first = start_dht(DHTConfig(host_maddrs=(LOOPBACK,)))
    second = start_dht(DHTConfig(host_maddrs=(LOOPBACK,),
                                 initial_peers=tuple(str(m) for m in first.get_visible_maddrs())))
    yield first, second
    second.shutdown()
    first.shutdown()


def test_manifest_is_signed_shared_and_first_one_wins(two_nodes):
    first, second = two_nodes
    created, new = join_or_create(first, RunManifest("run-a", {"model": "tiny", "lr": 0.001}))
    assert new and created.verified() and created.settings == {"model": "tiny", "lr": 0.001}
    # a joiner adopts it, asked to create or not
    assert join_or_create(second, RunManifest("run-a", {"model": "small"})) == (created, False)
    assert join_or_create(second, RunManifest("run-a", {"model": "small"}), create=False) == (created, False)
    assert fetch_manifest(second, "run-b") is None


def test_a_run_name_nobody_trains_is_refused_naming_the_runs_there_are(two_nodes):
    first, second = two_nodes
    join_or_create(first, RunManifest("run-j", {"model": "tiny"}))
    with pytest.raises(UserError, match=r"no run named 'run-k' is reachable through these peers \(runs seen: "
                                        r"[^)]*run-j[^)]*\); check --run-id, or pass --new-run to start it"):
        join_or_create(second, RunManifest("run-k", {}), create=False, look_seconds=0.5)
    private = RunManifest("run-k-0123abcd", {})  # a private run's namespace differs from its name
    with pytest.raises(UserError, match=r"check --run-id and --run-token"):
        join_or_create(second, private, create=False, name="run-k", look_seconds=0.5)
    assert join_or_create(second, RunManifest("run-k", {}), create=True)[1]  # --new-run


def test_tampered_manifest_is_ignored(two_nodes):
    first, second = two_nodes
    record = RunManifest("run-c", {"model": "tiny"}).to_record()
    record["settings"]["model"] = "1b"  # contents no longer match the hash
    from hivemind.utils import get_dht_time

    first.store(manifest_key("run-c"), record, get_dht_time() + 60)
    assert fetch_manifest(second, "run-c") is None
    assert publish_manifest(first, RunManifest("run-d", {}))


def test_records_replace_older_ones_and_are_read_by_others(two_nodes):
    first, second = two_nodes
    me = signing_peer_id()
    publisher = RecordPublisher(first, "run-e")
    for epoch in range(3):
        # the ttl shrinks, yet each new record must still replace the last one
        publisher.publish(PeerRecord(me, epoch, f"h{epoch}", 10 * epoch, "m"), ttl=60 - 20 * epoch)
    # stores run in the background: wait for the last one to land
    def newest():
        records = fetch_records(second, "run-e") or {}
        return me in records and records[me].epoch == 2 and records

    assert list(wait_until(newest, 10, "the newest record to reach the other node")) == [me]


def test_a_published_record_keeps_its_heartbeat_until_stopped(two_nodes):
    first, second = two_nodes
    me = signing_peer_id()
    publisher = RecordPublisher(first, "run-h", heartbeat=0.2)
    publisher.publish(PeerRecord(me, 1, "h1", 10, "m"), ttl=60)
    seen = wait_until(lambda: (fetch_records(second, "run-h") or {}).get(me), 10, "the record to reach the other node")
    assert seen.heartbeat == 0.2
    # refreshed with no further publish: its peer is alive though it says nothing new
    later = wait_until(lambda: (r := (fetch_records(second, "run-h") or {}).get(me)) and
                       r.updated_at > seen.updated_at + 0.3 and r, 10, "a heartbeat")
    assert (later.epoch, later.state_hash) == (1, "h1")
    publisher.stop()
    publisher.thread.join(timeout=5)
    assert not publisher.thread.is_alive()


def test_a_silent_peer_that_answers_a_ping_is_news_once(two_nodes):
    first, second = two_nodes
    publisher = RecordPublisher(first, "run-p", heartbeat=0.2)
    publisher.publish(PeerRecord(signing_peer_id(), 1, "h1", 10, "m"), ttl=60)
    publisher.reach = (second.peer_id.to_base58(),)  # as a sync sets it: a peer whose record went silent
    assert publisher.answered.wait(10), "the live peer's answer to the heartbeat's ping"
    assert publisher.reach == ()  # not pinged again: no news every heartbeat after it
    publisher.stop()


class HeldDHT:
    """A real DHT node whose lookups answer only when the test lets them: a DHT slower than its reader's timeout."""

    def __init__(self, dht):
        self.dht, self.gate, self.lookups = dht, threading.Event(), []

    def get(self, key, latest=False, return_future=False):
        held, real = concurrent.futures.Future(), self.dht.get(key, latest=latest, return_future=True)
        threading.Thread(target=lambda: self.gate.wait() and held.set_result(real.result()), daemon=True).start()
        self.lookups.append(held)
        return held


def test_a_lookup_that_answers_after_its_read_timed_out_answers_the_next_read(two_nodes):
    """Abandoned at its timeout, a slow DHT's every lookup was wasted: a peer's reads timed out for minutes on a
    loaded machine, the records it knew expired, and it stepped alone on an empty view."""
    first, second = two_nodes
    me = signing_peer_id()
    publish_record(first, "run-l", PeerRecord(me, 4, "h4", 10, "m"), get_dht_time() + 60)
    wait_until(lambda: me in (fetch_records(second, "run-l") or {}), 10, "the record to reach the other node")
    held = HeldDHT(second)
    reader = RecordReader(held, "run-l")
    assert reader.read(timeout=0.1) is None and reader.read(timeout=0.1) is None  # one lookup, still in flight
    held.gate.set()
    wait_until(held.lookups[0].done, 10, "the lookup to answer")
    answered = get_dht_time()
    records = reader.read(timeout=0)  # the late answer: no new lookup, no wait
    assert records[me].epoch == 4 and records[me].seen_at <= answered and len(held.lookups) == 1
    assert me in reader.read(timeout=10) and len(held.lookups) == 2  # once taken, a read looks again


def test_a_lookup_pending_too_long_is_given_up_for_a_new_one(two_nodes):
    held = HeldDHT(two_nodes[1])
    reader = RecordReader(held, "run-m", abandon_after=0.0)
    assert reader.read(timeout=0.05) is None and reader.read(timeout=0.05) is None
    assert len(held.lookups) == 2
    held.gate.set()
    wait_until(held.lookups[1].done, 10, "the new lookup to answer")
    assert reader.read(timeout=0) == {}  # the new one's answer: no records under this run
    assert len(held.lookups) == 2


def test_a_read_that_waits_looks_again_and_falls_back_on_an_earlier_answer(two_nodes):
    """An answer that came before a read that waits (a poll's lookup) is stale to it: a sync's first read took records
    from before the others ended their rounds. It is only the fallback while a fresh lookup goes out."""
    first, second = two_nodes
    me = signing_peer_id()

    def publish(epoch):
        publish_record(first, "run-f", PeerRecord(me, epoch, f"h{epoch}", 10, "m"), get_dht_time() + 60)
        seen = lambda: getattr((fetch_records(second, "run-f") or {}).get(me), "epoch", None)  # noqa: E731
        wait_until(lambda: seen() == epoch, 10, f"epoch {epoch}'s record to reach the other node")

    def poll():
        """A poll begins a lookup, which answers after it: held at the gate until then. (Not held, a CI machine once
        answered it within the poll's own call, which took the answer and left the next read no fallback.)"""
        held.gate.clear()
        assert reader.read(timeout=0) is None
        held.gate.set()
        wait_until(held.lookups[-1].done, 10, "the poll's lookup to answer")

    publish(4)
    held = HeldDHT(second)
    reader = RecordReader(held, "run-f")
    poll()
    publish(5)
    assert reader.read(timeout=10)[me].epoch == 5 and len(held.lookups) == 2  # a fresh lookup, not the poll's answer
    poll()
    held.gate.clear()  # the DHT answers no more in time
    publish(6)
    assert reader.read(timeout=0.2)[me].epoch == 5  # the fresh lookup is late: the earlier answer stands in
    held.gate.set()
    assert reader.read(timeout=10)[me].epoch == 6 and len(held.lookups) == 4  # the late lookup's answer, no new one


async def _forget(peer_id: str, _dht, node) -> bool:
    """Drop a peer from this node's routing table, as hivemind does after a request to it failed; True if it
    was there."""
    table = node.protocol.routing_table
    node_id = table.get(peer_id=PeerID.from_base58(peer_id))
    if node_id is not None:
        del table[node_id]
    return node_id is not None


async def _knows(peer_id: str, _dht, node) -> bool:
    return node.protocol.routing_table.get(peer_id=PeerID.from_base58(peer_id)) is not None


def test_reaching_out_puts_a_forgotten_peer_back_into_the_routing_table(two_nodes):
    """After a partition each half has dropped the other from its routing table and never looks for it again;
    a ping (``reach_out``, at every sync, to the peers gone silent) puts it back."""
    first, second = two_nodes
    other = second.peer_id.to_base58()
    assert first.run_coroutine(functools.partial(_forget, other))
    assert not first.run_coroutine(functools.partial(_knows, other))
    assert reach_out(first, [other]).result(timeout=10) == ()
    assert wait_until(lambda: first.run_coroutine(functools.partial(_knows, other)), 10, "the peer to be known again")
    assert reach_out(first, []) is None
    # a peer that does not answer (gone, or cut off: then its connection is dropped so that the next ping dials
    # afresh) counts as no answer, not an error
    nobody = PeerID.from_base58("QmNnooDu7bfjPFoTZYxMNLWUQJyrVwtbZg5gBMjTezGAJN").to_base58()
    assert reach_out(first, [other, nobody]).result(timeout=30) == (nobody,)


def test_port_in_use_is_a_user_error():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        maddr = f"/ip4/127.0.0.1/tcp/{taken.getsockname()[1]}"
        with pytest.raises(UserError, match="the port is already in use; pick a free port or use tcp/0"):
            start_dht(DHTConfig(host_maddrs=(maddr,)))


def test_records_are_signed_and_a_forged_or_malformed_one_is_refused(two_nodes):
    """A peer's record lives under a subkey that holds its public key, whose hash is its peer id: a store
    signed by another key (here: a node with a key of its own writing under our subkey) is refused, a record
    in our name under the forger's own subkey is stored but ignored by every reader, and the schema refuses
    bad values."""
    from hivemind.dht.crypto import RSASignatureValidator
    from hivemind.utils import get_dht_time
    from hivemind.utils.crypto import RSAPrivateKey

    from dht.records import peers_key, publish_record
    from dht.validation import record_subkey, run_validators

    first, second = two_nodes
    me = signing_peer_id()
    genuine = PeerRecord(me, 4, "h4", 40, "m")
    assert publish_record(first, "run-r", genuine, get_dht_time() + 60)
    forger_key = RSASignatureValidator(RSAPrivateKey())
    forger = start_dht(DHTConfig(host_maddrs=(LOOPBACK,),
                                 initial_peers=tuple(str(m) for m in first.get_visible_maddrs())),
                       [forger_key, *run_validators("run-r")[1:]])
    try:
        forged = dict(genuine.__dict__, epoch=99, state_hash="evil", tokens_total=10**9, updated_at=get_dht_time())
        assert not forger.store(peers_key("run-r"), forged, get_dht_time() + 120, subkey=record_subkey(me))
        # signed by the forger, under its own key, in our name (a later, better-looking record): stored, ignored
        impostor = me.encode() + forger_key.local_public_key
        assert forger.store(peers_key("run-r"), forged, get_dht_time() + 120, subkey=impostor)
        record = (fetch_records(second, "run-r") or {}).get(me)
        assert record is not None and (record.epoch, record.state_hash) == (4, "h4"), record
        # a value that breaks the schema is refused even under the writer's own subkey
        checked = start_dht(DHTConfig(host_maddrs=(LOOPBACK,)), run_validators("run-r"))
        try:
            bad = dict(genuine.__dict__, epoch="four")
            assert not checked.store(peers_key("run-r"), bad, get_dht_time() + 60, subkey=record_subkey(me))
        finally:
            checked.shutdown()
    finally:
        forger.shutdown()


@pytest.mark.parametrize("fields", [
    dict(),  # a fresh peer: no loss, no schedule yet
    dict(status="syncing", loss=3.25, tokens_per_second=812.5, next_sync_at=1.8e9, round_seconds=50.5,
         busy_until=1.8e9 + 30, client_mode=True, bytes_per_round=8_600_000, updated_at=1.8e9),
])
def test_what_peers_publish_passes_the_run_schema(fields):
    """Every record a peer publishes must pass the schema, or the DHT would silently drop it."""
    import dataclasses

    from hivemind.dht.protocol import DHTProtocol
    from hivemind.dht.routing import DHTID
    from hivemind.dht.validation import DHTRecord

    from dht.manifest import fingerprint, manifest_key
    from dht.records import peers_key
    from dht.validation import record_subkey, run_validators
    from peer.config import RunConfig

    schema = run_validators("run-g")[1]
    value = dataclasses.asdict(PeerRecord("peer-7", 3, "h3", 30, "m", **fields))
    dumps = DHTProtocol.serializer.dumps
    record = DHTRecord(DHTID.generate(source=peers_key("run-g")).to_bytes(), dumps(record_subkey("peer-7")),
                       dumps(value), 1.8e9)
    assert schema.validate(record)
    assert not schema.validate(dataclasses.replace(record, value=dumps(dict(value, epoch=3.0))))
    manifest = RunManifest("run-g", RunConfig().to_settings()).signed()
    assert schema.validate(DHTRecord(DHTID.generate(source=manifest_key("run-g")).to_bytes(),
                                     dumps(fingerprint(manifest.creator)), dumps(json.dumps(manifest.to_record())),
                                     1.8e9))


def test_a_strangers_manifest_does_not_replace_the_run_and_run_key_pins_the_creator(two_nodes):
    """Someone else signs another manifest under the same run id: it lands in its own slot; joiners keep the
    one the run's peers train with, --run-key picks the creator's, and a wrong --run-key is a clear error."""
    import dataclasses

    from hivemind.utils.crypto import RSAPrivateKey

    from dht.errors import UserError
    from dht.manifest import own_run_key

    first, second = two_nodes
    real, _ = join_or_create(first, RunManifest("run-q", {"model": "tiny"}))
    publish_record(first, "run-q", PeerRecord(signing_peer_id(), 1, "h", 10, real.hash), get_dht_time() + 60)
    fake = RunManifest("run-q", {"model": "1b"}).signed(RSAPrivateKey())
    assert fake.verified() and publish_manifest(second, fake)
    assert fetch_manifest(second, "run-q") == real  # the manifest a live peer trains with
    assert fetch_manifest(second, "run-q", run_key=fake.creator) == fake
    assert fetch_manifest(second, "run-q", run_key=own_run_key()) == real
    forged = dataclasses.replace(fake, settings={"model": "small"})  # contents changed after signing
    assert RunManifest.from_record("run-q", forged.to_record()) is None
    with pytest.raises(UserError, match="has no manifest signed by the --run-key you gave"):
        join_or_create(second, RunManifest("run-i", {}), run_key=fake.creator)


def test_a_hivemind_release_whose_internals_were_not_checked_is_refused_in_one_line():
    internals.check_version()  # the one installed is checked
    with pytest.raises(UserError) as refused:
        internals.check_version("1.2.0")
    assert str(refused.value) == ("hivemind 1.2.0 is installed, but this peer relies on the internals of hivemind "
                                  "1.1.12: pip install hivemind==1.1.12")


def test_addresses_are_ranked_by_reach_and_a_private_only_node_is_told_what_to_announce():
    from dht.addresses import private_only_hint, scope

    assert [scope(m) for m in ("/ip4/1.1.1.1/tcp/1", "/dns/example.org/tcp/1", "/ip4/10.1.2.3/tcp/1",
                               "/ip4/100.64.0.9/tcp/1", "/ip4/127.0.0.1/tcp/1", "/ip6/::1/tcp/1")] == [0, 0, 1, 1, 2, 2]
    hint = private_only_hint(["/ip4/10.1.2.3/tcp/31337/p2p/Qm", "/ip4/127.0.0.1/tcp/31337/p2p/Qm"])
    assert "--announce-maddrs /ip4/<public ip>/tcp/31337" in hint
    assert private_only_hint(["/ip4/1.1.1.1/tcp/31337/p2p/Qm", "/ip4/10.1.2.3/tcp/31337/p2p/Qm"]) is None
    assert private_only_hint(["/ip4/127.0.0.1/tcp/31337/p2p/Qm"]) is None  # one machine, by choice


def test_the_addresses_a_reachability_check_dials_are_direct_and_loopback_only_on_one_machine():
    from dht.reach import dialable

    peer = "/p2p/12D3KooWDBJV7mB8f5u5TCSzMbmd7PnzRdKEjDKdALJoNXQ5yGbs"
    circuit = f"/ip4/1.1.1.1/tcp/4001{peer}/p2p-circuit{peer}"
    assert dialable([f"/ip4/127.0.0.1/tcp/31337{peer}", f"/ip4/192.168.1.2/tcp/31337{peer}", circuit]) == [
        "/ip4/192.168.1.2/tcp/31337"]  # a checker's loopback is its own; a relay circuit proves nothing direct
    assert dialable([f"/ip4/127.0.0.1/tcp/31337{peer}"]) == ["/ip4/127.0.0.1/tcp/31337"]


async def _pending_for_good(dht, node):
    await asyncio.get_running_loop().create_future()  # nobody else holds it: it never resolves


def test_a_call_that_waits_on_a_dht_process_that_is_gone_names_it_at_once():
    """hivemind's calls that wait for the DHT process's answer (``get``, ``store``, ``run_coroutine``, and through it
    ``peer_id`` and ``get_visible_maddrs``), and its wait for the process to start, waited for good on a process
    that had died: ``python -m dht``, its DHT process killed just as it printed its addresses, hung asking its peer
    id (2 starts in 80 on Python 3.14). A node whose process never started stands for one that died: a DHT process
    SIGKILLed here may hold hivemind's process-wide lock on its results pipe (``MPFuture._update_lock``) for good,
    and every other DHT process of the test run that answers a request waits on it (the module's two nodes did)."""
    node = SwarmDHT(start=False)
    try:
        calls = [lambda: node.get("some-key", latest=True), lambda: node.store("k", 1, get_dht_time() + 9),
                 lambda: node.get_visible_maddrs(latest=True), lambda: node.peer_id, node.wait_until_ready]
        for call in calls:
            with pytest.raises(LinkLost, match="this node's DHT process died"):
                in_a_thread(call).result(timeout=10)  # (hivemind's: a concurrent.futures.TimeoutError here)
        assert isinstance(LinkLost("x"), UserError)  # each command prints it as one line
    finally:
        node.shutdown()


def test_a_fresh_address_list_that_never_comes_gives_the_one_from_start(monkeypatch):
    """hivemind asks the p2p daemon for a node's addresses afresh with no deadline. Once (Python 3.12, under a full
    test run's load) the answer never came: the peer, asking at start for the addresses it prints, waited for good,
    never trained, and could not leave on SIGTERM. A daemon whose fresh answer never comes stands for it: the node
    gives the addresses from its start once ``FRESH_ADDRESSES_SECONDS`` have passed."""
    original = P2P.get_visible_maddrs

    async def never_afresh(self, latest=False):
        if latest:
            await asyncio.get_running_loop().create_future()  # (never resolves)
        return await original(self)

    monkeypatch.setattr(P2P, "get_visible_maddrs", never_afresh)  # the DHT process, forked after this, has it
    monkeypatch.setattr("dht.node.FRESH_ADDRESSES_SECONDS", 1.0)
    node = start_dht(DHTConfig(host_maddrs=(LOOPBACK,)))
    try:
        at_start = node.get_visible_maddrs()
        assert at_start and in_a_thread(lambda: node.get_visible_maddrs(latest=True)).result(timeout=10) == at_start
    finally:
        node.shutdown()


def test_a_request_the_dht_process_drops_reads_as_a_timeout():
    """hivemind keeps no reference to a request's task: garbage-collected while pending, its coroutine is closed,
    and the caller got GeneratorExit (a starting peer exited on one). It gets a TimeoutError, which callers
    handle as a lookup that came late. The collector may run while the DHT process holds hivemind's
    (non-reentrant) lock on its results pipe, so the timeout is set by the event loop after the collection, never
    from inside it: from inside, it froze a peer's DHT process for good."""
    collecting, set_in_collection = [False], []

    class Recorded(concurrent.futures.Future):
        def set_exception(self, exception):
            set_in_collection.append(collecting[0])
            super().set_exception(exception)

    future, dht = Recorded(), types.SimpleNamespace(_node=None, _answering=set())  # (its process is this one)
    dht._answer = functools.partial(SwarmDHT._answer, dht)
    loop = asyncio.new_event_loop()
    try:
        task = loop.create_task(SwarmDHT._run_coroutine(dht, _pending_for_good, future))
        loop.run_until_complete(asyncio.sleep(0))  # the request is now pending on a future nobody else holds
        collecting[0] = True
        del task
        gc.collect()  # "Task was destroyed but it is pending!"
        collecting[0] = False
        loop.run_until_complete(asyncio.sleep(0))
    finally:
        loop.close()
    with pytest.raises(TimeoutError, match="dropped"):
        future.result(timeout=0)
    assert set_in_collection == [False]


async def _collect(dht, node):
    return gc.collect()


def test_a_request_collected_in_a_real_dht_process_answers_its_caller_at_once(two_nodes):
    """The same in a DHT's process: a request's answer goes through its future's own pipe, which the collection
    closed when the future was collected with the request. The timeout went into the closed pipe, and the caller
    waited for good: a peer asking for its addresses at start did (no timeout there). Its future is now held until
    answered."""
    dht = two_nodes[0]
    request = dht.run_coroutine(_pending_for_good, return_future=True)
    deadline = time.monotonic() + 30
    while not request.done() and time.monotonic() < deadline:  # until a collection finds the request pending
        dht.run_coroutine(_collect)
    with pytest.raises(TimeoutError, match="dropped"):
        request.result(timeout=0)


STALL = 1.0  # seconds the test's event loop is held while the other end answers: a process stopped for a moment


def test_a_request_given_up_as_its_reply_comes_leaves_the_daemon_client_working():
    """A DHT process that stalled past a request's timeout while its p2p daemon ran on (SIGSTOPped, or held by a
    long call) gave the request up in the same turn of its loop that it read the reply: hivemind's client set the
    reply on the cancelled call, and the task that reads every unary reply died of InvalidStateError. Every DHT
    request of that process timed out from then on: on Python 3.12 the fault tests' frozen peer (freeze-5) never
    heard from the swarm again and trained alone. A given-up call's reply is now dropped (``drop_late_replies``).

    The other end answers from a thread with its own loop and daemon while this loop is held. A timer then cancels
    the request in the turn of the loop that reads its reply, as 3.12's ``wait_for`` does (3.11's cancelled a turn
    later), and the test asks again."""
    internals.drop_late_replies()
    handled, stalled, stop = threading.Event(), threading.Event(), threading.Event()
    served = concurrent.futures.Future()

    def answer():
        async def echo(request, _context):
            handled.set()
            await asyncio.get_running_loop().run_in_executor(None, stalled.wait, 30)
            return request

        async def main():
            p2p = await P2P.create(host_maddrs=[LOOPBACK])
            await p2p.add_protobuf_handler("echo", echo, dht_pb2.PingRequest)
            served.set_result((p2p.peer_id, await p2p.get_visible_maddrs()))
            await asyncio.get_running_loop().run_in_executor(None, stop.wait, 60)
            await p2p.shutdown()

        asyncio.run(main())

    async def ask():
        peer_id, maddrs = await asyncio.wrap_future(served)
        p2p = await P2P.create(host_maddrs=[LOOPBACK], initial_peers=maddrs)
        try:
            def echo():
                return p2p.call_protobuf_handler(peer_id, "echo", dht_pb2.PingRequest(validate=True),
                                                 dht_pb2.PingRequest)

            given_up = asyncio.ensure_future(echo())
            assert await asyncio.get_running_loop().run_in_executor(None, handled.wait, 30)
            stalled.set()  # the reply is sent while this loop is held
            time.sleep(STALL)
            asyncio.get_running_loop().call_later(0, given_up.cancel)  # in the turn that reads the reply
            with pytest.raises(asyncio.CancelledError):
                await given_up
            return await asyncio.wait_for(echo(), 5)  # a TimeoutError here: the client's reader was dead
        finally:
            await p2p.shutdown()

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    try:
        assert asyncio.run(ask()).validate
    finally:
        stalled.set()
        stop.set()
        thread.join(30)


@pytest.fixture
def daemon_closed():
    """An event set when a daemon client of this process sees its daemon close (``watch_daemon_connection``)."""
    closed = threading.Event()
    internals.watch_daemon_connection(closed.set)
    yield closed
    internals._ON_DAEMON_CLOSED.remove(closed.set)


def test_a_p2p_daemon_that_dies_fails_the_calls_waiting_on_it_at_once(daemon_closed):
    """A p2p daemon killed (by hand, or by the kernel out of memory) ended hivemind's reader without a word, and the
    calls waiting on it waited out their timeouts: the DHT's process, and its peer, went on deaf to the swarm. Now
    they fail at once, and the process is told (the peer leaves, saying why: tests/test_faults.py)."""
    from hivemind.p2p import P2PDaemonError

    async def main():
        server = await P2P.create(host_maddrs=[LOOPBACK])
        caller = await P2P.create(host_maddrs=[LOOPBACK], initial_peers=await server.get_visible_maddrs())
        entered = asyncio.Event()

        async def hang(_request, _context):
            entered.set()
            await asyncio.Event().wait()

        try:
            await server.add_protobuf_handler("hang", hang, dht_pb2.PingRequest)
            call = asyncio.ensure_future(caller.call_protobuf_handler(server.peer_id, "hang", dht_pb2.PingRequest(),
                                                                      dht_pb2.PingRequest))
            await asyncio.wait_for(entered.wait(), 10)
            caller._child.kill()
            with pytest.raises(P2PDaemonError, match="closed its control connection"):
                await asyncio.wait_for(call, 10)  # a TimeoutError here: the call outlived its daemon
        finally:
            await caller.shutdown()
            await server.shutdown()

    asyncio.run(main())
    assert daemon_closed.is_set()


def test_the_daemon_client_reads_on_past_a_message_it_cannot_take(daemon_closed, caplog):
    """Any message hivemind's reader fails on ended it, and with it every reply to come. The daemon's end of the
    connection here is the test's: a message that is not protobuf, then the reply to a call, then the end."""
    from hivemind.p2p import P2PDaemonError
    from hivemind.p2p.p2p_daemon_bindings.control import ControlClient
    from hivemind.p2p.p2p_daemon_bindings.utils import read_pbmsg_safe, write_pbmsg
    from hivemind.proto import p2pd_pb2

    async def main():
        ours, theirs = socket.socketpair()
        daemon_reader, daemon_writer = await asyncio.open_connection(sock=theirs)

        class Connector:
            async def open_persistent_connection(self):
                return await asyncio.open_connection(sock=ours)

        client = await ControlClient.create(Connector())
        peer = PeerID(b"\x00\x01")

        async def take_call() -> p2pd_pb2.PersistentConnectionRequest:
            request = p2pd_pb2.PersistentConnectionRequest()
            await read_pbmsg_safe(daemon_reader, request)
            return request

        daemon_writer.write(b"\x03\xff\xff\xff")  # three bytes that parse as no message
        answered = asyncio.ensure_future(client.call_unary_handler(peer, "echo", b"ping"))
        request = await asyncio.wait_for(take_call(), 5)
        await write_pbmsg(daemon_writer, p2pd_pb2.PersistentConnectionResponse(
            callId=request.callId, callUnaryResponse=p2pd_pb2.CallUnaryResponse(response=request.callUnary.data)))
        assert await asyncio.wait_for(answered, 5) == b"ping"  # a TimeoutError here: the reader had died

        waiting = asyncio.ensure_future(client.call_unary_handler(peer, "echo", b"again"))
        await asyncio.wait_for(take_call(), 5)
        daemon_writer.close()
        with pytest.raises(P2PDaemonError, match="closed its control connection"):
            await asyncio.wait_for(waiting, 5)
        client.close()

    asyncio.run(main())
    assert "could not take a message from its daemon" in caplog.text
    assert daemon_closed.is_set()


def test_a_node_checks_each_record_once_and_a_bad_one_every_time():
    """Every lookup reply carries a run's whole dictionary of records, and checking each again in every reply was
    79% of a DHT process's CPU with 16 peers."""
    from hivemind.dht.validation import DHTRecord, RecordValidatorBase

    from dht.validation import RememberingValidator

    class Counting(RecordValidatorBase):
        checked = []

        def validate(self, record):
            self.checked.append(record)
            return record.value != b"forged"

    validator = RememberingValidator([Counting()], size=2)
    first, again, forged = (DHTRecord(b"k", b"s", value, 100.0) for value in (b"v1", b"v1", b"forged"))
    assert validator.validate(first) and validator.validate(again) and len(Counting.checked) == 1
    assert not validator.validate(forged) and not validator.validate(forged) and len(Counting.checked) == 3
    renewed = DHTRecord(b"k", b"s", b"v1", 102.0)  # a heartbeat: the same value, a new expiration, checked anew
    assert validator.validate(renewed) and len(Counting.checked) == 4
    assert validator.validate(DHTRecord(b"k", b"s", b"v2", 100.0)) and first not in validator.passed  # bounded


def test_validators_added_later_join_the_remembered_ones_and_a_record_is_signed_once():
    # hivemind.Optimizer adds its own signature validator to the DHT (``DHT.add_validators``); beside ours it signed
    # every progress record twice, no record passed, and its peers never found each other (bench.head_to_head)
    from hivemind.dht.crypto import RSASignatureValidator
    from hivemind.dht.validation import CompositeValidator, DHTRecord

    from dht.validation import RememberingValidator, signer

    ours = RSASignatureValidator()
    node = CompositeValidator([RememberingValidator([signer()])])  # as start_dht builds a node's validators
    node.extend([RSASignatureValidator()])
    record = DHTRecord(b"progress", ours.local_public_key, b"value", get_dht_time() + 60)
    signed = dataclasses.replace(record, value=node.sign_value(record))
    assert signed.value.count(b"[signature:") == 1 and node.validate(signed)
    assert node.strip_value(signed) == b"value"


def test_a_made_up_identity_leaves_no_file_behind_even_when_its_peer_is_killed(tmp_path):
    # a peer that names no --identity-path and keeps no checkpoint gets a throwaway key file; it goes once the peer's
    # DHT node runs for good: a SIGKILLed peer runs no exit handler (benchmarks and tests left one per kill in /tmp)
    script = ("import os, signal, sys; "
              "from dht.node import LOOPBACK, DHTConfig, discard_made_up_identity, signing_identity, start_dht; "
              "config, fresh = signing_identity(DHTConfig(host_maddrs=(LOOPBACK,))); "
              "print(config.identity_path, fresh, os.path.exists(config.identity_path), flush=True); "
              "dht = start_dht(config, check_identity=False); print(dht.peer_id, flush=True); "
              "discard_made_up_identity(config); os.killpg(0, signal.SIGKILL)")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                            cwd=ROOT, start_new_session=True)
    lines = result.stdout.split("\n")
    path, fresh, existed = lines[0].split()
    assert (fresh, existed) == ("True", "True") and lines[1].startswith("Qm"), result.stdout + result.stderr[-2000:]
    assert result.returncode == -signal.SIGKILL and not os.path.exists(os.path.dirname(path))
