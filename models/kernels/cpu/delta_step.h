// The Gated DeltaNet decode step of one layer after its input projections, fp32: delta_decode.
// Included by step.cpp inside its namespace (rms_norm is step.cpp's).
//
// Contract: what qwen3_5.GatedDeltaNet's torch form computes for one token (T == 1) between its
// projections and out_proj, the states updated in place, up to fp32 summation order:
//   - the causal conv's step (causal_conv.conv_step: the window times the weights, the window
//     shifted by one), then SiLU;
//   - q, k l2-normed and scaled (l2norm_scaled: rms_norm with the constant weights q_norm_w,
//     k_norm_w and eps 1e-6 / dk), each key head serving nv / nk consecutive value heads;
//   - beta = sigmoid(b) (times beta_scale), g = neg_A softplus(a + dt_bias) (torch's softplus:
//     x past 20 as x);
//   - per value head the delta rule (gated_delta.step): S = exp(g) S; S += k ((v - k^T S) beta)^T;
//     out = q^T S;
//   - the gated norm: rms_norm(out, norm_w, eps) * SiLU(z) per head.
// tests/kernels/test_delta_cpu.py compares it with the torch form over several steps from a non-zero state.
//
// Why: the torch form is dozens of small ops a layer, every delta layer of every token (a
// Qwen3.5-0.8B-like file: bench/hybrid_gguf.py); here one call, the heads in parallel.

inline float silu_f(float x) { return x / (1.0f + std::exp(-x)); }

// One token through a depthwise causal conv of width K over C channels, then SiLU (causal_conv.
// conv_step): x[c] = SiLU(window . w[c, :K-1] + xin[c] w[c, K-1] (+ bias[c])); the window (cs,
// [C, K-1]) shifted by one into co, which may be cs itself. Delta and Mamba2 layers' steps.
inline void conv_step_silu(const float* xin, const float* cs, float* co, const float* w, const float* bias, int64_t C,
                           int64_t K, float* x) {
  for (int64_t c = 0; c < C; ++c) {
    float s = 0.f;
    for (int64_t j = 0; j < K - 1; ++j) s += cs[c * (K - 1) + j] * w[c * K + j];
    s += xin[c] * w[c * K + K - 1];
    if (bias) s += bias[c];
    for (int64_t j = 0; j + 1 < K - 1; ++j) co[c * (K - 1) + j] = cs[c * (K - 1) + j + 1];
    if (K > 1) co[c * (K - 1) + K - 2] = xin[c];
    x[c] = silu_f(s);
  }
}

// conv_out, rec_out: where the updated states go (null: in place, into conv_state and rec; else
// conv_state and rec are only read: a verify's row chains its states through buffers of its own,
// hybrid_step.h). The same operations either way.
Tensor delta_decode_to(const Tensor& mixed_, const Tensor& z_, const Tensor& b_, const Tensor& a_,
                       const Tensor& conv_state, const Tensor& conv_w_, const Tensor& rec, const Tensor& neg_A_,
                       const Tensor& dt_bias_, const Tensor& q_norm_w_, const Tensor& k_norm_w_, const Tensor& norm_w_,
                       double norm_eps, int64_t nk, int64_t nv, int64_t dk, int64_t dv, double beta_scale,
                       float* conv_out, float* rec_out) {
  const int64_t key_dim = nk * dk, value_dim = nv * dv, C = 2 * key_dim + value_dim;
  for (const Tensor* t : {&mixed_, &z_, &b_, &a_, &conv_state, &conv_w_, &rec, &neg_A_, &dt_bias_, &q_norm_w_,
                          &k_norm_w_, &norm_w_})
    TORCH_CHECK(t->scalar_type() == at::kFloat && !t->is_cuda(), "delta_decode: fp32 CPU tensors");
  TORCH_CHECK(mixed_.numel() == C && z_.numel() == value_dim && b_.numel() == nv && a_.numel() == nv,
              "delta_decode: one token's projections");
  TORCH_CHECK(conv_state.is_contiguous() && conv_state.size(0) == C && rec.is_contiguous() && rec.numel() == nv * dk * dv,
              "delta_decode: the layer's states");
  TORCH_CHECK(nv % nk == 0 && conv_w_.numel() == C * (conv_state.size(1) + 1), "delta_decode: shapes");
  const Tensor mixed = mixed_.contiguous(), z = z_.contiguous(), b = b_.contiguous(), a = a_.contiguous(),
               conv_w = conv_w_.contiguous(), neg_A = neg_A_.contiguous(), dt_bias = dt_bias_.contiguous(),
               q_norm_w = q_norm_w_.contiguous(), k_norm_w = k_norm_w_.contiguous(), norm_w = norm_w_.contiguous();
  const int64_t K = conv_state.size(1) + 1;
  // the conv's step and SiLU, the window shifted
  std::vector<float> x(C);
  conv_step_silu(mixed.data_ptr<float>(), conv_state.data_ptr<float>(), conv_out ? conv_out : conv_state.data_ptr<float>(),
                 conv_w.data_ptr<float>(), nullptr, C, K, x.data());
  // q and k normed per key head
  std::vector<float> qn(key_dim), kn(key_dim);
  for (int64_t h = 0; h < nk; ++h) {
    rms_norm(x.data() + h * dk, q_norm_w.data_ptr<float>(), qn.data() + h * dk, dk, 1e-6 / static_cast<double>(dk));
    rms_norm(x.data() + key_dim + h * dk, k_norm_w.data_ptr<float>(), kn.data() + h * dk, dk,
             1e-6 / static_cast<double>(dk));
  }
  Tensor out = at::empty({1, value_dim}, mixed.options());
  float* o = out.data_ptr<float>();
  const float* S0 = rec.data_ptr<float>();
  float* S1 = rec_out ? rec_out : rec.data_ptr<float>();
  const float *bp = b.data_ptr<float>(), *ap = a.data_ptr<float>(), *zp = z.data_ptr<float>();
  const float *nA = neg_A.data_ptr<float>(), *dtb = dt_bias.data_ptr<float>(), *nw = norm_w.data_ptr<float>();
  const int64_t rep = nv / nk;
  at::parallel_for(0, nv, 1, [&](int64_t h0, int64_t h1) {
    std::vector<float> kv(dv), delta(dv), acc(dv);
    for (int64_t h = h0; h < h1; ++h) {
      const float* q = qn.data() + (h / rep) * dk;
      const float* k = kn.data() + (h / rep) * dk;
      const float* v = x.data() + 2 * key_dim + h * dv;
      float beta = 1.0f / (1.0f + std::exp(-bp[h]));
      if (beta_scale != 1.0) beta *= static_cast<float>(beta_scale);
      const float sp_in = ap[h] + dtb[h];
      const float sp = sp_in > 20.f ? sp_in : std::log1p(std::exp(sp_in));
      const float decay = std::exp(nA[h] * sp);
      const float* Sin = S0 + h * dk * dv;
      float* S = S1 + h * dk * dv;
      std::fill(kv.begin(), kv.end(), 0.f);
      for (int64_t i = 0; i < dk; ++i) {  // S = decay S; kv = k^T S
        const float* in = Sin + i * dv;
        float* row = S + i * dv;
        const float ki = k[i];
        for (int64_t j = 0; j < dv; ++j) {
          row[j] = in[j] * decay;
          kv[j] += ki * row[j];
        }
      }
      for (int64_t j = 0; j < dv; ++j) delta[j] = (v[j] - kv[j]) * beta;
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t i = 0; i < dk; ++i) {  // S += k delta^T; out = q^T S
        float* row = S + i * dv;
        const float ki = k[i], qi = q[i];
        for (int64_t j = 0; j < dv; ++j) {
          row[j] += ki * delta[j];
          acc[j] += qi * row[j];
        }
      }
      rms_norm(acc.data(), nw, o + h * dv, dv, norm_eps);
      for (int64_t j = 0; j < dv; ++j) o[h * dv + j] *= silu_f(zp[h * dv + j]);
    }
  });
  return out;
}

Tensor delta_decode(const Tensor& mixed, const Tensor& z, const Tensor& b, const Tensor& a, const Tensor& conv_state,
                    const Tensor& conv_w, const Tensor& rec, const Tensor& neg_A, const Tensor& dt_bias,
                    const Tensor& q_norm_w, const Tensor& k_norm_w, const Tensor& norm_w, double norm_eps, int64_t nk,
                    int64_t nv, int64_t dk, int64_t dv, double beta_scale) {
  return delta_decode_to(mixed, z, b, a, conv_state, conv_w, rec, neg_A, dt_bias, q_norm_w, k_norm_w, norm_w, norm_eps,
                         nk, nv, dk, dv, beta_scale, nullptr, nullptr);
}
