// GGUF block products on int8 inputs: block_linear(..., int8=true), the `cpu_int8: on` setting.
// Included by step.cpp inside its namespace, after the fp32 block kernels (f16, ld, scale_min_k4,
// block_shape and kMaxRows are step.cpp's).
//
// Contract: y = x~ W^T, W the blocks' dequantized weights (gguf-py's values), x~ the input rounded
// to int8 as llama.cpp's CPU kernels round it for that weight type (ggml's vec_dot_type), so that
// the integer sums are llama.cpp's own:
// - Q4_K / Q5_K / Q6_K (Q8_K): per 256 inputs, m the one of largest |x| (the first of equals),
//   iscale = -127 / m, q = min(127, round(iscale x)) to the nearest, ties to even, x~ = q / iscale
//   (quantize_row_q8_K_ref);
// - the 32-weight types (Q8_0 / Q8_1): per 32, q = round(x (127 / max|x|)), ties to even, x~ = q dx
//   with dx = max|x| / 127 rounded to fp16 (quantize_row_q8_0 / _q8_1's AVX forms). Q4_1 / Q5_1's
//   minimum terms are m dx sum(q), x~'s own (llama.cpp's Q8_1 rounds dx sum(q) to fp16 again,
//   which overflows to inf once a block's inputs sum past 65504).
// The sums of codes times q are integers, exact: K-quants' over a super-block with the sub-block
// scales multiplied in (maddubs, then a 16-bit dot product with the scales: llama.cpp's form),
// Q6_K's offset 32 and the minimum terms through the 16-input sums of q; the 32-weight types' per
// block (VNNI, offsets such as Q4_0's 8 taken in the integers). Each is scaled once in fp32.
// tests/kernels/test_block_int8.py bounds the result against x~ W^T in fp64.
//
// Why: the fp32 product turns every code into a float (about a dozen vector instructions per 32
// weights); an int8 dot product takes 32 codes in one, so decode of a K-quant file runs at
// llama.cpp's speed, with llama.cpp's rounding of the inputs, and prefill's rows, eight at a time,
// share each decoded block in place of a dequantized fp32 GEMM (bench/cpu_block_bench.py). Off by
// default: the fp32 path gives the dequantized model's own replies.

constexpr bool k_type(int64_t type) { return type == kQ4_K || type == kQ5_K || type == kQ6_K; }

inline float fp16_rounded(float v) {  // to the nearest fp16, ties to even (GGML_CPU_FP32_TO_FP16)
  return static_cast<float>(c10::Half(v));
}

// x's rows as int8: per row, K codes. K-quants: per 256 codes the scale (1 / iscale), per 16 the
// sum of q. The 32-weight types: per 32 codes the scale dx and dx sum(q), and each 4 codes'
// negated sum times the weights' code offset (Q4_0 8, Q5_0 16, Q8_0 128: the dot product's
// starting value, so that it sums (code - offset) q exactly)
struct Int8Rows {
  std::vector<int8_t> q;
  std::vector<float> dx, s32, dx8;  // dx8 (32-weight types, several rows): each dx 8 times, lane by lane
  std::vector<int16_t> bsums;
  std::vector<int32_t> init;
  std::vector<int32_t> sum;  // (32-weight types) each block's sum(q): the tiled Q4_0's offset term
  int64_t K = 0, nb = 0;  // nb: scales a row (K / 256 or K / 32)
};

// (Q8_0's 128: prefill's unsigned codes, gemm_rows_pairs; decode takes Q8_0's signs instead)
inline int code_offset(int64_t type) { return type == kQ4_0 ? 8 : type == kQ5_0 ? 16 : type == kQ8_0 ? 128 : 0; }

// Each block of 32 inputs of x's Tn rows (the rows in parallel), rounded: f(t, b, amax, q, sum),
// q[j] = x (top / max|x|) to the nearest, ties to even (the default mode), within +-top, sum = sum(q)
template <typename Code, typename F>
void each_rounded_block(const float* x, int64_t Tn, int64_t K, float top, F&& f) {
  at::parallel_for(0, Tn, 1, [&](int64_t ta, int64_t tb) {
    for (int64_t t = ta; t < tb; ++t)
      for (int64_t b = 0; b < K / 32; ++b) {
        const float* g = x + t * K + 32 * b;
        float amax = 0.f;
        for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(g[j]));
        const float inv = amax != 0.f ? top / amax : 0.f;
        Code q[32];
        int sum = 0;
        for (int j = 0; j < 32; ++j) {
          q[j] = static_cast<Code>(std::clamp(std::nearbyint(g[j] * inv), -top, top));
          sum += q[j];
        }
        f(t, b, amax, q, sum);
      }
  });
}

Int8Rows quantize_rows(const float* x, int64_t Tn, int64_t K, int64_t type) {
  Int8Rows r;
  r.K = K;
  r.q.resize(Tn * K);
  if (k_type(type)) {  // Q8_K
    r.nb = K / 256;
    r.dx.resize(Tn * r.nb);
    r.bsums.resize(Tn * K / 16);
    at::parallel_for(0, Tn, 1, [&](int64_t ta, int64_t tb) {  // (a prefill's rows: each row on its own)
    for (int64_t t = ta; t < tb; ++t)
      for (int64_t b = 0; b < r.nb; ++b) {
        const float* g = x + t * K + 256 * b;
        int8_t* q = r.q.data() + t * K + 256 * b;
        int16_t* bs = r.bsums.data() + t * K / 16 + 16 * b;
        float amax = 0.f, mx = 0.f;
        for (int j = 0; j < 256; ++j)
          if (std::fabs(g[j]) > amax) {
            amax = std::fabs(g[j]);
            mx = g[j];
          }
        if (amax == 0.f) {
          std::memset(q, 0, 256);
          std::memset(bs, 0, 32);
          r.dx[t * r.nb + b] = 0.f;
          continue;
        }
        const float iscale = -127.f / mx;
        for (int j = 0; j < 256; ++j) q[j] = static_cast<int8_t>(std::min(127.f, std::nearbyint(iscale * g[j])));
        for (int j = 0; j < 16; ++j) {
          int s = 0;
          for (int l = 0; l < 16; ++l) s += q[16 * j + l];
          bs[j] = static_cast<int16_t>(s);
        }
        r.dx[t * r.nb + b] = 1.f / iscale;
      }
    });
    return r;
  }
  const int offset = code_offset(type);
  r.nb = K / 32;
  r.dx.resize(Tn * r.nb);
  r.s32.resize(Tn * r.nb);
  r.init.resize(Tn * K / 4);
  r.sum.resize(Tn * r.nb);
  each_rounded_block<int8_t>(x, Tn, K, 127.f, [&](int64_t t, int64_t b, float amax, const int8_t* q, int sum) {
    std::copy(q, q + 32, r.q.data() + t * K + 32 * b);
    for (int l = 0; l < 8; ++l)
      r.init[t * K / 4 + 8 * b + l] = -offset * (q[4 * l] + q[4 * l + 1] + q[4 * l + 2] + q[4 * l + 3]);
    r.dx[t * r.nb + b] = fp16_rounded(amax / 127.0f);
    r.sum[t * r.nb + b] = sum;
    r.s32[t * r.nb + b] = r.dx[t * r.nb + b] * static_cast<float>(sum);
  });
  if (Tn > 1) {
    r.dx8.resize(Tn * r.nb * 8);
    for (int64_t i = 0; i < Tn * r.nb; ++i) std::fill_n(r.dx8.data() + 8 * i, 8, r.dx[i]);
  }
  return r;
}

// x~ itself: where no int8 dot product exists, the fp32 kernels take it (the same contract)
std::vector<float> dequantized_rows(const Int8Rows& r, int64_t Tn) {
  std::vector<float> x(Tn * r.K);
  const int64_t per = r.nb ? r.K / r.nb : 1;  // (K = 0: no rows to fill)
  at::parallel_for(0, Tn, 1, [&](int64_t ta, int64_t tb) {
    for (int64_t t = ta; t < tb; ++t)
      for (int64_t k = 0; k < r.K; ++k) x[t * r.K + k] = static_cast<float>(r.q[t * r.K + k]) * r.dx[t * r.nb + k / per];
  });
  return x;
}

#if defined(__AVX2__)
#define CHAT_INLINE __attribute__((always_inline)) inline

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// What every accumulator below reads: x~'s rows [t0, t0 + Tn), its sums zeroed by the caller's start()
struct RowsOf {
  const Int8Rows* x;
  int64_t Tn, t0;
  void bind(const Int8Rows& rows, int64_t tn, int64_t first) {
    x = &rows;
    Tn = tn;
    t0 = first;
  }
};

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

#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__) && \
    defined(__AVX512VNNI__)
#define CHAT_INT8_DOT 1

// The 32-weight types' dot products of 32 codes with q, 8 lanes of 4 (VNNI): (u - offset) . q with
// the offsets' sums as the starting value; a signed w's |w| against q with w's sign (Q8_0)
CHAT_INLINE __m256i dot_from(__m256i init, __m256i u, __m256i q) { return _mm256_dpbusd_epi32(init, u, q); }
CHAT_INLINE __m256i dot_signed(__m256i w, __m256i q) {
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_abs_epi8(w), _mm256_sign_epi8(q, w));
}

// The K-quants' accumulators: per row of x~, d dx (the super-block's integer sum) in 16 lanes, and
// the minimum terms (Q4_K / Q5_K: dmin dx sum over sub-blocks of m sum(q)) in 8, subtracted;
// without kMins, those are left to the caller (prefill's sum_terms)
template <int64_t TN, bool kMins = true>
struct AccK : RowsOf {
  static constexpr int64_t R = TN ? TN : kMaxRows;
  __m512 v[R];
  __m256 m[R];

  void start(const Int8Rows& rows, int64_t tn, int64_t first) {
    bind(rows, tn, first);
    std::fill_n(v, Tn, _mm512_setzero_ps());
    std::fill_n(m, Tn, _mm256_setzero_ps());
  }
  float result(int64_t t) const { return _mm512_reduce_add_ps(v[t]) - hsum(m[t]); }
  // super-block i: the codes u[4] (64 each, inputs 64 p ..) times q, each pair of products times
  // the 16-bit scales s[4] (a scale per 16 or 32 codes, lane by lane), summed as integers; offset
  // (Q6_K) the 16 scales against which sum(q) per 16 is subtracted 32 times; mins (Q4_K / Q5_K)
  // each sub-block's minimum twice, against the same sums
  template <bool Q6>
  CHAT_INLINE void unit(const __m512i u[4], const __m512i s[4], __m256i by16, int64_t i, float d, float dmin) {
    for (int64_t t = 0; t < (TN ? TN : Tn); ++t) {
      const int64_t row = t0 + t;
      const int8_t* q = x->q.data() + row * x->K + 256 * i;
      __m512i isum = _mm512_setzero_si512();
      for (int p = 0; p < 4; ++p)
        isum = _mm512_dpwssd_epi32(isum, _mm512_maddubs_epi16(u[p], _mm512_loadu_si512(q + 64 * p)), s[p]);
      const float dx = x->dx[row * x->nb + i];
      if constexpr (Q6 || kMins) {
        const __m256i bs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x->bsums.data() + row * x->K / 16 + 16 * i));
        const __m256i by = _mm256_madd_epi16(bs, by16);
        if constexpr (Q6)
          isum = _mm512_sub_epi32(isum, _mm512_zextsi256_si512(_mm256_slli_epi32(by, 5)));
        else
          m[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(by), _mm256_set1_ps(dmin * dx), m[t]);
      }
      v[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_set1_ps(d * dx), v[t]);
    }
  }
};

// lanes 0-15 of 16-bit lane index j, lanes 16-31 of j + 1 (a scale vector per two 32-code halves)
inline __m512i pick16(int j) {
  return _mm512_add_epi16(_mm512_set1_epi16(static_cast<int16_t>(j)),
                          _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(1), 1));
}

// One unit of a row (a 32-weight block, or a 256-weight super-block) into a's sums
template <int64_t T, typename A>
CHAT_INLINE void row_unit_i8(const uint8_t* b, int64_t i, A& a) {
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
    const __m128i sc8 = _mm_set_epi32(0, 0, static_cast<int>(sc[1]), static_cast<int>(sc[0]));
    const __m128i mn8 = _mm_set_epi32(0, 0, static_cast<int>(mn[1]), static_cast<int>(mn[0]));
    const __m512i scales = _mm512_castsi128_si512(_mm_cvtepu8_epi16(sc8));
    const __m256i mins = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(mn8, mn8));  // each sub-block's twice
    const uint8_t* qs = b + (T == kQ5_K ? 48 : 16);
    __m256i h = _mm256_setzero_si256();
    if constexpr (T == kQ5_K) h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16));
    __m512i u[4], s[4];
    for (int p = 0; p < 4; ++p) {  // sub-blocks 2p (32 bytes' low nibbles) and 2p + 1 (high)
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * p));
      u[p] = _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(v), _mm256_srli_epi16(v, 4), 1),
                              _mm512_set1_epi8(0x0F));
      if constexpr (T == kQ5_K) {
        const uint64_t hi = (static_cast<uint64_t>(_mm256_test_epi8_mask(h, _mm256_set1_epi8(static_cast<char>(2 << (2 * p))))) << 32) |
                            _mm256_test_epi8_mask(h, _mm256_set1_epi8(static_cast<char>(1 << (2 * p))));
        u[p] = _mm512_mask_add_epi8(u[p], hi, u[p], _mm512_set1_epi8(16));
      }
      s[p] = _mm512_permutexvar_epi16(pick16(2 * p), scales);
    }
    a.template unit<false>(u, s, mins, i, f16(b), f16(b + 2));
  } else if constexpr (T == kQ6_K) {
    const __m512i scales = _mm512_castsi256_si512(_mm256_cvtepi8_epi16(ld(b + 192)));  // 16, one a 16 codes
    __m512i u[4], s[4];
    for (int h = 0; h < 2; ++h) {
      const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h));
      for (int s2 = 0; s2 < 2; ++s2) {  // inputs 128 h + 64 s2 ..: sub-blocks r = 2 s2 + c, c = 0, 1
        __m256i half[2];
        for (int c = 0; c < 2; ++c) {  // the unsigned 6-bit codes (offset 32) of sub-block 4 h + r
          const int r = c + 2 * s2;
          const __m256i l = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * h + 32 * c));
          const __m256i lo = s2 ? _mm256_srli_epi16(l, 4) : l;
          const __m256i hi = r < 2 ? _mm256_slli_epi16(hb, 4 - 2 * r) : r == 2 ? hb : _mm256_srli_epi16(hb, 2);
          half[c] = _mm256_and_si256(_mm256_ternarylogic_epi32(_mm256_set1_epi8(0x0F), lo, hi, 0xCA),
                                     _mm256_set1_epi8(0x3F));
        }
        const int p = 2 * h + s2;
        u[p] = _mm512_inserti64x4(_mm512_castsi256_si512(half[0]), half[1], 1);
        // 16-bit lane L (codes 2L, 2L + 1 of these 64): scale 8 h + 4 s2 + L / 8
        s[p] = _mm512_permutexvar_epi16(
            _mm512_add_epi16(_mm512_set1_epi16(static_cast<int16_t>(4 * p)),
                             _mm512_setr_epi64(0, 0, 0x0001000100010001, 0x0001000100010001, 0x0002000200020002,
                                               0x0002000200020002, 0x0003000300030003, 0x0003000300030003)),
            scales);
      }
    }
    a.template unit<true>(u, s, _mm512_castsi512_si256(scales), i, f16(b + 208), 0.f);
  }
}

#endif

#include "blocks_int8_avx2.h"

#if defined(CHAT_INT8_DOT) || defined(CHAT_INT8_AVX2)
// Accumulators for up to kMaxRows rows of x~ from row t0 (one a row: gemv_rows_i8's two rows at a
// time are two chains) and the minimum terms: the 32-weight types (dot_from and dot_signed: VNNI's or
// AVX2's)
template <int64_t TN>
struct AccI8 : RowsOf {
  static constexpr int64_t R = TN ? TN : kMaxRows;
  __m256 v[R];
  float mins[R];

  void start(const Int8Rows& rows, int64_t tn, int64_t first) {
    bind(rows, tn, first);
    std::fill_n(v, Tn, _mm256_setzero_ps());
    std::fill_n(mins, Tn, 0.f);
  }
  float result(int64_t t) const { return hsum(v[t]) + mins[t]; }
  CHAT_INLINE __m256i qx(int64_t t, int64_t b) const {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x->q.data() + (t0 + t) * x->K + 32 * b));
  }
  CHAT_INLINE float dx(int64_t t, int64_t b) const { return x->dx[(t0 + t) * x->nb + b]; }
  // + dw dx_b (u - offset) . q_b for 32 unsigned codes u: one scale for the block's 32 codes
  CHAT_INLINE void blk(__m256i u, int64_t b, float dw) {
    for (int64_t t = 0; t < (TN ? TN : Tn); ++t) {
      const __m256i init = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x->init.data() + (t0 + t) * x->K / 4 + 8 * b));
      const __m256 p = _mm256_cvtepi32_ps(dot_from(init, u, qx(t, b)));
      v[t] = _mm256_fmadd_ps(p, _mm256_set1_ps(dw * dx(t, b)), v[t]);
    }
  }
  // + dw dx_b w . q_b for 32 signed codes w (Q8_0): |w| against q with w's sign
  CHAT_INLINE void blk_signed(__m256i w, int64_t b, float dw) {
    for (int64_t t = 0; t < (TN ? TN : Tn); ++t) {
      const __m256 p = _mm256_cvtepi32_ps(dot_signed(w, qx(t, b)));
      v[t] = _mm256_fmadd_ps(p, _mm256_set1_ps(dw * dx(t, b)), v[t]);
    }
  }
  CHAT_INLINE void min_term(int64_t b, float m) {  // + m dx_b sum(q_b)
    for (int64_t t = 0; t < (TN ? TN : Tn); ++t) mins[t] += m * x->s32[(t0 + t) * x->nb + b];
  }
};

// Whether decode takes a type's rows of W two at a time (two chains of accumulators): not the
// K-quants with the AVX2 forms, whose one row's codes, scales and sums already fill AVX2's 16
// registers (two rows spilled them: bench/cpu_block_bench.py --cached --threads 1 --cpu-isa avx2,
// and the LFM2-1.2B-like Q4_K_M decode, bench/cpu_bench.py --cpu-isa avx2)
#if defined(CHAT_INT8_DOT)
template <int64_t T>
constexpr bool kPairsOf = true;
#else
template <int64_t T>
constexpr bool kPairsOf = !k_type(T);
#endif

// y[t, n] for x~'s rows [t0, t0 + Tn) (Tn <= kMaxRows) and W's rows [n0, n1); without kMins, Q4_K /
// Q5_K's minimum terms left out (sum_terms)
template <int64_t T, int64_t TN, bool kMins = true>
void gemv_rows_i8(const Int8Rows& x, int64_t t0, int64_t Tn_, const uint8_t* w, int64_t row_bytes, int64_t N,
                  int64_t n0, int64_t n1, float* y) {
  constexpr bool kq = T == kQ4_K || T == kQ5_K || T == kQ6_K;
  using Acc = std::conditional_t<kq, AccK<TN, kMins>, AccI8<TN>>;
  const int64_t units = x.nb, ub = block_shape(T).bytes;
  const int64_t Tn = TN ? TN : Tn_;
  int64_t n = n0;
  // decode's next rows towards the caches, kAheadRows on from `rows` rows at b: units [i0, i1) of
  // them (the 32-weight types' whole rows at once; the K-quants' a unit at a time, as it computes)
  const auto prefetch = [&](const uint8_t* b, int64_t rows, int64_t i0, int64_t i1) {
    const char* ahead = reinterpret_cast<const char*>(b + kAheadRows * row_bytes);
    for (int64_t o = rows * i0 * ub; o < rows * i1 * ub + (kq ? 64 : 0); o += 64) _mm_prefetch(ahead + o, _MM_HINT_T0);
  };
  if constexpr (TN == 1 && kPairsOf<T>) {  // two rows at a time, the rows kAheadRows on prefetched (as gemv_rows_avx512)
    for (; n + 2 <= n1; n += 2) {
      const uint8_t* b0 = w + n * row_bytes;
      const uint8_t* b1 = b0 + row_bytes;
      const bool ahead = n + kAheadRows + 2 <= n1;
      if (!kq && ahead) prefetch(b0, 2, 0, units);
      Acc a0, a1;
      a0.start(x, Tn, t0);
      a1.start(x, Tn, t0);
      for (int64_t i = 0; i < units; ++i) {
        if (kq && ahead) prefetch(b0, 2, i, i + 1);
        row_unit_i8<T>(b0 + i * ub, i, a0);
        row_unit_i8<T>(b1 + i * ub, i, a1);
      }
      y[t0 * N + n] = a0.result(0);
      y[t0 * N + n + 1] = a1.result(0);
    }
  }
  for (; n < n1; ++n) {
    const uint8_t* b = w + n * row_bytes;
    Acc a;
    a.start(x, Tn, t0);
    if constexpr (TN == 1 && kq) {  // (a row at a time: its next rows prefetched as the pairs' are)
      const bool ahead = n + kAheadRows + 1 <= n1;
      for (int64_t i = 0; i < units; ++i) {
        if (ahead) prefetch(b, 1, i, i + 1);
        row_unit_i8<T>(b + i * ub, i, a);
      }
    } else {
      for (int64_t i = 0; i < units; ++i) row_unit_i8<T>(b + i * ub, i, a);
    }
    for (int64_t t = 0; t < Tn; ++t) y[(t0 + t) * N + n] = a.result(t);
  }
}
#endif

#if defined(CHAT_INT8_DOT)
// The 32-weight types' prefill accumulators: two blocks (64 codes) a step in 16 lanes, on the
// unsigned codes, the offsets in the dot products' starting values (Q4_1 / Q5_1's minimum terms
// are sum_terms')
template <int64_t TN>
struct AccL : RowsOf {
  static constexpr int64_t R = TN ? TN : kMaxRows;
  __m512 v[R];

  void start(const Int8Rows& rows, int64_t tn, int64_t first) {
    bind(rows, tn, first);
    std::fill_n(v, Tn, _mm512_setzero_ps());
  }
  float result(int64_t t) const { return _mm512_reduce_add_ps(v[t]); }
  // + dw dx u . q over blocks 2p and 2p + 1: u their 64 unsigned codes, dw2 their scales 8 times each
  CHAT_INLINE void pair(__m512i u, __m512 dw2, int64_t p) {
    for (int64_t t = 0; t < (TN ? TN : Tn); ++t) {
      const int64_t row = t0 + t;
      const __m512i q = _mm512_loadu_si512(x->q.data() + row * x->K + 64 * p);
      const __m512 dx = _mm512_loadu_ps(x->dx8.data() + (row * x->nb + 2 * p) * 8);
      const __m512i init = _mm512_loadu_si512(x->init.data() + row * x->K / 4 + 16 * p);
      v[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(init, u, q)),
                             _mm512_mul_ps(dw2, dx), v[t]);
    }
  }
};

// a 32-weight block's 32 codes as unsigned bytes, offset not taken (Q8_0's: + 128)
template <int64_t T>
CHAT_INLINE __m256i unsigned_codes(const uint8_t* b) {
  if constexpr (T == kQ8_0) {
    return _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2)), _mm256_set1_epi8(static_cast<char>(0x80)));
  } else {
    constexpr int off = T == kQ4_0 ? 2 : T == kQ4_1 ? 4 : T == kQ5_0 ? 6 : 8;
    __m256i u = nibbles32(ld(b + off));
    if constexpr (T == kQ5_0 || T == kQ5_1) {
      uint32_t qh;
      std::memcpy(&qh, b + off - 4, 4);
      u = _mm256_mask_add_epi8(u, static_cast<__mmask32>(qh), u, _mm256_set1_epi8(16));
    }
    return u;
  }
}

// prefill's form of gemv_rows_i8 for the 32-weight types, K a multiple of 64: y[t, n] =
// sum over blocks of dw dx (u - offset) . q, Q4_1 / Q5_1's minimum terms left to sum_terms
template <int64_t T, int64_t TN>
void gemm_rows_pairs(const Int8Rows& x, int64_t t0, int64_t Tn_, const uint8_t* w, int64_t row_bytes, int64_t N,
                     int64_t n0, int64_t n1, float* y) {
  const int64_t pairs = x.nb / 2, ub = block_shape(T).bytes, Tn = TN ? TN : Tn_;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* b = w + n * row_bytes;
    AccL<TN> a;
    a.start(x, Tn, t0);
    for (int64_t p = 0; p < pairs; ++p) {
      const uint8_t* b0 = b + 2 * p * ub;
      const __m512i u = _mm512_inserti64x4(_mm512_castsi256_si512(unsigned_codes<T>(b0)), unsigned_codes<T>(b0 + ub), 1);
      a.pair(u, _mm512_insertf32x8(_mm512_set1_ps(f16(b0)), _mm256_set1_ps(f16(b0 + ub)), 1), p);
    }
    for (int64_t t = 0; t < Tn; ++t) y[(t0 + t) * N + n] = a.result(t);
  }
}

#endif

#if defined(CHAT_INT8_DOT) || defined(CHAT_INT8_AVX2)
// Prefill's minimum terms, for x~'s first Tn rows against W's as one fp32 GEMM, y += a b^T: Q4_K /
// Q5_K's (a: dx sum(q) per 32-input sub-block, b: -dmin m), Q4_1 / Q5_1's (a: dx sum(q) per
// block, b: m), Q6_K's offset (a: dx sum(q) per 16 inputs, b: -32 d scale). Out of the integer
// loop, where they cost a few instructions a row of x, block and row of W. (The 32-weight types'
// code offsets stay in the integers: as an fp32 term apart, -offset dw dx sum(q), they cancel
// against the codes' sum, 1e-5 of |x~| |W| off where a block's codes sit at the offset.)
void sum_terms(const Int8Rows& x, int64_t Tn, const uint8_t* w, int64_t row_bytes, int64_t N, int64_t type, Tensor& y) {
  const bool kq = k_type(type), q6 = type == kQ6_K;
  const int64_t span = q6 ? 16 : 32, subs = x.K / span, ub = block_shape(type).bytes;
  Tensor a = at::empty({Tn, subs}, y.options()), b = at::empty({N, subs}, y.options());
  float* ap = a.data_ptr<float>();
  float* bp = b.data_ptr<float>();
  for (int64_t t = 0; t < Tn; ++t)
    for (int64_t j = 0; j < subs; ++j) {
      const int16_t* bs = x.bsums.data() + t * x.K / 16;
      ap[t * subs + j] = !kq ? x.s32[t * x.nb + j]
                         : q6 ? x.dx[t * x.nb + j / 16] * static_cast<float>(bs[j])
                              : x.dx[t * x.nb + j / 8] * static_cast<float>(bs[2 * j] + bs[2 * j + 1]);
    }
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t i = 0; i < (kq ? x.nb : subs); ++i) {
        const uint8_t* blk = w + n * row_bytes + i * ub;
        if (q6) {
          const float d = f16(blk + 208);
          for (int j = 0; j < 16; ++j) bp[n * subs + 16 * i + j] = -32.f * d * static_cast<float>(static_cast<int8_t>(blk[192 + j]));
        } else if (kq) {
          const float dmin = f16(blk + 2);
          uint32_t sc[2], mn[2];
          scales_mins_k4(blk + 4, sc, mn);
          uint8_t m[8];
          std::memcpy(m, mn, 8);
          for (int j = 0; j < 8; ++j) bp[n * subs + 8 * i + j] = -dmin * static_cast<float>(m[j]);
        } else {
          bp[n * subs + i] = f16(blk + 2);
        }
      }
  });
  y.narrow(0, 0, Tn).add_(at::mm(a, b.t()));
}

#include "kquant_tiles_avx2.h"
#endif
