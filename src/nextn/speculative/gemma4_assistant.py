"""Gemma 4's assistant drafter (`decoding_type: Gemma4Assistant`): a small checkpoint shipped beside a Gemma 4 model
(`google/gemma-4-*-it-assistant`) drafts a chain of K tokens from the target's last hidden state and the target's
own KV cache (models/gemma4_assistant.py for the model).

Per step, for a request whose last emitted token t lands at position p (after a prefill: the first token at the
prompt's length; after a verification of L..L+K that emitted n tokens: t = the n-th at L + n), the target has cached
0..p − 1 and its row before t holds h, the final normed hidden state that predicted t:

    t, h → assistant at position p → d1, h1 → assistant at p → d2, h2 → … → dK

K assistant forwards of one row each, all at position p over the target's KV as it stands (the verified
positions: rows past the accepted ones are not visible), nothing written: the assistant keeps no KV and no
per-request state, so rejected drafts need no rewind, a prefix-cache hit and a disaggregated request carry nothing
of it, and a step with speculation off skips it entirely. Drafts are the assistant head's argmax (deterministic:
strict acceptance for greedy requests, the coupled rule for sampled ones, so the output is plain decoding's token
for token). Each draft is a forward of its own (`traits.on_demand`): a step drafts only the draft length the policy
chose.

Sources: HF `generation/candidate_generator.py` (`SinglePositionMultiTokenCandidateGenerator`: the same position for
every draft, [embedding; hidden] in); llama.cpp `common/speculative.cpp` (`draft-mtp` with shared memory).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from nextn.config.llm_args import Gemma4AssistantDecodingConfig, LlmArgsError
from nextn.models.attention_metadata import AttentionMetadata
from nextn.models.config import ConfigError
from nextn.models.gemma4_assistant import Gemma4Assistant, assistant_config
from nextn.models.llama.config import LlamaModelConfig
from nextn.plugins.dense_linear import DenseLinear, install_dense_linears
from nextn.plugins.paged_attention import install_paged_attention
from nextn.plugins.rms_norm import install_rms_norms
from nextn.speculative.acceptance_rules import StandardAcceptance
from nextn.speculative.chain_step import LinearDrafter
from nextn.speculative.method import LoadContext, Method, from_build_yaml
from nextn.speculative.protocol import NO_CONTEXT, NO_PREFILL, AcceptanceRule, Drafter, DrafterState, rows_at
from nextn.speculative.traits import DraftKV, DrafterTraits

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def source_rows(target: LlamaModelConfig, assistant: LlamaModelConfig) -> list[tuple[int, int]]:
    """Where each assistant layer reads the target's KV — (cache row, first column: `kv_cache_layout`): for a layer
    of type T, the place of the target's last decoder layer of type T that computes its own KV (HF's
    `store_full_length_kv` layer).

    Raises:
        LlmArgsError: a target that is not Gemma 4, a layer type the target lacks, or head shapes that differ.
    """
    if target.architecture != "Gemma4ForCausalLM":
        raise LlmArgsError(f"Gemma4Assistant drafts for Gemma 4 targets; this engine is {target.architecture}")
    types = target.layer_types or ("full_attention",) * target.num_hidden_layers
    layout = target.kv_cache_layout  # (row, first column) per layer where narrow layers share rows
    store: dict[str, tuple[tuple[int, int], int]] = {}  # type → ((cache row, first column), decoder layer)
    row = 0
    for j in range(target.num_hidden_layers - target.num_kv_shared_layers):
        if j in target.linear_layers:
            continue
        store[types[j]] = (layout[j] if layout is not None else (row, 0), j)
        row += 1
    rows = []
    for i, kind in enumerate(assistant.layer_types or ("full_attention",) * assistant.num_hidden_layers):
        if kind not in store:
            raise LlmArgsError(f"Gemma4Assistant: assistant layer {i} is {kind}; the target has no such layer")
        r, j = store[kind]
        mine = (assistant.layer_head_dim(i), assistant.layer_kv_heads(i))
        theirs = (target.layer_head_dim(j), target.layer_kv_heads(j))
        if mine != theirs:
            raise LlmArgsError(f"Gemma4Assistant: assistant layer {i} ({kind}) has (head_dim, KV heads) {mine}, the "
                               f"target's layer {j} it reads {theirs}: an assistant of another model")
        rows.append(r)
    return rows


def load_assistant(path: Path, target: LlamaModelConfig, dtype: torch.dtype, device: torch.device,
                   open_checkpoint: Callable[[Path], Any] | None = None
                   ) -> tuple[Gemma4Assistant, list[tuple[int, int]]]:
    """The assistant at `path` in `dtype` on `device`, eval mode, on nextn's CPU kernels where they run, and the
    target cache place (row, first column) of each of its layers. `path`: an HF checkpoint directory (config.json +
    safetensors), or with `open_checkpoint` (`LoadContext.open_checkpoint`) also the GGUF llama.cpp's converter
    writes of one (`gemma4-assistant`, without the centroid head: the whole embedding scores the drafts, as in
    llama.cpp).

    Raises:
        LlmArgsError: not a Gemma 4 assistant checkpoint, one made for another target (hidden size, vocabulary,
            head shapes), or weights that do not match its config.
    """
    reader = _open(path, open_checkpoint)
    try:  # the config is checked before any weight is read
        try:
            cfg, own = assistant_config(reader.hf_config)
        except (ConfigError, ValueError) as e:
            raise LlmArgsError(f"Gemma4Assistant: {path}: {e}") from e
        if own["backbone_hidden_size"] != target.hidden_size or cfg.vocab_size != target.vocab_size:
            raise LlmArgsError(f"Gemma4Assistant: {path} was made for a target of hidden size "
                               f"{own['backbone_hidden_size']} and {cfg.vocab_size} token ids; this target has "
                               f"{target.hidden_size} and {target.vocab_size}")
        rows = source_rows(target, cfg)
        weights = {n: (w.to(dtype) if w.is_floating_point() else w).to(device)
                   for n in reader.names() if n != "lm_head.weight" for w in (reader.get(n),)}  # tied: the embedding
    finally:
        reader.close()
    with torch.device("meta"):
        model = Gemma4Assistant(cfg, own)
    try:
        model.load_state_dict(weights, strict=True, assign=True)
    except RuntimeError as e:
        raise LlmArgsError(f"Gemma4Assistant: {path}: weights do not match its config: {e}") from e
    model = model.eval().requires_grad_(False)
    if install_dense_linears(model, prefix=("model.layers.", "pre_projection", "post_projection", "masked_embedding")):
        if model.masked_embedding is None:
            model.dense_head = DenseLinear.from_weight(model.model.embed_tokens.weight)
    install_paged_attention(model)
    install_rms_norms(model)  # the norms of layers that run as modules, one dispatch each
    return model, rows


class _SafetensorsDir:
    """An HF checkpoint directory read as the build layer's readers are (`hf_config`, `names`, `get`, `close`)."""

    def __init__(self, path: Path) -> None:
        if not (path / "config.json").is_file():
            raise LlmArgsError(f"Gemma4Assistant: {path} is not an HF checkpoint directory (no config.json)")
        self.hf_config = json.loads((path / "config.json").read_text())
        self._files = sorted(path.glob("*.safetensors"))
        if not self._files:
            raise LlmArgsError(f"Gemma4Assistant: {path} holds no .safetensors weights")
        self._tensors: dict[str, torch.Tensor] = {}

    def names(self) -> list[str]:
        if not self._tensors:
            self._tensors = {n: t for f in self._files for n, t in load_file(str(f)).items()}
        return list(self._tensors)

    def get(self, name: str) -> torch.Tensor:
        return self._tensors[name]

    def close(self) -> None:
        self._tensors = {}


def _open(path: Path, open_checkpoint: Callable[[Path], Any] | None) -> Any:
    """A reader of the checkpoint at `path` (`open_checkpoint`'s, else `_SafetensorsDir`).

    Raises:
        LlmArgsError: nothing readable there (the reader's message).
    """
    if open_checkpoint is None:
        return _SafetensorsDir(path)
    try:
        return open_checkpoint(path)
    except Exception as e:  # the build layer's CheckpointError / GGUF errors, with their messages
        raise LlmArgsError(f"Gemma4Assistant: {e}") from e


class AssistantDrafter(LinearDrafter):
    """Drafts with a Gemma 4 assistant over the target's KV (module docstring for the data flow).

    Args:
        assistant: the loaded assistant (`load_assistant`), on the target's device.
        rows: where each assistant layer reads the target's cache: (row, first column), `source_rows`.
        num_draft_tokens: K, ≥ 1.
    """

    name = "Gemma4Assistant"
    # no KV, no state; each draft a forward of its own; with speculation off it has nothing to write
    traits = DrafterTraits(kv=DraftKV.NONE, on_demand=True, kv_only_pass=True, disaggregation=True)

    def __init__(self, assistant: Gemma4Assistant, rows: list[tuple[int, int]], num_draft_tokens: int) -> None:
        self.assistant, self.rows = assistant, rows
        self.num_draft_tokens = self.max_draft_depth = num_draft_tokens

    def initial_state(self, batch: int, hidden_size: int, device: torch.device, dtype: torch.dtype) -> DrafterState:
        return ()

    def _draft(self, model, kv_cache: torch.Tensor, meta: AttentionMetadata, hidden: torch.Tensor,
               tokens: torch.Tensor, last_idx: torch.Tensor, num_drafts: int) -> torch.Tensor:
        """Drafts [B, K] int64 (zeros past `num_drafts`) from row last_idx [B] of the target's hidden [B, T, H] and
        of `tokens` [B, T] (each row's token one position ahead: the last emitted one at last_idx)."""
        if self.assistant.rope_table.shape[0] != model.rope_table.shape[0]:
            self.assistant.size_rope(model.rope_table.shape[0], model.rope_table.device)
        h = rows_at(hidden, last_idx)  # [B, 1, H]
        token = tokens.gather(1, last_idx[:, None])  # [B, 1]
        position = rows_at(meta.positions, last_idx) + 1  # [B, 1] where that token sits
        kv_rows = [kv_cache[r][:, c:] if c else kv_cache[r] for r, c in self.rows]
        inputs = self.assistant.attention_inputs(position, meta, model.sliding_block_map)  # the same every draft
        drafts = []
        for _ in range(num_drafts):
            token, h = self.assistant.draft(model.model.embed_tokens(token), h, inputs, kv_rows)
            drafts.append(token)
        return torch.nn.functional.pad(torch.cat(drafts, dim=1), (0, self.num_draft_tokens - num_drafts))

    def after_prefill(self, model, kv_cache, meta, hidden, next_tokens, last_idx, input_ids, state,
                      step=NO_PREFILL):
        if not step.draft:  # nothing of the assistant to write
            return next_tokens.new_zeros(next_tokens.shape[0], self.num_draft_tokens), ()
        return self._draft(model, kv_cache, meta, hidden, next_tokens, last_idx, self.num_draft_tokens), ()

    def after_verify(self, model, kv_cache, meta, hidden, target_tokens, num_emitted, state, step=NO_CONTEXT):
        if not step.draft:
            return target_tokens.new_zeros(target_tokens.shape[0], self.num_draft_tokens), ()
        n = self.num_draft_tokens if step.num_drafts is None else step.num_drafts
        return self._draft(model, kv_cache, meta, hidden, target_tokens, num_emitted - 1, n), ()


def build(spec: Gemma4AssistantDecodingConfig, ctx: LoadContext) -> tuple[Drafter, AcceptanceRule]:
    """The assistant at `spec.speculative_model_dir` drafting a chain of `max_draft_len` over this Gemma 4 engine.

    Raises:
        LlmArgsError: a target that is not Gemma 4, tensor parallelism, or an unusable assistant checkpoint.
    """
    target = ctx.manifest.model
    if not isinstance(target, LlamaModelConfig):
        raise LlmArgsError(f"Gemma4Assistant drafts for Gemma 4 targets; this engine is {ctx.manifest.architecture}")
    if ctx.tensor_parallel:
        raise LlmArgsError("Gemma4Assistant with tensor parallelism is not supported: drop tensor_parallel_size")
    path = Path(spec.speculative_model_dir)
    assistant, rows = load_assistant(path, target, _DTYPES[ctx.manifest.dtype], ctx.device, ctx.open_checkpoint)
    logger.info("Gemma4Assistant: %s (%d layers reading the target's cache at (row, column) %s), K=%d, %s head",
                path, assistant.cfg.num_hidden_layers, rows, spec.max_draft_len,
                "centroid-masked" if assistant.masked_embedding is not None else "full")
    return AssistantDrafter(assistant, rows, spec.max_draft_len), StandardAcceptance()


METHOD = Method("Gemma4Assistant", Gemma4AssistantDecodingConfig, build, from_build_yaml("Gemma4Assistant"))
