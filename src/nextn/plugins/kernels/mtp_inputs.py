"""MTP step inputs on the device: the next verify step's inputs, and MTP Vanilla's window pools.

`next_step_inputs`: from a step's tokens [B, K+1] and num_emitted [B] (and the new drafts [B, K]), the next
step's input ids [last emitted token, d1..dK], kv_lens (the rewind: L + num_emitted) and positions
kv_len + [0..K] — what the model runner otherwise rebuilds from host lists (ARCHITECTURE.md, data flow).

`mtp_vanilla_window`: MTP Vanilla re-runs every module over the K+1 positions ending at the last accepted one
(`runtime.drafters.MtpVanillaDrafter.after_verify`, whose math is the reference here): the rows of
[pool; verified] from num_emitted to num_emitted + K, for the target hidden states and the tokens one ahead,
and their positions. The window is also the next step's pool. Sources: DeepSeek-V3 report §2.2 (MTP modules);
TensorRT-LLM `_torch/speculative/mtp.py` (Vanilla mode's hidden-state and token pools), semantics only.
"""

from __future__ import annotations

import functools

import torch

from nextn.plugins.kernels.dispatch import cdiv, launch, next_pow2, register_op, use_kernel

__all__ = ["next_step_inputs", "next_step_inputs_triton", "next_step_inputs_reference", "mtp_vanilla_window",
           "mtp_vanilla_window_triton", "mtp_vanilla_window_reference"]

_BLOCK_H = 256


@functools.cache
def _build():
    global tl
    import triton
    import triton.language as tl

    @triton.jit
    def next_inputs_kernel(tokens_ptr, num_emitted_ptr, drafts_ptr, kv_lens_ptr, ids_ptr, positions_ptr,
                           new_kv_lens_ptr, K, BLOCK_W: tl.constexpr):
        """Request b: ids = [tokens[b, n−1], drafts[b]], kv_len' = kv_len + n, positions = kv_len' + [0..K]."""
        b = tl.program_id(0)
        j = tl.arange(0, BLOCK_W)
        n = tl.load(num_emitted_ptr + b)
        last = tl.load(tokens_ptr + b * (K + 1) + n - 1)
        draft = tl.load(drafts_ptr + b * K + j - 1, mask=(j >= 1) & (j <= K), other=0)
        kv = tl.load(kv_lens_ptr + b) + n
        tl.store(ids_ptr + b * (K + 1) + j, tl.where(j == 0, last, draft), mask=j <= K)
        tl.store(positions_ptr + b * (K + 1) + j, kv + j, mask=j <= K)
        tl.store(new_kv_lens_ptr + b, kv)

    @triton.jit
    def vanilla_window_kernel(pool_tokens_ptr, pool_hidden_ptr, tokens_ptr, hidden_ptr, num_emitted_ptr,
                              first_position_ptr, win_tokens_ptr, win_hidden_ptr, win_positions_ptr, W, H,
                              BLOCK_H: tl.constexpr):
        """Program (b, i, c): window row i of request b (hidden columns c·BLOCK_H…), its token and position."""
        b = tl.program_id(0)
        i = tl.program_id(1)
        cols = tl.program_id(2) * BLOCK_H + tl.arange(0, BLOCK_H)
        n = tl.load(num_emitted_ptr + b)
        src = n + i  # row of [pool; verified], both W rows
        from_pool = src < W
        row_pool = (b * W + tl.minimum(src, W - 1)).to(tl.int64) * H
        row_new = (b * W + tl.maximum(src - W, 0)).to(tl.int64) * H
        inside = cols < H
        h_pool = tl.load(pool_hidden_ptr + row_pool + cols, mask=inside & from_pool, other=0.0)
        h_new = tl.load(hidden_ptr + row_new + cols, mask=inside & (src >= W), other=0.0)
        tl.store(win_hidden_ptr + (b * W + i).to(tl.int64) * H + cols, tl.where(from_pool, h_pool, h_new),
                 mask=inside)
        if tl.program_id(2) == 0:
            t_pool = tl.load(pool_tokens_ptr + b * W + tl.minimum(src, W - 1))
            t_new = tl.load(tokens_ptr + b * W + tl.maximum(src - W, 0))
            tl.store(win_tokens_ptr + b * W + i, tl.where(from_pool, t_pool, t_new))
            tl.store(win_positions_ptr + b * W + i, tl.load(first_position_ptr + b) + n - W + i)

    return next_inputs_kernel, vanilla_window_kernel


def __getattr__(name: str):
    kernels = ("next_inputs_kernel", "vanilla_window_kernel")
    if name in kernels:
        return _build()[kernels.index(name)]
    raise AttributeError(name)


def next_step_inputs_reference(tokens: torch.Tensor, num_emitted: torch.Tensor, draft_tokens: torch.Tensor,
                               kv_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The next verify step's inputs (PyTorch).

    Args:
        tokens: [B, K+1] int64 this step's tokens (the first num_emitted are emitted).
        num_emitted: [B] int64 in [1, K+1].
        draft_tokens: [B, K] int64 the drafts for the next step.
        kv_lens: [B] int64 this step's KV lengths L.
    Returns:
        input_ids [B, K+1] int64 = [last emitted token, d1..dK], positions [B, K+1] int64 = L' + [0..K],
        kv_lens [B] int64 L' = L + num_emitted.
    """
    last = tokens.gather(1, (num_emitted - 1)[:, None])
    new_kv_lens = kv_lens + num_emitted
    positions = new_kv_lens[:, None] + torch.arange(tokens.shape[1], device=tokens.device)
    return torch.cat([last, draft_tokens], dim=1), positions, new_kv_lens


def _next_inputs(tokens: torch.Tensor, num_emitted: torch.Tensor, draft_tokens: torch.Tensor,
                 kv_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    b, w = tokens.shape
    k = w - 1
    drafts = draft_tokens.contiguous() if k else tokens.new_zeros(b, 1)
    ids = torch.empty_like(tokens)
    positions = torch.empty(b, w, dtype=torch.int64, device=tokens.device)
    new_kv_lens = torch.empty(b, dtype=torch.int64, device=tokens.device)
    launch(_build()[0])[(b,)](tokens.contiguous(), num_emitted.contiguous(), drafts, kv_lens.contiguous(), ids,
                              positions, new_kv_lens, k, BLOCK_W=next_pow2(w, 2))
    return ids, positions, new_kv_lens


def mtp_vanilla_window_reference(pool_tokens: torch.Tensor, pool_hidden: torch.Tensor, target_tokens: torch.Tensor,
                                 hidden: torch.Tensor, num_emitted: torch.Tensor, first_position: torch.Tensor
                                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """MTP Vanilla's window after a verification (PyTorch; `MtpVanillaDrafter.after_verify`).

    Args:
        pool_tokens: [B, W] int64, pool_hidden: [B, W, H] the previous window (W = K+1).
        target_tokens: [B, W] int64 this step's tokens; hidden: [B, W, H] the target's hidden states at them.
        num_emitted: [B] int64 in [1, W]; first_position: [B] int64 the first verified position L.
    Returns:
        win_tokens [B, W] int64, win_hidden [B, W, H] (rows num_emitted..num_emitted+K of [pool; verified]),
        positions [B, W] int64 = L + num_emitted − W + [0..K] (the window ends at the last accepted position).
    """
    w = pool_tokens.shape[1]
    idx = num_emitted[:, None] + torch.arange(w, device=hidden.device)  # [B, W]
    win_hidden = torch.cat([pool_hidden, hidden], dim=1).gather(1, idx[..., None].expand(-1, -1, hidden.shape[-1]))
    win_tokens = torch.cat([pool_tokens, target_tokens], dim=1).gather(1, idx)
    positions = first_position[:, None] + num_emitted[:, None] - w + torch.arange(w, device=hidden.device)
    return win_tokens, win_hidden, positions


def _vanilla_window(pool_tokens: torch.Tensor, pool_hidden: torch.Tensor, target_tokens: torch.Tensor,
                    hidden: torch.Tensor, num_emitted: torch.Tensor, first_position: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    b, w, h = hidden.shape
    win_tokens = torch.empty_like(pool_tokens)
    win_hidden = torch.empty_like(hidden)
    positions = torch.empty(b, w, dtype=torch.int64, device=hidden.device)
    block_h = min(_BLOCK_H, next_pow2(h, 16))
    launch(_build()[1])[(b, w, cdiv(h, block_h))](
        pool_tokens.contiguous(), pool_hidden.to(hidden.dtype).contiguous(), target_tokens.contiguous(),
        hidden.contiguous(), num_emitted.contiguous(), first_position.contiguous(), win_tokens, win_hidden,
        positions, w, h, BLOCK_H=block_h)
    return win_tokens, win_hidden, positions


_next_inputs_op = register_op("next_step_inputs", _next_inputs)
_vanilla_window_op = register_op("mtp_vanilla_window", _vanilla_window)


def next_step_inputs_triton(tokens: torch.Tensor, num_emitted: torch.Tensor, draft_tokens: torch.Tensor,
                            kv_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launcher (one program per request): the arguments and results of `next_step_inputs_reference`."""
    return _next_inputs_op(tokens, num_emitted, draft_tokens, kv_lens)


def next_step_inputs(tokens: torch.Tensor, num_emitted: torch.Tensor, draft_tokens: torch.Tensor,
                     kv_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, positions, kv_lens) of the next step: the kernel where it can run, else the reference."""
    if use_kernel(tokens, num_emitted, draft_tokens, kv_lens):
        return next_step_inputs_triton(tokens, num_emitted, draft_tokens, kv_lens)
    return next_step_inputs_reference(tokens, num_emitted, draft_tokens, kv_lens)


def mtp_vanilla_window_triton(pool_tokens: torch.Tensor, pool_hidden: torch.Tensor, target_tokens: torch.Tensor,
                              hidden: torch.Tensor, num_emitted: torch.Tensor, first_position: torch.Tensor
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launcher (one program per window row and 256 hidden columns): as `mtp_vanilla_window_reference`."""
    return _vanilla_window_op(pool_tokens, pool_hidden, target_tokens, hidden, num_emitted, first_position)


def mtp_vanilla_window(pool_tokens: torch.Tensor, pool_hidden: torch.Tensor, target_tokens: torch.Tensor,
                       hidden: torch.Tensor, num_emitted: torch.Tensor, first_position: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """MTP Vanilla's window (tokens, hidden, positions): the kernel where it can run, else the reference."""
    if use_kernel(pool_tokens, pool_hidden, target_tokens, hidden, num_emitted, first_position):
        return mtp_vanilla_window_triton(pool_tokens, pool_hidden, target_tokens, hidden, num_emitted,
                                         first_position)
    return mtp_vanilla_window_reference(pool_tokens, pool_hidden, target_tokens, hidden, num_emitted,
                                        first_position)
