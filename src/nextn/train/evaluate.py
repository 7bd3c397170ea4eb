"""Acceptance of trained draft heads, measured with nextn itself: an engine with the heads, the public `LLM` API,
greedy decoding of held-out prompts with and without speculation.

AL = Σ emitted tokens / Σ (decode steps + 1) over the prompts (trtllm-bench's global AL, trtllm-bench docs: the
prefill counts as one step); DAR = accepted drafts / drafts; per-position acceptance = accepted at draft position j
/ decode steps. "lossless": every speculative output equals the same engine's plain decoding token for token (the
guarantee of greedy speculative decoding; float32 engines make it exact — in bfloat16 the [K+1]-row verify rounds
differently from a 1-row step and may part at a near-tie, docs/PERFORMANCE.md).
"""

from __future__ import annotations

import time
from pathlib import Path


def build_eval_engine(model_dir: str | Path, engine_dir: str | Path, *, max_seq_len: int, dtype: str = "float32",
                      medusa_model_dir: str | Path | None = None, max_batch_size: int = 8) -> Path:
    """`build-engine` of `model_dir` (an MTP checkpoint, or the base with `medusa_model_dir`'s heads)."""
    from nextn.build.engine_builder import build_engine

    build_engine(model_dir, engine_dir, dtype=dtype, max_batch_size=max_batch_size, max_seq_len=max_seq_len,
                 progress=False, medusa_model_dir=medusa_model_dir, force=True)
    return Path(engine_dir)


def measure_acceptance(engine_dir: str | Path, prompts: list[list[int]], speculative_config: dict, *,
                       max_tokens: int = 128, ignore_eos: bool = False, max_batch_size: int = 8) -> dict:
    """Greedy decoding of `prompts` (token ids) with `speculative_config` and without, on the engine `engine_dir`.

    Returns {"acceptance_length", "draft_acceptance_rate", "acceptance_rate_per_position", "lossless",
    "num_identical", "num_prompts", "tokens", "seconds", "plain_seconds", "max_tokens", "speculative_config"};
    the seconds are wall-clock of each whole `generate` (batched; not a speed figure).
    """
    from nextn import LLM, SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos)
    start = time.perf_counter()
    spec = LLM(engine_dir, speculative_config=speculative_config, max_batch_size=max_batch_size).generate(prompts, sp)
    seconds = time.perf_counter() - start
    plain = LLM(engine_dir, speculative_config=None, max_batch_size=max_batch_size).generate(prompts, sp)
    plain_seconds = time.perf_counter() - start - seconds
    outs = [o.outputs[0] for o in spec]
    errors = [o.error for o in outs if o.finish_reason == "error"]
    if errors:
        raise RuntimeError(f"{len(errors)} prompt(s) failed: {errors[0]}")
    tokens = sum(len(o.token_ids) for o in outs)
    steps = sum(o.num_decode_steps for o in outs)
    drafts = sum(o.num_draft_tokens for o in outs)
    accepted = sum(o.num_accepted_draft_tokens for o in outs)
    width = max((len(o.accepted_per_position) for o in outs), default=0)
    per_position = [sum(o.accepted_per_position[j] for o in outs if j < len(o.accepted_per_position)) / max(steps, 1)
                    for j in range(width)]
    identical = sum(a.token_ids == b.outputs[0].token_ids for a, b in zip(outs, plain))
    return {"acceptance_length": tokens / (steps + len(outs)), "draft_acceptance_rate": accepted / max(drafts, 1),
            "acceptance_rate_per_position": per_position, "lossless": identical == len(outs),
            "num_identical": identical, "num_prompts": len(outs), "tokens": tokens, "seconds": seconds,
            "plain_seconds": plain_seconds, "max_tokens": max_tokens, "ignore_eos": ignore_eos,
            "speculative_config": speculative_config}


def evaluate_heads(model_dir: str | Path, heads_dir: str | Path, method: str, prompts: list[list[int]], *,
                   num_draft_tokens: int = 3, use_mtp_vanilla: bool = False,
                   medusa_choices: list[list[int]] | None = None, max_tokens: int = 128, ignore_eos: bool = False,
                   dtype: str = "float32", engine_dir: str | Path | None = None) -> dict:
    """Build an engine with the trained heads (into `engine_dir`, default `heads_dir/engine-<dtype>`, kept for
    speed runs) and `measure_acceptance` on `prompts`; the result names the engine directory.

    method: "mtp" (`heads_dir` is the MTP checkpoint; Eagle, or Vanilla with `use_mtp_vanilla`, K =
    `num_draft_tokens`) or "medusa" (`heads_dir` holds medusa_lm_head.safetensors, the tree `medusa_choices`).
    """
    engine = Path(engine_dir) if engine_dir is not None else Path(heads_dir) / f"engine-{dtype}"
    max_seq_len = max(map(len, prompts)) + max_tokens + 64
    if method == "medusa":
        build_eval_engine(model_dir, engine, max_seq_len=max_seq_len, dtype=dtype, medusa_model_dir=heads_dir)
        spec = {"decoding_type": "Medusa", "medusa_choices": medusa_choices}
    else:
        build_eval_engine(heads_dir, engine, max_seq_len=max_seq_len, dtype=dtype)
        spec = {"decoding_type": "MTP", "num_nextn_predict_layers": num_draft_tokens,
                "use_mtp_vanilla": use_mtp_vanilla}
    m = measure_acceptance(engine, prompts, spec, max_tokens=max_tokens, ignore_eos=ignore_eos)
    if method == "medusa":
        m["speculative_config"] = {"decoding_type": "Medusa", "medusa_choices": f"{len(medusa_choices)} nodes"}
    mode = "medusa" if method == "medusa" else "vanilla" if use_mtp_vanilla else "eagle"
    return {**m, "engine_dir": str(engine), "dtype": dtype, "method": method, "mode": mode}
