"""Using the model a run makes: it leaves the swarm as a Hugging Face model, and samples.

- ``export.py``    ``python -m peer export``: G of a checkpoint's epoch, or of the swarm now, as a model directory
- ``generate.py``  ``python -m peer generate``: a prompt's continuation, from that directory or a checkpoint
"""
