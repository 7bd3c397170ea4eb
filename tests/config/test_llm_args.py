"""LLM arguments: TensorRT-LLM names, unknown keys named with the valid ones, YAML loading."""

from __future__ import annotations

import pytest

from nextn.config.llm_args import LlmArgsError, load_llm_args_yaml, parse_llm_args


def test_reference_example_yaml_loads(tmp_path):
    p = tmp_path / "x.yaml"
    p.write_text("cuda_graph_config: {enable_padding: true, max_batch_size: 128}\n"
                 "speculative_config:\n  decoding_type: MTP\n  num_nextn_predict_layers: 3\n"
                 "  use_relaxed_acceptance_for_thinking: true\n  relaxed_topk: 10\n  relaxed_delta: 0.6\n")
    args = parse_llm_args(load_llm_args_yaml(p))
    assert args.speculative_config.num_nextn_predict_layers == 3
    assert args.cuda_graph_config.max_batch_size == 128


def test_unknown_nested_key_names_key_and_valid_ones():
    with pytest.raises(LlmArgsError) as e:
        parse_llm_args({"speculative_config": {"decoding_type": "MTP", "num_draft": 3}})
    assert "speculative_config.num_draft" in str(e.value) and "num_nextn_predict_layers" in str(e.value)


def test_unknown_top_level_key_and_wrong_type():
    with pytest.raises(LlmArgsError, match="unknown key 'max_batch'.*max_batch_size"):
        parse_llm_args({"max_batch": 3})
    with pytest.raises(LlmArgsError, match="max_seq_len"):
        parse_llm_args({"max_seq_len": "long"})


def test_yaml_file_errors(tmp_path):
    with pytest.raises(LlmArgsError, match="does not exist"):
        load_llm_args_yaml(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a list\n")
    with pytest.raises(LlmArgsError, match="mapping"):
        load_llm_args_yaml(bad)


def test_every_example_config_loads():
    from pathlib import Path

    configs = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))
    assert configs
    for path in configs:
        parse_llm_args(load_llm_args_yaml(path))


def test_legacy_spellings_are_accepted_with_a_deprecation_warning():
    legacy = {"pytorch_backend_config": {"use_cuda_graph": True, "cuda_graph_batch_sizes": [1, 2, 4],
                                         "cuda_graph_padding_enabled": True}, "max_batch_size": 4}
    with pytest.warns(FutureWarning) as caught:
        args = parse_llm_args(legacy)
    messages = " ".join(str(w.message) for w in caught)
    assert "cuda_graph_config.batch_sizes" in messages and "top level" in messages
    assert args.cuda_graph_config.batch_sizes == [1, 2, 4] and args.cuda_graph_config.enable_padding
    assert args.max_batch_size == 4
    with pytest.warns(FutureWarning, match="use_cuda_graph"):
        assert parse_llm_args({"use_cuda_graph": False}).cuda_graph_config is None
