"""The servers `python -m nextn.bench.serve` compares: their command lines, start (a free loopback port, /health),
stop (SIGTERM, then SIGKILL) and speculative-decoding counters (/metrics).

- `nextn serve --model GGUF -t T --max_batch_size N [--extra_llm_api_options YAML]` (src/nextn/cli/serve.py), one
  per config, `none` for plain decoding; N, the most requests in one step, is the highest concurrency level (as
  llama-server's `-np` slots), not the engine's build default (8);
- llama.cpp's `llama-server -m GGUF -t T -tb T -np N -c N·CTX --cont-batching --metrics` (b11434's `--help`;
  ../shared/PEERS.md), plain, with a draft model (`-md DRAFT --spec-draft-n-max K`), with the model's own MTP layer
  (`--spec-type draft-mtp --spec-draft-n-max K`) or an n-gram mode
  (`--spec-type ngram-simple|ngram-map-k|ngram-map-k4v|ngram-mod|ngram-cache`).

Both expose vLLM's speculative counters on /metrics under their own prefix (`nextn_spec_decode_num_drafts_total`,
`llamacpp:spec_decode_num_drafts_total`, ...): drafts = verify steps, draft tokens proposed, draft tokens accepted.
AL here is per verify step, 1 + accepted / drafts (llama-server's `mean_acc_len`), and DAR = accepted / draft tokens.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

#: llama-server's speculative modes (`--spec-type`) this benchmark runs; "draft" needs a draft model, "draft-mtp" a
#: GGUF that embeds its MTP layer (`{arch}.nextn_predict_layers`).
LLAMA_CPP_MODES = ("plain", "draft", "draft-mtp", "ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod",
                   "ngram-cache")
#: Seconds a server is given to exit after SIGTERM before it is killed.
STOP_GRACE_S = 15.0


class ServerError(RuntimeError):
    """A server that exited or never became healthy; the message ends with its log's last lines."""


@dataclass(frozen=True)
class ServerSpec:
    """One server configuration: its label (a table row), family ("nextn" or "llama.cpp"), command line (the
    port is appended at start) and whether its texts are checked against the family's plain config."""

    label: str
    family: str
    argv: tuple[str, ...]
    speculative: bool


def nextn_spec(model: Path, threads: int, config: str | None, max_batch_size: int | None = None) -> ServerSpec:
    """`nextn serve` on `model` with `threads` threads; `config` is a YAML of LLM arguments or None (plain);
    `max_batch_size` None keeps the engine's."""
    argv = [sys.executable, "-m", "nextn.cli.main", "serve", "--model", str(model), "-t", str(threads),
            "--host", "127.0.0.1", "--log_level", "warning"]
    if max_batch_size is not None:
        argv += ["--max_batch_size", str(max_batch_size)]
    if config is not None:
        argv += ["--extra_llm_api_options", str(config)]
    label = "nextn plain" if config is None else f"nextn {Path(config).stem}"
    return ServerSpec(label, "nextn", tuple(argv), speculative=config is not None and _drafts(Path(config)))


def _drafts(config: Path) -> bool:
    """Whether a YAML of LLM arguments sets a speculative_config (`speculative_config: null` is plain decoding, the
    reference of the lossless check; an unreadable file counts as speculative and fails when the server starts)."""
    import yaml

    try:
        data = yaml.safe_load(config.read_text())
    except (OSError, yaml.YAMLError):
        return True
    return not isinstance(data, dict) or data.get("speculative_config", True) is not None


def llama_cpp_spec(server_bin: Path, model: Path, threads: int, mode: str, parallel: int, ctx_per_slot: int,
                   draft_model: Path | None = None, draft_max: int = 3, extra_args: tuple[str, ...] = ()
                   ) -> ServerSpec:
    """`llama-server` on `model`: `parallel` slots of `ctx_per_slot` tokens each, `threads` threads for decode and
    prompt processing, continuous batching, /metrics on; `mode` one of LLAMA_CPP_MODES.

    Raises:
        ValueError: an unknown mode, or "draft" without a draft model.
    """
    if mode not in LLAMA_CPP_MODES:
        raise ValueError(f"llama.cpp mode {mode!r} is not one of {', '.join(LLAMA_CPP_MODES)}")
    argv = [str(server_bin), "-m", str(model), "-t", str(threads), "-tb", str(threads), "-np", str(parallel),
            "-c", str(parallel * ctx_per_slot), "--cont-batching", "--metrics", "--no-webui", "--host", "127.0.0.1"]
    if mode == "draft":
        if draft_model is None:
            raise ValueError("llama.cpp mode 'draft' needs --draft_model DRAFT.gguf")
        argv += ["-md", str(draft_model), "--spec-type", "draft-simple", "--spec-draft-n-max", str(draft_max)]
    elif mode == "draft-mtp":
        argv += ["--spec-type", mode, "--spec-draft-n-max", str(draft_max)]
    elif mode != "plain":
        argv += ["--spec-type", mode]
    return ServerSpec(f"llama.cpp {mode}", "llama.cpp", tuple(argv + list(extra_args)), speculative=mode != "plain")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout_s: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return r.status, r.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        return e.code, ""
    except (OSError, ValueError):
        return 0, ""


def _tail(log: Path, lines: int = 8) -> str:
    try:
        text = log.read_text(errors="replace").strip().splitlines()[-lines:]
    except OSError:
        return "(no log)"
    return "\n    ".join(text) or "(empty log)"


def _port_argv(spec: ServerSpec, port: int) -> list[str]:
    return [*spec.argv, "--port", str(port)]


def stop(proc: subprocess.Popen, grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM to the server's process group (it was started in its own session), SIGKILL after `grace_s`."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@contextlib.contextmanager
def running(spec: ServerSpec, log: Path, startup_timeout_s: float) -> Iterator[str]:
    """Start `spec` on a free loopback port (output to `log`), wait until GET /health answers 200, yield its base
    URL ("http://127.0.0.1:PORT"), and stop it on exit, however the block ends.

    Raises:
        ServerError: the server exited, or was not healthy within `startup_timeout_s` seconds.
    """
    port = free_port()
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    with open(log, "w") as out:
        proc = subprocess.Popen(_port_argv(spec, port), stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_timeout_s
        while _get(f"{url}/health")[0] != 200:
            if proc.poll() is not None:
                raise ServerError(f"{spec.label} exited with {proc.returncode} before it was healthy; "
                                  f"{log}:\n    {_tail(log)}")
            if time.monotonic() > deadline:
                raise ServerError(f"{spec.label} was not healthy within {startup_timeout_s:.0f} s; {log}:\n    "
                                  f"{_tail(log)}")
            time.sleep(0.5)
        yield url
    finally:
        stop(proc)


@dataclass(frozen=True)
class SpecCounters:
    """A server's cumulative speculative-decoding counters (0 where it reports none)."""

    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted_tokens: float = 0.0

    def __sub__(self, other: "SpecCounters") -> "SpecCounters":
        return SpecCounters(self.drafts - other.drafts, self.draft_tokens - other.draft_tokens,
                            self.accepted_tokens - other.accepted_tokens)

    @property
    def acceptance_length(self) -> float | None:
        """1 + accepted / drafts (tokens per verify step); None when no step verified drafts."""
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts > 0 else None

    @property
    def draft_acceptance_rate(self) -> float | None:
        """accepted / proposed draft tokens; None when none was proposed."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens > 0 else None


_COUNTER = r"^[A-Za-z_:]*spec_decode_num_{}_total(?:\{{\}})? ([0-9.eE+-]+)$"


def parse_spec_counters(text: str) -> SpecCounters:
    """The speculative counters of a Prometheus exposition, whatever their prefix (nextn_, llamacpp:)."""
    def value(name: str) -> float:
        m = re.search(_COUNTER.format(name), text, re.M)
        return float(m.group(1)) if m else 0.0
    return SpecCounters(value("drafts"), value("draft_tokens"), value("accepted_tokens"))


def spec_counters(url: str) -> SpecCounters | None:
    """The server's counters from GET {url}/metrics; None when it serves no metrics."""
    status, text = _get(f"{url}/metrics", timeout_s=30)
    return parse_spec_counters(text) if status == 200 else None
