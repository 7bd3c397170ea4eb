"""The bandwidth floor helper: bytes per decode step count one embedding row and only the selected experts."""

from __future__ import annotations

from nextn.bench.bandwidth import decode_step_bytes, main, read_bandwidth_gbs
from nextn.testing import SMALL_VOCAB


def test_decode_step_bytes(checkpoints, capsys):
    engine = checkpoints.engine(num_mtp_modules=1, **SMALL_VOCAB)
    step, total = decode_step_bytes(engine)
    # vocab 512 × hidden 64 fp32: the embedding costs one row (256 B) instead of 128 KiB.
    assert 0 < step < total - 512 * 64 * 4 + 64 * 4 + 1
    assert read_bandwidth_gbs(size_mib=16, repeats=2) > 0
    assert main(["--engine_dir", str(engine)]) == 0 and "floor" in capsys.readouterr().out
