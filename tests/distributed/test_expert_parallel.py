"""Expert parallelism's local experts, without processes: the ranks' partial sums add up to the unsplit layer on
both dispatch paths (gathered weights for few assignments, per-expert buffers for many)."""

from __future__ import annotations

import pytest
import torch

from nextn.distributed.expert_parallel import LocalExperts
from nextn.models.config import DeepseekV3ModelConfig
from nextn.models.deepseek_v3.moe import RoutedExperts


@pytest.mark.parametrize("num_tokens", [1, 3, 40])  # 1 · top_k ≤ E_l: gathered; 40: buffers on every rank
@pytest.mark.parametrize("ep,moe_tp", [(2, 1), (4, 1), (2, 2)])
def test_local_experts_sum_to_the_full_layer(num_tokens, ep, moe_tp):
    cfg = DeepseekV3ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
                                num_hidden_layers=1, num_attention_heads=2, n_routed_experts=8,
                                num_experts_per_tok=2, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4,
                                v_head_dim=4)
    torch.manual_seed(0)
    full = RoutedExperts(cfg)
    with torch.no_grad():
        full.gate_up_proj.normal_()
        full.down_proj.normal_()
    x = torch.randn(num_tokens, 16)
    ids = torch.stack([torch.randperm(8)[:2] for _ in range(num_tokens)])  # distinct experts per token
    weights = torch.rand(num_tokens, 2)
    total = torch.zeros(num_tokens, 16)
    e_local, width = 8 // ep, 8 // moe_tp
    for rank in range(ep * moe_tp):
        local = LocalExperts(full, e_local, (rank // moe_tp) * e_local, width, (moe_tp, rank % moe_tp))
        shard = local.shard(full.gate_up_proj.detach(), full.down_proj.detach(), "")
        local.load_state_dict(shard, assign=True)
        total += local(x, weights, ids)
    torch.testing.assert_close(total, full(x, weights, ids), rtol=1e-5, atol=1e-5)
