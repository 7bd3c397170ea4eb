"""Draft_Target on a real model: SmolLM2-135M-Instruct (GGUF, from ../shared/data) verified by itself, drafted by
the same weights dequantized to bf16 and quantized again (its W4A16 groups are not the GGUF's Q4_1 blocks: it agrees
often, not always — about 80 % of drafts on these prompts), both as W4A16 engines on nextn's
CPU kernels — greedy output token-identical to the same engine's plain decoding, batched and with staggered
arrivals, overlap scheduler on and off, with `adaptive_draft_len` switching speculation on and off."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from nextn import LLM, SamplingParams
from nextn.bench.real_models import SHARED_DATA, load_prompt_texts
from nextn.build.gguf_reader import GGUFCheckpoint
from nextn.plugins import cpu_kernels

SMOLLM2 = SHARED_DATA / "models" / "smollm2-135m-instruct"
W4A16 = {"quant_algo": "W4A16"}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """(target GGUF, bf16 draft checkpoint dir, engine cache dir, prompt texts)."""
    found = sorted(SMOLLM2.glob("*.gguf"))
    if not found or not (SHARED_DATA / "prompts" / "mt_bench.jsonl").is_file():
        pytest.skip(f"SmolLM2 GGUF or the prompt sets are absent ({SMOLLM2}): ../shared/data is not checked out")
    if not cpu_kernels.available():
        pytest.skip("nextn's CPU kernels are not built here (W4A16 engines would run PyTorch's path)")
    tmp = tmp_path_factory.mktemp("smollm2_draft_target")
    draft = tmp / "draft_ckpt"
    draft.mkdir()
    with GGUFCheckpoint(found[0]) as ck:
        # not a truncated target: one with its first layers only agrees with it on ~1 % of drafts, so whether a
        # request's first drafts hit (and the adaptive policy keeps measuring it) hangs on rounding
        cfg = dict(ck.hf_config, torch_dtype="bfloat16")
        save_file({n: ck.get(n).to(torch.bfloat16).contiguous() for n in ck.names()}, str(draft / "model.safetensors"))
        ck.write_tokenizer_files(draft)
    (draft / "config.json").write_text(json.dumps(cfg))
    return found[0], draft, tmp / "engines", load_prompt_texts(2, 2)


GREEDY = SamplingParams(max_tokens=32, ignore_eos=True, detokenize=False)


@pytest.fixture(scope="module")
def plain(smollm2):
    """(chat-templated prompt ids, plain decoding's outputs)."""
    target, _, cache, texts = smollm2
    llm = LLM(target, quant_config=W4A16, engine_cache_dir=cache, max_batch_size=4)
    prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": t}]) for t in texts]
    return prompts, [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]


@pytest.mark.parametrize("overlap", [False, True])
def test_requantized_smollm2_drafter_is_lossless(smollm2, plain, overlap):
    (target, draft, cache, _), (prompts, plain) = smollm2, plain
    spec = {"decoding_type": "Draft_Target", "max_draft_len": 3, "speculative_model_dir": str(draft)}
    llm = LLM(target, speculative_config=spec, quant_config=W4A16, engine_cache_dir=cache, max_batch_size=4,
              disable_overlap_scheduler=not overlap)
    outs = [o.outputs[0] for o in llm.generate(prompts, GREEDY)]  # batch 4
    assert [o.token_ids for o in outs] == plain
    accepted = sum(o.num_accepted_draft_tokens for o in outs)
    assert 0 < accepted < sum(o.num_draft_tokens for o in outs)  # it drafts, and not always right
    one_by_one = [llm.generate([p], GREEDY)[0].outputs[0].token_ids for p in prompts]  # batch 1
    assert one_by_one == plain


def test_adaptive_draft_len_on_smollm2_is_lossless(smollm2, plain):
    (target, draft, cache, _), (prompts, plain) = smollm2, plain
    spec = {"decoding_type": "Draft_Target", "max_draft_len": 3, "speculative_model_dir": str(draft),
            "adaptive_draft_len": True}
    llm = LLM(target, speculative_config=spec, quant_config=W4A16, engine_cache_dir=cache, max_batch_size=4)
    llm.engine.iteration_log = []
    pending, ids, outs = list(prompts), [], {}
    while pending or llm.has_unfinished_requests:  # staggered arrivals: each joins a running batch
        if pending:
            ids.append(llm.add_request(pending.pop(0), GREEDY))
        for out in llm.step():
            outs[out.request_id] = out
    assert [outs[i].outputs[0].token_ids for i in ids] == plain
    assert llm.engine.draft_len_policy.alpha is not None  # it observed speculating steps
    # how long it speculates hangs on whether the first request's first drafts hit (a step of misses switches it
    # off until a probe: tests/speculative/test_draft_len_policy.py); it must start speculating and stay in [0, K]
    lengths = [e["draft_len"] for e in llm.engine.iteration_log if e["kind"] == "decode"]
    assert lengths[0] == 3 and set(lengths) <= {0, 1, 2, 3}
