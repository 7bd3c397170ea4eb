"""GLM-4.7-Flash (`glm4_moe_lite`, issue 62): DeepSeek-V3's layer under GLM's config, built as nextn's DeepSeek-V3
family — a tiny random checkpoint made by `transformers` at test time, and llama.cpp's `deepseek2` GGUF of it (MLA's
`kv_b_proj` stored in two halves, the MTP layer appended as the last block), decodes token-identical to
`transformers.generate` in float32, plainly, with NGram drafts and with its MTP layer, which drafts as `transformers`'
own MTP model; a dense layer after a sparse one, and DeepSeek-V2's softmax routing, are refused."""

from __future__ import annotations

import json

import pytest
import torch

from nextn.build.checkpoint import CheckpointError
from nextn.models.config import ConfigError, DeepseekV3ModelConfig
from nextn.plugins import cpu_kernels
from nextn.testing.tiny_families import add_mtp_layer, save_tiny

from family_sources import tiny_source

PROMPT = [1] + [100 + (7 * i) % 23 for i in range(45)]


@pytest.fixture(scope="module")
def glm_lite(tmp_path_factory, tokenizer_dir):
    """(checkpoint dir, transformers model fp32, transformers' MTP model) of a 3-layer GLM-4.7-Flash (the first
    layer dense) with one MTP layer, stored as the released checkpoint stores it (`model.layers.{N}`)."""
    from transformers import AutoModelForCausalLM, logging
    from transformers.modeling_layers import MtpModel

    out = tmp_path_factory.mktemp("glm4_moe_lite")
    save_tiny("glm4_moe_lite", out, tokenizer_dir)
    add_mtp_layer(out)
    config = json.loads((out / "config.json").read_text())  # what transformers' MtpModel reads for this family
    (out / "config.json").write_text(json.dumps({**config, "num_mtp_layers": 1, "mtp_mlp_layer_types": ["sparse"]}))
    logging.set_verbosity_error()
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    hf._keys_to_ignore_on_load_unexpected = [r"model\.layers\.3\..*"]  # (the released file's MTP layer is 47)
    return out, hf, MtpModel.from_pretrained(hf).eval()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["hf", "gguf"])
def test_engine_greedy_is_transformers(glm_lite, kind, tmp_path):
    """build-engine (float32) → LLM: plain, NGram and MTP (one module chained K = 2 times) decoding equal
    `transformers.generate`; the GGUF's engine holds the MTP module and drafts with it."""
    from nextn import LLM, SamplingParams
    from nextn.build.engine_builder import build_engine

    out, hf, _ = glm_lite
    with torch.no_grad():
        want = hf.generate(torch.tensor([PROMPT]), max_new_tokens=24, do_sample=False, pad_token_id=0,
                           eos_token_id=None)[0, len(PROMPT):].tolist()
    manifest = build_engine(tiny_source(out, kind), tmp_path / "engine", dtype="float32", quant_algo=None,
                            max_seq_len=256, progress=False)
    assert manifest.architecture == "DeepseekV3ForCausalLM"
    assert manifest.speculative.method == "mtp" and manifest.speculative.num_mtp_modules == 1
    assert manifest.model.first_k_dense_replace == 1 and manifest.model.norm_topk_prob
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    specs = [None, {"decoding_type": "NGram", "max_draft_len": 4} if kind == "hf" else
             {"decoding_type": "MTP", "num_nextn_predict_layers": 2}]
    for spec in specs:
        llm = LLM(tmp_path / "engine", device="cpu", speculative_config=spec)
        # MLA on nextn's CPU op: each row computed alone, as every other layer (else the engine says it is not)
        assert llm.engine.batch_invariant == cpu_kernels.available()
        result = llm.generate(PROMPT, params).outputs[0]
        llm.shutdown()
        assert result.token_ids == want, spec
        assert spec is None or result.num_draft_tokens > 0


@pytest.mark.slow
@pytest.mark.parametrize("quant_algo", ["W8A16", "W4A8"])
def test_weight_only_mtp_decoding_is_plain_decoding(glm_lite, quant_algo, tmp_path):
    """A weight-only engine keeps MLA's `kv_b_proj` as a float weight (MLA folds it into the query; quantized, every
    request failed), quantizes every routed expert like any linear (the MoE layer's experts; int4 ones run as one op
    where nextn's kernels load), and its MTP output equals its plain output, at batch 2."""
    from nextn import LLM, SamplingParams
    from nextn.build.engine_builder import build_engine
    from nextn.models.moe import SparseMoE
    from nextn.quantization.linear import WeightOnlyLinear

    out, _, _ = glm_lite
    # q_b_proj's 48 inputs (q_lora_rank) fit no int4 group size: kept in bf16
    keep = [f"model.layers.{i}.self_attn.q_b_proj" for i in range(4)] if quant_algo == "W4A8" else None
    build_engine(out, tmp_path / "engine", dtype="bfloat16", quant_algo=quant_algo, max_seq_len=256, progress=False,
                 exclude_modules=keep)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    got = []
    for spec in (None, {"decoding_type": "MTP", "num_nextn_predict_layers": 2}):
        llm = LLM(tmp_path / "engine", device="cpu", speculative_config=spec)
        moes = [m for m in llm.engine.model.modules() if isinstance(m, SparseMoE)]
        assert len(moes) == 3  # two sparse layers and the MTP layer's
        # every expert's three projections quantized (8 experts a layer)
        assert sum(isinstance(lin, WeightOnlyLinear) for m in moes for lin in m.experts.modules()) == 3 * 8 * 3
        if quant_algo == "W4A8":
            assert all((m.fused_experts is not None) == cpu_kernels.available() for m in moes)
        got.append([o.outputs[0] for o in llm.generate([PROMPT, PROMPT[:9]], params)])
        llm.shutdown()
    assert all(o.finish_reason == "length" and len(o.token_ids) == 24 for o in got[0] + got[1])
    assert [o.token_ids for o in got[1]] == [o.token_ids for o in got[0]]
    assert got[1][0].num_draft_tokens > 0


def test_mlp_layer_types_become_dense_layers_or_are_refused():
    base = dict(architectures=["Glm4MoeLiteForCausalLM"], vocab_size=64, hidden_size=64, intermediate_size=96,
                num_hidden_layers=4, num_attention_heads=4, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=16,
                v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
    cfg = DeepseekV3ModelConfig.from_hf({**base, "mlp_layer_types": ["dense", "dense", "sparse", "sparse"]})
    assert cfg.first_k_dense_replace == 2 and [cfg.is_moe_layer(i) for i in range(4)] == [False, False, True, True]
    assert DeepseekV3ModelConfig.from_hf(base).first_k_dense_replace == 1  # HF's default: the first layer dense
    with pytest.raises(ConfigError, match="dense layer after a sparse one"):
        DeepseekV3ModelConfig.from_hf({**base, "mlp_layer_types": ["dense", "sparse", "dense", "sparse"]})


@pytest.mark.parametrize("kind", ["hf", "gguf"])
def test_mtp_logits_match_transformers(glm_lite, kind, tmp_path):
    """Its MTP layer (`model.layers.{N}`, DeepSeek-V3's module; the GGUF's `blk.{N}.nextn.*` beside the block's own
    tensors) through nextn's DeepSeek-V3 MTP path: the draft logits at every position equal `transformers`' own MTP
    model's (`MtpModel.from_pretrained`)."""
    from transformers.cache_utils import MtpCache

    from nextn import LLM
    from nextn.build.engine_builder import build_engine
    from nextn.testing.mtp_check import mtp_pass

    out, hf, mtp = glm_lite
    build_engine(tiny_source(out, kind), tmp_path / "engine", dtype="float32", quant_algo=None, max_seq_len=256,
                 progress=False)
    llm = LLM(tmp_path / "engine", device="cpu", speculative_config=None)
    model = llm.engine.model
    ids = torch.tensor([PROMPT[:20]])
    run = mtp_pass(model, ids)
    got = run.mtp_logits
    with torch.inference_mode():
        main = model.logits(run.hidden[:, 1:])  # the control: the main head one position on is another distribution
    llm.shutdown()
    with torch.no_grad():
        h = hf(ids, output_hidden_states=True).hidden_states[-1]
        y = mtp.forward_layer(0, h[:, :-1], torch.arange(1, 20)[None], MtpCache(config=hf.config.get_mtp_config()),
                              input_ids=ids[:, 1:])
        want = mtp._project_to_logits(y).float()
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(main, want, atol=1e-2)


def _deepseek2_keys(**over):
    """A `key(name, kind, default)` over a deepseek2 file's metadata as llama.cpp's converter writes GLM-4.7-Flash's."""
    meta = {"nextn_predict_layers": 1, "expert_count": 8, "expert_used_count": 2, "attention.key_length_mla": 32,
            "attention.value_length_mla": 16, "rope.dimension_count": 16, "attention.kv_lora_rank": 32,
            "attention.q_lora_rank": 48, "expert_feed_forward_length": 64, **over}
    return lambda name, kind, default: meta.get(name, default)


def test_deepseek2_routing_and_dense_layers_from_the_file():
    """The dense layers are the leading blocks without a router; softmax routing (DeepSeek-V2's) is refused, and so
    is a router without the correction bias that sigmoid routing needs."""
    from nextn.build import gguf_deepseek2

    stored = {"model.layers.2.mlp.gate.weight", "model.layers.2.mlp.gate.e_score_correction_bias"}
    cfg = gguf_deepseek2.config(_deepseek2_keys(), 5, 4, stored.__contains__)
    assert (cfg["num_hidden_layers"], cfg["num_nextn_predict_layers"], cfg["first_k_dense_replace"]) == (4, 1, 2)
    assert (cfg["qk_nope_head_dim"], cfg["v_head_dim"], cfg["q_lora_rank"], cfg["norm_topk_prob"]) == (16, 16, 48, False)
    assert gguf_deepseek2.config(_deepseek2_keys(expert_gating_func=2), 5, 4, stored.__contains__) == cfg
    with pytest.raises(CheckpointError, match="softmax routing"):
        gguf_deepseek2.config(_deepseek2_keys(expert_gating_func=1), 5, 4, stored.__contains__)
    with pytest.raises(CheckpointError, match="softmax routing"):
        gguf_deepseek2.config(_deepseek2_keys(), 5, 4, {"model.layers.2.mlp.gate.weight"}.__contains__)


def test_deepseek2_yarn_gives_deepseek_v3s_softmax_scale():
    """DeepSeek-V3's GGUF metadata (YaRN factor 40 over 4096 positions, `yarn_log_multiplier` 0.1 = 0.1 ·
    mscale_all_dim) read back to its HF rope scaling: the config's softmax scale is V3's 0.135234 (192-dim q/k heads,
    mscale(40, 1)²); another scaling type is refused by name."""
    from nextn.build import gguf_deepseek2

    stored = {"model.layers.3.mlp.gate.weight", "model.layers.3.mlp.gate.e_score_correction_bias"}
    keys = _deepseek2_keys(**{"nextn_predict_layers": 0, "attention.key_length_mla": 192,
                              "attention.value_length_mla": 128, "rope.dimension_count": 64,
                              "attention.kv_lora_rank": 512, "attention.q_lora_rank": 1536,
                              "rope.scaling.type": "yarn", "rope.scaling.factor": 40.0,
                              "rope.scaling.original_context_length": 4096,
                              "rope.scaling.yarn_log_multiplier": 0.1})
    fields = gguf_deepseek2.config(keys, 5, 128, stored.__contains__)
    assert fields["first_k_dense_replace"] == 3 and fields["qk_nope_head_dim"] == 128
    cfg = DeepseekV3ModelConfig.from_hf({**fields, "vocab_size": 1000, "hidden_size": 7168, "intermediate_size": 18432,
                                         "rope_theta": 10000.0})
    assert (cfg.rope.rope_type, cfg.rope.factor, cfg.rope.original_max_position_embeddings) == ("yarn", 40.0, 4096)
    assert cfg.softmax_scale == pytest.approx(0.135234, abs=1e-6)
    with pytest.raises(CheckpointError, match="rope.scaling.type 'linear'"):
        gguf_deepseek2.config(_deepseek2_keys(**{"rope.scaling.type": "linear"}), 5, 4,
                              {"model.layers.2.mlp.gate.weight",
                               "model.layers.2.mlp.gate.e_score_correction_bias"}.__contains__)
