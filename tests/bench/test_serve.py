"""The serving benchmark (`python -m nextn.bench.serve`): metrics on synthetic timings, the client against an
in-process fake OpenAI endpoint and the real nextn app on stories260K, server start/stop, the workloads (dataset
names and categories, multi-turn conversations, repeated passes), the lossless check, the report files, and argument
refusals. No timed assertion."""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("openai", reason="the serving benchmark's client is the `openai` package (nextn's test extra)")

import uvicorn  # noqa: E402
from fastapi import FastAPI, Request  # noqa: E402
from fastapi.responses import PlainTextResponse, StreamingResponse  # noqa: E402

from nextn.bench import serve  # noqa: E402
from nextn.bench.dataset import DatasetError, read_prompt_rows  # noqa: E402
from nextn.bench.serve_client import (LevelMetrics, RequestResult, level_metrics, open_client, percentile,  # noqa: E402
                                      run_level, send_request)
from nextn.bench.serve_report import ConfigResult, LevelResult, lossless_mismatches, markdown_table  # noqa: E402
from nextn.bench.serve_servers import (ServerError, ServerSpec, llama_cpp_spec, nextn_spec,  # noqa: E402
                                       parse_spec_counters, running, SpecCounters)
from nextn.bench.serve_workload import level_phases, load_workload  # noqa: E402

STORIES = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "models" / "stories260K" / "stories260K.gguf"


# Metrics on synthetic timings ------------------------------------------------------------------------------------
def test_percentile_is_nearest_rank():
    assert percentile([], 0.5) == 0.0
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert percentile(list(map(float, range(1, 101))), 0.99) == 100.0  # sorted[int(100 · 0.99)] = sorted[99]
    assert percentile([5.0], 0.99) == 5.0


def test_request_tpot_and_itl():
    r = RequestResult(0, ok=True, e2e_s=1.0, output_tokens=11, ttft_s=0.2, chunk_times_s=(0.2, 0.3, 0.6))
    assert r.tpot_s == pytest.approx(0.08)  # (1.0 − 0.2) / (11 − 1)
    assert r.itl_s == pytest.approx([0.1, 0.3])
    assert RequestResult(0, ok=True, e2e_s=1.0, output_tokens=1, ttft_s=0.2).tpot_s is None
    assert RequestResult(0, ok=False, e2e_s=1.0, error="x").tpot_s is None


def test_level_metrics_counts_only_successful_requests():
    ok1 = RequestResult(0, ok=True, e2e_s=1.0, output_tokens=11, ttft_s=0.1, chunk_times_s=(0.1, 0.2, 0.4))
    ok2 = RequestResult(1, ok=True, e2e_s=2.0, output_tokens=21, ttft_s=0.3, chunk_times_s=(0.3, 0.5))
    bad = RequestResult(2, ok=False, e2e_s=0.5, error="APIError: boom")
    m = level_metrics([ok1, ok2, bad], wall_s=4.0)
    assert (m.num_requests, m.num_failed, m.output_tokens) == (3, 1, 32)
    assert m.output_tok_s == pytest.approx(8.0) and m.requests_per_s == pytest.approx(0.5)
    assert (m.ttft_ms_p50, m.ttft_ms_p99) == (pytest.approx(300.0), pytest.approx(300.0))  # sorted [100, 300][1]
    assert m.ttft_ms_mean == pytest.approx(200.0)
    assert m.tpot_ms_p50 == pytest.approx(90.0)  # TPOTs 90 ms, 85 ms → sorted [85, 90][1]
    assert m.tpot_ms_mean == pytest.approx(87.5)
    assert m.itl_ms_p50 == pytest.approx(200.0)  # ITLs 100, 200, 200 ms
    assert m.errors == ("APIError: boom",)
    assert level_metrics([bad], wall_s=1.0).output_tok_s == 0.0


def test_spec_counters_of_both_servers_and_their_al():
    nextn_text = ("# HELP nextn_spec_decode_num_drafts_total x\nnextn_spec_decode_num_drafts_total 10.0\n"
                  "nextn_spec_decode_num_draft_tokens_total 30.0\nnextn_spec_decode_num_accepted_tokens_total 15.0\n"
                  'nextn_spec_decode_num_accepted_tokens_per_pos_total{position="0"} 9.0\n')
    llama_text = ("llamacpp:spec_decode_num_drafts_total 4\nllamacpp:spec_decode_num_draft_tokens_total 12\n"
                  "llamacpp:spec_decode_num_accepted_tokens_total 6\n")
    assert parse_spec_counters(nextn_text) == SpecCounters(10, 30, 15)
    assert parse_spec_counters(llama_text) == SpecCounters(4, 12, 6)
    delta = parse_spec_counters(nextn_text) - SpecCounters(2, 6, 3)
    assert delta.acceptance_length == pytest.approx(1 + 12 / 8)
    assert delta.draft_acceptance_rate == pytest.approx(0.5)
    assert SpecCounters().acceptance_length is None and SpecCounters().draft_acceptance_rate is None
    assert parse_spec_counters("") == SpecCounters()


# Server command lines, start and stop ------------------------------------------------------------------------
def test_server_command_lines(tmp_path):
    plain = nextn_spec(Path("m.gguf"), 2, None)
    assert (plain.label, plain.speculative) == ("nextn plain", False)
    assert plain.argv[-6:] == ("-t", "2", "--host", "127.0.0.1", "--log_level", "warning")
    ngram = nextn_spec(Path("m.gguf"), 2, "configs/ngram.yaml")
    assert ngram.label == "nextn ngram" and ngram.argv[-2:] == ("--extra_llm_api_options", "configs/ngram.yaml")
    bin_ = Path("bin/llama-server")
    lp = llama_cpp_spec(bin_, Path("m.gguf"), 2, "plain", parallel=4, ctx_per_slot=512)
    assert lp.argv[lp.argv.index("-np") + 1] == "4" and lp.argv[lp.argv.index("-c") + 1] == "2048"
    assert "--metrics" in lp.argv and "--spec-type" not in lp.argv and not lp.speculative
    mod = llama_cpp_spec(bin_, Path("m.gguf"), 2, "ngram-mod", 1, 512, extra_args=("--spec-ngram-mod-n-min", "8"))
    assert mod.argv[mod.argv.index("--spec-type") + 1] == "ngram-mod" and mod.argv[-1] == "8"
    draft = llama_cpp_spec(bin_, Path("m.gguf"), 2, "draft", 1, 512, draft_model=Path("d.gguf"), draft_max=4)
    assert draft.argv[draft.argv.index("-md") + 1] == "d.gguf"
    assert draft.argv[draft.argv.index("--spec-draft-n-max") + 1] == "4"
    with pytest.raises(ValueError, match="needs --draft_model"):
        llama_cpp_spec(bin_, Path("m.gguf"), 2, "draft", 1, 512)
    assert not nextn_spec(Path("m.gguf"), 2, "configs/no_speculation.yaml").speculative  # the plain reference
    assert nextn_spec(Path("m.gguf"), 2, "configs/mtp_eagle_k3.yaml").speculative
    mtp = llama_cpp_spec(bin_, Path("m.gguf"), 2, "draft-mtp", 1, 512, draft_max=2)
    assert mtp.speculative and "-md" not in mtp.argv
    assert mtp.argv[mtp.argv.index("--spec-type") + 1] == "draft-mtp"
    assert mtp.argv[mtp.argv.index("--spec-draft-n-max") + 1] == "2"
    with pytest.raises(ValueError, match="not one of"):
        llama_cpp_spec(bin_, Path("m.gguf"), 2, "lookahead", 1, 512)


def test_nextn_model_serves_an_engine_beside_the_gguf(tmp_path, capsys):
    """--nextn_model: nextn serve loads the engine (e.g. W4A8), llama-server the GGUF; a missing one is refused."""
    gguf, engine = tmp_path / "m.gguf", tmp_path / "engine"
    gguf.write_bytes(b"GGUF")
    engine.mkdir()
    p = serve.build_parser()
    args = p.parse_args(["--model", str(gguf), "--nextn_model", str(engine), "--llama_cpp", "plain",
                         "--output_dir", str(tmp_path / "out")])
    specs = serve.server_specs(args, Path("bin"))
    nextn = specs[0].argv
    assert nextn[nextn.index("--model") + 1] == str(engine)
    assert specs[1].argv[specs[1].argv.index("-m") + 1] == str(gguf)
    with pytest.raises(SystemExit):
        serve.main(["--model", str(gguf), "--nextn_model", str(tmp_path / "absent"), "--output_dir",
                    str(tmp_path / "out2")])
    err = capsys.readouterr().err
    assert "--nextn_model" in err and "does not exist" in err


_HEALTH_SERVER = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[sys.argv.index("--port") + 1])), H).serve_forever()
"""


def test_running_waits_for_health_and_stops_the_server(tmp_path):
    spec = ServerSpec("fake", "url", (sys.executable, "-c", _HEALTH_SERVER), speculative=False)
    with running(spec, tmp_path / "fake.log", startup_timeout_s=60) as url:
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
    with pytest.raises(OSError):  # stopped: nothing listens any more
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


def test_running_reports_a_server_that_exits(tmp_path):
    spec = ServerSpec("broken", "url", (sys.executable, "-c", "print('no model here'); raise SystemExit(3)"), False)
    with pytest.raises(ServerError, match=r"exited with 3[\s\S]*no model here"):
        with running(spec, tmp_path / "broken.log", startup_timeout_s=60):
            pass


# The client against a fake OpenAI endpoint -------------------------------------------------------------------------
class _Fake:
    """A fake OpenAI server: one word a chunk, `usage` last; records request bodies and the most requests in flight."""

    def __init__(self, usage: bool = True) -> None:
        self.usage, self.bodies, self.in_flight, self.max_in_flight, self.drafts = usage, [], 0, 0, 0
        self.app = app = FastAPI()
        app.get("/health")(lambda: {"status": "ok"})
        app.get("/v1/models")(lambda: {"object": "list", "data": [{"id": "fake", "object": "model", "created": 0,
                                                                    "owned_by": "test"}]})
        app.get("/metrics")(lambda: PlainTextResponse(
            f"fake_spec_decode_num_drafts_total {self.drafts}\nfake_spec_decode_num_draft_tokens_total "
            f"{3 * self.drafts}\nfake_spec_decode_num_accepted_tokens_total {self.drafts}\n"))
        app.post("/v1/chat/completions")(self.handle)
        app.post("/v1/completions")(self.handle)

    async def handle(self, request: Request):
        body = await request.json()
        self.bodies.append(body)
        chat = "messages" in body
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]

        def event(piece: str | None) -> str:
            if piece is None:
                payload = {"id": "x", "object": "chunk", "created": 0, "model": "fake", "choices": [],
                           "usage": {"prompt_tokens": 1, "completion_tokens": body["max_tokens"],
                                     "total_tokens": 1 + body["max_tokens"]}}
            elif chat:
                payload = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "fake",
                           "choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": None}]}
            else:
                payload = {"id": "x", "object": "text_completion", "created": 0, "model": "fake",
                           "choices": [{"index": 0, "text": piece, "finish_reason": None}]}
            return f"data: {json.dumps(payload)}\n\n"

        async def events():
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            try:
                for i in range(body["max_tokens"]):
                    await asyncio.sleep(0.002)
                    yield event(f"{prompt[:4]}{i} ")
                self.drafts += 1
                if self.usage:
                    yield event(None)
                yield "data: [DONE]\n\n"
            finally:
                self.in_flight -= 1
        return StreamingResponse(events(), media_type="text/event-stream")


def _serve_in_thread(app):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    return server, thread, f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def fake():
    f = _Fake()
    server, thread, url = _serve_in_thread(f.app)
    yield f, url
    server.should_exit = True
    thread.join(30)


async def _level(url: str, **kw):
    client = open_client(url + "/v1", timeout_s=60)
    try:
        return await run_level(client, "fake", **kw)
    finally:
        await client.close()


@pytest.mark.parametrize("chat", [True, False])
def test_client_sends_greedy_streamed_requests_and_counts_usage(fake, chat):
    f, url = fake
    f.bodies.clear()
    results, wall = asyncio.run(_level(url, prompts=["alpha", "beta"], num_requests=3, concurrency=2, max_tokens=5,
                                       chat=chat))
    assert wall > 0 and [r.prompt_index for r in results] == [0, 1, 0]
    assert all(r.ok and r.output_tokens == 5 and len(r.chunk_times_s) == 5 for r in results)
    assert results[0].text == "alph0 alph1 alph2 alph3 alph4 " and results[1].text.startswith("beta0 ")
    assert all(r.ttft_s is not None and r.ttft_s <= r.e2e_s for r in results)
    for body in f.bodies:
        assert body["temperature"] == 0 and body["stream"] is True and body["ignore_eos"] is True
        assert body["stream_options"] == {"include_usage": True} and body["max_tokens"] == 5


def test_client_sends_sampled_requests_with_a_seed_per_prompt(fake):
    from nextn.bench.serve_client import Sampling

    f, url = fake
    f.bodies.clear()
    sampling = Sampling(temperature=0.7, top_p=0.8, top_k=20, seed=100)
    results, _ = asyncio.run(_level(url, prompts=["alpha", "beta"], num_requests=3, concurrency=1, max_tokens=2,
                                    sampling=sampling))
    assert all(r.ok for r in results)
    assert [(b["temperature"], b["top_p"], b["top_k"], b["seed"]) for b in f.bodies] == [
        (0.7, 0.8, 20, 100), (0.7, 0.8, 20, 101), (0.7, 0.8, 20, 100)]  # the seed follows the prompt
    assert sampling.describe() == "sampled (temperature 0.7, top-p 0.8, top-k 20, a seed per prompt)"
    f.bodies.clear()
    asyncio.run(_level(url, prompts=["a"], num_requests=1, concurrency=1, max_tokens=1,
                       sampling=Sampling(temperature=1.0)))
    assert "top_k" not in f.bodies[0] and f.bodies[0]["top_p"] == 1.0


def test_client_keeps_concurrency_and_poisson_arrivals(fake):
    f, url = fake
    f.max_in_flight = 0
    results, _ = asyncio.run(_level(url, prompts=["p"], num_requests=8, concurrency=3, max_tokens=3))
    assert len(results) == 8 and all(r.ok for r in results) and 1 <= f.max_in_flight <= 3
    f.max_in_flight = 0
    results, _ = asyncio.run(_level(url, prompts=["p"], num_requests=4, concurrency=4, max_tokens=2,
                                    request_rate=1000.0, seed=1))
    assert all(r.ok for r in results) and f.max_in_flight <= 4


def test_a_stream_without_usage_fails_the_request():
    f = _Fake(usage=False)
    server, thread, url = _serve_in_thread(f.app)
    try:
        async def one():
            client = open_client(url + "/v1", timeout_s=60)
            try:
                return await send_request(client, "fake", "hi", 0, 3)
            finally:
                await client.close()
        r = asyncio.run(one())
        assert not r.ok and "no usage" in r.error and r.text == "hi0 hi1 hi2 "
    finally:
        server.should_exit = True
        thread.join(30)


def test_an_unreachable_server_is_a_failed_request():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results, _ = asyncio.run(_level(f"http://127.0.0.1:{port}", prompts=["p"], num_requests=1, concurrency=1,
                                    max_tokens=2))
    assert not results[0].ok and results[0].error


def _prompt_file(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("Once upon a time", "The little dog", "Lily")))
    return path


def test_cli_measures_running_servers_and_writes_the_report(fake, tmp_path, capsys):
    f, url = fake
    out = tmp_path / "out"
    argv = ["--url", url, "--nextn_configs", "--llama_cpp", "--dataset", str(_prompt_file(tmp_path)),
            "--num_prompts", "2", "--concurrency", "1", "2", "--max_tokens", "4", "--runs", "2", "--output_dir",
            str(out)]
    assert serve.main(argv) == 0
    report = json.loads((out / "serve.json").read_text())
    assert report["written_by"] == "nextn bench.serve" and report["concurrency"] == [1, 2]
    (config,) = report["configs"]
    assert config["label"] == f"url {url}" and config["error"] is None
    for level, c in zip(config["levels"], (1, 2)):
        assert level["concurrency"] == c and len(level["passes_output_tok_s"]) == 2
        assert level["num_requests"] == max(2, 2 * c) and level["output_tokens"] == 4 * level["num_requests"]
        assert level["failed_requests_all_passes"] == 0
        assert level["acceptance_length"] == pytest.approx(1 + 1 / 1)  # the fake's counters: accepted = drafts
    md = (out / "serve.md").read_text()
    assert md.startswith(serve.MD_MARK) and f"| url {url} |" in md and "Lossless check: nothing compared" in md
    assert (out / "serve.png").read_bytes().startswith(b"\x89PNG")
    assert serve.main(argv) == 0  # its own output directory is reused


def test_restart_per_pass_gives_every_pass_of_every_level_a_fresh_warmed_server(fake, tmp_path, monkeypatch):
    """--restart_per_pass: one server start per (level, pass), each followed by the warm-up and exactly one pass of
    the level's requests; the passes of a level are kept together (best of them) and each start has its own log."""
    import contextlib

    f, url = fake
    f.bodies.clear()
    starts: list[str] = []

    @contextlib.contextmanager
    def fake_running(spec, log, timeout):
        starts.append(log.name)
        log.write_text("started")
        yield url

    monkeypatch.setattr(serve, "running", fake_running)
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    out = tmp_path / "out"
    assert serve.main(["--model", str(model), "--llama_cpp", "--dataset", str(_prompt_file(tmp_path)),
                       "--num_prompts", "2", "--concurrency", "1", "2", "--max_tokens", "2", "--runs", "3",
                       "--restart_per_pass", "--endpoint", "completions", "--output_dir", str(out)]) == 0
    assert starts == [f"nextn_plain.c{c}.pass{i}.log" for c in (1, 2) for i in (1, 2, 3)]
    prompts = [b["prompt"] for b in f.bodies]
    per_pass = {1: 2, 2: 4}  # requests of a pass: max(num_prompts, 2 × concurrency)
    i = 0
    for c in (1, 2):
        for _ in range(3):  # each start: the warm-up, then one pass
            assert prompts[i] == serve.WARMUP_PROMPT
            assert serve.WARMUP_PROMPT not in prompts[i + 1:i + 1 + per_pass[c]]
            i += 1 + per_pass[c]
    assert i == len(prompts)
    report = json.loads((out / "serve.json").read_text())
    assert report["restart_per_pass"] is True
    levels = report["configs"][0]["levels"]
    assert [(lv["concurrency"], len(lv["passes_output_tok_s"])) for lv in levels] == [(1, 3), (2, 3)]
    assert "each on a freshly started server" in (out / "serve.md").read_text()


# Workloads: dataset names and categories, conversations, repeated passes ------------------------------------------
_MT = [{"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Rewrite it in French."]},
       {"question_id": 82, "category": "math", "turns": ["Add 2 and 2.", "Now multiply them."]}]
_SPEC = _MT + [{"question_id": 100 + i, "category": c, "turns": [f"{c} task {i}"]}
               for i, c in enumerate(["summarization", "rag", "translation", "summarization", "rag"])]


def _prompts_dir(tmp_path: Path) -> Path:
    d = tmp_path / "prompts"
    d.mkdir(exist_ok=True)
    for name, rows in (("mt_bench.jsonl", _MT), ("spec_bench.jsonl", _SPEC), ("code_edit.jsonl", [{"prompt": "x"}])):
        (d / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d


def test_prompt_rows_keep_every_turn_and_the_category(tmp_path):
    fmt, rows = read_prompt_rows(_prompts_dir(tmp_path) / "spec_bench.jsonl")
    assert fmt == "spec_bench" and rows[0].turns == ("Write a poem.", "Rewrite it in French.")
    assert [r.category for r in rows[1:4]] == ["math", "summarization", "rag"]
    assert rows[2].turns == ("summarization task 0",)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"category": "writing", "turns": ["a", 3]}) + "\n")
    with pytest.raises(DatasetError, match=r"bad.jsonl:1: 'turns' must be a non-empty list of strings"):
        read_prompt_rows(bad)


def test_dataset_names_pick_only_their_category(tmp_path):
    d = _prompts_dir(tmp_path)
    for name in ("spec_bench_summarization", "spec_bench:summarization"):
        w = load_workload(name, d, 10)
        assert w.category == "summarization"
        assert w.conversations == (("summarization task 0",), ("summarization task 3",))
    assert load_workload("spec_bench_rag", d, 1).conversations == (("rag task 1",),)
    assert load_workload("mt_bench:math", d, 10).conversations == (("Add 2 and 2.",),)
    assert len(load_workload("spec_bench", d, 100).conversations) == len(_SPEC)
    with pytest.raises(DatasetError, match=r"no category 'poetry'; its categories are math \(1 rows\), rag \(2 "):
        load_workload("spec_bench:poetry", d, 10)
    with pytest.raises(DatasetError, match="has no categories"):
        load_workload("code_edit:edits", d, 10)
    with pytest.raises(DatasetError, match=r"neither a prompt file nor a named set; valid names: mt_bench, "
                       r"spec_bench, humaneval, code_edit, spec_bench_summarization, spec_bench_rag, NAME:CATEGORY"):
        load_workload("spec_bench_poetry", d, 10)


def test_turns_keep_conversations_and_refuse_single_turn_rows(tmp_path):
    d = _prompts_dir(tmp_path)
    w = load_workload("mt_bench", d, 10, turns=2)
    assert w.turns == 2 and w.prompts(2) == ["Rewrite it in French.", "Now multiply them."]
    with pytest.raises(DatasetError, match=r"--turns 2: 2 of the 2 prompts of spec_bench_rag have fewer turns"):
        load_workload("spec_bench_rag", d, 10, turns=2)
    assert [p.label for p in level_phases(1, 1)] == [""]
    assert [(p.turn, p.repetition, p.label) for p in level_phases(2, 2)] == [
        (1, 1, "pass 1, turn 1"), (2, 1, "pass 1, turn 2"), (1, 2, "pass 2, turn 1"), (2, 2, "pass 2, turn 2")]


def test_real_spec_bench_categories(shared_data):
    path = shared_data / "prompts" / "spec_bench.jsonl"
    if not path.is_file():
        pytest.skip(f"{path} is absent: the real Spec-Bench set is not available")
    _, rows = read_prompt_rows(path)
    for category in ("summarization", "rag"):
        w = load_workload(f"spec_bench_{category}", shared_data / "prompts", 1024)
        expected = tuple(r.turns for r in rows if r.category == category)
        assert len(expected) == 80 and w.conversations == expected


def test_a_failed_turn_leaves_its_conversation_unsent(fake):
    f, url = fake
    f.bodies.clear()
    history = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello!"}]
    results, _ = asyncio.run(_level(url, prompts=["And then?"], num_requests=2, concurrency=2, max_tokens=2,
                                    histories=[None, history]))
    assert not results[0].ok and "not sent" in results[0].error and results[1].ok
    assert [b["messages"] for b in f.bodies] == [history + [{"role": "user", "content": "And then?"}]]
    with pytest.raises(ValueError, match="1 histories for 2 requests"):
        asyncio.run(_level(url, prompts=["p"], num_requests=2, concurrency=1, max_tokens=2, histories=[history]))


def test_cli_sends_turn_2_with_turn_1s_answer_and_reports_each_turn(fake, tmp_path):
    f, url = fake
    f.bodies.clear()
    out = tmp_path / "out"
    assert serve.main(["--url", url, "--nextn_configs", "--llama_cpp", "--dataset", "mt_bench", "--prompts_dir",
                       str(_prompts_dir(tmp_path)), "--turns", "2", "--concurrency", "1", "--max_tokens", "3",
                       "--runs", "1", "--output_dir", str(out)]) == 0
    turn2 = [b["messages"] for b in f.bodies if len(b["messages"]) > 1]
    user = [{"role": "user", "content": t} for t in ("Write a poem.", "Rewrite it in French.", "Add 2 and 2.",
                                                    "Now multiply them.")]
    answers = [{"role": "assistant", "content": t} for t in ("Writ0 Writ1 Writ2 ", "Add 0 Add 1 Add 2 ")]
    assert turn2 == [[user[0], answers[0], user[1]], [user[2], answers[1], user[3]]]  # the fake's turn-1 answers
    report = json.loads((out / "serve.json").read_text())
    assert report["turns"] == 2 and report["format"] == "mt_bench"
    levels = report["configs"][0]["levels"]
    assert [(lv["phase"], lv["turn"], lv["num_requests"], lv["num_failed"]) for lv in levels] == [
        ("turn 1", 1, 2, 0), ("turn 2", 2, 2, 0)]
    md = (out / "serve.md").read_text()
    assert f"| url {url} (turn 1) |" in md and f"| url {url} (turn 2) |" in md and "2 turns" in md


def test_cli_repeat_sends_the_same_prompts_every_pass_and_reports_each(fake, tmp_path):
    f, url = fake
    f.bodies.clear()
    out = tmp_path / "out"
    assert serve.main(["--url", url, "--nextn_configs", "--llama_cpp", "--dataset", "spec_bench_summarization",
                       "--prompts_dir", str(_prompts_dir(tmp_path)), "--repeat", "3", "--concurrency", "1",
                       "--max_tokens", "2", "--endpoint", "completions", "--output_dir", str(out)]) == 0
    sent = [b["prompt"] for b in f.bodies[1:]]  # after the warm-up
    assert f.bodies[0]["prompt"] == serve.WARMUP_PROMPT
    assert sent == ["summarization task 0", "summarization task 3"] * 3
    report = json.loads((out / "serve.json").read_text())
    assert report["repeat"] == 3 and report["runs"] == 1 and report["category"] == "summarization"
    levels = report["configs"][0]["levels"]
    assert [(lv["phase"], lv["repetition"], len(lv["passes_output_tok_s"])) for lv in levels] == [
        ("pass 1", 1, 1), ("pass 2", 2, 1), ("pass 3", 3, 1)]
    assert f"| url {url} (pass 3) | 1 |" in (out / "serve.md").read_text()


# The lossless check and the table ----------------------------------------------------------------------------------
def _level_result(c: int, texts: dict[int, str]) -> LevelResult:
    m = LevelMetrics(2, 0, 1.0, 8, 8.0, 2.0, 10.0, 12.0, 5.0, 6.0, 4.0, 7.0, 10.5, 5.2)
    return LevelResult(c, m, [8.0], 0, 1.5 if c else None, 0.5, texts)


def test_lossless_check_compares_speculative_nextn_configs_with_plain():
    plain = ConfigResult("nextn plain", "nextn", False, [], [_level_result(1, {0: "abc", 1: "xyz"}),
                                                              _level_result(2, {0: "abc"})])
    ngram = ConfigResult("nextn ngram", "nextn", True, [], [_level_result(1, {0: "abc", 1: "xYz"}),
                                                             _level_result(2, {0: "abc"})])
    llama = ConfigResult("llama.cpp draft", "llama.cpp", True, [], [_level_result(1, {0: "other"})])
    mismatches, compared = lossless_mismatches([plain, ngram, llama])
    assert compared == 3 and [(m.label, m.concurrency, m.prompt_index, m.offset) for m in mismatches] == [
        ("nextn ngram", 1, 1, 1)]
    assert lossless_mismatches([ngram, llama]) == ([], 0)
    table = markdown_table([plain, ngram, ConfigResult("llama.cpp plain", "llama.cpp", False, [], error="boom")],
                           [1, 2])
    assert "| nextn plain | 8.0 | 10 / 5.0 | 8.0 | 10 / 5.0 |" in table
    assert "| llama.cpp plain | failed | – | failed | – |" in table and "- llama.cpp plain: boom" in table


def test_lossless_check_and_table_keep_phases_apart():
    def lv(phase: str, text: str) -> LevelResult:
        return LevelResult(**{**_level_result(1, {0: text}).__dict__, "phase": phase})
    plain = ConfigResult("nextn plain", "nextn", False, [], [lv("turn 1", "abc"), lv("turn 2", "xyz")])
    suffix = ConfigResult("nextn suffix", "nextn", True, [], [lv("turn 1", "abc"), lv("turn 2", "abc")])
    mismatches, compared = lossless_mismatches([plain, suffix])
    assert compared == 2 and [(m.phase, m.offset) for m in mismatches] == [("turn 2", 0)]
    table = markdown_table([plain, suffix], [1])
    assert "| nextn suffix (turn 1) | 8.0 | 10 / 5.0 |" in table and "| nextn suffix (turn 2) | 1 | 8.0 |" in table


# Argument refusals -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("extra, message", [
    (["--concurrency", "0"], "--concurrency must be in 1..256"),
    (["--concurrency", "257"], "--concurrency must be in 1..256"),
    (["--concurrency", "2", "2"], "repeats a level"),
    (["--runs", "0"], "--runs must be in 1..20"),
    (["--max_tokens", "100000"], "--max_tokens must be in 1..8192"),
    (["--num_prompts", "0"], "--num_prompts must be in 1..1024"),
    (["--request_rate", "0"], "--request_rate must be > 0"),
    (["--request_rate", "nan"], "--request_rate must be > 0"),
    (["--llama_cpp", "draft"], "needs --draft_model"),
    (["--nextn_configs", "missing.yaml"], "is not a file"),
    (["--model", "missing.gguf"], "is not a file"),
    (["--nextn_configs", "--llama_cpp"], "nothing to measure"),
    (["--url", "127.0.0.1:8000"], "not an http(s) URL"),
    (["--turns", "5"], "--turns must be in 1..4"),
    (["--repeat", "11"], "--repeat must be in 1..10"),
    (["--repeat", "2", "--runs", "2"], "give --runs 1 with --repeat"),
    (["--turns", "2", "--endpoint", "completions"], "needs --endpoint chat"),
    (["--dataset", "spec_bench_poetry"], "valid names: mt_bench, spec_bench"),
    (["--url", "http://127.0.0.1:1", "--restart_per_pass"], "cannot restart --url servers"),
    (["--temperature", "-1"], "--temperature must be in 0.0..100.0"),
    (["--top_p", "0"], "--top_p must be in (0, 1]"),
    (["--top_k", "-3"], "--top_k must be in 0..1048576"),
])
def test_bad_arguments_are_refused_before_any_server_starts(tmp_path, capsys, extra, message):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    argv = ["--model", str(model), "--output_dir", str(tmp_path / "out"), *extra]
    with pytest.raises(SystemExit) as e:
        serve.main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_directory_it_did_not_write_is_refused(tmp_path, capsys):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit) as e:
        serve.main(["--url", "http://127.0.0.1:1", "--nextn_configs", "--llama_cpp", "--output_dir",
                    str(tmp_path / "out")])
    assert e.value.code == 2 and "was not written by nextn bench.serve" in capsys.readouterr().err
    assert (tmp_path / "out" / "notes.txt").read_text() == "mine"


# The real nextn app on stories260K ---------------------------------------------------------------------------------
def test_real_nextn_app_on_stories260k(tmp_path):
    if not STORIES.is_file():
        pytest.skip(f"{STORIES} is absent (../shared/data): the real stories260K model is not available")
    from nextn import LLM
    from nextn.build.engine_builder import build_engine
    from nextn.serving.openai_server import create_app

    engine = tmp_path / "engine"
    build_engine(STORIES, engine, max_seq_len=256, progress=False)
    llm = LLM(engine, device="cpu")
    server, thread, url = _serve_in_thread(create_app(llm, "stories"))
    try:
        out = tmp_path / "out"
        assert serve.main(["--url", url, "--nextn_configs", "--llama_cpp", "--dataset", str(_prompt_file(tmp_path)),
                           "--num_prompts", "2", "--concurrency", "1", "2", "--max_tokens", "8", "--runs", "1",
                           "--endpoint", "completions", "--output_dir", str(out)]) == 0
        levels = json.loads((out / "serve.json").read_text())["configs"][0]["levels"]
        for level in levels:  # EOS ignored: every request ran max_tokens tokens, counted from usage
            assert level["output_tokens"] == 8 * level["num_requests"] and level["num_failed"] == 0
            assert level["ttft_ms_p50"] > 0 and level["tpot_ms_p50"] > 0
    finally:
        server.should_exit = True
        thread.join(30)
        llm.shutdown()
