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
// A verify's rows (block_linear_rows) and a prefill's last Tn % kMaxRows run these units over up
// to kMaxRows rows of x~ a row of W, the minimum terms inside; a prefill's whole tiles of the
// K-quants take kquant_tiles_avx2.h's form.

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
// the minimum terms (Q4_K / Q5_K) in 8, subtracted. (kMins: always here; sum_terms serves only
// kquant_tiles_avx2.h's tiles.)
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
  // super-block i: sub-block j's codes u (inputs 32 j ..) times q, each pair of products times
  // the 16-bit scales s lane by lane, summed as integers, code(j, u, s) giving u and s as they are
  // needed (sixteen such vectors made first would not stay in AVX2's 16 registers beside the sums:
  // bench/cpu_block_bench.py --cached --threads 1 --cpu-isa avx2); by16 the 16 values that the 16 sums of q per 16 inputs
  // are multiplied by (Q6_K: its scales, subtracted 32 times; Q4_K / Q5_K: each sub-block's minimum
  // twice)
  template <bool Q6, typename Code>
  CHAT_INLINE void unit(Code&& code, __m256i by16, int64_t i, float d, float dmin) {
    if constexpr (TN != 1) {
      // A whole tile (or TN = 0: a prefill's last rows, Tn of them): sub-block by sub-block, its
      // codes and scales made once for the rows, whose integer sums stay in registers
      // (bench/cpu_block_bench.py --rows 512 --cpu-isa avx2); the sums are the same integers, added
      // in the same order per row
      constexpr int64_t kRows = TN ? TN : kMaxRows;
      const int64_t rows = TN ? TN : Tn;
      __m256i isum[kRows];
      for (int64_t t = 0; t < rows; ++t) isum[t] = _mm256_setzero_si256();
      const int8_t* q = x->q.data() + t0 * x->K + 256 * i;
      for (int j = 0; j < 8; ++j) {
        __m256i uj, sj;
        code(j, uj, sj);
        for (int64_t t = 0; t < rows; ++t)
          isum[t] = _mm256_add_epi32(isum[t], _mm256_madd_epi16(_mm256_maddubs_epi16(
                                                  uj, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + t * x->K + 32 * j))), sj));
      }
      for (int64_t t = 0; t < rows; ++t) finish<Q6>(isum[t], by16, t, i, d, dmin);
    } else {  // (one row: decode's)
      const int8_t* q = x->q.data() + t0 * x->K + 256 * i;
      __m256i isum = _mm256_setzero_si256();
      for (int j = 0; j < 8; ++j) {
        __m256i uj, sj;
        code(j, uj, sj);
        isum = _mm256_add_epi32(isum, _mm256_madd_epi16(_mm256_maddubs_epi16(
                                          uj, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * j))), sj));
      }
      finish<Q6>(isum, by16, 0, i, d, dmin);
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
    // the 8 scales as 16-bit lanes in both halves: sub-block j's broadcast by one byte shuffle (a
    // scalar's broadcast takes three instructions: bench/cpu_block_bench.py --cached --threads 1
    // --cpu-isa avx2)
    const __m256i sc16 = _mm256_broadcastsi128_si256(
        _mm_cvtepu8_epi16(_mm_set_epi32(0, 0, static_cast<int>(sc[1]), static_cast<int>(sc[0]))));
    const __m128i mn8 = _mm_set_epi32(0, 0, static_cast<int>(mn[1]), static_cast<int>(mn[0]));
    const __m256i mins = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(mn8, mn8));  // each sub-block's twice
    const uint8_t* qs = b + (T == kQ5_K ? 48 : 16);
    // sub-block j: the low (j even) or high nibbles of the 32 bytes at 32 (j / 2)
    const auto code = [&](int j, __m256i& u, __m256i& s) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * (j / 2)));
      u = _mm256_and_si256(j % 2 ? _mm256_srli_epi16(v, 4) : v, _mm256_set1_epi8(0x0F));
      if constexpr (T == kQ5_K) {
        const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16));
        const __m256i bit = _mm256_set1_epi8(static_cast<char>(1 << j));
        u = _mm256_or_si256(u, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(h, bit), bit), _mm256_set1_epi8(16)));
      }
      s = _mm256_shuffle_epi8(sc16, _mm256_set1_epi16(static_cast<int16_t>(0x0100 + 0x0202 * j)));
    };
    a.template unit<false>(code, mins, i, f16(b), f16(b + 2));
  } else if constexpr (T == kQ6_K) {
    const __m256i scales = _mm256_cvtepi8_epi16(ld(b + 192));  // 16, one a 16 codes
    // sub-block k's two scales (a 16 codes each): the 32-bit lane k of `scales` everywhere, its low
    // 16 bits kept in the low half, its high 16 in the high half
    const __m256i halves = _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1,
                                            2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3);
    const __m256i low = _mm256_set1_epi8(0x0F);
    // sub-block k = 4 h + r: the unsigned 6-bit codes (offset 32) of inputs 32 k .., their low
    // nibbles those of the 32 bytes at 64 h + 32 (r % 2) (high nibbles for r >= 2), their top two
    // bits bits 2r, 2r + 1 of the 32 bytes at 128 + 32 h
    const auto code = [&](int k, __m256i& u, __m256i& s) {
      const int h = k / 4, r = k % 4;
      const __m256i l = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * h + 32 * (r % 2)));
      const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h));
      const __m256i lo = r >= 2 ? _mm256_srli_epi16(l, 4) : l;
      const __m256i hi = r < 2 ? _mm256_slli_epi16(hb, 4 - 2 * r) : r == 2 ? hb : _mm256_srli_epi16(hb, 2);
      u = _mm256_and_si256(_mm256_or_si256(_mm256_and_si256(lo, low), _mm256_andnot_si256(low, hi)), _mm256_set1_epi8(0x3F));
      s = _mm256_shuffle_epi8(_mm256_permutevar8x32_epi32(scales, _mm256_set1_epi32(k)), halves);
    };
    a.template unit<true>(code, scales, i, f16(b + 208), 0.f);
  }
}
#endif
