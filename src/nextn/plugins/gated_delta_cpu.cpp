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
// Why our own kernel: the reference runs ~6 tensor ops per token in Python; this is one call per layer, two passes
// over S per token. Each (row, head) is one task whose arithmetic does not depend on T, B or the thread
// (batch-invariant: a verify step's rows equal one-token steps'). One source over simd.h for every ISA variant.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_kernels.h"

#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <vector>

namespace {

namespace simd = nextn_cpu::simd;
using simd::V16;

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
        const V16 g = simd::set1(decay[bt]);
        // pass 1: S = decay · S, m = kᵀS (rows in order)
        for (int64_t c = 0; c < C; ++c) simd::store(&m[c * 16], simd::zero());
        for (int64_t i = 0; i < Dk; ++i) {
          const V16 ki = simd::set1(kt[i]);
          float* si = &s[i * Dp];
          for (int64_t c = 0; c < C; ++c) {
            const V16 sv = simd::load(si + c * 16) * g;
            simd::store(si + c * 16, sv);
            simd::store(&m[c * 16], simd::fmadd(ki, sv, simd::load(&m[c * 16])));
          }
        }
        const V16 bb = simd::set1(beta[bt]);
        for (int64_t c = 0; c < C; ++c) {
          const int64_t n = std::min<int64_t>(16, Dv - c * 16);
          simd::store(&delta[c * 16], (simd::load(vt + c * 16, n) - simd::load(&m[c * 16])) * bb);
          simd::store(&o[c * 16], simd::zero());
        }
        // pass 2: S = S + k ⊗ delta, out = qᵀS
        for (int64_t i = 0; i < Dk; ++i) {
          const V16 ki = simd::set1(kt[i]), qi = simd::set1(qt[i]);
          float* si = &s[i * Dp];
          for (int64_t c = 0; c < C; ++c) {
            const V16 sv = simd::fmadd(ki, simd::load(&delta[c * 16]), simd::load(si + c * 16));
            simd::store(si + c * 16, sv);
            simd::store(&o[c * 16], simd::fmadd(qi, sv, simd::load(&o[c * 16])));
          }
        }
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

}  // namespace

TORCH_LIBRARY_FRAGMENT(NEXTN_OPS, m) {
  m.def("gated_delta_rule(Tensor q, Tensor k, Tensor v, Tensor decay, Tensor beta, Tensor(a!) ring, Tensor slots, "
        "Tensor entry, Tensor fresh, Tensor valid) -> Tensor");
}

TORCH_LIBRARY_IMPL(NEXTN_OPS, CPU, m) { m.impl("gated_delta_rule", &gated_delta_rule); }
