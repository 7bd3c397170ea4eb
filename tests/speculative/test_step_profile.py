"""Step profiles (speculative/step_profile.py, runtime/step_profiler.py): the file round-trips, is refused when
malformed or oversized and never replaces a file it did not write; another machine's profile is measured again with
one line saying so; a policy seeded from a profile makes at once the decision a measuring one converges to; profiling
a tiny engine covers the batch sizes × draft lengths, is cached for the next load, and stays lossless."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from nextn import LLM, SamplingParams
from nextn.runtime import step_profiler
from nextn.speculative.draft_len_policy import AdaptiveDraftLen, StaticDraftLen
from nextn.speculative.step_profile import (MAX_PROFILE_BYTES, ProfileKey, StepProfile, StepProfileError,
                                            cached_step_profile, engine_digest, load_step_profile, profile_path,
                                            save_step_profile)

DIGEST = engine_digest("manifest", "drafter", "settings")
TABLE = {1: {0: 0.010, 1: 0.0105, 2: 0.011, 3: 0.0115, 4: 0.012},  # batch 1: a speculating step costs little more
         8: {0: 0.010, 1: 0.030, 2: 0.040, 3: 0.050, 4: 0.060}}  # batch 8: compute-bound, nothing could pay


def profile(key: ProfileKey | None = None, table=None) -> StepProfile:
    return StepProfile(key=key or ProfileKey.current(DIGEST, torch.device("cpu")), engine_name="tiny",
                       measure_seconds=1.5, step_time=table or TABLE)


def test_round_trip(tmp_path):
    p = profile()
    path = save_step_profile(p, tmp_path / "cache")
    assert path == profile_path(tmp_path / "cache", DIGEST) and path.name == f"step-profile-{DIGEST[:32]}.json"
    assert load_step_profile(path) == p and load_step_profile(path).step_time[8][3] == 0.050
    assert [f.name for f in path.parent.iterdir()] == [path.name]  # no temporary file left behind
    assert cached_step_profile(tmp_path / "cache", p.key, "tiny") == p
    assert cached_step_profile(tmp_path / "elsewhere", p.key, "tiny") is None


def test_another_machine_re_profiles_with_one_line(tmp_path, caplog):
    here = ProfileKey.current(DIGEST, torch.device("cpu"))
    there = here.model_copy(update={"processor": "Some Other CPU", "threads": here.threads + 3})
    save_step_profile(profile(there), tmp_path)
    with caplog.at_level(logging.INFO):
        assert cached_step_profile(tmp_path, here, "tiny") is None
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "re-profiling" in lines[0]
    assert lines[0].startswith(f"step profile for tiny was measured on Some Other CPU/{here.threads + 3} threads")
    save_step_profile(profile(here), tmp_path)  # a profile of ours: replaced
    assert load_step_profile(profile_path(tmp_path, DIGEST)).key == here


@pytest.mark.parametrize("content, error, ours", [
    (b"{not json", "not a valid step profile", False),
    (b'{"format": "nextn.step_profile", "version": 1}', "not a valid step profile: key", True),
    (b" " * (MAX_PROFILE_BYTES + 1), f"larger than {MAX_PROFILE_BYTES} bytes", False),
])
def test_malformed_or_oversized_files_are_refused(tmp_path, caplog, content, error, ours):
    path = profile_path(tmp_path, DIGEST)
    path.write_bytes(content)
    with pytest.raises(StepProfileError, match=error):
        load_step_profile(path)
    with caplog.at_level(logging.WARNING):  # the loader measures again ...
        assert cached_step_profile(tmp_path, profile().key, "tiny") is None
    assert error in caplog.text
    if ours:  # ... and replaces a file in its own format (a profile it cannot read: another version's) ...
        save_step_profile(profile(), tmp_path)
        assert load_step_profile(path) == profile()
        return
    with pytest.raises(StepProfileError, match="not written by this command"):  # ... never a file it did not write
        save_step_profile(profile(), tmp_path)
    assert path.read_bytes() == content


def test_bad_tables_and_links_are_refused(tmp_path):
    data = json.loads(profile().model_dump_json())
    for table, error in (({"3": {"0": 0.01, "1": 0.02}}, "power of two"), ({"1": {"1": 0.01, "2": 0.02}}, "k = 0"),
                         ({"1": {"0": 0.01, "1": -1.0}}, r"seconds in \(0"), ({}, "empty")):
        path = tmp_path / "bad.json"
        path.write_text(json.dumps({**data, "step_time": table}))
        with pytest.raises(StepProfileError, match=error):
            load_step_profile(path)
    (tmp_path / "target.json").write_text(profile().model_dump_json())
    link = profile_path(tmp_path / "links", DIGEST)
    link.parent.mkdir()
    link.symlink_to(tmp_path / "target.json")
    with pytest.raises(StepProfileError, match="symbolic link"):
        load_step_profile(link)
    with pytest.raises(StepProfileError, match="symbolic link"):
        save_step_profile(profile(), tmp_path / "links")
    with pytest.raises(StepProfileError, match="not a regular file"):
        load_step_profile(tmp_path)  # a directory


def measured_policy(k: int = 4) -> AdaptiveDraftLen:
    """A measuring policy after it has timed every length of both buckets and seen all drafts accepted."""
    p = AdaptiveDraftLen(StaticDraftLen(k), probe_every=1000)
    for bucket, times in TABLE.items():
        for _ in range(30):
            for j, seconds in times.items():
                p.observe(bucket * j, bucket * j, j, bucket, seconds)
    return p


def test_a_seeded_policy_decides_at_once_what_a_measuring_one_converges_to():
    seeded = AdaptiveDraftLen(StaticDraftLen(4), probe_every=8, profile=TABLE)
    fresh = AdaptiveDraftLen(StaticDraftLen(4), probe_every=8)
    # a hopeless bucket: plain decoding from its first step, and no probe ever (no acceptance could pay)
    assert seeded.hopeless(8, 4) and not fresh.hopeless(8, 4)
    assert [seeded.draft_len(8) for _ in range(300)] == [0] * 300
    assert fresh.draft_len(8) == 4  # the measuring policy first speculates to find that out
    # a paying bucket: the full length from the first step, and no plain step to time afterwards
    ks = []
    for _ in range(100):
        ks.append(seeded.draft_len(1))
        seeded.observe(4, 4, ks[-1], 1, 0.5)  # online times do not move a profiled bucket's table
    assert ks == [4] * 100 and seeded.step_time == TABLE
    fresh.observe(4, 4, 4, 1, 0.012)
    fresh.observe(4, 4, 4, 1, 0.012)
    assert fresh.draft_len(1) == 0  # the measuring policy spends a plain step on timing
    # once converged, the measuring policy agrees with the seeded one at every acceptance
    converged = measured_policy()
    assert converged.hopeless(8, 4) and converged.draft_len(8) == 0 and converged.draft_len(1) == 4
    for alpha in (0.05, 0.2, 0.5, 0.9):
        seeded.alpha = converged.alpha = alpha
        for b in (1, 8):
            assert seeded.best_draft_len(b, 4) == converged.best_draft_len(b, 4)
            assert [seeded.relative_step_time(b, j) for j in range(5)] == pytest.approx(
                [converged.relative_step_time(b, j) for j in range(5)])


def test_a_seeded_policy_tells_a_prefill_whether_its_batch_will_speculate():
    """`would_draft` (asked at prefill: a draft model skips its prompt pass when False) follows the profile: never in
    a hopeless bucket, in a paying one only while the acceptance makes some k pay; an unprofiled bucket explores."""
    seeded = AdaptiveDraftLen(StaticDraftLen(4), probe_every=8, profile=TABLE)
    assert not seeded.would_draft(8) and seeded.would_draft(1)  # α unknown: the batch-1 bucket would speculate
    seeded.alpha = 0.0  # drafts that never hit: no k pays even at batch 1
    assert not seeded.would_draft(1)
    seeded.alpha = 0.9
    assert seeded.would_draft(1) and seeded.draft_len(1) > 0  # the prefill's answer is the decode step's
    assert seeded.would_draft(2)  # not in the profile: explores, as without one
    assert not AdaptiveDraftLen(StaticDraftLen(0), profile=TABLE).would_draft(1)


def test_a_seeded_policy_still_probes_acceptance_while_off_and_measures_unprofiled_buckets():
    seeded = AdaptiveDraftLen(StaticDraftLen(4), probe_every=3, profile={1: TABLE[1]}, probe_budget=0)
    seeded.observe(4, 0, 4, 1, 0.0)  # nothing accepted: off at batch 1 ...
    ks = [seeded.draft_len(1) for _ in range(3)]
    assert ks[:2] == [0, 0] and ks[2] > 0  # ... with a probe that refreshes α after probe_every steps
    seeded.observe(8, 8, 4, 2, 0.012)  # batch 2 is not in the profile: measured as without one
    seeded.observe(8, 8, 4, 2, 0.012)
    assert seeded.step_time[2] == {4: 0.012} and seeded.draft_len(2) == 0  # its warm-up plain step


PROMPTS = [[11, 12, 13, 14, 15], [30, 31, 32], [7, 8, 9, 10], [40, 41], [50, 51, 52, 53]]
SP = SamplingParams(max_tokens=16, ignore_eos=True)


@pytest.mark.parametrize("overlap", [False, True])
def test_profiling_a_tiny_engine_is_cached_and_lossless(eagle, tmp_path, caplog, monkeypatch, overlap):
    monkeypatch.setattr(step_profiler, "BUDGET_S", 1e9)  # every batch size, however loaded the machine
    spec = {"decoding_type": "MTP", "num_nextn_predict_layers": 3, "adaptive_draft_len": True,
            "step_profile": "auto", "step_profile_dir": str(tmp_path)}
    with caplog.at_level(logging.INFO, logger="nextn.runtime.step_profiler"):
        llm = LLM(eagle, speculative_config=spec, max_batch_size=8, disable_overlap_scheduler=not overlap)
    assert "measured the step profile" in caplog.text
    (path,) = tmp_path.iterdir()
    saved = load_step_profile(path)
    assert set(saved.step_time) == {1, 2, 4, 8} and all(set(t) == {0, 1, 2, 3} for t in saved.step_time.values())
    assert saved.key.threads == torch.get_num_threads() and saved.measure_seconds > 0
    policy = llm.engine.draft_len_policy
    assert policy.step_time == saved.step_time
    plain = LLM(eagle, speculative_config=None, max_batch_size=8)
    ref = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, SP)]
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SP)] == ref
    assert llm.engine.pool.num_free == plain.engine.pool.num_free  # profiling left no block behind

    def no_measuring(*args, **kwargs):
        raise AssertionError("the cached profile should have been read")

    with monkeypatch.context() as m:
        m.setattr(step_profiler, "measure_step_time", no_measuring)
        again = LLM(eagle, speculative_config=spec, max_batch_size=8, disable_overlap_scheduler=not overlap)
    assert again.engine.draft_len_policy.step_time == saved.step_time
    assert [o.outputs[0].token_ids for o in again.generate(PROMPTS, SP)] == ref
    other = saved.model_copy(update={"key": saved.key.model_copy(update={"threads": saved.key.threads + 1})})
    path.write_text(other.model_dump_json())  # measured with another thread count: measured again, one line says so
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="nextn"):
        LLM(eagle, speculative_config=spec, max_batch_size=8)
    assert [r.getMessage() for r in caplog.records if "re-profiling" in r.getMessage()] == [
        f"step profile for {eagle.name} was measured on {other.key.machine()}, this is {saved.key.machine()}; "
        "re-profiling"]
    assert "measured the step profile" in caplog.text and load_step_profile(path).key == saved.key
    off = LLM(eagle, speculative_config={**spec, "step_profile": "off"}, max_batch_size=8)
    assert off.engine.draft_len_policy.step_time == {}  # "off": measured online, as without a profile


def test_a_profile_measured_for_smaller_batches_is_measured_again_for_larger_ones(eagle, tmp_path, monkeypatch):
    spec = {"decoding_type": "MTP", "num_nextn_predict_layers": 2, "adaptive_draft_len": True,
            "step_profile": "auto", "step_profile_dir": str(tmp_path)}
    measured = []
    real = step_profiler.measure_step_time
    monkeypatch.setattr(step_profiler, "measure_step_time", lambda target: measured.append(1) or real(target, False, 1e9))
    small = LLM(eagle, speculative_config=spec, max_batch_size=2)
    assert set(small.engine.draft_len_policy.step_time) == {1, 2} and len(measured) == 1
    LLM(eagle, speculative_config=spec, max_batch_size=2)
    assert len(measured) == 1  # the same sizes: read from the cache
    big = LLM(eagle, speculative_config=spec, max_batch_size=8)  # a server with more slots: buckets 4 and 8 missing
    assert len(measured) == 2 and set(big.engine.draft_len_policy.step_time) == {1, 2, 4, 8}
    (path,) = tmp_path.iterdir()
    assert set(load_step_profile(path).step_time) == {1, 2, 4, 8}  # the larger profile replaced the smaller
    LLM(eagle, speculative_config=spec, max_batch_size=4)
    assert len(measured) == 2  # a subset of what is cached: read


def test_the_time_budget_leaves_larger_batches_to_online_timing_once(eagle, tmp_path, monkeypatch, caplog):
    """Past `BUDGET_S` the larger batch sizes are not timed at load: the profile records them as left online, the
    policy explores them as without a profile, later loads do not measure them, and the output is plain's."""
    spec = {"decoding_type": "MTP", "num_nextn_predict_layers": 2, "adaptive_draft_len": True,
            "step_profile": "auto", "step_profile_dir": str(tmp_path)}
    monkeypatch.setattr(step_profiler, "BUDGET_S", 1e-6)  # only the first batch size fits
    with caplog.at_level(logging.INFO, logger="nextn.runtime.step_profiler"):
        llm = LLM(eagle, speculative_config=spec, max_batch_size=8)
    assert "batch sizes [2, 4, 8] left to online timing" in caplog.text
    (path,) = tmp_path.iterdir()
    saved = load_step_profile(path)
    assert set(saved.step_time) == {1} and saved.left_online == [2, 4, 8]
    assert set(llm.engine.draft_len_policy.step_time) == {1}
    ref = [o.outputs[0].token_ids for o in LLM(eagle, speculative_config=None, max_batch_size=8).generate(PROMPTS, SP)]
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SP)] == ref

    def no_measuring(*args, **kwargs):
        raise AssertionError("the buckets left online should not be measured again")
    monkeypatch.setattr(step_profiler, "measure_step_time", no_measuring)
    LLM(eagle, speculative_config=spec, max_batch_size=8)
