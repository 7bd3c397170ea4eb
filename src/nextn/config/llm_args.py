"""Typed LLM arguments with TensorRT-LLM's field names (`extra_llm_api_options` YAML; TensorRT-LLM llm_args.py).

Unknown keys and wrong types are errors naming the key and listing the valid ones. `speculative_config` is a
union on `decoding_type`; `null` means plain decoding. Floats must be finite and ints within ±2**31 (a bigger
size is never meant and would only fail later, deep in an allocation); the sizes are checked against the model
and the memory there is when the engine loads (runtime/engine_sizes.py). The YAML file must be a regular UTF-8
file of at most 1 MiB, nested at most 32 deep.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import yaml
from pydantic import AliasChoices, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from nextn.config.user_files import read_user_text


class LlmArgsError(ValueError):
    """Invalid LLM arguments (YAML or keyword overrides); the message names the key and the valid ones."""


MAX_INT = 2**31 - 1  # every int argument: sizes, counts, token ids
MAX_BATCH_SIZE = 1 << 16  # concurrent requests: per-request slots and state are allocated for each at load
MAX_YAML_BYTES = 1 << 20
MAX_NESTING = 32
MAX_TREE_DRAFT_TOKENS = 255  # draft nodes of one tree, dynamic or static (eagle_choices, medusa_choices)
MAX_TREE_DEPTH = 64  # ranks in one path of a static tree
TreePaths = Annotated[list[Annotated[list[int], Field(min_length=1, max_length=MAX_TREE_DEPTH)]],
                      Field(min_length=1, max_length=MAX_TREE_DRAFT_TOKENS)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @model_validator(mode="after")
    def _ints_bounded(self):
        for name, value in self.__dict__.items():
            bad = _out_of_range_int(value)
            if bad is not None:
                raise ValueError(f"{name}: {bad} is out of range (ints must be within ±{MAX_INT})")
        return self


def _out_of_range_int(value: Any, depth: int = 0) -> int | None:
    """The first int (bool excluded) outside ±MAX_INT in a value, its lists and dicts (keys too), else None."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value if abs(value) > MAX_INT else None
    if depth < MAX_NESTING and isinstance(value, (list, tuple, dict)):
        items = [*value.keys(), *value.values()] if isinstance(value, dict) else value
        for item in items:
            bad = _out_of_range_int(item, depth + 1)
            if bad is not None:
                return bad
    return None


def check_nesting(data: Any, what: str) -> None:
    """Refuse data nested deeper than MAX_NESTING or with more than 100,000 nodes (YAML aliases can make a small
    file a huge tree), iteratively, before pydantic recurses into it.

    Raises:
        LlmArgsError: naming `what` and the limit.
    """
    stack, nodes = [(data, 0)], 0
    while stack:
        value, depth = stack.pop()
        nodes += 1
        if depth > MAX_NESTING:
            raise LlmArgsError(f"{what} is nested more than {MAX_NESTING} levels deep: LLM arguments are a few levels "
                               "of mappings; check the file")
        if nodes > 100_000:
            raise LlmArgsError(f"{what} holds more than 100000 values (YAML aliases expanding?): LLM arguments are a "
                               "few dozen values; check the file")
        if isinstance(value, dict):
            stack.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, (list, tuple)):
            stack.extend((v, depth + 1) for v in value)


def expand_path(value: str, key: str) -> Path:
    """`value` as a path with `~` / `~user` expanded, for the LLM-argument `key` that holds it.

    Raises:
        LlmArgsError (a ValueError, so a validation error of the config naming `key`): a NUL byte (no path holds
            one), or a `~user` that names no user on this machine (or `~` without a home directory).
    """
    if "\0" in value:
        raise LlmArgsError(f"{key} {value!r} holds a NUL byte, which no path can hold: give a directory path")
    try:
        return Path(value).expanduser()
    except RuntimeError:  # pathlib: "Could not determine home directory."
        raise LlmArgsError(f"{key} {value!r}: {value.split('/')[0]} names no user's home directory on this "
                           "machine: give an absolute path, or one relative to the working directory (in a YAML "
                           "file: to its folder)") from None


class DecodingBaseConfig(_Strict):
    """Fields every linear-draft speculative config shares (TensorRT-LLM `DecodingBaseConfig`): the draft-length
    policy (speculative/draft_len_policy.py). A batch of B requests verifies the draft length of the smallest
    threshold ≥ B; above the largest threshold speculation is off."""

    draft_len_schedule: dict[int, int] | None = None
    max_concurrency: int | None = Field(default=None, gt=0)  # more requests in a batch: speculation off
    acceptance_rate_window_size: int | None = Field(default=None, ge=0)  # N speculation-enabled iterations ...
    acceptance_rate_threshold: float | None = Field(default=None, ge=0.0, le=1.0)  # ... below this DAR: off for good
    # nextn's own: each step's draft length from recent acceptance and measured step times (0 when none pays)
    adaptive_draft_len: bool = False
    # With adaptive_draft_len: "auto" reads the step times from a profile of this engine on this machine, measured at
    # the first load (seconds; runtime/step_profiler.py) and cached in step_profile_dir; "off" measures them online.
    step_profile: Literal["auto", "off"] = "off"
    step_profile_dir: str | None = Field(default=None, max_length=4096)  # null: ~/.cache/nextn/step_profiles

    @field_validator("step_profile_dir")
    @classmethod
    def _a_usable_path(cls, value: str | None) -> str | None:
        if value:
            expand_path(value, "step_profile_dir")
        return value


class MTPDecodingConfig(DecodingBaseConfig):
    """DeepSeek MTP speculative decoding (TensorRT-LLM `MTPDecodingConfig`)."""

    decoding_type: Literal["MTP"] = "MTP"
    num_nextn_predict_layers: int = Field(default=1, ge=1, le=16)  # K: draft tokens per step
    use_mtp_vanilla: bool = False  # K distinct modules with their own KV; forced on for K-module checkpoints
    mtp_eagle_one_model: bool = True  # accepted for compatibility; nextn always runs one fused step
    use_relaxed_acceptance_for_thinking: bool = False  # relaxed acceptance inside <think>…</think> (issue 5)
    relaxed_topk: int = Field(default=1, ge=1)
    relaxed_delta: float = Field(default=0.0, ge=0.0, le=1.0)  # a probability gap (speculative/acceptance_reference.py)
    begin_thinking_phase_token: int = 128798  # <think> in the DeepSeek-V3/R1 vocabulary
    end_thinking_phase_token: int = 128799  # </think>
    # Tree drafting (MTP Eagle; speculative/mtp_tree.py, peer names in docs/ARCHITECTURE.md). A static tree: paths
    # of top-k ranks over the module's successive drafts, depth ≤ K (TensorRT-LLM's `eagle_choices`).
    eagle_choices: TreePaths | None = None
    # A dynamic tree (EAGLE-2): each depth expands the `dynamic_tree_max_topK` best nodes by cumulative draft
    # probability into their top-k children, then the best `max_total_draft_tokens` nodes are verified.
    use_dynamic_tree: bool = False
    dynamic_tree_max_topK: int = Field(default=4, ge=1, le=16)  # SGLang's speculative_eagle_topk
    max_total_draft_tokens: int | None = Field(default=None, ge=1, le=MAX_TREE_DRAFT_TOKENS)  # draft nodes, root excluded; null: 15
    # The module's lm_head cut to its hot tokens, as Draft_Target's (speculative/draft_vocab.py): fewer bytes a draft.
    draft_vocab_size: int | None = Field(default=None, ge=1)
    draft_token_map: str | None = None

    @model_validator(mode="after")
    def _one_tree(self):
        if self.eagle_choices is not None and self.use_dynamic_tree:
            raise ValueError("eagle_choices (a static tree) and use_dynamic_tree are exclusive: give one")
        if (self.eagle_choices is not None or self.use_dynamic_tree) and (
                self.use_mtp_vanilla or self.use_relaxed_acceptance_for_thinking):
            raise ValueError("MTP tree drafting runs MTP Eagle with lossless acceptance: use_mtp_vanilla and "
                             "use_relaxed_acceptance_for_thinking must stay false with eagle_choices / use_dynamic_tree")
        return self


class MedusaDecodingConfig(_Strict):
    """Medusa heads with tree verification (TensorRT-LLM `MedusaDecodingConfig`)."""

    decoding_type: Literal["Medusa"] = "Medusa"
    num_medusa_heads: int | None = Field(default=None, ge=1)  # null: every head the engine holds
    # The tree: a list of top-k rank paths, or the name of a published tree (read from medusa_choices.json,
    # located by $NEXTN_MEDUSA_CHOICES or ../shared/data/); default: Medusa's mc_sim_7b_63.
    medusa_choices: TreePaths | str = Field(default="mc_sim_7b_63", max_length=256)
    posterior_threshold: float = Field(default=0.09, gt=0)  # typical acceptance ε (sampling requests)
    posterior_alpha: float = Field(default=0.3, gt=0)  # typical acceptance δ


class NGramDecodingConfig(DecodingBaseConfig):
    """N-gram (prompt lookup) drafting: drafts copied from the longest earlier match of the last n tokens in the
    request's own prompt and output — no draft model (TensorRT-LLM `NGramDecodingConfig`; Saxena 2023, "Prompt
    Lookup Decoding"; speculative/ngram.py). Works on any engine."""

    decoding_type: Literal["NGram"] = "NGram"
    max_draft_len: int = Field(ge=1, le=64)  # K: draft tokens per step (required, as in TensorRT-LLM)
    max_matching_ngram_size: int = Field(default=2, ge=1, le=64)  # longest n-gram matched (tried down to 1)
    is_keep_all: bool = True  # every earlier occurrence is a candidate (nextn always searches them all)
    is_use_oldest: bool = True  # the earliest occurrence of the matched n-gram; false: the latest
    is_public_pool: bool = True  # accepted; nextn searches each request's own tokens only (logged)


class DraftTargetDecodingConfig(DecodingBaseConfig):
    """Draft-target speculative decoding: a separate small draft model with the target's vocabulary proposes the
    drafts, sampled from its own distribution q and verified by rejection sampling (TensorRT-LLM
    `DraftTargetDecodingConfig`; Leviathan et al. 2023; speculative/draft_model.py)."""

    decoding_type: Literal["Draft_Target"] = "Draft_Target"
    max_draft_len: int = Field(ge=1, le=64)  # K: draft tokens per step (required, as in TensorRT-LLM)
    # The draft model: an engine directory or anything LLM(path) accepts (HF checkpoint, .gguf), built once into
    # the engine cache. TensorRT-LLM's field is `speculative_model`, with `speculative_model_dir` as its alias.
    speculative_model_dir: str = Field(validation_alias=AliasChoices("speculative_model_dir", "speculative_model"))
    # Keep only this many rows (the most frequent tokens) in the draft model's lm_head, fewer bytes a draft token;
    # lossless (the target verifies). EAGLE-3's name in vLLM / TensorRT-LLM; FR-Spec (speculative/draft_vocab.py).
    draft_vocab_size: int | None = Field(default=None, ge=1)
    # Which tokens are hot: a JSON list of token ids, most frequent first (`nextn token-map`; SGLang's
    # `speculative_token_map`); without it, the lowest ids (a BPE vocabulary's merge order).
    draft_token_map: str | None = None


class Gemma4AssistantDecodingConfig(DecodingBaseConfig):
    """Gemma 4's assistant drafter: the small `Gemma4AssistantForCausalLM` checkpoint shipped beside a Gemma 4 model
    drafts from the target's last hidden state over the target's own KV cache (HF's assisted generation with
    `assistant_model`; llama.cpp's `--spec-type draft-mtp` with a gemma4-assistant model;
    speculative/gemma4_assistant.py). Deterministic drafts: the output is plain decoding's."""

    decoding_type: Literal["Gemma4Assistant"] = "Gemma4Assistant"
    max_draft_len: int = Field(ge=1, le=64)  # K: draft tokens per step (each one assistant forward of one row)
    # The assistant's HF checkpoint directory (config.json with model_type gemma4_assistant, safetensors) or, through
    # LLM, the GGUF llama.cpp's converter writes of it (gemma4-assistant): read as it is, in the target's dtype (it is
    # small). `speculative_model` is accepted as an alias.
    speculative_model_dir: str = Field(validation_alias=AliasChoices("speculative_model_dir", "speculative_model"))


class SuffixDecodingConfig(DecodingBaseConfig):
    """Suffix decoding: drafts from suffix trees over the request's own prompt and output and over earlier
    requests' outputs — no draft model (Oliaro et al. 2025, arXiv 2411.04975; vLLM's `method: suffix`, whose
    option names these are; speculative/suffix.py). Drafts on the host: CPU engines."""

    decoding_type: Literal["Suffix"] = "Suffix"
    max_draft_len: int = Field(ge=1, le=64)  # K: the most draft tokens verified per step (required, as NGram's)
    suffix_decoding_max_tree_depth: int = Field(default=24, ge=1, le=64)  # D: longest context suffix matched
    # earlier requests' outputs kept in the global tree, the oldest evicted first; 0: no global tree
    suffix_decoding_max_cached_requests: int = Field(default=1000, ge=0, le=1_000_000)
    # a match of m tokens drafts at most max_spec_factor * m tokens (short matches speculate little)
    suffix_decoding_max_spec_factor: float = Field(default=1.0, gt=0.0, le=64.0)
    # drafting stops where the path's estimated probability (product of child/parent counts) falls below this
    suffix_decoding_min_token_prob: float = Field(default=0.1, ge=0.0, le=1.0)
    # Combined drafting (Arctic Inference's "Arctic + Suffix"; TensorRT-LLM's suffix automaton beside MTP/Eagle):
    # a chain drafter with its own model (Draft_Target, or MTP as a chain) drafts where the suffix trees expect
    # fewer than `suffix_decoding_min_score` accepted drafts; decided per request per step
    # (speculative/suffix_combined.py). Its max_draft_len must not exceed this config's.
    combine_with: Annotated[Union[MTPDecodingConfig, DraftTargetDecodingConfig],
                            Field(discriminator="decoding_type")] | None = None
    # a suffix proposal drafts for its request when its score (expected accepted drafts) reaches this; None: the
    # combined drafter's max_draft_len (the most it could give)
    suffix_decoding_min_score: float | None = Field(default=None, ge=0.0, le=64.0)

    @model_validator(mode="after")
    def _combined_fits(self):
        inner = self.combine_with
        k = getattr(inner, "max_draft_len", None) or getattr(inner, "num_nextn_predict_layers", 0)
        if inner is not None and k > self.max_draft_len:
            raise ValueError(f"combine_with's draft length {k} exceeds the suffix drafter's "
                             f"max_draft_len {self.max_draft_len}: the combined step verifies at most that many")
        if inner is not None and (getattr(inner, "use_dynamic_tree", False)
                                  or getattr(inner, "eagle_choices", None) is not None):
            raise ValueError("combine_with: MTP drafts a tree here (use_dynamic_tree / eagle_choices); combined "
                             "drafting takes a chain drafter")
        return self


SpeculativeConfig = Annotated[Union[MTPDecodingConfig, MedusaDecodingConfig, NGramDecodingConfig,
                                    DraftTargetDecodingConfig, SuffixDecodingConfig, Gemma4AssistantDecodingConfig],
                              Field(discriminator="decoding_type")]


class KvCacheConfig(_Strict):
    """Paged KV cache sizing (TensorRT-LLM `KvCacheConfig`)."""

    tokens_per_block: int = Field(default=32, gt=0)  # tokens per KV block
    max_tokens: int | None = Field(default=None, gt=0)  # cache capacity in tokens; null: max_batch_size·max_seq_len
    free_gpu_memory_fraction: float = Field(default=0.9, gt=0, le=1)  # used on CUDA when max_tokens is null
    enable_block_reuse: bool = True  # prefix caching: full KV blocks reused across requests (runtime/prefix_cache.py)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"


class CudaGraphConfig(_Strict):
    """CUDA graph capture (TensorRT-LLM `CudaGraphConfig`); `null` disables graphs."""

    batch_sizes: list[int] | None = None  # explicit capture sizes; null: derived from max_batch_size
    max_batch_size: int = Field(default=0, ge=0)  # 0 → 128
    enable_padding: bool = False  # pad a batch up to the next captured size


class TorchCompileConfig(_Strict):
    """`torch.compile` of the decode step (TensorRT-LLM `TorchCompileConfig`, the fields that apply here).

    nextn has no fusion backend of its own, so `enable_inductor` defaults to true (TensorRT-LLM: false, its own
    backend); false selects dynamo's `aot_eager` (graph capture only, for debugging). Stored artifacts of an
    engine built with `build-engine --compile_step` are loaded when the torch version and device type match.
    """

    enable_fullgraph: bool = True  # the step is one graph (a graph break is an error)
    enable_inductor: bool = True  # inductor code generation; false: aot_eager


class MoeConfig(_Strict):
    backend: Literal["AUTO", "CUTLASS", "TRTLLM", "WIDEEP", "TORCH"] = "AUTO"


class LlmArgs(_Strict):
    """The arguments of `LLM(...)`, `build-engine --extra_llm_api_options`, and `nextn generate`."""

    speculative_config: SpeculativeConfig | None = None
    kv_cache_config: KvCacheConfig = KvCacheConfig()
    cuda_graph_config: CudaGraphConfig | None = None  # accepted; graph capture needs CUDA and is reported when off
    torch_compile_config: TorchCompileConfig | None = None  # null: the decode step runs eagerly
    disable_overlap_scheduler: bool = False  # false: launch step n before reading back step n−1's results
    moe_config: MoeConfig = MoeConfig()
    max_batch_size: int | None = Field(default=None, gt=0, le=MAX_BATCH_SIZE)  # null: the engine's build option
    max_seq_len: int | None = Field(default=None, gt=0)  # null: the engine's build option
    max_num_tokens: int = Field(default=8192, gt=0)  # token budget of one scheduler step
    enable_chunked_prefill: bool = False  # split prompts longer than the step's token budget into chunks
    print_iter_log: bool = False
    # at load: every engine file's SHA-256 (full), or its size and safetensors header only (size), or nothing (off)
    verify_weights: Literal["full", "size", "off"] = "full"
    tensor_parallel_size: int = Field(default=1, ge=1, le=1024)  # ranks the model is split over (distributed/)
    moe_expert_parallel_size: int | None = Field(default=None, ge=1, le=1024)  # routed experts split by id; null: 1


#: speculative_config's members by decoding_type (the built-in ones here; `nextn.speculative.registry` adds a
#: registered method's config class through `register_decoding_config`).
_UNION_TAGS: dict[str, type[BaseModel]] = {"MTP": MTPDecodingConfig, "Medusa": MedusaDecodingConfig,
                                           "NGram": NGramDecodingConfig, "Draft_Target": DraftTargetDecodingConfig,
                                           "Suffix": SuffixDecodingConfig,
                                           "Gemma4Assistant": Gemma4AssistantDecodingConfig}


def register_decoding_config(config: type[BaseModel]) -> None:
    """Accept `config` as a `speculative_config` member, selected by its `decoding_type` default (the speculative
    registry calls this for each method it registers; a no-op for a class already accepted)."""
    tag = config.model_fields["decoding_type"].default
    if _UNION_TAGS.get(tag) is config:
        return
    _UNION_TAGS[tag] = config
    members = tuple(_UNION_TAGS.values())
    LlmArgs.model_fields["speculative_config"].annotation = Annotated[Union[members], Field(
        discriminator="decoding_type")] | None
    LlmArgs.model_rebuild(force=True)


def _owner_of(loc: tuple, model: type[BaseModel]) -> type[BaseModel]:
    """The pydantic model that holds the last key of `loc` (union tags such as 'MTP' select the member)."""
    owner = model
    for part in loc[:-1]:
        if str(part) in _UNION_TAGS:
            owner = _UNION_TAGS[str(part)]
            continue
        field = owner.model_fields.get(str(part))
        ann = getattr(field, "annotation", None) if field else None
        sub = [a for a in getattr(ann, "__args__", (ann,)) if isinstance(a, type) and issubclass(a, BaseModel)]
        owner = sub[0] if sub else owner
    return owner


def _format_error(e: ValidationError, model: type[BaseModel]) -> str:
    lines = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err["loc"] if str(x) not in _UNION_TAGS and not str(x).startswith("function-"))
        if err["type"] == "extra_forbidden":
            valid = ", ".join(_owner_of(err["loc"], model).model_fields)
            lines.append(f"unknown key {loc!r}; valid keys here: {valid}")
        else:
            lines.append(f"{loc}: {err['msg']}")
    return "; ".join(lines)


_LEGACY_CUDA_GRAPH = {"cuda_graph_batch_sizes": "batch_sizes", "cuda_graph_padding_enabled": "enable_padding",
                      "cuda_graph_max_batch_size": "max_batch_size"}


def upgrade_legacy_keys(data: dict[str, Any]) -> dict[str, Any]:
    """Accept older TensorRT-LLM spellings, warning with the new one for each.

    `pytorch_backend_config: {...}` → its keys at the top level; `use_cuda_graph` → `cuda_graph_config` ({} or
    null); `cuda_graph_batch_sizes` / `cuda_graph_padding_enabled` / `cuda_graph_max_batch_size` →
    `cuda_graph_config.{batch_sizes, enable_padding, max_batch_size}`.
    """
    out = dict(data)
    if isinstance(out.get("pytorch_backend_config"), dict):
        nested = out.pop("pytorch_backend_config")
        warnings.warn("pytorch_backend_config is deprecated: put its keys at the top level", FutureWarning, stacklevel=3)
        out = {**nested, **out}
    graph = dict(out["cuda_graph_config"]) if isinstance(out.get("cuda_graph_config"), dict) else None
    if "use_cuda_graph" in out:
        use = out.pop("use_cuda_graph")
        warnings.warn("use_cuda_graph is deprecated: use cuda_graph_config: {} (or null to disable)", FutureWarning,
                      stacklevel=3)
        graph = (graph or {}) if use else None
        out["cuda_graph_config"] = graph
    for old, new in _LEGACY_CUDA_GRAPH.items():
        if old in out:
            warnings.warn(f"{old} is deprecated: use cuda_graph_config.{new}", FutureWarning, stacklevel=3)
            graph = graph or {}
            graph[new] = out.pop(old)
            out["cuda_graph_config"] = graph
    return out


def parse_llm_args(data: dict[str, Any] | None, **overrides: Any) -> LlmArgs:
    """Validate a dict (YAML content) merged with keyword overrides into `LlmArgs` (legacy spellings upgraded).

    Raises:
        LlmArgsError: unknown key or wrong type; the message names the key and lists the valid ones.
    """
    if data is not None and not isinstance(data, dict):
        raise LlmArgsError(f"LLM arguments must be a mapping, got {type(data).__name__}")
    merged = upgrade_legacy_keys(dict(data or {}))
    merged.update({k: v for k, v in overrides.items() if v is not None or k == "speculative_config"})
    check_nesting(merged, "the LLM arguments")
    try:
        return LlmArgs.model_validate(merged)
    except ValidationError as e:
        raise LlmArgsError(f"invalid LLM arguments: {_format_error(e, LlmArgs)}") from e
    except RecursionError:
        raise LlmArgsError(f"the LLM arguments are nested too deeply (at most {MAX_NESTING} levels)") from None


def load_llm_args_yaml(path: str | Path) -> dict[str, Any]:
    """Read an `extra_llm_api_options` YAML file into a dict (validated later by `parse_llm_args`).

    Raises:
        LlmArgsError: the file is missing, not a regular file (a directory, /dev/zero, a pipe such as /dev/stdin:
            never read), larger than 1 MiB, not UTF-8, not YAML, nested too deeply, or not a mapping at the top level.
    """
    try:
        p = Path(path)
    except TypeError:
        raise LlmArgsError(f"extra_llm_api_options must be a path to a YAML file, got {type(path).__name__}") from None
    text = read_user_text(p, "extra_llm_api_options file", LlmArgsError, MAX_YAML_BYTES)
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise LlmArgsError(f"{p} is not valid YAML: {e}") from e
    except RecursionError:
        raise LlmArgsError(f"{p} is nested too deeply for LLM arguments (at most {MAX_NESTING} levels)") from None
    except ValueError as e:  # an integer of more than 4300 digits (Python's int-from-string limit)
        raise LlmArgsError(f"{p} holds a number Python refuses to read ({e}); LLM argument ints are within "
                           f"±{MAX_INT}") from None
    check_nesting(data, str(p))
    if not isinstance(data, dict):
        raise LlmArgsError(f"{p} must hold a mapping of LLM arguments at the top level, got {type(data).__name__}")
    parse_llm_args(data)  # fail early, naming the file's bad key
    return resolve_yaml_paths(data, p)


#: The LLM-argument keys (under speculative_config) that hold a file or directory path that must exist.
PATH_KEYS = ("speculative_model_dir", "speculative_model", "draft_token_map")
#: ... and those that name a directory nextn creates when it is missing (so need not exist yet).
DIR_KEYS = ("step_profile_dir",)


def resolve_yaml_paths(data: dict[str, Any], yaml_path: Path) -> dict[str, Any]:
    """`data` with each relative path of `PATH_KEYS` and `DIR_KEYS` made relative to the YAML file's folder
    (absolute), as a config file's paths are read wherever the command runs; `~` is expanded.

    Raises:
        LlmArgsError: a `PATH_KEYS` path does not exist (the message names the key, the YAML file and where it
            looked); a path with a NUL byte or an unknown `~user` (`expand_path`).
    """
    spec = data.get("speculative_config")
    if not isinstance(spec, dict):
        return data
    spec = dict(spec)
    if isinstance(spec.get("combine_with"), dict):  # a combined drafter's model drafter (its draft model's path)
        spec["combine_with"] = resolve_yaml_paths({"speculative_config": spec["combine_with"]},
                                                  yaml_path)["speculative_config"]
    for key in (*PATH_KEYS, *DIR_KEYS):
        value = spec.get(key)
        if not isinstance(value, str) or not value:
            continue
        given = expand_path(value, f"{key} in {yaml_path}:")
        resolved = given if given.is_absolute() else yaml_path.absolute().parent / given
        if key in PATH_KEYS and not resolved.exists():
            where = "" if given.is_absolute() else f" (relative to the YAML's folder: {resolved})"
            raise LlmArgsError(f"{key} in {yaml_path}: {value}{where} does not exist; a relative path in a YAML "
                               "file is read from the YAML file's folder")
        spec[key] = str(resolved)
    return {**data, "speculative_config": spec}
