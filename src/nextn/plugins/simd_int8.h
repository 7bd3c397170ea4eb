// int8 dot products over nextn's SIMD layer (simd.h): 16 output channels x 4 input channels of unsigned 4-bit
// weights against a row's 4 signed int8 activations, summed exactly in int32 lanes (AVX512-VNNI `vpdpbusd`, AVX2's
// `vpmaddubsw` + `vpmaddwd`, AVX-VNNI's 256-bit `vpdpbusd`, NEON's `sdot` or `smull` + pairwise adds, else scalar), and
// the int8 rounding of activations.
// What W4A8 multiplies (woq_linear_cpu.cpp, moe_cpu.cpp) and the int8 linear widens (int8_linear_cpu.cpp).
#pragma once

#include "simd.h"

namespace nextn_cpu::simd {

// --- int8 dot products: 16 int32 lanes += 4 unsigned weight bytes x 4 signed activation bytes each

#if defined(NEXTN_AVX512)
struct I16 {
  __m512i v;
};
struct U8x64 {  // lane c: bytes 4c..4c+3, each < 16
  __m512i v;
};
#elif defined(NEXTN_AVX2)
struct I16 {
  __m256i v[2];
};
struct U8x64 {
  __m256i v[2];
};
#elif defined(NEXTN_NEON)
struct I16 {  // channel c: lane c % 4 of v[c / 4]
  int32x4_t v[4];
};
struct U8x64 {  // channels 4i..4i+3: v[i]
  uint8x16_t v[4];
};
#else
struct I16 {
  int32_t v[16];
};
struct U8x64 {
  uint8_t v[64];
};
#endif

inline I16 izero() {
#if defined(NEXTN_AVX512)
  return {_mm512_setzero_si512()};
#elif defined(NEXTN_AVX2)
  return {{_mm256_setzero_si256(), _mm256_setzero_si256()}};
#elif defined(NEXTN_NEON)
  return {{vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0)}};
#else
  return {};
#endif
}

inline I16 iadd(const I16& a, const I16& b) {
#if defined(NEXTN_AVX512)
  return {_mm512_add_epi32(a.v, b.v)};
#elif defined(NEXTN_AVX2)
  return {{_mm256_add_epi32(a.v[0], b.v[0]), _mm256_add_epi32(a.v[1], b.v[1])}};
#elif defined(NEXTN_NEON)
  I16 r;
  for (int i = 0; i < 4; ++i) r.v[i] = vaddq_s32(a.v[i], b.v[i]);
  return r;
#else
  I16 r;
  for (int i = 0; i < 16; ++i) r.v[i] = a.v[i] + b.v[i];
  return r;
#endif
}

inline V16 to_float(const I16& a) {
#if defined(NEXTN_AVX512)
  return {Vec(_mm512_cvtepi32_ps(a.v))};
#elif defined(NEXTN_AVX2)
  return {{Vec(_mm256_cvtepi32_ps(a.v[0])), Vec(_mm256_cvtepi32_ps(a.v[1]))}};
#elif defined(NEXTN_NEON)
  static_assert(kParts == 4, "at::vec's NEON vectors hold 4 f32");
  return {{Vec(vcvtq_f32_s32(a.v[0])), Vec(vcvtq_f32_s32(a.v[1])), Vec(vcvtq_f32_s32(a.v[2])),
           Vec(vcvtq_f32_s32(a.v[3]))}};
#else
  alignas(64) float b[16];
  for (int i = 0; i < 16; ++i) b[i] = float(a.v[i]);
  return load(b);
#endif
}

// 64 bytes of int4 (byte 4c + j: channel c, its low nibble q[c][k + j], its high nibble q[c][k + 4 + j]) -> the
// low nibbles and the high nibbles as bytes
inline void nibbles(const uint8_t* w, U8x64& lo, U8x64& hi) {
#if defined(NEXTN_AVX512)
  const __m512i v = _mm512_loadu_si512(w), low4 = _mm512_set1_epi8(0x0F);
  lo.v = _mm512_and_si512(v, low4);
  hi.v = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
#elif defined(NEXTN_AVX2)
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  for (int i = 0; i < 2; ++i) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * i));
    lo.v[i] = _mm256_and_si256(v, low4);
    hi.v[i] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
  }
#elif defined(NEXTN_NEON)
  const uint8x16_t low4 = vdupq_n_u8(0x0F);
  for (int i = 0; i < 4; ++i) {
    const uint8x16_t v = vld1q_u8(w + 16 * i);
    lo.v[i] = vandq_u8(v, low4);
    hi.v[i] = vshrq_n_u8(v, 4);
  }
#else
  for (int i = 0; i < 64; ++i) lo.v[i] = w[i] & 15, hi.v[i] = w[i] >> 4;
#endif
}

#if defined(NEXTN_AVX2_VNNI)
// 8 int32 lanes + the dot products of their 4 unsigned bytes of a and 4 signed bytes of b (`vpdpbusd`), or of their 2
// int16 of a and of b (`vpdpwssd`): AVX-VNNI's VEX encoding, or the stand-in's EVEX one (simd.h)
inline __m256i dpbusd256(__m256i acc, __m256i a, __m256i b) {
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, a, b);
#else
  __asm__("vpdpbusd %2, %1, %0" : "+x"(acc) : "x"(a), "x"(b));
  return acc;
#endif
}
inline __m256i dpwssd256(__m256i acc, __m256i a, __m256i b) {
#if defined(__AVXVNNI__)
  return _mm256_dpwssd_avx_epi32(acc, a, b);
#else
  __asm__("vpdpwssd %2, %1, %0" : "+x"(acc) : "x"(a), "x"(b));
  return acc;
#endif
}
#endif

#if defined(NEXTN_NEON)
// x's 4 bytes in every 32-bit lane
inline int8x16_t broadcast4(int32_t x4) { return vreinterpretq_s8_s32(vdupq_n_s32(x4)); }
// the 16 bytes' products with xb as int16 pair sums: element 2c + h is channel c's products 2h and 2h + 1 (`smull`,
// `smull2`, `addp`); |a pair| <= 2 * 15 * 127
inline int16x8_t pairs4(uint8x16_t w, int8x16_t xb) {
  const int8x16_t ws = vreinterpretq_s8_u8(w);  // < 16: the same value signed
  return vpaddq_s16(vmull_s8(vget_low_s8(ws), vget_low_s8(xb)), vmull_high_s8(ws, xb));
}
#endif

// acc[c] + sum_j w[4c + j] * x[j]: w unsigned (< 16), x 4 signed bytes (|x| <= 127): exact in int32 on every path
// (`vpdpbusd`, `sdot`: w < 16 is the same byte signed; `vpmaddubsw` pairs stay below 2 * 15 * 127, far from int16
// saturation)
inline I16 dot4(const I16& acc, const U8x64& w, const int8_t* x) {
  int32_t x4;
  std::memcpy(&x4, x, 4);
#if defined(NEXTN_AVX512)
  static_assert(__AVX512VNNI__, "the AVX-512 variants require VNNI (cpu_kernels.py)");
  return {_mm512_dpbusd_epi32(acc.v, w.v, _mm512_set1_epi32(x4))};
#elif defined(NEXTN_AVX2_VNNI)
  const __m256i xb = _mm256_set1_epi32(x4);
  return {{dpbusd256(acc.v[0], w.v[0], xb), dpbusd256(acc.v[1], w.v[1], xb)}};
#elif defined(NEXTN_AVX2)
  const __m256i xb = _mm256_set1_epi32(x4), ones = _mm256_set1_epi16(1);
  return {{_mm256_add_epi32(acc.v[0], _mm256_madd_epi16(_mm256_maddubs_epi16(w.v[0], xb), ones)),
           _mm256_add_epi32(acc.v[1], _mm256_madd_epi16(_mm256_maddubs_epi16(w.v[1], xb), ones))}};
#elif defined(NEXTN_NEON_DOT)
  const int8x16_t xb = broadcast4(x4);
  I16 r;
  for (int i = 0; i < 4; ++i) r.v[i] = vdotq_s32(acc.v[i], vreinterpretq_s8_u8(w.v[i]), xb);
  return r;
#elif defined(NEXTN_NEON)
  const int8x16_t xb = broadcast4(x4);
  I16 r;
  for (int i = 0; i < 4; ++i) r.v[i] = vpadalq_s16(acc.v[i], pairs4(w.v[i], xb));
  return r;
#else
  I16 r;
  for (int c = 0; c < 16; ++c)
    r.v[c] = acc.v[c] + int32_t(w.v[4 * c]) * x[0] + int32_t(w.v[4 * c + 1]) * x[1] + int32_t(w.v[4 * c + 2]) * x[2] +
             int32_t(w.v[4 * c + 3]) * x[3];
  return r;
#endif
}

// A run of int8 dot products before they are widened to int32: AVX2 without VNNI keeps `vpmaddubsw`'s int16 pair sums
// (each at most 2 * 15 * 127 in magnitude, so kDotsPerWiden = 8 of them stay below 2^15) and widens them with one
// `vpmaddwd` per run instead of one per product, NEON without `sdot` likewise (`smull` + `addp`, one `sadalp` a run);
// elsewhere it is an I16 (`vpdpbusd`, `sdot` widen as they go). Exact either way.
#if defined(NEXTN_AVX2) && !defined(NEXTN_AVX2_VNNI)
struct P16 {
  __m256i v[2];
};
constexpr int kDotsPerWiden = 8;
inline P16 pzero() { return {{_mm256_setzero_si256(), _mm256_setzero_si256()}}; }
inline P16 pdot4(const P16& acc, const U8x64& w, const int8_t* x) {
  int32_t x4;
  std::memcpy(&x4, x, 4);
  const __m256i xb = _mm256_set1_epi32(x4);
  return {{_mm256_add_epi16(acc.v[0], _mm256_maddubs_epi16(w.v[0], xb)),
           _mm256_add_epi16(acc.v[1], _mm256_maddubs_epi16(w.v[1], xb))}};
}
inline I16 widen(const I16& acc, const P16& p) {
  const __m256i ones = _mm256_set1_epi16(1);
  return {{_mm256_add_epi32(acc.v[0], _mm256_madd_epi16(p.v[0], ones)),
           _mm256_add_epi32(acc.v[1], _mm256_madd_epi16(p.v[1], ones))}};
}
#elif defined(NEXTN_NEON) && !defined(NEXTN_NEON_DOT)
struct P16 {  // element 2c + h of v[c / 4]: channel c's pair sums (`pairs4`)
  int16x8_t v[4];
};
constexpr int kDotsPerWiden = 8;
inline P16 pzero() { return {{vdupq_n_s16(0), vdupq_n_s16(0), vdupq_n_s16(0), vdupq_n_s16(0)}}; }
inline P16 pdot4(const P16& acc, const U8x64& w, const int8_t* x) {
  int32_t x4;
  std::memcpy(&x4, x, 4);
  const int8x16_t xb = broadcast4(x4);
  P16 r;
  for (int i = 0; i < 4; ++i) r.v[i] = vaddq_s16(acc.v[i], pairs4(w.v[i], xb));
  return r;
}
inline I16 widen(const I16& acc, const P16& p) {  // `sadalp`: each channel's two pair sums added into its lane
  I16 r;
  for (int i = 0; i < 4; ++i) r.v[i] = vpadalq_s16(acc.v[i], p.v[i]);
  return r;
}
#else
using P16 = I16;
constexpr int kDotsPerWiden = 1 << 30;
inline P16 pzero() { return izero(); }
inline P16 pdot4(const P16& acc, const U8x64& w, const int8_t* x) { return dot4(acc, w, x); }
inline I16 widen(const I16& acc, const P16& p) { return iadd(acc, p); }
#endif

// 16 channels' 8-bit group scales (u8), for `scale_widen`: AVX2 without VNNI holds each twice in its 32-bit lane (one
// per int16 half), elsewhere once
#if defined(NEXTN_AVX2) && !defined(NEXTN_AVX2_VNNI)
struct Scale16 {
  __m256i v[2];
};
inline Scale16 group_scales16(const uint8_t* s) {
  Scale16 r;
  for (int i = 0; i < 2; ++i) {
    const __m256i u = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(s + 8 * i)));
    r.v[i] = _mm256_or_si256(u, _mm256_slli_epi32(u, 16));
  }
  return r;
}
#else
using Scale16 = I16;
inline Scale16 group_scales16(const uint8_t* s) {
#if defined(NEXTN_AVX512)
  return {_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s)))};
#elif defined(NEXTN_AVX2)
  return {{_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(s))),
           _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(s + 8)))}};
#elif defined(NEXTN_NEON)
  const uint8x16_t b = vld1q_u8(s);
  const uint16x8_t lo = vmovl_u8(vget_low_u8(b)), hi = vmovl_high_u8(b);
  return {{vreinterpretq_s32_u32(vmovl_u16(vget_low_u16(lo))), vreinterpretq_s32_u32(vmovl_high_u16(lo)),
           vreinterpretq_s32_u32(vmovl_u16(vget_low_u16(hi))), vreinterpretq_s32_u32(vmovl_high_u16(hi))}};
#else
  I16 r;
  for (int c = 0; c < 16; ++c) r.v[c] = s[c];
  return r;
#endif
}
#endif

// acc[c] + s[c] * (channel c's sum in p): a run of products widened and scaled by its group's 8-bit scale at once
// (AVX2: one `vpmaddwd` of the int16 pair sums by (s, s), what `widen` does with (1, 1); with VNNI, AVX-512: one
// `vpmulld`; NEON: one `mla`, after a `saddlp` without `sdot`). Exact in int32 while |acc| + 255 * |sum| < 2^31 (callers bound the inputs a sum spans:
// int4_blocks.h).
inline I16 scale_widen(const I16& acc, const P16& p, const Scale16& s) {
#if defined(NEXTN_AVX2_VNNI)
  return {{_mm256_add_epi32(acc.v[0], _mm256_mullo_epi32(p.v[0], s.v[0])),
           _mm256_add_epi32(acc.v[1], _mm256_mullo_epi32(p.v[1], s.v[1]))}};
#elif defined(NEXTN_AVX2)
  return {{_mm256_add_epi32(acc.v[0], _mm256_madd_epi16(p.v[0], s.v[0])),
           _mm256_add_epi32(acc.v[1], _mm256_madd_epi16(p.v[1], s.v[1]))}};
#elif defined(NEXTN_AVX512)
  return {_mm512_add_epi32(acc.v, _mm512_mullo_epi32(p.v, s.v))};
#elif defined(NEXTN_NEON_DOT)
  I16 r;
  for (int i = 0; i < 4; ++i) r.v[i] = vmlaq_s32(acc.v[i], p.v[i], s.v[i]);
  return r;
#elif defined(NEXTN_NEON)
  I16 r;  // `saddlp` widens the pair sums, `mla` scales and adds
  for (int i = 0; i < 4; ++i) r.v[i] = vmlaq_s32(acc.v[i], vpaddlq_s16(p.v[i]), s.v[i]);
  return r;
#else
  I16 r;
  for (int c = 0; c < 16; ++c) r.v[c] = acc.v[c] + p.v[c] * s.v[c];
  return r;
#endif
}

// 16 f32 -> int32 rounded to nearest even, clamped to [-128, 127] (|v| <= 127 here: the clamp is a guard), stored as
// int8; returns their sum (of the stored values). What quantizes W4A8's activations: vectorized, as a scalar loop it
// was ~15 % of a 4-row linear on AVX2.
inline int32_t store_int8_rne(int8_t* p, const V16& v) {
  const V16 r = round(v);  // an integer value: the truncating conversions below are exact
#if defined(NEXTN_AVX512)
  const __m512i lo = _mm512_set1_epi32(-128), hi = _mm512_set1_epi32(127);
  const __m512i q = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvttps_epi32(__m512(r.p[0])), lo), hi);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(q));
  return _mm512_reduce_add_epi32(q);
#elif defined(NEXTN_AVX2)
  // saturating packs clamp: int32 -> int16 -> int8, the 128-bit halves then put back in order
  const __m256i q0 = _mm256_cvttps_epi32(__m256(r.p[0])), q1 = _mm256_cvttps_epi32(__m256(r.p[1]));
  const __m256i w = _mm256_packs_epi32(q0, q1);  // 0-3 8-11 4-7 12-15 as int16
  const __m128i b = _mm_packs_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));  // 0-3 8-11 4-7 12-15
  const __m128i ordered = _mm_shuffle_epi32(b, _MM_SHUFFLE(3, 1, 2, 0));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), ordered);
  const __m128i s16 = _mm_madd_epi16(_mm_cvtepi8_epi16(ordered), _mm_set1_epi16(1));
  const __m128i s8 = _mm_madd_epi16(_mm_cvtepi8_epi16(_mm_srli_si128(ordered, 8)), _mm_set1_epi16(1));
  __m128i t = _mm_add_epi32(s16, s8);
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, _MM_SHUFFLE(1, 0, 3, 2)));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(t);
#elif defined(NEXTN_NEON)
  // truncating conversions of integer values, then saturating narrowings clamp: int32 -> int16 -> int8
  int16x8_t h[2];
  for (int i = 0; i < 2; ++i)
    h[i] = vcombine_s16(vqmovn_s32(vcvtq_s32_f32(float32x4_t(r.p[2 * i]))),
                        vqmovn_s32(vcvtq_s32_f32(float32x4_t(r.p[2 * i + 1]))));
  const int8x16_t q = vcombine_s8(vqmovn_s16(h[0]), vqmovn_s16(h[1]));
  vst1q_s8(p, q);
  return vaddlvq_s8(q);
#else
  alignas(64) float b[16];
  store(b, r);
  int32_t s = 0;
  for (int i = 0; i < 16; ++i) {
    const float f = b[i] < -128.f ? -128.f : b[i] > 127.f ? 127.f : b[i];
    p[i] = int8_t(f);
    s += p[i];
  }
  return s;
#endif
}

}  // namespace nextn_cpu::simd
