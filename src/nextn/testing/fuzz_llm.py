"""A seeded, time-bounded fuzzer of the `LLM` request API (issue 12): random and mutated bad requests — prompts of
every wrong kind, SamplingParams of wrong types and out-of-range values, aborts of real and made-up ids, and
"poison" requests that make an engine step fail (an injected fault) — thrown at `LLM.add_request` / `LLM.step` /
`LLM.generate` while good requests run.

Checks, every round: each bad input is refused with a named error (`RequestError` / `SamplingParamsError`) or runs
and finishes; each poison request ends with finish_reason "error"; each good request finishes with exactly its
solo output; the KV cache is full again and nothing is left running. Anything else is a failure, recorded.

    python -m nextn.testing.fuzz_llm --seconds 60 [--seed 0] [--engine_dir DIR]

(without --engine_dir a tiny engine is built in a temporary directory).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import random
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from nextn.runtime.request_validation import RequestError
from nextn.runtime.sampling_params import SamplingParams, SamplingParamsError

#: Values a field or a token id should never accept: wrong types, out of range, non-finite.
BAD_VALUES: list[Any] = [-1, -(2**70), 2**31, 2**63, 2**64, 2**70, 10**400, 1.5, 2.0, math.nan, math.inf, -math.inf,
                         True, False, None, "1", "", b"1", [], {}, [1], np.int64(1), np.float32(0.5), 1e-30, 1e308,
                         -0.0, object()]
POISON_SEED = 0xBAD5EED
FIELDS = ["max_tokens", "temperature", "top_k", "top_p", "seed", "end_id", "stop_token_ids", "ignore_eos",
          "detokenize"]


@dataclass
class FuzzReport:
    """Figures of one run (what docs/RELIABILITY.md quotes)."""

    seconds: float = 0.0
    rounds: int = 0
    inputs_tried: int = 0  # bad or mutated inputs and aborts thrown at the API
    clean_errors: int = 0  # refused with a named error, or finished with finish_reason "error" and a message
    accepted: int = 0  # mutated inputs that were valid after all: they ran and finished
    poison_isolated: int = 0  # requests that made a step fail, ended with "error" while the others went on
    good_requests: int = 0
    good_intact: int = 0  # finished with exactly their solo output
    failures: list[str] = field(default_factory=list)

    def summary(self) -> str:
        return (f"fuzz_llm: {self.rounds} rounds in {self.seconds:.1f} s: {self.inputs_tried} bad inputs tried, "
                f"{self.clean_errors} clean errors, {self.accepted} accepted (valid after mutation), "
                f"{self.poison_isolated} failing requests isolated; {self.good_intact}/{self.good_requests} good "
                f"requests intact; {len(self.failures)} failures")


class _Fuzzer:
    def __init__(self, llm, rng: random.Random, report: FuzzReport) -> None:
        self.llm, self.rng, self.report = llm, rng, report
        self.vocab = llm.engine.cfg.vocab_size
        self.max_seq_len = llm.engine.max_seq_len
        self.has_tokenizer = llm.engine.tokenizer is not None
        r = random.Random(1234)  # the good requests are the same whatever the seed
        self.good = []
        for i in range(6):
            prompt = [r.randrange(2, self.vocab) for _ in range(r.randrange(2, 10))]
            temp = 0.0 if i % 2 == 0 else r.choice([0.7, 1.0])
            params = SamplingParams(max_tokens=r.randrange(6, 14), temperature=temp, top_k=r.choice([0, 5]),
                                    seed=1000 + i, ignore_eos=True)
            self.good.append((prompt, params))
        self.solo = [llm.generate(p, sp).outputs[0] for p, sp in self.good]

    # Inputs -------------------------------------------------------------------------------------------------
    def bad_prompt(self) -> Any:
        rng, good = self.rng, list(self.rng.choice(self.good)[0])
        kind = rng.randrange(9)
        if kind == 0:  # one id replaced by a bad value
            good[rng.randrange(len(good))] = rng.choice(BAD_VALUES + [self.vocab, self.vocab + 1])
            return good
        if kind == 1:
            raw = bytes(t % 256 for t in good)
            return rng.choice([[], (), "", b"", raw, bytearray(raw), np.array(good), good[0], None, {}, [good],
                               [[1, 2]], {"ids": good}])
        if kind == 2:
            return [1] * rng.choice([self.max_seq_len - 1, self.max_seq_len, self.max_seq_len * 50])
        if kind == 3:
            return rng.choice(["\ud800", "ok\udfff", "a" * (self.max_seq_len * 10_000), "text " * 3, "\x00"])
        if kind == 4:
            return tuple(good)  # valid
        if kind == 5:
            return [float(t) for t in good]
        if kind == 6:
            return [bool(t % 2) for t in good]
        if kind == 7:
            return [np.int32(t) for t in good]
        return [rng.randrange(-(2**64), 2**64) for _ in range(rng.randrange(1, 5))]

    def bad_params(self) -> Any:
        rng = self.rng
        base = dict(rng.choice(self.good)[1].model_dump())
        kind = rng.randrange(5)
        if kind == 0:
            return {"not": "params"}
        if kind == 1:  # skips validation: the engine must check again
            name = rng.choice(FIELDS)
            return SamplingParams.model_construct(**{**base, name: rng.choice(BAD_VALUES)})
        for _ in range(rng.randrange(1, 3)):
            name = rng.choice(FIELDS)
            base[name] = rng.choice(BAD_VALUES + [self.vocab, self.vocab + 1, 2**31 - 1, self.max_seq_len + 1,
                                                  list(range(2000)), [self.vocab]])
        if kind == 4:
            base[rng.choice(["top_q", "n", "best_of"])] = 1
        return base  # kwargs for SamplingParams(**base)

    # One round ----------------------------------------------------------------------------------------------
    def throw(self, inflight_extra: list[int]) -> None:
        """One bad input at add_request (or SamplingParams, or an abort)."""
        rep, rng = self.report, self.rng
        rep.inputs_tried += 1
        what = rng.randrange(4)
        try:
            if what == 0:  # an abort of a made-up or accepted id
                rid = rng.choice([-1, 10**30, "x", None, 3.5, *inflight_extra]) if inflight_extra or rng.random() < .5 \
                    else rng.choice([-1, 10**30, "x", None])
                out = self.llm.abort_request(rid)
                if rid in inflight_extra:
                    inflight_extra.remove(rid)
                if out is None or out.outputs[0].finish_reason == "cancelled":
                    rep.clean_errors += out is None
                    rep.accepted += out is not None
                else:
                    rep.failures.append(f"abort({rid!r}) returned {out.outputs[0].finish_reason}")
                return
            if what == 1:
                prompt, params = self.bad_prompt(), rng.choice(self.good)[1]
            else:
                prompt, params = rng.choice(self.good)[0], self.bad_params()
                if isinstance(params, dict) and "not" not in params:
                    params = SamplingParams(**params)
            rid = self.llm.add_request(prompt, params)
            rep.accepted += 1
            inflight_extra.append(rid)
        except (RequestError, SamplingParamsError) as e:
            if str(e):
                rep.clean_errors += 1
            else:
                rep.failures.append(f"{type(e).__name__} without a message")
        except Exception as e:  # noqa: BLE001 - anything else is a finding
            rep.failures.append(f"unclean {type(e).__name__}: {str(e)[:200]}")

    def round(self, inject: bool) -> None:
        rep, rng, llm = self.report, self.rng, self.llm
        chosen = rng.sample(range(len(self.good)), rng.randrange(1, 4))
        ids = {}
        extra: list[int] = []
        poison: list[int] = []
        for i in chosen:
            for _ in range(rng.randrange(0, 3)):
                self.throw(extra)
            ids[llm.add_request(*self.good[i])] = i
        if inject and rng.random() < 0.5:
            rep.inputs_tried += 1
            poison.append(llm.add_request([5, 6, 7], SamplingParams(max_tokens=8, temperature=1.0, seed=POISON_SEED)))
        outs = {}
        steps = 0
        while llm.has_unfinished_requests:
            steps += 1
            if steps > 500:
                rep.failures.append("a round did not finish in 500 steps")
                break
            if rng.random() < 0.3:
                self.throw(extra)
            for out in llm.step():
                outs[out.request_id] = out
        for rid, i in ids.items():
            rep.good_requests += 1
            got, want = outs.get(rid), self.solo[i]
            if got is not None and got.outputs[0].token_ids == want.token_ids \
                    and got.outputs[0].finish_reason == want.finish_reason:
                rep.good_intact += 1
            else:
                rep.failures.append(f"good request {i} differs from its solo run: "
                                    f"{None if got is None else got.outputs[0]}")
        for rid in poison:
            out = outs.get(rid)
            if out is not None and out.outputs[0].finish_reason == "error" and out.outputs[0].error:
                rep.poison_isolated += 1
                rep.clean_errors += 1
            else:
                rep.failures.append(f"poison request ended {None if out is None else out.outputs[0].finish_reason}")
        for rid in extra:
            if rid not in outs:
                rep.failures.append(f"accepted request {rid} never finished")
        self.check_idle()

    def generate_round(self) -> None:
        """LLM.generate with bad prompts and params mixed into good ones."""
        rep, rng = self.report, self.rng
        chosen = rng.sample(range(len(self.good)), 2)
        prompts, params, good_at = [], [], {}
        for i in chosen:
            good_at[len(prompts)] = i
            prompts.append(self.good[i][0])
            params.append(self.good[i][1])
            for _ in range(rng.randrange(1, 3)):
                rep.inputs_tried += 1
                if rng.random() < 0.5:
                    prompts.append(self.bad_prompt())
                    params.append(self.good[i][1])
                else:
                    bad = self.bad_params()
                    try:
                        bad = SamplingParams(**bad) if isinstance(bad, dict) and "not" not in bad else bad
                    except SamplingParamsError:
                        rep.clean_errors += 1
                        continue
                    prompts.append(self.good[i][0])
                    params.append(bad)
        try:
            outs = self.llm.generate(prompts, params)
        except Exception as e:  # noqa: BLE001
            rep.failures.append(f"generate raised {type(e).__name__}: {str(e)[:200]}")
            return
        for j, out in enumerate(outs):
            c = out.outputs[0]
            if j in good_at:
                rep.good_requests += 1
                want = self.solo[good_at[j]]
                if c.token_ids == want.token_ids and c.finish_reason == want.finish_reason:
                    rep.good_intact += 1
                else:
                    rep.failures.append(f"good prompt {good_at[j]} in generate differs from its solo run")
            elif c.finish_reason == "error" and c.error:
                rep.clean_errors += 1
            elif c.finish_reason in ("length", "stop"):
                rep.accepted += 1
            else:
                rep.failures.append(f"bad prompt {j} ended {c.finish_reason}")
        self.check_idle()

    def check_idle(self) -> None:
        engine = self.llm.engine
        if engine.has_work or engine.pool.num_free != engine.pool.num_blocks - 1:
            self.report.failures.append(f"KV cache not full after a round: {engine.pool.num_free} of "
                                        f"{engine.pool.num_blocks - 1} blocks free, work left: {engine.has_work}")


@contextlib.contextmanager
def poison_fault() -> Iterator[None]:
    """Make sampling raise whenever a request with POISON_SEED is in the batch (an injected engine fault)."""
    import nextn.speculative.acceptance_rules as acceptance_rules

    real = acceptance_rules.counter_uniform

    def faulty(seed, counter, stream):
        if bool((seed == POISON_SEED).any()):
            raise RuntimeError("injected fault (fuzz poison request)")
        return real(seed, counter, stream)

    acceptance_rules.counter_uniform = faulty
    try:
        yield
    finally:
        acceptance_rules.counter_uniform = real


def fuzz_llm(llm, seconds: float = 15.0, seed: int = 0, inject_faults: bool = True) -> FuzzReport:
    """Fuzz `llm` (an `LLM` without a background loop) for about `seconds`; returns the figures and failures.

    The good requests' solo outputs are computed first (not counted in `seconds`); then rounds of add_request /
    step with bad inputs, aborts and (with `inject_faults`) poison requests, alternating with LLM.generate rounds.
    Finally the LLM must still generate the good requests exactly.
    """
    report = FuzzReport()
    rng = random.Random(seed)
    fuzzer = _Fuzzer(llm, rng, report)
    start = time.perf_counter()
    with poison_fault() if inject_faults else contextlib.nullcontext():
        while time.perf_counter() - start < seconds:
            report.rounds += 1
            if report.rounds % 3 == 0:
                fuzzer.generate_round()
            else:
                fuzzer.round(inject_faults)
    outs = llm.generate([p for p, _ in fuzzer.good], [sp for _, sp in fuzzer.good])
    for out, want in zip(outs, fuzzer.solo):
        if out.outputs[0].token_ids != want.token_ids:
            report.failures.append("the LLM does not reproduce a good request after the fuzzing")
    fuzzer.check_idle()
    report.seconds = time.perf_counter() - start
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--engine_dir", type=Path, help="an engine with a small vocabulary (default: a tiny one, built)")
    ap.add_argument("--no_faults", action="store_true", help="do not inject step failures")
    args = ap.parse_args(argv)
    logging.getLogger("nextn").setLevel(logging.CRITICAL)  # each injected fault logs a traceback
    from nextn import LLM

    with tempfile.TemporaryDirectory() as tmp:
        engine_dir = args.engine_dir
        if engine_dir is None:
            from nextn.build.engine_builder import build_engine
            from nextn.testing import SMALL_VOCAB, TinyDeepseekSpec, make_tiny_checkpoint

            ckpt = make_tiny_checkpoint(Path(tmp) / "ckpt", TinyDeepseekSpec(num_mtp_modules=1, **SMALL_VOCAB))
            engine_dir = Path(tmp) / "engine"
            build_engine(ckpt, engine_dir, progress=False, max_seq_len=64)
        llm = LLM(engine_dir, speculative_config={"decoding_type": "MTP", "num_nextn_predict_layers": 3},
                  device="cpu")
        report = fuzz_llm(llm, args.seconds, args.seed, inject_faults=not args.no_faults)
    print(report.summary())
    for failure in report.failures[:20]:
        print("  FAIL", failure)
    return 1 if report.failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
