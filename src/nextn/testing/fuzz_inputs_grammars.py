"""The `grammars` class of `fuzz_inputs.py` (issue 57): random guided-decoding requests against the real stories260K
(`../shared`; a batch-invariant engine) with an n-gram drafter on, so that steps verify ragged rows —

- `mixed`: a guided request (choice, regex or JSON schema; greedy or seeded sampling; log-probabilities on or off)
  in one batch with plain neighbours (greedy and sampled): every greedy neighbour's tokens equal its run alone, and
  the guided output keeps its grammar. (A sampled neighbour's tokens are kept in distribution, not token for token:
  rejection sampling's path depends on how many drafts its steps verified, which the draft-length schedule sets
  from the batch size.) Without `../shared`, a tiny DeepSeek-V3 with the real 129,280-token tokenizer and its MTP
  drafter stands in; its neighbours are compared where its engine is batch-invariant (nextn's CPU kernels loaded:
  MLA on `plugins/mla.py`'s op);
- `slow`: schemas and regexes whose repetition counts make xgrammar expand for seconds: compiled within the budget,
  or refused by name (`GrammarLimitError`) within budget plus slack;
- `flood`: a run of distinct schemas: the compiled grammars kept stay within the cache's bytes;
- `empty`: grammars that match no output: refused by name.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Any

from nextn.testing.fuzz_harness import Case, Harness

STORIES = Path(__file__).resolve().parents[3].parent / "shared" / "data" / "models" / "stories260K" / "stories260K.gguf"

BUDGET_S = 1.0
SLACK_S = 8.0  # past the budget: killing the worker and starting a fresh one (torch's imports) on a loaded machine
CACHE_BYTES = 8 << 20  # ~3 schemas of a 129k vocabulary (each ~2.4 MiB), many of a 512-token one
WORDS = ["alpha", "beta", "gamma", "yes", "no", "red", "blue", "42", "x y", "é"]


def _schema(rng: random.Random) -> dict:
    props = {}
    for i in range(rng.randint(1, 3)):
        props[f"k{i}_{rng.randrange(10**6)}"] = rng.choice([
            {"type": "integer", "minimum": 0, "maximum": rng.randint(1, 999)}, {"type": "boolean"},
            {"enum": rng.sample(WORDS, rng.randint(1, 4))}, {"type": "string", "maxLength": rng.randint(1, 8)}])
    return {"type": "object", "properties": props, "required": sorted(props), "additionalProperties": False}


def _regex(rng: random.Random) -> str:
    pieces = ["[0-9]{1,3}", "[a-c]{2}", "(ab|cd)", "-", "x?", "[A-Z]"]
    return "".join(rng.choice(pieces) for _ in range(rng.randint(1, 4)))


def _guided(rng: random.Random):
    from nextn.runtime.sampling_params import GuidedDecodingParams

    kind = rng.choice(["choice", "regex", "json"])
    if kind == "choice":
        return GuidedDecodingParams(choice=rng.sample(WORDS, rng.randint(1, 5)))
    if kind == "regex":
        return GuidedDecodingParams(regex=_regex(rng))
    return GuidedDecodingParams(json=_schema(rng))


def _keeps(guided, text: str) -> str | None:
    """Why `text` breaks the grammar, or None."""
    if guided.choice is not None:
        return None if text in guided.choice else f"{text!r} is not one of {guided.choice}"
    if guided.regex is not None:
        return None if re.fullmatch(guided.regex, text) else f"{text!r} does not match {guided.regex!r}"
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), guided.json_schema)
    except (ValueError, jsonschema.ValidationError) as e:
        return f"{text!r} is not valid against the schema: {str(e)[:120]}"
    return None


def _slow(rng: random.Random):
    from nextn.runtime.sampling_params import GuidedDecodingParams

    low = rng.randint(300, 3000)
    high = rng.randint(low, 20000)
    if rng.random() < 0.5:
        return GuidedDecodingParams(regex=f"{rng.choice(['[a-z]', '(ab|c)', '[0-9a-f]'])}{{{low},{high}}}")
    return GuidedDecodingParams(json={"type": "object", "properties": {"v": {"type": "string", "pattern": (
        f"[a-z]{{{low},{high}}}")}}, "required": ["v"]})


def _empty(rng: random.Random):
    from nextn.runtime.sampling_params import GuidedDecodingParams

    n = rng.randint(1, 5)
    if rng.random() < 0.5:  # a cycle of rules that never reaches a terminal first
        rules = [f"r{i} ::= r{(i + 1) % n} \"{rng.choice('abc')}\"" for i in range(n)]
        return GuidedDecodingParams(grammar="root ::= r0\n" + "\n".join(rules))
    defs = {f"d{i}": {"$ref": f"#/$defs/d{(i + 1) % n}"} for i in range(n)}
    return GuidedDecodingParams(json={"$ref": "#/$defs/d0", "$defs": defs})


class GrammarsCase(Case):
    name = "grammars"

    def __init__(self, harness: Harness, root: Path) -> None:
        super().__init__(harness, root)
        self.llm = None
        self.alone: dict[tuple, list[int]] = {}
        self.kinds = ["empty", "mixed", "slow"]  # the first turns (a short run still sees each rule), then random
        # set up now, as the template class starts its worker: the class's seconds are its inputs'
        self.h.guard(self.name, "building and loading the tiny engine", self._engine, 600.0)

    def close(self) -> None:
        if self.llm is not None:
            self.llm.shutdown()

    def _engine(self):
        if self.llm is None:
            from nextn.build.engine_builder import build_engine
            from nextn.runtime.grammar_pool import GrammarLimits
            from nextn.runtime.llm import LLM
            from nextn.testing import TinyDeepseekSpec, make_tiny_checkpoint

            if STORIES.is_file():
                build_engine(STORIES, self.root / "engine", progress=False, max_seq_len=256)
                spec = {"decoding_type": "NGram", "max_draft_len": 4, "max_matching_ngram_size": 2}
            else:
                ckpt = make_tiny_checkpoint(self.root / "ckpt", TinyDeepseekSpec(num_mtp_modules=1))
                build_engine(ckpt, self.root / "engine", progress=False, max_seq_len=128)
                spec = {"decoding_type": "MTP", "num_nextn_predict_layers": 1}
            self.llm = LLM(self.root / "engine", device="cpu", speculative_config=spec)
            self.llm.engine.grammar_limits = GrammarLimits(timeout_s=BUDGET_S, cache_bytes=CACHE_BYTES)
        return self.llm

    def one(self, rng: random.Random, tag: str) -> None:
        llm = self.h.guard(self.name, "building and loading the tiny engine", self._engine, 600.0)
        if llm is not None:
            kind = self.kinds.pop(0) if self.kinds else rng.choice(["mixed", "mixed", "slow", "flood", "empty"])
            getattr(self, f"_{kind}")(llm, rng, f"{tag} {kind}")

    def _mixed(self, llm, rng: random.Random, tag: str) -> None:
        from nextn.runtime.sampling_params import SamplingParams

        guided = _guided(rng)
        prompts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(2, 4))]

        def params(g=None) -> SamplingParams:
            sampled = rng.random() < 0.5
            return SamplingParams(max_tokens=rng.randint(4, 16), ignore_eos=g is None, guided_decoding=g,
                                  temperature=1.0 if sampled else 0.0, seed=rng.randrange(1000) if sampled else None,
                                  logprobs=rng.choice([None, 0, 2]))
        sps = [params(guided)] + [params() for _ in prompts[1:]]

        def run() -> list:
            return [o.outputs[0] for o in llm.generate(prompts, sps)]

        def check(outs: list) -> str | None:
            g = outs[0]
            if g.finish_reason == "stop" and _keeps(guided, g.text):
                return f"the guided output broke its grammar: {_keeps(guided, g.text)}"
            for prompt, sp, out in zip(prompts[1:], sps[1:], outs[1:]):
                if sp.temperature > 0 or not llm.engine.batch_invariant:
                    continue
                key = (prompt, sp.model_dump_json())
                if key not in self.alone:
                    self.alone[key] = llm.generate([prompt], sp)[0].outputs[0].token_ids
                if out.token_ids != self.alone[key]:
                    return f"a plain neighbour changed: {out.token_ids} alone {self.alone[key]}"
            return None
        self.h.attempt(self.name, f"{tag} {guided.key()[:160]} with {len(prompts) - 1} neighbours", run, (), 60.0,
                       check=check)

    def _compile(self, llm, guided) -> Any:
        from nextn.runtime.sampling_params import SamplingParams

        return llm.engine.compile_grammar(SamplingParams(guided_decoding=guided))

    def _slow(self, llm, rng: random.Random, tag: str) -> None:
        from nextn.runtime.request_validation import RequestSamplingParamsError

        guided = _slow(rng)
        self.h.attempt(self.name, f"{tag} {guided.key()[:160]}", lambda: self._compile(llm, guided),
                       (RequestSamplingParamsError,), BUDGET_S + SLACK_S)

    def _flood(self, llm, rng: random.Random, tag: str) -> None:
        from nextn.runtime.sampling_params import GuidedDecodingParams

        schemas = [GuidedDecodingParams(json=_schema(rng)) for _ in range(rng.randint(3, 6))]

        def run() -> int:
            for g in schemas:
                self._compile(llm, g)
            return llm.engine._grammar_compiler().cache_bytes

        self.h.attempt(self.name, f"{tag} {len(schemas)} schemas", run, (), 10.0 * len(schemas),
                       check=lambda kept: None if kept <= CACHE_BYTES else f"{kept} bytes kept > {CACHE_BYTES}")

    def _empty(self, llm, rng: random.Random, tag: str) -> None:
        from nextn.runtime.request_validation import RequestSamplingParamsError

        guided = _empty(rng)

        def run() -> None:
            try:
                self._compile(llm, guided)
            except RequestSamplingParamsError as e:
                if "matches no output" not in str(e):
                    raise AssertionError(f"refused for another reason: {e}") from None
                raise

        outcome, _ = self.h.attempt(self.name, f"{tag} {guided.key()[:160]}", run, (RequestSamplingParamsError,),
                                    BUDGET_S + SLACK_S)
        if outcome == "accepted":
            self.h.fail(self.name, f"{tag} {guided.key()[:160]}", "a grammar that matches no output was accepted")
