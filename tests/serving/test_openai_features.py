"""`nextn serve` with speculation on, through the official `openai` client: n choices, log-probabilities, penalties
and logit_bias, JSON-schema output, tool calls (streamed and not, a tool result fed back) — each equal to plain
decoding of the same request in `LLM.generate`, and an agent-style client loop that runs unchanged.

Every feature runs with MTP and NGram; Draft_Target (the engine drafting for itself), Medusa (heads over the same
checkpoint) and Suffix run a compact subset — n > 1, log-probabilities under penalties and bias, JSON-schema output,
a tool call. A request and its streamed twin are sent at once, so they share the engine's batch (n > 1 does too).
One server per drafter, shared by the module's tests."""

from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import uvicorn

from nextn import LLM, SamplingParams
from nextn.runtime.sampling_params import GuidedDecodingParams
from nextn.serving import openai_protocol as p
from nextn.serving.openai_server import OpenAIServer, create_app
from nextn.serving.openai_tools import parse_tool_calls, tool_call_grammar

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

MTP = {"decoding_type": "MTP", "num_nextn_predict_layers": 1}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}
ANSWER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "sunny": {"type": "boolean"}},
          "required": ["city", "sunny"], "additionalProperties": False}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def engine_dir(checkpoints):
    return checkpoints.engine(distill_steps=0)  # tiny DeepSeek-V3, one MTP module, the DeepSeek-V3 tokenizer


MEDUSA_CHOICES = [[0], [1], [0, 0], [0, 1], [1, 0]]
ALL = ["mtp", "ngram", "draft_target", "medusa", "suffix"]
FULL = ["mtp", "ngram"]  # every test; the other drafters run the compact subset (the tests parametrized with ALL)


@pytest.fixture(scope="module")
def medusa_engine_dir(checkpoints, tmp_path_factory):
    """The same checkpoint with 2 Medusa heads of 1 layer that start as copies of the model's output head (the
    ResBlocks add SiLU(0) = 0): each head guesses the next token again, so drafts are accepted where the output
    repeats a token."""
    import torch
    from safetensors.torch import load_file, save_file

    from nextn.build.engine_builder import build_engine

    ckpt = checkpoints.checkpoint(distill_steps=0)
    lm_head = next(w for shard in ckpt.glob("model*.safetensors") for k, w in load_file(shard).items()
                   if k == "lm_head.weight")
    hidden = lm_head.shape[1]
    heads = {}
    for i in range(2):
        heads[f"{i}.0.linear.weight"] = torch.zeros(hidden, hidden)
        heads[f"{i}.0.linear.bias"] = torch.zeros(hidden)
        heads[f"{i}.1.weight"] = lm_head.clone()
    tmp = tmp_path_factory.mktemp("medusa_serve")
    (tmp / "heads").mkdir()
    save_file(heads, str(tmp / "heads" / "medusa_lm_head.safetensors"))
    (tmp / "heads" / "config.json").write_text(json.dumps({"medusa_num_heads": 2, "medusa_num_layers": 1}))
    build_engine(ckpt, tmp / "engine", progress=False, medusa_model_dir=tmp / "heads")
    return tmp / "engine"


def _drafter(name: str, engine_dir, request) -> tuple[object, dict]:
    """(the engine directory, the speculative config) of a drafter."""
    if name == "medusa":
        return request.getfixturevalue("medusa_engine_dir"), {"decoding_type": "Medusa",
                                                               "medusa_choices": MEDUSA_CHOICES}
    return engine_dir, {"mtp": MTP, "ngram": {"decoding_type": "NGram", "max_draft_len": 3},
                        "draft_target": {"decoding_type": "Draft_Target", "max_draft_len": 3,
                                         "speculative_model_dir": str(engine_dir)},  # drafts for itself
                        "suffix": {"decoding_type": "Suffix", "max_draft_len": 6}}[name]


@pytest.fixture(scope="module", params=ALL)
def client(engine_dir, request):
    path, spec = _drafter(request.param, engine_dir, request)
    llm = LLM(path, speculative_config=spec, device="cpu")
    server = uvicorn.Server(uvicorn.Config(create_app(llm, "tiny"), host="127.0.0.1", port=_free_port(),
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    yield openai.OpenAI(base_url=f"http://127.0.0.1:{server.config.port}/v1", api_key="x", max_retries=0, timeout=120)
    server.should_exit = True
    thread.join(timeout=30)
    llm.shutdown()


@pytest.fixture(scope="module")
def plain(engine_dir):
    """The same engine without speculation, in this process: the references."""
    return LLM(engine_dir, speculative_config=None, device="cpu")


def _chat_ids(plain, messages, tools=None):
    server = OpenAIServer(plain, "ref")
    return server.chat_ids([p.ChatMessage.model_validate(m) for m in messages],
                           [p.Tool.model_validate(t) for t in tools] if tools else None)


def _together(*calls):
    """The calls' results, the calls made at once (their requests share the engine's batch)."""
    with ThreadPoolExecutor(len(calls)) as pool:
        return [f.result() for f in [pool.submit(c) for c in calls]]


def _stream_text(stream) -> dict[int, str]:
    out: dict[int, str] = {}
    for chunk in stream:
        for c in chunk.choices:
            out[c.index] = out.get(c.index, "") + (c.delta.content or "")
    return out


def test_n_choices(client, plain):
    prompt = "Once upon a time"
    kw = dict(model="tiny", prompt=prompt, max_tokens=8, extra_body={"ignore_eos": True})
    greedy = client.completions.create(n=2, **kw)
    [ref] = plain.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))
    assert [c.index for c in greedy.choices] == [0, 1] and {c.text for c in greedy.choices} == {ref.outputs[0].text}
    assert greedy.usage.prompt_tokens == len(ref.prompt_token_ids) and greedy.usage.completion_tokens == 16
    sampled = client.completions.create(n=3, seed=11, temperature=1.0, **kw)
    again = client.completions.create(n=3, seed=11, temperature=1.0, **kw)
    assert [c.index for c in sampled.choices] == [0, 1, 2] and len({c.text for c in sampled.choices}) > 1
    assert [c.text for c in sampled.choices] == [c.text for c in again.choices]  # one seed stream per choice
    stream = client.completions.create(n=3, seed=11, temperature=1.0, stream=True, **kw)
    assert _stream_text_completions(stream) == {c.index: c.text for c in sampled.choices}


def _stream_text_completions(stream) -> dict[int, str]:
    out: dict[int, str] = {}
    for chunk in stream:
        for c in chunk.choices:
            out[c.index] = out.get(c.index, "") + c.text
    return out


def test_logprobs_penalties_and_bias_equal_plain_decoding(client, plain):
    kw = dict(model="tiny", messages=USER, max_tokens=12, logprobs=True, top_logprobs=2,
              extra_body={"ignore_eos": True, "min_tokens": 4}, presence_penalty=1.2, frequency_penalty=0.4,
              logit_bias={"100": 3.0, "200": 2.5})

    def streamed() -> tuple[str, list[float]]:
        text, lps = "", []
        for chunk in client.chat.completions.create(stream=True, **kw):
            for ch in chunk.choices:
                text += ch.delta.content or ""
                lps += [t.logprob for t in (ch.logprobs.content if ch.logprobs else [])]
        return text, lps

    out, (text, lps) = _together(lambda: client.chat.completions.create(**kw), streamed)
    ids = _chat_ids(plain, USER)
    [ref] = plain.generate([ids], SamplingParams(max_tokens=12, ignore_eos=True, min_tokens=4, logprobs=2,
                                                 presence_penalty=1.2, frequency_penalty=0.4,
                                                 logit_bias={100: 3.0, 200: 2.5}))
    c = out.choices[0]
    assert c.message.content == ref.outputs[0].text
    got = [(t.logprob, [x.logprob for x in t.top_logprobs]) for t in c.logprobs.content]
    want = [(e.logprob, [lp for _, lp in e.top]) for e in ref.outputs[0].logprobs]
    assert len(got) == len(want) == 12
    for (a, ta), (b, tb) in zip(got, want):
        assert a == pytest.approx(b, abs=1e-4) and ta == pytest.approx(tb, abs=1e-4)
    assert text == c.message.content and lps == pytest.approx([a for a, _ in got], abs=1e-6)


def test_json_schema_output_validates(client, plain):
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}}
    kw = dict(model="tiny", messages=USER, max_tokens=40, response_format=fmt)
    out, streamed = _together(lambda: client.chat.completions.create(**kw),
                              lambda: _stream_text(client.chat.completions.create(stream=True, **kw)))
    data = json.loads(out.choices[0].message.content)
    jsonschema.validate(data, ANSWER)
    [ref] = plain.generate([_chat_ids(plain, USER)], SamplingParams(
        max_tokens=40, guided_decoding=GuidedDecodingParams(json=ANSWER)))
    assert out.choices[0].message.content == ref.outputs[0].text
    assert streamed[0] == out.choices[0].message.content
    obj = client.chat.completions.create(model="tiny", messages=USER, max_tokens=60,
                                         response_format={"type": "json_object"})
    if obj.choices[0].finish_reason == "stop":  # a random model may still be inside a string at max_tokens
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    assert obj.choices[0].message.content.startswith("{")


def test_tool_calls_parsed_streamed_and_valid(client, plain):
    _check_tool_call(client, plain, "required")


@pytest.mark.parametrize("client", FULL, indirect=True)
def test_a_named_tool_call_parsed_streamed_and_valid(client, plain):
    _check_tool_call(client, plain, {"type": "function", "function": {"name": "get_time"}})


def _check_tool_call(client, plain, choice):
    tools = [WEATHER, TIME]
    kw = dict(model="tiny", messages=USER, tools=tools, tool_choice=choice, max_tokens=60)

    def streamed() -> tuple[list, str | None]:
        calls, finish = [], None
        for chunk in client.chat.completions.create(stream=True, **kw):
            for ch in chunk.choices:
                calls += ch.delta.tool_calls or []
                finish = ch.finish_reason or finish
        return calls, finish

    out, (calls, finish) = _together(lambda: client.chat.completions.create(**kw), streamed)
    c = out.choices[0]
    assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1
    call = c.message.tool_calls[0]
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    jsonschema.validate(json.loads(call.function.arguments), schema[call.function.name])
    if isinstance(choice, dict):
        assert call.function.name == "get_time"
    assert finish == "tool_calls" and [(x.function.name, x.function.arguments) for x in calls] == [
        (call.function.name, call.function.arguments)]
    # the call plain decoding writes under the same grammar
    parsed = [p.Tool.model_validate(t) for t in tools]
    grammar = tool_call_grammar(parsed, p.ChatCompletionRequest.model_validate(
        {"messages": USER, "tools": tools, "tool_choice": choice}).tool_choice, plain.engine.tool_call_ebnf)
    [ref] = plain.generate([_chat_ids(plain, USER, tools)], SamplingParams(
        max_tokens=60, guided_decoding=GuidedDecodingParams(grammar=grammar)))
    [want] = parse_tool_calls(ref.outputs[0].text, parsed)[1]
    assert (call.function.name, call.function.arguments) == (want.function.name, want.function.arguments)


@pytest.mark.parametrize("client", FULL, indirect=True)
def test_an_agent_loop_runs_unchanged(client):
    """What an agent framework does: a JSON-schema call, a tool call, the tool's result fed back, a streamed
    answer — with the openai client as it is."""
    plan = client.chat.completions.create(
        model="tiny", messages=USER, max_tokens=40,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER, "strict": True}})
    jsonschema.validate(json.loads(plan.choices[0].message.content), ANSWER)
    messages = list(USER)
    first = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER], tool_choice="required",
                                           max_tokens=60)
    call = first.choices[0].message.tool_calls[0]
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temp": 21, "sky": "clear"})}]
    text = "".join(chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
        model="tiny", messages=messages, tools=[WEATHER], max_tokens=16, stream=True) if chunk.choices)
    assert isinstance(text, str)


@pytest.mark.parametrize("client", FULL, indirect=True)
def test_bad_tool_choice_and_two_constraints_are_400(client):
    with pytest.raises(openai.BadRequestError, match="not among the tools"):
        client.chat.completions.create(model="tiny", messages=USER, tools=[WEATHER], max_tokens=4,
                                       tool_choice={"type": "function", "function": {"name": "nope"}})
    with pytest.raises(openai.BadRequestError, match="one output constraint at a time"):
        client.chat.completions.create(model="tiny", messages=USER, tools=[WEATHER], tool_choice="required",
                                       response_format={"type": "json_object"}, max_tokens=4)


def test_tool_call_parsing_and_holding_back():
    from nextn.serving import openai_protocol as p
    from nextn.serving.openai_tools import open_tool_call, parse_tool_calls

    tools = [p.Tool.model_validate(WEATHER)]
    block = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>'
    content, calls = parse_tool_calls("Let me check. " + block, tools)
    assert content == "Let me check." and [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "C"})]
    fenced = '```json\n{"name": "get_weather", "arguments": {"city": "Rome", "unit": "F"}}\n```'
    assert parse_tool_calls(fenced, tools)[0] is None and len(parse_tool_calls(fenced, tools)[1]) == 1
    assert parse_tool_calls('{"name": "other", "arguments": {}}', tools) == ('{"name": "other", "arguments": {}}', [])
    assert parse_tool_calls("<tool_call>\nnot json\n</tool_call>", tools)[1] == []
    # streamed text is held back from where a call may begin: a tag (closed or not), a tag's prefix, or a bare call
    assert open_tool_call("Let me check. " + block + " more") == len("Let me check. ")
    assert open_tool_call("Hello <tool_") == len("Hello ")
    assert open_tool_call("```js") == 0 and open_tool_call("Plain answer.") == len("Plain answer.")



@pytest.mark.parametrize("client", ["ngram"], indirect=True)
def test_a_new_schema_compiles_off_the_event_loop(client, monkeypatch):
    """A new JSON schema's compile (up to about a second) runs in a worker thread, never on the server's event loop
    (which would stall every other stream and /health meanwhile); the request's output still validates."""
    import asyncio

    from nextn.runtime.guided_decoding import GrammarCompiler

    on_loop, compile_ = [], GrammarCompiler.compile

    def recording(self, params):  # each real compile (a cache miss): on an event loop's thread or not
        if params.key() not in self._cache:
            try:
                asyncio.get_running_loop()
                on_loop.append(True)
            except RuntimeError:
                on_loop.append(False)
        return compile_(self, params)

    monkeypatch.setattr(GrammarCompiler, "compile", recording)
    schema = {"type": "object", "properties": {"town": {"enum": ["Oslo", "Bergen"]}}, "required": ["town"],
              "additionalProperties": False}
    out = client.chat.completions.create(model="tiny", messages=USER, max_tokens=30, response_format={
        "type": "json_schema", "json_schema": {"name": "town", "schema": schema}})
    jsonschema.validate(json.loads(out.choices[0].message.content), schema)
    assert on_loop and not any(on_loop), on_loop
