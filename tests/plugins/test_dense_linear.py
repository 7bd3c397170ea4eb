"""nextn's dense CPU linear: against the PyTorch reference and F.linear, batch invariance bit for bit, layouts,
bad operands, fake tensors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nextn.plugins import cpu_kernels, dense_linear
from nextn.plugins.dense_linear import DenseLinear, pack, unpack

pytestmark = [pytest.mark.skipif(not dense_linear.available(),
                                 reason=f"nextn's CPU kernels unavailable: {dense_linear.unavailable_reason()}"),
              pytest.mark.usefixtures("kernel_variant")]

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
IDS = ["bf16", "fp16", "fp32"]


@pytest.fixture
def threads():
    """Restores the thread count a test changes."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def _operands(n: int, k: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen).to(dtype)
    return w, pack(w), torch.randn(n, generator=gen)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("n,k", [(16, 2), (40, 33), (80, 64), (100, 576), (48, 1536), (24, 8960)])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_matches_the_reference(dtype, n, k, with_bias):
    """N not a multiple of 16 (40, 100, 24), an odd K (bf16 pads it), K from 2 to 8960 (a Qwen2.5-1.5B down_proj
    input); every row path: 1 row (4 blocks a unit), up to 4, chunks of 8 and a remainder, 64 rows."""
    w, packed, bias = _operands(n, k, dtype)
    bias = bias if with_bias else None
    for rows in [*range(1, 18), 64]:
        x = torch.randn(rows, k).to(dtype)
        out = dense_linear.dense_linear(x, packed, n, bias)
        ref = dense_linear.dense_linear_reference(x, packed, n, bias)
        assert out.shape == (rows, n) and out.dtype == dtype
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol * ref.float().abs().max().item())


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("n,k", [(80, 576), (40, 33), (1536, 256)])
def test_every_row_is_computed_as_if_alone(dtype, n, k, threads):
    """Batch invariance, bit for bit: each row of an M-row call (M = 1..20) equals the row computed alone, at any
    position of the batch (the rows shuffled), with 1 and 2 threads. What keeps a verify step's logits equal to plain
    decoding's, and a request's independent of the others in its step."""
    _, packed, bias = _operands(n, k, dtype, seed=1)
    x = torch.randn(20, k).to(dtype)
    threads(1)
    alone = torch.cat([dense_linear.dense_linear(x[i:i + 1], packed, n, bias) for i in range(20)])
    for num_threads in (1, 2):
        threads(num_threads)
        for rows in range(1, 21):
            assert torch.equal(dense_linear.dense_linear(x[:rows], packed, n, bias), alone[:rows]), (num_threads, rows)
        perm = torch.randperm(20, generator=torch.Generator().manual_seed(7))
        assert torch.equal(dense_linear.dense_linear(x[perm], packed, n, bias), alone[perm])
        assert torch.equal(dense_linear.dense_linear(x[5:17], packed, n, bias), alone[5:17])


@pytest.mark.parametrize("n,k", [(96, 576), (40, 1536)])
def test_fp32_stays_within_fp32_tolerance_of_f_linear(n, k):
    """An fp32 engine stays what transformers' float32 computes (another summation order: rounding only)."""
    w, packed, bias = _operands(n, k, torch.float32, seed=3)
    x = torch.randn(9, k)
    ref = F.linear(x, w, bias)
    torch.testing.assert_close(dense_linear.dense_linear(x, packed, n, bias), ref, rtol=1e-5,
                               atol=1e-5 * ref.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_precision_stays_close_to_f_linear(dtype):
    """bf16 / fp16 engines: the output rounded once to x's dtype, F.linear's f32-accumulated result within a few of
    its units in the last place."""
    w, packed, bias = _operands(72, 1536, dtype, seed=4)
    x = torch.randn(5, 1536).to(dtype)
    ref = F.linear(x, w, bias.to(dtype)).float()
    out = dense_linear.dense_linear(x, packed, 72, bias.to(dtype))
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())


def test_x_of_another_dtype_and_leading_dims():
    """x's dtype picks the output's; a bf16 weight rounds f32 x to bf16; leading dims are kept."""
    w, packed, bias = _operands(24, 64, torch.bfloat16, seed=5)
    x = torch.randn(2, 3, 64)
    out = dense_linear.dense_linear(x, packed, 24, bias)
    assert out.shape == (2, 3, 24) and out.dtype == torch.float32
    torch.testing.assert_close(out, dense_linear.dense_linear(x.bfloat16().float(), packed, 24, bias), rtol=0, atol=0)
    torch.testing.assert_close(out, x.bfloat16().float() @ w.float().T + bias, rtol=1e-5, atol=1e-4)
    _, packed16, _ = _operands(24, 64, torch.float16)
    assert dense_linear.dense_linear(x.bfloat16(), packed16, 24).dtype == torch.bfloat16
    assert dense_linear.dense_linear(torch.randn(0, 64), packed, 24).shape == (0, 24)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_pack_lays_out_blocks_of_16_channels(dtype):
    w = torch.arange(40 * 33, dtype=torch.float32).view(40, 33).to(dtype)
    packed = pack(w)
    bf16 = dtype == torch.bfloat16
    assert packed.shape == (48, 34 if bf16 else 33) and packed.dtype == dtype
    assert torch.equal(unpack(packed, 40, 33), w)
    assert not unpack(packed, 48, packed.shape[1])[40:].any()  # padding channels are zeros
    c, k = 3, 4  # element 2c + j of input pair k (bf16), element c of input channel k (fp16/fp32)
    assert packed.flatten()[16 * k + (2 * c + 1 if bf16 else c)] == w[c, k + 1 if bf16 else k]
    with pytest.raises(ValueError, match="2-D"):
        pack(torch.zeros(16, 8, dtype=torch.int8))
    with pytest.raises(ValueError, match="N, K >= 1"):
        pack(torch.zeros(0, 8))


def test_bad_operands_are_named():
    _, packed, bias = _operands(40, 64, torch.bfloat16)
    op = cpu_kernels.ops().dense_linear
    with pytest.raises(RuntimeError, match="x has 32 input channels"):
        op(torch.randn(1, 32), packed, None, 40)
    with pytest.raises(RuntimeError, match="out_features = 50"):
        op(torch.randn(1, 64), packed, None, 50)
    with pytest.raises(RuntimeError, match="out_features = 32"):  # more than the padding cut off
        op(torch.randn(1, 64), packed, None, 32)
    with pytest.raises(RuntimeError, match="bias must have 40"):
        op(torch.randn(1, 64), packed, bias[:8], 40)
    with pytest.raises(RuntimeError, match="w must be a contiguous"):
        op(torch.randn(1, 64), packed.to(torch.int8), None, 40)
    with pytest.raises(RuntimeError, match="x must be bfloat16, float16 or float32"):
        op(torch.randn(1, 64).double(), packed, None, 40)
    _, packed32, _ = _operands(40, 33, torch.float32)
    with pytest.raises(RuntimeError, match="x has 34 input channels"):  # fp32 weights are not padded in K
        op(torch.randn(1, 34), packed32, None, 40)


def test_module_replaces_a_linear():
    lin = torch.nn.Linear(64, 40).bfloat16()
    layer = DenseLinear(lin)
    x = torch.randn(3, 64).bfloat16()
    torch.testing.assert_close(layer(x).float(), lin(x).float(), rtol=2e-2, atol=2e-2)
    assert "batch-invariant bfloat16" in repr(layer) and not layer.state_dict()
    with pytest.raises(ValueError, match="bf16/fp16/fp32 CPU weight"):
        DenseLinear(torch.nn.Linear(8, 8).double())


def test_module_refuses_a_machine_without_the_kernel(monkeypatch):
    monkeypatch.setattr(dense_linear.cpu_kernels, "_load", lambda: "the CPU lacks avx512_bf16")
    with pytest.raises(RuntimeError, match="unavailable: the CPU lacks avx512_bf16"):
        DenseLinear(torch.nn.Linear(8, 8))


def test_reference_rows_alone_is_batch_invariant():
    _, packed, bias = _operands(40, 96, torch.float32, seed=6)
    x = torch.randn(7, 96)
    together = dense_linear.dense_linear_reference(x, packed, 40, bias, rows_alone=True)
    assert torch.equal(together[3:4], dense_linear.dense_linear_reference(x[3:4], packed, 40, bias))


def test_fake_implementation_lets_torch_compile_trace_the_op():
    for dtype in DTYPES:
        _, packed, bias = _operands(40, 64, dtype)
        torch.library.opcheck(cpu_kernels.ops().dense_linear.default, (torch.randn(3, 64).to(dtype), packed, bias, 40),
                              test_utils=("test_schema", "test_faketensor"))
