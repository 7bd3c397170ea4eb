"""MTP drafters: the checkpoint's multi-token-prediction modules propose a chain of K drafts (`decoding_type: MTP`).

`after_prefill` and `after_verify` take fixed-shape device tensors (the row convention of protocol.py) and return
drafts [B, K] plus the per-request state (Vanilla's token/hidden pools; nothing for Eagle). MTP drafting a tree is
mtp_tree.py. Sources: DeepSeek-V3 report (arXiv:2412.19437) §2.2; TensorRT-LLM `_torch/speculative/mtp.py` (Eagle and
Vanilla modes) for the semantics, not the code.

MTP module 1 at position p pairs embed(x_{p+1}) with h_p and predicts x_{p+2}.
"""

from __future__ import annotations

import logging

import torch

from nextn.build.manifest import EngineManifest
from nextn.config.llm_args import LlmArgsError, MTPDecodingConfig
from nextn.models.attention_metadata import AttentionMetadata, slots_for_positions
from nextn.models.causal_lm import SelfDraftingCausalLM
from nextn.speculative.acceptance_rules import RelaxedAcceptance, StandardAcceptance
from nextn.speculative.chain_step import LinearDrafter
from nextn.speculative.draft_vocab import resolve_hot_tokens
from nextn.speculative.method import LoadContext, Method
from nextn.speculative.mtp_tree import MtpTreeAcceptance, tree_drafter, uses_tree
from nextn.speculative.protocol import NO_CONTEXT, NO_PREFILL, AcceptanceRule, Drafter, DrafterState, rows_at
from nextn.speculative.traits import DraftKV, DrafterTraits

logger = logging.getLogger(__name__)

class MtpEagleDrafter(LinearDrafter):
    """MTP Eagle: module 1 applied K times with a shared KV (TensorRT-LLM's default for one-module checkpoints).

    Step 1 runs over all rows (filling the module's KV for every accepted position; rows past the last accepted
    one write KV that later steps overwrite) and drafts from the last accepted row. Steps 2..K each take one token:
    the previous draft with the module's own previous output, at the next position.
    """

    name = "MtpEagle"
    # its only state is its KV, which moves with the target's; module 1's KV at p pairs embed(x_{p+1}) with h_p
    traits = DrafterTraits(kv=DraftKV.FROM_HIDDEN, key_lookahead=1, kv_only_pass=True, disaggregation=True,
                           draft_head=True)

    def __init__(self, num_draft_tokens: int) -> None:
        self.num_draft_tokens = self.max_draft_depth = num_draft_tokens

    def initial_state(self, batch: int, hidden_size: int, device: torch.device, dtype: torch.dtype) -> DrafterState:
        return ()

    def _draft(self, model: SelfDraftingCausalLM, kv_cache: torch.Tensor, meta: AttentionMetadata,
               hidden: torch.Tensor, next_tokens: torch.Tensor, last_idx: torch.Tensor) -> torch.Tensor:
        h = rows_at(model.forward_mtp(0, next_tokens, hidden, kv_cache, meta), last_idx)  # [B, 1, H]
        token = model.mtp_logits(0, h).argmax(-1)  # [B, 1]
        drafts = [token]
        position = rows_at(meta.positions, last_idx)  # [B, 1]
        for _ in range(1, self.num_draft_tokens):
            position = position + 1
            step_meta = meta.with_tokens(position, slots_for_positions(meta.block_tables, position, meta.block_size))
            h = model.forward_mtp(0, token, model.mtp_chain_hidden(0, h), kv_cache, step_meta)
            token = model.mtp_logits(0, h).argmax(-1)
            drafts.append(token)
        return torch.cat(drafts, dim=1)

    def after_prefill(self, model, kv_cache, meta, hidden, next_tokens, last_idx, input_ids, state,
                      step=NO_PREFILL):
        draft = step.draft
        if not draft:  # the module's KV over the prompt rows only
            model.forward_mtp(0, next_tokens, hidden, kv_cache, meta)
            return next_tokens.new_zeros(next_tokens.shape[0], self.num_draft_tokens), ()
        return self._draft(model, kv_cache, meta, hidden, next_tokens, last_idx), ()

    def after_verify(self, model, kv_cache, meta, hidden, target_tokens, num_emitted, state, step=NO_CONTEXT):
        if not step.draft:  # the module's KV over the verified rows only (`traits.kv_only_pass`)
            model.forward_mtp(0, target_tokens, hidden, kv_cache, meta)
            return target_tokens.new_zeros(target_tokens.shape[0], self.num_draft_tokens), ()
        return self._draft(model, kv_cache, meta, hidden, target_tokens, num_emitted - 1), ()


class MtpVanillaDrafter(LinearDrafter):
    """MTP Vanilla: K distinct modules, module k drafts token k, each with its own KV (DeepSeek-V3 report §2.2).

    Module k at position p pairs embed(x_{p+k}) with module k−1's output at p (the target's for k = 1). After a
    verification every module re-runs over a window of the K+1 positions ending at the last accepted one: this
    covers every position whose module-k KV was computed from a draft that has since been rejected, and every new
    position. The window's target hidden states and tokens come from the per-request pools
    (`pool_tokens` [B, K+1], `pool_hidden` [B, K+1, H]), slid after each verification.
    """

    name = "MtpVanilla"

    def __init__(self, num_draft_tokens: int) -> None:
        self.num_draft_tokens = self.max_draft_depth = num_draft_tokens
        # module k's KV at p depends on x_{p+k}; a prefill chunk re-runs K rows so that every module's KV near
        # its start comes from the true tokens
        self.traits = DrafterTraits(kv=DraftKV.FROM_HIDDEN, key_lookahead=num_draft_tokens,
                                    rerun_rows=num_draft_tokens, draft_head=True)

    def initial_state(self, batch: int, hidden_size: int, device: torch.device, dtype: torch.dtype) -> DrafterState:
        w = self.num_draft_tokens + 1
        return (torch.zeros(batch, w, dtype=torch.int64, device=device),
                torch.zeros(batch, w, hidden_size, dtype=dtype, device=device))

    def _run_modules(self, model: SelfDraftingCausalLM, kv_cache: torch.Tensor, meta: AttentionMetadata,
                     hidden: torch.Tensor, tokens: torch.Tensor, last_idx: torch.Tensor) -> torch.Tensor:
        drafts = []
        h = hidden
        for k in range(self.num_draft_tokens):
            h = model.forward_mtp(k, tokens, h if k == 0 else model.mtp_chain_hidden(k - 1, h), kv_cache, meta)
            token = model.mtp_logits(k, rows_at(h, last_idx)).argmax(-1)  # [B, 1]
            drafts.append(token)
            # Module k+1 at row i needs the token one further on: shift left, put the new draft at last_idx.
            tokens = torch.cat([tokens[:, 1:], tokens[:, -1:]], dim=1).scatter(1, last_idx[:, None], token)
        return torch.cat(drafts, dim=1)

    def _window(self, x: torch.Tensor, last_idx: torch.Tensor) -> torch.Tensor:
        """Rows last_idx−K..last_idx of x [B, T, ...] (zeros before row 0) → [B, K+1, ...]."""
        w = self.num_draft_tokens + 1
        idx = last_idx[:, None] - w + 1 + torch.arange(w, device=x.device)  # [B, K+1]
        valid = idx >= 0
        idx = idx.clamp(min=0).view(*idx.shape, *([1] * (x.dim() - 2))).expand(-1, -1, *x.shape[2:])
        out = x.gather(1, idx)
        return out * valid.view(*valid.shape, *([1] * (x.dim() - 2))).to(out.dtype)

    def after_prefill(self, model, kv_cache, meta, hidden, next_tokens, last_idx, input_ids, state,
                      step=NO_PREFILL):
        drafts = self._run_modules(model, kv_cache, meta, hidden, next_tokens, last_idx)
        return drafts, (self._window(next_tokens, last_idx), self._window(hidden, last_idx))

    def after_verify(self, model, kv_cache, meta, hidden, target_tokens, num_emitted, state, step=NO_CONTEXT):
        pool_tokens, pool_hidden = state  # positions L−K..L (tokens one ahead) and L−K−1..L−1, L = first verified
        w = self.num_draft_tokens + 1
        # Rows of [pool; verified] ending at the last accepted position L + num_emitted − 1.
        idx = num_emitted[:, None] + torch.arange(w, device=hidden.device)  # [B, K+1]
        win_hidden = torch.cat([pool_hidden, hidden], dim=1).gather(1, idx[..., None].expand(-1, -1, hidden.shape[-1]))
        win_tokens = torch.cat([pool_tokens, target_tokens], dim=1).gather(1, idx)
        positions = meta.positions[:, :1] + num_emitted[:, None] - w + torch.arange(w, device=hidden.device)
        win_meta = meta.with_tokens(positions, slots_for_positions(meta.block_tables, positions, meta.block_size))
        last = torch.full_like(num_emitted, w - 1)
        drafts = self._run_modules(model, kv_cache, win_meta, win_hidden, win_tokens, last)
        return drafts, (win_tokens, win_hidden)


def build(spec: MTPDecodingConfig, ctx: LoadContext) -> tuple[Drafter, AcceptanceRule]:
    """The MTP drafter this engine's modules support (Eagle, Vanilla, or a tree) and its acceptance rule (strict /
    rejection sampling, relaxed inside `<think>`, or tree acceptance).

    Raises:
        LlmArgsError: an engine without MTP layers, Vanilla with more drafts than modules, a malformed tree.
    """
    modules = ctx.manifest.speculative.num_mtp_modules
    k = spec.num_nextn_predict_layers
    if modules == 0:
        raise LlmArgsError("speculative_config asks for MTP but this engine has no MTP layers; "
                           "use speculative_config: null or build from a checkpoint with MTP weights")
    if uses_tree(spec):  # MTP Eagle drafting a tree (eagle_choices / use_dynamic_tree)
        return tree_drafter(spec, modules, ctx.device, ctx.manifest.model.vocab_size), MtpTreeAcceptance()
    if spec.use_mtp_vanilla or modules > 1:
        if k > modules:
            raise LlmArgsError(f"MTP Vanilla drafts one token per module: num_nextn_predict_layers={k} exceeds the "
                               f"engine's {modules} MTP modules")
        drafter: Drafter = MtpVanillaDrafter(k)
    else:
        drafter = MtpEagleDrafter(k)
    if spec.use_relaxed_acceptance_for_thinking:
        return drafter, RelaxedAcceptance(spec.relaxed_topk, spec.relaxed_delta, spec.begin_thinking_phase_token,
                                          spec.end_thinking_phase_token)
    return drafter, StandardAcceptance()


def built_for(manifest: EngineManifest) -> MTPDecodingConfig | None:
    """An engine with MTP modules decodes with them by default: its max draft length, its mode."""
    s = manifest.speculative
    if s.method != "mtp":
        return None
    return MTPDecodingConfig(num_nextn_predict_layers=s.max_draft_len or s.num_mtp_modules,
                             use_mtp_vanilla=s.use_mtp_vanilla)


def prepare_model(model: SelfDraftingCausalLM, spec: MTPDecodingConfig, ctx: LoadContext) -> None:
    """The draft head cut to its hot tokens when `draft_vocab_size` / `draft_token_map` are set
    (speculative/draft_vocab.py; `SelfDraftingCausalLM.cut_draft_head`): the MTP modules then score only those rows.

    Raises:
        LlmArgsError: an unreadable token map, or tensor parallelism (the head is split by vocabulary there).
    """
    if spec.draft_vocab_size is None and spec.draft_token_map is None:
        return
    if ctx.tensor_parallel:
        raise LlmArgsError("draft_vocab_size / draft_token_map are not supported with tensor parallelism (the "
                           "lm_head is split by vocabulary there): drop them")
    vocab = ctx.manifest.model.vocab_size
    try:
        hot = resolve_hot_tokens(ctx.engine_dir, vocab, spec.draft_vocab_size, spec.draft_token_map)
    except ValueError as e:
        raise LlmArgsError(f"draft head: {e}") from e
    if hot is not None:
        model.cut_draft_head(hot.to(ctx.device))
        logger.info("draft head: %d of %d token ids", hot.numel(), vocab)


METHOD = Method("MTP", MTPDecodingConfig, build, built_for, prepare_model)
