"""Training MTP modules on a frozen Llama-family base by self-distillation (DeepSeek-V3 report §2.2; EAGLE).

The module is DeepSeek's: x = eh_proj([enorm(embed(t)); hnorm(h)]), one block of the base's own `transformers` layer
(`DECODER_LAYERS`), logits = lm_head(shared_head.norm(x)), the base's embedding and lm_head frozen. Targets: the base's
greedy continuations (`train/data.py`). Two shapes, as the runtime drafters use them (`speculative/mtp.py`):

- Vanilla (K modules): module k at position i reads embed(t_{i+k}) and module k−1's output at i (the base's
  final-normed hidden state for k = 1) and predicts t_{i+k+1}; causal attention over its own outputs.
- Eagle (1 module applied K times): step s of a chain started at position p runs at position j = p + s − 1, reads
  embed(t_{j+1}) and step s−1's output at j − 1, and predicts t_{j+2}. Its attention context is what the runtime
  cache holds there: step-1 entries (computed from the base's hidden states) at positions ≤ p, then the chain's
  own step-2..s entries at p + 1..j. Training runs the K steps as K streams of the same sequence (EAGLE-3's
  "training-time test"), feeding back the module's own block outputs (the checkpoint says so: `mtp_chain_normed:
  false`), so K = 3 drafts are trained as used: stream s runs alone through the block, reading the earlier streams'
  cached K/V (`_eagle_attention`, a `transformers` attention function: any block works), as all streams under
  `eagle_mask` would (tested). Tokens are teacher-forced: a step only matters when the drafts before it were accepted.

Only chains that start at a generated position (p ≥ P − 1 for a prompt of P tokens) and labels inside the sequence
count. Loss: Σ_k cross-entropy against the base's greedy tokens, over the tokens of the training data (`LossVocab`:
the lm_head product is most of a step's cost) or the full vocabulary, plus optionally EAGLE's feature loss (smooth
L1 between the normed output and the base's own final state at the label's position); Adam, linear decay.
The output is an HF checkpoint (config.json with `num_nextn_predict_layers`, model.safetensors with the base's
tensors and the modules at `model.layers.{num_hidden_layers + k}`, tokenizer files) that `build-engine` reads.
"""

from __future__ import annotations

import copy
import functools
import inspect
from collections.abc import Callable
from typing import Any
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from nextn.train.data import DataConfig, Rows, SelfDistillData
from nextn.train.loop import FitResult, fit
from nextn.train.mtp_checkpoint import write_mtp_checkpoint
from nextn.train.session import TrainResult, TrainSettings, claim_train_output, finish, prepare

#: (block output after shared_head.norm [B, T, H], labels [B, T], keep [B, T], the base's final state that
#: predicted each label [B, T, H]) per draft step / module.
StepOutputs = list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]


class MtpModule(nn.Module):
    """One MTP module over whole sequences; parameter names follow the checkpoint's (`block.` = the layer's own)."""

    def __init__(self, block: nn.Module, hidden_size: int, make_norm: Callable[[int], nn.Module]) -> None:
        super().__init__()
        self.enorm, self.hnorm = make_norm(hidden_size), make_norm(hidden_size)
        self.eh_proj = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.block = block
        self.shared_head_norm = make_norm(hidden_size)

    def forward(self, tok_embeds: torch.Tensor, h_prev: torch.Tensor, position_embeddings, mask: torch.Tensor
                ) -> torch.Tensor:
        """tok_embeds, h_prev [B, T, H] → block output [B, T, H] (before shared_head.norm); mask [1, 1, T, T]
        additive."""
        x = self.eh_proj(torch.cat([self.enorm(tok_embeds), self.hnorm(h_prev)], dim=-1))
        return self.block(x, attention_mask=mask, position_embeddings=position_embeddings)

    def warm_start_from_base(self, hidden_rms: float) -> None:
        """Start as the base's own next-token head: eh_proj passes hnorm(h) through (eh_proj = [0, I]), the block is
        the identity (o_proj and down_proj zero, as residual branches are often started), and shared_head.norm's
        weight is `hidden_rms` (the base's final states' typical RMS), so logits(h) ≈ the base's lm_head(h).

        Untrained, the module then predicts token t + 1 for t + 2 — wrong, but with the base's calibrated logits
        in the base's own hidden space. From a random start the logits are confidently wrong (CE ≈ 12 for a
        ~4,000-token softmax on SmolLM2-135M) and 50 steps barely moved them.
        """
        h = self.eh_proj.weight.shape[0]
        with torch.no_grad():
            self.eh_proj.weight.zero_()
            self.eh_proj.weight[:, h:].copy_(torch.eye(h))
            self.block.self_attn.o_proj.weight.zero_()
            for name, p in self.block.mlp.named_parameters():  # dense, routed experts' and shared experts' down
                if name.endswith(("down_proj", "down_proj.weight")):
                    p.zero_()
            # a unit-offset norm (Gemma's) scales by 1 + w
            self.shared_head_norm.weight.fill_(hidden_rms - (1.0 if _unit_offset(self.shared_head_norm) else 0.0))

    def warm_start(self, final_norm: torch.Tensor) -> None:
        """shared_head.norm = the base's final norm; the rest keeps its default init.

        (The bigram start of `train/mtp_distill.py`, eh_proj = [I, 0], was measured worse on stories260K: after
        150 steps top-1 0.53 against 0.73, as it starts from confidently wrong predictions, CE ≈ 22.)
        """
        with torch.no_grad():
            self.shared_head_norm.weight.copy_(final_norm)

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """Checkpoint names (without the `model.layers.{i}.` prefix) → detached tensors."""
        from nextn.train.tiny_checkpoint import split_experts

        out = {}
        for name, t in self.state_dict().items():
            name = "shared_head.norm.weight" if name == "shared_head_norm.weight" else name.removeprefix("block.")
            out[name] = t.detach().clone().contiguous()
        return split_experts(out)  # an MoE block's experts under the released checkpoints' per-expert names


#: model_type → (transformers module, decoder layer class, RMSNorm class) of the bases MTP modules are trained for.
DECODER_LAYERS = {
    "llama": ("transformers.models.llama.modeling_llama", "LlamaDecoderLayer", "LlamaRMSNorm"),
    "qwen2": ("transformers.models.qwen2.modeling_qwen2", "Qwen2DecoderLayer", "Qwen2RMSNorm"),
    "qwen3": ("transformers.models.qwen3.modeling_qwen3", "Qwen3DecoderLayer", "Qwen3RMSNorm"),
    "mistral": ("transformers.models.mistral.modeling_mistral", "MistralDecoderLayer", "MistralRMSNorm"),
    "olmo2": ("transformers.models.olmo2.modeling_olmo2", "Olmo2DecoderLayer", "Olmo2RMSNorm"),
    # Gemma 3: unit-offset norms, embeddings × √hidden (`base_context`), a full-attention block
    "gemma3_text": ("transformers.models.gemma3.modeling_gemma3", "Gemma3DecoderLayer", "Gemma3RMSNorm"),
    # GLM-4.5 / 4.6 (a checkpoint without its MTP layer gets one): the block is an MoE layer, as released
    "glm4_moe": ("transformers.models.glm4_moe.modeling_glm4_moe", "Glm4MoeDecoderLayer", "Glm4MoeRMSNorm"),
    # Phi-3 / Phi-4-mini (fused projections, split on reading); Granite (its logits ÷ `logits_scaling`:
    # `TrainSession.lm_head`); SmolLM3 (the block built as a layer with RoPE: the engine's MTP layers rotate)
    "qwen3_moe": ("transformers.models.qwen3_moe.modeling_qwen3_moe", "Qwen3MoeDecoderLayer", "Qwen3MoeRMSNorm"),
    "qwen3_5_text": ("transformers.models.qwen3_5.modeling_qwen3_5", "Qwen3_5DecoderLayer", "Qwen3_5RMSNorm"),
    "phi3": ("transformers.models.phi3.modeling_phi3", "Phi3DecoderLayer", "Phi3RMSNorm"),
    "gemma2": ("transformers.models.gemma2.modeling_gemma2", "Gemma2DecoderLayer", "Gemma2RMSNorm"),
    "seed_oss": ("transformers.models.seed_oss.modeling_seed_oss", "SeedOssDecoderLayer", "SeedOssRMSNorm"),
    "glm4": ("transformers.models.glm4.modeling_glm4", "Glm4DecoderLayer", "Glm4RMSNorm"),
    "olmo3": ("transformers.models.olmo3.modeling_olmo3", "Olmo3DecoderLayer", "Olmo3RMSNorm"),
    "mixtral": ("transformers.models.mixtral.modeling_mixtral", "MixtralDecoderLayer", "MixtralRMSNorm"),
    "olmoe": ("transformers.models.olmoe.modeling_olmoe", "OlmoeDecoderLayer", "OlmoeRMSNorm"),
    "granite": ("transformers.models.granite.modeling_granite", "GraniteDecoderLayer", "GraniteRMSNorm"),
    "smollm3": ("transformers.models.smollm3.modeling_smollm3", "SmolLM3DecoderLayer", "SmolLM3RMSNorm"),
    # EXAONE 4 (post-norms, q/k norms; the block a full-attention layer with RoPE); Qwen2-MoE (a shared expert
    # scaled by sigmoid(shared_expert_gate))
    "exaone4": ("transformers.models.exaone4.modeling_exaone4", "Exaone4DecoderLayer", "Exaone4RMSNorm"),
    "qwen2_moe": ("transformers.models.qwen2_moe.modeling_qwen2_moe", "Qwen2MoeDecoderLayer", "Qwen2MoeRMSNorm"),
}


def _unit_offset(norm: nn.Module) -> bool:
    """Whether an RMSNorm module scales by 1 + weight (Gemma's) rather than by its weight."""
    with torch.no_grad():
        saved = norm.weight.detach().clone()
        norm.weight.zero_()
        out = norm(torch.ones(1, saved.shape[0]))
        norm.weight.copy_(saved)
    return bool(out.abs().sum() > 0)


def base_context(body: nn.Module) -> tuple[torch.Tensor, Callable[..., Any]]:
    """(The embedding the MTP module reads [V, H] — × the base's embedding scale, Gemma's √hidden; any scale is
    immaterial behind `enorm` —, the rotary embedding (x, positions) → (cos, sin) of its full-attention layers) of a
    `transformers` base's decoder body."""
    embed = body.embed_tokens
    weight = embed.weight.detach() * getattr(embed, "scalar_embed_scale", 1.0)
    rotary = body.rotary_emb
    if "layer_type" in inspect.signature(rotary.forward).parameters:  # Gemma 3: one rope per layer type
        rotary = functools.partial(rotary, layer_type="full_attention")
    return weight, rotary


def mtp_module(hf_config) -> MtpModule:
    """A module whose block is the base's own `transformers` decoder layer (`DECODER_LAYERS`: Llama, Qwen2 / 3 /
    3-MoE / 3.5, Qwen2-MoE, Mistral, Mixtral, OLMo 2 / 3, OLMoE, Gemma 2 / 3, GLM-4 / 4.5, Phi-3, Granite, SmolLM3,
    Seed-OSS, EXAONE 4; HF
    parameter names, as the engine's). The block is built as the base's last full-attention layer with RoPE (the
    engine's MTP layers attend to every earlier key with the global rope). Gemma 2's logit soft-capping is left out
    of the loss (monotone: the drafts' argmax is the same).

    Raises:
        ValueError: a base of another architecture.
    """
    import importlib

    if hf_config.model_type not in DECODER_LAYERS:
        raise ValueError(f"--method mtp trains MTP modules for {', '.join(DECODER_LAYERS)} bases; this base is "
                         f"{hf_config.model_type!r} (a DeepSeek-V3 checkpoint brings its own MTP modules)")
    module_name, layer_name, norm_name = DECODER_LAYERS[hf_config.model_type]
    hf = importlib.import_module(module_name)
    # the layer index only picks a cache slot and the layer type: the last full-attention decoder layer's
    types = getattr(hf_config, "layer_types", None) or ["full_attention"] * hf_config.num_hidden_layers
    rope = getattr(hf_config, "no_rope_layers", None) or [1] * hf_config.num_hidden_layers
    full = [i for i, t in enumerate(types) if t == "full_attention" and rope[i]]
    block = getattr(hf, layer_name)(hf_config, full[-1] if full else hf_config.num_hidden_layers - 1)
    if hf_config.model_type == "exaone4":  # a hybrid EXAONE 4's full layers are NoPE; without a window HF's rotate
        block.self_attn.sliding_window = None
    with torch.no_grad():  # stacked experts are left uninitialised (`torch.empty`) until a model's `_init_weights`
        for p in block.parameters():
            p.normal_(0.0, p.shape[-1] ** -0.5) if p.dim() == 3 else None
    return MtpModule(block, hf_config.hidden_size, lambda h: getattr(hf, norm_name)(h, eps=hf_config.rms_norm_eps))


def _causal(t: int) -> torch.Tensor:
    return torch.full((t, t), float("-inf")).triu(1)[None, None]  # [1, 1, T, T]


def eagle_mask(t: int, steps: int) -> torch.Tensor:
    """Additive mask [1, 1, steps·T, steps·T] over `steps` streams of T positions (stream s = draft step s + 1).

    Query (stream s, row j) sees stream 0 rows ≤ j − s and, for 1 ≤ m ≤ s, stream m row j − s + m: the runtime's
    cache after a chain started at p = j − s (module-1 entries up to p, then the chain's own entries).
    """
    j = torch.arange(t)
    allowed = torch.zeros(steps, t, steps, t, dtype=torch.bool)  # [s, j, m, i]
    for s in range(steps):
        allowed[s, :, 0, :] = j[None, :] <= (j[:, None] - s)
        for m in range(1, s + 1):
            allowed[s, :, m, :] = j[None, :] == (j[:, None] - s + m)
    mask = torch.zeros(steps * t, steps * t).masked_fill(~allowed.view(steps * t, steps * t), float("-inf"))
    return mask[None, None]


def _shift_down(x: torch.Tensor) -> torch.Tensor:
    """Row j ← row j − 1 (zeros at row 0): x [B, T, ...]."""
    return torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], dim=1)


def _eagle_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask, scaling: float, dropout: float = 0.0, **kwargs) -> tuple[torch.Tensor, None]:
    """A `transformers` attention function for one Eagle stream s, given the earlier streams' cached K/V.

    query [B, nh, T, d], key [B, nkv, T, d], value [B, nkv, T, dv] of stream s = len(cache) (cache:
    `module.eagle_cache`, appended here). Stream s's query at row j attends stream 0's keys at rows ≤ j − s (one
    [T, T] product) and stream m's key at row j − s + m for 1 ≤ m ≤ s (a dot product per row): the same result as
    all streams under `eagle_mask`, without re-running the earlier streams. Returns ([B, T, nh, dv], None).
    """
    cache = module.eagle_cache
    s, t = len(cache), query.shape[2]
    group = query.shape[1] // key.shape[1]
    cache.append((key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)))
    rows = torch.arange(t, device=query.device)
    k0, v0 = cache[0]
    scores = (query @ k0.transpose(-1, -2)).float() * scaling  # [B, nh, T, T]
    scores = scores.masked_fill(rows[None, :] > rows[:, None] - s, float("-inf"))
    shifted = [(_shift(k, s - m), _shift(v, s - m)) for m, (k, v) in enumerate(cache[1:], start=1)]
    if shifted:
        dk = torch.stack([k for k, _ in shifted], dim=-2)  # [B, nh, T, s, d]: stream m's row j − (s − m)
        diag = (query.unsqueeze(-2) * dk).sum(-1).float() * scaling  # [B, nh, T, s]
        valid = rows[:, None] - s + torch.arange(1, s + 1, device=query.device)[None, :] >= 0  # [T, s]
        scores = torch.cat([scores, diag.masked_fill(~valid, float("-inf"))], dim=-1)
    probs = torch.softmax(scores, dim=-1).to(query.dtype)
    out = probs[..., :t] @ v0  # [B, nh, T, dv]
    if shifted:
        out = out + (probs[..., t:].unsqueeze(-1) * torch.stack([v for _, v in shifted], dim=-2)).sum(-2)
    return out.transpose(1, 2).contiguous(), None


def _shift(x: torch.Tensor, n: int) -> torch.Tensor:
    """x [B, heads, T, d] moved n rows down along T (zeros on top)."""
    return torch.cat([torch.zeros_like(x[:, :, :n]), x[:, :, : x.shape[2] - n]], dim=2) if n else x


def _register_eagle_attention() -> str:
    from transformers import AttentionInterface

    AttentionInterface.register(EAGLE_ATTENTION, _eagle_attention)
    return EAGLE_ATTENTION


EAGLE_ATTENTION = "nextn_eagle_streams"


@dataclass
class LossVocab:
    """The tokens the cross-entropy is taken over: the sorted `ids` [C] of every token in the training data, plus,
    at each step, the hard negatives of that step (`classes`): the tokens outside `ids` that the heads currently
    rank highest. The base emits a few thousand distinct tokens in the self-distillation data (SmolLM2: ~4,000 of
    49,152); a softmax over those makes the lm_head product — most of a step's cost — ~10× cheaper, and the hard
    negatives keep the other ~45,000 tokens from winning the full-vocabulary argmax that decoding uses (without
    them, held-out top-1 stays at 0). Accuracy is always measured over the full vocabulary."""

    ids: torch.Tensor
    num_negative_rows: int = 256  # rows whose full-vocabulary top-k give the step's hard negatives
    num_negatives: int = 8  # k

    @classmethod
    def of(cls, tokens: torch.Tensor) -> "LossVocab":
        return cls(torch.unique(tokens))

    @torch.no_grad()
    def classes(self, x: torch.Tensor, lm_head: torch.Tensor) -> torch.Tensor:
        """Sorted class ids for one step: `ids` ∪ the top-k tokens of evenly spaced rows of x [N, H]."""
        rows = x[:: max(1, len(x) // self.num_negative_rows)][: self.num_negative_rows].detach()
        top = (rows @ lm_head.T).topk(self.num_negatives, dim=-1).indices.flatten()
        return torch.unique(torch.cat([self.ids, top]))


def class_loss(x: torch.Tensor, labels: torch.Tensor, lm_head: torch.Tensor, classes: torch.Tensor | None
               ) -> torch.Tensor:
    """Mean cross-entropy of x [N, H] @ lm_head[classes]ᵀ against labels [N] (token ids, all in `classes`);
    `classes` None: the full vocabulary."""
    if classes is None:
        return F.cross_entropy(x @ lm_head.T, labels)
    return F.cross_entropy(x @ lm_head[classes].T, torch.searchsorted(classes, labels))


@torch.no_grad()
def argmax_logits(x: torch.Tensor, lm_head: torch.Tensor, chunk: int = 2048) -> torch.Tensor:
    """argmax over the full vocabulary of x [N, H] @ lm_head [V, H]ᵀ → [N], `chunk` rows at a time (memory)."""
    return torch.cat([(part @ lm_head.T).argmax(-1) for part in x.split(chunk)]) if len(x) else \
        torch.zeros(0, dtype=torch.int64)


def generated(prompt_lens: torch.Tensor, lengths: torch.Tensor, t: int, first: int, label: int) -> torch.Tensor:
    """keep [B, t]: rows j with j ≥ prompt_len − 1 + `first` (the chain reads only the base's own tokens) whose label
    position j + `label` lies inside the sequence."""
    j = torch.arange(t)[None, :]
    return (j >= prompt_lens[:, None] - 1 + first) & (j + label < lengths[:, None])


@dataclass
class MtpContext:
    """The pieces of the model that the modules share: embedding, lm_head and rotary embedding (frozen or not),
    and the loss's vocabulary and feature-loss weight."""

    embed: torch.Tensor  # [V, H]
    lm_head: torch.Tensor  # [V, H]
    rotary: Callable[..., Any]  # transformers' rotary embedding: (x, position_ids [1, T]) → (cos, sin)
    vocab: LossVocab | None = None  # None: the full vocabulary
    feature_weight: float = 0.0  # weight of the smooth-L1 loss between the normed output and the base's state

    def vanilla(self, modules: nn.ModuleList, tokens: torch.Tensor, hidden: torch.Tensor, prompt_lens: torch.Tensor,
                lengths: torch.Tensor, targets: torch.Tensor | None = None) -> StepOutputs:
        """Module k (1-based) at row i reads t_{i+k} and module k−1's output at i, predicts t_{i+k+1}; tokens [B, L];
        the labels come from `targets` (`Rows.targets`: the base's greedy tokens; default `tokens`)."""
        length = tokens.shape[1]
        targets = tokens if targets is None else targets
        h_prev, out = hidden, []
        for k, module in enumerate(modules, start=1):
            t = length - k - 1
            positions = torch.arange(t)[None]
            x = module(self.embed[tokens[:, k : k + t]], h_prev[:, :t], self.rotary(h_prev, positions), _causal(t))
            keep = generated(prompt_lens, lengths, t, 0, k + 1)
            out.append((module.shared_head_norm(x), targets[:, k + 1 : k + 1 + t], keep, hidden[:, k : k + t]))
            h_prev = x
        return out

    def eagle(self, module: MtpModule, tokens: torch.Tensor, hidden: torch.Tensor, prompt_lens: torch.Tensor,
              lengths: torch.Tensor, steps: int, reference: bool = False, targets: torch.Tensor | None = None
              ) -> StepOutputs:
        """Draft steps 1..`steps` of one module (see the module docstring); each row j predicts t_{j+2} (from
        `targets`, the base's greedy tokens; default `tokens`).

        Stream s runs alone through the block with `_eagle_attention` (cost ≈ `steps` plain passes). With
        `reference`, every stream runs again at each step under `eagle_mask` (cost ∝ steps²; for tests).
        """
        b, length = tokens.shape
        t = length - 2
        embeds = self.embed[tokens[:, 1 : 1 + t]]  # [B, T, H] embed(t_{j+1})
        labels = (tokens if targets is None else targets)[:, 2 : 2 + t]
        targets = hidden[:, 1 : 1 + t]  # the base's state that predicted each label (the feature loss's target)
        xs, h_in = [], [hidden[:, :t]]  # stream inputs: the base's h_j, then the previous stream's output at j − 1
        attn = module.block.self_attn
        if reference:
            for s in range(steps):
                n = s + 1
                positions = torch.arange(t).repeat(n)[None]  # [1, n·T]
                x = module(embeds.repeat(1, n, 1), torch.cat(h_in, dim=1), self.rotary(hidden, positions),
                           eagle_mask(t, n))[:, s * t :]  # stream s's rows [B, T, H]
                xs.append(x)
                h_in.append(_shift_down(x))
        else:
            config, attn.config = attn.config, copy.copy(attn.config)  # the block's own, with the stream attention
            attn.config._attn_implementation, attn.eagle_cache = _register_eagle_attention(), []
            try:
                cos_sin = self.rotary(hidden, torch.arange(t)[None])
                for s in range(steps):
                    xs.append(module(embeds, h_in[-1], cos_sin, None))
                    h_in.append(_shift_down(xs[-1]))
            finally:
                attn.config, attn.eagle_cache = config, None
        return [(module.shared_head_norm(x), labels, generated(prompt_lens, lengths, t, s, 2), targets)
                for s, x in enumerate(xs)]

    def loss(self, outputs: StepOutputs) -> torch.Tensor:
        """Σ over steps of the mean cross-entropy on kept rows (over `vocab`), plus `feature_weight` × the smooth-L1
        distance of the normed output to the base's own final state at the label's position (EAGLE's feature loss)."""
        kept = [(x[keep], labels[keep], target[keep]) for x, labels, keep, target in outputs]
        classes = None if self.vocab is None else self.vocab.classes(torch.cat([x for x, _, _ in kept]), self.lm_head)
        total = self.lm_head.new_zeros(())
        for x, labels, target in kept:
            total = total + class_loss(x, labels, self.lm_head, classes)
            if self.feature_weight:
                total = total + self.feature_weight * F.smooth_l1_loss(x, target)
        return total

    @torch.no_grad()
    def top1(self, outputs: StepOutputs) -> list[float]:
        """Per step top-1 accuracy (full vocabulary) against the base's greedy tokens (teacher-forced chains)."""
        return [(argmax_logits(x[keep], self.lm_head) == labels[keep]).float().mean().item()
                for x, labels, keep, _ in outputs]


def fit_mtp(run: Callable[[Rows], StepOutputs], ctx: MtpContext, params, data: SelfDistillData, steps: int, *,
            batch: int = 64, lr: float = 3e-3, seed: int = 0, progress: bool = True, eval_every: int = 100,
            desc: str = "train MTP", with_prompts: bool = False, **fit_kwargs) -> FitResult:
    """Adam on `params` for `steps` steps of `ctx.loss(run(data.rows(batch)))` (`with_prompts`: prompt positions
    train too); the held-out top-1 (generated positions) per step."""
    return fit(params, lambda rows: ctx.loss(run(data.rows(rows, with_prompts))),
               lambda: ctx.top1(run(data.rows(data.held_out_rows))), data.num_train, steps, batch=batch, lr=lr,
               seed=seed, progress=progress, eval_every=eval_every, desc=desc, **fit_kwargs)


def train_mtp(model_dir: str | Path, data_cfg: DataConfig, output_dir: str | Path, settings: TrainSettings, *,
              num_modules: int = 1, num_draft_steps: int = 3, cache_dir: str | Path | None = None) -> TrainResult:
    """Self-distil MTP modules onto the frozen Llama / Qwen2 base `model_dir`; write the checkpoint to `output_dir`.

    `num_modules` = 1 trains one module for Eagle use, unrolled `num_draft_steps` times; K > 1 trains K Vanilla
    modules. Also writes `train_draft.json` (metrics, the split). `cache_dir` (default `output_dir/train_cache`)
    keeps the data and the resumable training state. Deterministic under the seeds (same thread count).
    Raises:
        ValueError: no usable prompt, a base of another architecture, or arguments out of range.
    """
    if num_modules < 1 or num_draft_steps < 1 or settings.steps < 0:
        raise ValueError(f"need num_modules ≥ 1, num_draft_steps ≥ 1, steps ≥ 0 "
                         f"(got {num_modules}, {num_draft_steps}, {settings.steps})")
    cache = claim_train_output(model_dir, data_cfg.files, output_dir, cache_dir)
    prep = prepare(model_dir, data_cfg, settings, cache)
    model, data = prep.model, prep.data
    modules = nn.ModuleList(mtp_module(model.config) for _ in range(num_modules))
    real = torch.arange(data.tokens.shape[1])[None, :] < data.lengths[: data.num_train, None]  # [S, L]
    hidden_rms = float(data.hidden[: data.num_train][real].float().pow(2).mean().sqrt())
    for module in modules:
        if settings.init == "base":
            module.warm_start_from_base(hidden_rms)
        else:
            module.warm_start(model.model.norm.weight.detach())
    vocab = LossVocab.of(data.train_token_ids()) if settings.loss_vocab == "data" else None
    embed, rotary = base_context(model.model)
    ctx = MtpContext(embed, prep.lm_head, rotary, vocab, settings.feature_weight)
    eagle = num_modules == 1
    if eagle:
        run = lambda r: ctx.eagle(modules[0], *r[:4], num_draft_steps, targets=r.targets)  # noqa: E731
    else:
        run = lambda r: ctx.vanilla(modules, *r[:4], targets=r.targets)  # noqa: E731
    top1_before = ctx.top1(run(data.rows(data.held_out_rows)))
    mode = "eagle" if eagle else "vanilla"
    fitted = fit_mtp(run, ctx, modules.parameters(), data, settings.steps, batch=settings.batch, lr=settings.lr,
                     seed=settings.seed, progress=settings.progress, eval_every=settings.eval_every,
                     desc=f"train MTP ({mode})", top1_start=top1_before, with_prompts=settings.train_on_prompts,
                     state_path=cache / "train_state_mtp.pt",
                     run_key=settings.run_key(prep.data_key, mode=mode, num_modules=num_modules,
                                              num_draft_steps=num_draft_steps),
                     deadline=prep.deadline, checkpoint_every_s=settings.checkpoint_every_s, bf16=settings.bf16,
                     warmup=settings.warmup)
    write_mtp_checkpoint(model_dir, [m.checkpoint_tensors() for m in modules], output_dir)
    vocab_size = len(vocab.ids) if vocab is not None else model.config.vocab_size
    extra = {}
    if eagle:  # the module applied past its trained steps too: a tree may go deeper than the chain it trained for
        depth = settings.tree_depth or 2 * num_draft_steps
        held_out = data.rows(data.held_out_rows)
        with torch.no_grad():
            streams = ctx.eagle(modules[0], *held_out[:4], depth, targets=held_out.targets)
        extra = calibrated_tree(streams, ctx.lm_head, settings.tree_nodes)
    return finish(prep, "mtp", mode, num_modules, num_draft_steps if eagle else num_modules, settings, fitted,
                  top1_before, vocab_size, output_dir, data_cfg, num_modules=num_modules, **extra)


def calibrated_tree(outputs: StepOutputs, lm_head: torch.Tensor, nodes: int, topk: int = 8) -> dict[str, object]:
    """The trained module's per-step, per-rank acceptance on held-out chains, each step conditional on the chain's
    earlier steps hitting (`tree_calibration.chain_rank_acceptance`; Eagle streams), and the static tree of `nodes`
    drafts it makes best (`eagle_choices`, best first, as deep as `outputs` has steps) with its expected AL;
    recorded in train_draft.json."""
    from nextn.train.tree_calibration import best_first_tree, chain_rank_acceptance, expected_acceptance_length

    acc = chain_rank_acceptance(outputs, lm_head, topk=topk)
    choices = best_first_tree(acc, nodes)
    return {"rank_acceptance": acc, "eagle_choices": choices,
            "expected_acceptance_length": expected_acceptance_length(acc, choices)}
