"""A second chat turn sent to the OpenAI server (the official `openai` client) hits the prefix cache: /metrics
counts the reused tokens (`nextn_prefix_cache_hits_total`, `..._queries_total`, vLLM's names) and the answer is the
one the engine gives without reuse."""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path

import openai
import pytest

from nextn import LLM, SamplingParams
from nextn.build.engine_builder import build_engine
from nextn.serving.openai_protocol import ChatMessage
from nextn.serving.openai_server import create_app

STORIES = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "models" / "stories260K" / "stories260K.gguf"
KV = {"tokens_per_block": 4}


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else -1.0


@pytest.fixture(scope="module")
def served(tmp_path_factory, local_server_cls):
    if not STORIES.is_file():
        pytest.skip(f"{STORIES} is absent (../shared/data): the real stories260K model is not available")
    engine = tmp_path_factory.mktemp("stories_prefix") / "engine"
    build_engine(STORIES, engine, max_seq_len=256, progress=False)
    llm = LLM(engine, device="cpu", kv_cache_config=KV)
    app = create_app(llm, "stories")
    server = local_server_cls(app)
    yield server.url, app, engine
    server.stop()
    llm.shutdown()


def test_a_second_chat_turn_hits_the_prefix_cache(served):
    url, app, engine = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    messages = [{"role": "system", "content": "Tell a short story about a cat and a dog."},
                {"role": "user", "content": "Once upon a time there was a little cat named Tom."}]
    first = client.chat.completions.create(model="stories", messages=messages, max_tokens=16)
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        before = r.read().decode()
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "What did Tom do next?"}]
    second = client.chat.completions.create(model="stories", messages=messages, max_tokens=16)
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        after = r.read().decode()
    hits = _metric(after, "nextn_prefix_cache_hits_total") - _metric(before, "nextn_prefix_cache_hits_total")
    queries = _metric(after, "nextn_prefix_cache_queries_total") - _metric(before, "nextn_prefix_cache_queries_total")
    assert queries == second.usage.prompt_tokens
    assert hits >= first.usage.prompt_tokens // 4 * 4 - 4 > 0  # (the prompt's blocks but its last, at least)
    # The same prompt ids through an engine without reuse give the same answer.
    plain = LLM(engine, device="cpu", kv_cache_config={**KV, "enable_block_reuse": False})
    ids = app.state.server.chat_ids([ChatMessage(**m) for m in messages])  # the server's own rendering
    assert len(ids) == second.usage.prompt_tokens
    assert plain.generate(ids, SamplingParams(max_tokens=16)).outputs[0].text == second.choices[0].message.content
