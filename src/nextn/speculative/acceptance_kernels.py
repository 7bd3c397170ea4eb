"""Acceptance kernels: strict, relaxed and rejection-sampling verification of the drafts, one row per program.

References (bit-identical integers): `nextn.speculative.acceptance_reference` (`strict_acceptance`,
`relaxed_acceptance`, `rejection_sampling` with argmax or explicit drafts). Sources: Leviathan et al. 2023 §2.3 and
Chen et al. 2023 Alg. 2 (rejection sampling), arXiv:2412.19437 §2.2 and TensorRT-LLM's MTP blog (its strict
and relaxed acceptance).

Two launches per rule, both fixed-grid: a row kernel over [B, K+1] (one program per target position: a pass over
the vocabulary in `BLOCK_V` chunks) writes the fallback token of each position and whether its draft passes; an
emit kernel over [B] turns those into tokens and num_emitted (accepted = the leading run of passes).
`acceptance_rules` calls these launchers on CUDA tensors and the references elsewhere (`dispatch.use_kernel`).

Exactness notes. Strict: the first index of the maximum (torch's argmax). Relaxed: a draft d is in the top-k when
fewer than k tokens rank before it (a larger logit, or an equal logit at a smaller id: the reference's topk on
ties), and close when exp(l_d − m)/Z ≥ 1/Z − delta; Z is summed in another order than torch's softmax, so only a
draft within an ulp of the threshold could differ. Rejection: the inverse-CDF draw accumulates the CDF in fp64
and rounds it to fp32, as torch's CPU cumsum does, then counts CDF entries ≤ u · total like the reference.
"""

from __future__ import annotations

import functools

import torch

from nextn.plugins.kernels.dispatch import launch, next_pow2, register_op

__all__ = ["strict_acceptance_triton", "relaxed_acceptance_triton", "rejection_sampling_triton"]

_BLOCK_V = 1024


@functools.cache
def _build():
    global tl
    import triton
    import triton.language as tl

    @triton.jit
    def accept_rows_kernel(logits_ptr, drafts_ptr, delta_ptr, top1_ptr, hit_ptr, V, K, TOPK,
                           RELAXED: tl.constexpr, BLOCK_V: tl.constexpr):
        """Row (b, j) of logits [B, K+1, V]: top1[b, j] (first argmax); hit[b, j] for j < K (draft passes)."""
        b = tl.program_id(0)
        j = tl.program_id(1)
        row = logits_ptr + (b * (K + 1) + j).to(tl.int64) * V
        has_draft = j < K
        d = tl.load(drafts_ptr + b * K + j, mask=has_draft, other=0)
        d_logit = tl.load(row + d).to(tl.float32)
        m = float("-inf")
        z = 0.0
        arg = 0
        rank = 0
        for start in range(0, V, BLOCK_V):
            offs = start + tl.arange(0, BLOCK_V)
            inside = offs < V
            x = tl.load(row + offs, mask=inside, other=float("-inf")).to(tl.float32)
            c_max = tl.max(x, axis=0)
            c_arg = tl.argmax(x, axis=0, tie_break_left=True) + start
            if RELAXED:
                m_new = tl.maximum(m, c_max)
                alpha = tl.where(m == m_new, 1.0, tl.exp(m - m_new))
                z = z * alpha + tl.sum(tl.where(inside, tl.exp(x - m_new), 0.0), axis=0)
                before = (x > d_logit) | ((x == d_logit) & (offs < d))
                rank += tl.sum((before & inside).to(tl.int32), axis=0)
            arg = tl.where(c_max > m, c_arg, arg)
            m = tl.maximum(m, c_max)
        tl.store(top1_ptr + b * (K + 1) + j, arg.to(tl.int64))
        if RELAXED:
            delta = tl.load(delta_ptr + b)
            hit = (rank < TOPK) & (tl.exp(d_logit - m) / z >= 1.0 / z - delta)
        else:
            hit = arg == d
        tl.store(hit_ptr + b * K + j, hit.to(tl.int8), mask=has_draft)

    @triton.jit
    def rejection_rows_kernel(p_ptr, q_ptr, drafts_ptr, accept_u_ptr, sample_u_ptr, drawn_ptr, hit_ptr, V, K,
                              HAS_Q: tl.constexpr, BLOCK_V: tl.constexpr):
        """Row (b, j) of target probs [B, K+1, V]: drawn[b, j] from the residual (j < K) or from p (the bonus,
        j = K); hit[b, j] = accept_u < min(1, p(d) / q(d))."""
        b = tl.program_id(0)
        j = tl.program_id(1)
        base = (b * (K + 1) + j).to(tl.int64) * V
        qbase = (b * K + j).to(tl.int64) * V
        has_draft = j < K
        d = tl.load(drafts_ptr + b * K + j, mask=has_draft, other=-1)
        # Pass 1: does the residual have mass; the fp64 totals of residual and p.
        res_max = 0.0
        res_sum = tl.zeros([1], dtype=tl.float64)
        p_sum = tl.zeros([1], dtype=tl.float64)
        for start in range(0, V, BLOCK_V):
            offs = start + tl.arange(0, BLOCK_V)
            inside = offs < V
            p = tl.load(p_ptr + base + offs, mask=inside, other=0.0)
            if HAS_Q:
                q = tl.load(q_ptr + qbase + offs, mask=inside & has_draft, other=0.0)
                res = tl.maximum(p - q, 0.0)
            else:
                res = tl.where(offs == d, 0.0, p)
            res = tl.where(has_draft, res, p)
            res_max = tl.maximum(res_max, tl.max(res, axis=0))
            res_sum += tl.sum(res.to(tl.float64), axis=0)
            p_sum += tl.sum(p.to(tl.float64), axis=0)
        use_res = res_max > 0.0
        total = tl.where(use_res, res_sum, p_sum).to(tl.float32)
        u = tl.load(sample_u_ptr + b * (K + 1) + j)
        target = u * total
        # Pass 2: count CDF entries (fp64 running sum rounded to fp32) ≤ target.
        carry = tl.zeros([1], dtype=tl.float64)
        count = 0
        for start in range(0, V, BLOCK_V):
            offs = start + tl.arange(0, BLOCK_V)
            inside = offs < V
            p = tl.load(p_ptr + base + offs, mask=inside, other=0.0)
            w = p
            if HAS_Q:
                q = tl.load(q_ptr + qbase + offs, mask=inside & has_draft, other=0.0)
                w = tl.where(use_res, tl.maximum(p - q, 0.0), p)
            else:
                w = tl.where(offs == d, tl.where(use_res, 0.0, p), p)
            cdf = tl.cumsum(w.to(tl.float64), axis=0) + carry
            count += tl.sum(((cdf.to(tl.float32) <= target) & inside).to(tl.int32), axis=0)
            carry += tl.sum(w.to(tl.float64), axis=0)
        tl.store(drawn_ptr + b * (K + 1) + j, tl.minimum(count, V - 1).to(tl.int64))
        # The accept test of draft j.
        p_d = tl.load(p_ptr + base + d, mask=has_draft, other=0.0)
        if HAS_Q:
            q_d = tl.load(q_ptr + qbase + d, mask=has_draft, other=1.0)
            ratio = p_d / tl.maximum(q_d, 1e-20)
        else:
            ratio = p_d
        a = tl.load(accept_u_ptr + b * K + j, mask=has_draft, other=1.0)
        tl.store(hit_ptr + b * K + j, (a < ratio).to(tl.int8), mask=has_draft)

    @triton.jit
    def emit_kernel(hit_ptr, drafts_ptr, fallback_ptr, tokens_ptr, num_emitted_ptr, K, BLOCK_K: tl.constexpr):
        """Request b: num_accepted = leading passes of hit[b, :K]; tokens = drafts before it, fallback after."""
        b = tl.program_id(0)
        j = tl.arange(0, BLOCK_K)
        hit = tl.load(hit_ptr + b * K + j, mask=j < K, other=0)
        n = tl.min(tl.where((hit == 0) & (j < K), j, K), axis=0)
        draft = tl.load(drafts_ptr + b * K + j, mask=j < K, other=0)
        fallback = tl.load(fallback_ptr + b * (K + 1) + j, mask=j <= K, other=0)
        tl.store(tokens_ptr + b * (K + 1) + j, tl.where(j < n, draft, fallback), mask=j <= K)
        tl.store(num_emitted_ptr + b, (n + 1).to(tl.int64))

    return accept_rows_kernel, rejection_rows_kernel, emit_kernel


def __getattr__(name: str):
    kernels = ("accept_rows_kernel", "rejection_rows_kernel", "emit_kernel")
    if name in kernels:
        return _build()[kernels.index(name)]
    raise AttributeError(name)


def _drafts_or_dummy(draft_tokens: torch.Tensor) -> torch.Tensor:
    """K = 0 has no drafts: hand the kernels a one-column placeholder they never read (masked)."""
    if draft_tokens.shape[1] == 0:
        return draft_tokens.new_zeros(draft_tokens.shape[0], 1)
    return draft_tokens.contiguous()


def _emit(hit: torch.Tensor, drafts: torch.Tensor, fallback: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    b = fallback.shape[0]
    tokens = torch.empty_like(fallback)
    num_emitted = torch.empty(b, dtype=torch.int64, device=fallback.device)
    launch(_build()[2])[(b,)](hit, drafts, fallback, tokens, num_emitted, k, BLOCK_K=next_pow2(k + 1, 2))
    return tokens, num_emitted


def _accept_rows(target_logits: torch.Tensor, draft_tokens: torch.Tensor, delta: torch.Tensor, topk: int,
                 relaxed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    b, w, v = target_logits.shape
    k = w - 1
    logits = target_logits.contiguous()
    drafts = _drafts_or_dummy(draft_tokens)
    top1 = torch.empty(b, w, dtype=torch.int64, device=logits.device)
    hit = torch.empty(b, max(k, 1), dtype=torch.int8, device=logits.device)
    launch(_build()[0])[(b, w)](logits, drafts, delta, top1, hit, v, k, topk, RELAXED=relaxed,
                                BLOCK_V=min(_BLOCK_V, next_pow2(v, 16)))
    return _emit(hit, drafts, top1, k)


def _strict_triton(target_logits: torch.Tensor, draft_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    b = target_logits.shape[0]
    delta = torch.zeros(b, dtype=torch.float32, device=target_logits.device)  # unread by the strict kernel
    return _accept_rows(target_logits, draft_tokens, delta, 1, relaxed=False)


def _relaxed_triton(target_logits: torch.Tensor, draft_tokens: torch.Tensor, delta: torch.Tensor,
                    topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _accept_rows(target_logits, draft_tokens, delta.float().contiguous(), topk, relaxed=True)


def _rejection_triton(target_probs: torch.Tensor, draft_tokens: torch.Tensor, accept_u: torch.Tensor,
                      sample_u: torch.Tensor, draft_probs: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    b, w, v = target_probs.shape
    k = w - 1
    p = target_probs.float().contiguous()
    has_q = draft_probs is not None
    q = draft_probs.float().contiguous() if draft_probs is not None else p
    drafts = _drafts_or_dummy(draft_tokens)
    a_u = accept_u.float().contiguous() if k else p.new_ones(b, 1)
    drawn = torch.empty(b, w, dtype=torch.int64, device=p.device)
    hit = torch.empty(b, max(k, 1), dtype=torch.int8, device=p.device)
    launch(_build()[1])[(b, w)](p, q, drafts, a_u, sample_u.float().contiguous(), drawn, hit, v, k, HAS_Q=has_q,
                                BLOCK_V=min(_BLOCK_V, next_pow2(v, 16)))
    return _emit(hit, drafts, drawn, k)


def _rejection_argmax_triton(target_probs: torch.Tensor, draft_tokens: torch.Tensor, accept_u: torch.Tensor,
                             sample_u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _rejection_triton(target_probs, draft_tokens, accept_u, sample_u, None)


def _rejection_q_triton(target_probs: torch.Tensor, draft_tokens: torch.Tensor, accept_u: torch.Tensor,
                        sample_u: torch.Tensor, draft_probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _rejection_triton(target_probs, draft_tokens, accept_u, sample_u, draft_probs)


_strict_op = register_op("strict_acceptance", _strict_triton)
_relaxed_op = register_op("relaxed_acceptance", _relaxed_triton)
_rejection_argmax_op = register_op("rejection_sampling", _rejection_argmax_triton)
_rejection_q_op = register_op("rejection_sampling_draft_probs", _rejection_q_triton)


def strict_acceptance_triton(target_logits: torch.Tensor, draft_tokens: torch.Tensor
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Launcher of strict acceptance, as `acceptance_reference.strict_acceptance`: logits [B, K+1, V] float, drafts
    [B, K] int64 → (target tokens [B, K+1] int64, the argmax at every position; num_emitted [B] int64 in [1, K+1])."""
    return _strict_op(target_logits, draft_tokens)


def relaxed_acceptance_triton(target_logits: torch.Tensor, draft_tokens: torch.Tensor, delta: torch.Tensor,
                              topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Launcher of relaxed acceptance: logits [B, K+1, V], drafts [B, K] int64, delta [B] fp32, topk ≥ 1 →
    (tokens [B, K+1] int64, num_emitted [B] int64), as `acceptance_reference.relaxed_acceptance`."""
    return _relaxed_op(target_logits, draft_tokens, delta, topk)


def rejection_sampling_triton(target_probs: torch.Tensor, draft_tokens: torch.Tensor, accept_u: torch.Tensor,
                              sample_u: torch.Tensor, draft_probs: torch.Tensor | None = None
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Launcher of rejection sampling: probs [B, K+1, V] fp32, drafts [B, K] int64, accept_u [B, K] and sample_u
    [B, K+1] fp32 uniforms (`counter_uniform`), draft_probs [B, K, V] or None (argmax drafts) → (tokens [B, K+1]
    int64, num_emitted [B] int64), as `acceptance_reference.rejection_sampling`."""
    if draft_probs is None:
        return _rejection_argmax_op(target_probs, draft_tokens, accept_u, sample_u)
    return _rejection_q_op(target_probs, draft_tokens, accept_u, sample_u, draft_probs)

