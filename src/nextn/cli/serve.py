"""`nextn serve`: an OpenAI-compatible HTTP server over an engine (FastAPI + uvicorn), like `trtllm-serve`.

Endpoints: POST /v1/completions, POST /v1/chat/completions (SSE streaming with "stream": true), GET /v1/models,
GET /health, GET /metrics (Prometheus: requests, TTFT/TPOT, speculative-decoding counters, free KV blocks).
Concurrent requests share the engine through in-flight batching. Omitted temperature means greedy decoding.
"""

from __future__ import annotations

import argparse
import logging

logger = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine_dir", required=True, help="engine directory written by build-engine")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    p.add_argument("--extra_llm_api_options", "--config", dest="extra_llm_api_options",
                   help="YAML of LLM arguments (TensorRT-LLM names), e.g. speculative_config, kv_cache_config")
    p.add_argument("--served_model_name", help="the model name clients send (default: the engine directory's name)")
    p.add_argument("--max_batch_size", type=int, help="max concurrent requests in a step (default: the engine's)")
    p.add_argument("--max_seq_len", type=int, help="max prompt + completion tokens (default: the engine's)")
    p.add_argument("--device", choices=["cpu", "cuda"], help="default: CUDA when available")
    p.add_argument("--log_level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level (default info)")


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from nextn import LLM
    from nextn.serving.openai_server import create_app

    overrides = {k: getattr(args, k) for k in ("max_batch_size", "max_seq_len") if getattr(args, k) is not None}
    llm = LLM(args.engine_dir, extra_llm_api_options=args.extra_llm_api_options, device=args.device, **overrides)
    app = create_app(llm, args.served_model_name)
    logging.getLogger("nextn").setLevel(min(logging.getLogger("nextn").getEffectiveLevel(), logging.INFO))
    logger.info("serving '%s' from %s on http://%s:%d", app.state.server.model_name, args.engine_dir, args.host,
                args.port)
    try:
        # On Ctrl+C / SIGTERM, streams still open after 10 s are cut; shutdown() then cancels their requests.
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=10)
    finally:
        llm.shutdown()
    return 0
