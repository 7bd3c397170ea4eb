"""GLM-4.7-Flash (`glm4_moe_lite`, issue 62): DeepSeek-V3's layer under GLM's config, built as nextn's DeepSeek-V3
family — a tiny random checkpoint made by `transformers` at test time decodes token-identical to
`transformers.generate` in float32, plainly and with NGram drafts, and its MTP layer drafts as `transformers`' own MTP
model; a dense layer after a sparse one is refused."""

from __future__ import annotations

import pytest
import torch

from nextn.models.config import ConfigError, DeepseekV3ModelConfig
from nextn.testing.tiny_families import save_tiny

PROMPT = [1] + [100 + (7 * i) % 23 for i in range(45)]


@pytest.mark.slow
def test_engine_greedy_is_transformers(tokenizer_dir, tmp_path):
    from nextn import LLM, SamplingParams
    from nextn.build.engine_builder import build_engine

    hf = save_tiny("glm4_moe_lite", tmp_path / "hf", tokenizer_dir)
    with torch.no_grad():
        want = hf.generate(torch.tensor([PROMPT]), max_new_tokens=24, do_sample=False, pad_token_id=0,
                           eos_token_id=None)[0, len(PROMPT):].tolist()
    manifest = build_engine(tmp_path / "hf", tmp_path / "engine", dtype="float32", quant_algo=None, max_seq_len=256,
                            progress=False)
    assert manifest.architecture == "DeepseekV3ForCausalLM"
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    for spec in (None, {"decoding_type": "NGram", "max_draft_len": 4}):
        llm = LLM(tmp_path / "engine", device="cpu", speculative_config=spec)
        got = llm.generate(PROMPT, params).outputs[0].token_ids
        llm.shutdown()
        assert got == want, spec


def test_mlp_layer_types_become_dense_layers_or_are_refused():
    base = dict(architectures=["Glm4MoeLiteForCausalLM"], vocab_size=64, hidden_size=64, intermediate_size=96,
                num_hidden_layers=4, num_attention_heads=4, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=16,
                v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
    cfg = DeepseekV3ModelConfig.from_hf({**base, "mlp_layer_types": ["dense", "dense", "sparse", "sparse"]})
    assert cfg.first_k_dense_replace == 2 and [cfg.is_moe_layer(i) for i in range(4)] == [False, False, True, True]
    assert DeepseekV3ModelConfig.from_hf(base).first_k_dense_replace == 1  # HF's default: the first layer dense
    with pytest.raises(ConfigError, match="dense layer after a sparse one"):
        DeepseekV3ModelConfig.from_hf({**base, "mlp_layer_types": ["dense", "sparse", "dense", "sparse"]})


def test_mtp_logits_match_transformers(tokenizer_dir, tmp_path):
    """Its MTP layer (`model.layers.{N}`, DeepSeek-V3's module) through nextn's DeepSeek-V3 MTP path: the draft
    logits at every position equal `transformers`' own MTP model's (`MtpModel.from_pretrained`)."""
    import json

    from transformers import AutoModelForCausalLM, logging
    from transformers.cache_utils import MtpCache
    from transformers.modeling_layers import MtpModel

    from nextn import LLM
    from nextn.build.engine_builder import build_engine
    from nextn.testing.mtp_check import mtp_pass
    from nextn.testing.tiny_families import add_mtp_layer

    out = tmp_path / "hf"
    save_tiny("glm4_moe_lite", out, tokenizer_dir)
    add_mtp_layer(out)
    config = json.loads((out / "config.json").read_text())  # what transformers' MtpModel reads for this family
    (out / "config.json").write_text(json.dumps({**config, "num_mtp_layers": 1, "mtp_mlp_layer_types": ["sparse"]}))
    logging.set_verbosity_error()
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    hf._keys_to_ignore_on_load_unexpected = [r"model\.layers\.3\..*"]  # (the released file's MTP layer is 47)
    mtp = MtpModel.from_pretrained(hf).eval()
    build_engine(out, tmp_path / "engine", dtype="float32", quant_algo=None, max_seq_len=256, progress=False)
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
