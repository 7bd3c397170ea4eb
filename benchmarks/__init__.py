"""Studies that informed a design: one-off measurements (kernels, drafters, suffix replays, structured output, the
decode step on a GPU, ...) whose figures are quoted in docs/PERFORMANCE.md and docs/performance-history.md.

Run from the repository root as `python -m benchmarks.<name>` (`--help` lists each one's options). They are not
part of the installed product: setuptools packages `src/` only, and nothing under `src/` imports them (they import
`nextn`, never the reverse). The product's own benchmarks (`nextn-bench`, `python -m nextn.bench.vs_llama_cpp`,
`python -m nextn.bench.serve`) stay in `src/nextn/bench/`.
"""
