"""A chat-template render worker: a child process that renders Jinja chat templates under a memory cap.

Run as a script (`python -P template_worker.py MEMORY_BYTES`) by `nextn.runtime.template_render`, never imported by
the parent for its rendering: it imports only jinja2, `transformers.utils.chat_template_utils` and nextn's
`runtime/worker_frames.py` (not torch), lowers its own CPU priority (nice 10, so a spinning template yields to the
engine), caps its address space at what the imports took plus MEMORY_BYTES (`RLIMIT_AS`), then answers render
requests one at a time on stdin/stdout.

Rendering is transformers' own `render_jinja_template` (the sandbox, filters and globals of `apply_chat_template`,
so the text is identical to `tokenizer.apply_chat_template(..., tokenize=False)`), with two cheap bounds added to
the compiled template (a recompile in transformers' environment): the `*`, `+` and `**` operators refuse results
over the character cap (strings, lists) or 65,536 bits (ints) before computing them, and the output is counted as
it is produced and stopped at the cap. Everything else (a loop that never ends, memory blown by other means) is the
parent's to stop: it kills this process at the wall-clock budget or on cancel.

Frames, both ways: an 8-byte big-endian length, then that many bytes of UTF-8 JSON (no pickle: the parent never
unpickles what a template produced). The worker first sends `{"ready": true}`; then per request
`{"template", "messages", "kwargs", "add_generation_prompt", "max_chars"}` it answers `{"text"}` or
`{"error", "kind"}` with kind "template" (the template raised), "size" (a cap was hit) or "memory" (MemoryError:
the worker then exits, so the parent starts a fresh one). It exits at end of input, or when its parent dies.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

from nextn.runtime.worker_frames import become_worker, read_frame, write_frame

MAX_INT_BITS = 1 << 16  # an int result beyond 65,536 bits (19,729 digits) is no chat-template arithmetic


class TemplateTooLarge(Exception):
    """A string, list, int or the output would pass the render's cap."""


class _Caps:
    max_chars = 1 << 24  # set per request; the worker renders one template at a time


def _check_binop(operator: str, left: Any, right: Any) -> None:
    if operator == "*":
        for seq, n in ((left, right), (right, left)):
            if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > _Caps.max_chars:
                raise TemplateTooLarge(f"{type(seq).__name__} of {len(seq)} × {n} would exceed the cap of "
                                       f"{_Caps.max_chars} characters/items")
        if isinstance(left, int) and isinstance(right, int) and left.bit_length() + right.bit_length() > MAX_INT_BITS:
            raise TemplateTooLarge(f"an integer product over {MAX_INT_BITS} bits")
    elif operator == "+":
        if isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)) \
                and len(left) + len(right) > _Caps.max_chars:
            raise TemplateTooLarge(f"a concatenation of {len(left)} + {len(right)} would exceed the cap of "
                                   f"{_Caps.max_chars} characters/items")
    elif operator == "**":
        if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and \
                right * max(abs(left).bit_length() - 1, 1) > MAX_INT_BITS:
            raise TemplateTooLarge(f"{left} ** {right} is over {MAX_INT_BITS} bits")


def _bounded_compile(source: str):
    """`source` compiled in transformers' chat-template environment, with the operator and output bounds."""
    import jinja2
    from transformers.utils import chat_template_utils

    class BoundedTemplate(jinja2.Template):
        def render(self, *args: Any, **kwargs: Any) -> str:  # jinja2.Template.render, the output counted
            ctx = self.new_context(dict(*args, **kwargs))
            try:
                pieces, size = [], 0
                for piece in self.root_render_func(ctx):
                    size += len(piece)
                    if size > _Caps.max_chars:
                        raise TemplateTooLarge(f"the output passed the cap of {_Caps.max_chars} characters")
                    pieces.append(piece)
                return "".join(pieces)
            except Exception:
                self.environment.handle_exception()

    def call_binop(context, operator, left, right):
        _check_binop(operator, left, right)
        return env.binop_table[operator](left, right)

    # transformers' environment, from an empty template: compiling `source` there would constant-fold (run) its
    # operators unbounded
    env = chat_template_utils._cached_compile_jinja_template("").environment.overlay()
    env.intercepted_binops = frozenset({"*", "+", "**"})
    env.call_binop = call_binop
    env.template_class = BoundedTemplate
    template = env.from_string(source)
    # `a ~ b` (jinja's Concat) is not a binop the sandbox intercepts: the compiled code joins through the module's
    # str_join / markup_join, which are bounded here like `+`
    names = template.root_render_func.__globals__
    for name in ("str_join", "markup_join"):
        if name in names:
            names[name] = _bounded_join(names[name])
    return template


def _bounded_join(join):
    """`join` (jinja's str_join / markup_join over an iterable) refusing a result past the cap."""

    def bounded(seq):
        parts = list(seq)
        size = sum(len(p) for p in parts if isinstance(p, str))
        if size > _Caps.max_chars:
            raise TemplateTooLarge(f"a concatenation of {size} characters would exceed the cap of "
                                   f"{_Caps.max_chars} characters")
        return join(parts)

    return bounded


def _render(request: dict) -> dict:
    from transformers.utils import chat_template_utils

    _Caps.max_chars = int(request["max_chars"])
    # render_jinja_template's own preparation of the data (plain JSON types, reasoning aliases), then the template
    # compiled by _bounded_compile (this process renders nothing else, so the module's compile hook is ours).
    chat_template_utils._compile_jinja_template = _compiled
    try:
        rendered, _ = chat_template_utils.render_jinja_template(
            conversations=[request["messages"]], chat_template=request["template"],
            add_generation_prompt=bool(request["add_generation_prompt"]), **request["kwargs"])
    except TemplateTooLarge as e:
        return {"error": str(e), "kind": "size"}
    except MemoryError:
        return {"error": "the render ran out of its memory cap", "kind": "memory"}
    except RecursionError:
        return {"error": "the template recursed too deeply", "kind": "template"}
    except Exception as e:  # jinja's TemplateError, raise_exception() in the template, a TypeError of its own
        return {"error": f"{type(e).__name__}: {e}", "kind": "template"}
    return {"text": rendered[0]}


_compiled = functools.lru_cache(maxsize=8)(_bounded_compile)


def main(argv: list[str]) -> int:
    import transformers.utils.chat_template_utils  # noqa: F401  (the imports, before the cap)

    become_worker(int(argv[1]) if len(argv) > 1 else 1 << 30)
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # stray prints must not corrupt the frames
    write_frame(out, {"ready": True})
    while True:
        request = read_frame(inp, 1 << 31)
        if request is None:
            return 0
        reply = _render(request)
        try:
            write_frame(out, reply)
        except MemoryError:
            write_frame(out, {"error": "the rendered text ran out of the memory cap", "kind": "memory"})
        if reply.get("kind") == "memory":
            return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
