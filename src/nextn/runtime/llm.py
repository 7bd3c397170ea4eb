"""`LLM`: the public API, in the shape of TensorRT-LLM's LLM API (`LLM(...).generate(prompts, SamplingParams)`)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from nextn.config.llm_args import LlmArgs, load_llm_args_yaml, parse_llm_args
from nextn.runtime.engine import Engine, RequestError, default_speculative_config
from nextn.runtime.outputs import CompletionOutput, RequestOutput
from nextn.runtime.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
_UNSET: Any = object()

Prompt = str | list[int]


class LLM:
    """An engine ready to generate.

    Args:
        engine_dir: a directory written by `build-engine`.
        speculative_config: a dict or `MTPDecodingConfig` (TensorRT-LLM names, e.g.
            `{"decoding_type": "MTP", "num_nextn_predict_layers": 3}`); None = plain decoding; omitted = what the
            engine was built for.
        extra_llm_api_options: a YAML file of LLM arguments (keyword overrides win).
        device: "cpu" or "cuda"; default: CUDA when available.
        **overrides: other LLM arguments (`max_batch_size`, `max_seq_len`, `kv_cache_config`, ...).
    Raises:
        EngineError: not an engine directory; LlmArgsError: unknown/invalid argument (named).
    """

    def __init__(self, engine_dir: str | Path, speculative_config: Any = _UNSET,
                 extra_llm_api_options: str | Path | None = None, device: str | None = None, **overrides: Any) -> None:
        from nextn.build.manifest import EngineManifest

        data = load_llm_args_yaml(extra_llm_api_options) if extra_llm_api_options else {}
        if speculative_config is not _UNSET:
            sc = speculative_config.model_dump() if hasattr(speculative_config, "model_dump") else speculative_config
            overrides["speculative_config"] = sc
            data.pop("speculative_config", None)
        self.args: LlmArgs = parse_llm_args(data, **overrides)
        manifest = EngineManifest.load(engine_dir)
        spec_given = "speculative_config" in overrides or "speculative_config" in data
        spec = self.args.speculative_config if spec_given else default_speculative_config(manifest)
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.engine = Engine(engine_dir, self.args, spec, device)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    # Request-level API (in-flight batching driven by the caller: benchmarks, servers) ---------------------
    def add_request(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> int:
        """Validate and queue one request; it joins the running batch at the next `step()`.

        Returns:
            The request id (the `request_id` of its `RequestOutput`).
        Raises:
            RequestError: empty prompt, too long for max_seq_len or the KV cache, ids outside the vocabulary.
        """
        req = self.engine.make_request(prompt, sampling_params or SamplingParams())
        self.engine.add_request(req)
        return req.request_id

    def step(self) -> list[RequestOutput]:
        """Run one engine iteration (schedule → verify-and-draft → postprocess); the requests it finished."""
        return [req.to_output() for req in self.engine.step()]

    @property
    def has_unfinished_requests(self) -> bool:
        return self.engine.has_work

    def generate(self, prompts: Prompt | Sequence[Prompt], sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> RequestOutput | list[RequestOutput]:
        """Decode every prompt to completion with in-flight batching.

        Args:
            prompts: a string, a token-id list, or a list of either.
            sampling_params: one for all prompts, or one per prompt.
        Returns:
            One `RequestOutput` per prompt, in order (a single one for a single prompt). A prompt that cannot run
            (empty, too long, ids outside the vocabulary) gets finish_reason "error" with the reason in
            `.outputs[0].error`, and the others still run.
        """
        single = isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int))
        plist: list[Prompt] = [prompts] if single else list(prompts)  # type: ignore[list-item]
        params = sampling_params if sampling_params is not None else SamplingParams()
        plist_params = list(params) if isinstance(params, Sequence) else [params] * len(plist)
        if len(plist_params) != len(plist):
            raise ValueError(f"got {len(plist_params)} SamplingParams for {len(plist)} prompts")
        outputs: list[RequestOutput | None] = [None] * len(plist)
        pending = {}
        for i, (prompt, sp) in enumerate(zip(plist, plist_params)):
            try:
                pending[self.add_request(prompt, sp)] = i
            except RequestError as e:
                logger.warning("prompt %d rejected: %s", i, e)
                outputs[i] = RequestOutput(-1, prompt if isinstance(prompt, str) else None,
                                           [] if isinstance(prompt, str) else list(prompt),
                                           [CompletionOutput(finish_reason="error", error=str(e))], finished=True)
        bar = tqdm(total=len(pending), desc="generate", disable=not use_tqdm)
        while self.has_unfinished_requests:
            for out in self.step():
                outputs[pending[out.request_id]] = out
                bar.update(1)
        bar.close()
        return outputs[0] if single else outputs  # type: ignore[return-value]
