"""Pacing a peer's sends (--max-upload): the pacer's clock in-process, the framing over a real socket, and a real
two-peer round that never sends faster than its rate."""

import asyncio

import pytest
from hivemind.p2p import P2P

from dht import internals
from peer.averaging.pacing import Pacer


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_pacer_spaces_bulk_at_its_rate_and_gives_no_credit_for_an_idle_link():
    clock = FakeClock()
    pacer = Pacer(1000.0, clock)  # bytes a second
    assert pacer.reserve(500) == 0.0  # an idle link: at once
    assert pacer.reserve(500) == pytest.approx(0.5)  # after the first 500 bytes left
    assert pacer.reserve(1000) == pytest.approx(1.0)
    clock.now += 0.25  # a quarter second later, 1.75 s of bytes are still ahead
    assert pacer.reserve(10) == pytest.approx(1.75)
    clock.now += 60  # idle for a minute: the next send goes at once, and the one after it waits its turn
    assert pacer.reserve(2000) == 0.0
    assert pacer.reserve(1) == pytest.approx(2.0)
    assert Pacer.from_mbit(8.0).rate == 1e6
    with pytest.raises(ValueError, match="positive"):
        Pacer(0.0)


def test_a_paced_bulk_message_goes_in_booked_pieces_and_a_small_one_at_once_both_framed_as_hivemind_reads_them():
    """Through a real loopback socket: a bulk message is written in pieces, each booked with the pacer before it is
    written; a control message is booked but not held back; hivemind's reader gets both whole."""
    booked, counted = [], []
    send, receive = P2P.send_raw_data, P2P.receive_raw_data
    internals.meter_streams(counted.append, lambda size: None, pace=lambda size: booked.append(size) or 0.0,
                            chunk=1000, small=100)
    try:
        async def exchange():
            got = []

            async def serve(reader, writer):
                got.append(await P2P.receive_raw_data(reader))
                got.append(await P2P.receive_raw_data(reader))
                writer.close()

            server = await asyncio.start_server(serve, "127.0.0.1", 0)
            port = server.sockets[0].getsockname()[1]
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            bulk, control = bytes(range(256)) * 10, b"matchmaking"  # 2560 bytes, 11 bytes
            await P2P.send_raw_data(bulk, writer)
            await P2P.send_raw_data(control, writer)
            await reader.read()  # the server closed: it read both
            writer.close()
            server.close()
            return got, bulk, control

        got, bulk, control = asyncio.run(exchange())
    finally:
        P2P.send_raw_data, P2P.receive_raw_data = staticmethod(send), staticmethod(receive)
    overhead = 1 + P2P.HEADER_LEN
    assert got == [bulk, control]
    assert booked == [1000 + overhead, 1000, 560, len(control) + overhead]  # three pieces, then the control message
    assert counted == [len(bulk) + overhead, len(control) + overhead]  # the metering is unchanged


@pytest.mark.slow
def test_a_peer_with_max_upload_never_sends_a_round_faster_than_its_rate(tmp_path):
    """Two real peers at --max-upload 0.5 (Mbit/s): every round's all-reduce (a third of a MB each way: fp16 halves
    of the micro model, sent and returned) takes at least its bytes at that rate, about 5 s where unpaced loopback
    takes a tenth of one, and the peers still agree on every round."""
    from tests.harness.swarm import Swarm, assert_all_leave, assert_groups_agree, wait_until

    rate = 0.5e6 / 8  # bytes a second
    swarm = Swarm(tmp_path)
    try:
        # rounds of 8 s of compute, so that a round's 5-s paced all-reduce fits between them as on a real uplink
        flags = ("--max-upload", "0.5", "--part-timeout", "20", "--inner-steps", "10", "--min-step-seconds", "0.8")
        peers = [swarm.peer(f"p{i}", *flags) for i in range(2)]
        wait_until(lambda: all(p.reached(lambda m: sum(r["applied"] and r["group_size"] == 2 for r in m) >= 3)
                               for p in peers), 240, "3 paced rounds of two")
        assert_all_leave(peers, 60)
    finally:
        swarm.close()
    assert assert_groups_agree(peers) >= 3
    for peer in peers:
        for record in peer.metrics:
            if record["applied"] and record["group_size"] == 2:
                # the first 16 KiB piece of an idle link leaves at once, and control messages are not held back
                paced = record["bytes_sent"] - 16 * 1024 - 8 * 1024
                assert record["sync_wall_seconds"] >= paced / rate, (record["bytes_sent"], record["sync_wall_seconds"])


def test_the_socket_queue_hint_names_the_sysctl_only_where_queues_are_unbounded(tmp_path):
    from peer.averaging.pacing import LOWAT_BYTES, socket_queue_hint

    setting = tmp_path / "tcp_notsent_lowat"
    setting.write_text("4294967295\n")  # Linux's default: no bound
    hint = socket_queue_hint(str(setting))
    assert f"sysctl -w net.ipv4.tcp_notsent_lowat={LOWAT_BYTES}" in hint and "\n" not in hint
    setting.write_text(f"{LOWAT_BYTES}\n")
    assert socket_queue_hint(str(setting)) is None  # set already
    assert socket_queue_hint(str(tmp_path / "absent")) is None  # not Linux
