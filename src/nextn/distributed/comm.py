"""The collectives one engine's ranks use, over `torch.distributed` (NCCL on CUDA, gloo on CPU), with clear errors.

Two process groups: the tensor group (the model's all-reduces and all-gathers; NCCL on GPUs) and a gloo control
group (rank 0's per-step plan, pickled: host objects never go through NCCL). A peer that exits closes its sockets,
so a collective waiting on it fails at once; one that hangs fails after `timeout`. Either way the error is a
`RankFailure` that names this rank and what to check — never a silent hang.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from nextn.distributed.mapping import Mapping, MappingError

#: How long a collective waits for a rank that neither answers nor exits (a hung peer).
DEFAULT_TIMEOUT = timedelta(seconds=120)


class RankFailure(RuntimeError):
    """Another rank of the engine died or stopped answering; this engine cannot step any more."""


class Communicator:
    """The collectives of one engine's ranks.

    Args:
        mapping: this rank's place; `mapping.world_size` ranks take part.
        group: the tensor group (None: the default group).
        control: a gloo group for pickled host objects (None: `group`, which must then be gloo).
    """

    def __init__(self, mapping: Mapping, group: Any = None, control: Any = None) -> None:
        self.mapping = mapping
        self.group = group
        self.control = control if control is not None else group

    @property
    def world_size(self) -> int:
        return self.mapping.world_size

    def _failed(self, what: str, error: BaseException) -> RankFailure:
        return RankFailure(f"rank {self.mapping.rank}/{self.world_size}: {what} with the other ranks failed "
                           f"({type(error).__name__}: {error}); another rank died or stopped answering — see its log")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` (any shape) over the ranks, in place; returns it. Row-parallel outputs, partial MoE sums."""
        if self.world_size == 1:
            return x
        try:
            dist.all_reduce(x, group=self.group)
        except (RuntimeError, ValueError) as e:  # gloo/NCCL errors are RuntimeErrors (DistBackendError)
            raise self._failed("all_reduce", e) from e
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's `x` [..., n] along the last dim in rank order → [..., world_size · n]."""
        if self.world_size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        try:
            dist.all_gather(parts, x, group=self.group)
        except (RuntimeError, ValueError) as e:
            raise self._failed("all_gather", e) from e
        return torch.cat(parts, dim=-1)

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0's picklable `obj` on every rank (the others pass None). Used once per step for the step plan."""
        box = [obj]
        try:
            dist.broadcast_object_list(box, src=0, group=self.control)
        except (RuntimeError, ValueError) as e:
            raise self._failed("broadcast of the step plan", e) from e
        return box[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's picklable `obj`, in rank order (the workers' load reports)."""
        out: list[Any] = [None] * self.world_size
        try:
            dist.all_gather_object(out, obj, group=self.control)
        except (RuntimeError, ValueError) as e:
            raise self._failed("all_gather of load reports", e) from e
        return out

    def barrier(self) -> None:
        try:
            dist.barrier(group=self.control)
        except (RuntimeError, ValueError) as e:
            raise self._failed("barrier", e) from e


def require_free_default_group(what: str) -> None:
    """torch.distributed has one default process group a process: refuse to start `what` while one is active.

    Raises:
        MappingError: naming the fix (shut the other tensor-parallel or disaggregated LLM down first).
    """
    if dist.is_initialized():
        raise MappingError(f"{what}: another tensor-parallel or disaggregated LLM (or a torch.distributed process "
                           "group) is active in this process, and torch.distributed allows one: call that LLM's "
                           "shutdown() / close() first")


def init_communicator(mapping: Mapping, device: torch.device, init_method: str | None = None,
                      timeout: timedelta = DEFAULT_TIMEOUT) -> Communicator:
    """Join the engine's process group (creating the default group if none exists) and return its communicator.

    Args:
        init_method: a `torch.distributed` rendezvous URL (`tcp://host:port`, `file:///path`); None: the
            environment (`MASTER_ADDR`, `MASTER_PORT`, as `torchrun` sets them).
        device: where the model runs: NCCL for CUDA tensors, gloo for CPU ones.
    Raises:
        RankFailure: the rendezvous did not complete within `timeout` (a rank did not start).
    """
    backend = "nccl" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        if device.type == "cuda":
            index = device.index if device.index is not None else mapping.rank % torch.cuda.device_count()
            torch.cuda.set_device(index)
        try:
            dist.init_process_group(backend, init_method=init_method or "env://", world_size=mapping.world_size,
                                    rank=mapping.rank, timeout=timeout)
        except (RuntimeError, ValueError) as e:
            raise RankFailure(f"rank {mapping.rank}/{mapping.world_size}: the rendezvous at "
                              f"{init_method or os.environ.get('MASTER_ADDR', 'env://')} failed: {e}") from e
    control = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else None
    return Communicator(mapping, group=None, control=control)
