"""`python -m benchmarks.kernels`: every kernel it times computes the same product (up to quantization)."""

from __future__ import annotations

import torch

from benchmarks.kernels import kernels, main


def test_kernels_have_the_output_shape_and_bf16_paths_agree():
    table = kernels(64, 64)
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    outs = {name: fn(x) for name, (fn, _) in table.items()}
    assert all(o.shape == (5, 64) for o in outs.values())
    if "bf16 packed" in outs:
        torch.testing.assert_close(outs["bf16 packed"].float(), outs["bf16"].float(), atol=1e-2, rtol=1e-2)
    assert table["int4 g32"][1] < table["int8"][1] < table["bf16"][1]  # bytes read


def test_cli_prints_a_row_per_row_count(capsys):
    assert main(["--shape", "32", "64", "--rows", "1", "3", "--iters", "2"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-2].split()[0] == "1" and lines[-1].split()[0] == "3"


def test_copies_cycle_nextns_kernels_over_distinct_matrices(capsys):
    from nextn.plugins import woq_linear

    table = kernels(64, 64, copies=3)
    assert all(name.startswith("nextn") for name in table) and (len(table) == 4) == woq_linear.available()
    assert main(["--shape", "64", "64", "--rows", "1", "--iters", "2", "--copies", "3"]) == 0
    assert "3 copies cycled" in capsys.readouterr().out


def test_dense_kernels_agree_and_the_dense_table_runs(capsys):
    from benchmarks.kernels import dense, dense_kernels

    table = dense_kernels(40, 64, copies=2)
    x = torch.randn(5, 64)
    outs = {name: fn(x.to(dtype)).float() for name, (fn, _, dtype) in table.items()}
    assert all(o.shape == (5, 40) for o in outs.values())
    for name, out in outs.items():  # each variant's first call reads the same copy: all within bf16 of fp32
        torch.testing.assert_close(out, outs["fp32 F.linear"], atol=0.1, rtol=0.05)
    results = dense([(40, 64)], rows=(1, 3), iters=2, threads=1)
    assert {(r["rows"], r["kernel"]) for r in results} == {(m, name) for m in (1, 3) for name in table}
    assert main(["--dense", "--shape", "40", "64", "--rows", "1", "--iters", "2", "--stream-mb", "0.01"]) == 0
    assert "2 copies cycled" in capsys.readouterr().out
