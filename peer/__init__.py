"""The training node. ``python -m peer`` runs one; see README.md.

- ``__main__.py``   parse, build, run, close
- ``config.py``     RunConfig (the run manifest), NodeConfig, SyncConfig; the CLI is derived from them
- ``node.py``       ``Peer``: builds the parts below and runs the round loop
- ``model.py``      Llama presets built from transformers configs (tiny, small, 150m, 1b)
- ``data.py``       tokenizers, bundled/local/streamed text, held-out split, per-peer order
- ``inner.py``      the inner AdamW loop (warmup + cosine, clipping, accumulation, bf16 on GPU)
- ``island.py``     a multi-process peer under torchrun: DDP inside, rank 0 speaks for the island
- ``flat.py``       flat fp32 CPU vectors for G, m, pseudo-gradients and moments (pinned copies from GPUs)
- ``outer.py``      GlobalState, its hash, the FMA-free Nesterov outer step
- ``consensus.py``  fork choice, expected group, responsiveness, the swarm's schedule (over records)
- ``liveness.py``   whether an expected peer can be reached now (every dial refused or in backoff: not waited for)
- ``sync.py``       one round's sync: catch up, average, apply
- ``deadlines.py``  all-reduce deadlines that follow measured round times
- ``contributions.py`` own recent deltas, re-contributed after losing a fork
- ``schedule.py``   when a round ends: the group's agreed length, or the swarm's published plans
- ``averager.py``   hivemind DecentralizedAverager subclass: round keys, exact all-reduce, sliced
                    state download from several donors
- ``allreduce.py``  the exact butterfly all-reduce (bit-identical results or a clean failure)
- ``checkpoint.py`` atomic checkpoints
- ``report.py``     progress bar, round summary, metrics JSON lines
- ``faults.py``     fault plans for tests: kill, freeze, slow, partition at six phases of a round
"""
