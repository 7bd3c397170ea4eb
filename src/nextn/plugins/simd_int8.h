// int8 dot products over nextn's SIMD layer (simd.h): 16 output channels x 4 input channels of unsigned 4-bit
// weights against a row's 4 signed int8 activations, summed exactly in int32 lanes (AVX512-VNNI `vpdpbusd`, AVX2's
// `vpmaddubsw` + `vpmaddwd`, else scalar), and the int8 rounding of activations. What W4A8 multiplies
// (woq_linear_cpu.cpp, moe_cpu.cpp) and the int8 linear widens (int8_linear_cpu.cpp).
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
#else
  return {};
#endif
}

inline I16 iadd(const I16& a, const I16& b) {
#if defined(NEXTN_AVX512)
  return {_mm512_add_epi32(a.v, b.v)};
#elif defined(NEXTN_AVX2)
  return {{_mm256_add_epi32(a.v[0], b.v[0]), _mm256_add_epi32(a.v[1], b.v[1])}};
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
#else
  for (int i = 0; i < 64; ++i) lo.v[i] = w[i] & 15, hi.v[i] = w[i] >> 4;
#endif
}

// acc[c] + sum_j w[4c + j] * x[j]: w unsigned (< 16), x 4 signed bytes (|x| <= 127): exact in int32 on every path
// (`vpdpbusd`; `vpmaddubsw` pairs stay below 2 * 15 * 127, far from int16 saturation)
inline I16 dot4(const I16& acc, const U8x64& w, const int8_t* x) {
  int32_t x4;
  std::memcpy(&x4, x, 4);
#if defined(NEXTN_AVX512)
  static_assert(__AVX512VNNI__, "the AVX-512 variants require VNNI (cpu_kernels.py)");
  return {_mm512_dpbusd_epi32(acc.v, w.v, _mm512_set1_epi32(x4))};
#elif defined(NEXTN_AVX2)
  const __m256i xb = _mm256_set1_epi32(x4), ones = _mm256_set1_epi16(1);
  return {{_mm256_add_epi32(acc.v[0], _mm256_madd_epi16(_mm256_maddubs_epi16(w.v[0], xb), ones)),
           _mm256_add_epi32(acc.v[1], _mm256_madd_epi16(_mm256_maddubs_epi16(w.v[1], xb), ones))}};
#else
  I16 r;
  for (int c = 0; c < 16; ++c)
    r.v[c] = acc.v[c] + int32_t(w.v[4 * c]) * x[0] + int32_t(w.v[4 * c + 1]) * x[1] + int32_t(w.v[4 * c + 2]) * x[2] +
             int32_t(w.v[4 * c + 3]) * x[3];
  return r;
#endif
}

// A run of int8 dot products before they are widened to int32: AVX2 keeps `vpmaddubsw`'s int16 pair sums (each at
// most 2 * 15 * 127 in magnitude, so kDotsPerWiden = 8 of them stay below 2^15) and widens them with one `vpmaddwd`
// per run instead of one per product; elsewhere it is an I16 (`vpdpbusd` widens as it goes). Exact either way.
#if defined(NEXTN_AVX2)
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
#else
using P16 = I16;
constexpr int kDotsPerWiden = 1 << 30;
inline P16 pzero() { return izero(); }
inline P16 pdot4(const P16& acc, const U8x64& w, const int8_t* x) { return dot4(acc, w, x); }
inline I16 widen(const I16& acc, const P16& p) { return iadd(acc, p); }
#endif

// 16 f32 -> int32 rounded to nearest even, stored as int8 (|v| <= 127 here); returns their int32 sum added to `sum`
inline int32_t store_int8_rne(int8_t* p, const V16& v) {
  alignas(64) float b[16];
  store(b, round(v));
  int32_t s = 0;
  for (int i = 0; i < 16; ++i) {
    const int32_t q = int32_t(b[i]);
    p[i] = int8_t(q < -128 ? -128 : q > 127 ? 127 : q);
    s += q;
  }
  return s;
}

}  // namespace nextn_cpu::simd
