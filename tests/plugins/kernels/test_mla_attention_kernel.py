"""MLA attention kernel (causal K+1 queries and tree-masked) against the PyTorch reference, fp32."""

from __future__ import annotations

import pytest
import torch

from nextn.models.attention_metadata import AttentionMetadata


def _cache(gen, num_slots, c, r):
    return torch.randn(num_slots, c + r, generator=gen)


def _tables(gen, batch, max_blocks, num_blocks):
    """Random blocks per request (block 0 is the null block: never handed out)."""
    return torch.randint(1, num_blocks, (batch, max_blocks), generator=gen)


def _run_both(q_lat, q_pe, kv, meta, scale):
    from nextn.plugins.kernels.dispatch import forced_kernels
    from nextn.plugins.kernels.mla_attention import mla_attention, mla_attention_reference

    want = mla_attention_reference(q_lat, q_pe, kv, meta.context_slots, meta.visible, scale)
    with forced_kernels():
        got = mla_attention(q_lat, q_pe, kv, meta, scale)
    return got, want


@pytest.mark.parametrize("batch,k,block_size,heads,lora", [
    (1, 1, 4, 1, 16), (1, 3, 16, 3, 32), (3, 2, 4, 3, 16), (3, 3, 8, 2, 24), (5, 1, 1, 1, 16), (2, 3, 4, 17, 16)])
def test_decode_matches_reference(kernels, batch, k, block_size, heads, lora):
    gen = torch.Generator().manual_seed(batch * 100 + k * 10 + block_size)
    rope, max_blocks = 8, 48 // block_size
    kv = _cache(gen, 64 * block_size, lora, rope)
    tables = _tables(gen, batch, max_blocks, 64)
    # The K+1 queries straddle a block boundary on row 0; other rows at random lengths (row 1 from position 0).
    kv_lens = torch.randint(0, max_blocks * block_size - k, (batch,), generator=gen)
    kv_lens[0] = max(block_size - 1, 0)
    if batch > 1:
        kv_lens[1] = 0
    positions = kv_lens[:, None] + torch.arange(k + 1)
    meta = AttentionMetadata.create(positions, positions, tables, block_size)  # slot_mapping unused here
    q_lat = torch.randn(batch, k + 1, heads, lora, generator=gen)
    q_pe = torch.randn(batch, k + 1, heads, rope, generator=gen)
    got, want = _run_both(q_lat, q_pe, kv, meta, 0.3)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_prefill_with_padded_rows(kernels):
    gen = torch.Generator().manual_seed(7)
    tables = torch.tensor([[3, 4, 5, 0], [6, 0, 0, 0]])
    positions = torch.arange(10).expand(2, -1)  # row 1 is 3 tokens long, the rest pads (attend like any query)
    meta = AttentionMetadata.create(positions, positions, tables, 4)
    kv = _cache(gen, 40, 16, 8)
    got, want = _run_both(torch.randn(2, 10, 2, 16, generator=gen), torch.randn(2, 10, 2, 8, generator=gen), kv,
                          meta, 0.25)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_single_visible_key_returns_its_latent(kernels):
    """Hand-worked: a query at position 0 sees one key, so its output is that key's c_kv exactly."""
    kv = torch.zeros(16, 24)
    kv[8] = torch.arange(24.0)  # block 2, offset 0
    meta = AttentionMetadata.create(torch.tensor([[0]]), torch.tensor([[8]]), torch.tensor([[2, 3]]), 4)
    got, _ = _run_both(torch.randn(1, 1, 3, 16), torch.randn(1, 1, 3, 8), kv, meta, 1.0)
    assert torch.equal(got, torch.arange(16.0).expand(1, 1, 3, 16))


@pytest.mark.parametrize("batch,block_size", [(1, 4), (3, 8)])
def test_tree_matches_reference(kernels, batch, block_size):
    from nextn.speculative.medusa_tree import build_tree

    tree = build_tree([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
    n = tree.num_tokens
    gen = torch.Generator().manual_seed(batch)
    max_blocks = 40 // block_size
    tables = _tables(gen, batch, max_blocks, 64)
    kv_lens = torch.randint(0, max_blocks * block_size - n, (batch,), generator=gen)
    kv_lens[0] = block_size - 2  # the tree spans a block boundary
    meta = AttentionMetadata.create_tree(kv_lens[:, None] + tree.depth, kv_lens[:, None], tables, block_size,
                                         kv_lens, tree.mask)
    kv = _cache(gen, 64 * block_size, 16, 8)
    got, want = _run_both(torch.randn(batch, n, 3, 16, generator=gen), torch.randn(batch, n, 3, 8, generator=gen),
                          kv, meta, 0.3)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("batch", [1, 3])
def test_per_request_tree_matches_reference(kernels, batch):
    """Per-request rectangular tree masks [B, T, L] (an MTP tree: T queries of one depth over L tree keys)."""
    gen = torch.Generator().manual_seed(batch)
    block_size, t, n = 4, 3, 6
    tables = _tables(gen, batch, 10, 64)
    kv_lens = torch.randint(0, 30, (batch,), generator=gen)
    mask = torch.rand(batch, t, n, generator=gen) < 0.5
    mask[:, :, 0] = True
    positions = kv_lens[:, None] + torch.arange(t)
    meta = AttentionMetadata.create_tree(positions, kv_lens[:, None] + torch.arange(t), tables, block_size, kv_lens,
                                         mask)
    kv = _cache(gen, 64 * block_size, 16, 8)
    got, want = _run_both(torch.randn(batch, t, 3, 16, generator=gen), torch.randn(batch, t, 3, 8, generator=gen),
                          kv, meta, 0.3)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_deepseek_layer_forward_with_kernels(kernels):
    """The model path: a one-layer DeepSeek-V3 writes its cache and attends through the dispatchers."""
    from nextn.models.config import DeepseekV3ModelConfig
    from nextn.models.deepseek_v3.model import DeepseekV3ForCausalLM
    from nextn.plugins.kernels.dispatch import forced_kernels
    from nextn.models.attention_metadata import slots_for_positions

    cfg = DeepseekV3ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                                num_hidden_layers=1, num_attention_heads=3, kv_lora_rank=16, qk_nope_head_dim=8,
                                qk_rope_head_dim=8, v_head_dim=8, max_position_embeddings=64)
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(cfg).eval()
    tables = torch.tensor([[1, 2, 3], [4, 5, 0]])
    ids = torch.randint(0, 64, (2, 6))
    positions = torch.tensor([[3, 4, 5, 6, 7, 8], [0, 1, 2, 3, 4, 5]])
    outs = []
    for forced in (False, True):
        kv = torch.zeros(1, 32, cfg.kv_cache_dim)
        with torch.inference_mode(), (forced_kernels() if forced else torch.enable_grad()):
            meta = AttentionMetadata.create(positions, slots_for_positions(tables, positions, 4), tables, 4)
            outs.append(model(ids, kv, meta))
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)


def test_each_request_is_computed_as_if_alone(kernels):
    """Batch invariance (issue 38): one program per query token, keys walked BLOCK_N at a time from position 0, so a
    request's output is bit for bit the same alone, in a batch of 5 at any position, and whatever the other requests'
    lengths (a wider block table). Under the interpreter here; on a GPU the same program order holds, and
    tests/plugins/kernels/test_kernels_gpu.py runs the kernel for real."""
    from nextn.plugins.kernels.dispatch import forced_kernels
    from nextn.plugins.kernels.mla_attention import mla_attention

    gen = torch.Generator().manual_seed(38)
    block_size, lora, rope, heads, k = 4, 16, 8, 3, 2
    kv = _cache(gen, 64 * block_size, lora, rope)
    tables = _tables(gen, 5, 12, 64)
    kv_lens = torch.tensor([5, 0, 31, 17, 9])
    positions = kv_lens[:, None] + torch.arange(k + 1)
    q_lat = torch.randn(5, k + 1, heads, lora, generator=gen)
    q_pe = torch.randn(5, k + 1, heads, rope, generator=gen)
    with forced_kernels():
        batch = mla_attention(q_lat, q_pe, kv, AttentionMetadata.create(positions, positions, tables, block_size), 0.3)
        for i in range(5):
            width = int(kv_lens[i] + k) // block_size + 1  # only the blocks this request uses
            meta = AttentionMetadata.create(positions[i:i + 1], positions[i:i + 1], tables[i:i + 1, :width],
                                            block_size)
            alone = mla_attention(q_lat[i:i + 1], q_pe[i:i + 1], kv, meta, 0.3)
            assert torch.equal(alone[0], batch[i]), f"request {i}"


def test_non_contiguous_queries(kernels):
    """The model's absorbed query is an einsum's output, often a permuted view: the kernel's output is row-major
    whatever q_lat's strides (an output allocated like q_lat once scrambled every multi-token step on CUDA)."""
    gen = torch.Generator().manual_seed(5)
    batch, t, heads, lora, rope, block_size = 2, 4, 3, 16, 8, 4
    kv = _cache(gen, 64 * block_size, lora, rope)
    tables = _tables(gen, batch, 8, 64)
    positions = torch.tensor([[5], [11]]) + torch.arange(t)
    meta = AttentionMetadata.create(positions, positions, tables, block_size)
    q_lat = torch.randn(batch, heads, t, lora, generator=gen).transpose(1, 2)  # [B, T, nh, C], not contiguous
    q_pe = torch.randn(batch, t, heads, rope, generator=gen)
    assert not q_lat.is_contiguous()
    got, want = _run_both(q_lat, q_pe, kv, meta, 0.3)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_mtp_engine_step_through_the_kernels_equals_plain_decoding(kernels, tmp_path):
    """What a CUDA machine runs, on CPU: every dispatcher through its Triton kernel (interpreter), a tiny
    DeepSeek-V3 with an MTP module, greedy tokens of plain and MTP Eagle (K = 3) steps, eager and through the graph
    runner (emulated capture), identical."""
    import json

    from benchmarks.gpu_step import main

    out = tmp_path / "r.json"
    assert main(["--tiny", "--device", "cpu", "--batch_sizes", "1,2", "--gen_tokens", "6", "--warmup", "0",
                 "--json", str(out)]) == 0
    identity = json.loads(out.read_text())["greedy_identity"]
    assert all(v["identical"] for v in identity.values()), identity
