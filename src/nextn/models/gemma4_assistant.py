"""Gemma 4's assistant drafter (`Gemma4AssistantForCausalLM`, model_type gemma4_assistant): a few Gemma 4 layers that
compute queries only and attend to the target's KV cache, fed the target's last hidden state.

One draft step for a request whose last emitted token t sits at position p (the target has cached 0..p − 1):

    x  = pre_projection([target.embed(t); h])            # h: the target's final normed hidden state that predicted t
    x  = layers(x) at rope position p                     # each layer's query over the target's KV of its type
    n  = norm(x);  draft = argmax head(n);  h' = post_projection(n)

and the next draft repeats it from (draft, h') at the same position p over the same KV: nothing of the assistant is
cached. Layer i of type T ("sliding_attention" / "full_attention") reads the cache row of the target's last decoder
layer of type T that computes its own KV (HF's `store_full_length_kv` layer); a sliding layer sees the keys at
p − window + 1 .. p − 1 (llama.cpp's `gemma4-assistant` mask; HF's bidirectional mask over a full-length cache keeps
up to two more, the same keys while p < window). The head is the assistant's tied embedding, or with
`use_ordered_embeddings` the centroid-masked head: the `centroid_intermediate_top_k` best of `num_centroids`
clusters, each a fixed set of vocab/num_centroids token ids (`token_ordering`), are the only tokens scored.

Sources: HF `models/gemma4_assistant/modeling_gemma4_assistant.py` and `generation/candidate_generator.py`
(`SinglePositionMultiTokenCandidateGenerator`); llama.cpp `src/models/gemma4-assistant.cpp`,
`common/speculative.cpp` (shared memory: one position for every draft).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import nn

from nextn.models.attention_metadata import AttentionMetadata
from nextn.models.causal_lm import vocab_projection
from nextn.models.config import ConfigError
from nextn.models.llama.config import LlamaModelConfig
from nextn.models.llama.model import LlamaBody
from nextn.models.llama.rope import rope_cache


def assistant_config(hf: dict[str, Any]) -> tuple[LlamaModelConfig, dict[str, Any]]:
    """(the assistant's layers as a Gemma 4 text config, its own fields: backbone_hidden_size,
    use_ordered_embeddings, num_centroids, centroid_intermediate_top_k) from its `config.json` dict.

    Raises:
        ConfigError: not a gemma4_assistant config, layers that compute KV (every layer must read the target's),
            per-layer inputs, a double-wide MLP, MoE, or centroids that do not divide the vocabulary.
    """
    archs = hf.get("architectures") or ()
    if hf.get("model_type") != "gemma4_assistant" and "Gemma4AssistantForCausalLM" not in archs:
        raise ConfigError(f"not a Gemma 4 assistant checkpoint (model_type {hf.get('model_type')!r}; expected "
                          "'gemma4_assistant', architecture Gemma4AssistantForCausalLM)")
    text = dict(hf.get("text_config") or {})
    layers = text.get("num_hidden_layers")
    shared = text.get("num_kv_shared_layers") or layers  # HF's `__post_init__`: every layer shares by default
    if shared != layers:
        raise ConfigError(f"Gemma 4 assistant: {layers - shared} of its {layers} layers compute their own KV; an "
                          "assistant's layers must all read the target's (num_kv_shared_layers = num_hidden_layers)")
    for key in ("hidden_size_per_layer_input", "use_double_wide_mlp", "enable_moe_block"):
        if text.get(key):
            raise ConfigError(f"Gemma 4 assistant: {key} = {text[key]!r} (an assistant has none)")
    # validated as a model of its own (no shared layers), then every layer reads KV from outside it (the target's)
    cfg = LlamaModelConfig.from_hf({**text, "architectures": ["Gemma4ForCausalLM"], "num_kv_shared_layers": 0})
    cfg = cfg.model_copy(update={"num_kv_shared_layers": layers})
    own = {"backbone_hidden_size": int(hf.get("backbone_hidden_size") or 1536),  # HF's defaults
           "use_ordered_embeddings": bool(hf.get("use_ordered_embeddings", False)),
           "num_centroids": int(hf.get("num_centroids") or 2048),
           "centroid_intermediate_top_k": int(hf.get("centroid_intermediate_top_k") or 32)}
    if own["use_ordered_embeddings"]:
        c, k = own["num_centroids"], own["centroid_intermediate_top_k"]
        if c < 1 or cfg.vocab_size % c or not 1 <= k <= c:
            raise ConfigError(f"Gemma 4 assistant: {c} centroids with top-{k} over a vocabulary of {cfg.vocab_size} "
                              "(the centroids must divide it, 1 ≤ top-k ≤ centroids)")
    return cfg, own


class MaskedEmbedding(nn.Module):
    """The centroid-masked head (HF `Gemma4AssistantMaskedEmbedder`): `centroids` [C, hidden] scores clusters,
    `token_ordering` [V] int64 lists each cluster's V / C token ids in turn."""

    def __init__(self, hidden_size: int, vocab_size: int, num_centroids: int, top_k: int) -> None:
        super().__init__()
        self.top_k, self.per_centroid = top_k, vocab_size // num_centroids
        self.centroids = nn.Linear(hidden_size, num_centroids, bias=False)
        self.register_buffer("token_ordering", torch.zeros(vocab_size, dtype=torch.int64))

    def top_tokens(self, hidden: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """The best-scoring token id [N] int64 of each row of hidden [N, hidden] among the tokens of its top-k
        clusters, scored against `table` [V, hidden] (the tied embedding) in its dtype as HF's head computes them,
        one row at a time (the same call whatever N: a row's draft does not depend on its batch). E2B's shapes:
        4,096 rows of 256 a draft, 0.35 ms in bf16 on 2 Zen 3 cores (1.7 ms widened to float32 first)."""
        clusters = self.centroids(hidden).float().topk(self.top_k, dim=-1).indices  # [N, k]
        ids = self.token_ordering.view(-1, self.per_centroid)[clusters].flatten(1)  # [N, k · V / C]
        x = hidden.to(table.dtype)
        scores = torch.stack([table.index_select(0, ids[r]) @ x[r] for r in range(ids.shape[0])])
        return ids.gather(1, scores.float().argmax(-1, keepdim=True))[:, 0]


class Gemma4Assistant(nn.Module):
    """The assistant's modules under HF's names (`model.layers.*`, `model.norm`, `model.embed_tokens` (its tied
    head), `pre_projection`, `post_projection`, `masked_embedding.*`); `draft` runs one step for a batch.

    Args:
        cfg: its layers as a Gemma 4 text config (`assistant_config`); own: its own fields.
    """

    def __init__(self, cfg: LlamaModelConfig, own: dict[str, Any]) -> None:
        super().__init__()
        self.cfg, backbone = cfg, own["backbone_hidden_size"]
        self.model = LlamaBody(cfg)
        self.pre_projection = nn.Linear(2 * backbone, cfg.hidden_size, bias=False)
        self.post_projection = nn.Linear(cfg.hidden_size, backbone, bias=False)
        self.masked_embedding = (MaskedEmbedding(cfg.hidden_size, cfg.vocab_size, own["num_centroids"],
                                                 own["centroid_intermediate_top_k"])
                                 if own["use_ordered_embeddings"] else None)
        self.layer_types = tuple(cfg.layer_types or ("full_attention",) * cfg.num_hidden_layers)
        self.register_buffer("rope_table", torch.zeros(1, 2, 1), persistent=False)  # sized to the target's
        self.dense_head: nn.Module | None = None  # the tied head on nextn's dense kernel (set at load where it runs)

    def size_rope(self, num_positions: int, device: torch.device) -> None:
        """Build `rope_table` [num_positions, 2 or 4, max head_dim // 2] fp32 (the target's length)."""
        self.rope_table = rope_cache(self.cfg, num_positions).to(device)

    def attention_inputs(self, positions: torch.Tensor, meta: AttentionMetadata,
                         block_map: torch.Tensor | None = None) -> dict[str, tuple[torch.Tensor, AttentionMetadata]]:
        """(cos_sin, metadata) per layer type for queries at `positions` [B, 1] int64 — p, each row's last token's
        position: its rope rows, and keys at 0..p − 1 (sliding layers: p − window + 1 .. p − 1) of the rows' block
        tables (`meta`: any forward's over these requests; `block_map`: the target's sliding blocks, where its
        sliding layers' rows have their own, `AttentionMetadata.windowed`). The same for every draft of a chain."""
        query = meta.with_tokens(positions, torch.zeros_like(positions))
        keys = torch.arange(query.max_context, device=positions.device)
        before = (keys[None, None, :] < positions[:, :, None])[:, None]  # [B, 1, 1, S]: not the query's own slot
        table = self.rope_table[positions]  # [B, 1, 2 or 4, D / 2]
        inputs = {"full_attention": (table[..., :2, :], replace(query, visible=query.visible & before))}
        if "sliding_attention" in self.layer_types:
            windowed = query.windowed(self.cfg.sliding_window, block_map)
            inputs["sliding_attention"] = (table[..., -2:, :], replace(windowed, visible=windowed.visible & before))
        return inputs

    def draft(self, embeds: torch.Tensor, hidden: torch.Tensor, inputs: dict[str, tuple[torch.Tensor, Any]],
              kv_rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft step.

        Args:
            embeds: [B, 1, backbone] the target's (scaled) embedding of each row's last token (or of the last draft).
            hidden: [B, 1, backbone] the target's final normed hidden state (or the previous step's `post_projection`).
            inputs: `attention_inputs` of the rows' position.
            kv_rows: per assistant layer, the target cache row it reads ([num_slots, width], read only).
        Returns:
            (draft tokens [B, 1] int64, the next step's hidden [B, 1, backbone]).
        """
        x = self.pre_projection(torch.cat([embeds, hidden], dim=-1))
        for layer, kind, kv in zip(self.model.layers, self.layer_types, kv_rows):
            cos_sin, layer_meta = inputs[kind]
            x = layer(x, cos_sin, kv, layer_meta)
        normed = self.model.norm(x)  # [B, 1, h]
        return self._head(normed[:, 0])[:, None], self.post_projection(normed)

    def _head(self, normed: torch.Tensor) -> torch.Tensor:
        """Draft tokens [B] int64 from normed [B, hidden]."""
        table = self.model.embed_tokens.weight
        if self.masked_embedding is not None:
            return self.masked_embedding.top_tokens(normed, table)
        if self.dense_head is not None:
            return self.dense_head(normed).float().argmax(-1)
        return vocab_projection(table, normed).float().argmax(-1)
