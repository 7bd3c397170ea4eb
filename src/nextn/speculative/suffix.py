"""Suffix decoding: the next K tokens are guessed from suffix trees — one over the request's own prompt and output,
one over earlier requests' outputs — by following the most frequent continuation of the longest matching context
suffix. No draft model, no training: it pays off where outputs repeat (agent loops, code edits, structured output).

Sources: Oliaro et al., "SuffixDecoding: Extreme Speculative Decoding for Emerging AI Applications", NeurIPS 2025
(arXiv 2411.04975); Snowflake Arctic Inference's suffix decoding (the algorithm, not the code) and vLLM's
`method: suffix` (the option names). The trees and the proposal rule are in suffix_tree.py.

    per request  a tree over its prompt + output (tokens by absolute position, per batch slot)
    global       a tree over earlier requests' outputs (prompts excluded, as in Arctic), at most
                 suffix_decoding_max_cached_requests of them, the oldest evicted first
    each step    the emitted tokens go into the request's tree; both trees propose (SuffixTree.propose) and the
                 higher score — the expected number of accepted drafts — wins (Arctic's rule; ties: the request's)
    short        a proposal under K tokens is padded with its last token (the sequence's last token when empty):
                 padded drafts are rejected harmlessly
    how many     the step verifies as many drafts as the longest proposal in the batch (`proposal_len`, ≥ 1),
                 so K can be large: a long copied stretch is verified in a few steps, a step with nothing to copy
                 verifies one draft. Given the engine's step times (`set_step_times`: `adaptive_draft_len`, best
                 with a step profile) it verifies instead the k in 0..K of the most expected tokens per second,
                 Σ_r (1 + G_r(k)) / t(B, k) — G_r(k) row r's calibrated expected accepted drafts among its first k —
                 or, in a ragged step, each row's own k_r (`proposal_lens`), so a batch whose rows cost a plain
                 step each (a CPU at batch 8) verifies only what pays, down to none (the trees still see every token)
    calibration  G_r from the tree's path probabilities through a calibration pooled over the engine's requests
                 by match length and draft index (suffix_calibration.py: a short match's drafts miss more than
                 the counts say, a long match's less, deep drafts much more), times the request's own factor c_r:
                 c_r starts at 1 with each request and follows an EMA of its accepted over pooled-predicted drafts
                 on the steps that verified its proposal; on a step that did not (k = 0) it moves back toward 1, and
                 the pooled evidence of an unverified proposal fades, so a request (or a workload change) whose
                 proposals once missed is tried again and never locked out of speculation by stale evidence

The drafter runs on the host, its tries in nextn's C++ where the extension builds (suffix_tree.py's
`new_suffix_tree`): `after_prefill` / `after_verify` read the step's tokens back (`.tolist()`), so the
step cannot be captured in a CUDA graph or compiled with fullgraph, and `build` accepts CPU engines only.
Drafts are deterministic: the acceptance rule sees one-hot q (strict for greedy requests, rejection sampling for
sampling ones), so greedy output is token-identical to plain decoding and sampled output keeps its distribution.

Rows map to requests through the drafter state: `initial_state` is the slot ids (arange), which the runner gathers
per row. Each slot's tokens are written by absolute position (prefill chunks at their positions, emitted tokens
after the verified position L), so re-runs are idempotent; an unknown gap (steps run with speculation off) starts
a new segment of the request's tree, and a rewrite of a known position rebuilds it.

A request's end is not signalled to drafters: a slot's previous sequence goes to the global tree when the slot
starts a new one (a prefill at position 0, or `load_prefix`). Its output is then complete — plus, under the
overlap scheduler, the up to K + 1 tokens a step in flight emitted past its stop, and after a preemption a
partial output (both are the target's own continuations, so at worst they add likely-wrong counts). An output
reaches the global tree only when its slot is reused.

Threading: the trees are mutated only inside the engine's step (after_prefill, after_verify, load_prefix), which
one engine thread drives; nothing here is safe to call concurrently.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from nextn.config.llm_args import LlmArgsError, SuffixDecodingConfig
from nextn.speculative.acceptance_rules import StandardAcceptance
from nextn.speculative.chain_step import LinearDrafter
from nextn.speculative.draft_gain import MIN_GAIN
from nextn.speculative.traits import DrafterTraits, DraftLenSource
from nextn.speculative.method import LoadContext, Method, from_build_yaml
from nextn.speculative.protocol import NO_CONTEXT, NO_PREFILL, AcceptanceRule, Drafter, DrafterState, rows_at
from nextn.speculative.suffix_calibration import AcceptanceCalibration
from nextn.speculative.suffix_combined import CombinedDrafter
from nextn.speculative.suffix_tree import OutputCache, new_suffix_tree

logger = logging.getLogger(__name__)

_UNKNOWN = -1  # a position whose token the drafter did not see (never a token id)


class _Slot:
    """One batch slot's request: its tokens by position, its own tree, its matches in both trees."""

    __slots__ = ("tokens", "prompt_len", "tree", "segment", "segment_start", "ends", "global_ends", "global_version",
                 "useful", "score", "probs", "match_len", "gains", "calibration")

    def __init__(self, depth: int) -> None:
        self.tokens: list[int] = []
        self.prompt_len = 0  # positions written as prefill inputs; the output follows
        self.tree = new_suffix_tree(depth)
        self.segment = 0  # the tree's sequence id for the tokens since the last gap
        self.segment_start = 0
        self.ends: list[int] = []  # matches of the context in `tree`
        self.global_ends: list[int] = []  # ... and in the global tree, valid at its `global_version`
        self.global_version = -1
        self.useful = 0  # drafts of the last proposal (the rest of the K are padding)
        self.score = 0.0  # its score: the trees' expected number of accepted drafts
        self.probs: list[float] = []  # each draft's path probability in its tree
        self.match_len = 0  # the context match it continues
        self.gains: list[float] = []  # gains[j]: the calibrated expected accepted drafts of verifying its first j + 1
        self.calibration = 1.0  # this request's accepted drafts per pooled prediction (module docstring)

    def output_segments(self) -> list[list[int]]:
        """The output's runs of known tokens."""
        runs: list[list[int]] = []
        run: list[int] = []
        for t in self.tokens[self.prompt_len:]:
            if t == _UNKNOWN:
                runs.append(run)
                run = []
            else:
                run.append(t)
        return [r for r in runs + [run] if r]


class SuffixDrafter(LinearDrafter):
    """Suffix-tree drafting over each request's prompt and output and earlier outputs (module docstring).

    Host-side state: `slots` (batch slot → its request's tokens and tree) and `outputs` (the global tree). The
    device state is only the slot ids [max_batch_size] int64.
    """

    name = "Suffix"
    traits = DrafterTraits(draft_len=DraftLenSource.PROPOSAL_PER_ROW)

    def __init__(self, num_draft_tokens: int, max_tree_depth: int = 24, max_cached_requests: int = 1000,
                 max_spec_factor: float = 1.0, min_token_prob: float = 0.1) -> None:
        self.num_draft_tokens = self.max_draft_depth = num_draft_tokens
        self.depth = max_tree_depth
        self.spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self.outputs = OutputCache(max_tree_depth, max_cached_requests)
        self.pooled = AcceptanceCalibration()  # every request's verified drafts, by match length and draft index
        self.slots: dict[int, _Slot] = {}
        self.step_time: Callable[[int, int], float] | None = None  # (batch, k) → t(k) / t(0); None: longest
        self.ragged_step_times: Callable[[int, int], list[float]] | None = None  # (batch, most) → t / t(0) by Σ k_r

    @classmethod
    def from_config(cls, spec: SuffixDecodingConfig) -> "SuffixDrafter":
        return cls(spec.max_draft_len, spec.suffix_decoding_max_tree_depth, spec.suffix_decoding_max_cached_requests,
                   spec.suffix_decoding_max_spec_factor, spec.suffix_decoding_min_token_prob)

    def initial_state(self, batch: int, hidden_size: int, device: torch.device, dtype: torch.dtype) -> DrafterState:
        return (torch.arange(batch, dtype=torch.int64, device=device),)

    def load_prefix(self, state: DrafterState, slot: int, token_ids: list[int]) -> None:
        """A prefix-cache hit starts a request in `slot` with the reused tokens (positions 0..n−1)."""
        s = self._start(slot)
        self._write(s, 0, token_ids)
        s.prompt_len = len(token_ids)

    calibration_smoothing = 0.1  # the EMA's weight of a verified step
    calibration_recovery = 0.05  # how far c_r moves back toward 1 on a step that did not verify its proposal

    def set_step_times(self, step_time: Callable[[int, int], float],
                       ragged_step_times: Callable[[int, int], list[float]] | None = None) -> None:
        """Hint by expected tokens per second from now on; `step_time(batch, k)`: a step's time over a plain one;
        `ragged_step_times(batch, most)`: a ragged step's verifying n = 0..most drafts in all (None: linear between
        the uniform step times around n / batch)."""
        self.step_time, self.ragged_step_times = step_time, ragged_step_times

    def proposal_len(self, slots: list[int]) -> int:
        """Without step times: the longest proposal among these slots' requests (their drafts past it are padding),
        at least 1: a copied stretch is verified as far as the trees predict it, a step with nothing to copy verifies
        one draft. With them: argmax over k in 0..longest of Σ_r (1 + G_r(k)) / t(B, k), a k ≥ 1 discounted by
        MIN_GAIN, G_r calibrated (module docstring; ties: the shorter)."""
        rows = [self.slots[s] for s in slots if s in self.slots]
        if not rows:
            return self.num_draft_tokens
        longest = max(r.useful for r in rows)
        step_time = self.step_time
        if step_time is None:
            return max(1, longest)
        batch = len(slots)

        def rate(k: int) -> float:  # a k ≥ 1 discounted by MIN_GAIN: it must pay by that margin
            drafts = sum(r.gains[min(k, r.useful) - 1] for r in rows if r.useful) if k else 0.0
            return (batch + drafts) / step_time(batch, k) / (MIN_GAIN if k else 1.0)

        return max(range(longest + 1), key=lambda k: (rate(k), -k))

    def proposal_lens(self, slots: list[int], cap: int) -> list[int] | None:
        """With step times: each row's own draft length k_r ≤ min(cap, its proposal) (ragged verification), the
        argmax of (B + Σ_r G_r(k_r)) / t(B, Σ_r k_r) — a ragged step priced by `ragged_step_times` (given), else as
        a uniform one with as many verified rows. Drafts are added one at a time where the calibrated gain of the
        next one is highest (a proposal's gains are concave: its path probabilities fall along the chain), and the
        best total is kept
        (ties: fewer rows). Without step times: None (the step verifies one length, `proposal_len`)."""
        if self.step_time is None:
            return None
        batch = len(slots)
        rows = [self.slots.get(s) for s in slots]
        limits = [min(cap, r.useful) if r is not None else 0 for r in rows]
        # every row's next marginal gain, best first: (−gain, row, its index in the row's gains)
        steps = sorted((-(r.gains[j] - (r.gains[j - 1] if j else 0.0)), i, j)
                       for i, (r, n) in enumerate(zip(rows, limits)) if r is not None for j in range(n))
        lens = [0] * batch
        if self.ragged_step_times is not None:
            times = self.ragged_step_times(batch, len(steps))
        else:  # t at each whole k once; between them linear (as the policy interpolates between timed lengths)
            whole = [self.step_time(batch, k) for k in range(max(limits, default=0) + 2)]
            times = [whole[q] + (whole[q + 1] - whole[q]) * r / batch
                     for q, r in (divmod(n, batch) for n in range(len(steps) + 1))]
        best_rate, best_n, gained = batch / times[0], 0, 0.0
        for n, (neg_gain, i, j) in enumerate(steps, 1):
            gained -= neg_gain
            rate = (batch + gained) / times[n] / MIN_GAIN  # verifying any draft must pay by that margin
            if rate > best_rate:
                best_rate, best_n = rate, n
        for _, i, _ in steps[:best_n]:
            lens[i] += 1
        return lens

    def _calibrate(self, s: _Slot, k: int, emitted: int) -> None:
        """The pooled calibration and the request's factor after a step that verified k drafts and emitted
        `emitted` tokens (before its proposal is replaced): the factor follows an EMA of accepted over pooled-
        predicted drafts when k > 0 and steps back toward 1 when its proposal went unverified."""
        if not s.useful:
            return
        k = min(k, s.useful)
        accepted = min(emitted - 1, k)
        if k == 0:
            self.pooled.observe(s.probs, s.match_len, 0, 0)
            s.calibration += self.calibration_recovery * (1.0 - s.calibration)
            return
        predicted = self.pooled.expected(s.probs, s.match_len, k)  # before this step's evidence
        self.pooled.observe(s.probs, s.match_len, k, accepted)
        if predicted > 0:
            ratio = min(max(accepted / predicted, 0.05), 2.0)
            s.calibration += self.calibration_smoothing * (ratio - s.calibration)

    # Host-side updates ------------------------------------------------------------------------------------------
    def _start(self, slot: int) -> _Slot:
        """A new request in `slot`: the previous one's output goes to the global tree."""
        old = self.slots.get(slot)
        if old is not None:
            self.outputs.add(old.output_segments())
        s = self.slots[slot] = _Slot(self.depth)
        return s

    def _write(self, s: _Slot, pos: int, tokens: list[int]) -> None:
        """tokens[i] at position pos + i: known equal ones skipped, a differing one rebuilds from there, a gap
        before `pos` starts a new segment."""
        glob = self.outputs.tree
        if tokens and pos == len(s.tokens):  # the common case, appending: one call per tree
            s.tokens += tokens
            s.ends = s.tree.extend(s.segment, tokens)
            s.global_ends = glob.extend_match_all(s.global_ends, tokens)
            return
        for i, t in enumerate(tokens):
            p, n = pos + i, len(s.tokens)
            if p < n:
                if s.tokens[p] == t:
                    continue
                self._rebuild(s, p)
                n = p
            if p > n:
                s.tokens += [_UNKNOWN] * (p - n)
                s.segment += 1
                s.segment_start, s.ends, s.global_ends = p, [], []
            s.tokens.append(t)
            s.ends = s.tree.extend(s.segment, (t,))
            s.global_ends = glob.extend_match(s.global_ends, t)

    def _rebuild(self, s: _Slot, end: int) -> None:
        """The slot's tree from its tokens before `end` (a known position rewritten: rare)."""
        tokens, prompt_len, calibration = s.tokens[:end], min(s.prompt_len, end), s.calibration
        s.__init__(self.depth)  # type: ignore[misc]  # a _Slot, reset in place (the slot table keeps it)
        s.calibration = calibration
        start = 0
        while start < len(tokens):
            while start < len(tokens) and tokens[start] == _UNKNOWN:
                start += 1
            stop = start
            while stop < len(tokens) and tokens[stop] != _UNKNOWN:
                stop += 1
            self._write(s, start, tokens[start:stop])
            start = stop
        if len(s.tokens) < end:  # it ended in a gap
            s.tokens += [_UNKNOWN] * (end - len(s.tokens))
            s.segment += 1
            s.segment_start, s.ends, s.global_ends = end, [], []
        s.prompt_len = prompt_len

    def _draft(self, s: _Slot) -> list[int]:
        """K drafts for the slot's request: the better proposal of its own tree and the global tree, padded."""
        glob = self.outputs.tree
        if s.global_version != glob.version:  # evictions may have dropped matched nodes
            s.global_ends = glob.match(s.tokens[max(s.segment_start, len(s.tokens) - self.depth):])
            s.global_version = glob.version
        k = self.num_draft_tokens
        best = s.tree.propose(s.ends, k, self.spec_factor, self.min_token_prob)
        if s.global_ends:
            other = glob.propose(s.global_ends, k, self.spec_factor, self.min_token_prob)
            if other.score > best.score:
                best = other
        drafts = best.tokens
        s.useful, s.score, s.match_len = len(drafts), best.score, best.match_len
        s.probs = [g - (best.gains[j - 1] if j else 0.0) for j, g in enumerate(best.gains)]
        s.gains = self.pooled.gains(s.probs, best.match_len, s.calibration)
        pad = drafts[-1] if drafts else s.tokens[-1]
        return drafts + [pad] * (k - len(drafts))

    # The protocol -----------------------------------------------------------------------------------------------
    def after_prefill(self, model, kv_cache, meta, hidden, next_tokens, last_idx, input_ids, state,
                      step=NO_PREFILL):
        draft = step.draft
        b = input_ids.shape[0]
        slots = state[0].tolist() if state else list(range(b))
        lens = (last_idx + 1).tolist()
        after = rows_at(next_tokens, last_idx)[:, 0].tolist()  # the token after each chunk
        chunks = [ids[:n] + [nxt] for ids, n, nxt in zip(input_ids.tolist(), lens, after)]
        rows = self.prefilled(slots, meta.positions[:, 0].tolist(), chunks, draft)
        return torch.tensor(rows, dtype=torch.int64, device=input_ids.device).view(b, -1), state

    def after_verify(self, model, kv_cache, meta, hidden, target_tokens, num_emitted, state, step=NO_CONTEXT):
        draft_lens = step.draft_lens
        b = target_tokens.shape[0]
        slots = state[0].tolist() if state else list(range(b))
        firsts = (meta.positions[:, 0] + 1).tolist()  # where each row's first emitted token lands (L + 1)
        emitted = [t[:n] for t, n in zip(target_tokens.tolist(), num_emitted.tolist())]
        k = target_tokens.shape[1] - 1 if draft_lens is None else draft_lens.tolist()
        rows = self.verified(slots, firsts, emitted, k)
        return torch.tensor(rows, dtype=torch.int64, device=target_tokens.device).view(b, -1), state

    # The same on host lists (the protocol methods above; offline replays, benchmarks/suffix_replay.py) -------------
    def prefilled(self, slots: list[int], starts: list[int], chunks: list[list[int]], draft: bool = True
                  ) -> list[list[int]]:
        """Prefill chunks: slot i's prompt tokens from position starts[i] followed by the token sampled after them
        (a chunk at position 0 starts a new request). Returns each slot's K drafts (zeros when not `draft`)."""
        rows = []
        for slot, start, chunk in zip(slots, starts, chunks):
            s = self._start(slot) if start == 0 or slot not in self.slots else self.slots[slot]
            self._write(s, start, chunk)
            s.prompt_len = start + len(chunk) - 1
            rows.append(self._draft(s) if draft else [0] * self.num_draft_tokens)
        return rows

    def verified(self, slots: list[int], firsts: list[int], emitted: list[list[int]], k: int | list[int]
                 ) -> list[list[int]]:
        """A step that verified `k` drafts of each row (a list: row i's own k[i], a ragged step): slot i emitted
        `emitted[i]` (accepted drafts + one) from position firsts[i]. Updates each request's calibration and returns
        each slot's next K drafts."""
        rows = []
        ks = k if isinstance(k, list) else [k] * len(slots)
        for slot, first, tokens, k_row in zip(slots, firsts, emitted, ks):
            s = self.slots.get(slot) or self._start(slot)
            self._calibrate(s, k_row, len(tokens))
            self._write(s, first, tokens)
            rows.append(self._draft(s))
        return rows

    def useful_drafts(self, slot: int) -> int:
        """How many of the slot's last K drafts the trees proposed (the rest are padding)."""
        s = self.slots.get(slot)
        return s.useful if s is not None else 0


def build(spec: SuffixDecodingConfig, ctx: LoadContext) -> tuple[Drafter, AcceptanceRule]:
    """Suffix-tree drafts (no weights: any CPU engine), verified strictly / by rejection sampling over the
    deterministic drafts.

    Raises:
        LlmArgsError: the engine runs on a GPU (the drafter reads every step's tokens on the host).
    """
    if ctx.device.type != "cpu":
        raise LlmArgsError(f"speculative_config.decoding_type 'Suffix' drafts on the host and runs on CPU engines "
                           f"only; this engine runs on {ctx.device}: use 'NGram' (prompt lookup on the device)")
    drafter = SuffixDrafter.from_config(spec)
    if spec.combine_with is None:
        return drafter, StandardAcceptance()
    assert ctx.build_method is not None  # set by the registry
    inner, rule = ctx.build_method(spec.combine_with)
    return CombinedDrafter(drafter, inner, spec.suffix_decoding_min_score), rule


def prepare_model(model, spec: SuffixDecodingConfig, ctx: LoadContext) -> None:
    """The combined drafter's model drafter's changes to the target (MTP: its draft head cut), if any."""
    if spec.combine_with is not None and ctx.prepare_method is not None:  # (set by the registry)
        ctx.prepare_method(model, spec.combine_with)


METHOD = Method("Suffix", SuffixDecodingConfig, build, from_build_yaml("Suffix"), prepare_model)
