"""MTP with a draft tree: the module's top-k drafts expanded into a tree and verified in one batched step.

Sources: Li et al. 2024, "EAGLE-2" §4 (dynamic trees: expand the top-k nodes by cumulative draft probability,
rerank to a node budget); Miao et al. 2024, "SpecInfer" §4 (tree verification, multi-step speculative sampling);
the Medusa tree step (speculative/medusa.py) for the paged-cache layout and KV compaction; TensorRT-LLM's
`eagle_choices` / `use_dynamic_tree` / `dynamic_tree_max_topK` / `max_total_draft_tokens` for the names. TensorRT-LLM's
MTP is chain-only; here MTP Eagle (one module applied once per depth) drafts a tree, on MLA and Llama-family
targets alike. Fixed shapes per (batch, tree width), no host synchronisation.

One decode step for B requests, a tree of N tokens (root = the last emitted token at position L = kv_len):

    target(tree tokens at cache positions L..L+N−1, rope positions L + depth, tree attention)      [B, N, H]
    target token per node (argmax, or one draw from p per depth) → longest accepted path       speculative/draft_tree
    KV of the path's nodes copied to L..L+a (a = accepted drafts); the rest is dead
    module 1 over the path rows at L..L+D (as MTP Eagle's first pass: its KV at the accepted positions from the
      target's hidden states) → h at the last accepted row, the new root's expansion
    expansion, depth d = 1..D−1: module 1 over the depth-d nodes at once, rope position R + d − 1 (R = the new
      root's position), node i's module KV at cache position R − 1 + i (the root's row is the first pass's at
      R − 1), each node seeing the module's KV before R − 1 and its own ancestors only (a per-depth tree mask)

A static tree (`eagle_choices`) takes each node's token from its parent's top-k at the node's rank. A dynamic
tree (`use_dynamic_tree`) keeps a beam of the k best nodes per depth by cumulative log-probability, expands each
into its top-k children, and verifies the best `max_total_draft_tokens` of all candidates (EAGLE-2), ordered by
score so that the first w nodes are the best w-node tree; its shape (parents, depth) is per request drafter state.
The module's KV written while drafting pairs a draft with the module's own hidden state, as in the chain; the next
step's first pass rewrites every accepted position from the target's, so no draft-time KV survives a step. With
the tree `chain_choices(K)` the drafts are exactly MTP Eagle's chain (tested).

A step verifying w < N tokens (draft-length policy) verifies the tree's first w tokens, a tree itself (the dynamic
tree's best w; a static tree's first w in `eagle_choices`' order, so list it best first); w = 1 (off, or
re-priming the drafts) is the chain step with no drafts. The step is the tree step (speculative/tree_step.py).
"""

from __future__ import annotations

import torch

from nextn.config.llm_args import LlmArgsError, MTPDecodingConfig
from nextn.speculative.draft_tree import (StaticTree, ancestor_mask, check_tree_fits, select_dynamic_tree, static_tree,
                                      tree_accept)
from nextn.speculative.medusa_tree import TreeError
from nextn.speculative.protocol import NO_PREFILL, SamplingTensors, TreeLayout
from nextn.speculative.acceptance_rules import StandardAcceptance, sample_tokens
from nextn.models.attention_metadata import AttentionMetadata, slots_for_positions
from nextn.speculative.draft_gain import TreeGain, prior_tree
from nextn.speculative.protocol import NO_CONTEXT, DrafterState, rows_at
from nextn.speculative.tree_step import TreeDrafterBase
from nextn.speculative.traits import DraftKV, DrafterTraits

DEFAULT_TREE_NODES = 15  # max_total_draft_tokens when null: 16 verified tokens per request with the root


class MtpTreeAcceptance(StandardAcceptance):
    """Lossless tree acceptance: greedy requests keep the longest path the target's argmax accepts; sampling
    requests draw one token per depth from the target (counter-based, position-keyed: the draws plain decoding
    makes) and descend while it is a child (`speculative.draft_tree.tree_accept`). Steps without a tree (width 1) use
    `StandardAcceptance`."""

    def accept_tree(self, logits: torch.Tensor, tree_tokens: torch.Tensor, layout: TreeLayout, kv_lens: torch.Tensor,
                    sampling: SamplingTensors) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(path [B, D+1], num_accepted [B], tokens [B, D+1]) for logits [B, N, V] fp32 over the tree tokens
        [B, N]; the token drawn at a node of depth t lands at position kv_len + 1 + t."""
        target = sample_tokens(logits, kv_lens[:, None] + 1 + layout.depth.expand_as(tree_tokens), sampling)
        return tree_accept(target, tree_tokens, layout.parents, layout.depth, layout.max_depth)


class MtpTreeDrafter(TreeDrafterBase):
    """MTP Eagle drafting a tree: module 1's first pass over the accepted rows, then one pass per tree depth."""

    name = "MtpTree"
    # module 1's KV at p pairs embed(x_{p+1}) with h_p
    traits = DrafterTraits(kv=DraftKV.FROM_HIDDEN, key_lookahead=1, draft_head=True, tree=True)
    gain: TreeGain  # the expected tokens of the tree's first k nodes (each subclass's tree)

    def __init__(self, max_depth: int, num_nodes: int) -> None:
        self.max_draft_depth = max_depth  # D: the most drafts one step can accept
        self.num_draft_tokens = num_nodes  # N − 1 draft nodes verified per step (the draft-length unit)

    def initial_state(self, batch: int, hidden_size: int, device: torch.device, dtype: torch.dtype) -> DrafterState:
        raise NotImplementedError  # each tree shape's own

    def expand(self, model, kv_cache, meta, h_root: torch.Tensor, base: torch.Tensor):
        raise NotImplementedError  # each tree shape's own

    def stat_draft_len(self, draft_len: int) -> int:
        return min(self.max_draft_depth, draft_len)  # one path of the verified tree can be accepted

    def expected_tokens(self, alpha: float, draft_len: float) -> float:
        """The gain of the tree's first `draft_len` nodes (`self.gain`: a `TreeGain` over its nodes, best first)."""
        return self.gain(alpha, draft_len)

    def _root(self, model, kv_cache: torch.Tensor, meta: AttentionMetadata, hidden: torch.Tensor,
              next_tokens: torch.Tensor, last_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Module 1 over the rows (its KV at their positions); (h at the last row [B, 1, H], the root's module-row
        position R − 1 [B])."""
        h = model.forward_mtp(0, next_tokens, hidden, kv_cache, meta)
        return rows_at(h, last_idx), rows_at(meta.positions, last_idx)[:, 0]

    def after_prefill(self, model, kv_cache, meta, hidden, next_tokens, last_idx, input_ids, state,
                      step=NO_PREFILL):
        draft = step.draft
        h_root, base = self._root(model, kv_cache, meta, hidden, next_tokens, last_idx)
        if not draft:  # the module's KV over the prompt rows only (the tree is drafted when speculation resumes)
            b = next_tokens.shape[0]
            return (next_tokens.new_zeros(b, self.num_draft_tokens),
                    state if state else self.initial_state(b, hidden.shape[-1], hidden.device, hidden.dtype))
        return self.expand(model, kv_cache, meta, h_root, base)

    def after_verify(self, model, kv_cache, meta, hidden, target_tokens, num_emitted, state, step=NO_CONTEXT):
        """Rows: the verified positions in order (a chain step's, or a tree step's accepted path after compaction)."""
        h_root, base = self._root(model, kv_cache, meta, hidden, target_tokens, num_emitted - 1)
        return self.expand(model, kv_cache, meta, h_root, base)

    def after_verify_tree(self, model, kv_cache, meta, hidden, path, tokens, num_accepted, state):
        """`after_verify` over the accepted path's rows, compacted to positions kv_len..kv_len + D."""
        positions = meta.tree_start[:, None] + torch.arange(path.shape[1], device=path.device)  # [B, D+1]
        path_meta = AttentionMetadata.create(positions, slots_for_positions(meta.block_tables, positions,
                                                                            meta.block_size),
                                             meta.block_tables, meta.block_size)
        path_hidden = hidden.gather(1, path[..., None].expand(-1, -1, hidden.shape[-1]))  # [B, D+1, H]
        return self.after_verify(model, kv_cache, path_meta, path_hidden, tokens, num_accepted + 1, state)

    def _depth_meta(self, meta: AttentionMetadata, base: torch.Tensor, depth: int, cols: torch.Tensor,
                    mask: torch.Tensor) -> AttentionMetadata:
        """Queries of one depth: rope position base + depth, module KV at cache positions base + cols [B or 1, n],
        seeing the keys before `base` and the tree keys base + j with mask[(b,) q, j]."""
        b = base.shape[0]
        positions = (base + depth)[:, None].expand(b, cols.shape[-1])
        slots = slots_for_positions(meta.block_tables, base[:, None] + cols, meta.block_size)
        return AttentionMetadata.create_tree(positions, slots, meta.block_tables, meta.block_size, base, mask)


class StaticTreeDrafter(MtpTreeDrafter):
    """A fixed tree of rank paths (`eagle_choices`): node [r1, .., rd] is the rank-rd draft after [r1, .., rd−1]."""

    name = "StaticTree"

    def __init__(self, tree: StaticTree) -> None:
        super().__init__(tree.max_depth, tree.num_tokens - 1)
        self.tree = tree
        paths: list[tuple[int, ...]] = [()]  # by node index ((depth, path) order), then in verification order
        for parent, rank in zip(tree.parents.tolist()[1:], tree.ranks.tolist()[1:]):
            paths.append(paths[parent] + (rank,))
        self.gain = TreeGain([paths[i] for i in tree.order.tolist()[1:]])
        self._layouts = {w: TreeLayout(*tree.verify_layout(w), tree.max_depth) for w in range(2, tree.num_tokens + 1)}

    def initial_state(self, batch, hidden_size, device, dtype) -> DrafterState:
        return ()

    def tree_layout(self, state: DrafterState, width: int) -> TreeLayout:
        """The first w tokens in verification order (`eagle_choices`' order when parents come first: list it best
        first), shared by the batch: parents [w], depth [w], mask [w, w]."""
        return self._layouts[width]

    def expand(self, model, kv_cache, meta, h_root: torch.Tensor, base: torch.Tensor):
        """Drafts [B, N−1] in verification order from the root's module output h_root [B, 1, H]; state ()."""
        tree, starts = self.tree, self.tree.depth_starts
        top = model.mtp_logits(0, h_root).topk(tree.topk, dim=-1).indices  # [B, 1, k]: children of depth 0
        h, drafts = h_root, []
        for d in range(1, tree.max_depth + 1):
            s, e = starts[d], starts[d + 1]
            local = tree.parents[s:e] - starts[d - 1]  # [n_d] parent index within depth d − 1
            tokens = top[:, local, tree.ranks[s:e]]  # [B, n_d]
            drafts.append(tokens)
            if d == tree.max_depth:
                break
            cols = torch.arange(s, e, device=base.device)
            h = model.forward_mtp(0, tokens, model.mtp_chain_hidden(0, h[:, local]), kv_cache,
                                  self._depth_meta(meta, base, d, cols, tree.mask[s:e]))  # [B, n_d, H]
            top = model.mtp_logits(0, h).topk(tree.topk, dim=-1).indices  # [B, n_d, k]
        return torch.cat(drafts, dim=1)[:, tree.order[1:] - 1], ()  # (depth, path) order → verification order


class DynamicTreeDrafter(MtpTreeDrafter):
    """EAGLE-2's dynamic tree: a beam of the `topk` best nodes per depth (cumulative draft log-probability), each
    expanded into its top-k children; the best `num_nodes` of the k + (D−1)·k² candidates are verified.

    The beam's module KV sits in a scratch layout at cache positions R − 1 + s, s = 1 + (d−1)·k + j for beam node
    j of depth d (s = 0: the root's row); per request, each beam node sees the root, its ancestors and itself.
    """

    name = "DynamicTree"

    def __init__(self, topk: int, max_depth: int, num_nodes: int) -> None:
        super().__init__(max_depth, num_nodes)
        self.topk = topk
        self.gain = TreeGain(prior_tree(max_depth, num_nodes, topk))  # its expected shape: best-first, prior ranks
        self.cand_depth = torch.tensor([1] * topk + [d + 1 for d in range(1, max_depth) for _ in range(topk * topk)])

    def initial_state(self, batch, hidden_size, device, dtype) -> DrafterState:
        n = self.num_draft_tokens + 1  # a valid tree (every node a child of the root) until the first prefill
        depth = torch.ones(batch, n, dtype=torch.int64, device=device)
        depth[:, 0] = 0
        return torch.zeros(batch, n, dtype=torch.int64, device=device), depth

    def tree_layout(self, state: DrafterState, width: int) -> TreeLayout:
        """Each request's best w-token tree: parents [B, w], depth [B, w], mask [B, w, w]."""
        parents, depth = state[0][:, :width], state[1][:, :width]
        return TreeLayout(parents, depth, ancestor_mask(parents, self.max_draft_depth), self.max_draft_depth)

    def expand(self, model, kv_cache, meta, h_root: torch.Tensor, base: torch.Tensor):
        """Drafts [B, N−1] (best first) and the tree's (parents [B, N], depth [B, N]) from h_root [B, 1, H]."""
        k, dev = self.topk, base.device
        b, hid = h_root.shape[0], h_root.shape[-1]
        lp, ids = torch.log_softmax(model.mtp_logits(0, h_root)[:, 0], dim=-1).topk(k, dim=-1)  # [B, k]
        beam_score, beam_tok = lp.clamp(max=0.0), ids
        beam_id = torch.arange(1, k + 1, device=dev).expand(b, k)  # 1-based candidate ids (0: the root)
        scores, tokens, parents = [beam_score], [beam_tok], [torch.zeros_like(beam_tok)]
        h_parent = h_root.expand(b, k, hid)
        width = 1 + (self.max_draft_depth - 1) * k
        seen = torch.zeros(b, k, width, dtype=torch.bool, device=dev)
        seen[:, :, 0] = True
        for d in range(1, self.max_draft_depth):
            cols = 1 + (d - 1) * k + torch.arange(k, device=dev)  # the beam's scratch rows
            seen = seen.scatter(2, cols.expand(b, k)[..., None], True)
            h = model.forward_mtp(0, beam_tok, model.mtp_chain_hidden(0, h_parent), kv_cache,
                                  self._depth_meta(meta, base, d, cols, seen))
            lp, ids = torch.log_softmax(model.mtp_logits(0, h), dim=-1).topk(k, dim=-1)  # [B, k, k]
            child_score = (beam_score[:, :, None] + lp.clamp(max=0.0)).flatten(1)  # [B, k²]
            child_tok = ids.flatten(1)
            first = 1 + k + (d - 1) * k * k  # id of this depth's first candidate
            scores.append(child_score)
            tokens.append(child_tok)
            parents.append(beam_id.repeat_interleave(k, dim=1))
            if d == self.max_draft_depth - 1:
                break
            beam_score, pick = child_score.topk(k, dim=1)  # the next beam
            beam_tok, beam_id = child_tok.gather(1, pick), first + pick
            local = (pick // k)[..., None]  # [B, k, 1] the parent's row in this beam
            h_parent = h.gather(1, local.expand(-1, -1, hid))
            seen = seen.gather(1, local.expand(-1, -1, width))
        drafts, tree_parents, depth = select_dynamic_tree(torch.cat(scores, 1), torch.cat(tokens, 1),
                                                          torch.cat(parents, 1), self.cand_depth.to(dev),
                                                          self.num_draft_tokens)
        return drafts, (tree_parents, depth)


def uses_tree(spec: object) -> bool:
    """Whether a speculative config asks for MTP tree drafting."""
    return isinstance(spec, MTPDecodingConfig) and (spec.eagle_choices is not None or spec.use_dynamic_tree)


def tree_drafter(spec: MTPDecodingConfig, num_mtp_modules: int, device: torch.device | str,
                 vocab_size: int | None = None) -> MtpTreeDrafter:
    """The tree drafter for an MTP config with `eagle_choices` or `use_dynamic_tree` (chosen once, at load time).

    Raises:
        LlmArgsError: an engine with more than one MTP module (trees run MTP Eagle), a malformed tree, one deeper
            than num_nextn_predict_layers, larger than 255 nodes or with a rank ≥ `vocab_size` (a top-k index), or a node budget the candidates cannot fill or the KV look-ahead
            cannot hold.
    """
    k_max = spec.num_nextn_predict_layers
    if num_mtp_modules != 1:
        raise LlmArgsError(f"MTP tree drafting applies one module once per depth (MTP Eagle); this engine has "
                           f"{num_mtp_modules} MTP modules (MTP Vanilla): drop eagle_choices / use_dynamic_tree")
    if spec.eagle_choices is not None:
        try:
            tree = static_tree(spec.eagle_choices, vocab_size)
            check_tree_fits("eagle_choices", tree.max_depth, k_max)
        except TreeError as e:
            raise LlmArgsError(f"eagle_choices: {e}") from e
        return StaticTreeDrafter(tree.to(device))
    k = spec.dynamic_tree_max_topK
    if vocab_size is not None and k > vocab_size:
        raise LlmArgsError(f"dynamic_tree_max_topK={k} exceeds the model's vocabulary of {vocab_size} tokens")
    nodes = spec.max_total_draft_tokens or DEFAULT_TREE_NODES
    candidates = k + (k_max - 1) * k * k
    if nodes > candidates:
        raise LlmArgsError(f"max_total_draft_tokens={nodes} exceeds the {candidates} candidates a dynamic tree of "
                           f"depth {k_max} and dynamic_tree_max_topK={k} drafts")
    if k_max + (k_max - 1) * k > 2 * nodes:  # the beam's KV rows must fit the decode look-ahead of 2·nodes + 1
        raise LlmArgsError(f"a dynamic tree of depth {k_max} with dynamic_tree_max_topK={k} needs "
                           f"max_total_draft_tokens ≥ {(k_max + (k_max - 1) * k + 1) // 2}")
    return DynamicTreeDrafter(k, k_max, nodes)
