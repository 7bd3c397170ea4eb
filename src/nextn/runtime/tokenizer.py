"""The engine's tokenizer (the checkpoint's own files, loaded with `transformers`), its chat template and EOS ids.

An engine holds the tokenizer files its checkpoint had (a GGUF's are rebuilt at build time by
`nextn.build.gguf_tokenizer`), the chat template among them (chat_template.jinja, or `chat_template` in
tokenizer_config.json), and generation_config.json, whose `eos_token_id` (an id or a list, as in HF) lists the ids
that end generation besides the model config's.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nextn.runtime.template_render import (ChatTemplateError, ChatTemplateLimitError, RenderLimits,  # noqa: F401
                                           shared_renderer)

if TYPE_CHECKING:
    import threading

    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

GENERATION_CONFIG_NAME = "generation_config.json"

#: Names a chat template gets from nextn itself, which `template_kwargs` may not replace
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "add_generation_prompt", "tools"})
#: At most this many `template_kwargs` per render (vLLM's `chat_template_kwargs`: a few switches)
MAX_TEMPLATE_KWARGS = 32


def check_template_kwargs(template_kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """`template_kwargs` as a dict, checked: at most MAX_TEMPLATE_KWARGS names, each an identifier a template can
    read, none of RESERVED_TEMPLATE_KWARGS.

    Raises:
        ChatTemplateError: too many names, a name that is not an identifier, or a reserved one (the message says
            which)."""
    if not template_kwargs:
        return {}
    if len(template_kwargs) > MAX_TEMPLATE_KWARGS:
        raise ChatTemplateError(f"chat_template_kwargs has {len(template_kwargs)} names; at most "
                                f"{MAX_TEMPLATE_KWARGS} are accepted")
    for name in template_kwargs:
        if not isinstance(name, str) or not name.isidentifier():
            raise ChatTemplateError(f"chat_template_kwargs: {name!r} is not a name a template can read")
        if name in RESERVED_TEMPLATE_KWARGS:
            raise ChatTemplateError(f"chat_template_kwargs: {name!r} is set by nextn itself"
                                    + (" (send tools in the request's `tools`)" if name == "tools" else ""))
    return dict(template_kwargs)


class EngineTokenizer:
    """encode (with the tokenizer's BOS convention), decode (special tokens skipped) and chat-template rendering."""

    def __init__(self, tok: "PreTrainedTokenizerBase") -> None:
        self.tok = tok

    @classmethod
    def load(cls, engine_dir: Path, files: list[str]) -> "EngineTokenizer | None":
        """The tokenizer saved in `engine_dir`, or None when the engine has none (token-id prompts only)."""
        from transformers import AutoTokenizer  # deferred: the CLI imports this module for its error type

        if not files:
            return None
        return cls(AutoTokenizer.from_pretrained(str(engine_dir), trust_remote_code=False))  # never run repo code

    @property
    def chat_template(self) -> str | None:
        """The model's chat template (Jinja source), None when the engine has none."""
        return getattr(self.tok, "chat_template", None) or None

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text))

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def render_chat(self, messages: Sequence[dict], chat_template: str | None = None, *,
                    limits: RenderLimits | None = None, cancel: "threading.Event | None" = None,
                    tools: Sequence[dict] | None = None, template_kwargs: Mapping[str, Any] | None = None) -> str:
        """`messages` rendered as text for the assistant's next turn, in a bounded worker process.

        Equal to `transformers`' `tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)`
        (keys whose value is None dropped, the special tokens passed to the template).
        Args:
            messages: `{"role": ..., "content": ...}` dicts, in order.
            chat_template: Jinja source (or a template name of the model's) to use instead of the model's default.
            limits: the render's time and size budget (default `RenderLimits()`: 5 s, 16 Mi characters).
            cancel: set it to stop the render (`RenderCancelled`).
            tools: OpenAI-style function definitions ({"type": "function", "function": {...}}) handed to the
                template as `tools`, as transformers' `apply_chat_template(tools=...)` does.
            template_kwargs: more names for the template, as transformers' `apply_chat_template(**kwargs)` and vLLM's
                `chat_template_kwargs` pass them (Qwen3's `{"enable_thinking": false}`); `check_template_kwargs`.
        Raises:
            ChatTemplateError: no messages, no template, the template raised (the message quotes it), or
                `template_kwargs` that `check_template_kwargs` refuses.
            ChatTemplateLimitError: the template passed the time, size or memory budget and was stopped.
        """
        if not messages:
            raise ChatTemplateError("no messages to render: give at least one")
        extra = check_template_kwargs(template_kwargs)
        if chat_template is None and self.chat_template is None:
            raise ChatTemplateError("this engine's tokenizer has no chat template (its checkpoint had none): send "
                                    "plain prompts")
        try:
            template = self.tok.get_chat_template(chat_template)
        except ValueError as e:  # several named templates and no default
            raise ChatTemplateError(str(e)) from None
        # None values dropped, except an assistant's content beside its tool calls (templates test it for none)
        conversation = [{k: v for k, v in m.items() if v is not None or (k == "content" and m.get("tool_calls"))}
                        for m in messages]
        kwargs = dict(self.tok.special_tokens_map) | extra | ({"tools": list(tools)} if tools else {})
        return shared_renderer().render(template, conversation, kwargs, add_generation_prompt=True, limits=limits,
                                        cancel=cancel)

    def apply_chat_template(self, messages: Sequence[dict], chat_template: str | None = None,
                            template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
        """Token ids of `messages` rendered for the assistant's next turn (`render_chat`, default budget).

        Equal to `transformers`' `tokenizer.apply_chat_template(messages, add_generation_prompt=True)`: the template
        writes its own special tokens (BOS included), so the text is encoded without adding any.
        Args:
            messages: `{"role": ..., "content": ...}` dicts, in order.
            chat_template: Jinja source to use instead of the model's (e.g. a server's fallback).
            template_kwargs: more names for the template (`render_chat`).
        Raises:
            ChatTemplateError: neither `chat_template` nor the model has a template, or the template raised (e.g. a
                role order it does not accept; the message quotes it).
            ChatTemplateLimitError: the template passed its time, size or memory budget and was stopped.
        """
        text = self.render_chat(messages, chat_template, template_kwargs=template_kwargs)
        return list(self.tok.encode(text, add_special_tokens=False))


#: Rendered once at build time with every template the tokenizer has (`check_chat_template`).
SAMPLE_CONVERSATIONS = (
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "Hi."},
     {"role": "assistant", "content": "Hello! How can I help?"}, {"role": "user", "content": "Tell me a story."}],
)


def check_chat_template(tok: "PreTrainedTokenizerBase", source: str, limits: RenderLimits | None = None) -> None:
    """Render the sample conversations with each of `tok`'s chat templates under `limits` (the default budget).

    A template that raises on a sample (e.g. one that refuses a system message) is accepted: only a render that
    passes the budget is refused, since it would pass it on every request too.
    Args:
        tok: a `transformers` tokenizer; nothing happens when it has no chat template.
        source: where the template came from, for the message (e.g. "model.gguf (tokenizer.chat_template)").
    Raises:
        ChatTemplateLimitError: a sample render passed the time, size or memory budget (names `source`).
    """
    _check_templates(getattr(tok, "chat_template", None), dict(tok.special_tokens_map), source, limits)


def check_saved_chat_template(tokenizer_dir: str | Path, files: list[str]) -> None:
    """`check_chat_template` on the template saved in `tokenizer_dir` (an HF checkpoint: chat_template.jinja, else
    tokenizer_config.json's `chat_template`, a string or a list of named ones), read without loading the tokenizer;
    the special tokens are tokenizer_config.json's `*_token` strings. Only `files` are read.

    Raises:
        ChatTemplateLimitError: as `check_chat_template`, naming the file.
    """
    root = Path(tokenizer_dir)
    config: dict = {}
    if "tokenizer_config.json" in files:
        try:
            loaded = json.loads((root / "tokenizer_config.json").read_text(encoding="utf-8"))
            config = loaded if isinstance(loaded, dict) else {}
        except (OSError, ValueError):
            config = {}  # the tokenizer's own loading reports a bad file
    templates: object
    source: str | Path
    if "chat_template.jinja" in files:
        templates, source = (root / "chat_template.jinja").read_text(encoding="utf-8"), root / "chat_template.jinja"
    else:
        templates, source = config.get("chat_template"), f"{root / 'tokenizer_config.json'} (chat_template)"
        if isinstance(templates, list):
            templates = {t.get("name"): t.get("template") for t in templates if isinstance(t, dict)}
    specials = {k: v.get("content") if isinstance(v, dict) else v for k, v in config.items()
                if k.endswith("_token") and isinstance(v, (str, dict))}
    _check_templates(templates, {k: v for k, v in specials.items() if isinstance(v, str)}, str(source), None)


def check_template_source(templates: str | dict | None, special_tokens: dict, source: str,
                          limits: RenderLimits | None = None) -> None:
    """`check_chat_template` on a template's source (a string, or a dict of named ones) and the special-token
    strings it may read (`{"bos_token": "<s>", ...}`), without a tokenizer (e.g. a GGUF's metadata).

    Raises:
        ChatTemplateLimitError: as `check_chat_template`.
    """
    _check_templates(templates, special_tokens, source, limits)


def _check_templates(templates: str | dict | None, special_tokens: dict, source: str,
                     limits: RenderLimits | None) -> None:
    named = templates.items() if isinstance(templates, dict) else [("default", templates)]
    for name, template in named:
        if not isinstance(template, str) or not template:
            continue
        for messages in SAMPLE_CONVERSATIONS:
            try:
                shared_renderer().render(template, messages, special_tokens, limits=limits)
            except ChatTemplateLimitError as e:
                which = "" if name == "default" else f" {name!r}"
                raise ChatTemplateLimitError(f"{source}: the chat template{which} cannot be used: rendering a "
                                             f"{len(messages)}-message sample conversation failed: {e}. Fix or remove the template") from None
            except ChatTemplateError:
                continue


def eos_token_ids(engine_dir: Path, config_eos: int | list[int] | None) -> frozenset[int]:
    """The ids that end generation: the model config's `eos_token_id` and generation_config.json's, if present.

    HF's `generate` stops at generation_config.json's `eos_token_id` (an int or a list; e.g. Qwen2.5's
    [151645, 151643], `<|im_end|>` and `<|endoftext|>`); the union with the config's keeps engines built before the file
    was written stopping where they did. An unreadable file is logged and ignored.
    """
    ids = set(_as_ids(config_eos))
    path = Path(engine_dir) / GENERATION_CONFIG_NAME
    if path.is_file():
        try:
            ids.update(_as_ids(json.loads(path.read_text()).get("eos_token_id")))
        except (ValueError, AttributeError, TypeError) as e:
            logger.warning("%s is not a readable generation config (%s): EOS ids from the model config only", path, e)
    return frozenset(ids)


def _as_ids(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [int(value)] if isinstance(value, int) else [int(v) for v in value]
