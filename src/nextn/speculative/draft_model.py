"""Draft-target speculative decoding: a separate small draft model with its own paged KV cache proposes the drafts.

Speculative sampling (Leviathan et al. 2023, §2.3; Chen et al. 2023, Alg. 2): the draft model proposes K tokens one
after another, each sampled from its distribution q (the argmax for greedy requests) at the request's temperature /
top-k / top-p, and keeps the whole q; the target scores all K in one forward (p) and the acceptance rule accepts
each draft with probability min(1, p/q), draws the first rejected position from normalize(max(0, p − q)) and, when
all K pass, a bonus token from p (`speculative/acceptance_reference.rejection_sampling` with `draft_probs = q`). Greedy requests
get argmax drafts and strict acceptance. TensorRT-LLM's name: `DraftTargetDecodingConfig` (decoding_type
`Draft_Target`).

The draft model's KV cache is its own tensor, addressed by the **target's block tables and slots** (same
tokens_per_block, as many slots as the target's cache; allocated at the first prefill, when the drafter first sees
the target's cache tensor): the one block pool and scheduler manage both, so
admission, growth, preemption and abort need nothing new, and rejected drafts are rewound like the target's — by
the KV length alone (dead entries are overwritten before anything reads them). Per decode step, for a request with
L cached tokens that emits n tokens t0..t(n−1) at positions L+1..L+n:

    target([last, d1..dk]) → acceptance(p, drafts, q) → tokens t0..tk, n
    draft([t_s..tk] at L+1+s..L+k+1)    one pass from the first row whose draft KV is missing: the previous step's
                                        one-token passes wrote d1..d(k−1) at L+1..L+k−1, so the accepted drafts
                                        before t(n−2) have theirs (the state keeps which tokens it wrote where:
                                        `written_rows`); the pass covers the correction / bonus token t(n−1) at L+n,
                                        so the draft KV is right up to L+n; rows past it hold rejected tokens,
                                        overwritten before they are read
    d1 ~ q1 from the row at L+n; d2..dK: K−1 one-token steps at L+n+1.. (the whole batch at once)

so drafting costs K draft forwards per step, whatever was accepted — the first over 1 or 2 rows a request when the
verified drafts were its own (K + 1 before: Qwen2.5-Coder-0.5B W4A8 on Zen 3, 22.6 ms a step for that pass at K = 3;
a row skipped is a row whose KV the one-token pass wrote, and batch invariance makes it the same bits) — or, since
each draft is a forward of its own (`traits.on_demand`), the k forwards of the
draft length k the draft-length policy chose for the step: with the eager chain step the scheduler asks for that many
(`StepPlan.num_drafts`) and lets the next step verify at most them, so a policy that verifies k < K at a batch
size where verification rows cost (batch 2 on a CPU) does not pay K − k draft passes it then drops. After a
prefill, the draft model runs over the same prompt rows (the same attention metadata), then drafts from the first
token at the prompt's end. Drafts are sampled with the counter-based RNG on their own stream (`STREAM_DRAFT`), so
a request's output does not depend on its batch.

While the draft-length policy turns speculation off, steps run without the draft model: a prefill then skips the
draft model's pass over the prompt and a decode step runs the target alone, so the positions they cover have no
draft KV. When speculation comes back on, the scheduler has the drafter `catch_up` over each request's missing
positions (one draft-model prefill over them) before its first drafting step, so a server whose load keeps
speculation off pays nothing for the draft model, and one that turns it back on drafts from complete KV.

Per-request state: q [max_batch, K, V] fp32 (kept only when a batch samples; greedy rows never read it: with a
one-hot p rejection sampling is strict acceptance whatever q holds); the draft tokens [max_batch, K] int64 whose
KV the last drafting wrote (−1 past them) and the position [max_batch] of the first. The decode step is the chain step
(`chain_step.verify_and_draft_step`); `traits.sampled` has it hand q (`draft_probs`) to the acceptance rule and the
sampling parameters to `after_verify`.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from nextn.build.manifest import EngineError, EngineManifest, verify_engine_files
from nextn.build.safetensors_map import map_safetensors
from nextn.config.llm_args import DraftTargetDecodingConfig, LlmArgsError
from nextn.models.registry import MODEL_CLASSES
from nextn.plugins.sampling import counter_uniform, sample_from_probs
from nextn.plugins.packed_linear import install_packed_linears
from nextn.plugins.decoder_layer import install_fused_layers
from nextn.plugins.paged_attention import install_paged_attention
from nextn.plugins.rms_norm import install_rms_norms
from nextn.quantization.linear import install_weight_only_linears
from nextn.speculative.protocol import NO_PREFILL, AcceptanceRule, SamplingTensors
from nextn.models.attention_metadata import AttentionMetadata, slots_for_positions
from nextn.speculative.draft_vocab import restrict_dense_head, restrict_quantized_head, resolve_hot_tokens
from nextn.speculative.protocol import NO_CONTEXT, DrafterState, rows_at
from nextn.speculative.acceptance_rules import StandardAcceptance
from nextn.speculative.chain_step import LinearDrafter
from nextn.speculative.method import LoadContext, Method, from_build_yaml
from nextn.speculative.protocol import Drafter
from nextn.speculative.traits import DraftKV, DrafterTraits
from nextn.models.kv_cache import allocate_kv_cache

logger = logging.getLogger(__name__)

#: The counter RNG stream of the draft model's samples (STREAM_SAMPLE = 1 and STREAM_ACCEPT = 2 are the target's).
STREAM_DRAFT = 3
_MEDUSA_PREFIX = "medusa_heads."


def load_draft_model(engine_dir: Path, manifest: EngineManifest, device: torch.device,
                     hot_tokens: torch.Tensor | None = None) -> torch.nn.Module:
    """The draft engine's model (any family of `models.registry`), weights on `device`, eval mode, no grad.

    Its rope table is sized later, to the target's (`DraftModelDrafter._bind`). Medusa heads an engine may carry
    are dropped (the draft model only runs its decoder). With `hot_tokens` (sorted ids [V'] int64,
    `draft_vocab.hot_token_ids`), its lm_head keeps those rows only: `logits` gives [..., V'].

    Raises:
        EngineFileError (an EngineError): a file the manifest lists is missing, truncated or altered (sizes, headers
            and SHA-256 checked, as the target's at its default `verify_weights: full`; a cached draft engine is then
            rebuilt by `engine_cache.load_through_cache`). EngineError: weights not matching the manifest.
    """
    verify_engine_files(engine_dir, manifest, "full")
    files = [engine_dir / f for f in manifest.weight_files]
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        mapped = map_safetensors(f)  # views of one mapping, as the target's (`model_loader.read_weights`)
        weights.update(mapped if device.type == "cpu" else {k: v.to(device) for k, v in mapped.items()})
    weights = {k: v for k, v in weights.items() if not k.startswith(_MEDUSA_PREFIX)}
    with torch.device("meta"):
        model = MODEL_CLASSES[manifest.architecture](manifest.model, max_positions=1)
    head_cut = hot_tokens is not None and restrict_quantized_head(weights, hot_tokens)
    if manifest.quant_config is not None:  # a weight-only quantized draft engine
        model.lm_head_quantized = "lm_head" in install_weight_only_linears(model, weights, manifest.quant_config)
    try:
        model.load_state_dict(weights, strict=True, assign=True)
    except RuntimeError as e:
        raise EngineError(f"draft engine weights do not match its manifest: {e}") from e
    if hot_tokens is not None and not head_cut:
        restrict_dense_head(model, hot_tokens)
    install_packed_linears(model)  # bf16 decoder linears on a CPU with bf16 instructions: oneDNN's packed kernel
    install_paged_attention(model)  # nextn's CPU attention kernel where it applies
    install_rms_norms(model)  # the norms of layers that run as modules, one dispatch each
    install_fused_layers(model)  # W4A16 on the CPU: one op per decoder layer
    return model.eval().requires_grad_(False)


def check_vocabularies(target_dir: Path, target: EngineManifest, draft_dir: Path, draft: EngineManifest) -> None:
    """Draft and target must share a vocabulary: the same vocabulary size and, when both engines carry a tokenizer,
    the same token → id map (the drafts are token ids the target verifies as they are).

    Raises:
        LlmArgsError: the sizes differ (both are named) or the tokenizers map tokens to different ids.
    """
    vt, vd = target.model.vocab_size, draft.model.vocab_size
    if vt != vd:
        raise LlmArgsError(f"Draft_Target needs one vocabulary: the draft model {draft_dir} has {vd} token ids, the "
                           f"target {target_dir} has {vt}; pick a draft model of the target's family")
    if target.tokenizer_files and draft.tokenizer_files:
        from transformers import AutoTokenizer

        a, b = (AutoTokenizer.from_pretrained(str(d), trust_remote_code=False).get_vocab()
                for d in (target_dir, draft_dir))
        if a != b:
            diff = sorted(set(a.items()) ^ set(b.items()), key=lambda kv: kv[1])[:3]
            raise LlmArgsError(f"Draft_Target needs one vocabulary: the tokenizers of the draft model {draft_dir} "
                               f"({len(b)} tokens) and the target {target_dir} ({len(a)} tokens) differ, e.g. {diff}")


class DraftModelDrafter(LinearDrafter):
    """Drafts from a separate draft model over its own paged KV cache (module docstring for the data flow).

    Args:
        draft_model: the draft engine's model (`load_draft_model`), on the target's device.
        num_draft_tokens: K (`max_draft_len`), ≥ 1.
        hot_tokens: the token ids [V'] int64 of a draft head cut to its hot rows (`draft_vocab`), None for the
            whole vocabulary; the head's row i proposes token hot_tokens[i].
    """

    name = "DraftModel"
    # sampled drafts (q to the acceptance rule); each draft is a forward of the draft model (a step drafts the
    # length it will verify); its KV at p depends on tokens ≤ p only (look-ahead 0), so a prefill that will not
    # speculate skips it and `catch_up` writes it later
    traits = DrafterTraits(kv=DraftKV.FROM_TOKENS, sampled=True, on_demand=True, kv_only_pass=True)

    def __init__(self, draft_model: torch.nn.Module, num_draft_tokens: int,
                 hot_tokens: torch.Tensor | None = None) -> None:
        self.draft = draft_model
        self.num_draft_tokens = self.max_draft_depth = num_draft_tokens
        self.vocab_size = draft_model.cfg.vocab_size
        self.hot_tokens = hot_tokens
        self.kv_cache: torch.Tensor | None = None  # [draft layers, target slots, draft kv dim], set by _bind

    @classmethod
    def from_config(cls, spec: DraftTargetDecodingConfig, target_dir: Path, target: EngineManifest,
                    device: torch.device) -> "DraftModelDrafter":
        """Check the vocabularies of the draft engine in `spec.speculative_model_dir` and load it (a checkpoint
        there was built into an engine by the LLM API before: `runtime/llm.py`, `draft_engine_dir`).

        Raises:
            LlmArgsError: different vocabularies; EngineError: `speculative_model_dir` is not an engine directory.
        """
        draft_dir = Path(spec.speculative_model_dir)
        draft = EngineManifest.load(draft_dir)
        check_vocabularies(Path(target_dir), target, draft_dir, draft)
        if getattr(draft.model, "linear_layers", ()):
            raise LlmArgsError(f"Draft_Target: the draft model {draft_dir} has linear-attention layers (a recurrent "
                               "state per request, which a draft model does not keep yet): draft with an "
                               "attention-only model of the same vocabulary")
        vocab = draft.model.vocab_size
        try:
            hot = resolve_hot_tokens(draft_dir, vocab, spec.draft_vocab_size, spec.draft_token_map)
        except ValueError as e:
            raise LlmArgsError(f"Draft_Target: {e}") from e
        logger.info("Draft_Target: draft model %s (%s, %d layers), K=%d, draft head %d of %d token ids", draft_dir,
                    draft.architecture, draft.model.num_hidden_layers, spec.max_draft_len,
                    vocab if hot is None else hot.numel(), vocab)
        hot = None if hot is None else hot.to(device)
        return cls(load_draft_model(draft_dir, draft, device, hot), spec.max_draft_len, hot)

    def draft_probs(self, state: DrafterState, num_drafts: int, sampling: SamplingTensors) -> torch.Tensor | None:
        """q [B, k, V] of the k verified drafts from the state (None: a greedy batch, or speculation was off)."""
        return state[0][:, :num_drafts] if state and sampling.any_sampled else None

    def initial_state(self, batch: int, hidden_size: int, device: torch.device, dtype: torch.dtype) -> DrafterState:
        k = self.num_draft_tokens
        return (torch.zeros(batch, k, self.vocab_size, dtype=torch.float32, device=device),
                torch.full((batch, k), -1, dtype=torch.int64, device=device),
                torch.full((batch,), -1, dtype=torch.int64, device=device))

    def _with_written(self, state: DrafterState, q: torch.Tensor | None, batch: int, device: torch.device,
                      written: torch.Tensor | None = None, at: torch.Tensor | None = None) -> DrafterState:
        """The state after a step: q [B, K, V] (None: `state`'s, kept for greedy batches), the draft tokens [B, K]
        whose KV this step's one-token passes wrote from position at [B] on (None: none, −1)."""
        if q is None:
            q = state[0] if state else self.initial_state(batch, 0, device, torch.float32)[0]
        if written is None or at is None:
            written = torch.full((batch, self.num_draft_tokens), -1, dtype=torch.int64, device=device)
            at = torch.full((batch,), -1, dtype=torch.int64, device=device)
        return q, written, at

    def _bind(self, model: torch.nn.Module, kv_cache: torch.Tensor) -> torch.Tensor:
        """The draft KV cache, allocated on first use with the target cache's slot count (so the target's block
        tables address it), and the draft rope table sized like the target's."""
        if self.kv_cache is None or self.kv_cache.shape[1] != kv_cache.shape[1]:
            cfg = self.draft.cfg
            dtype = next(self.draft.parameters()).dtype
            self.kv_cache = allocate_kv_cache(cfg.num_hidden_layers, kv_cache.shape[1], 1, cfg.kv_cache_dim, dtype,
                                              kv_cache.device)
            self.draft.rope_table = self.draft.rope_table_for(model.rope_table.shape[0]).to(kv_cache.device)
        return self.kv_cache

    def _sample(self, hidden: torch.Tensor, positions: torch.Tensor, sampling: SamplingTensors | None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft tokens [B, 1] from the draft model's hidden states [B, 1, H] for positions [B, 1], and q [B, 1, V]
        (None when no request samples: argmax drafts)."""
        logits = self.draft.logits(hidden)  # [B, 1, V] fp32 ([B, 1, V'] over the hot rows)
        if sampling is None or not sampling.any_sampled:
            top = logits.argmax(-1)
            return (top if self.hot_tokens is None else self.hot_tokens[top]), None
        if self.hot_tokens is not None:  # q is zero off the hot set: −inf logits there
            logits = logits.new_full((*logits.shape[:-1], self.vocab_size), float("-inf")).index_copy_(
                -1, self.hot_tokens, logits)
        q = sampling.probs(logits)  # greedy rows: one-hot at the argmax
        return sample_from_probs(q, counter_uniform(sampling.seed, positions, STREAM_DRAFT)), q

    def _draft(self, kv: torch.Tensor, meta: AttentionMetadata, tokens: torch.Tensor, positions: torch.Tensor,
               last_idx: torch.Tensor, sampling: SamplingTensors | None, state: DrafterState,
               num_drafts: int | None = None) -> tuple[torch.Tensor, DrafterState]:
        """Run the draft model over tokens [B, T] at positions [B, T], then n = `num_drafts` (None: K) drafts
        from row last_idx [B] on: n forwards in all, the first over the T tokens.

        Returns drafts [B, K] int64 (zeros past the n drafted) and the state (q [B, K, V], zeros past n; `state`
        passed on when no request samples).
        """
        n = self.num_draft_tokens if num_drafts is None else num_drafts
        step_meta = lambda pos: meta.with_tokens(pos, slots_for_positions(meta.block_tables, pos, meta.block_size))  # noqa: E731
        hidden = rows_at(self.draft(tokens, kv, step_meta(positions)), last_idx)  # [B, 1, H]
        position = rows_at(positions, last_idx) + 1  # [B, 1] where the next draft lands
        first = position[:, 0]  # d1's position: the one-token passes write d1..d(n−1) from there
        drafts, qs = [], []
        for i in range(n):
            token, q = self._sample(hidden, position, sampling)
            drafts.append(token)
            qs.append(q)
            if i + 1 < n:
                hidden = self.draft(token, kv, step_meta(position))
                position = position + 1
        missing = self.num_draft_tokens - n
        drafts_t = torch.nn.functional.pad(torch.cat(drafts, dim=1), (0, missing))
        written = torch.nn.functional.pad(drafts_t[:, :n - 1], (0, missing + 1), value=-1)
        q = None if qs[0] is None else torch.nn.functional.pad(torch.cat(qs, dim=1), (0, 0, 0, missing))
        return drafts_t, self._with_written(state, q, tokens.shape[0], tokens.device, written, first)

    def after_prefill(self, model, kv_cache, meta, hidden, next_tokens, last_idx, input_ids, state,
                      step=NO_PREFILL):
        sampling, draft = step.sampling, step.draft
        kv = self._bind(model, kv_cache)
        if not draft:  # speculation is off: no second prefill now, `catch_up` writes it if speculation comes back
            b = next_tokens.shape[0]
            return next_tokens.new_zeros(b, self.num_draft_tokens), self._with_written(state, None, b, kv.device)
        self.draft(input_ids, kv, meta)  # the prompt rows fill the draft KV (pads write into the null block)
        first = next_tokens.gather(1, last_idx[:, None])  # [B, 1] the token after the chunk
        position = rows_at(meta.positions, last_idx) + 1  # [B, 1]
        zero = torch.zeros_like(last_idx)
        return self._draft(kv, meta, first, position, zero, sampling, state)

    def catch_up(self, kv_cache: torch.Tensor, meta: AttentionMetadata, input_ids: torch.Tensor) -> None:
        """Write the draft KV of tokens input_ids [B, T] at `meta`'s positions (the draft model's prefill over
        them), for positions decoded or prefilled while speculation was off."""
        if self.kv_cache is None:
            raise RuntimeError("the draft KV cache is allocated at the first prefill; catch_up came before it")
        self.draft(input_ids, self.kv_cache, meta)

    def after_verify(self, model, kv_cache, meta, hidden, target_tokens, num_emitted, state, step=NO_CONTEXT):
        sampling, draft, num_drafts = step.sampling, step.draft, step.num_drafts
        kv = self._bind(model, kv_cache)
        # Verified row j (input at L + j) emitted target_tokens[:, j], the token at L + j + 1; the pass runs rows
        # start..start + width − 1 of them (those whose draft KV is missing, and the last emitted one)
        first = meta.positions[:, :1] + 1  # [B, 1]
        start, width = missing_rows(target_tokens, num_emitted, first[:, 0], state)
        cols = start[:, None] + torch.arange(width, device=target_tokens.device)  # [B, width]
        tokens, positions = target_tokens.gather(1, cols), first + cols
        if not draft:  # the draft KV of the emitted tokens only (`traits.kv_only_pass`): no draft passes
            self.draft(tokens, kv, meta.with_tokens(positions, slots_for_positions(
                meta.block_tables, positions, meta.block_size)))
            b = target_tokens.shape[0]
            return target_tokens.new_zeros(b, self.num_draft_tokens), self._with_written(state, None, b, kv.device)
        return self._draft(kv, meta, tokens, positions, num_emitted - 1 - start, sampling, state, num_drafts)


def missing_rows(target_tokens: torch.Tensor, num_emitted: torch.Tensor, first: torch.Tensor,
                 state: DrafterState) -> tuple[torch.Tensor, int]:
    """The verified rows a draft model's pass after verification must run: per request the first row whose draft
    KV is missing, start [B] int64, and one width for the batch (the rows start..start + width − 1, ending at or past
    the last emitted row num_emitted − 1, all within the K + 1 verified rows).

    Row j (token target_tokens[:, j] at position first + j) has its draft KV when the previous step's one-token passes
    wrote that token there and at every row before it (`state`'s written tokens [B, K] from position [B]); the last
    emitted row is always run (its hidden state drafts). Everything from row 0 (width K + 1) where the state does
    not say (a caller outside the engine), and off the CPU: a fixed width keeps the step one shape for CUDA graphs
    and `torch.compile` (the width here is read back from the device).
    """
    b, w = target_tokens.shape
    last = num_emitted - 1
    if len(state) < 3 or target_tokens.device.type != "cpu" or torch.compiler.is_compiling():
        return torch.zeros_like(last), w
    written, at = state[1], state[2]
    k = min(written.shape[1], w)
    same = (target_tokens[:, :k] == written[:, :k]) & (at == first)[:, None]
    start = torch.minimum(same.long().cumprod(1).sum(1), last)
    width = int((last - start).max()) + 1
    return torch.minimum(start, torch.full_like(start, w - width)), width


def build(spec: DraftTargetDecodingConfig, ctx: LoadContext) -> tuple[Drafter, AcceptanceRule]:
    """A second, smaller model with its own KV cache drafting a chain (`speculative_model_dir`), verified strictly /
    by rejection sampling against its own draft distribution.

    Raises:
        LlmArgsError: different vocabularies; EngineError / build errors for an unusable draft path.
    """
    return DraftModelDrafter.from_config(spec, ctx.engine_dir, ctx.manifest, ctx.device), StandardAcceptance()


METHOD = Method("Draft_Target", DraftTargetDecodingConfig, build, from_build_yaml("Draft_Target"))
