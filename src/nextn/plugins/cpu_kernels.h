// What nextn's CPU kernels share between their translation units (one extension: cpu_kernels.py). Raw-pointer
// entry points, no checks: the ops that call them check their tensors.
#pragma once

#include <cstdint>

namespace nextn_cpu {

constexpr int64_t kMaxD = 256;       // attention head_dim

// out[M, N] f32 = x[M, K] (bf16 bits) times the int4 weight (woq_linear_cpu.cpp: `pack_int4` layout, w = (q - 8) *
// scale + zero8 per group) plus bias (f32 [N] or null). Batch-invariant. K % 64 == 0, group_size % 32 == 0.
void int4_linear(const uint16_t* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, const uint16_t* scale,
                 const uint16_t* zero8, int64_t group_size, const float* bias, float* out);

// out[B, T, NH * D] f32: q [B, T, NH, D] bf16 attending over the bf16 cache [slots, 2 * NKV * D] through
// context_slots [B, S] where visible [B, T, S] (paged_attention_cpu.cpp). Batch-invariant.
void paged_attention_bf16(const uint16_t* q, const uint16_t* kv_cache, const int64_t* context_slots,
                          const bool* visible, int64_t B, int64_t T, int64_t NH, int64_t NKV, int64_t S, int64_t D,
                          float scale, float* out);

}  // namespace nextn_cpu
