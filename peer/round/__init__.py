"""The node and its rounds: build the parts, train, sync, report, checkpoint.

- ``node.py``      ``Peer``: builds the parts and runs the round loop
- ``sync.py``      one round's sync: catch up, average, apply
- ``schedule.py``  when a round ends: the group's agreed length, or the swarm's published plans
"""
