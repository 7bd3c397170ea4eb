"""A tiny DeepSeek-V3 student distilled from a small base's own generations: MLA + MoE + one MTP module, jointly.

No small pretrained DeepSeek-V3 exists here, so the DeepSeek path is measured on a student whose behaviour comes
from a real model (issue 4): the teacher (stories260K, a Llama) continues the training prompts greedily
(`train/data.py`), and a DeepSeek-V3 of `STUDENT_SPEC`'s shape — with the teacher's 512-token tokenizer — is trained
from scratch on those sequences, as DeepSeek trains (report §2.2): L = L_main + λ · L_MTP, where L_main is the
next-token cross-entropy over every position and L_MTP the MTP module's loss. The MTP module is trained unrolled
`num_draft_steps` times on its own hidden states (`MtpContext.eagle`, the Eagle use of one module, K = 3 by
default) and backpropagates into the shared trunk, embedding and head. Written as a DeepSeek-V3 release is
(`testing/tiny_checkpoint.py`): `save_pretrained` for the main model, the MTP layer at `model.layers.{N}` in the
per-expert layout in `model-mtp.safetensors`, the index, `num_nextn_predict_layers: 1`, the tokenizer files.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from nextn.testing.tiny_checkpoint import (
    INDEX_FILE, MTP_SHARD, TinyDeepseekSpec, _tensor_bytes, hf_config, quiet_transformers, split_experts,
)  # fmt: skip
from nextn.train.data import load_base, make_self_distill_data
from nextn.train.loop import fit
from nextn.train.mtp import MtpContext, MtpModule, MtpTrainResult

#: The student's shape: 3 layers (1 dense, 2 MoE: 8 routed experts, top-2 in 1 of 2 groups, 1 shared), MLA with a
#: 32-d latent and 8-d rope dims, hidden 64 like stories260K; vocabulary and special ids are set from the teacher.
STUDENT_SPEC = TinyDeepseekSpec(vocab_size=512, with_tokenizer=False, num_mtp_modules=1)


def deepseek_mtp_module(hf_cfg, layer_idx: int) -> MtpModule:
    """A module whose block is `transformers`' `DeepseekV3DecoderLayer` (MoE from `first_k_dense_replace` on)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm

    return MtpModule(DeepseekV3DecoderLayer(hf_cfg, layer_idx), hf_cfg.hidden_size,
                     lambda h: DeepseekV3RMSNorm(h, eps=hf_cfg.rms_norm_eps))


def student_spec(teacher_config, spec: TinyDeepseekSpec = STUDENT_SPEC) -> TinyDeepseekSpec:
    """`spec` with the teacher's vocabulary size and BOS / EOS ids."""
    return dataclasses.replace(spec, vocab_size=teacher_config.vocab_size, bos_token_id=teacher_config.bos_token_id,
                               eos_token_id=teacher_config.eos_token_id)


def train_student(teacher_dir: str | Path, data_files: list[str | Path], output_dir: str | Path, *,
                  mtp_lambda: float = 0.3, num_draft_steps: int = 3, steps: int = 2000, seed: int = 0,
                  batch: int = 64, lr: float = 3e-3, prompt_len: int = 16, num_tokens: int = 96,
                  max_prompts: int | None = None, held_out_fraction: float = 0.1, progress: bool = True,
                  spec: TinyDeepseekSpec = STUDENT_SPEC, eval_every: int = 100) -> MtpTrainResult:
    """Distil a DeepSeek-V3 student (with one MTP module) from `teacher_dir`'s greedy continuations; write it.

    Returns the metrics; `top1_*` are [next token, MTP step 1, .., step K] on held-out sequences. Also writes
    `train_draft.json` in `output_dir`. Deterministic under `seed` (same thread count).
    Raises:
        ValueError: no usable prompt, or arguments out of range.
    """
    from transformers import DeepseekV3ForCausalLM

    if steps < 0 or num_draft_steps < 1 or mtp_lambda < 0:
        raise ValueError(f"need steps ≥ 0, num_draft_steps ≥ 1, mtp_lambda ≥ 0 (got {steps}, {num_draft_steps}, "
                         f"{mtp_lambda})")
    start, cpu_start = time.perf_counter(), time.process_time()
    torch.manual_seed(seed)
    teacher, tokenizer = load_base(teacher_dir)
    data = make_self_distill_data(teacher, tokenizer, data_files, prompt_len=prompt_len, num_tokens=num_tokens,
                                  held_out_fraction=held_out_fraction, max_prompts=max_prompts, seed=seed)
    data_seconds, data_cpu = time.perf_counter() - start, time.process_time() - cpu_start
    spec = student_spec(teacher.config, spec)
    cfg = hf_config(spec)
    with quiet_transformers():
        student = DeepseekV3ForCausalLM(cfg).train()
    mtp = deepseek_mtp_module(cfg, spec.num_hidden_layers)
    for sub in mtp.modules():  # a standalone layer gets no HF init: its experts and router would stay empty
        student._init_weights(sub)
    mtp.warm_start(student.model.norm.weight.detach())
    params = [*student.parameters(), *mtp.parameters()]

    def run(tokens: torch.Tensor):
        """(next-token logits [B, L−1, V] and labels, MTP step outputs, context)."""
        hidden = student.model(tokens).last_hidden_state  # [B, L, H] after the final norm
        ctx = MtpContext(student.model.embed_tokens.weight, student.lm_head.weight, student.model.rotary_emb,
                         data.prompt_len)
        return student.lm_head(hidden[:, :-1]), tokens[:, 1:], ctx.eagle(mtp, tokens, hidden, num_draft_steps), ctx

    def loss_of(tokens: torch.Tensor) -> torch.Tensor:
        logits, labels, mtp_out, ctx = run(tokens)
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten()) + mtp_lambda * ctx.loss(mtp_out)

    @torch.no_grad()
    def top1() -> list[float]:
        tokens = data.held_out[0]
        logits, labels, mtp_out, ctx = run(tokens)
        keep = torch.arange(labels.shape[1]) >= data.prompt_len - 1  # the generated tokens
        main = (logits.argmax(-1) == labels)[:, keep].float().mean().item()
        return [main, *ctx.top1(mtp_out)]

    top1_before = top1()
    loss_value, top1_after = fit(params, loss_of, top1, (data.train[0],), steps, batch=batch, lr=lr, seed=seed,
                                 progress=progress, eval_every=eval_every, desc="train DeepSeek-V3 student",
                                 warmup=max(1, steps // 20), max_grad_norm=1.0, top1_start=top1_before)
    result = MtpTrainResult("eagle", 1, num_draft_steps, steps, loss_value, top1_before, top1_after, data.num_train,
                            data.tokens.shape[0] - data.num_train, data_seconds,
                            time.perf_counter() - start - data_seconds, data_cpu,
                            time.process_time() - cpu_start - data_cpu, data.held_out_prompts)
    write_student_checkpoint(student, mtp, spec, teacher_dir, output_dir)
    (Path(output_dir) / "train_draft.json").write_text(
        json.dumps({"method": "student", "mtp_lambda": mtp_lambda, **asdict(result)}) + "\n")
    return result


def write_student_checkpoint(student, mtp: MtpModule, spec: TinyDeepseekSpec, teacher_dir: str | Path,
                             output_dir: str | Path) -> Path:
    """Write the student as a DeepSeek-V3 release: main model, MTP shard, index, config, the teacher's tokenizer."""
    from nextn.build.engine_builder import open_checkpoint
    from nextn.build.gguf_reader import GGUFCheckpoint

    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    student.eval()
    with quiet_transformers():
        student.save_pretrained(out)
    prefix = f"model.layers.{spec.num_hidden_layers}."
    own = split_experts(mtp.checkpoint_tensors())
    own["embed_tokens.weight"] = student.model.embed_tokens.weight.detach().clone()  # DeepSeek's release keeps copies
    own["shared_head.head.weight"] = student.lm_head.weight.detach().clone()
    save_file({prefix + k: v.contiguous() for k, v in sorted(own.items())}, str(out / MTP_SHARD),
              metadata={"format": "pt"})
    files = {"model.safetensors": _tensor_bytes(out / "model.safetensors"), MTP_SHARD: _tensor_bytes(out / MTP_SHARD)}
    weight_map = {name: file for file, sizes in files.items() for name in sizes}
    index = {"metadata": {"total_size": sum(sum(sizes.values()) for sizes in files.values())},
             "weight_map": dict(sorted(weight_map.items()))}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    config = json.loads((out / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    (out / "config.json").write_text(json.dumps(dict(sorted(config.items())), indent=2) + "\n")
    with open_checkpoint(Path(teacher_dir)) as reader:
        if isinstance(reader, GGUFCheckpoint):
            reader.write_tokenizer_files(out)
        else:
            from transformers import AutoTokenizer

            AutoTokenizer.from_pretrained(teacher_dir).save_pretrained(str(out))
    return out
