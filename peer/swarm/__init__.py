"""How a peer reads the swarm: pure functions over the peers' DHT records and the group's gathered metadata.

- ``consensus.py``  responsiveness, fork choice, the expected group, voters and the majority rule
- ``deadlines.py``  all-reduce deadlines that follow measured round times
"""
