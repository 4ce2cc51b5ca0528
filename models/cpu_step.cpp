// The CPU decode step of a dense GQA transformer (Llama / SmolLM2, Qwen2, Qwen3) for one token, every
// layer in one call: the contract is in cpu_step.py, which builds and loads this file.
//
// Why C++: on a small model the eager torch step is bound by per-op overhead (~400 small ops a
// step on SmolLM2, 21-25 ms against 8 ms of matmul). Here the matmuls stay torch's kernels (the
// int4 GEMM of quant.Int4Linear, or at::linear for fp32 weights) and so do the attention's two
// batched GEMMs; the norms, RoPE, KV write, SwiGLU and residual adds are plain loops over the
// token's vectors (the reductions with independent accumulators, so the compiler vectorises
// them), with a fixed summation order (deterministic).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

using at::Tensor;
using OptList = c10::List<std::optional<Tensor>>;
constexpr int kLanes = 16;  // independent partial sums: a vectorisable reduction without -ffast-math

float dot(const float* a, const float* b, int64_t n) {
  float acc[kLanes] = {0};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int j = 0; j < kLanes; ++j) acc[j] += a[i + j] * b[i + j];
  float s = 0.f;
  for (int j = 0; j < kLanes; ++j) s += acc[j];
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// y = x / rms(x) * w, fp32 (F.rms_norm's form)
void rms_norm(const float* x, const float* w, float* y, int64_t n, double eps) {
  const float inv = 1.0f / std::sqrt(dot(x, x, n) / static_cast<float>(n) + static_cast<float>(eps));
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] * inv * w[i];
}

// torch's int4 kernel on one fp32 row: it takes and returns bf16; the casts are loops here (the
// same round-to-nearest-even as Tensor.to), not two dispatched ops per matmul.
Tensor int4_mm(const Tensor& x, const Tensor& packed, const Tensor& sz) {
  const Tensor xc = x.contiguous();
  const int64_t K = xc.size(-1);
  Tensor xb = at::empty({1, K}, xc.options().dtype(at::kBFloat16));
  const float* xp = xc.data_ptr<float>();
  at::BFloat16* xbp = xb.data_ptr<at::BFloat16>();
  for (int64_t i = 0; i < K; ++i) xbp[i] = at::BFloat16(xp[i]);
  Tensor yb = at::_weight_int4pack_mm_for_cpu(xb, packed, 32, sz);
  Tensor y = at::empty(yb.sizes(), xc.options());
  const at::BFloat16* ybp = yb.data_ptr<at::BFloat16>();
  float* yp = y.data_ptr<float>();
  for (int64_t i = 0, n = yb.numel(); i < n; ++i) yp[i] = static_cast<float>(ybp[i]);
  return y;
}

// One linear of the layer: (weight, int4 scale/zero or None for an fp32 weight, bias or None).
Tensor linear(const Tensor& x, const OptList& p, int64_t at_) {
  const Tensor w = p.get(at_).value();
  const std::optional<Tensor> sz = p.get(at_ + 1);
  const std::optional<Tensor> bias = p.get(at_ + 2);
  Tensor y = sz.has_value()
      ? int4_mm(x, w, *sz)
      : at::linear(x, w);
  if (bias.has_value()) y.add_(*bias);
  return y;
}

// Several linears reading the same input (q/k/v or gate/up kept apart), outputs side by side.
Tensor linears(const Tensor& x, const OptList& p, int64_t& at_, int64_t parts) {
  if (parts == 1) {
    Tensor y = linear(x, p, at_);
    at_ += 3;
    return y;
  }
  std::vector<Tensor> ys;
  for (int64_t i = 0; i < parts; ++i, at_ += 3) ys.push_back(linear(x, p, at_));
  return at::cat(ys, 1);
}

// Rotate-half RoPE over the first r dims of one head, in place: x*cos + roll(x, r/2)*signed_sin.
void rope(float* x, const float* cos, const float* sin, int64_t r) {
  const int64_t h = r / 2;
  float tmp[512];
  for (int64_t d = 0; d < r; ++d) tmp[d] = x[d];
  for (int64_t d = 0; d < h; ++d) x[d] = tmp[d] * cos[d] + tmp[d + h] * sin[d];
  for (int64_t d = h; d < r; ++d) x[d] = tmp[d] * cos[d] + tmp[d - h] * sin[d];
}

// Up to this many live slots the attention runs as loops, above it as torch's batched GEMMs.
// Measured on the embedded model, 2 cores (ms a step): at 16-144 slots loops 8.4-9.8, GEMMs
// 9.2-10.8; at 2,000 slots loops 27.0-28.9, GEMMs 20.5-21.6; at 6,000 59.6-65.1 against 40.8-41.7.
constexpr int64_t kLoopSlots = 256;

void attend_short(const float* q, const float* kc, const float* vc, int64_t ks, int64_t vs, int64_t live,
                  int64_t H, int64_t group, int64_t D, float scale, float* out) {
  float sc[kLoopSlots];
  for (int64_t h = 0; h < H; ++h) {
    const float* keys = kc + (h / group) * ks;
    const float* values = vc + (h / group) * vs;
    float mx = -INFINITY, sum = 0.f;
    for (int64_t s = 0; s < live; ++s) {
      sc[s] = dot(q + h * D, keys + s * D, D) * scale;
      mx = std::max(mx, sc[s]);
    }
    for (int64_t s = 0; s < live; ++s) sum += (sc[s] = std::exp(sc[s] - mx));
    float* o = out + h * D;
    std::fill(o, o + D, 0.f);
    for (int64_t s = 0; s < live; ++s) {
      const float p = sc[s] / sum;
      const float* vrow = values + s * D;
      for (int64_t d = 0; d < D; ++d) o[d] += p * vrow[d];
    }
  }
}

// x: [1, hidden] fp32 (the embedded token); cos, sin: [1, rotary] fp32 (Rope.cos_sin);
// params: per layer, in order: input norm weight, qkv linears (3 entries each), with qk_norm
// the per-head q and k norm weights, o_proj, post norm weight, gate/up linears, down_proj;
// caches: per layer k, v [KVH, S, D] fp32; meta: H, KVH, D, rotary, qk_norm (0/1), then per
// layer (qkv parts, gate/up parts). Returns the residual stream after the last layer, its last
// branch added.
Tensor llama_step(const Tensor& x_in, const Tensor& cos_t, const Tensor& sin_t, const OptList& params,
                  const std::vector<Tensor>& caches, const std::vector<int64_t>& meta, int64_t pos, double eps) {
  const int64_t H = meta[0], KVH = meta[1], D = meta[2], R = meta[3];
  const bool qk_norm = meta[4] != 0;
  const int64_t layers = (static_cast<int64_t>(meta.size()) - 5) / 2;
  const int64_t hidden = x_in.size(1), group = H / KVH, live = pos + 1;
  TORCH_CHECK(D <= 512 && R <= D && R % 2 == 0, "cpu_step: head size ", D, " / rotary ", R, " not supported");
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const float* cos = cos_t.data_ptr<float>();
  const float* sin = sin_t.data_ptr<float>();

  Tensor x = x_in.contiguous().clone();
  Tensor h = at::empty_like(x);
  Tensor attn = at::empty({1, H * D}, x.options());
  float* xs = x.data_ptr<float>();
  float* hs = h.data_ptr<float>();
  int64_t at_ = 0;
  for (int64_t l = 0; l < layers; ++l) {
    const int64_t qkv_parts = meta[5 + 2 * l], gu_parts = meta[6 + 2 * l];
    rms_norm(xs, params.get(at_++).value().data_ptr<float>(), hs, hidden, eps);
    Tensor qkv = linears(h, params, at_, qkv_parts).contiguous();
    float* q = qkv.data_ptr<float>();
    float* k = q + H * D;
    const float* v = k + KVH * D;
    if (qk_norm) {  // Qwen3: RMSNorm over each query and key head before RoPE
      const float* qw = params.get(at_++).value().data_ptr<float>();
      const float* kw = params.get(at_++).value().data_ptr<float>();
      for (int64_t i = 0; i < H; ++i) rms_norm(q + i * D, qw, q + i * D, D, eps);
      for (int64_t i = 0; i < KVH; ++i) rms_norm(k + i * D, kw, k + i * D, D, eps);
    }
    for (int64_t i = 0; i < H; ++i) rope(q + i * D, cos, sin, R);
    for (int64_t i = 0; i < KVH; ++i) rope(k + i * D, cos, sin, R);
    const Tensor& kc = caches[2 * l];
    const Tensor& vc = caches[2 * l + 1];
    float* kcp = kc.data_ptr<float>();
    float* vcp = vc.data_ptr<float>();
    const int64_t ks = kc.stride(0), vs = vc.stride(0);
    for (int64_t i = 0; i < KVH; ++i) {
      std::copy(k + i * D, k + (i + 1) * D, kcp + i * ks + pos * D);
      std::copy(v + i * D, v + (i + 1) * D, vcp + i * vs + pos * D);
    }
    // attention over the live slots as decode_attention computes it (scores, torch's softmax,
    // weighted values): loops over a short context, two batched GEMMs over a long one
    if (live <= kLoopSlots) {
      attend_short(q, kcp, vcp, ks, vs, live, H, group, D, scale, attn.data_ptr<float>());
    } else {
      Tensor qg = at::from_blob(q, {KVH, group, D}, x.options());
      Tensor sc = at::bmm(qg, kc.narrow(1, 0, live).transpose(1, 2)).mul_(scale);
      Tensor heads = attn.view({KVH, group, D});  // [KVH, G, D] is already head-major
      at::bmm_out(heads, at::_softmax(sc, -1, false), vc.narrow(1, 0, live));
    }
    Tensor a = linear(attn, params, at_);
    at_ += 3;
    const float* ap = a.data_ptr<float>();
    for (int64_t i = 0; i < hidden; ++i) xs[i] += ap[i];
    rms_norm(xs, params.get(at_++).value().data_ptr<float>(), hs, hidden, eps);
    Tensor gu = linears(h, params, at_, gu_parts).contiguous();
    const int64_t ffn = gu.size(1) / 2;
    Tensor act = at::silu(gu.narrow(1, 0, ffn));
    act.mul_(gu.narrow(1, ffn, ffn));
    Tensor m = linear(act, params, at_);
    at_ += 3;
    const float* mp = m.data_ptr<float>();
    for (int64_t i = 0; i < hidden; ++i) xs[i] += mp[i];
  }
  return x;
}

}  // namespace

TORCH_LIBRARY(chat_cpu, m) {
  m.def("llama_step(Tensor x, Tensor cos, Tensor sin, Tensor?[] params, Tensor[] caches, int[] meta, int pos, "
        "float eps) -> Tensor", &llama_step);
}
