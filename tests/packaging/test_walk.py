"""The house stays easy to read: a request's walk (docs/ARCHITECTURE.md, "A request's walk") crosses the files that
page lists, and no others. Traced, not asserted from reading: a synchronous `LLM.generate` of the tiny MTP Eagle
engine runs under `sys.setprofile` and every nextn source file one of whose functions runs is recorded.

The model's forward (`models/`, `quantization/`, `plugins/`: the family's decoder layers and nextn's kernels) is one
entry of the walk and is left out here; everything else must be exactly the documented set. A change that adds a file
to the walk fails this test: either keep the walk short or update the page and the lists below together.
"""

from __future__ import annotations

import sys
from pathlib import Path

from nextn import LLM, SamplingParams

# The spine: the files a reader follows from LLM.generate to the acceptance rule and back.
SPINE = {
    "runtime/llm.py", "runtime/engine.py", "runtime/scheduler.py", "runtime/step_plan.py",
    "runtime/model_runner.py", "speculative/chain_step.py", "speculative/acceptance_rules.py", "speculative/mtp.py",
}
# One hop each from the spine: admission, KV blocks, the draft length, references, types with behaviour.
ONE_HOP = {
    "progress.py", "runtime/parallel_sampling.py", "runtime/request_validation.py", "runtime/sampling_params.py",
    "runtime/kv_cache.py", "runtime/prefix_cache.py", "speculative/draft_len_policy.py",
    "speculative/acceptance_reference.py", "speculative/protocol.py", "runtime/request.py", "runtime/outputs.py",
}
MODEL = ("models/", "quantization/", "plugins/")


def _walk(engine_dir: Path) -> set[str]:
    llm = LLM(engine_dir, speculative_config={"decoding_type": "MTP", "num_nextn_predict_layers": 1})
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    llm.generate([[5, 6, 7, 8], [9, 10, 11]], params)  # warm: lazy imports and first-call paths are not the walk
    seen: set[str] = set()
    src = str(Path(__import__("nextn").__file__).parent) + "/"

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(src):
            seen.add(frame.f_code.co_filename[len(src):])

    sys.setprofile(profile)
    try:
        outs = llm.generate([[5, 6, 7, 8], [9, 10, 11]], params)
    finally:
        sys.setprofile(None)
    assert all(len(o.outputs[0].token_ids) == 8 for o in outs)
    return seen


def test_the_walk_crosses_the_documented_files(eagle):
    seen = _walk(eagle)
    model = {f for f in seen if f.startswith(MODEL)}
    assert "models/causal_lm.py" in model  # the trace saw the forward
    walk = seen - model
    assert walk == SPINE | ONE_HOP, (
        f"the walk now crosses {sorted(walk - SPINE - ONE_HOP)} and no longer {sorted(SPINE | ONE_HOP - walk)}: "
        "keep it short, or update docs/ARCHITECTURE.md ('A request's walk') and these lists")
    assert len(SPINE) + 2 <= 10  # the spine plus the model's forward (causal_lm and the family's layers)


def test_the_architecture_page_names_every_file_of_the_walk():
    page = (Path(__file__).parents[2] / "docs" / "ARCHITECTURE.md").read_text()
    walk_section = page.split("## A request's walk", 1)[1].split("\n## ", 1)[0]
    missing = sorted(f for f in SPINE | ONE_HOP if f"`{f}`" not in walk_section)
    assert not missing, f"docs/ARCHITECTURE.md's walk does not name {missing}"
