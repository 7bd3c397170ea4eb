// Paged attention for the CPU decode and verify steps (nextn plugin; Python side and the PyTorch reference:
// paged_attention.py).
//
//   nextn::paged_attention(q [B, T, NH, D], kv_cache [slots, 2 * NKV * D], context_slots [B, S] int64,
//                          visible [B, 1, T, S] bool, scale) -> [B, T, NH * D] in q's dtype
//
// Each query (b, t, head h) attends to the keys j of its sequence with visible[b, 0, t, j]: the cache row
// context_slots[b, j] holds K (NKV x D) then V (NKV x D); query head h reads KV head h / (NH / NKV) (GQA).
// f32 throughout: scores = scale * q.k, softmax (max-subtracted exp), o = sum_j p_j v_j / sum_j p_j.
//
// Why our own kernel: the PyTorch path gathers every sequence's context out of the cache, then runs two einsums, a
// mask and a softmax per layer, ~10 dispatches of microseconds each on a few hundred keys; this is one, reading the
// cache in place. Every query row is the same sequence of f32 operations whatever T, B or the thread (batch
// invariance: a verify step's rows equal plain steps'), which fused library kernels do not promise (SDPA broke
// greedy identity here: docs/PERFORMANCE.md).
//
// Built with AVX-512 F/BW/VL + FMA; any D <= kMaxD (a head_dim that is not a multiple of 16 ends in a masked chunk:
// stories260K's 8, for one, so its bf16 engines are batch-invariant too).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include "cpu_kernels.h"

#include <cmath>
#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

using nextn_cpu::kMaxD;

// Up to 16 values of a bf16 or f32 row as f32: the lanes set in `m` (the rest read as 0; a head_dim that is not a
// multiple of 16 ends in a masked chunk, so nothing past the row is read)
template <typename T>
inline __m512 load16(const T* p, __mmask16 m);
template <>
inline __m512 load16<float>(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
template <>
inline __m512 load16<at::BFloat16>(const at::BFloat16* p, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

// Query tokens per tile of `attend`: a tile's rows share each key and value load (a verify step's K+1 tokens are
// one tile), and its scores and accumulators (kTile x group x S and kTile x group x D floats) stay in cache however
// long the prompt, so a prefill of T tokens never builds a T x S score matrix.
constexpr int64_t kTile = 8;

// One (sequence, KV head): its `group` query heads x Tq tokens against S cached keys, kTile tokens at a time. Per
// query row the arithmetic is fixed whatever the tiling: each score is one dot product in 16-lane chunks then a lane
// reduction; the softmax and the weighted sum run over the keys in order.
template <typename T>
void attend(const T* q, int64_t q_tok_stride, const T* kv, int64_t kv_row, const int64_t* slots, const bool* vis,
            int64_t S, int64_t Tq, int64_t group, int64_t D, int64_t k_off, int64_t v_off, float scale, float* out,
            int64_t out_tok_stride) {
  const int64_t C = (D + 15) / 16, Dp = C * 16;  // 16-lane chunks of a head; rows padded to Dp with zeros
  const __mmask16 tail = D % 16 ? __mmask16((1u << (D % 16)) - 1) : __mmask16(0xFFFF);
  auto lanes = [&](int64_t c) { return c == C - 1 ? tail : __mmask16(0xFFFF); };
  const int64_t tile = std::min(Tq, kTile), R = tile * group;  // query rows of a tile: token-major, then head
  std::vector<float> qf(R * Dp), scores(R * S), acc(R * Dp), row_max(R), row_sum(R);
  for (int64_t t0 = 0; t0 < Tq; t0 += tile) {
    const int64_t nt = std::min(tile, Tq - t0);
    const bool* tv = vis + t0 * S;
    for (int64_t t = 0; t < nt; ++t)
      for (int64_t g = 0; g < group; ++g)
        for (int64_t c = 0; c < C; ++c)
          _mm512_storeu_ps(&qf[(t * group + g) * Dp + c * 16],
                           load16(q + (t0 + t) * q_tok_stride + g * D + c * 16, lanes(c)));
    std::fill(row_max.begin(), row_max.end(), -std::numeric_limits<float>::infinity());
    std::fill(row_sum.begin(), row_sum.end(), 0.f);
    std::fill(acc.begin(), acc.end(), 0.f);
    // scores
    for (int64_t j = 0; j < S; ++j) {
      const T* k = kv + slots[j] * kv_row + k_off;
      __m512 kj[kMaxD / 16];
      bool loaded = false;
      for (int64_t t = 0; t < nt; ++t) {
        if (!tv[t * S + j]) continue;
        if (!loaded) {
          for (int64_t c = 0; c < C; ++c) kj[c] = load16(k + c * 16, lanes(c));
          loaded = true;
        }
        for (int64_t g = 0; g < group; ++g) {
          const int64_t r = t * group + g;
          __m512 a = _mm512_mul_ps(kj[0], _mm512_loadu_ps(&qf[r * Dp]));
          for (int64_t c = 1; c < C; ++c) a = _mm512_fmadd_ps(kj[c], _mm512_loadu_ps(&qf[r * Dp + c * 16]), a);
          const float sc = _mm512_reduce_add_ps(a) * scale;
          scores[r * S + j] = sc;
          row_max[r] = std::max(row_max[r], sc);
        }
      }
    }
    // probabilities (unnormalised), in key order
    for (int64_t t = 0; t < nt; ++t)
      for (int64_t g = 0; g < group; ++g) {
        const int64_t r = t * group + g;
        for (int64_t j = 0; j < S; ++j) {
          if (!tv[t * S + j]) continue;
          const float pr = std::exp(scores[r * S + j] - row_max[r]);
          scores[r * S + j] = pr;
          row_sum[r] += pr;
        }
      }
    // weighted values
    for (int64_t j = 0; j < S; ++j) {
      const T* v = kv + slots[j] * kv_row + v_off;
      __m512 vj[kMaxD / 16];
      bool loaded = false;
      for (int64_t t = 0; t < nt; ++t) {
        if (!tv[t * S + j]) continue;
        if (!loaded) {
          for (int64_t c = 0; c < C; ++c) vj[c] = load16(v + c * 16, lanes(c));
          loaded = true;
        }
        for (int64_t g = 0; g < group; ++g) {
          const int64_t r = t * group + g;
          const __m512 pr = _mm512_set1_ps(scores[r * S + j]);
          float* a = &acc[r * Dp];
          for (int64_t c = 0; c < C; ++c)
            _mm512_storeu_ps(a + c * 16, _mm512_fmadd_ps(pr, vj[c], _mm512_loadu_ps(a + c * 16)));
        }
      }
    }
    for (int64_t t = 0; t < nt; ++t)
      for (int64_t g = 0; g < group; ++g) {
        const int64_t r = t * group + g;
        const float inv = row_sum[r] > 0.f ? 1.f / row_sum[r] : 0.f;
        for (int64_t d = 0; d < D; ++d) out[(t0 + t) * out_tok_stride + g * D + d] = acc[r * Dp + d] * inv;
      }
  }
}

// Every (sequence, KV head) is one task; tasks split across threads.
template <typename T>
void run(const T* qp, const T* kvp, const int64_t* slots, const bool* vis, int64_t B, int64_t Tq, int64_t NH,
         int64_t NKV, int64_t S, int64_t D, float scale, float* out) {
  const int64_t group = NH / NKV;
  at::parallel_for(0, B * NKV, 1, [&](int64_t w0, int64_t w1) {
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t b = w / NKV, h = w % NKV, base = (b * Tq * NH + h * group) * D;
      attend<T>(qp + base, NH * D, kvp, 2 * NKV * D, slots + b * S, vis + b * Tq * S, S, Tq, group, D, h * D,
                NKV * D + h * D, scale, out + base, NH * D);
    }
  });
}

}  // namespace

namespace nextn_cpu {

void paged_attention_bf16(const uint16_t* q, const uint16_t* kv_cache, const int64_t* context_slots,
                          const bool* visible, int64_t B, int64_t T, int64_t NH, int64_t NKV, int64_t S, int64_t D,
                          float scale, float* out) {
  run<at::BFloat16>(reinterpret_cast<const at::BFloat16*>(q), reinterpret_cast<const at::BFloat16*>(kv_cache),
                    context_slots, visible, B, T, NH, NKV, S, D, scale, out);
}

}  // namespace nextn_cpu

namespace {

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& context_slots,
                           const at::Tensor& visible, double scale) {
  TORCH_CHECK(q.dim() == 4, "paged_attention: q must be [B, T, NH, D]");
  const int64_t B = q.size(0), Tq = q.size(1), NH = q.size(2), D = q.size(3);
  TORCH_CHECK(D >= 1 && D <= kMaxD, "paged_attention: head_dim ", D, " must be in [1, ", kMaxD, "]");
  TORCH_CHECK(q.scalar_type() == kv_cache.scalar_type() &&
                  (q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kFloat),
              "paged_attention: q and kv_cache must both be bfloat16 or both float32");
  TORCH_CHECK(kv_cache.dim() == 2 && kv_cache.is_contiguous() && kv_cache.size(1) % (2 * D) == 0,
              "paged_attention: kv_cache must be a contiguous [slots, 2 * NKV * D] tensor");
  const int64_t NKV = kv_cache.size(1) / (2 * D);
  TORCH_CHECK(NH % NKV == 0, "paged_attention: ", NH, " query heads are not a multiple of ", NKV, " KV heads");
  TORCH_CHECK(context_slots.scalar_type() == at::kLong && context_slots.dim() == 2 && context_slots.size(0) == B,
              "paged_attention: context_slots must be [B, S] int64");
  const int64_t S = context_slots.size(1);
  TORCH_CHECK(visible.scalar_type() == at::kBool && visible.numel() == B * Tq * S,
              "paged_attention: visible must be [B, 1, T, S] bool");
  const at::Tensor qc = q.contiguous(), slots = context_slots.contiguous(), vis = visible.contiguous();
  at::Tensor out = at::empty({B, Tq, NH * D}, q.options().dtype(at::kFloat));
  const int64_t* sp = slots.data_ptr<int64_t>();
  const bool* vp = vis.data_ptr<bool>();
  float* op = out.data_ptr<float>();
  if (q.scalar_type() == at::kFloat) {
    run<float>(qc.data_ptr<float>(), kv_cache.data_ptr<float>(), sp, vp, B, Tq, NH, NKV, S, D, float(scale), op);
  } else {
    run<at::BFloat16>(qc.data_ptr<at::BFloat16>(), kv_cache.data_ptr<at::BFloat16>(), sp, vp, B, Tq, NH, NKV, S, D,
                      float(scale), op);
  }
  return out.to(q.scalar_type());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(nextn, m) {
  m.def("paged_attention(Tensor q, Tensor kv_cache, Tensor context_slots, Tensor visible, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(nextn, CPU, m) { m.impl("paged_attention", &paged_attention); }
