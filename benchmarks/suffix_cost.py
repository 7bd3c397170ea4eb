"""The host cost of suffix decoding per engine step: `python -m benchmarks.suffix_cost [num_requests ...]`.

Drives `SuffixDrafter.after_prefill` / `after_verify` as the engine does (the step's tensors on the CPU), without a
model: each request follows a synthetic "true" sequence (a 32k vocabulary, a 512-token prompt, outputs that copy
spans of the prompt and of earlier outputs with random tokens between), and a step emits the drafts that match it
plus one token. Requests finish after `output_len` tokens and their slot starts a new one, so the figures include
the global tree's inserts and evictions. Reported: µs per decode step (tree updates + proposals + the tensor
round trip), for the whole batch and per request, and µs per prefill row; wall-clock and this thread's CPU
time (the latter is the figure to read on a loaded machine).
"""

from __future__ import annotations

import random
import sys
import time
from types import SimpleNamespace

import torch

from nextn.speculative.suffix import SuffixDrafter

VOCAB = 32000


def _true_sequence(rng: random.Random, prompt_len: int, length: int, pool: list[list[int]]) -> list[int]:
    seq = [rng.randrange(VOCAB) for _ in range(prompt_len // 4)]
    while len(seq) < length:
        r = rng.random()
        if r < 0.5:  # copy a span of itself (code, structured text)
            start = rng.randrange(len(seq))
            seq += seq[start:start + rng.randint(4, 32)]
        elif r < 0.7 and pool:  # copy a span of an earlier output (a repeated template)
            src = rng.choice(pool)
            start = rng.randrange(len(src))
            seq += src[start:start + rng.randint(4, 32)]
        else:
            seq += [rng.randrange(VOCAB) for _ in range(rng.randint(1, 8))]
    return seq[:length]


def measure(num_requests: int = 16, k: int = 4, depth: int = 24, prompt_len: int = 512, output_len: int = 256,
            steps: int = 400, seed: int = 0) -> dict[str, float]:
    """Run `steps` decode steps of `num_requests` requests; returns µs per step (batch and per request), µs per
    prefill row, and the mean tokens emitted per request-step (the synthetic acceptance)."""
    rng = random.Random(seed)
    drafter = SuffixDrafter(k, max_tree_depth=depth)
    pool: list[list[int]] = []
    truth: list[list[int]] = [[] for _ in range(num_requests)]
    pos = [0] * num_requests  # the position of each request's last token
    drafts = [[0] * k for _ in range(num_requests)]
    prefill_s, prefill_rows = 0.0, 0

    def start(slot: int) -> None:
        nonlocal prefill_s, prefill_rows
        seq = _true_sequence(rng, prompt_len, prompt_len + output_len + k + 2, pool)
        truth[slot] = seq
        ids = torch.tensor([seq[:prompt_len]])
        nxt = torch.tensor([seq[1:prompt_len + 1]])
        meta = SimpleNamespace(positions=torch.arange(prompt_len)[None, :])
        t0 = time.perf_counter()
        out, _ = drafter.after_prefill(None, None, meta, None, nxt, torch.tensor([prompt_len - 1]), ids,
                                       (torch.tensor([slot]),))
        prefill_s += time.perf_counter() - t0
        prefill_rows += 1
        drafts[slot] = out[0].tolist()
        pos[slot] = prompt_len

    for slot in range(num_requests):
        start(slot)
    slots = torch.arange(num_requests)
    decode_s, decode_cpu, emitted_total = 0.0, 0.0, 0
    for _ in range(steps):
        tokens, counts = [], []
        for b in range(num_requests):
            want = truth[b][pos[b] + 1:pos[b] + k + 2]
            n = 0
            while n < k and drafts[b][n] == want[n]:
                n += 1
            tokens.append(want[:k + 1])
            counts.append(n + 1)
        meta = SimpleNamespace(positions=torch.tensor(pos)[:, None] + torch.arange(k + 1))
        t0, c0 = time.perf_counter(), time.thread_time()
        out, _ = drafter.after_verify(None, None, meta, None, torch.tensor(tokens), torch.tensor(counts), (slots,))
        decode_s += time.perf_counter() - t0
        decode_cpu += time.thread_time() - c0
        drafts = out.tolist()
        emitted_total += sum(counts)
        for b in range(num_requests):
            pos[b] += counts[b]
            if pos[b] >= prompt_len + output_len:  # finished: the slot starts another request
                pool.append(truth[b][prompt_len:pos[b] + 1])
                start(b)
    return {"us_per_step": 1e6 * decode_s / steps, "cpu_us_per_step": 1e6 * decode_cpu / steps, "us_per_request_step": 1e6 * decode_s / steps / num_requests,
            "us_per_prefill_row": 1e6 * prefill_s / prefill_rows,
            "tokens_per_request_step": emitted_total / steps / num_requests}


if __name__ == "__main__":
    for n in [int(a) for a in sys.argv[1:]] or [1, 16]:
        r = measure(n)
        print(f"{n:3d} requests: {r['us_per_step']:8.1f} us/step ({r['us_per_request_step']:6.1f} us/request; CPU "
              f"{r['cpu_us_per_step']:8.1f} us/step), "
              f"prefill {r['us_per_prefill_row']:8.1f} us/row (512 tokens), "
              f"{r['tokens_per_request_step']:.2f} tokens/request-step")
