"""The tiny family checkpoints as the tests read them: the HF directory, or its llama.cpp-converted GGUF."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nextn.testing import gguf_rewrite, llama_cpp_converter


def tiny_source(hf_dir: Path, kind: str) -> Path:
    """The checkpoint to read: the HF directory (`kind` "hf"), or the f32 GGUF llama.cpp's converter makes of it
    (once; skips without the converter); "gguf-1d": that GGUF with its one-row weights 1-D, as `llama-quantize`
    writes them (`ggml_n_dims` drops a trailing 1)."""
    if kind == "hf":
        return hf_dir
    if llama_cpp_converter.find() is None:
        pytest.skip("llama.cpp's convert_hf_to_gguf.py is absent: `python -m nextn.testing.llama_cpp_converter "
                    "--fetch` (.ci/run does)")
    out = hf_dir / "tiny-f32.gguf"
    if not out.is_file():
        llama_cpp_converter.convert(_as_converted(hf_dir), out, "f32")
    return _one_row_squeezed(out, hf_dir / "tiny-f32-1d.gguf") if kind == "gguf-1d" else out


def _one_row_squeezed(src: Path, dst: Path) -> Path:
    """`src` rewritten to `dst` with every [1, n] tensor stored 1-D (the metadata and other tensors as they are)."""
    squeezed = []

    def tensor(t):
        one_row = t.data.ndim == 2 and t.data.shape[0] == 1
        squeezed.append(one_row)
        return (t.data.reshape(-1) if one_row else t.data), t.tensor_type

    if not dst.exists():
        gguf_rewrite.rewrite(src, dst, tensor)
        assert any(squeezed), f"{src} has no one-row tensor"
    return dst


#: model_type → the one the converter is shown: the converter reads the vocabulary through `transformers`'
#: AutoTokenizer, which for Qwen3.5-MoE rebuilds Qwen3.5's own pre-tokenizer over the tiny checkpoint's SmolLM2
#: vocabulary — a tokenizer the converter does not know (the released checkpoints' is known). Shown the dense model_type,
#: AutoTokenizer reads the files as they are; the converter dispatches on `architectures`, unchanged.
_TOKENIZER_MODEL_TYPE = {"qwen3_5_moe_text": "qwen3_5_text"}


def _as_converted(hf_dir: Path) -> Path:
    """`hf_dir`, or a view of it (links to its files; config.json's model_type per `_TOKENIZER_MODEL_TYPE`)."""
    config = json.loads((hf_dir / "config.json").read_text())
    if config.get("model_type") not in _TOKENIZER_MODEL_TYPE:
        return hf_dir
    view = hf_dir.parent / f"{hf_dir.name}-converter-view"
    view.mkdir(exist_ok=True)
    for f in hf_dir.iterdir():
        if f.is_file() and f.name != "config.json" and not (view / f.name).exists():
            (view / f.name).symlink_to(f)
    config["model_type"] = _TOKENIZER_MODEL_TYPE[config["model_type"]]
    (view / "config.json").write_text(json.dumps(config))
    return view


#: The drafters every family's engine is checked with: none, NGram, Suffix
DRAFTERS = (None, {"decoding_type": "NGram", "max_draft_len": 4}, {"decoding_type": "Suffix", "max_draft_len": 8})


def assert_engine_greedy(source: Path, engine: Path, prompt: list[int], want: list[int]) -> None:
    """build-engine `source` (float32) into `engine`, then greedy-decode `prompt` for len(`want`) tokens plainly and
    with each of `DRAFTERS`: every run must give `want` (the drafts change speed, never the tokens)."""
    from nextn import LLM, SamplingParams
    from nextn.build.engine_builder import build_engine

    build_engine(source, engine, dtype="float32", quant_algo=None, max_seq_len=256, progress=False)
    params = SamplingParams(max_tokens=len(want), ignore_eos=True)
    for spec in DRAFTERS:
        llm = LLM(engine, device="cpu", speculative_config=spec)
        got = llm.generate(prompt, params).outputs[0].token_ids
        llm.shutdown()
        assert got == want, spec


def assert_batch_invariant_engine(hf_dir: Path, engine_dir: Path, fmt: str, drafter: str):
    """Build `hf_dir` as a `fmt` (W4A16 / W4A8) engine under `engine_dir`: batch 12 = staggered = alone, token for
    token, with `drafter` ("none", "NGram", ...); the engine says it is batch-invariant. Returns an `LLM` of it (the
    caller checks which kernels run, then shuts it down); skips where nextn's CPU kernels are unavailable."""
    from nextn import LLM
    from nextn.plugins import dense_linear
    from nextn.testing import batch_invariance as bi

    if not dense_linear.available():
        pytest.skip(f"nextn's CPU kernels are unavailable here: {dense_linear.unavailable_reason()}")
    prompts = bi.id_prompts(6, 49152, num_fillers=6)
    eng = bi.build_format(hf_dir, fmt, engine_dir / fmt, max_seq_len=256)
    ref = bi.Reference(eng, prompts, 24)
    results = bi.run_cell(eng, fmt, drafter, bi.speculative_config(drafter), prompts, ref, 24,
                          ("alone", "batch", "staggered"))
    assert results and all(r.ok for r in results), "\n" + bi.format_table(results)
    llm = LLM(eng, speculative_config=None, device="cpu")
    assert llm.engine.batch_invariant
    return llm


def assert_text_model_greedy(hf, hf_dir: Path, engine_dir: Path, prompt: list[int], architecture: str) -> None:
    """A released vision-language checkpoint `hf_dir` (of the `transformers` model `hf`) builds as its text model
    (`architecture`), whose greedy tokens equal transformers' generate of the whole model (24 tokens)."""
    import torch

    from nextn import LLM, SamplingParams
    from nextn.build.engine_builder import build_engine

    with torch.no_grad():
        want = hf.generate(input_ids=torch.tensor([prompt]), max_new_tokens=24, do_sample=False, pad_token_id=0,
                           eos_token_id=None)[0, len(prompt):].tolist()
    build_engine(hf_dir, engine_dir, dtype="float32", quant_algo=None, max_seq_len=256, progress=False)
    llm = LLM(engine_dir, device="cpu")
    assert llm.engine.cfg.architecture == architecture
    assert llm.generate(prompt, SamplingParams(max_tokens=24, ignore_eos=True)).outputs[0].token_ids == want
    llm.shutdown()
