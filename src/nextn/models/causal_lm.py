"""What every target model family shares: the runtime's model surface over a paged KV cache.

`SelfDraftingCausalLM` holds the methods the steps and drafters call — `forward`, `logits`, `draft_logits`,
`forward_mtp`, `mtp_logits`, `num_cache_layers` — for a family that provides `self.cfg` (with `num_hidden_layers`,
`num_nextn_predict_layers`), `self.model` (`embed_tokens`, `layers` = decoder layers then MTP layers, `norm`),
`self.lm_head` and the `rope_table` buffer. MTP layers page through the same block tables as the target (one cache
tensor, one row per layer). Families: `deepseek_v3.model`, `llama.model`.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from nextn.models import per_layer_inputs
from nextn.plugins.decoder_layer import FusedStack, stack_forward
from nextn.models.attention_metadata import AttentionMetadata
from nextn.models.recurrent_state import RecurrentState


def vocab_projection(weight: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """hidden [..., H] @ weight[V, H]^T → [..., V], computed as weight @ hidden^T.

    With few rows (decode) and a large vocabulary, CPU BLAS runs the [V, H] × [H, rows] orientation several times
    faster than `F.linear`'s, and a single fp32 row falls to a single-threaded GEMV: pad it to two (measured on
    the 2-core CI machine: 1.7 ms → 0.8 ms for V = 129280, H = 64; bf16 needs no padding: 0.33 ms). Shapes stay static.
    """
    flat = hidden.reshape(-1, hidden.shape[-1])
    rows = flat.shape[0]
    if rows == 1 and weight.dtype == torch.float32:
        flat = torch.cat([flat, flat])
    out = (weight @ flat.T).T[:rows]
    return out.reshape(*hidden.shape[:-1], weight.shape[0])


class SelfDraftingCausalLM(nn.Module):
    """The shared model surface; subclasses build `cfg`, `model`, `lm_head`, `rope_table` and `rope_table_for`."""

    draft_head_weight: torch.Tensor | None = None
    draft_hot_tokens: torch.Tensor | None = None  # `cut_draft_head`: the token id of each draft head row
    #: The lm_head is a `WeightOnlyLinear` (a quantized engine): logits come from calling it, not from its weight.
    lm_head_quantized: bool = False
    #: Every decoder layer as one op call (`plugins.decoder_layer.install_fused_layers`, W4A16 / W4A8 on the CPU).
    fused_stack: FusedStack | None = None
    #: The `attention_inputs` entry each decoder layer reads ("full_attention" / "sliding_attention", ":nope" added
    #: for a layer without RoPE; None: every layer full attention with RoPE) and the sliding layers' window: plain
    #: attributes, set by a family with such layers (torch.compile traces them).
    layer_types: tuple[str, ...] | None = None
    sliding_window: int | None = None
    #: [num_pool_blocks] int64: where the sliding layers' cache rows have blocks of their own, the sliding block of
    #: each pool block (`runtime/sliding_blocks.py`; set by the engine), else None
    sliding_block_map: torch.Tensor | None = None
    logits_scaling: float = 1.0  # logits ÷ this (Granite's `logits_scaling`)
    mtp_chain_normed: bool = False  # `mtp_chain_hidden`: the config's, a plain attribute (torch.compile traces it)
    final_logit_softcapping: float | None = None  # logits → cap · tanh(logits / cap) (Gemma 2)
    #: Per decoder layer its KV-cache row, −1 for a linear-attention layer (None: layer i is row i); how many
    #: decoder layers are linear-attention ones (plain attributes, set by the family: torch.compile traces them)
    cache_rows: tuple[int, ...] | None = None
    #: Per decoder layer the first column of its K and V in its row, where narrow layers share rows (Gemma 4:
    #: `LlamaModelConfig.kv_cache_layout`); None: every layer's row is its own
    cache_columns: tuple[int, ...] | None = None
    num_cache_rows: int | None = None  # the decoder layers' cache rows where they share rows (None: one a layer)
    num_linear_layers: int = 0
    num_kv_shared_layers: int = 0  # decoder layers reading an earlier layer's cache row (Gemma 4)
    per_layer_inputs: bool = False  # the layers take per-layer inputs (Gemma 4's PLE: `models/per_layer_inputs.py`)
    #: The linear-attention layers' per-request state (`allocate_recurrent_state`), None for a model without them
    recurrent_state: RecurrentState | None = None
    #: The batch slot of each row of the forward about to run ([B] int64; `bind_batch_slots`)
    batch_slots: torch.Tensor | None = None

    def __init__(self) -> None:
        super().__init__()
        self.draft_head: nn.Module | None = None  # `cut_draft_head` of a quantized engine: the hot rows, W8A16
        # The lm_head on nextn's batch-invariant dense kernel (`plugins.dense_linear.install_dense_linears`); an
        # instance attribute, as a submodule assigned later must not be shadowed by a class attribute.
        self.dense_lm_head: nn.Module | None = None

    @property
    def num_cache_layers(self) -> int:
        """KV-cache layers: the attention decoder layers (not linear-attention ones), then the MTP layers."""
        return self.num_attention_layers + self.cfg.num_nextn_predict_layers

    @property
    def num_attention_layers(self) -> int:
        """The decoder layers' KV-cache rows (the MTP layers' come after them)."""
        if self.num_cache_rows is not None:
            return self.num_cache_rows
        return self.cfg.num_hidden_layers - self.num_linear_layers - self.num_kv_shared_layers

    @property
    def has_recurrent_state(self) -> bool:
        """Whether some decoder layer keeps per-request recurrent state (Gated DeltaNet) instead of KV."""
        return self.num_linear_layers > 0

    def allocate_recurrent_state(self, num_slots: int, ring: int, device: torch.device | str) -> int:
        """Allocate the linear-attention layers' state for `num_slots` batch slots, `ring` states each (K + 1 for
        K drafts: `models/recurrent_state.py`); returns its bytes (0 for a model without such layers)."""
        if not self.has_recurrent_state:
            return 0
        layer = self.model.layers[self.cfg.linear_layers[0]].linear_attn
        self.recurrent_state = RecurrentState(len(self.cfg.linear_layers), num_slots, ring, layer.conv_dim,
                                              layer.kernel, layer.value_heads, layer.key_dim, layer.value_dim, device)
        return self.recurrent_state.nbytes

    def bind_batch_slots(self, slots: torch.Tensor) -> None:
        """The batch slot of each row [B] int64 of the next forwards (the model runner, before a step): where a
        model with recurrent state reads and keeps each row's state."""
        self.batch_slots = slots

    def _cos_sin(self, positions: torch.Tensor) -> torch.Tensor:
        """The full-attention layers' rope rows at `positions` [B, T]: [B, T, 2, rope_dim // 2]."""
        return self.rope_table[positions.clamp(min=0)][..., :2, :]

    def attention_inputs(self, meta: AttentionMetadata) -> dict[str, tuple[torch.Tensor, AttentionMetadata]]:
        """(cos_sin [B, T, 2, rope_dim // 2], metadata) per layer input key: `full_attention` always,
        `sliding_attention` where the config has sliding layers (their rope rows: the table's second pair when it has
        one; their metadata: `AttentionMetadata.windowed`), and `<type>:nope` for layers without RoPE (cos 1, sin 0:
        the rotation is the identity, exactly)."""
        table = self.rope_table[meta.positions.clamp(min=0)]  # [B, T, 2 or 4, rope_dim // 2]
        inputs = {"full_attention": (table[..., :2, :], meta)}
        if self.sliding_window is not None:
            inputs["sliding_attention"] = (table[..., -2:, :], meta.windowed(self.sliding_window,
                                                                                 self.sliding_block_map))
        if self.layer_types is not None and "linear_attention" in self.layer_types:
            inputs["linear_attention"] = inputs["full_attention"]  # no positions: the layer ignores the rows
        if self.layer_types is not None and any(k.endswith(":nope") for k in self.layer_types):
            identity = torch.stack([torch.ones_like(table[..., 0, :]), torch.zeros_like(table[..., 0, :])], -2)
            inputs.update({f"{k}:nope": (identity, m) for k, (_, m) in list(inputs.items())})
        return inputs

    def forward(self, input_ids: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Target forward. input_ids: [B, T] int64 → hidden states after the final norm [B, T, hidden]; writes KV
        at the tokens' slots."""
        x = self.model.embed_tokens(input_ids)
        state, rows = self.recurrent_state, None
        if state is not None:
            if self.batch_slots is None or self.batch_slots.shape[0] != input_ids.shape[0]:
                raise RuntimeError("a model with recurrent state needs its rows' batch slots (bind_batch_slots)")
            rows = state.rows(self.batch_slots, meta.positions, meta.slot_mapping >= meta.block_size)
            meta = replace(meta, recurrent=(state, rows))
        inputs = self.attention_inputs(meta)
        if self.fused_stack is not None and x.dtype == kv_cache.dtype == torch.bfloat16:
            return self.model.norm(stack_forward(self.fused_stack, x, inputs, kv_cache))
        types, cache_rows, columns = self.layer_types, self.cache_rows, self.cache_columns
        per_layer = per_layer_inputs.model_inputs(self.model, input_ids, x) if self.per_layer_inputs else None
        for i in range(self.cfg.num_hidden_layers):
            cos_sin, layer_meta = inputs[types[i] if types is not None else "full_attention"]
            row = i if cache_rows is None else cache_rows[i]
            kv = kv_cache[row] if row >= 0 else None
            if columns is not None and columns[i]:  # a narrow layer's columns of a shared row (a strided view)
                kv = kv[:, columns[i]:]
            if per_layer is not None:
                x = self.model.layers[i](x, cos_sin, kv, layer_meta, per_layer[:, :, i])
                continue
            x = self.model.layers[i](x, cos_sin, kv, layer_meta)
        if state is not None:
            state.advance(rows)
        return self.model.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """lm_head: [..., hidden] → [..., vocab] fp32 (÷ `logits_scaling`, soft-capped at `final_logit_softcapping`
        where the family has them)."""
        if self.lm_head_quantized:
            logits = self.lm_head(hidden).float()
        elif self.dense_lm_head is not None:
            logits = self.dense_lm_head(hidden).float()
        else:
            logits = vocab_projection(self.lm_head.weight, hidden).float()
        return self._finish_logits(logits)

    def _finish_logits(self, logits: torch.Tensor) -> torch.Tensor:
        if self.logits_scaling != 1.0:
            logits = logits / self.logits_scaling
        if self.final_logit_softcapping:
            logits = torch.tanh(logits / self.final_logit_softcapping) * self.final_logit_softcapping
        return logits

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The drafters' lm_head: [..., hidden] → [..., vocab] fp32, through `draft_head_weight` when set.

        Drafts only propose tokens (the target verifies them), so a cheaper copy of the head — bf16 for an fp32
        engine, or only its hot rows (`cut_draft_head`: −inf for every other token) — changes acceptance at most,
        never the output.
        """
        if self.draft_head is not None:
            logits = self.draft_head(hidden).float()
        elif self.draft_head_weight is None and self.lm_head_quantized:
            return self.logits(hidden)
        else:
            weight = self.draft_head_weight if self.draft_head_weight is not None else self.lm_head.weight
            logits = vocab_projection(weight, hidden.to(weight.dtype)).float()  # fp32 argmax is faster on CPU
        logits = self._finish_logits(logits)
        if self.draft_hot_tokens is None:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.cfg.vocab_size), float("-inf"))
        return full.index_copy_(-1, self.draft_hot_tokens, logits)

    def cut_draft_head(self, hot: torch.Tensor, chunk: int = 256) -> None:
        """Let drafters read only the lm_head rows of `hot` (sorted token ids [V'] int64; speculative/draft_vocab.py):
        `draft_head_weight` becomes those rows [V', hidden] (in `draft_head_weight`'s dtype when set, else the
        model's). A quantized head is dequantized by passing the identity through it, `chunk` rows at a time, and
        its rows quantized again as `draft_head`, W8A16 per row (exact for an int8 head, whose rows keep their
        values and scales): a quarter of bf16's bytes, and at one decode row the head's read is its cost (Qwen2.5's
        151,936 × 896 int8 head: 4.4 ms; 32,768 rows: ~1 ms).
        """
        if self.draft_head_weight is not None:
            rows = self.draft_head_weight.index_select(0, hot.to(self.draft_head_weight.device))
        elif self.lm_head_quantized:
            head, h = self.lm_head, self.lm_head.in_features
            eye = torch.eye(h, device=hot.device)
            cols = [head(eye[i:i + chunk]).float().index_select(-1, hot) for i in range(0, h, chunk)]  # W[hot]ᵀ
            dtype = self.model.norm.weight.dtype
            rows = torch.cat(cols).t().to(torch.bfloat16 if dtype == torch.float32 else dtype)
        else:
            rows = self.lm_head.weight.detach().index_select(0, hot)
        self.draft_hot_tokens = hot.to(rows.device)
        if self.lm_head_quantized and rows.device.type == "cpu":
            from nextn.quantization.linear import WeightOnlyLinear
            from nextn.quantization.weight_only import QuantConfig, quantize

            cfg = QuantConfig(quant_algo="W8A16")
            self.draft_head, self.draft_head_weight = WeightOnlyLinear(quantize(rows, cfg), cfg), None
        else:
            self.draft_head_weight = rows.contiguous()

    def use_bf16_draft_head(self) -> None:
        """Give drafters a bf16 copy of lm_head (about 5× faster on CPUs with bf16 matmul units; lossless)."""
        if not self.lm_head_quantized and self.lm_head.weight.dtype != torch.bfloat16:
            self.draft_head_weight = self.lm_head.weight.detach().to(torch.bfloat16)

    def mtp_layer(self, k: int) -> nn.Module:
        return self.model.layers[self.cfg.num_hidden_layers + k]

    def forward_mtp(self, k: int, input_ids: torch.Tensor, hidden_prev: torch.Tensor, kv_cache: torch.Tensor,
                    meta: AttentionMetadata) -> torch.Tensor:
        """MTP module k. input_ids: [B, T] (the token one position ahead of hidden_prev's); hidden_prev: [B, T, hidden]
        (the target's final hidden for k's first use, else the previous module's output) → [B, T, hidden]."""
        embeds = self.model.embed_tokens(input_ids)
        return self.mtp_layer(k).forward_mtp(embeds, hidden_prev, self._cos_sin(meta.positions),
                                             kv_cache[self.num_attention_layers + k], meta)

    def mtp_chain_hidden(self, k: int, hidden: torch.Tensor) -> torch.Tensor:
        """What the next chained use of a module reads from module k's output `hidden` [..., hidden]:
        `shared_head.norm(hidden)` where the family's MTP layer chains normed states (`mtp_chain_normed`: the
        released layers of Qwen3.5 / Qwen3-Next and GLM-4.5, as `transformers`' `MtpModel`, vLLM's
        `qwen3_next_mtp.py` and llama.cpp's `qwen35.cpp` / `glm4-moe.cpp` chain them), else `hidden` itself (the
        modules `nextn train-draft` trains; DeepSeek-V3's layout, as vLLM's `deepseek_mtp.py`)."""
        return self.mtp_layer(k).shared_head.norm(hidden) if self.mtp_chain_normed else hidden

    def mtp_logits(self, k: int, hidden: torch.Tensor) -> torch.Tensor:
        """lm_head(shared_head.norm(h)) of MTP module k: [..., hidden] → [..., vocab] fp32."""
        return self.draft_logits(self.mtp_layer(k).shared_head.norm(hidden))
