"""MTP over recurrent state, sampled: the hybrid families (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) keep the target's
distribution when their MTP layer's drafts are accepted in part, and a request's tokens do not depend on its batch,
its arrival or its preemption.

A random MTP layer's drafts are almost never accepted, which would test only the rejected path. So the tiny target
ties its lm_head to its embedding (its next token is mostly its last one, with a spread that temperature widens) and
its MTP layer copies the embedding of the token it is given (`fc` = [I | 0], the decoder layer's output projections
zero): it drafts "the same token again", which the target accepts about half the time at temperature 2 — each verify
step commits the recurrent state after a varying number of accepted drafts."""

from __future__ import annotations

import pytest
import torch

from nextn import LLM, SamplingParams
from nextn.build.engine_builder import build_engine
from nextn.testing.chi_square import chi_square_two_sample_pvalue
from nextn.testing.spec_checks import accept_every_draft, greedy_outputs, sampled_token_counts, staggered_outputs
from nextn.testing.tiny_families import add_qwen3_5_mtp, save_tiny

MTP3 = {"decoding_type": "MTP", "num_nextn_predict_layers": 3}
PROMPTS = [[1] + [100 + (7 * i) % 23 for i in range(45)], [1, 5, 9, 300, 7000, 12], [1] + list(range(2000, 2030))]
#: a spread next-token distribution (top-1 ~0.3–0.6) of which the copying drafts are accepted about half the time
SPREAD = dict(temperature=2.0, top_k=20)
N = 1500  # seeds a distribution is sampled with


def _copying_mtp(hf_dir) -> None:
    """Make the checkpoint's `mtp.*` layer draft the token it is given: fc = [I | 0] over [embedding; hidden], unit
    norms (zero-centred weights), the decoder layer's o_proj and down_proj zero (its residual passes x through)."""
    from safetensors.torch import load_file, save_file

    path = hf_dir / "model.safetensors"
    sd = load_file(path)
    hidden = sd["mtp.fc.weight"].shape[0]
    sd["mtp.fc.weight"] = torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], 1)
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        sd[f"mtp.{name}.weight"].zero_()
    for name in sd:
        if name.startswith("mtp.layers.0.") and name.endswith(("o_proj.weight", "down_proj.weight")):
            sd[name].zero_()
    save_file(sd, path, metadata={"format": "pt"})


@pytest.fixture(scope="module", params=["qwen3_5_text", "qwen3_5_moe_text", "qwen3_next"])
def engine(request, tmp_path_factory, tokenizer_dir):
    out = tmp_path_factory.mktemp(request.param)
    save_tiny(request.param, out / "hf", tokenizer_dir, seed=2, tie_word_embeddings=True)
    add_qwen3_5_mtp(out / "hf")
    _copying_mtp(out / "hf")
    build_engine(out / "hf", out / "engine", dtype="float32", quant_algo=None, max_seq_len=256, progress=False)
    return out / "engine"


@pytest.fixture(scope="module")
def plain_counts(engine) -> list:
    """Plain decoding's counts of the first three tokens of PROMPTS[1] over N seeds."""
    llm = LLM(engine, device="cpu", speculative_config=None, max_batch_size=64)
    counts = sampled_token_counts(llm, N, SPREAD, PROMPTS[1])
    llm.shutdown()
    return counts


def _mixed(n: int) -> list[SamplingParams]:
    """Greedy and sampled (spread, seeded) rows alternating."""
    return [SamplingParams(max_tokens=24, ignore_eos=True, seed=i, **(SPREAD if i % 2 else {})) for i in range(n)]


def test_mtp_keeps_the_token_distribution(engine, plain_counts):
    plain, prompt = plain_counts, PROMPTS[1]
    llm = LLM(engine, device="cpu", speculative_config=MTP3, max_batch_size=64)
    mtp = sampled_token_counts(llm, N, SPREAD, prompt)
    for j in (1, 2):  # the tokens out of verify steps
        assert chi_square_two_sample_pvalue(plain[j], mtp[j]) > 1e-3, (j, plain[j].most_common(5), mtp[j].most_common(5))
    assert len(plain[1]) > 5 and plain[1].most_common(1)[0][1] < 0.8 * N, "the test needs a spread distribution"
    outs = [o.outputs[0] for o in llm.generate([prompt] * 32, [SamplingParams(max_tokens=16, ignore_eos=True, seed=s,
                                                                               **SPREAD) for s in range(32)])]
    drafted, accepted = sum(o.num_draft_tokens for o in outs), sum(o.num_accepted_draft_tokens for o in outs)
    llm.shutdown()
    assert 0.2 * drafted < accepted < 0.9 * drafted, (accepted, drafted)  # drafts accepted in part


def test_accepting_every_draft_would_fail_the_check(engine, plain_counts, monkeypatch):
    """The check above has power: emitting the drafts unverified changes the distribution detectably (with fewer
    seeds than the check samples)."""
    import nextn.speculative.acceptance_rules as rules

    monkeypatch.setattr(rules, "rejection_sampling", accept_every_draft)
    llm = LLM(engine, device="cpu", speculative_config=MTP3, max_batch_size=64)
    broken = sampled_token_counts(llm, N // 2, SPREAD, PROMPTS[1])
    llm.shutdown()
    pvalues = [chi_square_two_sample_pvalue(plain_counts[j], broken[j]) for j in (1, 2)]
    assert min(pvalues) < 1e-6, pvalues


def test_batch_of_12_equals_each_alone_and_plain(engine):
    """Twelve greedy and sampled rows of different lengths in one batch: each row's tokens are the ones it decodes
    alone, and the ones plain decoding samples with its seed."""
    gen = torch.Generator().manual_seed(3)
    prompts = [[1] + torch.randint(2, 49152, (int(n),), generator=gen).tolist()
               for n in torch.randint(3, 40, (12,), generator=gen)]
    params = _mixed(12)
    plain = LLM(engine, device="cpu", speculative_config=None)
    want = greedy_outputs(plain, prompts, params)
    plain.shutdown()
    llm = LLM(engine, device="cpu", speculative_config=MTP3)
    alone = [greedy_outputs(llm, [p], [sp])[0] for p, sp in zip(prompts, params)]
    outs = [o.outputs[0] for o in llm.generate(prompts, params)]
    llm.shutdown()
    assert alone == want and [o.token_ids for o in outs] == want
    assert sum(o.num_accepted_draft_tokens for o in outs) > 0.2 * sum(o.num_draft_tokens for o in outs)


@pytest.mark.parametrize("overlap", [False, True])
def test_staggered_chunked_prefill_and_preemption_equal_plain(engine, overlap):
    params = _mixed(len(PROMPTS) * 2)
    prompts = PROMPTS * 2
    plain = LLM(engine, device="cpu", speculative_config=None)
    want = greedy_outputs(plain, prompts, params)
    plain.shutdown()
    llm = LLM(engine, device="cpu", speculative_config=MTP3, enable_chunked_prefill=True, max_num_tokens=16,
              kv_cache_config={"max_tokens": 128, "tokens_per_block": 8}, disable_overlap_scheduler=not overlap)
    assert staggered_outputs(llm, prompts, params) == want
    assert llm.engine.scheduler.num_preemptions > 0
    llm.shutdown()
