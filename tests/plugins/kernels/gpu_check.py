"""The kernels compiled for a real CUDA device: against the references, under torch.compile(fullgraph=True), and
captured in a CUDA graph. Run in a fresh process without TRITON_INTERPRET (`test_kernels_gpu.py` does); prints OK.
"""

from __future__ import annotations

import os

import torch

from nextn.speculative import acceptance_reference as R
from nextn.speculative import acceptance_kernels as K
from nextn.speculative import acceptance_rules as A
from nextn.plugins.kernels import dispatch
from nextn.plugins.kernels import medusa_tree as T
from nextn.plugins.kernels.mla_attention import mla_attention, mla_attention_reference
from nextn.speculative.medusa_tree import build_tree
from nextn.plugins.sampling import STREAM_ACCEPT, STREAM_SAMPLE, counter_uniform
from nextn.models.attention_metadata import AttentionMetadata, slots_for_positions

DEV = "cuda"


def _same(got, want) -> None:
    for g, w in zip(got, want):
        assert torch.equal(g.cpu(), w.cpu()), (g, w)


def check_against_references() -> None:
    gen = torch.Generator().manual_seed(0)
    b, k, v = 5, 3, 129280
    logits = torch.randn(b, k + 1, v, generator=gen)
    drafts = torch.where(torch.rand(b, k, generator=gen) < 0.7, logits.argmax(-1)[:, :k], 3)
    cuda = lambda *xs: [x.to(DEV) for x in xs]  # noqa: E731
    _same(A.strict_acceptance(*cuda(logits, drafts)), R.strict_acceptance(logits, drafts))
    delta = torch.tensor([0.0, 0.1, 0.3, 0.5, 1.0])
    _same(A.relaxed_acceptance(*cuda(logits, drafts, delta), 3),
          R.relaxed_acceptance(logits, drafts, delta, 3))
    probs = torch.softmax(logits, -1)
    seed, positions = torch.arange(b) * 7919, torch.arange(k + 1).expand(b, -1) + 100
    au, su = counter_uniform(seed, positions[:, :k], STREAM_ACCEPT), counter_uniform(seed, positions, STREAM_SAMPLE)
    # The CPU reference accumulates its CDF in fp64 like the kernel (torch's CUDA cumsum does not).
    _same(K.rejection_sampling_triton(*cuda(probs, drafts, au, su)), R.rejection_sampling(probs, drafts, au, su))
    tokens, n = R.strict_acceptance(logits, drafts)
    kv_lens = torch.tensor([0, 5, 17, 30, 31])
    tree = build_tree([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
    _same([T.tree_visibility(*cuda(kv_lens, tree.mask), 64)], [T.tree_visibility_reference(kv_lens, tree.mask, 64)])
    topk = torch.randint(0, 1000, (3, b, 2), generator=gen)
    _same([T.tree_candidates(*cuda(tokens[:, :1], topk, tree.candidate_index))],
          [T.tree_candidates_reference(tokens[:, :1], topk, tree.candidate_index)])
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 3e-2)):
        tables = torch.randint(1, 64, (b, 8), device=DEV)
        pos = kv_lens.to(DEV)[:, None] + torch.arange(k + 1, device=DEV)
        meta = AttentionMetadata.create(pos, slots_for_positions(tables, pos, 16), tables, 16)
        kv = torch.randn(64 * 16, 576, device=DEV, dtype=dtype)
        q_lat = torch.randn(b, k + 1, 16, 512, device=DEV, dtype=dtype)
        q_pe = torch.randn(b, k + 1, 16, 64, device=DEV, dtype=dtype)
        want = mla_attention_reference(q_lat.float(), q_pe.float(), kv.float(), meta.context_slots, meta.visible, 0.1)
        torch.testing.assert_close(mla_attention(q_lat, q_pe, kv, meta, 0.1).float(), want, atol=tol, rtol=tol)


def step(logits, drafts, kv_lens, tables, q_lat, q_pe, kv):
    """A miniature verify step: slots, attention, acceptance, the next KV lengths."""
    positions = kv_lens[:, None] + torch.arange(drafts.shape[1] + 1, device=drafts.device)
    meta = AttentionMetadata.create(positions, slots_for_positions(tables, positions, 16), tables, 16)
    o = mla_attention(q_lat, q_pe, kv, meta, 0.1)
    tokens, n = A.strict_acceptance(logits, drafts)
    return o, tokens, n, kv_lens + n


def check_compile_and_graph() -> None:
    gen = torch.Generator(device=DEV).manual_seed(0)
    b, k = 3, 2
    inputs = [torch.randn(b, k + 1, 1000, device=DEV, generator=gen), torch.randint(0, 1000, (b, k), device=DEV),
              torch.tensor([3, 15, 40], device=DEV), torch.randint(1, 32, (b, 4), device=DEV),
              torch.randn(b, k + 1, 16, 512, device=DEV, dtype=torch.bfloat16, generator=gen),
              torch.randn(b, k + 1, 16, 64, device=DEV, dtype=torch.bfloat16, generator=gen),
              torch.randn(32 * 16, 576, device=DEV, dtype=torch.bfloat16, generator=gen)]
    eager = step(*inputs)
    compiled = torch.compile(step, fullgraph=True)(*inputs)
    for e, c in zip(eager, compiled):
        torch.testing.assert_close(c, e, atol=2e-2, rtol=2e-2)
    static = [x.clone() for x in inputs]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step(*static)  # warm-up: build the kernels outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(*static)
    static[0].copy_(torch.randn(b, k + 1, 1000, device=DEV, generator=gen))
    static[2].copy_(torch.tensor([4, 16, 41], device=DEV))
    graph.replay()
    want = step(*static)
    for e, c in zip(want, out):
        torch.testing.assert_close(c, e, atol=2e-2, rtol=2e-2)


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET", "0") != "1", "run without TRITON_INTERPRET"
    assert dispatch.use_kernel(torch.zeros(1, device=DEV)), "kernels are not used on CUDA tensors"
    check_against_references()
    check_compile_and_graph()
    print("OK")
