"""Qwen3.5 (`qwen3_5_text`): Gated DeltaNet layers with per-request recurrent state between gated attention layers.

A tiny random checkpoint made by `transformers` at test time decodes as `transformers` in float32 — logits of the
model over the paged cache (prefill, token-by-token decode, a verify step of which one token is kept), and greedy
tokens through the engine, plain and with NGram and Suffix drafts. Speculation over the recurrent state is lossless:
drafts accepted in full (a warm suffix tree), in part (sampled rows, the coupled rule) and not at all leave the same
tokens as plain decoding; so do batches, staggered arrivals, chunked prefill and preemption, and a W4A16 engine's
drafts. Its MTP layer (`mtp.*`) drafts as transformers' own modules compose it (vLLM's `qwen3_next_mtp.py` order),
and MTP decoding equals plain decoding. What the state cannot run yet is refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from nextn import LLM, SamplingParams
from nextn.build.checkpoint import CheckpointReader
from nextn.build.engine_builder import build_engine
from nextn.build.gguf_reader import GGUFCheckpoint
from nextn.config.llm_args import LlmArgsError
from nextn.models.attention_metadata import AttentionMetadata, slots_for_positions
from nextn.models.config import ConfigError
from nextn.models.llama import LlamaModelConfig
from nextn.models.llama.weights import stored_view
from nextn.plugins import cpu_kernels
from nextn.testing.spec_checks import greedy_outputs, staggered_outputs
from nextn.testing.tiny_families import add_qwen3_5_mtp, save_tiny, save_tiny_qwen3_5_vl

from family_sources import assert_text_model_greedy, tiny_source
from test_llama import _load

PROMPT = [1] + [100 + (7 * i) % 23 for i in range(45)]
PROMPTS = [PROMPT, [1, 5, 9, 300, 7000, 12], [1] + list(range(2000, 2030))]
SUFFIX = {"decoding_type": "Suffix", "max_draft_len": 8}
NGRAM = {"decoding_type": "NGram", "max_draft_len": 4}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tokenizer_dir):
    """(transformers model fp32, HF checkpoint dir) of the tiny Qwen3.5."""
    out = tmp_path_factory.mktemp("qwen3_5")
    return save_tiny("qwen3_5_text", out, tokenizer_dir), out


@pytest.fixture(scope="module")
def engine(checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("qwen3_5_engine") / "engine"
    build_engine(checkpoint[1], out, dtype="float32", quant_algo=None, max_seq_len=256, progress=False)
    return out


@pytest.fixture(scope="module")
def reference(checkpoint):
    """transformers' greedy continuation (40 tokens) of each of PROMPTS."""
    hf = checkpoint[0]
    with torch.no_grad():
        return [hf.generate(torch.tensor([p]), max_new_tokens=40, do_sample=False, pad_token_id=0,
                            eos_token_id=None)[0, len(p):].tolist() for p in PROMPTS]


@pytest.fixture(scope="module")
def with_mtp(tmp_path_factory, tokenizer_dir):
    """(transformers model fp32, HF checkpoint dir with an `mtp.*` layer, its float32 engine)."""
    out = tmp_path_factory.mktemp("qwen3_5_mtp")
    hf = save_tiny("qwen3_5_text", out, tokenizer_dir, seed=2)
    add_qwen3_5_mtp(out)
    build_engine(out, out / "engine", dtype="float32", quant_algo=None, max_seq_len=256, progress=False)
    return hf, out, out / "engine"


def _meta(table: torch.Tensor, positions: torch.Tensor, block_size: int = 16) -> AttentionMetadata:
    return AttentionMetadata.create(positions, slots_for_positions(table, positions, block_size), table, block_size)


def test_logits_prefill_decode_and_partly_accepted_verify_match_transformers(checkpoint):
    hf, path = checkpoint
    cfg = LlamaModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    assert cfg.linear_layers == (0, 1, 2, 4) and cfg.num_cache_layers == 1 and cfg.rotary_dim == 4
    stored = stored_view(CheckpointReader(path), cfg)  # q_proj split into its query and gate rows
    model = _load(cfg, stored.get, stored.has)
    model.allocate_recurrent_state(3, 4, "cpu")
    model.bind_batch_slots(torch.tensor([2]))
    kv = torch.zeros(cfg.num_cache_layers, 8 * 16, cfg.kv_cache_dim)
    table = torch.tensor([[1, 2, 3, 4]])
    seq: list[int] = []

    def run(tokens: list[int], keep: int) -> float:
        """Feed `tokens` after `seq`, keep the first `keep` of them; the largest logit difference to transformers."""
        nonlocal seq
        positions = len(seq) + torch.arange(len(tokens))[None]
        got = model.logits(model(torch.tensor([tokens]), kv, _meta(table, positions)))
        want = hf(torch.tensor([seq + tokens])).logits[:, -len(tokens):]
        seq = seq + tokens[:keep]
        return (got - want).abs().max().item()

    with torch.no_grad():
        assert run(PROMPT[:20], 20) < 1e-4  # prefill from position 0
        for tok in (5, 77, 4000):  # decode, one token at a time
            assert run([tok], 1) < 1e-4
        assert run([9, 10, 11, 12], 2) < 1e-4  # a verify step of 4 tokens, 2 of them accepted
        assert run([300], 1) < 1e-4  # continues from the state after the 2nd: the 3rd and 4th left no trace
        # control: starting from the state after all four verified tokens gives other logits
        model.recurrent_state.base[2] -= 2
        assert run([301], 1) > 1e-3


@pytest.mark.parametrize("spec", [None, NGRAM, SUFFIX], ids=["plain", "ngram", "suffix"])
def test_engine_greedy_is_transformers(engine, reference, spec):
    llm = LLM(engine, device="cpu", speculative_config=spec)
    assert llm.engine.pool.cache is None  # off by default for a model with recurrent state
    kernels = [m.recurrence_kernel for m in llm.engine.model.modules() if hasattr(m, "recurrence_kernel")]
    assert len(kernels) == 4 and all(kernels) == cpu_kernels.available()  # nextn's op where the kernels build
    got = greedy_outputs(llm, PROMPTS, SamplingParams(max_tokens=40, ignore_eos=True))
    llm.shutdown()
    assert got == reference


def test_accepted_drafts_commit_the_right_state(engine, reference):
    """A warm suffix tree drafts the whole continuation (every draft accepted: the state after the last one is
    kept); sampled rows leave the greedy path mid-draft (part accepted); each equals plain decoding."""
    sampled = [SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.05, seed=s) for s in range(6)]
    plain = LLM(engine, device="cpu", speculative_config=None)
    want = greedy_outputs(plain, [PROMPT] * 6, sampled)
    plain.shutdown()
    llm = LLM(engine, device="cpu", speculative_config=SUFFIX)
    greedy = SamplingParams(max_tokens=40, ignore_eos=True)
    llm.generate(PROMPT, greedy)
    warm = llm.generate(PROMPT, greedy).outputs[0]
    assert warm.token_ids == reference[0] and warm.num_accepted_draft_tokens >= 30
    outs = [o.outputs[0] for o in llm.generate([PROMPT] * 6, sampled)]
    llm.shutdown()
    assert [o.token_ids for o in outs] == want
    assert any(0 < o.num_accepted_draft_tokens < o.num_draft_tokens for o in outs)


@pytest.mark.parametrize("overlap", [False, True])
def test_staggered_chunked_prefill_and_preemption_stay_lossless(engine, reference, overlap):
    llm = LLM(engine, device="cpu", speculative_config=NGRAM, enable_chunked_prefill=True, max_num_tokens=16,
              kv_cache_config={"max_tokens": 96, "tokens_per_block": 8}, disable_overlap_scheduler=not overlap)
    params = [SamplingParams(max_tokens=40, ignore_eos=True)] * len(PROMPTS)
    assert staggered_outputs(llm, PROMPTS, params) == reference
    assert llm.engine.scheduler.num_preemptions > 0
    llm.shutdown()


def test_w4a16_drafts_are_lossless(checkpoint, tmp_path):
    out = tmp_path / "w4a16"
    build_engine(checkpoint[1], out, quant_algo="W4A16", max_seq_len=256, progress=False)
    plain = LLM(out, device="cpu", speculative_config=None)
    want = greedy_outputs(plain, PROMPTS, SamplingParams(max_tokens=32, ignore_eos=True))
    plain.shutdown()
    for spec in (NGRAM, SUFFIX):
        llm = LLM(out, device="cpu", speculative_config=spec)
        assert greedy_outputs(llm, PROMPTS, SamplingParams(max_tokens=32, ignore_eos=True)) == want, spec
        llm.shutdown()


def test_what_the_state_cannot_run_is_refused_by_name(engine):
    with pytest.raises(LlmArgsError, match="enable_block_reuse.*recurrent state"):
        LLM(engine, device="cpu", kv_cache_config={"enable_block_reuse": True})
    with pytest.raises(LlmArgsError, match="torch_compile_config.*recurrent state"):
        LLM(engine, device="cpu", torch_compile_config={})


@pytest.mark.parametrize("spec", [None, NGRAM], ids=["plain", "ngram"])
def test_batch_of_12_equals_each_alone(engine, spec):
    """Sampled and greedy rows, 12 in a batch: each row's tokens are the ones it decodes alone (batch invariance
    of the recurrence as of the attention)."""
    gen = torch.Generator().manual_seed(3)
    prompts = [[1] + torch.randint(2, 49152, (int(n),), generator=gen).tolist()
               for n in torch.randint(3, 40, (12,), generator=gen)]
    params = [SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.8 * (i % 2), seed=i) for i in range(12)]
    llm = LLM(engine, device="cpu", speculative_config=spec)
    alone = [greedy_outputs(llm, [p], [sp])[0] for p, sp in zip(prompts, params)]
    assert greedy_outputs(llm, prompts, params) == alone
    llm.shutdown()


def _mtp_reference(hf, path: Path, ids: torch.Tensor) -> torch.Tensor:
    """MTP logits [1, T − 1, V] of `ids` from transformers' Qwen3.5 modules: lm_head(norm(layer(fc([
    pre_fc_norm_embedding(embed(t + 1)); pre_fc_norm_hidden(h_t)])))), h the model's output hidden states."""
    from safetensors.torch import load_file
    from transformers.masking_utils import create_causal_mask
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5RMSNorm

    sd, c = load_file(path / "model.safetensors"), hf.config
    layer = Qwen3_5DecoderLayer(c, c.layer_types.index("full_attention")).eval()
    layer.load_state_dict({k.removeprefix("mtp.layers.0."): v for k, v in sd.items() if k.startswith("mtp.layers.0.")})

    def norm(name: str) -> Qwen3_5RMSNorm:
        n = Qwen3_5RMSNorm(c.hidden_size, c.rms_norm_eps)
        n.weight.data.copy_(sd[f"mtp.{name}.weight"])
        return n

    h = hf.model(ids).last_hidden_state
    x = torch.cat([norm("pre_fc_norm_embedding")(hf.model.embed_tokens(ids[:, 1:])),
                   norm("pre_fc_norm_hidden")(h[:, :-1])], -1) @ sd["mtp.fc.weight"].T
    pos = torch.arange(x.shape[1])[None]
    mask = create_causal_mask(config=c, inputs_embeds=x, attention_mask=None, past_key_values=None, position_ids=pos)
    y = layer(x, position_embeddings=hf.model.rotary_emb(x, pos), attention_mask=mask, position_ids=pos)
    return hf.lm_head(norm("norm")(y))


@pytest.mark.parametrize("kind", ["hf", "gguf"])
def test_mtp_layer_drafts_as_transformers_modules_compose_it(with_mtp, kind):
    """From the HF checkpoint and from llama.cpp's GGUF of it (`qwen35`: values the converter changed restored)."""
    hf, path, _ = with_mtp
    source = tiny_source(path, kind)
    reader = GGUFCheckpoint(source) if kind == "gguf" else CheckpointReader(source)
    cfg = (reader.model_config if kind == "gguf"
           else LlamaModelConfig.from_hf(json.loads((path / "config.json").read_text())))
    assert cfg.num_nextn_predict_layers == 1 and cfg.num_cache_layers == 2  # one attention layer, one MTP layer
    assert cfg.linear_layers == (0, 1, 2, 4)
    stored = stored_view(reader, cfg)
    model = _load(cfg, stored.get, stored.has)
    model.allocate_recurrent_state(1, 1, "cpu")
    model.bind_batch_slots(torch.tensor([0]))
    ids = torch.tensor([PROMPT[:30]])
    kv = torch.zeros(cfg.num_cache_layers, 4 * 16, cfg.kv_cache_dim)
    table = torch.tensor([[1, 2]])
    with torch.no_grad():
        hidden = model(ids, kv, _meta(table, torch.arange(30)[None]))
        want = _mtp_reference(hf, path, ids)
        got = model.mtp_logits(0, model.forward_mtp(0, ids[:, 1:], hidden[:, :-1], kv,
                                                     _meta(table, torch.arange(29)[None])))
        # control: the token at t instead of t + 1 drafts otherwise
        wrong = model.mtp_logits(0, model.forward_mtp(0, ids[:, :-1], hidden[:, :-1], kv,
                                                       _meta(table, torch.arange(29)[None])))
    assert (got - want).abs().max().item() < 1e-4
    assert (wrong - want).abs().max().item() > 1e-2


@pytest.mark.parametrize("k", [1, 3])
def test_mtp_decoding_equals_plain_decoding(with_mtp, k):
    _, _, engine = with_mtp
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    plain = LLM(engine, device="cpu", speculative_config=None)
    want = greedy_outputs(plain, PROMPTS, params)
    plain.shutdown()
    llm = LLM(engine, device="cpu", speculative_config={"decoding_type": "MTP", "num_nextn_predict_layers": k})
    outs = [o.outputs[0] for o in llm.generate(PROMPTS, params)]
    llm.shutdown()
    assert [o.token_ids for o in outs] == want and all(o.num_draft_tokens > 0 for o in outs)


def test_released_vision_language_checkpoint_builds_its_text_model(tokenizer_dir, tmp_path):
    """Qwen3.5 ships as `Qwen3_5ForConditionalGeneration`: the text model under `model.language_model.`, the vision
    tower beside it (left out: nextn decodes text); its greedy text equals transformers' generate of the whole
    model."""
    hf = save_tiny_qwen3_5_vl(tmp_path / "hf", tokenizer_dir)
    assert_text_model_greedy(hf, tmp_path / "hf", tmp_path / "engine", PROMPT, "Qwen3_5ForCausalLM")


def test_gguf_greedy_is_transformers_plain_and_with_mtp(with_mtp, tmp_path):
    """llama.cpp's GGUF of the checkpoint (its MTP layer embedded as `blk.5.nextn.*`) decodes as transformers."""
    hf, path, _ = with_mtp
    with torch.no_grad():
        want = [hf.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False, pad_token_id=0,
                            eos_token_id=None)[0, len(p):].tolist() for p in PROMPTS]
    build_engine(tiny_source(path, "gguf"), tmp_path / "engine", dtype="float32", quant_algo=None, max_seq_len=256,
                 progress=False)
    for spec in (None, {"decoding_type": "MTP", "num_nextn_predict_layers": 2}):
        llm = LLM(tmp_path / "engine", device="cpu", speculative_config=spec)
        assert greedy_outputs(llm, PROMPTS, SamplingParams(max_tokens=24, ignore_eos=True)) == want, spec
        llm.shutdown()


def test_config_reads_defaults_and_refuses_what_it_cannot_build():
    base = dict(architectures=["Qwen3_5ForCausalLM"], vocab_size=64, hidden_size=64, intermediate_size=96,
                num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, linear_num_key_heads=2,
                linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4)
    cfg = LlamaModelConfig.from_hf(base)  # HF's defaults: head_dim 256, full attention every 4th layer, a quarter rotated
    assert cfg.linear_layers == (0, 1, 2, 4, 5, 6) and cfg.head_dim == 256 and cfg.rotary_dim == 64
    assert cfg.attn_output_gate and cfg.norm_style == "unit_offset" and cfg.num_nextn_predict_layers == 0
    with pytest.raises(ConfigError, match="mtp_num_hidden_layers=2"):
        LlamaModelConfig.from_hf({**base, "mtp_num_hidden_layers": 2})
    with pytest.raises(ConfigError, match="linear_attention layers"):
        LlamaModelConfig.from_hf({k: v for k, v in base.items() if k != "linear_conv_kernel_dim"})


def _with_random_q4_k(src: Path, dst: Path, names: tuple[str, ...]) -> None:
    """`src` rewritten to `dst` with the tensors `names` as random Q4_K blocks (small fp16 scales; the rest as is)."""
    import gguf
    import numpy as np

    from nextn.testing.gguf_rewrite import rewrite

    rng = np.random.default_rng(0)

    def tensor(t):
        if t.name not in names:
            return t.data, t.tensor_type
        rows, cols = t.data.shape
        blocks = rng.integers(0, 256, (rows, cols // 256, 144), dtype=np.uint8)
        blocks[..., 0:4] = np.frombuffer(np.float16([0.01, 0.01]).tobytes(), np.uint8)  # d, dmin
        return blocks.reshape(rows, -1), gguf.GGMLQuantizationType.Q4_K

    rewrite(src, dst, tensor)


def test_q4_k_blocks_of_reordered_projections_are_read_with_their_rows_restored(tokenizer_dir, tmp_path):
    """llama.cpp's converter tiles Qwen3.5's value heads: the q/k/v and z projections' rows are only reordered, so
    under W4A16 (two-level scales) their Q4_K blocks are read as they are with the rows put back — equal to `get`'s
    dequantized, restored values bit for bit, while the blocks in the file's row order are not (a control)."""
    from nextn.build.ggml_blocks import q4_k_two_level
    from nextn.quantization.weight_only import QuantConfig, dequantize

    save_tiny("qwen3_5_text", tmp_path / "hf", tokenizer_dir, hidden_size=256)
    add_qwen3_5_mtp(tmp_path / "hf")  # llama.cpp's converter requires their MTP layer
    names = ("blk.0.attn_qkv.weight", "blk.0.attn_gate.weight")
    _with_random_q4_k(tiny_source(tmp_path / "hf", "gguf"), tmp_path / "q4k.gguf", names)
    ckpt = GGUFCheckpoint(tmp_path / "q4k.gguf")
    cfg = QuantConfig(quant_algo="W4A16", group_size=32, super_block_size=256)
    for proj in ("in_proj_qkv", "in_proj_z"):
        name = f"model.layers.0.linear_attn.{proj}.weight"
        native = ckpt.native_w4a16(name, cfg)
        assert native is not None and torch.equal(dequantize(native, cfg), ckpt.get(name)), proj
        t = ckpt._tensors[name]
        as_stored = q4_k_two_level(t.data, *(int(x) for x in reversed(t.shape)))
        assert not torch.equal(dequantize(as_stored, cfg), ckpt.get(name)), proj


@pytest.mark.parametrize("family, kind", [("qwen3_next", "hf"), ("qwen3_next", "gguf"), ("qwen3_5_moe_text", "hf"),
                                          ("qwen3_5_moe_text", "gguf"), ("qwen3_5_moe_text", "gguf-1d")])
def test_hybrid_moe_greedy_is_transformers(tokenizer_dir, tmp_path, kind, family):
    """Qwen3-Next and Qwen3.5-MoE: the same hybrid layers with an MoE MLP (routed experts and a sigmoid-gated shared
    expert; Qwen3-Next's linear-attention projections stored fused per key head, split on reading) — plain, NGram
    and MTP decoding (its MTP layer an MoE block) equal transformers, from HF and from llama.cpp's
    `qwen3next` and `qwen35moe` GGUFs (the latter's value heads tiled as Qwen3.5's; "gguf-1d": its shared expert's
    gate stored 1-D, as quantized files store it)."""
    hf = save_tiny(family, tmp_path / "hf", tokenizer_dir)
    add_qwen3_5_mtp(tmp_path / "hf")  # llama.cpp's converter requires their MTP layer
    with torch.no_grad():
        want = [hf.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False, pad_token_id=0,
                            eos_token_id=None)[0, len(p):].tolist() for p in PROMPTS]
    build_engine(tiny_source(tmp_path / "hf", kind), tmp_path / "engine", dtype="float32", quant_algo=None,
                 max_seq_len=256, progress=False)
    for spec in (None, NGRAM, {"decoding_type": "MTP", "num_nextn_predict_layers": 2}):
        llm = LLM(tmp_path / "engine", device="cpu", speculative_config=spec)
        assert greedy_outputs(llm, PROMPTS, SamplingParams(max_tokens=24, ignore_eos=True)) == want, spec
        llm.shutdown()


def test_chained_drafts_read_the_normed_state(with_mtp, tmp_path):
    """Qwen3.5's released MTP layer chains its output after `shared_head.norm` (llama.cpp's `qwen35.cpp`, vLLM's
    `qwen3_next_mtp.py`): the second draft is the module's argmax at [embed(draft 1); norm(h1)]. Control: the block
    output h1 itself drafts otherwise. A checkpoint `nextn train-draft` wrote (`mtp_chain_normed: false`) keeps it."""
    from nextn.speculative.mtp import MtpEagleDrafter

    _, path, _ = with_mtp
    config = json.loads((path / "config.json").read_text())
    assert LlamaModelConfig.from_hf(config).mtp_chain_normed
    assert not LlamaModelConfig.from_hf({**config, "mtp_chain_normed": False}).mtp_chain_normed
    cfg = LlamaModelConfig.from_hf(config)
    stored = stored_view(CheckpointReader(path), cfg)
    model = _load(cfg, stored.get, stored.has)
    with torch.no_grad():  # channel scales far from one, so that norm(h1) and h1 draft apart somewhere
        norm = model.mtp_layer(0).shared_head.norm.weight
        norm.copy_(torch.rand(norm.shape, generator=torch.Generator().manual_seed(0)) * 3 - 0.5)
    table = torch.tensor([[1, 2, 3, 4]])
    seconds = {}
    for normed in (True, False):
        model.mtp_chain_normed = normed
        got = []
        for p in PROMPTS:
            ids = torch.tensor([p])
            model.allocate_recurrent_state(1, 1, "cpu")
            model.bind_batch_slots(torch.tensor([0]))
            kv = torch.zeros(cfg.num_cache_layers, 5 * 16, cfg.kv_cache_dim)
            meta = _meta(table, torch.arange(len(p))[None])
            with torch.no_grad():
                hidden = model(ids, kv, meta)
                nxt = torch.cat([ids[:, 1:], model.logits(hidden[:, -1:]).argmax(-1)], dim=1)
                drafts = MtpEagleDrafter(2)._draft(model, kv, meta, hidden, nxt, torch.tensor([len(p) - 1]))
                if normed:  # the second draft by hand, over the KV the first step left
                    h1 = model.forward_mtp(0, nxt, hidden, kv, meta)[:, -1:]
                    at = torch.tensor([[len(p)]])
                    h2 = model.forward_mtp(0, drafts[:, :1], model.mtp_layer(0).shared_head.norm(h1), kv,
                                           meta.with_tokens(at, slots_for_positions(table, at, 16)))
                    assert model.mtp_logits(0, h2).argmax(-1).item() == drafts[0, 1].item()
            got.append(drafts[0].tolist())
        seconds[normed] = got
    assert [d[0] for d in seconds[True]] == [d[0] for d in seconds[False]]
    assert seconds[True] != seconds[False]
