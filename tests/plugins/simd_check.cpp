// The SIMD layer (src/nextn/plugins/simd.h) against scalar references, as a program of its own: no torch library, only
// its headers (at::vec), so it runs where torch does not — the ARM64 variant under qemu-user
// (tests/plugins/test_simd_layer.py), and natively for each x86 variant the CPU runs, which shows that the checks
// agree with the variants the kernel tests cover. Prints "<checks> checks, <failures> failures"; exits 1 on any.
#include "simd_int8.h"

#include <cmath>
#include <cstdio>
#include <cstring>

using namespace nextn_cpu::simd;

static int checks = 0, failures = 0;

static void expect(bool ok, const char* what, int lane, double got, double want) {
  ++checks;
  if (!ok && failures++ < 20) std::printf("FAIL %s lane %d: got %.9g want %.9g\n", what, lane, got, want);
}

static void lanes(const V16& v, float* out) { store(out, v); }

static bool same(float a, float b) { return std::memcmp(&a, &b, 4) == 0; }

static uint32_t rng = 12345;
static float uniform(float lo, float hi) {  // xorshift: the same inputs on every machine
  rng ^= rng << 13, rng ^= rng >> 17, rng ^= rng << 5;
  return lo + (hi - lo) * float(rng & 0xFFFFFF) / float(0x1000000);
}

static float half_to_f32(uint16_t h) {  // IEEE binary16, normal and subnormal values
  const int e = (h >> 10) & 31, m = h & 1023;
  const float v = e == 0 ? std::ldexp(float(m), -24) : std::ldexp(float(1024 + m), e - 25);
  return (h & 0x8000) ? -v : v;
}

int main() {
  alignas(64) float a[16], b[16], c[16], r[16];
  for (int round_ = 0; round_ < 64; ++round_) {
    for (int i = 0; i < 16; ++i) a[i] = uniform(-8, 8), b[i] = uniform(-8, 8), c[i] = uniform(-8, 8);
    const V16 va = load(a), vb = load(b), vc = load(c);
    lanes(va + vb, r);
    for (int i = 0; i < 16; ++i) expect(same(r[i], a[i] + b[i]), "add", i, r[i], a[i] + b[i]);
    lanes(va - vb, r);
    for (int i = 0; i < 16; ++i) expect(same(r[i], a[i] - b[i]), "sub", i, r[i], a[i] - b[i]);
    lanes(va * vb, r);
    for (int i = 0; i < 16; ++i) expect(same(r[i], a[i] * b[i]), "mul", i, r[i], a[i] * b[i]);
    lanes(va / vb, r);
    for (int i = 0; i < 16; ++i) expect(same(r[i], a[i] / b[i]), "div", i, r[i], a[i] / b[i]);
    lanes(fmadd(va, vb, vc), r);  // fused where the ISA has it, else a product then a sum: either rounding
    for (int i = 0; i < 16; ++i)
      expect(same(r[i], std::fma(a[i], b[i], c[i])) || same(r[i], a[i] * b[i] + c[i]), "fmadd", i, r[i],
             std::fma(a[i], b[i], c[i]));
    lanes(max(va, vb), r);
    for (int i = 0; i < 16; ++i) expect(r[i] == std::fmax(a[i], b[i]), "max", i, r[i], std::fmax(a[i], b[i]));
    lanes(min(va, vb), r);
    for (int i = 0; i < 16; ++i) expect(r[i] == std::fmin(a[i], b[i]), "min", i, r[i], std::fmin(a[i], b[i]));
    lanes(abs(va), r);
    for (int i = 0; i < 16; ++i) expect(r[i] == std::fabs(a[i]), "abs", i, r[i], std::fabs(a[i]));
    // reduce_add: the fixed tree (lanes i + 8, then i + 4, i + 2, i + 1), bit for bit
    float t[16];
    std::memcpy(t, a, sizeof t);
    for (int w = 8; w >= 1; w /= 2)
      for (int i = 0; i < w; ++i) t[i] += t[i + w];
    expect(same(reduce_add(va), t[0]), "reduce_add", 0, reduce_add(va), t[0]);
    float m = a[0];
    for (int i = 1; i < 16; ++i) m = std::fmax(m, a[i]);
    expect(reduce_max(va) == m, "reduce_max", 0, reduce_max(va), m);
    // exp and tanh: |relative error| of exp within 4 ulp on [-80, 80], tanh within 4e-7 absolute
    for (int i = 0; i < 16; ++i) a[i] = uniform(-80, 80);
    lanes(exp(load(a)), r);
    for (int i = 0; i < 16; ++i) {
      const double want = std::exp(double(a[i]));
      expect(std::fabs(r[i] - want) <= 4 * 1.2e-7 * want, "exp", i, r[i], want);
    }
    for (int i = 0; i < 16; ++i) a[i] = uniform(-6, 6);
    lanes(tanh(load(a)), r);
    for (int i = 0; i < 16; ++i) expect(std::fabs(r[i] - std::tanh(double(a[i]))) <= 4e-7, "tanh", i, r[i], std::tanh(a[i]));
  }
  // round: to nearest, ties to even; store_int8_rne: the same, clamped, with the sum
  const float ties[16] = {0.5f, 1.5f, 2.5f, -0.5f, -1.5f, -2.5f, 2.4999f, -3.75f, 126.5f, 127.5f, -128.5f, 300.f,
                          -300.f, 0.f, 7.5f, 8.5f};
  lanes(round(load(ties)), r);
  for (int i = 0; i < 16; ++i) expect(r[i] == std::nearbyint(ties[i]), "round", i, r[i], std::nearbyint(ties[i]));
  int8_t q8[16];
  int32_t sum = store_int8_rne(q8, load(ties)), want_sum = 0;
  for (int i = 0; i < 16; ++i) {
    const int v = int(std::nearbyint(ties[i])), c = v < -128 ? -128 : v > 127 ? 127 : v;
    want_sum += c;
    expect(q8[i] == c, "store_int8_rne", i, q8[i], c);
  }
  expect(sum == want_sum, "store_int8_rne sum", 0, sum, want_sum);
  // partial loads and stores: the tail zero, nothing written past n
  for (int i = 0; i < 16; ++i) a[i] = float(i + 1), r[i] = -1.f;
  store(r, load(a, 5), 5);
  for (int i = 0; i < 16; ++i) expect(r[i] == (i < 5 ? float(i + 1) : -1.f), "partial load/store", i, r[i], i + 1);
  // widening loads: bf16, IEEE half, int8 / uint8 (whole and partial), exact
  uint16_t h[16], bf[16];
  int8_t s8[16];
  uint8_t u8[16];
  for (int i = 0; i < 16; ++i) {
    a[i] = uniform(-1000, 1000);
    bf[i] = f32_to_bf16(a[i]);
    h[i] = uint16_t(0x3C00 + 37 * i) ^ (i % 3 ? 0x8000 : 0) , s8[i] = int8_t(i * 17 - 128), u8[i] = uint8_t(i * 16 + 3);
  }
  h[15] = 0x0003;  // a subnormal half
  lanes(load_bf16(bf), r);
  for (int i = 0; i < 16; ++i) expect(same(r[i], bf16_to_f32(bf[i])), "load_bf16", i, r[i], bf16_to_f32(bf[i]));
  lanes(load_f16(h), r);
  for (int i = 0; i < 16; ++i) expect(r[i] == half_to_f32(h[i]), "load_f16", i, r[i], half_to_f32(h[i]));
  lanes(load_int8(s8), r);
  for (int i = 0; i < 16; ++i) expect(r[i] == float(s8[i]), "load_int8 s8", i, r[i], s8[i]);
  lanes(load_int8(u8, 7), r);
  for (int i = 0; i < 16; ++i) expect(r[i] == (i < 7 ? float(u8[i]) : 0.f), "load_int8 u8 partial", i, r[i], u8[i]);
  // bf16 rounding, ties to even: f32_to_bf16 per value, store_bf16 and round_bf16 per lane the same
  for (int i = 0; i < 16; ++i) {
    uint32_t u = 0x3F808000u + (uint32_t(i) << 16);  // exactly half way between two bf16 values
    if (i >= 8) u = 0x40490FDBu + uint32_t(i) * 0x1111u;
    std::memcpy(&a[i], &u, 4);
  }
  uint16_t out[16];
  store_bf16(out, load(a));
  lanes(round_bf16(load(a)), r);
  for (int i = 0; i < 16; ++i) {
    uint32_t u;
    std::memcpy(&u, &a[i], 4);
    const uint16_t want = uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
    expect(out[i] == want, "store_bf16", i, out[i], want);
    expect(same(r[i], bf16_to_f32(want)), "round_bf16", i, r[i], bf16_to_f32(want));
  }
  // reduce_add16: lane k the sum of vector k (on AVX2 its own fixed tree: within rounding there)
  V16 vs[16];
  float sums[16];
  for (int k = 0; k < 16; ++k) {
    double s = 0;
    for (int i = 0; i < 16; ++i) a[i] = uniform(-4, 4), s += a[i];
    vs[k] = load(a);
    sums[k] = float(s);
  }
  lanes(reduce_add16(vs), r);
  for (int k = 0; k < 16; ++k) expect(std::fabs(r[k] - sums[k]) <= 1e-5f, "reduce_add16", k, r[k], sums[k]);
  // pair products: bf16, int8 and int4 weights (16 channels x 2 inputs) times a row's (x_k, x_k+1)
  uint16_t wb[32], xb[2] = {f32_to_bf16(1.25f), f32_to_bf16(-0.375f)};
  int8_t wi[32];
  uint8_t w4[32];
  for (int j = 0; j < 32; ++j) wb[j] = f32_to_bf16(uniform(-2, 2)), wi[j] = int8_t(j * 7 - 100), w4[j] = uint8_t(j * 29 + 5);
  const XPair x = xpair(xb);
  const float x0 = bf16_to_f32(xb[0]), x1 = bf16_to_f32(xb[1]);
  for (int i = 0; i < 16; ++i) c[i] = uniform(-1, 1);
  lanes(dot(load(c), pairs_bf16(wb), x), r);
  for (int ch = 0; ch < 16; ++ch) {
    const double want = c[ch] + double(bf16_to_f32(wb[2 * ch])) * x0 + double(bf16_to_f32(wb[2 * ch + 1])) * x1;
    expect(std::fabs(r[ch] - want) <= 1e-6 * (1 + std::fabs(want)), "dot bf16", ch, r[ch], want);
  }
  lanes(dot(load(c), pairs_int8(wi), x), r);
  for (int ch = 0; ch < 16; ++ch) {
    const double want = c[ch] + double(wi[2 * ch]) * x0 + double(wi[2 * ch + 1]) * x1;
    expect(std::fabs(r[ch] - want) <= 1e-5 * (1 + std::fabs(want)), "dot int8", ch, r[ch], want);
  }
  Pairs lo, hi;
  pairs_int4(w4, lo, hi);
  float rl[16], rh[16];
  lanes(dot(zero(), lo, x), rl);
  lanes(dot(zero(), hi, x), rh);
  for (int ch = 0; ch < 16; ++ch) {
    const double wl = (128 + (w4[2 * ch] & 15)) * double(x0) + (128 + (w4[2 * ch + 1] & 15)) * double(x1);
    const double wh = (128 + (w4[2 * ch] >> 4)) * double(x0) + (128 + (w4[2 * ch + 1] >> 4)) * double(x1);
    expect(std::fabs(rl[ch] - wl) <= 1e-5 * std::fabs(wl), "dot int4 low nibbles", ch, rl[ch], wl);
    expect(std::fabs(rh[ch] - wh) <= 1e-5 * std::fabs(wh), "dot int4 high nibbles", ch, rh[ch], wh);
  }
  // int8 dot products: 64 int4 bytes (nibbles) x 4 signed activation bytes, exact in int32
  uint8_t w64[64];
  int8_t xa[4] = {127, -128 + 1, 55, -3};
  for (int j = 0; j < 64; ++j) w64[j] = uint8_t(j * 37 + 11);
  U8x64 nlo, nhi;
  nibbles(w64, nlo, nhi);
  P16 p = pzero();
  for (int rep = 0; rep < 3; ++rep) p = pdot4(p, nlo, xa);
  I16 acc = widen(izero(), p);
  acc = iadd(acc, dot4(izero(), nhi, xa));
  lanes(to_float(acc), r);
  for (int ch = 0; ch < 16; ++ch) {
    int32_t want = 0;
    for (int j = 0; j < 4; ++j) want += 3 * (w64[4 * ch + j] & 15) * xa[j] + (w64[4 * ch + j] >> 4) * xa[j];
    expect(r[ch] == float(want), "int8 dot4", ch, r[ch], want);
  }
  // a run of products scaled by 16 channels' 8-bit group scales as it is widened (W4A8 with two-level scales), on top
  // of an accumulator: exact in int32, the largest scale included
  uint8_t sc8[16];
  for (int ch = 0; ch < 16; ++ch) sc8[ch] = uint8_t(ch == 5 ? 255 : ch * 13 + 1);
  P16 ps = pzero();
  for (int rep = 0; rep < 8; ++rep) ps = pdot4(ps, rep % 2 ? nhi : nlo, xa);  // kDotsPerWiden's worth, |sum| < 2^15
  I16 sacc = scale_widen(widen(izero(), p), ps, group_scales16(sc8));
  lanes(to_float(sacc), r);
  for (int ch = 0; ch < 16; ++ch) {
    int32_t lo = 0, hi = 0;
    for (int j = 0; j < 4; ++j) lo += (w64[4 * ch + j] & 15) * xa[j], hi += (w64[4 * ch + j] >> 4) * xa[j];
    const int32_t want = 3 * lo + sc8[ch] * 4 * (lo + hi);
    expect(r[ch] == float(want), "scale_widen", ch, r[ch], want);
  }
  std::printf("%s: %d checks, %d failures\n", kVariant, checks, failures);
  return failures ? 1 : 0;
}
