"""The compiled decode step (`compile_decode_fn`): same greedy tokens as eager over several batch sizes and table
widths with one graph per guard set, and stored artifacts ignored with a logged reason when they do not fit."""

from __future__ import annotations

import hashlib
import json
import logging

import pytest
import torch
from torch._dynamo.utils import counters

from nextn import LLM, SamplingParams
from nextn.build.manifest import CompiledStepInfo, EngineManifest
from nextn.config.llm_args import LlmArgsError, TorchCompileConfig, parse_llm_args
from nextn.runtime.compiled_step import (
    ARTIFACTS_FILE, compile_decode_fn, default_warmup_batch_sizes, load_compile_artifacts,
)  # fmt: skip
from nextn.testing import SMALL_VOCAB

PROMPTS = [[5, 6, 7, 8], [9], list(range(20, 60)), [100, 3, 100, 3, 7]]
# One target layer (dense) and an MoE MTP block: tracing the step is most of these tests' time.
TINY = dict(SMALL_VOCAB, num_hidden_layers=1, first_k_dense_replace=1)


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 3])
def test_compiled_step_matches_eager_greedy(checkpoints, k):
    """aot_eager traces the same graph inductor compiles (fullgraph, dynamic batch and width) at a fraction of the
    compile time; the inductor backend itself is checked in tests/build/test_compile_step.py."""
    engine = checkpoints.engine(num_mtp_modules=1, **TINY)
    llm = LLM(engine, speculative_config={"decoding_type": "MTP", "num_nextn_predict_layers": k})
    sp = SamplingParams(max_tokens=30, ignore_eos=True)  # crosses block boundaries: table widths 1, 2, 3
    eager = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp)]
    torch._dynamo.reset()
    counters.clear()
    runner = llm.engine.runner
    runner.decode_fn = compile_decode_fn(runner.decode_fn, None, "cpu", TorchCompileConfig(enable_inductor=False))
    compiled = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp)]
    assert compiled == eager
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:1], sp)] == eager[:1]  # B = 1
    # B 4 → 1 as requests finish and widths grow: B = 1 and B ≥ 2 (one range per MoE dispatch path) only.
    assert 1 <= counters["stats"]["unique_graphs"] <= 4


def _fake_artifacts(engine, **fields) -> None:
    data = b"not a torch cache"
    (engine / ARTIFACTS_FILE).parent.mkdir(exist_ok=True)
    (engine / ARTIFACTS_FILE).write_bytes(data)
    info = {"file": ARTIFACTS_FILE, "sha256": hashlib.sha256(data).hexdigest(), "num_bytes": len(data),
            "torch_version": torch.__version__, "device_type": "cpu", **fields}
    manifest = EngineManifest.load(engine)
    manifest.model_copy(update={"compiled_step": CompiledStepInfo(**info)}).save(engine)


@pytest.mark.parametrize("fields,reason", [
    ({"torch_version": "2.0.0"}, f"made with torch 2.0.0, this is torch {torch.__version__}"),
    ({"device_type": "cuda"}, "made for device type cuda, this engine runs on cpu"),
    ({"cpu_threads": torch.get_num_threads() + 1}, f"made with {torch.get_num_threads() + 1} torch threads"),
    ({"sha256": "0" * 64}, "does not match the manifest's sha256"),
    ({}, "torch could not load"),  # the metadata fits but the bytes are not a torch cache
])
def test_unusable_artifacts_are_ignored_with_a_reason(checkpoints, tmp_path, caplog, fields, reason):
    src = checkpoints.engine(num_mtp_modules=1, **TINY)
    engine = tmp_path / "engine"
    engine.mkdir()
    for f in src.iterdir():
        (engine / f.name).write_bytes(f.read_bytes())
    _fake_artifacts(engine, **fields)
    with caplog.at_level(logging.WARNING, logger="nextn.runtime.compiled_step"):
        assert load_compile_artifacts(engine, "cpu") is False
    assert reason in caplog.text and "ignored" in caplog.text
    LLM(engine)  # the engine itself still loads


def test_old_manifest_without_compiled_step_loads(checkpoints, tmp_path, caplog):
    src = checkpoints.engine(num_mtp_modules=1, **TINY)
    engine = tmp_path / "engine"
    engine.mkdir()
    for f in src.iterdir():
        (engine / f.name).write_bytes(f.read_bytes())
    data = json.loads((engine / "manifest.json").read_text())
    data.pop("compiled_step", None)
    (engine / "manifest.json").write_text(json.dumps(data))
    assert EngineManifest.load(engine).compiled_step is None
    with caplog.at_level(logging.WARNING, logger="nextn.runtime.compiled_step"):
        assert load_compile_artifacts(engine, "cpu") is False
    assert caplog.text == ""  # nothing stored is not worth a warning
    assert LLM(engine).generate([1, 2], SamplingParams(max_tokens=2)).finished


def test_torch_compile_config_in_llm_args():
    args = parse_llm_args({"torch_compile_config": {"enable_fullgraph": True, "enable_inductor": False}})
    assert args.torch_compile_config == TorchCompileConfig(enable_inductor=False)
    assert parse_llm_args({}).torch_compile_config is None  # default: eager
    with pytest.raises(LlmArgsError, match="enable_fullgraph, enable_inductor"):
        parse_llm_args({"torch_compile_config": {"enable_piecewise_cuda_graph": True}})


def test_default_warmup_batch_sizes():
    assert default_warmup_batch_sizes(8) == [1, 2, 4, 8]
    assert default_warmup_batch_sizes(6) == [1, 2, 4, 6]
    assert default_warmup_batch_sizes(1) == [1]
    assert default_warmup_batch_sizes(8, [16, 4, 1]) == [1, 4]
