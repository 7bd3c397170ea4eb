"""A checkpoint's tensors in the engine's Llama layout where a family stores them otherwise: Phi-3's fused
`self_attn.qkv_proj` ([q + 2 kv, hidden]: q, then k, then v rows) and `mlp.gate_up_proj` ([2 · intermediate, hidden]:
gate rows, then up rows) read as q/k/v and gate/up by rows, and under partial rotary the q / k rows (and q/k norm
weights) of each head in `rope.partial_rotary_order`, a gated attention's `self_attn.q_proj` ([query head 0, gate head 0,
query head 1, ...]: Qwen3.5) as `q_proj` and `gate_proj`, Qwen3.5's MTP layer (`mtp.fc`, `mtp.pre_fc_norm_*`,
`mtp.layers.0.*`, `mtp.norm`) under the MTP module's names at `model.layers.{num_hidden_layers}` (as llama.cpp's
converter maps it; vLLM's `qwen3_next_mtp.py` runs it the same way) — and of a released Qwen3.5 vision-language
checkpoint the text model's tensors (`model.language_model.*` as `model.*`; the vision tower, `model.visual.*`, is
not the text model's and is left out) —, Qwen3-Next's fused `linear_attn.in_proj_qkvz` / `in_proj_ba` (per key head:
its q, k, value heads' v and z rows; its value heads' b then a rows: HF `fix_query_key_value_ordering`) as Qwen3.5's
`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`, and Mixtral's `block_sparse_moe.{gate, experts.E.w1 / w3 / w2}`
under the MoE layer's names (`mlp.gate`, `mlp.experts.E.gate_proj / up_proj / down_proj`), and gpt-oss's
`mlp.router` as `mlp.gate` and its experts stored as one tensor a layer — `mlp.experts.gate_up_proj` [E, hidden,
2 · width] (gate and up columns interleaved: HF `GptOssExperts` takes gate_up[..., ::2] and [..., 1::2]),
`down_proj` [E, width, hidden], their biases [E, 2 · width] and [E, hidden] — as each expert's `gate_proj` /
`up_proj` / `down_proj` (weights transposed to [out, in]).

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
_FUSED_LINEAR = re.compile(r"^(.*\.linear_attn\.)(in_proj_qkvz|in_proj_ba)\.weight$")
_GATED_Q = re.compile(r"^(.*\.self_attn\.)q_proj\.(weight|bias)$")


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


#: A vision-language checkpoint's text model and vision tower (Qwen3.5's releases)
_TEXT_MODEL = re.compile(r"^model\.language_model\.")
_VISION = ("model.visual.",)
#: Gemma 4's vision and audio towers and their projections into the text model's embeddings (its releases are
#: `Gemma4ForConditionalGeneration`: the text model under `model.language_model.`)
_GEMMA4_TOWERS = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.")
#: Qwen3.5's MTP names (`mtp.` stripped) → the MTP module's
_QWEN_MTP = {"fc": "eh_proj", "pre_fc_norm_embedding": "enorm", "pre_fc_norm_hidden": "hnorm",
             "norm": "shared_head.norm"}


#: gpt-oss's router and fused experts (HF `GptOssForCausalLM` checkpoints)
_GPT_OSS = re.compile(r"^(.*\.layers\.\d+\.mlp\.)(router\.(weight|bias)|experts\.(gate_up_proj|down_proj)(_bias)?)$")


def _gpt_oss_views(name: str, num_experts: int) -> dict[str, tuple[str, int | None, str | None, bool]] | None:
    """The engine's tensors a gpt-oss MoE tensor holds — engine name → (stored name, expert or None for the whole
    tensor, "gate" / "up" columns or None for all, transposed) — or None for any other tensor."""
    m = _GPT_OSS.match(name)
    if m is None:
        return None
    prefix = m.group(1)
    if m.group(3) is not None:  # the router: renamed
        return {f"{prefix}gate.{m.group(3)}": (name, None, None, False)}
    param = "bias" if m.group(5) else "weight"
    parts = (("gate_proj", "gate"), ("up_proj", "up")) if m.group(4) == "gate_up_proj" else (("down_proj", None),)
    return {f"{prefix}experts.{e}.{proj}.{param}": (name, e, cols, param == "weight")
            for e in range(num_experts) for proj, cols in parts}


def _qwen_mtp_name(name: str, num_layers: int) -> str | None:
    """The engine's name of a Qwen3.5 `mtp.*` tensor, or None for any other tensor."""
    if not name.startswith("mtp."):
        return None
    head, _, rest = name[4:].partition(".")
    if head in _QWEN_MTP:
        return f"model.layers.{num_layers}.{_QWEN_MTP[head]}.{rest}"
    index, _, tail = rest.partition(".")
    if head == "layers" and index.isdecimal():
        return f"model.layers.{num_layers + int(index)}.{tail}"
    return None


def _linear_parts(cfg: LlamaModelConfig, fused: str) -> dict[str, torch.Tensor]:
    """The rows of Qwen3-Next's fused `in_proj_qkvz` (per key head: q, k, then its value heads' v and z) or
    `in_proj_ba` (per key head: its value heads' b, then a) that make each Qwen3.5 projection, in order."""
    nk, nv, dk, dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                      cfg.linear_value_head_dim)
    assert nk and nv and dk and dv  # the config's check for linear-attention layers
    r = nv // nk
    if fused == "in_proj_ba":
        group = torch.arange(nk * 2 * r).reshape(nk, 2, r)
        return {"in_proj_b": group[:, 0].reshape(-1), "in_proj_a": group[:, 1].reshape(-1)}
    width = 2 * dk + 2 * r * dv
    base = torch.arange(nk)[:, None] * width
    part = lambda start, n: (base + start + torch.arange(n)).reshape(-1)  # noqa: E731
    return {"in_proj_qkv": torch.cat([part(0, dk), part(dk, dk), part(2 * dk, r * dv)]),
            "in_proj_z": part(2 * dk + r * dv, r * dv)}


def needs_view(cfg: LlamaModelConfig) -> bool:
    """Whether `cfg`'s checkpoints store a tensor otherwise than the engine (fused projections, partial rotary,
    interleaved rope pairs, other norm names)."""
    return (cfg.architecture in ("Phi3ForCausalLM", "Glm4ForCausalLM", "MixtralForCausalLM", "GptOssForCausalLM",
                                 "Gemma4ForCausalLM")
            or cfg.rope_interleaved
            or (cfg.rotary_dim or cfg.head_dim) < cfg.head_dim or cfg.attn_output_gate)


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
        # engine name -> (stored q_proj name, 0 for the query rows or 1 for the gate rows of each head)
        self._gated: dict[str, tuple[str, int]] = {}
        # engine name -> (stored name, its rows in order): Qwen3-Next's per-key-head fused projections
        self._picked: dict[str, tuple[str, torch.Tensor]] = {}
        # engine name -> gpt-oss's stored tensor, expert, columns, transposed (`_gpt_oss_views`)
        self._experts: dict[str, tuple[str, int | None, str | None, bool]] = {}
        self._names: list[str] = []
        renamed = _RENAMED.get(cfg.architecture, {})
        for name in reader.names():
            qwen_name = None  # Qwen3.5: its MTP layer's and a vision-language checkpoint's text model's names
            if cfg.attn_output_gate:
                if name.startswith(_VISION):
                    continue
                qwen_name = _qwen_mtp_name(name, cfg.num_hidden_layers) or (
                    _TEXT_MODEL.sub("model.", name) if _TEXT_MODEL.match(name) else None)
            if cfg.architecture == "Gemma4ForCausalLM" and (name.startswith(_GEMMA4_TOWERS) or _TEXT_MODEL.match(name)):
                if _TEXT_MODEL.match(name):
                    self._rows[_TEXT_MODEL.sub("model.", name)] = (name, None, None)
                    self._names.append(_TEXT_MODEL.sub("model.", name))
                continue
            f = _FUSED_LINEAR.match(name) if cfg.attn_output_gate else None
            if f is not None:
                for part, rows in _linear_parts(cfg, f.group(2)).items():
                    self._picked[f"{f.group(1)}{part}.weight"] = (name, rows)
                    self._names.append(f"{f.group(1)}{part}.weight")
                continue
            g = _GATED_Q.match(qwen_name or name) if cfg.attn_output_gate else None
            if g is not None:
                for which, part in enumerate(("q_proj", "gate_proj")):
                    self._gated[f"{g.group(1)}{part}.{g.group(2)}"] = (name, which)
                    self._names.append(f"{g.group(1)}{part}.{g.group(2)}")
                continue
            if qwen_name is not None:
                self._rows[qwen_name] = (name, None, None)
                self._names.append(qwen_name)
                continue
            if (views := _gpt_oss_views(name, cfg.num_experts)) is not None:
                self._experts.update(views)
                self._names += list(views)
                continue
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
        if name in self._experts:
            stored, e, cols, transposed = self._experts[name]
            dtype, shape = self._reader.tensor_info(stored)
            part = shape[1:] if e is not None else shape
            if cols is not None:
                part = [*part[:-1], part[-1] // 2]
            return dtype, part[::-1] if transposed else part
        if name in self._gated:
            dtype, shape = self._reader.tensor_info(self._gated[name][0])
            return dtype, [shape[0] // 2, *shape[1:]]
        if name in self._picked:
            stored, rows = self._picked[name]
            dtype, shape = self._reader.tensor_info(stored)
            return dtype, [len(rows), *shape[1:]]
        if name in self._rows:
            stored, start, end = self._rows[name]
            dtype, shape = self._reader.tensor_info(stored)
            return dtype, ([end - start, *shape[1:]] if start is not None else shape)
        return self._reader.tensor_info(name)

    def get(self, name: str) -> torch.Tensor:
        """Tensor `name` in the engine's layout. Raises KeyError when absent."""
        if name in self._experts:
            stored, e, cols, transposed = self._experts[name]
            t = self._reader.get(stored) if e is None else self._reader.get(stored, e)  # one expert read alone
            t = t[..., 0::2] if cols == "gate" else t[..., 1::2] if cols == "up" else t
            return t.T if transposed else t
        if name in self._gated:
            stored, which = self._gated[name]
            return self._reorder(name, self._half(self._reader.get(stored), which))
        if name in self._picked:
            stored, rows = self._picked[name]
            return self._reader.get(stored)[rows]
        if name in self._rows:
            stored, start, end = self._rows[name]
            return self._reorder(name, self._reader.get(stored)[start:end])
        return self._reorder(name, self._reader.get(name))

    def native_w4a16(self, name: str, cfg: Any) -> dict[str, torch.Tensor] | None:
        """The reader's `native_w4a16` (a GGUF's 4-bit blocks as they are) with the same row selection, or None."""
        native = getattr(self._reader, "native_w4a16", None)
        if native is None or name in self._experts:  # gpt-oss's column views are not rows of 4-bit blocks
            return None
        if name in self._picked:
            stored, rows = self._picked[name]
            out = native(stored, cfg)
            return None if out is None else {k: v[rows].contiguous() for k, v in out.items()}
        if name in self._gated:
            stored, which = self._gated[name]
            out = native(stored, cfg)
            return None if out is None else {k: self._reorder(name, self._half(v, which)).contiguous()
                                             for k, v in out.items()}
        stored, start, end = self._rows.get(name, (name, None, None))
        out = native(stored, cfg)
        if out is None:
            return None
        return {k: self._reorder(name, v[start:end]).contiguous() for k, v in out.items()}

    def _half(self, rows: torch.Tensor, which: int) -> torch.Tensor:
        """The query (`which` 0) or gate (1) rows of a gated q_proj's [2 · heads · head_dim, ...] rows."""
        heads, d = self._cfg.num_attention_heads, self._cfg.head_dim
        return rows.reshape(heads, 2, d, *rows.shape[1:])[:, which].reshape(heads * d, *rows.shape[1:])

    def _reorder(self, name: str, rows: torch.Tensor) -> torch.Tensor:
        """The rows of a q / k projection (or its norm's weights) in `partial_rotary_order`, head by head."""
        if self._order is None or not _ROTATED.search(name):
            return rows
        d = self._cfg.head_dim
        heads = rows.shape[0] // d
        order = (self._order[None, :] + d * torch.arange(heads)[:, None]).reshape(-1)
        return rows[order]
