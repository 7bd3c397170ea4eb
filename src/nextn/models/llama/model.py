"""Llama for inference over a paged KV cache: RMSNorm, RoPE (Llama-3 scaling), GQA attention, SwiGLU MLP.

Sources: Touvron et al. 2023 ("Llama 2", §2.2: pre-norm RMSNorm, SwiGLU, RoPE, GQA); parameter names and numerics
follow HF `transformers` `LlamaForCausalLM`, the oracle (fp32 logits matched to ~1e-5). The interface mirrors
`nextn.models.deepseek_v3.model.DeepseekV3ForCausalLM` (forward over fixed-shape tensors and an
`AttentionMetadata`, `logits`, `draft_logits`, `num_cache_layers`, the `rope_table` buffer, and the MTP surface
`forward_mtp` / `mtp_logits`), so the runtime's steps and drafters run either family. Per token per layer the cache
holds K then V of every KV head: [2 · num_key_value_heads · head_dim].

MTP for Llama (issue 4): a checkpoint with `num_nextn_predict_layers` = K > 0 holds K DeepSeek-style MTP modules
(DeepSeek-V3 report §2.2) at `model.layers.{num_hidden_layers + i}`: `enorm`, `hnorm`, `eh_proj`, one Llama decoder
block and `shared_head.norm`, with the main model's embedding and lm_head shared; their KV pages through the same
block tables as extra cache layers. `nextn train-draft --method mtp` trains them by self-distillation.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from nextn.models.causal_lm import SelfDraftingCausalLM
from nextn.models.gated_deltanet import GatedDeltaNet
from nextn.models.layers import (Fp32WeightRMSNorm, GatedMLP, PreNormDecoderLayer, RMSNorm, UnitOffsetRMSNorm,
                                 WeightlessRMSNorm, row_exact)
from nextn.models import per_layer_inputs
from nextn.models.llama.config import LlamaModelConfig
from nextn.models.llama.rope import apply_rope, rope_cache
from nextn.models.moe import ClampedSwiGLU, NoAuxRouter, Router, SparseMoE
from nextn.plugins import cpu_kernels, gated_delta
from nextn.plugins.decoder_layer import FusedLayerWeights, fused_forward
from nextn.plugins.moe_experts import block_forward
from nextn.plugins.kv_cache_write import kv_cache_write
from nextn.models.attention_metadata import AttentionMetadata


def norm_class(cfg: LlamaModelConfig) -> type[RMSNorm]:
    """The family's RMSNorm (`cfg.norm_style`): Llama's, Gemma's (1 + weight) or OLMo 2's (weight in fp32)."""
    return {"llama": RMSNorm, "unit_offset": UnitOffsetRMSNorm, "fp32_weight": Fp32WeightRMSNorm}[cfg.norm_style]


class ScaledEmbedding(nn.Embedding):
    """Token embeddings times `multiplier` rounded to the weight's dtype (HF `Gemma3TextScaledWordEmbedding`:
    √hidden_size); the weight is HF's `embed_tokens.weight`, unscaled."""

    def __init__(self, num_embeddings: int, embedding_dim: int, multiplier: float) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.multiplier = multiplier

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = super().forward(input_ids)
        return x * torch.tensor(self.multiplier, dtype=x.dtype)


class LlamaAttention(nn.Module):
    """Grouped-query attention with HF parameter names (`q_proj`, `k_proj`, `v_proj`, `o_proj`); q/k/v biases when
    `cfg.has_qkv_bias` (Qwen2), an o_proj bias too when `cfg.attention_bias`; per-head RMSNorms of q and k before
    RoPE (`q_norm`, `k_norm` [head_dim]) when `cfg.qk_norm` (Qwen3, Gemma 3); with `cfg.attn_output_gate` the
    output is multiplied by sigmoid(`gate_proj`(x)) before o_proj (Qwen3.5's gated attention).

    `paged_attention_kernel` (set at load by `plugins.paged_attention.install_paged_attention` where it applies):
    attend with nextn's CPU kernel, reading the cache in place, instead of the PyTorch gather-and-einsum path.
    """

    paged_attention_kernel = False

    def __init__(self, cfg: LlamaModelConfig, index: int | None = None) -> None:
        super().__init__()
        h = cfg.hidden_size
        d = cfg.head_dim if index is None else cfg.layer_head_dim(index)
        nkv = cfg.num_key_value_heads if index is None else cfg.layer_kv_heads(index)
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, nkv, d
        self.kv_width = 2 * nkv * d  # this layer's columns of a cache row (Gemma 4: its rows may be wider)
        #: Gemma 4: a KV-shared layer attends to an earlier layer's cache and writes none; with k_eq_v a full layer's
        #: V is its K projection; V is normalised by a weightless RMSNorm (`v_norm`)
        self.kv_shared = index is not None and cfg.is_kv_shared(index)
        self.k_eq_v = index is not None and cfg.attention_k_eq_v and cfg.is_global_layer(index)
        self.v_norm = WeightlessRMSNorm(cfg.rms_norm_eps) if cfg.v_norm else None
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=cfg.has_qkv_bias)
        if not self.kv_shared:
            self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=cfg.has_qkv_bias)
        if not self.kv_shared and not self.k_eq_v:
            self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=cfg.has_qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=cfg.attention_bias)
        self.output_gate = cfg.attn_output_gate
        if self.output_gate:
            self.gate_proj = nn.Linear(h, self.num_heads * d, bias=False)
        self.qk_norm_all_heads = cfg.qk_norm_over == "all_heads"  # OLMo 2: one norm over all heads of q (of k)
        if cfg.qk_norm:
            full = self.qk_norm_all_heads
            self.q_norm = norm_class(cfg)(self.num_heads * d if full else d, eps=cfg.rms_norm_eps)
            if not self.kv_shared:
                self.k_norm = norm_class(cfg)(self.num_kv_heads * d if full else d, eps=cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        self.scale = cfg.softmax_scale
        self.softcap = cfg.attn_logit_softcapping  # Gemma 2: scores → cap · tanh(scores / cap); None: none
        # gpt-oss: a logit per query head joining each softmax (float32 in every engine, as the scores are)
        self.sinks = nn.Parameter(torch.zeros(self.num_heads), requires_grad=False) if cfg.attn_sinks else None

    def forward(self, x: torch.Tensor, cos_sin: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """Attend the query tokens to their sequences' cached K/V, after writing their own.

        Args:
            x: [B, T, hidden] normalised hidden states.
            cos_sin: [B, T, 2, head_dim // 2] rope table rows at the tokens' positions.
            kv_cache: [num_slots, 2 · num_kv_heads · head_dim] this layer's paged cache (written in place).
            meta: positions, slot_mapping [B, T]; context_slots [B, S]; visible [B, 1, T, S].
        Returns:
            [B, T, hidden].
        """
        b, t, _ = x.shape
        nkv, d = self.num_kv_heads, self.head_dim
        group = self.num_heads // nkv
        if kv_cache.shape[-1] != self.kv_width:  # a row wider than this layer's K and V: its first columns
            kv_cache = kv_cache[:, :self.kv_width]
        if cos_sin.shape[-1] != d // 2:  # a rope table wider than this layer's heads: its first pairs
            cos_sin = cos_sin[..., :d // 2]
        if self.kv_shared or self.v_norm is not None:
            return self._gemma4_forward(x, cos_sin, kv_cache, meta)
        q, k = self.q_proj(x), self.k_proj(x)
        if self.qk_norm and self.qk_norm_all_heads:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.view(b, t, self.num_heads, d), k.view(b, t, nkv, d)  # [B, T, nh or nkv, d]
        if self.qk_norm and not self.qk_norm_all_heads:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos_sin), apply_rope(k, cos_sin)
        v = self.v_proj(x)  # [B, T, nkv · d]
        new_kv = torch.cat([k.reshape(b, t, nkv * d), v], dim=-1).to(kv_cache.dtype)  # [B, T, 2 · nkv · d]
        kv_cache_write(kv_cache, meta.slot_mapping.reshape(-1), new_kv.reshape(b * t, -1))
        return self._attend(q, x, kv_cache, meta)

    def _gemma4_forward(self, x: torch.Tensor, cos_sin: torch.Tensor, kv_cache: torch.Tensor,
                        meta: AttentionMetadata) -> torch.Tensor:
        """Gemma 4's attention (HF `Gemma4TextAttention`): per-head q/k norms, V from v_proj or (k_eq_v) the raw K
        projection, normalised without weight; a KV-shared layer computes its query only."""
        b, t, _ = x.shape
        q = apply_rope(self.q_norm(self.q_proj(x).view(b, t, self.num_heads, self.head_dim)), cos_sin)
        if not self.kv_shared:
            raw = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
            v = self.v_proj(x).view(raw.shape) if not self.k_eq_v else raw
            k = apply_rope(self.k_norm(raw), cos_sin)
            new_kv = torch.cat([k.reshape(b, t, -1), self.v_norm(v).reshape(b, t, -1)], -1).to(kv_cache.dtype)
            kv_cache_write(kv_cache, meta.slot_mapping.reshape(-1), new_kv.reshape(b * t, -1))
        return self._attend(q, x, kv_cache, meta)

    def _attend(self, q: torch.Tensor, x: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """o_proj(attention of q [B, T, heads, head_dim] over the layer's cached context); x: the layer input."""
        b, t = q.shape[:2]
        nkv, d = self.num_kv_heads, self.head_dim
        group = self.num_heads // nkv
        if self.paged_attention_kernel and kv_cache.dtype == q.dtype:  # row-strided views too (Gemma 4)
            o = cpu_kernels.ops().paged_attention(q, kv_cache, meta.context_slots, meta.visible, self.scale,
                                                  self.softcap or 0.0,
                                                  self.sinks.float() if self.sinks is not None else None)
            return self.o_proj(self._gated(o, x))

        # Each sequence's context through its block table: [B, S, 2, nkv, d], S = max_blocks · block_size.
        ctx = kv_cache[meta.context_slots].to(x.dtype)
        s = ctx.shape[1]
        k_ctx, v_ctx = ctx.view(b, s, 2, nkv, d).unbind(2)  # [B, S, nkv, d] each
        q = q.view(b, t, nkv, group, d)  # query head h = kv head h // group (HF `repeat_kv`)
        scores = torch.einsum("btkgd,bskd->bkgts", q, k_ctx).float() * self.scale  # [B, nkv, group, T, S]
        if self.softcap:
            scores = torch.tanh(scores / self.softcap) * self.softcap
        scores = scores.reshape(b, self.num_heads, t, s).masked_fill(~meta.visible, float("-inf"))
        if self.sinks is not None:  # the sink joins the softmax as one more logit, then is dropped (no value)
            sink = self.sinks.float().view(1, -1, 1, 1).expand(b, -1, t, 1)
            probs = F.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :s].to(x.dtype).view(b, nkv, group, t, s)
        else:
            probs = F.softmax(scores, dim=-1).to(x.dtype).view(b, nkv, group, t, s)
        o = torch.einsum("bkgts,bskd->btkgd", probs, v_ctx).reshape(b, t, self.num_heads * d)
        return self.o_proj(self._gated(o, x))

    def _gated(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """o × sigmoid(gate_proj(x)) with the output gate, else o."""
        return o * row_exact(torch.sigmoid, self.gate_proj(x)) if self.output_gate else o


def mlp_for(cfg: LlamaModelConfig, index: int | None) -> nn.Module:
    """Decoder layer `index`'s MLP: the sparse MoE one where `cfg.is_moe_layer(index)`, else the dense gated MLP."""
    if index is not None and cfg.is_moe_layer(index):
        gate = expert = None  # softmax top-k (`Router`), SwiGLU experts (`GatedMLP`)
        if cfg.router_bias:
            gate = Router(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob, bias=True)
        if cfg.expert_act == "clamped_swiglu":
            expert = partial(ClampedSwiGLU, cfg.hidden_size, cfg.moe_intermediate_size, cfg.swiglu_alpha,
                             cfg.swiglu_limit)
        if cfg.moe_router == "sigmoid_grouped":
            gate = NoAuxRouter(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group,
                               cfg.norm_topk_prob, cfg.routed_scaling_factor)
        shared = cfg.moe_intermediate_size * cfg.n_shared_experts if cfg.n_shared_experts else None
        return SparseMoE(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
                         cfg.norm_topk_prob, cfg.hidden_act, cfg.shared_expert_intermediate_size, gate, shared, expert)
    wide = index is not None and cfg.double_wide_mlp and cfg.is_kv_shared(index)  # Gemma 4's KV-shared layers
    return GatedMLP(cfg.hidden_size, cfg.intermediate_size * (2 if wide else 1), cfg.hidden_act)


class LlamaDecoderLayer(PreNormDecoderLayer):
    """Pre-norm (or sandwich-norm) block with GQA attention and a gated MLP (whether it attends to every earlier key
    or to the sliding window is the model's `layer_types`: the forward hands it the matching metadata).

    `fused` (set at load by `plugins.decoder_layer.install_fused_layers` where it applies: W4A16 engines on the
    CPU): run the whole layer as one op of nextn's CPU kernels instead of the modules one by one.
    """

    fused: FusedLayerWeights | None = None
    moe_block: bool = False  # the MoE MLP half as one op too (`plugins.moe_experts.block_forward`; set at load)
    #: Gemma 4: the layer ends with its per-layer input (`per_layer_inputs.layer_output`) and × `layer_scalar`
    per_layer_input: bool = False
    scaled: bool = False  # it holds a `layer_scalar` buffer (a flag: no attribute lookup that fails on the hot path)

    def __init__(self, cfg: LlamaModelConfig, index: int | None = None) -> None:
        super().__init__(LlamaAttention(cfg, index), mlp_for(cfg, index), cfg.hidden_size, cfg.rms_norm_eps,
                         placement=cfg.norm_placement, norm=norm_class(cfg),
                         residual_multiplier=cfg.residual_multiplier)
        decoder = index is not None and index < cfg.num_hidden_layers
        if decoder and cfg.hidden_size_per_layer_input:
            per_layer_inputs.add_layer_modules(self, cfg.hidden_size, cfg.hidden_size_per_layer_input, cfg.hidden_act,
                                               norm_class(cfg), cfg.rms_norm_eps)
            self.per_layer_input = True
        if decoder and cfg.layer_scalar:  # a buffer in HF (`nn.Buffer`), a checkpoint tensor all the same
            self.register_buffer("layer_scalar", torch.ones(1))
            self.scaled = True

    def forward(self, x: torch.Tensor, cos_sin: torch.Tensor, kv_cache: torch.Tensor, meta,
                per_layer_input: torch.Tensor | None = None) -> torch.Tensor:
        """x: [B, T, hidden] → [B, T, hidden]; writes this layer's KV (kv_cache: [num_slots, kv dim]);
        per_layer_input: [B, T, width], this layer's slice of the model's per-layer inputs (Gemma 4), else None."""
        if self.per_layer_input or self.scaled:
            x = super().forward(x, cos_sin, kv_cache, meta)
            if per_layer_input is not None:
                x = per_layer_inputs.layer_output(self, x, per_layer_input)
            return x * self.layer_scalar if self.scaled else x
        if self.fused is not None and x.dtype == kv_cache.dtype == torch.bfloat16:
            out = fused_forward(self, x, cos_sin, kv_cache, meta)
            # an MoE layer: the op ran the attention only (x + attn(norm(x))); its MLP runs here
            if self.moe_block:
                return block_forward(self.mlp, self.post_attention_layernorm, out)
            return out + self.mlp(self.post_attention_layernorm(out)) if self.fused.attention_only else out
        return super().forward(x, cos_sin, kv_cache, meta)


class LinearAttentionDecoderLayer(nn.Module):
    """A pre-norm block whose token mixer is a Gated DeltaNet (`linear_attn`: recurrent state, no KV) and whose MLP
    is the model's (HF `Qwen3_5DecoderLayer` of type linear_attention).

    `fused_deltanet` (set at load by `plugins.gated_delta.install_gated_delta` where it applies: W4A16 / W4A8
    engines on the CPU): run the whole layer as one op of nextn's CPU kernels instead of the modules one by one; with
    an MoE MLP the op runs the token mixer's half, and `moe_block` (set at load by `install_fused_layers`) the MLP
    half as `plugins.moe_experts.block_forward`."""

    fused_deltanet = None
    moe_block: bool = False

    def __init__(self, cfg: LlamaModelConfig, index: int, state_index: int) -> None:
        super().__init__()
        norm = norm_class(cfg)
        self.linear_attn = GatedDeltaNet(cfg, state_index)
        self.mlp = mlp_for(cfg, index)
        self.input_layernorm = norm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = norm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos_sin: torch.Tensor, kv_cache: torch.Tensor | None, meta) -> torch.Tensor:
        """x: [B, T, hidden] → [B, T, hidden]; keeps the layer's state for `meta.recurrent`'s rows."""
        if self.fused_deltanet is not None and x.dtype == torch.bfloat16:
            out = gated_delta.layer_forward(self, x, meta)
            if not self.fused_deltanet.attention_only:
                return out
            if self.moe_block:
                return block_forward(self.mlp, self.post_attention_layernorm, out)
            return out + self.mlp(self.post_attention_layernorm(out))
        x = x + self.linear_attn(self.input_layernorm(x), cos_sin, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


def decoder_layer(cfg: LlamaModelConfig, index: int) -> nn.Module:
    """Decoder layer `index`: a Gated DeltaNet block where `cfg.layer_types` says linear_attention, else Llama's."""
    linear = cfg.linear_layers
    if index in linear:
        return LinearAttentionDecoderLayer(cfg, index, linear.index(index))
    return LlamaDecoderLayer(cfg, index)


class SharedHead(nn.Module):
    """The MTP module's output norm (`shared_head.norm`); its head is the main model's lm_head."""

    def __init__(self, hidden_size: int, eps: float, norm: type[RMSNorm] = RMSNorm) -> None:
        super().__init__()
        self.norm = norm(hidden_size, eps=eps)


class LlamaMTPLayer(LlamaDecoderLayer):
    """One MTP module: h' = Block(eh_proj([enorm(embed(t)); hnorm(h)])), embedding first (DeepSeek's design)."""

    def __init__(self, cfg: LlamaModelConfig, index: int | None = None) -> None:
        super().__init__(cfg, index)
        self.enorm = norm_class(cfg)(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.hnorm = norm_class(cfg)(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.shared_head = SharedHead(cfg.hidden_size, cfg.rms_norm_eps, norm_class(cfg))

    def forward_mtp(self, token_embeds: torch.Tensor, hidden_prev: torch.Tensor, cos_sin: torch.Tensor,
                    kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """token_embeds, hidden_prev: [B, T, hidden] → the block output [B, T, hidden] (before shared_head.norm)."""
        x = self.eh_proj(torch.cat([self.enorm(token_embeds), self.hnorm(hidden_prev)], dim=-1))
        return super().forward(x, cos_sin, kv_cache, meta)


class LlamaBody(nn.Module):
    """`model.*`: embeddings, decoder layers then the MTP layers, final norm."""

    def __init__(self, cfg: LlamaModelConfig) -> None:
        super().__init__()
        self.embed_tokens = (ScaledEmbedding(cfg.vocab_size, cfg.hidden_size, cfg.embedding_multiplier)
                             if cfg.embedding_multiplier not in (None, 1.0) else nn.Embedding(cfg.vocab_size,
                                                                                              cfg.hidden_size))
        self.layers = nn.ModuleList([decoder_layer(cfg, i) for i in range(cfg.num_hidden_layers)]
                                    + [LlamaMTPLayer(cfg, cfg.num_hidden_layers + i)
                                       for i in range(cfg.num_nextn_predict_layers)])
        self.norm = norm_class(cfg)(cfg.hidden_size, eps=cfg.rms_norm_eps)
        if cfg.hidden_size_per_layer_input:  # Gemma 4's per-layer inputs (`per_layer_inputs.py`)
            assert cfg.vocab_size_per_layer_input is not None  # the config's check
            per_layer_inputs.add_model_modules(self, cfg.vocab_size_per_layer_input, cfg.hidden_size,
                                               cfg.num_hidden_layers, cfg.hidden_size_per_layer_input,
                                               norm_class(cfg), cfg.rms_norm_eps)


class TiedLMHead(nn.Module):
    """The lm_head of a tied model: `weight` is the embedding's [vocab, hidden] parameter, owned (and stored) once.

    The embedding module is held outside the module tree, so `state_dict` has no `lm_head.weight`, and `weight`
    follows the embedding when `load_state_dict(assign=True)` replaces its parameter.
    """

    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        self._embedding = (embedding,)  # a tuple: not registered as a submodule

    @property
    def weight(self) -> torch.Tensor:
        return self._embedding[0].weight


class LlamaForCausalLM(SelfDraftingCausalLM):
    """The Llama-family target model (Llama, Qwen2); parameter names are HF's. A tied model
    (`tie_word_embeddings`) has no `lm_head.weight` of its own: its lm_head is the embedding (`TiedLMHead`).

    The KV cache is one tensor [num_hidden_layers + num_nextn_predict_layers, num_slots, 2 · num_key_value_heads ·
    head_dim]: MTP layers page through the same block tables as the target.
    """

    def __init__(self, cfg: LlamaModelConfig, max_positions: int | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = LlamaBody(cfg)
        self.lm_head: nn.Module = (TiedLMHead(self.model.embed_tokens) if cfg.tie_word_embeddings
                                   else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False))
        self._register_load_state_dict_pre_hook(self._drop_tied_copy)
        self.layer_types = cfg.layer_input_keys
        self.logits_scaling = cfg.logits_scaling
        self.final_logit_softcapping = cfg.final_logit_softcapping
        self.mtp_chain_normed = cfg.mtp_chain_normed
        if cfg.has_sliding_layers:
            self.sliding_window = cfg.sliding_window
        if cfg.linear_layers or cfg.num_kv_shared_layers:
            # KV-cache rows of the attention layers only (-1: a Gated DeltaNet layer; a KV-shared layer: its source's)
            self.cache_rows = cfg.layer_cache_rows
            self.num_linear_layers = len(cfg.linear_layers)
            self.num_kv_shared_layers = cfg.num_kv_shared_layers
        if (layout := cfg.kv_cache_layout) is not None:  # layers of different widths sharing rows (Gemma 4)
            self.cache_rows = tuple(r for r, _ in layout)
            self.cache_columns = tuple(c for _, c in layout)
            self.num_cache_rows = 1 + max(self.cache_rows)
        self.per_layer_inputs = bool(cfg.hidden_size_per_layer_input)
        self.draft_head_weight: torch.Tensor | None = None
        self.register_buffer("rope_table", rope_cache(cfg, max_positions or cfg.max_position_embeddings),
                             persistent=False)

    def _drop_tied_copy(self, state_dict, prefix, *args) -> None:
        """Engines built before tied embeddings were stored once hold an explicit `lm_head.weight` copy: drop it."""
        if self.cfg.tie_word_embeddings:
            state_dict.pop(prefix + "lm_head.weight", None)

    def rope_table_for(self, num_positions: int) -> torch.Tensor:
        """A fresh `rope_table` [num_positions, 2 (4 with a sliding layers' rope base), head_dim // 2] fp32 on the CPU
        (after loading on the meta device)."""
        return rope_cache(self.cfg, num_positions)

