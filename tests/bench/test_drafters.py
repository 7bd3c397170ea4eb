"""The configurations `python -m nextn.bench.drafters` compares (the runs themselves are benchmarks)."""

from pathlib import Path

from nextn.bench.drafters import _configs
from nextn.config.llm_args import DraftTargetDecodingConfig, MTPDecodingConfig, NGramDecodingConfig

KINDS = {"Draft_Target": DraftTargetDecodingConfig, "NGram": NGramDecodingConfig, "MTP": MTPDecodingConfig}


def test_without_a_draft_model_no_draft_target_runs_and_mtp_chains_get_cut_heads():
    out = _configs(None, 4, [32768], Path("hot.json"), mtp_lens=[2, 3])
    assert not any(name.startswith("Draft_Target") for name in out)
    assert out["plain"] is None
    assert out["MTP K=2"] == {"decoding_type": "MTP", "num_nextn_predict_layers": 2}
    assert out["MTP K=3 draft_vocab_size=32768"] == {"decoding_type": "MTP", "num_nextn_predict_layers": 3,
                                                     "draft_vocab_size": 32768, "draft_token_map": "hot.json"}
    assert out["MTP K≤2 adaptive draft_vocab_size=32768"]["adaptive_draft_len"] is True
    assert {"NGram K=4", "NGram K≤4 adaptive"} <= set(out)
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
