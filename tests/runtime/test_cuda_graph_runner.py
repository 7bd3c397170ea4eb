"""The CUDA graph runner: TensorRT-LLM's capture-size rule and padding; replay through static buffers is
token-identical to the eager engine (the CPU emulation backend here, the real backend under the `gpu` marker);
pad rows and stale rows never touch a real request's KV."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from nextn import LLM, SamplingParams
from nextn.config.llm_args import CudaGraphConfig
from nextn.speculative.acceptance_rules import greedy_sampling
from nextn.runtime.cuda_graph_runner import (
    CudaGraphStep,
    EmulatedGraphBackend,
    capture_batch_sizes,
    generate_batch_sizes,
    graph_batch_size,
    graph_decode_fn,
)
from nextn.speculative.chain_step import verify_and_draft_step
from nextn.testing import SMALL_VOCAB

UP_TO_32 = list(range(1, 33))
PADDED_TO_128 = [1, 2, 4, *range(8, 129, 8)]


# The bucket rule (TensorRT-LLM `CudaGraphConfig._generate_cuda_graph_batch_sizes` + `_filter_cuda_graph_batch_sizes`)
@pytest.mark.parametrize(("max_bs", "padding", "expected"), [
    (128, False, [*UP_TO_32, 64, 128]),
    (1000, False, [*UP_TO_32, 64, 128, 256, 512, 1000]),
    (512, False, [*UP_TO_32, 64, 128, 256, 512]),
    (20, False, list(range(1, 21))),
    (128, True, PADDED_TO_128),
    (300, True, [*PADDED_TO_128, 192, 256, 300]),
    (20, True, [1, 2, 4, 8, 16, 20]),
    (1, True, [1]),
])
def test_generated_sizes_follow_tensorrt_llm(max_bs, padding, expected):
    assert generate_batch_sizes(max_bs, padding) == expected


def test_config_sizes_are_capped_by_the_engine():
    assert capture_batch_sizes(CudaGraphConfig(), 512) == [*UP_TO_32, 64, 128]  # max_batch_size 0 → 128
    assert capture_batch_sizes(CudaGraphConfig(), 8) == list(range(1, 9))
    assert capture_batch_sizes(CudaGraphConfig(enable_padding=True), 6) == [1, 2, 4, 6]  # pad to the cap instead
    assert capture_batch_sizes(CudaGraphConfig(max_batch_size=40, enable_padding=True), 64) == [1, 2, 4, 8, 16, 24, 32, 40]
    assert capture_batch_sizes(CudaGraphConfig(batch_sizes=[4, 1, 2]), 8) == [1, 2, 4]
    assert capture_batch_sizes(CudaGraphConfig(batch_sizes=[1, 2, 16], enable_padding=True), 8) == [1, 2, 8]
    assert capture_batch_sizes(CudaGraphConfig(batch_sizes=[1, 2, 16]), 8) == [1, 2]
    with pytest.raises(ValueError, match="must equal max"):
        capture_batch_sizes(CudaGraphConfig(batch_sizes=[1, 2], max_batch_size=4), 8)


def test_padding_rounds_up_and_exact_sizes_only_without_it():
    sizes = [1, 2, 4, 8]
    assert [graph_batch_size(b, sizes, True) for b in (1, 3, 5, 8, 9)] == [1, 4, 8, 8, None]
    assert [graph_batch_size(b, sizes, False) for b in (1, 3, 5, 8, 9)] == [1, None, None, 8, None]


def test_graphs_need_cuda_unless_a_backend_is_given(caplog):
    with pytest.raises(ValueError, match="CUDA device"):
        CudaGraphStep(verify_and_draft_step, CudaGraphConfig(), 4, 8, "cpu")
    with caplog.at_level(logging.WARNING):
        assert graph_decode_fn(verify_and_draft_step, CudaGraphConfig(), torch.device("cpu"), 4, 8) is verify_and_draft_step
    assert "need a CUDA device" in caplog.text
    assert graph_decode_fn(verify_and_draft_step, None, torch.device("cuda"), 4, 8) is verify_and_draft_step


# End to end on the tiny DeepSeek engine --------------------------------------------------------------------------------
PROMPTS = [[11, 12, 13, 14, 15, 16, 17, 18, 19], [30, 31, 32], [7, 8, 9, 10, 11, 12], [5]]
MAX_TOKENS = [6, 10, 14, 20]  # requests finish one by one: batch 4, 3, 2, 1
MEDUSA_TREE = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]


def _mtp(k: int, vanilla: bool = False) -> dict:
    return {"decoding_type": "MTP", "num_nextn_predict_layers": k, "use_mtp_vanilla": vanilla}


@pytest.fixture(scope="module")
def eagle_engine(checkpoints):
    return checkpoints.engine(num_mtp_modules=1, **SMALL_VOCAB)


@pytest.fixture(scope="module")
def vanilla_engine(checkpoints):
    return checkpoints.engine(num_mtp_modules=3, **SMALL_VOCAB)




def _bigram_mtp(model) -> None:
    """Make every MTP module lm_head(norm(embed(token)) + block noise), `distill_mtp`'s warm start: drafts get
    accepted (multi-token steps, rewinds) without minutes of distillation."""
    h = model.cfg.hidden_size
    with torch.no_grad():
        for k in range(model.cfg.num_nextn_predict_layers):
            layer = model.mtp_layer(k)
            layer.eh_proj.weight.zero_()
            layer.eh_proj.weight[:, :h].copy_(torch.eye(h))
            layer.shared_head.norm.weight.copy_(model.model.norm.weight)


def _llm(engine_dir, spec, device: str = "cpu", graphs: CudaGraphConfig | None = None,
         backend=None) -> tuple[LLM, CudaGraphStep | None]:
    llm = LLM(engine_dir, speculative_config=spec, device=device, max_batch_size=4, max_seq_len=128)
    eng = llm.engine
    _bigram_mtp(eng.model)
    if graphs is None:
        return llm, None
    max_blocks = -(-(eng.max_seq_len + eng.scheduler.lookahead) // eng.block_size)
    step = CudaGraphStep(eng.runner.decode_fn, graphs, eng.max_batch_size, max_blocks, device, backend=backend)
    eng.runner.decode_fn = step
    return llm, step


def _params(sampled_first: bool = False) -> list[SamplingParams]:
    ps = [SamplingParams(max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    if sampled_first:  # the shortest request samples: the first steps use the sampling variant, the rest greedy
        ps[0] = SamplingParams(max_tokens=MAX_TOKENS[0], ignore_eos=True, temperature=0.8, top_k=20, seed=7)
    return ps


def _run(llm: LLM, params) -> list[tuple[list[int], int]]:
    return [(o.outputs[0].token_ids, o.outputs[0].num_accepted_draft_tokens) for o in llm.generate(PROMPTS, params)]


@pytest.mark.parametrize(("engine", "spec", "graphs", "sampled"), [
    ("eagle", _mtp(1), CudaGraphConfig(enable_padding=True), True),
    ("eagle", _mtp(3), CudaGraphConfig(enable_padding=True), False),
    ("vanilla", _mtp(3, vanilla=True), CudaGraphConfig(batch_sizes=[1, 2]), False),  # 3 and 4 run eagerly
    ("medusa", {"decoding_type": "Medusa", "medusa_choices": MEDUSA_TREE}, CudaGraphConfig(enable_padding=True), False),
], ids=["eagle-k1-sampled", "eagle-k3", "vanilla-k3-exact", "medusa"])
def test_graph_replay_matches_the_eager_engine(request, engine, spec, graphs, sampled, caplog):
    engine_dir = request.getfixturevalue(f"{engine}_engine")
    eager, _ = _llm(engine_dir, spec)
    graph, step = _llm(engine_dir, spec, graphs=graphs, backend=EmulatedGraphBackend())
    with caplog.at_level(logging.INFO, logger="nextn.runtime.cuda_graph_runner"):
        outs = _run(graph, _params(sampled))
    assert outs == _run(eager, _params(sampled))  # tokens and accepted drafts, request by request
    assert step.num_replays > 0
    if engine != "medusa":
        assert sum(n for _, n in outs) > 0, "drafts must get accepted so multi-token steps are exercised"
    if graphs.enable_padding:
        assert step.num_eager == 0 and step.num_padded_rows > 0  # batch 3 replayed in the bucket of 4
        assert step.backend.captured[:3] == [4, 2, 1]  # largest first
    else:
        assert step.num_eager > 0 and "batch 4 has no captured size" in caplog.text
    if sampled:
        assert len(step.backend.captured) == 6  # the sampling variant, then the greedy one


def test_pad_and_stale_rows_never_touch_real_kv(eagle_engine):
    """Batch of 4, then 3 of them padded to 4: the dropped request's KV stays as it was (a stale static row would
    rewrite it), the pad row writes only the null block, and the real rows match the eager step."""
    llm, step = _llm(eagle_engine, _mtp(2), graphs=CudaGraphConfig(batch_sizes=[4], enable_padding=True),
                     backend=EmulatedGraphBackend())
    eng = llm.engine
    bs, kv = eng.block_size, eng.runner.kv_cache
    kv.normal_(generator=torch.Generator().manual_seed(0))
    tables = torch.tensor([[1, 2], [3, 4], [5, 6], [7, 8]])
    kv_lens = torch.tensor([5, 9, 3, 12])
    ids = torch.randint(0, 500, (4, 3), generator=torch.Generator().manual_seed(1))
    fixed = (eng.model, eng.drafter, eng.acceptance, kv)
    with torch.inference_mode():
        step(*fixed, ids, kv_lens, tables, greedy_sampling(4), (), (), bs)
        kv[:, 7 * bs : 9 * bs] = 7.0  # request 3's blocks
        kv[:, :bs] = 0.0  # the null block
        before = kv.clone()
        out = step(*fixed, ids[:3], kv_lens[:3], tables[:3], greedy_sampling(3), (), (), bs)
        ref_kv = before.clone()
        ref = verify_and_draft_step(eng.model, eng.drafter, eng.acceptance, ref_kv, ids[:3], kv_lens[:3], tables[:3],
                                    greedy_sampling(3), (), (), bs)
    assert step.num_padded_rows == 1
    assert torch.equal(kv[:, 7 * bs : 9 * bs], before[:, 7 * bs : 9 * bs])  # the dropped request: untouched
    assert not torch.equal(kv[:, :bs], before[:, :bs])  # the pad row wrote into the null block
    torch.testing.assert_close(kv[:, bs:], ref_kv[:, bs:])  # every real block as the eager step leaves it
    assert torch.equal(out.tokens, ref.tokens) and torch.equal(out.num_emitted, ref.num_emitted)
    assert torch.equal(out.draft_tokens, ref.draft_tokens)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(("engine", "spec"), [("eagle", _mtp(3)), ("vanilla", _mtp(3, vanilla=True)), ("eagle", None)],
                         ids=["eagle-k3", "vanilla-k3", "plain"])
def test_cuda_graph_replay_matches_the_eager_engine_on_cuda(request, engine, spec):
    engine_dir = request.getfixturevalue(f"{engine}_engine")
    eager, _ = _llm(engine_dir, spec, device="cuda")
    graph, step = _llm(engine_dir, spec, device="cuda", graphs=CudaGraphConfig(enable_padding=True))
    for sampled in (True, False):
        assert _run(graph, _params(sampled)) == _run(eager, _params(sampled))
    assert step.num_replays > 0 and step.num_eager == 0 and step.num_padded_rows > 0


def test_gpu_step_benchmark_runs_tiny_on_cpu(tmp_path, capsys):
    from benchmarks.gpu_step import main

    out = tmp_path / "r.json"
    assert main(["--tiny", "--device", "cpu", "--batch_sizes", "1,2", "--gen_tokens", "4", "--warmup", "0",
                 "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [r["batch"] for r in result["rows"]] == [1, 2] and result["acceptance_length"] == 4
    assert all(v["identical"] for v in result["greedy_identity"].values()), result["greedy_identity"]
    assert result["batch1"]["mtp_speedup_over_plain"] > 0 and "greedy identity" in capsys.readouterr().out
