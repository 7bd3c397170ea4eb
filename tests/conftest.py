"""Shared fixtures: tiny DeepSeek-V3 checkpoints (HF `save_pretrained` + DeepSeek's MTP layout) and their engines.

Checkpoints are made by `nextn.testing` (seeded, nothing committed) and cached per session, keyed by their spec.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Under pytest-xdist (the README's `-n 2`) the workers share the cores: an OpenMP thread waiting for work sleeps
# instead of spinning (spinning threads of two processes on two cores made the suite ~3x slower). Set before torch
# loads its OpenMP runtime; each worker keeps torch's default thread count, so the kernels' threaded paths still run.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Triton's interpreter must be on before anything imports triton (torch.compile does): triton.language's own
# @jit helpers (tl.max, tl.cumsum, ...) are built at import. Only without CUDA: on a GPU the kernels compile for real
# (tests/plugins/kernels/conftest.py sets it too, for that folder run on its own).
if not os.environ.get("CUDA_VISIBLE_DEVICES") and not Path("/dev/nvidia0").exists():
    os.environ.setdefault("TRITON_INTERPRET", "1")

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"

# avx2_vnni is avx2 with other int8 dot products (plugins/simd_int8.h, simd_int16.h) and nothing else. Where it is not
# the CPU's best variant (a Zen 4 or an Ice Lake runs it through its EVEX stand-in, beside its avx512 variants), its
# per-variant tests are those of the kernels that take int8 dot products: W4A8 (`int8-x` in the linears' ids), the
# int8 linears (W8A16, int8 kv_b), and the tests marked `int8_dots` — the rest is avx2's code, tested as avx2.
_INT8_DOTS = ("W4A8", "w4a8", "int8", "W8A16")


def pytest_collection_modifyitems(config, items):
    from nextn.plugins import cpu_kernels

    runnable = cpu_kernels.runnable()
    if "avx2_vnni" not in runnable or runnable[0] == "avx2_vnni":
        return
    keep, drop = [], []
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        vnni = "avx2_vnni" in (params.get("kernel_variant"), params.get("variant"))
        int8 = item.get_closest_marker("int8_dots") is not None or any(s in item.nodeid for s in _INT8_DOTS)
        (drop if vnni and not int8 else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture(scope="session", autouse=True)
def _step_profiles_in_a_temporary_dir(tmp_path_factory):
    """Configs with `step_profile: auto` and no `step_profile_dir` (configs/*.yaml) cache their profiles here, not
    in the user's ~/.cache/nextn."""
    from nextn.runtime import step_profiler
    from nextn.speculative import step_profile

    path = tmp_path_factory.mktemp("step_profiles")
    with pytest.MonkeyPatch.context() as m:
        m.setattr(step_profile, "DEFAULT_PROFILE_DIR", path)
        m.setattr(step_profiler, "DEFAULT_PROFILE_DIR", path)
        yield


@pytest.fixture(autouse=True)
def _torch_threads_restored():
    """An in-process CLI `main` (`cli/threads.apply_threads`) sets torch's thread count for the whole process — to 1
    under xdist, where the other worker keeps a core busy; the next test starts from the count before it again."""
    import sys

    torch = sys.modules.get("torch")
    before = torch.get_num_threads() if torch is not None else None
    yield
    if before is not None and torch.get_num_threads() != before:
        torch.set_num_threads(before)


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not (SHARED_DATA / "prompts" / "mt_bench.jsonl").is_file():
        pytest.skip(f"../shared/data is absent ({SHARED_DATA}): real prompt sets are not available")
    return SHARED_DATA


class Checkpoints:
    """Session cache of checkpoints and engines by spec."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._made: dict[tuple, Path] = {}

    def checkpoint(self, distill_steps: int = 0, **spec_fields) -> Path:
        from nextn.testing import TinyDeepseekSpec, distill_mtp, make_tiny_checkpoint

        key = (distill_steps, tuple(sorted(spec_fields.items())))
        if key not in self._made:
            spec = TinyDeepseekSpec(**spec_fields)
            out = self.root / f"ckpt{len(self._made)}"
            make_tiny_checkpoint(out, spec)
            if distill_steps:
                distill_mtp(out, steps=distill_steps, seed=spec.seed, progress=False)
            self._made[key] = out
        return self._made[key]

    def engine(self, distill_steps: int = 0, build: dict | None = None, **spec_fields) -> Path:
        from nextn.build.engine_builder import build_engine

        ckpt = self.checkpoint(distill_steps, **spec_fields)
        out = ckpt.with_name(ckpt.name + "_engine" + "_".join(f"{k}{v}" for k, v in sorted((build or {}).items())))
        if not out.exists():
            build_engine(ckpt, out, progress=False, **(build or {}))
        return out


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> Checkpoints:
    return Checkpoints(tmp_path_factory.mktemp("checkpoints"))


# Engines shared by the runtime and speculative tests (session-scoped: built once).
@pytest.fixture(scope="session")
def eagle(checkpoints):
    """A tiny DeepSeek-V3 engine (small vocabulary) with one MTP module distilled for 150 steps: drafts get accepted."""
    from nextn.testing import SMALL_VOCAB

    return checkpoints.engine(distill_steps=150, num_mtp_modules=1, **SMALL_VOCAB)


@pytest.fixture(scope="session")
def vanilla(checkpoints):
    """The same with two undistilled MTP modules (MTP Vanilla)."""
    from nextn.testing import SMALL_VOCAB

    return checkpoints.engine(num_mtp_modules=2, **SMALL_VOCAB)


@pytest.fixture(scope="session")
def medusa_engine(checkpoints, tmp_path_factory):
    """A tiny DeepSeek-V3 engine (small vocabulary, one MTP module) with 3 seeded random Medusa heads of 1 layer."""
    import json

    import torch
    from safetensors.torch import save_file

    from nextn.build.engine_builder import build_engine
    from nextn.models.medusa import MedusaHeads
    from nextn.testing import SMALL_VOCAB

    tmp = tmp_path_factory.mktemp("medusa")
    torch.manual_seed(0)
    heads = MedusaHeads(3, 1, 64, SMALL_VOCAB["vocab_size"])
    (tmp / "heads").mkdir()
    save_file({k: v.contiguous() for k, v in heads.state_dict().items()}, str(tmp / "heads" / "medusa_lm_head.safetensors"))
    (tmp / "heads" / "config.json").write_text(json.dumps({"medusa_num_heads": 3, "medusa_num_layers": 1}))
    build_engine(checkpoints.checkpoint(num_mtp_modules=1, **SMALL_VOCAB), tmp / "engine", progress=False,
                 medusa_model_dir=tmp / "heads")
    return tmp / "engine"
