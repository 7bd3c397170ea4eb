// The gated delta rule over per-request recurrent state: Qwen3.5's / Qwen3-Next's linear attention (nextn plugin;
// Python side and PyTorch reference: models/gated_deltanet.py, `GatedDeltaNet.forward`).
//
//   nextn::gated_delta_rule(q [B, T, H, Dk], k [B, T, H, Dk], v [B, T, H, Dv], decay [B, T, H], beta [B, T, H],
//                           ring [slots, R, H, Dk, Dv], slots [B] int64, entry [B] int64, fresh [B] bool,
//                           valid [B, T] bool) -> out [B, T, H, Dv]             all float32
//
// Per row b and head h, from the state S [Dk, Dv] in ring[slots[b], entry[b], h] (zeros where fresh[b]), per token t
// with valid[b, t] (Yang, Kautz & Hatamizadeh 2025, "Gated Delta Networks", eq. 10; HF `modeling_qwen3_5.py`,
// `torch_recurrent_gated_delta_rule`):
//   S = decay · S;  m = kᵀS;  S = S + k ⊗ ((v − m) · beta);  out = qᵀS
// and S is kept in ring[slots[b], t mod R, h] for the last R valid tokens (what a verify step may accept:
// models/recurrent_state.py). q is expected l2-normalised and scaled, k l2-normalised (the module does it).
// Pads (valid false) are skipped: their outputs are 0 and the ring keeps what it held.
//
//   nextn::gated_deltanet_mix(qkv [B, T, 2·Hk·Dk + Hv·Dv], z [B, T, Hv·Dv], b [B, T, Hv], a [B, T, Hv] (the layer's
//       input projections, all float32 or all bf16), conv_w [C, kernel] f32, a_log [Hv], dt_bias [Hv], norm_w [Dv] f32,
//       conv_ring [slots, R, C, kernel − 1] f32 (written), ring [slots, R, Hv, Dk, Dv] f32 (written), slots, entry,
//       fresh, valid, key_heads, eps) -> [B, T, Hv·Dv] in qkv's dtype
// is the layer's whole token mixer between its input projections and out_proj (models/gated_deltanet.py, the
// module's PyTorch path is the reference): the causal depthwise conv over the conv state in
// conv_ring[slots[b], entry[b]] and the T inputs, silu, q and k l2-normalised (q also / sqrt(Dk)), beta = sigmoid(b),
// decay = exp(−exp(A_log) · softplus(a + dt_bias)), the rule above, and norm_w · rmsnorm(o) · silu(z) per value
// head; the conv states after the last R valid tokens are kept in conv_ring as the recurrent states in ring. One
// call per layer in place of ~70 tensor ops. The transcendentals of b and a in double (as the module's `row_exact`),
// silu through simd::exp (the same for every lane): each row computed alone, batch-invariant.
//
// Why our own kernel: the reference runs ~6 tensor ops per token in Python; this is one call per layer, two passes
// over S per token. Each (row, head) is one task whose arithmetic does not depend on T, B or the thread
// (batch-invariant: a verify step's rows equal one-token steps'). One source over simd.h for every ISA variant.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_kernels.h"
#include "gated_deltanet.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <vector>

namespace {

namespace simd = nextn_cpu::simd;
using simd::V16;
using nextn_cpu::deltanet::delta_token;
using nextn_cpu::deltanet::check_mix;
using nextn_cpu::deltanet::MixOperands;
using nextn_cpu::deltanet::run_mix;

void run(const float* q, const float* k, const float* v, const float* decay, const float* beta, float* ring,
         const int64_t* slots, const int64_t* entry, const bool* fresh, const bool* valid, int64_t B, int64_t T,
         int64_t H, int64_t Dk, int64_t Dv, int64_t R, float* out) {
  const int64_t C = (Dv + 15) / 16, Dp = C * 16;  // a state row padded to whole 16-lane chunks
  const int64_t state = Dk * Dv;
  at::parallel_for(0, B * H, 1, [&](int64_t w0, int64_t w1) {
    std::vector<float> s(Dk * Dp), m(Dp), delta(Dp), o(Dp);
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t b = w / H, h = w % H;
      float* slot_ring = ring + slots[b] * R * H * state;
      std::fill(s.begin(), s.end(), 0.f);
      if (!fresh[b]) {
        const float* init = slot_ring + (entry[b] * H + h) * state;
        for (int64_t i = 0; i < Dk; ++i) std::memcpy(&s[i * Dp], init + i * Dv, Dv * sizeof(float));
      }
      int64_t n_valid = 0;
      for (int64_t t = 0; t < T; ++t) n_valid += valid[b * T + t];
      for (int64_t t = 0; t < T; ++t) {
        const int64_t bt = (b * T + t) * H + h;
        float* ot = out + bt * Dv;
        if (!valid[b * T + t]) {
          std::memset(ot, 0, Dv * sizeof(float));
          continue;
        }
        const float* qt = q + bt * Dk;
        const float* kt = k + bt * Dk;
        const float* vt = v + bt * Dv;
        delta_token(s.data(), Dk, Dv, qt, kt, vt, decay[bt], beta[bt], m.data(), delta.data(), o.data());
        std::memcpy(ot, o.data(), Dv * sizeof(float));
        if (t >= n_valid - R) {  // one of the last R valid tokens: keep its state
          float* keep = slot_ring + ((t % R) * H + h) * state;
          for (int64_t i = 0; i < Dk; ++i) std::memcpy(keep + i * Dv, &s[i * Dp], Dv * sizeof(float));
        }
      }
    }
  });
}

at::Tensor gated_delta_rule(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& decay,
                            const at::Tensor& beta, at::Tensor ring, const at::Tensor& slots, const at::Tensor& entry,
                            const at::Tensor& fresh, const at::Tensor& valid) {
  TORCH_CHECK(q.dim() == 4 && k.sizes() == q.sizes() && v.dim() == 4, "gated_delta_rule: q, k [B, T, H, Dk], v [B, T, H, Dv]");
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2), Dk = q.size(3), Dv = v.size(3);
  TORCH_CHECK(v.size(0) == B && v.size(1) == T && v.size(2) == H, "gated_delta_rule: v must be [B, T, H, Dv]");
  TORCH_CHECK(decay.numel() == B * T * H && beta.numel() == B * T * H, "gated_delta_rule: decay, beta [B, T, H]");
  TORCH_CHECK(ring.dim() == 5 && ring.size(2) == H && ring.size(3) == Dk && ring.size(4) == Dv && ring.is_contiguous(),
              "gated_delta_rule: ring must be a contiguous [slots, R, H, Dk, Dv]");
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&q, &k, &v, &decay, &beta, &ring})
    TORCH_CHECK(t->scalar_type() == at::kFloat, "gated_delta_rule: float32 tensors expected");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == B && entry.scalar_type() == at::kLong &&
                  entry.numel() == B, "gated_delta_rule: slots, entry [B] int64");
  TORCH_CHECK(fresh.scalar_type() == at::kBool && fresh.numel() == B && valid.scalar_type() == at::kBool &&
                  valid.numel() == B * T, "gated_delta_rule: fresh [B], valid [B, T] bool");
  const at::Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous(), dc = decay.contiguous(),
                   bc = beta.contiguous(), sc = slots.contiguous(), ec = entry.contiguous(), fc = fresh.contiguous(),
                   vv = valid.contiguous();
  const int64_t S = ring.size(0), R = ring.size(1);
  const int64_t* sp = sc.data_ptr<int64_t>();
  const int64_t* ep = ec.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(sp[b] >= 0 && sp[b] < S && ep[b] >= 0 && ep[b] < R, "gated_delta_rule: a slot or entry is out of range");
  at::Tensor out = at::empty({B, T, H, Dv}, q.options());
  run(qc.data_ptr<float>(), kc.data_ptr<float>(), vc.data_ptr<float>(), dc.data_ptr<float>(), bc.data_ptr<float>(),
      ring.data_ptr<float>(), sp, ep, fc.data_ptr<bool>(), vv.data_ptr<bool>(), B, T, H, Dk, Dv, R,
      out.data_ptr<float>());
  return out;
}

at::Tensor gated_deltanet_mix(const at::Tensor& qkv, const at::Tensor& z, const at::Tensor& b, const at::Tensor& a,
                              const at::Tensor& conv_w, const at::Tensor& a_log, const at::Tensor& dt_bias,
                              const at::Tensor& norm_w, at::Tensor conv_ring, at::Tensor ring, const at::Tensor& slots,
                              const at::Tensor& entry, const at::Tensor& fresh, const at::Tensor& valid,
                              int64_t key_heads, double eps) {
  const char* op = "gated_deltanet_mix";
  TORCH_CHECK(qkv.dim() == 3, op, ": qkv must be [B, T, 2·Hk·Dk + Hv·Dv]");
  const int64_t B = qkv.size(0), T = qkv.size(1);
  MixOperands m = check_mix(conv_w, a_log, dt_bias, norm_w, conv_ring, ring, slots, entry, fresh, valid, B, T,
                            key_heads, eps, op);
  const int64_t C = m.shape.channels(), Hv = m.shape.Hv, Dv = m.shape.Dv;
  TORCH_CHECK(qkv.size(2) == C, op, ": qkv has ", qkv.size(2), " channels, the ring's shapes say ", C);
  TORCH_CHECK(z.scalar_type() == qkv.scalar_type() && b.scalar_type() == qkv.scalar_type() &&
                  a.scalar_type() == qkv.scalar_type() &&
                  (qkv.scalar_type() == at::kFloat || qkv.scalar_type() == at::kBFloat16),
              op, ": qkv, z, b, a must share one dtype, float32 or bfloat16");
  TORCH_CHECK(z.numel() == B * T * Hv * Dv && b.numel() == B * T * Hv && a.numel() == B * T * Hv,
              op, ": z [B, T, Hv·Dv], b and a [B, T, Hv]");
  m.shape.qkv_stride = C;
  m.shape.z_stride = Hv * Dv;
  m.shape.ba_stride = Hv;
  const at::Tensor xc = qkv.contiguous(), zc = z.contiguous(), bc = b.contiguous(), ac = a.contiguous();
  at::Tensor out = at::empty({B, T, Hv * Dv}, qkv.options());
  if (qkv.scalar_type() == at::kFloat) {
    run_mix(m, xc.data_ptr<float>(), zc.data_ptr<float>(), bc.data_ptr<float>(), ac.data_ptr<float>(),
            out.data_ptr<float>());
  } else {
    using BF = at::BFloat16;
    run_mix(m, xc.data_ptr<BF>(), zc.data_ptr<BF>(), bc.data_ptr<BF>(), ac.data_ptr<BF>(), out.data_ptr<BF>());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(NEXTN_OPS, m) {
  m.def("gated_delta_rule(Tensor q, Tensor k, Tensor v, Tensor decay, Tensor beta, Tensor(a!) ring, Tensor slots, "
        "Tensor entry, Tensor fresh, Tensor valid) -> Tensor");
  m.def("gated_deltanet_mix(Tensor qkv, Tensor z, Tensor b, Tensor a, Tensor conv_w, Tensor a_log, Tensor dt_bias, "
        "Tensor norm_w, Tensor(a!) conv_ring, Tensor(b!) ring, Tensor slots, Tensor entry, Tensor fresh, "
        "Tensor valid, int key_heads, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(NEXTN_OPS, CPU, m) {
  m.impl("gated_delta_rule", &gated_delta_rule);
  m.impl("gated_deltanet_mix", &gated_deltanet_mix);
}
