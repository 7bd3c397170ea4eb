"""fp32 logits of nextn's DeepSeek-V3 match Hugging Face `transformers` on the same checkpoint."""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV3ForCausalLM as HFDeepseekV3

from nextn.testing import SMALL_VOCAB as SMALL
from nextn.build.engine_builder import build_engine
from nextn.speculative.acceptance_rules import StandardAcceptance, greedy_sampling
from nextn.speculative.chain_step import prefill_step
from nextn.speculative.chain_step import NoDrafter
from nextn.models.kv_cache import allocate_kv_cache

CONFIGS = {
    "q_lora+yarn+groups": dict(),
    "q_proj(no q_lora)": dict(q_lora_rank=None),
    "4 groups, top-2 groups, 3 experts/token": dict(n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=3),
    "all dense": dict(first_k_dense_replace=3),
}


def _engine_model(ckpt, tmp_path):
    from nextn import LLM

    engine = tmp_path / "engine"
    build_engine(ckpt, engine, progress=False, extra_llm_api_options=None)
    return LLM(engine, speculative_config=None).engine


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_transformers(checkpoints, tmp_path, name):
    ckpt = checkpoints.checkpoint(num_mtp_modules=1, **SMALL, **CONFIGS[name])
    engine = _engine_model(ckpt, tmp_path)
    hf = HFDeepseekV3.from_pretrained(ckpt).eval()
    assert hf.config.rope_parameters["rope_type"] == "yarn"
    gen = torch.Generator().manual_seed(0)
    lens = [37, 5, 20]
    ids = torch.randint(0, 512, (3, max(lens)), generator=gen)
    cfg = engine.cfg
    kv = allocate_kv_cache(engine.model.num_cache_layers, 16, 8, cfg.kv_cache_dim, torch.float32)
    tables = torch.tensor([[1, 2, 3, 4, 5], [6, 7, 0, 0, 0], [8, 9, 10, 0, 0]])
    with torch.inference_mode():
        # Batched prefill over right-padded prompts, then the logits at every real position.
        from nextn.models.attention_metadata import AttentionMetadata, slots_for_positions

        pos = torch.arange(ids.shape[1]).expand(3, -1)
        valid = pos < torch.tensor(lens)[:, None]
        meta = AttentionMetadata.create(pos, slots_for_positions(tables, pos, 8, valid), tables, 8)
        logits = engine.model.logits(engine.model(ids, kv, meta))
        for b, n in enumerate(lens):
            ref = hf(ids[b : b + 1, :n]).logits[0]
            torch.testing.assert_close(logits[b, :n], ref, atol=1e-4, rtol=1e-4)
        # Incremental decode over the paged cache matches the full forward too.
        out = prefill_step(engine.model, NoDrafter(), StandardAcceptance(), kv, ids, torch.tensor(lens), tables,
                           greedy_sampling(3), (), 8)
        ref_next = torch.stack([hf(ids[b : b + 1, :n]).logits[0, -1].argmax() for b, n in enumerate(lens)])
        assert out.tokens[:, 0].tolist() == ref_next.tolist()
