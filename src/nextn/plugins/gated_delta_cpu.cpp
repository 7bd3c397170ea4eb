// The gated delta rule over per-request recurrent state: Qwen3.5's / Qwen3-Next's linear attention (nextn plugin;
// Python side and PyTorch reference: plugins/gated_delta.py, models/gated_deltanet.py `GatedDeltaNet.forward`).
//
//   nextn::gated_delta_rule(q [B, T, H, Dk], k [B, T, H, Dk], v [B, T, H, Dv], decay [B, T, H], beta [B, T, H],
//                           ssm [slots, H, Dk, Dv], pending [slots, R, H, Dk + Dv + 1] (both written), slots [B]
//                           int64, committed [B] int64, fresh [B] bool, valid [B, T] bool) -> out [B, T, H, Dv]
//                           (tensors float32 unless said)
//
// Per row b and head h, from the state S [Dk, Dv] (zeros where fresh[b]; else ssm[slots[b], h] with the first
// committed[b] updates of pending[slots[b], :, h] applied), per token t with valid[b, t] (Yang, Kautz &
// Hatamizadeh 2025, "Gated Delta Networks", eq. 10; HF `modeling_qwen3_5.py`, `torch_recurrent_gated_delta_rule`):
//   S = decay · S;  m = kᵀS;  d = (v − m) · beta;  S = S + k ⊗ d;  out = qᵀS
// then the state before the last R valid tokens goes to ssm[slots[b], h] and their updates (k, d, decay) to
// pending[slots[b], 0..R-1, h] in order (gated_deltanet.h `HeadRecurrence`; models/recurrent_state.py: a verify step
// may accept any prefix of its tokens). q is expected l2-normalised and scaled, k l2-normalised (the module does it).
// Pads (valid false, after the valid tokens) are skipped: their outputs are 0.
//
//   nextn::gated_deltanet_mix(qkv [B, T, 2·Hk·Dk + Hv·Dv], z [B, T, Hv·Dv], b [B, T, Hv], a [B, T, Hv] (the layer's
//       input projections, all float32 or all bf16), conv_w [C, kernel], a_log [Hv], dt_bias [Hv], norm_w [Dv],
//       conv_ring [slots, R, C, kernel − 1], ssm, pending (written), slots, committed, fresh, valid, key_heads, eps)
//       -> [B, T, Hv·Dv] in qkv's dtype
// is the layer's whole token mixer between its input projections and out_proj (models/gated_deltanet.py, the
// module's PyTorch path is the reference): the causal depthwise conv over the conv state after the row's last
// committed token (conv_ring[slots[b], committed[b] − 1]) and the T inputs, silu, q and k l2-normalised (q also
// / sqrt(Dk)), beta = sigmoid(b), decay = exp(−exp(A_log) · softplus(a + dt_bias)), the rule above, and norm_w ·
// rmsnorm(o) · silu(z) per value head; the conv states after the last R valid tokens are kept in conv_ring[slot,
// 0..R-1] in order. One call per layer in place of ~70 tensor ops. The transcendentals of b and a in double (as the
// module's `row_exact`), silu through simd::exp (the same for every lane): each row computed alone,
// batch-invariant.
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
using nextn_cpu::deltanet::HeadRecurrence;
using nextn_cpu::deltanet::check_mix;
using nextn_cpu::deltanet::MixOperands;
using nextn_cpu::deltanet::run_mix;

void run(const float* q, const float* k, const float* v, const float* decay, const float* beta, float* ssm,
         float* pending, const int64_t* slots, const int64_t* committed, const bool* fresh, const bool* valid,
         int64_t B, int64_t T, int64_t H, int64_t Dk, int64_t Dv, int64_t R, float* out) {
  const int64_t U = HeadRecurrence::unit(Dk, Dv);
  at::parallel_for(0, B * H, 1, [&](int64_t w0, int64_t w1) {
    HeadRecurrence rec(Dk, Dv, H, R);
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t b = w / H, h = w % H;
      int64_t n_valid = 0;
      for (int64_t t = 0; t < T; ++t) n_valid += valid[b * T + t];
      rec.start(ssm + (slots[b] * H + h) * Dk * Dv, pending + (slots[b] * R * H + h) * U, fresh[b], committed[b],
                n_valid);
      for (int64_t t = 0; t < T; ++t) {
        const int64_t bt = (b * T + t) * H + h;
        float* ot = out + bt * Dv;
        if (!valid[b * T + t]) {
          std::memset(ot, 0, Dv * sizeof(float));
          continue;
        }
        const float* o = rec.token(t, q + bt * Dk, k + bt * Dk, v + bt * Dv, decay[bt], beta[bt]);
        std::memcpy(ot, o, Dv * sizeof(float));
      }
    }
  });
}

at::Tensor gated_delta_rule(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& decay,
                            const at::Tensor& beta, at::Tensor ssm, at::Tensor pending, const at::Tensor& slots,
                            const at::Tensor& committed, const at::Tensor& fresh, const at::Tensor& valid) {
  const char* op = "gated_delta_rule";
  TORCH_CHECK(q.dim() == 4 && k.sizes() == q.sizes() && v.dim() == 4, op, ": q, k [B, T, H, Dk], v [B, T, H, Dv]");
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2), Dk = q.size(3), Dv = v.size(3);
  TORCH_CHECK(v.size(0) == B && v.size(1) == T && v.size(2) == H, op, ": v must be [B, T, H, Dv]");
  TORCH_CHECK(decay.numel() == B * T * H && beta.numel() == B * T * H, op, ": decay, beta [B, T, H]");
  for (const at::Tensor* t : {&q, &k, &v, &decay, &beta})
    TORCH_CHECK(t->scalar_type() == at::kFloat, op, ": float32 tensors expected");
  TORCH_CHECK(valid.scalar_type() == at::kBool && valid.numel() == B * T, op, ": valid must be [B, T] bool");
  const at::Tensor sc = slots.contiguous(), cc = committed.contiguous(), fc = fresh.contiguous();
  const auto [S, Hs, Dks, Dvs, R] = nextn_cpu::deltanet::check_state(ssm, pending, sc, cc, fc, B, 0, op);
  TORCH_CHECK(Hs == H && Dks == Dk && Dvs == Dv, op, ": ssm must be [slots, ", H, ", ", Dk, ", ", Dv, "]");
  const at::Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous(), dc = decay.contiguous(),
                   bc = beta.contiguous(), vv = valid.contiguous();
  at::Tensor out = at::empty({B, T, H, Dv}, q.options());
  run(qc.data_ptr<float>(), kc.data_ptr<float>(), vc.data_ptr<float>(), dc.data_ptr<float>(), bc.data_ptr<float>(),
      ssm.data_ptr<float>(), pending.data_ptr<float>(), sc.data_ptr<int64_t>(), cc.data_ptr<int64_t>(),
      fc.data_ptr<bool>(), vv.data_ptr<bool>(), B, T, H, Dk, Dv, R, out.data_ptr<float>());
  return out;
}

at::Tensor gated_deltanet_mix(const at::Tensor& qkv, const at::Tensor& z, const at::Tensor& b, const at::Tensor& a,
                              const at::Tensor& conv_w, const at::Tensor& a_log, const at::Tensor& dt_bias,
                              const at::Tensor& norm_w, at::Tensor conv_ring, at::Tensor ssm, at::Tensor pending,
                              const at::Tensor& slots, const at::Tensor& committed, const at::Tensor& fresh,
                              const at::Tensor& valid, int64_t key_heads, double eps) {
  const char* op = "gated_deltanet_mix";
  TORCH_CHECK(qkv.dim() == 3, op, ": qkv must be [B, T, 2·Hk·Dk + Hv·Dv]");
  const int64_t B = qkv.size(0), T = qkv.size(1);
  MixOperands m = check_mix(conv_w, a_log, dt_bias, norm_w, conv_ring, ssm, pending, slots, committed, fresh, valid,
                            B, T, key_heads, eps, op);
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
  m.def("gated_delta_rule(Tensor q, Tensor k, Tensor v, Tensor decay, Tensor beta, Tensor(a!) ssm, "
        "Tensor(b!) pending, Tensor slots, Tensor committed, Tensor fresh, Tensor valid) -> Tensor");
  m.def("gated_deltanet_mix(Tensor qkv, Tensor z, Tensor b, Tensor a, Tensor conv_w, Tensor a_log, Tensor dt_bias, "
        "Tensor norm_w, Tensor(a!) conv_ring, Tensor(b!) ssm, Tensor(c!) pending, Tensor slots, Tensor committed, "
        "Tensor fresh, Tensor valid, int key_heads, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(NEXTN_OPS, CPU, m) {
  m.impl("gated_delta_rule", &gated_delta_rule);
  m.impl("gated_deltanet_mix", &gated_deltanet_mix);
}
