"""nextn's CPU paged attention: against the PyTorch reference (causal, tree masks, GQA, pads), batch invariance,
fake tensors, and the model path it replaces."""

from __future__ import annotations

import pytest
import torch

from nextn.plugins import cpu_kernels, paged_attention

pytestmark = [pytest.mark.skipif(not cpu_kernels.available(),
                                 reason=f"nextn's CPU kernels unavailable: {cpu_kernels.unavailable_reason()}"),
              pytest.mark.usefixtures("kernel_variant")]


def _case(b: int, t: int, nh: int, nkv: int, d: int, ctx: list[int], dtype: torch.dtype, seed: int = 0,
          block_size: int = 4):
    """A paged cache with each sequence's blocks scattered; queries at the last t positions of each context."""
    gen = torch.Generator().manual_seed(seed)
    max_blocks = (max(ctx) + block_size - 1) // block_size
    num_blocks = 1 + b * max_blocks
    kv = torch.randn(num_blocks * block_size, 2 * nkv * d, generator=gen).to(dtype)
    perm = torch.randperm(num_blocks - 1, generator=gen) + 1  # block 0 is the null block
    tables = torch.zeros(b, max_blocks, dtype=torch.int64)
    for i, n in enumerate(ctx):
        used = (n + block_size - 1) // block_size
        tables[i, :used] = perm[i * max_blocks:i * max_blocks + used]
    slots = (tables[:, :, None] * block_size + torch.arange(block_size)).reshape(b, -1)
    positions = torch.stack([torch.arange(n - t, n) for n in ctx])  # [B, T]
    visible = (torch.arange(slots.shape[1])[None, None, :] <= positions[:, :, None])[:, None]
    q = torch.randn(b, t, nh, d, generator=gen).to(dtype)
    return q, kv, slots, visible


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("b,t,nh,nkv,d,ctx", [(1, 1, 12, 2, 128, [37]), (3, 5, 9, 3, 64, [9, 21, 14]),
                                              (2, 4, 4, 4, 32, [4, 30]), (2, 3, 8, 4, 8, [5, 19]),
                                              (1, 2, 6, 2, 40, [23]),
                                              (2, 19, 12, 2, 128, [40, 61]),  # a verify step's one tile
                                              (2, 37, 12, 2, 128, [40, 61])])  # 5 query tiles, the last partial
def test_matches_the_reference(dtype, b, t, nh, nkv, d, ctx):
    q, kv, slots, visible = _case(b, t, nh, nkv, d, ctx, dtype)
    out = cpu_kernels.ops().paged_attention(q, kv, slots, visible, d ** -0.5)
    ref = paged_attention.reference(q, kv, slots, visible, d ** -0.5)
    assert out.shape == (b, t, nh * d) and out.dtype == dtype
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("variant", cpu_kernels.runnable())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_strided_rows_and_wide_heads_match_the_reference_on_every_variant(variant, dtype):
    """Gemma 4: a layer's cache rows as the first columns of wider rows (a row-strided view of a cache as wide as the
    widest layer) and heads of 512 (its full layers), on each ISA variant the CPU runs; the columns past the view
    hold other values, which a kernel reading the view as contiguous would mix in (the control)."""
    cpu_kernels.build(variant)
    op = getattr(torch.ops, cpu_kernels.namespace(variant)).paged_attention
    for nh, nkv, d, extra in ((8, 1, 64, 128), (4, 1, 512, 0), (4, 2, 128, 512)):
        q, kv, slots, visible = _case(2, 3, nh, nkv, d, [17, 40], dtype, seed=7)
        wide = torch.cat([kv, torch.randn(kv.shape[0], extra).to(dtype)], 1) if extra else kv
        view = wide[:, :2 * nkv * d]
        assert view.is_contiguous() == (extra == 0)
        ref = paged_attention.reference(q, kv, slots, visible, d ** -0.5)
        tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(op(q, view, slots, visible, d ** -0.5).float(), ref.float(), rtol=tol, atol=tol)
        if extra:  # the control: the same values packed as if the rows were contiguous differ
            packed = wide.reshape(-1)[:kv.numel()].view(kv.shape)
            assert (op(q, packed, slots, visible, d ** -0.5).float() - ref.float()).abs().max() > 0.1


@pytest.mark.parametrize("variant", cpu_kernels.runnable())
def test_soft_capped_scores_match_the_reference_on_every_variant(variant):
    """Gemma 2's attention logit soft-capping (cap · tanh(score / cap)) on each ISA variant the CPU runs; a cap of 2
    moves every score (the uncapped kernel is then far from the capped reference: the control)."""
    cpu_kernels.build(variant)
    op = getattr(torch.ops, cpu_kernels.namespace(variant)).paged_attention
    q, kv, slots, visible = _case(2, 3, 8, 4, 64, [17, 40], torch.float32, seed=5)
    q = q * 4  # scores of several units, where tanh bends
    ref = paged_attention.reference(q, kv, slots, visible, 0.125, 2.0)
    torch.testing.assert_close(op(q, kv, slots, visible, 0.125, 2.0), ref, rtol=1e-5, atol=1e-5)
    assert (op(q, kv, slots, visible, 0.125) - ref).abs().max() > 1e-2
    with pytest.raises(RuntimeError, match="softcap must be >= 0"):
        op(q, kv, slots, visible, 0.125, -1.0)


@pytest.mark.parametrize("variant", cpu_kernels.runnable())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_attention_sinks_match_the_reference_on_every_variant(variant, dtype):
    """gpt-oss's attention sinks (a logit per query head in each softmax, no value) on each ISA variant the CPU runs,
    with a row that sees one key only (where a sink moves the output most); batch-invariant with them; the kernel
    without the sinks is far from the reference with them (the control)."""
    cpu_kernels.build(variant)
    op = getattr(torch.ops, cpu_kernels.namespace(variant)).paged_attention
    q, kv, slots, visible = _case(2, 5, 8, 2, 40, [5, 33], dtype, seed=7)
    sinks = torch.linspace(-2.0, 3.0, 8)
    ref = paged_attention.reference(q, kv, slots, visible, 0.2, 0.0, sinks)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    out = op(q, kv, slots, visible, 0.2, 0.0, sinks)
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)
    assert (op(q, kv, slots, visible, 0.2).float() - ref.float()).abs().max() > 0.1
    for j in range(5):  # each query row alone equals its row of the batch
        alone = op(q[1:, j:j + 1], kv, slots[1:], visible[1:, :, j:j + 1], 0.2, 0.0, sinks)
        assert torch.equal(alone[0, 0], out[1, j])
    with pytest.raises(RuntimeError, match="sinks must be"):
        op(q, kv, slots, visible, 0.2, 0.0, sinks[:4])


def test_a_tree_mask_is_honoured():
    """Queries that see arbitrary key subsets (a draft tree: ancestors only), not just a causal prefix."""
    q, kv, slots, _ = _case(1, 6, 4, 2, 64, [24], torch.float32, seed=3)
    gen = torch.Generator().manual_seed(4)
    visible = torch.rand(1, 1, 6, slots.shape[1], generator=gen) < 0.5
    visible[..., 0] = True
    out = cpu_kernels.ops().paged_attention(q, kv, slots, visible, 0.125)
    torch.testing.assert_close(out, paged_attention.reference(q, kv, slots, visible, 0.125), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("d", [64, 8, 40])
def test_every_query_row_is_computed_as_if_alone(dtype, d):
    """Batch invariance, bit for bit: a verify step's or a prefill chunk's rows (T > 1 in one query tile and over
    several, B > 1) equal one-token steps' (head_dim 8 and 40 end in a masked chunk)."""
    q, kv, slots, visible = _case(2, 37, 6, 2, d, [45, 39], dtype, seed=5)
    together = cpu_kernels.ops().paged_attention(q, kv, slots, visible, 0.125)
    verify = cpu_kernels.ops().paged_attention(q[:, -17:], kv, slots, visible[:, :, -17:], 0.125)
    assert torch.equal(verify, together[:, -17:])
    for i in range(2):
        for j in range(37):
            alone = cpu_kernels.ops().paged_attention(q[i:i + 1, j:j + 1], kv, slots[i:i + 1],
                                                    visible[i:i + 1, :, j:j + 1], 0.125)
            assert torch.equal(alone[0, 0], together[i, j])


def test_bad_operands_are_named():
    q, kv, slots, visible = _case(1, 1, 4, 2, 64, [8], torch.float32)
    big_q, big_kv, big_slots, big_visible = _case(1, 1, 2, 1, 520, [4], torch.float32)
    with pytest.raises(RuntimeError, match="head_dim 520 must be in"):
        cpu_kernels.ops().paged_attention(big_q, big_kv, big_slots, big_visible, 1.0)
    with pytest.raises(RuntimeError, match="kv_cache must be a .* tensor of contiguous rows"):
        cpu_kernels.ops().paged_attention(q[..., :40], kv, slots, visible, 1.0)
    with pytest.raises(RuntimeError, match="kv_cache must be a .* tensor of contiguous rows"):  # columns strided
        cpu_kernels.ops().paged_attention(q, kv.repeat(1, 2)[:, ::2], slots, visible, 1.0)
    with pytest.raises(RuntimeError, match="bfloat16 or both float32"):
        cpu_kernels.ops().paged_attention(q.bfloat16(), kv, slots, visible, 1.0)
    with pytest.raises(RuntimeError, match="visible"):
        cpu_kernels.ops().paged_attention(q, kv, slots, visible[..., :3], 1.0)


def test_fake_implementation_lets_torch_compile_trace_the_op():
    q, kv, slots, visible = _case(1, 2, 4, 2, 64, [8], torch.float32)
    torch.library.opcheck(cpu_kernels.ops().paged_attention.default, (q, kv, slots, visible, 0.125),
                          test_utils=("test_schema", "test_faketensor"))


def test_a_llama_engine_attends_with_the_kernel_and_matches_transformers(tmp_path):
    """The model path: a tiny HF Llama (head_dim 16) built into a float32 engine uses the kernel in every layer, and
    its greedy continuation equals `transformers`' token for token."""
    from nextn.build.engine_builder import build_engine
    from nextn.runtime.llm import LLM
    from nextn.runtime.sampling_params import SamplingParams
    from nextn.testing.tiny_llama import tiny_hf_llama

    hf = tiny_hf_llama()
    hf.save_pretrained(tmp_path / "ckpt")
    build_engine(tmp_path / "ckpt", tmp_path / "engine", progress=False, max_seq_len=128, dtype="float32")
    llm = LLM(tmp_path / "engine")
    try:
        layers = llm.engine.model.model.layers
        assert all(layer.self_attn.paged_attention_kernel for layer in layers)
        prompt = [1, 17, 42, 99, 5]
        out = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))[0]
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0, len(prompt):].tolist()
        assert list(out.outputs[0].token_ids) == ref
    finally:
        llm.shutdown()
