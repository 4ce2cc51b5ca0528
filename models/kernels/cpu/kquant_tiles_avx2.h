// A prefill's K-quant products with AVX2 (Q4_K, Q5_K, Q6_K on int8 inputs: block_linear's rows of
// x~ in whole tiles of kMaxRows, the last Tn % kMaxRows rows left to gemv_rows_i8). Included by
// blocks_int8.h after sum_terms (row_unit_i8, Int8Rows, k_type are its and blocks_int8_avx2.h's).
//
// Contract: blocks_int8.h's, y = x~ W^T: per super-block the integer sums of codes times q with
// the scales multiplied in, scaled once in fp32 (d dx), the minimum terms (Q4_K / Q5_K) and Q6_K's
// offset 32 as one fp32 GEMM apart (sum_terms, as the VNNI prefill takes them). Not the decode's
// bits (its fp32 sums run lane by lane, these once a super-block): a verify's rows, which must be
// the decode's, take block_linear_rows. tests/kernels/test_block_int8.py bounds both against x~ W^T.
//
// The form: x~'s rows interleaved eight at a time, four inputs a row in turn (32 bytes: inputs
// 4m .. 4m + 3 of the tile's eight rows), each four codes of a row of W broadcast against them, so
// one maddubs gives the eight rows' pair sums of four inputs; a span's pair sums (codes under one
// scale) add up in 16 bits as long as they cannot overflow, and one madd with the scale takes them
// to 32 bits (Q4_K: eight maddubs a madd; Q5_K four; Q6_K two). The row-by-row form (AccK) spends a
// madd on each maddubs, and on AVX2 machines whose one vector multiply unit runs both, that is half
// its time (bench/cpu_block_bench.py --rows 512 --cpu-isa avx2). W's rows are unpacked 16 at a
// time into bytes and 16-bit scales once, for all the tiles that pass over them (a few KB, in the
// caches).

#if defined(CHAT_INT8_AVX2)

// x~'s whole tiles of kMaxRows rows, interleaved: tile g's inputs 4m .. 4m + 3 of row r at
// q[(g K / 4 + m) 32 + 4 r]; dx[(g nb + i) 8 + r] the row's super-block i scale
struct Int8Tiles {
  std::vector<int8_t> q;
  std::vector<float> dx;
  int64_t K = 0, nb = 0, tiles = 0;
};

Int8Tiles tile_rows(const Int8Rows& r, int64_t tiles) {
  Int8Tiles t;
  t.K = r.K;
  t.nb = r.nb;
  t.tiles = tiles;
  t.q.resize(tiles * kMaxRows * r.K);
  t.dx.resize(tiles * kMaxRows * r.nb);
  const int64_t groups = r.K / 4;
  at::parallel_for(0, tiles, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t row = 0; row < kMaxRows; ++row) {
        const int8_t* src = r.q.data() + (g * kMaxRows + row) * r.K;
        int8_t* dst = t.q.data() + g * kMaxRows * r.K + 4 * row;
        for (int64_t m = 0; m < groups; ++m) std::memcpy(dst + 32 * m, src + 4 * m, 4);
        for (int64_t i = 0; i < r.nb; ++i) t.dx[(g * r.nb + i) * kMaxRows + row] = r.dx[(g * kMaxRows + row) * r.nb + i];
      }
  });
  return t;
}

// row_unit_i8's K-quant units taken apart: a row's codes as bytes (unsigned: Q6_K's with its
// offset 32), its scales one per 16 codes (Q4_K / Q5_K's twice each), d per super-block
struct UnpackK {
  uint8_t* codes;
  int16_t* scales;
  float* d;
  template <bool Q6, typename Code>
  CHAT_INLINE void unit(Code&& code, __m256i, int64_t i, float dw, float) {
    for (int j = 0; j < 8; ++j) {
      __m256i u, s;
      code(j, u, s);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + 256 * i + 32 * j), u);
      scales[16 * i + 2 * j] = static_cast<int16_t>(_mm256_extract_epi16(s, 0));
      scales[16 * i + 2 * j + 1] = static_cast<int16_t>(_mm256_extract_epi16(s, 8));
    }
    d[i] = dw;
  }
};

// Per type: codes under one scale (kSpan) and maddubs summed in 16 bits before a madd (kGroup):
// a maddubs lane is at most 2 x top x 127 (top 15, 31, 63), kGroup of them under 32,767
template <int64_t T>
constexpr int kSpan = T == kQ6_K ? 16 : 32;
template <int64_t T>
constexpr int kGroup = T == kQ4_K ? 8 : T == kQ5_K ? 4 : 2;

// NW rows of W (their unpacked codes c[w], scales s[w], d[w]) against one tile: the eight rows'
// sums, v[w] lane r row r's
template <int64_t T, int NW>
CHAT_INLINE void tile_rows_product(const Int8Tiles& x, int64_t g, const uint8_t* const* c, const int16_t* const* s,
                                   const float* const* d, __m256* v) {
  constexpr int span = kSpan<T>, group = kGroup<T>;
  for (int w = 0; w < NW; ++w) v[w] = _mm256_setzero_ps();
  const int8_t* xq = x.q.data() + g * kMaxRows * x.K;
  for (int64_t i = 0; i < x.nb; ++i) {
    __m256i isum[NW];
    for (int w = 0; w < NW; ++w) isum[w] = _mm256_setzero_si256();
    const int8_t* xi = xq + 256 * kMaxRows * i;
    for (int sp = 0; sp < 256 / span; ++sp) {
      __m256i scale[NW];
      for (int w = 0; w < NW; ++w) scale[w] = _mm256_set1_epi16(s[w][16 * i + sp * span / 16]);
      for (int gr = 0; gr < span / 4 / group; ++gr) {
        __m256i p[NW];
        for (int m = 0; m < group; ++m) {
          const int idx = sp * span / 4 + gr * group + m;  // four inputs' index in the super-block
          const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xi + 32 * idx));
          for (int w = 0; w < NW; ++w) {
            int32_t four;
            std::memcpy(&four, c[w] + 256 * i + 4 * idx, 4);
            const __m256i prod = _mm256_maddubs_epi16(_mm256_set1_epi32(four), q);
            p[w] = m ? _mm256_add_epi16(p[w], prod) : prod;
          }
        }
        for (int w = 0; w < NW; ++w) isum[w] = _mm256_add_epi32(isum[w], _mm256_madd_epi16(p[w], scale[w]));
      }
    }
    const __m256 dx = _mm256_loadu_ps(x.dx.data() + (g * x.nb + i) * kMaxRows);
    for (int w = 0; w < NW; ++w)
      v[w] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[w]), _mm256_mul_ps(_mm256_set1_ps(d[w][i]), dx), v[w]);
  }
}

// y[t, n] for the tiles' rows (the first tiles kMaxRows rows of y) and W's rows [n0, n1), without
// the minimum / offset terms (sum_terms adds them)
template <int64_t T>
void gemm_k_tiles(const Int8Tiles& x, const uint8_t* w, int64_t row_bytes, int64_t N, int64_t n0, int64_t n1, float* y) {
  constexpr int64_t kChunk = 16;
  const int64_t K = x.K, nb = x.nb, ub = block_shape(T).bytes;
  std::vector<uint8_t> codes(kChunk * K);
  std::vector<int16_t> scales(kChunk * K / 16);
  std::vector<float> ds(kChunk * nb);
  alignas(32) float out[2][kMaxRows];
  for (int64_t c0 = n0; c0 < n1; c0 += kChunk) {
    const int64_t c1 = std::min(n1, c0 + kChunk);
    for (int64_t n = c0; n < c1; ++n) {
      UnpackK u{codes.data() + (n - c0) * K, scales.data() + (n - c0) * K / 16, ds.data() + (n - c0) * nb};
      for (int64_t i = 0; i < nb; ++i) row_unit_i8<T>(w + n * row_bytes + i * ub, i, u);
    }
    for (int64_t g = 0; g < x.tiles; ++g) {
      int64_t n = c0;
      for (; n + 2 <= c1; n += 2) {
        const int64_t a = n - c0;
        const uint8_t* c[2] = {codes.data() + a * K, codes.data() + (a + 1) * K};
        const int16_t* s[2] = {scales.data() + a * K / 16, scales.data() + (a + 1) * K / 16};
        const float* d[2] = {ds.data() + a * nb, ds.data() + (a + 1) * nb};
        __m256 v[2];
        tile_rows_product<T, 2>(x, g, c, s, d, v);
        _mm256_store_ps(out[0], v[0]);
        _mm256_store_ps(out[1], v[1]);
        for (int64_t r = 0; r < kMaxRows; ++r) {
          y[(g * kMaxRows + r) * N + n] = out[0][r];
          y[(g * kMaxRows + r) * N + n + 1] = out[1][r];
        }
      }
      for (; n < c1; ++n) {
        const int64_t a = n - c0;
        const uint8_t* c[1] = {codes.data() + a * K};
        const int16_t* s[1] = {scales.data() + a * K / 16};
        const float* d[1] = {ds.data() + a * nb};
        __m256 v[1];
        tile_rows_product<T, 1>(x, g, c, s, d, v);
        _mm256_store_ps(out[0], v[0]);
        for (int64_t r = 0; r < kMaxRows; ++r) y[(g * kMaxRows + r) * N + n] = out[0][r];
      }
    }
  }
}

#endif
