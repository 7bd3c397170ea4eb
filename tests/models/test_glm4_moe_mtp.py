"""GLM-4.5's MTP layer (issue 62): a tiny random `glm4_moe` checkpoint with one MTP module stored as the released
ones store it (`model.layers.{N}`: an MoE decoder block plus `enorm`, `hnorm`, `eh_proj`, `shared_head.norm`) builds
into an engine whose MTP logits equal `transformers`' own MTP model (`MtpModel.from_pretrained`, what
`generate(use_mtp=True)` drafts with), and MTP decoding (Eagle-style chain, K = 3) is token-identical to plain decoding
and to `transformers`' greedy output — from the HF checkpoint and from llama.cpp's GGUF of it."""

from __future__ import annotations

import pytest
import torch

from nextn.testing.mtp_check import mtp_pass
from nextn.testing.tiny_families import add_mtp_layer, save_tiny

from family_sources import tiny_source
from test_moe_families import _model


PROMPT = [1] + [100 + (7 * i) % 23 for i in range(45)]


@pytest.fixture(scope="module")
def glm_mtp(tmp_path_factory, tokenizer_dir):
    """(checkpoint dir, transformers model fp32, transformers' MTP model) of a 3-layer GLM-4.5 with one MTP module."""
    from transformers import AutoModelForCausalLM, logging
    from transformers.modeling_layers import MtpModel

    out = tmp_path_factory.mktemp("glm4_moe_mtp")
    save_tiny("glm4_moe", out, tokenizer_dir)
    add_mtp_layer(out)
    logging.set_verbosity_error()  # the main model leaves the MTP weights unread, by design
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    # transformers finds MTP weights by the released checkpoints' layer numbers (92, 46): point it at layer 3
    hf._keys_to_ignore_on_load_unexpected = [r"model\.layers\.3\..*"]
    return out, hf, MtpModel.from_pretrained(hf).eval()


def _reference_mtp_logits(hf, mtp, ids: torch.Tensor) -> torch.Tensor:
    """transformers' MTP draft logits at every position t (from h_t and token t + 1) as `MTPCandidateGenerator` runs
    it: [1, T - 1, vocab]."""
    from transformers.cache_utils import MtpCache

    with torch.no_grad():
        hidden = hf(ids, output_hidden_states=True).hidden_states[-1]
        cache = MtpCache(config=hf.config.get_mtp_config())
        pos = torch.arange(1, ids.shape[1])[None]
        y = mtp.forward_layer(0, hidden[:, :-1], pos, cache, input_ids=ids[:, 1:])
        return mtp._project_to_logits(y).float()


@pytest.mark.parametrize("kind", ["hf", "gguf"])
def test_mtp_logits_match_transformers(glm_mtp, kind):
    out, hf, mtp = glm_mtp
    model = _model(tiny_source(out, kind))
    cfg = model.cfg
    assert cfg.num_nextn_predict_layers == 1 and cfg.is_moe_layer(3) and not cfg.is_moe_layer(0)
    assert type(model.model.layers[3].mlp).__name__ == "SparseMoE"
    ids = torch.tensor([PROMPT[:20]])
    got = mtp_pass(model, ids).mtp_logits
    want = _reference_mtp_logits(hf, mtp, ids)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    wrong = mtp_pass(model, ids, shift=0).mtp_logits  # the control: the token at t beside h_t drafts otherwise
    assert not torch.allclose(wrong, want, atol=1e-2)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gguf"])  # (the HF checkpoint's engine: test_moe_families; its MTP logits: above)
def test_mtp_decoding_is_transformers_greedy(glm_mtp, kind, tmp_path):
    """build-engine (float32) → LLM with MTP drafts (one module chained K = 3 times): tokens equal plain decoding's
    and `transformers.generate`'s."""
    from nextn import LLM, SamplingParams
    from nextn.build.engine_builder import build_engine

    out, hf, _ = glm_mtp
    with torch.no_grad():
        want = hf.generate(torch.tensor([PROMPT]), max_new_tokens=32, do_sample=False, pad_token_id=0,
                           eos_token_id=None)[0, len(PROMPT):].tolist()
    manifest = build_engine(tiny_source(out, kind), tmp_path / "engine", dtype="float32", quant_algo=None,
                            max_seq_len=256, progress=False)
    assert manifest.speculative.method == "mtp" and manifest.speculative.num_mtp_modules == 1
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    for spec in (None, {"decoding_type": "MTP", "num_nextn_predict_layers": 3}):
        llm = LLM(tmp_path / "engine", device="cpu", speculative_config=spec)
        result = llm.generate(PROMPT, params).outputs[0]
        llm.shutdown()
        assert result.token_ids == want, spec
        assert spec is None or result.num_draft_tokens > 0


@pytest.mark.slow
def test_w4a16_mtp_decoding_is_plain_decoding(glm_mtp, tmp_path):
    """A W4A16 engine (MoE MTP layer on nextn's fused CPU ops where the kernels load): MTP output = plain output."""
    from nextn import LLM, SamplingParams
    from nextn.build.engine_builder import build_engine

    out, _, _ = glm_mtp
    build_engine(out, tmp_path / "engine", dtype="bfloat16", quant_algo="W4A16", max_seq_len=256, progress=False)
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    got = []
    for spec in (None, {"decoding_type": "MTP", "num_nextn_predict_layers": 3}):
        llm = LLM(tmp_path / "engine", device="cpu", speculative_config=spec)
        got.append(llm.generate([PROMPT, PROMPT[:9]], params))
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in got[1]] == [o.outputs[0].token_ids for o in got[0]]


def test_mtp_holds_in_batches_staggered_chunked_sampled_and_preempted(glm_mtp, tmp_path):
    """Through the engine (batch 12 with fillers, staggered arrivals, chunked prefill, prefix-cache hits, seeded
    sampled rows amid greedy ones, preemption under a tight cache with both schedulers): MTP output equals each
    prompt's plain decoding alone."""
    from nextn.build.engine_builder import build_engine
    from nextn.testing import batch_invariance as bi

    out, _, _ = glm_mtp
    build_engine(out, tmp_path / "engine", dtype="float32", quant_algo=None, max_seq_len=256, progress=False)
    engine = tmp_path / "engine"
    spec = {"decoding_type": "MTP", "num_nextn_predict_layers": 3}
    prompts = bi.id_prompts(6, 49152, num_fillers=6)
    ref = bi.Reference(engine, prompts, 24)
    results = bi.run_cell(engine, "fp32", "MTP", spec, prompts, ref, 24)
    assert results and all(r.ok for r in results), "\n" + bi.format_table(results)
    for overlap in (False, True):
        tight = bi._llm(engine, spec, enable_chunked_prefill=True, max_num_tokens=8,
                        kv_cache_config={"max_tokens": 112, "tokens_per_block": 8}, disable_overlap_scheduler=not overlap)
        assert bi._staggered(tight, prompts.main, bi._greedy(24)) == ref.main
        assert tight.engine.scheduler.num_preemptions > 0
        tight.shutdown()
