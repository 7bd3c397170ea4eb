"""`SamplingParams.n`: LLM.generate returns n sequences per prompt, sequence j seeded seed + j, the prompt's KV
blocks shared through the prefix cache; a single request (add_request) is one sequence."""

from __future__ import annotations

import pytest

from nextn import LLM, SamplingParams
from nextn.runtime.request_validation import RequestError


def test_n_sequences_each_seeded_like_a_request_alone(llama_engine):
    llm = LLM(llama_engine, speculative_config={"decoding_type": "NGram", "max_draft_len": 3})
    many, other = llm.generate([list(range(3, 40)), [4, 5]], [SamplingParams(max_tokens=6, n=3, temperature=1.0,
                                                                             seed=5), SamplingParams(max_tokens=4)])
    assert [c.index for c in many.outputs] == [0, 1, 2] and len(other.outputs) == 1
    for j, c in enumerate(many.outputs):
        [alone] = llm.generate([list(range(3, 40))], SamplingParams(max_tokens=6, temperature=1.0, seed=5 + j))
        assert c.token_ids == alone.outputs[0].token_ids
    assert len({tuple(c.token_ids) for c in many.outputs}) > 1
    assert llm.prefix_cache_stats.hits > 0  # the later sequences reused the prompt's blocks
    with pytest.raises(RequestError, match="one request is one sequence"):
        llm.add_request([1, 2], SamplingParams(n=2))
