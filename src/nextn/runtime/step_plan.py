"""`StepPlan` (a `PrefillPlan` or a `DecodePlan`): the scheduler → runner contract for one step, data only (vLLM's
`SchedulerOutput`).

The scheduler builds one per step from its requests; the model runner reads nothing else. The same object is what
rank 0 of a tensor-parallel engine broadcasts to the other ranks (distributed/mirror.py), so every rank launches
exactly the same step. It holds plain ints, floats and tuples: no live `Request`, nothing mutable, picklable.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from nextn.runtime.logits_processors import build_processing
from nextn.runtime.request import Request
from nextn.speculative.logits_processing import LogitsProcessing


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanRows:
    """What every step's plan has, per row (request, in batch order).

    Attributes:
        step_id: the scheduler's count of the plans it has made (it keys the plan's requests there).
        request_ids: [B] each row's request id (the overlap scheduler matches rows of consecutive steps by it).
        batch_slots: [B] each row's batch slot (its row in the drafter and acceptance state buffers).
        block_tables: [B] each row's KV block ids (unpadded).
        temperature, top_k, top_p, seeds: [B] each row's sampling parameters and seed.
        drafting: whether the step drafts (see each plan).
        processing: the rows' logit processing (penalties, bias, min_tokens, grammar masks;
            runtime/logits_processors.py) for each position the step samples; None when no row needs any. Tensors:
            still data only.
        num_logprobs: the most top log-probabilities a row asks for; −1 when none asks for log-probabilities.
    """

    step_id: int
    request_ids: tuple[int, ...]
    batch_slots: tuple[int, ...]
    block_tables: tuple[tuple[int, ...], ...]
    temperature: tuple[float, ...]
    top_k: tuple[int, ...]
    top_p: tuple[float, ...]
    seeds: tuple[int, ...]
    drafting: bool
    processing: LogitsProcessing | None = None
    num_logprobs: int = -1

    @property
    def num_requests(self) -> int:
        return len(self.request_ids)


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefillPlan(PlanRows):
    """A prefill step: prompt chunks (`PlanRows` per row, and these).

    Attributes:
        drafting: False when the draft-length policy would not speculate at the running batch's size: the drafter
            writes its KV but drafts nothing.
        token_ids: [B] each row's whole sequence (its chunk, the token after it, a reused prefix).
        prefill_lens: [B] tokens the row's admission prefills (`Progress.prefill_len`).
        chunk_starts, chunk_ends: [B] each row runs its tokens [start, end); the chunk with end ≥ prefill_len is its
            last and emits the first token.
        num_reused: [B] tokens the row reuses from the prefix cache when this chunk is the first of its admission,
            else 0; the drafter's per-request state is rebuilt for them (`Drafter.load_prefix`).
    """

    token_ids: tuple[tuple[int, ...], ...]
    prefill_lens: tuple[int, ...]
    chunk_starts: tuple[int, ...]
    chunk_ends: tuple[int, ...]
    num_reused: tuple[int, ...]

    @property
    def kind(self) -> Literal["prefill"]:
        return "prefill"

    def is_last_chunk(self, row: int) -> bool:
        return self.chunk_ends[row] >= self.prefill_lens[row]

    @classmethod
    def build(cls, step_id: int, reqs: tuple[Request, ...], starts: tuple[int, ...], ends: tuple[int, ...],
              num_reused: tuple[int, ...], drafting: bool) -> PrefillPlan:
        """Prompt chunks [starts[i], ends[i]) of `reqs`."""
        return cls(step_id=step_id, **_rows(reqs), drafting=drafting,
                   token_ids=tuple(tuple(r.all_token_ids) for r in reqs),
                   prefill_lens=tuple(r.progress.prefill_len for r in reqs), chunk_starts=starts, chunk_ends=ends,
                   num_reused=num_reused, processing=_processing(reqs, 0), num_logprobs=_num_logprobs(reqs))


@dataclass(frozen=True, slots=True, kw_only=True)
class DecodePlan(PlanRows):
    """A decode step: one verify-and-draft step per request (`PlanRows` per row, and these).

    Attributes:
        draft_len: drafts each row verifies (the draft-length policy's choice, ≤ K).
        drafting: whether the step drafts for the next one: False when speculation is off (draft_len 0): plain
            decoding, at no more cost. A request whose last step did not draft first runs one step with draft_len 0
            and drafting on when speculation comes back on (it has no drafts to verify).
        kv_lens: [B] each row's KV length on the host (the step writes at kv_len..kv_len+draft_len).
        input_ids: [B, draft_len + 1] each row's `[last emitted, d1..d_draft_len]` (missing drafts 0).
        catch_up_starts: () when no row catches up: [B] the first position whose drafter KV a row lacks (prefilled
            or decoded while speculation was off, by a drafter whose KV is written later: `DraftKV.FROM_TOKENS`),
            −1 for a row that lacks none. The runner has the drafter write positions catch_up_starts[b] .. the
            row's kv_len before the step.
        catch_up_ids: [B] the tokens at those positions that the host knows (all but the last: the step's input
            token, which with the overlap scheduler may still be in flight; the runner takes it from the inputs).
        draft_lens: () when every row verifies draft_len: [B] the drafts each row verifies, ≤ draft_len = their
            maximum (a ragged step: `chain_step.verify_ragged`; input_ids keep draft_len + 1 columns).
        num_drafts: the drafts the step makes for the next one, in [1, K], for a drafter that drafts on demand
            (`DraftSchedule.on_demand`; the policy's draft length); None: the drafter's K.
    """

    draft_len: int
    kv_lens: tuple[int, ...]
    input_ids: tuple[tuple[int, ...], ...]
    catch_up_starts: tuple[int, ...] = ()
    catch_up_ids: tuple[tuple[int, ...], ...] = ()
    draft_lens: tuple[int, ...] = ()
    num_drafts: int | None = None

    @property
    def kind(self) -> Literal["decode"]:
        return "decode"

    @classmethod
    def build(cls, step_id: int, reqs: tuple[Request, ...], draft_len: int, drafting: bool, catch_up: bool = False,
              draft_lens: tuple[int, ...] = (), num_drafts: int | None = None) -> DecodePlan:
        """One verify-and-draft step of `reqs`, verifying `draft_len` of each one's drafts (`draft_lens`: row i
        only its first draft_lens[i], draft_len their maximum) and drafting `num_drafts` (None: K); with
        `catch_up`, the rows whose drafter KV has a gap (`Progress.drafter_gap`) have the drafter write it first."""
        starts, ids = (zip(*[_catch_up(r) for r in reqs])) if catch_up else ((), ())
        pad = [0] * draft_len
        kv_lens = tuple(r.kv_len for r in reqs)
        input_ids = tuple((r.last_token_id, *(r.draft_tokens + pad)[:draft_len]) for r in reqs)
        return cls(step_id=step_id, **_rows(reqs), draft_len=draft_len, drafting=drafting, kv_lens=kv_lens,
                   input_ids=input_ids, processing=_processing(reqs, draft_len, input_ids),
                   num_logprobs=_num_logprobs(reqs), catch_up_starts=tuple(starts), catch_up_ids=tuple(ids),
                   draft_lens=draft_lens, num_drafts=num_drafts)


#: One step's plan: the scheduler → runner contract.
StepPlan = PrefillPlan | DecodePlan


def _catch_up(req: Request) -> tuple[int, tuple[int, ...]]:
    """(first position without drafter KV or −1, the host's tokens from there up to the step's input token).

    The step's input token sits at position kv_len, or kv_len + 1 while a step that emits it is in flight (a
    step that does not draft emits exactly one token)."""
    gap = req.progress.drafter_gap
    if gap is None:
        return -1, ()
    end = req.kv_len + (1 if req.progress.num_inflight_tokens else 0)
    return gap, tuple(req.all_token_ids[gap:end])


def _processing(reqs: tuple[Request, ...], draft_len: int, input_ids: tuple = ()) -> LogitsProcessing | None:
    """The processed rows' `LogitsProcessing` over draft_len + 1 positions (a prefill: its last row only)."""
    rows = [(i, r.processor, input_ids[i][1:] if input_ids else ()) for i, r in enumerate(reqs)
            if r.processor is not None]
    return build_processing(rows, draft_len + 1) if rows else None


def _num_logprobs(reqs: tuple[Request, ...]) -> int:
    return max((r.params.logprobs for r in reqs if r.params.logprobs is not None), default=-1)


def _rows(reqs: tuple[Request, ...]) -> dict[str, Any]:
    """The per-row fields every plan has, from request_ids to seeds (one tuple per field), by name."""
    return {"request_ids": tuple(r.request_id for r in reqs), "batch_slots": tuple(r.batch_slot for r in reqs),
            "block_tables": tuple(tuple(r.block_table) for r in reqs),
            "temperature": tuple(r.params.temperature for r in reqs), "top_k": tuple(r.params.top_k for r in reqs),
            "top_p": tuple(r.params.top_p for r in reqs), "seeds": tuple(r.seed for r in reqs)}
