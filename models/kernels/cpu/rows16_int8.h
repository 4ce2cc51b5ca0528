// Q4_0 / Q4_1 products on int8 inputs over the blocks interleaved 16 rows at a time (the rows16
// layout, written by models/quant/rows16.py): the `cpu_int8` products of those types, decode's row,
// a verify's rows and a prefill's alike. Included by step.cpp inside its namespace, after
// blocks_int8.h (Int8Rows, quantize_rows, CHAT_INLINE; step.cpp's kQ4_0 / kQ4_1, row_runs,
// check_blocks).
//
// Layout: rows 16 g .. 16 g + 15 of W form group g, its blocks in order; block b of a group is
// the 16 rows' fp16 scales d (32 bytes), Q4_1's 16 fp16 minimums m (32 bytes), then the 16 rows'
// 16 code bytes in four quads: quad k holds, row after row, bytes 4k .. 4k + 3 of that row's
// codes (low nibbles: codes 4k .. 4k + 3; high: 16 + 4k .. 16 + 4k + 3). 288 bytes a block of 16
// rows for Q4_0, 320 for Q4_1: the blocks' own bytes. Each 32-bit lane of a quad is one row, so one
// dot product instruction takes four codes of 16 rows against four inputs broadcast, and the
// scales load as vectors (the row-by-row kernels spend most of their instructions per block on
// one row's scalar scales: bench/cpu_block_bench.py --rows16).
//
// Contract: blocks_int8.h's, the same integers: per row and block the integer sum u . q of the
// codes against x~'s 32 inputs (Q4_0: less 8 sum(q), exact), scaled by d dx in fp32 and summed over
// the blocks in order in one fp32 lane (fma), Q4_1's minimum terms m (dx sum(q)) in another, added
// at the end. Each row's operations are the same whatever the run of rows it is computed in and
// on either instruction set (AVX-512 VNNI takes a group in one vector, AVX2 in two halves of 8
// rows), so decode, a verify's rows and a prefill's agree bit for bit, and the two builds too
// (tests/test_rows16.py).

constexpr int64_t kGroupRows = 16;
constexpr int64_t kRows16 = 128;  // a rows16 matrix's type code: kRows16 + the GGUF type (+ kWide: 16-bit inputs)
constexpr int64_t kWide = 64;

constexpr bool rows16_type(int64_t type) { return type == kQ4_0 || type == kQ4_1; }
constexpr int64_t rows16_block_bytes(int64_t type) { return type == kQ4_1 ? 320 : 288; }

// x's rows rounded to 16 bits per 32 inputs ("wide" inputs: the `cpu_int8: wide` setting): q =
// round(x 32767 / max|x|) to the nearest, ties to even, dx = max|x| / 32767 in fp32, x~ = q dx (an
// input within 2^-16 of its block's largest; int8's step is 2^-8). Per block, 16 words of two
// int16 codes each, in the order the kernels' dot products take them: for quad k, codes
// (4k, 4k + 2), (4k + 1, 4k + 3), (16 + 4k, 16 + 4k + 2), (16 + 4k + 1, 16 + 4k + 3); the
// block's sum(q) and dx sum(q) beside (Q4_0's offset, Q4_1's minimum terms).
struct WideRows {
  std::vector<int32_t> words, sum;
  std::vector<float> dx, s32;
  int64_t K = 0, nb = 0;
};

WideRows quantize_wide(const float* x, int64_t Tn, int64_t K) {
  WideRows r;
  r.K = K;
  r.nb = K / 32;
  r.words.resize(Tn * r.nb * 16);
  r.sum.resize(Tn * r.nb);
  r.dx.resize(Tn * r.nb);
  r.s32.resize(Tn * r.nb);
  each_rounded_block<int16_t>(x, Tn, K, 32767.f, [&](int64_t t, int64_t b, float amax, const int16_t* q, int sum) {
    int32_t* w = r.words.data() + (t * r.nb + b) * 16;
    const auto pair = [&](int a, int c) {
      return static_cast<int32_t>(static_cast<uint32_t>(static_cast<uint16_t>(q[a])) |
                                  (static_cast<uint32_t>(static_cast<uint16_t>(q[c])) << 16));
    };
    for (int k = 0; k < 4; ++k) {
      w[4 * k] = pair(4 * k, 4 * k + 2);
      w[4 * k + 1] = pair(4 * k + 1, 4 * k + 3);
      w[4 * k + 2] = pair(16 + 4 * k, 16 + 4 * k + 2);
      w[4 * k + 3] = pair(16 + 4 * k + 1, 16 + 4 * k + 3);
    }
    r.sum[t * r.nb + b] = sum;
    r.dx[t * r.nb + b] = amax / 32767.0f;
    r.s32[t * r.nb + b] = r.dx[t * r.nb + b] * static_cast<float>(sum);
  });
  return r;
}

#if defined(CHAT_INT8_DOT) || defined(CHAT_INT8_AVX2)
#define CHAT_ROWS16 1

// y[t0 + t, 16 g + r] for t < TN and groups [g0, g1): x~'s rows rounded for Q4_0 / Q4_1 (Q8_0 / Q8_1's
// rule: Int8Rows; or to 16 bits: WideRows, whose pairs of codes meet the weights' in 16-bit lanes)
template <int64_t T, int64_t TN, typename Rows>
void rows16_rows(const Rows& x, int64_t t0, const uint8_t* w, int64_t N, int64_t g0, int64_t g1, float* y) {
  constexpr int64_t GB = rows16_block_bytes(T), QS = T == kQ4_1 ? 64 : 32;
  constexpr bool kWide = std::is_same_v<Rows, WideRows>;
  const int64_t nb = x.nb, K = x.K;
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* gp = w + g * nb * GB;
#if defined(CHAT_INT8_DOT)
    const __m512i low = _mm512_set1_epi8(0x0F);
    __m512 acc[TN], accm[TN];
    for (int64_t t = 0; t < TN; ++t) acc[t] = accm[t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* bp = gp + b * GB;
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bp)));
      __m512i lo[4], hi[4];
      for (int k = 0; k < 4; ++k) {
        const __m512i v = _mm512_loadu_si512(bp + QS + 64 * k);
        lo[k] = _mm512_and_si512(v, low);
        hi[k] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      }
      for (int64_t t = 0; t < TN; ++t) {
        const int64_t row = t0 + t;
        __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
        if constexpr (kWide) {  // a lane's even and odd code bytes as 16-bit pairs against two inputs each
          const int32_t* q = x.words.data() + (row * nb + b) * 16;
          const __m512i even = _mm512_set1_epi32(0x00FF00FF);
          for (int k = 0; k < 4; ++k) {
            s0 = _mm512_dpwssd_epi32(s0, _mm512_and_si512(lo[k], even), _mm512_set1_epi32(q[4 * k]));
            s1 = _mm512_dpwssd_epi32(s1, _mm512_and_si512(_mm512_srli_epi32(lo[k], 8), even), _mm512_set1_epi32(q[4 * k + 1]));
            s0 = _mm512_dpwssd_epi32(s0, _mm512_and_si512(hi[k], even), _mm512_set1_epi32(q[4 * k + 2]));
            s1 = _mm512_dpwssd_epi32(s1, _mm512_and_si512(_mm512_srli_epi32(hi[k], 8), even), _mm512_set1_epi32(q[4 * k + 3]));
          }
        } else {
          const int8_t* q = x.q.data() + row * K + 32 * b;
          for (int k = 0; k < 4; ++k) {
            int32_t a, c;
            std::memcpy(&a, q + 4 * k, 4);
            std::memcpy(&c, q + 16 + 4 * k, 4);
            s0 = _mm512_dpbusd_epi32(s0, lo[k], _mm512_set1_epi32(a));
            s1 = _mm512_dpbusd_epi32(s1, hi[k], _mm512_set1_epi32(c));
          }
        }
        __m512i s = _mm512_add_epi32(s0, s1);
        if constexpr (T == kQ4_0) s = _mm512_sub_epi32(s, _mm512_set1_epi32(8 * x.sum[row * nb + b]));
        const __m512 dd = _mm512_mul_ps(d, _mm512_set1_ps(x.dx[row * nb + b]));
        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), dd, acc[t]);
        if constexpr (T == kQ4_1) {
          const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bp + 32)));
          accm[t] = _mm512_fmadd_ps(m, _mm512_set1_ps(x.s32[row * nb + b]), accm[t]);
        }
      }
    }
    for (int64_t t = 0; t < TN; ++t) {
      const __m512 r = T == kQ4_1 ? _mm512_add_ps(acc[t], accm[t]) : acc[t];
      _mm512_storeu_ps(y + (t0 + t) * N + kGroupRows * g, r);
    }
#else
    const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    for (int half = 0; half < 2; ++half) {  // rows 8 half .. 8 half + 7: a quad's 32 bytes from 32 half
      __m256 acc[TN], accm[TN];
      for (int64_t t = 0; t < TN; ++t) acc[t] = accm[t] = _mm256_setzero_ps();
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* bp = gp + b * GB;
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bp + 16 * half)));
        __m256i lo[4], hi[4];
        for (int k = 0; k < 4; ++k) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bp + QS + 64 * k + 32 * half));
          lo[k] = _mm256_and_si256(v, low);
          hi[k] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        }
        for (int64_t t = 0; t < TN; ++t) {
          const int64_t row = t0 + t;
          __m256i s;
          if constexpr (kWide) {  // (madd: dpwssd's 32-bit sums of two 16-bit products)
            const int32_t* q = x.words.data() + (row * nb + b) * 16;
            const __m256i even = _mm256_set1_epi32(0x00FF00FF);
            __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
            for (int k = 0; k < 4; ++k) {
              s0 = _mm256_add_epi32(s0, _mm256_madd_epi16(_mm256_and_si256(lo[k], even), _mm256_set1_epi32(q[4 * k])));
              s1 = _mm256_add_epi32(s1, _mm256_madd_epi16(_mm256_and_si256(_mm256_srli_epi32(lo[k], 8), even),
                                                          _mm256_set1_epi32(q[4 * k + 1])));
              s0 = _mm256_add_epi32(s0, _mm256_madd_epi16(_mm256_and_si256(hi[k], even), _mm256_set1_epi32(q[4 * k + 2])));
              s1 = _mm256_add_epi32(s1, _mm256_madd_epi16(_mm256_and_si256(_mm256_srli_epi32(hi[k], 8), even),
                                                          _mm256_set1_epi32(q[4 * k + 3])));
            }
            s = _mm256_add_epi32(s0, s1);
          } else {
            const int8_t* q = x.q.data() + row * K + 32 * b;
            // pairs of code x input to 16 bits (at most 2 x 15 x 127), eight such sums to 16 bits
            // (at most 30,480: no saturation), then to 32 bits: the same integers as dpbusd's
            __m256i s16 = _mm256_setzero_si256();
            for (int k = 0; k < 4; ++k) {
              int32_t a, c;
              std::memcpy(&a, q + 4 * k, 4);
              std::memcpy(&c, q + 16 + 4 * k, 4);
              s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(lo[k], _mm256_set1_epi32(a)));
              s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(hi[k], _mm256_set1_epi32(c)));
            }
            s = _mm256_madd_epi16(s16, ones);
          }
          if constexpr (T == kQ4_0) s = _mm256_sub_epi32(s, _mm256_set1_epi32(8 * x.sum[row * nb + b]));
          const __m256 dd = _mm256_mul_ps(d, _mm256_set1_ps(x.dx[row * nb + b]));
          acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), dd, acc[t]);
          if constexpr (T == kQ4_1) {
            const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bp + 32 + 16 * half)));
            accm[t] = _mm256_fmadd_ps(m, _mm256_set1_ps(x.s32[row * nb + b]), accm[t]);
          }
        }
      }
      for (int64_t t = 0; t < TN; ++t) {
        const __m256 r = T == kQ4_1 ? _mm256_add_ps(acc[t], accm[t]) : acc[t];
        _mm256_storeu_ps(y + (t0 + t) * N + kGroupRows * g + 8 * half, r);
      }
    }
#endif
  }
}

// y = x~ W^T for all Tn rows of x~, W in rows16 (type: Q4_0 or Q4_1), groups [g0, g1), each group's
// bytes read once for runs of up to kRunRows rows (row_runs), which stay in the caches
template <typename Rows>
void rows16_product(const Rows& x, int64_t Tn, const uint8_t* w, int64_t type, int64_t N, int64_t g0, int64_t g1,
                    float* y) {
  const auto runs = [&](auto tc) {
    constexpr int64_t T = decltype(tc)::value;
    for (int64_t g = g0; g < g1; ++g)
      row_runs(Tn, [&](auto run, int64_t t0) { rows16_rows<T, decltype(run)::value, Rows>(x, t0, w, N, g, g + 1, y); });
  };
  if (type == kQ4_0)
    runs(std::integral_constant<int64_t, kQ4_0>{});
  else
    runs(std::integral_constant<int64_t, kQ4_1>{});
}
#endif

// A rows16 matrix's checks: [N, row bytes] uint8 as the blocks were (N a multiple of 16); K returned
int64_t check_rows16(const Tensor& w, int64_t type) {
  TORCH_CHECK(rows16_type(type), "rows16: type ", type, " has no rows16 layout (Q4_0 and Q4_1 have)");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous() && w.size(0) % kGroupRows == 0,
              "rows16: [N, row bytes] uint8 with N a multiple of 16");
  return check_blocks(w, type);
}

// y = x W^T on int8 inputs (wide: 16-bit ones) for x [T, K] fp32 (any T) and W in rows16: block_linear's
// product of such a matrix
Tensor rows16_linear(const Tensor& x, const Tensor& w, int64_t type, bool wide) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "rows16_linear: x must be [T, K] fp32");
  const int64_t K = check_rows16(w, type), N = w.size(0), Tn = x.size(0);
  TORCH_CHECK(x.size(1) == K, "rows16_linear: x has ", x.size(1), " columns, the matrix ", K);
  Tensor y = at::empty({Tn, N}, x.options());
#if defined(CHAT_ROWS16)
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  if (wide) {
    const WideRows rows = quantize_wide(x.data_ptr<float>(), Tn, K);
    at::parallel_for(0, N / kGroupRows, 1, [&](int64_t g0, int64_t g1) { rows16_product(rows, Tn, wp, type, N, g0, g1, yp); });
  } else {
    const Int8Rows rows = quantize_rows(x.data_ptr<float>(), Tn, K, type);
    at::parallel_for(0, N / kGroupRows, 1, [&](int64_t g0, int64_t g1) { rows16_product(rows, Tn, wp, type, N, g0, g1, yp); });
  }
#else
  TORCH_CHECK(false, "rows16_linear: this build has no int8 dot product (AVX2 or AVX-512 VNNI)");
#endif
  return y;
}
