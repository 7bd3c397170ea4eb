"""W8A16 / W4A16 engines: built from a real `transformers` Llama checkpoint, their greedy output equals that of an
engine holding the reference-dequantized weights, and speculation on them stays token-identical to their own plain
decoding."""

from __future__ import annotations

import json
from difflib import SequenceMatcher

import pytest
import torch
from safetensors.torch import load_file, save_file

from nextn import LLM, SamplingParams
from nextn.build.engine_builder import build_engine
from nextn.build.manifest import EngineError
from nextn.quantization import QuantConfig, dequantize, quantize
from nextn.testing.tiny_llama import tiny_hf_llama

PROMPTS = [[5, 6, 7, 8], [9], list(range(20, 50))]
PARAMS = SamplingParams(max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    out = tmp_path_factory.mktemp("q") / "ckpt"
    tiny_hf_llama(vocab_size=320, lm_head_scale=40.0).save_pretrained(out)  # 320: a multiple of 16 (int4 packing)
    return out


@pytest.fixture(scope="module")
def tied_ckpt(tmp_path_factory):
    out = tmp_path_factory.mktemp("q") / "tied"
    tiny_hf_llama(tied=True, lm_head_scale=5.0, vocab_size=320).save_pretrained(out)
    return out


def _dequantized_copy(ckpt, out, cfg: QuantConfig):
    """The checkpoint with every linear weight `cfg` quantizes replaced by dequantize(quantize(bf16 weight)); a tied
    checkpoint becomes an untied one whose lm_head is the dequantized embedding."""
    out.mkdir()
    for f in ckpt.iterdir():
        if f.suffix != ".safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    state = load_file(str(ckpt / "model.safetensors"))
    config = json.loads((ckpt / "config.json").read_text())
    if config.get("tie_word_embeddings"):
        state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
        (out / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    for name, w in state.items():
        if w.dim() == 2 and (".layers." in name or name == "lm_head.weight") and cfg.applies_to(name[:-7]):
            layer = cfg.for_module(name[:-7])
            state[name] = dequantize(quantize(w.bfloat16(), layer), layer).bfloat16().float()
    save_file(state, str(out / "model.safetensors"))
    return out


@pytest.mark.parametrize("algo,group,head,tied,sb", [
    ("W8A16", None, None, False, None),  # lm_head W8A16 (the default)
    ("W4A16", 32, None, False, None),  # decoder W4A16, lm_head W8A16
    ("W4A16", 32, "W4A16", False, None),
    ("W4A16", 32, "excluded", False, None),  # lm_head in bf16
    ("W8A16", None, None, True, None),  # a tied model: a quantized lm_head copy of the embedding
    ("W4A16", 32, "W4A16", False, 256),  # two-level scales (k-quants), the 4-bit lm_head too
    ("W4A8", 32, None, False, None),  # int8 activations per group on nextn's kernel
])
def test_quantized_engine_equals_reference_dequantization(ckpt, tied_ckpt, tmp_path, algo, group, head, tied, sb):
    engine, ckpt = tmp_path / "engine", tied_ckpt if tied else ckpt
    exclude = ["lm_head"] if head == "excluded" else None
    build_engine(ckpt, engine, dtype="bfloat16", max_seq_len=128, progress=False, quant_algo=algo, group_size=group,
                 exclude_modules=exclude, lm_head_quant_algo=None if head == "excluded" else head,
                 super_block_size=sb)
    manifest = json.loads((engine / "manifest.json").read_text())
    assert manifest["quant_config"]["quant_algo"] == algo and manifest["quant_config"]["exclude_modules"] == (exclude or [])
    assert manifest["quant_config"]["super_block_size"] == sb
    stored = load_file(str(engine / "model.safetensors"))
    dtypes = {"W8A16": torch.int8, "W4A16": torch.uint8, "W4A8": torch.uint8}
    assert stored["model.layers.0.mlp.down_proj.weight"].dtype == dtypes[algo]
    assert ("model.layers.0.mlp.down_proj.weight_scale_2" in stored) == (sb is not None)
    assert stored["lm_head.weight"].dtype == (torch.bfloat16 if exclude else dtypes[head or "W8A16"])
    assert stored["model.embed_tokens.weight"].dtype == torch.bfloat16  # a tied model keeps its embedding whole
    cfg = QuantConfig(**manifest["quant_config"])
    ref_engine = tmp_path / "ref"
    build_engine(_dequantized_copy(ckpt, tmp_path / "deq", cfg), ref_engine, dtype="bfloat16", max_seq_len=128,
                 progress=False)
    quantized = [o.outputs[0].token_ids for o in LLM(engine, speculative_config=None).generate(PROMPTS, PARAMS)]
    reference = [o.outputs[0].token_ids for o in LLM(ref_engine, speculative_config=None).generate(PROMPTS, PARAMS)]
    # the kernels scale after accumulating (the reference rounds each dequantized weight to bf16 first): a near-tie
    # may flip (measured: a 3 % logit margin at token 4 of one W4A16 sequence; W8A16 with int16 activations, the
    # avx2 / avx512 variants: token 3 of the second prompt, 211 against 185, 16.39 against 16.17 in f32 — an exact
    # tie in the engine's bf16 logits, whose step there is 0.125), not the first tokens
    early = 3 if algo == "W8A16" else 2
    assert all(q[:early] == r[:early] for q, r in zip(quantized, reference)), (quantized, reference)
    # tokens in common, aligned (one flipped near-tie shifts the rest of a sequence by one: measured, a repeated token
    # inserted at index 3 of a W4A16 sequence, identical after it)
    same = sum(m.size for q, r in zip(quantized, reference)
               for m in SequenceMatcher(None, q, r, autojunk=False).get_matching_blocks())
    assert same >= (0.8 if algo == "W8A16" else 0.6) * sum(map(len, reference))
    ngram = LLM(engine, speculative_config={"decoding_type": "NGram", "max_draft_len": 3,
                                            "max_matching_ngram_size": 2}).generate(PROMPTS, PARAMS)
    assert [o.outputs[0].token_ids for o in ngram] == quantized  # verifying 4 rows = decoding them one by one


def test_an_unpackable_w4a16_lm_head_is_stored_w8a16(tmp_path):
    ckpt = tmp_path / "ckpt"
    tiny_hf_llama(vocab_size=300).save_pretrained(ckpt)  # 300 rows: not a multiple of 16
    manifest = build_engine(ckpt, tmp_path / "e", max_seq_len=64, progress=False, quant_algo="W4A16", group_size=32,
                            lm_head_quant_algo="W4A16")
    assert manifest.quant_config.lm_head_quant_algo == "W8A16"
    stored = load_file(str(tmp_path / "e" / "model.safetensors"))
    assert stored["lm_head.weight"].dtype == torch.int8 and stored["model.layers.0.mlp.up_proj.weight"].dtype == torch.uint8
    assert len(LLM(tmp_path / "e").generate([[5, 6]], PARAMS)[0].outputs[0].token_ids) == PARAMS.max_tokens


def test_bad_quant_options_are_named(ckpt, tmp_path):
    with pytest.raises(EngineError, match="group_size 48 does not divide"):
        build_engine(ckpt, tmp_path / "e1", max_seq_len=64, progress=False, quant_algo="W4A16", group_size=48)
    with pytest.raises(EngineError, match="W8A16 scales each output channel"):
        build_engine(ckpt, tmp_path / "e2", max_seq_len=64, progress=False, quant_algo="W8A16", group_size=32)
    with pytest.raises(EngineError, match="unknown quant_algo"):
        build_engine(ckpt, tmp_path / "e3", max_seq_len=64, progress=False, quant_algo="FP8")
    with pytest.raises(EngineError, match="super_block_size 16 is smaller than the group size 32"):
        build_engine(ckpt, tmp_path / "e4", max_seq_len=64, progress=False, quant_algo="W4A16", super_block_size=16)
    with pytest.raises(EngineError, match="apply to W4A16 / W4A8 only"):
        build_engine(ckpt, tmp_path / "e5", max_seq_len=64, progress=False, quant_algo="W8A16", super_block_size=256)
    assert not any((tmp_path / f"e{i}").exists() for i in range(1, 6))
