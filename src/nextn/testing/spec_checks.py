"""Shared checks for the tests of every drafter: a broken acceptance rule (to show a distribution test has power)
and the batch-independence of a seeded request."""

from __future__ import annotations

import torch

from nextn.runtime.sampling_params import SamplingParams

#: Prompts that share the batch with the request under test in `same_seed_same_output_whatever_the_batch`.
OTHER_PROMPTS = [[3, 4], list(range(20, 45)), [7] * 9]


def accept_every_draft(target_probs: torch.Tensor, draft_tokens: torch.Tensor, accept_u: torch.Tensor,
                       sample_u: torch.Tensor, draft_probs: torch.Tensor | None = None):
    """A wrong rule with `rejection_sampling`'s signature: emits all K drafts unverified plus a token from p.

    Monkeypatched over `nextn.runtime.acceptance_rules.rejection_sampling`, it must make a chi-square test of the
    output distribution fail; otherwise that test could not detect a lossy rule.
    """
    from nextn.plugins.acceptance import _emit
    from nextn.plugins.sampling import sample_from_probs

    k = draft_tokens.shape[1]
    return _emit(draft_tokens, sample_from_probs(target_probs, sample_u), draft_tokens.new_full(draft_tokens.shape[:1], k))


def same_seed_same_output_whatever_the_batch(llm, prompt: list[int], params: SamplingParams) -> None:
    """Assert that a seeded request gives the same tokens alone and amid other requests, and others with another seed.

    Raises:
        AssertionError: the output depends on the batch, or ignores the seed.
    """
    alone = llm.generate(prompt, params).outputs[0].token_ids
    batch = llm.generate(OTHER_PROMPTS[:2] + [prompt] + OTHER_PROMPTS[2:],
                         [SamplingParams(max_tokens=30, temperature=1.0, seed=9), SamplingParams(max_tokens=5),
                          params, SamplingParams(max_tokens=12, temperature=0.5, top_k=3, seed=5)])
    assert batch[2].outputs[0].token_ids == alone
    assert llm.generate(prompt, params.model_copy(update={"seed": 4321})).outputs[0].token_ids != alone
