"""Which share of the model a rank holds: TensorRT-LLM's `tensorrt_llm.Mapping` names, reduced to what nextn splits.

One group of `world_size = tp_size` ranks runs one engine. Attention heads, MLP columns/rows and the vocabulary are
split `tp_size` ways (Megatron-LM, Shoeybi et al. 2019, §3). DeepSeek-V3's routed experts are split
`moe_ep_size` ways by expert id (expert parallelism) and, within an expert, `moe_tp_size = tp_size / moe_ep_size`
ways by intermediate columns (TensorRT-LLM's `moe_tp_size`); both leave each rank a partial sum that one
all-reduce over the group completes.
"""

from __future__ import annotations

from dataclasses import dataclass

from nextn.config.llm_args import LlmArgsError


class MappingError(LlmArgsError):
    """Parallel sizes that do not fit the model or each other; the message names the size and the fix."""


@dataclass(frozen=True)
class Mapping:
    """The parallel layout of one engine and this process's place in it.

    Attributes:
        world_size: ranks that run the engine (= tp_size; pipeline parallelism is not implemented).
        rank: this process's rank in [0, world_size); rank 0 drives the scheduler.
        tp_size: tensor-parallel ranks (`tensor_parallel_size`).
        moe_ep_size: expert-parallel ranks for the routed experts (`moe_expert_parallel_size`), dividing tp_size.
    """

    world_size: int = 1
    rank: int = 0
    tp_size: int = 1
    moe_ep_size: int = 1

    def __post_init__(self) -> None:
        if self.tp_size < 1 or self.moe_ep_size < 1:
            raise MappingError(f"tensor_parallel_size={self.tp_size} and moe_expert_parallel_size="
                               f"{self.moe_ep_size} must be ≥ 1")
        if self.world_size != self.tp_size:
            raise MappingError(f"world_size={self.world_size} must equal tensor_parallel_size={self.tp_size} "
                               "(pipeline parallelism is not implemented)")
        if self.tp_size % self.moe_ep_size:
            raise MappingError(f"moe_expert_parallel_size={self.moe_ep_size} must divide "
                               f"tensor_parallel_size={self.tp_size} (TensorRT-LLM: tp = moe_tp × moe_ep)")
        if not 0 <= self.rank < self.world_size:
            raise MappingError(f"rank={self.rank} outside [0, {self.world_size})")

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def moe_tp_size(self) -> int:
        return self.tp_size // self.moe_ep_size

    @property
    def moe_ep_rank(self) -> int:
        return self.tp_rank // self.moe_tp_size

    @property
    def moe_tp_rank(self) -> int:
        return self.tp_rank % self.moe_tp_size

    @property
    def is_driver(self) -> bool:
        """Rank 0 schedules, takes requests and broadcasts each step's inputs; the others mirror its steps."""
        return self.rank == 0

    def with_rank(self, rank: int) -> "Mapping":
        return Mapping(self.world_size, rank, self.tp_size, self.moe_ep_size)
