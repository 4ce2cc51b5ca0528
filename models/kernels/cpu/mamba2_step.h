// The Mamba2 mixer's decode step of one layer after its input projection, fp32: mamba2_decode.
// Included by step.cpp inside its namespace (rms_norm is step.cpp's; silu_f and conv_step_silu
// delta_step.h's).
//
// Contract: what mamba2.Mamba2Mixer's torch form computes for one token (T == 1) between in_proj
// and out_proj, the states updated in place, up to fp32 summation order:
//   - zxbcdt split into z [H P], xBC [H P + 2 G N], dt [H];
//   - the causal conv's step over xBC (causal_conv.conv_step: the window times the weights, plus
//     the bias where there is one; the window shifted by one), then SiLU; x [H, P], B, C [G, N];
//   - dt = clamp(softplus(dt + dt_bias), dt_min, dt_max) (torch's softplus: x past 20 as x);
//   - per head h of group g (H / G consecutive heads a group) the scan step (mamba2.step):
//     S = exp(dt A) S + (dt x) B^T; y = S C + D x;
//   - the gated norm (GroupedGatedRMSNorm): rms_norm over each group's channels of y * SiLU(z),
//     times the weight.
// Returns [1, H P]. tests/kernels/test_mamba2_cpu.py compares it with the torch form over several steps
// from a non-zero state.
//
// Why: the torch form is about twenty dispatched ops a layer between the projections (split,
// conv step and window shift, SiLU, softplus and clamp, the scan's decay, update and read, the
// gate and the grouped norm), every Mamba2 layer of every token; here one call, the heads in
// parallel (bench/cpu_block_bench.py --mamba2).

// conv_out, ssm_out: where the updated states go (null: in place, into conv_state and ssm; else
// those are only read: a verify's row chains its states through buffers of its own,
// mamba2_hybrid_step.h). The same operations either way.
Tensor mamba2_decode_to(const Tensor& zxbcdt_, const Tensor& conv_state, const Tensor& conv_w_,
                        const std::optional<Tensor>& conv_b_, const Tensor& ssm, const Tensor& A_, const Tensor& dt_bias_,
                        const Tensor& D_, const Tensor& norm_w_, double norm_eps, double dt_min, double dt_max, int64_t H,
                        int64_t P, int64_t N, int64_t G, float* conv_out, float* ssm_out) {
  const int64_t inner = H * P, C = inner + 2 * G * N;
  for (const Tensor* t : {&zxbcdt_, &conv_state, &conv_w_, &ssm, &A_, &dt_bias_, &D_, &norm_w_})
    TORCH_CHECK(t->scalar_type() == at::kFloat && !t->is_cuda(), "mamba2_decode: fp32 CPU tensors");
  TORCH_CHECK(G > 0 && H % G == 0 && inner % G == 0, "mamba2_decode: heads in whole groups");
  TORCH_CHECK(zxbcdt_.numel() == inner + C + H, "mamba2_decode: one token's projection");
  TORCH_CHECK(conv_state.is_contiguous() && conv_state.dim() == 2 && conv_state.size(0) == C,
              "mamba2_decode: the layer's conv window [C, K-1]");
  TORCH_CHECK(ssm.is_contiguous() && ssm.numel() == H * P * N, "mamba2_decode: the layer's ssm state [H, P, N]");
  const int64_t K = conv_state.size(1) + 1;
  TORCH_CHECK(conv_w_.numel() == C * K && A_.numel() == H && dt_bias_.numel() == H && D_.numel() == H &&
              norm_w_.numel() == inner, "mamba2_decode: parameter shapes");
  const Tensor zx = zxbcdt_.contiguous(), conv_w = conv_w_.contiguous(), A = A_.contiguous(),
               dt_bias = dt_bias_.contiguous(), D = D_.contiguous(), norm_w = norm_w_.contiguous();
  Tensor conv_b;
  if (conv_b_.has_value() && conv_b_->defined()) {
    TORCH_CHECK(conv_b_->scalar_type() == at::kFloat && conv_b_->numel() == C, "mamba2_decode: the conv's bias");
    conv_b = conv_b_->contiguous();
  }
  const float* z = zx.data_ptr<float>();
  const float* xin = z + inner;
  const float* dtin = xin + C;
  // the conv's step and SiLU, the window shifted
  std::vector<float> xbc(C);
  float* cs = conv_state.data_ptr<float>();
  conv_step_silu(xin, cs, conv_out ? conv_out : cs, conv_w.data_ptr<float>(), conv_b.defined() ? conv_b.data_ptr<float>() : nullptr, C, K,
                 xbc.data());
  const float* x = xbc.data();
  const float* B = x + inner;
  const float* Cm = B + G * N;
  Tensor out = at::empty({1, inner}, zx.options());
  float* y = out.data_ptr<float>();
  const float* S0 = ssm.data_ptr<float>();
  float* S1 = ssm_out ? ssm_out : ssm.data_ptr<float>();
  const float *Ap = A.data_ptr<float>(), *dtb = dt_bias.data_ptr<float>(), *Dp = D.data_ptr<float>();
  const float lo = static_cast<float>(dt_min), hi = static_cast<float>(dt_max);
  const int64_t rep = H / G;
  at::parallel_for(0, H, 1, [&](int64_t h0, int64_t h1) {
    for (int64_t h = h0; h < h1; ++h) {
      const float sp_in = dtin[h] + dtb[h];
      const float dt = std::min(std::max(sp_in > 20.f ? sp_in : std::log1p(std::exp(sp_in)), lo), hi);
      const float decay = std::exp(dt * Ap[h]);
      const float* b = B + (h / rep) * N;
      const float* c = Cm + (h / rep) * N;
      for (int64_t p = 0; p < P; ++p) {
        const float* prev = S0 + (h * P + p) * N;
        float* row = S1 + (h * P + p) * N;
        const float xdt = dt * x[h * P + p];
        // the update, then the read by step.cpp's lane-wise dot: one loop with the read's running
        // sum in it is a chain of dependent adds the compiler may not vectorise
        for (int64_t n = 0; n < N; ++n) row[n] = prev[n] * decay + xdt * b[n];
        y[h * P + p] = dot(row, c, N) + Dp[h] * x[h * P + p];
      }
    }
  });
  // the gate and the grouped norm
  const int64_t gsize = inner / G;
  std::vector<float> g(inner);
  for (int64_t i = 0; i < inner; ++i) g[i] = y[i] * silu_f(z[i]);
  const float* nw = norm_w.data_ptr<float>();
  for (int64_t k = 0; k < G; ++k) rms_norm(g.data() + k * gsize, nw + k * gsize, y + k * gsize, gsize, norm_eps);
  return out;
}

Tensor mamba2_decode(const Tensor& zxbcdt, const Tensor& conv_state, const Tensor& conv_w,
                     const std::optional<Tensor>& conv_b, const Tensor& ssm, const Tensor& A, const Tensor& dt_bias,
                     const Tensor& D, const Tensor& norm_w, double norm_eps, double dt_min, double dt_max, int64_t H,
                     int64_t P, int64_t N, int64_t G) {
  return mamba2_decode_to(zxbcdt, conv_state, conv_w, conv_b, ssm, A, dt_bias, D, norm_w, norm_eps, dt_min, dt_max, H, P,
                          N, G, nullptr, nullptr);
}
