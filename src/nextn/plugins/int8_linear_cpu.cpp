// The int8 weight-only linear layer (W8A16, and every quantized engine's lm_head) for the CPU decode and verify
// steps (nextn plugin; Python side and the PyTorch reference: woq_linear.py).
//
//   nextn::woq_int8_linear(x [M, K] bf16 | f32, w [N, K] int8 (`pack_int8` layout), scale [N] f32, bias [N]?)
//     -> [M, N] in x's dtype: y = scale * sum(q * x) + bias
//
// Layout: blocks of 16 output channels, 16 K bytes each; per 2 input channels k, k + 1 of a block, 32 bytes, byte
// 2c + j = q[c][k + j]: a vector lane is an output channel, one scale per lane.
//
// What x is multiplied as depends on the variant (`int8_activations()`, woq_linear.py's reference follows it):
//  - avx512_bf16: x rounded to bf16, the weights widened exactly to bf16, `vdpbf16ps` (32 multiply-adds an
//    instruction, so a verify step's rows stay bound by the weight bytes), f32 sums;
//  - every other variant: x quantized per group of 128 input channels (the last group shorter) to int16, sx =
//    max|x| / 32767, xq = round-to-even(x * (1 / sx)): a finer grid than bf16's for all but a group's smallest
//    values. Exact int32 sums of q * xq per group (`vpdpwssd`, AVX2's `vpmaddwd`), then y += float(sum) * sx in f32,
//    group by group. On AVX2 the f32 path (int8 -> f32 widening, two FMAs a pair) was compute-bound past one row
//    (figures at the dispatch below).
//
// Batch invariance: y[m, n] is the same sequence of operations on x[m] and W[n] whatever M, the row chunk, the
// channel block or the thread (the row's quantization reads the row alone).

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_kernels.h"
#include "simd_int16.h"

#include <cstdint>
#include <optional>
#include <vector>

namespace {

namespace simd = nextn_cpu::simd;
using nextn_cpu::run_blocks;
using simd::V16;

constexpr int kMaxRows = 8;
constexpr int kMaxRows16 = 16;  // bf16 path: one block, a row's f32 sums: up to 16 rows share one widening
constexpr int64_t kGroup16 = 128;  // int16 path: input channels a group (int32 sums stay exact up to 512)

// NB blocks of 16 output channels against rows [0, MB) of x (bf16, row stride K). Per 2 input channels one 32-byte
// load widens to 16 channels x (k, k+1) pairs (`simd::pairs_int8`: exact, |q| <= 128 fits bf16's 8-bit
// significand), and one `simd::dot` per row multiplies them with x's pair. y = scale * sum + bias, f32.
template <int MB, int NB>
inline void int8_block(const uint16_t* x, int64_t K, const int8_t* w, const float* scale, float* out,
                       int64_t out_stride, const float* bias) {
  const int64_t block_bytes = 16 * K;
  V16 acc[MB][NB];
  for (int m = 0; m < MB; ++m)
    for (int n = 0; n < NB; ++n) acc[m][n] = simd::zero();
  for (int64_t k = 0; k < K; k += 2) {
    if ((k & 3) == 0)
      for (int n = 0; n < NB; ++n) simd::prefetch_l2(w + (n + NB) * block_bytes + 16 * k);
    for (int n = 0; n < NB; ++n) {
      const simd::Pairs wv = simd::pairs_int8(w + n * block_bytes + 16 * k);
      for (int m = 0; m < MB; ++m) acc[m][n] = simd::dot(acc[m][n], wv, simd::xpair(x + m * K + k));
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int n = 0; n < NB; ++n) {
      V16 y = acc[m][n] * simd::load(scale + 16 * n);
      if (bias) y = y + simd::load(bias + 16 * n);
      simd::store(out + m * out_stride + 16 * n, y);
    }
}

// x [M, K] bf16 -> xq [M, K] int16 per group of kGroup16 (G groups, the last K - (G - 1) * kGroup16 long): sx =
// max|x| / 32767, xq = round-to-even of x * (1 / sx) (0 for an all-zero group). Each row alone: batch-invariant.
void quantize_rows16(const uint16_t* x, int64_t M, int64_t K, int16_t* xq, float* sx) {
  const int64_t G = (K + kGroup16 - 1) / kGroup16;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t gi = 0; gi < G; ++gi) {
      const int64_t k0 = gi * kGroup16, k1 = std::min(K, k0 + kGroup16);
      const uint16_t* p = x + m * K;
      V16 amax = simd::zero();
      for (int64_t k = k0; k < k1; k += 16) amax = simd::max(amax, simd::abs(simd::load_bf16(p + k)));
      const float s = simd::reduce_max(amax) / 32767.f;
      const V16 inv = simd::set1(s > 0.f ? 1.f / s : 0.f);  // a multiply per element, not a division
      for (int64_t k = k0; k < k1; k += 16) simd::store_int16_rne(xq + m * K + k, simd::load_bf16(p + k) * inv);
      sx[m * G + gi] = s;
    }
}

// The same blocks against rows [0, MB) of xq (int16, `quantize_rows16`; sx [MB][G] their group scales): per 2 input
// channels one 32-byte load sign-extends to 16 channels x (k, k+1) int16 pairs, one `simd::dot2` per row; at the end
// of each group the int32 sums are scaled by the row's sx into the f32 sums (kept in `out`, read back from L1).
template <int MB, int NB>
inline void int8x16_block(const int16_t* xq, const float* sx, int64_t K, const int8_t* w, const float* scale,
                          float* out, int64_t out_stride, const float* bias) {
  const int64_t block_bytes = 16 * K, G = (K + kGroup16 - 1) / kGroup16;
  for (int64_t gi = 0; gi < G; ++gi) {
    const int64_t k0 = gi * kGroup16, k1 = std::min(K, k0 + kGroup16);
    simd::I16 acc[MB][NB];
    for (int m = 0; m < MB; ++m)
      for (int n = 0; n < NB; ++n) acc[m][n] = simd::izero();
    for (int64_t k = k0; k < k1; k += 2) {
      if ((k & 3) == 0)
        for (int n = 0; n < NB; ++n) simd::prefetch_l2(w + (n + NB) * block_bytes + 16 * k);
      for (int n = 0; n < NB; ++n) {
        const simd::W16 wv = simd::pairs16_int8(w + n * block_bytes + 16 * k);
        for (int m = 0; m < MB; ++m) acc[m][n] = simd::dot2(acc[m][n], wv, xq + m * K + k);
      }
    }
    for (int m = 0; m < MB; ++m)
      for (int n = 0; n < NB; ++n) {
        float* o = out + m * out_stride + 16 * n;
        const V16 prev = gi == 0 ? simd::zero() : simd::load(o);
        simd::store(o, simd::fmadd(simd::to_float(acc[m][n]), simd::set1(sx[m * G + gi]), prev));
      }
  }
  for (int m = 0; m < MB; ++m)
    for (int n = 0; n < NB; ++n) {
      float* o = out + m * out_stride + 16 * n;
      V16 y = simd::load(o) * simd::load(scale + 16 * n);
      if (bias) y = y + simd::load(bias + 16 * n);
      simd::store(o, y);
    }
}

at::Tensor woq_int8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale,
                           const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kChar && w.is_contiguous(),
              "woq_int8_linear: w must be a contiguous [N, K] int8 tensor (`pack_int8` layout)");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(K % 16 == 0, "woq_int8_linear: K = ", K, " must be a multiple of 16");
  TORCH_CHECK(N % 16 == 0, "woq_int8_linear: N = ", N, " output channels must be a multiple of 16");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == N,
              "woq_int8_linear: scale must be a contiguous float32 [N]");
  const at::Tensor xb = nextn_cpu::check_x(x, K, "woq_int8_linear", at::kBFloat16);
  const int64_t M = xb.size(0);
  at::Tensor out = at::empty({M, N}, x.options().dtype(at::kFloat)), bias_keep;
  const float* b = nextn_cpu::bias_ptr(bias, N, bias_keep);
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(xb.data_ptr<at::BFloat16>());
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  float* op = out.data_ptr<float>();
#if defined(NEXTN_BF16_DOT)
  // one row: 4 blocks at a time (4 independent vdpbf16ps chains); up to 4 rows: 2 blocks; more: 2 blocks, 8 rows a
  // chunk; past 8 rows one block, up to 16 rows a chunk (each block's weights widened once for them)
  auto block = [&](auto mb, auto nb, int64_t m0, int64_t blk) {
    constexpr int MB = decltype(mb)::value, NB = decltype(nb)::value;
    int8_block<MB, NB>(xp + m0 * K, K, wp + blk * 16 * K, sp + blk * 16, op + m0 * N + blk * 16, N,
                       b ? b + blk * 16 : nullptr);
  };
  if (M == 1) {
    run_blocks<4, 1>(M, N / 16, 4, block);
  } else if (M <= 4) {
    run_blocks<2, 4>(M, N / 16, 4, block);
  } else if (M <= kMaxRows) {
    run_blocks<2, kMaxRows>(M, N / 16, 4, block);
  } else {
    run_blocks<1, kMaxRows16>(M, N / 16, 4, block);
  }
#else
  const int64_t G = (K + kGroup16 - 1) / kGroup16;
  std::vector<int16_t> xq(M * K);
  std::vector<float> sx(M * G);
  quantize_rows16(xp, M, K, xq.data(), sx.data());
  auto block = [&](auto mb, auto nb, int64_t m0, int64_t blk) {
    constexpr int MB = decltype(mb)::value, NB = decltype(nb)::value;
    int8x16_block<MB, NB>(xq.data() + m0 * K, sx.data() + m0 * G, K, wp + blk * 16 * K, sp + blk * 16,
                          op + m0 * N + blk * 16, N, b ? b + blk * 16 : nullptr);
  };
  // AVX2 / NEON (an I16 takes 2 or 4 vector registers): one row 4 blocks at a time, more 2 blocks, 2 rows a chunk (3
  // rows together). A [151936, 1536] matrix on 2 Zen 3 cores: 6.7 / 6.7 / 9.6 / 16.8 ms at 1 / 2 / 4 / 8 rows;
  // 7-9 / 12-14 / 14 / 28 ms one block at a time; the f32 path 13.2 / 14.1 / 18.2 / 37.5 ms
  if constexpr (simd::kRegisterShare > 1) {
    if (M == 1) {
      run_blocks<4, 1>(M, N / 16, 4, block);
    } else if (M == 3) {
      run_blocks<2, 3>(M, N / 16, 4, block);
    } else {
      run_blocks<2, 2>(M, N / 16, 4, block);
    }
  } else if (M == 1) {
    run_blocks<4, 1>(M, N / 16, 4, block);
  } else {
    run_blocks<2, kMaxRows>(M, N / 16, 4, block);
  }
#endif
  return nextn_cpu::finish(out, x);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(NEXTN_OPS, m) {
  m.def("woq_int8_linear(Tensor x, Tensor w, Tensor scale, Tensor? bias) -> Tensor");
  // what woq_int8_linear multiplies x as on this variant: "bf16", or "int16" per group of 128 input channels
  m.def("int8_linear_activations() -> str", []() {
#if defined(NEXTN_BF16_DOT)
    return std::string("bf16");
#else
    return std::string("int16");
#endif
  });
}

TORCH_LIBRARY_IMPL(NEXTN_OPS, CPU, m) { m.impl("woq_int8_linear", &woq_int8_linear); }
