// Weight-only quantized linear layers for the CPU decode and verify steps (nextn plugin; Python side and the
// PyTorch reference: woq_linear.py).
//
//   nextn::woq_int4_linear(x [M, K], w [N, K/2] uint8, scale [N/16, K/g, 16] bf16, zero8 [N/16, K/g, 16] bf16, g,
//                          bias?)
//   nextn::woq_int8_linear(x [M, K], w [N, K] int8, scale [N] f32, bias?)
//     -> [M, N] in x's dtype
//
// x is bf16 or f32; bias is [N] or absent. int4: w = (q - 8) * scale + zero8 per group of g input channels
// (q in [0, 15]), x rounded to bf16, exact products and f32 sums; int8: y = scale * sum(q * x) in f32.
//
// Why our own kernel: a decode step multiplies 1 row (plain) or K + 1 rows (a verify step) by every weight, so it
// is bound by the weight bytes. PyTorch's CPU weight-only kernels are compute-bound at one row and fall off a cliff
// past four rows (docs/PERFORMANCE.md). Here a block of output channels is unpacked into registers once and
// multiplied against up to 8 rows, the rows of a verify step re-reading the block from L1.
//
// Batch invariance (what makes speculative decoding token-identical to plain decoding): every output y[m, n] is
// the same sequence of f32 operations on x[m] and W[n] whatever M, the row chunk, the channel block or the thread.
//
// int4 layout (made by `pack_int4` in woq_linear.py from the engine's portable one): blocks of 16 output channels
// (N % 16 == 0), 8 K bytes each; in a block, for every 4 input channels k..k+3, 32 bytes: byte 2c + j (channel c,
// j = 0, 1) holds q[c][k + j] in its low nibble and q[c][k + 2 + j] in its high nibble, so one 32-byte load widens
// to 16 channels x 2 (k, k+1) pairs and 16 x (k+2, k+3): a vector lane is an output channel, and a group's scales
// (`block_scales`: [N/16, G, 16]) apply to 16 channels with one FMA. An earlier layout put 32 input channels of
// one output channel in a vector: one scale FMA per 32 weights and row, which bounded the verify step's rows.
//
// Built with AVX-512 F/BW/VL/BF16 + FMA + OpenMP (at::parallel_for); loaded only on CPUs with those
// (woq_linear.py).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include "cpu_kernels.h"

#include <cstdint>
#include <vector>
#include <optional>

namespace {

constexpr int kMaxRows = 8;  // rows per register block

// Ask for the next channel block's bytes at this offset into L2 while this block computes: the weights stream from
// DRAM once per step, and without it loads and arithmetic do not overlap (measured: a [151936, 1536] int8 matrix,
// one row, 14.5 -> 5.9-7.9 ms; an L1 hint gained less).
template <int NB, typename T>
inline void prefetch_next(const T* p, int64_t row_stride) {
  for (int n = 0; n < NB; ++n) _mm_prefetch(reinterpret_cast<const char*>(p + (n + NB) * row_stride), _MM_HINT_T1);
}

inline __m512 bf16x16_to_f32(__m256i b) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}

// NB blocks of 16 output channels (int4, `pack_int4` layout, starting at w; 8 K bytes a block) against rows
// [0, MB) of x (bf16, row stride K). A vector lane is an output channel: per 4 input channels, one 32-byte load
// widens to two vectors of 16 channels x (k, k+1) and (k+2, k+3) bf16 pairs (nibbles -> bf16 integers by a table
// lookup, exact), and one vdpbf16ps per vector and row multiplies them with x's pair, broadcast (exact products,
// f32 sums, two chains: lo and hi pairs). At the end of a group of g input channels each row's sums are scaled by
// the group's 16 scales (one FMA for 16 channels) and the zero points enter through the group sum of x:
//   y = sum_g [ scale_g * sum_{k in g} q_k x_k + (zero8_g - 8 scale_g) * xs_g ] + bias.
// Every channel's result is this sequence of f32 operations whatever MB, NB or the thread: batch-invariant.
// s, z: the blocks' bf16 scale and zero8, [NB][G][16]; xs: [MB][G] f32 group sums of x.
template <int MB, int NB>
inline void int4_block(const uint16_t* x, int64_t K, const uint8_t* w, const uint16_t* s, const uint16_t* z,
                       int64_t G, int64_t g, const float* xs, float* out, int64_t out_stride, const float* bias) {
  const __m512i low4 = _mm512_set1_epi16(0x0F);
  // bf16 bit patterns of 0.0 .. 15.0, indexed by a nibble
  const __m512i table = _mm512_set_epi16(
      0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
      0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120, 0x4110, 0x4100,
      0x40E0, 0x40C0, 0x40A0, 0x4080, 0x4040, 0x4000, 0x3F80, 0x0000);
  const __m512 eight = _mm512_set1_ps(8.f);
  const int64_t block_bytes = 8 * K;
  __m512 acc[MB][NB];
  for (int m = 0; m < MB; ++m)
    for (int n = 0; n < NB; ++n) acc[m][n] = _mm512_setzero_ps();
  for (int64_t gi = 0; gi < G; ++gi) {
    __m512 lo[MB][NB], hi[MB][NB];
    for (int m = 0; m < MB; ++m)
      for (int n = 0; n < NB; ++n) lo[m][n] = hi[m][n] = _mm512_setzero_ps();
    for (int64_t k = gi * g; k < (gi + 1) * g; k += 4) {
      if ((k & 7) == 0)
        for (int n = 0; n < NB; ++n)
          _mm_prefetch(reinterpret_cast<const char*>(w + (n + NB) * block_bytes + 8 * k), _MM_HINT_T1);
      for (int n = 0; n < NB; ++n) {
        const __m512i q = _mm512_cvtepu8_epi16(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + n * block_bytes + 8 * k)));
        const __m512bh wl = (__m512bh)_mm512_permutexvar_epi16(_mm512_and_si512(q, low4), table);
        const __m512bh wh = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(q, 4), table);
        for (int m = 0; m < MB; ++m) {
          const uint32_t* xm = reinterpret_cast<const uint32_t*>(x + m * K + k);
          lo[m][n] = _mm512_dpbf16_ps(lo[m][n], wl, (__m512bh)_mm512_set1_epi32(int(xm[0])));
          hi[m][n] = _mm512_dpbf16_ps(hi[m][n], wh, (__m512bh)_mm512_set1_epi32(int(xm[1])));
        }
      }
    }
    for (int n = 0; n < NB; ++n) {
      const __m512 sv = bf16x16_to_f32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + (n * G + gi) * 16)));
      const __m512 zv = _mm512_fnmadd_ps(
          eight, sv, bf16x16_to_f32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(z + (n * G + gi) * 16))));
      for (int m = 0; m < MB; ++m) {
        acc[m][n] = _mm512_fmadd_ps(_mm512_add_ps(lo[m][n], hi[m][n]), sv, acc[m][n]);
        acc[m][n] = _mm512_fmadd_ps(zv, _mm512_set1_ps(xs[m * G + gi]), acc[m][n]);
      }
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int n = 0; n < NB; ++n) {
      __m512 y = acc[m][n];
      if (bias) y = _mm512_add_ps(y, _mm512_loadu_ps(bias + 16 * n));
      _mm512_storeu_ps(out + m * out_stride + 16 * n, y);
    }
}

template <int MB, int NB>
inline void int8_block(const float* x, int64_t K, const int8_t* w, const float* scale, float* out,
                       int64_t out_stride, const float* bias) {
  __m512 acc[MB][NB];
  for (int m = 0; m < MB; ++m)
    for (int n = 0; n < NB; ++n) acc[m][n] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    __m512 xv[MB];
    if ((k & 63) == 0) prefetch_next<NB>(w + k, K);
    for (int m = 0; m < MB; ++m) xv[m] = _mm512_loadu_ps(x + m * K + k);
    for (int n = 0; n < NB; ++n) {
      const __m512 wv = _mm512_cvtepi32_ps(
          _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + n * K + k))));
      for (int m = 0; m < MB; ++m) acc[m][n] = _mm512_fmadd_ps(wv, xv[m], acc[m][n]);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int n = 0; n < NB; ++n)
      out[m * out_stride + n] = scale[n] * _mm512_reduce_add_ps(acc[m][n]) + (bias ? bias[n] : 0.f);
}

template <int V>
using Int = std::integral_constant<int, V>;

// Call f(Int<rows>{}) for a runtime row count 1..MAX (MAX: 4 or 8), the row count a compile-time constant.
template <int MAX, typename F>
inline void with_rows(int64_t rows, F&& f) {
  switch (rows) {
    case 1: f(Int<1>{}); return;
    case 2: f(Int<2>{}); return;
    case 3: f(Int<3>{}); return;
    case 4: f(Int<4>{}); return;
  }
  if constexpr (MAX > 4) {
    switch (rows) {
      case 5: f(Int<5>{}); return;
      case 6: f(Int<6>{}); return;
      case 7: f(Int<7>{}); return;
      default: f(Int<8>{}); return;
    }
  }
}

// Run `block(Int<MB>, Int<NB>, m0, n0)` over M rows and N units (output channels for int8, blocks of 16 channels
// for int4): NB units at a time, split across threads (at least `grain` such steps a thread), the last < NB one
// by one; within them, chunks of MAX rows reuse the units' weights from L1.
template <int NB, int MAX, typename Block>
void run_blocks(int64_t M, int64_t N, int64_t grain, Block& block) {
  const int64_t blocks = (N + NB - 1) / NB;
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * NB;
      for (int64_t m0 = 0; m0 < M; m0 += MAX) {
        with_rows<MAX>(std::min<int64_t>(MAX, M - m0), [&](auto mb) {
          if (n0 + NB <= N) {
            block(mb, Int<NB>{}, m0, n0);
          } else {
            for (int64_t n = n0; n < N; ++n) block(mb, Int<1>{}, m0, n);
          }
        });
      }
    }
  });
}

// int8: up to 4 rows, 4 channels a block (NB x MAX = 16 accumulators); more rows (a verify step): 2 channels a
// block, 8 rows a chunk.
template <typename Block>
void for_each_block(int64_t M, int64_t N, Block&& block) {
  if (M <= 4) {
    run_blocks<4, 4>(M, N, 16, block);
  } else {
    run_blocks<2, kMaxRows>(M, N, 16, block);
  }
}

// x checked and flattened to a contiguous [M, K] `as` tensor (the dtype the kernel reads it in).
at::Tensor check_x(const at::Tensor& x, int64_t K, const char* op, at::ScalarType as) {
  TORCH_CHECK(x.device().is_cpu(), op, ": x must be on the CPU");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, op,
              ": x must be bfloat16 or float32, got ", x.scalar_type());
  TORCH_CHECK(x.size(-1) == K, op, ": x has ", x.size(-1), " input channels, the weight ", K);
  return x.reshape({-1, K}).to(as).contiguous();
}

const float* bias_ptr(const std::optional<at::Tensor>& bias, int64_t N, at::Tensor& keep) {
  if (!bias.has_value()) return nullptr;
  TORCH_CHECK(bias->numel() == N, "bias must have ", N, " elements, got ", bias->numel());
  keep = bias->to(at::kFloat).contiguous();
  return keep.data_ptr<float>();
}

at::Tensor finish(const at::Tensor& out, const at::Tensor& x) {
  auto sizes = x.sizes().vec();
  sizes.back() = out.size(1);
  return out.to(x.scalar_type()).view(sizes);
}

}  // namespace

namespace nextn_cpu {

void int4_linear(const uint16_t* xp, int64_t M, int64_t K, const uint8_t* wp, int64_t N, const uint16_t* sp,
                 const uint16_t* zp, int64_t group_size, const float* b, float* op) {
  const int64_t G = K / group_size;
  // group sums of x, f32, in a fixed order per row
  std::vector<float> xs(M * G);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t gi = 0; gi < G; ++gi) {
      __m512 a = _mm512_setzero_ps();
      for (int64_t k = gi * group_size; k < (gi + 1) * group_size; k += 16)
        a = _mm512_add_ps(a, bf16x16_to_f32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp + m * K + k))));
      xs[m * G + gi] = _mm512_reduce_add_ps(a);
    }
  // blocks of 16 channels split across threads; one row: 2 blocks at a time (4 independent vdpbf16ps chains);
  // more: 1 block, up to 8 rows a chunk re-reading the block's weights from L1/L2
  auto block = [&](auto mb, auto nb, int64_t m0, int64_t blk) {
    constexpr int MB = decltype(mb)::value, NB = decltype(nb)::value;
    int4_block<MB, NB>(xp + m0 * K, K, wp + blk * 8 * K, sp + blk * G * 16, zp + blk * G * 16, G, group_size,
                       xs.data() + m0 * G, op + m0 * N + blk * 16, N, b ? b + blk * 16 : nullptr);
  };
  if (M == 1) {
    run_blocks<2, 1>(M, N / 16, 4, block);
  } else {
    run_blocks<1, kMaxRows>(M, N / 16, 4, block);
  }
}

}  // namespace nextn_cpu

namespace {

at::Tensor woq_int4_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale,
                           const at::Tensor& zero8, int64_t group_size, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(),
              "woq_int4_linear: w must be a contiguous [N, K/2] uint8 tensor");
  const int64_t N = w.size(0), K = w.size(1) * 2;
  TORCH_CHECK(K % 64 == 0, "woq_int4_linear: K = ", K, " must be a multiple of 64");
  TORCH_CHECK(N % 16 == 0, "woq_int4_linear: N = ", N, " output channels must be a multiple of 16");
  TORCH_CHECK(group_size % 32 == 0 && K % group_size == 0, "woq_int4_linear: group_size ", group_size,
              " must be a multiple of 32 dividing K = ", K);
  const int64_t G = K / group_size;
  TORCH_CHECK(scale.scalar_type() == at::kBFloat16 && zero8.scalar_type() == at::kBFloat16 &&
                  scale.is_contiguous() && zero8.is_contiguous() && scale.numel() == N * G && zero8.numel() == N * G,
              "woq_int4_linear: scale and zero8 must be contiguous bfloat16 [N / 16, K / group_size, 16]");
  const at::Tensor xb = check_x(x, K, "woq_int4_linear", at::kBFloat16);
  const int64_t M = xb.size(0);
  at::Tensor out = at::empty({M, N}, x.options().dtype(at::kFloat)), bias_keep;
  nextn_cpu::int4_linear(reinterpret_cast<const uint16_t*>(xb.data_ptr<at::BFloat16>()), M, K, w.data_ptr<uint8_t>(),
                         N, reinterpret_cast<const uint16_t*>(scale.data_ptr<at::BFloat16>()),
                         reinterpret_cast<const uint16_t*>(zero8.data_ptr<at::BFloat16>()), group_size,
                         bias_ptr(bias, N, bias_keep), out.data_ptr<float>());
  return finish(out, x);
}

at::Tensor woq_int8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale,
                           const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kChar && w.is_contiguous(),
              "woq_int8_linear: w must be a contiguous [N, K] int8 tensor");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(K % 16 == 0, "woq_int8_linear: K = ", K, " must be a multiple of 16");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == N,
              "woq_int8_linear: scale must be a contiguous float32 [N]");
  const at::Tensor x2 = check_x(x, K, "woq_int8_linear", at::kFloat);
  const int64_t M = x2.size(0);
  at::Tensor out = at::empty({M, N}, x2.options()), bias_keep;
  const float* b = bias_ptr(bias, N, bias_keep);
  const float* xp = x2.data_ptr<float>();
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for_each_block(M, N, [&](auto mb, auto nb, int64_t m0, int64_t n0) {
    constexpr int MB = decltype(mb)::value, NB = decltype(nb)::value;
    int8_block<MB, NB>(xp + m0 * K, K, wp + n0 * K, sp + n0, op + m0 * N + n0, N, b ? b + n0 : nullptr);
  });
  return finish(out, x);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(nextn, m) {
  m.def("woq_int4_linear(Tensor x, Tensor w, Tensor scale, Tensor zero, int group_size, Tensor? bias) -> Tensor");
  m.def("woq_int8_linear(Tensor x, Tensor w, Tensor scale, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(nextn, CPU, m) {
  m.impl("woq_int4_linear", &woq_int4_linear);
  m.impl("woq_int8_linear", &woq_int8_linear);
}
