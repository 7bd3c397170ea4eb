"""Draft-length policies: how many drafts each decode step verifies, so that speculation never costs more than
it gains (a strategy chosen once, at load time, from the speculative config).

Speculation pays when the target forward over B·(k+1) tokens costs little more than over B tokens: true at small
batches, false once the step is compute-bound (large B) or when few drafts are accepted. The policies follow
TensorRT-LLM's speculative-config fields (`DecodingBaseConfig`):
- `draft_len_schedule` {batch size threshold: draft length}: a batch of B requests uses the draft length of the
  smallest threshold ≥ B; above the largest threshold speculation is off (draft length 0).
- `max_concurrency`: above this many requests in the batch speculation is off.
- `acceptance_rate_window_size` N and `acceptance_rate_threshold` t: once the rolling draft acceptance rate
  (accepted drafts / drafts) over the last N speculation-enabled iterations drops below t, speculation is off for
  good.
- `adaptive_draft_len: true` (nextn's own): each step verifies the draft length k ≤ the schedule's that maximises
  expected tokens per second, Σ_r E_r(k) / t(k), from each request's own recent acceptance and the step times
  measured on this machine at each k (`AdaptiveDraftLen`); k = 0 (plain decoding) when no k pays. With
  `step_profile: auto` the step times come from a profile measured once per engine and machine and cached
  (speculative/step_profile.py, runtime/step_profiler.py), so only acceptance is learnt while serving.

A step with draft length 0 < k < K runs the same verify-and-draft step with k draft columns ([last, d1..dk]); the
drafter still drafts K tokens (its KV and pools stay exactly as after a K-draft step, so raising k again later
keeps the drafts equal to drafts from scratch), and the unused drafts are dropped — except a drafter whose every
draft is a forward of its own (a draft model, `DrafterTraits.on_demand`), which drafts the k it was given, so
that a longer k takes effect one step later (runtime/scheduler.py). With speculation off (k = 0)
the step is plain decoding with no drafter at all, so it costs what plain decoding costs; when speculation comes
back on, one step with k = 0 and the drafter on re-primes the drafts (the drafter's KV / pools for the positions
decoded while off are missing, which can only lower acceptance: verification keeps the output lossless).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from nextn.config.llm_args import DecodingBaseConfig, LlmArgsError, MedusaDecodingConfig
from nextn.speculative.draft_gain import MIN_GAIN, Gain, alpha_for_gain, expected_tokens

__all__ = ["AdaptiveDraftLen", "DraftLenPolicy", "acceptance_from_rate", "choose_draft_len_policy", "expected_tokens"]


class DraftLenPolicy(Protocol):
    max_draft_len: int  # K: the drafter's draft count, the most a step can verify

    def draft_len(self, batch_size: int, request_ids: Sequence[int] = ()) -> int:
        """Drafts each request verifies in a decode step of `batch_size` requests (ids `request_ids`), in [0, K]."""

    def would_draft(self, batch_size: int) -> bool:
        """Whether a decode step of `batch_size` requests may speculate (no side effects: asked at prefill, so
        that a prefill whose next step will not speculate skips drafting)."""

    def observe(self, num_draft_tokens: int, num_accepted_draft_tokens: int, draft_len: int = 0,
                batch_size: int = 0, seconds: float = 0.0, per_request: Mapping[int, int] | None = None) -> None:
        """One processed decode iteration's totals over its batch (feedback for acceptance-based policies): drafts
        counted and accepted (`Drafter.stat_draft_len` per request: a tree counts its depth), the step's draft
        length as `draft_len` returned it (a tree's nodes), its batch size, its wall time in seconds (0: unknown),
        and each request's accepted drafts (request id → count; None: not given)."""


class StaticDraftLen:
    """Always K (TensorRT-LLM's behaviour without a schedule)."""

    def __init__(self, max_draft_len: int) -> None:
        self.max_draft_len = max_draft_len

    def would_draft(self, batch_size: int) -> bool:
        return self.max_draft_len > 0

    def draft_len(self, batch_size: int, request_ids: Sequence[int] = ()) -> int:
        return self.max_draft_len

    def observe(self, num_draft_tokens: int, num_accepted_draft_tokens: int, draft_len: int = 0,
                batch_size: int = 0, seconds: float = 0.0, per_request: Mapping[int, int] | None = None) -> None:
        pass


class BatchSizeDraftLen:
    """`draft_len_schedule` and/or `max_concurrency`: the draft length as a function of the batch size."""

    def __init__(self, max_draft_len: int, schedule: dict[int, int] | None, max_concurrency: int | None) -> None:
        self.max_draft_len = max_draft_len
        self.schedule = sorted((schedule or {}).items())
        self.max_concurrency = max_concurrency

    def draft_len(self, batch_size: int, request_ids: Sequence[int] = ()) -> int:
        if self.max_concurrency is not None and batch_size > self.max_concurrency:
            return 0
        if not self.schedule:
            return self.max_draft_len
        return next((k for limit, k in self.schedule if batch_size <= limit), 0)

    def would_draft(self, batch_size: int) -> bool:
        return self.draft_len(batch_size) > 0

    def observe(self, num_draft_tokens: int, num_accepted_draft_tokens: int, draft_len: int = 0,
                batch_size: int = 0, seconds: float = 0.0, per_request: Mapping[int, int] | None = None) -> None:
        pass


class AcceptanceGate:
    """Wraps a policy; turns speculation off for good once the rolling draft acceptance rate over the last
    `window` speculation-enabled iterations falls below `threshold`."""

    def __init__(self, inner: DraftLenPolicy, window: int, threshold: float) -> None:
        self.inner, self.threshold = inner, threshold
        self.max_draft_len = inner.max_draft_len
        self._window: deque[tuple[int, int]] = deque(maxlen=window)
        self.disabled = False

    def draft_len(self, batch_size: int, request_ids: Sequence[int] = ()) -> int:
        return 0 if self.disabled else self.inner.draft_len(batch_size, request_ids)

    def would_draft(self, batch_size: int) -> bool:
        return not self.disabled and self.inner.would_draft(batch_size)

    def observe(self, num_draft_tokens: int, num_accepted_draft_tokens: int, draft_len: int = 0,
                batch_size: int = 0, seconds: float = 0.0, per_request: Mapping[int, int] | None = None) -> None:
        if self.disabled or num_draft_tokens == 0:
            return
        self._window.append((num_draft_tokens, num_accepted_draft_tokens))
        if len(self._window) == self._window.maxlen:
            drafts = sum(d for d, _ in self._window)
            self.disabled = sum(a for _, a in self._window) / drafts < self.threshold
        self.inner.observe(num_draft_tokens, num_accepted_draft_tokens, draft_len, batch_size, seconds, per_request)


def acceptance_from_rate(rate: float, k: float) -> float:
    """The per-draft acceptance probability α whose expected accepted share E[accepted] / k at chain draft length k
    is `rate` (the inverse of α(1 − α^k) / ((1 − α) k), monotone in α; bisection)."""
    return alpha_for_gain(expected_tokens, rate * k, k)


@dataclass
class _ProbeState:
    """One batch-size bucket's probing (`AdaptiveDraftLen`)."""

    interval: int  # steps between probes now (doubles while speculation stays off)
    off: bool = False  # the last chosen k was 0
    since_switch: int = 0  # steps since the last probe at the current on/off state
    probing: bool = False  # a probe from off is under way: speculate until a speculating step is observed
    probe_len: int = 0  # the draft length that probe runs


class AdaptiveDraftLen:
    """Wraps a policy; picks each step's draft length k in [0, the inner policy's] to maximise the batch's expected
    tokens per second, Σ_r E(α_r, k) / t(k), from each request's own recent acceptance and measured step times.

    E(α, k) = `gain`(α, k), the expected tokens per request of a step verifying k drafts (speculative/draft_gain.py: a
    chain's `expected_tokens`; a tree's `TreeGain` over its first k nodes, k counting nodes); α_r is request r's
    top-1 acceptance: the α at which E(α, n) − 1 equals the EMAs (weight `acceptance_smoothing`) of its accepted
    drafts per step, n the EMA of its verified drafts per step, over the speculating steps it took part in (a
    request not yet observed starts from the pooled α of all requests; none observed at all: the full length is
    tried). So a request whose drafts keep missing (chat beside code, a drafter that does not know the
    topic) pulls k down only by its own share, and a lone request runs the length that pays for it alone; k = 0
    (plain decoding) when no k pays for the batch by `min_gain` (5 %: near break-even the prediction errs by more).

    t(k) is measured, per batch-size bucket (powers of two) and per k: an EMA of the wall time of the steps that ran
    at that length (k = 0: plain steps, no drafter), restarted from the new time when the last was more than
    `probe_every` timed steps ago (a probe's t(K) after a pause, or the engine's first, cold steps, would otherwise
    decide for a long time). A k not yet measured is interpolated between the measured lengths around it, else
    extrapolated from the nearest measured k' > 0 as t(k') + (k − k') · v · t(0), v = `prior_cost` per verified row
    (below k': at most (t(k') / t(0) − 1) / k', so that no estimate undercuts a plain step), or as t(0) · (1 +
    `prior_cost` · k) when no speculating step was timed. Measuring each length matters because most drafters draft K
    tokens whatever k the step verifies (their KV stays as after a full step): a short k saves verify rows only, not
    draft work, while a draft model drafts k (each draft a forward), so no per-draft linear model fits both. A bucket whose plain step is not yet timed times one after `warmup_steps` speculating steps, so a drafter
    that does not pay is found out within a few steps. Afterwards it probes (each bucket on its own): while off,
    after `probe_every` plain steps it speculates until one speculating step was observed (the drafter's first step
    back only primes the drafts; this one refreshes α and t(k)) at the k ≥ 1 of the best predicted rate — the
    cheapest informative probe, not the full length (a 16-node tree at batch 8 costs several plain steps) — the
    wait doubling after each probe that leaves it off (up to `max_probe_every`: a probe costs a draft-priming step
    and a speculating one), or `idle_probe_every` at once when the bucket is hopeless — no k would pay even if
    every draft were accepted (max_k E(1, k) / (t(k) / t(0)) < 1: a compute-bound batch, or a drafter costlier
    than the tokens it could add; measured on this CPU at batch 8, where one probe costs ~17 plain steps); while
    on, every `probe_every` speculating steps one plain step refreshes t(0). A probe from off is also held back
    until it fits `probe_budget`, the share of decode time probes may cost: a probe's loss, in plain steps, is
    2 · t(k) / t(0) − (1 + E(α, k)) (its priming and speculating steps against two plain steps), so a probe that
    costs c plain steps waits at least c / probe_budget steps (default 0.5 %) — where drafting costs many plain
    steps (a 16-node MTP tree over a 129k vocabulary on a CPU: ~10 plain steps a probe), probing stays within
    budget: on the demo checkpoint at batch 1, probes every 32–256 steps cost 22 % of the throughput, at 0.5 % two
    probes in 2,000 steps cost 2 % (docs/performance-history.md).

    With a step profile (`profile`, speculative/step_profile.py: t(k) per bucket measured once for this engine on this
    machine) the profiled buckets explore nothing for step times: their t(k) are the profile's from the first step,
    never replaced online (a profiled bucket times no plain steps, so online speculating times alone would skew
    t(k) / t(0)), no warm-up plain step, no plain probes while on; a hopeless bucket runs k = 0 from its first step
    and never probes (no acceptance could change that); a paying bucket speculates from its first step, and while
    off still probes to refresh α. Buckets the profile lacks behave as above. Lossless by construction: only the
    number of verified drafts changes, never the acceptance rule. The step's shape is one draft length for the whole
    batch ([B, k+1], graph-capturable), so per-request acceptance chooses the batch's k rather than giving each row
    its own width (a row's extra verified drafts cost nothing more once the step runs).
    """

    max_tracked_requests = 4096  # per-request α kept for at most this many recent requests (least recent dropped)
    min_gain = MIN_GAIN  # a k ≥ 1 must be predicted to beat plain decoding by this factor (draft_gain.py)

    def __init__(self, inner: DraftLenPolicy, prior_cost: float = 0.1, smoothing: float = 0.2,
                 acceptance_smoothing: float = 0.1,
                 probe_every: int = 32, warmup_steps: int = 2, max_probe_every: int = 256,
                 idle_probe_every: int = 1024, gain: Gain = expected_tokens,
                 profile: Mapping[int, Mapping[int, float]] | None = None, probe_budget: float = 0.005) -> None:
        self.inner, self.max_draft_len, self.gain = inner, inner.max_draft_len, gain
        self.prior_cost, self.smoothing, self.probe_every = prior_cost, smoothing, probe_every
        self.warmup_steps, self.max_probe_every = warmup_steps, max_probe_every
        self.idle_probe_every, self.probe_budget = idle_probe_every, probe_budget
        self.acceptance_smoothing = acceptance_smoothing
        self.alpha: float | None = None  # pooled over all requests; unknown until a speculating step was observed
        self._pooled: tuple[float, float, float] | None = None  # `_acceptance_ema` of a request's mean step
        # request id → the same for each recently observed request (least recent first)
        self._request_stats: OrderedDict[int, tuple[float, float, float]] = OrderedDict()
        # batch-size bucket → {k: EMA seconds of a step at k}; a step profile's buckets: its seconds, kept as they are
        self.step_time: dict[int, dict[int, float]] = {b: dict(times) for b, times in (profile or {}).items()}
        self._profiled = frozenset(self.step_time)
        self._timed_at: dict[int, dict[int, int]] = {}  # bucket → {k: `_timed_steps` when t(k) was last timed}
        self._timed_steps = 0  # timed steps observed
        self._spec_steps: dict[int, int] = {}  # bucket → speculating steps observed (for the first plain timing)
        self._probes: dict[int, _ProbeState] = {}  # bucket → its probing state

    @property
    def request_alpha(self) -> dict[int, float]:
        """Request id → its own α, for the recently observed requests (least recent first)."""
        return {rid: stats[2] for rid, stats in self._request_stats.items()}

    @staticmethod
    def _bucket(batch_size: int) -> int:
        return 1 << max(batch_size - 1, 0).bit_length()

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.smoothing * (new - old)

    def _acceptance_ema(self, old: tuple[float, float, float] | None, accepted: float,
                        drafts: float) -> tuple[float, float, float]:
        """(EMA accepted drafts, EMA verified drafts, their α) per step after one more step's counts. The counts
        are averaged, not per-step α: one step's α is 0 or 1 more often than not, and α's map is not linear."""
        a = self.acceptance_smoothing
        if old is None:
            acc, n = accepted, drafts
        else:
            acc, n = old[0] + a * (accepted - old[0]), old[1] + a * (drafts - old[1])
        return acc, n, alpha_for_gain(self.gain, acc, n)

    def relative_step_time(self, batch_size: int, k: int) -> float:
        """t(k) / t(0) for this batch size's bucket: measured where a step at k was timed, else estimated (see the
        class docstring)."""
        times = self.step_time.get(self._bucket(batch_size), {})
        t0 = times.get(0)
        if k == 0:
            return 1.0
        if t0 is None:
            return 1.0 + self.prior_cost * k
        if k in times:
            return times[k] / t0
        measured = [j for j in times if j > 0]
        if not measured:
            return 1.0 + self.prior_cost * k
        below, above = [j for j in measured if j < k], [j for j in measured if j > k]
        if below and above:  # between two timed lengths: interpolate
            lo, hi = max(below), min(above)
            return (times[lo] + (times[hi] - times[lo]) * (k - lo) / (hi - lo)) / t0
        near = max(below) if below else min(above)
        ratio = times[near] / t0
        per_row = self.prior_cost if k > near else min(self.prior_cost, max(ratio - 1.0, 0.0) / near)
        return ratio + per_row * (k - near)

    def best_draft_len(self, batch_size: int, limit: int, request_ids: Sequence[int] = (), lowest: int = 0) -> int:
        """argmax over k in [lowest, limit] of Σ_r E(α_r, k) / (t(k) / t(0)), a k ≥ 1 discounted by `min_gain`
        (ties: the shorter draft); the pooled α
        stands for requests not yet observed, and for the whole batch when no ids are given (`limit` while no α is
        known). `lowest` 1: the length a probe from off runs."""
        stats = self._request_stats
        alphas = [stats[r][2] if r in stats else self.alpha for r in request_ids] or [self.alpha]
        known = [a for a in alphas if a is not None]
        if len(known) < len(alphas):
            return limit
        rates = [sum(self.gain(a, k) for a in known) / self.relative_step_time(batch_size, k)
                 * (1.0 if k == 0 else 1.0 / self.min_gain) for k in range(limit + 1)]
        return max(range(lowest, limit + 1), key=lambda k: (rates[k] - 1e-9 * k))

    def would_draft(self, batch_size: int) -> bool:
        """Where the step profile covers the batch size: whether the draft length this policy would pick there now
        (the pooled α for a new request) is > 0 — so a prefill admitted into a batch that decodes plainly skips
        its drafter (a draft model: no second prefill). Elsewhere the wrapped policy's answer (this one explores)."""
        if not self.inner.would_draft(batch_size):
            return False
        if self._bucket(batch_size) not in self._profiled:
            return True
        limit = self.inner.draft_len(batch_size)
        return limit > 0 and not self.hopeless(batch_size, limit) and self.best_draft_len(batch_size, limit) > 0

    def hopeless(self, batch_size: int, limit: int) -> bool:
        """No draft length in [1, limit] would pay at this batch size's measured step times even with every draft
        accepted: max_k E(1, k) / (t(k) / t(0)) < 1 (False until a plain and a speculating step were timed)."""
        times = self.step_time.get(self._bucket(batch_size), {})
        if 0 not in times or len(times) < 2:
            return False
        return all(self.gain(1.0, k) < self.relative_step_time(batch_size, k) for k in range(1, limit + 1))

    def draft_len(self, batch_size: int, request_ids: Sequence[int] = ()) -> int:
        limit = self.inner.draft_len(batch_size, request_ids)
        if limit == 0:
            return 0
        bucket = self._bucket(batch_size)
        profiled = bucket in self._profiled
        if profiled and self.hopeless(batch_size, limit):  # the profile says no acceptance could pay: never explore
            return 0
        if 0 not in self.step_time.get(bucket, {}) and self._spec_steps.get(bucket, 0) >= self.warmup_steps:
            self._spec_steps[bucket] = 0  # time a plain step of this bucket (again, if it was not timed)
            return 0
        probe = self._probes.setdefault(bucket, _ProbeState(self.probe_every))
        if probe.probing:  # until a speculating step ran (the first one after a pause only primes the drafts)
            return min(probe.probe_len, limit)
        k = self.best_draft_len(batch_size, limit, request_ids)
        if (k == 0) != probe.off:  # switched: probe the other side at the base interval again
            probe.off, probe.since_switch, probe.interval = k == 0, 0, self.probe_every
        if k == 0 and probe.interval < self.idle_probe_every and self.hopeless(batch_size, limit):
            probe.interval = self.idle_probe_every
        if profiled and not probe.off:  # t(0) is the profile's: no plain step to time
            return k
        probe.since_switch += 1
        if probe.since_switch >= probe.interval:  # probe the other side (see the class docstring)
            if probe.off:  # each probe that leaves speculation off doubles the wait for the next one
                probe_len = self.best_draft_len(batch_size, limit, request_ids, lowest=1)
                if probe.since_switch < self.probe_wait(batch_size, probe_len, request_ids):
                    return 0  # not yet within the probe budget
                probe.since_switch = 0
                probe.interval = min(2 * probe.interval, self.max_probe_every)
                probe.probing, probe.probe_len = True, probe_len
                return probe.probe_len
            probe.since_switch = 0
            return 0
        return k

    def probe_wait(self, batch_size: int, k: int, request_ids: Sequence[int] = ()) -> float:
        """Plain steps a probe at draft length k must follow so that probes cost at most `probe_budget` of the
        decode time: its loss in plain steps, 2 · t(k) / t(0) − (1 + mean E(α_r, k)), over the budget (0 where it
        costs nothing or there is no budget)."""
        if self.probe_budget <= 0 or k <= 0:
            return 0.0
        stats = self._request_stats
        alphas = [stats[r][2] if r in stats else self.alpha for r in request_ids] or [self.alpha]
        gain = sum(self.gain(a if a is not None else 0.0, k) for a in alphas) / len(alphas)
        loss = 2.0 * self.relative_step_time(batch_size, k) - (1.0 + gain)
        return max(loss, 0.0) / self.probe_budget

    def observe(self, num_draft_tokens: int, num_accepted_draft_tokens: int, draft_len: int = 0,
                batch_size: int = 0, seconds: float = 0.0, per_request: Mapping[int, int] | None = None) -> None:
        self.inner.observe(num_draft_tokens, num_accepted_draft_tokens, draft_len, batch_size, seconds, per_request)
        if draft_len > 0 and num_draft_tokens > 0:
            if (probe := self._probes.get(self._bucket(batch_size))) is not None:
                probe.probing = False
            prior = self._pooled
            if per_request:  # a request's mean step: draft_len verified, this many accepted
                mean = sum(per_request.values()) / len(per_request)
            else:  # (a chain: k drafts counted per request, k·rate accepted)
                mean = num_accepted_draft_tokens / num_draft_tokens * draft_len
            self._pooled = self._acceptance_ema(prior, mean, draft_len)
            self.alpha = self._pooled[2]
            for rid, accepted in (per_request or {}).items():
                stats = self._acceptance_ema(self._request_stats.get(rid, prior), accepted, draft_len)
                self._request_stats[rid] = stats
                self._request_stats.move_to_end(rid)
            while len(self._request_stats) > self.max_tracked_requests:
                self._request_stats.popitem(last=False)
        if seconds <= 0.0 or batch_size <= 0:
            return
        bucket = self._bucket(batch_size)
        if bucket in self._profiled:
            return
        times, seen = self.step_time.setdefault(bucket, {}), self._timed_at.setdefault(bucket, {})
        self._timed_steps += 1
        stale = self._timed_steps - seen.get(draft_len, self._timed_steps) > self.probe_every
        # a length timed long ago (a probe after a pause; the first, cold steps) is replaced, not blended
        times[draft_len] = seconds if stale else self._ema(times.get(draft_len), seconds)
        seen[draft_len] = self._timed_steps
        if draft_len > 0:
            self._spec_steps[bucket] = self._spec_steps.get(bucket, 0) + 1


class ProposalDraftLen(AdaptiveDraftLen):
    """`adaptive_draft_len` for a drafter that knows each step's proposals and their expected acceptance (Suffix:
    `set_step_times`): the draft length is the wrapped policy's cap, and the drafter's `proposal_len` picks the
    step's k in [0, cap] from its proposals and `relative_step_time` (the step profile's times, else timed online as
    `AdaptiveDraftLen` does) — no α estimate, no probes: the proposals are known before every step at no cost."""

    def draft_len(self, batch_size: int, request_ids: Sequence[int] = ()) -> int:
        return self.inner.draft_len(batch_size, request_ids)

    def would_draft(self, batch_size: int) -> bool:
        return self.inner.would_draft(batch_size)

    def ragged_step_times(self, batch_size: int, most: int) -> list[float]:
        """t / t(0) of a ragged step (`chain_step.verify_ragged`) at this batch size verifying n drafts in all (each
        row its own k), for n = 0..most. Fewer than one a row: the plain step plus what n more token rows cost the
        batch-1 steps of the profile, t(B, 0) + t₁(B − 1 + n) − t₁(B − 1) (t₁(j): batch 1 verifying j drafts; B + n
        token rows either way), which keeps the linear kernels' cost per row count — a CPU kernel that unpacks the
        weights once per chunk of rows makes the first row past a chunk dearer than the next ones, which the uniform
        times between k = 0 and k = 1 underprice. Elsewhere (or without those batch-1 times): linear between the
        uniform draft lengths around n / B (`relative_step_time`)."""
        b = batch_size
        uniform = [self.relative_step_time(b, k) for k in range(most // b + 2)]
        out = [uniform[q] + (uniform[q + 1] - uniform[q]) * r / b for q, r in (divmod(n, b) for n in range(most + 1))]
        t0, ones = self.step_time.get(self._bucket(b), {}).get(0), self.step_time.get(1, {})
        if t0 and 0 in ones:
            reach = min(most, b - 1, max(ones) - (b - 1))  # n < B, and t₁ timed that far
            if reach > 0:
                t1 = [self.relative_step_time(1, j) * ones[0] for j in range(b - 1, b + reach)]
                out[1:reach + 1] = [1.0 + (t - t1[0]) / t0 for t in t1[1:]]
        return out


def choose_draft_len_policy(spec: DecodingBaseConfig | MedusaDecodingConfig | None, num_draft_tokens: int,
                            gain: Gain = expected_tokens,
                            step_profile: Mapping[int, Mapping[int, float]] | None = None,
                            proposes: bool = False) -> DraftLenPolicy:
    """The draft-length policy for this speculative config (chosen once, at load time); `gain` is the drafter's
    expected tokens per step at (α, draft length) (`Drafter.expected_tokens`), the adaptive policy's model;
    `step_profile` the engine's measured step times {bucket: {k: seconds}} (speculative/step_profile.py), which the
    adaptive policy starts from instead of measuring them; `proposes`: the drafter chooses each step's length from
    its own proposals given step times (`Proposer.set_step_times`), so `adaptive_draft_len` is a `ProposalDraftLen`.

    Medusa verifies its whole tree every step (its width is the tree's, not a draft length): static.

    Raises:
        LlmArgsError: a schedule entry with a threshold < 1 or a draft length outside [0, K].
    """
    if not isinstance(spec, DecodingBaseConfig):
        return StaticDraftLen(num_draft_tokens)
    schedule = spec.draft_len_schedule
    bad = {b: k for b, k in (schedule or {}).items() if b < 1 or not 0 <= k <= num_draft_tokens}
    if bad:
        raise LlmArgsError(f"speculative_config.draft_len_schedule {bad}: thresholds must be ≥ 1 and draft lengths "
                           f"in [0, the max draft length {num_draft_tokens}]")
    policy: DraftLenPolicy = StaticDraftLen(num_draft_tokens)
    if schedule or spec.max_concurrency is not None:
        policy = BatchSizeDraftLen(num_draft_tokens, schedule, spec.max_concurrency)
    if spec.acceptance_rate_window_size and spec.acceptance_rate_threshold is not None:
        policy = AcceptanceGate(policy, spec.acceptance_rate_window_size, spec.acceptance_rate_threshold)
    if spec.adaptive_draft_len:
        policy = (ProposalDraftLen if proposes else AdaptiveDraftLen)(policy, gain=gain, profile=step_profile)
    return policy
