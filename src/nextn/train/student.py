"""A tiny DeepSeek-V3 student distilled from a small base's own generations: MLA + MoE + one MTP module, jointly.

No small pretrained DeepSeek-V3 exists here, so the DeepSeek path is measured on a student whose behaviour comes
from a real model (issue 4): the teacher (stories260K, a Llama) continues the training prompts greedily
(`train/data.py`), and a DeepSeek-V3 of `STUDENT_SPEC`'s shape — with the teacher's 512-token tokenizer — is trained
from scratch on those sequences, as DeepSeek trains (report §2.2): L = L_main + λ · L_MTP, where L_main is the
next-token cross-entropy over every position and L_MTP the MTP module's loss. The MTP module is trained unrolled
`num_draft_steps` times on its own hidden states (`MtpContext.eagle`, the Eagle use of one module, K = 3 by
default) and backpropagates into the shared trunk, embedding and head. Written as a DeepSeek-V3 release is
(`train/tiny_checkpoint.py`): `save_pretrained` for the main model, the MTP layer at `model.layers.{N}` in the
per-expert layout in `model-mtp.safetensors`, the index, `num_nextn_predict_layers: 1`, the tokenizer files.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from nextn.train.tiny_checkpoint import (
    INDEX_FILE, MTP_SHARD, TinyDeepseekSpec, _tensor_bytes, hf_config, quiet_transformers, split_experts,
)  # fmt: skip
from nextn.train.data import DataConfig
from nextn.train.loop import fit
from nextn.train.mtp import MtpContext, MtpModule, generated
from nextn.train.session import TrainResult, TrainSettings, claim_train_output, finish, prepare

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


def train_student(teacher_dir: str | Path, data_cfg: DataConfig, output_dir: str | Path, settings: TrainSettings,
                  *, mtp_lambda: float = 0.3, num_draft_steps: int = 3, spec: TinyDeepseekSpec = STUDENT_SPEC,
                  cache_dir: str | Path | None = None) -> TrainResult:
    """Distil a DeepSeek-V3 student (with one MTP module) from `teacher_dir`'s greedy continuations; write it.

    Returns the metrics; `top1_*` are [next token, MTP step 1, .., step K] on held-out sequences. Also writes
    `train_draft.json` in `output_dir`. Deterministic under the seeds (same thread count).
    Raises:
        ValueError: no usable prompt, or arguments out of range.
    """
    from transformers import DeepseekV3ForCausalLM

    if settings.steps < 0 or num_draft_steps < 1 or mtp_lambda < 0:
        raise ValueError(f"need steps ≥ 0, num_draft_steps ≥ 1, mtp_lambda ≥ 0 (got {settings.steps}, "
                         f"{num_draft_steps}, {mtp_lambda})")
    cache = claim_train_output(teacher_dir, data_cfg.files, output_dir, cache_dir)
    prep = prepare(teacher_dir, data_cfg, settings, cache)
    data = prep.data
    spec = student_spec(prep.model.config, spec)
    cfg = hf_config(spec)
    with quiet_transformers():
        student = DeepseekV3ForCausalLM(cfg).train()
    mtp = deepseek_mtp_module(cfg, spec.num_hidden_layers)
    for sub in mtp.modules():  # a standalone layer gets no HF init: its experts and router would stay empty
        student._init_weights(sub)
    mtp.warm_start(student.model.norm.weight.detach())
    params = [*student.parameters(), *mtp.parameters()]

    def run(tokens: torch.Tensor, prompt_lens: torch.Tensor, lengths: torch.Tensor):
        """(next-token logits [N, V] and labels [N] at real positions, MTP step outputs, context)."""
        hidden = student.model(tokens).last_hidden_state  # [B, L, H] after the final norm
        ctx = MtpContext(student.model.embed_tokens.weight, student.lm_head.weight, student.model.rotary_emb)
        keep = generated(torch.zeros_like(prompt_lens) + 1, lengths, tokens.shape[1] - 1, 0, 1)  # every next token
        return (student.lm_head(hidden[:, :-1][keep]), tokens[:, 1:][keep],
                ctx.eagle(mtp, tokens, hidden, prompt_lens, lengths, num_draft_steps), ctx)

    def loss_of(rows: torch.Tensor) -> torch.Tensor:
        tokens, _, prompt_lens, lengths, _ = data.rows(rows)
        logits, labels, mtp_out, ctx = run(tokens, prompt_lens, lengths)
        return F.cross_entropy(logits, labels) + mtp_lambda * ctx.loss(mtp_out)

    @torch.no_grad()
    def top1() -> list[float]:
        tokens, _, prompt_lens, lengths, _ = data.rows(data.held_out_rows)
        t = tokens.shape[1] - 1
        hidden = student.model(tokens).last_hidden_state
        keep = generated(prompt_lens, lengths, t, 0, 1)  # the generated tokens
        main = (student.lm_head(hidden[:, :-1][keep]).argmax(-1) == tokens[:, 1:][keep]).float().mean().item()
        ctx = MtpContext(student.model.embed_tokens.weight, student.lm_head.weight, student.model.rotary_emb)
        return [main, *ctx.top1(ctx.eagle(mtp, tokens, hidden, prompt_lens, lengths, num_draft_steps))]

    top1_before = top1()
    fitted = fit(params, loss_of, top1, data.num_train, settings.steps, batch=settings.batch, lr=settings.lr,
                 seed=settings.seed, progress=settings.progress, eval_every=settings.eval_every,
                 desc="train DeepSeek-V3 student", warmup=max(1, settings.steps // 20), max_grad_norm=1.0,
                 top1_start=top1_before, state_path=cache / "train_state_student.pt",
                 run_key=settings.run_key(prep.data_key, mtp_lambda=mtp_lambda, num_draft_steps=num_draft_steps),
                 deadline=prep.deadline, checkpoint_every_s=settings.checkpoint_every_s)
    write_student_checkpoint(student, mtp, spec, teacher_dir, output_dir)
    return finish(prep, "student", "eagle", 1, num_draft_steps, settings, fitted, top1_before, spec.vocab_size,
                  output_dir, data_cfg, mtp_lambda=mtp_lambda, num_modules=1)


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

            AutoTokenizer.from_pretrained(teacher_dir, trust_remote_code=False).save_pretrained(str(out))
    return out
