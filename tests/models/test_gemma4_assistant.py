"""Gemma 4's assistant drafter (issue 62): a tiny random `Gemma4AssistantForCausalLM` (made by `transformers` at test
time, `testing.tiny_gemma4_assistant`) drafting for the tiny Gemma 4 target of test_gemma4.py over the target's own
KV cache: its drafts at every step are `transformers`' (`reference_drafts`: HF's assistant loop from the target's
shared KV and last hidden state), with the centroid-masked head and the full one, at prompts inside and past the
sliding window; through the engine its output is plain decoding's token for token, greedy and sampled, at batch 1,
batched and staggered; checkpoints made for another target are refused by name."""

from __future__ import annotations

import json

import pytest
import torch

from nextn.config.llm_args import LlmArgsError
from nextn.models.attention_metadata import AttentionMetadata  # noqa: F401 (the steps' metadata)
from nextn.models.kv_cache import allocate_kv_cache
from nextn.speculative.acceptance_rules import StandardAcceptance, greedy_sampling
from nextn.speculative.chain_step import prefill_step, verify_and_draft_step
from nextn.speculative.gemma4_assistant import AssistantDrafter, load_assistant
from nextn.testing.tiny_families import save_tiny
from nextn.testing.tiny_gemma4_assistant import reference_drafts, save_tiny_assistant

from family_sources import tiny_source
from test_gemma4 import _config, _model

BLOCK = 8
K = 3


@pytest.fixture(scope="module")
def target(tmp_path_factory, tokenizer_dir):
    out = tmp_path_factory.mktemp("gemma4_target")
    return save_tiny("gemma4_text", out, tokenizer_dir), out


@pytest.fixture(scope="module", params=[True, False], ids=["centroid_head", "full_head"])
def assistant(request, tmp_path_factory, tokenizer_dir):
    out = tmp_path_factory.mktemp("gemma4_assistant")
    return save_tiny_assistant(out, tokenizer_dir, ordered=request.param), out


def _decode(model, drafter, prompts: list[list[int]], steps: int) -> tuple[list[list[int]], list[list[list[int]]]]:
    """Greedy speculative decoding of right-padded `prompts` through the runtime's prefill and verify steps with
    `drafter`: (each row's emitted tokens, each row's drafts at each step with the context they were made from)."""
    b, width = len(prompts), max(len(p) for p in prompts)
    blocks = -(-(width + steps * (K + 1) + 2) // BLOCK)
    tables = torch.arange(1, b * blocks + 1).view(b, blocks)
    kv = allocate_kv_cache(model.num_cache_layers, b * blocks + 1, BLOCK, model.cfg.kv_cache_dim, torch.float32)
    ids = torch.tensor([p + [0] * (width - len(p)) for p in prompts])
    acceptance, sampling = StandardAcceptance(), greedy_sampling(b)
    with torch.inference_mode():
        out = prefill_step(model, drafter, acceptance, kv, ids, torch.tensor([len(p) for p in prompts]), tables,
                           sampling, (), BLOCK)
        emitted = [[int(out.tokens[r, 0])] for r in range(b)]
        made = [[(p + e, out.draft_tokens[r].tolist())] for r, (p, e) in enumerate(zip(prompts, emitted))]
        for _ in range(steps):
            kv_lens = torch.tensor([len(p) + len(e) - 1 for p, e in zip(prompts, emitted)])
            inputs = torch.cat([torch.tensor([[e[-1]] for e in emitted]), out.draft_tokens], dim=1)
            out = verify_and_draft_step(model, drafter, acceptance, kv, inputs, kv_lens, tables, sampling,
                                        out.drafter_state, out.accept_state, BLOCK)
            for r in range(b):
                emitted[r] += out.tokens[r, :int(out.num_emitted[r])].tolist()
                made[r].append((prompts[r] + emitted[r], out.draft_tokens[r].tolist()))
    return emitted, made


@pytest.mark.parametrize("lens", [[9, 5], [30, 21]], ids=["inside_window", "past_window"])
@pytest.mark.parametrize("kernel", [True, False], ids=["dense_kernel", "pytorch"])
def test_drafts_equal_transformers_at_every_step(target, assistant, lens, kernel):
    hf_target, target_dir = target
    hf_assistant, assistant_dir = assistant
    model = _model(target_dir)
    loaded, rows = load_assistant(assistant_dir, model.cfg, torch.float32, torch.device("cpu"))
    if not kernel:  # the full head's PyTorch path (where nextn's dense kernel does not load)
        if loaded.masked_embedding is not None:
            pytest.skip("a centroid head has one path; the full head's two are compared")
        loaded.dense_head = None
    prompts = [[1] + [100 + (5 * i + 3 * n) % 41 for i in range(n - 1)] for n in lens]
    emitted, made = _decode(model, AssistantDrafter(loaded, rows, K), prompts, steps=6)
    for r, prompt in enumerate(prompts):
        with torch.inference_mode():
            want = hf_target.generate(torch.tensor([prompt]), max_new_tokens=len(emitted[r]), do_sample=False)
        assert emitted[r] == want[0, len(prompt):].tolist()  # speculation changed nothing
        for context, drafts in made[r]:
            assert drafts == reference_drafts(hf_target, hf_assistant, context, K), len(context)


def test_cache_rows_are_the_stored_layers(target):
    """The tiny target's layers 0..3 compute KV (4 and 5 read 3 and 2) in 3 cache rows of 64 values: the sliding
    layers' 32 in pairs (0 and 1 in row 0, 3 in row 2), the full layer's 64 in row 1. The assistant's sliding layer
    reads the last sliding one (layer 3: row 2 from column 0), its full layer the last full one (layer 2, row 1)."""
    from nextn.models.gemma4_assistant import assistant_config
    from nextn.speculative.gemma4_assistant import source_rows
    from nextn.testing.tiny_gemma4_assistant import ASSISTANT_TEXT

    _, target_dir = target
    cfg, _ = assistant_config({"model_type": "gemma4_assistant", "text_config": ASSISTANT_TEXT})
    target_cfg = _config(target_dir)
    assert target_cfg.kv_cache_layout == ((0, 0), (0, 32), (1, 0), (2, 0), (2, 0), (1, 0))
    assert target_cfg.num_cache_layers == 3
    assert source_rows(target_cfg, cfg) == [(2, 0), (1, 0)]


@pytest.fixture(scope="module")
def centroid_assistant(tmp_path_factory, tokenizer_dir):
    out = tmp_path_factory.mktemp("gemma4_assistant_engine")
    save_tiny_assistant(out, tokenizer_dir)
    return out


@pytest.mark.parametrize("fmt", ["fp32", "W4A8"])
def test_engine_output_is_plain_decoding(target, centroid_assistant, tmp_path_factory, fmt):
    """Through the engine (scheduler, overlap, prefix cache, chunked prefill): greedy requests alone, batched with
    company, staggered, chunked and after prefix-cache hits decode as plain decoding does, and seeded sampled
    requests too (deterministic drafts: the coupled rule draws plain decoding's tokens); the W4A8 engine's assistant
    runs in bf16 on nextn's kernels."""
    from nextn import LLM, SamplingParams
    from nextn.plugins import dense_linear
    from nextn.testing import batch_invariance as bi

    if fmt != "fp32" and not dense_linear.available():
        pytest.skip(f"nextn's CPU kernels are unavailable here: {dense_linear.unavailable_reason()}")
    _, target_dir = target
    engine = bi.build_format(target_dir, fmt, tmp_path_factory.mktemp("engines") / fmt, max_seq_len=256)
    spec = {"decoding_type": "Gemma4Assistant", "max_draft_len": K, "speculative_model_dir": str(centroid_assistant)}
    prompts = bi.id_prompts(6, 49152, num_fillers=6)
    ref = bi.Reference(engine, prompts, 24)
    results = bi.run_cell(engine, fmt, "Gemma4Assistant", spec, prompts, ref, 24)
    assert results and all(r.ok for r in results), "\n" + bi.format_table(results)
    sampled = [SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.9, seed=s) for s in range(4)]
    outs = {}
    for name, config in (("plain", None), ("assistant", spec)):
        llm = LLM(engine, speculative_config=config, device="cpu", max_batch_size=12)
        outs[name] = [o.outputs[0] for o in llm.generate(prompts.main[:4], sampled)]
        if config is not None:
            assert llm.engine.drafter.name == "Gemma4Assistant"
            if fmt != "fp32":  # the assistant's layers on nextn's kernels
                assert all(a.paged_attention_kernel for a in _attentions(llm.engine.drafter.assistant))
        llm.shutdown()
    assert [o.token_ids for o in outs["assistant"]] == [o.token_ids for o in outs["plain"]]
    assert sum(o.num_draft_tokens for o in outs["assistant"]) > 0  # the drafts were verified
    if fmt == "fp32":  # preemption (a cache of 14 blocks) with chunked prefill, both schedulers
        for overlap in (False, True):
            tight = LLM(engine, speculative_config=spec, device="cpu", enable_chunked_prefill=True, max_num_tokens=8,
                        kv_cache_config={"max_tokens": 112, "tokens_per_block": 8},
                        disable_overlap_scheduler=not overlap)
            assert bi._staggered(tight, prompts.main, bi._greedy(24)) == ref.main
            assert tight.engine.scheduler.num_preemptions > 0
            tight.shutdown()


def _attentions(model):
    from nextn.models.llama.model import LlamaAttention

    return [m for m in model.modules() if isinstance(m, LlamaAttention)]


def test_refuses_another_targets_assistant(target, tmp_path, tokenizer_dir):
    """An assistant made for a target of another hidden size, and a checkpoint that is not an assistant, are
    refused by name before any weight is read."""
    from nextn.testing.tiny_gemma4_assistant import tiny_assistant

    _, target_dir = target
    cfg = _config(target_dir)
    tiny_assistant(backbone_hidden_size=96).save_pretrained(tmp_path / "other")
    with pytest.raises(LlmArgsError, match="hidden size 96"):
        load_assistant(tmp_path / "other", cfg, torch.float32, torch.device("cpu"))
    with pytest.raises(LlmArgsError, match="not a Gemma 4 assistant"):
        load_assistant(target_dir, cfg, torch.float32, torch.device("cpu"))
    with pytest.raises(LlmArgsError, match="no config.json"):
        load_assistant(tmp_path, cfg, torch.float32, torch.device("cpu"))
    from nextn.models.config import ConfigError
    from nextn.models.registry import model_config_from_hf

    with pytest.raises(ConfigError, match="is a drafter, not a model to build.*Gemma4Assistant"):
        model_config_from_hf(json.loads((tmp_path / "other" / "config.json").read_text()))


@pytest.fixture(scope="module")
def gguf_pair(tmp_path_factory):
    """The tiny target and a full-head assistant over a Gemma-style SentencePiece vocabulary, each converted by
    llama.cpp's converter (`gemma4`, `gemma4-assistant`: the converter leaves centroid heads out)."""
    from nextn.testing.tiny_families import gemma_tokenizer

    out = tmp_path_factory.mktemp("gemma4_gguf_pair")
    vocab = gemma_tokenizer(out / "tokenizer")
    target = save_tiny("gemma4_text", out / "target", out / "tokenizer", vocab_size=vocab,
                       vocab_size_per_layer_input=vocab)
    assistant = save_tiny_assistant(out / "assistant", out / "tokenizer", ordered=False, vocab_size=vocab)
    # the converter cuts an assistant's embedding to tokenizer.model's pieces (Gemma 3's `modify_tensors`), which for
    # this tiny vocabulary lack the 4 added tokens its token list has; tokenizer.json counts them
    (out / "assistant" / "tokenizer.model").unlink()
    return (target, tiny_source(out / "target", "gguf")), (assistant, tiny_source(out / "assistant", "gguf"))


def test_gguf_assistant_drafts_equal_transformers(gguf_pair):
    """llama.cpp's GGUF of an assistant (`gemma4-assistant`: `nextn.pre_projection` / `post_projection`, the layers
    under gemma4's names, the backbone's width as `embedding_length_out`) drafts as `transformers` does, for the
    target's GGUF."""
    from nextn.build.engine_settings import open_checkpoint
    from nextn.build.gguf_reader import GGUFCheckpoint
    from nextn.models.llama.weights import stored_view
    from test_llama import _load

    (hf_target, target_gguf), (hf_assistant, assistant_gguf) = gguf_pair
    reader = GGUFCheckpoint(target_gguf)
    cfg = reader.model_config
    stored = stored_view(reader, cfg)
    model = _load(cfg, stored.get, stored.has)
    loaded, rows = load_assistant(assistant_gguf, cfg, torch.float32, torch.device("cpu"), open_checkpoint)
    assert rows == [(2, 0), (1, 0)] and loaded.masked_embedding is None
    prompts = [[1] + [3 + (5 * i + 3 * n) % 190 for i in range(n - 1)] for n in (9, 30)]
    _, made = _decode(model, AssistantDrafter(loaded, rows, K), prompts, steps=4)
    for per_row in made:
        for context, drafts in per_row:
            assert drafts == reference_drafts(hf_target, hf_assistant, context, K), len(context)


def test_gguf_pair_through_the_engine(gguf_pair, tmp_path):
    """`LLM` over the target's GGUF with `speculative_model_dir` the assistant's GGUF: plain decoding's tokens."""
    from nextn import LLM, SamplingParams

    (_, target_gguf), (_, assistant_gguf) = gguf_pair
    spec = {"decoding_type": "Gemma4Assistant", "max_draft_len": K, "speculative_model_dir": str(assistant_gguf)}
    prompts = [[1] + [3 + (7 * i) % 190 for i in range(n)] for n in (7, 25, 40)]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    outs = {}
    for name, config in (("plain", None), ("assistant", spec)):
        llm = LLM(target_gguf, speculative_config=config, device="cpu", dtype="float32", quant_config=None,
                  engine_cache_dir=tmp_path / "cache")
        outs[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        llm.shutdown()
    assert outs["assistant"] == outs["plain"]
