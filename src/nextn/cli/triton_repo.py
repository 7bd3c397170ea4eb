"""Write a Triton Inference Server model repository that serves an nextn engine with the Python backend.

The model takes TensorRT-LLM's tensor names: text (`text_input`, `max_tokens`, `stream`, `temperature`, `top_k`,
`top_p`, `seed`, `end_id` → `text_output`) or token ids (`input_ids`, `request_output_len` → `output_ids`,
`sequence_length`), and reports `acceptance_rate`, `total_accepted_draft_tokens`, `total_draft_tokens`. With
--decoupled it streams one response per engine step (gRPC streaming); serve with e.g.
`tritonserver --model-repository REPO` (the Python backend must find nextn: see --python_env). To require an API
key, tritonserver checks a header itself: the command printed adds `--http-restricted-api` and
`--grpc-restricted-protocol` with `authorization=Bearer KEY`, the header `nextn serve --api_key` takes.
"""

from __future__ import annotations

import argparse
import sys



# Triton's own header check (2.41+), the same header `nextn serve --api_key` takes; the server answers 403 without it.
_RESTRICTED = "inference,metadata,model-config,model-repository,statistics,shared-memory,trace,logging"
RESTRICT_HINT = (f"'--http-restricted-api={_RESTRICTED}:authorization=Bearer KEY' "
                 f"'--grpc-restricted-protocol={_RESTRICTED}:authorization=Bearer KEY'")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine_dir", required=True, help="engine directory written by build-engine")
    p.add_argument("--output_dir", required=True, help="the model repository (created; other models are kept; a model directory that nextn triton-repo did "
                   "not write is refused)")
    p.add_argument("--model_name", default="nextn", help="Triton model name (default nextn)")
    p.add_argument("--decoupled", action="store_true",
                   help="decoupled (streaming) model: one response per engine step when the request sets stream")
    p.add_argument("--max_batch_size", type=int, default=64, help="Triton max_batch_size (default 64)")
    p.add_argument("--device", choices=("cpu", "cuda"), help="engine device (default: CUDA when available)")
    p.add_argument("--extra_llm_api_options", "--config", dest="extra_llm_api_options",
                   help="YAML of LLM arguments (TensorRT-LLM names), e.g. speculative_config, kv_cache_config")
    p.add_argument("--python_env",
                   help="virtual environment with nextn installed, written as EXECUTION_ENV_PATH (default: the "
                        "running one, when it is a virtual environment); 'none' = rely on the server's PATH")


def run(args: argparse.Namespace) -> int:
    from nextn.build.manifest import EngineError
    from nextn.serving.triton_repo import write_model_repository

    env = args.python_env
    if env is None:
        env = sys.prefix if sys.prefix != sys.base_prefix else None
    elif env.lower() == "none":
        env = None
    try:
        model_dir = write_model_repository(args.engine_dir, args.output_dir, args.model_name, args.decoupled,
                                           args.max_batch_size, args.device, args.extra_llm_api_options, env)
    except (ValueError, OSError, EngineError) as e:
        print(f"nextn triton-repo: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {model_dir} ({'decoupled' if args.decoupled else 'non-decoupled'}); serve with: tritonserver "
          f"--model-repository {model_dir.parent}")
    print(f"to require an API key (as `nextn serve --api_key`; /v2/health stays open), add: {RESTRICT_HINT}")
    return 0
