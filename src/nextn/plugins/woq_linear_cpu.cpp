// Weight-only quantized linear layers for the CPU decode and verify steps (nextn plugin; Python side and the
// PyTorch reference: woq_linear.py).
//
//   nextn::woq_int4_linear(x [M, K], w [N, K/2] uint8, scale, zero, g, bias?): one-level scales: scale
//                          [N/16, K/g, 16] bf16, zero = zero8 [N/16, K/g, 16] bf16; two-level (k-quants): scale
//                          [N/16, K/g, 2, 16] uint8 (u8 scale, i8 zero), zero [N/16, S, 2, 16] fp16 (d, dmin)
//     -> [M, N] in x's dtype (the int8 linear: int8_linear_cpu.cpp)
//
// x is bf16 or f32; bias is [N] or absent. int4: w = (q - 8) * scale + zero8 per group of g input channels
// (q in [0, 15]), or w = q * (d * scale) + dmin * zero with d, dmin per super-block of S groups; x rounded to
// bf16, exact products and f32 sums (W4A8: x quantized to int8 per group, exact int32 sums per group).
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
// One source for every ISA variant over simd.h (cpu_kernels.py builds and picks the variant); OpenMP threads through
// at::parallel_for.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_kernels.h"
#include "int4_blocks.h"

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace {

namespace simd = nextn_cpu::simd;
using nextn_cpu::Int;
using nextn_cpu::run_blocks;
using nextn_cpu::with_rows;
using namespace nextn_cpu::int4;
using simd::V16;

constexpr int kMaxRows = 8;  // rows per register block
// Up to this many rows share one unpacking of a block's weights where the registers allow (W4A8: a row's int32 and
// f32 sums, 12 rows). A second chunk unpacks the weights again: past 8
// rows, the ninth row of a verify step at batch 8 cost ~2.5x a row of the chunk (Qwen2.5-1.5B W4A8, 2 Zen 4 cores:
// 9 rows' linears 10 ms slower than 8 rows', 3 ms with one chunk).
constexpr int kMaxRowsA8 = 12;
// Where a V16 takes two or four vector registers (AVX2's 16, NEON): W4A8's blocks at a time for one row, rows a chunk
#ifndef NEXTN_NARROW_BLOCKS1
#define NEXTN_NARROW_BLOCKS1 1
#endif
#ifndef NEXTN_NARROW_ROWS
#define NEXTN_NARROW_ROWS 4
#endif
constexpr int kNarrowBlocks1 = NEXTN_NARROW_BLOCKS1;
constexpr int kNarrowRows = NEXTN_NARROW_ROWS;

// x [M, K] bf16 -> xq [M, K] int8, per block of ag input channels (a multiple of the weight group g): sx = max|x| /
// 127, xq = round-to-even of x * (1 / sx) (0 for an all-zero block), and per weight group xs = sx * sum xq (what the
// group's zero point multiplies). Each row alone: batch-invariant.
void quantize_rows(const uint16_t* x, int64_t M, int64_t K, int64_t g, int64_t ag, int8_t* xq, float* sx, float* xs) {
  const int64_t G = K / g, GA = K / ag;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t ai = 0; ai < GA; ++ai) {
      const uint16_t* p = x + m * K + ai * ag;
      V16 amax = simd::zero();
      for (int64_t k = 0; k < ag; k += 16) amax = simd::max(amax, simd::abs(simd::load_bf16(p + k)));
      const float s = simd::reduce_max(amax) / 127.f;
      const V16 inv = simd::set1(s > 0.f ? 1.f / s : 0.f);  // a multiply per element, not a division
      for (int64_t gi = ai * (ag / g); gi < (ai + 1) * (ag / g); ++gi) {
        int32_t sum = 0;
        for (int64_t k = gi * g; k < (gi + 1) * g; k += 16)
          sum += simd::store_int8_rne(xq + m * K + k, simd::load_bf16(x + m * K + k) * inv);
        xs[m * G + gi] = s * float(sum);
      }
      sx[m * GA + ai] = s;
    }
}

// f(make_scales): make_scales(block) gives that 16-channel block's group scales (Bf16Scales or KScales)
template <typename F>
void with_block_scales(const nextn_cpu::Int4Scales& scales, int64_t G, F&& f) {
  if (scales.group == nullptr) {
    f([&](int64_t blk) { return Bf16Scales{scales.scale + blk * G * 16, scales.zero8 + blk * G * 16, G}; });
  } else {
    const int64_t S = G / scales.groups_per_super;
    f([&, S](int64_t blk) {
      return KScales{scales.group + blk * G * 32, scales.super + blk * S * 32, G, S, scales.groups_per_super};
    });
  }
}

}  // namespace

namespace nextn_cpu {

int64_t int8_activation_group(const Int4Scales& scales, int64_t group_size) {
  return scales.group == nullptr ? group_size : group_size * scales.groups_per_super;
}

void int4_prepare(const uint16_t* xp, int64_t M, int64_t K, int64_t group_size, const Int4Scales& scales,
                  Int4Activations& a) {
  const int64_t G = K / group_size;
  a.x = xp;
  a.xs.assign(M * G, 0.f);
  if (scales.int8_activations) {
    a.act_group = int8_activation_group(scales, group_size);
    a.xq.resize(M * K);
    a.sx.resize(M * (K / a.act_group));
    quantize_rows(xp, M, K, group_size, a.act_group, a.xq.data(), a.sx.data(), a.xs.data());
    return;
  }
  // group sums of x, f32, in a fixed order per row (W4A8: sx * sum xq, from quantize_rows)
  for (int64_t m = 0; m < M; ++m)
    for (int64_t gi = 0; gi < G; ++gi) {
      V16 v = simd::zero();
      for (int64_t k = gi * group_size; k < (gi + 1) * group_size; k += 16) v = v + simd::load_bf16(xp + m * K + k);
      a.xs[m * G + gi] = simd::reduce_add(v);
    }
}

void int4_linear(const uint16_t* xp, int64_t M, int64_t K, const uint8_t* wp, int64_t N, const Int4Scales& scales,
                 int64_t group_size, const float* b, float* op) {
  Int4Activations a;
  int4_prepare(xp, M, K, group_size, scales, a);
  int4_linear_prepared(a, 0, M, K, wp, N, scales, group_size, b, op);
}

void int4_linear_prepared(const Int4Activations& a, int64_t m0, int64_t M, int64_t K, const uint8_t* wp, int64_t N,
                          const Int4Scales& scales, int64_t group_size, const float* b, float* op) {
  const int64_t G = K / group_size;
  const uint16_t* xp = a.x + m0 * K;
  const float* xsp = a.xs.data() + m0 * G;
  // blocks of 16 channels split across threads, one at a time, up to 8 rows a chunk re-reading the block's weights
  // from L1/L2. One row took 2 blocks at a time before (4 vdpbf16ps chains): on AVX-512, with the weights from DRAM,
  // one block was faster (an [8960, 1536] matrix, 48 copies, 2 threads, Zen 4: 220-257 -> 135-199 us; AVX2 level)
  auto run = [&](auto make_scales) {
    auto block = [&](auto mb, auto nb, int64_t r0, int64_t blk) {
      constexpr int MB = decltype(mb)::value, NB = decltype(nb)::value;
      int4_block<MB, NB>(xp + r0 * K, K, wp + blk * 8 * K, make_scales(blk), G, group_size, xsp + r0 * G,
                         op + r0 * N + blk * 16, N, b ? b + blk * 16 : nullptr);
    };
    run_blocks<1, kMaxRows>(M, N / 16, 4, block);
  };
  if (scales.int8_activations) {
    TORCH_CHECK(!a.xq.empty() && a.act_group == int8_activation_group(scales, group_size),
                "int4_linear: W4A8 weights need activations prepared for their scales (int4_prepare)");
    const int8_t* xq = a.xq.data() + m0 * K;
    const int64_t GA = K / a.act_group;
    const float* sx = a.sx.data() + m0 * GA;
    // two-level scales: the group scales applied in integer (int4a8_super_block; int4a8_block past kIntScaledInputs)
    const bool int_scaled = a.act_group <= kIntScaledInputs;
    // one block of 16 channels at a time, up to 8 rows a chunk (12 for 9-12 rows). Several blocks at a time (more
    // vpdpbusd chains) lost on AVX-512 once the weights stream from DRAM: one row 4 blocks, up to 4 rows 2 before,
    // against one block (an [8960, 1536] matrix, 48 copies, 2 threads, Zen 4, `benchmarks.kernels --variants`):
    // 1 row 262 -> 200 us, 4 rows 390-514 -> 257-261 us (a [1536, 576]: 27 -> 18 us, 31-40 -> 20-21 us)
    auto run8 = [&](auto make_scales) {
      auto block = [&](auto mb, auto nb, int64_t r0, int64_t blk) {
        constexpr int MB = decltype(mb)::value, NB = decltype(nb)::value;
        const auto sc = make_scales(blk);
        if constexpr (decltype(sc)::kTwoLevel) {
          if (int_scaled) {
            int4a8_super_block<MB, NB>(xq + r0 * K, K, wp + blk * 8 * K, sc, group_size, sx + r0 * GA, xsp + r0 * G,
                                       op + r0 * N + blk * 16, N, b ? b + blk * 16 : nullptr);
            return;
          }
        }
        int4a8_block<MB, NB>(xq + r0 * K, K, wp + blk * 8 * K, sc, G, group_size, sx + r0 * GA, GA, xsp + r0 * G,
                             op + r0 * N + blk * 16, N, b ? b + blk * 16 : nullptr);
      };
      if constexpr (simd::kRegisterShare > 1) {  // AVX2 / NEON: a V16 takes 2 or 4 of the vector registers
        if (M == 1) {
          run_blocks<kNarrowBlocks1, 1>(M, N / 16, 2, block);
        } else {
          run_blocks<1, kNarrowRows>(M, N / 16, 4, block);
        }
      } else if (M <= kMaxRows || M > kMaxRowsA8) {
        run_blocks<1, kMaxRows>(M, N / 16, M <= 4 ? 2 : 4, block);
      } else {  // 9-12 rows (a batch of 8 verifying a few drafts): one chunk, the weights unpacked once
        run_blocks<1, kMaxRowsA8>(M, N / 16, 4, block);
      }
    };
    with_block_scales(scales, G, run8);
    return;
  }
  with_block_scales(scales, G, run);
}

Int4Scales int4_scales(const at::Tensor& scale, const at::Tensor& zero, int64_t N, int64_t G, const char* op) {
  Int4Scales r;
  TORCH_CHECK(scale.is_contiguous() && zero.is_contiguous(), op, ": scale and zero must be contiguous");
  if (scale.scalar_type() == at::kBFloat16) {
    TORCH_CHECK(zero.scalar_type() == at::kBFloat16 && scale.numel() == N * G && zero.numel() == N * G, op,
                ": one-level scales: scale and zero8 must be bfloat16 [N / 16, K / group_size, 16] = [", N / 16, ", ",
                G, ", 16]");
    r.scale = reinterpret_cast<const uint16_t*>(scale.data_ptr<at::BFloat16>());
    r.zero8 = reinterpret_cast<const uint16_t*>(zero.data_ptr<at::BFloat16>());
    return r;
  }
  TORCH_CHECK(scale.scalar_type() == at::kByte, op, ": scale must be bfloat16 (one-level scales, with a bfloat16 "
              "zero8) or uint8 (two-level: 8-bit group scales and zeros, with float16 super-block scales), got ",
              scale.scalar_type());
  TORCH_CHECK(zero.scalar_type() == at::kHalf && scale.numel() == 2 * N * G &&
                  zero.numel() % (2 * N) == 0 && zero.numel() > 0,
              op, ": two-level scales: scale must be uint8 [N / 16, G, 2, 16] and zero float16 [N / 16, S, 2, 16] "
              "(G = K / group_size = ", G, ", S super-blocks), got ", scale.scalar_type(), " ", scale.sizes(), " and ",
              zero.scalar_type(), " ", zero.sizes());
  const int64_t S = zero.numel() / (2 * N);
  TORCH_CHECK(G % S == 0, op, ": ", S, " super-blocks do not divide ", G, " groups");
  r.group = scale.data_ptr<uint8_t>();
  r.super = reinterpret_cast<const uint16_t*>(zero.data_ptr<at::Half>());
  r.groups_per_super = G / S;
  return r;
}

}  // namespace nextn_cpu

namespace {

at::Tensor woq_int4_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale,
                           const at::Tensor& zero, int64_t group_size, const std::optional<at::Tensor>& bias,
                           bool int8_activations) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(),
              "woq_int4_linear: w must be a contiguous [N, K/2] uint8 tensor");
  const int64_t N = w.size(0), K = w.size(1) * 2;
  TORCH_CHECK(K % 64 == 0, "woq_int4_linear: K = ", K, " must be a multiple of 64");
  TORCH_CHECK(N % 16 == 0, "woq_int4_linear: N = ", N, " output channels must be a multiple of 16");
  TORCH_CHECK(group_size % 32 == 0 && K % group_size == 0, "woq_int4_linear: group_size ", group_size,
              " must be a multiple of 32 dividing K = ", K);
  nextn_cpu::Int4Scales scales = nextn_cpu::int4_scales(scale, zero, N, K / group_size, "woq_int4_linear");
  scales.int8_activations = int8_activations;
  const at::Tensor xb = nextn_cpu::check_x(x, K, "woq_int4_linear", at::kBFloat16);
  const int64_t M = xb.size(0);
  at::Tensor out = at::empty({M, N}, x.options().dtype(at::kFloat)), bias_keep;
  nextn_cpu::int4_linear(reinterpret_cast<const uint16_t*>(xb.data_ptr<at::BFloat16>()), M, K, w.data_ptr<uint8_t>(),
                         N, scales, group_size, nextn_cpu::bias_ptr(bias, N, bias_keep), out.data_ptr<float>());
  return nextn_cpu::finish(out, x);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(NEXTN_OPS, m) {
  // the ISA variant these kernels were compiled for (simd.h): what cpu_kernels.py checks after loading
  m.def("isa() -> str", []() { return std::string(nextn_cpu::simd::kVariant); });
  m.def("woq_int4_linear(Tensor x, Tensor w, Tensor scale, Tensor zero, int group_size, Tensor? bias, "
        "bool int8_activations=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(NEXTN_OPS, CPU, m) {
  m.impl("woq_int4_linear", &woq_int4_linear);
}
