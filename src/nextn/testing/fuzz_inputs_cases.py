"""The classes of `fuzz_inputs.py`, one object each: `one(rng, tag)` makes a random input, runs it through the
entry point users reach, and checks the rule of its class; `close()` releases what the class holds."""

from __future__ import annotations

import argparse
import os
import random
import shutil
from pathlib import Path
from typing import Any

import yaml

from nextn.testing import fuzz_inputs_gen as gen
from nextn.testing.fuzz_harness import BUILD_BOUND_S, Case, Harness, fresh_dir, quiet

TEMPLATE_SLACK_S = 2.5  # past a render's budget: killing the worker, a loaded 2-core machine
READ_BOUND_S = 5.0  # a user-named file is refused within seconds (PyYAML takes ~2 s to refuse a deep 1 MiB file)
BOMB_CAP = 4 << 20  # the gzip bombs run against the prompt readers' cap lowered to 4 MiB (theirs: 1 GiB)
TINY_VOCAB = 512  # the tree class's engine (SMALL_VOCAB)


# 1. chat templates ----------------------------------------------------------------------------------------------
class TemplatesCase(Case):
    name = "templates"
    GOOD = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}{% if add_generation_prompt %}>{% endif %}"

    def __init__(self, harness: Harness, root: Path) -> None:
        super().__init__(harness, root)
        from nextn.runtime.template_render import ChatTemplateRenderer

        # one worker: the good render before each hostile one makes it ready, so a timing is the render's own
        self.renderer = ChatTemplateRenderer(num_workers=1, memory_bytes=256 << 20)
        self.renderer.start()

    def close(self) -> None:
        self.renderer.close()

    def one(self, rng: random.Random, tag: str) -> None:
        from nextn.runtime.template_render import ChatTemplateError, RenderLimits

        messages = [{"role": rng.choice(["system", "user", "assistant"]), "content": "".join(
            rng.choice("ab xy\n{}%é") for _ in range(rng.randrange(0, 30)))} for _ in range(rng.randrange(1, 4))]
        want = "".join(f"[{m['role']}]{m['content']}" for m in messages) + ">"
        text = self.h.guard(self.name, f"{tag} the good template after the previous input",
                            lambda: self.renderer.render(self.GOOD, messages), 60.0)
        if text is not None and text != want:
            self.h.fail(self.name, f"{tag} the good template", f"rendered {text[:200]!r}, want {want[:200]!r}")
        source = gen.template(rng)
        limits = RenderLimits(timeout_s=round(rng.uniform(0.3, 0.8), 2), max_chars=rng.choice([1 << 10, 1 << 16,
                                                                                               1 << 20]))
        kwargs = {"bos_token": rng.choice(["<s>", "", "x" * 1000]), "eos_token": "</s>"}

        def fits(out: Any) -> str | None:
            ok = isinstance(out, str) and len(out) <= limits.max_chars
            return None if ok else f"returned {type(out).__name__} of {len(out)} > {limits.max_chars} characters"

        self.h.attempt(self.name, f"{tag} {source!r} under {limits}", lambda: self.renderer.render(
            source, messages, kwargs, limits=limits), (ChatTemplateError,), limits.timeout_s + TEMPLATE_SLACK_S,
            check=fits)


# 2. counts: LLM arguments and GGUF headers ------------------------------------------------------------------------
class CountsCase(Case):
    name = "counts"

    def one(self, rng: random.Random, tag: str) -> None:
        roll = rng.random()
        if roll < 0.35:
            self._parse(rng, tag)
        elif roll < 0.5:
            self._yaml(rng, tag)
        else:
            self._build(rng, tag)

    def _parse(self, rng: random.Random, tag: str) -> None:
        from nextn.config.llm_args import LlmArgsError, parse_llm_args

        data = gen.llm_args(rng)
        self.h.attempt(self.name, f"{tag} parse_llm_args({data!r})", lambda: parse_llm_args(data), (LlmArgsError,),
                       2.0, check=_llm_args_within_caps)

    def _yaml(self, rng: random.Random, tag: str) -> None:
        from nextn.config.llm_args import LlmArgsError, load_llm_args_yaml, parse_llm_args

        data = gen.llm_args(rng)
        d = fresh_dir(self.root)
        path = d / "options.yaml"
        path.write_text(yaml.safe_dump(data))
        self.h.attempt(self.name, f"{tag} YAML {data!r}", lambda: parse_llm_args(load_llm_args_yaml(path)),
                       (LlmArgsError,), 2.0, check=_llm_args_within_caps)
        shutil.rmtree(d)

    def _build(self, rng: random.Random, tag: str) -> None:
        from nextn.cli import build_engine as cli

        d = fresh_dir(self.root)
        meta: dict[str, Any] = {}
        for key in rng.sample(sorted(gen.GGUF_COUNTS), rng.randrange(0, 3)):
            meta[key] = None if rng.random() < 0.1 else gen.gguf_value(rng, gen.GGUF_COUNTS[key])
        tokens, tokens_label = gen.token_list(rng, 24) if rng.random() < 0.3 else (None, "honest tokens")
        stored = rng.choice([2, 2, 2, 1, 3])
        try:
            model = gen.write_tiny_gguf(d / "m.gguf", meta, tokens, stored)
        except Exception:  # noqa: BLE001 - a value the gguf writer itself refuses: not an input we can make
            shutil.rmtree(d)
            return
        argv = ["--model_dir", str(model), "--output_dir", str(d / "out" / "engine"), "--no-progress"]
        label = f"{tag} build-engine of a GGUF with {meta}, {tokens_label}, {stored} stored blocks"
        if rng.random() < 0.4:
            argv += ["--max_batch_size", str(gen.count(rng, 8) if rng.random() < 0.5 else rng.choice(
                [0, -1, 65536, 65537, 2**31, 2**63]))]
        if rng.random() < 0.4:
            argv += ["--max_seq_len", str(rng.choice([0, 1, 2, 64, 65, 2**31 - 1, 2**31, 2**40]))]
        if rng.random() < 0.3:
            data = gen.llm_args(rng)
            (d / "options.yaml").write_text(yaml.safe_dump(data))
            argv += ["--extra_llm_api_options", str(d / "options.yaml")]
            label += f", options {data!r}"
        label += f", {argv[6:]}"
        if rng.random() < 0.3:  # the output's parent does not exist yet: it must not be left behind either
            argv[3] = str(d / "out" / "new" / "engine")
        (d / "out").mkdir()
        (d / "out" / "keep.txt").write_text("a user's file beside the output\n")
        before = sorted(p.name for p in (d / "out").iterdir())
        model_bytes = model.read_bytes()

        def built(code: Any) -> str | None:
            if code != 0:
                return f"main returned {code!r}"
            return None if (Path(argv[3]) / "manifest.json").is_file() else "no manifest.json after a build"

        outcome, _ = self.h.attempt(self.name, label, lambda: quiet(cli.main, argv),
                                    (), BUILD_BOUND_S, exit_2_is_named=True, check=built)
        after = sorted(p.name for p in (d / "out").iterdir())
        expected = before if outcome != "accepted" else sorted({*before, Path(argv[3]).relative_to(d / "out").parts[0]})
        if after != expected:
            self.h.fail(self.name, label, f"the output's parent holds {after} after the {outcome} build, want "
                                          f"{expected}")
        if model.read_bytes() != model_bytes:
            self.h.fail(self.name, label, "the checkpoint changed")
        shutil.rmtree(d)


def _llm_args_within_caps(args: Any) -> str | None:
    """What an accepted LlmArgs holds past the documented caps (config/llm_args.py), else None."""
    from nextn.config.llm_args import MAX_BATCH_SIZE, MAX_INT

    def ints(value: Any):
        if isinstance(value, bool):
            return
        if isinstance(value, int):
            yield value
        elif isinstance(value, dict):
            for k, v in value.items():
                yield from ints(k)
                yield from ints(v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                yield from ints(v)

    dumped = args.model_dump()
    big = [i for i in ints(dumped) if abs(i) > MAX_INT]
    if big:
        return f"accepted an int past ±{MAX_INT}: {big[0]}"
    if args.max_batch_size is not None and not 1 <= args.max_batch_size <= MAX_BATCH_SIZE:
        return f"accepted max_batch_size {args.max_batch_size}"
    if not 1 <= args.tensor_parallel_size <= 1024:
        return f"accepted tensor_parallel_size {args.tensor_parallel_size}"
    for key in ("max_seq_len", "max_num_tokens"):
        value = getattr(args, key)
        if value is not None and value < 1:
            return f"accepted {key} {value}"
    if args.kv_cache_config.tokens_per_block < 1:
        return f"accepted tokens_per_block {args.kv_cache_config.tokens_per_block}"
    return None


# 3. user-named files ------------------------------------------------------------------------------------------------
def _readers() -> list[tuple[str, int, tuple[str, ...], str | None, Any, tuple[type[BaseException], ...], bool]]:
    """(what, size cap, file suffixes, fixed file name or None, read(path), named errors, exit 2 named)."""
    from nextn.bench.dataset import DatasetError, load_dataset, read_prompt_file
    from nextn.cli import train_draft
    from nextn.cli.token_map import MAX_CORPUS_BYTES, TokenMapError, corpus_texts
    from nextn.config.llm_args import MAX_YAML_BYTES, LlmArgsError, load_llm_args_yaml
    from nextn.config.prompt_files import MAX_PROMPT_FILE_BYTES
    from nextn.config.user_files import MAX_USER_FILE_BYTES
    from nextn.speculative.medusa_tree import MAX_TREE_FILE_BYTES, TreeError, published_tree
    from nextn.speculative.draft_vocab import load_token_map
    from nextn.train.prompts import read_prompts
    from nextn.train.session import read_train_record

    def medusa(path: Path):
        old = os.environ.get("NEXTN_MEDUSA_CHOICES")
        os.environ["NEXTN_MEDUSA_CHOICES"] = str(path)
        try:
            return published_tree("mc_sim_7b_63")
        finally:
            os.environ.pop("NEXTN_MEDUSA_CHOICES") if old is None else os.environ.__setitem__("NEXTN_MEDUSA_CHOICES",
                                                                                               old)

    parser = argparse.ArgumentParser(prog="fuzz", add_help=False)
    prompts = (".jsonl", ".jsonl.gz", ".json")
    return [
        ("extra_llm_api_options YAML", MAX_YAML_BYTES, (".yaml",), None, load_llm_args_yaml, (LlmArgsError,), False),
        ("draft_token_map", MAX_USER_FILE_BYTES, (".json",), None, lambda p: load_token_map(p, TINY_VOCAB),
         (ValueError,), False),
        ("the Medusa tree file ($NEXTN_MEDUSA_CHOICES)", MAX_TREE_FILE_BYTES, (".json",), None, medusa, (TreeError,),
         False),
        ("token-map corpus", MAX_CORPUS_BYTES, (".txt", *prompts), None, lambda p: corpus_texts([p]),
         (TokenMapError,), False),
        ("train-draft prompt file", MAX_PROMPT_FILE_BYTES, (".txt", *prompts), None,
         lambda p: read_prompts([p], chat=False), (ValueError,), False),
        ("bench dataset", MAX_PROMPT_FILE_BYTES, prompts, None, load_dataset, (DatasetError,), False),
        ("bench prompt file", MAX_PROMPT_FILE_BYTES, prompts, None, read_prompt_file, (DatasetError,), False),
        ("train_draft.json (bench --heads)", MAX_USER_FILE_BYTES, ("",), "train_draft.json",
         lambda p: read_train_record(parser, p.parent), (), True),
        ("train_draft.json (train-draft --eval_only)", MAX_USER_FILE_BYTES, ("",), "train_draft.json",
         lambda p: train_draft._record(p.parent), (ValueError,), False),
        ("--eval_medusa_choices", MAX_USER_FILE_BYTES, (".json",), None, lambda p: train_draft._load_choices(p, "t"),
         (ValueError,), False),
    ]


class UserFilesCase(Case):
    name = "user_files"

    def __init__(self, harness: Harness, root: Path) -> None:
        super().__init__(harness, root)
        self.readers = _readers()

    def one(self, rng: random.Random, tag: str) -> None:
        import nextn.config.prompt_files as prompt_files

        what, cap, suffixes, fixed, read, named, exit_2 = rng.choice(self.readers)
        kind = rng.choice(gen.FILE_KINDS)
        d = fresh_dir(self.root)
        name = fixed or f"input{rng.choice(suffixes)}"
        if kind == "gzip_bomb" and fixed is None and ".jsonl.gz" in suffixes:
            name = "input.jsonl.gz"
        path = gen.hostile_file(rng, d / name, kind, cap, 3 * BOMB_CAP // 2, fixed_name=fixed is not None)
        bomb = kind == "gzip_bomb" and path.name.endswith(".gz")
        old_cap = prompt_files.MAX_PROMPT_FILE_BYTES
        if bomb:
            prompt_files.MAX_PROMPT_FILE_BYTES = BOMB_CAP
        try:
            outcome, _ = self.h.attempt(self.name, f"{tag} {what} given {kind} ({path.name})", lambda: quiet(
                read, path), named, READ_BOUND_S, exit_2_is_named=exit_2)
        finally:
            prompt_files.MAX_PROMPT_FILE_BYTES = old_cap
        if outcome == "accepted" and kind not in ("junk", "bad_utf8", "deep_json"):
            self.h.fail(self.name, f"{tag} {what} given {kind}", "accepted: a file that is not a small regular file "
                                                                "was read or silently ignored")
        shutil.rmtree(d)


# 4. trees -----------------------------------------------------------------------------------------------------------
class TreesCase(Case):
    name = "trees"

    def __init__(self, harness: Harness, root: Path) -> None:
        super().__init__(harness, root)
        self.engine: Path | None = None

    def _tiny_engine(self) -> Path:
        if self.engine is None:
            from nextn.build.engine_builder import build_engine
            from nextn.testing import SMALL_VOCAB, TinyDeepseekSpec, make_tiny_checkpoint

            ckpt = make_tiny_checkpoint(self.root / "ckpt", TinyDeepseekSpec(num_mtp_modules=1, **SMALL_VOCAB))
            build_engine(ckpt, self.root / "engine", progress=False, max_seq_len=64)
            from nextn.runtime.llm import LLM

            # the first load may build the CPU kernels (minutes on a cold cache): not a tree's cost
            LLM(self.root / "engine", device="cpu").shutdown()
            self.engine = self.root / "engine"
        return self.engine

    def one(self, rng: random.Random, tag: str) -> None:
        from nextn.config.llm_args import MAX_TREE_DEPTH, MAX_TREE_DRAFT_TOKENS, LlmArgsError, parse_llm_args

        choices, label = gen.tree(rng)
        medusa = rng.random() < 0.4
        depth = max((len(c) for c in choices if isinstance(c, list)), default=1) if isinstance(choices, list) else 1
        spec = {"decoding_type": "Medusa", "medusa_choices": choices} if medusa else {
            "decoding_type": "MTP", "num_nextn_predict_layers": rng.choice([1, 2, 4, 16, min(depth, 16)]),
            "eagle_choices": choices}
        key = "medusa_choices" if medusa else "eagle_choices"

        def within_caps(args: Any) -> str | None:
            got = getattr(args.speculative_config, key)
            if got is None or isinstance(got, str):  # no static tree, or a published tree's name
                return None
            if not 1 <= len(got) <= MAX_TREE_DRAFT_TOKENS or any(not 1 <= len(p) <= MAX_TREE_DEPTH for p in got):
                return f"accepted a tree of {len(got)} nodes, {max(map(len, got), default=0)} deep"
            if any(isinstance(r, bool) or not isinstance(r, int) for p in got for r in p):
                return "accepted a rank that is not an int"
            return None  # ranks are checked against the vocabulary (and ≥ 0) at load

        text = f"{tag} {key}: {label}: {str(choices)[:160]}"
        outcome, args = self.h.attempt(self.name, text, lambda: parse_llm_args({"speculative_config": spec}),
                                       (LlmArgsError,), 3.0, check=within_caps)
        if outcome != "accepted" or not isinstance(getattr(args.speculative_config, key), list):
            return  # refused, no tree, or the name of a published tree (the user_files class reads those)
        parsed = [list(p) for p in getattr(args.speculative_config, key)]
        over = any(not 0 <= r < TINY_VOCAB for p in parsed for r in p)
        engine = self.h.guard(self.name, "building and loading the tiny engine", self._tiny_engine, 600.0)
        if engine is None:
            return
        if medusa:  # the load-time check (a Medusa engine's loader calls it with the engine's vocabulary)
            from nextn.speculative.medusa_tree import TreeError, build_tree

            load = lambda: build_tree(parsed, TINY_VOCAB)  # noqa: E731
            named: tuple[type[BaseException], ...] = (TreeError,)
        else:
            from nextn.runtime.llm import LLM

            def load():
                LLM(engine, speculative_config={**spec, "eagle_choices": parsed}, device="cpu").shutdown()
            named = (LlmArgsError,)
        outcome, _ = self.h.attempt(self.name, f"{text} loaded on a {TINY_VOCAB}-token engine", load, named, 10.0)
        if outcome == "accepted" and over:
            self.h.fail(self.name, text, f"a rank outside the {TINY_VOCAB}-token vocabulary was accepted at load")
