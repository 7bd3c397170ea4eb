"""Grammars for guided decoding, compiled by xgrammar (Dong et al. 2024, arXiv 2411.15100).

xgrammar over llguidance, measured on this CPU (2 cores, Zen 4) with a 5-property JSON schema (nested object,
array, pattern) and a 49-51-token answer: per-token mask time median / max 2 / 90 µs (SmolLM2, 49k vocabulary) and
4 / 98 µs (Qwen2.5, 152k), against llguidance 1.9.1's 14 / 1,280 µs and 24 / 1,439 µs; compile 0.12 / 0.61 s
against 0.34 / 1.37 s. Both mask far inside a decode step (~5–35 ms here); xgrammar's worst case is 13× lower.

One `GrammarCompiler` per engine (its tokenizer's vocabulary and stop tokens); each conversion and compile runs in a
grammar worker process under a time budget (runtime/grammar_pool.py), and compiled grammars are cached by their
text, bounded by entries and bytes (least recently used evicted). A request gets its own `GrammarMatcher`, which the
host advances with each emitted token and forks-and-rolls-back over the drafts of a step
(runtime/logits_processors.py).
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING

from nextn.runtime.grammar_pool import GrammarLimits, GrammarWorkers, shared_grammar_workers
from nextn.runtime.sampling_params import GuidedDecodingParams, SamplingParamsError

if TYPE_CHECKING:
    import xgrammar

__all__ = ["GrammarCompiler", "unenforced_keywords"]

_CACHE_SIZE = 64
#: JSON Schema keywords xgrammar's grammar does not enforce (measured on the JSON-Schema-Test-Suite; OpenAI's strict
#: structured outputs refuse the same kind): refused by name rather than silently under-enforced.
_UNENFORCED = ("allOf", "oneOf", "not", "if", "then", "else", "dependentRequired", "dependentSchemas",
               "unevaluatedProperties", "unevaluatedItems", "patternProperties", "propertyNames", "contains",
               "minContains", "maxContains", "uniqueItems", "multipleOf", "minProperties", "maxProperties",
               "dependencies", "$dynamicRef", "$recursiveRef")
#: Keywords that only describe a schema: beside them a combinator is alone.
_ANNOTATIONS = {"$schema", "$id", "$defs", "definitions", "$comment", "title", "description", "default", "examples",
                "deprecated", "readOnly", "writeOnly"}
_MAX_DEPTH = 64


def _choice_ebnf(choices: list[str]) -> str:
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def unenforced_keywords(schema: object) -> list[str]:
    """The places in a JSON Schema that xgrammar's JSON-schema grammar would not enforce, as "keyword at /path":
    the keywords of `_UNENFORCED`, `anyOf` beside validation keywords, `$ref`s that are not local ("#..."), and
    `required` names an object does not declare in its `properties`. [] when the grammar enforces all of it.
    Nesting deeper than 64 levels is reported too (bounded walk)."""
    found: list[str] = []

    def walk(node: object, path: str, depth: int) -> None:
        if depth > _MAX_DEPTH:
            found.append(f"nesting deeper than {_MAX_DEPTH} at {path or '/'}")
            return
        if isinstance(node, list):
            for i, item in enumerate(node):
                walk(item, f"{path}/{i}", depth + 1)
            return
        if not isinstance(node, dict):
            return
        where = path or "/"
        found.extend(f"{k} at {where}" for k in _UNENFORCED if k in node)
        if "anyOf" in node and set(node) - _ANNOTATIONS - {"anyOf"}:
            found.append(f"anyOf beside {sorted(set(node) - _ANNOTATIONS - {'anyOf'})} at {where}")
        ref = node.get("$ref")
        if isinstance(ref, str) and not ref.startswith("#"):
            found.append(f"non-local $ref {ref[:60]!r} at {where}")
        required = node.get("required")
        if isinstance(required, list):
            properties = node.get("properties")
            declared = properties if isinstance(properties, dict) else {}
            missing = [r for r in required if r not in declared]
            if missing:
                found.append(f"required {missing[:3]} not in properties at {where}")
        for key, value in node.items():
            if key in ("properties", "$defs", "definitions") and isinstance(value, dict):  # name → schema
                for name, sub in value.items():
                    walk(sub, f"{path}/{key}/{name}", depth + 1)
            elif key not in ("enum", "const", "default", "examples", "required"):  # values, not schemas
                walk(value, f"{path}/{key}", depth + 1)

    walk(schema, "", 0)
    return found


class GrammarCompiler:
    """Compiles `GuidedDecodingParams` for one tokenizer; thread-safe (the server's threads share it).

    Each conversion and compile runs in a grammar worker under `limits` (runtime/grammar_pool.py); the compiled
    grammars are kept here, bounded by entries (64) and by bytes (`limits.cache_bytes`, xgrammar's own measure).

    Args:
        hf_tokenizer: the engine's `transformers` tokenizer; vocab_size: the model's vocabulary (≥ the tokenizer's:
            padded rows are never allowed); stop_ids: the engine's end-of-sequence tokens (allowed once the grammar
            is complete). limits: the budget (default `GrammarLimits()`); workers: the pool (default: the
            process's shared one).
    """

    def __init__(self, hf_tokenizer, vocab_size: int, stop_ids: list[int], limits: GrammarLimits | None = None,
                 workers: GrammarWorkers | None = None) -> None:
        import xgrammar as xgr

        self.hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        self.stop_ids = list(stop_ids)
        self.limits = limits or GrammarLimits()
        self._workers = workers or shared_grammar_workers()
        self._info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size,
                                                        stop_token_ids=self.stop_ids)
        self._info_json = self._info.serialize_json()
        self._info_key = hashlib.sha256(self._info_json.encode("utf-8", "surrogatepass")).hexdigest()[:32]
        self._cache: OrderedDict[str, tuple[xgrammar.CompiledGrammar, int]] = OrderedDict()
        self._cache_bytes = 0
        self._lock = threading.Lock()

    @property
    def cache_bytes(self) -> int:
        """Bytes of the compiled grammars kept now (xgrammar's `memory_size_bytes`), at most `limits.cache_bytes`."""
        return self._cache_bytes

    def compile(self, params: GuidedDecodingParams) -> xgrammar.CompiledGrammar:
        """The compiled grammar.

        Raises:
            SamplingParamsError: xgrammar cannot compile it, the schema uses what it would not enforce, or the grammar
                matches no output (each named). GrammarLimitError (a SamplingParamsError): it passed its time,
                size or memory budget. GrammarBusyError (a SamplingParamsError): the workers are all busy.
        """
        import xgrammar as xgr

        key = params.key()
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key][0]
        if params.json_object:
            form, source = "json_object", None
        elif params.json_schema is not None:
            schema = params.json_schema
            try:
                schema = json.loads(schema) if isinstance(schema, str) else schema
            except ValueError as e:
                raise SamplingParamsError(f"the guided-decoding JSON schema is not JSON: {e}") from None
            unenforced = unenforced_keywords(schema)
            if unenforced:
                raise SamplingParamsError(
                    "the JSON schema uses what the grammar cannot enforce: " + "; ".join(unenforced[:5])
                    + (f" (and {len(unenforced) - 5} more)" if len(unenforced) > 5 else "")
                    + ". Supported: type, properties, required (of declared properties), items, prefixItems, "
                    "enum, const, anyOf (alone), local $ref/$defs, string/number/array bounds, pattern")
            form, source = "json_schema", json.dumps(schema)
        elif params.regex is not None:
            form, source = "regex", params.regex
        elif params.grammar is not None:
            form, source = "grammar", params.grammar
        else:
            form, source = "grammar", _choice_ebnf(params.choice or [])
        text = self._workers.compile(self._info_key, self._info_json, form, source, self.limits)
        compiled = xgr.CompiledGrammar.deserialize_json(text, self._info)
        size = int(compiled.memory_size_bytes)
        with self._lock:
            if key not in self._cache:
                self._cache[key] = (compiled, size)
                self._cache_bytes += size
            while len(self._cache) > _CACHE_SIZE or self._cache_bytes > self.limits.cache_bytes:
                _, (_, evicted) = self._cache.popitem(last=False)
                self._cache_bytes -= evicted
        return compiled

    def tool_call_ebnf(self, schema: dict, open_tag: str, close_tag: str) -> str:
        """The EBNF grammar of `open_tag`, one JSON value valid against `schema` (compact), then `close_tag`,
        converted in a grammar worker under `limits`. Raises SamplingParamsError (and its budget subclasses)."""
        return self._workers.tool_call_ebnf(json.dumps(schema), open_tag, close_tag, self.limits)

    def matcher(self, params: GuidedDecodingParams, stop_ids: list[int] | None = None) -> xgrammar.GrammarMatcher:
        """A fresh matcher at the grammar's start; `stop_ids` (default: the engine's EOS) end a complete output."""
        import xgrammar as xgr

        return xgr.GrammarMatcher(self.compile(params), override_stop_tokens=list(stop_ids or self.stop_ids))
