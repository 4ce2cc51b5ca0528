// Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 products on rounded inputs over the blocks interleaved 16 rows
// at a time (the rows16 layout, written by models/quant/rows16.py): the `cpu_int8` products of those
// types, decode's row, a verify's rows and a prefill's alike. Included by step.cpp inside its namespace, after
// blocks_int8.h (Int8Rows, quantize_rows, CHAT_INLINE; step.cpp's GGUF type codes, row_runs,
// check_blocks).
//
// Layout: rows 16 g .. 16 g + 15 of W form group g, its blocks in order; block b of a group is
// the 16 rows' fp16 scales d (32 bytes), Q4_1 / Q5_1's 16 fp16 minimums m (32 bytes), Q5_0 / Q5_1's
// 16 words of fifth bits (64 bytes: bit 8i + k that of code 4k + i, bit 8i + 4 + k that of code
// 16 + 4k + i), then the 16 rows' code bytes in quads: quad k holds, row after row, bytes 4k ..
// 4k + 3 of that row's codes (the nibble types' four quads: low nibbles codes 4k .. 4k + 3, high
// 16 + 4k .. 16 + 4k + 3; Q8_0's eight quads: codes 4k .. 4k + 3, their sign bits flipped, i.e.
// unsigned with offset 128). The blocks' own bytes. Each 32-bit lane of a quad is one row, so one
// dot product instruction takes four codes of 16 rows against four inputs broadcast, and the
// scales load as vectors (the row-by-row kernels spend most of their instructions per block on
// one row's scalar scales: bench/cpu_block_bench.py --rows16).
//
// Contract: blocks_int8.h's, the same integers: per row and block the integer sum u . q of the
// codes against x~'s 32 inputs (less the codes' zero times sum(q): Q4_0 8, Q5_0 16, Q8_0 128;
// exact), scaled by d dx in fp32 and summed over the blocks in order in one fp32 lane (fma), Q4_1 /
// Q5_1's minimum terms m (dx sum(q)) in another, added at the end. Each row's operations are the same whatever the run of rows it is computed in and
// on either instruction set (AVX-512 VNNI takes a group in one vector, AVX2 in two halves of 8
// rows), so decode, a verify's rows and a prefill's agree bit for bit, and the two builds too
// (tests/kernels/test_rows16.py).

constexpr int64_t kGroupRows = 16;
constexpr int64_t kRows16 = 128;  // a rows16 matrix's type code: kRows16 + the GGUF type (+ kWide: 16-bit inputs)
constexpr int64_t kWide = 64;

constexpr bool rows16_type(int64_t type) {
  return type == kQ4_0 || type == kQ4_1 || type == kQ5_0 || type == kQ5_1 || type == kQ8_0;
}
// a block of 16 rows: the rows' blocks' own bytes
constexpr int64_t rows16_block_bytes(int64_t type) {
  return 16 * (type == kQ4_0 ? 18 : type == kQ4_1 ? 20 : type == kQ5_0 ? 22 : type == kQ5_1 ? 24 : 34);
}

// A rows16 type code's GGUF type and width (kWide: 16-bit inputs)
struct Rows16Code {
  int64_t type;
  bool wide;
};
constexpr Rows16Code rows16_code(int64_t code) { return {(code - kRows16) % kWide, code - kRows16 >= kWide}; }

// x's rows rounded to 16 bits per 32 inputs ("wide" inputs: the `cpu_int8: wide` setting): q =
// round(x 32767 / max|x|) to the nearest, ties to even, dx = max|x| / 32767 in fp32, x~ = q dx (an
// input within 2^-16 of its block's largest; int8's step is 2^-8). Per block, 16 words of two
// int16 codes each, in the order the kernels' dot products take them: for quad k, codes
// (4k, 4k + 2), (4k + 1, 4k + 3), (16 + 4k, 16 + 4k + 2), (16 + 4k + 1, 16 + 4k + 3); the
// block's sum(q) and dx sum(q) beside (the codes' offsets, the minimum terms).
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

// A type's rows16 block: where its fields start (scales at 0, then minimums, fifth bits) and its quads
template <int64_t T>
struct Rows16Of {
  static constexpr bool kMin = T == kQ4_1 || T == kQ5_1, kFifth = T == kQ5_0 || T == kQ5_1;
  static constexpr int64_t kM = 32, kQH = kMin ? 64 : 32, kQS = kQH + (kFifth ? 64 : 0);
  static constexpr int64_t kBytes = rows16_block_bytes(T);
  static constexpr int kOffset = T == kQ4_0 ? 8 : T == kQ5_0 ? 16 : T == kQ8_0 ? 128 : 0;  // the codes' zero
};

// y[t0 + t, 16 g + r] for t < TN and groups [g0, g1): x~'s rows rounded for the type (Q8_0 / Q8_1's
// rule: Int8Rows; or to 16 bits: WideRows, whose pairs of codes meet the weights' in 16-bit lanes)
template <int64_t T, int64_t TN, typename Rows>
void rows16_rows(const Rows& x, int64_t t0, const uint8_t* w, int64_t N, int64_t g0, int64_t g1, float* y) {
  using L = Rows16Of<T>;
  constexpr int64_t GB = L::kBytes;
  constexpr bool kWide = std::is_same_v<Rows, WideRows>;
  const int64_t nb = x.nb, K = x.K;
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* gp = w + g * nb * GB;
#if defined(CHAT_INT8_DOT)
    const __m512i low = _mm512_set1_epi8(0x0F), fifth = _mm512_set1_epi8(0x10);
    __m512 acc[TN], accm[TN];
    for (int64_t t = 0; t < TN; ++t) acc[t] = accm[t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* bp = gp + b * GB;
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bp)));
      // lo[k]: the unsigned codes of inputs 4k .. 4k + 3, hi[k]: of 16 + 4k .. (a row a lane)
      __m512i lo[4], hi[4];
      for (int k = 0; k < 4; ++k) {
        if constexpr (T == kQ8_0) {
          lo[k] = _mm512_loadu_si512(bp + L::kQS + 64 * k);
          hi[k] = _mm512_loadu_si512(bp + L::kQS + 64 * (k + 4));
        } else {
          const __m512i v = _mm512_loadu_si512(bp + L::kQS + 64 * k);
          lo[k] = _mm512_and_si512(v, low);
          hi[k] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
          if constexpr (L::kFifth) {  // (rows16.py's _FIFTH: quad k's fifth bits to bit 4 of each byte)
            const __m512i h = _mm512_loadu_si512(bp + L::kQH);
            lo[k] = _mm512_or_si512(lo[k], _mm512_and_si512(_mm512_slli_epi32(h, 4 - k), fifth));
            hi[k] = _mm512_or_si512(hi[k], _mm512_and_si512(_mm512_srli_epi32(h, k), fifth));
          }
        }
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
        if constexpr (L::kOffset != 0) s = _mm512_sub_epi32(s, _mm512_set1_epi32(L::kOffset * x.sum[row * nb + b]));
        const __m512 dd = _mm512_mul_ps(d, _mm512_set1_ps(x.dx[row * nb + b]));
        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), dd, acc[t]);
        if constexpr (L::kMin) {
          const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bp + L::kM)));
          accm[t] = _mm512_fmadd_ps(m, _mm512_set1_ps(x.s32[row * nb + b]), accm[t]);
        }
      }
    }
    for (int64_t t = 0; t < TN; ++t) {
      const __m512 r = L::kMin ? _mm512_add_ps(acc[t], accm[t]) : acc[t];
      _mm512_storeu_ps(y + (t0 + t) * N + kGroupRows * g, r);
    }
#else
    const __m256i low = _mm256_set1_epi8(0x0F), fifth = _mm256_set1_epi8(0x10), ones = _mm256_set1_epi16(1);
    for (int half = 0; half < 2; ++half) {  // rows 8 half .. 8 half + 7: a quad's 32 bytes from 32 half
      __m256 acc[TN], accm[TN];
      for (int64_t t = 0; t < TN; ++t) acc[t] = accm[t] = _mm256_setzero_ps();
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* bp = gp + b * GB;
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bp + 16 * half)));
        __m256i lo[4], hi[4];  // (Q8_0 on int8 inputs: its signed codes, maddubs' pairs of unsigned ones would saturate)
        for (int k = 0; k < 4; ++k) {
          if constexpr (T == kQ8_0) {
            lo[k] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bp + L::kQS + 64 * k + 32 * half));
            hi[k] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bp + L::kQS + 64 * (k + 4) + 32 * half));
            if constexpr (!kWide) {
              lo[k] = _mm256_xor_si256(lo[k], _mm256_set1_epi8(static_cast<char>(0x80)));
              hi[k] = _mm256_xor_si256(hi[k], _mm256_set1_epi8(static_cast<char>(0x80)));
            }
          } else {
            const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bp + L::kQS + 64 * k + 32 * half));
            lo[k] = _mm256_and_si256(v, low);
            hi[k] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
            if constexpr (L::kFifth) {
              const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bp + L::kQH + 32 * half));
              lo[k] = _mm256_or_si256(lo[k], _mm256_and_si256(_mm256_slli_epi32(h, 4 - k), fifth));
              hi[k] = _mm256_or_si256(hi[k], _mm256_and_si256(_mm256_srli_epi32(h, k), fifth));
            }
          }
        }
        // 16-bit inputs (madd: dpwssd's 32-bit sums of two 16-bit products): quad by quad, its
        // codes as 16-bit pairs made once for the TN rows, whose integer sums stay in registers
        // (the same integers as row by row: bench/cpu_block_bench.py --rows16 --rows 512)
        __m256i wsum[kWide ? TN : 1];
        if constexpr (kWide) {
          const __m256i even = _mm256_set1_epi32(0x00FF00FF);
          for (int64_t t = 0; t < TN; ++t) wsum[t] = _mm256_setzero_si256();
          for (int k = 0; k < 4; ++k) {
            const __m256i le = _mm256_and_si256(lo[k], even), lodd = _mm256_and_si256(_mm256_srli_epi32(lo[k], 8), even);
            const __m256i he = _mm256_and_si256(hi[k], even), hodd = _mm256_and_si256(_mm256_srli_epi32(hi[k], 8), even);
            for (int64_t t = 0; t < TN; ++t) {
              const int32_t* q = x.words.data() + ((t0 + t) * nb + b) * 16 + 4 * k;
              const __m256i p = _mm256_add_epi32(_mm256_madd_epi16(le, _mm256_set1_epi32(q[0])),
                                                 _mm256_madd_epi16(lodd, _mm256_set1_epi32(q[1])));
              const __m256i r = _mm256_add_epi32(_mm256_madd_epi16(he, _mm256_set1_epi32(q[2])),
                                                 _mm256_madd_epi16(hodd, _mm256_set1_epi32(q[3])));
              wsum[t] = _mm256_add_epi32(wsum[t], _mm256_add_epi32(p, r));
            }
          }
        }
        for (int64_t t = 0; t < TN; ++t) {
          const int64_t row = t0 + t;
          __m256i s;
          constexpr bool kOffset = L::kOffset != 0 && (T != kQ8_0 || kWide);  // (Q8_0's signed form has none)
          if constexpr (kWide) {
            s = wsum[t];
          } else {
            const int8_t* q = x.q.data() + row * K + 32 * b;
            const auto input = [&](int at) {
              int32_t a;
              std::memcpy(&a, q + at, 4);
              return _mm256_set1_epi32(a);
            };
            if constexpr (T == kQ8_0) {  // |w| times q with w's signs, each pair to 32 bits (dpbusd's integers)
              s = _mm256_setzero_si256();
              for (int k = 0; k < 4; ++k) {
                const __m256i a = input(4 * k), c = input(16 + 4 * k);
                s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(lo[k], lo[k]),
                                                                               _mm256_sign_epi8(a, lo[k])), ones));
                s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(hi[k], hi[k]),
                                                                               _mm256_sign_epi8(c, hi[k])), ones));
              }
            } else {
              // pairs of code x input to 16 bits (at most 2 x 31 x 127), four such sums (Q4: eight)
              // to 16 bits (at most 31,496: no saturation), then to 32 bits: dpbusd's integers
              __m256i s16 = _mm256_setzero_si256(), t16 = _mm256_setzero_si256();
              for (int k = 0; k < 4; ++k) {
                s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(lo[k], input(4 * k)));
                if constexpr (L::kFifth)
                  t16 = _mm256_add_epi16(t16, _mm256_maddubs_epi16(hi[k], input(16 + 4 * k)));
                else
                  s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(hi[k], input(16 + 4 * k)));
              }
              s = _mm256_madd_epi16(s16, ones);
              if constexpr (L::kFifth) s = _mm256_add_epi32(s, _mm256_madd_epi16(t16, ones));
            }
          }
          if constexpr (kOffset) s = _mm256_sub_epi32(s, _mm256_set1_epi32(L::kOffset * x.sum[row * nb + b]));
          const __m256 dd = _mm256_mul_ps(d, _mm256_set1_ps(x.dx[row * nb + b]));
          acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), dd, acc[t]);
          if constexpr (L::kMin) {
            const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bp + L::kM + 16 * half)));
            accm[t] = _mm256_fmadd_ps(m, _mm256_set1_ps(x.s32[row * nb + b]), accm[t]);
          }
        }
      }
      for (int64_t t = 0; t < TN; ++t) {
        const __m256 r = L::kMin ? _mm256_add_ps(acc[t], accm[t]) : acc[t];
        _mm256_storeu_ps(y + (t0 + t) * N + kGroupRows * g + 8 * half, r);
      }
    }
#endif
  }
}

// y = x~ W^T for all Tn rows of x~, W in rows16 (type: a rows16_type), groups [g0, g1), each group's
// bytes read once for runs of up to kRunRows rows (row_runs), which stay in the caches
template <typename Rows>
void rows16_product(const Rows& x, int64_t Tn, const uint8_t* w, int64_t type, int64_t N, int64_t g0, int64_t g1,
                    float* y) {
  const auto runs = [&](auto tc) {
    constexpr int64_t T = decltype(tc)::value;
    for (int64_t g = g0; g < g1; ++g)
      row_runs(Tn, [&](auto run, int64_t t0) { rows16_rows<T, decltype(run)::value, Rows>(x, t0, w, N, g, g + 1, y); });
  };
  switch (type) {
    case kQ4_0: return runs(std::integral_constant<int64_t, kQ4_0>{});
    case kQ4_1: return runs(std::integral_constant<int64_t, kQ4_1>{});
    case kQ5_0: return runs(std::integral_constant<int64_t, kQ5_0>{});
    case kQ5_1: return runs(std::integral_constant<int64_t, kQ5_1>{});
    default: return runs(std::integral_constant<int64_t, kQ8_0>{});
  }
}
#endif

// A rows16 matrix's checks: [N, row bytes] uint8 as the blocks were (N a multiple of 16); K returned
int64_t check_rows16(const Tensor& w, int64_t type) {
  TORCH_CHECK(rows16_type(type), "rows16: type ", type, " has no rows16 layout (Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 have)");
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
