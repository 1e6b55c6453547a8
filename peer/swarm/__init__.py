"""How a peer reads the swarm: pure functions over the peers' DHT records and the group's gathered metadata.

- ``consensus.py``  responsiveness, fork choice, the expected group, voters and the majority rule
- ``metadata.py``   the typed group metadata every member reads alike (``Contribution``), and ``Averaged``
- ``grouping.py``   rounds of many groups: the plan, each group's delegate, what a formed group admits
- ``failures.py``   one exception type per way an averaging attempt fails (what the round decides on)
- ``timing.py``     when rounds end: the group's agreed length, the round in progress, the swarm's plans
- ``deadlines.py``  all-reduce deadlines that follow measured round times
- ``records.py``    the record cache: the swarm as last read, kept across a failed read
- ``clock.py``      time as the round reads it (monotonic, DHT time, sleep), so tests can fake it
"""
