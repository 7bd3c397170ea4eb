"""Gemma 4's assistant drafter beside llama.cpp's `draft-mtp` on the same GGUF pair: drafts step by step and speed
(a benchmark, not a test).

No Gemma 4 weights (and no trained assistant) are reachable here, so the assistant is scripted from the target: a
random assistant checkpoint (`transformers`' `Gemma4AssistantForCausalLM`) whose layers add nothing (their output
norms zeroed: each layer passes its input on, its attention over the target's KV still computed), whose input
projection maps the target's embedding of each token seen in the target's own greedy output onto its own orthogonal
direction, and whose tied head scores that token's most frequent successor there highest. It drafts the target's
greedy bigrams, so acceptance is high and the speed-up measurable — the cost of a real assistant of these shapes,
whatever its weights. It is written as an HF checkpoint (with a centroid head over an identity token ordering, which
the GGUF leaves out) and converted by llama.cpp's `convert_hf_to_gguf.py` (bf16; f32 with `--tiny`).

Per K: llama.cpp's `llama-speculative-simple -m TARGET -md ASSISTANT --spec-type draft-mtp --spec-draft-n-max K -v`
(each step's drafts, accepted counts, tokens/s) and nextn on the same pair (drafts recorded, accepted counts from
them and its output; tokens/s best of `--runs` after a warm-up), both greedy from the same prompt; nextn plain and
llama.cpp plain (`llama-completion`) on the target alone; nextn with the HF assistant (centroid head).

    python -m benchmarks.gemma4_assistant --tiny --out runs/gemma4_assistant/tiny --k 1 2 3
    python -m benchmarks.gemma4_assistant --target runs/models/gemma4/gemma4-e2b-l10-Q4_K_M.gguf \
        --out runs/gemma4_assistant/e2b --k 3 --max_tokens 128 --runs 3

Assistant shapes (E2B's target; the released assistant's config is not reachable here): hidden 256, 4 layers (3
sliding, 1 full) of 4 query heads over the target's KV heads, MLP 2048, 2048 centroids, top 32.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

import torch

from benchmarks.draft_mtp_parity import accepted_counts, recorded_drafts
from nextn.bench import llama_cpp

PROMPT = "Once upon a time there was a little girl who liked to draw and play in the park with her dog"
TINY_PROMPT = "the model token draft verify cache block layer the model token draft verify cache"


def make_tiny(out: Path) -> Path:
    """The tiny random Gemma 4 target of the tests (3 KV-shared layers) over a Gemma-style tokenizer, as llama.cpp's
    f32 GGUF."""
    from nextn.testing import llama_cpp_converter
    from nextn.testing.tiny_families import gemma_tokenizer, save_tiny

    gguf = out / "target.gguf"
    if not gguf.is_file():
        vocab = gemma_tokenizer(out / "tokenizer")
        # the last 3 layers KV-shared: llama.cpp needs the last layer computing KV to be a full-attention one
        save_tiny("gemma4_text", out / "target", out / "tokenizer", vocab_size=vocab, vocab_size_per_layer_input=vocab,
                  num_kv_shared_layers=3)
        llama_cpp_converter.convert(out / "target", gguf, "f32")
    return gguf


def bigrams(tokens: list[int]) -> dict[int, int]:
    """Each token's most frequent successor in `tokens`, the most frequent tokens first."""
    pairs = Counter(zip(tokens, tokens[1:]))
    order = [a for a, _ in Counter(tokens[:-1]).most_common()]
    return {a: max((b for x, b in pairs if x == a), key=lambda b: pairs[(a, b)]) for a in order}


def scripted_assistant(target: Path, table: dict[int, int], out: Path, tiny: bool) -> tuple[Path, Path]:
    """The assistant that drafts `table`'s successors (module docstring), as an HF checkpoint and its GGUF."""
    from nextn.build.gguf_reader import GGUFCheckpoint
    from nextn.testing import llama_cpp_converter
    from nextn.testing.tiny_gemma4_assistant import ASSISTANT_TEXT, assistant_modes
    from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM

    hf_dir, gguf = out / "assistant", out / "assistant.gguf"
    with GGUFCheckpoint(target) as reader:
        cfg = reader.hf_config
        embed = reader.get("model.embed_tokens.weight").float() * cfg["hidden_size"] ** 0.5  # the scaled input
        reader.write_tokenizer_files(hf_dir)
    vocab, width = embed.shape
    text = dict(ASSISTANT_TEXT, vocab_size=vocab, rope_parameters=cfg.get("rope_parameters"),
                sliding_window=cfg["sliding_window"], head_dim=cfg["head_dim"], global_head_dim=cfg["global_head_dim"],
                num_key_value_heads=cfg["num_key_value_heads"],
                num_global_key_value_heads=cfg["num_global_key_value_heads"], bos_token_id=cfg.get("bos_token_id"),
                eos_token_id=cfg.get("eos_token_id"), pad_token_id=0, max_position_embeddings=4096)
    if not tiny:  # E2B-sized (module docstring)
        text.update(hidden_size=256, intermediate_size=2048, num_hidden_layers=4, num_kv_shared_layers=4,
                    layer_types=["sliding_attention"] * 3 + ["full_attention"])
    clusters = next(c for c in range(min(2048, vocab // 8), 0, -1) if vocab % c == 0)  # E2B: 2048 of 128 tokens
    acfg = Gemma4AssistantConfig(text_config=text, backbone_hidden_size=width, use_ordered_embeddings=True,
                                 num_centroids=clusters, centroid_intermediate_top_k=min(32, max(1, clusters // 8)))
    torch.manual_seed(0)
    with assistant_modes():
        model = Gemma4AssistantForCausalLM(acfg).eval()
    h = text["hidden_size"]
    sources = list(table)[:h]
    dirs = torch.linalg.qr(torch.randn(h, h))[0][:, :len(sources)].T * h ** 0.5  # orthogonal, RMS 1: [M, h]
    with torch.no_grad():
        for layer in model.model.layers:
            layer.post_attention_layernorm.weight.zero_()  # the layer passes its input on
            layer.post_feedforward_layernorm.weight.zero_()
            layer.layer_scalar.fill_(1.0)
        model.model.norm.weight.fill_(1.0)
        src = embed[sources]  # [M, width]
        proj = torch.linalg.lstsq(src, dirs).solution.T  # [h, width]: proj @ e_s = dirs[s]
        model.pre_projection.weight.zero_()
        model.pre_projection.weight[:, :width] = proj
        table_rows = torch.randn(vocab, h) * 0.01
        for i, s in enumerate(sources):
            table_rows[table[s]] += 4.0 * dirs[i] / h
        model.model.embed_tokens.weight.copy_(table_rows)
        per = vocab // clusters
        model.masked_embedding.token_ordering.copy_(torch.arange(vocab))
        cent = torch.randn(clusters, h) * 0.01
        for i, s in enumerate(sources):
            cent[table[s] // per] += dirs[i] / h
        model.masked_embedding.centroids.weight.copy_(cent)
    model.save_pretrained(hf_dir)
    if not gguf.is_file():
        llama_cpp_converter.convert(hf_dir, gguf, "f32" if tiny else "bf16")
    return hf_dir, gguf


def run_nextn(target: Path, spec: dict | None, prompt: str, max_tokens: int, runs: int, quant: dict | None,
              record: bool = False) -> dict:
    """nextn greedy on `prompt`: output tokens, prompt ids, tokens/s (best of `runs` after a warm-up), accepted
    drafts; with `record`, each step's drafts (one more, untimed, run)."""
    from nextn import LLM, SamplingParams
    from nextn.speculative import gemma4_assistant

    llm = LLM(target, device="cpu", speculative_config=spec, quant_config=quant)
    ids = llm.tokenizer.encode(prompt)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    out = llm.generate([ids], params)[0].outputs[0]
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        llm.generate([ids], params)
        best = min(best, time.perf_counter() - start)
    drafts: list[list[int]] = []
    if record:
        with recorded_drafts(gemma4_assistant.AssistantDrafter) as drafts:
            llm.generate([ids], params)
    llm.shutdown()
    return {"tokens": list(out.token_ids), "ids": ids, "tok_s": max_tokens / best, "drafts": drafts,
            "drafted": out.num_draft_tokens, "accepted": out.num_accepted_draft_tokens}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gemma4_assistant", description=__doc__.split("\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--target", type=Path, help="a Gemma 4 GGUF (benchmarks/gemma4_model.py makes one)")
    source.add_argument("--tiny", action="store_true", help="the tests' tiny Gemma 4, f32")
    parser.add_argument("--out", type=Path, required=True, help="folder for the assistant and report.json")
    parser.add_argument("--k", type=int, nargs="+", default=[3], help="draft tokens a step")
    parser.add_argument("--max_tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt", default=None)
    parser.add_argument("--llama_cpp_bin", help="llama.cpp's build/bin (default: ../shared/PEERS.md's location)")
    args = parser.parse_args(argv)
    bin_dir = llama_cpp.find_bin_dir(args.llama_cpp_bin, tool="llama-speculative-simple")
    if bin_dir is None:
        parser.error("llama.cpp's llama-speculative-simple is not built (../shared/PEERS.md)")
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)
    target = make_tiny(args.out) if args.tiny else args.target
    prompt = args.prompt or (TINY_PROMPT if args.tiny else PROMPT)
    quant = {"quant_algo": None} if args.tiny else {"quant_algo": "auto"}
    plain = run_nextn(target, None, prompt, args.max_tokens, args.runs, quant)
    table = bigrams(plain["ids"] + plain["tokens"])
    hf_dir, gguf = scripted_assistant(target, table, args.out, args.tiny)
    peer_plain = llama_cpp.complete(bin_dir, target, prompt, args.max_tokens, args.threads)
    report = {"target": str(target), "assistant": str(gguf), "prompt": prompt, "max_tokens": args.max_tokens,
              "nextn_plain_tok_s": plain["tok_s"], "llama_cpp_plain_tok_s": peer_plain.tokens_per_s, "k": {}}
    print(f"plain: nextn {plain['tok_s']:.2f} tok/s, llama.cpp {peer_plain.tokens_per_s:.2f} tok/s", flush=True)
    for k in args.k:
        spec = {"decoding_type": "Gemma4Assistant", "max_draft_len": k}
        ours = run_nextn(target, {**spec, "speculative_model_dir": str(gguf)}, prompt, args.max_tokens, args.runs,
                         quant, record=True)
        hf = run_nextn(target, {**spec, "speculative_model_dir": str(hf_dir)}, prompt, args.max_tokens, args.runs,
                       quant)
        peer, peer_drafts, peer_accepted = llama_cpp.mtp_speculative(bin_dir, target, prompt, args.max_tokens, k,
                                                                     args.threads, 1800, draft=gguf)
        # llama.cpp prefills the prompt but its last token and drafts once from it before its first verify; nextn
        # drafts first after the prefill, from the first output token: the steps align after llama.cpp's first
        peer_drafts, peer_accepted = peer_drafts[1:], peer_accepted[1:]
        verified = accepted_counts(ours["drafts"], ours["tokens"])  # the steps whose drafts a step verified
        steps = min(len(verified), len(peer_drafts))
        row = {"nextn_gguf_tok_s": ours["tok_s"], "nextn_hf_centroid_tok_s": hf["tok_s"],
               "llama_cpp_tok_s": peer.tokens_per_s, "same_output_as_plain": ours["tokens"] == plain["tokens"]
               and hf["tokens"] == plain["tokens"], "nextn_al": 1 + ours["accepted"] / max(1, ours["drafted"]) * k,
               "nextn_accepted": ours["accepted"], "nextn_drafted": ours["drafted"],
               "llama_cpp_accepted": peer.num_accepted, "llama_cpp_drafted": peer.num_drafted,
               "steps_compared": steps, "steps_identical": sum(ours["drafts"][i] == peer_drafts[i]
                                                               for i in range(steps)),
               "first_differences": [(i, ours["drafts"][i], peer_drafts[i]) for i in range(steps)
                                     if ours["drafts"][i] != peer_drafts[i]][:5],
               "accepted_per_step": {"nextn": verified[:steps], "llama_cpp": peer_accepted[:steps]},
               # the last step is cut by the token limit, on each side its own way
               "accepted_per_step_equal": verified[:steps - 1] == peer_accepted[:steps - 1]}
        report["k"][k] = row
        print(f"K={k}: nextn {ours['tok_s']:.2f} tok/s (GGUF assistant), {hf['tok_s']:.2f} (HF, centroid head); "
              f"llama.cpp {peer.tokens_per_s:.2f}; accepted nextn {ours['accepted']}/{ours['drafted']}, llama.cpp "
              f"{peer.num_accepted}/{peer.num_drafted}; identical drafts {row['steps_identical']}/{steps} steps",
              flush=True)
    (args.out / "report.json").write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
