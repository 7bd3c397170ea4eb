"""Expert parallelism's local experts, without processes: the ranks' partial sums add up to the unsplit MoE layer's
routed experts on both dispatch paths (gathered weights for few assignments, per-expert buffers for many)."""

from __future__ import annotations

import pytest
import torch

from nextn.distributed.expert_parallel import LocalExperts
from nextn.models.moe import SparseMoE


@pytest.mark.parametrize("num_tokens", [1, 3, 40])  # 1 · top_k ≤ E_l: gathered; 40: buffers on every rank
@pytest.mark.parametrize("ep,moe_tp", [(2, 1), (4, 1), (2, 2)])
def test_local_experts_sum_to_the_full_layer(num_tokens, ep, moe_tp):
    torch.manual_seed(0)
    full = SparseMoE(16, 8, 2, 8, norm_topk_prob=True)
    with torch.no_grad():
        for p in full.parameters():
            p.normal_()
    x = torch.randn(num_tokens, 16)
    ids = torch.stack([torch.randperm(8)[:2] for _ in range(num_tokens)])  # distinct experts per token
    weights = torch.rand(num_tokens, 2)
    with torch.no_grad():  # each token's experts one by one: the reference
        expected = torch.stack([sum(weights[n, k] * full.experts[int(ids[n, k])](x[n]) for k in range(2))
                                for n in range(num_tokens)])
    engine = {f"{e}.{name}": t.detach() for e, ex in enumerate(full.experts) for name, t in ex.state_dict().items()}
    total = torch.zeros(num_tokens, 16)
    e_local, width = 8 // ep, 8 // moe_tp
    for rank in range(ep * moe_tp):
        local = LocalExperts(16, e_local, (rank // moe_tp) * e_local, width, 8, (moe_tp, rank % moe_tp))
        src = dict(engine)
        local.load_state_dict(local.shard(src, "", 8), assign=True)
        assert not src  # every expert's tensors taken, on every rank
        with torch.no_grad():
            total += local(x, weights, ids)
    torch.testing.assert_close(total, expected, rtol=1e-5, atol=1e-5)
