"""Suffix decoding under load, replayed: recorded greedy outputs through `SuffixDrafter` at C concurrent requests,
each step's draft lengths chosen as the engine chooses them (ragged: `proposal_lens` over the step profile), priced
with the engine's measured step times — the decision quality of the draft-length choice, without the model or the
server's noise (a benchmark, not a test).

    clients      C closed-loop clients: a request starts when one finishes (its prompt and first output token into
                 the drafter, as a prefill), the streams in order; prefill time is not counted (the same for both)
    a step       the B running requests' k_r from `proposal_lens(slots, K)`; row r accepts the longest prefix of
                 its first k_r drafts equal to the recorded output, emits it plus one token (the engine's greedy
                 step exactly) and costs the profile's ragged-step time of Σ k_r drafts at batch B
                 (`ProposalDraftLen.ragged_step_times`; t(B, 0) interpolated between measured B)
    plain        the same clients decoding one token per step at t(B, 0)
    reported     per C and pass: predicted output speed over plain, verified rows per step, and the accepted over
                 the calibrated predicted drafts of the rows verified (1.0: the calibration is right where it acts)

Streams and the profile as `bench.suffix_replay` (its --output_dir keeps streams.json):

    python -m benchmarks.suffix_load_replay --streams runs/suffix_replay_mt/streams.json \\
        --step_profile ~/.cache/nextn/step_profiles/step-profile-<engine>.json --concurrency 1 2 4 8 --passes 2
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from pathlib import Path

from benchmarks.suffix_replay import Stream, accepted_prefix
from nextn.speculative.suffix import SuffixDrafter

MAX_CONCURRENCY = 64
StepTime = Callable[[int, float], float]  # (batch, mean verified drafts per row) → seconds
RaggedTimes = Callable[[int, int], list[float]]  # (batch, most) → t / t(B, 0) verifying n = 0..most drafts in all


def profile_step_time(profile_file: Path, max_draft_len: int) -> tuple[StepTime, RaggedTimes]:
    """t(B, k) seconds from a step profile: the adaptive policy's interpolation between measured k (relative to
    t(B, 0)), t(B, 0) linear between measured batch sizes (the nearest beyond them); and the engine's relative
    times of ragged steps (`ProposalDraftLen.ragged_step_times`).

    Raises:
        StepProfileError: not a step profile (speculative/step_profile.py).
    """
    from nextn.speculative.draft_len_policy import ProposalDraftLen, StaticDraftLen
    from nextn.speculative.step_profile import load_step_profile

    times = load_step_profile(profile_file).step_time
    policy = ProposalDraftLen(StaticDraftLen(max_draft_len), profile=times)
    batches = sorted(times)

    def base(b: int) -> float:
        lo = max([x for x in batches if x <= b], default=batches[0])
        hi = min([x for x in batches if x >= b], default=batches[-1])
        if lo == hi:
            return times[lo][0]
        return times[lo][0] + (times[hi][0] - times[lo][0]) * (b - lo) / (hi - lo)

    def t(b: int, k: float) -> float:
        whole = int(k)
        r0 = policy.relative_step_time(b, whole)
        r = r0 if k == whole else r0 + (policy.relative_step_time(b, whole + 1) - r0) * (k - whole)
        return base(b) * r

    return t, policy.ragged_step_times


def replay_under_load(streams: Sequence[Stream], drafter: SuffixDrafter, concurrency: int, passes: int,
                      step_time: StepTime, ragged: RaggedTimes | None = None) -> list[dict]:
    """The streams through `drafter` by `concurrency` closed-loop clients, `passes` times (module docstring); the
    drafter must have step times (`set_step_times`); `ragged` prices a step by its drafts in all (else t(B, mean k)).
    Returns one dict per pass."""
    k_max = drafter.num_draft_tokens
    out = []
    for passno in range(1, passes + 1):
        queue, free = list(range(len(streams))), list(range(concurrency))
        active: dict[int, list] = {}  # slot → [stream index, output position, drafts]
        spec_s = tokens = steps = rows = accepted = 0
        predicted = 0.0
        while queue or active:
            while queue and free:
                slot, j = free.pop(0), queue.pop(0)
                prompt, output = streams[j]
                active[slot] = [j, 1, drafter.prefilled([slot], [0], [list(prompt) + output[:1]])[0]]
            slots = sorted(active)
            lens = drafter.proposal_lens(slots, k_max)
            firsts, emitted = [], []
            for slot, k in zip(slots, lens):
                j, i, drafts = active[slot]
                prompt, output = streams[j]
                if k:
                    s = drafter.slots[slot]
                    predicted += s.gains[min(k, s.useful) - 1]
                a = accepted_prefix(drafts[:k], output[i:])
                firsts.append(len(prompt) + i)
                emitted.append(output[i:i + a + 1])
                accepted += len(emitted[-1]) - 1
            n = sum(lens)
            spec_s += (step_time(len(slots), 0.0) * ragged(len(slots), n)[n] if ragged is not None
                       else step_time(len(slots), n / len(slots)))
            steps, rows = steps + 1, rows + sum(lens)
            for slot, tok, drafts in zip(slots, emitted, drafter.verified(slots, firsts, emitted, lens)):
                active[slot][1] += len(tok)
                active[slot][2] = drafts
                tokens += len(tok)
                if active[slot][1] >= len(streams[active[slot][0]][1]):
                    del active[slot]
                    free.append(slot)
        out.append({"concurrency": concurrency, "pass": passno, "tokens": tokens, "steps": steps,
                    "predicted_speedup": round(_plain_time(streams, concurrency, step_time) / spec_s, 3),
                    "verified_rows_per_step": round(rows / steps, 2),
                    "accepted_over_predicted": round(accepted / predicted, 3) if predicted else None})
    return out


def _plain_time(streams: Sequence[Stream], concurrency: int, step_time: StepTime) -> float:
    """Seconds for the clients to decode every stream one token a step (after each prefill's token)."""
    left, running, total = [len(o) - 1 for _, o in streams], [], 0.0
    while left or running:
        while left and len(running) < concurrency:
            running.append(left.pop(0))
        running = [n for n in running if n > 0]
        if not running:
            continue
        total += step_time(len(running), 0.0)
        running = [n - 1 for n in running if n > 1]
    return total


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.suffix_load_replay", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=Path, required=True, help="streams.json written by bench.suffix_replay")
    p.add_argument("--step_profile", type=Path, required=True, help="the engine's step profile JSON")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--passes", type=int, default=2, help="replays of all requests (pass 2+: global trees warm)")
    p.add_argument("--max_draft_len", type=int, default=16, help="K (default 16, configs/suffix.yaml's)")
    args = p.parse_args(argv)
    if not all(1 <= c <= MAX_CONCURRENCY for c in args.concurrency) or not 1 <= args.passes <= 5:
        p.error(f"--concurrency must be in 1..{MAX_CONCURRENCY} and --passes in 1..5")
    if not 1 <= args.max_draft_len <= 64:
        p.error("--max_draft_len must be in 1..64")
    try:
        streams = [(list(a), list(b)) for a, b in json.loads(args.streams.read_text())["streams"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        p.error(f"--streams {args.streams} is not a streams.json of bench.suffix_replay ({e})")
    step_time, ragged = profile_step_time(args.step_profile, args.max_draft_len)
    print("concurrency pass  predicted ×plain  verified rows/step  accepted/predicted")
    for c in args.concurrency:
        drafter = SuffixDrafter(args.max_draft_len)
        drafter.set_step_times(lambda b, k: step_time(b, k) / step_time(b, 0.0), ragged)
        for r in replay_under_load(streams, drafter, c, args.passes, step_time, ragged):
            ratio = "—" if r["accepted_over_predicted"] is None else f"{r['accepted_over_predicted']:.2f}"
            print(f"{c:11d} {r['pass']:4d} {r['predicted_speedup']:16.3f} {r['verified_rows_per_step']:19.2f} "
                  f"{ratio:>19s}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
