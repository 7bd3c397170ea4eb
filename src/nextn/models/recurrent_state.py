"""Per-request recurrent state of the Gated DeltaNet layers (Qwen3.5, Qwen3-Next), kept by batch slot, and the rule
that makes speculative verification over it lossless.

A linear-attention layer carries, per request, a causal-conv state (the last `kernel − 1` inputs of its depthwise
conv) and a recurrent state (one [key_dim, value_dim] matrix per value head) in place of a KV cache. A verify step
runs K + 1 tokens through the layer, and only the accepted ones may leave their mark. So each layer keeps a **ring of
the states after each of the last R tokens it ran** (R = K + 1: every position a verify step can accept) per batch
slot, with `base[slot]`, the position of the first token of the slot's last forward. The next forward of the slot
starts at position p (its KV length after acceptance, or a prefill chunk's start) and reads the state after token
p − 1: ring entry (p − 1 − base) mod R — so rejected drafts are never committed, and no step needs to be told what
was accepted (the same positions that rewind the KV cache pick the state). A forward that starts at position 0 starts
from zeros (a new request, or one re-prefilled after preemption). Pads (tokens whose KV goes to the null block) leave
the ring as it was. This is what vLLM and SGLang do for Qwen3-Next's speculative decoding (a state per draft
position, the accepted one kept), expressed through positions.

Shapes: conv [layers, slots, R, conv_dim, kernel − 1] and ssm [layers, slots, R, value_heads, key_dim, value_dim],
float32 (HF computes the recurrence in float32).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RecurrentRows:
    """One forward's view of the state: rows' batch slots [B] int64, each row's start entry [B] int64 in the ring,
    `fresh` [B] bool (starts at position 0: zero state), `valid` [B, T] bool (a token, not a pad), `start` [B] int64
    (the first token's position)."""

    slots: torch.Tensor
    entry: torch.Tensor
    fresh: torch.Tensor
    valid: torch.Tensor
    start: torch.Tensor


class RecurrentState:
    """The ring buffers of every linear-attention layer for `num_slots` batch slots (see the module docstring).

    Args:
        num_layers: linear-attention layers.
        num_slots: batch slots (the engine's max_batch_size).
        ring: states kept per slot, R ≥ 1: K + 1 for a verify step of K drafts.
        conv_dim, kernel: the conv's channels and taps; value_heads, key_dim, value_dim: the recurrent state's shape.
    """

    def __init__(self, num_layers: int, num_slots: int, ring: int, conv_dim: int, kernel: int, value_heads: int,
                 key_dim: int, value_dim: int, device: torch.device | str = "cpu") -> None:
        self.ring = ring
        self.conv = torch.zeros(num_layers, num_slots, ring, conv_dim, kernel - 1, device=device)
        self.ssm = torch.zeros(num_layers, num_slots, ring, value_heads, key_dim, value_dim, device=device)
        self.base = torch.zeros(num_slots, dtype=torch.int64, device=device)

    @property
    def nbytes(self) -> int:
        return self.conv.nbytes + self.ssm.nbytes + self.base.nbytes

    def rows(self, slots: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor) -> RecurrentRows:
        """The forward's rows: `slots` [B] int64 batch slots, `positions` [B, T] int64, `valid` [B, T] bool."""
        start = positions[:, 0]
        entry = torch.remainder(start - 1 - self.base[slots], self.ring)
        return RecurrentRows(slots, entry, start == 0, valid, start)

    def initial_conv(self, layer: int, rows: RecurrentRows) -> torch.Tensor:
        """The conv state [B, conv_dim, kernel − 1] before the rows' first tokens (zeros where fresh); the
        recurrent state is read by the recurrence itself (`plugins.gated_delta`)."""
        conv = self.conv[layer, rows.slots, rows.entry]
        return torch.where(rows.fresh[:, None, None], 0.0, conv)

    def store_conv(self, layer: int, rows: RecurrentRows, window: torch.Tensor) -> None:
        """Keep the conv states after the last R valid tokens of each row at once (the recurrence keeps the ssm
        states). window: [B, conv_dim, kernel − 1 + T], the state before the first token then the T tokens' inputs."""
        width = self.conv.shape[-1]
        after = window.unfold(2, width, 1)[:, :, 1:]  # [B, C, T, kernel − 1]: the state after token t
        last = rows.valid.sum(-1) - 1  # each row's last valid token
        for j in range(self.ring):
            t = j + self.ring * torch.div(last - j, self.ring, rounding_mode="floor")  # the last valid t ≡ j (mod R)
            keep = last >= j
            idx = t.clamp(min=0)[:, None, None, None].expand(-1, after.shape[1], 1, width)
            new = after.gather(2, idx)[:, :, 0]
            old = self.conv[layer, rows.slots, j]
            self.conv[layer, rows.slots, j] = torch.where(keep[:, None, None], new, old)

    def advance(self, rows: RecurrentRows) -> None:
        """After every layer ran: the rows' ring entries now start at their forward's first position."""
        self.base[rows.slots] = rows.start
