// A whole dense decoder layer (Llama, Qwen2, Qwen3, Gemma 3) in one op, for W4A16 engines on the CPU (nextn plugin;
// Python side and the reference: decoder_layer.py).
//
//   nextn::llama_decoder_layer(x [B, T, H] bf16, cos_sin [B, T, 2, D/2] f32, kv_cache [slots, 2 * NKV * D] bf16
//       (written in place), slot_mapping [B * T] int64, context_slots [B, S] int64, visible [B, 1, T, S] bool,
//       norms (input [H], post [H], then with `sandwich` pre_ff [H], post_ff [H], then with `qk_norm` q [D], k [D]:
//       all bf16 (Llama's w * bf16(x_hat)) or all f32 (Gemma's bf16(x_hat * s), s = 1 + w)), qkv, o, gate_up, down
//       (each [w, scale, zero] or [w, scale, zero, bias]: the int4 weights of woq_linear_cpu.cpp, one- or two-level
//       scales), num_heads, num_kv_heads, group_size, eps, scale, int8_activations, sandwich, qk_norm, activation
//       (0 SiLU, 1 GELU-tanh), residual_multiplier (Granite's; not with sandwich), pre_norms (false: OLMo 2's and
//       EXAONE 4's post-norms, the input and pre_ff norms empty), qk_norm_all_heads (OLMo 2: q [NH*D], k [NKV*D]),
//       attn_softcap (Gemma 2's attention logit soft-capping; 0: none), attn_sinks (gpt-oss: [NH] f32, a logit a
//       query head in each softmax; None: none), output_gate (Qwen3.5: qkv holds a gate's NH · D rows after v,
//       and the attention output is multiplied by bf16(sigmoid(gate)) before o)) -> [B, T, H] bf16; with gate_up
//       and down
//       empty (an MoE layer, pre-norms: its MLP is moe_cpu.cpp's), the attention half only -> x1 [B, T, H] bf16
//   nextn::llama_decoder_stack(x, cos_sin, kv_cache [layers, slots, 2 * NKV * D], ..., norms, qkv, o, gate_up, down
//       (every layer's operands, layer after layer), arity, ..., cos_sin_local, visible_local, sliding (per layer:
//       1 = a sliding-window layer, which takes the _local rope rows and mask)) -> [B, T, H] bf16: all the layers
//       in one call
//
// It computes what the layer's PyTorch modules compute (models/llama/model.py, models/layers.py) with the same
// bf16 roundings, in the same order:
//   h = w1 * bf16(x * rsqrt(mean(x^2) + eps))                       RMSNorm in f32, rounded, times the weight
//   q, k, v = bf16(h Wqkv^T + b)                                    one int4 matmul over the concatenated q/k/v
//   q, k = RoPE(q), RoPE(k)                                         rotate-half, cos/sin rounded to bf16 first
//   cache[slot] = [k, v]; o = bf16(attention(q, cache))             paged_attention_cpu.cpp
//   x1 = bf16(x + bf16(o Wo^T + bo))
//   g, u = bf16(h2 Wgu^T), h2 = RMSNorm(x1);  x2 = bf16(x1 + bf16(bf16(bf16(silu(g)) * u) Wdown^T))
// Layer options: q_norm / k_norm RMSNorm each head of q and k before RoPE; sandwich norms normalise the attention
// output (post) and the MLP's input (pre_ff) and output (post_ff) — x1 = bf16(x + post(bf16(o Wo^T))), x2 = bf16(x1 +
// post_ff(bf16(... Wdown^T))); GELU-tanh replaces SiLU.
// Only the RMSNorm sums and silu's exp are computed in another order than PyTorch's (a last-bit difference in
// rare elements); every row is computed alone, so the op is batch-invariant like the kernels it calls.
//
// Why: a decode step of a small model is dominated by dispatch, not arithmetic: the PyTorch path runs ~50 ops per
// layer (~10 us each from Python) around 7 matmuls; this is one call per layer, with q/k/v and gate/up each one
// matmul over concatenated weights (docs/PERFORMANCE.md).

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

#include "cpu_kernels.h"
#include "layer_parts.h"

namespace {

using namespace nextn_cpu::layer;  // simd, V16, bf16 loads and stores, norms, Int4, matmul (layer_parts.h)

// GELU, tanh form: 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), tanh(y) = 1 - 2 / (exp(2y) + 1)
inline V16 gelu_tanh(const V16& x) {
  const V16 y = simd::set1(0.7978845608028654f) * (x + simd::set1(0.044715f) * x * x * x);
  const V16 t = simd::set1(1.f) - simd::set1(2.f) / (simd::exp(y + y) + simd::set1(1.f));
  return simd::set1(0.5f) * x * (simd::set1(1.f) + t);
}

// One head of D values (f32, already rounded to bf16) rotated in HF's rotate-half layout -> bf16:
// [x1 c - x2 s, x2 c + x1 s] with c, s rounded to bf16 and every product and sum rounded (PyTorch's bf16 ops).
inline void rope_head(const float* x, const float* cs, int64_t D, uint16_t* out) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < half; i += 16) {
    const V16 c = round_bf16(simd::load(cs + i)), s = round_bf16(simd::load(cs + half + i));
    const V16 x1 = simd::load(x + i), x2 = simd::load(x + half + i);
    store_bf16(out + i, round_bf16(x1 * c) - round_bf16(x2 * s));
    store_bf16(out + half + i, round_bf16(x2 * c) + round_bf16(x1 * s));
  }
}

at::Tensor llama_decoder_layer(const at::Tensor& x, const at::Tensor& cos_sin, at::Tensor& kv_cache,
                               const at::Tensor& slot_mapping, const at::Tensor& context_slots,
                               const at::Tensor& visible, at::TensorList norms, at::TensorList qkv_t,
                               at::TensorList o_t, at::TensorList gate_up_t, at::TensorList down_t, int64_t num_heads,
                               int64_t num_kv_heads, int64_t group_size, double eps, double scale,
                               bool int8_activations, bool sandwich, bool qk_norm, int64_t activation,
                               double residual_multiplier, bool pre_norms, bool qk_norm_all_heads,
                               double attn_softcap, const std::optional<at::Tensor>& attn_sinks,
                               bool output_gate = false) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kBFloat16 && x.device().is_cpu(),
              "llama_decoder_layer: x must be a [B, T, H] bfloat16 CPU tensor");
  const int64_t B = x.size(0), T = x.size(1), H = x.size(2), M = B * T;
  TORCH_CHECK(cos_sin.scalar_type() == at::kFloat && cos_sin.dim() == 4 && cos_sin.size(0) == B &&
                  cos_sin.size(1) == T && cos_sin.size(2) == 2,
              "llama_decoder_layer: cos_sin must be [B, T, 2, head_dim / 2] float32");
  const int64_t D = 2 * cos_sin.size(3), NH = num_heads, NKV = num_kv_heads;
  TORCH_CHECK(H % 64 == 0 && D % 32 == 0 && D <= nextn_cpu::kMaxD && NH % NKV == 0,
              "llama_decoder_layer: needs hidden % 64 == 0, head_dim % 32 == 0 (<= ", nextn_cpu::kMaxD,
              ") and whole query groups; got hidden ", H, ", head_dim ", D, ", heads ", NH, "/", NKV);
  TORCH_CHECK(!attn_sinks || (attn_sinks->scalar_type() == at::kFloat && attn_sinks->is_contiguous() &&
                              attn_sinks->dim() == 1 && attn_sinks->size(0) == NH),
              "llama_decoder_layer: attn_sinks must be a contiguous [num_heads] float32 tensor");
  const float* sinks = attn_sinks ? attn_sinks->data_ptr<float>() : nullptr;
  TORCH_CHECK(kv_cache.scalar_type() == at::kBFloat16 && kv_cache.dim() == 2 && kv_cache.is_contiguous() &&
                  kv_cache.size(1) == 2 * NKV * D,
              "llama_decoder_layer: kv_cache must be a contiguous bfloat16 [slots, ", 2 * NKV * D, "] tensor");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.numel() == M,
              "llama_decoder_layer: slot_mapping must hold B * T int64 slots");
  TORCH_CHECK(context_slots.scalar_type() == at::kLong && context_slots.dim() == 2 && context_slots.size(0) == B,
              "llama_decoder_layer: context_slots must be [B, S] int64");
  const int64_t S = context_slots.size(1);
  TORCH_CHECK(visible.scalar_type() == at::kBool && visible.numel() == B * T * S,
              "llama_decoder_layer: visible must be [B, 1, T, S] bool");
  const size_t num_norms = 2 + 2 * sandwich + 2 * qk_norm;
  TORCH_CHECK(norms.size() == num_norms, "llama_decoder_layer: norms must hold ", num_norms,
              " tensors (input, post", sandwich ? ", pre_ff, post_ff" : "", qk_norm ? ", q, k" : "", ")");
  const bool f32_norms = norms[1].scalar_type() == at::kFloat;
  TORCH_CHECK(pre_norms || sandwich, "llama_decoder_layer: post-norms only come with sandwich norms");
  for (size_t j = 0; j < num_norms; ++j) {
    const bool qk = qk_norm && j >= num_norms - 2, absent = !pre_norms && (j == 0 || j == 2);
    const int64_t n = absent ? 0 : qk ? (qk_norm_all_heads ? (j == num_norms - 2 ? NH : NKV) * D : D) : H;
    TORCH_CHECK(norms[j].scalar_type() == (f32_norms ? at::kFloat : at::kBFloat16) && norms[j].is_contiguous() &&
                    norms[j].numel() == n,
                "llama_decoder_layer: norm ", j, " must be contiguous [", n, "], all bfloat16 or all float32");
  }
  TORCH_CHECK(activation == 0 || activation == 1, "llama_decoder_layer: activation must be 0 (SiLU) or 1 (GELU-tanh)");
  TORCH_CHECK(!sandwich || residual_multiplier == 1.0,
              "llama_decoder_layer: a residual multiplier with sandwich norms");
  TORCH_CHECK(group_size % 32 == 0 && group_size > 0, "llama_decoder_layer: group_size must be a multiple of 32");
  // no gate_up / down (an MoE layer, whose MLP the caller runs): the op ends after the attention, returning x1
  const bool attention_only = gate_up_t.empty() && down_t.empty();
  TORCH_CHECK(!attention_only || (!sandwich && pre_norms),
              "llama_decoder_layer: an attention-only layer (no gate_up, down) takes pre-norms only");
  TORCH_CHECK(attention_only || (gate_up_t.size() >= 1 && gate_up_t[0].dim() == 2 && gate_up_t[0].size(0) % 2 == 0),
              "llama_decoder_layer: gate_up must hold the gate then the up rows");
  // with the output gate (Qwen3.5), its NH · D rows follow q, k and v in the one matmul
  const int64_t I = attention_only ? 64 : gate_up_t[0].size(0) / 2, NQKV = (NH + 2 * NKV + output_gate * NH) * D;
  TORCH_CHECK(I % 64 == 0 && H % group_size == 0 && I % group_size == 0 && (NH * D) % group_size == 0,
              "llama_decoder_layer: intermediate size ", I, " and hidden ", H, " must be multiples of 64 and of the "
              "group size ", group_size);
  const Int4 qkv = int4_weights(qkv_t, H, NQKV, group_size, int8_activations, "qkv");
  const Int4 o = int4_weights(o_t, NH * D, H, group_size, int8_activations, "o");
  const Int4 gate_up = attention_only ? Int4{} : int4_weights(gate_up_t, H, 2 * I, group_size, int8_activations,
                                                               "gate_up");
  const Int4 down = attention_only ? Int4{} : int4_weights(down_t, I, H, group_size, int8_activations, "down");
  auto norm = [&](size_t j) { return Norm{norms[j].data_ptr(), f32_norms}; };
  const Norm input_norm = norm(0), post_norm = norm(1);
  const Norm pre_ff = sandwich ? norm(2) : Norm{}, post_ff = sandwich ? norm(3) : Norm{};
  const Norm q_norm = qk_norm ? norm(num_norms - 2) : Norm{}, k_norm = qk_norm ? norm(num_norms - 1) : Norm{};

  const at::Tensor xc = x.contiguous(), cs = cos_sin.contiguous(), slots = slot_mapping.contiguous();
  const at::Tensor ctx = context_slots.contiguous(), vis = visible.contiguous();
  const uint16_t* xp = bf16_ptr(xc);
  uint16_t* cache = reinterpret_cast<uint16_t*>(kv_cache.data_ptr<at::BFloat16>());
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t kv_row = 2 * NKV * D, num_slots = kv_cache.size(0);
  for (int64_t m = 0; m < M; ++m)
    TORCH_CHECK(slot[m] >= 0 && slot[m] < num_slots, "llama_decoder_layer: slot ", slot[m], " out of range");

  std::vector<uint16_t> h(M * std::max(H, I)), q(M * NH * D), x1(M * H), tmp(sandwich ? M * H : 0);
  std::vector<uint16_t> gate(output_gate ? M * NH * D : 0);  // bf16(sigmoid(g)) of each query head's value
  std::vector<float> f(M * std::max(NQKV, 2 * I));
  at::Tensor out = at::empty_like(xc);
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());

  // attention
  for_rows(M, [&](int64_t m) {
    if (pre_norms) return input_norm.apply(xp + m * H, H, float(eps), h.data() + m * H);
    std::copy(xp + m * H, xp + (m + 1) * H, h.data() + m * H);  // post-norms only (OLMo 2): the input as it is
  });
  matmul(qkv, h.data(), M, group_size, f.data());
  for_rows(M, [&](int64_t m) {
    float* row = f.data() + m * NQKV;
    round_row(row, NQKV);
    if (qk_norm && qk_norm_all_heads) {  // q's heads as one vector, k's as another (OLMo 2), before RoPE
      std::vector<uint16_t> buf(NH * D);
      for (int j = 0; j < 2; ++j) {
        float* v = row + (j ? NH * D : 0);
        const int64_t n = (j ? NKV : NH) * D;
        (j ? k_norm : q_norm).apply(v, n, float(eps), buf.data());
        for (int64_t i = 0; i < n; i += 16) simd::store(v + i, load_bf16(buf.data() + i));
      }
    } else if (qk_norm) {  // each head of q and k normalised in place (bf16 values held as f32), before RoPE
      uint16_t head[nextn_cpu::kMaxD];
      for (int64_t hd = 0; hd < NH + NKV; ++hd) {
        float* v = row + hd * D;
        (hd < NH ? q_norm : k_norm).apply(v, D, float(eps), head);
        for (int64_t i = 0; i < D; i += 16) simd::store(v + i, load_bf16(head + i));
      }
    }
    const float* c = cs.data_ptr<float>() + m * D;  // [cos (D/2), sin (D/2)]
    uint16_t* kv = cache + slot[m] * kv_row;
    for (int64_t hd = 0; hd < NH; ++hd) rope_head(row + hd * D, c, D, q.data() + m * NH * D + hd * D);
    for (int64_t hd = 0; hd < NKV; ++hd) rope_head(row + (NH + hd) * D, c, D, kv + hd * D);
    for (int64_t i = 0; i < NKV * D; i += 16) store_bf16(kv + NKV * D + i, simd::load(row + (NH + NKV) * D + i));
    if (output_gate)
      for (int64_t i = 0; i < NH * D; i += 16) {
        const V16 g = simd::load(row + (NH + 2 * NKV) * D + i);
        store_bf16(gate.data() + m * NH * D + i, simd::set1(1.f) / (simd::set1(1.f) + simd::exp(simd::zero() - g)));
      }
  });
  nextn_cpu::paged_attention_bf16(q.data(), cache, ctx.data_ptr<int64_t>(), vis.data_ptr<bool>(), B, T, NH, NKV, S,
                                  D, float(scale), float(attn_softcap), sinks, f.data());
  for_rows(M, [&](int64_t m) {
    const int64_t row = m * NH * D;
    if (output_gate) {  // bf16(bf16(o) · bf16(sigmoid(g))), the module's `o * sigmoid(gate_proj(x))`
      for (int64_t i = 0; i < NH * D; i += 16)
        store_bf16(q.data() + row + i, round_bf16(simd::load(f.data() + row + i)) * load_bf16(gate.data() + row + i));
      return;
    }
    for (int64_t i = 0; i < NH * D; i += 16) store_bf16(q.data() + row + i, simd::load(f.data() + row + i));
  });
  matmul(o, q.data(), M, group_size, f.data());
  for_rows(M, [&](int64_t m) {
    if (sandwich) {  // x1 = bf16(x + post(bf16(attention output))); h = pre_ff(x1)
      round_row(f.data() + m * H, H);  // the projection's bf16 output, as the modules see it
      post_norm.apply(f.data() + m * H, H, float(eps), tmp.data() + m * H);
      for (int64_t i = 0; i < H; i += 16)
        store_bf16(x1.data() + m * H + i, load_bf16(xp + m * H + i) + load_bf16(tmp.data() + m * H + i));
      if (pre_norms) {
        pre_ff.apply(x1.data() + m * H, H, float(eps), h.data() + m * H);
      } else {
        std::copy(x1.data() + m * H, x1.data() + (m + 1) * H, h.data() + m * H);
      }
    } else {
      residual_add(xp + m * H, f.data() + m * H, H, x1.data() + m * H, float(residual_multiplier));
      if (!attention_only) post_norm.apply(x1.data() + m * H, H, float(eps), h.data() + m * H);
    }
  });
  if (attention_only) {
    std::copy(x1.begin(), x1.end(), op);
    return out;
  }

  // MLP
  matmul(gate_up, h.data(), M, group_size, f.data());
  for_rows(M, [&](int64_t m) {
    const float* g = f.data() + m * 2 * I;
    for (int64_t i = 0; i < I; i += 16) {
      const V16 gv = round_bf16(simd::load(g + i)), uv = round_bf16(simd::load(g + I + i));
      const V16 a = round_bf16(activation == 1 ? gelu_tanh(gv)
                                               : gv / (simd::set1(1.f) + simd::exp(simd::zero() - gv)));
      store_bf16(h.data() + m * I + i, a * uv);
    }
  });
  matmul(down, h.data(), M, group_size, f.data());
  for_rows(M, [&](int64_t m) {
    if (sandwich) {  // x2 = bf16(x1 + post_ff(bf16(MLP output)))
      round_row(f.data() + m * H, H);
      post_ff.apply(f.data() + m * H, H, float(eps), tmp.data() + m * H);
      for (int64_t i = 0; i < H; i += 16)
        store_bf16(op + m * H + i, load_bf16(x1.data() + m * H + i) + load_bf16(tmp.data() + m * H + i));
    } else {
      residual_add(x1.data() + m * H, f.data() + m * H, H, op + m * H, float(residual_multiplier));
    }
  });
  return out;
}

// The decoder layers of a model, one after another, in one call: layer i reads kv_cache[i] and the i-th slice of
// each operand list (norms: `norms.size() / layers` a layer, in llama_decoder_layer's order; qkv, o, gate_up, down:
// arity[0..3] tensors a layer), and a sliding layer (sliding[i] = 1) the _local rope rows and mask (and the _local
// slots and context slots where the sliding layers' cache rows have blocks of their own). What the layers
// compute is llama_decoder_layer's, call for call; the call saves a small model's decode step the Python and
// dispatcher work around 30 op calls (~15-20 us a layer on this CPU). MoE layers (moe_routers not empty: a router
// [E, H] bf16 a layer, the experts' stacked [w, scale, zero] of gate_up and of down, 3 a layer, as moe_block takes
// them; gate_up / down arity 0) run the attention op then moe_block with the layer's post-attention norm: two op
// calls' work a layer, none of their Python.
at::Tensor llama_decoder_stack(const at::Tensor& x, const at::Tensor& cos_sin, at::Tensor& kv_cache,
                               const at::Tensor& slot_mapping, const at::Tensor& context_slots,
                               const at::Tensor& visible, at::TensorList norms, at::TensorList qkv, at::TensorList o,
                               at::TensorList gate_up, at::TensorList down, at::TensorList moe_routers,
                               at::TensorList moe_gate_up, at::TensorList moe_down, at::IntArrayRef arity,
                               int64_t num_heads,
                               int64_t num_kv_heads, int64_t group_size, double eps, double scale,
                               bool int8_activations, bool sandwich, bool qk_norm, int64_t activation,
                               const std::optional<at::Tensor>& cos_sin_local,
                               const std::optional<at::Tensor>& visible_local, at::IntArrayRef sliding,
                               double residual_multiplier, bool pre_norms, bool qk_norm_all_heads,
                               double attn_softcap, const std::optional<at::Tensor>& slot_mapping_local,
                               const std::optional<at::Tensor>& context_slots_local, int64_t moe_top_k,
                               bool moe_norm_topk) {
  TORCH_CHECK(arity.size() == 4, "llama_decoder_stack: arity must give the tensors a layer of qkv, o, gate_up, down");
  const bool moe = !moe_routers.empty();
  const int64_t per = 2 + 2 * sandwich + 2 * qk_norm;
  TORCH_CHECK(norms.size() % per == 0 && !norms.empty(), "llama_decoder_stack: norms must hold ", per,
              " tensors a layer");
  const int64_t L = static_cast<int64_t>(norms.size()) / per;
  const at::TensorList lists[4] = {qkv, o, gate_up, down};
  for (int j = 0; j < 4; ++j)
    TORCH_CHECK(((moe && j >= 2 && arity[j] == 0) || (arity[j] >= 3 && arity[j] <= 4)) &&
                    static_cast<int64_t>(lists[j].size()) == L * arity[j],
                "llama_decoder_stack: operand list ", j, " must hold ", L, " layers x 3 or 4 tensors (gate_up and down "
                "none with MoE layers), got ", lists[j].size(), " for arity ", arity[j]);
  TORCH_CHECK(!moe || (static_cast<int64_t>(moe_routers.size()) == L &&
                       static_cast<int64_t>(moe_gate_up.size()) == 3 * L &&
                       static_cast<int64_t>(moe_down.size()) == 3 * L && !sandwich && pre_norms &&
                       residual_multiplier == 1.0),
              "llama_decoder_stack: MoE layers need a router and the experts' stacked [w, scale, zero] of gate_up "
              "and of down for each of the ", L, " layers (pre-norm layers, no sandwich norms or residual multiplier)");
  TORCH_CHECK(kv_cache.dim() == 3 && kv_cache.size(0) >= L,
              "llama_decoder_stack: kv_cache must be [layers >= ", L, ", slots, kv dim]");
  TORCH_CHECK(sliding.empty() || (static_cast<int64_t>(sliding.size()) == L && cos_sin_local && visible_local),
              "llama_decoder_stack: sliding must be empty or one flag a layer, with cos_sin_local and visible_local");
  TORCH_CHECK(slot_mapping_local.has_value() == context_slots_local.has_value(),
              "llama_decoder_stack: slot_mapping_local and context_slots_local go together");
  const bool own = slot_mapping_local.has_value();
  at::Tensor h = x;
  for (int64_t i = 0; i < L; ++i) {
    at::Tensor cache = kv_cache.select(0, i);
    const bool local = !sliding.empty() && sliding[i];
    h = llama_decoder_layer(h, local ? *cos_sin_local : cos_sin, cache,
                            local && own ? *slot_mapping_local : slot_mapping,
                            local && own ? *context_slots_local : context_slots,
                            local ? *visible_local : visible, norms.slice(i * per, per),
                            qkv.slice(i * arity[0], arity[0]), o.slice(i * arity[1], arity[1]),
                            gate_up.slice(i * arity[2], arity[2]), down.slice(i * arity[3], arity[3]), num_heads,
                            num_kv_heads, group_size, eps, scale, int8_activations, sandwich, qk_norm, activation,
                            residual_multiplier, pre_norms, qk_norm_all_heads, attn_softcap, std::nullopt);
    if (moe)  // the attention op stopped after its residual add: the layer's MLP half, moe_block's, on the same rows
      h = nextn_cpu::moe_block(h.reshape({-1, h.size(-1)}), norms[i * per + 1], eps, moe_routers[i],
                               nextn_cpu::MoeRouting{0, moe_top_k, moe_norm_topk}, moe_gate_up.slice(3 * i, 3),
                               moe_down.slice(3 * i, 3), group_size, int8_activations)
              .view(h.sizes());
  }
  return h;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(NEXTN_OPS, m) {
  m.def("llama_decoder_layer(Tensor x, Tensor cos_sin, Tensor(a!) kv_cache, Tensor slot_mapping, "
        "Tensor context_slots, Tensor visible, Tensor[] norms, Tensor[] qkv, Tensor[] o, "
        "Tensor[] gate_up, Tensor[] down, int num_heads, int num_kv_heads, int group_size, float eps, "
        "float scale, bool int8_activations=False, bool sandwich=False, bool qk_norm=False, "
        "int activation=0, float residual_multiplier=1.0, bool pre_norms=True, "
        "bool qk_norm_all_heads=False, float attn_softcap=0.0, Tensor? attn_sinks=None, "
        "bool output_gate=False) -> Tensor");
  m.def("llama_decoder_stack(Tensor x, Tensor cos_sin, Tensor(a!) kv_cache, Tensor slot_mapping, "
        "Tensor context_slots, Tensor visible, Tensor[] norms, Tensor[] qkv, Tensor[] o, Tensor[] gate_up, "
        "Tensor[] down, Tensor[] moe_routers, Tensor[] moe_gate_up, Tensor[] moe_down, int[] arity, int num_heads, "
        "int num_kv_heads, int group_size, float eps, float scale, "
        "bool int8_activations=False, bool sandwich=False, bool qk_norm=False, int activation=0, "
        "Tensor? cos_sin_local=None, Tensor? visible_local=None, int[] sliding=[], "
        "float residual_multiplier=1.0, bool pre_norms=True, bool qk_norm_all_heads=False, "
        "float attn_softcap=0.0, Tensor? slot_mapping_local=None, Tensor? context_slots_local=None, "
        "int moe_top_k=0, bool moe_norm_topk=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(NEXTN_OPS, CPU, m) {
  m.impl("llama_decoder_layer", &llama_decoder_layer);
  m.impl("llama_decoder_stack", &llama_decoder_stack);
}
