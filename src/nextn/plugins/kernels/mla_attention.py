"""Absorbed MLA attention over the paged latent cache: K+1 causal queries per request, or a Medusa tree.

Sources: DeepSeek-V2 report §2.1 (MLA), absorption as in vLLM `mla/common.py` and FlashMLA's decode kernel
(queries attend over the compressed latent c_kv plus the roped shared key k_pe; the latent is also the value);
online softmax from FlashAttention (Dao et al. 2022, Alg. 1); tree masks from Medusa (Cai et al. 2024 §2.1.2).
Reference: `mla_attention_reference`, the math `models.deepseek_v3.mla` computed inline before (the model calls
the dispatcher `mla_attention`).

Per query token (b, t) and head n, over key positions s of request b's paged cache (slot through its block table):
    score[s] = (q_lat[n] · c_kv[s] + q_pe[n] · k_pe[s]) · scale      (fp32)
    o_lat[n] = Σ_s softmax(score)[s] · c_kv[s]                        over the visible keys
Visible (the same mask as `AttentionMetadata.visible`): causal, s ≤ max(position, 0); tree, s < kv_len or
s = kv_len + j with tree_mask[(b,) t, j] (one [L, L] tree for the batch, or [B, T, L] per request). Keys beyond
max_blocks · block_size do not exist.

Kernel: one program per (query token, BLOCK_H heads); it walks the visible keys BLOCK_N at a time, each key's
slot looked up through the block table, so K+1 queries may span block boundaries freely.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from nextn.plugins.kernels.dispatch import cdiv, launch, next_pow2, register_op, use_kernel

__all__ = ["mla_attention", "mla_attention_triton", "mla_attention_reference"]

_BLOCK_N = 32
_BLOCK_H = 16


@functools.cache
def _build():
    global tl
    import triton
    import triton.language as tl

    @triton.jit
    def mla_attention_kernel(q_lat_ptr, q_pe_ptr, kv_ptr, block_tables_ptr, positions_ptr, tree_start_ptr,
                             tree_mask_ptr, out_ptr, scale, T, NH, C, R, kv_stride, max_blocks, block_size, L_TREE,
                             IS_TREE: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_H: tl.constexpr,
                             BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
        """Program (b·T + t, h): o_lat of heads h·BLOCK_H … for query token t of request b."""
        qi = tl.program_id(0)
        b = qi // T
        t = qi % T
        heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        c = tl.arange(0, BLOCK_C)
        r = tl.arange(0, BLOCK_R)
        h_in = heads < NH
        c_in = c < C
        r_in = r < R
        q_rows = (qi * NH + heads).to(tl.int64)
        q = tl.load(q_lat_ptr + q_rows[:, None] * C + c[None, :], mask=h_in[:, None] & c_in[None, :], other=0.0)
        qp = tl.load(q_pe_ptr + q_rows[:, None] * R + r[None, :], mask=h_in[:, None] & r_in[None, :], other=0.0)
        max_keys = max_blocks * block_size
        if IS_TREE:
            start = tl.load(tree_start_ptr + b)
            n_keys = tl.minimum(start + L_TREE, max_keys)
        else:
            n_keys = tl.minimum(tl.maximum(tl.load(positions_ptr + qi), 0) + 1, max_keys)
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_C], tl.float32)
        for s0 in range(0, n_keys, BLOCK_N):
            keys = s0 + tl.arange(0, BLOCK_N)
            k_in = keys < n_keys
            block = tl.load(block_tables_ptr + b * max_blocks + keys // block_size, mask=k_in, other=0)
            slot = (block * block_size + keys % block_size).to(tl.int64)
            kv = tl.load(kv_ptr + slot[:, None] * kv_stride + c[None, :], mask=k_in[:, None] & c_in[None, :],
                         other=0.0).to(q.dtype)
            pe = tl.load(kv_ptr + slot[:, None] * kv_stride + C + r[None, :], mask=k_in[:, None] & r_in[None, :],
                         other=0.0).to(q.dtype)
            s = tl.dot(q, tl.trans(kv), input_precision=DOT_PRECISION)
            # fp32 even where the scale arrives as fp64 (a Python float under torch.compile's Triton launcher)
            s = ((s + tl.dot(qp, tl.trans(pe), input_precision=DOT_PRECISION)) * scale).to(tl.float32)
            vis = k_in
            if IS_TREE:
                rel = keys - start
                in_tree = (rel >= 0) & (rel < L_TREE)
                tm = tl.load(tree_mask_ptr + qi * L_TREE + rel, mask=k_in & in_tree, other=0)  # [B, T, L]
                vis = vis & ((rel < 0) | (tm != 0))
            s = tl.where(vis[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(kv.dtype), kv, input_precision=DOT_PRECISION)
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(out_ptr + q_rows[:, None] * C + c[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=h_in[:, None] & c_in[None, :])

    return (mla_attention_kernel,)


def __getattr__(name: str):
    if name == "mla_attention_kernel":
        return _build()[0]
    raise AttributeError(name)


def mla_attention_reference(q_lat: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                            context_slots: torch.Tensor, visible: torch.Tensor, scale: float) -> torch.Tensor:
    """Absorbed MLA attention (PyTorch): gather each sequence's context, masked fp32 softmax, latent output.

    Args:
        q_lat: [B, T, nh, C] absorbed queries (q_nope · W_UK), C = kv_lora_rank.
        q_pe: [B, T, nh, R] roped query parts, R = qk_rope_head_dim.
        kv_cache: [num_slots, C + R] one layer's paged cache (c_kv, then k_pe).
        context_slots: [B, S] int64 the slot of every key position; visible: [B, 1, T, S] bool.
        scale: softmax scale.
    Returns:
        o_lat [B, T, nh, C] in q_lat's dtype (scores and softmax in fp32, products in q_lat's dtype).
    """
    lora, rope_d = q_lat.shape[-1], q_pe.shape[-1]
    # Gather each sequence's context through its block table: [B, S, lora + rope], S = max_blocks · block_size.
    ctx = kv_cache[context_slots].to(q_lat.dtype)
    ctx_kv, ctx_pe = ctx.split([lora, rope_d], dim=-1)
    scores = (torch.einsum("btnc,bsc->bnts", q_lat, ctx_kv)
              + torch.einsum("btnr,bsr->bnts", q_pe, ctx_pe)).float() * scale  # [B, nh, T, S]
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = F.softmax(scores, dim=-1).to(q_lat.dtype)
    return torch.einsum("bnts,bsc->btnc", probs, ctx_kv)  # [B, T, nh, lora]


def _attention(q_lat: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
               positions: torch.Tensor, block_size: int, scale: float, tree_start: torch.Tensor,
               tree_mask: torch.Tensor, is_tree: bool) -> torch.Tensor:
    b, t, nh, c = q_lat.shape
    r = q_pe.shape[-1]
    if is_tree and tree_mask.dim() == 2:  # one tree for the batch: [L, L] → [B, L, L]
        tree_mask = tree_mask.expand(b, *tree_mask.shape)
    # Row-major [B, T, nh, C] as the kernel writes it (empty_like would copy q_lat's strides: an einsum's
    # output is often a permuted view)
    out = torch.empty(q_lat.shape, dtype=q_lat.dtype, device=q_lat.device)
    block_h = min(_BLOCK_H, next_pow2(nh, 16))
    precision = "ieee" if q_lat.dtype == torch.float32 else "tf32"
    launch(_build()[0])[(b * t, cdiv(nh, block_h))](
        q_lat.contiguous(), q_pe.contiguous(), kv_cache, block_tables.contiguous(), positions.contiguous(),
        tree_start.contiguous(), tree_mask.to(torch.int8).contiguous(), out, scale, t, nh, c, r, kv_cache.stride(0),
        block_tables.shape[1], block_size, tree_mask.shape[-1], IS_TREE=is_tree, DOT_PRECISION=precision,
        BLOCK_H=block_h, BLOCK_C=next_pow2(c, 16), BLOCK_R=next_pow2(r, 16), BLOCK_N=_BLOCK_N)
    return out


def _causal(q_lat: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
            positions: torch.Tensor, block_size: int, scale: float) -> torch.Tensor:
    none = positions.new_zeros(1)
    return _attention(q_lat, q_pe, kv_cache, block_tables, positions, block_size, scale, none, none, False)


def _tree(q_lat: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
          positions: torch.Tensor, block_size: int, scale: float, tree_start: torch.Tensor,
          tree_mask: torch.Tensor) -> torch.Tensor:
    return _attention(q_lat, q_pe, kv_cache, block_tables, positions, block_size, scale, tree_start, tree_mask, True)


_causal_op = register_op("mla_attention", _causal)
_tree_op = register_op("mla_tree_attention", _tree)


def mla_attention_triton(q_lat: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                         positions: torch.Tensor, block_size: int, scale: float, tree_start: torch.Tensor | None = None,
                         tree_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Launcher: q_lat [B, T, nh, C], q_pe [B, T, nh, R], kv_cache [num_slots, C + R] (row-contiguous),
    block_tables [B, max_blocks] int64, positions [B, T] int64 → o_lat [B, T, nh, C] (q_lat's dtype).
    Causal unless tree_start [B] int64 (kv_len) and tree_mask are given: [L, L] bool, one tree for the batch
    (then T = L), or [B, T, L] bool per request (T queries over L tree keys at kv_len..kv_len+L−1)."""
    if tree_mask is None:
        return _causal_op(q_lat, q_pe, kv_cache, block_tables, positions, block_size, scale)
    return _tree_op(q_lat, q_pe, kv_cache, block_tables, positions, block_size, scale, tree_start, tree_mask)


def mla_attention(q_lat: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, meta, scale: float) -> torch.Tensor:
    """MLA attention for one layer and one `AttentionMetadata`: the kernel where it can run, else the reference.

    Args: as `mla_attention_reference`; meta gives block_tables, positions, block_size and, for a tree forward,
    tree_start / tree_mask (else context_slots and visible for the reference). Returns o_lat [B, T, nh, C].
    """
    if use_kernel(q_lat, q_pe, kv_cache) and kv_cache.stride(-1) == 1:
        return mla_attention_triton(q_lat, q_pe, kv_cache, meta.block_tables, meta.positions, meta.block_size, scale,
                                    meta.tree_start, meta.tree_mask)
    return mla_attention_reference(q_lat, q_pe, kv_cache, meta.context_slots, meta.visible, scale)
