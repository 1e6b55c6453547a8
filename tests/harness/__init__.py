"""The test harness that tests and benchmarks share: real swarms, and the hooks that strike or corrupt a peer.

- ``swarm.py``         ``Swarm``: a bootstrap node and real ``python -m peer`` processes, reaped on close
- ``__main__.py``      ``python -m tests.harness``: a real peer run with the harness's hooks
- ``faults.py``        fault plans as data: kill, die, stop (Ctrl+C), freeze, slow, partition at a phase of a round
- ``misbehaviour.py``  a byzantine peer: NaN or scaled pseudo-gradients
- ``fake.py``          an in-process transport and clock for the round's decisions
- ``dial.py``          a DHT node that dials on request (network namespace tests)
"""
