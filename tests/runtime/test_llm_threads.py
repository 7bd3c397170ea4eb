"""One `LLM` used from several threads (issue 32, class 2): every caller gets exactly its solo output or a named
refusal (`EngineBusyError`), never a lost request or a wrong token."""

from __future__ import annotations

import threading
import time

import pytest

from nextn import LLM, SamplingParams
from nextn.runtime.llm import EngineBusyError

SP = SamplingParams(max_tokens=10, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 5, 6, 7], [9, 10, 11]]
DRAFTERS = {"plain": None, "mtp": {"decoding_type": "MTP", "num_nextn_predict_layers": 2},
            "ngram": {"decoding_type": "NGram", "max_draft_len": 3}}


def run_threads(target, n: int) -> list[BaseException]:
    """Run target(i) on n threads started together; the exceptions they raised."""
    errors: list[BaseException] = []
    start = threading.Barrier(n)

    def body(i: int) -> None:
        try:
            start.wait()
            target(i)
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    threads = [threading.Thread(target=body, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a caller hung"
    return errors


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_eight_threads_of_generate_and_generate_async_get_their_solo_outputs(eagle, drafter):
    """Threads 0-3 call `generate` (the first ones serialise on the engine lock), threads 4-7 `generate_async`
    (the loop starts once a synchronous generate is done; later `generate` calls go through it)."""
    llm = LLM(eagle, speculative_config=DRAFTERS[drafter], device="cpu")
    ref = tokens(llm.generate(PROMPTS, SP))
    got: dict[tuple[int, int], list[list[int]]] = {}

    def caller(i: int) -> None:
        for r in range(2):
            if i < 4:
                out = llm.generate(PROMPTS, SP)
            else:
                out = [h.result(60) for h in [llm.generate_async(p, SP) for p in PROMPTS]]
            got[i, r] = tokens(out)

    try:
        assert run_threads(caller, 8) == []
    finally:
        llm.shutdown()
    assert len(got) == 16
    assert all(g == ref for g in got.values()), {k: g for k, g in got.items() if g != ref}
    assert tokens(llm.generate(PROMPTS, SP)) == ref  # the synchronous API works again after shutdown


def test_add_request_step_and_abort_from_several_threads(eagle):
    """Four threads add a request each and step until it is done (any thread's step may finish it); one aborts its
    own; a fifth thread's `generate` runs meanwhile and the add_request outputs it finished reach `step()`."""
    llm = LLM(eagle, speculative_config=DRAFTERS["mtp"], device="cpu")
    ref = tokens(llm.generate(PROMPTS, SP))
    done: dict[int, object] = {}
    mine: dict[int, int] = {}
    lock = threading.Lock()

    def caller(i: int) -> None:
        if i == 4:
            assert tokens(llm.generate(PROMPTS, SP)) == ref
            return
        rid = llm.add_request(PROMPTS[i % 2], SP)
        mine[i] = rid
        if i == 3:
            out = llm.abort_request(rid)
            if out is not None:
                assert out.outputs[0].finish_reason == "cancelled"
                assert out.outputs[0].token_ids == ref[1][:len(out.outputs[0].token_ids)]
                with lock:
                    done[rid] = out
        deadline = time.monotonic() + 60
        while rid not in done:
            for out in llm.step():
                with lock:
                    assert out.request_id not in done, "an output returned twice"
                    done[out.request_id] = out
            assert time.monotonic() < deadline, f"request {rid} lost: no step returned it"

    assert run_threads(caller, 5) == []
    for i in range(3):
        assert done[mine[i]].outputs[0].token_ids == ref[i % 2]
    assert done[mine[3]].outputs[0].finish_reason in ("cancelled", "length")
    for _ in range(3):  # at most an overlapped step in flight is left: it returns nothing more
        if llm.has_unfinished_requests:
            assert llm.step() == []
    assert not llm.has_unfinished_requests


def test_the_loop_and_the_synchronous_api_refuse_each_other_by_name(eagle):
    llm = LLM(eagle, speculative_config=None, device="cpu")
    ref = tokens(llm.generate(PROMPTS, SP))
    rid = llm.add_request(PROMPTS[0], SP)
    with pytest.raises(EngineBusyError, match="add_request are unfinished"):
        llm.generate_async(PROMPTS[0], SP)
    llm.abort_request(rid)
    handle = llm.generate_async(PROMPTS[1], SP)
    try:
        with pytest.raises(EngineBusyError, match="owns the engine"):
            llm.step()
        with pytest.raises(EngineBusyError, match="owns the engine"):
            llm.add_request(PROMPTS[0], SP)
        assert handle.result(60).outputs[0].token_ids == ref[1]
        assert tokens(llm.generate(PROMPTS, SP)) == ref  # through the loop
    finally:
        llm.shutdown()


def test_a_shutdown_racing_with_submissions_leaves_no_handle_waiting(eagle):
    """Every handle gets a final output (its tokens, or "cancelled" by the shutdown), or the submit restarts a loop."""
    llm = LLM(eagle, speculative_config=None, device="cpu")
    ref = tokens(llm.generate(PROMPTS, SP))
    finals = []

    def caller(i: int) -> None:
        if i == 0:
            for _ in range(5):
                llm.shutdown()
            return
        for _ in range(4):
            out = llm.generate_async(PROMPTS[i % 2], SP).result(60)
            finals.append((i, out))

    try:
        assert run_threads(caller, 4) == []
    finally:
        llm.shutdown()
    assert len(finals) == 12
    for i, out in finals:
        c = out.outputs[0]
        assert c.finish_reason in ("length", "cancelled")
        assert c.token_ids == ref[i % 2][:len(c.token_ids)]
        assert c.finish_reason == "cancelled" or c.token_ids == ref[i % 2]


def test_a_generate_hands_the_add_request_outputs_it_finished_to_step(eagle):
    llm = LLM(eagle, speculative_config=None, device="cpu")
    ref = tokens(llm.generate(PROMPTS, SP))
    rid = llm.add_request(PROMPTS[0], SP)
    assert tokens([llm.generate(PROMPTS[1], SP)]) == [ref[1]]  # steps the queued request too
    assert llm.has_unfinished_requests
    outs = []
    while llm.has_unfinished_requests:
        outs += llm.step()
    assert [(o.request_id, o.outputs[0].token_ids) for o in outs] == [(rid, ref[0])]


def test_several_threads_wait_on_one_handle(eagle):
    llm = LLM(eagle, speculative_config=None, device="cpu")
    ref = tokens(llm.generate(PROMPTS, SP))
    try:
        handle = llm.generate_async(PROMPTS[0], SP)
        results = []
        assert run_threads(lambda i: results.append(handle.result(60)), 3) == []
        assert [o.outputs[0].token_ids for o in results] == [ref[0]] * 3
        after: list = []
        assert run_threads(lambda i: after.extend(handle), 1) == []  # still iterable after result()
        assert tokens(after) == [ref[0]]
    finally:
        llm.shutdown()
