"""The mixture-of-experts families (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE, GLM-4.5) decode as `transformers` in float32 —
tiny random checkpoints made at test time, read from HF safetensors and from the GGUF llama.cpp's own converter
writes — plain, with the NGram and Suffix drafters and with a small dense draft model (Draft_Target); only the
routed experts run; and a request's tokens do not depend on what shares its steps (batch 12, staggered, chunked) in
the bf16, W4A16 and W4A8 engines."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from nextn.build.checkpoint import CheckpointReader
from nextn.build.gguf_reader import GGUFCheckpoint
from nextn.models.config import ConfigError
from nextn.models.llama import LlamaModelConfig
from nextn.models.llama.weights import stored_view
from nextn.models.moe import SparseMoE
from nextn.testing import batch_invariance as bi
from nextn.testing.tiny_families import MOE_FAMILIES, save_tiny

from family_sources import assert_engine_greedy, tiny_source
from test_llama import _assert_matches_hf, _load

PROMPT = [1] + [100 + (7 * i) % 23 for i in range(45)]  # 46 tokens, repetitive: drafts get accepted


@pytest.fixture(scope="module", params=list(MOE_FAMILIES))
def family(request, tmp_path_factory, tokenizer_dir):
    """(model_type, transformers model fp32, HF checkpoint dir) of one MoE family."""
    out = tmp_path_factory.mktemp(request.param)
    return request.param, save_tiny(request.param, out, tokenizer_dir), out


def _model(path: Path):
    reader = GGUFCheckpoint(path) if path.suffix == ".gguf" else CheckpointReader(path)
    cfg = (reader.model_config if path.suffix == ".gguf"
           else LlamaModelConfig.from_hf(json.loads((path / "config.json").read_text())))
    stored = stored_view(reader, cfg)  # Mixtral's block_sparse_moe names
    return _load(cfg, stored.get, stored.has)


@pytest.mark.parametrize("kind", ["hf", "gguf"])
def test_logits_match_transformers(family, kind):
    model_type, hf, hf_dir = family
    model = _model(tiny_source(hf_dir, kind))
    want = MOE_FAMILIES[model_type]
    assert model.cfg.num_experts == want.get("num_experts", want.get("num_local_experts", want.get("n_routed_experts")))
    assert model.cfg.norm_topk_prob == (model_type in ("qwen3_moe", "mixtral", "glm4_moe"))
    if model_type == "glm4_moe":  # what the GGUF's metadata and tensors must give back too
        cfg = model.cfg
        assert (cfg.moe_router, cfg.routed_scaling_factor, cfg.n_shared_experts, cfg.mlp_only_layers, cfg.rotary_dim,
                cfg.qk_norm, cfg.qkv_bias, cfg.attention_bias) == ("sigmoid_grouped", 2.5, 1, (0,), 8, True, True,
                                                                   False)
    assert _assert_matches_hf(model, hf, 4000, [70, 9, 33]) < 1e-4


def test_qwen3_moe_dense_layers(tokenizer_dir, tmp_path):
    """Qwen3-MoE's `mlp_only_layers` keep a dense MLP (HF only: llama.cpp's converter refuses them)."""
    hf = save_tiny("qwen3_moe", tmp_path, tokenizer_dir, mlp_only_layers=[1])
    model = _model(tmp_path)
    assert [type(layer.mlp).__name__ for layer in model.model.layers] == ["SparseMoE", "GatedMLP", "SparseMoE"]
    assert _assert_matches_hf(model, hf, 4000, [40, 7]) < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["hf", "gguf"])
def test_engine_greedy_is_transformers_plain_and_speculative(family, kind, tmp_path):
    """build-engine (float32) → LLM: greedy tokens equal `transformers.generate`, plain and with NGram / Suffix."""
    _, hf, hf_dir = family
    with torch.no_grad():
        want = hf.generate(torch.tensor([PROMPT]), max_new_tokens=32, do_sample=False, pad_token_id=0,
                           eos_token_id=None)[0, len(PROMPT):].tolist()
    assert_engine_greedy(tiny_source(hf_dir, kind), tmp_path / "engine", PROMPT, want)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["hf", "gguf"])
def test_draft_target_with_a_small_dense_draft_is_lossless(family, kind, tokenizer_dir, tmp_path):
    """Draft_Target over each MoE target: a 2-layer dense Qwen3 of the same vocabulary drafts K = 3 (from the same
    kind of file: llama.cpp's converter pads both GGUFs' vocabularies alike); the greedy tokens are `transformers`' (a
    verify step reads the union of its rows' experts)."""
    from nextn import LLM, SamplingParams
    from nextn.build.engine_builder import build_engine

    _, hf, hf_dir = family
    with torch.no_grad():
        want = hf.generate(torch.tensor([PROMPT]), max_new_tokens=24, do_sample=False, pad_token_id=0,
                           eos_token_id=None)[0, len(PROMPT):].tolist()
    save_tiny("qwen3", tmp_path / "draft_hf", tokenizer_dir, vocab_size=hf.config.vocab_size)
    for f in [*hf_dir.glob("tokenizer*"), *hf_dir.glob("special_tokens_map.json")]:  # the target's (GLM's specials)
        shutil.copy(f, tmp_path / "draft_hf" / f.name)
    for src, out in ((tiny_source(hf_dir, kind), "target"), (tiny_source(tmp_path / "draft_hf", kind), "draft")):
        build_engine(src, tmp_path / out, dtype="float32", quant_algo=None, max_seq_len=256, progress=False)
    spec = {"decoding_type": "Draft_Target", "max_draft_len": 3, "speculative_model_dir": str(tmp_path / "draft")}
    llm = LLM(tmp_path / "target", device="cpu", speculative_config=spec)
    outs = [o.outputs[0] for o in llm.generate([PROMPT, PROMPT[:9]], SamplingParams(max_tokens=24, ignore_eos=True))]
    llm.shutdown()
    assert outs[0].token_ids == want and outs[0].num_draft_tokens > 0


def test_glm4_moe_expert_groups(tokenizer_dir, tmp_path):
    """GLM-4.5's group-limited routing (the best `topk_group` of `n_group` expert groups; HF only: llama.cpp's converter
    writes one group) matches transformers; the control routes without groups and differs."""
    hf = save_tiny("glm4_moe", tmp_path, tokenizer_dir, n_group=4, topk_group=2)
    model = _model(tmp_path)
    assert (model.cfg.n_group, model.cfg.topk_group) == (4, 2)
    assert _assert_matches_hf(model, hf, 4000, [40, 7]) < 1e-4
    gates = [layer.mlp.gate for layer in model.model.layers[1:]]
    for gate in gates:
        gate.n_group = gate.topk_group = 1
    with pytest.raises(AssertionError):
        _assert_matches_hf(model, hf, 4000, [40, 7])


def test_only_routed_experts_run():
    """Each expert runs on exactly the tokens routed to it (none runs on no token), and a token's output is the
    weighted sum of its top-k experts, computed alone: the control sums all E experts and differs."""
    torch.manual_seed(0)
    moe = SparseMoE(64, 16, 2, 64, norm_topk_prob=True)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.3)
    x = torch.randn(5, 64)
    seen: dict[int, int] = {}
    for e, expert in enumerate(moe.experts):
        expert.register_forward_hook(lambda m, inp, out, e=e: seen.__setitem__(e, seen.get(e, 0) + inp[0].shape[0]))
    with torch.inference_mode():
        out = moe(x)
        weights, ids = moe.gate(x)
        assert seen == {int(e): int(n) for e, n in zip(*ids.flatten().unique(return_counts=True))}
        assert sum(seen.values()) == 5 * 2 and len(seen) < 16
        want = torch.stack([sum(w * moe.experts[int(i)](x[t]) for w, i in zip(weights[t], ids[t])) for t in range(5)])
        torch.testing.assert_close(out, want)
        probs = torch.softmax(moe.gate.weight @ x.T, 0).T  # every expert, weighted by its probability
        every = torch.stack([sum(probs[t, e] * moe.experts[e](x[t]) for e in range(16)) for t in range(5)])
        assert not torch.allclose(out, every, atol=1e-3)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_moe_rows_do_not_depend_on_the_token_count(dtype):
    """On nextn's dense kernel a token's MoE output alone equals its row among 1..47 others (router, grouping)."""
    from nextn.plugins import dense_linear

    if not dense_linear.available():
        pytest.skip(f"nextn's dense CPU kernel is unavailable: {dense_linear.unavailable_reason()}")
    torch.manual_seed(0)
    moe = SparseMoE(64, 8, 2, 64, norm_topk_prob=False, shared_width=96)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.2)
    moe = moe.to(getattr(torch, dtype))
    dense_linear.install_dense_linears(moe, prefix="")
    x = torch.randn(48, 64).to(getattr(torch, dtype))
    with torch.inference_mode():
        full = moe(x)
        for n in (1, 2, 3, 5, 7, 12):
            assert torch.equal(moe(x[:n]), full[:n]), n


def test_moe_compiles_to_the_same_numbers():
    """Under torch.compile(fullgraph=True) (no host sync: every expert over every token) the layer's output equals
    the eager routed-experts-only one bit for bit."""
    from nextn.plugins import dense_linear

    torch.manual_seed(0)
    moe = SparseMoE(64, 8, 3, 64, norm_topk_prob=True)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.3)
    if dense_linear.available():
        dense_linear.install_dense_linears(moe, prefix="")
    x = torch.randn(7, 64)
    torch._dynamo.reset()
    with torch.inference_mode():
        compiled = torch.compile(moe, fullgraph=True, backend="aot_eager")(x)
        assert torch.equal(compiled, moe(x))


def test_moe_configs_and_refusals():
    """What the configs set, and what is refused by name."""
    base = dict(vocab_size=32, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4)
    mixtral = LlamaModelConfig.from_hf({**base, "architectures": ["MixtralForCausalLM"], "num_local_experts": 8,
                                        "num_experts_per_tok": 2})
    assert (mixtral.num_experts, mixtral.moe_intermediate_size, mixtral.norm_topk_prob) == (8, 96, True)
    qwen = LlamaModelConfig.from_hf({**base, "architectures": ["Qwen3MoeForCausalLM"], "num_experts": 8,
                                     "num_experts_per_tok": 2, "moe_intermediate_size": 32, "decoder_sparse_step": 2,
                                     "mlp_only_layers": [3]})
    assert [qwen.is_moe_layer(i) for i in range(4)] == [False, True, False, False] and qwen.qk_norm
    with pytest.raises(ConfigError, match="num_experts_per_tok"):
        LlamaModelConfig.from_hf({**base, "architectures": ["OlmoeForCausalLM"], "num_experts": 4,
                                  "num_experts_per_tok": 5})
    with pytest.raises(ConfigError, match="cannot choose 5"):
        LlamaModelConfig.from_hf({**base, "architectures": ["Glm4MoeForCausalLM"], "n_routed_experts": 8,
                                  "num_experts_per_tok": 5, "moe_intermediate_size": 32, "n_group": 4, "topk_group": 2})
    with pytest.raises(ConfigError, match="clip_qkv"):
        LlamaModelConfig.from_hf({**base, "architectures": ["OlmoeForCausalLM"], "num_experts": 4,
                                  "num_experts_per_tok": 2, "clip_qkv": 8.0})


@pytest.fixture(scope="module")
def qwen3_moe_engines(tokenizer_dir, tmp_path_factory):
    """Engines of the tiny Qwen3-MoE by format, prompts (6 checked, 6 fillers) and the references."""
    work = tmp_path_factory.mktemp("moe_inv")
    save_tiny("qwen3_moe", work / "hf", tokenizer_dir)
    prompts = bi.id_prompts(6, 49152, num_fillers=6)
    cache: dict[str, tuple[Path, bi.Reference]] = {}

    def engine(fmt: str) -> tuple[Path, bi.Reference]:
        if fmt not in cache:
            eng = bi.build_format(work / "hf", fmt, work / fmt, max_seq_len=256)
            cache[fmt] = eng, bi.Reference(eng, prompts, 24)
        return cache[fmt]

    return engine, prompts


@pytest.mark.slow
@pytest.mark.parametrize("fmt,drafter", [("bf16", "none"), ("bf16", "NGram"), ("W4A16", "none"), ("W4A16", "NGram"),
                                         ("W4A8", "NGram")])
def test_moe_outputs_do_not_depend_on_the_batch(qwen3_moe_engines, fmt, drafter):
    """Batch 12 = staggered = chunked = alone, token for token, with and without drafts; the engine says it is
    batch-invariant (every router, expert and attention on nextn's per-row kernels)."""
    from nextn import LLM
    from nextn.plugins import dense_linear

    if not dense_linear.available():
        pytest.skip(f"nextn's CPU kernels are unavailable here: {dense_linear.unavailable_reason()}")
    engine, prompts = qwen3_moe_engines
    eng, ref = engine(fmt)
    results = bi.run_cell(eng, fmt, drafter, bi.speculative_config(drafter), prompts, ref, 24,
                          ("alone", "batch", "staggered", "chunked"))
    assert results and all(r.ok for r in results), "\n" + bi.format_table(results)
    llm = LLM(eng, speculative_config=None, device="cpu")
    assert llm.engine.batch_invariant
    llm.shutdown()
