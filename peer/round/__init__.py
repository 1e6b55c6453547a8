"""The node and its rounds: build the parts, train, sync, report, checkpoint.

- ``decide.py``     the round's decisions as one pure function over a typed view: ``decide(view) -> Action``
- ``outcomes.py``   how a sync ended (``Outcome``), and the line it says about it
- ``sync.py``       ``Synchronizer``: one round's sync, acting on those decisions (attempt, average, apply)
- ``meeting.py``    when a sync meets its group: the planned meeting, the window past it, the waits around it
- ``outer.py``      ``OuterStep``: this peer's side of the outer step (the delta it sends, the step it applies)
- ``cross.py``      ``Crossing``: a round of many groups past our group's all-reduce (cross as delegate, receive)
- ``catchup.py``    adopting a better state: download, hash check, rebase; settling; handing over on leaving
- ``announce.py``   our record: our state and what we say (schedule, status, the state we download)
- ``transport.py``  what a round needs from the network, and its real implementation over hivemind
- ``schedule.py``   ``RoundClock``: when a round ends (the group's agreed length, or the swarm's plans)
- ``inflight.py``   a round's sync in flight, here or in the background (overlap)
- ``metrics.py``    a round's metrics record
- ``build.py``      every part of a node, built from its configs with its collaborators passed in
- ``manifest.py``   which run a node joins: its checkpoint's or its flags' manifest against the swarm's
- ``node.py``       ``Peer``: the round loop, reports, leaving
- ``checkpoints.py`` when a node checkpoints, its snapshot, and whether it is copied or written in place
- ``stopping.py``   Ctrl+C and SIGTERM: leave after the step; a watch thread leaves for a training thread stuck in C
"""
