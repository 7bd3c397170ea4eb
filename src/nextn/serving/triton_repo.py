"""Write a Triton Inference Server model repository that serves one nextn engine (`nextn triton-repo`).

Layout (Triton's): `<repo>/<model_name>/config.pbtxt`, `<repo>/<model_name>/1/model.py` and the marker
`.nextn-output.json` (a model directory nextn did not write is never touched), the latter a copy of
`nextn/serving/triton_model.py` (Python backend). The config declares TensorRT-LLM's tensor names
(`triton_io.INPUTS` / `OUTPUTS`), one CPU model instance (`KIND_CPU`: Triton assigns no GPU; the engine picks its
device itself), dynamic batching, and the engine directory and options as `parameters`. With `python_env` it also
sets `EXECUTION_ENV_PATH`, so the Python backend activates that environment (where nextn is installed) for the
model; without it the server's `PATH` must start with that environment's `bin/`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from nextn.build.manifest import EngineManifest
from nextn.build.output_files import (MARKER_NAME, SNIFF_BYTES, OutputPathError, is_report_of, write_output_file,
                                      written_by)
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
    """Write `<output_dir>/<model_name>/` for an engine; other models in the repository are kept. An existing model
    directory is rewritten only when it holds nothing but what an earlier `nextn triton-repo` wrote (`check_model_dir`).

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
        EngineError: `engine_dir` is not an engine directory. OutputPathError (an EngineError): the model directory
            holds a user's model or a symbolic link, or the repository is a file. ValueError: a bad model name or
            max_batch_size.
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
    model_dir = check_model_dir(Path(output_dir), model_name)
    (model_dir / "1").mkdir(parents=True, exist_ok=True)
    marker = model_dir / MARKER_NAME
    if not marker.exists():
        marker.write_text(json.dumps(written_by("triton-repo")) + "\n")
    write_output_file(model_dir / "config.pbtxt", config_pbtxt(model_name, parameters, decoupled, max_batch_size),
                      "config.pbtxt", force=True)  # checked above; written atomically (a link is replaced, never followed)
    write_output_file(model_dir / "1" / "model.py", MODEL_TEMPLATE.read_bytes(), "1/model.py", force=True)
    return model_dir


#: What `write_model_repository` writes into a model directory (the Python backend adds 1/__pycache__/).
OWN_FILES = frozenset({"config.pbtxt", "1/model.py", MARKER_NAME})


def check_model_dir(repo: Path, model_name: str) -> Path:
    """Check that `<repo>/<model_name>` may be (re)written: missing, empty, or holding only what an earlier
    `nextn triton-repo` wrote there (config.pbtxt with an nextn engine_dir parameter, 1/model.py, the marker and
    Python caches), with no symbolic link anywhere in it. Return the model directory.

    Raises:
        OutputPathError: the repository is a file, or the model directory holds a link or any other file (a user's
            model: its files named; nothing is changed).
    """
    if repo.exists() and not repo.is_dir():
        raise OutputPathError(f"--output_dir {repo} exists and is not a directory; give the model repository's "
                              "directory")
    model_dir = repo / model_name
    if model_dir.is_symlink() or (model_dir.exists() and not model_dir.is_dir()):
        raise OutputPathError(f"{model_dir} is a symbolic link or a file; nothing was written: choose another "
                              "--model_name or --output_dir")
    if not model_dir.exists():
        return model_dir
    links, foreign = [], []
    for root, dirs, files in os.walk(model_dir):
        for name in [*dirs, *files]:
            path = Path(root) / name
            rel = path.relative_to(model_dir).as_posix()
            if path.is_symlink():
                links.append(rel)
            elif name in files and rel not in OWN_FILES and "__pycache__" not in Path(rel).parts:
                foreign.append(rel)
    ours = _is_own_marker(model_dir / MARKER_NAME) or _is_own_config(model_dir / "config.pbtxt")
    if links:
        raise OutputPathError(f"{model_dir} holds symbolic links ({', '.join(sorted(links)[:8])}); nothing was written: "
                              "nextn triton-repo writes only into a model directory of plain files it wrote")
    if foreign or (any(model_dir.iterdir()) and not ours):
        shown = sorted(foreign)[:8] or sorted(p.name for p in model_dir.iterdir())[:8]
        raise OutputPathError(f"{model_dir} is a model that nextn triton-repo did not write (it holds "
                              f"{', '.join(shown)}); nothing was changed: choose another --model_name or --output_dir")
    return model_dir


def _is_own_marker(path: Path) -> bool:
    """A marker triton-repo wrote (`{"written_by": "nextn triton-repo"}`), not a user's file of that name."""
    if path.is_symlink() or not path.is_file():
        return False
    with path.open("rb") as f:
        return is_report_of("triton-repo")(f.read(SNIFF_BYTES))


def _is_own_config(path: Path) -> bool:
    """A config.pbtxt written by an earlier nextn triton-repo (before the marker): the python backend with our
    engine_dir parameter."""
    if path.is_symlink() or not path.is_file():
        return False
    with path.open("rb") as f:
        head = f.read(SNIFF_BYTES)
    return b'backend: "python"' in head and b'parameters { key: "engine_dir"' in head


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
