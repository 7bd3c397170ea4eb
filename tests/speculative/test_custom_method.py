"""A new speculative method is one module, one config class and one registry line: a drafter defined here, in the
test, plugs in without touching any source file and runs lossless through `LLM.generate`, the prefix cache, the
overlap scheduler and the OpenAI server (`nextn serve`'s app)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Literal

import openai
import pytest
import torch
import uvicorn

from nextn import LLM, SamplingParams
from nextn.build.engine_builder import build_engine
from nextn.config.llm_args import DecodingBaseConfig, LlmArgsError, parse_llm_args
from nextn.serving.openai_server import create_app
from nextn.speculative import registry
from nextn.speculative.acceptance_rules import StandardAcceptance
from nextn.speculative.chain_step import LinearDrafter
from nextn.speculative.protocol import rows_at

STORIES = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "models" / "stories260K" / "stories260K.gguf"


# The whole method: a config class, a drafter, a build function and one registry line. ------------------------------
class RepeatDecodingConfig(DecodingBaseConfig):
    """Drafts the last emitted token K times (a made-up method: small models repeat themselves)."""

    decoding_type: Literal["Repeat"] = "Repeat"
    max_draft_len: int = 3


class RepeatDrafter(LinearDrafter):
    name = "Repeat"

    def __init__(self, k: int) -> None:
        self.num_draft_tokens = self.max_draft_depth = k
        self.calls = 0

    def initial_state(self, batch, hidden_size, device, dtype):
        return ()

    def after_prefill(self, model, kv_cache, meta, hidden, next_tokens, last_idx, input_ids, state, step=None):
        self.calls += 1
        return rows_at(next_tokens, last_idx).expand(-1, self.num_draft_tokens).contiguous(), ()

    def after_verify(self, model, kv_cache, meta, hidden, target_tokens, num_emitted, state, step=None):
        self.calls += 1
        return rows_at(target_tokens, num_emitted - 1).expand(-1, self.num_draft_tokens).contiguous(), ()


def build_repeat(spec: RepeatDecodingConfig, ctx: registry.LoadContext):
    return RepeatDrafter(spec.max_draft_len), StandardAcceptance()


registry.register(registry.Method("Repeat", RepeatDecodingConfig, build_repeat))
# -----------------------------------------------------------------------------------------------------------------

SPEC = {"decoding_type": "Repeat", "max_draft_len": 3}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    if not STORIES.is_file():
        pytest.skip(f"{STORIES} is absent (../shared/data): the real stories260K model is not available")
    out = tmp_path_factory.mktemp("repeat") / "engine"
    build_engine(STORIES, out, max_seq_len=256, progress=False)
    return out


def _prompts(llm: LLM) -> list[list[int]]:
    """Four prompts sharing a prefix of more than two KV blocks (the prefix cache reuses full blocks)."""
    story = ("Once upon a time, there was a little girl named Lily. She loved to play in the park with her dog. "
             "One day, Lily and her dog went to the park to play. They ran and jumped and had lots of fun. ")
    ends = ["Then", "The little dog ran", "Lily and Ben went to the", "Tom was sad because"]
    return [llm.tokenizer.encode(story + e) for e in ends]


def test_the_config_is_validated_like_a_built_in_one():
    assert isinstance(parse_llm_args({"speculative_config": SPEC}).speculative_config, RepeatDecodingConfig)
    with pytest.raises(LlmArgsError, match="unknown key 'speculative_config.colour'"):
        parse_llm_args({"speculative_config": {**SPEC, "colour": "red"}})
    with pytest.raises(ValueError, match="already registered"):
        registry.register(registry.Method("Repeat", RepeatDecodingConfig, lambda spec, ctx: None))


@pytest.mark.parametrize("overlap", [True, False])
def test_a_registered_drafter_is_lossless_through_generate_and_the_prefix_cache(engine, overlap):
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    args = {"disable_overlap_scheduler": not overlap}
    plain = LLM(engine, speculative_config=None, **args)
    prompts = _prompts(plain)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    plain.shutdown()
    llm = LLM(engine, speculative_config=SPEC, **args)
    drafter = llm.engine.drafter
    assert isinstance(drafter, RepeatDrafter)
    assert len(prompts[0]) > 2 * llm.args.kv_cache_config.tokens_per_block
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]  # batch of 4
    assert got == want
    alone = [llm.generate(p, params).outputs[0].token_ids for p in prompts]  # each again: prefix-cache hits
    assert alone == want
    assert llm.engine.pool.cache.stats.hit_rate > 0
    assert drafter.calls > 0
    llm.shutdown()


def test_a_registered_drafter_serves_through_the_openai_app(engine):
    llm = LLM(engine, speculative_config=SPEC)
    prompt = "Once upon a time"
    want = llm.generate(prompt, SamplingParams(max_tokens=24)).outputs[0].text
    server = uvicorn.Server(uvicorn.Config(create_app(llm, "stories"), host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.1)
    try:
        port = server.servers[0].sockets[0].getsockname()[1]
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
        out = client.completions.create(model="stories", prompt=prompt, max_tokens=24, temperature=0)
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model="stories", prompt=prompt, max_tokens=24, temperature=0, stream=True))
        assert out.choices[0].text == want == streamed
        assert llm.engine.drafter.calls > 0
    finally:
        server.should_exit = True
        thread.join(30)
        llm.shutdown()


def test_drafts_are_the_last_token_repeated():
    d = RepeatDrafter(2)
    tokens = torch.tensor([[5, 6, 7], [8, 9, 10]])
    drafts, _ = d.after_verify(None, None, None, None, tokens, torch.tensor([2, 1]), ())
    assert drafts.tolist() == [[6, 6], [8, 8]]
