"""Tensor parallelism for the Llama family and DeepSeek-V3: this rank's share of a model built full-size on the meta
device, and of the engine weights.

Sources: Megatron-LM (Shoeybi et al. 2019, §3): an MLP's first projections split by output columns, its last by
input rows, one all-reduce after it; attention split by heads, the output projection by rows, one all-reduce;
vocab-parallel embedding (out-of-range ids give zero rows, an all-reduce completes the lookup) and lm_head (each
rank's vocabulary slice of the logits, all-gathered). Names follow TensorRT-LLM (`ColumnLinear`/`RowLinear`,
`Mapping`). Per layer and decode step a rank therefore all-reduces [tokens, hidden] twice (attention, MLP/MoE) and
all-gathers the logits once per lm_head call.

- Llama / Qwen2: q/k/v heads (GQA: each rank keeps whole KV-head groups, so `num_key_value_heads` must divide by
  tp), `o_proj` by rows, `gate_proj` / `up_proj` by columns, `down_proj` by rows. The KV cache of a rank holds its
  KV heads only.
- DeepSeek-V3 MLA: `q_proj` / `q_b_proj` and `kv_b_proj` by heads, `o_proj` by rows; the low-rank `q_a_proj` and
  `kv_a_proj_with_mqa` are replicated, and so is the latent KV cache (every head reads the whole latent: MLA's KV
  cannot be split by heads — TensorRT-LLM's answer at scale is attention data parallelism, not done here).
  Dense MLPs as Llama's. The MoE (`expert_parallel.ParallelMoE`): routed experts split by id (expert parallelism)
  and by intermediate columns (moe_tp), the shared experts by columns; one all-reduce per MoE layer.
- MTP modules are decoder blocks: split the same way; `eh_proj`, the norms and the router are replicated.

Gathered logits equal the unsplit model's dot products for the same hidden state, so acceptance (strict, relaxed,
rejection sampling) sees the same kind of logits on every rank and every rank takes the same tokens. Hidden states
differ from TP=1 only by the all-reduce's summation order (float rounding).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nextn.distributed.comm import Communicator
from nextn.distributed.expert_parallel import ParallelMoE
from nextn.distributed.mapping import Mapping, MappingError
from nextn.models.causal_lm import vocab_projection
from nextn.models.deepseek_v3.mla import MLAttention
from nextn.models.layers import GatedMLP
from nextn.models.llama.model import LlamaAttention
from nextn.models.moe import SparseMoE
from nextn.quantization.linear import WeightOnlyLinear

Weights = dict[str, torch.Tensor]


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_local @ W_local^T) + b: the input features split across ranks (Megatron's row-parallel layer,
    TensorRT-LLM `RowLinear`). `weight` [out_features, in_features / tp]; `bias` [out_features], added once after
    the sum."""

    def __init__(self, in_local: int, out_features: int, bias: bool, comm: Communicator) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_local))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.comm = comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., in_features / tp] → [..., out_features], the same on every rank."""
        y = self.comm.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rows [rank · V_l, (rank + 1) · V_l) of the embedding, V_l = ceil(vocab / tp) (the last rank's padded with
    zeros); a lookup outside the slice gives a zero row and an all-reduce sums the one non-zero row per token, so
    the result equals the unsplit lookup exactly. `weight` [V_l, hidden]."""

    def __init__(self, vocab_local: int, hidden_size: int, first: int, comm: Communicator) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_local, hidden_size))
        self.first, self.comm = first, comm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids: [...] int64 (full vocabulary) → [..., hidden]."""
        local = ids - self.first
        mine = (local >= 0) & (local < self.weight.shape[0])
        rows = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)  # [..., hidden]
        rows = rows * mine[..., None].to(rows.dtype)
        return self.comm.all_reduce(rows)


class VocabParallelLMHead(nn.Module):
    """The lm_head's vocabulary slice (the embedding's, when tied): logits [..., V_l] per rank, all-gathered and cut
    to the vocabulary, [..., vocab]. `weight` [V_l, hidden] when untied; a tied head reads the embedding's."""

    def __init__(self, vocab_size: int, vocab_local: int, hidden_size: int, comm: Communicator,
                 tied_to: VocabParallelEmbedding | None = None) -> None:
        super().__init__()
        self.vocab_size, self.comm = vocab_size, comm
        self._tied = (tied_to,) if tied_to is not None else None  # a tuple: not a submodule, not in state_dict
        if tied_to is None:
            self.weight_local = nn.Parameter(torch.empty(vocab_local, hidden_size))

    @property
    def weight(self) -> torch.Tensor:
        return self._tied[0].weight if self._tied is not None else self.weight_local

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [..., hidden] → logits [..., vocab] in the weight dtype, identical on every rank."""
        local = vocab_projection(self.weight, hidden.to(self.weight.dtype))
        return self.comm.all_gather_last(local)[..., : self.vocab_size]


def _chunk(t: torch.Tensor, dim: int, parts: int, index: int) -> torch.Tensor:
    return t.chunk(parts, dim=dim)[index].contiguous()


def _split(n: int, parts: int, what: str, fix: str) -> int:
    if n % parts:
        raise MappingError(f"{what} = {n} is not divisible by {parts}: {fix}")
    return n // parts


def _linear(in_features: int, out_features: int, bias: bool) -> nn.Linear:
    with torch.device("meta"):
        return nn.Linear(in_features, out_features, bias=bias)


class _Sharder:
    """Rewrites one model in place for a rank and collects its share of the weights under the same names."""

    def __init__(self, weights: Weights, comm: Communicator) -> None:
        self.src, self.out, self.comm = weights, {}, comm
        self.tp, self.rank = comm.mapping.tp_size, comm.mapping.tp_rank

    def take(self, name: str, dim: int | None = None) -> None:
        """Weight `name` whole (dim None) or this rank's chunk along `dim`; absent names are skipped."""
        if name in self.src:
            t = self.src.pop(name)
            self.out[name] = t if dim is None else _chunk(t, dim, self.tp, self.rank)

    def column(self, parent: nn.Module, prefix: str, child: str, out_local: int) -> None:
        old = getattr(parent, child)
        setattr(parent, child, _linear(old.in_features, out_local, old.bias is not None))
        self.take(f"{prefix}{child}.weight", 0)
        self.take(f"{prefix}{child}.bias", 0)

    def row(self, parent: nn.Module, prefix: str, child: str, in_local: int, reduce: bool = True) -> None:
        old = getattr(parent, child)
        with torch.device("meta"):
            new = (RowParallelLinear(in_local, old.out_features, old.bias is not None, self.comm) if reduce
                   else nn.Linear(in_local, old.out_features, bias=False))
        setattr(parent, child, new)
        self.take(f"{prefix}{child}.weight", 1)
        self.take(f"{prefix}{child}.bias")

    def llama_attention(self, attn: LlamaAttention, prefix: str) -> None:
        fix = "use a tensor_parallel_size that divides num_key_value_heads"
        nkv = _split(attn.num_kv_heads, self.tp, "num_key_value_heads", fix)
        nh = _split(attn.num_heads, self.tp, "num_attention_heads", fix)
        for child, heads in (("q_proj", nh), ("k_proj", nkv), ("v_proj", nkv)):
            self.column(attn, prefix, child, heads * attn.head_dim)
        self.row(attn, prefix, "o_proj", nh * attn.head_dim)
        attn.num_heads, attn.num_kv_heads = nh, nkv

    def mla(self, attn: MLAttention, prefix: str) -> None:
        cfg = attn.cfg
        nh = _split(attn.num_heads, self.tp, "num_attention_heads",
                    "use a tensor_parallel_size that divides it")
        q = "q_proj" if cfg.q_lora_rank is None else "q_b_proj"
        self.column(attn, prefix, q, nh * cfg.qk_head_dim)
        self.column(attn, prefix, "kv_b_proj", nh * (cfg.qk_nope_head_dim + cfg.v_head_dim))
        self.row(attn, prefix, "o_proj", nh * cfg.v_head_dim)
        attn.num_heads = nh

    def mlp(self, mlp: GatedMLP, prefix: str, reduce: bool = True) -> None:
        inter = _split(mlp.gate_proj.out_features, self.tp, f"{prefix}intermediate size",
                       "use a tensor_parallel_size that divides it")
        self.column(mlp, prefix, "gate_proj", inter)
        self.column(mlp, prefix, "up_proj", inter)
        self.row(mlp, prefix, "down_proj", inter, reduce=reduce)

    def moe(self, parent: nn.Module, moe: SparseMoE, prefix: str) -> None:
        new = ParallelMoE(moe, self.comm)
        if moe.shared_experts is not None:
            self.mlp(moe.shared_experts, prefix + "shared_experts.", reduce=False)  # summed with the routed experts
        for part in ("gate.weight", "gate.e_score_correction_bias"):
            self.take(prefix + part)
        self.out.update(new.experts.shard(self.src, prefix + "experts.", new.num_experts))
        parent.mlp = new

    def vocab(self, model: nn.Module) -> None:
        cfg = model.cfg
        v_local = -(-cfg.vocab_size // self.tp)
        first = self.rank * v_local

        def rows(t: torch.Tensor) -> torch.Tensor:  # [V, H] → this rank's [V_l, H], zero-padded at the end
            part = t[first:first + v_local]
            pad = part.new_zeros(v_local - part.shape[0], part.shape[1])
            return torch.cat([part, pad]) if pad.shape[0] else part.contiguous()

        with torch.device("meta"):
            embed = VocabParallelEmbedding(v_local, cfg.hidden_size, first, self.comm)
            tied = getattr(cfg, "tie_word_embeddings", False) and "lm_head.weight" not in self.src
            head = VocabParallelLMHead(cfg.vocab_size, v_local, cfg.hidden_size, self.comm, embed if tied else None)
        model.model.embed_tokens, model.lm_head = embed, head
        self.out["model.embed_tokens.weight"] = rows(self.src.pop("model.embed_tokens.weight"))
        if not tied:
            self.out["lm_head.weight_local"] = rows(self.src.pop("lm_head.weight"))


def local_kv_config(cfg, mapping: Mapping):
    """The model config as one rank's KV cache sees it: a Llama rank caches its `num_key_value_heads / tp` heads;
    MLA's latent cache is whole on every rank.

    Raises:
        MappingError: num_key_value_heads not divisible by tp_size.
    """
    if not hasattr(cfg, "num_key_value_heads"):
        return cfg
    nkv = _split(cfg.num_key_value_heads, mapping.tp_size, "num_key_value_heads",
                 "use a tensor_parallel_size that divides it")
    return cfg.model_copy(update={"num_key_value_heads": nkv})


def shard_model(model: nn.Module, weights: Weights, comm: Communicator) -> Weights:
    """Rewrite `model` (a `LlamaForCausalLM` or `DeepseekV3ForCausalLM` on the meta device, full size) into this
    rank's share and return the matching share of `weights` (engine names; `lm_head.weight` becomes
    `lm_head.weight_local`), ready for `load_state_dict(strict=True, assign=True)`.

    The vocabulary projection is then a `VocabParallelLMHead` called through `model.logits` / `draft_logits`
    (`lm_head_quantized`: "call the head"), and drafters' bf16 head copies are not made.

    Raises:
        MappingError: a size not divisible by the parallel sizes (named, with the fix), or a weight-only quantized
            engine (its packed tensors are not split yet).
    """
    if any(isinstance(m, WeightOnlyLinear) for m in model.modules()):
        raise MappingError("weight-only quantized engines run with tensor_parallel_size 1 for now: build the engine "
                           "with --quant_algo none to split it")
    s = _Sharder(dict(weights), comm)
    for i, layer in enumerate(model.model.layers):
        prefix = f"model.layers.{i}."
        attn = layer.self_attn
        if isinstance(attn, LlamaAttention):
            s.llama_attention(attn, prefix + "self_attn.")
        elif isinstance(attn, MLAttention):
            s.mla(attn, prefix + "self_attn.")
        if isinstance(layer.mlp, SparseMoE):
            s.moe(layer, layer.mlp, prefix + "mlp.")
        else:
            s.mlp(layer.mlp, prefix + "mlp.")
    s.vocab(model)
    model.lm_head_quantized = True  # logits come from calling the (vocab-parallel) head
    s.out.update(s.src)  # norms, routers' biases, eh_proj, ...: replicated
    return s.out


class TensorParallelSharding:
    """One rank's share of a tensor-parallel engine, as the engine's loader takes it (`engine_loader.Sharding`)."""

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm

    def kv_config(self, cfg):
        """`local_kv_config` for this rank."""
        return local_kv_config(cfg, self.comm.mapping)

    def shard(self, model: nn.Module, weights: Weights) -> Weights:
        """`shard_model` for this rank."""
        return shard_model(model, weights, self.comm)
