"""The attention-kernel benchmark runs at small shapes, prints one line per shape, and refuses bad shapes."""

from __future__ import annotations

import pytest

from benchmarks import attention_kernel
from nextn.plugins import cpu_kernels

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason=f"nextn's CPU kernels are unavailable here: "
                                f"{cpu_kernels.unavailable_reason()}")


def test_prints_a_line_per_shape(capsys):
    assert attention_kernel.main(["--shapes", "1x16", "9x40", "--heads", "4", "2", "8", "--iters", "2",
                                  "--layers", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("4 query heads, 2 KV heads, head_dim 8")
    assert len(lines) == 3 and lines[1].startswith("T=    1") and lines[2].startswith("T=    9")
    assert "S=   16" in lines[1] and "S=   40" in lines[2] and "for 3 layers" in lines[2]
    assert "a cache per layer" in lines[0] and "GB/s" in lines[2]


def test_alternates_variants_in_one_process(capsys):
    """A line per (shape, variant), the variant named; every layer on one cache with --one_cache."""
    variants = cpu_kernels.runnable()[-2:]
    assert attention_kernel.main(["--shapes", "1x32", "--heads", "4", "2", "16", "--iters", "2", "--layers", "2",
                                  "--one_cache", "--variants", *variants]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "one cache" in lines[0] and len(lines) == 1 + len(variants)
    assert [line.split()[0] for line in lines[1:]] == variants


def test_caches_beyond_the_bound_are_refused_before_allocating(capsys):
    with pytest.raises(SystemExit):
        attention_kernel.main(["--shapes", "1x32768", "--layers", "500"])
    assert "GiB" in capsys.readouterr().err


@pytest.mark.parametrize("shape", ["7x3", "ax4", "0x5", "1x40000"])
def test_bad_shapes_are_refused(shape, capsys):
    with pytest.raises(SystemExit):
        attention_kernel.main(["--shapes", shape])
    err = capsys.readouterr().err
    assert "--shapes takes TxS pairs" in err or "need 1 ≤ T ≤ S ≤ 32768" in err
