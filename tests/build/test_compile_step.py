"""`build-engine --compile_step`: the decode step is compiled (inductor) at build time, its artifacts are stored in
the engine directory and recorded in the manifest, and a later load in an empty inductor cache reuses them (cache
hits, no miss) with the same greedy tokens as eager decoding."""

from __future__ import annotations

import hashlib

import pytest
import torch
from torch._dynamo.utils import counters

from nextn import LLM, SamplingParams
from nextn.build.manifest import EngineManifest
from nextn.cli.build_engine import main
from nextn.runtime.compiled_step import compile_decode_fn
from nextn.testing import SMALL_VOCAB

# One dense layer and no drafting: the smallest step inductor can compile (C++ kernels build slowly on 2 cores).
TINY = dict(SMALL_VOCAB, num_hidden_layers=1, first_k_dense_replace=1)


@pytest.mark.slow
def test_build_engine_compile_step_stores_artifacts_that_a_later_load_reuses(checkpoints, tmp_path, monkeypatch,
                                                                             capsys):
    ckpt = checkpoints.checkpoint(num_mtp_modules=1, **TINY)
    yaml = tmp_path / "args.yaml"
    yaml.write_text("speculative_config: null\ntorch_compile_config: {enable_inductor: true}\n")
    out = tmp_path / "engine"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor_build"))
    torch._dynamo.reset()
    assert main(["--model_dir", str(ckpt), "--output_dir", str(out), "--extra_llm_api_options", str(yaml),
                 "--max_batch_size", "4", "--compile_step", "--compile_batch_sizes", "2", "--compile_device", "cpu",
                 "--no-progress"]) == 0
    assert "compiled:   compiled/torch_compile_cache.bin" in capsys.readouterr().out

    info = EngineManifest.load(out).compiled_step
    assert info is not None
    assert (info.torch_version, info.device_type, info.batch_sizes, info.draft_len, info.cpu_threads) == \
        (torch.__version__, "cpu", [2], 0, torch.get_num_threads())
    assert hashlib.sha256((out / info.file).read_bytes()).hexdigest() == info.sha256
    assert info.artifacts.get("inductor", 0) >= 1 and info.num_kernels >= 1
    assert hashlib.sha256((out / info.kernels_file).read_bytes()).hexdigest() == info.kernels_sha256

    prompts = [[5, 6, 7, 8], [9, 10], list(range(20, 50))]
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    llm = LLM(out, disable_overlap_scheduler=True)
    eager = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]

    # A later load: nothing compiled in memory, an empty inductor cache directory.
    load_cache = tmp_path / "inductor_load"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(load_cache))
    torch._dynamo.reset()
    counters.clear()
    runner = llm.engine.runner
    runner.decode_fn = compile_decode_fn(runner.decode_fn, out, "cpu")
    assert len(list(load_cache.glob("*/*.so"))) == info.num_kernels  # the built kernels, not rebuilt
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp)] == eager
    assert counters["inductor"]["fxgraph_cache_hit"] >= 1
    assert counters["inductor"]["fxgraph_cache_miss"] == 0
