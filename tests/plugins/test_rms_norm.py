"""nextn's RMSNorm op (plugins/rms_norm_cpu.cpp) against its PyTorch reference on every ISA variant this CPU runs:
Llama's form w · bf16(x̂), Gemma's bf16(x̂ · s) and the weightless bf16(x̂), batch-invariant bit for bit; the norm
modules run it once installed, and a model's greedy tokens are unchanged."""

from __future__ import annotations

import pytest
import torch

from nextn.models.layers import RMSNorm, UnitOffsetRMSNorm, WeightlessRMSNorm
from nextn.plugins import cpu_kernels
from nextn.plugins.rms_norm import install_rms_norms, rms_norm, rms_norm_reference

pytestmark = pytest.mark.skipif(not cpu_kernels.available(),
                                reason=f"nextn's CPU kernels are unavailable here: {cpu_kernels.unavailable_reason()}")


@pytest.mark.parametrize("form", ["bf16 weight", "f32 scale", "none"])
@pytest.mark.parametrize("h", [16, 256, 1536])
def test_the_op_matches_the_reference(kernel_variant, form, h):
    g = torch.Generator().manual_seed(h)
    x = (torch.randn(3, 5, h, generator=g) * 4).bfloat16()
    x[1, 2] = 0  # an all-zero row: eps keeps it finite
    weight = {"bf16 weight": (torch.randn(h, generator=g) + 1).bfloat16(),
              "f32 scale": torch.randn(h, generator=g) + 1, "none": None}[form]
    got, want = rms_norm(x, weight, 1e-6), rms_norm_reference(x, weight, 1e-6)
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    assert not got[1, 2].any()
    # the sum of squares in another order than PyTorch's: x̂ differs in the last f32 bits, at most one bf16 step
    torch.testing.assert_close(got.float(), want.float(), atol=0, rtol=2 ** -7)
    assert (got != want).float().mean() < 0.01
    assert torch.equal(rms_norm(x[1:2, 2:4], weight, 1e-6), got[1:2, 2:4])  # a row alone: the same bits


def test_bad_operands_are_refused_by_name(kernel_variant):
    x = torch.randn(2, 32).bfloat16()
    with pytest.raises(RuntimeError, match="rms_norm: weight must be \\[32\\]"):
        rms_norm(x, torch.ones(16).bfloat16(), 1e-6)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        rms_norm(torch.randn(2, 24).bfloat16(), None, 1e-6)
    with pytest.raises(RuntimeError, match="bfloat16 on the CPU"):
        rms_norm(x.float(), None, 1e-6)


def test_installed_norm_modules_run_the_op():
    torch.manual_seed(0)
    norms = torch.nn.ModuleList([RMSNorm(64), UnitOffsetRMSNorm(64), WeightlessRMSNorm(), RMSNorm(24)])
    for n in norms[:2]:
        torch.nn.init.normal_(n.weight, 1.0, 0.2)
    norms.bfloat16()
    x = (torch.randn(4, 64) * 3).bfloat16()
    before = [n(x if i < 3 else x[:, :24]) for i, n in enumerate(norms)]
    assert install_rms_norms(norms) == 3 and not norms[3].rms_norm_kernel  # 24 wide: not a multiple of 16
    calls = []
    inner = cpu_kernels.ops().rms_norm
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("nextn.models.layers.rms_norm", lambda *a: calls.append(a) or inner(*a))
        after = [n(x if i < 3 else x[:, :24]) for i, n in enumerate(norms)]
    assert len(calls) == 3
    for b, a in zip(before, after):
        torch.testing.assert_close(a.float(), b.float(), atol=0, rtol=2 ** -7)
    assert torch.equal(after[3], before[3])
    assert norms[1](x.float()).dtype == torch.float32  # f32 inputs keep PyTorch's path
