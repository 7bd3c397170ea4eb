"""Random hostile inputs for `fuzz_inputs.py` (issue 32's classes): chat templates, counts (LLM arguments and GGUF
metadata), rank trees, and user-named files that are not what they claim. Every generator draws from the caller's
`random.Random`, so a run is reproduced by its seed; each returns plain data plus a short label for the report.
"""

from __future__ import annotations

import gzip
import math
import os
import random
from pathlib import Path
from typing import Any

# Counts ---------------------------------------------------------------------------------------------------------

#: Values no count should take silently: zero, negative, past every cap, wrong types, non-finite.
HOSTILE_COUNTS: list[Any] = [0, -1, -(2**31), 2**16 + 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1, 2**64,
                             10**30, True, False, 1.5, 2.0, -0.0, math.nan, math.inf, "8", "", None, [], [8], {},
                             {"n": 8}]


def count(rng: random.Random, good: int = 8) -> Any:
    """A count: half the time a plausible one (small, near `good`), else a hostile value or a huge random int."""
    roll = rng.random()
    if roll < 0.5:
        return rng.choice([1, 2, good, good * 2, rng.randrange(1, 4 * good + 2)])
    if roll < 0.85:
        return rng.choice(HOSTILE_COUNTS)
    return rng.choice([rng.randrange(-(2**70), 2**70), 2 ** rng.randrange(16, 200), -rng.randrange(1, 10**6)])


def _hashable(value: Any) -> Any:
    return value if isinstance(value, (int, float, str, type(None))) else str(value)


def llm_args(rng: random.Random) -> dict[str, Any]:
    """A random LLM-arguments mapping (TensorRT-LLM keys) with hostile counts in random places."""
    data: dict[str, Any] = {}
    for key, good in rng.sample([("max_batch_size", 8), ("max_seq_len", 64), ("max_num_tokens", 256),
                                 ("tensor_parallel_size", 1), ("moe_expert_parallel_size", 1)], rng.randrange(0, 4)):
        data[key] = count(rng, good)
    if rng.random() < 0.4:
        data["kv_cache_config"] = {k: (count(rng, g) if k != "free_gpu_memory_fraction" else
                                       rng.choice([0.5, 0.0, 1.5, -1, math.nan, "0.5", 1]))
                                   for k, g in rng.sample([("tokens_per_block", 32), ("max_tokens", 2048),
                                                           ("free_gpu_memory_fraction", 0)], rng.randrange(1, 4))}
    if rng.random() < 0.2:
        data["cuda_graph_config"] = {"batch_sizes": [count(rng, 4) for _ in range(rng.randrange(0, 4))],
                                     "max_batch_size": count(rng, 8)}
    if rng.random() < 0.5:
        kind = rng.choice(["MTP", "NGram", "Draft_Target", "Medusa", rng.choice(["mtp", "", None, 3])])
        spec: dict[str, Any] = {"decoding_type": kind}
        fields = {"MTP": [("num_nextn_predict_layers", 1), ("max_total_draft_tokens", 15),
                          ("dynamic_tree_max_topK", 4), ("relaxed_topk", 1), ("draft_vocab_size", 64)],
                  "NGram": [("max_draft_len", 4), ("max_matching_ngram_size", 2), ("max_concurrency", 8)],
                  "Draft_Target": [("max_draft_len", 4), ("draft_vocab_size", 64)],
                  "Medusa": [("num_medusa_heads", 4)]}.get(kind, [("max_draft_len", 4)])
        for key, good in rng.sample(fields, rng.randrange(1, len(fields) + 1)):
            spec[key] = count(rng, good)
        if kind == "Draft_Target":
            spec["speculative_model_dir"] = "/nonexistent/draft"
        if rng.random() < 0.2:
            spec["draft_len_schedule"] = {_hashable(count(rng, 4)): count(rng, 2) for _ in range(rng.randrange(1, 3))}
        data["speculative_config"] = spec
    return data


#: GGUF metadata keys of the tiny Llama GGUF that size something, and their honest values.
GGUF_COUNTS = {"llama.block_count": 2, "llama.context_length": 64, "llama.embedding_length": 16,
               "llama.feed_forward_length": 32, "llama.attention.head_count": 2, "llama.attention.head_count_kv": 1,
               "llama.rope.dimension_count": 8, "llama.vocab_size": 24}


def gguf_value(rng: random.Random, honest: int) -> tuple[Any, str]:
    """A (value, GGUF type name) for a count key: a hostile value of a type it fits, or a near-honest one."""
    kind = rng.choice(["UINT32", "UINT32", "INT32", "UINT64", "INT64", "FLOAT32", "BOOL", "STRING", "ARRAY", "UINT8"])
    value: Any
    if kind in ("UINT32", "UINT64", "UINT8"):
        top = {"UINT32": 2**32 - 1, "UINT64": 2**64 - 1, "UINT8": 255}[kind]
        value = rng.choice([0, 1, honest, honest + 1, honest * 2, max(honest - 1, 0), top, top // 2 + 1,
                            rng.randrange(0, top + 1)])
    elif kind in ("INT32", "INT64"):
        top = 2**31 - 1 if kind == "INT32" else 2**63 - 1
        value = rng.choice([-1, -top - 1, 0, honest, top, rng.randrange(-top - 1, top + 1)])
    elif kind == "FLOAT32":
        value = rng.choice([float(honest), honest + 0.5, -1.0, 1e30, math.nan, math.inf])
    elif kind == "BOOL":
        value = rng.choice([True, False])
    elif kind == "STRING":
        value = rng.choice([str(honest), "", "-1", "1e9", "x" * rng.randrange(1, 300)])
    else:
        value = rng.choice([[honest], [honest] * rng.randrange(2, 40), [], ["a", "b"]])
    return value, kind


def token_list(rng: random.Random, vocab: int) -> tuple[list[Any] | None, str]:
    """A `tokenizer.ggml.tokens` list: honest (None), too short or long, empty, duplicated, or of other types."""
    kind = rng.randrange(6)
    names = ["<unk>", "<s>", "</s>"] + [f"t{i}" for i in range(vocab - 3)]
    if kind == 0:
        return None, "honest tokens"
    if kind == 1:
        n = rng.choice([0, 1, 3, vocab - 1, vocab + 1, vocab * 3, rng.randrange(0, 3 * vocab)])
        return ["<unk>", "<s>", "</s>", *[f"t{i}" for i in range(max(n - 3, 0))]][:n], f"{n} tokens"
    if kind == 2:
        return ["t"] * vocab, "duplicate tokens"
    if kind == 3:
        return [str(i) * rng.randrange(1, 2000) for i in range(vocab)], "long tokens"
    if kind == 4:
        return list(range(vocab)), "int tokens"
    return names[:vocab // 2] + [""] * (vocab - vocab // 2), "empty-string tokens"


def write_tiny_gguf(path: Path, meta: dict[str, tuple[Any, str] | None] | None = None,
                    tokens: list[Any] | None = None, stored_blocks: int = 2) -> Path:
    """A float32 Llama GGUF with hidden 16, 2 heads (1 KV head), ffn 32, a 24-token vocabulary, `stored_blocks`
    blocks; `meta` overrides a key with (value, GGUF type name), or drops it (None); `tokens` replaces the list."""
    import gguf
    import numpy as np

    vt = gguf.GGUFValueType
    keys: dict[str, tuple[Any, str] | None] = {k: (v, "UINT32") for k, v in GGUF_COUNTS.items()
                                               if k not in ("llama.vocab_size", "llama.rope.dimension_count")}
    keys["llama.attention.layer_norm_rms_epsilon"] = (1e-5, "FLOAT32")
    keys.update(meta or {})
    w = gguf.GGUFWriter(str(path), "llama")
    for key, item in keys.items():
        if item is None:
            continue
        value, kind = item
        if kind == "ARRAY":
            w.add_array(key, value)
        else:
            w.add_key_value(key, value, getattr(vt, kind))
    toks = tokens if tokens is not None else ["<unk>", "<s>", "</s>"] + [f"t{i}" for i in range(21)]
    w.add_tokenizer_model("llama")
    w.add_token_list(toks)
    w.add_token_scores([0.0] * len(toks))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    rng = np.random.default_rng(0)
    shapes = {"token_embd.weight": (24, 16), "output_norm.weight": (16,), "output.weight": (24, 16)}
    for b in range(stored_blocks):
        shapes.update({f"blk.{b}.attn_q.weight": (16, 16), f"blk.{b}.attn_k.weight": (8, 16),
                       f"blk.{b}.attn_v.weight": (8, 16), f"blk.{b}.attn_output.weight": (16, 16),
                       f"blk.{b}.ffn_gate.weight": (32, 16), f"blk.{b}.ffn_up.weight": (32, 16),
                       f"blk.{b}.ffn_down.weight": (16, 32), f"blk.{b}.attn_norm.weight": (16,),
                       f"blk.{b}.ffn_norm.weight": (16,)})
    for name, shape in shapes.items():
        w.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# Trees ----------------------------------------------------------------------------------------------------------

def tree(rng: random.Random) -> tuple[Any, str]:
    """Random rank paths: sizes to 20,000 nodes, depths to 100, ranks to 2**31, duplicates, missing parents, wrong
    types; about a third are valid trees within the caps."""
    kind = rng.randrange(8)
    if kind <= 2:  # a valid prefix-closed tree of random shape (sometimes past the caps)
        limit = rng.choice([rng.randrange(1, 40), rng.randrange(1, 300), rng.randrange(1, 20_000)])
        max_depth, max_rank = rng.choice([3, 8, 64, 65, 100]), rng.choice([2, 4, 16, 600, 2**31])
        nodes, frontier = [], [()]
        while len(nodes) < limit and frontier:
            parent = frontier.pop(rng.randrange(len(frontier)))
            for r in sorted(rng.sample(range(min(max_rank, 10**6)), min(rng.randrange(1, 4), max_rank))):
                child = (*parent, r)
                if len(child) <= max_depth and len(nodes) < limit:
                    nodes.append(list(child))
                    frontier.append(child)
        if kind == 2 and nodes:  # the same tree with a chain past the depth cap
            nodes += [[0] * d for d in range(1, rng.choice([64, 65, 100]) + 1) if [0] * d not in nodes]
        return nodes, f"tree of {len(nodes)} nodes, depth ≤ {max_depth}, ranks < {max_rank}"
    if kind == 3:
        n = rng.choice([1, 2, 255, 256, 20_000])
        return [[0]] * n, f"{n} duplicate nodes"
    if kind == 4:
        return [[rng.randrange(0, 4) for _ in range(rng.randrange(2, 100))] for _ in range(rng.randrange(1, 50))], \
            "paths without their parents"
    if kind == 5:
        return [[0], [rng.choice([-1, 2**31, 2**31 - 1, 2**63, 10**30, 511, 512])]], "hostile rank"
    if kind == 6:
        bad = rng.choice([1.0, True, "0", None, [0], {}, math.nan, 0.5])
        return [[0], [bad]] if rng.random() < 0.5 else [[0], bad], f"wrong type {bad!r}"
    return rng.choice([[], [[]], "[[0]]", 7, None, {"0": [0]}, [[0], []], [(0,), (0, 0)]]), "not a tree"


# Chat templates -------------------------------------------------------------------------------------------------

def _big(rng: random.Random) -> str:
    return rng.choice([str(2 ** rng.randrange(10, 40)), str(10 ** rng.randrange(3, 12)), str(rng.randrange(1000, 10**9)),
                       "(10**9)", "(2**31)", "(2**62)", str(rng.randrange(2, 70))])


def _expr(rng: random.Random, depth: int = 0) -> str:
    """A string- or list-valued expression whose size may grow by a random factor at each level."""
    atom = rng.choice(["'x'", "'ab'", "messages[0].content", "'<|im_start|>'", "(bos_token or 'b')"])
    if depth >= 3 or rng.random() < 0.25:
        return atom
    inner = _expr(rng, depth + 1)
    return rng.choice([
        f"({inner} * {_big(rng)})", f"({inner} ~ {inner})", f"({inner} + {inner})", f"({inner}|center({_big(rng)}))",
        f"({inner}.replace('x', {inner}))", f"(([{inner}] * {_big(rng)})|join({inner}))", f"({inner}|indent({_big(rng)}))",
        f"('{{:>{_big(rng)}}}'.format({inner}))", f"({inner}|wordwrap(1))", f"(({inner})|list|join(' '))",
        f"({inner}|string * {rng.randrange(1, 5)})", f"({inner}|truncate({_big(rng)}))",
    ])


def _statement(rng: random.Random, depth: int = 0) -> str:
    kind = rng.randrange(9)
    if kind == 0:  # nested range loops of random sizes
        body = rng.choice(["", "x", "{{ loop.index }}", f"{{{{ {_expr(rng, 2)} }}}}"])
        for level in range(rng.randrange(1, 5)):
            body = f"{{% for i{level} in range({_big(rng)}) %}}{body}{{% endfor %}}"
        return body
    if kind == 1:  # a doubling / squaring loop
        op = rng.choice(["ns.v ~ ns.v", "ns.v + ns.v", "ns.v * 2", "ns.v * ns.v"])
        start = rng.choice(["'x'", "[1]", "3", "'ab'"])
        return (f"{{% set ns = namespace(v={start}) %}}{{% for i in range({rng.randrange(8, 70)}) %}}"
                f"{{% set ns.v = {op} %}}{{% endfor %}}{{{{ ns.v|length if ns.v is not number else ns.v }}}}")
    if kind == 2:  # powers
        return f"{{{{ {rng.randrange(2, 12)} ** {_big(rng)} }}}}" if rng.random() < 0.7 else \
            f"{{{{ ({_big(rng)} ** {rng.randrange(2, 40)}) ** {_big(rng)} }}}}"
    if kind == 3:  # a macro that calls itself (once or twice a level)
        calls = "{{ f(n + 1, s ~ s) }}" * rng.randrange(1, 3)
        stop = rng.choice(["", f"{{% if n > {rng.randrange(5, 200)} %}}{{{{ s|length }}}}{{% else %}}"])
        end = "{% endif %}" if stop else ""
        return f"{{% macro f(n, s) %}}{stop}{calls}{end}{{% endmacro %}}{{{{ f(0, 'x') }}}}"
    if kind == 4:  # a recursive loop
        return f"{{% for x in range({rng.randrange(2, 50)}) recursive %}}{{{{ loop(range({rng.randrange(2, 50)})) }}}}" \
               "{% endfor %}"
    if kind == 5:  # a huge output
        return f"{{% for i in range({_big(rng)}) %}}{{{{ {_expr(rng, 1)} }}}}{{% endfor %}}"
    if kind == 6:
        return f"{{{{ {_expr(rng)} }}}}"
    if kind == 7:  # benign
        return "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"
    return f"{{{{ range({_big(rng)})|list|length }}}}"


def template(rng: random.Random) -> str:
    """A random composition of hostile pieces (sometimes a benign one, sometimes cut into a syntax error)."""
    text = "".join(_statement(rng) for _ in range(rng.randrange(1, 4)))
    if rng.random() < 0.05:
        text = text[: rng.randrange(1, len(text) + 1)]
    return text


# Files ----------------------------------------------------------------------------------------------------------

#: What a user-named path may be instead of a small regular file.
FILE_KINDS = ["dev_zero", "fifo", "directory", "link_to_dev_zero", "link_to_fifo", "sparse_past_cap", "gzip_bomb",
              "bad_utf8", "missing", "deep_json", "junk"]


def hostile_file(rng: random.Random, path: Path, kind: str, cap: int, bomb_bytes: int, fixed_name: bool = False
                 ) -> Path:
    """Make `path` a hostile file of `kind` (FILE_KINDS) for a reader whose size cap is `cap` bytes; a gzip bomb
    decompresses to `bomb_bytes` (past the reader's cap, compressed ~1000:1). Returns the path to name: `path`, or
    /dev/zero itself (kind "dev_zero", unless the reader's file name is fixed: then `path` links to it)."""
    if kind == "dev_zero":
        if not fixed_name:
            return Path("/dev/zero")
        path.symlink_to("/dev/zero")
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
        (path / "inner.json").write_text("[1]")
    elif kind == "link_to_dev_zero":
        path.symlink_to("/dev/zero")
    elif kind == "link_to_fifo":
        fifo = path.with_name(path.name + ".fifo")
        os.mkfifo(fifo)
        path.symlink_to(fifo)
    elif kind == "sparse_past_cap":
        with open(path, "wb") as f:
            f.truncate(cap + rng.choice([1, 4096, cap]))
    elif kind == "gzip_bomb":
        line = rng.choice([b'{"prompt": "' + b"a" * 4096 + b'", "output_tokens": 4}\n', b"\0" * 65536, b"a" * 65536])
        with gzip.open(path, "wb", compresslevel=9) as f:
            for _ in range(bomb_bytes // len(line) + 1):
                f.write(line)
    elif kind == "bad_utf8":
        good = rng.choice([b'{"a": "', b'[1, 2, "', b"prompt: '", b'{"prompt": "'])
        path.write_bytes(good + bytes(rng.choice([0xFF, 0xC3, 0xED, 0x80, 0xF4]) for _ in range(rng.randrange(1, 9)))
                         + b'"}\n')
    elif kind == "deep_json":
        n = rng.choice([100, 10_000, 200_000])
        path.write_text("[" * n + "]" * n if rng.random() < 0.5 else '{"a":' * n + "1" + "}" * n)
    elif kind == "junk":
        path.write_bytes(rng.choice([b"", b"NaN", b"[1e999]", b"9" * 5000, b"\0\0\0", os.urandom(rng.randrange(1, 512)),
                                     b'{"prompt": 5}\n', b"[-1, 2]", b"- a\n- b\n", b"a: &x [*x]\n"]))
    elif kind != "missing":
        raise ValueError(kind)
    return path
