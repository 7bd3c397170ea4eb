"""The decode step on a GPU: step time against the memory-bandwidth floor, the CUDA-graph speed-up, MTP's speed-up
over plain decoding at a fixed acceptance, and throughput by batch size. A DeepSeek-V3-architecture model with
random weights (default: DeepSeek-V2-Lite-sized, ~16B parameters, ~32 GB in bf16) is built directly on the device,
so no checkpoint is needed.

    python -m benchmarks.gpu_step --json $OUT/gpu_step.json        # on the GPU
    python -m benchmarks.gpu_step --tiny                           # a few seconds on CPU (smoke test)

Random weights never get drafts accepted, so the timed MTP steps use `FixedAcceptance` (BENCHMARK ONLY, lossy):
each step emits exactly `--accepted` + 1 tokens. The greedy-identity check uses the real, lossless acceptance.
On CPU the "graph" rows run the emulation backend (no speed-up is expected there).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from nextn.bench.outputs import check_report, write_report
from nextn.config.llm_args import CudaGraphConfig
from nextn.models.config import DeepseekV3ModelConfig
from nextn.models.deepseek_v3.model import DeepseekV3ForCausalLM
from nextn.speculative.acceptance_rules import StandardAcceptance, greedy_sampling
from nextn.runtime.cuda_graph_runner import CudaGraphBackend, CudaGraphStep, EmulatedGraphBackend
from nextn.speculative.mtp import MtpEagleDrafter
from nextn.speculative.chain_step import NoDrafter
from nextn.models.kv_cache import allocate_kv_cache
from nextn.speculative.chain_step import prefill_step, verify_and_draft_step

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def model_config(tiny: bool, num_layers: int | None = None, num_experts: int | None = None) -> DeepseekV3ModelConfig:
    """DeepSeek-V2-Lite's sizes with V3's routing and one MTP module (tiny: the test checkpoints' sizes)."""
    if tiny:
        sizes = dict(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                     num_hidden_layers=3, num_attention_heads=4, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16,
                     qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
                     n_group=2, topk_group=1)
    else:
        sizes = dict(vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
                     num_hidden_layers=27, num_attention_heads=16, q_lora_rank=None, kv_lora_rank=512,
                     qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=64,
                     n_shared_experts=2, num_experts_per_tok=6, n_group=8, topk_group=4)
    if num_layers:
        sizes["num_hidden_layers"] = num_layers
    if num_experts:
        sizes["n_routed_experts"] = num_experts
    return DeepseekV3ModelConfig(**sizes, first_k_dense_replace=1, routed_scaling_factor=2.5,
                                 num_nextn_predict_layers=1, max_position_embeddings=16384)


def random_model(cfg: DeepseekV3ModelConfig, dtype: torch.dtype, device: torch.device, max_positions: int,
                 seed: int = 0) -> DeepseekV3ForCausalLM:
    """The model with N(0, 1/fan_in) matrices, norms 1 + 0.1·N(0, 1), fp32 router bias 0.05·N(0, 1)."""
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(cfg, max_positions=1)
    gen = torch.Generator(device=device).manual_seed(seed)
    weights = {}
    for name, p in model.state_dict().items():
        if name.endswith("e_score_correction_bias"):
            weights[name] = 0.05 * torch.randn(p.shape, generator=gen, device=device, dtype=torch.float32)
        elif p.dim() == 1:
            weights[name] = (1 + 0.1 * torch.randn(p.shape, generator=gen, device=device)).to(dtype)
        else:
            std = 1.0 if name.endswith("embed_tokens.weight") else p.shape[-1] ** -0.5
            weights[name] = torch.randn(p.shape, generator=gen, device=device, dtype=dtype) * std
    model.load_state_dict(weights, strict=True, assign=True)
    model.rope_table = model.rope_table_for(max_positions).to(device)
    return model.eval().requires_grad_(False)


class FixedAcceptance:
    """BENCHMARK ONLY, lossy: every step emits exactly `num_accepted` + 1 tokens (the target's argmax at each
    verified position) whatever the drafts, to time steps at a chosen acceptance length on random weights."""

    def __init__(self, num_accepted: int) -> None:
        self.num_accepted = num_accepted

    def initial_state(self, batch, device):
        return ()

    def prompt_state(self, token_ids):
        return ()

    def observe(self, tokens, num_emitted, state):
        return state

    def accept(self, logits, draft_tokens, first_position, sampling, state, draft_probs=None):
        return logits.argmax(-1), torch.full_like(first_position, self.num_accepted + 1), ()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth_gbs(device: torch.device, size_mib: int, repeats: int = 5) -> float:
    """Best-of-`repeats` device copy bandwidth in GB/s, bytes read plus bytes written."""
    x = torch.ones(size_mib * 2**20, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    y.copy_(x)
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        y.copy_(x)
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * x.numel() / best / 1e9


def time_ms(fn: Callable[[], object], device: torch.device, iters: int, warmup: int) -> float:
    """Median wall time of fn() in ms, synchronised after every call (host launch overhead included)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def step_bytes(model: DeepseekV3ForCausalLM, batch: int, num_draft: int, context: int, kv_itemsize: int) -> int:
    """Bytes one decode step must read at least: target weights (routed experts: the expected number of distinct
    experts its B·(K+1) tokens select under uniform routing), the KV of `context` tokens per request, and for
    MTP Eagle K module passes (B·(K+1) tokens, then B per pass) each with the draft head."""
    cfg = model.cfg
    layers, n_target = model.model.layers, cfg.num_hidden_layers
    size = lambda ps: sum(p.numel() * p.element_size() for p in ps)  # noqa: E731

    def layer_bytes(i: int, tokens: int) -> float:
        experts = getattr(layers[i].mlp, "experts", None)
        dense = size(p for n, p in layers[i].named_parameters() if ".experts." not in f".{n}")
        if experts is None:
            return dense
        e, k = len(experts), cfg.num_experts_per_tok
        touched = e * (1 - (1 - k / e) ** tokens)
        return dense + touched * size(experts.parameters()) / e

    kv_row = cfg.kv_cache_dim * kv_itemsize
    head = model.lm_head.weight.numel() * model.lm_head.weight.element_size()
    tokens = batch * (num_draft + 1)
    total = sum(layer_bytes(i, tokens) for i in range(n_target)) + head + batch * context * kv_row * n_target
    for j in range(num_draft):
        total += layer_bytes(n_target, tokens if j == 0 else batch) + head + batch * context * kv_row
    return int(total)


class StepInputs:
    """Fixed decode inputs for `batch` requests with `context` cached tokens each (distinct KV blocks)."""

    def __init__(self, batch: int, num_draft: int, context: int, blocks_per_seq: int, block_size: int,
                 vocab: int, device: torch.device) -> None:
        gen = torch.Generator().manual_seed(batch)
        self.ids = torch.randint(0, vocab, (batch, num_draft + 1), generator=gen).to(device)
        self.kv_lens = torch.full((batch,), context, dtype=torch.int64, device=device)
        self.tables = (1 + torch.arange(batch * blocks_per_seq, device=device)).view(batch, blocks_per_seq)
        self.sampling = greedy_sampling(batch, device)
        self.block_size = block_size

    def call(self, decode_fn, model, drafter, acceptance, kv):
        return lambda: decode_fn(model, drafter, acceptance, kv, self.ids, self.kv_lens, self.tables, self.sampling,
                                 (), (), self.block_size)


def greedy_generate(model, drafter, acceptance, kv, decode_fn, prompts: torch.Tensor, num_tokens: int,
                    block_size: int, blocks_per_seq: int) -> list[list[int]]:
    """Greedy tokens of a fixed batch of equal-length prompts [B, T] (prefill, then decode steps)."""
    b, t = prompts.shape
    device = prompts.device
    tables = (1 + torch.arange(b * blocks_per_seq, device=device)).view(b, blocks_per_seq)
    sampling = greedy_sampling(b, device)
    lens = torch.full((b,), t, dtype=torch.int64, device=device)
    out = prefill_step(model, drafter, acceptance, kv, prompts, lens, tables, sampling, (), block_size)
    seqs = [[tok] for tok in out.tokens[:, 0].tolist()]
    last, drafts, state, kv_lens = out.tokens[:, :1], out.draft_tokens, out.drafter_state, lens
    while min(len(s) for s in seqs) < num_tokens:
        out = decode_fn(model, drafter, acceptance, kv, torch.cat([last, drafts], 1), kv_lens, tables, sampling,
                        state, out.accept_state, block_size)
        for seq, row, n in zip(seqs, out.tokens.tolist(), out.num_emitted.tolist()):
            seq.extend(row[:n])
        kv_lens = kv_lens + out.num_emitted
        last = out.tokens.gather(1, out.num_emitted[:, None] - 1)
        drafts, state = out.draft_tokens.clone(), tuple(s.clone() for s in out.drafter_state)
    return [s[:num_tokens] for s in seqs]


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = DTYPES[args.dtype or ("float32" if args.tiny else "bfloat16")]
    cfg = model_config(args.tiny, args.layers, args.experts)
    k, bs = args.num_draft, args.block_size
    accepted = k if args.accepted is None else min(args.accepted, k)
    batches = [int(x) for x in args.batch_sizes.split(",")]
    blocks_per_seq = -(-(args.context + args.gen_tokens + 2 * k + 1) // bs)
    model = random_model(cfg, dtype, device, blocks_per_seq * bs, args.seed)
    num_blocks = max(batches) * blocks_per_seq + 1
    kv = allocate_kv_cache(model.num_cache_layers, num_blocks, bs, cfg.kv_cache_dim, dtype, device)
    backend = (lambda: CudaGraphBackend()) if device.type == "cuda" else (lambda: EmulatedGraphBackend())
    identity_batch = min(4, max(batches))
    graph_cfg = CudaGraphConfig(batch_sizes=sorted({*batches, identity_batch}))
    graphs = {name: CudaGraphStep(verify_and_draft_step, graph_cfg, max(batches), blocks_per_seq, device, backend())
              for name in ("plain", "mtp", "mtp_lossless")}
    params = sum(p.numel() for p in model.parameters())
    bw = copy_bandwidth_gbs(device, 64 if args.tiny else 2048)
    gib = params * torch.empty(0, dtype=dtype).element_size() / 2**30
    print(f"model: DeepSeek-V3 architecture, random weights, {params / 1e9:.2f} B parameters ({gib:.1f} GiB {dtype}), "
          f"{cfg.num_hidden_layers} layers + 1 MTP module, {cfg.n_routed_experts} experts "
          f"(top {cfg.num_experts_per_tok}); device {device}")
    print(f"device copy bandwidth (read + write): {bw:.0f} GB/s; context {args.context} tokens; K = {k} drafts; "
          f"timed MTP steps accept exactly {accepted} (FixedAcceptance, benchmark only) → AL {accepted + 1}")
    plain, eagle, lossless = NoDrafter(), MtpEagleDrafter(k), StandardAcceptance()  # the objects graphs bind to
    variants = {"plain": (plain, lossless, 0), "mtp": (eagle, FixedAcceptance(accepted), k)}
    rows = []
    with torch.inference_mode():
        for b in batches:
            row = {"batch": b}
            for name, (drafter, acceptance, kk) in variants.items():
                inputs = StepInputs(b, kk, args.context, blocks_per_seq, bs, cfg.vocab_size, device)
                for mode, fn in (("graph", graphs[name]), ("eager", verify_and_draft_step)):
                    if mode == "graph" or b == batches[0] or args.eager_all:
                        call = inputs.call(fn, model, drafter, acceptance, kv)
                        row[f"{name}_{mode}_ms"] = time_ms(call, device, args.iters, args.warmup)
                floor_bytes = step_bytes(model, b, kk, args.context, kv.element_size())
                row[f"{name}_floor_ms"] = floor_bytes / (bw * 1e9) * 1e3
            row["plain_tokens_per_s"] = b / row["plain_graph_ms"] * 1e3
            row["mtp_tokens_per_s"] = b * (accepted + 1) / row["mtp_graph_ms"] * 1e3
            rows.append(row)
        prompts = torch.randint(0, cfg.vocab_size, (identity_batch, 16), generator=torch.Generator().manual_seed(1))
        runs = {"plain_eager": (plain, verify_and_draft_step), "plain_graph": (plain, graphs["plain"]),
                "mtp_eager": (eagle, verify_and_draft_step), "mtp_graph": (eagle, graphs["mtp_lossless"])}
        identity = check_identity(runs, model, lossless, kv, prompts.to(device), args.gen_tokens, bs, blocks_per_seq)
    one = rows[0]
    summary = {
        "graph_speedup_plain": one["plain_eager_ms"] / one["plain_graph_ms"],
        "graph_speedup_mtp": one["mtp_eager_ms"] / one["mtp_graph_ms"],
        "plain_vs_floor": one["plain_graph_ms"] / one["plain_floor_ms"],
        "mtp_vs_floor": one["mtp_graph_ms"] / one["mtp_floor_ms"],
        "mtp_speedup_over_plain": one["mtp_tokens_per_s"] / one["plain_tokens_per_s"],
        "mtp_speedup_over_plain_per_al": one["plain_graph_ms"] / one["mtp_graph_ms"],
    }
    print_report(rows, summary, identity, accepted + 1, batches[0])
    return {"config": {**vars(args), "device": str(device), "dtype": str(dtype), "parameters": params,
                       "model": cfg.model_dump(mode="json"), "graphs": "cuda" if device.type == "cuda" else "emulated"},
            "copy_bandwidth_gbs": bw, "acceptance_length": accepted + 1, "rows": rows, "batch1": summary,
            "greedy_identity": identity}


def check_identity(runs: dict, model, acceptance, kv, prompts: torch.Tensor, num_tokens: int, block_size: int,
                   blocks_per_seq: int) -> dict:
    """Greedy tokens of each run {name: (drafter, decode_fn)} against the first run's: identical, and per prompt the
    first differing token (None when equal)."""
    tokens = {name: greedy_generate(model, drafter, acceptance, kv, fn, prompts, num_tokens, block_size, blocks_per_seq)
              for name, (drafter, fn) in runs.items()}
    ref = next(iter(tokens.values()))
    result = {}
    for name, toks in tokens.items():
        diverge = [next((i for i, (x, y) in enumerate(zip(a, r)) if x != y), None) for a, r in zip(toks, ref)]
        result[name] = {"identical": all(d is None for d in diverge), "first_divergence": diverge}
    return result


def print_report(rows: list[dict], summary: dict, identity: dict, al: int, b1: int) -> None:
    print(f"\nbatch {b1}: plain {rows[0]['plain_eager_ms']:.3f} ms eager, {rows[0]['plain_graph_ms']:.3f} ms graph "
          f"(floor {rows[0]['plain_floor_ms']:.3f} ms, {summary['plain_vs_floor']:.2f}× floor); "
          f"MTP {rows[0]['mtp_eager_ms']:.3f} ms eager, {rows[0]['mtp_graph_ms']:.3f} ms graph "
          f"(floor {rows[0]['mtp_floor_ms']:.3f} ms, {summary['mtp_vs_floor']:.2f}× floor)")
    print(f"CUDA-graph speed-up over eager: plain {summary['graph_speedup_plain']:.2f}×, MTP "
          f"{summary['graph_speedup_mtp']:.2f}×")
    print(f"MTP speed-up over plain decoding at AL {al}: {summary['mtp_speedup_over_plain']:.2f}× "
          f"(÷ AL = {summary['mtp_speedup_over_plain_per_al']:.2f})")
    print(f"\n{'batch':>5} {'plain ms':>9} {'floor':>7} {'plain tok/s':>12} {'MTP ms':>9} {'floor':>7} "
          f"{'MTP tok/s':>12} {'MTP/plain':>9}")
    for r in rows:
        print(f"{r['batch']:>5} {r['plain_graph_ms']:>9.3f} {r['plain_floor_ms']:>7.3f} {r['plain_tokens_per_s']:>12,.0f} "
              f"{r['mtp_graph_ms']:>9.3f} {r['mtp_floor_ms']:>7.3f} {r['mtp_tokens_per_s']:>12,.0f} "
              f"{r['mtp_tokens_per_s'] / r['plain_tokens_per_s']:>8.2f}×")
    print("\ngreedy identity vs plain eager decoding (lossless acceptance): " + ", ".join(
        f"{name} {'identical' if v['identical'] else 'DIFFERS at ' + str(v['first_divergence'])}"
        for name, v in identity.items() if name != "plain_eager"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_step", description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="test-checkpoint sizes, float32, a few seconds on CPU")
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: bfloat16 (float32 with --tiny)")
    p.add_argument("--layers", type=int, default=None, help="override num_hidden_layers (default 27; tiny 3)")
    p.add_argument("--experts", type=int, default=None, help="override n_routed_experts (default 64; tiny 8)")
    p.add_argument("--num_draft", type=int, default=3, help="K, MTP Eagle drafts per step")
    p.add_argument("--accepted", type=int, default=None, help="drafts accepted per timed MTP step (default K)")
    p.add_argument("--context", type=int, default=None, help="cached tokens per request (default 1024; tiny 16)")
    p.add_argument("--batch_sizes", default=None, help="comma-separated (default 1,2,4,...,64; tiny 1,2)")
    p.add_argument("--block_size", type=int, default=32, help="tokens per KV block")
    p.add_argument("--gen_tokens", type=int, default=None, help="tokens per prompt in the identity check (default 32; tiny 6)")
    p.add_argument("--iters", type=int, default=None, help="timed steps per point (default 20; tiny 1)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--eager_all", action="store_true", help="also time eager steps at every batch size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="gpu_step.json",
                   help="where to write the results (an existing file only when a run of this benchmark wrote it)")
    args = p.parse_args(argv)
    check_report(p, args.json, "gpu_step")
    tiny_defaults = {"context": (1024, 16), "batch_sizes": ("1,2,4,8,16,32,64", "1,2"), "gen_tokens": (32, 6),
                     "iters": (20, 1)}
    for name, (full, tiny) in tiny_defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, tiny if args.tiny else full)
    if args.tiny:
        args.warmup = min(args.warmup, 1)
    result = run(args)
    write_report(args.json, "gpu_step", result, indent=2)
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
