"""The swarm layer on real hivemind DHT nodes on loopback: manifests, records, startup errors."""

import socket

import pytest

from dht.errors import UserError
from dht.manifest import RunManifest, fetch_manifest, join_or_create, manifest_key, publish_manifest
from dht.node import LOOPBACK, DHTConfig, start_dht
from dht.records import PeerRecord, RecordPublisher, fetch_records
from tests.swarm import wait_until


@pytest.fixture(scope="module")
def two_nodes():
    first = start_dht(DHTConfig(host_maddrs=(LOOPBACK,)))
    second = start_dht(DHTConfig(host_maddrs=(LOOPBACK,),
                                 initial_peers=tuple(str(m) for m in first.get_visible_maddrs())))
    yield first, second
    second.shutdown()
    first.shutdown()


def test_manifest_is_shared_and_first_one_wins(two_nodes):
    first, second = two_nodes
    ours = RunManifest("run-a", {"model": "tiny", "lr": 0.001})
    assert join_or_create(first, ours) == ours
    theirs = RunManifest("run-a", {"model": "small"})
    assert join_or_create(second, theirs) == ours  # a joiner adopts the existing run
    assert fetch_manifest(second, "run-b") is None


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
    publisher = RecordPublisher(first, "run-e")
    for epoch in range(3):
        # the ttl shrinks, yet each new record must still replace the last one
        publisher.publish(PeerRecord("peer-1", epoch, f"h{epoch}", 10 * epoch, "m"), ttl=60 - 20 * epoch)
    # stores run in the background: wait for the last one to land
    def newest():
        records = fetch_records(second, "run-e") or {}
        return "peer-1" in records and records["peer-1"].epoch == 2 and records

    assert list(wait_until(newest, 10, "the newest record to reach the other node")) == ["peer-1"]


def test_port_in_use_is_a_user_error():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        maddr = f"/ip4/127.0.0.1/tcp/{taken.getsockname()[1]}"
        with pytest.raises(UserError, match="the port is already in use; pick a free port or use tcp/0"):
            start_dht(DHTConfig(host_maddrs=(maddr,)))
