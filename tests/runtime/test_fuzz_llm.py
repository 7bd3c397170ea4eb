"""Issue 12's fuzz test of the request API: seeded and time-bounded, random and mutated bad requests (and requests
that make a step fail) thrown at LLM.add_request / step / generate while good requests run. Every good request must
finish with exactly its solo output, every bad one get a named error, the KV cache come back full, the LLM stay
usable, and nothing in the test's directories change. The figures are printed (docs/RELIABILITY.md quotes them);
longer runs: `python -m nextn.testing.fuzz_llm --seconds N`."""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

import pytest

from nextn import LLM
from nextn.testing import SMALL_VOCAB as SMALL
from nextn.testing.fuzz_llm import fuzz_llm

MTP3 = {"decoding_type": "MTP", "num_nextn_predict_layers": 3}


def _snapshot(*dirs: Path) -> dict[str, str]:
    files = {}
    for d in dirs:
        for root, _, names in os.walk(d):
            for name in names:
                p = Path(root) / name
                files[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
    return files


@pytest.mark.slow
def test_fuzz_llm_request_api(checkpoints, tmp_path, monkeypatch, capsys):
    engine_dir = checkpoints.engine(build={"max_seq_len": 64}, num_mtp_modules=1, **SMALL)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "user_file.txt").write_text("keep me\n")
    before = _snapshot(engine_dir, tmp_path)
    llm = LLM(engine_dir, speculative_config=MTP3, device="cpu")
    logging.disable(logging.CRITICAL)  # the injected faults log a traceback each
    try:
        report = fuzz_llm(llm, seconds=15, seed=12)
    finally:
        logging.disable(logging.NOTSET)
    with capsys.disabled():
        print("\n" + report.summary())
    assert not report.failures, report.failures[:10]
    assert report.inputs_tried > 0 and report.good_requests > 0
    assert report.good_intact == report.good_requests
    assert report.clean_errors + report.accepted == report.inputs_tried  # each input: a named error, or it ran
    assert llm.engine.pool.num_free == llm.engine.pool.num_blocks - 1 and not llm.engine.has_work
    assert _snapshot(engine_dir, tmp_path) == before
