"""Self-distillation of a checkpoint's MTP modules onto its own target model (training-side, plain PyTorch).

A freshly made tiny checkpoint has random MTP modules, so their drafts are never accepted. `distill_mtp`
trains only the MTP layers (target frozen) to predict the target's own greedy continuations, the way
DeepSeek-V3 trains MTP (report §2.2; arXiv:2412.19437 §2.2): module k at position i reads the embedding of token
i+k and the previous hidden state (the target's final-normed hidden state for k = 1, module k−1's block
output otherwise) and predicts token i+k+1:

    x = eh_proj(cat[enorm(embed(t_{i+k})), hnorm(h_prev_i)])      # embedding first, [B, T, H]
    x = decoder_block(x)                                          # causal attention over the sequence
    logits = lm_head(shared_head.norm(x))                         # the target's frozen lm_head

The loss is feature distillation (as EAGLE's regression loss): the squared error between the module's
normed output and the target's final hidden state that produced the label, i.e. the logits are matched
through the frozen lm_head. A 129k-way softmax per step does not fit the CPU budget, and a sampled one
over-fits the sampled tokens; accuracies are reported with the full vocabulary.
"""

from __future__ import annotations

import copy
import re
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from nextn.progress import progress_bar

from nextn.train.tiny_checkpoint import (
    checkpoint_files,
    dequantize_fp8_state,
    fuse_experts,
    quantize_fp8_block,
    quiet_transformers,
    split_experts,
)


class MtpModule(nn.Module):
    """One DeepSeek MTP module over whole sequences; parameter names follow the checkpoint (minus the layer prefix)."""

    def __init__(self, cfg, layer_idx: int):
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm

        super().__init__()
        h = cfg.hidden_size
        self.enorm = DeepseekV3RMSNorm(h, eps=cfg.rms_norm_eps)
        self.hnorm = DeepseekV3RMSNorm(h, eps=cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.block = DeepseekV3DecoderLayer(cfg, layer_idx)
        self.shared_head_norm = DeepseekV3RMSNorm(h, eps=cfg.rms_norm_eps)

    def forward(self, tok_embeds: torch.Tensor, h_prev: torch.Tensor, position_embeddings, mask: torch.Tensor) -> torch.Tensor:
        """tok_embeds, h_prev [B, T, H] → block output [B, T, H] (before `shared_head.norm`)."""
        x = self.eh_proj(torch.cat([self.enorm(tok_embeds), self.hnorm(h_prev)], dim=-1))
        return self.block(x, attention_mask=mask, position_embeddings=position_embeddings)

    def load_checkpoint_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Load `enorm.weight`, ..., `mlp.experts.{e}.gate_proj.weight` (per-expert layout, prefix stripped)."""
        state = {_to_module_name(k): v.float() for k, v in fuse_experts(tensors).items()
                 if not k.startswith(("embed_tokens.", "shared_head.head."))}
        self.load_state_dict(state, strict=True)

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """Inverse of `load_checkpoint_tensors` (without the embedding / head copies)."""
        state = {_to_checkpoint_name(k): v.detach().clone() for k, v in self.state_dict().items()}
        return split_experts(state)


def _to_module_name(name: str) -> str:
    if name.startswith(("enorm.", "hnorm.", "eh_proj.")):
        return name
    return "shared_head_norm.weight" if name == "shared_head.norm.weight" else "block." + name


def _to_checkpoint_name(name: str) -> str:
    return "shared_head.norm.weight" if name == "shared_head_norm.weight" else name.removeprefix("block.")


def distill_mtp(checkpoint_dir: str | Path, steps: int = 300, seq_len: int = 40, batch: int = 16, seed: int = 0,
                prompts: list[str] | None = None, progress: bool = True, num_sequences: int = 128,
                prompt_len: int = 8, lr: float = 3e-3, eval_every: int = 50) -> dict:
    """Train the MTP layers of `checkpoint_dir` in place on the target's greedy continuations; returns metrics.

    Data: `num_sequences` sequences of `seq_len` tokens, each `prompt_len` prompt tokens (windows of the
    tokenized `prompts`, or random ids when None) followed by the target's greedy continuation; 1/8 of them
    are held out. Only positions whose label is a generated token enter the loss and the accuracies.
    Before training each module is warm-started as the target's "bigram" predictor: `eh_proj` = [I, 0] (pass
    the token embedding through) and `shared_head.norm` = the target's final norm, unless the modules as
    loaded are already more accurate (a checkpoint distilled before keeps its training).
    Returns {"num_modules", "steps", "final_loss", "top1_before": [per module], "top1_after": [...], "seconds"}
    (top-1 = full-vocabulary argmax on the held-out sequences; "before" is the checkpoint as it was). The
    trained tensors are written back under their original names (re-quantized when the checkpoint is FP8).
    Raises ValueError when the checkpoint has no MTP layers.
    """
    start = time.perf_counter()
    target, cfg = _load_target(Path(checkpoint_dir))
    weights = _MtpWeights(Path(checkpoint_dir), cfg)
    modules = weights.modules(target.config)

    gen = torch.Generator().manual_seed(seed)
    tokens = _greedy_data(target, Path(checkpoint_dir), prompts, num_sequences, seq_len, prompt_len, gen)  # [S, L]
    with torch.no_grad():
        hidden = target.model(tokens).last_hidden_state  # [S, L, H], after the final norm
    num_eval = max(1, num_sequences // 8)
    train, held_out = (tokens[num_eval:], hidden[num_eval:]), (tokens[:num_eval], hidden[:num_eval])
    ctx = _Context(target, prompt_len)

    top1_before = ctx.evaluate(modules, *held_out)
    loaded = copy.deepcopy(modules.state_dict())
    _warm_start(modules, target)
    if sum(ctx.evaluate(modules, *held_out)) < sum(top1_before):  # already distilled: continue from it
        modules.load_state_dict(loaded)
    optimizer = torch.optim.Adam(modules.parameters(), lr=lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 - s / max(steps, 1))
    bar = progress_bar(range(steps), enabled=progress, desc="distill MTP")
    loss_value, top1 = float("nan"), top1_before
    for step in bar:
        pick = torch.randint(0, train[0].shape[0], (batch,), generator=gen)
        loss = ctx.loss(modules, train[0][pick], train[1][pick])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        loss_value = loss.item()
        if progress and (step + 1) % eval_every == 0:
            top1 = ctx.evaluate(modules, *held_out)
        bar.set_postfix(loss=f"{loss_value:.4f}", top1="/".join(f"{a:.2f}" for a in top1))
    top1_after = ctx.evaluate(modules, *held_out)
    weights.write_back(modules)
    return {"num_modules": len(modules), "steps": steps, "final_loss": loss_value, "top1_before": top1_before,
            "top1_after": top1_after, "seconds": time.perf_counter() - start}


class _MtpWeights:
    """The checkpoint files holding MTP layers: read into `MtpModule`s, and rewritten from them."""

    def __init__(self, ckpt: Path, cfg):
        self.ckpt, self.first = ckpt, cfg.num_hidden_layers
        self.num_modules = getattr(cfg, "num_nextn_predict_layers", 0) or 0
        if self.num_modules < 1:
            raise ValueError(f"{ckpt} has no MTP layers (num_nextn_predict_layers = {self.num_modules})")
        self.files = {f: names for f, names in checkpoint_files(ckpt).items()
                      if any(_is_mtp(name, self.first) for name in names)}
        self.stored = {}
        for file in self.files:
            self.stored.update(load_file(ckpt / file))

    def modules(self, cfg) -> nn.ModuleList:
        plain = dequantize_fp8_state(self.stored)
        modules = nn.ModuleList(MtpModule(cfg, self.first + k) for k in range(self.num_modules))
        for k, module in enumerate(modules):
            prefix = f"model.layers.{self.first + k}."
            module.load_checkpoint_tensors({n[len(prefix):]: t for n, t in plain.items() if n.startswith(prefix)})
        return modules

    def write_back(self, modules: nn.ModuleList) -> None:
        """Rewrite the files with the modules' tensors in their stored dtype (FP8 weights re-quantized)."""
        updated = dict(self.stored)
        for k, module in enumerate(modules):
            prefix = f"model.layers.{self.first + k}."
            for name, t in module.checkpoint_tensors().items():
                old = self.stored[prefix + name]
                if old.dtype == torch.float8_e4m3fn:
                    updated[prefix + name], updated[prefix + name + "_scale_inv"] = quantize_fp8_block(t)
                else:
                    updated[prefix + name] = t.to(old.dtype).contiguous()
        for file, names in self.files.items():
            save_file({n: updated[n] for n in sorted(names)}, self.ckpt / file, metadata={"format": "pt"})


def _warm_start(modules: nn.ModuleList, target) -> None:
    """Start every module as lm_head(norm(embed(token))): the target's next token given the current one only."""
    h = target.config.hidden_size
    with torch.no_grad():
        for module in modules:
            module.eh_proj.weight.zero_()
            module.eh_proj.weight[:, :h].copy_(torch.eye(h))  # [H, 2H]: embedding half through, hidden half off
            module.shared_head_norm.weight.copy_(target.model.norm.weight)


class _Context:
    """Frozen target pieces shared by the training and evaluation passes."""

    def __init__(self, target, prompt_len: int):
        self.rotary = target.model.rotary_emb
        self.embed = target.model.embed_tokens.weight.detach()  # [V, H]
        self.lm_head = target.lm_head.weight.detach()  # [V, H]
        self.prompt_len = prompt_len

    def run(self, modules, tokens: torch.Tensor, hidden: torch.Tensor):
        """Per module k: (output after shared_head.norm [B, T, H], labels [B, T], teacher [B, T, H], mask [B, T]).

        Module k at position i reads t_{i+k} and predicts t_{i+k+1}; the teacher is the target's final hidden
        state at position i+k (whose lm_head argmax is t_{i+k+1}); mask keeps positions with a generated label.
        """
        seq_len = tokens.shape[1]
        h_prev = hidden
        for k, module in enumerate(modules, start=1):
            t = seq_len - k - 1  # positions i with a label t_{i+k+1}
            inputs, labels = tokens[:, k : k + t], tokens[:, k + 1 : k + 1 + t]
            positions = torch.arange(t).unsqueeze(0)  # [1, T]
            mask = torch.full((t, t), float("-inf")).triu(1)[None, None]  # [1, 1, T, T] causal
            out = module(self.embed[inputs], h_prev[:, :t], self.rotary(h_prev, positions), mask)
            keep = (torch.arange(t) + k + 1 >= self.prompt_len).expand_as(labels)
            yield module.shared_head_norm(out), labels, hidden[:, k : k + t], keep
            h_prev = out

    def loss(self, modules, tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Feature distillation: Σ_k mean squared error to the teacher's final hidden state (logits = lm_head · it)."""
        return sum(((x - teacher)[keep] ** 2).mean() for x, _, teacher, keep in self.run(modules, tokens, hidden))

    @torch.no_grad()
    def evaluate(self, modules, tokens: torch.Tensor, hidden: torch.Tensor) -> list[float]:
        """Per-module top-1 accuracy with the full vocabulary."""
        return [((x[keep] @ self.lm_head.T).argmax(-1) == labels[keep]).float().mean().item()
                for x, labels, _, keep in self.run(modules, tokens, hidden)]


def _load_target(ckpt: Path):
    """The frozen fp32 target (`from_pretrained`; FP8 checkpoints are dequantized here) and its HF config."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    with quiet_transformers():
        cfg = DeepseekV3Config.from_pretrained(ckpt)
        if getattr(cfg, "quantization_config", None) is None:
            target = DeepseekV3ForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
        else:
            del cfg.quantization_config
            target = DeepseekV3ForCausalLM(cfg)
            state = {}
            for file in checkpoint_files(ckpt):
                state.update(load_file(ckpt / file))
            main = {k: v.float() for k, v in fuse_experts(dequantize_fp8_state(state)).items()
                    if not _is_mtp(k, cfg.num_hidden_layers)}
            target.load_state_dict(main, strict=True)
    target.eval().requires_grad_(False)
    return target, cfg


def _is_mtp(name: str, num_hidden_layers: int) -> bool:
    m = re.match(r"model\.layers\.(\d+)\.", name)
    return m is not None and int(m[1]) >= num_hidden_layers


def _greedy_data(target, ckpt: Path, prompts, num_sequences: int, seq_len: int, prompt_len: int,
                 gen: torch.Generator) -> torch.Tensor:
    """[num_sequences, seq_len] token ids: `prompt_len` prompt tokens, then the target's greedy continuation."""
    vocab = target.config.vocab_size
    if prompts:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(ckpt, trust_remote_code=False)
        stream = torch.tensor([i for p in prompts for i in tokenizer(p)["input_ids"]], dtype=torch.long)
        while stream.numel() < prompt_len + num_sequences:
            stream = torch.cat([stream, stream])
        starts = torch.randint(0, stream.numel() - prompt_len + 1, (num_sequences,), generator=gen)
        prompt = torch.stack([stream[s : s + prompt_len] for s in starts.tolist()])
    else:
        prompt = torch.randint(3, min(vocab, 128000), (num_sequences, prompt_len), generator=gen)
    with torch.no_grad():  # eos_token_id=None: never stop early, every row is the full greedy continuation
        out = target.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                              max_new_tokens=seq_len - prompt_len, eos_token_id=None, pad_token_id=0)
    if out.shape != (num_sequences, seq_len):
        raise RuntimeError(f"generate returned {tuple(out.shape)}, expected {(num_sequences, seq_len)}")
    return out
