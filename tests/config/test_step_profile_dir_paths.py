"""`step_profile_dir` (config/llm_args.py, runtime/step_profiler.py): a path no directory can have is a named
validation error, and a relative one in a YAML file is read from the YAML's folder like every other path key
(issue 57)."""

from __future__ import annotations

import logging

import pytest

from nextn.config.llm_args import LlmArgsError, load_llm_args_yaml, parse_llm_args

MTP = {"decoding_type": "MTP", "num_nextn_predict_layers": 1, "adaptive_draft_len": True, "step_profile": "auto"}


@pytest.mark.parametrize("value, why", [("profiles\0x", "NUL byte"),
                                        ("~nosuchuser-nextn/profiles", "~nosuchuser-nextn names no user")])
def test_a_path_no_directory_can_have_is_a_named_error(value, why):
    with pytest.raises(LlmArgsError, match=f"speculative_config.step_profile_dir: .*{why}"):
        parse_llm_args({"speculative_config": {**MTP, "step_profile_dir": value}})


@pytest.mark.parametrize("value, why", [('"profiles\\0x"', "NUL byte"),
                                        ("~nosuchuser-nextn/profiles", "~nosuchuser-nextn names no user")])
def test_a_yaml_path_no_directory_can_have_is_a_named_error(tmp_path, value, why):
    cfg = tmp_path / "llm.yaml"
    cfg.write_text("speculative_config:\n  decoding_type: MTP\n  adaptive_draft_len: true\n  step_profile: auto\n"
                   f"  step_profile_dir: {value}\n")
    with pytest.raises(LlmArgsError, match=f"step_profile_dir.*{why}"):
        load_llm_args_yaml(cfg)


def test_an_unknown_user_in_a_yaml_model_path_is_a_named_error(tmp_path):
    cfg = tmp_path / "draft.yaml"
    cfg.write_text("speculative_config:\n  decoding_type: Draft_Target\n  max_draft_len: 2\n"
                   "  speculative_model_dir: ~nosuchuser-nextn/draft\n")
    with pytest.raises(LlmArgsError, match=f"speculative_model_dir in {cfg}.*~nosuchuser-nextn names no user"):
        load_llm_args_yaml(cfg)


def test_a_relative_step_profile_dir_in_a_yaml_is_read_from_the_yamls_folder(tmp_path, monkeypatch):
    conf = tmp_path / "conf"
    conf.mkdir()
    cfg = conf / "llm.yaml"
    cfg.write_text("speculative_config:\n  decoding_type: MTP\n  adaptive_draft_len: true\n  step_profile: auto\n"
                   "  step_profile_dir: profiles/here\n")  # need not exist yet: created when a profile is saved
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    spec = parse_llm_args(load_llm_args_yaml(cfg)).speculative_config
    assert spec.step_profile_dir == str(conf / "profiles" / "here")
    cfg.write_text(cfg.read_text().replace("profiles/here", "~/profiles"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert load_llm_args_yaml(cfg)["speculative_config"]["step_profile_dir"] == str(tmp_path / "home" / "profiles")
    combined = tmp_path / "suffix.yaml"
    combined.write_text("speculative_config:\n  decoding_type: Suffix\n  max_draft_len: 2\n  combine_with:\n"
                        "    decoding_type: MTP\n    step_profile_dir: p\n")
    inner = load_llm_args_yaml(combined)["speculative_config"]["combine_with"]
    assert inner["step_profile_dir"] == str(tmp_path / "p")


def test_the_profile_of_a_yaml_with_a_relative_step_profile_dir_lands_beside_the_yaml(checkpoints, tmp_path,
                                                                                       monkeypatch, caplog):
    from nextn import LLM
    from nextn.runtime import step_profiler

    engine = checkpoints.engine(num_mtp_modules=1)
    conf = tmp_path / "conf"
    conf.mkdir()
    cfg = conf / "llm.yaml"
    cfg.write_text("speculative_config:\n  decoding_type: MTP\n  num_nextn_predict_layers: 1\n"
                   "  adaptive_draft_len: true\n  step_profile: auto\n  step_profile_dir: profiles\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(step_profiler, "measure_step_time", lambda target: ({1: {0: 0.010, 1: 0.012}}, []))
    with caplog.at_level(logging.INFO, logger="nextn.runtime.step_profiler"):
        LLM(engine, extra_llm_api_options=cfg, max_batch_size=1)
    assert "measured the step profile" in caplog.text
    assert len(list((conf / "profiles").iterdir())) == 1 and not (tmp_path / "profiles").exists()


def test_llm_with_a_nul_byte_in_step_profile_dir_is_a_named_error(checkpoints):
    from nextn import LLM

    with pytest.raises(LlmArgsError, match="step_profile_dir: .*NUL byte"):
        LLM(checkpoints.engine(num_mtp_modules=1), speculative_config={**MTP, "step_profile_dir": "p\0"},
            max_batch_size=1)
