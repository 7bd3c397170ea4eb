"""A checkpoint's tensors in the engine's Llama layout where a family stores them otherwise: Phi-3's fused
`self_attn.qkv_proj` ([q + 2 kv, hidden]: q, then k, then v rows) and `mlp.gate_up_proj` ([2 · intermediate, hidden]:
gate rows, then up rows) read as q/k/v and gate/up by rows, and under partial rotary the q / k rows (and q/k norm
weights) of each head in `rope.partial_rotary_order`, and Mixtral's `block_sparse_moe.{gate, experts.E.w1 / w3 / w2}`
under the MoE layer's names (`mlp.gate`, `mlp.experts.E.gate_proj / up_proj / down_proj`).

Sources: HF `modeling_phi3.py` (`Phi3Attention` slices qkv in that order, `Phi3MLP` chunks gate_up in two);
llama.cpp's converter keeps both fused (`blk.N.attn_qkv`, phi3's `blk.N.ffn_up`: gate then up, ggml's swiglu order).

`StoredLayout` wraps a reader (`CheckpointReader` / `GGUFCheckpoint`) with the surface the engine build reads
(`names`, `has`, `tensor_info`, `get`, `native_w4a16`); every operation is a row selection, so a GGUF's 4-bit blocks
(`native_w4a16`: one row of blocks per output channel) are selected as they are.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from nextn.models.llama.config import LlamaModelConfig
from nextn.models.llama.rope import partial_rotary_order

_FUSED = re.compile(r"^(.*\.)(self_attn\.qkv_proj|mlp\.gate_up_proj)\.(weight|bias)$")
_ROTATED = re.compile(r"\.self_attn\.(q_proj|k_proj|q_norm|k_norm)\.(weight|bias)$")


#: Per architecture, stored norm names → the engine's (GLM-4's sandwich norms: its `post_self_attn_layernorm`
#: normalises the attention output, its `post_attention_layernorm` the MLP input, `post_mlp_layernorm` its output)
_RENAMED = {"Glm4ForCausalLM": {"post_self_attn_layernorm": "post_attention_layernorm",
                                "post_attention_layernorm": "pre_feedforward_layernorm",
                                "post_mlp_layernorm": "post_feedforward_layernorm"}}


#: Mixtral's MoE names (HF `MixtralForCausalLM` checkpoints: `block_sparse_moe`, experts' w1 / w3 / w2) → the engine's
_MIXTRAL = re.compile(r"^(.*\.layers\.\d+\.)block_sparse_moe\.(gate|experts\.\d+\.(w1|w2|w3))\.weight$")
_MIXTRAL_EXPERT = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def _mixtral_name(name: str) -> str | None:
    """The engine's name of a Mixtral MoE tensor, or None for any other tensor."""
    m = _MIXTRAL.match(name)
    if m is None:
        return None
    part = "gate" if m.group(3) is None else m.group(2).rsplit(".", 1)[0] + "." + _MIXTRAL_EXPERT[m.group(3)]
    return f"{m.group(1)}mlp.{part}.weight"


def needs_view(cfg: LlamaModelConfig) -> bool:
    """Whether `cfg`'s checkpoints store a tensor otherwise than the engine (fused projections, partial rotary,
    interleaved rope pairs, other norm names)."""
    return (cfg.architecture in ("Phi3ForCausalLM", "Glm4ForCausalLM", "MixtralForCausalLM") or cfg.rope_interleaved
            or (cfg.rotary_dim or cfg.head_dim) < cfg.head_dim)


class StoredLayout:
    """`reader`'s tensors under the engine's names (see the module docstring).

    Args:
        reader: the checkpoint reader (HF names).
        cfg: the normalised config (sizes of the fused parts, rotary_dim).
    """

    def __init__(self, reader: Any, cfg: LlamaModelConfig) -> None:
        self._reader = reader
        self._cfg = cfg
        q, kv, i = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim, cfg.intermediate_size
        parts = {"self_attn.qkv_proj": [("self_attn.q_proj", 0, q), ("self_attn.k_proj", q, q + kv),
                                        ("self_attn.v_proj", q + kv, q + 2 * kv)],
                 "mlp.gate_up_proj": [("mlp.gate_proj", 0, i), ("mlp.up_proj", i, 2 * i)]}
        # engine name -> (stored name, first row, end row); rows None: the whole tensor under another name
        self._rows: dict[str, tuple[str, int | None, int | None]] = {}
        self._names: list[str] = []
        renamed = _RENAMED.get(cfg.architecture, {})
        for name in reader.names():
            if (engine_name := _mixtral_name(name)) is not None:
                self._rows[engine_name] = (name, None, None)
                self._names.append(engine_name)
                continue
            m = _FUSED.match(name)
            if m is None:
                prefix, _, rest = name.rpartition("layers.")
                module, _, tail = rest.partition(".")  # "N", "<module>.weight"
                stored_module, _, param = tail.partition(".")
                if prefix and stored_module in renamed:
                    engine = f"{prefix}layers.{module}.{renamed[stored_module]}.{param}"
                    self._rows[engine] = (name, None, None)
                    self._names.append(engine)
                else:
                    self._names.append(name)
                continue
            for part, start, end in parts[m.group(2)]:
                self._rows[f"{m.group(1)}{part}.{m.group(3)}"] = (name, start, end)
                self._names.append(f"{m.group(1)}{part}.{m.group(3)}")
        self._known = set(self._names)
        rotary = cfg.rotary_dim or cfg.head_dim
        self._order = (partial_rotary_order(cfg.head_dim, rotary, cfg.rope_interleaved)
                       if rotary < cfg.head_dim or cfg.rope_interleaved else None)

    def names(self) -> list[str]:
        return list(self._names)

    def has(self, name: str) -> bool:
        return name in self._known

    def tensor_info(self, name: str) -> tuple[str, list[int]]:
        """(dtype, shape) from the header: a fused part's rows, else the stored tensor's."""
        if name in self._rows:
            stored, start, end = self._rows[name]
            dtype, shape = self._reader.tensor_info(stored)
            return dtype, ([end - start, *shape[1:]] if start is not None else shape)
        return self._reader.tensor_info(name)

    def get(self, name: str) -> torch.Tensor:
        """Tensor `name` in the engine's layout. Raises KeyError when absent."""
        if name in self._rows:
            stored, start, end = self._rows[name]
            return self._reorder(name, self._reader.get(stored)[start:end])
        return self._reorder(name, self._reader.get(name))

    def native_w4a16(self, name: str, cfg: Any) -> dict[str, torch.Tensor] | None:
        """The reader's `native_w4a16` (a GGUF's 4-bit blocks as they are) with the same row selection, or None."""
        native = getattr(self._reader, "native_w4a16", None)
        if native is None:
            return None
        stored, start, end = self._rows.get(name, (name, None, None))
        out = native(stored, cfg)
        if out is None:
            return None
        return {k: self._reorder(name, v[start:end]).contiguous() for k, v in out.items()}

    def _reorder(self, name: str, rows: torch.Tensor) -> torch.Tensor:
        """The rows of a q / k projection (or its norm's weights) in `partial_rotary_order`, head by head."""
        if self._order is None or not _ROTATED.search(name):
            return rows
        d = self._cfg.head_dim
        heads = rows.shape[0] // d
        order = (self._order[None, :] + d * torch.arange(heads)[:, None]).reshape(-1)
        return rows[order]
