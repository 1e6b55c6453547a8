"""Which peers an averager is streaming with, so that an unanswered ping leaves their connections open."""

from peer.averaging.inuse import InUse


def test_a_peer_is_in_use_while_any_of_its_streams_is_open():
    in_use = InUse()
    with in_use.streaming(["a", "b", "c"]):  # an all-reduce with a, b and c
        with in_use.streaming(["b"]):  # b downloads a round's result from us meanwhile
            assert in_use.peers() == {"a", "b", "c"}
        assert in_use.peers() == {"a", "b", "c"}
        with in_use.streaming(["d"]):
            assert in_use.peers() == {"a", "b", "c", "d"}
    assert in_use.peers() == set()


def test_a_stream_that_fails_still_releases_its_peer():
    in_use = InUse()
    try:
        with in_use.streaming(["a"]):
            raise ConnectionResetError
    except ConnectionResetError:
        pass
    assert in_use.peers() == set()
