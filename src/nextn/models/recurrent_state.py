"""Per-request recurrent state of the Gated DeltaNet layers (Qwen3.5, Qwen3-Next), kept by batch slot, and the rule
that makes speculative verification over it lossless.

A linear-attention layer carries, per request, a causal-conv state (the last `kernel − 1` inputs of its depthwise
conv) and a recurrent state (one [key_dim, value_dim] matrix per value head) in place of a KV cache. A verify step
runs K + 1 tokens through the layer, and only the accepted ones may leave their mark. So each slot keeps **the state
before the last R tokens it ran** (R = K + 1: every position a verify step can accept) and **those tokens' updates**
— the rule's S = decay · S + k ⊗ d as (k, d, decay), Dk + Dv + 1 floats a head instead of a Dk × Dv state — with
`base[slot]`, the position of the first of them. The next forward of the slot starts at position p (its KV length
after acceptance, or a prefill chunk's start) and first applies the p − base updates it now knows were accepted
(`committed`): rejected drafts are never applied, and no step needs to be told what was accepted (the same positions
that rewind the KV cache pick the state). Re-applying an update repeats the rule's own two float operations, so the
state is bit-identical to having kept it. The conv states after each of those R tokens are kept whole (kernel − 1
inputs each, small). A forward that starts at position 0 starts from zeros (a new request, or one re-prefilled after
preemption). Pads (tokens after a row's valid ones) leave no mark. vLLM and SGLang keep a whole state per draft
position for Qwen3-Next's speculative decoding instead; writing R whole states per verify step was most of its cost
here (docs/PERFORMANCE.md, "Hybrid models").

Shapes: conv [layers, slots, R, conv_dim, kernel − 1], ssm [layers, slots, value_heads, key_dim, value_dim] and
pending [layers, slots, R, value_heads, key_dim + value_dim + 1], float32 (HF computes the recurrence in float32).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RecurrentRows:
    """One forward's view of the state: rows' batch slots [B] int64, `committed` [B] int64 (how many of the slot's
    pending updates its first position commits: 1..R where not fresh), `fresh` [B] bool (starts at position 0: zero
    state), `valid` [B, T] bool (a token, not a pad; pads follow the tokens), `start` [B] int64 (the first token's
    position)."""

    slots: torch.Tensor
    committed: torch.Tensor
    fresh: torch.Tensor
    valid: torch.Tensor
    start: torch.Tensor


class RecurrentState:
    """The states of every linear-attention layer for `num_slots` batch slots (see the module docstring).

    Args:
        num_layers: linear-attention layers.
        num_slots: batch slots (the engine's max_batch_size).
        ring: tokens kept pending per slot, R ≥ 1: K + 1 for a verify step of K drafts.
        conv_dim, kernel: the conv's channels and taps; value_heads, key_dim, value_dim: the recurrent state's shape.
    """

    def __init__(self, num_layers: int, num_slots: int, ring: int, conv_dim: int, kernel: int, value_heads: int,
                 key_dim: int, value_dim: int, device: torch.device | str = "cpu") -> None:
        self.ring = ring
        self.conv = torch.zeros(num_layers, num_slots, ring, conv_dim, kernel - 1, device=device)
        self.ssm = torch.zeros(num_layers, num_slots, value_heads, key_dim, value_dim, device=device)
        self.pending = torch.zeros(num_layers, num_slots, ring, value_heads, key_dim + value_dim + 1, device=device)
        self.base = torch.zeros(num_slots, dtype=torch.int64, device=device)

    @staticmethod
    def bytes_per_slot(num_layers: int, ring: int, conv_dim: int, kernel: int, value_heads: int, key_dim: int,
                       value_dim: int) -> int:
        """Bytes of one slot's state (float32 conv, ssm and pending; the slot's base position)."""
        floats = ring * conv_dim * (kernel - 1) + value_heads * key_dim * value_dim \
            + ring * value_heads * (key_dim + value_dim + 1)
        return num_layers * floats * 4 + 8

    @property
    def nbytes(self) -> int:
        return self.conv.nbytes + self.ssm.nbytes + self.pending.nbytes + self.base.nbytes

    def rows(self, slots: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor) -> RecurrentRows:
        """The forward's rows: `slots` [B] int64 batch slots, `positions` [B, T] int64, `valid` [B, T] bool."""
        start = positions[:, 0]
        return RecurrentRows(slots, start - self.base[slots], start == 0, valid, start)

    def initial_conv(self, layer: int, rows: RecurrentRows) -> torch.Tensor:
        """The conv state [B, conv_dim, kernel − 1] before the rows' first tokens (zeros where fresh); the
        recurrent state is read by the recurrence itself (`plugins.gated_delta`)."""
        conv = self.conv[layer, rows.slots, (rows.committed - 1).clamp(0, self.ring - 1)]
        return torch.where(rows.fresh[:, None, None], 0.0, conv)

    def store_conv(self, layer: int, rows: RecurrentRows, window: torch.Tensor) -> None:
        """Keep the conv states after the last R valid tokens of each row, in order (the recurrence keeps the rest).
        window: [B, conv_dim, kernel − 1 + T], the state before the first token then the T tokens' inputs."""
        width = self.conv.shape[-1]
        after = window.unfold(2, width, 1)[:, :, 1:]  # [B, C, T, kernel − 1]: the state after token t
        n_valid = rows.valid.sum(-1)
        first = (n_valid - self.ring).clamp(min=0)  # the first of the last R valid tokens
        for j in range(self.ring):
            t = first + j
            keep = t < n_valid
            idx = t.clamp(max=after.shape[2] - 1)[:, None, None, None].expand(-1, after.shape[1], 1, width)
            new = after.gather(2, idx)[:, :, 0]
            old = self.conv[layer, rows.slots, j]
            self.conv[layer, rows.slots, j] = torch.where(keep[:, None, None], new, old)

    def advance(self, rows: RecurrentRows) -> None:
        """After every layer ran: the rows' pending tokens are the last R valid tokens of this forward (a row of pads
        only left its slot as it was)."""
        n_valid = rows.valid.sum(-1)
        moved = rows.start + (n_valid - self.ring).clamp(min=0)
        self.base[rows.slots] = torch.where(n_valid > 0, moved, self.base[rows.slots])
