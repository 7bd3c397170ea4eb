"""nextn's MTP drafts beside llama.cpp's `draft-mtp` on the same GGUF, step by step (a benchmark, not a test).

Issue 62's parity check: one GGUF that embeds its MTP layer (`{arch}.nextn_predict_layers`, llama.cpp's
`convert_hf_to_gguf.py`), one prompt, greedy, K = each of `--k`: llama.cpp's `llama-speculative-simple --spec-type
draft-mtp --spec-draft-n-max K -v` logs every step's K drafts and its accepted count; nextn (an engine built from the
same GGUF, float32; MTP with K drafts a step, the module chained Eagle-style as llama.cpp does) records every step's
drafts, and its accepted counts follow from them and its output. llama.cpp prefills the prompt but its last token
and drafts once from that token (the hidden state before it) before its first verify; nextn drafts first after the
prefill, from the first output token — the steps are aligned after llama.cpp's extra first one. Reported per K: steps
compared, steps whose drafts are identical, the steps that differ (with both drafts), acceptance on both sides.

llama.cpp's MTP context holds one entry more than vLLM's and nextn's: it pairs each token with the hidden state one
position before it, and the prompt's first token with the hidden state it holds before any batch (`pending_h`, zeros)
— a key at position 0 that the others do not have. `--k 1` also recomputes the drafts teacher-forced from nextn's
modules over the whole output, without and with that entry: with it they equal llama.cpp's at every step.

`--tiny qwen3_5 | glm4_moe` makes the GGUF first: a tiny random checkpoint of that family with an MTP
layer (`nextn.testing.tiny_families`, SmolLM2's tokenizer from ../shared), converted by llama.cpp's converter. A random
MTP layer drafts tokens the target rarely accepts, so the drafts themselves are compared, not only acceptance.

    python -m benchmarks.draft_mtp_parity --tiny qwen3_5 --out runs/draft_mtp/qwen3_5 --k 1 2 3
    python -m benchmarks.draft_mtp_parity --gguf MODEL-with-mtp.gguf --out runs/draft_mtp/model --k 1 2 3
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

from nextn.bench import llama_cpp

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
PROMPT = "the model token draft verify cache block layer the model token draft verify cache"
#: Qwen3.5's rope is multi-section (text positions: all sections equal, plain rope); llama.cpp's kernel needs the
#: sections to fit the tiny head's rotary pairs
_TINY_ROPE = {"partial_rotary_factor": 0.25, "rope_theta": 10000.0, "rope_type": "default", "mrope_section": [1, 1, 0],
              "mrope_interleaved": True}


def make_tiny(family: str, out: Path) -> Path:
    """A tiny random `family` checkpoint with an MTP layer under `out`/hf and llama.cpp's f32 GGUF of it."""
    from nextn.testing import llama_cpp_converter
    from nextn.testing.tiny_families import add_mtp_layer, add_qwen3_5_mtp, save_tiny, smollm2_tokenizer

    gguf = out / f"tiny-{family}.gguf"
    if gguf.is_file():
        return gguf
    (out / "tok").mkdir(parents=True, exist_ok=True)
    smollm2_tokenizer(SHARED, out / "tok")
    hf = out / "hf"
    hf.mkdir(exist_ok=True)
    if family.startswith("qwen3_5"):
        save_tiny(f"{family}_text", hf, out / "tok", seed=2, rope_parameters=_TINY_ROPE)
        add_qwen3_5_mtp(hf)
    else:
        save_tiny(family, hf, out / "tok", seed=2)
        add_mtp_layer(hf)
    llama_cpp_converter.convert(hf, gguf, "f32")
    return gguf


def accepted_counts(drafts: list[list[int]], tokens: list[int]) -> list[int]:
    """Each step's accepted drafts, given the steps' drafts and the greedy output `tokens` (the first from the
    prefill): a step's drafts continue the token before them; it accepts their longest prefix equal to the output."""
    counts, at = [], 0
    for d in drafts:
        want = tokens[at + 1: at + 1 + len(d)]
        n = next((i for i, (a, b) in enumerate(zip(d, want)) if a != b), min(len(d), len(want)))
        counts.append(n)
        at += n + 1
        if at >= len(tokens) - 1:
            break
    return counts


@contextlib.contextmanager
def recorded_drafts(drafter_class: type) -> Iterator[list[list[int]]]:
    """While open, every `_draft` call of `drafter_class` appends its first row's drafts to the list it yields."""
    recorded: list[list[int]] = []
    original = drafter_class._draft

    def recording(self, *args, **kwargs):
        drafts = original(self, *args, **kwargs)
        recorded.append(drafts[0].tolist())
        return drafts

    drafter_class._draft = recording
    try:
        yield recorded
    finally:
        drafter_class._draft = original


def nextn_drafts(engine: Path, prompt: str, max_tokens: int, k: int) -> tuple[list[list[int]], list[int], list[int]]:
    """nextn's greedy run of `prompt` with MTP drafting `k` tokens a step: (each step's drafts, its output tokens,
    the prompt's token ids)."""
    from nextn import LLM, SamplingParams
    from nextn.speculative import mtp

    with recorded_drafts(mtp.MtpEagleDrafter) as recorded:
        llm = LLM(engine, device="cpu", speculative_config={"decoding_type": "MTP", "num_nextn_predict_layers": k})
        ids = llm.tokenizer.encode(prompt)
        out = llm.generate([ids], SamplingParams(max_tokens=max_tokens, ignore_eos=True))[0].outputs[0]
        llm.shutdown()
    return recorded, list(out.token_ids), ids


def teacher_forced_drafts(gguf: Path, tokens: list[int], num_prompt: int, with_zero_entry: bool) -> list[int]:
    """K = 1 drafts recomputed from nextn's modules (float32) over prompt + output in one pass: step s drafts from
    (h_{n−1+s}, x_{n+s}); `with_zero_entry` adds llama.cpp's (zero hidden, x_0) key at position 0 to the MTP's
    attention context (then every pair sits one position later, which rope's relative positions do not see)."""
    from nextn.build.gguf_reader import GGUFCheckpoint
    from nextn.models.attention_metadata import AttentionMetadata, slots_for_positions
    from nextn.models.llama import LlamaForCausalLM
    from nextn.models.llama.weights import stored_view, to_runtime

    reader = GGUFCheckpoint(gguf)
    cfg = reader.model_config
    stored = stored_view(reader, cfg)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, max_positions=1)
    model.load_state_dict(dict(to_runtime(stored.get, stored.has, cfg, torch.float32)), strict=True, assign=True)
    seq = torch.tensor([tokens])
    t, block = seq.shape[1], 16
    model.rope_table = model.rope_table_for(t + block)
    model.allocate_recurrent_state(1, 1, "cpu")
    model.bind_batch_slots(torch.tensor([0]))
    table = torch.arange(1, 2 + t // block)[None]
    meta = lambda pos: AttentionMetadata.create(pos, slots_for_positions(table, pos, block), table, block)  # noqa
    kv = torch.zeros(model.num_cache_layers, (2 + t // block) * block, cfg.kv_cache_dim)
    with torch.no_grad():
        h = model.eval()(seq, kv, meta(torch.arange(t)[None]))
        if with_zero_entry:
            hidden = torch.cat([torch.zeros_like(h[:, :1]), h[:, :-1]], dim=1)
            out = model.forward_mtp(0, seq, hidden, kv, meta(torch.arange(t)[None]))[:, 1:]
        else:
            out = model.forward_mtp(0, seq[:, 1:], h[:, :-1], kv, meta(torch.arange(t - 1)[None]))
        drafts = model.mtp_logits(0, out).argmax(-1)[0]  # row p: from (h_p, x_{p+1})
    return drafts[num_prompt - 1:].tolist()


def compare(ours: list[list[int]], peers: list[list[int]]) -> dict:
    steps = min(len(ours), len(peers))
    differ = [i for i in range(steps) if ours[i] != peers[i]]
    return {"steps": steps, "identical": steps - len(differ),
            "differences": {i: {"nextn": ours[i], "llama_cpp": peers[i]} for i in differ}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.draft_mtp_parity", description=__doc__.split("\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--gguf", type=Path, help="a GGUF that embeds its MTP layer")
    source.add_argument("--tiny", choices=["qwen3_5", "glm4_moe"], help="make a tiny one first")
    parser.add_argument("--out", type=Path, required=True, help="folder for the engine and report.json (created)")
    parser.add_argument("--k", type=int, nargs="+", default=[1, 2, 3], help="draft tokens a step")
    parser.add_argument("--max_tokens", type=int, default=48)
    parser.add_argument("--prompt", default=PROMPT)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--llama_cpp_bin", help="llama.cpp's build/bin (default: ../shared/PEERS.md's location)")
    args = parser.parse_args(argv)
    from nextn.build.engine_builder import build_engine

    bin_dir = llama_cpp.find_bin_dir(args.llama_cpp_bin, tool="llama-speculative-simple")
    if bin_dir is None:
        parser.error("llama.cpp's llama-speculative-simple is not built (../shared/PEERS.md)")
    args.out.mkdir(parents=True, exist_ok=True)
    gguf = args.gguf or make_tiny(args.tiny, args.out)
    engine = args.out / "engine"
    if not (engine / "manifest.json").is_file():
        build_engine(gguf, engine, dtype="float32", quant_algo=None, max_seq_len=512, progress=False)
    torch.set_num_threads(args.threads)
    report = {"gguf": str(gguf), "prompt": args.prompt, "max_tokens": args.max_tokens, "k": {}}
    for k in args.k:
        peer, peer_drafts, peer_accepted = llama_cpp.mtp_speculative(bin_dir, gguf, args.prompt, args.max_tokens, k,
                                                                     args.threads)
        drafts, tokens, ids = nextn_drafts(engine, args.prompt, args.max_tokens, k)
        peer_drafts, peer_accepted = peer_drafts[1:], peer_accepted[1:]  # llama.cpp's draft before its first verify
        row = compare(drafts, peer_drafts)
        ours = accepted_counts(drafts, tokens)
        row.update(prompt_tokens=len(ids), nextn_accepted=sum(ours), llama_cpp_accepted=sum(peer_accepted),
                   accepted_equal_per_step=ours[:row["steps"]] == peer_accepted[:row["steps"]],
                   llama_cpp_drafted=peer.num_drafted, llama_cpp_accept=peer.num_accepted)
        if k == 1:
            for key, extra in (("teacher_forced_identical", False), ("with_llama_cpp_context_identical", True)):
                forced = teacher_forced_drafts(gguf, ids + tokens, len(ids), extra)
                n = min(len(forced), len(peer_drafts))
                row[key] = f"{sum(forced[i] == peer_drafts[i][0] for i in range(n))}/{n}"
            print(f"K=1 recomputed: nextn's modules {row['teacher_forced_identical']} with llama.cpp's drafts, "
                  f"with llama.cpp's extra context entry {row['with_llama_cpp_context_identical']}", flush=True)
        report["k"][k] = row
        print(f"K={k}: {row['identical']}/{row['steps']} steps with identical drafts; accepted nextn {sum(ours)}, "
              f"llama.cpp {sum(peer_accepted)}; steps that differ: {list(row['differences'])}", flush=True)
    (args.out / "report.json").write_text(json.dumps(report, indent=2))
    ok = all(r["identical"] == r["steps"] > 0 for r in report["k"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
