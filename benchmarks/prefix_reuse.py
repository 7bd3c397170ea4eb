"""MT-bench two-turn conversations with prefix caching on and off: turn-2 TTFT, end-to-end time, hit rate.

Each conversation is the MT-bench question's first turn, the model's greedy answer, then its second turn, rendered
by the model's chat template (SmolLM2's `<|im_start|>` turns), so the turn-2 prompt starts with the whole turn-1
prompt and answer — what a chat client resends. Conversations run one after another (batch 1: TTFT is then the
prefill alone), each on two engines loaded side by side, `enable_block_reuse` false and true, in alternating order
(a machine whose load drifts biases neither). Reported per turn: mean and median TTFT and end-to-end time (ms),
the reused share of the prompt tokens, and whether the greedy answers of the two engines are identical.

`--serve` does the same through two `nextn serve` processes with the `openai` client: TTFT is the time to the
first streamed content chunk as the client sees it; the hit rate comes from `/metrics`
(`nextn_prefix_cache_hits_total / nextn_prefix_cache_queries_total`).

    python -m benchmarks.prefix_reuse --model ../shared/data/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf \
        --num_conversations 8 --max_tokens 64 [--speculative ngram] [--serve]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from nextn.config.prompt_files import json_lines
from nextn.bench.outputs import check_report, write_report
from nextn.bench.real_models import DEFAULT_WORK_DIR, SHARED_DATA, build_cached_engine

SPECS = {"none": None, "ngram": {"decoding_type": "NGram", "max_draft_len": 4, "max_matching_ngram_size": 3}}


@dataclass
class Turn:
    """One measured request. Times in ms; `cached` = prompt tokens reused from the prefix cache (−1: unknown,
    through the server); `al` = acceptance length (−1 through the server)."""

    conversation: int
    turn: int
    prompt_tokens: int
    cached: int
    ttft_ms: float
    e2e_ms: float
    text: str
    al: float = -1.0


def load_conversations(num: int, data_dir: Path = SHARED_DATA) -> list[tuple[str, str]]:
    """(first turn, second turn) of the first `num` MT-bench questions.

    Raises:
        DatasetError: ../shared/data/prompts/mt_bench.jsonl is absent or unreadable (bench/dataset.py's bounds).
    """
    rows = [row for _, row in json_lines(data_dir / "prompts" / "mt_bench.jsonl", "prompt file")]
    return [(r["turns"][0], r["turns"][1]) for r in rows[:num]]


def _messages(conv: tuple[str, str], answer: str | None) -> list[dict]:
    msgs = [{"role": "user", "content": conv[0]}]
    return msgs if answer is None else msgs + [{"role": "assistant", "content": answer},
                                               {"role": "user", "content": conv[1]}]


def _chat_ids(llm, messages: list[dict]) -> list[int]:
    ids = llm.tokenizer.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return [int(i) for i in (ids["input_ids"] if hasattr(ids, "keys") else ids)]


def _ask(llm, conv_index: int, turn: int, messages: list[dict], max_tokens: int) -> Turn:
    from nextn.runtime.sampling_params import SamplingParams

    out = llm.generate(_chat_ids(llm, messages), SamplingParams(max_tokens=max_tokens))
    c = out.outputs[0]
    return Turn(conv_index, turn, len(out.prompt_token_ids), out.num_cached_tokens, c.ttft_ms,
                (c.finished_time - c.arrival_time) * 1e3, c.text, c.acceptance_length)


def run_in_process(engine_dir: Path, convs: list[tuple[str, str]], max_tokens: int, spec: dict | None
                   ) -> dict[bool, list[Turn]]:
    """Both engines (reuse off, on), conversation by conversation in alternating order → turns per setting."""
    from nextn.runtime.llm import LLM

    llms = {reuse: LLM(engine_dir, speculative_config=spec, max_batch_size=1, max_seq_len=512, device="cpu",
                       kv_cache_config={"enable_block_reuse": reuse}) for reuse in (False, True)}
    for llm in llms.values():  # warm-up (first-call overheads), then a cold cache
        _ask(llm, -1, 1, [{"role": "user", "content": "Hello!"}], 8)
        llm.reset_prefix_cache()
    turns: dict[bool, list[Turn]] = {False: [], True: []}
    for i, conv in enumerate(convs):
        for reuse in ((False, True) if i % 2 == 0 else (True, False)):
            first = _ask(llms[reuse], i, 1, _messages(conv, None), max_tokens)
            turns[reuse] += [first, _ask(llms[reuse], i, 2, _messages(conv, first.text), max_tokens)]
        print(f"conversation {i}: turn-2 TTFT off {turns[False][-1].ttft_ms:.0f} ms, on {turns[True][-1].ttft_ms:.0f} "
              f"ms ({turns[True][-1].cached}/{turns[True][-1].prompt_tokens} tokens reused)", file=sys.stderr)
    return turns


# Through `nextn serve` -----------------------------------------------------------------------------------------
def _start(engine_dir: Path, reuse: bool, spec: dict | None, work: Path) -> tuple[subprocess.Popen, str]:
    import socket

    import yaml

    options = work / f"reuse_{reuse}.yaml"
    options.write_text(yaml.safe_dump({"kv_cache_config": {"enable_block_reuse": reuse}, "speculative_config": spec,
                                       "max_batch_size": 1, "max_seq_len": 512}))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "nextn.cli.main", "serve", "--engine_dir", str(engine_dir),
                             "--port", str(port), "--device", "cpu", "--log_level", "warning",
                             "--extra_llm_api_options", str(options)])
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 600
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"nextn serve exited with status {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            if time.monotonic() > deadline:
                proc.kill()
                raise SystemExit("nextn serve did not become healthy in 600 s") from None
            time.sleep(1)


def _cache_counters(url: str) -> tuple[float, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    values = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in ("nextn_prefix_cache_queries_total", "nextn_prefix_cache_hits_total"):
            values[name] = float(value)
    return values["nextn_prefix_cache_queries_total"], values["nextn_prefix_cache_hits_total"]


def _stream(client, model: str, conv_index: int, turn: int, messages: list[dict], max_tokens: int) -> Turn:
    t0 = time.perf_counter()
    first, parts, usage = None, [], None
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            parts.append(chunk.choices[0].delta.content)
        usage = chunk.usage or usage
    end = time.perf_counter()
    return Turn(conv_index, turn, usage.prompt_tokens if usage else -1, -1, ((first or end) - t0) * 1e3,
                (end - t0) * 1e3, "".join(parts))


def run_served(engine_dir: Path, convs: list[tuple[str, str]], max_tokens: int, spec: dict | None
               ) -> tuple[dict[bool, list[Turn]], dict[bool, tuple[float, float]]]:
    """As `run_in_process` through two `nextn serve` processes; also (queries, hits) per setting from /metrics."""
    import openai

    with tempfile.TemporaryDirectory() as work:
        servers = {reuse: _start(engine_dir, reuse, spec, Path(work)) for reuse in (False, True)}
        try:
            clients = {r: openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
                       for r, (_, url) in servers.items()}
            model = clients[False].models.list().data[0].id
            for reuse, client in clients.items():  # warm-up
                _stream(client, model, -1, 1, [{"role": "user", "content": "Hello!"}], 8)
            start = {r: _cache_counters(url) for r, (_, url) in servers.items()}
            turns: dict[bool, list[Turn]] = {False: [], True: []}
            for i, conv in enumerate(convs):
                for reuse in ((False, True) if i % 2 == 0 else (True, False)):
                    first = _stream(clients[reuse], model, i, 1, _messages(conv, None), max_tokens)
                    turns[reuse] += [first, _stream(clients[reuse], model, i, 2, _messages(conv, first.text),
                                                    max_tokens)]
                print(f"served conversation {i}: turn-2 TTFT off {turns[False][-1].ttft_ms:.0f} ms, on "
                      f"{turns[True][-1].ttft_ms:.0f} ms", file=sys.stderr)
            counters = {}
            for r, (_, url) in servers.items():
                q, h = _cache_counters(url)
                counters[r] = (q - start[r][0], h - start[r][1])
        finally:
            for proc, _ in servers.values():
                proc.terminate()
                proc.wait(60)
    return turns, counters


# Summary -------------------------------------------------------------------------------------------------------
def summarize(turns: dict[bool, list[Turn]], counters: dict[bool, tuple[float, float]] | None = None) -> dict:
    """Per setting and turn: mean / median TTFT and end-to-end ms, hit rate; identical answers off vs on."""
    out: dict = {}
    for reuse, rows in turns.items():
        for turn in (1, 2):
            sel = [t for t in rows if t.turn == turn]
            prompt = sum(t.prompt_tokens for t in sel)
            out[f"reuse_{'on' if reuse else 'off'}_turn{turn}"] = {
                "ttft_ms_mean": statistics.mean(t.ttft_ms for t in sel),
                "ttft_ms_median": statistics.median(t.ttft_ms for t in sel),
                "e2e_ms_mean": statistics.mean(t.e2e_ms for t in sel),
                "prompt_tokens_mean": prompt / len(sel),
                "acceptance_length_mean": statistics.mean(t.al for t in sel),
                "hit_rate": sum(t.cached for t in sel) / prompt if sel[0].cached >= 0 else None}
        if counters is not None:
            q, h = counters[reuse]
            out[f"reuse_{'on' if reuse else 'off'}_metrics_hit_rate"] = h / q if q else 0.0
    out["identical_answers"] = sum(a.text == b.text for a, b in zip(turns[False], turns[True]))
    out["num_turns"] = len(turns[False])
    return out


def table(title: str, s: dict) -> str:
    lines = [f"{title}", "| Prefix caching | Turn | Prompt tokens (mean) | TTFT mean / median (ms) "
             "| End-to-end mean (ms) | Reused / prompt tokens | AL (mean) |", "|---|---|---|---|---|---|---|"]
    for reuse in ("off", "on"):
        for turn in (1, 2):
            r = s[f"reuse_{reuse}_turn{turn}"]
            rate = s.get(f"reuse_{reuse}_metrics_hit_rate") if r["hit_rate"] is None else r["hit_rate"]
            rate_text = "—" if rate is None else f"{rate:.1%}" + (" (all turns, /metrics)" if r["hit_rate"] is None
                                                                  else "")
            lines.append(f"| {reuse} | {turn} | {r['prompt_tokens_mean']:.0f} | {r['ttft_ms_mean']:.0f} / "
                         f"{r['ttft_ms_median']:.0f} | {r['e2e_ms_mean']:.0f} | {rate_text} | "
                         + ("—" if r["acceptance_length_mean"] < 0 else f"{r['acceptance_length_mean']:.2f}") + " |")
    lines.append(f"Identical greedy answers, off vs on: {s['identical_answers']}/{s['num_turns']}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.prefix_reuse", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, required=True, help="a .gguf file with a chat template")
    p.add_argument("--num_conversations", type=int, default=8, help="MT-bench questions (default 8)")
    p.add_argument("--max_tokens", type=int, default=64, help="most tokens per answer (default 64; EOS stops)")
    p.add_argument("--speculative", choices=sorted(SPECS), default="none", help="drafter (default none)")
    p.add_argument("--serve", action="store_true", help="also through `nextn serve` with the openai client")
    p.add_argument("--work_dir", type=Path, default=DEFAULT_WORK_DIR, help="where the fp32 engine is built")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    p.add_argument("--json", type=Path, help="also write the raw turns and the summaries here (an existing file "
                   "only when a run of this benchmark wrote it)")
    args = p.parse_args(argv)
    check_report(p, args.json, "prefix_reuse")
    import torch

    torch.set_num_threads(args.threads)
    engine = build_cached_engine(args.model, "float32", args.work_dir)
    convs = load_conversations(args.num_conversations)
    spec = SPECS[args.speculative]
    turns = run_in_process(engine, convs, args.max_tokens, spec)
    results = {"in_process": summarize(turns)}
    print(table(f"LLM API, speculative {args.speculative}:", results["in_process"]))
    raw = {"in_process": {str(k): [asdict(t) for t in v] for k, v in turns.items()}}
    if args.serve:
        served, counters = run_served(engine, convs, args.max_tokens, spec)
        results["served"] = summarize(served, counters)
        print(table(f"nextn serve + openai client, speculative {args.speculative}:", results["served"]))
        raw["served"] = {str(k): [asdict(t) for t in v] for k, v in served.items()}
    if args.json:
        write_report(args.json, "prefix_reuse", {"args": {k: str(v) for k, v in vars(args).items()},
                                                 "summary": results, "turns": raw})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
