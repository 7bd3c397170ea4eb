"""The MT-bench two-turn prefix-reuse benchmark's pieces (the command itself is run by hand: docs/PERFORMANCE.md):
conversations from MT-bench, the per-turn summary and its table."""

from __future__ import annotations

from benchmarks.prefix_reuse import Turn, load_conversations, summarize, table


def test_conversations_are_the_two_mt_bench_turns(shared_data):
    convs = load_conversations(3, shared_data)
    assert len(convs) == 3 and all(isinstance(a, str) and isinstance(b, str) and a != b for a, b in convs)
    assert convs[0][1].startswith("Rewrite your previous response")


def test_summary_per_setting_and_turn():
    turns = {False: [Turn(0, 1, 10, 0, 100.0, 900.0, "a"), Turn(0, 2, 30, 0, 300.0, 1000.0, "b")],
             True: [Turn(0, 1, 10, 0, 110.0, 950.0, "a"), Turn(0, 2, 30, 24, 120.0, 800.0, "c")]}
    s = summarize(turns)
    assert s["reuse_on_turn2"]["hit_rate"] == 24 / 30 and s["reuse_off_turn2"]["ttft_ms_mean"] == 300.0
    assert s["identical_answers"] == 1 and s["num_turns"] == 2
    text = table("t", s)
    assert "| on | 2 | 30 | 120 / 120 | 800 | 80.0% | — |" in text and "off vs on: 1/2" in text
    served = summarize({k: [Turn(t.conversation, t.turn, t.prompt_tokens, -1, t.ttft_ms, t.e2e_ms, t.text)
                            for t in v] for k, v in turns.items()}, {False: (40, 0), True: (40, 24)})
    assert served["reuse_on_turn2"]["hit_rate"] is None and served["reuse_on_metrics_hit_rate"] == 0.6
    assert "60.0% (all turns, /metrics)" in table("t", served)
