"""Issue 12 item 4: every engine size is checked against the model and against the memory there is before the KV
cache (or the rope table) is allocated; the error says what the KV cache would need, what there is, and the fix."""

from __future__ import annotations

import json
import shutil

import pytest

import nextn.runtime.engine_loader as engine_mod
import nextn.runtime.engine_sizes as engine_sizes
from nextn import LLM
from nextn.build.manifest import EngineError
from nextn.runtime.engine_sizes import EngineSizeError, available_memory
from nextn.testing import SMALL_VOCAB as SMALL


@pytest.fixture(scope="module")
def engine_dir(checkpoints):
    return checkpoints.engine(num_mtp_modules=1, **SMALL)  # max_position_embeddings 2048


@pytest.fixture
def no_allocation(monkeypatch):
    """Fail the test if the KV cache is allocated."""
    def refuse(*args, **kwargs):
        raise AssertionError("the KV cache was allocated before the sizes were checked")
    monkeypatch.setattr(engine_mod, "allocate_kv_cache", refuse)


def test_max_seq_len_beyond_the_model_is_refused(engine_dir, tmp_path, no_allocation):
    opts = tmp_path / "opts.yaml"
    opts.write_text("max_seq_len: 100000\n")
    with pytest.raises(EngineSizeError, match=r"max_seq_len = 100000 \(the engine was built for 2048\) exceeds the "
                                              "model's max_position_embeddings 2048"):
        LLM(engine_dir, extra_llm_api_options=opts, device="cpu")


def test_a_manifest_with_a_huge_max_seq_len_is_refused(engine_dir, tmp_path, no_allocation, monkeypatch):
    copy = tmp_path / "engine"
    shutil.copytree(engine_dir, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["build_options"]["max_seq_len"] = 10**9
    (copy / "manifest.json").write_text(json.dumps(manifest))
    # Refused when the manifest is read (build/manifest.py) or, at the latest, here before any allocation.
    with pytest.raises((EngineSizeError, EngineError),
                       match="max_seq_len.{0,3}1000000000 exceeds the model's max_position_embeddings.{0,3}2048") as e:
        LLM(copy, device="cpu")
    monkeypatch.undo()
    if isinstance(e.value, EngineSizeError):
        assert LLM(copy, device="cpu", max_seq_len=128).engine.max_seq_len == 128  # the fix it names works


def test_a_kv_cache_larger_than_memory_is_refused_with_both_figures(engine_dir, no_allocation):
    with pytest.raises(EngineSizeError) as e:
        LLM(engine_dir, device="cpu", kv_cache_config={"max_tokens": 2**31 - 1})
    msg = str(e.value)
    assert "the KV cache would need 1280.00 GiB" in msg and "kv_cache_config.max_tokens" in msg
    assert "GiB, of which kv_cache_config.free_gpu_memory_fraction allows" in msg


def test_the_default_kv_cache_is_checked_against_available_memory(engine_dir, monkeypatch, no_allocation):
    monkeypatch.setattr(engine_sizes, "available_memory", lambda device: (64 << 20, "test memory"))
    with pytest.raises(EngineSizeError) as e:
        LLM(engine_dir, device="cpu", max_batch_size=64)
    msg = str(e.value)
    assert "max_batch_size 64 × max_seq_len 2048" in msg and "test memory is 0.06 GiB" in msg
    assert "lower max_seq_len or max_batch_size" in msg and "set kv_cache_config.max_tokens to at most" in msg
    fit = int(msg.split("max_tokens to at most ")[1].split()[0])
    monkeypatch.undo()
    monkeypatch.setattr(engine_sizes, "available_memory", lambda device: (64 << 20, "test memory"))
    llm = LLM(engine_dir, device="cpu", max_batch_size=64, kv_cache_config={"max_tokens": fit})  # the fix works
    assert llm.engine.pool.capacity_tokens >= fit


def test_weights_larger_than_memory_are_refused_before_they_are_read(engine_dir, monkeypatch):
    """The weights' resident size (their files' bytes) against the memory there is, before any is read: a named error
    with both figures and the fix."""
    def refuse(*args, **kwargs):
        raise AssertionError("the weights were read before their size was checked")
    monkeypatch.setattr(engine_mod, "read_weights", refuse)
    monkeypatch.setattr(engine_sizes, "available_memory", lambda device: (1 << 10, "test memory"))
    with pytest.raises(EngineSizeError, match=r"the engine's weights need 0\.\d\d GiB of memory and test memory is "
                                              r"0\.00 GiB: free memory, or build a smaller format \(--quant_algo W4A16"):
        LLM(engine_dir, device="cpu")


def test_available_memory_reads_the_host():
    avail, what = available_memory(engine_mod.torch.device("cpu"))
    assert avail > 0 and what


def test_cpu_kv_cache_is_resident_only_where_written():
    import torch

    from nextn.models.kv_cache import allocate_kv_cache

    def rss_bytes() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    before = rss_bytes()
    kv = allocate_kv_cache(8, 4096, 16, 256, torch.bfloat16)  # 256 MiB of zeros
    assert kv.shape == (8, 4096 * 16, 256) and kv.dtype == torch.bfloat16 and kv.is_contiguous()
    assert rss_bytes() - before < 32 * 2**20  # not written yet: (almost) nothing resident
    kv[2].index_copy_(0, torch.tensor([5, 60000]), torch.ones(2, 256, dtype=torch.bfloat16))
    assert kv[2, 5].sum() == 256 and kv[2, 6].abs().sum() == 0 and kv[7, 65535].abs().sum() == 0
