"""The configurations `python -m benchmarks.drafters` compares (the runs themselves are benchmarks)."""

from pathlib import Path

from benchmarks.drafters import _configs
from nextn.config.llm_args import (DraftTargetDecodingConfig, MTPDecodingConfig, NGramDecodingConfig,
                                   SuffixDecodingConfig)

KINDS = {"Draft_Target": DraftTargetDecodingConfig, "NGram": NGramDecodingConfig, "MTP": MTPDecodingConfig,
         "Suffix": SuffixDecodingConfig}


def test_without_a_draft_model_no_draft_target_runs_and_mtp_chains_get_cut_heads():
    out = _configs(None, 4, [32768], Path("hot.json"), mtp_lens=[2, 3])
    assert not any(name.startswith("Draft_Target") for name in out)
    assert out["plain"] is None
    assert out["MTP K=2"] == {"decoding_type": "MTP", "num_nextn_predict_layers": 2}
    assert out["MTP K=3 draft_vocab_size=32768"] == {"decoding_type": "MTP", "num_nextn_predict_layers": 3,
                                                     "draft_vocab_size": 32768, "draft_token_map": "hot.json"}
    assert out["MTP K≤2 adaptive draft_vocab_size=32768"]["adaptive_draft_len"] is True
    assert {"NGram K=4", "NGram K≤4 adaptive", "Suffix K=4", "Suffix K≤4 adaptive"} <= set(out)
    assert out["Suffix K≤4 adaptive"] == {"decoding_type": "Suffix", "max_draft_len": 4, "adaptive_draft_len": True,
                                          "step_profile": "auto"}
    for spec in out.values():
        if spec is not None:
            KINDS[spec["decoding_type"]](**spec)


def test_with_a_draft_model_every_config_is_valid_as_written():
    out = _configs(Path("draft.gguf"), 3, [1024])
    assert out["Draft_Target K=3 draft_vocab_size=1024"]["draft_vocab_size"] == 1024
    assert out["Draft_Target K≤3 adaptive"]["adaptive_draft_len"] is True
    for spec in out.values():
        if spec is not None:
            KINDS[spec["decoding_type"]](**spec)


def test_a_batch_pass_runs_the_prompts_in_waves_of_the_batch_size():
    """`--batch B` means B requests in flight: the engine's max_batch_size is the largest B of the invocation, so
    the pass must not hand it every prompt at once."""
    from types import SimpleNamespace

    from benchmarks.decode_pass import run_nextn

    seen = []

    def generate(prompts, params):
        seen.append(len(prompts))
        out = SimpleNamespace(token_ids=[1] * params.max_tokens, num_decode_steps=params.max_tokens - 1,
                              num_draft_tokens=0, num_accepted_draft_tokens=0)
        return [SimpleNamespace(outputs=[out]) for _ in prompts]

    r = run_nextn(SimpleNamespace(generate=generate), [[1, 2]] * 7, 4, 3)
    assert seen == [3, 3, 1] and len(r["tokens"]) == 7 and r["al"] == 1.0


def test_a_llama_cpp_build_without_its_tools_is_refused_before_any_engine_is_built(tmp_path, monkeypatch, capsys):
    import pytest

    import benchmarks.drafters as drafters

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("llama-bench", "llama-completion"):  # a build with the plain tool only: the draft model's is missing
        (bin_dir / tool).write_text("")
    monkeypatch.setattr(drafters, "_llm", lambda *a, **k: pytest.fail("an engine was built before the check"))
    with pytest.raises(SystemExit) as e:
        drafters.main(["--target", str(tmp_path / "t.gguf"), "--draft", str(tmp_path / "d.gguf"),
                       "--llama_cpp_bin", str(bin_dir), "--configs", "plain"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "lacks llama-speculative-simple" in err and "--target llama-speculative-simple" in err
