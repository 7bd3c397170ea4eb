"""oneDNN-packed bf16 linears (plugins/packed_linear.py) against `F.linear`, and an engine that uses them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nextn.plugins.packed_linear import PackedLinear, install_packed_linears, packing_supported

needs_bf16_cpu = pytest.mark.skipif(not packing_supported(torch.device("cpu"), torch.bfloat16),
                                    reason="oneDNN's packed bf16 kernel is off here (a CPU without bf16 instructions, or a "
                                           "PyTorch build whose op fails its probe)")


@needs_bf16_cpu
@pytest.mark.parametrize("rows", [1, 4, 5, 9])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(rows, bias):
    torch.manual_seed(rows)
    layer = nn.Linear(96, 200, bias=bias).to(torch.bfloat16)
    x = torch.randn(2, rows, 96, dtype=torch.bfloat16)
    packed = PackedLinear(layer)
    y = packed(x)
    ref = F.linear(x, layer.weight, layer.bias)
    assert y.shape == (2, rows, 200) and y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), ref.float(), atol=1e-2, rtol=1e-2)
    # float32 activations come back float32
    assert packed(x.float()).dtype == torch.float32


def test_packed_linear_rejects_float32_weights():
    with pytest.raises(ValueError, match="bf16 CPU weight"):
        PackedLinear(nn.Linear(8, 8))


@needs_bf16_cpu
def test_install_replaces_decoder_linears_only():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj, self.kv_b_proj = nn.Linear(16, 16), nn.Linear(16, 32)

    class Model(nn.Module):
        weights_read_directly = ("kv_b_proj",)

        def __init__(self):
            super().__init__()
            self.model = nn.Module()
            self.model.layers = nn.ModuleList([Block(), Block()])
            self.lm_head = nn.Linear(16, 50)

    m = Model().to(torch.bfloat16)
    assert install_packed_linears(m) == ["model.layers.0.q_proj", "model.layers.1.q_proj"]
    assert isinstance(m.model.layers[1].q_proj, PackedLinear)
    assert type(m.model.layers[0].kv_b_proj) is nn.Linear and type(m.lm_head) is nn.Linear
    assert install_packed_linears(Model()) == []  # float32: nothing to pack


@needs_bf16_cpu
def test_packed_linear_under_torch_compile_matches_eager():
    torch.manual_seed(0)
    layer = PackedLinear(nn.Linear(64, 96, bias=True).to(torch.bfloat16))
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    compiled = torch.compile(lambda t: layer(t) * 2, fullgraph=True, backend="aot_eager")  # the custom op traces
    torch.testing.assert_close(compiled(x), layer(x) * 2, atol=0, rtol=0)


def test_packing_is_off_where_the_op_fails_its_probe(monkeypatch):
    """PyTorch 2.10's aarch64 wheel packs a weight but its op raises (NotImplementedError: the custom-op alias check
    cannot read the opaque packed tensor): layers then stay `nn.Linear` instead of failing at the first step."""
    from nextn.plugins import packed_linear as module

    def broken(x, packed, bias):
        raise NotImplementedError("Cannot access storage of OpaqueTensorImpl")

    model = nn.Module()
    model.model = nn.Module()
    model.model.layers = nn.ModuleList([nn.Linear(8, 8).to(torch.bfloat16)])
    module._packed_kernel_runs.cache_clear()
    monkeypatch.setattr(module, "packed_linear", broken)
    try:
        assert not packing_supported(torch.device("cpu"), torch.bfloat16)
        assert install_packed_linears(model) == [] and type(model.model.layers[0]) is nn.Linear
    finally:
        module._packed_kernel_runs.cache_clear()
