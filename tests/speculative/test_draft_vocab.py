"""The draft head cut to its hot tokens (speculative/draft_vocab.py): which ids are kept, the token-map file's errors,
and a cut quantized head computing exactly the full head's hot rows."""

from __future__ import annotations

import json

import pytest
import torch

from nextn.quantization.linear import WeightOnlyLinear
from nextn.quantization.weight_only import QuantConfig, quantize
from nextn.speculative.draft_vocab import (always_kept_ids, hot_token_ids, load_token_map, restrict_dense_head,
                                       restrict_quantized_head)


def test_hot_ids_are_the_lowest_ids_plus_the_kept_ones_in_blocks_of_16():
    hot = hot_token_ids(1000, 40, kept=[990, 995, 5])
    assert hot.dtype == torch.int64 and hot.numel() == 48  # 40 rounded up to a multiple of 16
    assert hot.tolist() == sorted(hot.tolist())
    assert {990, 995}.issubset(hot.tolist())
    assert hot.tolist()[:46] == list(range(46))  # the rest: the lowest ids (5 counted once)


def test_a_ranking_comes_first_and_without_a_size_is_kept_whole():
    ranking = [700, 3, 500, 999]
    hot = hot_token_ids(1000, 16, kept=[998], ranking=ranking)
    assert {700, 3, 500, 999, 998}.issubset(hot.tolist()) and hot.numel() == 16
    assert set(hot.tolist()) - {700, 3, 500, 999, 998} == set(range(12)) - {3}  # then the lowest ids
    whole = hot_token_ids(1000, None, ranking=list(range(100, 120)))
    assert set(range(100, 120)).issubset(whole.tolist()) and whole.numel() == 32


def test_no_cut_asked_for_or_none_left():
    assert hot_token_ids(1000, None) is None
    assert hot_token_ids(100, 100) is None and hot_token_ids(100, 200) is None
    with pytest.raises(ValueError, match="≥ 1"):
        hot_token_ids(100, 0)


def test_token_map_errors_name_the_file_and_the_fix(tmp_path):
    good = tmp_path / "map.json"
    good.write_text("[5, 1, 9]")
    assert load_token_map(good, 10) == [5, 1, 9]
    with pytest.raises(ValueError, match="nextn token-map"):
        load_token_map(tmp_path / "missing.json", 10)
    (tmp_path / "dict.json").write_text('{"a": 1}')
    with pytest.raises(ValueError, match="JSON list of token ids"):
        load_token_map(tmp_path / "dict.json", 10)
    (tmp_path / "big.json").write_text("[1, 12]")
    with pytest.raises(ValueError, match=r"\[0, 10\).*\[12\].*another tokenizer"):
        load_token_map(tmp_path / "big.json", 10)


def test_kept_ids_are_the_added_tokens_and_the_eos_ids(tmp_path):
    assert always_kept_ids(tmp_path, 100) == []
    (tmp_path / "tokenizer.json").write_text(json.dumps({"added_tokens": [{"id": 90, "content": "<s>"},
                                                                          {"id": 150, "content": "<pad>"}]}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [91, 2]}))
    assert always_kept_ids(tmp_path, 100) == [2, 90, 91]  # 150 is past the vocabulary
    (tmp_path / "generation_config.json").write_text("{")
    with pytest.raises(ValueError, match="generation_config.json is not valid JSON"):
        always_kept_ids(tmp_path, 100)


@pytest.mark.parametrize("algo", ["W4A16", "W4A8", "W8A16"])
def test_a_cut_quantized_head_computes_the_full_heads_hot_rows_exactly(algo):
    torch.manual_seed(0)
    w = torch.randn(256, 128)
    cfg = QuantConfig(quant_algo=algo, group_size=32) if algo != "W8A16" else QuantConfig(quant_algo=algo)
    tensors = {f"lm_head.{k}": v for k, v in quantize(w, cfg).items()}
    hot = hot_token_ids(256, 48, ranking=list(range(200, 256, 2)))
    full = WeightOnlyLinear({k.removeprefix("lm_head."): v for k, v in tensors.items()}, cfg)
    other = {"model.norm.weight": torch.ones(128)}
    weights = {**tensors, **other}
    assert restrict_quantized_head(weights, hot)
    assert weights["model.norm.weight"] is other["model.norm.weight"]  # other tensors untouched
    cut = WeightOnlyLinear({k.removeprefix("lm_head."): v for k, v in weights.items() if k.startswith("lm_head.")},
                           cfg)
    x = torch.randn(3, 128).bfloat16()
    # every output channel is computed alone (batch- and block-invariant kernels): bit for bit
    assert torch.equal(cut(x), full(x)[:, hot])
    assert not restrict_quantized_head(other, hot)  # a dense head: nothing to do here


def test_a_cut_dense_head_leaves_a_tied_embedding_whole():
    model = torch.nn.Module()
    model.embed = torch.nn.Embedding(100, 8)
    model.lm_head = torch.nn.Linear(8, 100, bias=False)
    model.lm_head.weight = model.embed.weight  # tied
    hot = hot_token_ids(100, 16, ranking=[99, 50])
    x = torch.randn(2, 8)
    want = model.lm_head(x)[:, hot]
    restrict_dense_head(model, hot)
    assert model.embed.weight.shape == (100, 8) and model.lm_head.weight.shape == (16, 8)
    torch.testing.assert_close(model.lm_head(x), want, rtol=0, atol=0)


@pytest.mark.parametrize("algo", ["W8A16", "W4A16"])
def test_a_quantized_head_cut_for_self_drafting_holds_its_dequantized_hot_rows(algo):
    """`cut_draft_head` on a quantized lm_head (MTP): the hot rows come out of the head itself (the identity
    passed through it), so they equal the reference dequantization, in bf16; the drafters read them quantized
    again, W8A16 — for an int8 head exactly its own int8 rows and scales."""
    from types import SimpleNamespace

    from nextn.models.causal_lm import SelfDraftingCausalLM
    from nextn.models.layers import RMSNorm
    from nextn.quantization.weight_only import dequantize

    torch.manual_seed(0)
    cfg = QuantConfig(quant_algo=algo, group_size=32) if algo != "W8A16" else QuantConfig(quant_algo=algo)
    tensors = quantize(torch.randn(320, 128), cfg)
    model = SelfDraftingCausalLM()
    model.lm_head, model.lm_head_quantized = WeightOnlyLinear(dict(tensors), cfg), True
    model.model = torch.nn.Module()
    model.model.norm = RMSNorm(128, eps=1e-6).to(torch.bfloat16)
    model.cfg = SimpleNamespace(vocab_size=320)
    hot = hot_token_ids(320, 48, ranking=list(range(300, 320)))
    model.cut_draft_head(hot)
    want = dequantize(tensors, cfg)[hot].to(torch.bfloat16)
    int8 = QuantConfig(quant_algo="W8A16")
    assert model.draft_head_weight is None and model.draft_head.out_features == hot.numel()
    requantized = quantize(want, int8)
    if algo == "W8A16":  # the head's own int8 rows and scales, unchanged
        assert torch.equal(requantized["weight"], tensors["weight"][hot])
        assert torch.equal(requantized["weight_scale"], tensors["weight_scale"][hot])
    x = torch.randn(3, 128).bfloat16()
    logits = model.draft_logits(x)
    assert logits.shape == (3, 320) and torch.isinf(logits[:, 100:300]).all()
    ref = x.float() @ dequantize(requantized, int8).T  # the int8 rows the drafters read
    torch.testing.assert_close(logits[:, hot], ref, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("special", ["/dev/zero", "fifo", "dir"])
def test_a_token_map_that_is_not_a_regular_file_is_refused_unread(tmp_path, special):
    # issue 32: `draft_token_map: /dev/zero` read forever (MemoryError); a FIFO would hang the load
    import os

    path = special
    if special == "fifo":
        path = tmp_path / "fifo"
        os.mkfifo(path)
    elif special == "dir":
        path = tmp_path
    with pytest.raises(ValueError, match="not a regular file"):
        load_token_map(path, 10)


def test_a_token_map_larger_than_the_cap_is_refused(tmp_path, monkeypatch):
    from nextn.config import user_files

    path = tmp_path / "map.json"
    path.write_text("[" + ", ".join(["1"] * 2000) + "]")
    monkeypatch.setattr(user_files, "MAX_USER_FILE_BYTES", 100)
    with pytest.raises(ValueError, match="larger than"):
        load_token_map(path, 10)


def test_mtp_cuts_the_draft_head_through_its_prepare_model_hook_and_never_under_tensor_parallelism(tmp_path):
    """The engine calls `registry.prepare_model` once on the loaded target; MTP's hook cuts the head only when a
    draft vocabulary is asked for, and refuses under tensor parallelism (the lm_head is split by vocabulary)."""
    from pathlib import Path

    from nextn.config.llm_args import LlmArgsError, MTPDecodingConfig
    from nextn.speculative import mtp, registry
    from nextn.speculative.method import LoadContext

    assert registry.METHODS["MTP"].prepare_model is mtp.prepare_model

    class Untouchable:  # any call on the model is an error: nothing to prepare
        def __getattr__(self, name):
            raise AssertionError(f"model.{name} touched")

    ctx = LoadContext(None, Path(tmp_path), torch.device("cpu"), 128, tensor_parallel=True)
    registry.prepare_model(Untouchable(), None, ctx)  # plain decoding
    registry.prepare_model(Untouchable(), MTPDecodingConfig(num_nextn_predict_layers=1), ctx)  # no draft vocabulary
    with pytest.raises(LlmArgsError, match="tensor parallelism"):
        registry.prepare_model(Untouchable(), MTPDecodingConfig(num_nextn_predict_layers=1, draft_vocab_size=32), ctx)
