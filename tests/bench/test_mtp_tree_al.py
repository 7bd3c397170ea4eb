"""The configurations `python -m benchmarks.mtp_tree_al` compares (the runs themselves are benchmarks)."""

from types import SimpleNamespace

from benchmarks.mtp_tree_al import _all_configs, configs
from nextn.config.llm_args import MTPDecodingConfig
from nextn.train.tree_calibration import best_first_tree

ACC = [[0.45, 0.12, 0.06, 0.05], [0.40, 0.12, 0.05, 0.03], [0.36, 0.11, 0.05, 0.04]]


def test_each_budget_verifies_the_same_number_of_tokens():
    out = configs([4, 16], 3, ACC)
    assert out["chain-16"]["num_nextn_predict_layers"] == 15
    for name in ("static-16", "static-cal-16"):
        assert len(out[name]["eagle_choices"]) == 15 and out[name]["num_nextn_predict_layers"] == 3
    assert out["static-cal-16"]["eagle_choices"] == best_first_tree(ACC, 15)
    assert out["dynamic-top4-16"]["max_total_draft_tokens"] == 15
    assert "static-cal-4" not in configs([4], 3)  # no measured acceptance: no calibrated tree
    for spec in out.values():
        MTPDecodingConfig(**spec)  # every config is valid as written


def test_a_schedule_is_capped_at_each_configs_own_drafts_and_adaptive_is_added():
    args = SimpleNamespace(budgets=[4, 16], depth=3, acceptance=ACC, draft_vocab_size=None,
                           draft_len_schedule={"2": 15, "8": 3}, adaptive_draft_len=True)
    out = _all_configs(args)
    assert out["chain-4"]["draft_len_schedule"] == {2: 3, 8: 3}
    assert out["static-cal-16"]["draft_len_schedule"] == {2: 15, 8: 3}
    assert all(spec["adaptive_draft_len"] for spec in out.values())


def test_compare_policies_runs_each_config_under_three_policies():
    args = SimpleNamespace(budgets=[16], depth=3, acceptance=None, draft_vocab_size=None,
                           draft_len_schedule={"1": 15, "4": 3}, adaptive_draft_len=False, compare_policies=True)
    out = _all_configs(args)
    assert set(out) == {f"{c} {p}" for c in configs([16], 3) for p in ("schedule", "schedule+adaptive", "adaptive")}
    for name, spec in out.items():
        assert ("draft_len_schedule" in spec) == ("schedule" in name)
        assert spec.get("adaptive_draft_len", False) == name.endswith("adaptive")
        MTPDecodingConfig(**spec)
    assert out["static-16 schedule"]["draft_len_schedule"] == {1: 15, 4: 3}


def test_held_out_prompts_skip_the_top1_meter_and_other_sources():
    from benchmarks.mtp_tree_al import held_out_prompts

    meta = {"eval_prompt_ids": ["humaneval/HumanEval/1", "mt_bench/81", "humaneval/HumanEval/7", "mt_bench/90",
                                "humaneval/HumanEval/9"],
            "held_out_prompts": [[1], [2], [3], [4], [5]], "data_config": {"num_top1_prompts": 2}}
    assert held_out_prompts(meta, "humaneval", 8) == (["humaneval/HumanEval/7", "humaneval/HumanEval/9"], [[3], [5]])
    assert held_out_prompts(meta, "mt_bench", 1) == (["mt_bench/90"], [[4]])
