"""The inner optimizer (peer/train/optim.py): torch's AdamW bit for bit, without importing torch._dynamo."""

import subprocess
import sys

import torch

from peer.train.optim import EagerAdamW


def _pair(seed: int = 0):
    torch.manual_seed(seed)
    ours, theirs = torch.nn.Linear(16, 8), torch.nn.Linear(16, 8)
    theirs.load_state_dict(ours.state_dict())
    kwargs = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    return (ours, EagerAdamW(ours.parameters(), **kwargs)), (theirs, torch.optim.AdamW(theirs.parameters(), **kwargs))


def _steps(pairs, count: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for _ in range(count):
        batch = torch.randn(4, 16, generator=generator)
        for model, optimizer in pairs:
            model(batch).pow(2).sum().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)


def test_eager_adamw_takes_torchs_steps_bit_for_bit_and_shares_its_state_dict():
    """The same steps as torch.optim.AdamW, to the bit; a state dict of one loads into the other (a checkpoint of
    an older peer resumes, and the reverse), and the steps after the swap still agree."""
    ours, theirs = _pair()
    _steps([ours, theirs], 5, seed=1)
    assert all(torch.equal(p, q) for p, q in zip(ours[0].parameters(), theirs[0].parameters()))
    ours_state, theirs_state = ours[1].state_dict(), theirs[1].state_dict()
    assert ours_state["param_groups"] == theirs_state["param_groups"]
    assert all(torch.equal(ours_state["state"][0][k], theirs_state["state"][0][k]) for k in ("exp_avg", "exp_avg_sq"))
    ours[1].load_state_dict(theirs_state)
    theirs[1].load_state_dict(ours_state)
    _steps([ours, theirs], 3, seed=2)
    assert all(torch.equal(p, q) for p, q in zip(ours[0].parameters(), theirs[0].parameters()))


def test_a_trainers_start_step_and_checkpoint_never_import_torch_dynamo():
    """What a restart does before its first step (the trainer built, AdamW's state restored) and what a round does
    after it (steps, a state dict for the checkpoint) leave torch._dynamo unimported: its import took 1.1 s of a
    3.3-s restart (bench/results/startup.md). In a fresh interpreter: this one may hold it already."""
    script = (
        "import sys, torch\n"
        "from peer.config import RunConfig\n"
        "from peer.train.inner import InnerTrainer\n"
        "from peer.train.model import build_model\n"
        "run = RunConfig(model='micro', seq_len=16, batch_size=2).resolved()\n"
        "trainer = InnerTrainer(build_model('micro', 256, 16, seed=0), run, torch.device('cpu'))\n"
        "batches = iter(lambda: torch.randint(0, 256, (2, 16)), None)\n"
        "trainer.train(batches, 2, 0)\n"
        "trainer.optimizer.load_state_dict(trainer.optimizer.state_dict())\n"
        "trainer.train(batches, 1, 2)\n"
        "print(sorted(m for m in sys.modules if m.startswith('torch._dynamo')))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]", done.stdout
