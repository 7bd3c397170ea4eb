"""`nextn serve`: an OpenAI-compatible HTTP server over an engine (FastAPI + uvicorn), like `trtllm-serve`.

`--model` takes a checkpoint (a .gguf file or an HF directory) as `nextn generate --model` does: it is built once
into nextn's engine cache ($NEXTN_CACHE_DIR, default ~/.cache/nextn/engines) and reused.

Endpoints: POST /v1/completions, POST /v1/chat/completions (SSE streaming with "stream": true), GET /v1/models,
GET /health, GET /metrics (Prometheus: requests, TTFT/TPOT, speculative-decoding counters, free KV blocks).
Concurrent requests share the engine through in-flight batching. Omitted temperature means greedy decoding.
With --api_key (or the NEXTN_API_KEY environment variable) every endpoint but /health needs
`Authorization: Bearer <key>`; binding beyond loopback without a key prints a warning.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from nextn.cli.threads import add_threads_argument, apply_threads

logger = logging.getLogger(__name__)


DEFAULT_MAX_REQUEST_BYTES = 16 * 2**20  # = nextn.serving.http_edge's (not imported: keeps `--help` fast)
DEFAULT_CHAT_TEMPLATE_TIMEOUT_S = 5.0  # = nextn.runtime.template_render's DEFAULT_TIMEOUT_S
DEFAULT_GRAMMAR_TIMEOUT_S = 10.0  # = nextn.runtime.grammar_pool's DEFAULT_TIMEOUT_S
DEFAULT_GRAMMAR_CACHE_MB = 256  # = nextn.runtime.grammar_pool's DEFAULT_CACHE_BYTES >> 20
DEFAULT_MAX_SEQUENCES = 128  # = nextn.serving.openai_server's DEFAULT_MAX_SEQUENCES
MAX_CHAT_TEMPLATE_TIMEOUT_S = 3600.0


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive byte count, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive byte count, got {value}")
    return value


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a TCP port number (1-65535), got {text!r}") from None
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port number (1-65535), got {value}")
    return value


def _api_key(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("the API key is empty: give a non-empty key, or leave --api_key out to "
                                         "serve without one")
    if not all("!" <= c <= "~" for c in text):  # what a client can send in 'Authorization: Bearer KEY'
        raise argparse.ArgumentTypeError("the API key must be printable ASCII without spaces (clients send it in an "
                                         "HTTP header)")
    return text


def _timeout(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value <= MAX_CHAT_TEMPLATE_TIMEOUT_S:  # also refuses NaN
        raise argparse.ArgumentTypeError(f"must be seconds in (0, {MAX_CHAT_TEMPLATE_TIMEOUT_S:g}], got {text!r}")
    return value


def exposure_warning(host: str, api_key: str | None) -> str | None:
    """The warning to print when `host` is reachable from other machines and no API key is set, else None."""
    from nextn.serving.http_edge import is_loopback

    if api_key or is_loopback(host):
        return None
    return (f"serving on {host} without an API key: anyone who can reach this address can use the model; pass "
            "--api_key KEY (or set NEXTN_API_KEY), or bind --host 127.0.0.1")


def served_model_name(args: argparse.Namespace) -> str | None:
    """--served_model_name, else for --model the checkpoint's name (the file's without `.gguf`: a cached engine's
    directory is a hash), else None (the engine directory's name)."""
    if args.served_model_name or not args.model:
        return args.served_model_name
    name = Path(args.model).name
    return name[:-len(".gguf")] if name.endswith(".gguf") else name


def add_arguments(p: argparse.ArgumentParser) -> None:
    from nextn.cli.checkpoint_options import add_checkpoint_options

    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--engine_dir", help="engine directory written by build-engine")
    src.add_argument("--model", help="a checkpoint (a .gguf file or an HF directory) or an engine: a checkpoint is "
                                     "built once into nextn's engine cache and reused (as LLM(path))")
    add_checkpoint_options(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=_port, default=8000, help="port to listen on, 1-65535 (default 8000)")
    p.add_argument("--extra_llm_api_options", "--config", dest="extra_llm_api_options",
                   help="YAML of LLM arguments (TensorRT-LLM names), e.g. speculative_config, kv_cache_config")
    p.add_argument("--served_model_name",
                   help="the model name clients send (default: the engine directory's name, or --model's checkpoint "
                        "name)")
    p.add_argument("--max_batch_size", type=int, help="max concurrent requests in a step (default: the engine's)")
    p.add_argument("--max_seq_len", type=int, help="max prompt + completion tokens (default: the engine's)")
    p.add_argument("--device", choices=["cpu", "cuda"], help="default: CUDA when available")
    p.add_argument("--tp_size", type=int, dest="tensor_parallel_size",
                   help="tensor-parallel ranks (trtllm-serve's name; started by nextn: docs/ARCHITECTURE.md)")
    p.add_argument("--ep_size", type=int, dest="moe_expert_parallel_size",
                   help="expert-parallel ranks for DeepSeek-V3's routed experts (divides --tp_size)")
    p.add_argument("--api_key", type=_api_key, default=os.environ.get("NEXTN_API_KEY") or None,
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health (default: the "
                        "NEXTN_API_KEY environment variable; unset = no key)")
    p.add_argument("--max_request_bytes", type=_positive, default=DEFAULT_MAX_REQUEST_BYTES,
                   help=f"largest request body accepted, in bytes; larger ones get HTTP 413 before being read "
                        f"(default {DEFAULT_MAX_REQUEST_BYTES} = 16 MiB)")
    p.add_argument("--chat_template_timeout", type=_timeout, default=DEFAULT_CHAT_TEMPLATE_TIMEOUT_S,
                   help="seconds one chat-template render may take before it is stopped and the request gets a 400 "
                        f"(default {DEFAULT_CHAT_TEMPLATE_TIMEOUT_S:g}); renders run in worker processes")
    p.add_argument("--grammar_timeout", type=_timeout, default=DEFAULT_GRAMMAR_TIMEOUT_S,
                   help="seconds one guided-decoding grammar (response_format, guided_*, tool_choice) may take to "
                        "convert and compile before it is stopped and the request gets a 400 "
                        f"(default {DEFAULT_GRAMMAR_TIMEOUT_S:g}); compiles run in a worker process")
    p.add_argument("--grammar_cache_mb", type=_positive, default=DEFAULT_GRAMMAR_CACHE_MB,
                   help="MiB of compiled grammars kept for reuse, least recently used dropped first; a grammar that "
                        f"alone compiles to more is refused (default {DEFAULT_GRAMMAR_CACHE_MB})")
    p.add_argument("--max_sequences_per_request", type=_positive, default=DEFAULT_MAX_SEQUENCES,
                   help="the most sequences one request may start, prompts × n; more get a 400 "
                        f"(default {DEFAULT_MAX_SEQUENCES})")
    add_threads_argument(p)
    p.add_argument("--log_level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level (default info)")


def run(args: argparse.Namespace) -> int:
    problem = _cannot_listen(args.host, args.port)
    if problem:  # before the imports and the model load: a taken port must not cost a load first
        print(f"nextn serve: error: {problem}", file=sys.stderr)
        return 2
    import uvicorn

    from nextn import LLM
    from nextn.cli.env_options import env_llm_overrides
    from nextn.cli.checkpoint_options import checkpoint_llm_kwargs
    from nextn.runtime.grammar_pool import GrammarLimits
    from nextn.serving.openai_server import create_app

    try:
        apply_threads(args.num_threads, "nextn serve")
    except ValueError as e:
        print(f"nextn serve: error: {e}", file=sys.stderr)
        return 2
    warning = exposure_warning(args.host, args.api_key)
    if warning:
        print(f"nextn serve: warning: {warning}", file=sys.stderr)
    sizes = ("max_batch_size", "max_seq_len", "tensor_parallel_size", "moe_expert_parallel_size")
    overrides = {k: getattr(args, k) for k in sizes if getattr(args, k) is not None} | env_llm_overrides()
    source = args.engine_dir or args.model
    llm = LLM(source, extra_llm_api_options=args.extra_llm_api_options, device=args.device,
              **checkpoint_llm_kwargs(args), **overrides)
    app = create_app(llm, served_model_name(args), api_key=args.api_key, max_request_bytes=args.max_request_bytes,
                     chat_template_timeout_s=args.chat_template_timeout,
                     grammar_limits=GrammarLimits(args.grammar_timeout, args.grammar_cache_mb << 20),
                     max_sequences=args.max_sequences_per_request)
    logging.getLogger("nextn").setLevel(min(logging.getLogger("nextn").getEffectiveLevel(), logging.INFO))
    logger.info("serving '%s' from %s on http://%s:%d", app.state.server.model_name, source, args.host,
                args.port)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                           timeout_graceful_shutdown=10))
    server.handle_exit = _renders_stopped_first(server.handle_exit)
    try:
        # On Ctrl+C / SIGTERM, streams still open after 10 s are cut; shutdown() then cancels their requests.
        server.run()
    finally:
        llm.shutdown()
    return 0 if server.started else 1  # uvicorn logged why it could not start (e.g. the port is in use)


def _cannot_listen(host: str, port: int) -> str | None:
    """Why the server could not listen on host:port (bound and released here, as uvicorn binds: SO_REUSEADDR), or
    None."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        return f"cannot resolve --host {host!r}: {e}"
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError as e:
            return (f"cannot listen on {host}:{port}: {e.strerror or e} (another server there?): stop it or give "
                    "another --port")
    return None


def _renders_stopped_first(handle_exit):
    """uvicorn's signal handler, preceded by closing the chat-template renderer and the grammar workers: renders and
    compiles in flight stop at once (their requests get an error), so a template that loops or a grammar that
    expands cannot hold the shutdown. Runs in the event-loop thread, which never holds the pools' locks."""
    def handle(sig, frame) -> None:
        from nextn.runtime.grammar_pool import shared_grammar_workers
        from nextn.runtime.template_render import shared_renderer

        shared_renderer().close()
        shared_grammar_workers().close()
        handle_exit(sig, frame)
    return handle
