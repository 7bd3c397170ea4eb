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

    root = Path(__file__).resolve().parents[2]
    configs = sorted((root / "configs").glob("*.yaml"))
    assert configs
    for path in configs:
        try:
            parse_llm_args(load_llm_args_yaml(path))
        except LlmArgsError as e:  # a draft model not downloaded here: named, and looked for in the repo's runs/
            assert path.name in ("draft_target.yaml", "suffix_draft_target.yaml", "gemma4_assistant.yaml")
            assert f"speculative_model_dir in {path}" in str(e)
            assert str(root / "configs" / ".." / "runs" / "models") in str(e)


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


def test_yaml_paths_are_relative_to_the_yaml_file(tmp_path, monkeypatch):
    """speculative_model_dir / draft_token_map given relative in a YAML are read from the YAML's folder, wherever
    the command runs; absolute ones stay; a missing one names the key and the file."""
    from pathlib import Path

    conf = tmp_path / "conf"
    (conf / "models").mkdir(parents=True)
    (conf / "models" / "draft.gguf").write_bytes(b"")
    (tmp_path / "hot.json").write_text("[1, 2]")
    cfg = conf / "draft.yaml"
    cfg.write_text("speculative_config:\n  decoding_type: Draft_Target\n  max_draft_len: 2\n"
                   "  speculative_model_dir: models/draft.gguf\n  draft_token_map: ../hot.json\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    spec = parse_llm_args(load_llm_args_yaml(cfg)).speculative_config
    assert Path(spec.speculative_model_dir).resolve() == (conf / "models" / "draft.gguf").resolve()
    assert Path(spec.draft_token_map).resolve() == (tmp_path / "hot.json").resolve()
    monkeypatch.chdir(tmp_path)  # a relative YAML path too
    spec = parse_llm_args(load_llm_args_yaml(Path("conf/draft.yaml"))).speculative_config
    assert Path(spec.speculative_model_dir).resolve() == (conf / "models" / "draft.gguf").resolve()
    cfg.write_text(cfg.read_text().replace("models/draft.gguf", str(conf / "models" / "draft.gguf")))
    assert parse_llm_args(load_llm_args_yaml(cfg)).speculative_config.speculative_model_dir == str(
        conf / "models" / "draft.gguf")


@pytest.mark.parametrize("key, value", [("speculative_model_dir", "models/missing.gguf"),
                                        ("speculative_model", "/no/such/draft"), ("draft_token_map", "hot.json")])
def test_a_missing_yaml_path_names_the_key_and_the_file(tmp_path, key, value):
    cfg = tmp_path / "draft.yaml"
    model = "" if key.startswith("speculative_model") else f"  speculative_model_dir: {tmp_path}\n"
    cfg.write_text(f"speculative_config:\n  decoding_type: Draft_Target\n  max_draft_len: 2\n{model}"
                   f"  {key}: {value}\n")
    with pytest.raises(LlmArgsError, match=f"{key} in {cfg}: {value}.* does not exist"):
        load_llm_args_yaml(cfg)
