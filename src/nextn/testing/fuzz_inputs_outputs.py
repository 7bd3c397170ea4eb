"""Class 5 of `fuzz_inputs.py`: a user's files, links out of the folder and the command's own inputs placed at
random where each writing command writes (build-engine, train-draft, token-map, triton-repo, make-checkpoint,
nextn-bench, the bench modules). Each placement must be refused with a named error, and afterwards every path in
the case directory (the output, the inputs, and a folder outside that links point into) must be as it was:
the same bytes, the same links, nothing created."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import stat
from pathlib import Path
from typing import Any

from nextn.testing import fuzz_inputs_gen as gen
from nextn.testing.fuzz_harness import BUILD_BOUND_S, Case, Harness, fresh_dir, quiet

BOUND_S = 5.0
#: Contents of a user's files: none is in any command's own format (a token map, a `written_by` report, a PNG).
USER_CONTENTS = [b"my notes\n", b'{"model_type": "llama", "hidden_size": 4096}\n', b"\x00\x01binary",
                 b'{"written_by": "someone else"}\n', b'{"written_by": "nextn bench.other"}\n', b"",
                 b'{"results": []}\n', b"- yaml: list\n", b"PK\x03\x04zip"]
USER_NAMES = ["config.json", "model.safetensors", "manifest.json", "tokenizer.json", "notes.txt", "train_draft.json",
              ".nextn-output.json", "config.pbtxt", "1/model.py", "sub/dir/data.bin", ".hidden", "README.md"]
BENCH_MODULES = ["drafters", "gpu_step", "mtp_tree_al", "prefix_reuse", "vs_llama_cpp", "real_models", "compile_step",
                 "quant_quality"]


def listing(root: Path) -> dict[str, Any]:
    """Every path under `root` (links not followed): its kind and, for a file, its bytes' hash."""
    out: dict[str, Any] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = p.lstat()
            rel = p.relative_to(root).as_posix()
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("link", os.readlink(p))
            elif stat.S_ISREG(st.st_mode):
                out[rel] = ("file", hashlib.sha256(p.read_bytes()).hexdigest())
            else:
                out[rel] = ("dir" if stat.S_ISDIR(st.st_mode) else "special", stat.S_IFMT(st.st_mode))
    return out


def place_user_files(rng: random.Random, folder: Path, outside: Path, at_least: int = 1) -> list[str]:
    """Put a user's files and links (to a file or folder outside, or dangling) into `folder`; returns their names."""
    folder.mkdir(parents=True, exist_ok=True)
    placed = []
    for _ in range(rng.randrange(at_least, 4)):
        name = rng.choice(USER_NAMES + [f"file{rng.randrange(100)}.dat"])
        p = folder / name
        if p.exists() or p.is_symlink():
            continue
        p.parent.mkdir(parents=True, exist_ok=True)
        roll = rng.random()
        if roll < 0.7:
            p.write_bytes(rng.choice(USER_CONTENTS))
        elif roll < 0.8:
            p.symlink_to(outside / "secret.txt")
        elif roll < 0.9:
            p.symlink_to(outside)
        else:
            p.symlink_to(outside / "missing")
        placed.append(name)
    if not placed:
        (folder / "notes.txt").write_bytes(b"my notes\n")
        placed.append("notes.txt")
    return placed


def hostile_output_file(rng: random.Random, path: Path, outside: Path) -> str:
    """Make `path` something a file output may not replace; returns what it is."""
    kind = rng.choice(["user file", "directory", "link to a file outside", "link to a folder outside",
                       "dangling link", "fifo", "link to /dev/zero", "under a file", "link to own-format file"])
    if kind == "under a file":  # the output's parent is a user's file
        path.parent.mkdir(parents=True, exist_ok=True)
        path.with_name("parent.txt").write_bytes(b"a user's file\n")
        return kind
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "user file":
        path.write_bytes(rng.choice(USER_CONTENTS))
    elif kind == "directory":
        path.mkdir()
        if rng.random() < 0.5:
            (path / "inside.txt").write_bytes(b"kept\n")
    elif kind == "link to a file outside":
        path.symlink_to(outside / "secret.txt")
    elif kind == "link to a folder outside":
        path.symlink_to(outside)
    elif kind == "dangling link":
        path.symlink_to(outside / "missing.json")
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "link to /dev/zero":
        path.symlink_to("/dev/zero")
    else:  # a link to a file in the command's own format: still a link, never followed
        (outside / "own.json").write_bytes(b"[1, 2, 3]")
        path.symlink_to(outside / "own.json")
    return kind


class OutputsCase(Case):
    name = "outputs"

    def __init__(self, harness: Harness, root: Path) -> None:
        super().__init__(harness, root)
        self.engine: Path | None = None

    def _tiny_engine(self) -> Path:
        if self.engine is None:
            from nextn.build.engine_builder import build_engine

            gen.write_tiny_gguf(self.root / "tiny.gguf")
            build_engine(self.root / "tiny.gguf", self.root / "engine", progress=False)
            self.engine = self.root / "engine"
        return self.engine

    def one(self, rng: random.Random, tag: str) -> None:
        command = rng.choice(["build-engine", "train-draft", "token-map", "triton-repo", "make-checkpoint",
                              "nextn-bench", "bench module"])
        d = fresh_dir(self.root)
        outside = d / "outside"
        outside.mkdir()
        (outside / "secret.txt").write_bytes(b"outside the output folder\n")
        run, named, exit_2, what = getattr(self, "_" + command.replace("-", "_").replace(" ", "_"))(rng, d, outside)
        before = listing(d)
        label = f"{tag} {command}: {what}"
        outcome, _ = self.h.attempt(self.name, label, lambda: quiet(run), named, BOUND_S if command != "build-engine"
                                    else BUILD_BOUND_S, exit_2_is_named=exit_2)
        after = listing(d)
        changed = sorted(k for k in before if after.get(k) != before[k])
        created = sorted(k for k in after if k not in before)
        if outcome == "accepted":
            self.h.fail(self.name, label, f"accepted (wrote {created[:6]})")
        elif changed or created:
            self.h.fail(self.name, label, f"after the {outcome}: changed {changed[:6]}, created {created[:6]}")
        shutil.rmtree(d)

    # One scenario per command: (run, named errors, exit 2 is named, what was placed) ------------------------------
    def _build_engine(self, rng: random.Random, d: Path, outside: Path):
        from nextn.cli import build_engine as cli

        (d / "in").mkdir()
        model = gen.write_tiny_gguf(d / "in" / "m.gguf")
        kind = rng.choice(["user files", "link to a folder outside", "the input's folder", "the input itself",
                           "a user's file", "a fake engine", "a folder holding the input"])
        out = d / "out"
        if kind == "user files":
            what = f"user files {place_user_files(rng, out, outside)}"
        elif kind == "link to a folder outside":
            (outside / "empty").mkdir()
            out.symlink_to(outside / "empty")
            what = kind
        elif kind == "the input's folder":
            out, what = d / "in", kind
        elif kind == "the input itself":
            out, what = model, kind
        elif kind == "a user's file":
            out.write_bytes(rng.choice(USER_CONTENTS))
            what = kind
        elif kind == "a fake engine":  # a manifest.json of the user's own, beside other files
            out.mkdir()
            (out / "manifest.json").write_bytes(rng.choice([b'{"name": "my project"}', b"{}", b"not json"]))
            what = f"{kind} + {place_user_files(rng, out, outside, 0)}"
        else:
            out, what = d, kind
        argv = ["--model_dir", str(model), "--output_dir", str(out), "--no-progress"]
        if rng.random() < 0.3:
            argv.append("--force")
            what += " --force"
        return (lambda: cli.main(argv)), (), True, what

    def _train_draft(self, rng: random.Random, d: Path, outside: Path):
        from nextn.build.output_files import OutputPathError
        from nextn.train.session import claim_train_output

        base, data = d / "base", d / "data" / "prompts.jsonl"
        base.mkdir()
        (base / "config.json").write_text('{"model_type": "llama"}')
        data.parent.mkdir()
        data.write_text('{"prompt": "hi"}\n')
        out, cache = d / "out", None
        kind = rng.choice(["user files", "the base model", "the data's folder", "a folder holding the inputs",
                           "a link", "a user's file", "another command's marker", "user files in --cache_dir"])
        if kind == "user files":
            kind = f"user files {place_user_files(rng, out, outside)}"
        elif kind == "the base model":
            out = base
        elif kind == "the data's folder":
            out = data.parent
        elif kind == "a folder holding the inputs":
            out = d
        elif kind == "a link":
            out.symlink_to(outside)
        elif kind == "a user's file":
            out.write_bytes(rng.choice(USER_CONTENTS))
        elif kind == "another command's marker":
            out.mkdir()
            (out / ".nextn-output.json").write_text(json.dumps({"written_by": "nextn make-checkpoint"}))
            (out / "config.json").write_text("{}")
        else:
            cache = d / "cache"
            kind = f"{kind} {place_user_files(rng, cache, outside)}"
            out = d / "out_claimed_earlier"  # an output this trainer claimed before: only the cache is at fault
            out.mkdir()
            (out / ".nextn-output.json").write_text(json.dumps({"written_by": "nextn train-draft"}) + "\n")
        return (lambda: claim_train_output(base, [data], out, cache)), (OutputPathError,), False, kind

    def _token_map(self, rng: random.Random, d: Path, outside: Path):
        from nextn.build.output_files import OutputPathError
        from nextn.cli.token_map import write_token_map

        out = d / "maps" / "map.json"
        kind = hostile_output_file(rng, out, outside)
        if kind == "under a file":
            out = out.with_name("parent.txt") / "map.json"
        force = rng.random() < 0.3 and kind not in ("user file",)
        return (lambda: write_token_map([3, 1, 2], out, force)), (OutputPathError,), False, f"{kind}, force={force}"

    def _triton_repo(self, rng: random.Random, d: Path, outside: Path):
        from nextn.build.output_files import OutputPathError
        from nextn.serving.triton_repo import write_model_repository

        engine = self._tiny_engine()
        repo, name = d / "repo", rng.choice(["nextn", "my_model", "m"])
        kind = rng.choice(["user files", "a link to a folder outside", "a repository that is a file",
                           "our files plus a link"])
        if kind == "user files":
            kind = f"user files {place_user_files(rng, repo / name, outside)}"
        elif kind == "a link to a folder outside":
            repo.mkdir()
            (repo / name).symlink_to(outside)
        elif kind == "a repository that is a file":
            repo.write_bytes(rng.choice(USER_CONTENTS))
        else:  # an earlier triton-repo output, with a link added
            write_model_repository(engine, repo, name)
            link = repo / name / rng.choice(["1/extra.py", "config.pbtxt.bak", "1/model.py"])
            link.unlink(missing_ok=True)
            link.symlink_to(outside / "secret.txt")
        return (lambda: write_model_repository(engine, repo, name)), (OutputPathError,), False, kind

    def _make_checkpoint(self, rng: random.Random, d: Path, outside: Path):
        from nextn.build.output_files import OutputPathError, claim_output_dir

        out = d / "ckpt"
        kind = rng.choice(["user files", "a link", "a user's file", "another command's marker", "a foreign marker"])
        if kind == "user files":
            kind = f"user files {place_user_files(rng, out, outside)}"
        elif kind == "a link":
            out.symlink_to(outside)
        elif kind == "a user's file":
            out.write_bytes(rng.choice(USER_CONTENTS))
        else:
            out.mkdir()
            marker = {"written_by": "nextn train-draft"} if kind == "another command's marker" else "garbage"
            (out / ".nextn-output.json").write_text(json.dumps(marker))
            (out / "model.safetensors").write_bytes(b"user weights")
        return (lambda: claim_output_dir(out, "make-checkpoint")), (OutputPathError,), False, kind

    def _nextn_bench(self, rng: random.Random, d: Path, outside: Path):
        from nextn.build.output_files import OutputPathError, is_jsonl_with, write_output_file
        from nextn.cli.nextn_bench import _check_outputs

        which = rng.choice(["--report_json", "--report_json tagged", "--iteration_log", "--plot", "--output"])
        out = d / "results" / ("report.json" if "report" in which else "log.jsonl")
        if which == "--report_json tagged":  # FILE.k{K}.json beside --report_json
            kind = hostile_output_file(rng, out.with_name(f"report.k{rng.randrange(1, 9)}.json"), outside)
            kind = "tagged " + kind
        elif which == "--plot":
            out = d / "plots"
            chart = out / rng.choice(["throughput_vs_k.png", f"acceptance_per_position_k{rng.randrange(1, 9)}.png"])
            kind, target = "under a file", out
            # a chart-named path that is not a PNG, or --plot itself not a folder (a folder is what it should be)
            while kind == "under a file" or (target == out and kind == "directory"):
                target = chart if rng.random() < 0.7 else out
                if target.exists() or target.is_symlink():
                    shutil.rmtree(d / "plots")
                kind = hostile_output_file(rng, target, outside)
            if target == chart and kind == "directory":
                kind = "a chart-named directory"
        else:
            kind = hostile_output_file(rng, out, outside)
        if kind.endswith("under a file"):
            out = out.with_name("parent.txt") / out.name
        if which == "--output":
            run = lambda: write_output_file(out, '{"task_id": 0}\n', "--output", is_jsonl_with("task_id"))  # noqa
        else:
            args = argparse.Namespace(report_json=None, iteration_log=None, plot=None)
            setattr(args, {"--report_json tagged": "report_json"}.get(which, which[2:]), out)
            run = lambda: _check_outputs(args)  # noqa: E731
        return run, (OutputPathError,), False, f"{which}: {kind}"

    def _bench_module(self, rng: random.Random, d: Path, outside: Path):
        from nextn.bench.outputs import check_report, write_report
        from nextn.build.output_files import OutputPathError

        module = rng.choice(BENCH_MODULES)
        out = d / "bench" / "result.json"
        kind = hostile_output_file(rng, out, outside) if rng.random() < 0.8 else "another module's report"
        if kind == "another module's report":
            out.parent.mkdir(parents=True)
            other = rng.choice([m for m in BENCH_MODULES if m != module])
            out.write_text(json.dumps({"written_by": f"nextn bench.{other}", "results": []}))
        if kind == "under a file":
            out = out.with_name("parent.txt") / "result.json"
        parser = argparse.ArgumentParser(prog=f"bench.{module}", add_help=False)
        if rng.random() < 0.5:
            return (lambda: check_report(parser, out, module)), (), True, f"bench.{module} --json: {kind}"
        return (lambda: write_report(out, module, {"results": [1]})), (OutputPathError,), False, \
            f"bench.{module} write_report: {kind}"
