"""Suffix decoding replayed on recorded greedy outputs: nextn's `SuffixDrafter` beside Arctic Inference's suffix
tree (`arctic_inference.suffix_decoding`, when it imports), on the same token streams (a benchmark, not a test).

Streams: the greedy plain outputs of `--engine` on the first `--num_prompts` prompts of `--dataset` (chat
template, `--max_tokens` new tokens, EOS ignored), decoded once and kept in OUTPUT_DIR/streams.json (reused when
the engine, the prompts and the token count match). Greedy verification is deterministic given the drafts, so a
replay reproduces what the engine emits at batch 1 without running the model:

    each request   its prompt, then the first output token (the prefill's), go into the drafter; each step it
                   proposes drafts, the step verifies k of them, accepts the longest prefix that equals the
                   recorded output and emits it plus one token — exactly the engine's greedy step
    nextn          `SuffixDrafter.prefilled` / `verified` (the protocol methods' host halves) and, with
                   `--step_profile`, its measured k (`proposal_len` over the profile's batch-1 step times)
    Arctic         `SuffixDecodingCache.start_request` / `speculate` / `add_active_response` / `stop_request`, the
                   calls vLLM's `method: suffix` makes; every draft it returns is verified (vLLM's rule); chains,
                   and with `--arctic_tree` its speculation trees (accepted: the deepest path of the tree that
                   equals the output)
    copy oracle    an upper bound for every copying drafter: each step verifies exactly the longest stretch of the
                   output to come (≤ K) found in the request's context or an earlier output (with a step
                   profile, its prefix of the most tokens per second); it reads the output before it is decoded
    passes         `--passes 2`: the same requests again, the global trees warm with pass 1's outputs (an
                   agent's retries); each pass reported apart

Reported per system and pass: AL (tokens per step), verified draft rows per step, the drafter's host time per step
(µs, update + proposal, this CPU), and with a step profile the decode speed-up over plain decoding it predicts:
tokens × t(1, 0) / Σ (t(1, k_step) + host time). `--step_profile`: the engine's step profile on this machine
(`step_profile: auto` writes it at first load into ~/.cache/nextn/step_profiles; `nextn cache` lists them).

    python -m benchmarks.suffix_replay --engine runs/eng/qwen15-w4a8 --dataset code_edit --num_prompts 16 \\
        --max_tokens 256 --max_draft_len 16 --passes 2 --step_profile PROFILE.json --output_dir runs/suffix_replay
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from nextn.bench.outputs import check_report, write_report
from nextn.bench.serve_workload import load_workload
from nextn.speculative.suffix import SuffixDrafter
from nextn.speculative.suffix_tree import MAX_DEPTH

MODULE = "suffix_replay"
MAX_PROMPTS = 1000  # the most requests a replay decodes
MAX_NEW_TOKENS = 4096
Stream = tuple[list[int], list[int]]  # (prompt token ids, greedy output token ids)
StepTime = Callable[[int], float]  # k → seconds of a batch-1 step verifying k drafts


@dataclass
class PassResult:
    """One system's replay of every stream once."""

    system: str
    passno: int
    tokens: int = 0  # decode tokens (after the prefill's)
    steps: int = 0
    rows: int = 0  # verified draft rows
    host_s: float = 0.0  # the drafter's update + proposal time
    step_s: float = 0.0  # Σ t(1, k) over the steps (0 without a profile)

    @property
    def al(self) -> float:
        return self.tokens / max(self.steps, 1)

    def speedup(self, plain_step: float | None) -> float | None:
        """Predicted decode speed over plain decoding (None without a step profile)."""
        if not plain_step or not self.step_s:
            return None
        return self.tokens * plain_step / (self.step_s + self.host_s)

    def row(self, plain_step: float | None) -> dict:
        s = self.speedup(plain_step)
        return {"system": self.system, "pass": self.passno, "AL": round(self.al, 3),
                "rows_per_step": round(self.rows / max(self.steps, 1), 2),
                "host_us_per_step": round(1e6 * self.host_s / max(self.steps, 1), 1),
                "predicted_speedup": None if s is None else round(s, 3), **asdict(self)}


def accepted_prefix(drafts: Sequence[int], truth: Sequence[int]) -> int:
    """How many leading drafts equal the recorded continuation (greedy verification of a chain)."""
    n = 0
    for d, t in zip(drafts, truth):
        if d != t:
            break
        n += 1
    return n


def accepted_tree(tokens: Sequence[int], parents: Sequence[int], truth: Sequence[int]) -> int:
    """The depth of the tree's deepest path that equals the recorded continuation (`parents[i]`: node i's parent
    index, −1 for the root's children; a parent precedes its children)."""
    depth, node = 0, -1
    while depth < len(truth):
        nxt = next((i for i, (t, p) in enumerate(zip(tokens, parents)) if p == node and t == truth[depth]), None)
        if nxt is None:
            break
        node, depth = nxt, depth + 1
    return depth


def replay_nextn(streams: Sequence[Stream], drafter: SuffixDrafter, passes: int, step_time: StepTime | None,
                 name: str = "nextn") -> list[PassResult]:
    """Each stream through `drafter` at batch 1 (slot 0), greedy, `passes` times (module docstring)."""
    out = []
    for passno in range(1, passes + 1):
        res = PassResult(name, passno)
        for prompt, output in streams:
            t0 = time.perf_counter()
            drafts = drafter.prefilled([0], [0], [list(prompt) + output[:1]])[0]
            res.host_s += time.perf_counter() - t0
            i = 1
            while i < len(output):
                t0 = time.perf_counter()
                k = drafter.proposal_len([0])
                res.host_s += time.perf_counter() - t0
                acc = accepted_prefix(drafts[:k], output[i:])
                emitted = output[i:i + acc + 1]
                t0 = time.perf_counter()
                drafts = drafter.verified([0], [len(prompt) + i], [emitted], k)[0]
                res.host_s += time.perf_counter() - t0
                res.tokens, res.steps, res.rows = res.tokens + len(emitted), res.steps + 1, res.rows + k
                res.step_s += step_time(k) if step_time else 0.0
                i += len(emitted)
        out.append(res)
    return out


def replay_arctic(streams: Sequence[Stream], passes: int, step_time: StepTime | None, max_draft_len: int,
                  depth: int, spec_factor: float, min_token_prob: float, tree: bool) -> list[PassResult]:
    """The same streams through Arctic Inference's `SuffixDecodingCache` (ImportError when it is absent)."""
    from arctic_inference.suffix_decoding import SuffixDecodingCache

    cache = SuffixDecodingCache(max_tree_depth=depth, max_cached_requests=1000)
    name = "Arctic (tree)" if tree else "Arctic"
    out = []
    for passno in range(1, passes + 1):
        res = PassResult(name, passno)
        for r, (prompt, output) in enumerate(streams):
            req = f"{passno}/{r}"
            context = list(prompt) + output[:1]
            t0 = time.perf_counter()
            cache.start_request(req, list(prompt))
            cache.add_active_response(req, output[:1])
            res.host_s += time.perf_counter() - t0
            i = 1
            while i < len(output):
                t0 = time.perf_counter()
                draft = cache.speculate(req, context[-depth:], max_spec_tokens=max_draft_len,
                                        max_spec_factor=spec_factor, min_token_prob=min_token_prob,
                                        use_tree_spec=tree)
                res.host_s += time.perf_counter() - t0
                k = len(draft.token_ids)
                acc = (accepted_tree(draft.token_ids, draft.parents, output[i:]) if tree
                       else accepted_prefix(draft.token_ids, output[i:]))
                emitted = output[i:i + acc + 1]
                t0 = time.perf_counter()
                cache.add_active_response(req, emitted)
                res.host_s += time.perf_counter() - t0
                context += emitted
                res.tokens, res.steps, res.rows = res.tokens + len(emitted), res.steps + 1, res.rows + k
                res.step_s += step_time(k) if step_time else 0.0
                i += len(emitted)
            cache.stop_request(req)
        out.append(res)
    return out


class _Haystack:
    """Token sequences searchable for a contiguous run (each token as " id" in one string, so `str.find` matches
    only at token boundaries)."""

    def __init__(self) -> None:
        self.text = ""

    def add(self, tokens: Sequence[int], separate: bool = False) -> None:
        self.text += (" |" if separate else "") + "".join(f" {t}" for t in tokens)

    def longest_run(self, wanted: Sequence[int]) -> int:
        """The longest prefix of `wanted` that occurs here (binary search: a run's prefixes occur too)."""
        lo, hi = 0, len(wanted)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.text.find("".join(f" {t}" for t in wanted[:mid]) + " ") >= 0 or \
                    self.text.endswith("".join(f" {t}" for t in wanted[:mid])):
                lo = mid
            else:
                hi = mid - 1
        return lo


def replay_copy_oracle(streams: Sequence[Stream], passes: int, step_time: StepTime | None,
                       max_draft_len: int) -> list[PassResult]:
    """The most any drafter that copies could give: each step the oracle knows the longest stretch (≤ K tokens)
    of the recorded output still to come that occurs in the request's own context (prompt and output so far) or in
    an earlier request's output (the sources a suffix tree holds), and verifies exactly that many drafts — with a
    step profile, the prefix of it with the most tokens per second, (1 + k) / t(1, k). An upper bound, not a
    drafter: it reads the output before it is decoded."""
    earlier = _Haystack()
    out = []
    for passno in range(1, passes + 1):
        res = PassResult("copy oracle (upper bound)", passno)
        for prompt, output in streams:
            own = _Haystack()
            own.add(list(prompt) + output[:1])
            i = 1
            while i < len(output):
                wanted = output[i:i + max_draft_len]
                run = max(own.longest_run(wanted), earlier.longest_run(wanted))
                k = run if step_time is None else max(range(run + 1), key=lambda j: ((1 + j) / step_time(j), -j))
                emitted = output[i:i + k + 1]
                own.add(emitted)
                res.tokens, res.steps, res.rows = res.tokens + len(emitted), res.steps + 1, res.rows + k
                res.step_s += step_time(k) if step_time else 0.0
                i += len(emitted)
            earlier.add(output, separate=True)
        out.append(res)
    return out


def record_streams(engine: Path, dataset: str, prompts_dir: Path, num_prompts: int, max_tokens: int, turn: int,
                   path: Path) -> list[Stream]:
    """Greedy plain outputs of `engine` on the dataset's user turn `turn` (turn 2: after turn 1 and its greedy
    answer, as `bench.serve --turns 2` sends it), cached in `path` (a report of this benchmark) by their inputs."""
    key = {"engine": str(engine.resolve()), "dataset": dataset, "num_prompts": num_prompts, "max_tokens": max_tokens,
           "turn": turn}
    if path.exists():
        cached = json.loads(path.read_text())
        if cached.get("key") == key:
            return [(p, o) for p, o in cached["streams"]]
    from nextn.bench.real_models import nextn_greedy
    from nextn.runtime.llm import LLM

    conversations = load_workload(dataset, prompts_dir, num_prompts, turn).conversations
    llm = LLM(str(engine), max_batch_size=min(8, len(conversations)))
    history: list[list[dict]] = [[] for _ in conversations]
    for t in range(turn):
        chats = [h + [{"role": "user", "content": turns[t]}] for h, turns in zip(history, conversations)]
        prompts = [llm.tokenizer.apply_chat_template(c) for c in chats]
        outputs = nextn_greedy(llm, prompts, max_tokens, ignore_eos=True)
        history = [c + [{"role": "assistant", "content": llm.tokenizer.decode(o)}]
                   for c, o in zip(chats, outputs)]
    streams = [(list(p), list(o)) for p, o in zip(prompts, outputs)]
    write_report(path, MODULE, {"key": key, "streams": streams}, "--output_dir", indent=None)
    return streams


def batch1_step_time(profile_file: Path, max_draft_len: int) -> tuple[StepTime, float]:
    """(k → t(1, k) seconds, t(1, 0)) from a step profile's batch-1 times (interpolated between measured k as the
    adaptive policy does).

    Raises:
        StepProfileError: not a step profile (speculative/step_profile.py); ValueError: it has no batch-1 times.
    """
    from nextn.speculative.draft_len_policy import AdaptiveDraftLen, StaticDraftLen
    from nextn.speculative.step_profile import load_step_profile

    profile = load_step_profile(profile_file)
    if 1 not in profile.step_time:
        raise ValueError(f"{profile_file}: no batch-1 step times")
    policy = AdaptiveDraftLen(StaticDraftLen(max_draft_len), profile=profile.step_time)
    t0 = profile.step_time[1][0]
    return (lambda k: t0 * policy.relative_step_time(1, k)), t0


def _args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.suffix_replay", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", type=Path, required=True, help="nextn engine directory (or checkpoint) to decode with")
    p.add_argument("--dataset", default="code_edit", help="a serving-benchmark dataset name (default code_edit)")
    p.add_argument("--prompts_dir", type=Path, default=Path("../shared/data/prompts"))
    p.add_argument("--num_prompts", type=int, default=16)
    p.add_argument("--max_tokens", type=int, default=256)
    p.add_argument("--turn", type=int, default=1, choices=[1, 2], help="replay this user turn (2: MT-bench's second, "
                   "after the first and its greedy answer)")
    p.add_argument("--max_draft_len", type=int, default=16, help="K (default 16, configs/suffix.yaml's)")
    p.add_argument("--max_tree_depth", type=int, default=24)
    p.add_argument("--max_spec_factor", type=float, default=1.0)
    p.add_argument("--min_token_prob", type=float, default=0.1)
    p.add_argument("--passes", type=int, default=2, help="replays of all requests (pass 2+: global trees warm)")
    p.add_argument("--arctic_tree", action="store_true", help="also Arctic's speculation trees")
    p.add_argument("--step_profile", type=Path, help="the engine's step profile JSON: predicted speed-ups, and "
                   "nextn's k by measurement")
    p.add_argument("--output_dir", type=Path, required=True, help="streams.json and suffix_replay.json go here")
    args = p.parse_args(argv)
    for name in ("streams.json", "suffix_replay.json"):
        check_report(p, args.output_dir / name, MODULE, "--output_dir")
    if not 1 <= args.num_prompts <= MAX_PROMPTS or not 1 <= args.max_tokens <= MAX_NEW_TOKENS:
        p.error(f"--num_prompts must be in 1..{MAX_PROMPTS} and --max_tokens in 1..{MAX_NEW_TOKENS}")
    if not 1 <= args.max_tree_depth <= MAX_DEPTH or not 1 <= args.max_draft_len <= MAX_DEPTH:
        p.error(f"--max_tree_depth and --max_draft_len must be in 1..{MAX_DEPTH}")
    if not 1 <= args.passes <= 5:
        p.error("--passes must be in 1..5")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = _args(argv)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    streams = record_streams(args.engine, args.dataset, args.prompts_dir, args.num_prompts, args.max_tokens,
                             args.turn, args.output_dir / "streams.json")
    step_time, plain_step = batch1_step_time(args.step_profile, args.max_draft_len) if args.step_profile else (None, None)
    kw = dict(max_tree_depth=args.max_tree_depth, max_spec_factor=args.max_spec_factor,
              min_token_prob=args.min_token_prob)
    longest = SuffixDrafter(args.max_draft_len, **kw)
    results = replay_nextn(streams, longest, args.passes, step_time, "nextn (longest proposal)")
    if step_time is not None:
        measured = SuffixDrafter(args.max_draft_len, **kw)
        measured.set_step_times(lambda b, k: step_time(k) / plain_step)
        results += replay_nextn(streams, measured, args.passes, step_time, "nextn (k by measurement)")
    try:
        for tree in (False, True) if args.arctic_tree else (False,):
            results += replay_arctic(streams, args.passes, step_time, args.max_draft_len, args.max_tree_depth,
                                     args.max_spec_factor, args.min_token_prob, tree)
    except ImportError as e:
        print(f"arctic_inference not importable ({e}): nextn only")
    results += replay_copy_oracle(streams, args.passes, step_time, args.max_draft_len)
    rows = [r.row(plain_step) for r in results]
    header = f"{'system':28s} pass     AL  rows/step  host µs/step  predicted ×plain"
    print(header)
    for r in rows:
        sp = "—" if r["predicted_speedup"] is None else f"{r['predicted_speedup']:.2f}×"
        print(f"{r['system']:28s} {r['pass']:4d} {r['AL']:6.2f} {r['rows_per_step']:10.2f} "
              f"{r['host_us_per_step']:13.1f}  {sp}")
    write_report(args.output_dir / "suffix_replay.json", MODULE, {"argv": sys.argv if argv is None else list(argv),
                                                                  "plain_step_s": plain_step, "results": rows},
                 "--output_dir")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
