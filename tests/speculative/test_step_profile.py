"""Step profiles (speculative/step_profile.py, runtime/step_profiler.py): the file round-trips, is refused when
malformed or oversized and never replaces a file it did not write; another machine's profile is measured again with
one line saying so; a policy seeded from a profile makes at once the decision a measuring one converges to."""

from __future__ import annotations

import json
import logging

import pytest
import torch

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
    assert len(lines) == 1 and lines[0].startswith(
        f"step profile for tiny was measured on Some Other CPU/{here.threads + 3} threads") and "re-profiling" in lines[0]
    save_step_profile(profile(here), tmp_path)  # a profile of ours: replaced
    assert load_step_profile(profile_path(tmp_path, DIGEST)).key == here


@pytest.mark.parametrize("content, error", [
    (b"{not json", "not a valid step profile"),
    (b'{"format": "nextn.step_profile", "version": 1}', "not a valid step profile: key"),
    (b" " * (MAX_PROFILE_BYTES + 1), f"over {MAX_PROFILE_BYTES} bytes"),
])
def test_malformed_or_oversized_files_are_refused(tmp_path, caplog, content, error):
    path = profile_path(tmp_path, DIGEST)
    path.write_bytes(content)
    with pytest.raises(StepProfileError, match=error):
        load_step_profile(path)
    with caplog.at_level(logging.WARNING):  # the loader measures again ...
        assert cached_step_profile(tmp_path, profile().key, "tiny") is None
    assert error in caplog.text
    with pytest.raises(StepProfileError, match=error):  # ... and never replaces a file it did not write
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
    with pytest.raises(StepProfileError, match="not a regular file"):
        load_step_profile(link)
    with pytest.raises(StepProfileError, match="not a regular file"):
        save_step_profile(profile(), tmp_path / "links")


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


def test_a_seeded_policy_still_probes_acceptance_while_off_and_measures_unprofiled_buckets():
    seeded = AdaptiveDraftLen(StaticDraftLen(4), probe_every=3, profile={1: TABLE[1]})
    seeded.observe(4, 0, 4, 1, 0.0)  # nothing accepted: off at batch 1 ...
    ks = [seeded.draft_len(1) for _ in range(3)]
    assert ks[:2] == [0, 0] and ks[2] > 0  # ... with a probe that refreshes α after probe_every steps
    seeded.observe(8, 8, 4, 2, 0.012)  # batch 2 is not in the profile: measured as without one
    seeded.observe(8, 8, 4, 2, 0.012)
    assert seeded.step_time[2] == {4: 0.012} and seeded.draft_len(2) == 0  # its warm-up plain step
