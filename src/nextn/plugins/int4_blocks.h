// The register blocks of nextn's int4 linear (woq_linear_cpu.cpp dispatches to them; their PyTorch reference:
// woq_linear.py): readers of a block's group scales (one-level bf16, two-level k-quants), W4A16's block
// (`int4_block`), W4A8's (`int4a8_block`) and W4A8's with two-level scales applied in integer
// (`int4a8_super_block`). Each computes NB blocks of 16 output channels against MB rows; every output
// is the same sequence of operations whatever MB, NB or the thread (batch invariance).
#pragma once

#include "simd_int8.h"

#include <cstdint>

namespace nextn_cpu::int4 {

namespace simd = nextn_cpu::simd;

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
  inline void prefetch_next(int NB, int64_t gi, int64_t, int64_t) const {
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
  // (in_super: gi's place in its super-block, counted by the caller: a division per group cost ~5 % of a W4A8 linear)
  inline void prefetch_next(int NB, int64_t gi, int64_t si, int64_t in_super) const {
    if (gi % 2 == 0) simd::prefetch_l2(g8 + (NB * G + gi) * 32);
    if (in_super == 0) simd::prefetch_l2(sup + (NB * S + si) * 32);
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
    sc.prefetch_next(NB, gi, si, in_super);
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

// W4A8's products over input channels [k0, k1) (a run short enough for `simd::P16`: at most 4 kDotsPerWiden) for
// NB blocks of 16 channels (`pack_int4_vnni` layout: per 8 input channels k..k+7 of a block, 64 bytes, byte 4c + j =
// q[c][k + j] | q[c][k + 4 + j] << 4) against rows [0, MB) of xq (int8, row stride K), from zero: per 8 input
// channels one 64-byte load gives, by an AND and a shift, 16 channels x 4 input channels of unsigned bytes twice,
// and one `simd::pdot4` per half and row (vpdpbusd where the CPU has VNNI, vpmaddubsw elsewhere: exact) takes x's 4
// bytes, broadcast. kSplit (one row): the high nibbles in a second chain, phi.
template <int MB, int NB, bool kSplit>
__attribute__((always_inline)) inline void span_products(const int8_t* xq, int64_t K, const uint8_t* w, int64_t k0,
                                                         int64_t k1, simd::P16 (&plo)[MB][NB],
                                                         simd::P16 (&phi)[MB][kSplit ? NB : 1]) {
  const int64_t block_bytes = 8 * K;
  for (int m = 0; m < MB; ++m)
    for (int n = 0; n < NB; ++n) {
      plo[m][n] = simd::pzero();
      if constexpr (kSplit) phi[m][n] = simd::pzero();
    }
  for (int64_t k = k0; k < k1; k += 8) {
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
}

// W4A8: NB blocks of 16 output channels against rows [0, MB) of xq, x quantized to int8 (xq = round(x / sx), sx =
// max|x| / 127: `quantize_rows`), the products by `span_products`. At the end of a group:
//   y += (s_g * sx) * sum_{k in g} q_k xq_k + z_g * (sx * sum_{k in g} xq_k)
// with the group's weight scale s_g and zero z_g (w = q * s_g + z_g), in f32 — the same for a row whatever MB, NB
// or the thread: batch-invariant. sx [MB][GA]: the rows' activation scales (a group's, or with two-level scales its
// super-block's); xs [MB][G]: sx * sum xq over each group.
template <int MB, int NB, typename Scales>
inline void int4a8_block(const int8_t* xq, int64_t K, const uint8_t* w, const Scales& sc, int64_t G, int64_t g,
                         const float* sx, int64_t GA, const float* xs, float* out, int64_t out_stride,
                         const float* bias) {
  constexpr bool kSplit = MB == 1;  // two int32 chains (low / high nibbles) for one row
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
    sc.prefetch_next(NB, gi, si, in_super);
    for (int64_t k0 = gi * g; k0 < (gi + 1) * g; k0 += span) {
      simd::P16 plo[MB][NB], phi[MB][kSplit ? NB : 1];
      span_products<MB, NB, kSplit>(xq, K, w, k0, k0 + span, plo, phi);
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
        acc[m][n] = simd::fmadd(simd::to_float(d), sv * simd::set1(sx[m * GA + (Scales::kTwoLevel ? si : gi)]),
                                acc[m][n]);
        acc[m][n] = simd::fmadd(zv, simd::set1(xs[m * G + gi]), acc[m][n]);
      }
    }
    next_group(sc, si, in_super);
  }
  store_rows<MB, NB>(acc, bias, out, out_stride);
}

// W4A8 with two-level scales (llama.cpp's Q4_K x Q8_K arithmetic), the group scales applied in integer: x is
// quantized per super-block (one sx for its gps groups), so a super-block's group sums add up in int32, each scaled
// by its 8-bit group scale as it is widened (`simd::scale_widen`: AVX2's `vpmaddwd` of `vpmaddubsw`'s int16 pair
// sums by the scale instead of by 1; AVX-512 one `vpmulld`), and one conversion to f32 a super-block replaces
// int4a8_block's per-group f32 work; the zero points come first, in a loop of their own. Measured against
// int4a8_block on the same activations (an [8960, 1536] matrix from DRAM, 2 threads, Zen 4): AVX2 1 / 4 / 5 rows
// -4 / -10 / -13 %, AVX-512 -15 / -14 / -15 %. Per row and channel, the zero points over the groups in order, then
// per super-block S in order:
//   y = sum_g (dmin_S(g) * z_g) * xs_g + sum_S (d_S * sx_S) * sum_{g in S} sc_g * sum_{k in g} q_k xq_k
// with w = q * (d_S * sc_g) + dmin_S * z_g (dmin * z exact in f32) and xs_g = sx_S * sum_{k in g} xq_k. Exact in
// int32 while a super-block spans at most kIntScaledInputs inputs (15 * 127 * 255 * 4096 < 2^31). The same f32
// operations for a row whatever MB, NB or the thread: batch-invariant. sx [MB][S], xs [MB][G].
constexpr int64_t kIntScaledInputs = 4096;
template <int MB, int NB>
inline void int4a8_super_block(const int8_t* xq, int64_t K, const uint8_t* w, const KScales& sc, int64_t g,
                               const float* sx, const float* xs, float* out, int64_t out_stride, const float* bias) {
  constexpr bool kSplit = MB == 1;
  const int64_t G = sc.G, S = sc.S;
  const int64_t span = simd::kDotsPerWiden >= g / 4 ? g : 4 * simd::kDotsPerWiden;
  // the zero points first, in a loop of their own (in the main loop, short of registers, their FMAs cost ~20 % at
  // 4 rows)
  V16 acc[MB][NB];
  for (int m = 0; m < MB; ++m)
    for (int n = 0; n < NB; ++n) acc[m][n] = simd::zero();
  for (int64_t si = 0; si < S; ++si)
    for (int n = 0; n < NB; ++n) {
      const V16 dmin = simd::load_f16(sc.sup + (n * S + si) * 32 + 16);
      for (int64_t gi = si * sc.gps; gi < (si + 1) * sc.gps; ++gi) {
        const V16 zv = simd::load_int8(reinterpret_cast<const int8_t*>(sc.g8 + (n * G + gi) * 32 + 16)) * dmin;
        for (int m = 0; m < MB; ++m) acc[m][n] = simd::fmadd(zv, simd::set1(xs[m * G + gi]), acc[m][n]);
      }
    }
  for (int64_t si = 0; si < S; ++si) {
    simd::I16 isum[MB][NB];
    for (int m = 0; m < MB; ++m)
      for (int n = 0; n < NB; ++n) isum[m][n] = simd::izero();
    for (int64_t gi = si * sc.gps; gi < (si + 1) * sc.gps; ++gi) {
      sc.prefetch_next(NB, gi, si, gi - si * sc.gps);
      for (int64_t k0 = gi * g; k0 < (gi + 1) * g; k0 += span) {
        simd::P16 plo[MB][NB], phi[MB][kSplit ? NB : 1];
        span_products<MB, NB, kSplit>(xq, K, w, k0, k0 + span, plo, phi);
        for (int n = 0; n < NB; ++n) {
          const simd::Scale16 s = simd::group_scales16(sc.g8 + (n * G + gi) * 32);
          for (int m = 0; m < MB; ++m) {
            isum[m][n] = simd::scale_widen(isum[m][n], plo[m][n], s);
            if constexpr (kSplit) isum[m][n] = simd::scale_widen(isum[m][n], phi[m][n], s);
          }
        }
      }
    }
    for (int n = 0; n < NB; ++n) {
      const V16 d = simd::load_f16(sc.sup + (n * S + si) * 32);
      for (int m = 0; m < MB; ++m)
        acc[m][n] = simd::fmadd(simd::to_float(isum[m][n]), d * simd::set1(sx[m * S + si]), acc[m][n]);
    }
  }
  store_rows<MB, NB>(acc, bias, out, out_stride);
}

}  // namespace nextn_cpu::int4
