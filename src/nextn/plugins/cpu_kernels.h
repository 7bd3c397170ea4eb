// What nextn's CPU kernels share between their translation units (one extension per ISA variant: cpu_kernels.py).
// Raw-pointer entry points, no checks: the ops that call them check their tensors. SIMD: simd.h.
#pragma once

#include <ATen/core/Tensor.h>

#include <ATen/Parallel.h>

#include "simd.h"

#include <algorithm>
#include <optional>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

namespace nextn_cpu {

constexpr int64_t kMaxD = 512;       // attention head_dim (Gemma 4's full-attention layers: 512)

// Register blocking of the variant: a V16 is simd::kParts vectors, and AVX-512 and NEON have 32 vector registers,
// AVX2 and the portable path 16. kKeys: the dot products (one row against kKeys others) whose accumulators stay in
// registers at once (the attention kernels' scores).
#if defined(NEXTN_AVX512) || defined(__aarch64__)
constexpr int kRegs = 32;
#else
constexpr int kRegs = 16;
#endif
constexpr int kKeys = simd::kParts == 1 ? 16 : (kRegs / simd::kParts) / 2;

// Up to 16 values of a bf16 or f32 row as f32: the first n (the rest read as 0; nothing past the row is read)
inline simd::V16 load16(const float* p, int64_t n) { return simd::load(p, n); }
inline simd::V16 load16(const at::BFloat16* p, int64_t n) {
  return simd::load_bf16(reinterpret_cast<const uint16_t*>(p), n);
}

// rsqrt(mean(x^2) + eps) of one bf16 row of H (H % 16 == 0), broadcast
inline simd::V16 inv_rms(const uint16_t* x, int64_t H, float eps) {
  simd::V16 ss = simd::zero();
  for (int64_t i = 0; i < H; i += 16) {
    const simd::V16 v = simd::load_bf16(x + i);
    ss = simd::fmadd(v, v, ss);
  }
  return simd::set1(1.f / std::sqrt(simd::reduce_add(ss) / float(H) + eps));
}

// out = w * bf16(x * rsqrt(mean(x^2) + eps)), one row of H (H % 16 == 0): Llama's RMSNorm with bf16 weights
inline void rms_norm(const uint16_t* x, const uint16_t* w, int64_t H, float eps, uint16_t* out) {
  const simd::V16 inv = inv_rms(x, H, eps);
  for (int64_t i = 0; i < H; i += 16)
    simd::store_bf16(out + i, simd::load_bf16(w + i) * simd::round_bf16(simd::load_bf16(x + i) * inv));
}

// out = bf16(x * rsqrt(mean(x^2) + eps) * s), s f32 (Gemma's 1 + w; OLMo 2's and gpt-oss's w, in f32), one bf16 row
inline void rms_norm_scaled(const uint16_t* x, const float* s, int64_t H, float eps, uint16_t* out) {
  const simd::V16 inv = inv_rms(x, H, eps);
  for (int64_t i = 0; i < H; i += 16) simd::store_bf16(out + i, (simd::load_bf16(x + i) * inv) * simd::load(s + i));
}

// --- the linear ops' operands (woq_linear_cpu.cpp, int8_linear_cpu.cpp)

// x checked and flattened to a contiguous [M, K] `as` tensor (the dtype the kernel reads it in).
inline at::Tensor check_x(const at::Tensor& x, int64_t K, const char* op, at::ScalarType as) {
  TORCH_CHECK(x.device().is_cpu(), op, ": x must be on the CPU");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, op,
              ": x must be bfloat16 or float32, got ", x.scalar_type());
  TORCH_CHECK(x.size(-1) == K, op, ": x has ", x.size(-1), " input channels, the weight ", K);
  return x.reshape({-1, K}).to(as).contiguous();
}

// bias as f32 [N] (kept alive in `keep`), or null
inline const float* bias_ptr(const std::optional<at::Tensor>& bias, int64_t N, at::Tensor& keep) {
  if (!bias.has_value()) return nullptr;
  TORCH_CHECK(bias->numel() == N, "bias must have ", N, " elements, got ", bias->numel());
  keep = bias->to(at::kFloat).contiguous();
  return keep.data_ptr<float>();
}

// out [M, N] f32 -> x's dtype and leading shape
inline at::Tensor finish(const at::Tensor& out, const at::Tensor& x) {
  auto sizes = x.sizes().vec();
  sizes.back() = out.size(1);
  return out.to(x.scalar_type()).view(sizes);
}

// An int4 weight's scales, one of two formats (woq_linear_cpu.cpp; layouts from woq_linear.py):
//  - one-level (`group` null): bf16 `scale` and `zero8` per group of input channels and output channel,
//    [N/16, G, 16]: w = (q - 8) * scale + zero8;
//  - two-level (llama.cpp's k-quant scheme): per group 8-bit `group` [N/16, G, 2, 16] (a u8 scale, an i8 zero),
//    under fp16 `super` [N/16, G / groups_per_super, 2, 16] (d, dmin) per super-block of groups:
//    w = q * (d * scale) + dmin * zero.
struct Int4Scales {
  const uint16_t* scale = nullptr;
  const uint16_t* zero8 = nullptr;
  const uint8_t* group = nullptr;
  const uint16_t* super = nullptr;
  int64_t groups_per_super = 0;
  // W4A8: x quantized to int8 per group, the weight in `pack_int4_vnni` layout (else bf16 x, `pack_int4` layout)
  bool int8_activations = false;
};

// out[M, N] f32 = x[M, K] (bf16 bits) times the int4 weight (`pack_int4` layout, q in [0, 15]) with `scales`, plus
// bias (f32 [N] or null). Batch-invariant. K % 64 == 0, N % 16 == 0, group_size % 32 == 0.
void int4_linear(const uint16_t* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, const Int4Scales& scales,
                 int64_t group_size, const float* bias, float* out);

// An int4 linear's activations prepared once for several calls over the same rows (an MoE expert's rows against
// each chunk of its weight): x (bf16 bits) and its group sums xs [M, K / group_size], or for W4A8 also x quantized
// to int8 (xq [M, K], sx [M, K / act_group]) per `int8_activation_group` input channels, xs then sx * sum xq.
// Each row alone: the same numbers as int4_linear's own preparation.
struct Int4Activations {
  const uint16_t* x = nullptr;
  int64_t act_group = 0;
  std::vector<int8_t> xq;
  std::vector<float> sx, xs;
};
// W4A8's activation block: a weight group (one-level scales: llama.cpp's Q4_0 x Q8_0), or a super-block (two-level:
// Q4_K x Q8_K, so that the 8-bit group scales apply in integer)
int64_t int8_activation_group(const Int4Scales& scales, int64_t group_size);
void int4_prepare(const uint16_t* x, int64_t M, int64_t K, int64_t group_size, const Int4Scales& scales,
                  Int4Activations& a);
// int4_linear over rows [m0, m0 + M) of prepared activations (out: those rows' [M, N])
void int4_linear_prepared(const Int4Activations& a, int64_t m0, int64_t M, int64_t K, const uint8_t* w, int64_t N,
                          const Int4Scales& scales, int64_t group_size, const float* bias, float* out);

// The scales of an int4 weight of N output channels and G groups from the op's (scale, zero) tensors, dispatched on
// their dtypes (bf16, bf16: one-level; uint8, fp16: two-level); TORCH_CHECKs shapes and dtypes, naming `op`.
Int4Scales int4_scales(const at::Tensor& scale, const at::Tensor& zero, int64_t N, int64_t G, const char* op);

// An MoE layer's routing (moe_cpu.cpp): kind 0 softmax (`Router`; bias added to the logits), 1 sigmoid with groups
// (`NoAuxRouter`; bias: e_score_correction_bias, used to choose only, and n_group, topk_group, scaling)
struct MoeRouting {
  int64_t kind = 0;
  int64_t top_k = 1;
  bool norm_topk = false;
  int64_t n_group = 1, topk_group = 1;
  float scaling = 1.f;
  const float* bias = nullptr;  // [E] f32 or null
};

// An MoE layer's shared expert: its stacked [w, scale, zero] of gate_up and of down (a stack of one; empty: none)
// and, for Qwen2-MoE's, the gate row [H] bf16 that scales it by sigmoid (null: added unscaled)
struct MoeShared {
  at::TensorList gate_up = {}, down = {};
  const uint16_t* gate = nullptr;
};

// x + the MoE MLP half of x (moe_cpu.cpp's `moe_block` op; the decoder stack calls it between its layers' attention)
at::Tensor moe_block(const at::Tensor& x, const at::Tensor& norm, double eps, const at::Tensor& router,
                     const MoeRouting& routing, at::TensorList gate_up, at::TensorList down, int64_t group_size,
                     bool int8_activations, at::TensorList gate_up_bias = {}, at::TensorList down_bias = {},
                     int64_t activation = 0, double alpha = 1.702, double limit = 7.0, const MoeShared& shared = {});

// out[B, T, NH * D] f32: q [B, T, NH, D] bf16 attending over the bf16 cache [slots, 2 * NKV * D] through
// context_slots [B, S] where visible [B, T, S] (paged_attention_cpu.cpp), scores soft-capped where softcap > 0, an
// attention sink per query head in each softmax where sinks ([NH] f32) is not null. Batch-invariant.
void paged_attention_bf16(const uint16_t* q, const uint16_t* kv_cache, const int64_t* context_slots,
                          const bool* visible, int64_t B, int64_t T, int64_t NH, int64_t NKV, int64_t S, int64_t D,
                          float scale, float softcap, const float* sinks, float* out);


// The linear kernels' row and block loops (woq_linear_cpu.cpp, dense_linear_cpu.cpp). Which path a row takes changes
// nothing in its arithmetic: every row is computed alone (batch invariance).
template <int V>
using Int = std::integral_constant<int, V>;

// Call f(Int<rows>{}) for a runtime row count 1..MAX (larger counts: MAX), the row count a compile-time constant.
template <int MAX, int R = 1, typename F>
inline void with_rows(int64_t rows, F&& f) {
  if constexpr (R < MAX) {
    if (rows > R) return with_rows<MAX, R + 1>(rows, std::forward<F>(f));
  }
  f(Int<R>{});
}

// Run `block(Int<MB>, Int<NB>, m0, n0)` over M rows and N units (output channels for int8, blocks of 16 channels
// for int4): NB units at a time, split across threads (at least `grain` such steps a thread), the last < NB one
// by one; within them, chunks of at most MAX rows reuse the units' weights from L1, each chunk unpacking them again
// (so callers pick the largest MAX their registers allow). The chunks are as even as their number allows (9 rows
// at MAX 8: 5 + 4, not 8 + 1; the same unpacking work, no chunk left with a single multiply-add chain). Each row's
// arithmetic is the same whatever chunk it is in: batch-invariant.
template <int NB, int MAX, typename Block>
void run_blocks(int64_t M, int64_t N, int64_t grain, Block& block) {
  const int64_t blocks = (N + NB - 1) / NB;
  if (M <= 0) return;
  const int64_t chunks = (M + MAX - 1) / MAX, small = M / chunks, big = M % chunks;
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * NB;
      int64_t m0 = 0;
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t rows = small + (c < big);  // the first M % chunks chunks one row more
        with_rows<MAX>(rows, [&](auto mb) {
          if (n0 + NB <= N) {
            block(mb, Int<NB>{}, m0, n0);
          } else {
            for (int64_t n = n0; n < N; ++n) block(mb, Int<1>{}, m0, n);
          }
        });
        m0 += rows;
      }
    }
  });
}

}  // namespace nextn_cpu
