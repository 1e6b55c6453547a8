"""All-reduce deadlines follow measured times: a frozen groupmate costs seconds, not the configured minute."""

from peer.swarm.deadlines import Deadlines


def test_ceiling_until_something_is_measured_then_a_multiple_of_the_median_with_a_floor():
    deadlines = Deadlines(ceiling=60, floor=5, factor=3, part_ceiling=15)
    assert deadlines.allreduce() == 60 and deadlines.part() == 15
    for seconds in (0.5, 0.7, 0.6):
        deadlines.observe(seconds)
    assert deadlines.allreduce() == 5  # 3 x 0.6 is below the floor
    for seconds in (4.0, 4.0, 4.0, 4.0):
        deadlines.observe(seconds)
    assert deadlines.allreduce() == 12 and deadlines.part() == 12
    for seconds in [100.0] * 8:  # the window forgets old rounds; the ceiling still holds
        deadlines.observe(seconds)
    assert deadlines.allreduce() == 60 and deadlines.part() == 15


def test_a_round_that_moves_twice_the_bytes_gets_twice_the_time():
    deadlines = Deadlines(ceiling=60, floor=1, factor=3, part_ceiling=60)
    deadlines.observe(2.0)             # a pseudo-gradient alone
    deadlines.observe(4.0, size=2)     # with the inner first moment: the same speed per byte
    assert deadlines.allreduce() == 6 and deadlines.allreduce(size=2) == 12 and deadlines.part(size=2) == 12
