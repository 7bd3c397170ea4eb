// int16 pair products over nextn's SIMD layer (simd.h): 16 output channels x 2 input channels of int8 weights,
// widened to int16, against a row's two int16 activations, summed exactly in int32 lanes (AVX512-VNNI `vpdpwssd`,
// AVX2's `vpmaddwd` + `vpaddd`, AVX-VNNI's 256-bit `vpdpwssd`, NEON's `smull` + `addp`, else scalar). What the int8 linear multiplies on CPUs
// without bf16 dot products (int8_linear_cpu.cpp): 16 multiply-adds a `vpmaddwd` against 8 an f32 FMA, and no
// widening to f32 per row.
#pragma once

#include "simd_int8.h"

namespace nextn_cpu::simd {

#if defined(NEXTN_AVX512)
struct W16 {  // 32 int16, element 2c + j: channel c, input channel k + j
  __m512i v;
};
#elif defined(NEXTN_AVX2)
struct W16 {
  __m256i v[2];
};
#elif defined(NEXTN_NEON)
struct W16 {  // channels 4i..4i+3: v[i]
  int16x8_t v[4];
};
#else
struct W16 {
  int16_t v[32];
};
#endif

// 32 int8 (byte 2c + j: channel c, input channel k + j, `pack_int8`'s layout) sign-extended to int16
inline W16 pairs16_int8(const int8_t* w) {
#if defined(NEXTN_AVX512)
  return {_mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)))};
#elif defined(NEXTN_AVX2)
  return {{_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))),
           _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 16)))}};
#elif defined(NEXTN_NEON)
  const int8x16_t a = vld1q_s8(w), b = vld1q_s8(w + 16);
  return {{vmovl_s8(vget_low_s8(a)), vmovl_high_s8(a), vmovl_s8(vget_low_s8(b)), vmovl_high_s8(b)}};
#else
  W16 r;
  for (int i = 0; i < 32; ++i) r.v[i] = w[i];
  return r;
#endif
}

// acc[c] + w[2c] * x[0] + w[2c + 1] * x[1]: |w| <= 128 and |x| <= 32767, so a pair is below 2^23 in magnitude and
// 256 pairs below 2^31: exact in int32 on every path (callers widen every 128 input channels)
inline I16 dot2(const I16& acc, const W16& w, const int16_t* x) {
  int32_t x2;
  std::memcpy(&x2, x, 4);
#if defined(NEXTN_AVX512)
  static_assert(__AVX512VNNI__, "the AVX-512 variants require VNNI (cpu_kernels.py)");
  return {_mm512_dpwssd_epi32(acc.v, w.v, _mm512_set1_epi32(x2))};
#elif defined(NEXTN_AVX2_VNNI)
  const __m256i xb = _mm256_set1_epi32(x2);
  return {{dpwssd256(acc.v[0], w.v[0], xb), dpwssd256(acc.v[1], w.v[1], xb)}};
#elif defined(NEXTN_AVX2)
  const __m256i xb = _mm256_set1_epi32(x2);
  return {{_mm256_add_epi32(acc.v[0], _mm256_madd_epi16(w.v[0], xb)),
           _mm256_add_epi32(acc.v[1], _mm256_madd_epi16(w.v[1], xb))}};
#elif defined(NEXTN_NEON)
  const int16x8_t xb = vreinterpretq_s16_s32(vdupq_n_s32(x2));
  I16 r;
  for (int i = 0; i < 4; ++i)
    r.v[i] = vaddq_s32(acc.v[i], vpaddq_s32(vmull_s16(vget_low_s16(w.v[i]), vget_low_s16(xb)),
                                            vmull_high_s16(w.v[i], xb)));
  return r;
#else
  I16 r;
  for (int c = 0; c < 16; ++c) r.v[c] = acc.v[c] + int32_t(w.v[2 * c]) * x[0] + int32_t(w.v[2 * c + 1]) * x[1];
  return r;
#endif
}

// 16 f32 -> int32 rounded to nearest even, clamped to [-32767, 32767], stored as int16 (NaN as 0: its group's scale
// is NaN too, so the output stays NaN, without an undefined float-to-int conversion)
inline void store_int16_rne(int16_t* p, const V16& v) {
  alignas(64) float b[16];
  store(b, round(v));
  for (int i = 0; i < 16; ++i)
    p[i] = int16_t(b[i] != b[i] ? 0.f : b[i] < -32767.f ? -32767.f : b[i] > 32767.f ? 32767.f : b[i]);
}

}  // namespace nextn_cpu::simd
