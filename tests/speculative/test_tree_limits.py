"""Trees are validated where the vocabulary is known, at load (issue 32, class 5): a rank ≥ the vocabulary is an
LlmArgsError naming it, not "this is a bug in nextn" on every request; too large a tree never loads."""

from __future__ import annotations

import pytest

from nextn.config.llm_args import LlmArgsError
from nextn.runtime.llm import LLM
from nextn.testing import SMALL_VOCAB


@pytest.fixture(scope="module")
def mtp_engine(checkpoints):
    return checkpoints.engine(num_mtp_modules=1, **SMALL_VOCAB)


@pytest.mark.parametrize("rank", [600, 2_000_000_000])
def test_an_eagle_choices_rank_past_the_vocabulary_is_refused_at_load(mtp_engine, rank):
    spec = {"decoding_type": "MTP", "num_nextn_predict_layers": 2, "eagle_choices": [[0], [rank]]}
    with pytest.raises(LlmArgsError, match=f"eagle_choices: .*rank {rank}.*vocabulary"):
        LLM(mtp_engine, speculative_config=spec)


def test_a_medusa_choices_rank_past_the_vocabulary_is_refused_at_load(medusa_engine):
    spec = {"decoding_type": "Medusa", "medusa_choices": [[0], [600]]}
    with pytest.raises(LlmArgsError, match="medusa_choices: .*rank 600.*vocabulary"):
        LLM(medusa_engine, speculative_config=spec)


@pytest.mark.parametrize("key,decoding", [("eagle_choices", "MTP"), ("medusa_choices", "Medusa")])
def test_a_tree_over_255_nodes_is_refused_when_parsed(key, decoding):
    from nextn.config.llm_args import parse_llm_args

    with pytest.raises(LlmArgsError, match=f"{key}.*at most 255"):
        parse_llm_args({"speculative_config": {"decoding_type": decoding, key: [[i] for i in range(2000)]}})
