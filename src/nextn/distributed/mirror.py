"""Rank 0 drives, the other ranks mirror: one engine's step on several processes.

Rank 0 owns everything on the host — requests, the scheduler, the prefix cache, the draft-length policy — exactly
as with one process. Each `ModelRunner.launch` on rank 0 first broadcasts the step's `StepPlan` (the scheduler's
data-only per-step output, runtime/step_plan.py: per row the batch slot, block table, sampling parameters, seed, KV
length and the tokens the step needs) with whether it continues from the step before, over the gloo control group.
Every other rank (`serve_steps`) calls its own runner's `launch` with the same plan, so each rank runs the same step
function on its share of the model, its own KV cache (its KV heads) and its own copy of the drafter's per-request
state; the model's collectives (all-reduce, logits all-gather) meet inside the step. Since the gathered logits are
the same on every rank, so are the accepted tokens and drafts: the workers' device state stays in step without ever
being read back. With the overlap scheduler a worker keeps its own previous step on its device for the rows whose
inputs come from it (model_runner.py), as rank 0 does. (TensorRT-LLM's LLM API: rank 0's executor broadcasts each
iteration's requests to the MPI workers; vLLM's `broadcast_tensor_dict` of the step inputs.)

What rank 0 decides from timing (the adaptive draft length) or from randomness (seeds) reaches the workers as
values in the plan, so they never diverge.
"""

from __future__ import annotations

import logging

from nextn.distributed.comm import Communicator
from nextn.runtime.engine import Engine
from nextn.runtime.step_plan import StepPlan

logger = logging.getLogger(__name__)


#: Sent instead of a plan when rank 0's engine shuts down.
SHUTDOWN = "shutdown"


class PlanBroadcaster:
    """Rank 0's `ModelRunner.on_launch`: broadcast each launch's plan; `shutdown` releases the workers."""

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm
        self.closed = False

    def __call__(self, plan: StepPlan, from_previous: bool) -> None:
        self.comm.broadcast_object((plan, from_previous))

    def shutdown(self) -> None:
        if not self.closed:
            self.closed = True
            self.comm.broadcast_object(SHUTDOWN)


def serve_steps(engine: Engine, comm: Communicator) -> int:
    """A worker rank's loop: launch every step rank 0 plans, until it sends `SHUTDOWN`.

    Args:
        engine: this rank's `Engine` (its scheduler unused).
    Returns:
        The number of steps run.
    Raises:
        RankFailure: rank 0 died or stopped answering (a broadcast or a collective inside the step failed).
    """
    prev = None
    steps = 0
    while True:
        message = comm.broadcast_object()
        if message == SHUTDOWN:
            return steps
        plan, from_previous = message
        try:
            prev = engine.runner.launch(plan, prev if from_previous else None)
        except Exception as e:  # noqa: BLE001 - rank 0 fails on the same inputs and isolates the request
            if type(e).__name__ == "RankFailure":
                raise
            logger.warning("rank %d: step failed (%s: %s); rank 0 handles it", comm.mapping.rank,
                           type(e).__name__, e)
            prev = None
        steps += 1
