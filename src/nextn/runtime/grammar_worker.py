"""A grammar worker: a child process that converts and compiles guided-decoding grammars with xgrammar.

Run as a script (`python -P grammar_worker.py MEMORY_BYTES`) by `nextn.runtime.grammar_pool`, never imported by the
parent for its work. A schema's conversion or compile can take minutes and gigabytes (xgrammar expands a
`pattern` of `[a-z]{2000,10000}` into that many states) and cannot be stopped inside a thread, so it runs here,
where the parent kills it at the wall-clock budget; the worker lowers its CPU priority (nice 10) and caps its
address space at its imports plus MEMORY_BYTES (`runtime/worker_frames.py`).

Frames (`worker_frames`: length-prefixed JSON, no pickle). First `{"ready": true}`; then per request:
- `{"op": "tokenizer", "key", "info"}`: keep xgrammar's `TokenizerInfo` (its `serialize_json` text) under `key`;
  answers `{"ok": true}`.
- `{"op": "compile", "tokenizer", "form", "source", "max_bytes"}`: form "json_schema" (source: the schema's JSON
  text), "json_object", "regex" or "grammar" (EBNF); answers `{"compiled": CompiledGrammar.serialize_json(),
  "bytes"}` or `{"error", "kind"}`.
- `{"op": "tool_call", "schema", "open", "close"}`: the EBNF of `open`, one JSON value valid against `schema`, then
  `close`; answers `{"ebnf"}` or `{"error", "kind"}`.
Error kinds: "unknown_tokenizer" (not sent yet, or dropped: a worker keeps the last 4), "grammar" (xgrammar
refused it), "empty" (the grammar matches no output at all: no first token and no end), "size" (the compiled grammar
is over `max_bytes`), "memory" (MemoryError: the worker then exits).
"""

from __future__ import annotations

import json
import sys

from nextn.runtime.worker_frames import become_worker, read_frame, write_frame

MAX_REQUEST_BYTES = 1 << 28  # a tokenizer's info is a few MB (152k-token vocabularies: ~5 MB)
MAX_TOKENIZERS = 4  # engines in one process rarely have more tokenizers; older ones are dropped first


def _compile(xgr, compilers: dict, request: dict) -> dict:
    compiler = compilers.get(request["tokenizer"])
    if compiler is None:  # never sent, or dropped for newer ones: the parent sends it and asks again
        return {"error": "unknown tokenizer (send it first)", "kind": "unknown_tokenizer"}
    form, source = request["form"], request.get("source")
    if form == "json_object":
        compiled = compiler.compile_builtin_json_grammar()
    elif form == "json_schema":
        # compact separators and no free whitespace: a small model cannot loop on blanks inside the value
        compiled = compiler.compile_json_schema(source, any_whitespace=False)
    elif form == "regex":
        compiled = compiler.compile_regex(source)
    elif form == "grammar":
        compiled = compiler.compile_grammar(source)
    else:
        return {"error": f"unknown form {str(form)[:40]!r}", "kind": "protocol"}
    size = int(compiled.memory_size_bytes)
    if size > int(request["max_bytes"]):
        return {"error": f"the compiled grammar takes {size / 2**20:.1f} MiB; at most "
                         f"{int(request['max_bytes']) / 2**20:.0f} MiB are allowed", "kind": "size"}
    matcher = xgr.GrammarMatcher(compiled)
    mask = xgr.allocate_token_bitmask(1, compiled.tokenizer_info.vocab_size)
    matcher.fill_next_token_bitmask(mask)
    if not bool(mask.any()):  # neither a first token nor the end is allowed: no output can match
        return {"error": "the grammar matches no output at all (e.g. a rule that only refers to itself, as "
                         "`root ::= root \"a\"`, or a schema whose $ref only recurses)", "kind": "empty"}
    return {"compiled": compiled.serialize_json(), "bytes": size}


def _tool_call(xgr, request: dict) -> dict:
    body = xgr.Grammar.from_json_schema(request["schema"], any_whitespace=False)
    open_, close = (xgr.Grammar.from_ebnf(f"root ::= {json.dumps(s)}") for s in (request["open"], request["close"]))
    return {"ebnf": str(xgr.Grammar.concat(open_, body, close))}


def _answer(xgr, compilers: dict, request: dict) -> dict:
    op = request.get("op")
    try:
        if op == "tokenizer":
            info = xgr.TokenizerInfo.deserialize_json(request["info"])
            compilers[request["key"]] = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            while len(compilers) > MAX_TOKENIZERS:
                compilers.pop(next(iter(compilers)))
            return {"ok": True}
        if op == "compile":
            return _compile(xgr, compilers, request)
        if op == "tool_call":
            return _tool_call(xgr, request)
        return {"error": f"unknown op {str(op)[:40]!r}", "kind": "protocol"}
    except MemoryError:
        return {"error": "the grammar ran out of the worker's memory cap", "kind": "memory"}
    except Exception as e:  # xgrammar raises RuntimeError / ValueError with its parser's message
        return {"error": str(e)[:500] or type(e).__name__, "kind": "grammar"}


def main(argv: list[str]) -> int:
    import xgrammar as xgr  # (and torch, which it imports: before the memory cap)

    become_worker(int(argv[1]) if len(argv) > 1 else 2 << 30)
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # stray prints must not corrupt the frames
    compilers: dict = {}
    write_frame(out, {"ready": True})
    while True:
        request = read_frame(inp, MAX_REQUEST_BYTES)
        if request is None:
            return 0
        reply = _answer(xgr, compilers, request)
        try:
            write_frame(out, reply)
        except MemoryError:
            write_frame(out, {"error": "the compiled grammar ran out of the worker's memory cap", "kind": "memory"})
            return 1
        if reply.get("kind") == "memory":
            return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
