// nextn's portable SIMD layer: what the CPU kernels compute with, one source for every ISA variant
// (cpu_kernels.py compiles each kernel once per variant with that variant's flags and CPU_CAPABILITY macros).
//
// Float arithmetic is ATen's `at::vec::Vectorized<float>` (it ships with torch's headers: AVX-512, AVX2, ARM NEON and a
// portable DEFAULT); a `V16` is 16 f32 lanes, one, two or four of its vectors, because the kernels' weight layouts put
// 16 output channels in a vector's lanes. What at::vec does not offer is here, written once per ISA and nowhere else:
// widening bf16 / fp16 / int8 loads, bf16 rounding (to nearest even, as PyTorch's), partial loads, int8 dot products
// (AVX512-VNNI / AVX-VNNI `vpdpbusd`, AVX2's `vpmaddubsw` + `vpmaddwd`, NEON's `sdot` or `smull` + pairwise adds,
// else scalar: simd_int8.h), bf16 pair products
// (AVX512-BF16 `vdpbf16ps`, else two f32 FMAs of the widened values), fixed-order lane reductions, prefetches.
//
// Batch invariance: every operation here acts on each lane alone, or reduces lanes in a fixed order of the variant;
// none depends on a row count or a thread. Two variants may round differently in the last bits (an FMA against a
// `vdpbf16ps`, a reduction tree of 16 lanes against 8 + 8).

#pragma once

#include <ATen/cpu/vec/vec.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(CPU_CAPABILITY_AVX512)
#define NEXTN_AVX512 1
#elif defined(CPU_CAPABILITY_AVX2)
#define NEXTN_AVX2 1
#endif
#if defined(NEXTN_AVX512) && defined(__AVX512BF16__)
#define NEXTN_BF16_DOT 1
#endif
// AVX2 with 256-bit int8 / int16 dot products (`vpdpbusd`, `vpdpwssd`): AVX-VNNI (Intel Alder Lake and later, Xeon 6
// E-cores) or, built with NEXTN_VNNI_EVEX (cpu_kernels.py's stand-in where a CPU has AVX512-VNNI/VL but not AVX-VNNI,
// how the variant is tested there), the same instructions in their EVEX encoding as inline assembly, so that all else
// compiles as for AVX-VNNI
#if defined(NEXTN_AVX2) && (defined(__AVXVNNI__) || defined(NEXTN_VNNI_EVEX))
#define NEXTN_AVX2_VNNI 1
#endif
// ARM64: NEON is part of ARMv8-A (at::vec's vectors there); `sdot` (ARMv8.2's dot product extension, FEAT_DotProd:
// Graviton 2 and later, Apple M1 and later, Ampere Altra) where the variant is compiled with +dotprod
#if defined(__aarch64__)
#include <arm_neon.h>
#define NEXTN_NEON 1
#if defined(__ARM_FEATURE_DOTPROD)
#define NEXTN_NEON_DOT 1
#endif
#endif

namespace nextn_cpu::simd {

using Vec = at::vec::Vectorized<float>;
constexpr int kParts = 16 / Vec::size();
static_assert(16 % Vec::size() == 0, "a V16 is a whole number of at::vec vectors");

// 16 f32 lanes
struct V16 {
  Vec p[kParts];
};

// (unrolled: a V16 of several vectors then lives in registers, not on the stack)
#define NEXTN_V16_MAP(expr)                       \
  V16 r;                                          \
  _Pragma("GCC unroll 4")                         \
  for (int i = 0; i < kParts; ++i) r.p[i] = expr; \
  return r

inline V16 zero() { NEXTN_V16_MAP(Vec(0.f)); }
inline V16 set1(float v) { NEXTN_V16_MAP(Vec(v)); }
inline V16 load(const float* p) { NEXTN_V16_MAP(Vec::loadu(p + i * Vec::size())); }
inline void store(float* p, const V16& v) {
  for (int i = 0; i < kParts; ++i) v.p[i].store(p + i * Vec::size());
}
inline V16 operator+(const V16& a, const V16& b) { NEXTN_V16_MAP(a.p[i] + b.p[i]); }
inline V16 operator-(const V16& a, const V16& b) { NEXTN_V16_MAP(a.p[i] - b.p[i]); }
inline V16 operator*(const V16& a, const V16& b) { NEXTN_V16_MAP(a.p[i] * b.p[i]); }
inline V16 operator/(const V16& a, const V16& b) { NEXTN_V16_MAP(a.p[i] / b.p[i]); }
// a * b + c and c - a * b (fused where the ISA has FMA)
inline V16 fmadd(const V16& a, const V16& b, const V16& c) { NEXTN_V16_MAP(at::vec::fmadd(a.p[i], b.p[i], c.p[i])); }
inline V16 fnmadd(const V16& a, const V16& b, const V16& c) {
  NEXTN_V16_MAP(at::vec::fmsub(a.p[i], b.p[i], c.p[i]).neg());
}
inline V16 max(const V16& a, const V16& b) { NEXTN_V16_MAP(at::vec::maximum(a.p[i], b.p[i])); }
inline V16 min(const V16& a, const V16& b) { NEXTN_V16_MAP(at::vec::minimum(a.p[i], b.p[i])); }
inline V16 abs(const V16& a) { NEXTN_V16_MAP(a.p[i].abs()); }
inline V16 round(const V16& a) { NEXTN_V16_MAP(a.p[i].round()); }  // to nearest, ties to even

// The first n (< 16) values of p, the rest 0; nothing past p + n is read
inline V16 load(const float* p, int64_t n) {
  if (n >= 16) return load(p);
  alignas(64) float b[16] = {};
  std::memcpy(b, p, sizeof(float) * n);
  return load(b);
}
// The first n lanes of v to p; nothing past p + n is written
inline void store(float* p, const V16& v, int64_t n) {
  if (n >= 16) return store(p, v);
  alignas(64) float b[16];
  store(b, v);
  std::memcpy(p, b, sizeof(float) * n);
}

// --- widening loads: 16 values -> 16 f32 lanes, exact

inline float bf16_to_f32(uint16_t b) {
  const uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline V16 load_bf16(const uint16_t* p) {
#if defined(NEXTN_AVX512)
  return {Vec(_mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16)))};
#elif defined(NEXTN_AVX2)
  V16 r;
  for (int i = 0; i < 2; ++i)
    r.p[i] = Vec(_mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8 * i))), 16)));
  return r;
#else
  alignas(64) float b[16];
  for (int i = 0; i < 16; ++i) b[i] = bf16_to_f32(p[i]);
  return load(b);
#endif
}
inline V16 load_bf16(const uint16_t* p, int64_t n) {
  if (n >= 16) return load_bf16(p);
  alignas(64) uint16_t b[16] = {};
  std::memcpy(b, p, sizeof(uint16_t) * n);
  return load_bf16(b);
}

inline V16 load_f16(const uint16_t* p) {  // IEEE half bits
#if defined(NEXTN_AVX512)
  return {Vec(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))))};
#elif defined(NEXTN_AVX2)
  return {Vec(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))),
          Vec(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8))))};
#else
  alignas(64) float b[16];
  for (int i = 0; i < 16; ++i) b[i] = c10::detail::fp16_ieee_to_fp32_value(p[i]);
  return load(b);
#endif
}

template <typename T>  // uint8_t or int8_t
inline V16 load_int8(const T* p) {
#if defined(NEXTN_AVX512)
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if constexpr (std::is_signed_v<T>) return {Vec(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)))};
  else return {Vec(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b)))};
#elif defined(NEXTN_AVX2)
  V16 r;
  for (int i = 0; i < 2; ++i) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * i));
    if constexpr (std::is_signed_v<T>) r.p[i] = Vec(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)));
    else r.p[i] = Vec(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)));
  }
  return r;
#else
  alignas(64) float b[16];
  for (int i = 0; i < 16; ++i) b[i] = float(p[i]);
  return load(b);
#endif
}
template <typename T>
inline V16 load_int8(const T* p, int64_t n) {
  if (n >= 16) return load_int8(p);
  alignas(16) T b[16] = {};
  std::memcpy(b, p, sizeof(T) * n);
  return load_int8(b);
}

// --- bf16 rounding: f32 -> the nearest bf16, ties to even (PyTorch's `round_to_nearest_even`; NaN stays NaN)

inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if (std::isnan(f)) return 0x7FC0;
  return uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

inline void store_bf16(uint16_t* p, const V16& v) {
#if defined(NEXTN_AVX512)
  const __m512i u = _mm512_castps_si512(__m512(v.p[0]));
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), odd), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(__m512(v.p[0]), __m512(v.p[0]), _CMP_UNORD_Q);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
#elif defined(NEXTN_AVX2)
  for (int i = 0; i < 2; ++i) {
    const __m256 f = __m256(v.p[i]);
    const __m256i u = _mm256_castps_si256(f);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), odd), 16);
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q)));
    // 8 int32 (each < 2^16) -> 8 uint16
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p + 8 * i), packed);
  }
#else
  alignas(64) float b[16];
  store(b, v);
  for (int i = 0; i < 16; ++i) p[i] = f32_to_bf16(b[i]);
#endif
}
// v rounded to bf16 and widened back
inline V16 round_bf16(const V16& v) {
  alignas(64) uint16_t b[16];
  store_bf16(b, v);
  return load_bf16(b);
}

// --- reductions, each in a fixed order of the variant

inline float reduce_add(const V16& v) {
#if defined(NEXTN_AVX512)
  return _mm512_reduce_add_ps(__m512(v.p[0]));
#else
  alignas(64) float b[16];
  store(b, v);
  for (int w = 8; w >= 1; w /= 2)  // lanes i + 8, then i + 4, i + 2, i + 1 (the AVX-512 tree)
    for (int i = 0; i < w; ++i) b[i] += b[i + w];
  return b[0];
#endif
}

inline float reduce_max(const V16& v) {
#if defined(NEXTN_AVX512)
  return _mm512_reduce_max_ps(__m512(v.p[0]));
#else
  alignas(64) float b[16];
  store(b, v);
  float m = b[0];
  for (int i = 1; i < 16; ++i) m = b[i] > m ? b[i] : m;
  return m;
#endif
}

// The lane sums of 16 vectors, in order, each in a fixed tree of the variant (AVX-512 and the portable path:
// reduce_add(a[k]) bit for bit)
inline V16 reduce_add16(const V16 (&a)[16]) {
#if defined(NEXTN_AVX512)
  // 4 levels of in-register shuffles and an add per pair of vectors, each lane summed in reduce_add's tree
  __m512 y[8], z[4], w[2];
  for (int p = 0; p < 8; ++p) {  // y[p]: lanes 0-7 key 2p's a[i] + a[i + 8], lanes 8-15 key 2p + 1's
    const __m512 a0 = __m512(a[2 * p].p[0]), a1 = __m512(a[2 * p + 1].p[0]);
    y[p] = _mm512_add_ps(_mm512_shuffle_f32x4(a0, a1, 0x44), _mm512_shuffle_f32x4(a0, a1, 0xEE));
  }
  for (int p = 0; p < 4; ++p)  // z[p]: 128-bit block b = key 4p + b's (i, i + 4) sums
    z[p] = _mm512_add_ps(_mm512_shuffle_f32x4(y[2 * p], y[2 * p + 1], 0x88),
                         _mm512_shuffle_f32x4(y[2 * p], y[2 * p + 1], 0xDD));
  for (int p = 0; p < 2; ++p)  // w[p], block b: keys 8p + b and 8p + 4 + b, their (i, i + 2) sums, two lanes each
    w[p] = _mm512_add_ps(_mm512_shuffle_ps(z[2 * p], z[2 * p + 1], 0x44),
                         _mm512_shuffle_ps(z[2 * p], z[2 * p + 1], 0xEE));
  const __m512 f = _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], 0x88), _mm512_shuffle_ps(w[0], w[1], 0xDD));
  const __m512i key_order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return {Vec(_mm512_permutexvar_ps(key_order, f))};
#elif defined(NEXTN_AVX2)
  // 8 keys at a time: each key's two halves added, then horizontal adds across keys (lane sums (0 + 1) + (2 + 3)
  // and the same of 4..7, then the two added): a fixed tree per key, not reduce_add's, 3x fewer instructions
  __m256 h[2];
  for (int half = 0; half < 2; ++half) {
    __m256 t[8];
    for (int k = 0; k < 8; ++k) t[k] = _mm256_add_ps(__m256(a[8 * half + k].p[0]), __m256(a[8 * half + k].p[1]));
    const __m256 u0 = _mm256_hadd_ps(t[0], t[1]), u1 = _mm256_hadd_ps(t[2], t[3]);
    const __m256 u2 = _mm256_hadd_ps(t[4], t[5]), u3 = _mm256_hadd_ps(t[6], t[7]);
    const __m256 v0 = _mm256_hadd_ps(u0, u1), v1 = _mm256_hadd_ps(u2, u3);  // 128-bit halves: keys' lanes 0-3, 4-7
    h[half] = _mm256_add_ps(_mm256_permute2f128_ps(v0, v1, 0x20), _mm256_permute2f128_ps(v0, v1, 0x31));
  }
  return {{Vec(h[0]), Vec(h[1])}};
#else
  alignas(64) float s[16];
  for (int k = 0; k < 16; ++k) s[k] = reduce_add(a[k]);
  return load(s);
#endif
}

// exp(v), 16 lanes (|error| ~1 ulp): 2^n * p(r), r = v - n ln 2 in two parts (Cody and Waite), p a degree-6
// polynomial (Cephes' expf coefficients); v clamped to [-104, 88] (below -87.3 the result is 2^-126 p(r) or less on
// variants without AVX-512's scalef: 1 + exp(v) is 1 for SiLU long before, and a softmax weight that small counts
// for nothing). The same for every lane whatever the batch.
inline V16 exp(V16 v) {
  v = max(min(v, set1(88.f)), set1(-104.f));
  const V16 n = round(v * set1(1.44269504088896341f));
  V16 r = fnmadd(n, set1(0.693359375f), v);
  r = fnmadd(n, set1(-2.12194440e-4f), r);
  V16 p = set1(1.3981999507e-3f);
  p = fmadd(p, r, set1(8.3334519073e-3f));
  p = fmadd(p, r, set1(4.1665795894e-2f));
  p = fmadd(p, r, set1(1.6666665459e-1f));
  p = fmadd(p, r, set1(5.0000001201e-1f));
  p = fmadd(p, r * r, r + set1(1.f));
#if defined(NEXTN_AVX512)
  return {Vec(_mm512_scalef_ps(__m512(p.p[0]), __m512(n.p[0])))};
#else
  alignas(64) float pb[16], nb[16];
  store(pb, p);
  store(nb, n);
  for (int i = 0; i < 16; ++i) {
    const int e = int(nb[i]) < -126 ? -126 : int(nb[i]);
    const uint32_t bits = uint32_t(e + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, 4);
    pb[i] *= scale;
  }
  return load(pb);
#endif
}

// tanh(v), 16 lanes: (1 - e) / (1 + e) with e = exp(-2v) (`exp` clamps its argument, so a large negative v gives
// e ~ 1.6e38 and -1, not NaN; |error| ~1e-7 absolute: Gemma 2's soft-capping multiplies it by its cap, 50 for
// attention logits). The same for every lane whatever the batch.
inline V16 tanh(const V16& v) {
  const V16 e = exp(v * set1(-2.f));
  return (set1(1.f) - e) / (set1(1.f) + e);
}

// --- bf16 pair products: 16 output channels x 2 input channels (k, k + 1), multiplied by a row's (x_k, x_k+1)

#if defined(NEXTN_BF16_DOT)
struct Pairs {  // 32 bf16, element 2c + j the channel c's value at k + j
  __m512bh v;
};
#else
struct Pairs {  // the same values widened: even[c] = channel c's value at k, odd[c] at k + 1
  V16 even, odd;
};
#endif

// 32 bf16 (element 2c + j: channel c, input channel k + j)
inline Pairs pairs_bf16(const uint16_t* w) {
#if defined(NEXTN_BF16_DOT)
  return {(__m512bh)_mm512_loadu_si512(w)};
#elif defined(NEXTN_AVX512)
  const __m512i u = _mm512_loadu_si512(w);
  return {{Vec(_mm512_castsi512_ps(_mm512_slli_epi32(u, 16)))},
          {Vec(_mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32(int(0xFFFF0000u)))))}};
#elif defined(NEXTN_AVX2)
  Pairs r;
  for (int i = 0; i < 2; ++i) {
    const __m256i u = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 16 * i));
    r.even.p[i] = Vec(_mm256_castsi256_ps(_mm256_slli_epi32(u, 16)));
    r.odd.p[i] = Vec(_mm256_castsi256_ps(_mm256_and_si256(u, _mm256_set1_epi32(int(0xFFFF0000u)))));
  }
  return r;
#else
  alignas(64) float e[16], o[16];
  for (int c = 0; c < 16; ++c) e[c] = bf16_to_f32(w[2 * c]), o[c] = bf16_to_f32(w[2 * c + 1]);
  return {load(e), load(o)};
#endif
}

// 32 int8 (byte 2c + j: channel c, input channel k + j), exact in bf16 (|q| <= 128)
inline Pairs pairs_int8(const int8_t* w) {
#if defined(NEXTN_BF16_DOT)
  const __m512 c0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))));
  const __m512 c8 =
      _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 16))));
  return {_mm512_cvtne2ps_pbh(c8, c0)};  // bf16 lanes 0-15 from c0 (channels 0-7), 16-31 from c8
#elif defined(NEXTN_AVX512)
  const __m512i u = _mm512_cvtepi16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)));  // lane c: 2 bytes
  return {{Vec(_mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(u, 24), 24)))},
          {Vec(_mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(u, 16), 24)))}};
#elif defined(NEXTN_AVX2)
  Pairs r;
  for (int i = 0; i < 2; ++i) {
    const __m256i u = _mm256_cvtepi16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 16 * i)));
    r.even.p[i] = Vec(_mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(u, 24), 24)));
    r.odd.p[i] = Vec(_mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(u, 16), 24)));
  }
  return r;
#else
  alignas(64) float e[16], o[16];
  for (int c = 0; c < 16; ++c) e[c] = float(w[2 * c]), o[c] = float(w[2 * c + 1]);
  return {load(e), load(o)};
#endif
}

// 32 bytes of int4 pairs (byte 2c + j: channel c; its low nibble q[c][k + j], its high nibble q[c][k + 2 + j]) ->
// (lo, hi): the values 128 + q (exact in bf16), lo for inputs k, k + 1, hi for k + 2, k + 3. The 128 comes back out
// through the group sum of x (woq_linear_cpu.cpp).
inline void pairs_int4(const uint8_t* w, Pairs& lo, Pairs& hi) {
#if defined(NEXTN_BF16_DOT)
  const __m512i q = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)));
  const __m512i low4 = _mm512_set1_epi16(0x0F), b128 = _mm512_set1_epi16(0x4300);  // bf16 128.0: 0x4300 | q = 128 + q
  lo.v = (__m512bh)_mm512_ternarylogic_epi32(q, low4, b128, 0xEA);  // (q & 0x0F) | 0x4300
  hi.v = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(q, 4), b128);
#elif defined(NEXTN_AVX512)
  // lane c: the 16 bits (byte 2c + 1) << 8 | byte 2c; f32 128 + q is 0x43000000 | q << 16
  const __m512i u = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)));
  const __m512i f128 = _mm512_set1_epi32(0x43000000), nib = _mm512_set1_epi32(0x000F0000);
  auto at = [&](int shift) {  // 128 + the nibble at bit `shift` of the lane, as f32
    const __m512i s = shift <= 16 ? _mm512_slli_epi32(u, 16 - shift) : _mm512_srli_epi32(u, shift - 16);
    return V16{{Vec(_mm512_castsi512_ps(_mm512_ternarylogic_epi32(s, nib, f128, 0xEA)))}};
  };
  lo.even = at(0), lo.odd = at(8), hi.even = at(4), hi.odd = at(12);
#elif defined(NEXTN_AVX2)
  const __m256i f128 = _mm256_set1_epi32(0x43000000), nib = _mm256_set1_epi32(0x000F0000);
  for (int i = 0; i < 2; ++i) {
    const __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 16 * i)));
    auto at = [&](int shift) {
      const __m256i s = shift <= 16 ? _mm256_slli_epi32(u, 16 - shift) : _mm256_srli_epi32(u, shift - 16);
      return Vec(_mm256_castsi256_ps(_mm256_or_si256(_mm256_and_si256(s, nib), f128)));
    };
    lo.even.p[i] = at(0), lo.odd.p[i] = at(8), hi.even.p[i] = at(4), hi.odd.p[i] = at(12);
  }
#else
  alignas(64) float le[16], lo_[16], he[16], ho[16];
  for (int c = 0; c < 16; ++c) {
    const uint8_t b0 = w[2 * c], b1 = w[2 * c + 1];
    le[c] = 128.f + float(b0 & 15), lo_[c] = 128.f + float(b1 & 15);
    he[c] = 128.f + float(b0 >> 4), ho[c] = 128.f + float(b1 >> 4);
  }
  lo = {load(le), load(lo_)};
  hi = {load(he), load(ho)};
#endif
}

// A row's two inputs (x_k, x_k+1), bf16 bits, broadcast for `dot`
#if defined(NEXTN_BF16_DOT)
struct XPair {
  __m512bh v;
};
inline XPair xpair(const uint16_t* x) {
  uint32_t u;
  std::memcpy(&u, x, 4);
  return {(__m512bh)_mm512_set1_epi32(int(u))};
}
// acc + w(k) x_k + w(k + 1) x_k+1 per channel (exact products, f32 sums: `vdpbf16ps`)
inline V16 dot(const V16& acc, const Pairs& w, const XPair& x) {
  return {Vec(_mm512_dpbf16_ps(__m512(acc.p[0]), w.v, x.v))};
}
#else
struct XPair {
  V16 x0, x1;
};
inline XPair xpair(const uint16_t* x) { return {set1(bf16_to_f32(x[0])), set1(bf16_to_f32(x[1]))}; }
// acc + w(k) x_k + w(k + 1) x_k+1 per channel (exact products, two f32 FMAs)
inline V16 dot(const V16& acc, const Pairs& w, const XPair& x) {
  return fmadd(w.odd, x.x1, fmadd(w.even, x.x0, acc));
}
#endif

// acc + a(2i) b(2i) + a(2i+1) b(2i+1) in lane i: two vectors of 32 bf16 multiplied element by element and summed in
// pairs (exact products, f32 sums: `vdpbf16ps`; elsewhere two FMAs of the widened values). kPairDot: whether the CPU
// does it in one instruction (where it does not, a kernel that reuses a widened operand is cheaper)
#if defined(NEXTN_BF16_DOT)
constexpr bool kPairDot = true;
inline V16 dot(const V16& acc, const Pairs& a, const Pairs& b) {
  return {Vec(_mm512_dpbf16_ps(__m512(acc.p[0]), a.v, b.v))};
}
#else
constexpr bool kPairDot = false;
inline V16 dot(const V16& acc, const Pairs& a, const Pairs& b) {
  return fmadd(a.odd, b.odd, fmadd(a.even, b.even, acc));
}
#endif

// How many rows of a linear's row chunk the kernels keep in registers: AVX-512's 32 vector registers hold a V16
// each; AVX2's 16 hold one V16 per two, NEON's 32 one per four
constexpr int kRegisterShare = kParts;

// --- memory hints

inline void prefetch_l2(const void* p) {
#if defined(__x86_64__) || defined(_M_X64)
  _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T1);
#else
  __builtin_prefetch(p, 0, 2);
#endif
}

// The variant this translation unit was compiled for (its name in cpu_kernels.py)
#if defined(NEXTN_BF16_DOT)
constexpr const char* kVariant = "avx512_bf16";
#elif defined(NEXTN_AVX512)
constexpr const char* kVariant = "avx512";
#elif defined(NEXTN_AVX2_VNNI)
constexpr const char* kVariant = "avx2_vnni";
#elif defined(NEXTN_AVX2)
constexpr const char* kVariant = "avx2";
#elif defined(NEXTN_NEON_DOT)
constexpr const char* kVariant = "neon_dotprod";
#elif defined(NEXTN_NEON)
constexpr const char* kVariant = "neon";
#else
constexpr const char* kVariant = "generic";
#endif

}  // namespace nextn_cpu::simd
