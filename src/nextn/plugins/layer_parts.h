// The parts of a fused decoder layer that its ops share (decoder_layer_cpu.cpp: Llama's layer; deltanet_layer_cpu.cpp:
// Gated DeltaNet's): RMSNorm rows, bf16 rounding, the residual add, the int4 linears' operands, row loops.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>

#include "cpu_kernels.h"

namespace nextn_cpu::layer {

namespace simd = nextn_cpu::simd;
using simd::V16;
using simd::load_bf16;
using simd::round_bf16;
using simd::store_bf16;
using nextn_cpu::rms_norm;

// out = bf16(x * rsqrt(mean(x^2) + eps) * s), s f32 (Gemma's RMSNorm: s = 1 + w computed in f32), x bf16 or f32
template <typename Load>
inline void rms_norm_f32w(Load&& load, const float* s, int64_t n, float eps, uint16_t* out) {
  V16 ss = simd::zero();
  for (int64_t i = 0; i < n; i += 16) {
    const V16 v = load(i);
    ss = simd::fmadd(v, v, ss);
  }
  const V16 inv = simd::set1(1.f / std::sqrt(simd::reduce_add(ss) / float(n) + eps));
  for (int64_t i = 0; i < n; i += 16) store_bf16(out + i, (load(i) * inv) * simd::load(s + i));
}

// A norm's weights: bf16 (Llama: w * bf16(x_hat)) or f32 (Gemma: bf16(x_hat * s)); one row of n (n % 16 == 0) from
// bf16 or f32 values (already bf16-rounded) to bf16
struct Norm {
  const void* w = nullptr;
  bool f32 = false;
  void apply(const uint16_t* x, int64_t n, float eps, uint16_t* out) const {
    if (f32) return nextn_cpu::rms_norm_scaled(x, static_cast<const float*>(w), n, eps, out);
    rms_norm(x, static_cast<const uint16_t*>(w), n, eps, out);
  }
  void apply(const float* x, int64_t n, float eps, uint16_t* out) const {
    const float* s = static_cast<const float*>(w);
    if (f32) return rms_norm_f32w([&](int64_t i) { return simd::load(x + i); }, s, n, eps, out);
    V16 ss = simd::zero();
    for (int64_t i = 0; i < n; i += 16) ss = simd::fmadd(simd::load(x + i), simd::load(x + i), ss);
    const V16 inv = simd::set1(1.f / std::sqrt(simd::reduce_add(ss) / float(n) + eps));
    const uint16_t* wb = static_cast<const uint16_t*>(w);
    for (int64_t i = 0; i < n; i += 16) store_bf16(out + i, load_bf16(wb + i) * round_bf16(simd::load(x + i) * inv));
  }
};

// x[i] = bf16(x[i]) in place, n % 16 == 0
inline void round_row(float* x, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) simd::store(x + i, round_bf16(simd::load(x + i)));
}

// out[i] = bf16(a[i] + bf16(b[i])): a residual add (a bf16, b the f32 matmul output); with a residual multiplier
// r != 1 (Granite) bf16(a[i] + bf16(bf16(b[i]) * r)), as the modules' bf16 `x + branch * r`
inline void residual_add(const uint16_t* a, const float* b, int64_t n, uint16_t* out, float r) {
  if (r == 1.f) {
    for (int64_t i = 0; i < n; i += 16) store_bf16(out + i, load_bf16(a + i) + round_bf16(simd::load(b + i)));
    return;
  }
  const V16 rv = simd::set1(r);
  for (int64_t i = 0; i < n; i += 16)
    store_bf16(out + i, load_bf16(a + i) + round_bf16(round_bf16(simd::load(b + i)) * rv));
}

// One int4 linear's tensors: [w, scale, zero] (one- or two-level scales: cpu_kernels.h) and an optional f32 bias
struct Int4 {
  const uint8_t* w;
  nextn_cpu::Int4Scales scales;
  const float* bias = nullptr;
  int64_t N, K;
};

// One linear's tensors checked for K input and N output channels (`op`, `name`: for the errors)
inline Int4 int4_weights(const at::TensorList& t, int64_t K, int64_t N, int64_t group_size, bool int8_activations,
                         const char* name, const char* op = "llama_decoder_layer") {
  TORCH_CHECK(t.size() == 3 || t.size() == 4, op, ": ", name, " must be [w, scale, zero] or [w, scale, zero, bias]");
  TORCH_CHECK(t[0].scalar_type() == at::kByte && t[0].is_contiguous() && t[0].dim() == 2 && t[0].size(0) == N &&
                  t[0].size(1) * 2 == K,
              op, ": ", name, ".w must be a contiguous [", N, ", ", K / 2, "] uint8 tensor");
  Int4 r{t[0].data_ptr<uint8_t>(), nextn_cpu::int4_scales(t[1], t[2], N, K / group_size, op),
         nullptr, N, K};
  r.scales.int8_activations = int8_activations;
  if (t.size() == 4) {
    TORCH_CHECK(t[3].scalar_type() == at::kFloat && t[3].is_contiguous() && t[3].numel() == N,
                op, ": ", name, ".bias must be a contiguous float32 [", N, "]");
    r.bias = t[3].data_ptr<float>();
  }
  return r;
}

inline void matmul(const Int4& l, const uint16_t* x, int64_t M, int64_t group_size, float* out) {
  nextn_cpu::int4_linear(x, M, l.K, l.w, l.N, l.scales, group_size, l.bias, out);
}

inline const uint16_t* bf16_ptr(const at::Tensor& t) {
  return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>());
}

// f(m) for each of M rows, split across threads
template <typename F>
void for_rows(int64_t M, F&& f) {
  at::parallel_for(0, M, 8, [&](int64_t r0, int64_t r1) {
    for (int64_t m = r0; m < r1; ++m) f(m);
  });
}

}  // namespace nextn_cpu::layer
