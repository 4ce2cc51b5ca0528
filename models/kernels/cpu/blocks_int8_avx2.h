// GGUF block products on int8 inputs with AVX2 (`cpu_int8: on` where AVX-512 VNNI is missing): the
// accumulators and per-type units that blocks_int8.h's gemv_rows_i8 runs there. Included by
// blocks_int8.h, whose AccI8 takes dot_from and dot_signed from here (Int8Rows, RowsOf, hsum,
// scales_mins_k4; step.cpp's ld, nibbles32, bit_bytes, f16),
// also where AVX-512 lacks VNNI.
//
// Contract: blocks_int8.h's, the same integer sums: llama.cpp's AVX2 form of them. A code byte
// times an input byte, pairs summed to 16 bits (maddubs: at most 2 x 63 x 127 here, or 2 x 128 x
// 127 for Q8_0's magnitudes against q with the codes' signs, so nothing saturates), then to 32
// bits (madd: with ones, or with the K-quants' 16-bit sub-block scales, as VNNI's dpwssd does).
// The 32-weight types' offsets start the sums (Int8Rows.init, lane for lane dpbusd's), Q6_K's 32
// and the minimum terms come through the 16-input sums of q; every sum is scaled once in fp32.
// Prefill runs these units over kMaxRows rows of x~ a row of W, the minimum terms inside.

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(CHAT_INT8_DOT)
#define CHAT_INT8_AVX2 1

// 8 lanes, lane l the sum over codes 4l .. 4l + 3 of u q (u unsigned, q signed): VNNI's dpbusd
CHAT_INLINE __m256i dot_u8s8(__m256i u, __m256i q) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, q), _mm256_set1_epi16(1));
}
CHAT_INLINE __m256i dot_from(__m256i init, __m256i u, __m256i q) { return _mm256_add_epi32(init, dot_u8s8(u, q)); }
CHAT_INLINE __m256i dot_signed(__m256i w, __m256i q) {  // |w| (-128 gives 0x80: 128 unsigned, as wanted)
  return dot_u8s8(_mm256_sign_epi8(w, w), _mm256_sign_epi8(q, w));
}

// The K-quants' accumulators: per row of x~, d dx (the super-block's integer sum) in 8 lanes, and
// the minimum terms (Q4_K / Q5_K) in 8, subtracted. (kMins: always here; prefill has no sum_terms.)
template <int64_t TN, bool kMins = true>
struct AccK : RowsOf {
  static constexpr int64_t R = TN ? TN : kMaxRows;
  __m256 v[R], m[R];

  void start(const Int8Rows& rows, int64_t tn, int64_t first) {
    bind(rows, tn, first);
    std::fill_n(v, Tn, _mm256_setzero_ps());
    std::fill_n(m, Tn, _mm256_setzero_ps());
  }
  float result(int64_t t) const { return hsum(v[t]) - hsum(m[t]); }
  // super-block i: the codes u[8] (sub-block j: inputs 32 j ..) times q, each pair of products
  // times the 16-bit scales s[j] lane by lane, summed as integers; by16 the 16 values that the 16
  // sums of q per 16 inputs are multiplied by (Q6_K: its scales, subtracted 32 times; Q4_K / Q5_K:
  // each sub-block's minimum twice)
  template <bool Q6>
  CHAT_INLINE void unit(const __m256i u[8], const __m256i s[8], __m256i by16, int64_t i, float d, float dmin) {
    if constexpr (TN > 1) {
      // A whole tile: sub-block by sub-block, its codes and scales read once for the TN rows,
      // whose integer sums stay in registers (AVX2 has 16: u[8] and s[8] beside TN sums and the
      // accumulators would spill each product's operands, bench/cpu_block_bench.py --rows 512
      // --cpu-isa avx2); the sums are the same integers, added in the same order per row
      __m256i isum[TN];
      for (int64_t t = 0; t < TN; ++t) isum[t] = _mm256_setzero_si256();
      const int8_t* q = x->q.data() + t0 * x->K + 256 * i;
      for (int j = 0; j < 8; ++j) {
        const __m256i uj = u[j], sj = s[j];
        for (int64_t t = 0; t < TN; ++t)
          isum[t] = _mm256_add_epi32(isum[t], _mm256_madd_epi16(_mm256_maddubs_epi16(
                                                  uj, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + t * x->K + 32 * j))), sj));
      }
      for (int64_t t = 0; t < TN; ++t) finish<Q6>(isum[t], by16, t, i, d, dmin);
    } else {
      for (int64_t t = 0; t < (TN ? TN : Tn); ++t) {
        const int8_t* q = x->q.data() + (t0 + t) * x->K + 256 * i;
        __m256i isum = _mm256_setzero_si256();
        for (int j = 0; j < 8; ++j)
          isum = _mm256_add_epi32(isum, _mm256_madd_epi16(_mm256_maddubs_epi16(
                                            u[j], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * j))), s[j]));
        finish<Q6>(isum, by16, t, i, d, dmin);
      }
    }
  }
  // row t's super-block i: its integer sum scaled into v[t], the minimum (or Q6_K's 32) terms
  template <bool Q6>
  CHAT_INLINE void finish(__m256i isum, __m256i by16, int64_t t, int64_t i, float d, float dmin) {
    const int64_t row = t0 + t;
    const float dx = x->dx[row * x->nb + i];
    const __m256i bs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x->bsums.data() + row * x->K / 16 + 16 * i));
    const __m256i by = _mm256_madd_epi16(bs, by16);
    if constexpr (Q6)
      isum = _mm256_sub_epi32(isum, _mm256_slli_epi32(by, 5));
    else
      m[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(by), _mm256_set1_ps(dmin * dx), m[t]);
    v[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(d * dx), v[t]);
  }
};

// One unit of a row (a 32-weight block, or a 256-weight super-block) into a's sums
template <int64_t T, typename A>
CHAT_INLINE void row_unit_i8(const uint8_t* b, int64_t i, A& a) {
  if constexpr (T == kQ8_0) {
    a.blk_signed(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2)), i, f16(b));
  } else if constexpr (T == kQ4_0 || T == kQ4_1 || T == kQ5_0 || T == kQ5_1) {
    constexpr int off = T == kQ4_0 ? 2 : T == kQ4_1 ? 4 : T == kQ5_0 ? 6 : 8;
    __m256i u = nibbles32(ld(b + off));
    if constexpr (T == kQ5_0 || T == kQ5_1)
      u = _mm256_or_si256(u, _mm256_and_si256(bit_bytes(b + off - 4), _mm256_set1_epi8(16)));
    a.blk(u, i, f16(b));
    if constexpr (T == kQ4_1 || T == kQ5_1) a.min_term(i, f16(b + 2));
  } else if constexpr (T == kQ4_K || T == kQ5_K) {
    uint32_t sc[2], mn[2];
    scales_mins_k4(b + 4, sc, mn);
    uint8_t scb[8];
    std::memcpy(scb, sc, 8);
    const __m128i mn8 = _mm_set_epi32(0, 0, static_cast<int>(mn[1]), static_cast<int>(mn[0]));
    const __m256i mins = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(mn8, mn8));  // each sub-block's twice
    const uint8_t* qs = b + (T == kQ5_K ? 48 : 16);
    const __m256i h = T == kQ5_K ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16)) : _mm256_setzero_si256();
    __m256i u[8], s[8];
    for (int p = 0; p < 4; ++p) {  // sub-blocks 2p (32 bytes' low nibbles) and 2p + 1 (high)
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * p));
      for (int e = 0; e < 2; ++e) {
        const int j = 2 * p + e;
        u[j] = _mm256_and_si256(e ? _mm256_srli_epi16(v, 4) : v, _mm256_set1_epi8(0x0F));
        if constexpr (T == kQ5_K) {
          const __m256i bit = _mm256_set1_epi8(static_cast<char>(1 << j));
          u[j] = _mm256_or_si256(u[j], _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(h, bit), bit),
                                                        _mm256_set1_epi8(16)));
        }
        s[j] = _mm256_set1_epi16(scb[j]);
      }
    }
    a.template unit<false>(u, s, mins, i, f16(b), f16(b + 2));
  } else if constexpr (T == kQ6_K) {
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    const __m256i scales = _mm256_cvtepi8_epi16(ld(b + 192));  // 16, one a 16 codes
    const __m256i low = _mm256_set1_epi8(0x0F);
    __m256i u[8], s[8];
    for (int h = 0; h < 2; ++h) {
      const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h));
      for (int c = 0; c < 2; ++c) {  // the 32 low-nibble bytes at 64 h + 32 c: sub-blocks r = c and c + 2
        const __m256i l = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * h + 32 * c));
        for (int s2 = 0; s2 < 2; ++s2) {
          const int r = c + 2 * s2, k = 4 * h + r;  // the unsigned 6-bit codes (offset 32) of inputs 32 k ..
          const __m256i lo = s2 ? _mm256_srli_epi16(l, 4) : l;
          const __m256i hi = r < 2 ? _mm256_slli_epi16(hb, 4 - 2 * r) : r == 2 ? hb : _mm256_srli_epi16(hb, 2);
          u[k] = _mm256_and_si256(_mm256_or_si256(_mm256_and_si256(lo, low), _mm256_andnot_si256(low, hi)),
                                  _mm256_set1_epi8(0x3F));
          s[k] = _mm256_set_m128i(_mm_set1_epi16(sc[2 * k + 1]), _mm_set1_epi16(sc[2 * k]));
        }
      }
    }
    a.template unit<true>(u, s, scales, i, f16(b + 208), 0.f);
  }
}
#endif
