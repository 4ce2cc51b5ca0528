// The CPU decode step of the DeltaNet hybrids: Qwen3.5, Qwen3.5-MoE and Qwen3-Next
// (qwen3_5.HybridForCausalLM: Gated DeltaNet layers and gated full-attention layers, each with a
// SwiGLU MLP or routed experts in GGUF blocks beside a gated shared expert) and OLMo-Hybrid (its
// DeltaNet layers and post-norm OLMo-3 attention layers, SwiGLU MLPs), all in one call.
// Included by step.cpp inside its namespace, after llama_step (linear, linears, rms_norm, rope,
// attention and delta_decode are step.cpp's and delta_step.h's). The contract is in
// hybrid_step.py.
//
// A DeltaNet layer: the input projections (one to four linears; their outputs side by side are
// qkv, z, b, a), delta_decode (the conv step, the delta rule, the gated norm: the states updated
// in place), the heads put in out_proj's order where its columns are tiled, out_proj. An attention
// layer: q (with its sigmoid output gate, [q | gate] per head), k, v; the zero-centred q/k norms
// (weights given with their offset added), partial RoPE over the first `rotary` dims, the KV write
// and the attention over slots 0..pos, the gate, o_proj. As llama_step: T rows are T one-token
// steps, bit for bit (each row's norms, conv, delta rule and attention a row at a time; the
// linears through their row-exact forms), and `row_states` (empty, or per DeltaNet layer its conv
// window [T, C, K-1] and recurrent state [T, nv, dk, dv]) receives the states after each row: the
// rows chain their states through it (delta_decode_to's out-of-place form), one copy into the
// live states at the end rather than one a row.

inline float sigmoid_f(float x) { return 1.0f / (1.0f + std::exp(-x)); }

// A layer's routed experts (moe.SparseMoe over quant.BlockExperts), each row of x on its own as
// a one-token step computes it: h = norm(x); the router's logits, their softmax over all experts
// in fp32 and the top k (renormalised to sum 1 where norm_topk), by the same ATen ops as the torch
// form; the chosen experts through experts_decode; where the layer has a shared expert (shared
// parts > 0), + sigmoid(h . g) times its SwiGLU (shared_gated; else the SwiGLU itself, Granite
// 4.0-H's shared MLP); x += the sum times `scale` (Granite's residual multiplier; 1: none). params:
// the post-attention norm weight (offset added), the router [E, hidden] fp32, the gate/up/down
// stacks [E, rows, row bytes], their types [tg, tu, td, int8 inputs] (int64); then (shared) its
// gate/up linears, down_proj and (shared_gated) the gate's weight [1, hidden].
void moe_mlp(Tensor& x, Tensor& h, const OptList& params, int64_t& at_, int64_t shared_parts, double eps,
             int64_t top_k, bool norm_topk, bool shared_gated = true, double scale = 1.0) {
  const int64_t Tn = x.size(0), hidden = x.size(1);
  const float* norm = params.get(at_++).value().data_ptr<float>();
  for (int64_t t = 0; t < Tn; ++t)
    rms_norm(x.data_ptr<float>() + t * hidden, norm, h.data_ptr<float>() + t * hidden, hidden, eps);
  const Tensor router = params.get(at_++).value(), gate = params.get(at_++).value(), up = params.get(at_++).value(),
               down = params.get(at_++).value(), types = params.get(at_++).value();
  const int64_t* ty = types.data_ptr<int64_t>();
  TORCH_CHECK(types.numel() == 4 && router.size(1) == hidden && top_k >= 1 && top_k <= router.size(0),
              "hybrid_step: a routed-experts layer's router or expert types");
  Tensor branch = at::empty_like(x);
  for (int64_t t = 0; t < Tn; ++t) {
    const Tensor row = h.narrow(0, t, 1);
    const Tensor probs = at::softmax(at::linear(row, router), -1);
    auto [w, idx] = at::topk(probs, top_k, -1);
    if (norm_topk) w = w / w.sum(-1, true);
    branch.narrow(0, t, 1).copy_(experts_decode(row, gate, up, down, ty[0], ty[1], ty[2], idx, w, ty[3] != 0));
  }
  if (shared_parts > 0) {
    const Tensor s = linear(swiglu_rows(linears(h, params, at_, shared_parts).contiguous()), params, at_);
    if (shared_gated) {
      const Tensor g = params.get(at_++).value();
      for (int64_t t = 0; t < Tn; ++t)  // (the gate a row at a time, as linear() takes an fp32 weight)
        branch.narrow(0, t, 1).add_(at::sigmoid(at::linear(h.narrow(0, t, 1), g)) * s.narrow(0, t, 1));
    } else {
      branch.add_(s);
    }
  }
  if (scale != 1.0) branch.mul_(static_cast<float>(scale));
  add_rows(x, branch);
}

// An OLMo-Hybrid attention layer (olmo_hybrid.OlmoHybridLayer): q and k RMS-normed over all their
// heads together, RoPE over the first R dims (R = 0: NoPE), the attention, o_proj; its output and
// then its MLP's (on the stream itself) each normed before they join the stream. params: q/k/v
// linears, q_norm [H D], k_norm [KVH D], o_proj, the post-attention norm, gate/up linears,
// down_proj, the post-feedforward norm.
void olmo_attention_layer(Tensor& x, Tensor& attn, const float* cos, const float* sin, int64_t cs, const OptList& params,
                          int64_t& at_, const std::vector<Tensor>& caches, int64_t& ci, int64_t pos, double eps,
                          int64_t H, int64_t KVH, int64_t D, int64_t R, float scale, int64_t in_parts, int64_t gu_parts) {
  const int64_t Tn = x.size(0), hidden = x.size(1);
  float* xs = x.data_ptr<float>();
  Tensor qkv = linears(x, params, at_, in_parts).contiguous();
  const int64_t width = qkv.size(1);
  TORCH_CHECK(width == H * D + 2 * KVH * D, "hybrid_step: an OLMo attention layer's projections");
  const float* qw = params.get(at_++).value().data_ptr<float>();
  const float* kw = params.get(at_++).value().data_ptr<float>();
  const Tensor& kc = caches[ci++];
  const Tensor& vc = caches[ci++];
  for (int64_t t = 0; t < Tn; ++t) {
    float* q = qkv.data_ptr<float>() + t * width;
    float* k = q + H * D;
    const float* v = k + KVH * D;
    rms_norm(q, qw, q, H * D, eps);
    rms_norm(k, kw, k, KVH * D, eps);
    for (int64_t i = 0; i < H; ++i) rope(q + i * D, cos + t * cs, sin + t * cs, R);
    for (int64_t i = 0; i < KVH; ++i) rope(k + i * D, cos + t * cs, sin + t * cs, R);
    Tensor out = attn.narrow(0, t, 1);
    attention_kv(q, k, v, kc, vc, pos + t, H, KVH, D, scale, x, out);
  }
  Tensor a = linear(attn, params, at_);
  const float* post_attn = params.get(at_++).value().data_ptr<float>();
  std::vector<float> normed(hidden);
  for (int64_t t = 0; t < Tn; ++t) {
    rms_norm(a.data_ptr<float>() + t * hidden, post_attn, normed.data(), hidden, eps);
    for (int64_t i = 0; i < hidden; ++i) xs[t * hidden + i] += normed[i];
  }
  Tensor m = linear(swiglu_rows(linears(x, params, at_, gu_parts).contiguous()), params, at_);
  const float* post_ff = params.get(at_++).value().data_ptr<float>();
  for (int64_t t = 0; t < Tn; ++t) {
    rms_norm(m.data_ptr<float>() + t * hidden, post_ff, normed.data(), hidden, eps);
    for (int64_t i = 0; i < hidden; ++i) xs[t * hidden + i] += normed[i];
  }
}

// meta: H, KVH, D, rotary (0: none), nk, nv, dk, dv, out_tiled (0/1), top_k, norm_topk (0/1),
// then per layer (kind: 1 DeltaNet, 0 Qwen3.5's gated attention, 2 OLMo-3's post-norm attention;
// its input linears' count; its gate/up linears' count, the shared expert's in a routed layer;
// routed: 1 where the MLP is routed experts, moe_mlp's). params per layer: the input
// norm weight (offset added), the input linears (3 entries each); DeltaNet: conv weight [C, 1, K],
// neg_A, dt_bias, q_norm_w, k_norm_w, norm weight, out_proj; attention: q/k norm weights (offset
// added), o_proj; then the post norm weight (offset added), gate/up linears, down_proj (or
// moe_mlp's params). caches
// per layer: DeltaNet conv window [C, K-1] and recurrent [nv, dk, dv]; attention k, v.
Tensor hybrid_step(const Tensor& x_in, const Tensor& cos_t, const Tensor& sin_t, const OptList& params,
                   const std::vector<Tensor>& caches, const std::vector<int64_t>& meta, int64_t pos, double eps,
                   double lin_eps, double beta_scale, const std::vector<Tensor>& row_states) {
  const int64_t H = meta[0], KVH = meta[1], D = meta[2], R = meta[3];
  const int64_t nk = meta[4], nv = meta[5], dk = meta[6], dv = meta[7];
  const bool tiled = meta[8] != 0;
  const int64_t top_k = meta[9];
  const bool norm_topk = meta[10] != 0;
  constexpr int64_t kGlobal = 11, kPerLayer = 4;
  const int64_t layers = (static_cast<int64_t>(meta.size()) - kGlobal) / kPerLayer;
  const int64_t hidden = x_in.size(1), Tn = x_in.size(0);
  const int64_t key_dim = nk * dk, value_dim = nv * dv, conv_dim = 2 * key_dim + value_dim;
  TORCH_CHECK(D <= 512 && R <= D && R % 2 == 0 && nv % nk == 0, "hybrid_step: head sizes not supported");
  auto [scale, cs, cos, sin, x, h, attn, xs, hs] = step_rows(x_in, cos_t, sin_t, H, D, "hybrid_step");
  int64_t at_ = 0, ci = 0, si = 0;  // the next param, cache, row_states entry
  for (int64_t l = 0; l < layers; ++l) {
    const int64_t* lm = meta.data() + kGlobal + kPerLayer * l;
    const int64_t kind = lm[0], in_parts = lm[1], gu_parts = lm[2];
    const bool routed = lm[3] != 0;
    if (kind == 2) {  // OLMo-3 attention, post-norm: x += norm(attn(x)); x += norm(mlp(x))
      olmo_attention_layer(x, attn, cos, sin, cs, params, at_, caches, ci, pos, eps, H, KVH, D, R, scale,
                           in_parts, gu_parts);
      continue;
    }
    const float* in_norm = params.get(at_++).value().data_ptr<float>();
    for (int64_t t = 0; t < Tn; ++t) rms_norm(xs + t * hidden, in_norm, hs + t * hidden, hidden, eps);
    Tensor branch;
    if (kind == 1) {
      Tensor proj = linears(h, params, at_, in_parts).contiguous();
      TORCH_CHECK(proj.size(1) == conv_dim + value_dim + 2 * nv, "hybrid_step: a DeltaNet layer's projections");
      const Tensor conv_w = params.get(at_++).value(), neg_A = params.get(at_++).value(),
                   dt_bias = params.get(at_++).value(), qn = params.get(at_++).value(),
                   kn = params.get(at_++).value(), norm_w = params.get(at_++).value();
      const Tensor& conv = caches[ci++];
      const Tensor& rec = caches[ci++];
      const Tensor* keep = row_states.empty() ? nullptr : &row_states[si];
      si += 2;
      Tensor outs = at::empty({Tn, value_dim}, x.options());
      for (int64_t t = 0; t < Tn; ++t) {
        const Tensor row = proj[t];
        // keeping the states of each row: row t reads row t-1's (the live ones for the first) and
        // writes its own, the live states left alone until the last row's are copied in below
        const Tensor& conv_in = keep && t ? keep[0][t - 1] : conv;
        const Tensor& rec_in = keep && t ? keep[1][t - 1] : rec;
        Tensor o = delta_decode_to(row.narrow(0, 0, conv_dim), row.narrow(0, conv_dim, value_dim),
                                   row.narrow(0, conv_dim + value_dim, nv), row.narrow(0, conv_dim + value_dim + nv, nv),
                                   t ? conv_in.contiguous() : conv_in, conv_w, t ? rec_in.contiguous() : rec_in, neg_A,
                                   dt_bias, qn, kn, norm_w, lin_eps, nk, nv, dk, dv, beta_scale,
                                   keep ? keep[0].data_ptr<float>() + t * conv.numel() : nullptr,
                                   keep ? keep[1].data_ptr<float>() + t * rec.numel() : nullptr);
        const float* op = o.data_ptr<float>();
        float* dst = outs.data_ptr<float>() + t * value_dim;
        if (tiled) {  // value head kh r + j (HF's grouped order) to out_proj's slot j nk + kh
          const int64_t r = nv / nk;
          for (int64_t kh = 0; kh < nk; ++kh)
            for (int64_t j = 0; j < r; ++j) std::copy(op + (kh * r + j) * dv, op + (kh * r + j + 1) * dv, dst + (j * nk + kh) * dv);
        } else {
          std::copy(op, op + value_dim, dst);
        }
      }
      if (keep) {  // the live states as T steps leave them (a rollback copies an earlier row's: fixed_after)
        conv.copy_(keep[0][Tn - 1]);
        rec.copy_(keep[1][Tn - 1]);
      }
      branch = linear(outs, params, at_);
    } else {
      Tensor qkv = linears(h, params, at_, in_parts).contiguous();
      const int64_t width = qkv.size(1);
      TORCH_CHECK(width == 2 * H * D + 2 * KVH * D, "hybrid_step: an attention layer's projections");
      const float* qw = params.get(at_++).value().data_ptr<float>();
      const float* kw = params.get(at_++).value().data_ptr<float>();
      const Tensor& kc = caches[ci++];
      const Tensor& vc = caches[ci++];
      std::vector<float> q(H * D);
      for (int64_t t = 0; t < Tn; ++t) {
        float* row = qkv.data_ptr<float>() + t * width;
        float* k = row + 2 * H * D;
        const float* v = k + KVH * D;
        for (int64_t i = 0; i < H; ++i) {  // [q | gate] per head: q normed and rotated apart
          rms_norm(row + i * 2 * D, qw, q.data() + i * D, D, eps);
          rope(q.data() + i * D, cos + t * cs, sin + t * cs, R);
        }
        for (int64_t i = 0; i < KVH; ++i) {
          rms_norm(k + i * D, kw, k + i * D, D, eps);
          rope(k + i * D, cos + t * cs, sin + t * cs, R);
        }
        Tensor out = attn.narrow(0, t, 1);
        attention_kv(q.data(), k, v, kc, vc, pos + t, H, KVH, D, scale, x, out);
        float* op = out.data_ptr<float>();
        for (int64_t i = 0; i < H; ++i)
          for (int64_t d = 0; d < D; ++d) op[i * D + d] *= sigmoid_f(row[i * 2 * D + D + d]);
      }
      branch = linear(attn, params, at_);
    }
    add_rows(x, branch);
    if (routed)
      moe_mlp(x, h, params, at_, gu_parts, eps, top_k, norm_topk);
    else
      residual_mlp(x, h, params, at_, gu_parts, eps);
  }
  return x;
}
