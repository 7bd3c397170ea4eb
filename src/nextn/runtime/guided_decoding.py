"""Grammars for guided decoding, compiled by xgrammar (Dong et al. 2024, arXiv 2411.15100).

xgrammar over llguidance, measured on this CPU (2 cores, Zen 4) with a 5-property JSON schema (nested object,
array, pattern) and a 49-51-token answer: per-token mask time median / max 2 / 90 µs (SmolLM2, 49k vocabulary) and
4 / 98 µs (Qwen2.5, 152k), against llguidance 1.9.1's 14 / 1,280 µs and 24 / 1,439 µs; compile 0.12 / 0.61 s
against 0.34 / 1.37 s. Both mask far inside a decode step (~5–35 ms here); xgrammar's worst case is 13× lower.

One `GrammarCompiler` per engine (its tokenizer's vocabulary and stop tokens); compiled grammars are cached by their
text (bounded, least recently used evicted). A request gets its own `GrammarMatcher`, which the host advances with
each emitted token and forks-and-rolls-back over the drafts of a step (runtime/logits_processors.py).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING

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
            declared = node.get("properties") if isinstance(node.get("properties"), dict) else {}
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

    Args:
        hf_tokenizer: the engine's `transformers` tokenizer; vocab_size: the model's vocabulary (≥ the tokenizer's:
            padded rows are never allowed); stop_ids: the engine's end-of-sequence tokens (allowed once the grammar
            is complete).
    """

    def __init__(self, hf_tokenizer, vocab_size: int, stop_ids: list[int]) -> None:
        import xgrammar as xgr

        self.hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        self.stop_ids = list(stop_ids)
        info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size, stop_token_ids=self.stop_ids)
        self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        self._cache: OrderedDict[str, xgrammar.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, params: GuidedDecodingParams) -> xgrammar.CompiledGrammar:
        """The compiled grammar. Raises SamplingParamsError naming the problem when xgrammar cannot compile it."""
        key = params.key()
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        c = self._compiler
        try:
            if params.json_object:
                compiled = c.compile_builtin_json_grammar()
            elif params.json_schema is not None:
                schema = params.json_schema
                schema = json.loads(schema) if isinstance(schema, str) else schema
                unenforced = unenforced_keywords(schema)
                if unenforced:
                    raise SamplingParamsError(
                        "the JSON schema uses what the grammar cannot enforce: " + "; ".join(unenforced[:5])
                        + (f" (and {len(unenforced) - 5} more)" if len(unenforced) > 5 else "")
                        + ". Supported: type, properties, required (of declared properties), items, prefixItems, "
                        "enum, const, anyOf (alone), local $ref/$defs, string/number/array bounds, pattern")
                # Compact separators and no free whitespace: a small model cannot loop on blanks inside the value.
                compiled = c.compile_json_schema(schema, any_whitespace=False)
            elif params.regex is not None:
                compiled = c.compile_regex(params.regex)
            elif params.grammar is not None:
                compiled = c.compile_grammar(params.grammar)
            else:
                compiled = c.compile_grammar(_choice_ebnf(params.choice or []))
        except SamplingParamsError:
            raise
        except Exception as e:  # xgrammar raises RuntimeError/ValueError with the parser's message
            raise SamplingParamsError(f"the guided-decoding grammar cannot be compiled: {str(e)[:500]}") from None
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def matcher(self, params: GuidedDecodingParams, stop_ids: list[int] | None = None) -> xgrammar.GrammarMatcher:
        """A fresh matcher at the grammar's start; `stop_ids` (default: the engine's EOS) end a complete output."""
        import xgrammar as xgr

        return xgr.GrammarMatcher(self.compile(params), override_stop_tokens=list(stop_ids or self.stop_ids))
