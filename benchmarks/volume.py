"""Bytes a rank sends per decode step under nextn's tensor / expert parallelism, computed from the model config.

`python -m benchmarks.volume` prints the table in docs/ARCHITECTURE.md (DeepSeek-V3's real sizes, TP 8 /
EP 8). Collectives and their per-rank traffic (ring algorithms, N ranks, S bytes of tensor; NCCL's and gloo's):
all-reduce sends 2 (N − 1) / N · S, all-gather (N − 1) / N · S_total. Per forward over T tokens, hidden H: one
all-reduce of the vocab-parallel embedding, two per decoder layer (attention output, MLP or MoE — the MoE's routed
and shared experts share one), and an all-gather of the logits [T, V] per lm_head call. The step plan rank 0
broadcasts (a few hundred bytes per request) is left out.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepVolume:
    """Bytes one rank sends in one decode step, by source."""

    embedding: float
    layers: float
    logits: float

    @property
    def total(self) -> float:
        return self.embedding + self.layers + self.logits


def decode_step_volume(hidden_size: int, num_layers: int, vocab_size: int, tp: int, batch: int, num_drafts: int,
                       num_mtp_layers: int = 1, act_bytes: int = 2, logit_bytes: int = 2) -> StepVolume:
    """Per-rank bytes of one MTP Eagle verify-and-draft step (speculative/chain_step.py) for `batch` requests.

    The target runs T = batch · (K + 1) rows; the MTP module runs batch · (K + 1) rows, then K − 1 one-row steps
    (K = num_drafts), each through `num_mtp_layers` decoder blocks, the embedding and the lm_head.

    Args:
        act_bytes: bytes per activation value (bf16: 2); logit_bytes: per gathered logit (bf16 head: 2).
    Returns:
        The volume by source, in bytes.
    """
    reduce_factor = 2 * (tp - 1) / tp
    gather_factor = (tp - 1) / tp
    target_rows = batch * (num_drafts + 1)
    mtp_rows = batch * (num_drafts + 1) + batch * max(num_drafts - 1, 0)
    row = hidden_size * act_bytes
    forwards = target_rows + mtp_rows  # rows that pass the embedding and reach an lm_head
    return StepVolume(
        embedding=reduce_factor * forwards * row,
        layers=reduce_factor * 2 * row * (target_rows * num_layers + mtp_rows * num_mtp_layers),
        logits=gather_factor * forwards * vocab_size * logit_bytes,
    )


def main() -> None:
    h, layers, vocab = 7168, 61, 129280  # DeepSeek-V3 (config.json of deepseek-ai/DeepSeek-V3)
    print("| batch | K | embedding MB | layers MB | logits MB | total MB per rank per step |")
    print("|---|---|---|---|---|---|")
    for batch in (1, 8, 64):
        for k in (1, 3):
            v = decode_step_volume(h, layers, vocab, tp=8, batch=batch, num_drafts=k)
            print(f"| {batch} | {k} | {v.embedding / 1e6:.2f} | {v.layers / 1e6:.1f} | {v.logits / 1e6:.1f} "
                  f"| {v.total / 1e6:.1f} |")


if __name__ == "__main__":
    main()
