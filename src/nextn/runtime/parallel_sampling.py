"""Parallel sampling (`SamplingParams.n`): a prompt's n sequences as n requests, and their outputs as one.

Sequence j of a prompt is its own request seeded seed + j (its own seed drawn when seed is None), so each has its
own random stream; the n prompts are identical, so the later ones reuse the first's KV blocks through the prefix
cache (vLLM's parallel sampling; TensorRT-LLM's `n`).
"""

from __future__ import annotations

from nextn.runtime.outputs import RequestOutput
from nextn.runtime.sampling_params import SamplingParams

__all__ = ["expand_n", "merge_n"]


def expand_n(plist: list, params: list[SamplingParams]) -> tuple[list[int], list[tuple]]:
    """(owner prompt index, (prompt, params)) per sequence: a prompt with n > 1 becomes n requests, sequence j seeded
    seed + j (its own draw when seed is None); their prompts share KV blocks through the prefix cache."""
    owners, out = [], []
    for i, (prompt, sp) in enumerate(zip(plist, params)):
        n = sp.n if isinstance(sp, SamplingParams) else 1  # anything else is refused by name when made a request
        for j in range(n):
            one = sp if n == 1 else sp.model_copy(
                update={"n": 1, "seed": None if sp.seed is None else (sp.seed + j) % 2**63})
            owners.append(i)
            out.append((prompt, one))
    return owners, out


def merge_n(owners: list[int], outputs: list[RequestOutput], num_prompts: int) -> list[RequestOutput]:
    """One RequestOutput per prompt, its sequences in `.outputs` (index 0..n−1)."""
    merged: list[RequestOutput | None] = [None] * num_prompts
    for owner, out in zip(owners, outputs):
        first = merged[owner]
        if first is None:
            merged[owner] = out
        else:
            extra = out.outputs[0]
            extra.index = len(first.outputs)
            first.outputs.append(extra)
            first.finished = first.finished and out.finished
    return merged  # type: ignore[return-value]
