"""Medusa tree kernels: the tree attention mask over the paged context, and the candidate gather.

Source: Cai et al. 2024 ("Medusa") §2.1.2 (tree attention, candidates from the heads' top-k); tree buffers from
`nextn.speculative.medusa_tree`. References: `tree_visibility_reference` (the mask `AttentionMetadata.create_tree`
builds) and `tree_candidates_reference` (`MedusaDrafter.tree_from`'s gather).

Tree tokens sit at cache positions kv_len..kv_len+L−1 (by token index); token i sees every key before kv_len and
the tree tokens j with tree_mask[i, j] (its ancestors and itself), nothing else. The mask is one tree for the
batch ([L, L], Medusa) or one per request and possibly rectangular ([B, Q, L]: Q query tokens over L tree keys —
an MTP tree's per-request dynamic tree, or the queries of one depth; speculative/mtp_tree.py). The next tree's
tokens are [root, head 0 top-k, head 1 top-k, ...] picked by the tree's candidate index.
"""

from __future__ import annotations

import functools

import torch

from nextn.plugins.kernels.dispatch import cdiv, launch, next_pow2, register_op, use_kernel

__all__ = ["tree_visibility", "tree_visibility_triton", "tree_visibility_reference", "tree_candidates",
           "tree_candidates_triton", "tree_candidates_reference"]

_BLOCK_S = 256


@functools.cache
def _build():
    global tl
    import triton
    import triton.language as tl

    @triton.jit
    def tree_visibility_kernel(kv_lens_ptr, tree_mask_ptr, visible_ptr, Q, L, S, BLOCK_S: tl.constexpr):
        """Program (b, i, c): visible[b, i, c·BLOCK_S …] for query token i of request b (mask [B, Q, L])."""
        b = tl.program_id(0)
        i = tl.program_id(1)
        keys = tl.program_id(2) * BLOCK_S + tl.arange(0, BLOCK_S)
        inside = keys < S
        rel = keys - tl.load(kv_lens_ptr + b)
        in_tree = (rel >= 0) & (rel < L)
        m = tl.load(tree_mask_ptr + (b * Q + i) * L + tl.minimum(tl.maximum(rel, 0), L - 1), mask=inside, other=0)
        vis = (rel < 0) | (in_tree & (m != 0))
        tl.store(visible_ptr + (b * Q + i).to(tl.int64) * S + keys, vis, mask=inside)

    @triton.jit
    def tree_candidates_kernel(root_ptr, topk_ptr, index_ptr, out_ptr, B, L, TOPK, BLOCK_L: tl.constexpr):
        """Request b: out[b, i] = candidates[b, index[i]], candidates = [root, topk[0, b], topk[1, b], ...]."""
        b = tl.program_id(0)
        i = tl.arange(0, BLOCK_L)
        inside = i < L
        c = tl.load(index_ptr + i, mask=inside, other=0)
        head = tl.maximum(c - 1, 0) // TOPK
        rank = tl.maximum(c - 1, 0) % TOPK
        cand = tl.load(topk_ptr + (head * B + b) * TOPK + rank, mask=inside & (c > 0), other=0)
        root = tl.load(root_ptr + b)
        tl.store(out_ptr + b * L + i, tl.where(c == 0, root, cand), mask=inside)

    return tree_visibility_kernel, tree_candidates_kernel


def __getattr__(name: str):
    kernels = ("tree_visibility_kernel", "tree_candidates_kernel")
    if name in kernels:
        return _build()[kernels.index(name)]
    raise AttributeError(name)


def tree_visibility_reference(kv_lens: torch.Tensor, tree_mask: torch.Tensor, max_context: int) -> torch.Tensor:
    """Which keys each tree token sees (PyTorch).

    Args:
        kv_lens: [B] int64 cached tokens before the tree.
        tree_mask: [L, L] bool (one tree for the batch) or [B, Q, L] bool (per request; Q query tokens over the L
            tree keys); tree_mask[(b,) i, j]: query token i sees tree token j.
        max_context: S, the keys gathered per sequence (max_blocks · block_size).
    Returns:
        [B, Q, S] bool (Q = L for a square mask): key position s < kv_len, or s = kv_len + j with tree_mask[i, j].
    """
    s, n = max_context, tree_mask.shape[-1]
    mask = _per_request(tree_mask, kv_lens.shape[0])  # [B, Q, L]
    rel = torch.arange(s, device=kv_lens.device)[None, :] - kv_lens[:, None]  # [B, S] key index in the tree
    in_tree = (rel >= 0) & (rel < n)
    tree_vis = mask.gather(2, rel.clamp(0, n - 1)[:, None, :].expand(-1, mask.shape[1], -1))  # [B, Q, S]
    return (rel < 0)[:, None, :] | (in_tree[:, None, :] & tree_vis)


def _per_request(tree_mask: torch.Tensor, batch: int) -> torch.Tensor:
    """A tree mask as [B, Q, L]: a shared [L, L] mask expanded (no copy), a per-request one as it is."""
    return tree_mask.expand(batch, *tree_mask.shape) if tree_mask.dim() == 2 else tree_mask


def _tree_visibility(kv_lens: torch.Tensor, tree_mask: torch.Tensor, max_context: int) -> torch.Tensor:
    mask = _per_request(tree_mask, kv_lens.shape[0]).to(torch.int8).contiguous()  # [B, Q, L]
    b, q, n = mask.shape
    visible = torch.empty(b, q, max_context, dtype=torch.bool, device=kv_lens.device)
    # A fixed block: max_context follows the widest block table, so it may be symbolic under torch.compile.
    launch(_build()[0])[(b, q, cdiv(max_context, _BLOCK_S))](
        kv_lens.contiguous(), mask, visible, q, n, max_context, BLOCK_S=_BLOCK_S)
    return visible


def tree_candidates_reference(root: torch.Tensor, topk_ids: torch.Tensor, candidate_index: torch.Tensor
                              ) -> torch.Tensor:
    """The next tree's tokens (PyTorch).

    Args:
        root: [B, 1] int64 the last emitted token.
        topk_ids: [D, B, topk] int64 each head's top-k token ids at the last accepted position.
        candidate_index: [L] int64 (`TreeBuffers.candidate_index`), entries in [0, D·topk].
    Returns:
        [B, L] int64 tree tokens (the root first).
    """
    candidates = torch.cat([root, topk_ids.permute(1, 0, 2).reshape(root.shape[0], -1)], dim=1)
    return candidates[:, candidate_index]


def _tree_candidates(root: torch.Tensor, topk_ids: torch.Tensor, candidate_index: torch.Tensor) -> torch.Tensor:
    d, b, k = topk_ids.shape
    n = candidate_index.shape[0]
    out = torch.empty(b, n, dtype=torch.int64, device=root.device)
    launch(_build()[1])[(b,)](root.contiguous(), topk_ids.contiguous(), candidate_index.contiguous(), out, b, n, k,
                              BLOCK_L=next_pow2(n, 2))
    return out


_tree_visibility_op = register_op("tree_visibility", _tree_visibility)
_tree_candidates_op = register_op("tree_candidates", _tree_candidates)


def tree_visibility_triton(kv_lens: torch.Tensor, tree_mask: torch.Tensor, max_context: int) -> torch.Tensor:
    """Launcher (one program per tree token and 256 keys): as `tree_visibility_reference`."""
    return _tree_visibility_op(kv_lens, tree_mask, max_context)


def tree_visibility(kv_lens: torch.Tensor, tree_mask: torch.Tensor, max_context: int) -> torch.Tensor:
    """The tree attention mask [B, Q, S] bool (tree_mask [L, L] or [B, Q, L]): the kernel where it can run, else
    the reference."""
    if use_kernel(kv_lens, tree_mask):
        return tree_visibility_triton(kv_lens, tree_mask, max_context)
    return tree_visibility_reference(kv_lens, tree_mask, max_context)


def tree_candidates_triton(root: torch.Tensor, topk_ids: torch.Tensor, candidate_index: torch.Tensor
                           ) -> torch.Tensor:
    """Launcher (one program per request): as `tree_candidates_reference`."""
    return _tree_candidates_op(root, topk_ids, candidate_index)


def tree_candidates(root: torch.Tensor, topk_ids: torch.Tensor, candidate_index: torch.Tensor) -> torch.Tensor:
    """The next tree's tokens [B, L] int64: the kernel where it can run, else the reference."""
    if use_kernel(root, topk_ids, candidate_index):
        return tree_candidates_triton(root, topk_ids, candidate_index)
    return tree_candidates_reference(root, topk_ids, candidate_index)
