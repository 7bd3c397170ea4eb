// Multi-head Latent Attention for the CPU, absorbed form, one op per layer (nextn plugin; Python side and the
// PyTorch reference: mla.py).
//
//   nextn::mla_attention(q_nope [B, T, NH, P], q_pe [B, T, NH, R], kv_b [NH, P + V, C] (kv_b_proj's weight),
//                        kv_cache [slots, C + R], context_slots [B, S] int64, visible [B, 1, T, S] bool, scale,
//                        kv_b_scale [NH, P + V] f32 | None) -> [B, T, NH * V] f32
//
// kv_b is the engine's dtype, or int8 with kv_b_scale (a weight-quantized engine: `plugins/mla.py`, each row of C
// values with its f32 scale): a row's values times its scale, the scale applied to q_nope[p] before the row's FMAs
// (W_UK) and to the dot product after it (W_UV). Half the bytes of bf16 from DRAM a step.
//
// Per query row (b, t, head h), f32 throughout:
//   q_lat = q_nope · W_UK[h]                     (W_UK[h] = kv_b[h, :P], [P, C]: P rows added in order)
//   score_j = scale · ([q_lat; q_pe] · cache[context_slots[b, j]])   over the C + R values of each cached key
//   o_lat = sum_j p_j · c_kv_j / sum_j p_j       (softmax over the visible keys, max-subtracted `simd::exp`)
//   out = o_lat · W_UV[h]^T                      (W_UV[h] = kv_b[h, P:], [V, C]: a dot product of C per output)
// DeepSeek-V2 report §2.1 (MLA), absorption as in vLLM's `mla/common.py`; the cache holds the normalised latent
// c_kv [C] and the roped shared key k_pe [R] per token, which is also the value (its first C values).
//
// Why our own kernel: PyTorch's path (two einsums around a gather, a mask and a softmax) picks its reduction order by
// the batch — MKL's and oneDNN's GEMMs block by the row count — so a verify step's rows drifted from plain steps'.
// Here every row is the same sequence of f32 operations whatever T, B, the task split or the thread
// (batch-invariant: tests/plugins/test_mla.py checks it bit for bit), reading the cache and kv_b in place.
// One source for every ISA variant over simd.h.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_kernels.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

namespace simd = nextn_cpu::simd;
using simd::V16;

using nextn_cpu::kKeys;
using nextn_cpu::kRegs;
using nextn_cpu::load16;

// The 64-byte lines of [p, p + bytes) prefetched into L2 (a weight row read next: kv_b streams from DRAM, once a step)
inline void prefetch_bytes(const void* p, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) simd::prefetch_l2(static_cast<const char*>(p) + b);
}

inline V16 load16(const int8_t* p, int64_t n) { return simd::load_int8(p, n); }

// A row of n values as f32 into dst (padded with zeros to a multiple of 16)
template <typename T>
inline void widen(const T* src, int64_t n, float* dst) {
  for (int64_t i = 0; i < n; i += 16) simd::store(dst + i, load16(src + i, std::min<int64_t>(16, n - i)));
}

// The dot products of one row x (f32, zero-padded to a multiple of 16) with 16 rows of n values (`rows`: bf16 or
// f32, read in place): per row the chunk products summed chunk by chunk (a mul, then FMAs), then each row's lanes
// summed in the variant's fixed tree (`reduce_add16`). Each row's arithmetic is the same whatever the other 15.
template <typename T>
inline V16 dot16(const float* x, const T* const* rows, int64_t n) {
  V16 a[16];
  for (int k0 = 0; k0 < 16; k0 += kKeys) {
    V16 s[kKeys];
    const V16 x0 = simd::load(x);
    const int64_t n0 = std::min<int64_t>(16, n);
#pragma GCC unroll 16
    for (int k = 0; k < kKeys; ++k) s[k] = load16(rows[k0 + k], n0) * x0;
    for (int64_t c = 16; c < n; c += 16) {
      const V16 xc = simd::load(x + c);
      const int64_t nc = std::min<int64_t>(16, n - c);
#pragma GCC unroll 16
      for (int k = 0; k < kKeys; ++k) s[k] = simd::fmadd(load16(rows[k0 + k] + c, nc), xc, s[k]);
    }
#pragma GCC unroll 16
    for (int k = 0; k < kKeys; ++k) a[k0 + k] = s[k];
  }
  return simd::reduce_add16(a);
}

// acc[c] += p[k] * lat[k][c] for NC chunks of 16, over the keys k < nk the row sees, in order, in registers
constexpr int kNC = kRegs / simd::kParts / 2;
template <int NC>
inline void weigh(float* acc, const float* lat, int64_t lat_row, const float* p, const bool* seen, int64_t nk) {
  V16 s[NC];
#pragma GCC unroll 16
  for (int c = 0; c < NC; ++c) s[c] = simd::load(acc + c * 16);
  for (int64_t k = 0; k < nk; ++k) {
    if (!seen[k]) continue;
    const V16 pk = simd::set1(p[k]);
#pragma GCC unroll 16
    for (int c = 0; c < NC; ++c) s[c] = simd::fmadd(pk, simd::load(lat + k * lat_row + c * 16), s[c]);
  }
#pragma GCC unroll 16
  for (int c = 0; c < NC; ++c) simd::store(acc + c * 16, s[c]);
}

constexpr int64_t kOneTile = 32;  // up to this many query tokens (a verify step's K + 1) in one task
constexpr int64_t kTile = 8;      // query tokens per task beyond that (a prefill)
constexpr int64_t kHeads = 4;     // heads per task (they share each key's load)

// One task: tokens [t0, t0 + nt) x heads [h0, h0 + nh) of sequence b.
// kv_b's rows are W (T, or int8 with kv_b_scale: a row's values times its f32 scale)
template <typename T, typename W>
void attend(const T* q_nope, const T* q_pe, const W* kv_b, const float* kv_b_scale, const T* kv, const int64_t* slots,
            const bool* vis, int64_t t0, int64_t nt, int64_t h0, int64_t nh, int64_t NH, int64_t P, int64_t R,
            int64_t V, int64_t C, int64_t S, float scale, float* out) {
  const int64_t D = C + R, Dp = (D + 15) / 16 * 16, Cp = (C + 15) / 16 * 16, S16 = (S + 15) / 16 * 16;
  const int64_t rows = nt * nh;  // token-major, then head
  std::vector<float> qf(rows * Dp, 0.f), scores(rows * S16), probs(rows * S16, 0.f), acc(rows * Cp, 0.f);
  std::vector<float> row_sum(rows), lat(16 * Cp, 0.f);
  const std::vector<T> zeros(Dp + Cp, T(0.f));  // the rows past a last partial block of 16
  const std::vector<W> wzeros(Cp, W(0));
  const T* ptrs[16];
  const W* wptrs[16];
  // 16 rows of n values for `dot16`, read by `readers` query rows: bf16 rows read by 8 or more widened once into `buf`
  // (exact, so the products are the same either way), else read in place
  std::vector<float> buf(16 * std::max(Dp, Cp));
  const float* fptrs[16];
  auto rows16 = [&](const auto* const* src, int64_t n, int64_t readers, auto&& dot) {
    using Row = std::remove_cv_t<std::remove_pointer_t<std::remove_cv_t<std::remove_reference_t<decltype(*src)>>>>;
    if constexpr (std::is_same_v<Row, float>) {
      dot(src);
    } else {
      if (readers < 8) return dot(src);
      const int64_t np = (n + 15) / 16 * 16;
      for (int k = 0; k < 16; ++k) {
        widen(src[k], n, &buf[k * np]);
        fptrs[k] = &buf[k * np];
      }
      dot(static_cast<const float* const*>(fptrs));
    }
  };
  // absorbed queries: q_lat = sum_p q_nope[p] * W_UK[h][p] (p in order; W_UK[h]'s rows read once for every token),
  // then q_pe after it: [q_lat; q_pe], the cache's order
  for (int64_t i = 0; i < nh; ++i) {
    const int64_t h = h0 + i;
    for (int64_t p = 0; p < P; ++p) {
      const W* wr = kv_b + (h * (P + V) + p) * C;
      if (p + 8 < P) prefetch_bytes(wr + 8 * C, C * sizeof(W));  // the row 8 ahead, from DRAM
      for (int64_t t = 0; t < nt; ++t) {
        float* q = &qf[(t * nh + i) * Dp];
        const float qv = float(q_nope[((t0 + t) * NH + h) * P + p]);
        const V16 s = simd::set1(kv_b_scale ? qv * kv_b_scale[h * (P + V) + p] : qv);
        for (int64_t c = 0; c < C; c += 16)
          simd::store(q + c, simd::fmadd(s, load16(wr + c, std::min<int64_t>(16, C - c)), simd::load(q + c)));
      }
    }
    for (int64_t t = 0; t < nt; ++t)
      for (int64_t r = 0; r < R; ++r) qf[(t * nh + i) * Dp + C + r] = float(q_pe[((t0 + t) * NH + h) * R + r]);
  }
  // keys up to the last any row sees
  int64_t end = 0;
  for (int64_t t = 0; t < nt; ++t) {
    int64_t last = S;
    while (last > 0 && !vis[(t0 + t) * S + last - 1]) --last;
    end = std::max(end, last);
  }
  // scores, 16 keys at a time (a last partial block reads zero keys)
  for (int64_t j0 = 0; j0 < end; j0 += 16) {
    const int64_t nk = std::min<int64_t>(16, end - j0);
    for (int64_t k = 0; k < 16; ++k) ptrs[k] = k < nk ? kv + slots[j0 + k] * D : zeros.data();
    rows16(ptrs, D, rows, [&](auto keys) {
      for (int64_t r = 0; r < rows; ++r)
        simd::store(&scores[r * S16 + j0], dot16(&qf[r * Dp], keys, D) * simd::set1(scale));
    });
  }
  // probabilities (unnormalised): the row's max over the keys it sees, exp(score - max) (0 where it does not see)
  const V16 hidden = simd::set1(-3.0e38f);
  for (int64_t r = 0; r < rows; ++r) {
    const float* sr = &scores[r * S16];
    const bool* vr = vis + (t0 + r / nh) * S;
    V16 mx = simd::set1(-std::numeric_limits<float>::infinity());
    for (int64_t j = 0; j < end; j += 16) {
      const V16 seen = simd::load_int8(reinterpret_cast<const uint8_t*>(vr + j), end - j);
      mx = simd::max(mx, simd::fmadd(simd::set1(1.f) - seen, hidden, simd::load(sr + j)));
    }
    const V16 row_mx = simd::set1(simd::reduce_max(mx));
    V16 sum = simd::zero();
    for (int64_t j = 0; j < end; j += 16) {
      const V16 seen = simd::load_int8(reinterpret_cast<const uint8_t*>(vr + j), end - j);
      const V16 pr = simd::exp(simd::load(sr + j) - row_mx) * seen;
      sum = sum + pr;
      simd::store(&probs[r * S16 + j], pr);
    }
    row_sum[r] = simd::reduce_add(sum);
  }
  // o_lat: the visible keys' latents weighted in key order, 16 keys at a time (widened once for every row), each
  // row's accumulators kNC chunks at a time in registers
  const int64_t Cc = Cp / 16;
  for (int64_t j0 = 0; j0 < end; j0 += 16) {
    const int64_t nk = std::min<int64_t>(16, end - j0);
    for (int64_t k = 0; k < nk; ++k) widen(kv + slots[j0 + k] * D, C, &lat[k * Cp]);
    for (int64_t r = 0; r < rows; ++r) {
      const bool* vr = vis + (t0 + r / nh) * S + j0;
      const float* pr = &probs[r * S16 + j0];
      float* a = &acc[r * Cp];
      int64_t c = 0;
      for (; c + kNC <= Cc; c += kNC) weigh<kNC>(a + c * 16, lat.data() + c * 16, Cp, pr, vr, nk);
      for (; c < Cc; ++c) weigh<1>(a + c * 16, lat.data() + c * 16, Cp, pr, vr, nk);
    }
  }
  // out = o_lat · W_UV^T, 16 outputs at a time
  for (int64_t r = 0; r < rows; ++r) {
    const float inv = row_sum[r] > 0.f ? 1.f / row_sum[r] : 0.f;
    float* a = &acc[r * Cp];
    for (int64_t c = 0; c < Cp; c += 16) simd::store(a + c, simd::load(a + c) * simd::set1(inv));
  }
  for (int64_t i = 0; i < nh; ++i) {
    const int64_t h = h0 + i;
    for (int64_t v0 = 0; v0 < V; v0 += 16) {
      const int64_t nv = std::min<int64_t>(16, V - v0);
      for (int64_t k = 0; k < 16; ++k) wptrs[k] = k < nv ? kv_b + (h * (P + V) + P + v0 + k) * C : wzeros.data();
      if (v0 + 16 < V) prefetch_bytes(kv_b + (h * (P + V) + P + v0 + 16) * C, 16 * C * sizeof(W));
      rows16(wptrs, C, nt, [&](auto w_uv) {
        for (int64_t t = 0; t < nt; ++t) {
          alignas(64) float o[16];
          simd::store(o, dot16(&acc[(t * nh + i) * Cp], w_uv, C));
          float* dst = out + ((t0 + t) * NH + h) * V + v0;
          const float* ws = kv_b_scale ? kv_b_scale + h * (P + V) + P + v0 : nullptr;
          for (int64_t k = 0; k < nv; ++k) dst[k] = ws ? o[k] * ws[k] : o[k];
        }
      });
    }
  }
}

template <typename T, typename W>
void run(const T* q_nope, const T* q_pe, const W* kv_b, const float* kv_b_scale, const T* kv, const int64_t* slots,
         const bool* vis, int64_t B, int64_t Tq, int64_t NH, int64_t P, int64_t R, int64_t V, int64_t C, int64_t S,
         float scale, float* out) {
  const int64_t tile = Tq <= kOneTile ? Tq : kTile, tiles = (Tq + tile - 1) / tile;
  // heads a task: up to kHeads, fewer where that splits the tasks evenly over the threads (20 heads at batch 1 on 2
  // threads: 10 tasks of 2, not 5 of 4 where one thread ran 3). Which rows share a task changes nothing in their
  // arithmetic.
  const int64_t threads = at::get_num_threads();
  int64_t heads = kHeads;
  for (int64_t h = kHeads; h >= 1; --h)
    if (B * tiles * ((NH + h - 1) / h) % threads == 0) {
      heads = h;
      break;
    }
  const int64_t groups = (NH + heads - 1) / heads;
  at::parallel_for(0, B * tiles * groups, 1, [&](int64_t w0, int64_t w1) {
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t b = w / (tiles * groups), t0 = (w / groups) % tiles * tile, h0 = w % groups * heads;
      attend<T, W>(q_nope + b * Tq * NH * P, q_pe + b * Tq * NH * R, kv_b, kv_b_scale, kv, slots + b * S,
                   vis + b * Tq * S, t0, std::min(tile, Tq - t0), h0, std::min(heads, NH - h0), NH, P, R, V, C, S,
                   scale, out + b * Tq * NH * V);
    }
  });
}

at::Tensor mla_attention(const at::Tensor& q_nope, const at::Tensor& q_pe, const at::Tensor& kv_b,
                         const at::Tensor& kv_cache, const at::Tensor& context_slots, const at::Tensor& visible,
                         double scale, const std::optional<at::Tensor>& kv_b_scale) {
  TORCH_CHECK(q_nope.dim() == 4 && q_pe.dim() == 4, "mla_attention: q_nope and q_pe must be [B, T, NH, *]");
  const int64_t B = q_nope.size(0), Tq = q_nope.size(1), NH = q_nope.size(2), P = q_nope.size(3), R = q_pe.size(3);
  TORCH_CHECK(q_pe.size(0) == B && q_pe.size(1) == Tq && q_pe.size(2) == NH, "mla_attention: q_pe must be [B, T, NH, R]");
  const auto dt = q_nope.scalar_type();
  const bool int8 = kv_b_scale.has_value();
  TORCH_CHECK((dt == at::kBFloat16 || dt == at::kFloat) && q_pe.scalar_type() == dt &&
                  kv_b.scalar_type() == (int8 ? at::kChar : dt) && kv_cache.scalar_type() == dt,
              "mla_attention: q_nope, q_pe, kv_b and kv_cache must all be bfloat16 or all float32 (kv_b int8 with "
              "kv_b_scale)");
  TORCH_CHECK(kv_b.dim() == 3 && kv_b.size(0) == NH && kv_b.size(1) > P && kv_b.is_contiguous(),
              "mla_attention: kv_b must be a contiguous [NH, P + V, C] tensor");
  const int64_t V = kv_b.size(1) - P, C = kv_b.size(2);
  TORCH_CHECK(!int8 || (kv_b_scale->scalar_type() == at::kFloat && kv_b_scale->is_contiguous() &&
                        kv_b_scale->numel() == NH * (P + V)),
              "mla_attention: kv_b_scale must be a contiguous [NH, P + V] float32 tensor");
  TORCH_CHECK(kv_cache.dim() == 2 && kv_cache.is_contiguous() && kv_cache.size(1) == C + R,
              "mla_attention: kv_cache must be a contiguous [slots, C + R] tensor");
  TORCH_CHECK(context_slots.scalar_type() == at::kLong && context_slots.dim() == 2 && context_slots.size(0) == B,
              "mla_attention: context_slots must be [B, S] int64");
  const int64_t S = context_slots.size(1);
  TORCH_CHECK(visible.scalar_type() == at::kBool && visible.numel() == B * Tq * S,
              "mla_attention: visible must be [B, 1, T, S] bool");
  const at::Tensor qn = q_nope.contiguous(), qp = q_pe.contiguous(), slots = context_slots.contiguous(),
                   vis = visible.contiguous();
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < B * S; ++i)
    TORCH_CHECK(sp[i] >= 0 && sp[i] < kv_cache.size(0), "mla_attention: context slot ", sp[i], " out of range [0, ",
                kv_cache.size(0), ")");
  at::Tensor out = at::empty({B, Tq, NH * V}, q_nope.options().dtype(at::kFloat));
  const float* ws = int8 ? kv_b_scale->data_ptr<float>() : nullptr;
  auto go = [&](auto* t) {
    using T = std::remove_pointer_t<decltype(t)>;
    const T* q = qn.data_ptr<T>();
    if (int8)
      run<T, int8_t>(q, qp.data_ptr<T>(), kv_b.data_ptr<int8_t>(), ws, kv_cache.data_ptr<T>(), sp,
                     vis.data_ptr<bool>(), B, Tq, NH, P, R, V, C, S, float(scale), out.data_ptr<float>());
    else
      run<T, T>(q, qp.data_ptr<T>(), kv_b.data_ptr<T>(), nullptr, kv_cache.data_ptr<T>(), sp, vis.data_ptr<bool>(),
                B, Tq, NH, P, R, V, C, S, float(scale), out.data_ptr<float>());
  };
  if (dt == at::kFloat)
    go(static_cast<float*>(nullptr));
  else
    go(static_cast<at::BFloat16*>(nullptr));
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(NEXTN_OPS, m) {
  m.def("mla_attention(Tensor q_nope, Tensor q_pe, Tensor kv_b, Tensor kv_cache, Tensor context_slots, "
        "Tensor visible, float scale, Tensor? kv_b_scale=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(NEXTN_OPS, CPU, m) { m.impl("mla_attention", &mla_attention); }
