"""Qwen3-Next's and Qwen3.5-MoE's layers (a Gated DeltaNet or gated attention token mixer, then an MoE MLP with a
sigmoid-gated shared expert) on nextn's CPU ops, every ISA variant the CPU runs: the mixer half as the layer op's
attention-only form (`gated_deltanet_layer` with no MLP operands; `llama_decoder_layer`'s for the attention layers),
the MLP half as `moe_block` — against the modules, rows and token splits bit-identical, and engines of both families
staying lossless with drafters, in batches and under preemption."""

from __future__ import annotations

import pytest
import torch

from nextn import LLM, SamplingParams
from nextn.plugins import cpu_kernels
from nextn.plugins.gated_delta import layer_forward
from nextn.testing.spec_checks import greedy_outputs

from test_deltanet_layer import (PROMPTS, _case, _layers, _Meta, _run, _state_copy, assert_drafted_equals_plain,
                                 llm, tiny_engine)  # noqa: F401 (llm: the fixture, over this module's engine)
from test_gated_delta import assert_rows_and_splits_bit_identical

pytestmark = [pytest.mark.skipif(not cpu_kernels.available(),
                                 reason=f"nextn's CPU kernels unavailable: {cpu_kernels.unavailable_reason()}"),
              pytest.mark.usefixtures("kernel_variant")]

#: (family, format): hidden 128, 2 key / 4 value heads of 32, 8 experts of width 64 (top-2), a shared expert of 64
CASES = {"qwen3_next-W4A16": ("qwen3_next", "W4A16"), "qwen3_5_moe-W4A8": ("qwen3_5_moe_text", "W4A8")}


@pytest.fixture(scope="module", params=list(CASES))
def engine(request, tmp_path_factory):
    family, fmt = CASES[request.param]
    return tiny_engine(tmp_path_factory.mktemp(request.param), family, fmt, moe_intermediate_size=64,
                       shared_expert_intermediate_size=64)


def test_every_layer_takes_the_ops(llm):
    """3 DeltaNet layers: the op's attention-only form and `moe_block` with the shared expert fused; the gated
    attention layer: the attention-only layer op and `moe_block`."""
    layers = _layers(llm)
    assert len(layers) == 3
    for layer in layers:
        assert layer.fused_deltanet is not None and layer.fused_deltanet.attention_only and layer.moe_block
        assert layer.mlp.fused_experts.shared_gate_up and layer.mlp.shared_expert_gate is not None
    (attention,) = [m for m in llm.engine.model.model.layers if getattr(m, "fused", None) is not None]
    assert attention.fused.output_gate and attention.fused.attention_only and attention.moe_block


@pytest.mark.parametrize("b,t", [(1, 1), (3, 4), (2, 9)])
def test_mixer_half_matches_the_modules(llm, b, t):
    """The attention-only op = x + mixer(norm(x)) by the modules (pads, fresh rows, more tokens than ring entries):
    the output within bf16 rounding, the kept states within float32 rounding of values computed from it."""
    for i, layer in enumerate(_layers(llm)):
        x, state, rows = _case(llm, b, t, seed=i)
        want_state = _state_copy(state)
        with torch.no_grad():
            got = layer_forward(layer, x, _Meta(state, rows))
            want = x + layer.linear_attn(layer.input_layernorm(x), None, None, _Meta(want_state, rows))
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=3e-2)
        for name in ("conv", "ssm", "pending"):
            torch.testing.assert_close(getattr(state, name), getattr(want_state, name), rtol=2e-2, atol=2e-2)
        assert (got - x).abs().max() > 0.1  # the mixer did something: a control against an identity


def _modules(layer, x, state, rows) -> torch.Tensor:
    """The layer by its modules: the mixer's, then the MoE's (router, experts one by one, the gated shared expert)."""
    fused = layer.mlp.fused_experts
    layer.mlp.fused_experts = None
    try:
        return _run(layer, x, state, rows, fused=False)
    finally:
        layer.mlp.fused_experts = fused


def test_layer_matches_the_modules(llm):
    """The whole layer (the op's mixer half, then `moe_block`) against its modules: within bf16 rounding, most
    elements bit-equal; a control without the MLP half is far off."""
    for i, layer in enumerate(_layers(llm)):
        x, state, rows = _case(llm, 3, 4, seed=10 + i)
        mixed_state = _state_copy(state)
        want = _modules(layer, x, _state_copy(state), rows)
        got = _run(layer, x, state, rows, fused=True)
        torch.testing.assert_close(got.float(), want.float(), rtol=3e-2, atol=5e-2)
        valid = rows.valid[..., None].expand_as(got)
        assert (got == want)[valid].float().mean() > 0.5
        with torch.no_grad():
            mixer_only = layer_forward(layer, x, _Meta(mixed_state, rows))
        assert (mixer_only.float() - want.float())[valid].abs().max() > 0.1


def test_rows_and_token_splits_are_bit_identical(llm):
    """A row alone and in the batch, its tokens in one call or one a call: the same bits through both ops."""
    layer = _layers(llm)[1]
    x, state, rows = _case(llm, 3, 4, seed=3)
    assert_rows_and_splits_bit_identical(lambda x, s, r: _run(layer, x, s, r, fused=True), x, state, rows,
                                         _state_copy)


@pytest.mark.parametrize("spec", [{"decoding_type": "NGram", "max_draft_len": 4},
                                  {"decoding_type": "Suffix", "max_draft_len": 8}], ids=["ngram", "suffix"])
def test_engine_with_the_ops_stays_lossless(engine, llm, spec):
    """Drafted greedy output equals plain decoding through the ops, in a batch, staggered with chunked prefill and
    preemption."""
    assert_drafted_equals_plain(engine, llm, spec, lambda layer: layer.moe_block)


def test_gated_attention_before_an_moe_takes_the_attention_only_op(llm):
    """The gated attention layer, whose MLP is an MoE, runs the op's attention half with the gate (x + attention(
    norm(x)), the gate applied), matching the modules: the output and the KV it writes."""
    from nextn.plugins.decoder_layer import fused_forward
    from test_decoder_layer import _inputs

    model = llm.engine.model
    (layer,) = [m for m in model.model.layers if getattr(m, "fused", None) is not None]
    x, kv, meta = _inputs(layer, 2, 3, [8, 21])
    cos_sin = model._cos_sin(meta.positions)
    kv_fused, kv_ref = kv.clone(), kv.clone()
    fused = fused_forward(layer, x, cos_sin, kv_fused, meta)
    with torch.no_grad():
        ref = x + layer.self_attn(layer.input_layernorm(x), cos_sin, kv_ref, meta)
    torch.testing.assert_close(fused.float(), ref.float(), rtol=2e-2, atol=3e-2)
    torch.testing.assert_close(kv_fused.float(), kv_ref.float(), rtol=2e-2, atol=2e-2)


def test_adaptive_suffix_on_a_hybrid_target_verifies_one_length_a_step(engine, llm):
    """Adaptive Suffix decoding on a hybrid target (its step profile measured at load): no ragged steps — their
    rows, one verified token each (`chain_step.verify_ragged`), cannot carry recurrent state — and the output equals
    plain decoding, in a batch, the second pass drafting from the first's responses."""
    params = [SamplingParams(max_tokens=24, ignore_eos=True)] * len(PROMPTS)
    want = greedy_outputs(llm, PROMPTS, params)
    spec = {"decoding_type": "Suffix", "max_draft_len": 4, "adaptive_draft_len": True, "step_profile": "auto"}
    drafted = LLM(engine, device="cpu", speculative_config=spec)
    assert drafted.engine.scheduler.draft_schedule.proposal_lens is None
    for _ in range(2):
        assert greedy_outputs(drafted, PROMPTS, params) == want
    drafted.shutdown()
