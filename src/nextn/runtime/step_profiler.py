"""Measuring a step profile (speculative/step_profile.py): the engine's decode-step time per batch size and draft
length on this machine, once, at the first load with `step_profile: auto`; later loads read it from the cache.

The grid: batch sizes 1, 2, 4, 8, 16 (capped by max_batch_size and by what the KV cache holds; a capped size is
stored under its bucket, as `AdaptiveDraftLen` buckets batch sizes) × draft lengths k = 0..K (above 8: powers of
two and K, `draft_lens`). Each batch size runs real steps through the engine's own model runner and a scheduler of
its own (built like the engine's, over a pool without prefix cache, so nothing it computes is ever reused): B
synthetic requests (fixed pseudo-random prompts of `PROMPT_LEN` tokens, greedy, EOS ignored) are prefilled once,
then decoded in rounds of one step at each k, longest first (`ForcedDraftLen`; k = 0 is a plain step without the
drafter, as the adaptive policy runs it, and the drafts' re-priming step after it is not timed), each step's drafts
replaced by pseudo-random tokens (`_distinct_drafts`: a real draft's tokens differ, and an MoE model's verify step
reads the union of their experts; the synthetic requests' drafts are mostly padding, one token repeated, which routes
every row to the same experts — measured on Qwen3-30B-A3B's layer shapes at batch 8: a verify step priced at a
fraction of its cost, Suffix drafting then ran at 0.90× plain), so that other load
on the machine and the growing context weigh on every k alike. A step's time is the one
`Scheduler.update_from_output` hands the policy (`StepResult.seconds`); the first `WARMUP_ROUNDS` are dropped
(first-use costs: kernel selection, graph capture, compilation) and each k's time is the fastest of its next
`TIMED_ROUNDS` steps (timeit's rule: other work on the machine only ever adds time, and more of it to a cheap step
than in proportion). Steps run synchronously (no step in flight), so a time is the step's own.

Cost: per batch size one prefill and (WARMUP_ROUNDS + TIMED_ROUNDS) × (K + 2) decode steps for K ≤ 8, within
`BUDGET_S` seconds: the batch sizes whose estimated time would pass it are left to the policy's online timing
(`AdaptiveDraftLen` explores a bucket the profile lacks) and recorded as such, so later loads do not measure them
(the seconds for SmolLM2-135M are in docs/ARCHITECTURE.md, under the draft-length policy).

What it leaves behind: nothing in the engine's pool or prefix cache; the drafter's per-slot state is rebuilt by the
next prefill of each slot (Suffix decoding moves a slot's previous sequence — here a synthetic one — into its global
tree when the slot is reused, where it can only cost acceptance, never correctness).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Mapping, Sequence
import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch
from pydantic import BaseModel

from nextn.build.manifest import EngineManifest
from nextn.config.llm_args import DecodingBaseConfig, LlmArgs, expand_path
from nextn.plugins import cpu_kernels
from nextn.progress import progress_bar
from nextn.runtime.kv_cache import BlockPool
from nextn.runtime.model_runner import ModelRunner
from nextn.runtime.request import Request
from nextn.runtime.sampling_params import SamplingParams
from nextn.runtime.scheduler import Scheduler
from nextn.runtime.step_plan import DecodePlan
from nextn.speculative.draft_len_policy import DraftLenPolicy
from nextn.speculative.step_profile import (DEFAULT_PROFILE_DIR, ProfileKey, StepProfile, StepProfileError,
                                            cached_step_profile, engine_digest, save_step_profile)

__all__ = ["ForcedDraftLen", "ProfileTarget", "measure_step_time", "step_profile_for", "wanted_buckets"]

logger = logging.getLogger(__name__)

BATCH_SIZES = (1, 2, 4, 8, 16)
PROMPT_LEN = 32  # tokens of each synthetic prompt (fewer when max_seq_len is short)
WARMUP_ROUNDS = 2  # rounds (one step at each k) dropped before timing: first-use costs
TIMED_ROUNDS = 5  # rounds timed (each k's fastest step over them is its time)
MAX_EVERY_K = 8  # every draft length up to this is timed; above it powers of two and K (`draft_lens`)
#: seconds a first load spends measuring: batch sizes are timed smallest first while the next one's estimated
#: time (the last one's, scaled by the batch) still fits; the larger ones are left to the policy's online timing
BUDGET_S = 6.0
#: how the table is measured; part of the engine digest, so that a change of method measures again
SCHEME = (f"batch {BATCH_SIZES}, k ≤ {MAX_EVERY_K} + powers, prompt {PROMPT_LEN}, "
          f"rounds {WARMUP_ROUNDS}+{TIMED_ROUNDS}, min")

#: builds a scheduler like the engine's: (pool, draft-length policy, whether the drafter's proposals cap k)
SchedulerFactory = Callable[[BlockPool, DraftLenPolicy, bool], Scheduler]


class ForcedDraftLen:
    """A draft-length policy that runs the draft length its owner sets (`k`) and keeps the wall times of the steps
    it observes at one batch size, per draft length (the drafter drafts, at prefill too, exactly when k > 0)."""

    def __init__(self, max_draft_len: int, batch_size: int) -> None:
        self.max_draft_len, self.batch_size, self.k = max_draft_len, batch_size, max_draft_len
        self.seconds: dict[int, list[float]] = {}  # k → one per observed timed step at `batch_size`

    def draft_len(self, batch_size: int, request_ids: Sequence[int] = ()) -> int:
        return self.k

    def would_draft(self, batch_size: int) -> bool:
        return self.k > 0

    def observe(self, num_draft_tokens: int, num_accepted_draft_tokens: int, draft_len: int = 0,
                batch_size: int = 0, seconds: float = 0.0, per_request: Mapping[int, int] | None = None) -> None:
        if seconds > 0.0 and batch_size == self.batch_size:
            self.seconds.setdefault(draft_len, []).append(seconds)


@dataclass(frozen=True)
class ProfileTarget:
    """What measuring needs of a loaded engine (runtime/engine_loader.py builds it)."""

    runner: ModelRunner
    new_scheduler: SchedulerFactory
    num_blocks: int  # of the KV cache tensor, the null block included
    block_size: int
    max_batch_size: int
    max_seq_len: int
    num_draft_tokens: int  # K
    vocab_size: int
    on_demand: bool = False  # the scheduler's: a step at k drafts k, not K (its times differ)


def draft_lens(max_draft_len: int) -> list[int]:
    """The draft lengths timed: every k ≤ `MAX_EVERY_K`, then powers of two and K itself (a tree's K counts its
    nodes, up to 255; `AdaptiveDraftLen` interpolates between timed lengths)."""
    powers = {1 << i for i in range(max_draft_len.bit_length())}
    return sorted({k for k in range(min(max_draft_len, MAX_EVERY_K) + 1)} | powers | {max_draft_len})


def _bucket(batch_size: int) -> int:
    return 1 << max(batch_size - 1, 0).bit_length()


def _plan(target: ProfileTarget) -> tuple[list[int], int, int]:
    """(the batch sizes timed, the synthetic prompts' length, new tokens per request): BATCH_SIZES capped by
    max_batch_size and by what the KV cache holds at once."""
    K = target.num_draft_tokens
    rounds = WARMUP_ROUNDS + TIMED_ROUNDS
    per_round = sum(k + 1 for k in draft_lens(K)) + 1  # tokens a round may emit per request (+1: re-priming)
    lookahead = 2 * K + 1
    prompt_len = max(1, min(PROMPT_LEN, target.max_seq_len - lookahead - 1 - rounds * per_round))
    max_tokens = max(1, min(rounds * per_round + 1, target.max_seq_len - prompt_len))
    per_request = -(-(prompt_len + max_tokens + lookahead + K + 1) // target.block_size)  # KV blocks
    fits = max(1, (target.num_blocks - 1) // per_request)
    return sorted({min(b, target.max_batch_size, fits) for b in BATCH_SIZES}), prompt_len, max_tokens


def wanted_buckets(target: ProfileTarget) -> set[int]:
    """The batch-size buckets a profile of this engine, as loaded now, should hold: a cached profile measured with
    a smaller max_batch_size (or KV cache) lacks the larger ones and is measured again."""
    return {_bucket(b) for b in _plan(target)[0]}


def measure_step_time(target: ProfileTarget, progress: bool = True, budget_s: float | None = None
                      ) -> tuple[dict[int, dict[int, float]], list[int]]:
    """(the step-time table {bucket: {k: seconds}} of the engine behind `target`, the buckets left to online timing).

    Batch sizes are timed smallest first while the elapsed time plus the next one's estimate (the last one's time
    × the batch-size ratio) fits `budget_s`; the first is always timed. A draft length not timed before the requests
    run out of room (a short max_seq_len) is left out (`AdaptiveDraftLen` interpolates a missing k); so is a batch
    size without a plain and a speculating time. `budget_s` None: `BUDGET_S`. See the module docstring."""
    budget_s = BUDGET_S if budget_s is None else budget_s
    sizes, prompt_len, max_tokens = _plan(target)
    rounds = WARMUP_ROUNDS + TIMED_ROUNDS
    rng = random.Random(0)
    prompts = [[rng.randrange(target.vocab_size) for _ in range(prompt_len)] for _ in range(max(sizes))]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    table: dict[int, dict[int, float]] = {}
    start, last = time.perf_counter(), None
    with progress_bar(total=len(sizes) * rounds, desc="step profile", unit="round", enabled=progress) as bar:
        for i, b in enumerate(sizes):
            if last is not None:
                elapsed = time.perf_counter() - start
                if elapsed + last[1] * b / last[0] > budget_s:
                    left = sorted({_bucket(x) for x in sizes[i:]})
                    logger.info("step profile: batch sizes %s left to online timing (a %.0f s budget)", left,
                                budget_s)
                    return table, left
            began = time.perf_counter()
            times = _measure_batch(target, b, prompts[:b], params, bar.update)
            last = (b, time.perf_counter() - began)
            if 0 in times and len(times) > 1:
                table[_bucket(b)] = times
    return table, []


def _distinct_drafts(plan, rng: random.Random, vocab_size: int):
    """`plan` with a decode step's drafts (input_ids[:, 1:]) replaced by pseudo-random tokens; other plans as
    they are."""
    if not isinstance(plan, DecodePlan) or plan.draft_len == 0:
        return plan
    ids = tuple((row[0], *(rng.randrange(vocab_size) for _ in row[1:])) for row in plan.input_ids)
    return dataclasses.replace(plan, input_ids=ids)


def _measure_batch(target: ProfileTarget, batch_size: int, prompts: list[list[int]], params: SamplingParams,
                   on_round: Callable[[int], object]) -> dict[int, float]:
    """{k: seconds of a decode step of `batch_size` requests at draft length k}: the requests are prefilled
    once, then decoded in rounds of one step at each k of `draft_lens(K)`, longest first (so that contention and
    the growing context weigh on every k alike), the first WARMUP_ROUNDS dropped, the fastest kept. Calls
    `on_round(1)` after each round."""
    K = target.num_draft_tokens
    policy = ForcedDraftLen(K, batch_size)
    scheduler = target.new_scheduler(BlockPool(target.num_blocks, target.block_size), policy, False)
    for i, ids in enumerate(prompts):
        scheduler.add(Request(i, None, list(ids), params, frozenset(), seed=i))
    rounds = WARMUP_ROUNDS + TIMED_ROUNDS
    rng = random.Random(batch_size)
    order = draft_lens(K)[::-1]
    turn = 0  # steps timed so far: k = order[turn % len(order)] runs next
    limit = 2 * rounds * (len(order) + 1) + batch_size  # prefills (under the token budget) + decode steps, bounded
    for _ in range(limit):
        policy.k = order[turn % len(order)]
        done = len(policy.seconds.get(policy.k, ()))
        plan = scheduler.schedule()
        if plan is None or plan.kind == "decode" and plan.num_requests < batch_size:
            break  # (a request ran out of room: the batch would shrink)
        plan = _distinct_drafts(plan, rng, target.vocab_size)
        scheduler.update_from_output(plan, target.runner.run(plan))
        if len(policy.seconds.get(policy.k, ())) > done:  # timed (not a prefill, nor the drafts' re-priming step)
            turn += 1
            if turn % len(order) == 0:
                on_round(1)
                if turn == rounds * len(order):
                    break
    return {k: min(seconds[WARMUP_ROUNDS:] or seconds[-1:]) for k, seconds in policy.seconds.items()}


def _engine_identity(manifest: EngineManifest, spec: BaseModel, args: LlmArgs, device: torch.device,
                     on_demand: bool = False) -> str:
    """`engine_digest` of what makes this engine's steps what they are: the engine, the drafter's config (its
    draft-length policy fields excluded: they choose k, the profile times every k), whether a step drafts only its
    k, the KV dtype, the compiled / graphed step settings, the device type (on a CPU, nextn's kernel sources and ISA
    variant too: a faster kernel changes the times), the measuring scheme."""
    drafter = spec.model_dump_json(exclude=set(DecodingBaseConfig.model_fields))
    step = [args.kv_cache_config.dtype, args.torch_compile_config, args.cuda_graph_config, device.type]
    if on_demand:
        step.append("drafts on demand")
    if device.type == "cpu":
        step.append(cpu_kernels.source_digest())
        step.append(str(cpu_kernels.variant()))  # the ISA variant running them (NEXTN_CPU_ISA can force another)
    return engine_digest(manifest.model_dump_json(), drafter, repr(step), SCHEME)


def step_profile_for(spec: BaseModel | None, args: LlmArgs, manifest: EngineManifest, engine_dir: Path,
                     device: torch.device, target: ProfileTarget,
                     sharded: bool = False) -> dict[int, dict[int, float]] | None:
    """The step-time table the draft-length policy starts from, or None (it measures online, as without a
    profile): only with `adaptive_draft_len`, `step_profile: auto` and a drafter (K ≥ 1). The cached profile of
    this engine on this machine when there is one; else measured now (`measure_step_time` on `target`, a progress
    bar while it runs) and cached. A tensor-parallel rank (`sharded`) reads a cached profile but does not measure
    (its steps need every rank). A cache that cannot be written is logged and the table used all the same.

    Raises:
        LlmArgsError: `step_profile_dir` holds a NUL byte or an unknown `~user` (`expand_path`; a validated config
            refuses them already).
    """
    if not (isinstance(spec, DecodingBaseConfig) and spec.adaptive_draft_len and spec.step_profile == "auto"
            and target.num_draft_tokens > 0):
        return None
    cache_dir = expand_path(spec.step_profile_dir, "step_profile_dir") if spec.step_profile_dir else DEFAULT_PROFILE_DIR
    key = ProfileKey.current(_engine_identity(manifest, spec, args, device, target.on_demand), device)
    name = engine_dir.name
    profile = cached_step_profile(cache_dir, key, name)
    if profile is not None:
        missing = sorted(wanted_buckets(target) - set(profile.step_time) - set(profile.left_online))
        if not missing or sharded:
            logger.info("step profile of %s read from %s", name, cache_dir)
            return profile.step_time
        logger.info("the cached step profile of %s lacks batch sizes %s (measured with a smaller max_batch_size or "
                    "KV cache): measuring it again", name, missing)
    if sharded:
        logger.info("no step profile of %s cached in %s: tensor-parallel ranks measure step times online", name,
                    cache_dir)
        return None
    t0 = time.perf_counter()
    table, left_online = measure_step_time(target)
    seconds = time.perf_counter() - t0
    if not table:
        logger.warning("the step profile of %s measured nothing (max_seq_len %d too short?): step times are measured "
                       "online", name, target.max_seq_len)
        return None
    profile = StepProfile(key=key, engine_name=name[:256], measure_seconds=round(seconds, 3), step_time=table,
                          left_online=left_online)
    try:
        path = save_step_profile(profile, cache_dir)
    except StepProfileError as e:
        logger.warning("measured the step profile of %s in %.1fs; not cached: %s", name, seconds, e)
    else:
        logger.info("measured the step profile of %s in %.1fs, cached at %s", name, seconds, path)
    return table
