"""Starting a tensor-parallel engine's ranks: `LLM(..., tensor_parallel_size=N)` starts N − 1 worker processes itself
(as TensorRT-LLM's LLM API and vLLM do), or, under `torchrun`, each launched process takes its rank from the
environment (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`).

Started workers are `python -m nextn.distributed.worker SPEC` processes (a fresh interpreter: the caller's script is
not re-imported, so it needs no `if __name__ == "__main__"` guard, unlike multiprocessing's spawn). They meet rank 0
at a `file://` rendezvous in a fresh temporary directory, build the same `Engine` with their share of the model and
report their load (None, or the error) in one all-gather with rank 0, then run `mirror.serve_steps` until rank 0
shuts down. Rank 0 checks that they are alive before every step: a worker that died makes the next step fail at
once with a `RankFailure` naming it; a worker whose rank 0 died fails its next collective and exits.

Before any process starts, the sizes are checked against the model and the machine (`preflight.py`), and against
the process: torch.distributed has one default group a process, so one started tensor-parallel `LLM` at a time
(`LLM.shutdown()` releases its group, workers and rendezvous; the next one can then start).
"""

from __future__ import annotations

import logging
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from nextn.build.manifest import EngineManifest
from nextn.distributed.comm import Communicator, RankFailure, init_communicator, require_free_default_group
from nextn.distributed.mapping import Mapping
from nextn.distributed.mirror import PlanBroadcaster, serve_steps
from nextn.distributed.preflight import check_machine, check_model_split
from nextn.distributed.tensor_parallel import TensorParallelSharding
from nextn.runtime.engine import Engine

logger = logging.getLogger(__name__)


def mapping_from_args(args: Any, rank: int = 0) -> Mapping:
    """The `Mapping` of `LlmArgs` (`tensor_parallel_size`, `moe_expert_parallel_size`) for `rank`.

    Raises:
        MappingError: sizes that do not fit each other.
    """
    tp = args.tensor_parallel_size
    return Mapping(world_size=tp, rank=rank, tp_size=tp, moe_ep_size=args.moe_expert_parallel_size or 1)


def torchrun_rank() -> tuple[int, int] | None:
    """(rank, world_size) when this process was started by `torchrun` (or any launcher setting RANK and WORLD_SIZE
    with world_size > 1), else None."""
    if "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return None


def device_for(device: str | torch.device, rank: int) -> torch.device:
    """`cuda` → `cuda:<rank mod devices>` (one GPU per rank on a node); any other device as given."""
    d = torch.device(device)
    return torch.device("cuda", rank % torch.cuda.device_count()) if d.type == "cuda" and d.index is None else d


def exit_now(status: int) -> NoReturn:
    """End a worker rank that has served its last step: stdio flushed, then `os._exit` — not an interpreter
    shutdown, whose C++ static destructors can find a library's thread still joinable (gloo's, OpenMP's) and abort
    the process ("terminate called without an active exception", exit -6) after its work was done."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(status)


def run_worker(engine_dir: str | Path, args: Any, spec: Any, device: str, mapping: Mapping,
               init_method: str | None = None) -> int:
    """A worker rank's life: join the group, load this rank's share of the engine, report, mirror rank 0's steps.

    Returns:
        The number of steps it ran (after rank 0's shutdown).
    Raises:
        RankFailure: rank 0 died or stopped answering; any load error (after reporting it to rank 0).
    """
    comm = init_communicator(mapping, device_for(device, mapping.rank), init_method)
    try:
        try:
            engine = Engine(engine_dir, args, spec, device_for(device, mapping.rank), TensorParallelSharding(comm))
        except Exception as e:
            comm.all_gather_object(f"{type(e).__name__}: {e}")
            raise
        comm.all_gather_object(None)
        return serve_steps(engine, comm)
    finally:
        dist.destroy_process_group()


@dataclass
class WorkerGroup:
    """Rank 0's handle on the engine's other ranks and the group's communicator.

    Attributes:
        processes: the started workers (empty under torchrun: the launcher owns the processes).
        rendezvous_dir: the temporary directory of a started group's rendezvous and worker specs.
    """

    comm: Communicator
    processes: list[subprocess.Popen]
    rendezvous_dir: str | None = None
    broadcaster: PlanBroadcaster | None = None
    closed: bool = False

    def check_alive(self) -> None:
        """Raises RankFailure naming every started worker that has exited (instead of waiting on it)."""
        dead = [(i + 1, p.returncode) for i, p in enumerate(self.processes) if p.poll() is not None]
        if dead and not self.closed:
            raise RankFailure("tensor-parallel worker rank(s) " + ", ".join(f"{r} (exit code {c})" for r, c in dead)
                              + " exited; the engine cannot step without them: create a new LLM")

    def wait_ready(self, error: BaseException | None) -> None:
        """Exchange load reports with the workers (rank 0's `error`, or None).

        Raises:
            RankFailure: rank 0 loaded but a worker could not (its error is in the message) or exited.
        """
        self.check_alive()
        reports = self.comm.all_gather_object(None if error is None else f"{type(error).__name__}: {error}")
        failed = [(rank, r) for rank, r in enumerate(reports) if r is not None and rank > 0]
        if failed and error is None:  # rank 0's own error, raised by the caller, says it first
            raise RankFailure("; ".join(f"worker rank {rank} could not load the engine: {r}" for rank, r in failed))

    def attach(self, engine: Any) -> None:
        """Rank 0's engine broadcasts each step's plan to the workers, after checking that they are alive."""
        self.broadcaster = broadcaster = PlanBroadcaster(self.comm)

        def launch_hook(plan, from_previous: bool) -> None:
            if self.closed:
                raise RankFailure("this tensor-parallel LLM was shut down: its worker ranks and process group are "
                                  "released; create a new LLM")
            self.check_alive()
            broadcaster(plan, from_previous)

        engine.runner.on_launch = launch_hook

    def close(self, timeout_s: float = 30.0) -> None:
        """Release the workers (the SHUTDOWN plan), wait for them (killed after `timeout_s`), leave the group."""
        if self.closed:
            return
        try:
            if self.broadcaster is not None and all(p.poll() is None for p in self.processes):
                self.broadcaster.shutdown()
        except RankFailure as e:
            logger.warning("shutting the tensor-parallel workers down: %s", e)
        self.closed = True
        self._reap(timeout_s)

    def abandon(self) -> None:
        """After a failed start: kill the started workers (they may wait in a collective) and leave the group."""
        self.closed = True
        self._reap(0.0)

    def _reap(self, timeout_s: float) -> None:
        """Wait for every worker (killed after `timeout_s`; at once for 0), leave the group, remove the rendezvous."""
        for p in self.processes:
            try:
                if timeout_s <= 0:
                    raise subprocess.TimeoutExpired(p.args, 0)
                p.wait(timeout_s)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if dist.is_initialized():
            dist.destroy_process_group()
        if self.rendezvous_dir:
            shutil.rmtree(self.rendezvous_dir, ignore_errors=True)


def start_workers(engine_dir: str | Path, args: Any, spec: Any, device: str) -> WorkerGroup:
    """Start ranks 1..N−1 of a tensor-parallel engine (`python -m nextn.distributed.worker`) and join the group as
    rank 0. CPU ranks share the cores: each worker gets `torch.get_num_threads() // N` threads.

    Raises:
        MappingError: another tensor-parallel LLM of this process still holds torch.distributed's default group.
        RankFailure: the rendezvous failed (a worker did not start).
    """
    mapping = mapping_from_args(args)
    require_free_default_group(f"tensor_parallel_size = {mapping.world_size}")
    rendezvous_dir = tempfile.mkdtemp(prefix="nextn-tp-")
    init_method = f"file://{rendezvous_dir}/rendezvous"
    threads = max(1, torch.get_num_threads() // mapping.world_size)
    group = WorkerGroup(None, [], rendezvous_dir)  # type: ignore[arg-type]
    try:
        for rank in range(1, mapping.world_size):
            spec_file = Path(rendezvous_dir) / f"rank{rank}.pkl"
            spec_file.write_bytes(pickle.dumps({"engine_dir": str(engine_dir), "args": args, "spec": spec,
                                                "device": str(device), "mapping": mapping.with_rank(rank),
                                                "init_method": init_method, "num_threads": threads}))
            group.processes.append(subprocess.Popen([sys.executable, "-m", "nextn.distributed.worker",
                                                     str(spec_file)]))
        group.comm = init_communicator(mapping, device_for(device, 0), init_method)
    except BaseException:
        group.abandon()
        raise
    return group


def start_engine(engine_dir: str | Path, args: Any, spec: Any, device: str,
                 open_checkpoint: Callable[[Path], Any] | None = None) -> tuple[Any, WorkerGroup | None]:
    """Rank 0's `Engine` and its worker group (None for tensor_parallel_size 1 outside torchrun).

    `open_checkpoint`: the build layer's checkpoint reader for a speculative method that reads weights of its own
    (the LLM API passes `engine_settings.open_checkpoint`; `Engine`'s argument). Under `torchrun` a process of rank
    > 0 serves rank 0's steps here and then exits (`exit_now(0)`): only rank 0
    returns, so a script written for one process runs unchanged under `torchrun --nproc_per_node N`.

    Raises:
        MappingError: sizes that do not fit the model, the machine (more ranks than GPUs or CPU cores) or each
            other, all checked before any process starts; RankFailure: a rank failed to start or load;
        EngineError / LlmArgsError: as `Engine`.
    """
    launched = torchrun_rank()
    mapping = mapping_from_args(args, 0 if launched is None else launched[0])  # sizes that fit each other
    if args.tensor_parallel_size == 1 and launched is None:
        return Engine(engine_dir, args, spec, device, open_checkpoint=open_checkpoint), None
    manifest = EngineManifest.load(engine_dir)
    check_model_split(manifest.model, mapping, quantized=manifest.quant_config is not None)
    if launched is not None:
        rank, world = launched
        if world != mapping.world_size:
            raise RankFailure(f"torchrun started {world} processes but tensor_parallel_size is "
                              f"{args.tensor_parallel_size}: use --nproc_per_node {args.tensor_parallel_size}")
        if rank != 0:
            run_worker(engine_dir, args, spec, device, mapping)
            exit_now(0)
        group = WorkerGroup(init_communicator(mapping, device_for(device, 0)), [])
    else:
        check_machine(mapping, device)
        group = start_workers(engine_dir, args, spec, device)
    engine = error = None
    try:
        try:
            engine = Engine(engine_dir, args, spec, device_for(device, 0), TensorParallelSharding(group.comm))
        except Exception as e:  # noqa: BLE001 - told to the workers, then raised
            error = e
        group.wait_ready(error)
    except BaseException:
        group.abandon()
        raise
    if error is not None:
        group.abandon()
        raise error
    group.attach(engine)
    return engine, group
