// RMSNorm for the layers that run as modules (nextn plugin; Python side and the PyTorch reference: rms_norm.py).
//
//   nextn::rms_norm(x [..., H] bf16, weight: bf16 [H] | f32 [H] | None, eps) -> [..., H] bf16
//
// Per row: x_hat = x * rsqrt(mean(x^2) + eps) in f32, then
//   bf16 weight (Llama, HF `LlamaRMSNorm`):             w * bf16(x_hat), the product rounded to bf16
//   f32 weight s (Gemma's 1 + w, OLMo 2's w):           bf16(x_hat * s)
//   none (Gemma 4's V norm, `with_scale=False`):        bf16(x_hat)
// — the formulas of `models/layers.py`'s norms, one dispatch instead of eight. The sum of squares runs in the SIMD
// layer's lane order (`nextn_cpu::inv_rms`, the fused decoder layer's), not PyTorch's: a last-bit difference in
// x_hat at most; every row is the same operations whatever the batch or the thread (batch invariance).
// H % 16 == 0.

#include <ATen/ATen.h>
#include <torch/library.h>

#include "cpu_kernels.h"

#include <optional>
#include <vector>

namespace {

at::Tensor rms_norm(const at::Tensor& x, const std::optional<at::Tensor>& weight, double eps) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16, "rms_norm: x must be bfloat16 on the CPU");
  const int64_t H = x.size(-1);
  TORCH_CHECK(H % 16 == 0, "rms_norm: the last dimension (", H, ") must be a multiple of 16");
  if (weight) {
    TORCH_CHECK(weight->dim() == 1 && weight->size(0) == H, "rms_norm: weight must be [", H, "]");
    TORCH_CHECK(weight->scalar_type() == at::kBFloat16 || weight->scalar_type() == at::kFloat,
                "rms_norm: weight must be bfloat16 (w * bf16(x_hat)) or float32 (bf16(x_hat * s))");
  }
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty_like(xc);
  const int64_t M = H ? xc.numel() / H : 0;
  const at::Tensor w = weight ? weight->contiguous() : at::ones({H}, x.options().dtype(at::kFloat));
  const bool f32 = w.scalar_type() == at::kFloat;
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const float e = float(eps);
  at::parallel_for(0, M, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t m = lo; m < hi; ++m) {
      if (f32) {
        nextn_cpu::rms_norm_scaled(xp + m * H, w.data_ptr<float>(), H, e, op + m * H);
      } else {
        nextn_cpu::rms_norm(xp + m * H, reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()), H, e,
                            op + m * H);
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(NEXTN_OPS, m) { m.def("rms_norm(Tensor x, Tensor? weight, float eps) -> Tensor"); }

TORCH_LIBRARY_IMPL(NEXTN_OPS, CPU, m) { m.impl("rms_norm", &rms_norm); }
