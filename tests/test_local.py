"""The local model as the sync phase sees it: with overlap, changes to theta keep the steps taken since."""

import threading
from types import SimpleNamespace

import torch

from peer.train.flat import FlatLayout
from peer.train.local import LocalModel


def make(values):
    params = [torch.nn.Parameter(torch.tensor(values[:2])), torch.nn.Parameter(torch.tensor(values[2:]))]
    trainer = SimpleNamespace(params=params, step_lock=threading.Lock(), changed=False,
                              first_moments=lambda: [torch.full_like(p, 7.0) for p in params])
    trainer.touch = lambda: setattr(trainer, "changed", True)  # an island's rank 0 then re-sends its model
    return LocalModel(trainer, FlatLayout(params)), params


def flat(params):
    return torch.cat([p.detach().reshape(-1) for p in params])


def test_without_overlap_the_sync_reads_and_sets_the_live_parameters():
    local, params = make([1.0, 2.0, 3.0, 4.0])
    assert torch.equal(local.gather(torch.empty(4)), torch.tensor([1.0, 2.0, 3.0, 4.0]))
    local.set(torch.tensor([5.0, 5.0, 5.0, 5.0]))
    assert torch.equal(flat(params), torch.tensor([5.0, 5.0, 5.0, 5.0]))
    assert local.trainer.changed, "a write from the sync must be marked, so an island's ranks receive it"


def test_with_overlap_the_sync_sees_theta_e_and_the_outer_update_keeps_the_new_steps():
    local, params = make([1.0, 2.0, 3.0, 4.0])
    local.freeze(with_moments=True)
    with torch.no_grad():  # round e+1 trains on while its sync runs
        for p in params:
            p.sub_(0.25)
    assert torch.equal(local.gather(torch.empty(4)), torch.tensor([1.0, 2.0, 3.0, 4.0]))  # theta_e
    assert torch.equal(local.gather_moments(torch.empty(4)), torch.full((4,), 7.0))
    local.set(torch.tensor([10.0, 10.0, 10.0, 10.0]))  # the outer step lands: theta <- G' - (steps since)
    assert torch.equal(flat(params), torch.tensor([9.75, 9.75, 9.75, 9.75]))
    assert torch.equal(local.gather(torch.empty(4)), torch.tensor([10.0, 10.0, 10.0, 10.0]))
    local.thaw()

    local.freeze(with_moments=False)  # eager: the next round starts from the proxy outer step instead
    local.start(torch.tensor([20.0, 20.0, 20.0, 20.0]))
    with torch.no_grad():
        for p in params:
            p.sub_(0.5)
    local.shift(torch.tensor([1.0, 0.0, 0.0, -1.0]))  # a rebase moves theta_e, the proxy and the live model
    assert torch.equal(local.gather(torch.empty(4)), torch.tensor([10.75, 9.75, 9.75, 8.75]))  # theta_e + shift
    local.set(torch.tensor([21.0, 21.0, 21.0, 21.0]))  # the real step supersedes both: G' plus the work since
    assert torch.equal(flat(params), torch.tensor([20.5, 20.5, 20.5, 20.5]))
    local.thaw()
    assert torch.equal(local.gather(torch.empty(4)), flat(params))


def test_a_sync_that_took_no_outer_step_takes_the_eager_step_back_out():
    """Caught up (a rebase shift) or no group: the round's work is kept, the eager proxy step is undone."""
    local, params = make([1.0, 2.0, 3.0, 4.0])
    local.freeze(with_moments=False)
    local.start(torch.tensor([8.0, 9.0, 10.0, 11.0]))  # the eager step moved theta by +7
    with torch.no_grad():
        for p in params:
            p.sub_(0.5)  # the next round's work so far
    local.shift(torch.tensor([100.0, 100.0, 100.0, 100.0]))  # caught up: a rebase onto a state 100 away
    local.thaw()
    assert torch.equal(flat(params), torch.tensor([100.5, 101.5, 102.5, 103.5]))  # theta_e + shift + work


def test_a_checkpoint_between_a_syncs_end_and_thaw_saves_theta_as_thaw_leaves_it():
    local, params = make([1.0, 2.0, 3.0, 4.0])
    local.freeze(with_moments=False)
    local.start(torch.tensor([20.0, 20.0, 20.0, 20.0]))  # the eager step
    with torch.no_grad():
        for p in params:
            p.sub_(0.5)
    settled = local.settled(torch.empty(4))  # the sync took no outer step: the eager step comes back out
    local.thaw()
    assert torch.equal(settled, flat(params)) and torch.equal(settled, torch.tensor([0.5, 1.5, 2.5, 3.5]))

