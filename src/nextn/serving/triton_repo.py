"""Write a Triton Inference Server model repository that serves one nextn engine (`nextn triton-repo`).

Layout (Triton's): `<repo>/<model_name>/config.pbtxt` and `<repo>/<model_name>/1/model.py`, the latter a copy of
`nextn/serving/triton_model.py` (Python backend). The config declares TensorRT-LLM's tensor names
(`triton_io.INPUTS` / `OUTPUTS`), one CPU model instance (`KIND_CPU`: Triton assigns no GPU; the engine picks its
device itself), dynamic batching, and the engine directory and options as `parameters`. With `python_env` it also
sets `EXECUTION_ENV_PATH`, so the Python backend activates that environment (where nextn is installed) for the
model; without it the server's `PATH` must start with that environment's `bin/`.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from nextn.build.manifest import EngineManifest
from nextn.serving import triton_io
from nextn.serving.triton_io import TensorSpec

MODEL_TEMPLATE = Path(__file__).with_name("triton_model.py")


def config_pbtxt(model_name: str, parameters: dict[str, str], decoupled: bool = False,
                 max_batch_size: int = 64) -> str:
    """The text of the model's config.pbtxt.

    Args:
        model_name: Triton's model name (the directory name).
        parameters: config `parameters` (string values), e.g. {"engine_dir": "/abs/path"}.
        decoupled: stream several responses per request (`model_transaction_policy { decoupled: true }`).
        max_batch_size: Triton's cap on requests per `execute` call (≥ 1; the engine batches independently).
    """
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be ≥ 1, got {max_batch_size}")
    lines = [f'name: "{model_name}"', 'backend: "python"', f"max_batch_size: {max_batch_size}",
             f"model_transaction_policy {{ decoupled: {'true' if decoupled else 'false'} }}",
             "dynamic_batching { }",
             "instance_group [ { count: 1, kind: KIND_CPU } ]",
             _tensors("input", triton_io.INPUTS), _tensors("output", triton_io.OUTPUTS)]
    for key, value in parameters.items():
        lines.append(f'parameters {{ key: "{key}" value {{ string_value: "{_escape(value)}" }} }}')
    return "\n".join(lines) + "\n"


def write_model_repository(engine_dir: str | Path, output_dir: str | Path, model_name: str = "nextn",
                           decoupled: bool = False, max_batch_size: int = 64, device: str | None = None,
                           extra_llm_api_options: str | Path | None = None,
                           python_env: str | Path | None = None) -> Path:
    """Write (or overwrite) `<output_dir>/<model_name>/` for an engine; other models in the repository are kept.

    Args:
        engine_dir: an engine directory written by `build-engine` (stored as an absolute path).
        output_dir: the model repository (created when missing).
        model_name: Triton's model name.
        decoupled: streaming model (one response per engine step).
        max_batch_size: Triton's max_batch_size.
        device: "cpu" or "cuda" for the engine; None = CUDA when available.
        extra_llm_api_options: a YAML file of LLM arguments (TensorRT-LLM names) passed to `LLM`.
        python_env: a virtual environment with nextn installed, for `EXECUTION_ENV_PATH`.
    Returns:
        The model directory.
    Raises:
        EngineError: `engine_dir` is not an engine directory. ValueError: a bad model name or max_batch_size.
        FileNotFoundError: `extra_llm_api_options` or `python_env/bin/activate` is missing.
    """
    engine_dir = Path(engine_dir).resolve()
    EngineManifest.load(engine_dir)  # fail here, not when the server loads the model
    if not model_name or "/" in model_name or model_name.startswith("."):
        raise ValueError(f"invalid model name {model_name!r}: use a plain directory name")
    parameters = {"engine_dir": str(engine_dir)}
    if device:
        parameters["device"] = device
    if extra_llm_api_options:
        options = Path(extra_llm_api_options).resolve()
        if not options.is_file():
            raise FileNotFoundError(f"extra_llm_api_options {options} does not exist")
        parameters["extra_llm_api_options"] = str(options)
    if python_env:
        env = Path(python_env).resolve()
        if not (env / "bin" / "activate").is_file():
            raise FileNotFoundError(f"python_env {env} has no bin/activate: give a virtual environment's directory")
        parameters["EXECUTION_ENV_PATH"] = str(env)
    model_dir = Path(output_dir) / model_name
    (model_dir / "1").mkdir(parents=True, exist_ok=True)
    (model_dir / "config.pbtxt").write_text(config_pbtxt(model_name, parameters, decoupled, max_batch_size))
    shutil.copyfile(MODEL_TEMPLATE, model_dir / "1" / "model.py")
    return model_dir


def _tensors(kind: str, specs: tuple[TensorSpec, ...]) -> str:
    rows = []
    for s in specs:
        dims = ", ".join(map(str, s.dims))
        extra = ", optional: true" if s.optional else ""
        extra += ", allow_ragged_batch: true" if s.name == "input_ids" else ""
        rows.append(f'  {{ name: "{s.name}", data_type: {s.data_type}, dims: [ {dims} ]{extra} }}')
    return f"{kind} [\n" + ",\n".join(rows) + "\n]"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"')
