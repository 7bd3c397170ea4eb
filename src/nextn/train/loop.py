"""The training loop shared by the draft-head trainers: Adam with a linear decay, a progress bar with the loss and
per-head held-out top-1 accuracy, deterministic batches under a seed, resumable checkpoints and a time budget.

Resuming: every `checkpoint_every_s` seconds (and when the budget runs out) the loop writes its whole state —
parameters, Adam moments, the schedule, the batch generator's state, the step — atomically to `state_path`,
tagged with `run_key` (the settings that must match). A later call with the same `state_path` and `run_key`
continues from it, and ends bit-identical to a run that was never interrupted (same thread count).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from nextn.progress import progress_bar

logger = logging.getLogger(__name__)


@dataclass
class FitResult:
    """loss: the last step's; top1: final held-out top-1 per head; steps_done: optimizer steps taken in all;
    complete: all `steps` ran (False when the time budget stopped it: resume with the same command);
    resumed_from: the step a checkpoint resumed from (0: a fresh start)."""

    loss: float
    top1: list[float]
    steps_done: int
    complete: bool
    resumed_from: int


def fit(params: Iterable[torch.nn.Parameter], loss_fn: Callable[[torch.Tensor], torch.Tensor],
        top1_fn: Callable[[], list[float]], num_rows: int, steps: int, *, batch: int, lr: float, seed: int,
        progress: bool, eval_every: int, desc: str, warmup: int = 0, max_grad_norm: float | None = None,
        top1_start: list[float] | None = None, state_path: str | Path | None = None, run_key: str = "",
        deadline: float | None = None, checkpoint_every_s: float = 120.0, bf16: bool = False) -> FitResult:
    """Run `steps` Adam steps of `loss_fn(rows)` over random batches of `batch` row indices in [0, num_rows).

    Args:
        loss_fn: the mean loss of a batch, given its row indices [batch] int64.
        top1_fn: held-out per-head top-1 accuracy (shown in the bar every `eval_every` steps).
        warmup: steps of linear warm-up before the linear decay (0: decay only).
        max_grad_norm: clip the gradient norm to this (None: no clipping).
        top1_start: top-1 before training when the caller has it (else measured).
        state_path: the resumable checkpoint (None: none); resumed from when it exists with the same `run_key`.
        deadline: `time.perf_counter()` value after which no new step starts (None: no budget).
        bf16: run the loss under CPU bfloat16 autocast (matmuls in bf16, parameters and Adam in float32).
    """
    gen = torch.Generator().manual_seed(seed)
    params = list(params)
    optimizer = torch.optim.Adam(params, lr=lr)
    decay = (lambda s: 1 - s / max(steps, 1)) if not warmup else \
        (lambda s: min((s + 1) / warmup, 1 - s / max(steps, 1)))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, decay)
    state_path = Path(state_path) if state_path is not None else None
    start_step, loss_value = 0, float("nan")
    if state_path is not None and state_path.is_file():
        state = torch.load(state_path, weights_only=True)
        if state["run_key"] == run_key and state["steps"] == steps:
            with torch.no_grad():
                for p, saved in zip(params, state["params"], strict=True):
                    p.copy_(saved)
            optimizer.load_state_dict(state["optimizer"])
            schedule.load_state_dict(state["schedule"])
            gen.set_state(state["generator"])
            start_step, loss_value = state["step"], state["loss"]
            logger.warning("resuming %s from step %d of %d (%s)", desc, start_step, steps, state_path)
        else:
            logger.warning("ignoring %s: it was written for other settings", state_path)

    def save(step: int) -> None:
        if state_path is None:
            return
        tmp = state_path.with_suffix(".tmp")
        torch.save({"run_key": run_key, "steps": steps, "step": step, "loss": loss_value,
                    "params": [p.detach().clone() for p in params], "optimizer": optimizer.state_dict(),
                    "schedule": schedule.state_dict(), "generator": gen.get_state()}, tmp)
        tmp.replace(state_path)

    top1 = top1_start if top1_start is not None else top1_fn()
    bar = progress_bar(range(start_step, steps), enabled=progress, desc=desc, initial=start_step, total=steps)
    last_save, step = time.perf_counter(), start_step
    for step in bar:
        if deadline is not None and time.perf_counter() > deadline:
            save(step)
            bar.close()
            logger.warning("%s: the time budget ran out at step %d of %d; the checkpoint %s resumes it", desc, step,
                           steps, state_path)
            return FitResult(loss_value, top1_fn(), step, False, start_step)
        pick = torch.randint(0, num_rows, (min(batch, num_rows),), generator=gen)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = loss_fn(pick)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
        optimizer.step()
        schedule.step()
        loss_value = loss.item()
        if progress and ((step + 1) % eval_every == 0 or step + 1 == steps):
            top1 = top1_fn()
        bar.set_postfix(loss=f"{loss_value:.3f}", top1="/".join(f"{a:.2f}" for a in top1), refresh=False)
        if state_path is not None and time.perf_counter() - last_save > checkpoint_every_s and step + 1 < steps:
            save(step + 1)
            last_save = time.perf_counter()
    bar.close()
    if state_path is not None:
        save(steps)
    return FitResult(loss_value, top1_fn(), steps, True, start_step)
