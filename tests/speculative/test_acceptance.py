"""Strict acceptance against TensorRT-LLM's unit-test cases (REFERENCE.md §2) and a brute-force reference."""

from __future__ import annotations

import torch

from nextn.speculative.acceptance_reference import strict_acceptance


def _logits_for(top1: list[list[int]], vocab: int = 8) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(top1), vocab).float()


def test_trtllm_cases():
    logits = _logits_for([[1, 3, 2, 4]] * 3)
    drafts = torch.tensor([[1, 3, 4], [1, 3, 2], [0, 3, 2]])
    tokens, n = strict_acceptance(logits, drafts)
    assert n.tolist() == [3, 4, 1]
    assert tokens[0, :3].tolist() == [1, 3, 2]  # two drafts accepted, then the correction
    assert tokens[1].tolist() == [1, 3, 2, 4]  # all accepted plus the bonus token


def test_matches_brute_force_on_random_batches():
    gen = torch.Generator().manual_seed(0)
    for k in range(0, 5):
        logits = torch.randn(64, k + 1, 5, generator=gen)
        target = logits.argmax(-1)
        drafts = torch.where(torch.rand(64, k, generator=gen) < 0.7, target[:, :k], torch.randint(0, 5, (64, k), generator=gen))
        tokens, n = strict_acceptance(logits, drafts)
        for b in range(64):
            a = 0
            while a < k and drafts[b, a] == target[b, a]:
                a += 1
            assert n[b].item() == a + 1
            assert tokens[b].tolist() == target[b].tolist()
