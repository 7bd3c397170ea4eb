"""Runtime-test fixtures shared across files."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from nextn.build.engine_builder import build_engine
from nextn.models.medusa import MedusaHeads
from nextn.testing.tiny_checkpoint import SMALL_VOCAB


@pytest.fixture(scope="session")
def eagle(checkpoints):
    """A tiny DeepSeek-V3 engine (small vocabulary) with one MTP module distilled for 150 steps: drafts get accepted."""
    return checkpoints.engine(distill_steps=150, num_mtp_modules=1, **SMALL_VOCAB)


@pytest.fixture(scope="session")
def vanilla(checkpoints):
    """The same with two undistilled MTP modules (MTP Vanilla)."""
    return checkpoints.engine(num_mtp_modules=2, **SMALL_VOCAB)


@pytest.fixture(scope="session")
def medusa_engine(checkpoints, tmp_path_factory):
    """A tiny DeepSeek-V3 engine (small vocabulary, one MTP module) with 3 seeded random Medusa heads of 1 layer."""
    tmp = tmp_path_factory.mktemp("medusa")
    torch.manual_seed(0)
    heads = MedusaHeads(3, 1, 64, SMALL_VOCAB["vocab_size"])
    (tmp / "heads").mkdir()
    save_file({k: v.contiguous() for k, v in heads.state_dict().items()}, str(tmp / "heads" / "medusa_lm_head.safetensors"))
    (tmp / "heads" / "config.json").write_text(json.dumps({"medusa_num_heads": 3, "medusa_num_layers": 1}))
    build_engine(checkpoints.checkpoint(num_mtp_modules=1, **SMALL_VOCAB), tmp / "engine", progress=False,
                 medusa_model_dir=tmp / "heads")
    return tmp / "engine"
