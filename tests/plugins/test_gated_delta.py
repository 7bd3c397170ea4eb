"""nextn's CPU gated delta rule (Gated DeltaNet's recurrence over the ring of per-request states), on every ISA
variant this CPU runs: against the PyTorch reference (outputs and the ring it keeps; fresh rows, pads, grouped value
heads, head sizes that are not multiples of 16), bit-identical whatever the batch and however the tokens are split
into calls (a verify step's K + 1 tokens equal K + 1 one-token steps), and the model path it replaces."""

from __future__ import annotations

import pytest
import torch

from nextn.plugins import cpu_kernels, gated_delta

pytestmark = [pytest.mark.skipif(not cpu_kernels.available(),
                                 reason=f"nextn's CPU kernels unavailable: {cpu_kernels.unavailable_reason()}"),
              pytest.mark.usefixtures("kernel_variant")]


def _case(b: int, t: int, h: int, dk: int, dv: int, slots: int = 5, ring: int = 4, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(b, t, h, dk, generator=gen), dim=-1) * dk ** -0.5
    k = torch.nn.functional.normalize(torch.randn(b, t, h, dk, generator=gen), dim=-1)
    v = torch.randn(b, t, h, dv, generator=gen)
    decay = torch.rand(b, t, h, generator=gen) * 0.5 + 0.5
    beta = torch.rand(b, t, h, generator=gen)
    ssm = torch.randn(slots, h, dk, dv, generator=gen)
    pending = torch.randn(slots, ring, h, dk + dv + 1, generator=gen) * 0.3
    pending[..., -1] = torch.rand(slots, ring, h, generator=gen) * 0.5 + 0.5  # the updates' decays
    rows = torch.randperm(slots, generator=gen)[:b]
    committed = torch.randint(0, ring + 1, (b,), generator=gen)
    fresh = torch.arange(b) % 3 == 0
    lens = torch.randint(1, t + 1, (b,), generator=gen)
    valid = torch.arange(t)[None, :] < lens[:, None]
    return q, k, v, decay, beta, ssm, pending, rows, committed, fresh, valid


@pytest.mark.parametrize("b,t,h,dk,dv", [(1, 1, 4, 16, 16), (3, 7, 4, 16, 24), (2, 12, 2, 128, 128),
                                         (4, 3, 6, 32, 8)])
def test_matches_the_reference(b, t, h, dk, dv):
    """Outputs, the state kept and the pending updates, against the reference (rows with fewer and more valid
    tokens than R, fresh rows, 0..R committed updates)."""
    q, k, v, decay, beta, ssm, pending, slots, committed, fresh, valid = _case(b, t, h, dk, dv)
    want_ssm, want_pending = ssm.clone(), pending.clone()
    want = gated_delta.reference(q, k, v, decay, beta, want_ssm, want_pending, slots, committed, fresh, valid)
    out = cpu_kernels.ops().gated_delta_rule(q, k, v, decay, beta, ssm, pending, slots, committed, fresh, valid)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ssm, want_ssm, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pending, want_pending, rtol=1e-5, atol=1e-5)
    assert not torch.equal(ssm, _case(b, t, h, dk, dv)[5])  # it wrote the state


@pytest.mark.parametrize("rule", ["kernel", "reference"])
def test_committing_a_prefix_is_bit_identical_to_running_it(rule):
    """A verify step of R tokens leaves them pending; the next call committing the first j of them computes, bit for
    bit, what it computes after a call that ran only those j tokens (any accepted prefix; R = 5)."""
    fn = cpu_kernels.ops().gated_delta_rule if rule == "kernel" else gated_delta.reference
    q, k, v, decay, beta, ssm, pending, slots, _, _, _ = _case(2, 6, 4, 32, 24, ring=5)
    zero, one = torch.zeros(2, dtype=torch.int64), torch.ones(2, dtype=torch.int64)
    fresh = torch.zeros(2, dtype=torch.bool)

    def run(state, t0, t1, committed):
        n = t1 - t0
        return fn(q[:, t0:t1], k[:, t0:t1], v[:, t0:t1], decay[:, t0:t1], beta[:, t0:t1], *state, slots, committed,
                  fresh, torch.ones(2, n, dtype=torch.bool))

    for j in range(1, 6):
        verified = (ssm.clone(), pending.clone())
        run(verified, 0, 5, zero)  # the verify step: 5 tokens pending
        after = run(verified, 5, 6, one * j)  # the next step: j of them accepted
        prefix = (ssm.clone(), pending.clone())
        run(prefix, 0, j, zero)
        assert torch.equal(run(prefix, 5, 6, one * j), after)


def test_rows_and_token_splits_are_bit_identical():
    """Each row alone and in the batch, and its tokens in one call or one call each (each call committing the one
    token before it, as a decode step does), give the same bits."""
    q, k, v, decay, beta, ssm, pending, slots, committed, fresh, _ = _case(3, 6, 4, 32, 32, ring=6)
    valid = torch.ones(3, 6, dtype=torch.bool)
    op = cpu_kernels.ops().gated_delta_rule
    batch = op(q, k, v, decay, beta, ssm.clone(), pending.clone(), slots, committed, fresh, valid)
    for r in range(3):
        row = slice(r, r + 1)
        alone = op(q[row], k[row], v[row], decay[row], beta[row], ssm.clone(), pending.clone(), slots[row],
                   committed[row], fresh[row], valid[row])
        assert torch.equal(alone, batch[row])
        state, outs = (ssm.clone(), pending.clone()), []
        for t in range(6):
            step = slice(t, t + 1)
            outs.append(op(q[row, step], k[row, step], v[row, step], decay[row, step], beta[row, step], *state,
                           slots[row], committed[row] if t == 0 else torch.tensor([1]), fresh[row] & (t == 0),
                           valid[row, step]))
        assert torch.equal(torch.cat(outs, 1), batch[row])


def test_bad_arguments_are_refused():
    q, k, v, decay, beta, ssm, pending, slots, committed, fresh, valid = _case(2, 3, 4, 16, 16)
    op = cpu_kernels.ops().gated_delta_rule
    with pytest.raises(RuntimeError, match="out of range"):
        op(q, k, v, decay, beta, ssm, pending, slots + 100, committed, fresh, valid)
    with pytest.raises(RuntimeError, match="out of range"):
        op(q, k, v, decay, beta, ssm, pending, slots, committed + 5, torch.zeros(2, dtype=torch.bool), valid)
    with pytest.raises(RuntimeError, match="float32"):
        op(q.double(), k.double(), v, decay, beta, ssm, pending, slots, committed, fresh, valid)


def _layer(hk: int, hv: int, dk: int, dv: int, hidden: int = 64, seed: int = 0):
    from types import SimpleNamespace

    from nextn.models.gated_deltanet import GatedDeltaNet

    cfg = SimpleNamespace(hidden_size=hidden, linear_num_key_heads=hk, linear_num_value_heads=hv,
                          linear_key_head_dim=dk, linear_value_head_dim=dv, linear_conv_kernel_dim=4, rms_norm_eps=1e-6)
    torch.manual_seed(seed)
    layer = GatedDeltaNet(cfg, 1)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * (0.5 if p.dim() == 1 else p.shape[-1] ** -0.5))
    return layer


def _mixer_case(layer, b: int, t: int, slots: int = 5, ring: int = 4, seed: int = 1):
    from nextn.models.recurrent_state import RecurrentRows, RecurrentState

    gen = torch.Generator().manual_seed(seed)
    state = RecurrentState(2, slots, ring, layer.conv_dim, layer.kernel, layer.value_heads, layer.key_dim,
                           layer.value_dim)
    state.conv.normal_(generator=gen)
    state.ssm.normal_(generator=gen)
    state.pending.normal_(generator=gen).mul_(0.3)
    state.pending[..., -1].uniform_(0.5, 1.0, generator=gen)
    rows_slots = torch.randperm(slots, generator=gen)[:b]
    lens = torch.randint(1, t + 1, (b,), generator=gen)
    rows = RecurrentRows(rows_slots, torch.randint(1, ring + 1, (b,), generator=gen), torch.arange(b) % 3 == 1,
                         torch.arange(t)[None, :] < lens[:, None], torch.zeros(b, dtype=torch.int64))
    x = torch.randn(b, t, layer.in_proj_qkv.in_features, generator=gen)
    return x, state, rows


def _mix(layer, x, state, rows, fused: bool):
    from nextn.plugins.gated_delta import install_gated_delta

    layer.recurrence_kernel, layer.mix_operands = False, None
    if fused:
        install_gated_delta(layer)
    with torch.no_grad():
        return layer(x, None, None, SimpleMeta(state, rows))


class SimpleMeta:
    def __init__(self, state, rows) -> None:
        self.recurrent = (state, rows)


@pytest.mark.parametrize("hk,hv,dk,dv,b,t", [(2, 2, 16, 16, 1, 1), (2, 4, 32, 24, 3, 5), (1, 2, 128, 128, 2, 4),
                                             (2, 2, 16, 16, 4, 9)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_mixer_matches_the_module(hk, hv, dk, dv, b, t, dtype):
    """The whole token mixer as one op against the module's PyTorch path (grouped value heads, pads, fresh rows,
    more tokens than ring entries): outputs, and the conv and recurrent states it keeps."""
    layer = _layer(hk, hv, dk, dv).to(dtype)
    x, state, rows = _mixer_case(layer, b, t)
    x = x.to(dtype)
    want_state = RecurrentStateCopy(state)
    want = _mix(layer, x, want_state, rows, fused=False)
    got = _mix(layer, x, state, rows, fused=True)
    assert layer.mix_operands is not None
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(state.conv, want_state.conv, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state.ssm, want_state.ssm, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(state.pending, want_state.pending, rtol=1e-4, atol=1e-4)


def RecurrentStateCopy(state):
    import copy

    other = copy.copy(state)
    other.conv, other.ssm, other.base = state.conv.clone(), state.ssm.clone(), state.base.clone()
    other.pending = state.pending.clone()
    return other


def assert_rows_and_splits_bit_identical(run, x, state, rows, copy_state):
    """run(x, state, rows) → out [B, T, ...] over a `RecurrentState`: each row alone and in the batch, and its tokens
    in one call or one a call (each committing the token before it, as decode steps do), give the same bits (batch
    invariance, and a verify step's rows equal one-token steps'). Returns the batch's state, the last row's state
    after its one-token calls, and that row's slot."""
    from nextn.models.recurrent_state import RecurrentRows

    b, t = x.shape[:2]
    rows = RecurrentRows(rows.slots, rows.committed, rows.fresh, torch.ones(b, t, dtype=torch.bool), rows.start)
    batch_state = copy_state(state)
    batch = run(x, batch_state, rows)
    for r in range(b):
        one = RecurrentRows(*(f[r:r + 1] for f in (rows.slots, rows.committed, rows.fresh, rows.valid, rows.start)))
        assert torch.equal(run(x[r:r + 1], copy_state(state), one), batch[r:r + 1])
        step_state, outs = copy_state(state), []
        for i in range(t):
            step = RecurrentRows(one.slots, one.committed if i == 0 else torch.tensor([1]), one.fresh & (i == 0),
                                 one.valid[:, :1], one.start)
            outs.append(run(x[r:r + 1, i:i + 1], step_state, step))
        assert torch.equal(torch.cat(outs, 1), batch[r:r + 1])
    return batch_state, step_state, int(rows.slots[-1])


def test_layer_mixer_rows_and_token_splits_are_bit_identical():
    layer = _layer(2, 4, 32, 32).to(torch.bfloat16)
    x, state, rows = _mixer_case(layer, 3, 6, ring=6)
    assert_rows_and_splits_bit_identical(lambda x, s, r: _mix(layer, x, s, r, fused=True), x.bfloat16(), state, rows,
                                         RecurrentStateCopy)


def test_layer_mixer_refuses_bad_arguments():
    layer = _layer(2, 2, 16, 16)
    x, state, rows = _mixer_case(layer, 2, 3)
    from nextn.models.recurrent_state import RecurrentRows

    bad = RecurrentRows(rows.slots + 100, rows.committed, rows.fresh, rows.valid, rows.start)
    with pytest.raises(RuntimeError, match="out of range"):
        _mix(layer, x, state, bad, fused=True)
    with pytest.raises(RuntimeError, match="one dtype"):
        cpu_kernels.ops().gated_deltanet_mix(x @ layer.in_proj_qkv.weight.T, (x @ layer.in_proj_z.weight.T).double(),
                                             x[..., :2], x[..., :2], *layer.mix_operands, state.conv[1], state.ssm[1],
                                             state.pending[1], rows.slots, rows.committed, rows.fresh, rows.valid, 2,
                                             1e-6)
