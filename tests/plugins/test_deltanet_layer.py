"""nextn's fused Gated DeltaNet decoder layer (`gated_deltanet_layer`, Qwen3.5's linear-attention layers) on every
ISA variant this CPU runs: against the layer's modules on W4A16 and W4A8 engines of a tiny Qwen3.5 (the output, and
the conv and recurrent states it keeps), bit-identical whatever the batch and however the tokens are split into
calls, and the engine that runs it staying lossless with drafters, in batches and under preemption."""

from __future__ import annotations

import copy

import pytest
import torch

from nextn import LLM, SamplingParams
from nextn.build.engine_builder import build_engine
from nextn.models.recurrent_state import RecurrentRows
from nextn.plugins import cpu_kernels
from nextn.testing.spec_checks import greedy_outputs, staggered_outputs
from nextn.testing.tiny_families import tiny_hf_model

from test_gated_delta import assert_rows_and_splits_bit_identical

pytestmark = [pytest.mark.skipif(not cpu_kernels.available(),
                                 reason=f"nextn's CPU kernels unavailable: {cpu_kernels.unavailable_reason()}"),
              pytest.mark.usefixtures("kernel_variant")]

PROMPTS = [[1] + [100 + (7 * i) % 23 for i in range(30)], [1, 5, 9, 300, 70, 12], [1] + list(range(200, 230))]


@pytest.fixture(scope="module", params=["W4A16", "W4A8"])
def engine(request, tmp_path_factory):
    """A tiny Qwen3.5 whose DeltaNet layers take the op: hidden 128, MLP 128, 2 key heads and 4 value heads of 32
    (value width 128, conv channels 256), group size 32; 3 DeltaNet layers and 1 gated attention layer."""
    return tiny_engine(tmp_path_factory.mktemp(request.param), "qwen3_5_text", request.param, intermediate_size=128)


def tiny_engine(root, family: str, fmt: str, **overrides):
    """A tiny hybrid checkpoint of `family` (hidden 128, 2 key / 4 value heads of 32; 3 DeltaNet layers and 1 gated
    attention layer; `overrides` for the MLP) built under `root` as a `fmt` engine, group size 32: its path."""
    tiny_hf_model(family, seed=1, vocab_size=320, hidden_size=128, num_hidden_layers=4, head_dim=32,
                  linear_key_head_dim=32, linear_value_head_dim=32, **overrides).save_pretrained(root / "ckpt")
    build_engine(root / "ckpt", root / "engine", progress=False, max_seq_len=128, dtype="bfloat16", quant_algo=fmt,
                 group_size=32)
    return root / "engine"


@pytest.fixture(scope="module")
def llm(engine):
    llm = LLM(engine, device="cpu")
    yield llm
    llm.shutdown()


def _layers(llm) -> list:
    return [m for m in llm.engine.model.modules() if hasattr(m, "fused_deltanet")]


def _state_copy(state):
    other = copy.copy(state)
    other.conv, other.ssm, other.base = state.conv.clone(), state.ssm.clone(), state.base.clone()
    other.pending = state.pending.clone()
    return other


class _Meta:
    def __init__(self, state, rows) -> None:
        self.recurrent = (state, rows)


def _case(llm, b: int, t: int, seed: int = 0):
    """x [b, t, hidden] bf16, a state whose rings hold random values, rows with pads, fresh rows and ring entries."""
    gen = torch.Generator().manual_seed(seed)
    state = _state_copy(llm.engine.model.recurrent_state)
    state.conv.copy_(0.5 * torch.randn(state.conv.shape, generator=gen))
    state.ssm.copy_(0.1 * torch.randn(state.ssm.shape, generator=gen))
    state.pending.copy_(0.1 * torch.randn(state.pending.shape, generator=gen))
    state.pending[..., -1] = 0.9
    slots = torch.randperm(state.conv.shape[1], generator=gen)[:b]
    lens = torch.randint(1, t + 1, (b,), generator=gen)
    rows = RecurrentRows(slots, torch.randint(1, state.ring + 1, (b,), generator=gen), torch.arange(b) % 3 == 1,
                         torch.arange(t)[None, :] < lens[:, None], torch.zeros(b, dtype=torch.int64))
    return torch.randn(b, t, 128, generator=gen).bfloat16(), state, rows


def _run(layer, x, state, rows, fused: bool) -> torch.Tensor:
    kept = layer.fused_deltanet
    layer.fused_deltanet = kept if fused else None
    try:
        with torch.no_grad():
            return layer(x, None, None, _Meta(state, rows))
    finally:
        layer.fused_deltanet = kept


def test_every_deltanet_layer_takes_the_op(llm):
    layers = _layers(llm)
    assert len(layers) == 3 and all(layer.fused_deltanet is not None for layer in layers)


@pytest.mark.parametrize("b,t", [(1, 1), (3, 4), (2, 9)])
def test_op_matches_the_modules(llm, b, t):
    """The op against the same layer's modules (pads, fresh rows, more tokens than ring entries): the output within
    bf16 rounding, the kept conv and recurrent states within float32 rounding of values computed from it."""
    for i, layer in enumerate(_layers(llm)):
        x, state, rows = _case(llm, b, t, seed=i)
        want_state = _state_copy(state)
        want = _run(layer, x, want_state, rows, fused=False)
        got = _run(layer, x, state, rows, fused=True)
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=3e-2)
        torch.testing.assert_close(state.conv, want_state.conv, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(state.ssm, want_state.ssm, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(state.pending, want_state.pending, rtol=2e-2, atol=2e-2)
        assert (got - x).abs().max() > 0.1  # the layer did something: a control against an identity


def test_rows_and_token_splits_are_bit_identical(llm):
    """A row alone and in the batch, and its tokens in one call or one a call (a verify step's rows and one-token
    steps), give the same bits: the output and the states."""
    layer = _layers(llm)[0]
    x, state, rows = _case(llm, 3, 4)
    batch_state, step_state, slot = assert_rows_and_splits_bit_identical(
        lambda x, s, r: _run(layer, x, s, r, fused=True), x, state, rows, _state_copy)
    assert state.ring == 1  # no drafter: the last token pending on both sides, the state before it kept
    for name in ("conv", "ssm", "pending"):
        assert torch.equal(getattr(step_state, name)[:, slot], getattr(batch_state, name)[:, slot])


@pytest.mark.parametrize("spec", [{"decoding_type": "NGram", "max_draft_len": 4},
                                  {"decoding_type": "Suffix", "max_draft_len": 8}], ids=["ngram", "suffix"])
def test_engine_with_the_op_stays_lossless(engine, llm, spec):
    """Drafted greedy output equals plain decoding through the op, in a batch, staggered with chunked prefill and
    preemption."""
    assert_drafted_equals_plain(engine, llm, spec, lambda layer: layer.fused_deltanet is not None)


def assert_drafted_equals_plain(engine, llm, spec: dict, takes_ops) -> None:
    """`engine` drafting with `spec` (every DeltaNet layer `takes_ops`) gives `llm`'s plain greedy output on
    `PROMPTS`: in a batch, and staggered with chunked prefill and preemption (a small KV cache)."""
    params = [SamplingParams(max_tokens=32, ignore_eos=True)] * len(PROMPTS)
    want = greedy_outputs(llm, PROMPTS, params)
    drafted = LLM(engine, device="cpu", speculative_config=spec)
    assert all(takes_ops(layer) for layer in _layers(drafted))
    assert greedy_outputs(drafted, PROMPTS, params) == want
    drafted.shutdown()
    small = LLM(engine, device="cpu", speculative_config=spec, enable_chunked_prefill=True, max_num_tokens=16,
                kv_cache_config={"max_tokens": 96, "tokens_per_block": 8})
    assert staggered_outputs(small, PROMPTS, params) == want
    assert small.engine.scheduler.num_preemptions > 0
    small.shutdown()


def test_op_refuses_bad_arguments(llm):
    from nextn.plugins.gated_delta import layer_forward

    layer = _layers(llm)[0]
    x, state, rows = _case(llm, 2, 3)
    bad = RecurrentRows(rows.slots + 100, rows.committed, rows.fresh, rows.valid, rows.start)
    with pytest.raises(RuntimeError, match="gated_deltanet_layer: a slot or committed count is out of range"):
        layer_forward(layer, x, _Meta(state, bad))
    with pytest.raises(RuntimeError, match="gated_deltanet_layer: x must be"):
        layer_forward(layer, x.float(), _Meta(state, rows))


def test_gated_attention_layer_takes_the_fused_op(llm):
    """Qwen3.5's gated attention layer (q/k norms, a quarter of each head rotated, the output gate) runs as the fused
    layer op, gate_proj's rows after v in its one matmul, and matches its modules: the output and the KV it writes."""
    from test_decoder_layer import _both, _inputs

    model = llm.engine.model
    (layer,) = [m for m in model.model.layers if getattr(m, "fused", None) is not None]
    assert layer.fused.output_gate and layer.fused.qkv[0].shape[0] == (
        2 * layer.self_attn.num_heads + 2 * layer.self_attn.num_kv_heads) * layer.self_attn.head_dim
    fused, ref, kv_fused, kv_ref = _both(llm, list(model.model.layers).index(layer), 3, 4, [9, 30, 4])
    torch.testing.assert_close(fused.float(), ref.float(), rtol=2e-2, atol=3e-2)
    torch.testing.assert_close(kv_fused.float(), kv_ref.float(), rtol=2e-2, atol=2e-2)
    x, kv, meta = _inputs(layer, 3, 4, [9, 30, 4])
    cos_sin, saved = model._cos_sin(meta.positions), layer.fused
    attn = layer.self_attn  # a control: the modules without the gate give another output
    attn.output_gate, layer.fused = False, None
    try:
        ungated = layer(x, cos_sin, kv.clone(), meta)
    finally:
        attn.output_gate, layer.fused = True, saved
    assert (ungated.float() - ref.float()).abs().max() > 0.1
