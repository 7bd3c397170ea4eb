"""A tool-use conversation against `nextn serve`, as an agent framework holds it, with the official `openai` client:
a function schema, `tool_choice` "auto" then "required", the call's result fed back, the final answer streamed.

    python -m benchmarks.tool_check --engine_dir ENGINE [--extra_llm_api_options configs/ngram.yaml]

Starts the server in this process on a free loopback port, prints each turn (the parsed `tool_calls`, whether
their arguments validate against the function's schema with `jsonschema`, the answer) and exits 1 when a call is
missing or invalid.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import threading
import time

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a given city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "The city name, e.g. Paris"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
QUESTION = "What is the weather like in Paris today? Answer in celsius."


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def converse(client, model: str, tool_choice: str, stream: bool) -> tuple[bool, list[str]]:
    """One conversation; (every call valid, the lines to print)."""
    import jsonschema

    lines, messages = [], [{"role": "user", "content": QUESTION}]
    kw = dict(model=model, messages=messages, tools=[WEATHER], tool_choice=tool_choice, max_tokens=128,
              temperature=0)
    if stream:
        calls, content = [], ""
        for chunk in client.chat.completions.create(stream=True, **kw):
            for ch in chunk.choices:
                calls += ch.delta.tool_calls or []
                content += ch.delta.content or ""
        call_list = [(c.id, c.function.name, c.function.arguments) for c in calls]
    else:
        msg = client.chat.completions.create(**kw).choices[0].message
        content = msg.content or ""
        call_list = [(c.id, c.function.name, c.function.arguments) for c in msg.tool_calls or []]
    lines.append(f"tool_choice={tool_choice} stream={stream}: content {content[:80]!r}, calls {call_list}")
    ok = bool(call_list)
    for cid, name, args in call_list:
        try:
            jsonschema.validate(json.loads(args), WEATHER["function"]["parameters"])
            valid = name == "get_weather"
        except (json.JSONDecodeError, jsonschema.ValidationError):
            valid = False
        ok = ok and valid
        lines.append(f"  {name}({args}) valid: {valid}")
    if call_list:
        cid, name, args = call_list[0]
        messages += [{"role": "assistant", "content": None, "tool_calls": [
                         {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}]},
                     {"role": "tool", "tool_call_id": cid, "content": json.dumps({"temperature": 18,
                                                                                   "condition": "sunny"})}]
        answer = "".join(chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
            model=model, messages=messages, tools=[WEATHER], max_tokens=64, temperature=0, stream=True)
            if chunk.choices)
        lines.append(f"  answer after the tool result: {answer.strip()[:160]!r}")
    return ok, lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.tool_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--engine_dir", required=True)
    p.add_argument("--extra_llm_api_options", default=None, help="LLM options YAML (e.g. a drafter's config)")
    args = p.parse_args(argv)
    import openai
    import uvicorn

    from nextn import LLM
    from nextn.serving.openai_server import create_app

    llm = LLM(args.engine_dir, extra_llm_api_options=args.extra_llm_api_options)
    server = uvicorn.Server(uvicorn.Config(create_app(llm, "model"), host="127.0.0.1", port=_free_port(),
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.config.port}/v1", api_key="x", max_retries=0,
                           timeout=600)
    all_ok = True
    try:
        for choice in ("auto", "required"):
            for stream in (False, True):
                ok, lines = converse(client, "model", choice, stream)
                all_ok = all_ok and ok
                print("\n".join(lines), flush=True)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        llm.shutdown()
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
