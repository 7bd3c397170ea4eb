"""Gemma 4's GGUF (llama.cpp architecture `gemma4`): its tensor names and the HF config (`Gemma4TextConfig`'s field
names) read from its metadata.

Sources: llama.cpp's converter, `conversion/gemma.py` (`Gemma4Model.set_gguf_parameters`: `attention.key_length` /
`value_length` are the full-attention layers' head size and `*_swa` the sliding ones'; `attention.head_count_kv` a
count or one per layer; `feed_forward_length` one per layer where the KV-shared layers' MLP is double wide;
`attention.shared_kv_layers`, `embedding_length_per_layer_input`, `attention.sliding_window_pattern` one bool a layer;
`generate_extra_tensors`: the full layers' "proportional" rope as a `rope_freqs` tensor of head_size / 2 factors, 1
for each rotated pair and 1e30 for each pair that passes through; norms stored as they are — Gemma 4's RMSNorm scales
by w, not 1 + w) and the tensor names of `gguf-py`'s `MODEL_ARCH.GEMMA4` (`inp_gate`, `proj`, `post_norm`,
`layer_output_scale`, `per_layer_token_embd`, `per_layer_model_proj`, `per_layer_proj_norm`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from nextn.build.checkpoint import CheckpointError

#: llama.cpp block tensor → HF module under `model.layers.N.` (Gemma's four norms; the per-layer input block)
BLOCK = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
    "inp_gate": "per_layer_input_gate", "proj": "per_layer_projection", "post_norm": "post_per_layer_input_norm",
    "layer_output_scale": "layer_scalar",
}  # fmt: skip
#: Block tensors whose HF name is not `<module>.<weight | bias>` (without `blk.N.` → without `model.layers.N.`)
TENSOR_NAMES = {"layer_output_scale.weight": "layer_scalar"}
#: The per-layer inputs' model-level tensors
GLOBAL_NAMES = {"per_layer_token_embd.weight": "model.embed_tokens_per_layer.weight",
                "per_layer_model_proj.weight": "model.per_layer_model_projection.weight",
                "per_layer_proj_norm.weight": "model.per_layer_projection_norm.weight",
                # a Gemma 4 assistant's (`gemma4-assistant`: conversion/gemma.py `Gemma4AssistantModel`)
                "nextn.pre_projection.weight": "pre_projection.weight",
                "nextn.post_projection.weight": "post_projection.weight"}


def assistant_config(text: dict[str, Any], backbone_hidden_size: int) -> dict[str, Any]:
    """The HF config of a `gemma4-assistant` file (`Gemma4AssistantConfig`'s fields) around its layers' text config
    `text` (read as a gemma4 file's). llama.cpp's converter leaves the centroid-masked head out (its drafts score the
    whole tied embedding), so the config says `use_ordered_embeddings` false."""
    text = {**text, "architectures": ["Gemma4ForCausalLM"], "model_type": "gemma4_text"}
    return {"architectures": ["Gemma4AssistantForCausalLM"], "model_type": "gemma4_assistant", "text_config": text,
            "backbone_hidden_size": backbone_hidden_size, "use_ordered_embeddings": False,
            "tie_word_embeddings": True}


def config(key: Callable[..., Any], layers: int, factors: Callable[[str, int], list[float] | None],
           has: Callable[[str], bool]) -> dict[str, Any]:
    """The HF config fields of a `gemma4` file (`key(name, kind, default)` reads `gemma4.{name}`; `factors(tensor
    name, count)` a factor tensor's values; `has(HF name)` whether the file holds a tensor). The per-layer
    embedding's rows are the vocabulary's (as in every release; a file where they differ fails the shape check).

    Raises:
        CheckpointError: experts (the MoE variant), a per-layer list whose length is not the layer count, KV heads or MLP widths that differ
            within a layer type other than as Gemma 4 has them, or a `rope_freqs` that is not 1s then 1e30s.
    """
    if key("expert_count", "raw", 0):
        raise CheckpointError("a gemma4 GGUF with experts (Gemma 4's MoE: a dense MLP beside its experts) is not "
                              "supported yet; the dense Gemma 4 models are")
    pattern = key("attention.sliding_window_pattern", "raw", None)
    if not isinstance(pattern, list) or len(pattern) < layers:
        raise CheckpointError(f"gemma4.attention.sliding_window_pattern must list a bool for each of the "
                              f"{layers} layers")
    types = ["sliding_attention" if p else "full_attention" for p in pattern[:layers]]
    shared = key("attention.shared_kv_layers", "count", 0) if key("attention.shared_kv_layers", "raw", 0) else 0

    def per_layer(name: str) -> list[int]:
        value = key(name, "raw", None)
        values = [int(v) for v in value] if isinstance(value, list) else [key(name, "count", None)] * layers
        if len(values) != layers:
            raise CheckpointError(f"gemma4.{name} lists {len(values)} values for {layers} layers")
        return values

    kv_heads, ffn = per_layer("attention.head_count_kv"), per_layer("feed_forward_length")
    by_type = {t: {kv_heads[i] for i in range(layers) if types[i] == t} for t in set(types)}
    first_shared = layers - shared
    wide = {ffn[i] for i in range(first_shared, layers)}
    own = ffn[:first_shared] or ffn  # an assistant's layers all read shared KV (`gemma4-assistant`)
    if any(len(v) != 1 for v in by_type.values()) or len(set(own)) != 1 or len(wide) > 1 or (
            wide and wide.pop() not in (ffn[0], 2 * ffn[0])):
        raise CheckpointError(f"gemma4 KV heads {kv_heads} or MLP widths {ffn} differ within a layer type "
                              "otherwise than Gemma 4's (the KV-shared layers' MLP 1 or 2 times the others')")
    global_dim = key("attention.key_length", "count", None)
    full = next((i for i in range(first_shared) if types[i] == "full_attention"), None)
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": key("rope.freq_base", "number", 1_000_000.0)}
    values = factors("rope_freqs.weight", global_dim // 2)
    if values is not None:  # 1 for a rotated pair, 1e30 (a frequency of ~0) for one that passes through
        rotated = sum(1 for v in values if v == 1.0)
        if values != [1.0] * rotated + [values[-1]] * (len(values) - rotated) or (rotated < len(values)
                                                                                   and values[-1] < 1e20):
            raise CheckpointError("gemma4 rope_freqs must be 1s then 1e30s (proportional rope)")
        rope = {**rope, "rope_type": "proportional", "partial_rotary_factor": rotated / (global_dim // 2)}
    return {
        "hidden_activation": "gelu_pytorch_tanh", "layer_types": types,
        "sliding_window": key("attention.sliding_window", "count", 512),
        "head_dim": key("attention.key_length_swa", "count", global_dim), "global_head_dim": global_dim,
        "num_key_value_heads": next(iter(by_type.get("sliding_attention", by_type["full_attention"]))),
        "num_global_key_value_heads": next(iter(by_type.get("full_attention", by_type["sliding_attention"]))),
        "intermediate_size": ffn[0], "use_double_wide_mlp": ffn[-1] == 2 * ffn[0] and shared > 0,
        "num_kv_shared_layers": shared,
        "hidden_size_per_layer_input": key("embedding_length_per_layer_input", "raw", 0) or 0,
        "attention_k_eq_v": full is not None and not has(f"model.layers.{full}.self_attn.v_proj.weight"),
        "final_logit_softcapping": key("final_logit_softcapping", "number", 0.0) or None,
        "rope_parameters": {"full_attention": rope, "sliding_attention": {
            "rope_type": "default", "rope_theta": key("rope.freq_base_swa", "number", 10_000.0)}},
        "rope_freq_factors": None, "rope_scaling": None,
    }  # fmt: skip
