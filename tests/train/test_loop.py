"""The shared training loop (`train/loop.py`): a run stopped by its time budget and resumed from its checkpoint ends
bit-identical to an uninterrupted run; a checkpoint of other settings is ignored; a finished run reruns instantly."""

from __future__ import annotations

import time

import torch

from nextn.train.loop import fit

STEPS = 30


def _problem():
    """A seeded least-squares fit: rows of x [64, 8] → y [64], one linear layer."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(64, 8, generator=g), torch.randn(8, generator=g)
    torch.manual_seed(1)
    model = torch.nn.Linear(8, 1)
    loss_fn = lambda rows: ((model(x[rows]).squeeze(-1) - x[rows] @ w) ** 2).mean()  # noqa: E731
    top1_fn = lambda: [0.0]  # noqa: E731
    return model, loss_fn, top1_fn


def _fit(state_path=None, deadline=None, run_key="a"):
    model, loss_fn, top1_fn = _problem()
    r = fit(model.parameters(), loss_fn, top1_fn, 64, STEPS, batch=8, lr=0.05, seed=2, progress=False,
            eval_every=10, desc="toy", state_path=state_path, run_key=run_key, deadline=deadline,
            checkpoint_every_s=0.0)
    return r, model.state_dict()


def test_budget_stop_then_resume_equals_an_uninterrupted_run(tmp_path):
    full, want = _fit()
    assert full.complete and full.steps_done == STEPS and full.resumed_from == 0
    state = tmp_path / "state.pt"
    stopped, _ = _fit(state, deadline=time.perf_counter() - 1)  # the budget is already spent
    assert not stopped.complete and stopped.steps_done == 0 and state.is_file()
    model, loss_fn, top1_fn = _problem()
    calls = []

    def counting(rows):
        calls.append(1)
        if len(calls) == 12:  # interrupt mid-run: the last checkpoint is after step 11
            raise KeyboardInterrupt
        return loss_fn(rows)

    try:
        fit(model.parameters(), counting, top1_fn, 64, STEPS, batch=8, lr=0.05, seed=2, progress=False,
            eval_every=10, desc="toy", state_path=state, run_key="a", checkpoint_every_s=0.0)
    except KeyboardInterrupt:
        pass
    assert torch.load(state, weights_only=True)["step"] == 11
    resumed, got = _fit(state)
    assert resumed.complete and resumed.resumed_from == 11 and resumed.loss == full.loss
    assert all(torch.equal(want[k], got[k]) for k in want)
    again, got_again = _fit(state)  # finished: nothing left to run
    assert again.resumed_from == STEPS and all(torch.equal(want[k], got_again[k]) for k in want)


def test_a_checkpoint_of_other_settings_is_ignored(tmp_path):
    state = tmp_path / "state.pt"
    _fit(state, run_key="other")
    r, got = _fit(state, run_key="a")
    _, want = _fit()
    assert r.resumed_from == 0 and all(torch.equal(want[k], got[k]) for k in want)
