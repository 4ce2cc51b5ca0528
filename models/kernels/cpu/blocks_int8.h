// GGUF block products on int8 inputs: block_linear(..., int8=true), the `cpu_int8: on` setting.
// Included by step.cpp inside its namespace, after the fp32 block kernels (f16, ld, scale_min_k4,
// block_shape and kMaxRows are step.cpp's).
//
// Contract: y = x~ W^T, W the blocks' dequantized weights (gguf-py's values), x~ the input rounded
// to int8 per 32 values with one scale, as llama.cpp's CPU kernels round theirs (Q8_0 / Q8_K):
// x~ = q dx, dx = max|x| / 127, q = round(x (127 / max|x|)) to the nearest, ties to even (the rule
// of qplanar.quantized_reference, the CUDA GEMVs' int8 inputs). Per 32 weights (Q6_K: per 16) the
// sum of codes times q is an integer, exact (VNNI's dot products, offsets such as Q4_0's 8 taken
// in the integers), then scaled once in fp32 by d_w dx; the minimum terms of Q4_1 / Q5_1 / Q4_K /
// Q5_K as m (dx sum(q)). tests/test_block_int8.py bounds the result against x~ W^T in fp64.
//
// Why: the fp32 product turns every code into a float (about a dozen vector instructions per 32
// weights); an int8 dot product takes 32 codes in one, so decode of a K-quant file runs at
// llama.cpp's speed, with llama.cpp's rounding of the inputs (bench/RESULTS.md). Off by default:
// the fp32 path gives the dequantized model's own replies.

// x's rows as int8: per row, K codes; per 32 codes their scale dx and dx sum(q); per 16, dx sum(q)
// (Q6_K's halves); per 32, each 4 codes' negated sum times the weights' code offset (Q4_0 8,
// Q5_0 16, Q6_K 32: the dot product's starting value, so that it sums (code - offset) q exactly)
struct Int8Rows {
  std::vector<int8_t> q;
  std::vector<float> dx, s32, s16;
  std::vector<int32_t> init;
  int64_t K = 0, nb = 0;
};

inline int code_offset(int64_t type) {
  return type == kQ4_0 ? 8 : type == kQ5_0 ? 16 : type == kQ6_K ? 32 : 0;
}

Int8Rows quantize_rows(const float* x, int64_t Tn, int64_t K, int offset) {
  Int8Rows r;
  r.K = K;
  r.nb = K / 32;
  r.q.resize(Tn * K);
  r.dx.resize(Tn * r.nb);
  r.s32.resize(Tn * r.nb);
  r.s16.resize(Tn * 2 * r.nb);
  r.init.resize(Tn * K / 4);
  for (int64_t t = 0; t < Tn; ++t)
    for (int64_t b = 0; b < r.nb; ++b) {
      const float* g = x + t * K + 32 * b;
      float amax = 0.f;
      for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(g[j]));
      const float inv = amax > 0.f ? 127.0f / amax : 0.f, d = amax / 127.0f;
      int8_t* q = r.q.data() + t * K + 32 * b;
      int half[2] = {0, 0};
      for (int j = 0; j < 32; ++j) {
        const float v = std::nearbyint(g[j] * inv);  // (round to nearest, ties to even: the default mode)
        q[j] = static_cast<int8_t>(std::clamp(v, -127.f, 127.f));
        half[j / 16] += q[j];
      }
      for (int l = 0; l < 8; ++l)
        r.init[t * K / 4 + 8 * b + l] = -offset * (q[4 * l] + q[4 * l + 1] + q[4 * l + 2] + q[4 * l + 3]);
      r.dx[t * r.nb + b] = d;
      r.s32[t * r.nb + b] = d * static_cast<float>(half[0] + half[1]);
      r.s16[t * 2 * r.nb + 2 * b] = d * static_cast<float>(half[0]);
      r.s16[t * 2 * r.nb + 2 * b + 1] = d * static_cast<float>(half[1]);
    }
  return r;
}

// x~ itself (q dx): where no int8 dot product exists, the fp32 kernels take it (the same contract)
std::vector<float> dequantized_rows(const Int8Rows& r, int64_t Tn) {
  std::vector<float> x(Tn * r.K);
  for (int64_t t = 0; t < Tn; ++t)
    for (int64_t k = 0; k < r.K; ++k) x[t * r.K + k] = static_cast<float>(r.q[t * r.K + k]) * r.dx[t * r.nb + k / 32];
  return x;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define CHAT_INT8_DOT 1

#define CHAT_INLINE __attribute__((always_inline)) inline

// Accumulators for up to kMaxRows rows of x~ (one a row: gemv_rows_i8's two rows at a time are two
// chains), the minimum terms, and a super-block's scales times the inputs' (K-quants)
template <int64_t TN>
struct AccI8 {
  static constexpr int64_t R = TN ? TN : kMaxRows;
  __m256 v[R], minv[R], s8[R];
  __m512 s16[R];
  float mins[R];
  const Int8Rows* x;
  int64_t Tn;

  void start(const Int8Rows& rows, int64_t tn) {
    x = &rows;
    Tn = tn;
    for (int64_t t = 0; t < Tn; ++t) {
      v[t] = minv[t] = _mm256_setzero_ps();
      mins[t] = 0.f;
    }
  }
  float result(int64_t t) const {
    const __m256 s8v = _mm256_add_ps(v[t], minv[t]);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(s8v), _mm256_extractf128_ps(s8v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s))) + mins[t];
  }
  CHAT_INLINE __m256i qx(int64_t t, int64_t b) const {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x->q.data() + t * x->K + 32 * b));
  }
  // (u - offset) . q_b as 8 int32 partial sums (4 codes each) in fp32, for 32 unsigned codes u
  CHAT_INLINE __m256 dot(__m256i u, int64_t t, int64_t b) const {
    const __m256i init = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x->init.data() + t * x->K / 4 + 8 * b));
    return _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(init, u, qx(t, b)));
  }
  // + dw dx_b (u - offset) . q_b: one scale for the block's 32 codes
  CHAT_INLINE void blk(__m256i u, int64_t b, float dw) {
    for (int64_t t = 0; t < (TN ? TN : Tn); ++t)
      v[t] = _mm256_fmadd_ps(dot(u, t, b), _mm256_set1_ps(dw * x->dx[t * x->nb + b]), v[t]);
  }
  // + dw dx_b w . q_b for 32 signed codes w (Q8_0): |w| against q with w's sign
  CHAT_INLINE void blk_signed(__m256i w, int64_t b, float dw) {
    const __m256i u = _mm256_abs_epi8(w);  // (-128 gives 0x80: 128 unsigned, as wanted)
    for (int64_t t = 0; t < (TN ? TN : Tn); ++t) {
      const __m256 p = _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(_mm256_setzero_si256(), u, _mm256_sign_epi8(qx(t, b), w)));
      v[t] = _mm256_fmadd_ps(p, _mm256_set1_ps(dw * x->dx[t * x->nb + b]), v[t]);
    }
  }
  CHAT_INLINE void min_term(int64_t b, float m) {  // + m dx_b sum(q_b)
    for (int64_t t = 0; t < (TN ? TN : Tn); ++t) mins[t] += m * x->s32[t * x->nb + b];
  }
  // Q4_K / Q5_K super-block i: its 8 sub-blocks' scales d sc (ds) times the inputs' dx, kept;
  // and - sum over them of dmin mn (dm) dx sum(q) into the minimum terms
  CHAT_INLINE void k_scales(int64_t i, __m256 ds, __m256 dm) {
    for (int64_t t = 0; t < (TN ? TN : Tn); ++t) {
      s8[t] = _mm256_mul_ps(ds, _mm256_loadu_ps(x->dx.data() + t * x->nb + 8 * i));
      minv[t] = _mm256_fnmadd_ps(dm, _mm256_loadu_ps(x->s32.data() + t * x->nb + 8 * i), minv[t]);
    }
  }
  // + (that scale of sub-block `sub`) (u - offset) . q of super-block i's sub-block `sub`
  CHAT_INLINE void k_blk(__m256i u, int64_t i, int sub) {
    for (int64_t t = 0; t < (TN ? TN : Tn); ++t)
      v[t] = _mm256_fmadd_ps(dot(u, t, 8 * i + sub), _mm256_permutevar8x32_ps(s8[t], _mm256_set1_epi32(sub)), v[t]);
  }
  // Q6_K super-block i: its 16 scales d sc (ds, a scale per 16 codes) times the inputs' dx, kept
  CHAT_INLINE void q6_scales(int64_t i, __m512 ds) {
    const __m512i pairs = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    for (int64_t t = 0; t < (TN ? TN : Tn); ++t)
      s16[t] = _mm512_mul_ps(ds, _mm512_permutexvar_ps(pairs, _mm512_castps256_ps512(
                                     _mm256_loadu_ps(x->dx.data() + t * x->nb + 8 * i))));
  }
  // + (the scales of sub-block k's two halves) (u - 32) . q of super-block i's sub-block k
  CHAT_INLINE void q6_blk(__m256i u, int64_t i, int k) {
    const __m512i lanes = _mm512_setr_epi32(2 * k, 2 * k, 2 * k, 2 * k, 2 * k + 1, 2 * k + 1, 2 * k + 1, 2 * k + 1,
                                            0, 0, 0, 0, 0, 0, 0, 0);
    for (int64_t t = 0; t < (TN ? TN : Tn); ++t)
      v[t] = _mm256_fmadd_ps(dot(u, t, 8 * i + k), _mm512_castps512_ps256(_mm512_permutexvar_ps(lanes, s16[t])), v[t]);
  }
};

inline __m256i nibbles32(__m128i v) {  // 16 bytes' low nibbles then their high ones, as 32 bytes
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), _mm256_set1_epi8(0x0F));
}

// Q4_K / Q5_K: the 8 6-bit scales (sc) and minimums (mn) of 12 packed bytes, as bytes of sc[0..1]
// and mn[0..1] (scale_min_k4's values, all at once)
inline void scales_mins_k4(const uint8_t* q, uint32_t sc[2], uint32_t mn[2]) {
  uint32_t u[3];
  std::memcpy(u, q, 12);
  constexpr uint32_t k6 = 0x3f3f3f3f, k4 = 0x0f0f0f0f, k2 = 0x03030303;
  sc[0] = u[0] & k6;
  sc[1] = (u[2] & k4) | (((u[0] >> 6) & k2) << 4);
  mn[0] = u[1] & k6;
  mn[1] = ((u[2] >> 4) & k4) | (((u[1] >> 6) & k2) << 4);
}

inline __m256 bytes8_ps(const uint32_t w[2]) {  // 8 unsigned bytes as floats
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_set_epi32(0, 0, static_cast<int>(w[1]), static_cast<int>(w[0]))));
}

// One unit of a row (a 32-weight block, or a 256-weight super-block: 32-blocks 8 i ...) into a
template <int64_t T, int64_t TN>
CHAT_INLINE void row_unit_i8(const uint8_t* b, int64_t i, AccI8<TN>& a) {
  if constexpr (T == kQ8_0) {
    a.blk_signed(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2)), i, f16(b));
  } else if constexpr (T == kQ4_0 || T == kQ4_1 || T == kQ5_0 || T == kQ5_1) {
    constexpr int off = T == kQ4_0 ? 2 : T == kQ4_1 ? 4 : T == kQ5_0 ? 6 : 8;
    __m256i u = nibbles32(ld(b + off));
    if constexpr (T == kQ5_0 || T == kQ5_1) {
      uint32_t qh;
      std::memcpy(&qh, b + off - 4, 4);
      u = _mm256_mask_add_epi8(u, static_cast<__mmask32>(qh), u, _mm256_set1_epi8(16));
    }
    a.blk(u, i, f16(b));
    if constexpr (T == kQ4_1 || T == kQ5_1) a.min_term(i, f16(b + 2));
  } else if constexpr (T == kQ4_K || T == kQ5_K) {
    uint32_t sc[2], mn[2];
    scales_mins_k4(b + 4, sc, mn);
    a.k_scales(i, _mm256_mul_ps(bytes8_ps(sc), _mm256_set1_ps(f16(b))),
               _mm256_mul_ps(bytes8_ps(mn), _mm256_set1_ps(f16(b + 2))));
    const uint8_t* qs = b + (T == kQ5_K ? 48 : 16);
    __m256i h = _mm256_setzero_si256();
    if constexpr (T == kQ5_K) h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16));
    for (int p = 0; p < 4; ++p) {  // sub-blocks 2p (low nibbles) and 2p + 1 (high) of 32 bytes
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * p));
      __m256i q[2] = {_mm256_and_si256(v, _mm256_set1_epi8(0x0F)),
                      _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F))};
      for (int e = 0; e < 2; ++e) {
        const int sub = 2 * p + e;
        if constexpr (T == kQ5_K)
          q[e] = _mm256_mask_add_epi8(q[e], _mm256_test_epi8_mask(h, _mm256_set1_epi8(static_cast<char>(1 << sub))),
                                      q[e], _mm256_set1_epi8(16));
        a.k_blk(q[e], i, sub);
      }
    }
  } else if constexpr (T == kQ6_K) {
    a.q6_scales(i, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(ld(b + 192))), _mm512_set1_ps(f16(b + 208))));
    for (int h = 0; h < 2; ++h) {
      const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h));
      for (int c = 0; c < 2; ++c) {
        const __m256i l = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * h + 32 * c));
        for (int s2 = 0; s2 < 2; ++s2) {  // sub-block k = 4 h + r: the unsigned 6-bit codes (offset 32)
          const int r = c + 2 * s2;
          const __m256i lo = s2 ? _mm256_srli_epi16(l, 4) : l;
          const __m256i hi = r < 2 ? _mm256_slli_epi16(hb, 4 - 2 * r) : r == 2 ? hb : _mm256_srli_epi16(hb, 2);
          const __m256i u = _mm256_and_si256(_mm256_ternarylogic_epi32(_mm256_set1_epi8(0x0F), lo, hi, 0xCA),
                                             _mm256_set1_epi8(0x3F));
          a.q6_blk(u, i, 4 * h + r);
        }
      }
    }
  }
}

template <int64_t T, int64_t TN>
void gemv_rows_i8(const Int8Rows& x, int64_t Tn_, const uint8_t* w, int64_t row_bytes, int64_t N, int64_t n0,
                  int64_t n1, float* y) {
  constexpr bool kq = T == kQ4_K || T == kQ5_K || T == kQ6_K;
  const int64_t units = kq ? x.K / 256 : x.nb, ub = block_shape(T).bytes;
  const int64_t Tn = TN ? TN : Tn_;
  int64_t n = n0;
  if constexpr (TN == 1) {  // two rows at a time, the rows kAheadRows on prefetched (as gemv_rows_avx512)
    for (; n + 2 <= n1; n += 2) {
      const uint8_t* b0 = w + n * row_bytes;
      const uint8_t* b1 = b0 + row_bytes;
      const char* ahead = reinterpret_cast<const char*>(b0 + kAheadRows * row_bytes);
      const bool prefetch = n + kAheadRows + 2 <= n1;
      if (!kq && prefetch)
        for (int64_t o = 0; o < 2 * row_bytes; o += 64) _mm_prefetch(ahead + o, _MM_HINT_T0);
      AccI8<TN> a0, a1;
      a0.start(x, Tn);
      a1.start(x, Tn);
      for (int64_t i = 0; i < units; ++i) {
        if (kq && prefetch)
          for (int64_t o = 2 * i * ub; o < 2 * (i + 1) * ub + 64; o += 64) _mm_prefetch(ahead + o, _MM_HINT_T0);
        row_unit_i8<T, TN>(b0 + i * ub, i, a0);
        row_unit_i8<T, TN>(b1 + i * ub, i, a1);
      }
      y[n] = a0.result(0);
      y[n + 1] = a1.result(0);
    }
  }
  for (; n < n1; ++n) {
    const uint8_t* b = w + n * row_bytes;
    AccI8<TN> a;
    a.start(x, Tn);
    for (int64_t i = 0; i < units; ++i) row_unit_i8<T, TN>(b + i * ub, i, a);
    for (int64_t t = 0; t < Tn; ++t) y[t * N + n] = a.result(t);
  }
}
#endif
