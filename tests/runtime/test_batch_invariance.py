"""Batch invariance: a request's greedy tokens are the plain decoder's alone (the reference: each prompt alone,
plain decoding, no prefix cache), whatever shares its steps — a batch of 12, staggered arrivals, chunked prefill,
prefix-cache hits — and whatever the drafter; a seeded sampled request draws the same tokens alone and in a batch.

The matrix is `nextn.testing.batch_invariance` (`python -m nextn.testing.batch_invariance --model GGUF ...` runs
it in full: 32 prompts × 128 tokens, every format × drafter × scenario). Here, within CI's minutes on 2 cores:
- stories260K (a real pretrained Llama, GGUF): 6 checked prompts × 24 tokens, each batch topped up to 12 with
  unchecked fillers. bf16 and W4A16: drafters none, NGram, Draft_Target (the fp32 build as draft), Medusa (seeded
  random heads), every scenario. fp32, W8A16, W4A8: none and NGram, scenarios batch, staggered, chunked.
  (stories260K's MLP width 172 fits no int4 group: its W4A16 / W4A8 engines quantize attention and keep the MLPs
  bf16, as `build-engine --exclude_modules` does.)
- MTP: the tiny DeepSeek-V3 (MLA, MoE; one distilled MTP module) and a tiny Llama with 1 MTP layer, fp32 and bf16.
- SmolLM2-135M (Q4_1 GGUF): bf16 and W4A16, none and NGram, 4 prompts × 64 tokens, alone vs a batch of 12.
- Every lower ISA variant of nextn's CPU kernels the CPU runs (`NEXTN_CPU_ISA`): stories260K in each format with
  one drafter, scenarios batch, staggered, chunked, against that variant's own reference.
Real models are skipped with the reason when ../shared/data is absent.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nextn.plugins import cpu_kernels
from nextn.testing import SMALL_VOCAB
from nextn.testing import batch_invariance as bi

pytestmark = pytest.mark.slow

DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"
STORIES = DATA / "models" / "stories260K" / "stories260K.gguf"
SMOLLM2 = DATA / "models" / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"
ALL = ("alone", "batch", "staggered", "chunked", "prefix", "sampled")
BASIC = ("batch", "staggered", "chunked")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_deepseek_moe_rows_do_not_depend_on_the_token_count(dtype):
    """A token's MoE output alone equals its row among 1..47 others (router, gathered vs buffered dispatch, bmm M)."""
    import torch

    from nextn.models.config import DeepseekV3ModelConfig
    from nextn.models.deepseek_v3.moe import deepseek_moe
    from nextn.plugins import dense_linear

    if not dense_linear.available():
        pytest.skip(f"nextn's dense CPU kernel is unavailable: {dense_linear.unavailable_reason()}")
    cfg = DeepseekV3ModelConfig(vocab_size=32, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
                                num_hidden_layers=2, num_attention_heads=2, n_routed_experts=8, n_group=2,
                                topk_group=1, num_experts_per_tok=2, kv_lora_rank=8, qk_nope_head_dim=4,
                                qk_rope_head_dim=4, v_head_dim=4)
    torch.manual_seed(0)
    moe = deepseek_moe(cfg)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.2)
    moe = moe.to(getattr(torch, dtype))
    moe.gate.e_score_correction_bias.data = moe.gate.e_score_correction_bias.float()
    dense_linear.install_dense_linears(moe, prefix="")
    x = torch.randn(48, 64).to(getattr(torch, dtype))
    with torch.inference_mode():
        full = moe(x)
        for n in (1, 2, 3, 4, 5, 7, 12):
            assert torch.equal(moe(x[:n]), full[:n]), n


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gated_mlp_rows_do_not_depend_on_the_token_count(dtype):
    """A SwiGLU width that is no multiple of the vector width (stories260K's 172): the silu's tail moves with N."""
    import torch

    from nextn.models.layers import GatedMLP
    from nextn.plugins import dense_linear

    if not dense_linear.available():
        pytest.skip(f"nextn's dense CPU kernel is unavailable: {dense_linear.unavailable_reason()}")
    torch.manual_seed(0)
    mlp = GatedMLP(64, 172).to(getattr(torch, dtype))
    dense_linear.install_dense_linears(mlp, prefix="")
    x = torch.randn(48, 64).to(getattr(torch, dtype))
    with torch.inference_mode():
        full = mlp(x)
        for n in (1, 2, 3, 5, 7, 12):
            assert torch.equal(mlp(x[:n]), full[:n]), n


def _assert_all_identical(results: list[bi.Result]) -> None:
    assert results and all(r.ok for r in results), "\n" + bi.format_table(results)


@pytest.fixture(scope="module")
def stories(tmp_path_factory):
    """Builds of stories260K by format (with 3 Medusa heads), the fp32 draft engine, prompts, and references."""
    if not STORIES.is_file():
        pytest.skip(f"{STORIES} is absent: the real stories260K model is not available")
    work = tmp_path_factory.mktemp("stories_inv")
    draft = bi.build_format(STORIES, "fp32", work / "draft", max_seq_len=256)
    cfg = json.loads((draft / "manifest.json").read_text())["model"]
    heads = bi.random_medusa_heads(work / "heads", 3, cfg["hidden_size"], cfg["vocab_size"])
    prompts = bi.id_prompts(6, cfg["vocab_size"], num_fillers=6)
    cache: dict[str, tuple[Path, bi.Reference]] = {}

    def engine(fmt: str) -> tuple[Path, bi.Reference]:
        if fmt not in cache:
            eng = bi.build_format(STORIES, fmt, work / fmt, heads, cfg, max_seq_len=256)
            cache[fmt] = eng, bi.Reference(eng, prompts, 24)
        return cache[fmt]

    return engine, draft, prompts


@pytest.mark.parametrize("fmt,drafter,scenarios", [
    *[(f, d, ALL) for f in ("bf16", "W4A16") for d in ("none", "NGram", "Draft_Target", "Medusa")],
    *[(f, d, BASIC) for f in ("fp32", "W8A16", "W4A8") for d in ("none", "NGram")],
])
def test_stories260k_outputs_do_not_depend_on_the_batch(stories, fmt, drafter, scenarios):
    engine, draft, prompts = stories
    eng, ref = engine(fmt)
    spec = bi.speculative_config(drafter, draft)
    _assert_all_identical(bi.run_cell(eng, fmt, drafter, spec, prompts, ref, 24, scenarios))


@pytest.mark.parametrize("variant", cpu_kernels.runnable()[1:])  # the best variant runs every test above
@pytest.mark.parametrize("fmt,drafter", [("bf16", "NGram"), ("W4A16", "Draft_Target"), ("fp32", "NGram"),
                                         ("W8A16", "none"), ("W4A8", "NGram")])
def test_stories260k_outputs_do_not_depend_on_the_batch_on_every_kernel_variant(stories, variant, fmt, drafter):
    """The same within every lower ISA variant the CPU runs (NEXTN_CPU_ISA=avx512, avx2, generic): each variant's
    own plain, alone decoding is the reference (two variants may differ in the last bits, never one with itself)."""
    engine, draft, prompts = stories
    eng, _ = engine(fmt)
    with cpu_kernels.use(variant):
        ref = bi.Reference(eng, prompts, 24)
        results = bi.run_cell(eng, fmt, drafter, bi.speculative_config(drafter, draft), prompts, ref, 24, BASIC)
        assert cpu_kernels.ops().isa() == variant
    _assert_all_identical(results)


@pytest.mark.parametrize("fmt", ["fp32", "bf16", "W8A16", "W4A8"])
def test_every_target_linear_runs_on_a_per_row_kernel(stories, fmt):
    """The engine's own account (`batch_dependent_linear`, part of `Engine.batch_invariant`, said at load): every
    decoder linear and the lm_head of the target run on nextn's per-row kernels — the dense kernel for fp32 / bf16
    (the lm_head included), the int kernels for W8A16 / W4A8, and the dequantized weight on the dense kernel where
    PyTorch's int8 kernel cannot run (stories260K's down_proj, K = 172) — and its attention (head_dim 8, a masked
    chunk) on nextn's paged kernel: the engine says it is batch-invariant."""
    from nextn import LLM
    from nextn.plugins import dense_linear
    from nextn.runtime.model_loader import batch_dependent_attention, batch_dependent_linear

    if not dense_linear.available():
        pytest.skip(f"nextn's CPU kernels are unavailable here: {dense_linear.unavailable_reason()}")
    engine, _, _ = stories
    llm = LLM(engine(fmt)[0], speculative_config=None, device="cpu")
    assert batch_dependent_linear(llm.engine.model) is None
    assert batch_dependent_attention(llm.engine.model) is None
    assert llm.engine.batch_invariant
    if fmt in ("fp32", "bf16"):
        assert isinstance(llm.engine.model.dense_lm_head, dense_linear.DenseLinear)


@pytest.fixture(scope="module")
def deepseek_mtp(checkpoints, tmp_path_factory):
    """The tiny DeepSeek-V3 with one distilled MTP module, by engine dtype."""
    ckpt = checkpoints.checkpoint(distill_steps=150, num_mtp_modules=1, **SMALL_VOCAB)
    work = tmp_path_factory.mktemp("ds_inv")
    return lambda fmt: bi.build_format(ckpt, fmt, work / fmt)


@pytest.mark.parametrize("fmt", ["fp32", "bf16"])
@pytest.mark.parametrize("drafter", ["none", "MTP"])
def test_deepseek_v3_outputs_do_not_depend_on_the_batch(deepseek_mtp, fmt, drafter):
    eng = deepseek_mtp(fmt)
    prompts = bi.id_prompts(6, SMALL_VOCAB["vocab_size"], num_fillers=6)
    ref = bi.Reference(eng, prompts, 24)
    results = bi.run_cell(eng, fmt, drafter, bi.speculative_config(drafter), prompts, ref, 24,
                          ALL if drafter == "MTP" else BASIC)
    _assert_all_identical(results)


def _llama_mtp_checkpoint(out: Path) -> Path:
    """A 2-layer HF Llama (head_dim 16: nextn's attention kernel) with one random MTP module at model.layers.2."""
    import torch
    from safetensors.torch import load_file, save_file

    from nextn.testing.tiny_llama import tiny_hf_llama
    from nextn.train.mtp import mtp_module

    hf = tiny_hf_llama()
    module = mtp_module(hf.config)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.02 * torch.randn_like(p))
    hf.save_pretrained(out)
    state = load_file(str(out / "model.safetensors"))
    state.update({f"model.layers.2.{n}": t for n, t in module.checkpoint_tensors().items()})
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    return out


@pytest.fixture(scope="module")
def llama_mtp(tmp_path_factory):
    """The tiny Llama with one MTP layer, by engine dtype."""
    work = tmp_path_factory.mktemp("llama_mtp_inv")
    ckpt = _llama_mtp_checkpoint(work / "ckpt")
    return lambda fmt: bi.build_format(ckpt, fmt, work / fmt, max_seq_len=256)


@pytest.mark.parametrize("fmt", ["fp32", "bf16"])
def test_llama_mtp_outputs_do_not_depend_on_the_batch(llama_mtp, fmt):
    eng = llama_mtp(fmt)
    prompts = bi.id_prompts(6, 300, num_fillers=6)
    ref = bi.Reference(eng, prompts, 24)
    _assert_all_identical(bi.run_cell(eng, fmt, "MTP", bi.speculative_config("MTP"), prompts, ref, 24, ALL))


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    if not SMOLLM2.is_file():
        pytest.skip(f"{SMOLLM2} is absent: the real SmolLM2 model is not available")
    return tmp_path_factory.mktemp("smollm2_inv")


@pytest.mark.parametrize("fmt", ["bf16", "W4A16"])
def test_smollm2_outputs_do_not_depend_on_the_batch(smollm2, fmt):
    eng = bi.build_format(SMOLLM2, fmt, smollm2 / fmt, max_seq_len=512)
    from nextn import LLM

    tok = LLM(eng, speculative_config=None, device="cpu").tokenizer
    prompts = bi.text_prompts(tok.encode, 12, DATA, min_len=16, max_len=64)
    checked = bi.Prompts(prompts.main[:4], fillers=prompts.main[4:])
    ref = bi.Reference(eng, checked, 32)
    results = []
    for drafter in ("none", "NGram"):
        results += bi.run_cell(eng, fmt, drafter, bi.speculative_config(drafter), checked, ref, 32, ("batch",))
    _assert_all_identical(results)
