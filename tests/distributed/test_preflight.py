"""Parallel sizes checked against the model and the machine before any worker process starts (issue 32, class 3):
a size that cannot work is a named `MappingError` and no process was created."""

from __future__ import annotations

import subprocess

import pytest

from nextn import LLM
from nextn.build.manifest import EngineManifest
from nextn.distributed import launcher, preflight
from nextn.distributed.mapping import Mapping, MappingError
from nextn.distributed.preflight import check_model_split
from nextn.testing import SMALL_VOCAB


@pytest.fixture
def no_processes(monkeypatch):
    """Fails the test if a worker process would be started."""
    def refuse(*args, **kwargs):
        raise AssertionError(f"a process was started: {args}")

    monkeypatch.setattr(launcher.subprocess, "Popen", refuse)
    monkeypatch.setattr(subprocess, "Popen", refuse)


def test_a_huge_tensor_parallel_size_from_yaml_starts_no_process(llama_engine, tmp_path, no_processes):
    yaml = tmp_path / "opts.yaml"
    yaml.write_text("tensor_parallel_size: 1024\n")
    with pytest.raises(MappingError, match="num_key_value_heads = 2 is not divisible by 1024"):
        LLM(llama_engine, speculative_config=None, extra_llm_api_options=yaml, device="cpu")


def test_more_ranks_than_cpu_cores_starts_no_process(llama_engine, monkeypatch, no_processes):
    monkeypatch.setattr(preflight.os, "sched_getaffinity", lambda pid: {0})
    with pytest.raises(MappingError, match="tensor_parallel_size = 2 needs 2 ranks on this machine but it has 1 CPU"):
        LLM(llama_engine, speculative_config=None, tensor_parallel_size=2, device="cpu")


def test_more_ranks_than_gpus_is_refused(monkeypatch):
    monkeypatch.setattr(preflight.torch.cuda, "device_count", lambda: 1)
    with pytest.raises(MappingError, match="has 1 CUDA devices"):
        preflight.check_machine(Mapping(world_size=2, tp_size=2), "cuda")


def test_expert_parallelism_on_a_model_without_experts_is_refused(llama_engine, no_processes):
    with pytest.raises(MappingError, match="no routed experts"):
        LLM(llama_engine, speculative_config=None, tensor_parallel_size=2, moe_expert_parallel_size=2, device="cpu")
    with pytest.raises(MappingError, match="must divide tensor_parallel_size"):  # checked even for one rank
        LLM(llama_engine, speculative_config=None, moe_expert_parallel_size=2, device="cpu")


def test_every_split_dimension_of_deepseek_v3_is_checked(checkpoints):
    cfg = EngineManifest.load(checkpoints.engine(**SMALL_VOCAB)).model
    assert cfg.n_routed_experts and cfg.num_attention_heads % 2 == 0
    check_model_split(cfg, Mapping(world_size=2, tp_size=2, moe_ep_size=2))  # the tiny model splits in two
    cases = [({"num_attention_heads": 6}, 4, 1, "num_attention_heads = 6 is not divisible by 4"),
             ({"n_routed_experts": 6}, 4, 4, "n_routed_experts = 6 is not divisible by 4"),
             ({"moe_intermediate_size": 6}, 4, 1, "moe_intermediate_size = 6 is not divisible by moe_tp_size"),
             ({"intermediate_size": 6, "first_k_dense_replace": 1}, 4, 4, "intermediate_size = 6"),
             ({"num_attention_heads": 8, "moe_intermediate_size": 12, "n_shared_experts": 1}, 8, 8, "shared experts")]
    for update, tp, ep, message in cases:
        with pytest.raises(MappingError, match=message):
            check_model_split(cfg.model_copy(update=update), Mapping(world_size=tp, tp_size=tp, moe_ep_size=ep))
    with pytest.raises(MappingError, match="weight-only quantized"):
        check_model_split(cfg, Mapping(world_size=2, tp_size=2), quantized=True)


def test_families_the_split_does_not_compute_yet_are_refused_by_name():
    """Gemma 3 / Granite (scaled embeddings), OLMo 2 (a q/k norm over all heads) and the softmax-routed MoE families
    run unsplit for now."""
    from nextn.models.llama import LlamaModelConfig

    base = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2)
    two = Mapping(world_size=2, tp_size=2)
    check_model_split(LlamaModelConfig.from_hf({**base, "architectures": ["Qwen3ForCausalLM"]}), two)
    for arch, what in (("Gemma3ForCausalLM", "embedding_multiplier"), ("Olmo2ForCausalLM", "all_heads")):
        with pytest.raises(MappingError, match=f"{arch} .*{what}.*tensor_parallel_size 1"):
            check_model_split(LlamaModelConfig.from_hf({**base, "architectures": [arch], "sliding_window": 8}), two)
    moe = LlamaModelConfig.from_hf({**base, "architectures": ["Qwen3MoeForCausalLM"], "num_experts": 4,
                                    "num_experts_per_tok": 2, "moe_intermediate_size": 64})
    with pytest.raises(MappingError, match="Qwen3MoeForCausalLM .*num_experts.*tensor_parallel_size 1"):
        check_model_split(moe, two)
