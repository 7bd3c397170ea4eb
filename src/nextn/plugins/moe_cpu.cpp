// nextn's CPU kernel of an MoE layer's routed experts (moe_experts.py): each expert runs on its own tokens only,
// its int4 weights read in place. One source over simd.h for every ISA variant (cpu_kernels.py).
//
//   nextn::moe_experts(x [N, H] bf16, ids [N, k] int64, weights [N, k] f32, gate_up [w, scale, zero] (the E
//       experts' int4 weights of their gate rows then up rows stacked: w [E, 2 I, H / 2], scale and zero [E, ...] as
//       one linear's), down [w, scale, zero] ([E, H, I / 2]), group_size, int8_activations, gate_up_bias [[E, 2 I]
//       f32] and down_bias [[E, H] f32] or both empty, activation (0: SwiGLU; 1: gpt-oss's clamped SwiGLU, alpha,
//       limit)) -> [N, H]. Stacked, not a list of 3 E tensors: converting 768 tensors (128 experts) cost ~50 us a
//       call, serial time at batch 1.
//   nextn::moe_block(x [N, H] bf16, norm [H] bf16 (w * bf16(x_hat)) or f32 (bf16(x_hat * s): gpt-oss), eps,
//       router [E, H] bf16, top_k, norm_topk, gate_up, down, group_size, int8_activations, gate_up_bias, down_bias,
//       shared_gate_up, shared_down, router_bias [E] f32 | None, activation, alpha, limit, router_kind, n_group,
//       topk_group, routed_scaling, shared_gate [H] bf16 | None) -> x + mlp(xn), xn = RMSNorm(x): the MLP half of an
//       MoE layer as models/moe.py's routers and `SparseMoE` compute it, without the dozen small PyTorch ops between
//       the attention and the experts. Routing, router_kind 0 (`Router`: Qwen3-MoE, Mixtral, OLMoE, gpt-oss): logits
//       bf16(xn Wr^T (+ router_bias)) (f32 sums), softmax in f64 rounded to f32, the top_k by descending probability
//       (ties: lower id), renormalised when norm_topk; router_kind 1 (`NoAuxRouter`: DeepSeek-V3, GLM-4.5,
//       GLM-4.7-Flash): scores sigmoid(xn Wr^T) in f32 (f64 sigmoid), router_bias the choice-only correction bias,
//       n_group / topk_group group limits, weights renormalised and times routed_scaling. The shared expert
//       (shared_gate_up / shared_down: a stack of one expert; empty: none) is added to the routed sum, scaled by
//       bf16(sigmoid(bf16(xn . shared_gate))) where shared_gate is given (Qwen2-MoE's `shared_expert_gate`).
//
// Per expert e (ascending id) with its tokens' rows X_e (tokens ascending), as models/moe.py computes them:
//   g, u = bf16(X_e Wgu^T (+ b_gu));  h = bf16(bf16(silu(g)) * u);  y = bf16(h Wdown^T (+ b_down))
//   (clamped: g' = min(g, limit), h = bf16(g' sigmoid(alpha g') (clamp(u, +-limit) + 1)), in f32: models/moe.py's
//   `ClampedSwiGLU` computes it in f64, a last-bit difference)
//   out[t] = bf16(out[t] + bf16(y[t] * bf16(w[t, e])))        out starts at 0, in bf16
// so a token's sum runs over its experts in ascending id and every row is computed alone (int4_linear is
// batch-invariant): the output of a token does not depend on the others in the step.

#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "cpu_kernels.h"

#include <cstring>
#include <limits>
#include <optional>
#include <vector>

namespace {

using nextn_cpu::simd::V16;
using nextn_cpu::simd::load_bf16;
using nextn_cpu::simd::round_bf16;
using nextn_cpu::simd::store_bf16;
namespace simd = nextn_cpu::simd;

struct Int4 {
  const uint8_t* w = nullptr;
  nextn_cpu::Int4Scales scales;
  const float* bias = nullptr;  // [N] f32, or none
};

// The experts' activation (`activation` of the ops)
struct Glu {
  int64_t kind = 0;  // 0: silu(g) * u; 1: gpt-oss's clamped SwiGLU
  float alpha = 1.702f, limit = 7.f;
};

// The E experts' stacked int4 weights of one projection ([w [E, N, K / 2], scale, zero]: `stack_rows`), each
// expert's a view by pointer offsets (no tensor made per expert)
struct Experts {
  Int4 first;                                  // expert 0's
  int64_t w_step = 0, scale_step = 0, super_step = 0;  // elements from one expert to the next
  Int4 at(int64_t e) const {
    Int4 r = first;
    r.w += e * w_step;
    if (r.scales.group == nullptr) {
      r.scales.scale += e * scale_step;
      r.scales.zero8 += e * scale_step;
    } else {
      r.scales.group += e * scale_step;
      r.scales.super += e * super_step;
    }
    return r;
  }
};

Experts stacked_experts(at::TensorList t, int64_t E, int64_t N, int64_t K, int64_t group_size, bool int8_activations,
                        const char* name) {
  TORCH_CHECK(t.size() == 3, "moe_experts: ", name, " must hold [w, scale, zero], each stacked over the experts");
  const at::Tensor& w = t[0];
  TORCH_CHECK(w.scalar_type() == at::kByte && w.is_contiguous() && w.dim() == 3 && w.size(0) == E &&
                  w.size(1) == N && w.size(2) * 2 == K,
              "moe_experts: ", name, " w must be a contiguous [", E, ", ", N, ", ", K / 2, "] uint8 tensor");
  TORCH_CHECK(t[1].dim() >= 1 && t[1].size(0) == E && t[1].is_contiguous() && t[2].dim() >= 1 &&
                  t[2].size(0) == E && t[2].is_contiguous(),
              "moe_experts: ", name, " scale and zero must be contiguous, stacked over the ", E, " experts");
  Experts r;
  r.first.w = w.data_ptr<uint8_t>();
  r.first.scales = nextn_cpu::int4_scales(t[1][0], t[2][0], N, K / group_size, "moe_experts");
  r.first.scales.int8_activations = int8_activations;
  r.w_step = N * K / 2;
  r.scale_step = t[1].numel() / E;
  r.super_step = t[2].numel() / E;
  return r;
}

// Blocks [b0, b0 + n) of an int4 weight (16 output channels a block): its bytes and scales from there on.
Int4 block_slice(const Int4& l, int64_t K, int64_t group_size, int64_t b0) {
  Int4 r = l;
  const int64_t G = K / group_size;
  r.w = l.w + b0 * 8 * K;
  if (l.bias != nullptr) r.bias = l.bias + b0 * 16;
  if (l.scales.group == nullptr) {
    r.scales.scale = l.scales.scale + b0 * G * 16;
    r.scales.zero8 = l.scales.zero8 + b0 * G * 16;
  } else {
    const int64_t S = G / l.scales.groups_per_super;
    r.scales.group = l.scales.group + b0 * G * 32;
    r.scales.super = l.scales.super + b0 * S * 32;
  }
  return r;
}

// out[r, :N] = rows r of x [A, K] times expert e's weight, for the rows start[e]..start[e+1] of each expert e:
// units of kChunk blocks of every active expert split across the threads in one parallel region (int4_linear runs
// inline there); each output is computed as the whole-matrix call computes it (per-channel-block arithmetic).
constexpr int64_t kChunk = 16;
void matmuls(const std::vector<Int4>& l, const std::vector<int64_t>& start, const uint16_t* x, int64_t K, int64_t N,
             int64_t group_size, bool int8_activations, float* out) {
  // every row's activations prepared once (W4A8: quantized), not once per chunk of its expert's weight
  nextn_cpu::Int4Activations act;
  if (l.empty()) return;
  nextn_cpu::Int4Scales fmt = l.front().scales;  // every expert's scales have one format
  fmt.int8_activations = int8_activations;
  nextn_cpu::int4_prepare(x, start.back(), K, group_size, fmt, act);
  const int64_t blocks = N / 16, chunks = (blocks + kChunk - 1) / kChunk;
  std::vector<int64_t> units;  // expert * chunks + chunk, active experts only
  for (int64_t e = 0; e + 1 < int64_t(start.size()); ++e)
    if (start[e + 1] > start[e])
      for (int64_t c = 0; c < chunks; ++c) units.push_back(e * chunks + c);
  at::parallel_for(0, int64_t(units.size()), 1, [&](int64_t u0, int64_t u1) {
    std::vector<float> tmp;
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t e = units[u] / chunks, b0 = (units[u] % chunks) * kChunk;
      const int64_t nb = std::min(kChunk, blocks - b0), rows = start[e + 1] - start[e];
      const Int4 w = block_slice(l[e], K, group_size, b0);
      tmp.resize(rows * nb * 16);
      nextn_cpu::int4_linear_prepared(act, start[e], rows, K, w.w, nb * 16, w.scales, group_size, w.bias, tmp.data());
      for (int64_t r = 0; r < rows; ++r)
        std::memcpy(out + (start[e] + r) * N + b0 * 16, tmp.data() + r * nb * 16, sizeof(float) * nb * 16);
    }
  });
}

// The experts' checks; returns (E, I).
std::pair<int64_t, int64_t> check_experts(int64_t H, at::TensorList gate_up, at::TensorList down, int64_t group_size) {
  TORCH_CHECK(gate_up.size() == 3 && down.size() == 3 && gate_up[0].dim() == 3 && down[0].dim() == 3 &&
                  gate_up[0].size(0) == down[0].size(0),
              "moe_experts: gate_up and down must each hold [w, scale, zero] stacked over the same experts");
  const int64_t E = gate_up[0].size(0);
  TORCH_CHECK(gate_up[0].size(1) % 32 == 0, "moe_experts: gate_up must hold the gate then the up rows, 16k each");
  const int64_t I = gate_up[0].size(1) / 2;
  TORCH_CHECK(H % 64 == 0 && I % 64 == 0 && group_size % 32 == 0 && H % group_size == 0 && I % group_size == 0,
              "moe_experts: hidden ", H, " and expert width ", I, " must be multiples of 64 and of group_size ",
              group_size, " (a multiple of 32)");
  return {E, I};
}

// The experts' biases of n values each ([[E, n] f32] or empty: none)
const float* expert_biases(at::TensorList biases, int64_t E, int64_t n, const char* name) {
  if (biases.empty()) return nullptr;
  TORCH_CHECK(biases.size() == 1 && biases[0].scalar_type() == at::kFloat && biases[0].is_contiguous() &&
                  biases[0].numel() == E * n,
              "moe_experts: ", name, " must hold one contiguous [", E, ", ", n, "] float32 tensor");
  return biases[0].data_ptr<float>();
}

// op[t] = sum over token t's k experts (ascending id) of bf16(y * bf16(w)), from 0, in bf16: the module's arithmetic
void experts_into(const uint16_t* xp, int64_t N, int64_t H, const int64_t* idp, const float* wp, int64_t k,
                  at::TensorList gate_up, at::TensorList down, int64_t E, int64_t I, int64_t group_size,
                  bool int8_activations, uint16_t* op, at::TensorList gate_up_bias = {},
                  at::TensorList down_bias = {}, Glu glu = {}) {
  TORCH_CHECK(gate_up_bias.empty() == down_bias.empty(), "moe_experts: gate_up_bias and down_bias must both be empty "
              "or both hold the experts' biases");
  const float* gu_bias = expert_biases(gate_up_bias, E, 2 * I, "gate_up_bias");
  const float* dn_bias = expert_biases(down_bias, E, H, "down_bias");
  TORCH_CHECK(glu.kind == 0 || glu.kind == 1, "moe_experts: activation must be 0 (SwiGLU) or 1 (clamped SwiGLU)");
  // the assignments grouped by expert (a counting sort: stable, so tokens ascend within an expert)
  std::vector<int64_t> start(E + 1, 0), order(N * k);
  for (int64_t a = 0; a < N * k; ++a) ++start[idp[a] + 1];
  for (int64_t e = 0; e < E; ++e) start[e + 1] += start[e];
  std::vector<int64_t> next(start.begin(), start.end() - 1);
  for (int64_t a = 0; a < N * k; ++a) order[next[idp[a]]++] = a;

  const Experts gu_all = stacked_experts(gate_up, E, 2 * I, H, group_size, int8_activations, "gate_up");
  const Experts dn_all = stacked_experts(down, E, H, I, group_size, int8_activations, "down");
  std::vector<Int4> gu(E), dn(E);
  for (int64_t e = 0; e < E; ++e) {
    if (start[e + 1] == start[e]) continue;  // an expert no token chose is never read
    gu[e] = gu_all.at(e);
    dn[e] = dn_all.at(e);
    gu[e].bias = gu_bias ? gu_bias + e * 2 * I : nullptr;
    dn[e].bias = dn_bias ? dn_bias + e * H : nullptr;
  }
  // every assignment's row of x, grouped by expert (row r = assignment order[r])
  const int64_t A = N * k;
  std::vector<uint16_t> xs(A * H), hs(A * I);
  std::vector<float> f(A * 2 * I), y(A * H);
  for (int64_t r = 0; r < A; ++r) std::memcpy(xs.data() + r * H, xp + (order[r] / k) * H, sizeof(uint16_t) * H);
  // each projection of every active expert in one parallel region (few long streams, not 2 E short calls)
  matmuls(gu, start, xs.data(), H, 2 * I, group_size, int8_activations, f.data());
  at::parallel_for(0, A, 8, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* g = f.data() + r * 2 * I;
      for (int64_t i = 0; i < I; i += 16) {
        const V16 gv = round_bf16(simd::load(g + i)), uv = round_bf16(simd::load(g + I + i));
        if (glu.kind == 0) {
          store_bf16(hs.data() + r * I + i, round_bf16(gv / (simd::set1(1.f) + simd::exp(simd::zero() - gv))) * uv);
        } else {
          const V16 lim = simd::set1(glu.limit), gc = simd::min(gv, lim);
          const V16 uc = simd::max(simd::min(uv, lim), simd::zero() - lim) + simd::set1(1.f);
          const V16 sig = simd::set1(1.f) / (simd::set1(1.f) + simd::exp(simd::zero() - gc * simd::set1(glu.alpha)));
          store_bf16(hs.data() + r * I + i, gc * sig * uc);
        }
      }
    }
  });
  matmuls(dn, start, hs.data(), I, H, group_size, int8_activations, y.data());
  std::fill(op, op + N * H, uint16_t(0));
  for (int64_t r = 0; r < A; ++r) {  // experts in ascending id: each token's sum in that order
    const int64_t t = order[r] / k;
    const V16 w = round_bf16(simd::set1(wp[order[r]]));
    for (int64_t i = 0; i < H; i += 16)
      store_bf16(op + t * H + i, load_bf16(op + t * H + i) + round_bf16(round_bf16(simd::load(y.data() + r * H + i)) * w));
  }
}

at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights,
                       at::TensorList gate_up, at::TensorList down, int64_t group_size, bool int8_activations,
                       at::TensorList gate_up_bias, at::TensorList down_bias, int64_t activation, double alpha,
                       double limit) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "moe_experts: x must be a contiguous [N, H] bfloat16 tensor");
  const int64_t N = x.size(0), H = x.size(1);
  TORCH_CHECK(ids.dim() == 2 && ids.size(0) == N && ids.scalar_type() == at::kLong && ids.is_contiguous(),
              "moe_experts: ids must be a contiguous [N, k] int64 tensor");
  const int64_t k = ids.size(1);
  TORCH_CHECK(weights.sizes() == ids.sizes() && weights.scalar_type() == at::kFloat && weights.is_contiguous(),
              "moe_experts: weights must be a contiguous [N, k] float32 tensor");
  const auto [E, I] = check_experts(H, gate_up, down, group_size);
  const int64_t* idp = ids.data_ptr<int64_t>();
  for (int64_t a = 0; a < N * k; ++a)
    TORCH_CHECK(idp[a] >= 0 && idp[a] < E, "moe_experts: expert id ", idp[a], " outside [0, ", E, ")");
  at::Tensor out = at::empty({N, H}, x.options());
  experts_into(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), N, H, idp, weights.data_ptr<float>(), k,
               gate_up, down, E, I, group_size, int8_activations,
               reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()), gate_up_bias, down_bias,
               Glu{activation, float(alpha), float(limit)});
  return out;
}

// f32 -> bf16 -> f32, round to nearest even (finite values)
inline float to_bf16(float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  u = (u + 0x7fff + ((u >> 16) & 1)) & 0xffff0000u;
  std::memcpy(&v, &u, 4);
  return v;
}


// The router's logits of one row xn against router rows [E, H] bf16 (each alone: batch-invariant), f32 sums of exact
// products, plus bias; rounded to bf16 for the softmax router (its `dense` kernel's bf16 output), kept in f32 for the
// sigmoid one (NoAuxRouter scores in f32)
void router_logits(const uint16_t* xn, const uint16_t* rw, int64_t E, int64_t H, const float* bias, bool round,
                   float* out) {
  for (int64_t e = 0; e < E; ++e) {
    const uint16_t* wr = rw + e * H;
    V16 acc = simd::zero();
    for (int64_t i = 0; i < H; i += 16) acc = simd::fmadd(load_bf16(xn + i), load_bf16(wr + i), acc);
    const float v = simd::reduce_add(acc);
    out[e] = round ? to_bf16(v + (bias ? bias[e] : 0.f)) : v;
  }
}

// The first `k` of `order` by descending `key` (ties: the lower index first)
void top_by(std::vector<int64_t>& order, int64_t k, const float* key) {
  std::partial_sort(order.begin(), order.begin() + k, order.end(),
                    [&](int64_t a, int64_t b) { return key[a] > key[b] || (key[a] == key[b] && a < b); });
}

// Softmax routing (models/moe.py `Router`): softmax in f64 rounded to f32, the top_k by descending probability,
// renormalised when norm_topk
void route_softmax(const float* l, int64_t E, const nextn_cpu::MoeRouting& r, int64_t* ids, float* weights) {
  double m = l[0], sum = 0;
  for (int64_t e = 1; e < E; ++e) m = std::max(m, double(l[e]));
  std::vector<double> p(E);
  for (int64_t e = 0; e < E; ++e) sum += (p[e] = std::exp(double(l[e]) - m));
  std::vector<float> prob(E);
  std::vector<int64_t> order(E);
  for (int64_t e = 0; e < E; ++e) prob[e] = float(p[e] / sum), order[e] = e;
  top_by(order, r.top_k, prob.data());
  float total = 0.f;
  for (int64_t j = 0; j < r.top_k; ++j) total += prob[order[j]];
  for (int64_t j = 0; j < r.top_k; ++j) {
    ids[j] = order[j];
    weights[j] = r.norm_topk ? prob[order[j]] / total : prob[order[j]];
  }
}

// Sigmoid group-limited routing (models/moe.py `NoAuxRouter`: DeepSeek-V3's noaux_tc, GLM-4.5's): scores
// s = sigmoid(l) (f64, rounded to f32), choice c = s + bias; the n_group groups ranked by the sum of their two best
// c, the experts of the best topk_group groups only; the top_k of those by c; weights s of the chosen, divided by
// their sum + 1e-20 when norm_topk, times the routed scaling factor
void route_sigmoid_grouped(const float* l, int64_t E, const nextn_cpu::MoeRouting& r, int64_t* ids, float* weights) {
  std::vector<float> s(E), c(E);
  for (int64_t e = 0; e < E; ++e) {
    s[e] = float(1.0 / (1.0 + std::exp(-double(l[e]))));
    c[e] = s[e] + (r.bias ? r.bias[e] : 0.f);
  }
  if (r.n_group > 1) {
    const int64_t per = E / r.n_group;
    std::vector<float> gs(r.n_group);
    std::vector<int64_t> order(per), groups(r.n_group);
    for (int64_t g = 0; g < r.n_group; ++g) {
      for (int64_t j = 0; j < per; ++j) order[j] = g * per + j;
      top_by(order, 2, c.data());
      gs[g] = c[order[0]] + c[order[1]];
      groups[g] = g;
    }
    top_by(groups, r.topk_group, gs.data());
    std::vector<bool> keep(r.n_group, false);
    for (int64_t j = 0; j < r.topk_group; ++j) keep[groups[j]] = true;
    for (int64_t e = 0; e < E; ++e)
      if (!keep[e / per]) c[e] = -std::numeric_limits<float>::infinity();
  }
  std::vector<int64_t> order(E);
  for (int64_t e = 0; e < E; ++e) order[e] = e;
  top_by(order, r.top_k, c.data());
  float total = 0.f;
  for (int64_t j = 0; j < r.top_k; ++j) total += s[order[j]];
  for (int64_t j = 0; j < r.top_k; ++j) {
    ids[j] = order[j];
    weights[j] = (r.norm_topk ? s[order[j]] / (total + 1e-20f) : s[order[j]]) * r.scaling;
  }
}

// op[t] = bf16(op[t] + sh) with sh the shared expert of row t (a stack of one expert: [w [1, 2 I, H / 2], scale,
// zero]), times bf16(sigmoid(bf16(xn_t . gate))) where gate ([H] bf16) is given (Qwen2-MoE's shared_expert_gate)
void add_shared(const uint16_t* xn, int64_t N, int64_t H, const nextn_cpu::MoeShared& shared, int64_t group_size,
                bool int8_activations, uint16_t* op) {
  const auto [E, I] = check_experts(H, shared.gate_up, shared.down, group_size);
  TORCH_CHECK(E == 1, "moe_block: the shared expert must be a stack of one expert, got ", E);
  std::vector<int64_t> zero(N, 0);
  std::vector<float> one(N, 1.f);
  std::vector<uint16_t> sh(N * H);
  experts_into(xn, N, H, zero.data(), one.data(), 1, shared.gate_up, shared.down, 1, I, group_size, int8_activations,
               sh.data());
  for (int64_t n = 0; n < N; ++n) {
    uint16_t* o = op + n * H;
    const uint16_t* y = sh.data() + n * H;
    if (shared.gate != nullptr) {
      float logit;
      router_logits(xn + n * H, shared.gate, 1, H, nullptr, true, &logit);
      const V16 g = round_bf16(simd::set1(float(1.0 / (1.0 + std::exp(-double(logit))))));
      for (int64_t i = 0; i < H; i += 16) store_bf16(o + i, load_bf16(o + i) + round_bf16(load_bf16(y + i) * g));
    } else {
      for (int64_t i = 0; i < H; i += 16) store_bf16(o + i, load_bf16(o + i) + load_bf16(y + i));
    }
  }
}

}  // namespace

namespace nextn_cpu {

at::Tensor moe_block(const at::Tensor& x, const at::Tensor& norm, double eps, const at::Tensor& router,
                     const MoeRouting& routing, at::TensorList gate_up, at::TensorList down, int64_t group_size,
                     bool int8_activations, at::TensorList gate_up_bias, at::TensorList down_bias,
                     int64_t activation, double alpha, double limit, const MoeShared& shared) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "moe_block: x must be a contiguous [N, H] bfloat16 tensor");
  const int64_t N = x.size(0), H = x.size(1);
  const auto [E, I] = check_experts(H, gate_up, down, group_size);
  TORCH_CHECK((norm.scalar_type() == at::kBFloat16 || norm.scalar_type() == at::kFloat) && norm.is_contiguous() &&
                  norm.numel() == H,
              "moe_block: norm must be a contiguous [", H, "] bfloat16 (weights) or float32 (scales) tensor");
  TORCH_CHECK(router.scalar_type() == at::kBFloat16 && router.is_contiguous() && router.dim() == 2 &&
                  router.size(0) == E && router.size(1) == H,
              "moe_block: router must be a contiguous [", E, ", ", H, "] bfloat16 tensor");
  TORCH_CHECK(routing.kind == 0 || routing.kind == 1, "moe_block: router_kind must be 0 (softmax) or 1 (sigmoid, "
              "grouped), got ", routing.kind);
  TORCH_CHECK(1 <= routing.top_k && routing.top_k <= E, "moe_block: top_k ", routing.top_k, " outside [1, ", E, "]");
  if (routing.kind == 1)
    TORCH_CHECK(routing.n_group >= 1 && E % routing.n_group == 0 && 1 <= routing.topk_group &&
                    routing.topk_group <= routing.n_group && (routing.n_group == 1 || E / routing.n_group >= 2) &&
                    routing.top_k <= routing.topk_group * (E / routing.n_group),
                "moe_block: routing ", E, " experts in ", routing.n_group, " groups, the best ", routing.topk_group,
                " of them, cannot choose ", routing.top_k);
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const bool scaled = norm.scalar_type() == at::kFloat;
  const void* nw = norm.data_ptr();
  const uint16_t* rw = reinterpret_cast<const uint16_t*>(router.data_ptr<at::BFloat16>());
  std::vector<uint16_t> xn(N * H);
  std::vector<float> logits(N * E);
  std::vector<int64_t> ids(N * routing.top_k);
  std::vector<float> weights(N * routing.top_k);
  at::parallel_for(0, N, 1, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      if (scaled)
        nextn_cpu::rms_norm_scaled(xp + n * H, static_cast<const float*>(nw), H, float(eps), xn.data() + n * H);
      else
        nextn_cpu::rms_norm(xp + n * H, static_cast<const uint16_t*>(nw), H, float(eps), xn.data() + n * H);
    }
  });
  const int64_t chunk = std::max<int64_t>(1, std::min<int64_t>(E, 16));  // logits of 16 experts a task
  const int64_t per_row = (E + chunk - 1) / chunk;
  at::parallel_for(0, N * per_row, 1, [&](int64_t a0, int64_t a1) {
    for (int64_t a = a0; a < a1; ++a) {
      const int64_t n = a / per_row, e0 = (a % per_row) * chunk, ne = std::min(chunk, E - e0);
      router_logits(xn.data() + n * H, rw + e0 * H, ne, H, routing.kind == 0 && routing.bias ? routing.bias + e0
                    : nullptr, routing.kind == 0, logits.data() + n * E + e0);
    }
  });
  for (int64_t n = 0; n < N; ++n)
    (routing.kind == 0 ? route_softmax : route_sigmoid_grouped)(logits.data() + n * E, E, routing,
                                                                 ids.data() + n * routing.top_k,
                                                                 weights.data() + n * routing.top_k);
  at::Tensor out = at::empty({N, H}, x.options());
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  experts_into(xn.data(), N, H, ids.data(), weights.data(), routing.top_k, gate_up, down, E, I, group_size,
               int8_activations, op, gate_up_bias, down_bias, Glu{activation, float(alpha), float(limit)});
  if (!shared.gate_up.empty()) add_shared(xn.data(), N, H, shared, group_size, int8_activations, op);
  for (int64_t a = 0; a < N * H; a += 16) store_bf16(op + a, load_bf16(xp + a) + load_bf16(op + a));  // residual
  return out;
}

}  // namespace nextn_cpu

namespace {

// The op's flat arguments as moe_block's structs
at::Tensor moe_block_op(const at::Tensor& x, const at::Tensor& norm, double eps, const at::Tensor& router,
                        int64_t top_k, bool norm_topk, at::TensorList gate_up, at::TensorList down, int64_t group_size,
                        bool int8_activations, at::TensorList gate_up_bias, at::TensorList down_bias,
                        at::TensorList shared_gate_up, at::TensorList shared_down,
                        const std::optional<at::Tensor>& router_bias, int64_t activation, double alpha, double limit,
                        int64_t router_kind, int64_t n_group, int64_t topk_group, double routed_scaling,
                        const std::optional<at::Tensor>& shared_gate) {
  const int64_t E = gate_up.empty() ? 0 : gate_up[0].size(0), H = x.size(-1);
  TORCH_CHECK(!router_bias || (router_bias->scalar_type() == at::kFloat && router_bias->is_contiguous() &&
                               router_bias->numel() == E),
              "moe_block: router_bias must be a contiguous [", E, "] float32 tensor");
  TORCH_CHECK(shared_gate_up.empty() == shared_down.empty(), "moe_block: shared_gate_up and shared_down go together");
  TORCH_CHECK(!shared_gate || (!shared_gate_up.empty() && shared_gate->scalar_type() == at::kBFloat16 &&
                               shared_gate->is_contiguous() && shared_gate->numel() == H),
              "moe_block: shared_gate must be a contiguous [", H, "] bfloat16 tensor, with a shared expert");
  nextn_cpu::MoeRouting routing{router_kind, top_k, norm_topk, n_group, topk_group, float(routed_scaling),
                                router_bias ? router_bias->data_ptr<float>() : nullptr};
  nextn_cpu::MoeShared shared{shared_gate_up, shared_down,
                              shared_gate ? reinterpret_cast<const uint16_t*>(shared_gate->data_ptr<at::BFloat16>())
                                          : nullptr};
  return nextn_cpu::moe_block(x, norm, eps, router, routing, gate_up, down, group_size, int8_activations, gate_up_bias,
                              down_bias, activation, alpha, limit, shared);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(NEXTN_OPS, m) {
  m.def("moe_experts(Tensor x, Tensor ids, Tensor weights, Tensor[] gate_up, Tensor[] down, int group_size, "
        "bool int8_activations, Tensor[] gate_up_bias, Tensor[] down_bias, int activation=0, float alpha=1.702, "
        "float limit=7.0) -> Tensor");
  m.def("moe_block(Tensor x, Tensor norm, float eps, Tensor router, int top_k, bool norm_topk, Tensor[] gate_up, "
        "Tensor[] down, int group_size, bool int8_activations, Tensor[] gate_up_bias, Tensor[] down_bias, "
        "Tensor[] shared_gate_up, Tensor[] shared_down, Tensor? router_bias=None, int activation=0, "
        "float alpha=1.702, float limit=7.0, int router_kind=0, int n_group=1, int topk_group=1, "
        "float routed_scaling=1.0, Tensor? shared_gate=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(NEXTN_OPS, CPU, m) {
  m.impl("moe_experts", &moe_experts);
  m.impl("moe_block", &moe_block_op);
}
