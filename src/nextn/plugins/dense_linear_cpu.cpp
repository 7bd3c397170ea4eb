// Dense (bf16 / fp16 / fp32 weight) linear layers for the CPU decode and verify steps, batch-invariant (nextn
// plugin; Python side, layouts and the PyTorch reference: dense_linear.py).
//
//   nextn::dense_linear(x [M, K], w [N', K'] (`pack` layout), bias [N] | None, N) -> [M, N] in x's dtype
//
// N' = N rounded up to 16 (the extra channels are zeros and never stored); x is bf16, fp16 or f32.
//  - bf16 w: x rounded to bf16, `simd::dot` (exact products, f32 sums; K' = K rounded up to 2, x padded with a 0);
//  - fp16 w: converted to f32 (exactly), x in f32, f32 FMA;
//  - fp32 w: x in f32, f32 FMA (an fp32 engine stays within fp32 tolerance of transformers' float32).
// y = sum + bias (f32), rounded to x's dtype.
//
// Why our own kernel: PyTorch's dense CPU linears (oneDNN for bf16, MKL for fp32) choose their blocking and
// summation order by the row count, so a row's result depends on how many rows share the call: measured, fp32
// F.linear of M rows differs from the same rows in 4-row calls for M in {1, 2, 3, 5, 6, 7, 9}; bf16 at M = 1 for
// [1536, 8960] and [8960, 1536]. A request's logits then depend on the other requests of the step and on a verify
// step's K + 1 rows, which breaks "speculative greedy decoding = plain greedy decoding, token for token".
//
// Batch invariance: every output y[m, n] is the same sequence of operations on x[m] and W[n] whatever M, the row
// chunk, the row's position, the channel block, the thread count or the split across threads: one accumulator per
// (row, channel), zeroed, then the input channels in order (no split-K), then the bias.
//
// Layouts (blocks of 16 output channels, a vector lane per channel, as woq_linear_cpu.cpp's int8 kernel):
//  - bf16: per 2 input channels k, k+1 of a block, 32 bf16 = one 64-byte load, element 2c + j = w[c][k + j];
//  - fp16 / fp32: per input channel k of a block, 16 values, element c = w[c][k] (32 or 64 bytes).
// A block is multiplied against up to 8 rows from registers (rows > 8: chunks of 8 re-reading it from L1/L2), with
// NB blocks at a time for independent accumulator chains, and the lines of the next blocks prefetched into L2 so that
// loads from DRAM overlap the arithmetic (the weights are read once a step: memory-bound at 1-8 rows).
//
// One source for every ISA variant over simd.h (cpu_kernels.py builds and picks the variant); OpenMP threads through
// at::parallel_for.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <type_traits>

#include "cpu_kernels.h"

namespace {

namespace simd = nextn_cpu::simd;
using nextn_cpu::Int;
using nextn_cpu::run_blocks;
using nextn_cpu::with_rows;

constexpr int kRows = 8;  // rows per register block

using simd::V16;

// rows [0, MB) x NB blocks of 16 channels = acc (+ bias); lanes past `valid` channels (the padding) are not stored
template <int MB, int NB>
inline void store(const V16 (&acc)[MB][NB], const float* bias, float* out, int64_t out_stride, int64_t valid) {
  for (int n = 0; n < NB; ++n) {
    const int64_t left = valid - 16 * n;
    if (left <= 0) return;
    const V16 b = bias ? simd::load(bias + 16 * n, left) : simd::zero();
    for (int m = 0; m < MB; ++m) simd::store(out + m * out_stride + 16 * n, bias ? acc[m][n] + b : acc[m][n], left);
  }
}

// NB blocks of 16 channels of a bf16 weight (starting at w, 16 * K elements a block) against rows [0, MB) of x (bf16
// bits, row stride K, K even): per 2 input channels one 64-byte load per block, one `simd::dot` per row with x's
// pair (acc += w[k] x[k] + w[k+1] x[k+1], exact products, f32 sums: vdpbf16ps on AVX512-BF16, two FMAs elsewhere).
template <int MB, int NB>
inline void bf16_block(const uint16_t* x, int64_t K, const uint16_t* w, const float* bias, float* out,
                       int64_t out_stride, int64_t valid) {
  const int64_t block = 16 * K;
  V16 acc[MB][NB];
  for (int m = 0; m < MB; ++m)
    for (int n = 0; n < NB; ++n) acc[m][n] = simd::zero();
  for (int64_t k = 0; k < K; k += 2) {
    for (int n = 0; n < NB; ++n) simd::prefetch_l2(w + (n + NB) * block + 16 * k);
    for (int n = 0; n < NB; ++n) {
      const simd::Pairs wv = simd::pairs_bf16(w + n * block + 16 * k);
      for (int m = 0; m < MB; ++m) acc[m][n] = simd::dot(acc[m][n], wv, simd::xpair(x + m * K + k));
    }
  }
  store<MB, NB>(acc, bias, out, out_stride, valid);
}

inline V16 load16(const float* p) { return simd::load(p); }
inline V16 load16(const uint16_t* p) { return simd::load_f16(p); }  // fp16 bits -> f32, exact

// NB blocks of 16 channels of an fp32 or fp16 (T = uint16_t: its bits) weight against rows [0, MB) of x (f32, row
// stride K): per input channel one load per block (widened to f32), one FMA per row with x[k] broadcast.
template <int MB, int NB, typename T>
inline void fma_block(const float* x, int64_t K, const T* w, const float* bias, float* out, int64_t out_stride,
                      int64_t valid) {
  constexpr int64_t kPerLine = 64 / (16 * sizeof(T));  // input channels a 64-byte line of a block holds
  const int64_t block = 16 * K;
  V16 acc[MB][NB];
  for (int m = 0; m < MB; ++m)
    for (int n = 0; n < NB; ++n) acc[m][n] = simd::zero();
  for (int64_t k = 0; k < K; ++k) {
    if (k % kPerLine == 0)
      for (int n = 0; n < NB; ++n) simd::prefetch_l2(w + (n + NB) * block + 16 * k);
    for (int n = 0; n < NB; ++n) {
      const V16 wv = load16(w + n * block + 16 * k);
      for (int m = 0; m < MB; ++m) acc[m][n] = simd::fmadd(wv, simd::set1(x[m * K + k]), acc[m][n]);
    }
  }
  store<MB, NB>(acc, bias, out, out_stride, valid);
}

// One row: 4 blocks at a time (4 independent chains); up to 4 rows: 2 blocks, one chunk; more: 2 blocks, 8 rows a
// chunk (16 accumulators)
template <typename Block>
void run(int64_t M, int64_t blocks, Block& block) {
  if (M == 1) {
    run_blocks<4, 1>(M, blocks, 4, block);
  } else if (M <= 4) {
    run_blocks<2, 4>(M, blocks, 4, block);
  } else {
    run_blocks<2, kRows>(M, blocks, 4, block);
  }
}

at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                        int64_t out_features) {
  const char* op = "dense_linear";
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), op, ": x and w must be on the CPU");
  const auto wt = w.scalar_type(), xt = x.scalar_type();
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && (wt == at::kBFloat16 || wt == at::kHalf || wt == at::kFloat), op,
              ": w must be a contiguous 2-D bfloat16, float16 or float32 tensor in `pack`'s layout, got ", wt, " ",
              w.sizes());
  TORCH_CHECK(xt == at::kBFloat16 || xt == at::kHalf || xt == at::kFloat, op,
              ": x must be bfloat16, float16 or float32, got ", xt);
  TORCH_CHECK(x.dim() >= 1, op, ": x must have an input-channel dimension");
  const int64_t N = out_features, Np = w.size(0), Kp = w.size(1), K = x.size(-1);
  TORCH_CHECK(Np % 16 == 0 && N > Np - 16 && N <= Np, op, ": w has ", Np, " rows, out_features = ", N,
              " must be them less the padding to 16 (", Np - 15, "..", Np, ")");
  const bool bf16 = wt == at::kBFloat16;
  TORCH_CHECK(Kp == (bf16 ? K + (K & 1) : K) && K > 0, op, ": x has ", K, " input channels, the ", wt,
              " weight ", bf16 ? "(padded to even) " : "", Kp);
  at::Tensor bias_f;
  if (bias.has_value()) {
    TORCH_CHECK(bias->device().is_cpu() && bias->numel() == N, op, ": bias must have ", N, " elements on the CPU, got ",
                bias->numel());
    bias_f = bias->to(at::kFloat).contiguous();
  }
  const float* b = bias.has_value() ? bias_f.data_ptr<float>() : nullptr;
  at::Tensor xs = x.reshape({-1, K}).to(bf16 ? at::kBFloat16 : at::kFloat).contiguous();
  if (Kp > K) xs = at::constant_pad_nd(xs, {0, Kp - K}).contiguous();
  const int64_t M = xs.size(0);
  at::Tensor out = at::empty({M, N}, x.options().dtype(at::kFloat));
  if (M > 0) {
    float* o = out.data_ptr<float>();
    if (bf16) {
      const auto* xp = reinterpret_cast<const uint16_t*>(xs.data_ptr<at::BFloat16>());
      const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
      auto block = [&](auto mb, auto nb, int64_t m0, int64_t blk) {
        bf16_block<decltype(mb)::value, decltype(nb)::value>(xp + m0 * Kp, Kp, wp + blk * 16 * Kp,
                                                             b ? b + blk * 16 : nullptr, o + m0 * N + blk * 16, N,
                                                             N - blk * 16);
      };
      run(M, Np / 16, block);
    } else {
      const float* xp = xs.data_ptr<float>();
      auto with_weight = [&](const auto* wp) {
        auto block = [&](auto mb, auto nb, int64_t m0, int64_t blk) {
          fma_block<decltype(mb)::value, decltype(nb)::value>(xp + m0 * K, K, wp + blk * 16 * K,
                                                              b ? b + blk * 16 : nullptr, o + m0 * N + blk * 16, N,
                                                              N - blk * 16);
        };
        run(M, Np / 16, block);
      };
      if (wt == at::kFloat) {
        with_weight(w.data_ptr<float>());
      } else {
        with_weight(reinterpret_cast<const uint16_t*>(w.data_ptr<at::Half>()));
      }
    }
  }
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  return out.to(xt).view(sizes);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(NEXTN_OPS, m) {
  m.def("dense_linear(Tensor x, Tensor w, Tensor? bias, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(NEXTN_OPS, CPU, m) {
  m.impl("dense_linear", &dense_linear);
}
