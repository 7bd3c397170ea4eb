// Gated DeltaNet's token mixer over raw pointers, shared by its ops (gated_delta_cpu.cpp: the recurrence and the
// mixer; deltanet_layer_cpu.cpp: the whole layer). Formulas and sources: gated_delta_cpu.cpp's header.
#pragma once

#include <ATen/core/Tensor.h>

#include "cpu_kernels.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace nextn_cpu::deltanet {

using simd::V16;

// One token of the rule on the state s [Dk rows of Dp = 16·ceil(Dv/16) floats]: S = decay · S; m = kᵀS;
// S = S + k ⊗ ((v − m) · beta); o = qᵀS (o, m, delta: Dp floats of scratch). Two passes over S, rows in order.
inline void delta_token(float* s, int64_t Dk, int64_t Dv, const float* qt, const float* kt, const float* vt,
                        float decay, float beta, float* m, float* delta, float* o) {
  const int64_t C = (Dv + 15) / 16, Dp = C * 16;
  const V16 g = simd::set1(decay);
  // pass 1: S = decay · S, m = kᵀS (rows in order)
  for (int64_t c = 0; c < C; ++c) simd::store(m + c * 16, simd::zero());
  for (int64_t i = 0; i < Dk; ++i) {
    const V16 ki = simd::set1(kt[i]);
    float* si = s + i * Dp;
    for (int64_t c = 0; c < C; ++c) {
      const V16 sv = simd::load(si + c * 16) * g;
      simd::store(si + c * 16, sv);
      simd::store(m + c * 16, simd::fmadd(ki, sv, simd::load(m + c * 16)));
    }
  }
  const V16 bb = simd::set1(beta);
  for (int64_t c = 0; c < C; ++c) {
    const int64_t n = std::min<int64_t>(16, Dv - c * 16);
    simd::store(delta + c * 16, (simd::load(vt + c * 16, n) - simd::load(m + c * 16)) * bb);
    simd::store(o + c * 16, simd::zero());
  }
  // pass 2: S = S + k ⊗ delta, out = qᵀS
  for (int64_t i = 0; i < Dk; ++i) {
    const V16 ki = simd::set1(kt[i]), qi = simd::set1(qt[i]);
    float* si = s + i * Dp;
    for (int64_t c = 0; c < C; ++c) {
      const V16 sv = simd::fmadd(ki, simd::load(delta + c * 16), simd::load(si + c * 16));
      simd::store(si + c * 16, sv);
      simd::store(o + c * 16, simd::fmadd(qi, sv, simd::load(o + c * 16)));
    }
  }
}

// One (row, value head)'s recurrence over a forward's tokens, on the state layout of models/recurrent_state.py:
// `ssm` [slots, Hv, Dk, Dv] holds each slot's state before its pending tokens, `pending` [slots, R, Hv, U] (U = Dk +
// Dv + 1) those tokens' updates (k, d, decay: S = decay · S, then S = S + k ⊗ d — the rule's two steps, so applying
// them again gives the same bits). A forward first commits `committed` pending updates (the tokens of the slot's last
// forward that were accepted), then keeps the state before its own last R valid tokens as the slot's state and their
// updates as the pending ones. Keeping R whole states (Dk · Dv floats each) instead was most of a verify step's cost.
class HeadRecurrence {
 public:
  HeadRecurrence(int64_t Dk, int64_t Dv, int64_t Hv, int64_t R)
      : Dk_(Dk), Dv_(Dv), Dp_((Dv + 15) / 16 * 16), stride_(Hv * unit(Dk, Dv)), R_(R),
        s_(Dk * Dp_), m_(Dp_), d_(Dp_), o_(Dp_) {}

  static int64_t unit(int64_t Dk, int64_t Dv) { return Dk + Dv + 1; }

  // Row b's head h: its slot's state `ssm_h` (ssm[slot, h]) and pending updates `pending_h` (pending[slot, 0, h]).
  // One pass: each row of the state is read, the committed updates applied in registers (each element's operations
  // those of `delta_token`, in order: the same bits), and written to the scratch state — and, when the forward's
  // first token is already one the slot keeps pending, back as the slot's state.
  void start(float* ssm_h, float* pending_h, bool fresh, int64_t committed, int64_t n_valid) {
    ssm_ = ssm_h;
    pending_ = pending_h;
    lo_ = std::max<int64_t>(0, n_valid - R_);
    const bool keep = lo_ == 0 && n_valid > 0;
    stored_ = keep;
    const int64_t C = Dp_ / 16;
    for (int64_t i = 0; i < Dk_; ++i) {
      float* si = &s_[i * Dp_];
      for (int64_t c = 0; c < C; ++c) {
        const int64_t n = std::min<int64_t>(16, Dv_ - c * 16);
        V16 sv = simd::zero();
        if (!fresh) {
          sv = simd::load(ssm_h + i * Dv_ + c * 16, n);
          for (int64_t j = 0; j < committed; ++j) {
            const float* u = pending_h + j * stride_;
            sv = sv * simd::set1(u[Dk_ + Dv_]);
            sv = simd::fmadd(simd::set1(u[i]), simd::load(u + Dk_ + c * 16, n), sv);
          }
        }
        simd::store(si + c * 16, sv);
        if (keep) simd::store(ssm_h + i * Dv_ + c * 16, sv, n);
      }
    }
  }

  // Valid token t of the forward (q, k normalised): runs the rule, keeps what the ring keeps; returns its output o
  // (Dv floats)
  const float* token(int64_t t, const float* q, const float* k, const float* v, float decay, float beta) {
    if (t == lo_ && !stored_)  // the state before the forward's last R valid tokens: the slot's state from now on
      for (int64_t i = 0; i < Dk_; ++i) std::memcpy(ssm_ + i * Dv_, &s_[i * Dp_], Dv_ * sizeof(float));
    delta_token(s_.data(), Dk_, Dv_, q, k, v, decay, beta, m_.data(), d_.data(), o_.data());
    if (t >= lo_) {
      float* u = pending_ + (t - lo_) * stride_;
      std::memcpy(u, k, Dk_ * sizeof(float));
      std::memcpy(u + Dk_, d_.data(), Dv_ * sizeof(float));
      u[Dk_ + Dv_] = decay;
    }
    return o_.data();
  }

 private:
  int64_t Dk_, Dv_, Dp_, stride_, R_, lo_ = 0;
  bool stored_ = false;
  float* ssm_ = nullptr;
  float* pending_ = nullptr;
  std::vector<float> s_, m_, d_, o_;
};

// --- the whole token mixer of a Gated DeltaNet layer between its input projections and out_proj

// silu(v) = v / (1 + exp(−v)), 16 lanes (simd::exp: the same for every lane whatever the batch)
inline V16 silu(const V16& v) { return v / (simd::set1(1.f) + simd::exp(v * simd::set1(-1.f))); }

// Σ x² of n floats (16-lane partial sums, then across lanes: a fixed order for a given n)
inline float sum_sq(const float* x, int64_t n) {
  V16 acc = simd::zero();
  for (int64_t i = 0; i < n; i += 16) {
    const V16 v = simd::load(x + i, std::min<int64_t>(16, n - i));
    acc = simd::fmadd(v, v, acc);
  }
  return simd::reduce_add(acc);
}

// The mixer's sizes; the strides are the elements between two tokens' rows of qkv, z and b / a (a fused layer reads
// them from its concatenated projections)
struct MixShape {
  int64_t B, T, Hk, Hv, Dk, Dv, K, R;
  float eps;
  int64_t qkv_stride, z_stride, ba_stride;
  int64_t channels() const { return 2 * Hk * Dk + Hv * Dv; }
};

// The mixer of B rows of T tokens (E: the projections' element type, float or at::BFloat16; O: the output's):
// out [B·T, Hv·Dv] from qkv, z, b, a; the rings written (gated_delta_cpu.cpp's header)
template <typename E, typename O>
void mix(const E* qkv, const E* z, const E* bproj, const E* aproj, const float* conv_w, const float* a_log,
         const float* dt_bias, const float* norm_w, float* conv_ring, float* ssm, float* pending,
         const int64_t* slots, const int64_t* committed, const bool* fresh, const bool* valid, const MixShape& m,
         O* out) {
  const int64_t B = m.B, T = m.T, Hk = m.Hk, Hv = m.Hv, Dk = m.Dk, Dv = m.Dv, K = m.K, R = m.R, C = m.channels();
  const int64_t W = K - 1 + T;  // a row's conv window: the state before its first token, then its T inputs
  std::vector<int64_t> n_valid(B, 0);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) n_valid[b] += valid[b * T + t];
  // the window [B, W, C] in f32 and the conv weight by tap [K, C] (read before any ring entry is written)
  std::vector<float> win(B * W * C), taps(K * C), mixed(B * T * C);
  for (int64_t c = 0; c < C; ++c)
    for (int64_t j = 0; j < K; ++j) taps[j * C + c] = conv_w[c * K + j];
  at::parallel_for(0, B * W, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t b = r / W, j = r % W;
      float* dst = &win[r * C];
      if (j >= K - 1) {
        const E* src = qkv + (b * T + j - (K - 1)) * m.qkv_stride;
        for (int64_t c = 0; c < C; ++c) dst[c] = float(src[c]);
      } else if (fresh[b]) {
        std::fill(dst, dst + C, 0.f);
      } else {
        const float* state = conv_ring + (slots[b] * R + committed[b] - 1) * C * (K - 1);
        for (int64_t c = 0; c < C; ++c) dst[c] = state[c * (K - 1) + j];
      }
    }
  });
  // the causal depthwise conv and silu, token by token: Σ_j w[c, j] · window[t + j, c], taps in order
  at::parallel_for(0, B * T, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t b = r / T, t = r % T;
      const float* x = &win[(b * W + t) * C];
      float* dst = &mixed[r * C];
      for (int64_t c = 0; c < C; c += 16) {
        const int64_t n = std::min<int64_t>(16, C - c);
        V16 acc = simd::load(&taps[c], n) * simd::load(x + c, n);
        for (int64_t j = 1; j < K; ++j) acc = acc + simd::load(&taps[j * C + c], n) * simd::load(x + j * C + c, n);
        simd::store(dst + c, silu(acc), n);
      }
    }
  });
  // the conv state after each of the last R valid tokens (in order): the window's K − 1 inputs after it
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = std::max<int64_t>(0, n_valid[b] - R); t < n_valid[b]; ++t) {
      float* state = conv_ring + (slots[b] * R + t - std::max<int64_t>(0, n_valid[b] - R)) * C * (K - 1);
      for (int64_t j = 0; j < K - 1; ++j) {
        const float* col = &win[(b * W + t + 1 + j) * C];
        for (int64_t c = 0; c < C; ++c) state[c * (K - 1) + j] = col[c];
      }
    }
  // per (row, value head): l2-normed q, k, the gates, the recurrence, the gated RMSNorm
  const int64_t Dp = (Dv + 15) / 16 * 16, rep = Hv / Hk, U = HeadRecurrence::unit(Dk, Dv);
  const float q_scale = 1.f / std::sqrt(float(Dk));
  at::parallel_for(0, B * Hv, 1, [&](int64_t w0, int64_t w1) {
    HeadRecurrence rec(Dk, Dv, Hv, R);
    std::vector<float> qn(Dk), kn(Dk), gate(Dp), y(Dp);
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t b = w / Hv, h = w % Hv, hk = h / rep;
      rec.start(ssm + (slots[b] * Hv + h) * Dk * Dv, pending + (slots[b] * R * Hv + h) * U, fresh[b], committed[b],
                n_valid[b]);
      const double a_h = std::exp(double(a_log[h]));
      for (int64_t t = 0; t < T; ++t) {
        const int64_t bt = b * T + t;
        O* ot = out + (bt * Hv + h) * Dv;
        if (!valid[bt]) {
          std::fill(ot, ot + Dv, O(0.f));
          continue;
        }
        const float* row = &mixed[bt * C];
        const float* q = row + hk * Dk;
        const float* k = row + Hk * Dk + hk * Dk;
        const float* v = row + 2 * Hk * Dk + h * Dv;
        const float qi = 1.f / std::sqrt(sum_sq(q, Dk) + 1e-6f), ki = 1.f / std::sqrt(sum_sq(k, Dk) + 1e-6f);
        for (int64_t i = 0; i < Dk; ++i) {
          qn[i] = (q[i] * qi) * q_scale;
          kn[i] = k[i] * ki;
        }
        const double bv = double(float(bproj[bt * m.ba_stride + h]));
        const double av = double(float(float(aproj[bt * m.ba_stride + h]) + dt_bias[h]));
        const float beta = float(1.0 / (1.0 + std::exp(-bv)));
        const float softplus = av > 20.0 ? float(av) : float(std::log1p(std::exp(av)));
        const float decay = float(std::exp(-double(float(a_h) * softplus)));
        const float* o = rec.token(t, qn.data(), kn.data(), v, decay, beta);
        // gated RMSNorm: w · (o · rsqrt(mean(o²) + eps)) · silu(z)
        const E* zt = z + bt * m.z_stride + h * Dv;
        for (int64_t i = 0; i < Dv; ++i) gate[i] = float(zt[i]);
        const float inv = 1.f / std::sqrt(sum_sq(o, Dv) / float(Dv) + m.eps);
        for (int64_t c = 0; c < Dv; c += 16) {
          const int64_t n = std::min<int64_t>(16, Dv - c);
          const V16 yv = (simd::load(norm_w + c, n) * (simd::load(o + c, n) * simd::set1(inv))) *
                        silu(simd::load(&gate[c], n));
          simd::store(&y[c], yv, n);
        }
        for (int64_t i = 0; i < Dv; ++i) ot[i] = O(y[i]);
      }
    }
  });
}

// The recurrent state's tensors checked for B rows (`op`: for the errors): ssm [slots, Hv, Dk, Dv] and pending
// [slots, R, Hv, Dk + Dv + 1] float32 contiguous, slots and committed [B] int64 (committed in [lo, R] for rows that
// are not fresh), fresh [B] bool; returns (slots, Hv, Dk, Dv, R)
inline std::array<int64_t, 5> check_state(const at::Tensor& ssm, const at::Tensor& pending, const at::Tensor& slots,
                                          const at::Tensor& committed, const at::Tensor& fresh, int64_t B, int64_t lo,
                                          const char* op) {
  TORCH_CHECK(ssm.dim() == 4 && ssm.is_contiguous() && ssm.scalar_type() == at::kFloat, op,
              ": ssm must be a contiguous float32 [slots, Hv, Dk, Dv]");
  const int64_t S = ssm.size(0), Hv = ssm.size(1), Dk = ssm.size(2), Dv = ssm.size(3);
  TORCH_CHECK(pending.dim() == 4 && pending.is_contiguous() && pending.scalar_type() == at::kFloat &&
                  pending.size(0) == S && pending.size(1) >= 1 && pending.size(2) == Hv &&
                  pending.size(3) == HeadRecurrence::unit(Dk, Dv),
              op, ": pending must be a contiguous float32 [slots, R, Hv, Dk + Dv + 1]");
  const int64_t R = pending.size(1);
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == B && slots.is_contiguous() &&
                  committed.scalar_type() == at::kLong && committed.numel() == B && committed.is_contiguous(),
              op, ": slots, committed must be contiguous [B] int64");
  TORCH_CHECK(fresh.scalar_type() == at::kBool && fresh.numel() == B && fresh.is_contiguous(), op,
              ": fresh must be a contiguous [B] bool");
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t* cp = committed.data_ptr<int64_t>();
  const bool* fp = fresh.data_ptr<bool>();
  for (int64_t i = 0; i < B; ++i)
    TORCH_CHECK(sp[i] >= 0 && sp[i] < S && (fp[i] || (cp[i] >= lo && cp[i] <= R)), op,
                ": a slot or committed count is out of range");
  return {S, Hv, Dk, Dv, R};
}

// The mixer's parameters and state checked for B rows of T tokens (`op`: for the errors), contiguous, with the shape
// (its strides left to the caller)
struct MixOperands {
  at::Tensor conv_w, a_log, dt_bias, norm_w, slots, committed, fresh, valid;
  float* conv_ring;
  float* ssm;
  float* pending;
  MixShape shape;
};

inline MixOperands check_mix(const at::Tensor& conv_w, const at::Tensor& a_log, const at::Tensor& dt_bias,
                             const at::Tensor& norm_w, at::Tensor& conv_ring, at::Tensor& ssm, at::Tensor& pending,
                             const at::Tensor& slots, const at::Tensor& committed, const at::Tensor& fresh,
                             const at::Tensor& valid, int64_t B, int64_t T, int64_t key_heads, double eps,
                             const char* op) {
  const at::Tensor sc = slots.contiguous(), cc = committed.contiguous(), fc = fresh.contiguous();
  // a row that is not fresh starts from the conv state after its last committed token: committed >= 1
  const auto [S, Hv, Dk, Dv, R] = check_state(ssm, pending, sc, cc, fc, B, 1, op);
  TORCH_CHECK(key_heads > 0 && Hv % key_heads == 0, op, ": value heads must be a multiple of key_heads");
  const int64_t C = 2 * key_heads * Dk + Hv * Dv;
  TORCH_CHECK(conv_w.scalar_type() == at::kFloat && conv_w.dim() == 2 && conv_w.size(0) == C && conv_w.size(1) >= 2,
              op, ": conv_w must be float32 [", C, ", kernel]");
  const int64_t K = conv_w.size(1);
  TORCH_CHECK(conv_ring.scalar_type() == at::kFloat && conv_ring.is_contiguous() && conv_ring.dim() == 4 &&
                  conv_ring.size(0) == S && conv_ring.size(1) == R && conv_ring.size(2) == C &&
                  conv_ring.size(3) == K - 1,
              op, ": conv_ring must be a contiguous float32 [slots, R, C, kernel − 1]");
  for (const at::Tensor* t : {&a_log, &dt_bias, &norm_w})
    TORCH_CHECK(t->scalar_type() == at::kFloat, op, ": A_log, dt_bias, norm weight must be float32");
  TORCH_CHECK(a_log.numel() == Hv && dt_bias.numel() == Hv && norm_w.numel() == Dv, op,
              ": A_log, dt_bias [Hv], norm weight [Dv]");
  TORCH_CHECK(valid.scalar_type() == at::kBool && valid.numel() == B * T, op, ": valid must be [B, T] bool");
  return MixOperands{conv_w.contiguous(), a_log.contiguous(), dt_bias.contiguous(), norm_w.contiguous(), sc, cc, fc,
                     valid.contiguous(), conv_ring.data_ptr<float>(), ssm.data_ptr<float>(),
                     pending.data_ptr<float>(), MixShape{B, T, key_heads, Hv, Dk, Dv, K, R, float(eps), 0, 0, 0}};
}

template <typename E, typename O>
void run_mix(const MixOperands& m, const E* qkv, const E* z, const E* b, const E* a, O* out) {
  mix<E, O>(qkv, z, b, a, m.conv_w.data_ptr<float>(), m.a_log.data_ptr<float>(), m.dt_bias.data_ptr<float>(),
            m.norm_w.data_ptr<float>(), m.conv_ring, m.ssm, m.pending, m.slots.data_ptr<int64_t>(),
            m.committed.data_ptr<int64_t>(),
            m.fresh.data_ptr<bool>(), m.valid.data_ptr<bool>(), m.shape, out);
}

}  // namespace nextn_cpu::deltanet
