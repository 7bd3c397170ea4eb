// A whole Gated DeltaNet decoder layer (Qwen3.5's and Qwen3-Next's linear-attention layers with a dense gated MLP)
// of a W4A16 / W4A8 engine in one op, for every step (nextn plugin; Python side: gated_delta.py; the reference is
// the layer's modules, models/llama/model.py `LinearAttentionDecoderLayer`).
//
//   nextn::gated_deltanet_layer(x [B, T, H] bf16, norms (input [H], post [H]: bf16 weights, Llama's w · bf16(x̂), or
//       f32 scales, bf16(x̂ · s) with s = 1 + w), qkvz (in_proj_qkv's rows then in_proj_z's), ba [2·Hv, H] bf16
//       (in_proj_b's rows then in_proj_a's), out, gate_up, down (int4 [w, scale, zero]: woq_linear_cpu.cpp's
//       layouts), conv_w, a_log, dt_bias, norm_w, conv_ring, ssm, pending, slots, committed, fresh, valid, key_heads
//       (the mixer's
//       operands: gated_delta_cpu.cpp's `gated_deltanet_mix`), group_size, eps, mix_eps, int8_activations)
//       -> [B, T, H] bf16
//
// With gate_up and down empty the op stops after the token mixer's residual add and returns x1 (an MoE MLP follows:
// the layer runs it as moe_cpu.cpp's `moe_block`, Qwen3-Next's and Qwen3.5-MoE's layers).
//
// It computes what the modules compute, with their bf16 roundings:
//   h = norm(x);  qkv, z = bf16(h Wqkvz^T);  b, a = bf16(h Wba^T)       one int4 matmul, one bf16 dot per row
//   m = bf16(mixer(qkv, z, b, a))                                       gated_deltanet.h (conv, gates, the rule)
//   x1 = bf16(x + bf16(m Wout^T));  h2 = post(x1)
//   g, u = bf16(h2 Wgu^T);  x2 = bf16(x1 + bf16(bf16(bf16(silu(g)) · u) Wdown^T))
// The b / a projection sums its 16-lane partial products across lanes (the module's dense kernel sums in channel
// order): their last bits may differ, which tolerance tests allow. Every row is computed alone: batch-invariant.
//
// Why: a DeltaNet layer run as modules is ~25 ops around 6 matmuls (norms, projections, the mixer, residual adds, the
// MLP); Qwen3.5 has three such layers to one attention layer, so a small model's step is mostly their dispatch.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

#include "cpu_kernels.h"
#include "gated_deltanet.h"
#include "layer_parts.h"

namespace {

namespace simd = nextn_cpu::simd;
using simd::V16;
using namespace nextn_cpu::layer;
using nextn_cpu::deltanet::check_mix;
using nextn_cpu::deltanet::MixOperands;
using nextn_cpu::deltanet::run_mix;

at::Tensor gated_deltanet_layer(const at::Tensor& x, at::TensorList norms, at::TensorList qkvz_t,
                                const at::Tensor& ba_w, at::TensorList out_t, at::TensorList gate_up_t,
                                at::TensorList down_t, const at::Tensor& conv_w, const at::Tensor& a_log,
                                const at::Tensor& dt_bias, const at::Tensor& norm_w, at::Tensor conv_ring,
                                at::Tensor ssm, at::Tensor pending, const at::Tensor& slots,
                                const at::Tensor& committed, const at::Tensor& fresh,
                                const at::Tensor& valid, int64_t key_heads, int64_t group_size, double eps,
                                double mix_eps, bool int8_activations) {
  const char* op = "gated_deltanet_layer";
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kBFloat16 && x.device().is_cpu(), op,
              ": x must be a [B, T, H] bfloat16 CPU tensor");
  const int64_t B = x.size(0), T = x.size(1), H = x.size(2), M = B * T;
  MixOperands mo = check_mix(conv_w, a_log, dt_bias, norm_w, conv_ring, ssm, pending, slots, committed, fresh,
                             valid, B, T, key_heads, mix_eps, op);
  const int64_t C = mo.shape.channels(), Hv = mo.shape.Hv, V = Hv * mo.shape.Dv;
  TORCH_CHECK(group_size > 0 && group_size % 32 == 0, op, ": group_size must be a multiple of 32");
  const bool attention_only = gate_up_t.empty() && down_t.empty();
  TORCH_CHECK(attention_only || (gate_up_t.size() >= 1 && gate_up_t[0].dim() == 2 && gate_up_t[0].size(0) % 2 == 0),
              op, ": gate_up must hold the gate then the up rows (or gate_up and down both empty)");
  const int64_t I = attention_only ? 64 : gate_up_t[0].size(0) / 2;
  TORCH_CHECK(H % 64 == 0 && V % 64 == 0 && I % 64 == 0 && (C + V) % 16 == 0 && H % group_size == 0 &&
                  V % group_size == 0 && I % group_size == 0,
              op, ": needs hidden ", H, ", value width ", V, " and intermediate size ", I,
              " multiples of 64 and of the group size ", group_size);
  TORCH_CHECK(norms.size() == 2, op, ": norms must be (input, post)");
  const bool f32_norms = norms[0].scalar_type() == at::kFloat;
  for (const at::Tensor& n : norms)
    TORCH_CHECK(n.scalar_type() == (f32_norms ? at::kFloat : at::kBFloat16) && n.is_contiguous() && n.numel() == H,
                op, ": the norms must be contiguous [", H, "], both bfloat16 or both float32");
  TORCH_CHECK(ba_w.scalar_type() == at::kBFloat16 && ba_w.is_contiguous() && ba_w.dim() == 2 &&
                  ba_w.size(0) == 2 * Hv && ba_w.size(1) == H,
              op, ": ba must be a contiguous bfloat16 [", 2 * Hv, ", ", H, "]");
  const Int4 qkvz = int4_weights(qkvz_t, H, C + V, group_size, int8_activations, "qkvz", op);
  const Int4 out_proj = int4_weights(out_t, V, H, group_size, int8_activations, "out", op);
  const Int4 gate_up = attention_only ? Int4{} : int4_weights(gate_up_t, H, 2 * I, group_size, int8_activations,
                                                               "gate_up", op);
  const Int4 down = attention_only ? Int4{} : int4_weights(down_t, I, H, group_size, int8_activations, "down", op);
  const Norm input_norm{norms[0].data_ptr(), f32_norms}, post_norm{norms[1].data_ptr(), f32_norms};

  const at::Tensor xc = x.contiguous();
  const uint16_t* xp = bf16_ptr(xc);
  const uint16_t* wba = bf16_ptr(ba_w);
  std::vector<uint16_t> h(M * std::max({H, I, V})), x1(M * H);
  std::vector<float> f(M * std::max({C + V, 2 * I, H})), ba(M * 2 * Hv);
  at::Tensor out = at::empty_like(xc);
  uint16_t* op_out = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());

  // the input projections
  for_rows(M, [&](int64_t m) { input_norm.apply(xp + m * H, H, float(eps), h.data() + m * H); });
  matmul(qkvz, h.data(), M, group_size, f.data());
  for_rows(M, [&](int64_t m) {
    round_row(f.data() + m * (C + V), C + V);
    const uint16_t* hm = h.data() + m * H;
    for (int64_t n = 0; n < 2 * Hv; ++n) {
      V16 acc = simd::zero();
      for (int64_t k = 0; k < H; k += 16)
        acc = simd::fmadd(simd::load_bf16(hm + k), simd::load_bf16(wba + n * H + k), acc);
      ba[m * 2 * Hv + n] = simd::bf16_to_f32(simd::f32_to_bf16(simd::reduce_add(acc)));
    }
  });
  // the mixer, its output rounded to bf16 into h (free again)
  mo.shape.qkv_stride = mo.shape.z_stride = C + V;
  mo.shape.ba_stride = 2 * Hv;
  at::BFloat16* mixed = reinterpret_cast<at::BFloat16*>(h.data());
  run_mix(mo, f.data(), f.data() + C, ba.data(), ba.data() + Hv, mixed);
  // out_proj, the residual, the MLP
  matmul(out_proj, h.data(), M, group_size, f.data());
  if (attention_only) {
    for_rows(M, [&](int64_t m) { residual_add(xp + m * H, f.data() + m * H, H, op_out + m * H, 1.f); });
    return out;
  }
  for_rows(M, [&](int64_t m) {
    residual_add(xp + m * H, f.data() + m * H, H, x1.data() + m * H, 1.f);
    post_norm.apply(x1.data() + m * H, H, float(eps), h.data() + m * H);
  });
  matmul(gate_up, h.data(), M, group_size, f.data());
  for_rows(M, [&](int64_t m) {
    const float* g = f.data() + m * 2 * I;
    for (int64_t i = 0; i < I; i += 16) {
      const V16 gv = round_bf16(simd::load(g + i)), uv = round_bf16(simd::load(g + I + i));
      const V16 a = round_bf16(gv / (simd::set1(1.f) + simd::exp(simd::zero() - gv)));
      store_bf16(h.data() + m * I + i, a * uv);
    }
  });
  matmul(down, h.data(), M, group_size, f.data());
  for_rows(M, [&](int64_t m) { residual_add(x1.data() + m * H, f.data() + m * H, H, op_out + m * H, 1.f); });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(NEXTN_OPS, m) {
  m.def("gated_deltanet_layer(Tensor x, Tensor[] norms, Tensor[] qkvz, Tensor ba, Tensor[] out, Tensor[] gate_up, "
        "Tensor[] down, Tensor conv_w, Tensor a_log, Tensor dt_bias, Tensor norm_w, Tensor(a!) conv_ring, "
        "Tensor(b!) ssm, Tensor(c!) pending, Tensor slots, Tensor committed, Tensor fresh, Tensor valid, "
        "int key_heads, int group_size, "
        "float eps, float mix_eps, bool int8_activations=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(NEXTN_OPS, CPU, m) { m.impl("gated_deltanet_layer", &gated_deltanet_layer); }
