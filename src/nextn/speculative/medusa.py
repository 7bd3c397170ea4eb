"""Medusa: the drafter that builds candidate trees from the heads, and its tree acceptance rule.

Source: Cai et al. 2024 ("Medusa", §2.1.2 tree attention, §2.3.1 greedy/typical acceptance); FasterDecoding/Medusa.
The step is the batched tree step (speculative/tree_step.py: every request verifies the same tree shape, over the
paged KV cache). Per step, for a tree of L tokens whose root (the last emitted token) sits at L0 = kv_len:

    per path: accepted = longest prefix with candidate[j+1] == argmax at node j; best path per request
    emitted = argmax along the best path up to its last accepted node (accepted drafts + the correction)
    next tree = candidates [emitted last, head_0 top-k, head_1 top-k, ...] gathered by the tree's candidate index,
      the heads applied to the hidden state at the last accepted node
"""

from __future__ import annotations

import torch

from nextn.build.manifest import EngineManifest
from nextn.config.llm_args import LlmArgsError, MedusaDecodingConfig
from nextn.models.medusa import MedusaHeads
from nextn.speculative.acceptance_reference import tree_greedy_acceptance, tree_typical_acceptance
from nextn.speculative.acceptance_rules import StandardAcceptance
from nextn.plugins.kernels.medusa_tree import tree_candidates
from nextn.speculative.medusa_tree import TreeBuffers, TreeError, build_tree, published_tree
from nextn.speculative.method import LoadContext, Method
from nextn.plugins.sampling import STREAM_SAMPLE, counter_uniform, sample_from_probs
from nextn.speculative.protocol import NO_PREFILL, AcceptState, AcceptanceRule, Drafter, SamplingTensors, TreeLayout
from nextn.speculative.draft_gain import TreeGain
from nextn.speculative.protocol import NO_CONTEXT, DrafterState, rows_at
from nextn.speculative.tree_step import TreeDrafterBase
from nextn.speculative.traits import DrafterTraits


class TreeAcceptance:
    """Medusa's acceptance rule over the root-to-leaf paths of `tree` (the drafter's): greedy path matching
    (lossless) for greedy requests, typical acceptance (`posterior_threshold`, `posterior_alpha`; lossy, Medusa-2)
    for sampling requests, whose token at the last accepted node is then drawn from the target. Chosen from the
    Medusa speculative config."""

    def __init__(self, tree: TreeBuffers, posterior_threshold: float = 0.09, posterior_alpha: float = 0.3) -> None:
        self.tree = tree
        self.posterior_threshold, self.posterior_alpha = posterior_threshold, posterior_alpha

    def initial_state(self, batch, device) -> AcceptState:
        return ()

    def prompt_state(self, token_ids) -> tuple[float, ...]:
        return ()

    def observe(self, tokens, num_emitted, state):
        return state

    def accept(self, logits, draft_tokens, first_position, sampling, state, draft_probs=None):
        """A chain of drafts (`AcceptanceRule.accept`; a tree step of width 1): the standard rule's tokens."""
        return StandardAcceptance().accept(logits, draft_tokens, first_position, sampling, state, draft_probs)

    def accept_tree(self, logits: torch.Tensor, tree_tokens: torch.Tensor, layout: TreeLayout, kv_lens: torch.Tensor,
                    sampling: SamplingTensors) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(path [B, D+1], num_accepted [B], emitted tokens along it [B, D+1]) for logits [B, L, V] over the whole
        tree (`TreeAcceptanceRule.accept_tree`); the path is the best of the tree's paths, padded with 0."""
        tree = self.tree
        target = logits.argmax(dim=-1)  # [B, L]
        best, n = tree_greedy_acceptance(target, tree_tokens, tree.paths, tree.path_valid)
        tokens = target[:, tree.paths].gather(1, best[:, None, None].expand(-1, 1, tree.paths.shape[1])).squeeze(1)
        if not sampling.any_sampled:
            return tree.paths[best], n, tokens
        probs = sampling.probs(logits)  # [B, L, V]
        t_best, t_n = tree_typical_acceptance(probs, tree_tokens, tree.paths, tree.path_valid,
                                              self.posterior_threshold, self.posterior_alpha)
        t_path = tree.paths[t_best]  # [B, D+1]
        accepted = tree_tokens.gather(1, t_path)  # candidates along the path; entry 0 is the root
        steps = torch.arange(t_path.shape[1], device=logits.device)
        u = counter_uniform(sampling.seed, kv_lens[:, None] + 1 + steps, STREAM_SAMPLE)
        drawn = sample_from_probs(probs.gather(1, t_path[..., None].expand(-1, -1, probs.shape[-1])), u)  # [B, D+1]
        t_tokens = torch.where(steps[None, :] < t_n[:, None], torch.roll(accepted, -1, dims=1), drawn)
        greedy = sampling.temperature <= 0
        return (tree.paths[torch.where(greedy, best, t_best)], torch.where(greedy, n, t_n),
                torch.where(greedy[:, None], tokens, t_tokens))


class MedusaDrafter(TreeDrafterBase):
    """Drafts a whole candidate tree (L − 1 tokens) from the Medusa heads at the last accepted position."""

    name = "Medusa"
    traits = DrafterTraits(tree=True)  # no KV of its own; its heads have their own vocabulary projection

    def __init__(self, heads: MedusaHeads, tree: TreeBuffers) -> None:
        if tree.max_depth > len(heads):
            raise ValueError(f"the Medusa tree is {tree.max_depth} deep but the engine has {len(heads)} heads")
        self.heads = heads
        self.tree = tree
        self._layout = TreeLayout(tree.parents, tree.depth, tree.mask, tree.max_depth)
        self.num_draft_tokens = tree.num_tokens - 1
        self.max_draft_depth = tree.max_depth
        depth, mask = tree.depth.tolist(), tree.mask.tolist()
        rank = [c - 1 - (d - 1) * tree.topk for c, d in zip(tree.candidate_index.tolist(), depth)]
        self.gain = TreeGain([tuple(rank[j] for j in sorted((j for j in range(1, len(depth)) if mask[i][j]),
                                                            key=depth.__getitem__)) for i in range(1, len(depth))])


    def stat_draft_len(self, draft_len: int) -> int:
        return self.max_draft_depth  # the whole tree is verified every step; one path of it can be accepted

    def expected_tokens(self, alpha: float, draft_len: float) -> float:
        """The whole tree's `TreeGain` (every step verifies all of it, whatever `draft_len`)."""
        return self.gain(alpha, self.num_draft_tokens)

    def initial_state(self, batch, hidden_size, device, dtype) -> DrafterState:
        return ()

    def tree_from(self, hidden_last: torch.Tensor, root: torch.Tensor) -> torch.Tensor:
        """Next tree tokens [B, L] from the hidden state at the last accepted position [B, 1, H] and its token [B, 1]."""
        topk = self.heads(hidden_last)[: self.tree.max_depth, :, 0].topk(self.tree.topk, dim=-1).indices  # [D, B, k]
        return tree_candidates(root, topk, self.tree.candidate_index)

    def tree_layout(self, state: DrafterState, width: int) -> TreeLayout:
        """The whole tree, shared by the batch (every step verifies all of it)."""
        return self._layout

    def after_prefill(self, model, kv_cache, meta, hidden, next_tokens, last_idx, input_ids, state,
                      step=NO_PREFILL):
        tree = self.tree_from(rows_at(hidden, last_idx), next_tokens.gather(1, last_idx[:, None]))
        return tree[:, 1:], ()

    def after_verify(self, model, kv_cache, meta, hidden, target_tokens, num_emitted, state, step=NO_CONTEXT):
        """The next tree from the last accepted row of a chain step (`Drafter.after_verify`; a Medusa engine's steps
        are tree steps, which call `after_verify_tree`)."""
        last = num_emitted - 1
        tree = self.tree_from(rows_at(hidden, last), target_tokens.gather(1, last[:, None]))
        return tree[:, 1:], state

    def after_verify_tree(self, model, kv_cache, meta, hidden, path, tokens, num_accepted, state):
        """The next tree's candidates [B, L−1] from the heads at the last accepted node, rooted at its token."""
        last_node = path.gather(1, num_accepted[:, None])  # [B, 1]
        tree = self.tree_from(rows_at(hidden, last_node[:, 0]), tokens.gather(1, num_accepted[:, None]))
        return tree[:, 1:], state


def build(spec: MedusaDecodingConfig, ctx: LoadContext) -> tuple[Drafter, AcceptanceRule]:
    """The engine's Medusa heads drafting `medusa_choices`, with Medusa's tree acceptance (typical acceptance for
    sampling requests).

    Raises:
        LlmArgsError: an engine without heads, more heads asked for than stored, a malformed or unknown tree.
    """
    heads = ctx.medusa_heads
    if heads is None:
        raise LlmArgsError("speculative_config asks for Medusa but this engine has no Medusa heads; rebuild "
                           "with build-engine --medusa_model_dir HEADS")
    n = spec.num_medusa_heads or len(heads)
    if n > len(heads):
        raise LlmArgsError(f"num_medusa_heads={n} but the engine holds {len(heads)} Medusa heads")
    choices = spec.medusa_choices
    try:  # a tree's ranks index a top-k over the vocabulary
        tree = build_tree(published_tree(choices) if isinstance(choices, str) else choices,
                          ctx.manifest.model.vocab_size)
        drafter = MedusaDrafter(heads[:n] if n < len(heads) else heads, tree.to(ctx.device))
    except (TreeError, ValueError) as e:
        raise LlmArgsError(f"medusa_choices: {e}") from e
    return drafter, TreeAcceptance(drafter.tree, spec.posterior_threshold, spec.posterior_alpha)


def built_for(manifest: EngineManifest) -> MedusaDecodingConfig | None:
    """An engine with Medusa heads decodes with them by default."""
    s = manifest.speculative
    return MedusaDecodingConfig(num_medusa_heads=s.max_draft_len or None) if s.method == "medusa" else None


METHOD = Method("Medusa", MedusaDecodingConfig, build, built_for)
