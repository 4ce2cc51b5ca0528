// GGUF block products in fp32 with AVX2 and FMA, for the CPUs without AVX-512 (AMD before Zen 4,
// most Intel client parts): the accumulator and per-type unit that step.cpp's gemv_rows_simd runs
// there. Included by step.cpp inside its namespace, after the AVX-512 forms (f16, ld, nibbles32,
// scale_min_k4, block_shape and kMaxRows are step.cpp's).
//
// Contract: gemv_rows_avx512's, the dequantized product up to fp32 rounding order: per 32 weights
// the integer codes (less the type's offset) widened to fp32 and multiplied with x, the
// (sub-)block's scale applied to that partial sum (Q6_K: a scale per 16), the minimum terms of
// Q4_1 / Q5_1 / Q4_K / Q5_K as m * (the block's sum of x). tests/kernels/test_block_quant.py bounds it
// against the fp64 product as it bounds the AVX-512 form.
//
// Why: the portable loop (gemv_rows) dequantizes a block into a buffer and reads it back; on an
// AVX2 machine it ran several times slower than llama.cpp's decode of the same file
// (bench/cpu_block_bench.py, bench/cpu_bench.py).

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(CHAT_SIMD_BLOCKS)
#define CHAT_SIMD_BLOCKS 1
#define CHAT_AVX2_BLOCKS 1

// Accumulators for up to kMaxRows rows of x: two 8-lane chains a row (the first and second 16 of
// each 32), and the minimum terms
template <int64_t TN>  // TN rows of x (0: Tn, known at run time)
struct Acc8 {
  static constexpr int64_t R = TN ? TN : kMaxRows;
  __m256 v[R], v2[R];
  float mins[R];
  const float* x;
  int64_t K, Tn;
  void start(const float* rows, int64_t k, int64_t tn) {
    x = rows;
    K = k;
    Tn = tn;
    for (int64_t t = 0; t < Tn; ++t) {
      v[t] = _mm256_setzero_ps();
      v2[t] = _mm256_setzero_ps();
      mins[t] = 0.f;
    }
  }
  float result(int64_t t) const {
    const __m256 a = _mm256_add_ps(v[t], v2[t]);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s))) + mins[t];
  }
  // + s0 (q . x[j..j+16)) + s1 (q . x[j+16..j+32)) for 32 signed byte codes q
  inline void sub(__m256i q, int64_t j, float s0, float s1) {
    const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
    const __m256 f0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
    const __m256 f1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(lo, lo)));
    const __m256 f2 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
    const __m256 f3 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(hi, hi)));
    const __m256 s0v = _mm256_set1_ps(s0), s1v = _mm256_set1_ps(s1);
    for (int64_t t = 0; t < (TN ? TN : Tn); ++t) {
      const float* xp = x + t * K + j;
      const __m256 p0 = _mm256_fmadd_ps(f1, _mm256_loadu_ps(xp + 8), _mm256_mul_ps(f0, _mm256_loadu_ps(xp)));
      const __m256 p1 = _mm256_fmadd_ps(f3, _mm256_loadu_ps(xp + 24), _mm256_mul_ps(f2, _mm256_loadu_ps(xp + 16)));
      v[t] = _mm256_fmadd_ps(s0v, p0, v[t]);
      v2[t] = _mm256_fmadd_ps(s1v, p1, v2[t]);
    }
  }
  inline void min_term(const float* xs, int64_t nsub, int64_t i, float m) {  // + m * sum(x[32 i .. 32 i + 32))
    for (int64_t t = 0; t < (TN ? TN : Tn); ++t) mins[t] += m * xs[t * nsub + i];
  }
};

template <int64_t TN>
using SimdAcc = Acc8<TN>;

// One unit of a row (a 32-weight block, or a 256-weight super-block) into a's sums
template <int64_t T, int64_t TN>
inline void row_unit(const uint8_t* b, int64_t i, Acc8<TN>& a, const float* xs, int64_t nsub) {
  if constexpr (T == kQ8_0) {
    const float d = f16(b);
    a.sub(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2)), 32 * i, d, d);
  } else if constexpr (T == kQ4_0 || T == kQ4_1 || T == kQ5_0 || T == kQ5_1) {
    constexpr int off = T == kQ4_0 ? 2 : T == kQ4_1 ? 4 : T == kQ5_0 ? 6 : 8;
    const float d = f16(b);
    __m256i u = nibbles32(ld(b + off));
    if constexpr (T == kQ5_0 || T == kQ5_1)
      u = _mm256_or_si256(u, _mm256_and_si256(bit_bytes(b + off - 4), _mm256_set1_epi8(16)));
    if constexpr (T == kQ4_0 || T == kQ5_0)
      u = _mm256_sub_epi8(u, _mm256_set1_epi8(T == kQ4_0 ? 8 : 16));
    else
      a.min_term(xs, nsub, i, f16(b + 2));
    a.sub(u, 32 * i, d, d);
  } else if constexpr (T == kQ4_K || T == kQ5_K) {
    const float d = f16(b), dmin = f16(b + 2);
    const uint8_t* qs = b + (T == kQ5_K ? 48 : 16);
    const __m256i h = T == kQ5_K ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16)) : _mm256_setzero_si256();
    for (int p = 0; p < 4; ++p) {  // sub-blocks 2p (low nibbles) and 2p + 1 (high) of 32 bytes
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * p));
      for (int e = 0; e < 2; ++e) {
        const int sub = 2 * p + e;
        int sc, mn;
        scale_min_k4(sub, b + 4, sc, mn);
        __m256i q = _mm256_and_si256(e ? _mm256_srli_epi16(v, 4) : v, _mm256_set1_epi8(0x0F));
        if constexpr (T == kQ5_K) {
          const __m256i bit = _mm256_set1_epi8(static_cast<char>(1 << sub));
          q = _mm256_or_si256(q, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(h, bit), bit),
                                                  _mm256_set1_epi8(16)));
        }
        const int64_t j = 256 * i + 32 * sub;
        const float s = d * static_cast<float>(sc);
        a.sub(q, j, s, s);
        a.min_term(xs, nsub, j / 32, -(dmin * static_cast<float>(mn)));
      }
    }
  } else if constexpr (T == kQ6_K) {
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    const float d = f16(b + 208);
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int h = 0; h < 2; ++h) {
      const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h));
      for (int c = 0; c < 2; ++c) {  // the 32 low-nibble bytes at 64 h + 32 c: sub-blocks r = c and c + 2
        const __m256i l = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * h + 32 * c));
        for (int s2 = 0; s2 < 2; ++s2) {
          const int r = c + 2 * s2, k = 4 * h + r;
          // the code's low nibble from l (its high nibble where s2), its two high bits from hb
          // moved to bits 4-5
          const __m256i lo = s2 ? _mm256_srli_epi16(l, 4) : l;
          const __m256i hi = r < 2 ? _mm256_slli_epi16(hb, 4 - 2 * r) : r == 2 ? hb : _mm256_srli_epi16(hb, 2);
          const __m256i v = _mm256_and_si256(_mm256_or_si256(_mm256_and_si256(lo, low), _mm256_andnot_si256(low, hi)),
                                             _mm256_set1_epi8(0x3F));
          a.sub(_mm256_sub_epi8(v, _mm256_set1_epi8(32)), 256 * i + 32 * k, d * static_cast<float>(sc[2 * k]),
                d * static_cast<float>(sc[2 * k + 1]));
        }
      }
    }
  }
}
#endif
