// Paged attention for the CPU decode and verify steps (nextn plugin; Python side and the PyTorch reference:
// paged_attention.py).
//
//   nextn::paged_attention(q [B, T, NH, D], kv_cache [slots, 2 * NKV * D] (rows may be strided: the first columns
//                          of a wider cache row, Gemma 4's narrower layers), context_slots [B, S] int64,
//                          visible [B, 1, T, S] bool, scale, softcap = 0, sinks = None [NH] f32)
//                          -> [B, T, NH * D] in q's dtype
//
// Each query (b, t, head h) attends to the keys j of its sequence with visible[b, 0, t, j]: the cache row
// context_slots[b, j] holds K (NKV x D) then V (NKV x D); query head h reads KV head h / (NH / NKV) (GQA).
// f32 sums throughout: scores = scale * q.k (a bf16 cache on AVX512-BF16: exact bf16 pair products by `vdpbf16ps`;
// else f32 FMAs) (then softcap * tanh(score / softcap) where softcap > 0: Gemma 2's attention
// logit soft-capping), softmax (max-subtracted `simd::exp`), o = sum_j p_j v_j / sum_j p_j; with sinks (gpt-oss)
// head h's sink s_h is one more logit in the max and the sum, with no value: o = sum_j p_j v_j / (sum_j p_j + e^s_h).
//
// Why our own kernel: the PyTorch path gathers every sequence's context out of the cache, then runs two einsums, a
// mask and a softmax per layer, ~10 dispatches of microseconds each on a few hundred keys; this is one, reading the
// cache in place. Every query row is the same sequence of f32 operations whatever T, B or the thread (batch
// invariance: a verify step's rows equal plain steps'), which fused library kernels do not promise (SDPA broke
// greedy identity here: docs/PERFORMANCE.md).
//
// One source for every ISA variant over simd.h; any D <= kMaxD (a head_dim that is not a multiple of 16 ends in a
// partial chunk: stories260K's 8, for one, so its bf16 engines are batch-invariant too).

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

namespace simd = nextn_cpu::simd;
using nextn_cpu::kMaxD;

using simd::V16;

using nextn_cpu::load16;  // a head_dim that is not a multiple of 16 ends in a partial chunk

// Query tokens per tile of `attend`: a tile's rows share each key and value load (a verify step's K+1 tokens are
// one tile), and its scores and accumulators (kTile x group x S floats) stay in cache however long the prompt, so a
// prefill of T tokens never builds a T x S score matrix.
constexpr int64_t kTile = 8;
constexpr int64_t kOneTile = 32;  // up to this many query tokens (a verify step's K + 1) in one tile

// Register blocking (cpu_kernels.h): kKeys keys' score accumulators in registers at once (`scores16`); kRB x kNC: the
// rows x 16-lane chunks of the weighted sum's accumulators (kRB * kNC + kNC + 1 vectors of V16 in registers).
using nextn_cpu::kKeys;
constexpr int kNC = simd::kParts == 1 ? 2 : 1;
constexpr int kRB = simd::kParts == 1 ? 12 : 6;
// Keys per block of the weighted sum: a block's V rows stay in L1 while every row block and chunk reads them
constexpr int64_t kKeyBlock = 32;
// How many keys ahead the K and V rows are prefetched
constexpr int64_t kAhead = 64;

// Scores of one query row (its C chunks in `qr`, f32, zero-padded) against 16 keys (`kb`: 16 rows of Dp f32): per
// key the chunk products summed chunk by chunk (a mul, then C - 1 FMAs), then each key's lanes summed
// (`simd::reduce_add16`: the variant's fixed lane order), times scale. kKeys keys at a time keep their accumulators
// in registers; each key's arithmetic is the same whatever kKeys.
__attribute__((noinline)) V16 scores16(const float* qr, const float* kb, int64_t C, int64_t Dp, float scale) {
  V16 a[16];
  for (int k0 = 0; k0 < 16; k0 += kKeys) {
    V16 s[kKeys];
    const V16 q0 = simd::load(qr);
#pragma GCC unroll 16
    for (int k = 0; k < kKeys; ++k) s[k] = simd::load(kb + (k0 + k) * Dp) * q0;
    for (int64_t c = 1; c < C; ++c) {
      const V16 qc = simd::load(qr + c * 16);
#pragma GCC unroll 16
      for (int k = 0; k < kKeys; ++k) s[k] = simd::fmadd(simd::load(kb + (k0 + k) * Dp + c * 16), qc, s[k]);
    }
#pragma GCC unroll 16
    for (int k = 0; k < kKeys; ++k) a[k0 + k] = s[k];
  }
  return simd::reduce_add16(a) * simd::set1(scale);
}

// Scores of one query row (bf16, C2 chunks of 32, zero-padded) against 16 keys (`kb`: 16 rows of Dq bf16, the cache's
// K rows as they are), where the CPU multiplies bf16 pairs in one instruction (simd::kPairDot: `vdpbf16ps`, 32
// products a chunk, no widening): per key the chunks' pair products summed in 16 lanes (lane i: channels 2i and 2i + 1
// of each chunk), then each key's lanes summed (`simd::reduce_add16`), times scale. Each key's arithmetic is the same
// whatever the row count.
__attribute__((noinline)) V16 scores16_pairs(const uint16_t* qr, const uint16_t* kb, int64_t C2, int64_t Dq,
                                             float scale) {
  V16 a[16];
#pragma GCC unroll 16
  for (int k = 0; k < 16; ++k) a[k] = simd::zero();
  for (int64_t c = 0; c < C2; ++c) {
    const simd::Pairs q = simd::pairs_bf16(qr + c * 32);
#pragma GCC unroll 16
    for (int k = 0; k < 16; ++k) a[k] = simd::dot(a[k], simd::pairs_bf16(kb + k * Dq + c * 32), q);
  }
  return simd::reduce_add16(a) * simd::set1(scale);
}

// acc[r][c] += p[j][r] * v[j][c] for RB rows (p: probabilities [keys][R] from row r0, R apart) and NC chunks of 16
// starting at chunk c0, over keys [j0, j1) in order, the accumulators in registers; then stored to acc (Dp apart).
template <int RB, int NC, typename T>
__attribute__((noinline)) void weigh_values(const T* kv, int64_t kv_row, int64_t v_off, const int64_t* slots, const float* p, int64_t R,
                         int64_t j0, int64_t j1, int64_t c0, float* acc, int64_t Dp) {
  V16 s[RB][NC];
#pragma GCC unroll 16
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 2
    for (int c = 0; c < NC; ++c) s[r][c] = simd::load(acc + r * Dp + (c0 + c) * 16);
  for (int64_t j = j0; j < j1; ++j) {
    const T* v = kv + slots[j] * kv_row + v_off + c0 * 16;
    const float* pj = p + j * R;
    V16 vj[NC];
#pragma GCC unroll 2
    for (int c = 0; c < NC; ++c) vj[c] = load16(v + c * 16, 16);
#pragma GCC unroll 16
    for (int r = 0; r < RB; ++r) {
      const V16 pr = simd::set1(pj[r]);
#pragma GCC unroll 2
      for (int c = 0; c < NC; ++c) s[r][c] = simd::fmadd(pr, vj[c], s[r][c]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < RB; ++r)
#pragma GCC unroll 2
    for (int c = 0; c < NC; ++c) simd::store(acc + r * Dp + (c0 + c) * 16, s[r][c]);
}

// The cache lines of n values from p into L2 (the rows of the next keys: the cache is read through the block table,
// rows a KV row apart, which the hardware prefetchers follow poorly)
template <typename T>
inline void prefetch_row(const T* p, int64_t n) {
  const char* b = reinterpret_cast<const char*>(p);
  for (int64_t o = 0; o < n * int64_t(sizeof(T)); o += 64) simd::prefetch_l2(b + o);
}

// f(std::integral_constant<int, n>) for a run-time 0 < n <= N (nothing for n = 0)
template <int N, typename F>
inline void with_rows(int64_t n, F&& f) {
  if constexpr (N > 0) {
    if (n == N) f(std::integral_constant<int, N>{});
    else with_rows<N - 1>(n, f);
  }
}

// The visibility of up to 16 keys (`left` of them still in the row) as 1.0 / 0.0 lanes (bool is one byte, 0 or 1)
inline V16 visible16(const bool* v, int64_t left) {
  return simd::load_int8(reinterpret_cast<const uint8_t*>(v), left);
}

// One (sequence, KV head): its `group` query heads x Tq tokens against S cached keys, kTile tokens at a time. Per
// query row the arithmetic is fixed whatever the tiling: each score is one dot product in 16-lane chunks then a lane
// reduction in the variant's order; the softmax runs over the keys 16 at a time (the sum in 16 lanes, then reduced)
// and the weighted sum over the visible keys in order (an FMA per key and chunk, the probability broadcast). Scores
// are computed 16 keys at a time for every key up to the tile's last visible one (a key no row sees is computed and
// ignored); the weighted sum runs over the keys every row of the tile sees with its accumulators in registers, then
// over the rest (a verify step's or a tree's last keys) row by row, skipping the keys a row does not see.
template <typename T>
void attend(const T* q, int64_t q_tok_stride, const T* kv, int64_t kv_row, const int64_t* slots, const bool* vis,
            int64_t S, int64_t Tq, int64_t group, int64_t D, int64_t k_off, int64_t v_off, float scale, float softcap,
            const float* sinks, float* out, int64_t out_tok_stride) {
  const int64_t C = (D + 15) / 16, Dp = C * 16;  // 16-lane chunks of a head; rows padded to Dp with zeros
  auto lanes = [&](int64_t c) { return c == C - 1 ? D - c * 16 : int64_t(16); };
  // query rows of a tile: token-major, then head; a verify step's tokens (up to kOneTile) are one tile
  const int64_t tile = Tq <= kOneTile ? Tq : kTile, R = tile * group;
  const int64_t S16 = (S + 15) / 16 * 16;
  std::vector<float> qf(R * Dp), scores(R * S16), probs(S16 * R), acc(R * Dp), row_sum(R), kb(16 * Dp);
  // bf16 pair products: the query rows and 16 keys' K rows as bf16 bits, zero-padded to chunks of 32
  constexpr bool pairs = simd::kPairDot && std::is_same_v<T, at::BFloat16>;
  const int64_t Dq = (D + 31) / 32 * 32;
  std::vector<uint16_t> qb(pairs ? R * Dq : 0, 0), kb16(pairs ? 16 * Dq : 0, 0);
  std::vector<float> vf;  // a head_dim that is not a multiple of 16: V rows padded to Dp (f32) for the last chunk
  // an invisible key's score is pushed this far down before the row's max (its probability is then zeroed)
  const V16 hidden = simd::set1(-3.0e38f);
  for (int64_t t0 = 0; t0 < Tq; t0 += tile) {
    const int64_t nt = std::min(tile, Tq - t0), nr = nt * group;
    const bool* tv = vis + t0 * S;
    // keys [0, shared) are visible to every token of the tile; none at or past `end`
    int64_t shared = S, end = 0;
    for (int64_t t = 0; t < nt; ++t) {
      const bool* row = tv + t * S;
      int64_t j = 0;
      while (j < S && row[j]) ++j;
      shared = std::min(shared, j);
      int64_t last = S;
      while (last > 0 && !row[last - 1]) --last;
      end = std::max(end, last);
    }
    shared = std::min(shared, end);
    // scores, 16 keys at a time (a last partial block reads zero keys): bf16 pair products where the CPU has them,
    // else the keys widened to f32 once for every row
    if constexpr (pairs) {
      for (int64_t t = 0; t < nt; ++t)
        for (int64_t g = 0; g < group; ++g)
          std::memcpy(&qb[(t * group + g) * Dq], q + (t0 + t) * q_tok_stride + g * D, D * sizeof(T));
    } else {
      for (int64_t t = 0; t < nt; ++t)
        for (int64_t g = 0; g < group; ++g)
          for (int64_t c = 0; c < C; ++c)
            simd::store(&qf[(t * group + g) * Dp + c * 16], load16(q + (t0 + t) * q_tok_stride + g * D + c * 16, lanes(c)));
    }
    for (int64_t j0 = 0; j0 < end; j0 += 16) {
      const int64_t nk = std::min<int64_t>(16, end - j0);
      for (int64_t k = j0 + kAhead; k < std::min(end, j0 + kAhead + 16); ++k) prefetch_row(kv + slots[k] * kv_row + k_off, D);
      if constexpr (pairs) {
        for (int64_t k = 0; k < 16; ++k) {
          if (k < nk) std::memcpy(&kb16[k * Dq], kv + slots[j0 + k] * kv_row + k_off, D * sizeof(T));
          else std::fill(&kb16[k * Dq], &kb16[k * Dq] + D, uint16_t(0));
        }
      } else {
        for (int64_t k = 0; k < 16; ++k)
          for (int64_t c = 0; c < C; ++c)
            simd::store(&kb[k * Dp + c * 16],
                        k < nk ? load16(kv + slots[j0 + k] * kv_row + k_off + c * 16, lanes(c)) : simd::zero());
      }
      for (int64_t r = 0; r < nr; ++r) {
        V16 sc = pairs ? scores16_pairs(&qb[r * Dq], kb16.data(), Dq / 32, Dq, scale)
                       : scores16(&qf[r * Dp], kb.data(), C, Dp, scale);
        if (softcap > 0.f) sc = simd::set1(softcap) * simd::tanh(sc / simd::set1(softcap));
        simd::store(&scores[r * S16 + j0], sc);
      }
    }
    // probabilities (unnormalised), 16 keys at a time: the row's max over the keys it sees, exp(score - max)
    // (0 where it does not see the key), their sum; transposed for the weighted sum
    for (int64_t t = 0; t < nt; ++t)
      for (int64_t g = 0; g < group; ++g) {
        const int64_t r = t * group + g;
        const float* sr = &scores[r * S16];
        const bool* vr = tv + t * S;
        V16 mx = simd::set1(-std::numeric_limits<float>::infinity());
        for (int64_t j = 0; j < end; j += 16) {
          const V16 seen = visible16(vr + j, end - j);
          mx = simd::max(mx, simd::fmadd(simd::set1(1.f) - seen, hidden, simd::load(sr + j)));
        }
        // an attention sink (gpt-oss): one more logit in the row's max and its sum, with no value
        const float sink = sinks ? sinks[g] : -std::numeric_limits<float>::infinity();
        const float row_max = std::max(simd::reduce_max(mx), sink);
        const V16 row_mx = simd::set1(row_max);
        V16 sum = simd::zero();
        alignas(64) float e[16];
        for (int64_t j = 0; j < end; j += 16) {
          const V16 pr = simd::exp(simd::load(sr + j) - row_mx) * visible16(vr + j, end - j);
          sum = sum + pr;
          simd::store(e, pr);
          for (int64_t i = 0, n = std::min<int64_t>(16, end - j); i < n; ++i) probs[(j + i) * nr + r] = e[i];
        }
        row_sum[r] = simd::reduce_add(sum) + (sinks ? std::exp(sink - row_max) : 0.f);
      }
    // weighted values: the keys every row sees, rows in register blocks; a head_dim not a multiple of 16 reads
    // its V rows through a zero-padded copy
    std::fill(acc.begin(), acc.end(), 0.f);
    const T* vbase = kv;
    int64_t vrow = kv_row, voff = v_off;
    const int64_t* vslots = slots;
    std::vector<int64_t> ids;
    if (D % 16) {
      vf.assign(end * Dp, 0.f);
      for (int64_t j = 0; j < end; ++j)
        for (int64_t c = 0; c < C; ++c)
          simd::store(&vf[j * Dp + c * 16], load16(kv + slots[j] * kv_row + v_off + c * 16, lanes(c)));
      ids.resize(end);
      for (int64_t j = 0; j < end; ++j) ids[j] = j;
    }
    // rows [r0, r0 + RB) over keys [j0, j1), kNC chunks at a time (a last odd chunk alone)
    auto block = [&](auto rb, int64_t r0, int64_t j0, int64_t j1) {
      constexpr int RB = decltype(rb)::value;
      const float* p = probs.data() + r0;
      float* a = &acc[r0 * Dp];
      for (int64_t c0 = 0; c0 < C; c0 += kNC) {
        const bool whole = c0 + kNC <= C;
        if (D % 16 == 0) {
          if (whole) weigh_values<RB, kNC>(vbase, vrow, voff, vslots, p, nr, j0, j1, c0, a, Dp);
          else weigh_values<RB, 1>(vbase, vrow, voff, vslots, p, nr, j0, j1, c0, a, Dp);
        } else {
          if (whole) weigh_values<RB, kNC>(vf.data(), Dp, 0, ids.data(), p, nr, j0, j1, c0, a, Dp);
          else weigh_values<RB, 1>(vf.data(), Dp, 0, ids.data(), p, nr, j0, j1, c0, a, Dp);
        }
      }
    };
    // kKeyBlock keys at a time (their V rows read from memory once, then from L1 by every row block and chunk);
    // the rows kRB at a time, the last < kRB together
    for (int64_t j0 = 0; j0 < shared; j0 += kKeyBlock) {
      const int64_t j1 = std::min(shared, j0 + kKeyBlock);
      for (int64_t k = j0 + kAhead; k < std::min(shared, j1 + kAhead); ++k) prefetch_row(kv + slots[k] * kv_row + v_off, D);
      int64_t r0 = 0;
      for (; r0 + kRB <= nr; r0 += kRB) block(std::integral_constant<int, kRB>{}, r0, j0, j1);
      with_rows<kRB - 1>(nr - r0, [&](auto rb) { block(rb, r0, j0, j1); });
    }
    // ... then the keys some rows do not see, row by row
    for (int64_t j = shared; j < end; ++j) {
      V16 vj[kMaxD / 16];
      for (int64_t c = 0; c < C; ++c) vj[c] = load16(kv + slots[j] * kv_row + v_off + c * 16, lanes(c));
      for (int64_t t = 0; t < nt; ++t) {
        if (!tv[t * S + j]) continue;
        for (int64_t g = 0; g < group; ++g) {
          const int64_t r = t * group + g;
          const V16 pr = simd::set1(probs[j * nr + r]);
          float* a = &acc[r * Dp];
          for (int64_t c = 0; c < C; ++c) simd::store(a + c * 16, simd::fmadd(pr, vj[c], simd::load(a + c * 16)));
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
void run(const T* qp, const T* kvp, int64_t kv_row, const int64_t* slots, const bool* vis, int64_t B, int64_t Tq,
         int64_t NH, int64_t NKV, int64_t S, int64_t D, float scale, float softcap, const float* sinks, float* out) {
  const int64_t group = NH / NKV;
  at::parallel_for(0, B * NKV, 1, [&](int64_t w0, int64_t w1) {
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t b = w / NKV, h = w % NKV, base = (b * Tq * NH + h * group) * D;
      attend<T>(qp + base, NH * D, kvp, kv_row, slots + b * S, vis + b * Tq * S, S, Tq, group, D, h * D,
                NKV * D + h * D, scale, softcap, sinks ? sinks + h * group : nullptr, out + base, NH * D);
    }
  });
}

}  // namespace

namespace nextn_cpu {

void paged_attention_bf16(const uint16_t* q, const uint16_t* kv_cache, const int64_t* context_slots,
                          const bool* visible, int64_t B, int64_t T, int64_t NH, int64_t NKV, int64_t S, int64_t D,
                          float scale, float softcap, const float* sinks, float* out) {
  run<at::BFloat16>(reinterpret_cast<const at::BFloat16*>(q), reinterpret_cast<const at::BFloat16*>(kv_cache),
                    2 * NKV * D, context_slots, visible, B, T, NH, NKV, S, D, scale, softcap, sinks, out);
}

}  // namespace nextn_cpu

namespace {

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& context_slots,
                           const at::Tensor& visible, double scale, double softcap,
                           const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK(q.dim() == 4, "paged_attention: q must be [B, T, NH, D]");
  const int64_t B = q.size(0), Tq = q.size(1), NH = q.size(2), D = q.size(3);
  TORCH_CHECK(softcap >= 0.0, "paged_attention: softcap must be >= 0 (0: none), got ", softcap);
  TORCH_CHECK(D >= 1 && D <= kMaxD, "paged_attention: head_dim ", D, " must be in [1, ", kMaxD, "]");
  TORCH_CHECK(q.scalar_type() == kv_cache.scalar_type() &&
                  (q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kFloat),
              "paged_attention: q and kv_cache must both be bfloat16 or both float32");
  TORCH_CHECK(kv_cache.dim() == 2 && kv_cache.stride(1) == 1 && kv_cache.stride(0) >= kv_cache.size(1) &&
                  kv_cache.size(1) % (2 * D) == 0,
              "paged_attention: kv_cache must be a [slots, 2 * NKV * D] tensor of contiguous rows");
  const int64_t NKV = kv_cache.size(1) / (2 * D);
  TORCH_CHECK(NH % NKV == 0, "paged_attention: ", NH, " query heads are not a multiple of ", NKV, " KV heads");
  TORCH_CHECK(context_slots.scalar_type() == at::kLong && context_slots.dim() == 2 && context_slots.size(0) == B,
              "paged_attention: context_slots must be [B, S] int64");
  const int64_t S = context_slots.size(1);
  TORCH_CHECK(visible.scalar_type() == at::kBool && visible.numel() == B * Tq * S,
              "paged_attention: visible must be [B, 1, T, S] bool");
  TORCH_CHECK(!sinks || (sinks->scalar_type() == at::kFloat && sinks->dim() == 1 && sinks->size(0) == NH),
              "paged_attention: sinks must be [NH] float32 (one logit a query head)");
  const at::Tensor qc = q.contiguous(), slots = context_slots.contiguous(), vis = visible.contiguous();
  const at::Tensor sk = sinks ? sinks->contiguous() : at::Tensor();
  const float* skp = sinks ? sk.data_ptr<float>() : nullptr;
  at::Tensor out = at::empty({B, Tq, NH * D}, q.options().dtype(at::kFloat));
  const int64_t* sp = slots.data_ptr<int64_t>();
  const bool* vp = vis.data_ptr<bool>();
  float* op = out.data_ptr<float>();
  if (q.scalar_type() == at::kFloat) {
    run<float>(qc.data_ptr<float>(), kv_cache.data_ptr<float>(), kv_cache.stride(0), sp, vp, B, Tq, NH, NKV, S, D, float(scale),
               float(softcap), skp, op);
  } else {
    run<at::BFloat16>(qc.data_ptr<at::BFloat16>(), kv_cache.data_ptr<at::BFloat16>(), kv_cache.stride(0), sp, vp, B, Tq, NH, NKV, S, D,
                      float(scale), float(softcap), skp, op);
  }
  return out.to(q.scalar_type());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(NEXTN_OPS, m) {
  m.def("paged_attention(Tensor q, Tensor kv_cache, Tensor context_slots, Tensor visible, float scale, "
        "float softcap=0.0, Tensor? sinks=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(NEXTN_OPS, CPU, m) { m.impl("paged_attention", &paged_attention); }
