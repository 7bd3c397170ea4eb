"""MTP modules on a Llama base (issue 4): a Llama HF checkpoint with `model.layers.{L + i}` MTP weights and
`num_nextn_predict_layers` builds into an engine whose MTP module matches the training-side module, and greedy
decoding with MTP drafts (Eagle and Vanilla) is token-identical to plain decoding."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaForCausalLM as HFLlama

from nextn import LLM, SamplingParams
from nextn.build.engine_builder import build_engine
from nextn.models.llama import LlamaForCausalLM, LlamaModelConfig, runtime_weight_specs, to_runtime
from nextn.testing.mtp_check import mtp_pass
from nextn.testing.tiny_llama import tiny_hf_llama
from nextn.train.mtp import MtpContext, mtp_module


def _hf_llama(num_mtp: int) -> tuple[HFLlama, list]:
    hf = tiny_hf_llama()
    cfg = hf.config
    modules = [mtp_module(cfg) for _ in range(num_mtp)]
    for m in modules:
        with torch.no_grad():
            for p in m.parameters():
                p.add_(0.02 * torch.randn_like(p))  # norms away from 1
    return hf, modules


def _write_checkpoint(out, num_mtp: int):
    """A 2-layer HF Llama with `num_mtp` MTP modules at model.layers.2.. (written as the trainer writes them)."""
    hf, modules = _hf_llama(num_mtp)
    hf.save_pretrained(out)
    state = load_file(str(out / "model.safetensors"))
    for k, m in enumerate(modules):
        state.update({f"model.layers.{2 + k}.{n}": t for n, t in m.checkpoint_tensors().items()})
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["num_nextn_predict_layers"] = num_mtp
    (out / "config.json").write_text(json.dumps(config))
    return out, hf, modules


@pytest.fixture(scope="module")
def mtp_checkpoint(tmp_path_factory):
    return _write_checkpoint(tmp_path_factory.mktemp("llama_mtp") / "ckpt", 3)


def test_config_reads_num_nextn_predict_layers_and_specs_hold_mtp_layers():
    base = {"architectures": ["LlamaForCausalLM"], "vocab_size": 32, "hidden_size": 16, "intermediate_size": 24,
            "num_hidden_layers": 2, "num_attention_heads": 2}
    assert LlamaModelConfig.from_hf(base).num_nextn_predict_layers == 0
    cfg = LlamaModelConfig.from_hf({**base, "num_nextn_predict_layers": 2})
    specs = runtime_weight_specs(cfg)
    assert specs["model.layers.3.eh_proj.weight"] == (16, 32)
    assert specs["model.layers.2.shared_head.norm.weight"] == (16,)
    assert "model.layers.4.enorm.weight" not in specs and "model.layers.3.embed_tokens.weight" not in specs
    assert LlamaForCausalLM(cfg).num_cache_layers == 4


def test_engine_mtp_module_matches_the_training_module(mtp_checkpoint):
    """forward_mtp over the paged cache = the trainer's module over the whole sequence (shapes and values)."""
    ckpt, hf, modules = mtp_checkpoint
    cfg = LlamaModelConfig.from_hf(json.loads((ckpt / "config.json").read_text()))
    state = load_file(str(ckpt / "model.safetensors"))
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, max_positions=1)
    model.load_state_dict(dict(to_runtime(state.__getitem__, state.__contains__, cfg, torch.float32)), strict=True,
                          assign=True)
    model.rope_table = model.rope_table_for(64)
    model.eval().requires_grad_(False)
    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(1))
    hidden, h1, logits = mtp_pass(model, ids)  # [2, 12, 64], [2, 11, 64], [2, 11, 300]
    assert h1.shape == (2, 11, 64) and logits.shape == (2, 11, 300)
    ctx = MtpContext(hf.model.embed_tokens.weight, hf.lm_head.weight, hf.model.rotary_emb)
    with torch.no_grad():
        ref = hf.model(ids).last_hidden_state
        x, *_ = ctx.vanilla(torch.nn.ModuleList(modules[:1]), ids, ref, torch.ones(2, dtype=torch.int64),
                            torch.full((2,), 12))[0]
    torch.testing.assert_close(hidden, ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[:, :10], (x @ hf.lm_head.weight.T)[:, :10], atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize(("num_mtp", "spec"), [(3, {"num_nextn_predict_layers": 3, "use_mtp_vanilla": True}),
                                               (1, {"num_nextn_predict_layers": 3})])
def test_mtp_decoding_is_token_identical_to_plain_decoding(tmp_path, num_mtp, spec):
    """Vanilla (3 modules) and Eagle (1 module, K = 3) drafts; random modules, so acceptance is not asserted."""
    ckpt, _, _ = _write_checkpoint(tmp_path / "ckpt", num_mtp)
    manifest = build_engine(ckpt, tmp_path / "engine", progress=False, max_seq_len=128)
    assert manifest.speculative.method == "mtp" and manifest.speculative.num_mtp_modules == num_mtp
    prompts = [[5, 6, 7, 8], [9], list(range(20, 60))]
    sp = SamplingParams(max_tokens=40, ignore_eos=True)
    plain = LLM(tmp_path / "engine", speculative_config=None).generate(prompts, sp)
    mtp = LLM(tmp_path / "engine", speculative_config={"decoding_type": "MTP", **spec}).generate(prompts, sp)
    assert [o.outputs[0].token_ids for o in mtp] == [o.outputs[0].token_ids for o in plain]
    assert all(o.outputs[0].num_draft_tokens > 0 for o in mtp)
