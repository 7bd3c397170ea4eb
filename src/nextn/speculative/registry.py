"""The speculative methods by `decoding_type`: what each one builds, and which config class it reads.

A method is one module with a `build(spec, ctx)` function and a `METHOD` record (method.py), one config class
(TensorRT-LLM's name where it has one) and one `register` call: `build` returns the drafter and the acceptance rule the engine runs (protocol.py), chosen
once at load time. `default_config` is what an engine built for a method decodes with when the user names none.
Nothing else in nextn names a method: the engine, the prefix cache, disaggregated serving and the benchmarks read
the drafter's protocol attributes.

    from nextn.speculative import registry
    registry.register(registry.Method("MyDraft", MyDraftConfig, build=my_build))
    LLM(engine, speculative_config={"decoding_type": "MyDraft", ...})
"""

from __future__ import annotations

from dataclasses import replace

from pydantic import BaseModel
from torch import nn

from nextn.build.manifest import EngineManifest
from nextn.config.llm_args import LlmArgsError, register_decoding_config
from nextn.speculative import draft_model, gemma4_assistant, medusa, mtp, ngram, suffix
from nextn.speculative.acceptance_rules import StandardAcceptance
from nextn.speculative.chain_step import NoDrafter
from nextn.speculative.method import LoadContext, Method
from nextn.speculative.protocol import AcceptanceRule, Drafter

__all__ = ["METHODS", "LoadContext", "Method", "build", "default_config", "prepare_model", "register"]


METHODS: dict[str, Method] = {}


def register(method: Method) -> Method:
    """Add a method (and its config class to what `speculative_config` accepts).

    Raises:
        ValueError: its decoding_type is taken by another method, or its config's `decoding_type` default differs.
    """
    if METHODS.get(method.decoding_type, method) is not method:
        raise ValueError(f"decoding_type {method.decoding_type!r} is already registered")
    default = method.config.model_fields["decoding_type"].default if "decoding_type" in method.config.model_fields \
        else None
    if default != method.decoding_type:
        raise ValueError(f"{method.config.__name__}.decoding_type defaults to {default!r}, not "
                         f"{method.decoding_type!r}")
    register_decoding_config(method.config)
    METHODS[method.decoding_type] = method
    return method


def build(spec: BaseModel | None, ctx: LoadContext) -> tuple[Drafter, AcceptanceRule]:
    """The drafter and acceptance rule for `spec` (None: plain decoding) on the engine of `ctx`.

    Raises:
        LlmArgsError: an unregistered decoding_type, or one this engine cannot run (the method's own checks).
    """
    if spec is None:
        return NoDrafter(), StandardAcceptance()
    method = METHODS.get(str(getattr(spec, "decoding_type", None)))
    if method is None:
        raise LlmArgsError(f"speculative_config.decoding_type {getattr(spec, 'decoding_type', None)!r} is not one "
                           f"of {', '.join(METHODS)}")
    return method.build(spec, _with_registry(ctx))


def _with_registry(ctx: LoadContext) -> LoadContext:
    """`ctx` with the registry's build / prepare_model for the configs a combining method wraps."""
    return replace(ctx, build_method=lambda inner: build(inner, ctx),
                   prepare_method=lambda model, inner: prepare_model(model, inner, ctx))


def prepare_model(model: nn.Module, spec: BaseModel | None, ctx: LoadContext) -> None:
    """The method's changes to the loaded target model (`Method.prepare_model`), if it has any; nothing for plain
    decoding.

    Raises:
        LlmArgsError: a config the loaded model cannot run (the method's own checks).
    """
    method = None if spec is None else METHODS.get(str(getattr(spec, "decoding_type", None)))
    if method is not None and method.prepare_model is not None:
        method.prepare_model(model, spec, _with_registry(ctx))


def default_config(manifest: EngineManifest) -> BaseModel | None:
    """What the engine was built for (its MTP modules, Medusa heads, or the build YAML's speculative_config of a
    method that needs no weights), or None."""
    for method in METHODS.values():
        if method.built_for is not None and (spec := method.built_for(manifest)) is not None:
            return spec
    return None


# the built-in methods, each its module's METHOD
for _module in (mtp, medusa, ngram, draft_model, suffix, gemma4_assistant):
    register(_module.METHOD)
