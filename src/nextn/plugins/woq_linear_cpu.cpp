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
#include "simd_int8.h"

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace {

namespace simd = nextn_cpu::simd;
using nextn_cpu::Int;
using nextn_cpu::run_blocks;
using nextn_cpu::with_rows;

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

// Both kernels ask for every cache line of the next channel blocks into L2 while these compute: the weights stream
// from DRAM once per step, and without it loads and arithmetic do not overlap (measured: a [151936, 1536] int8
// matrix, one row, 14.5 -> 5.9-7.9 ms; an L1 hint gained less).

using simd::V16;

// A block's group scales, one-level: bf16 scale and zero8 [NB][G][16] (16 channels a group). `get(n, gi, si)` (si:
// the super-block, unused here) gives the group's scale and the coefficient of its x sum for weights read as
// 128 + q (int4_block): (q - 8) * s + z8 = (128 + q) * s + (z8 - 136 s).
struct Bf16Scales {
  const uint16_t* s;
  const uint16_t* z;
  int64_t G;
  static constexpr bool kTwoLevel = false;
  inline void prefetch_next(int NB, int64_t gi, int64_t) const {
    if (gi % 4 == 0) {  // a 64-byte line holds 4 groups' scales (and zero8s)
      simd::prefetch_l2(s + (NB * G + gi) * 16);
      simd::prefetch_l2(z + (NB * G + gi) * 16);
    }
  }
  __attribute__((always_inline)) inline void get(int n, int64_t gi, int64_t, V16& sv, V16& zv) const {
    const int64_t at = (n * G + gi) * 16;
    sv = simd::load_bf16(s + at);
    zv = simd::fnmadd(simd::set1(136.f), sv, simd::load_bf16(z + at));
  }
};

// Two-level (llama.cpp's k-quants): 8-bit group scales [NB][G][2][16] (u8 scale, i8 zero) under fp16 (d, dmin)
// [NB][S][2][16] per super-block of `gps` groups: w = q * (d * scale) + dmin * zero. d * scale and dmin * zero are
// exact in f32 (11 x 8 bits), so a GGUF Q4_K block (6-bit scales and mins) is read with llama.cpp's values.
// Weights read as 128 + q: zv = dmin * zero - 128 * sv.
struct KScales {
  const uint8_t* g8;
  const uint16_t* sup;
  int64_t G, S, gps;
  static constexpr bool kTwoLevel = true;
  inline void prefetch_next(int NB, int64_t gi, int64_t si) const {
    if (gi % 2 == 0) simd::prefetch_l2(g8 + (NB * G + gi) * 32);
    if (gi % gps == 0) simd::prefetch_l2(sup + (NB * S + si) * 32);
  }
  // d and dmin are re-read (from L1) for every group rather than held in registers across the group: with 8 rows
  // the accumulators leave no registers for them (measured: held, batch 8 spilled and ran 15 % slower)
  __attribute__((always_inline)) inline void get(int n, int64_t gi, int64_t si, V16& sv, V16& zv) const {
    const uint8_t* p = g8 + (n * G + gi) * 32;
    const uint16_t* ds = sup + (n * S + si) * 32;
    const V16 d = simd::load_f16(ds), dmin = simd::load_f16(ds + 16);
    sv = simd::load_int8(p) * d;
    zv = simd::fnmadd(simd::set1(128.f), sv, simd::load_int8(reinterpret_cast<const int8_t*>(p + 16)) * dmin);
  }
};

// out rows [0, MB) x NB blocks of 16 channels = acc (+ bias)
template <int MB, int NB>
inline void store_rows(const V16 (&acc)[MB][NB], const float* bias, float* out, int64_t out_stride) {
  for (int m = 0; m < MB; ++m)
    for (int n = 0; n < NB; ++n) {
      V16 y = acc[m][n];
      if (bias) y = y + simd::load(bias + 16 * n);
      simd::store(out + m * out_stride + 16 * n, y);
    }
}

// After a group: two-level scales count the groups of a super-block (no division per group)
template <typename Scales>
inline void next_group(const Scales& sc, int64_t& si, int64_t& in_super) {
  if constexpr (Scales::kTwoLevel) {
    if (++in_super == sc.gps) in_super = 0, ++si;
  }
}

// NB blocks of 16 output channels (int4, `pack_int4` layout, starting at w; 8 K bytes a block) against rows
// [0, MB) of x (bf16, row stride K). A vector lane is an output channel: per 4 input channels, one 32-byte load
// widens to 16 channels x (k, k+1) and (k+2, k+3) pairs (`simd::pairs_int4`: a nibble q -> 128 + q, exact; the 128
// comes back out through the group sum of x), and one `simd::dot` per pair and row multiplies them with x's pair
// (vdpbf16ps on AVX512-BF16, two FMAs elsewhere: exact products, f32 sums, two chains: lo and hi pairs). At the end
// of a group of g input channels each row's sums are scaled by the group's 16 scales (one FMA for 16 channels) and
// the zero points enter through the group sum of x:
//   y = sum_g [ s_g * sum_{k in g} (128 + q_k) x_k + z_g * xs_g ] + bias     (Scales::get gives s_g, z_g)
// Every channel's result is this sequence of f32 operations whatever MB, NB or the thread: batch-invariant.
// xs: [MB][G] f32 group sums of x.
template <int MB, int NB, typename Scales>
inline void int4_block(const uint16_t* x, int64_t K, const uint8_t* w, const Scales& sc, int64_t G, int64_t g,
                       const float* xs, float* out, int64_t out_stride, const float* bias) {
  const int64_t block_bytes = 8 * K;
  int64_t si = 0, in_super = 0;  // two-level: the super-block of group gi (counted, not divided), gi's place in it
  V16 acc[MB][NB];
  for (int m = 0; m < MB; ++m)
    for (int n = 0; n < NB; ++n) acc[m][n] = simd::zero();
  for (int64_t gi = 0; gi < G; ++gi) {
    V16 lo[MB][NB], hi[MB][NB];
    for (int m = 0; m < MB; ++m)
      for (int n = 0; n < NB; ++n) lo[m][n] = hi[m][n] = simd::zero();
    sc.prefetch_next(NB, gi, si);
    for (int64_t k = gi * g; k < (gi + 1) * g; k += 4) {
      if ((k & 7) == 0)
        for (int n = 0; n < NB; ++n) simd::prefetch_l2(w + (n + NB) * block_bytes + 8 * k);
      for (int n = 0; n < NB; ++n) {
        simd::Pairs wl, wh;
        simd::pairs_int4(w + n * block_bytes + 8 * k, wl, wh);
        for (int m = 0; m < MB; ++m) {
          lo[m][n] = simd::dot(lo[m][n], wl, simd::xpair(x + m * K + k));
          hi[m][n] = simd::dot(hi[m][n], wh, simd::xpair(x + m * K + k + 2));
        }
      }
    }
    for (int n = 0; n < NB; ++n) {
      V16 sv, zv;
      sc.get(n, gi, si, sv, zv);
      for (int m = 0; m < MB; ++m) {
        acc[m][n] = simd::fmadd(lo[m][n] + hi[m][n], sv, acc[m][n]);
        acc[m][n] = simd::fmadd(zv, simd::set1(xs[m * G + gi]), acc[m][n]);
      }
    }
    next_group(sc, si, in_super);
  }
  store_rows<MB, NB>(acc, bias, out, out_stride);
}

// W4A8: NB blocks of 16 output channels (int4, `pack_int4_vnni` layout: per 8 input channels k..k+7 of a block, 64
// bytes, byte 4c + j = q[c][k + j] | q[c][k + 4 + j] << 4) against rows [0, MB) of xq, x quantized per group of g
// to int8 (xq = round(x / sx), sx = max|x| / 127: `quantize_rows`). Per 8 input channels one 64-byte load gives, by
// an AND and a shift, 16 channels x 4 input channels of unsigned bytes twice, and one `simd::dot4` per half and row
// (vpdpbusd where the CPU has VNNI, vpmaddubsw + vpmaddwd elsewhere: exact in int32 either way) takes x's 4 bytes,
// broadcast. At the end of a group:
//   y += (s_g * sx) * sum_{k in g} q_k xq_k + z_g * (sx * sum_{k in g} xq_k)
// with the group's weight scale s_g and zero z_g (w = q * s_g + z_g), in f32 — the same for a row whatever MB, NB
// or the thread: batch-invariant. sx, xs: [MB][G] the rows' group scales and sx * sum xq.
template <int MB, int NB, typename Scales>
inline void int4a8_block(const int8_t* xq, int64_t K, const uint8_t* w, const Scales& sc, int64_t G, int64_t g,
                         const float* sx, const float* xs, float* out, int64_t out_stride, const float* bias) {
  constexpr bool kSplit = MB == 1;  // two int32 chains (low / high nibbles) for one row
  const int64_t block_bytes = 8 * K;
  int64_t si = 0, in_super = 0;
  V16 acc[MB][NB];
  for (int m = 0; m < MB; ++m)
    for (int n = 0; n < NB; ++n) acc[m][n] = simd::zero();
  // input channels a run of products spans before it is widened (8 products a lane: simd::kDotsPerWiden)
  const int64_t span = simd::kDotsPerWiden >= g / 4 ? g : 4 * simd::kDotsPerWiden;
  for (int64_t gi = 0; gi < G; ++gi) {
    simd::I16 lo[MB][NB], hi[MB][kSplit ? NB : 1];
    for (int m = 0; m < MB; ++m)
      for (int n = 0; n < NB; ++n) {
        lo[m][n] = simd::izero();
        if constexpr (kSplit) hi[m][n] = simd::izero();
      }
    sc.prefetch_next(NB, gi, si);
    for (int64_t k0 = gi * g; k0 < (gi + 1) * g; k0 += span) {
      simd::P16 plo[MB][NB], phi[MB][kSplit ? NB : 1];
      for (int m = 0; m < MB; ++m)
        for (int n = 0; n < NB; ++n) {
          plo[m][n] = simd::pzero();
          if constexpr (kSplit) phi[m][n] = simd::pzero();
        }
      for (int64_t k = k0; k < k0 + span; k += 8) {
        for (int n = 0; n < NB; ++n) simd::prefetch_l2(w + (n + NB) * block_bytes + 8 * k);
        for (int n = 0; n < NB; ++n) {
          simd::U8x64 wl, wh;
          simd::nibbles(w + n * block_bytes + 8 * k, wl, wh);
          for (int m = 0; m < MB; ++m) {
            const int8_t* xm = xq + m * K + k;
            plo[m][n] = simd::pdot4(plo[m][n], wl, xm);
            if constexpr (kSplit) {
              phi[m][n] = simd::pdot4(phi[m][n], wh, xm + 4);
            } else {
              plo[m][n] = simd::pdot4(plo[m][n], wh, xm + 4);
            }
          }
        }
      }
      for (int m = 0; m < MB; ++m)
        for (int n = 0; n < NB; ++n) {
          lo[m][n] = simd::widen(lo[m][n], plo[m][n]);
          if constexpr (kSplit) hi[m][n] = simd::widen(hi[m][n], phi[m][n]);
        }
    }
    for (int n = 0; n < NB; ++n) {
      V16 sv, zv;
      sc.get(n, gi, si, sv, zv);
      zv = simd::fmadd(simd::set1(128.f), sv, zv);  // get's zero is for weights read as 128 + q
      for (int m = 0; m < MB; ++m) {
        simd::I16 d = lo[m][n];
        if constexpr (kSplit) d = simd::iadd(d, hi[m][n]);
        acc[m][n] = simd::fmadd(simd::to_float(d), sv * simd::set1(sx[m * G + gi]), acc[m][n]);
        acc[m][n] = simd::fmadd(zv, simd::set1(xs[m * G + gi]), acc[m][n]);
      }
    }
    next_group(sc, si, in_super);
  }
  store_rows<MB, NB>(acc, bias, out, out_stride);
}

// x [M, K] bf16 -> xq [M, K] int8, per group of g: sx = max|x| / 127, xq = round-to-even of x * (1 / sx) (0 for an
// all-zero group), xs = sx * sum xq (what the group's zero point multiplies). Each row alone: batch-invariant.
void quantize_rows(const uint16_t* x, int64_t M, int64_t K, int64_t g, int8_t* xq, float* sx, float* xs) {
  const int64_t G = K / g;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t gi = 0; gi < G; ++gi) {
      const uint16_t* p = x + m * K + gi * g;
      V16 amax = simd::zero();
      for (int64_t k = 0; k < g; k += 16) amax = simd::max(amax, simd::abs(simd::load_bf16(p + k)));
      const float s = simd::reduce_max(amax) / 127.f;
      const V16 inv = simd::set1(s > 0.f ? 1.f / s : 0.f);  // a multiply per element, not a division
      int32_t sum = 0;
      for (int64_t k = 0; k < g; k += 16)
        sum += simd::store_int8_rne(xq + m * K + gi * g + k, simd::load_bf16(p + k) * inv);
      sx[m * G + gi] = s;
      xs[m * G + gi] = s * float(sum);
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

void int4_prepare(const uint16_t* xp, int64_t M, int64_t K, int64_t group_size, bool int8_activations,
                  Int4Activations& a) {
  const int64_t G = K / group_size;
  a.x = xp;
  a.xs.assign(M * G, 0.f);
  if (int8_activations) {
    a.xq.resize(M * K);
    a.sx.resize(M * G);
    quantize_rows(xp, M, K, group_size, a.xq.data(), a.sx.data(), a.xs.data());
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
  int4_prepare(xp, M, K, group_size, scales.int8_activations, a);
  int4_linear_prepared(a, 0, M, K, wp, N, scales, group_size, b, op);
}

void int4_linear_prepared(const Int4Activations& a, int64_t m0, int64_t M, int64_t K, const uint8_t* wp, int64_t N,
                          const Int4Scales& scales, int64_t group_size, const float* b, float* op) {
  const int64_t G = K / group_size;
  const uint16_t* xp = a.x + m0 * K;
  const float* xsp = a.xs.data() + m0 * G;
  // blocks of 16 channels split across threads; one row: 2 blocks at a time (4 independent vdpbf16ps chains);
  // more: 1 block, up to 8 rows a chunk re-reading the block's weights from L1/L2
  auto run = [&](auto make_scales) {
    auto block = [&](auto mb, auto nb, int64_t r0, int64_t blk) {
      constexpr int MB = decltype(mb)::value, NB = decltype(nb)::value;
      int4_block<MB, NB>(xp + r0 * K, K, wp + blk * 8 * K, make_scales(blk), G, group_size, xsp + r0 * G,
                         op + r0 * N + blk * 16, N, b ? b + blk * 16 : nullptr);
    };
    if (M == 1) {
      run_blocks<2, 1>(M, N / 16, 4, block);
    } else {
      run_blocks<1, kMaxRows>(M, N / 16, 4, block);
    }
  };
  if (scales.int8_activations) {
    TORCH_CHECK(!a.xq.empty(), "int4_linear: W4A8 weights need activations prepared with int8_activations");
    const int8_t* xq = a.xq.data() + m0 * K;
    const float* sx = a.sx.data() + m0 * G;
    // one row: 4 blocks at a time (8 vpdpbusd chains), 2 for a small matrix; up to 4 rows: 2; more: 1 block, 8 rows
    // a chunk
    auto run8 = [&](auto make_scales) {
      auto block = [&](auto mb, auto nb, int64_t r0, int64_t blk) {
        constexpr int MB = decltype(mb)::value, NB = decltype(nb)::value;
        int4a8_block<MB, NB>(xq + r0 * K, K, wp + blk * 8 * K, make_scales(blk), G, group_size, sx + r0 * G,
                             xsp + r0 * G, op + r0 * N + blk * 16, N, b ? b + blk * 16 : nullptr);
      };
      if constexpr (simd::kRegisterShare > 1) {  // AVX2 / NEON: a V16 takes 2 or 4 of the vector registers
        if (M == 1) {
          run_blocks<kNarrowBlocks1, 1>(M, N / 16, 2, block);
        } else {
          run_blocks<1, kNarrowRows>(M, N / 16, 4, block);
        }
      } else if (M == 1 && N >= 2048) {
        run_blocks<4, 1>(M, N / 16, 2, block);
      } else if (M == 1) {  // a small matrix: 2 blocks a unit, enough units to share between the threads
        run_blocks<2, 1>(M, N / 16, 2, block);
      } else if (M <= 4) {
        run_blocks<2, 4>(M, N / 16, 2, block);
      } else if (M <= kMaxRows || M > kMaxRowsA8) {
        run_blocks<1, kMaxRows>(M, N / 16, 4, block);
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
