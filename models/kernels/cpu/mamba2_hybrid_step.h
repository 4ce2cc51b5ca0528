// The CPU decode step of the Mamba2 hybrids: Granite 4.0-H (granitemoehybrid: pre-norm layers
// whose mixer is Mamba2 or GQA attention, then routed experts beside a shared SwiGLU MLP, or the
// shared MLP alone, each branch times the residual multiplier) and Nemotron-H (one pre-norm block
// a layer: Mamba2, attention or a squared-ReLU MLP), all in one call. Included by step.cpp inside
// its namespace after hybrid_step.h (moe_mlp is hybrid_step.h's; mamba2_decode_to mamba2_step.h's;
// linear, linears, rms_norm, rope and the attention step.cpp's). The contract is in
// mamba2_hybrid_step.py.

// The block kinds of mamba2_hybrid_step's meta
constexpr int64_t kMamba = 1, kAttention = 2, kSwiGLU = 3, kReluSquared = 4, kRouted = 5;

// meta: H, KVH, D, rotary (0: none), the mixers' H, P, N, G, top_k, norm_topk (0/1), then per
// block (its kind; its input linears' count: an attention's q/k/v, a SwiGLU's or the routed
// block's shared gate/up). Every block is pre-norm, x += scale (block(norm(x))), the blocks in
// order (a Granite layer is two: its mixer and its MLP). params per block: the norm weight, then
// Mamba2: in_proj, conv weight [C, K], conv bias (or None), A, dt_bias, D, the gated norm's weight
// (fp32), out_proj; attention: q/k/v linears, o_proj; SwiGLU: gate/up linears, down_proj;
// squared ReLU: up_proj, down_proj; routed: moe_mlp's after its norm (router, stacks, types, the
// shared MLP's gate/up linears and down_proj). caches per Mamba2 block: conv [C, K-1], ssm
// [H, P, N] (fp32); per attention block k, v. scale: the residual multiplier (1: none); q_scale:
// q's factor before the attention (Granite's attention_multiplier times sqrt(D); 1: none), whose
// softmax scale is then 1/sqrt(D); mix_eps: the mixers' gated norm's. row_states: empty, or per
// Mamba2 block [T, C, K-1] and [T, H, P, N] fp32 that receive its states after each row (a
// verify's rollback: mamba2_hybrid_step.py). Every row is a one-token step's, bit for bit.
Tensor mamba2_hybrid_step(const Tensor& x_in, const Tensor& cos_t, const Tensor& sin_t, const OptList& params,
                          const std::vector<Tensor>& caches, const std::vector<int64_t>& meta, int64_t pos, double eps,
                          double scale, double q_scale, double mix_eps, double dt_min, double dt_max,
                          const std::vector<Tensor>& row_states) {
  const int64_t H = meta[0], KVH = meta[1], D = meta[2], R = meta[3];
  const int64_t mH = meta[4], mP = meta[5], mN = meta[6], mG = meta[7], top_k = meta[8];
  const bool norm_topk = meta[9] != 0;
  constexpr int64_t kGlobal = 10, kPerBlock = 2;
  const int64_t blocks = (static_cast<int64_t>(meta.size()) - kGlobal) / kPerBlock;
  const int64_t hidden = x_in.size(1), Tn = x_in.size(0);
  const int64_t inner = mH * mP, conv_dim = inner + 2 * mG * mN;
  TORCH_CHECK(D <= 512 && R <= D && R % 2 == 0, "mamba2_hybrid_step: head sizes not supported");
  auto [attn_scale, cs, cos, sin, x, h, attn, xs, hs] = step_rows(x_in, cos_t, sin_t, H, D, "mamba2_hybrid_step");
  const float qs = static_cast<float>(q_scale);
  int64_t at_ = 0, ci = 0, si = 0;  // the next param, cache, row_states entry
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t kind = meta[kGlobal + kPerBlock * b], parts = meta[kGlobal + kPerBlock * b + 1];
    if (kind == kRouted) {  // (its norm is moe_mlp's first param)
      moe_mlp(x, h, params, at_, parts, eps, top_k, norm_topk, false, scale);
      continue;
    }
    const float* norm = params.get(at_++).value().data_ptr<float>();
    for (int64_t t = 0; t < Tn; ++t) rms_norm(xs + t * hidden, norm, hs + t * hidden, hidden, eps);
    Tensor branch;
    if (kind == kMamba) {
      Tensor proj = linear(h, params, at_).contiguous();
      TORCH_CHECK(proj.size(1) == inner + conv_dim + mH, "mamba2_hybrid_step: a Mamba2 block's in_proj");
      const Tensor conv_w = params.get(at_++).value();
      const std::optional<Tensor> conv_b = params.get(at_++);
      const Tensor A = params.get(at_++).value(), dt_bias = params.get(at_++).value(), Dp = params.get(at_++).value(),
                   norm_w = params.get(at_++).value();
      const Tensor& conv = caches[ci++];
      const Tensor& ssm = caches[ci++];
      const Tensor* keep = row_states.empty() ? nullptr : &row_states[si];
      si += 2;
      TORCH_CHECK(!keep || (keep[0].is_contiguous() && keep[1].is_contiguous() && keep[0].numel() == Tn * conv.numel() &&
                            keep[1].numel() == Tn * ssm.numel()),
                  "mamba2_hybrid_step: row_states needs [T, C, K-1] and [T, H, P, N] fp32 per Mamba2 block");
      Tensor ys = at::empty({Tn, inner}, x.options());
      for (int64_t t = 0; t < Tn; ++t) {
        // keeping the states of each row: row t reads row t-1's (the live ones for the first) and
        // writes its own, the live states left alone until the last row's are copied in below
        const Tensor& conv_in = keep && t ? keep[0][t - 1] : conv;
        const Tensor& ssm_in = keep && t ? keep[1][t - 1] : ssm;
        Tensor y = mamba2_decode_to(proj[t], conv_in, conv_w, conv_b, ssm_in, A, dt_bias, Dp, norm_w, mix_eps, dt_min,
                                    dt_max, mH, mP, mN, mG, keep ? keep[0].data_ptr<float>() + t * conv.numel() : nullptr,
                                    keep ? keep[1].data_ptr<float>() + t * ssm.numel() : nullptr);
        ys.narrow(0, t, 1).copy_(y);
      }
      if (keep) {  // the live states as T steps leave them (a rollback copies an earlier row's)
        conv.copy_(keep[0][Tn - 1]);
        ssm.copy_(keep[1][Tn - 1]);
      }
      branch = linear(ys, params, at_);
    } else if (kind == kAttention) {
      Tensor qkv = linears(h, params, at_, parts).contiguous();
      const int64_t width = qkv.size(1);
      TORCH_CHECK(width == H * D + 2 * KVH * D, "mamba2_hybrid_step: an attention block's projections");
      const Tensor& kc = caches[ci++];
      const Tensor& vc = caches[ci++];
      for (int64_t t = 0; t < Tn; ++t) {
        float* q = qkv.data_ptr<float>() + t * width;
        float* k = q + H * D;
        const float* v = k + KVH * D;
        if (qs != 1.0f)
          for (int64_t i = 0; i < H * D; ++i) q[i] *= qs;
        for (int64_t i = 0; i < H; ++i) rope(q + i * D, cos + t * cs, sin + t * cs, R);
        for (int64_t i = 0; i < KVH; ++i) rope(k + i * D, cos + t * cs, sin + t * cs, R);
        Tensor row = attn.narrow(0, t, 1);
        attention_kv(q, k, v, kc, vc, pos + t, H, KVH, D, attn_scale, x, row);
      }
      branch = linear(attn, params, at_);
    } else if (kind == kSwiGLU) {
      branch = linear(swiglu_rows(linears(h, params, at_, parts).contiguous()), params, at_);
    } else {
      TORCH_CHECK(kind == kReluSquared, "mamba2_hybrid_step: block kind ", kind);
      Tensor u = linear(h, params, at_);
      u.clamp_min_(0.0f);
      u.mul_(u);
      branch = linear(u, params, at_);
    }
    if (scale != 1.0) branch.mul_(static_cast<float>(scale));
    add_rows(x, branch);
  }
  return x;
}
