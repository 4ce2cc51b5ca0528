// The CPU decode step of a dense GQA transformer (Llama / SmolLM2, Qwen2, Qwen3), or of LFM2 (its
// short-convolution layers between GQA ones), for one token, every layer in one call: the contract
// is in cpu_step.py, which builds and loads this file.
//
// Why C++: on a small model the eager torch step is bound by per-op overhead (hundreds of small
// ops a step on SmolLM2, most of its time outside the matmuls: bench/cpu_bench.py --cpu-kernel
// off). Here the matmuls stay torch's kernels (the int4 GEMM of quant.Int4Linear, or at::linear
// for fp32 weights); the norms, RoPE, KV write, SwiGLU and residual adds are plain loops over the
// token's vectors (the reductions with independent accumulators, so the compiler vectorises them),
// and so is the attention (over an fp32 cache past 256 slots: torch's two batched GEMMs); every
// sum in a fixed order.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <map>
#include <optional>
#include <vector>

namespace {

using at::Tensor;
using OptList = c10::List<std::optional<Tensor>>;
constexpr int kLanes = 16;  // independent partial sums: a vectorisable reduction without -ffast-math

float dot(const float* a, const float* b, int64_t n) {
  float acc[kLanes] = {0};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int j = 0; j < kLanes; ++j) acc[j] += a[i + j] * b[i + j];
  float s = 0.f;
  for (int j = 0; j < kLanes; ++j) s += acc[j];
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// y = x / rms(x) * w, fp32 (F.rms_norm's form)
void rms_norm(const float* x, const float* w, float* y, int64_t n, double eps) {
  const float inv = 1.0f / std::sqrt(dot(x, x, n) / static_cast<float>(n) + static_cast<float>(eps));
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] * inv * w[i];
}

// rms_norm over the last dimension of x (any leading shape), fp32: a decode step's norms as one
// call each (F.rms_norm on the CPU is about seven dispatched ops, each paying its overhead)
Tensor rms_norm_rows(const Tensor& x, const Tensor& w, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat && w.dim() == 1 &&
              x.size(-1) == w.size(0), "rms_norm_rows: fp32 x [..., n] and weight [n]");
  const Tensor xc = x.contiguous(), wc = w.contiguous();
  Tensor y = at::empty_like(xc);
  const int64_t n = wc.size(0), rows = n ? xc.numel() / n : 0;
  for (int64_t r = 0; r < rows; ++r)
    rms_norm(xc.data_ptr<float>() + r * n, wc.data_ptr<float>(), y.data_ptr<float>() + r * n, n, eps);
  return y;
}

#include "delta_step.h"
#include "mamba2_step.h"

// torch's int4 kernel on fp32 rows: it takes and returns bf16; the casts are loops here (the
// same round-to-nearest-even as Tensor.to), not two dispatched ops per matmul.
Tensor int4_mm(const Tensor& x, const Tensor& packed, const Tensor& sz) {
  const Tensor xc = x.contiguous();
  const int64_t K = xc.size(-1), Tn = xc.numel() / K;
  Tensor xb = at::empty({Tn, K}, xc.options().dtype(at::kBFloat16));
  const float* xp = xc.data_ptr<float>();
  at::BFloat16* xbp = xb.data_ptr<at::BFloat16>();
  for (int64_t i = 0; i < Tn * K; ++i) xbp[i] = at::BFloat16(xp[i]);
  Tensor yb = at::_weight_int4pack_mm_for_cpu(xb, packed, 32, sz);
  Tensor y = at::empty(yb.sizes(), xc.options());
  const at::BFloat16* ybp = yb.data_ptr<at::BFloat16>();
  float* yp = y.data_ptr<float>();
  for (int64_t i = 0, n = yb.numel(); i < n; ++i) yp[i] = static_cast<float>(ybp[i]);
  return y;
}


// --- GGUF blocks read as stored (quant.BlockLinear): Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q4_K Q5_K Q6_K ---------
// Each block dequantizes to exactly gguf-py's fp32 values (the layouts are formats/gguf_blocks.py's;
// tests/formats/test_gguf_blocks.py compares block_dequant with it bit for bit), into a buffer the dot then
// reads: y = x W^T in fp32, the dequantized product up to summation order.
enum GgmlType : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14 };

inline float f16(const uint8_t* p) {  // exact (every fp16 is an fp32); F16C's one instruction where it exists
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
#endif
}

struct BlockShape {
  int64_t weights, bytes;
};

BlockShape block_shape(int64_t type) {
  switch (type) {
    case kQ4_0: return {32, 18};
    case kQ4_1: return {32, 20};
    case kQ5_0: return {32, 22};
    case kQ5_1: return {32, 24};
    case kQ8_0: return {32, 34};
    case kQ4_K: return {256, 144};
    case kQ5_K: return {256, 176};
    case kQ6_K: return {256, 210};
  }
  TORCH_CHECK(false, "GGUF block type ", type, " is not read by the CPU kernels");
}

// Q4_K / Q5_K: the j-th 6-bit scale and minimum of 12 packed bytes
inline void scale_min_k4(int j, const uint8_t* q, int& sc, int& m) {
  if (j < 4) {
    sc = q[j] & 63;
    m = q[j + 4] & 63;
  } else {
    sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

template <int64_t T>
void dequant_block(const uint8_t* b, float* y) {
  if constexpr (T == kQ4_0 || T == kQ4_1) {
    const float d = f16(b);
    const float m = T == kQ4_1 ? f16(b + 2) : 0.f;
    const uint8_t* qs = b + (T == kQ4_1 ? 4 : 2);
    for (int j = 0; j < 16; ++j) {
      if constexpr (T == kQ4_0) {
        y[j] = d * static_cast<float>((qs[j] & 0xF) - 8);
        y[j + 16] = d * static_cast<float>((qs[j] >> 4) - 8);
      } else {
        y[j] = d * static_cast<float>(qs[j] & 0xF) + m;
        y[j + 16] = d * static_cast<float>(qs[j] >> 4) + m;
      }
    }
  } else if constexpr (T == kQ5_0 || T == kQ5_1) {
    const float d = f16(b);
    const float m = T == kQ5_1 ? f16(b + 2) : 0.f;
    const uint8_t* p = b + (T == kQ5_1 ? 4 : 2);
    uint32_t qh;
    std::memcpy(&qh, p, 4);
    const uint8_t* qs = p + 4;
    for (int j = 0; j < 16; ++j) {
      const int lo = (qs[j] & 0xF) | (((qh >> j) & 1) << 4);
      const int hi = (qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
      if constexpr (T == kQ5_0) {
        y[j] = d * static_cast<float>(lo - 16);
        y[j + 16] = d * static_cast<float>(hi - 16);
      } else {
        y[j] = d * static_cast<float>(lo) + m;
        y[j + 16] = d * static_cast<float>(hi) + m;
      }
    }
  } else if constexpr (T == kQ8_0) {
    const float d = f16(b);
    const int8_t* q = reinterpret_cast<const int8_t*>(b + 2);
    for (int j = 0; j < 32; ++j) y[j] = static_cast<float>(q[j]) * d;
  } else if constexpr (T == kQ4_K || T == kQ5_K) {
    const float d = f16(b), dmin = f16(b + 2);
    const uint8_t* scales = b + 4;
    const uint8_t* qh = b + 16;  // Q5_K only
    const uint8_t* qs = b + (T == kQ5_K ? 48 : 16);
    for (int i = 0; i < 8; ++i) {  // sub-block i: the low (even i) or high nibbles of qs[32 (i/2) ...]
      int sc, mn;
      scale_min_k4(i, scales, sc, mn);
      const float ds = d * static_cast<float>(sc), dm = dmin * static_cast<float>(mn);
      const uint8_t* q = qs + 32 * (i / 2);
      const int shift = 4 * (i % 2);
      for (int j = 0; j < 32; ++j) {
        int v = (q[j] >> shift) & 0xF;
        if constexpr (T == kQ5_K) v |= ((qh[j] >> i) & 1) << 4;
        y[32 * i + j] = ds * static_cast<float>(v) - dm;
      }
    }
  } else if constexpr (T == kQ6_K) {
    const uint8_t* ql = b;
    const uint8_t* qh = b + 128;
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    const float d = f16(b + 208);
    for (int k = 0; k < 8; ++k) {  // sub-block k = 4 h + r of 32 weights, a scale per 16
      const int h = k / 4, r = k % 4;
      const uint8_t* l = ql + 64 * h + 32 * (r & 1);
      const uint8_t* hb = qh + 32 * h;
      const float d0 = d * static_cast<float>(sc[2 * k]), d1 = d * static_cast<float>(sc[2 * k + 1]);
      for (int j = 0; j < 32; ++j) {
        const int v = (((l[j] >> (4 * (r >> 1))) & 0xF) | (((hb[j] >> (2 * r)) & 3) << 4)) - 32;
        y[32 * k + j] = (j < 16 ? d0 : d1) * static_cast<float>(v);
      }
    }
  }
}

// rows [n0, n1) of W dequantized into y (row-major, K weights a row)
template <int64_t T>
void dequant_rows(const uint8_t* w, int64_t row_bytes, int64_t K, int64_t n0, int64_t n1, float* y) {
  constexpr int64_t BW = T == kQ4_K || T == kQ5_K || T == kQ6_K ? 256 : 32;
  const int64_t bytes = block_shape(T).bytes, nb = K / BW;
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t b = 0; b < nb; ++b) dequant_block<T>(w + n * row_bytes + b * bytes, y + n * K + b * BW);
}

// y[t, n] = sum_k x[t, k] W[n, k] for rows [n0, n1) of W and all T rows of x (T <= kMaxRows)
constexpr int64_t kMaxRows = 8;

// Tn rows of x in runs of up to kRunRows, each run's count a compile-time constant, so that a
// kernel keeps a run's sums in registers (with a runtime count they live in memory and each extra
// row of a verify costs nearly a row's whole product: bench/cpu_block_bench.py --verify); each
// row's operations are the one-row kernel's whatever its run. f(std::integral_constant<int64_t, run>, t0).
constexpr int64_t kRunRows = 8;
template <typename F>
void row_runs(int64_t Tn, F&& f) {
  static_assert(kRunRows == 8, "row_runs names each run length up to kRunRows");
  for (int64_t t0 = 0; t0 < Tn; t0 += kRunRows) {
    switch (std::min(kRunRows, Tn - t0)) {
      case 1: f(std::integral_constant<int64_t, 1>{}, t0); break;
      case 2: f(std::integral_constant<int64_t, 2>{}, t0); break;
      case 3: f(std::integral_constant<int64_t, 3>{}, t0); break;
      case 4: f(std::integral_constant<int64_t, 4>{}, t0); break;
      case 5: f(std::integral_constant<int64_t, 5>{}, t0); break;
      case 6: f(std::integral_constant<int64_t, 6>{}, t0); break;
      case 7: f(std::integral_constant<int64_t, 7>{}, t0); break;
      default: f(std::integral_constant<int64_t, 8>{}, t0); break;
    }
  }
}

template <int64_t T>
void gemv_rows(const float* x, int64_t Tn, int64_t K, const uint8_t* w, int64_t row_bytes, int64_t N,
               int64_t n0, int64_t n1, float* y) {
  constexpr int64_t BW = T == kQ4_K || T == kQ5_K || T == kQ6_K ? 256 : 32;
  const int64_t bytes = block_shape(T).bytes, nb = K / BW;
  alignas(64) float buf[BW];
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    float acc[kMaxRows][kLanes] = {};
    for (int64_t b = 0; b < nb; ++b) {
      dequant_block<T>(row + b * bytes, buf);
      for (int64_t t = 0; t < Tn; ++t) {
        const float* xb = x + t * K + b * BW;
        for (int64_t i = 0; i < BW; i += kLanes)
          for (int j = 0; j < kLanes; ++j) acc[t][j] += buf[i + j] * xb[i + j];
      }
    }
    for (int64_t t = 0; t < Tn; ++t) {
      float s = 0.f;
      for (int j = 0; j < kLanes; ++j) s += acc[t][j];
      y[t * N + n] = s;
    }
  }
}


#if defined(__AVX2__)
inline __m128i ld(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
inline __m256i nibbles32(__m128i v) {  // 16 bytes' low nibbles then their high ones, as 32 bytes
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), _mm256_set1_epi8(0x0F));
}
// 0xFF in byte j where bit j of the 32 bits at p is set (llama.cpp's bytes_from_bits_32)
inline __m256i bit_bytes(const uint8_t* p) {
  uint32_t bits;
  std::memcpy(&bits, p, 4);
  const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(bits)),
                                             _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                                               0x0101010101010101, 0x0000000000000000));
  return _mm256_cmpeq_epi8(_mm256_or_si256(spread, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe)), _mm256_set1_epi64x(-1));
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define CHAT_SIMD_BLOCKS 1
// The same product with AVX-512, from the blocks directly: per 32 (Q6_K: 16) weights the integer
// codes widened to fp32 and multiplied with x, the block's scale applied to that partial sum, and
// the minimum terms of Q4_1 / Q5_1 / Q4_K / Q5_K as m * (the block's sum of x): the dequantized
// product up to fp32 rounding order (not bit for bit; tests bound it). Many times faster than the
// loop above (bench/cpu_block_bench.py).
inline __m512 i8_ps(__m128i v) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v)); }
inline __m128i lo_nib(__m128i v) { return _mm_and_si128(v, _mm_set1_epi8(0x0F)); }
inline __m128i hi_nib(__m128i v) { return _mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(0x0F)); }

// Accumulators for up to kMaxRows rows of x; `sub(t, q0, q1, j, s)` adds s * (q0 . x[j..j+16) + q1 . x[j+16..j+32))
template <int64_t TN>  // TN rows of x (0: Tn, known at run time); TN = 1 keeps the sums in registers
struct Acc {
  static constexpr int64_t R = TN ? TN : kMaxRows;
  __m512 v[R], v2[R];  // v2: the second 16 of each 32 where the weights come dequantized (wsum)
  float mins[R];
  const float* x;
  int64_t K, Tn;
  void start(const float* rows, int64_t k, int64_t tn) {
    x = rows;
    K = k;
    Tn = tn;
    for (int64_t t = 0; t < Tn; ++t) {
      v[t] = _mm512_setzero_ps();
      v2[t] = _mm512_setzero_ps();
      mins[t] = 0.f;
    }
  }
  float result(int64_t t) const { return _mm512_reduce_add_ps(_mm512_add_ps(v[t], v2[t])) + mins[t]; }
  inline void sub(__m512 q0, __m512 q1, int64_t j, float s) {
    const __m512 sv = _mm512_set1_ps(s);
    for (int64_t t = 0; t < (TN ? TN : Tn); ++t) {
      const float* xp = x + t * K + j;
      const __m512 p = _mm512_fmadd_ps(q0, _mm512_loadu_ps(xp), _mm512_mul_ps(q1, _mm512_loadu_ps(xp + 16)));
      v[t] = _mm512_fmadd_ps(sv, p, v[t]);
    }
  }
  inline void sub2(__m512 q0, __m512 q1, int64_t j, float s0, float s1) {  // a scale per 16
    const __m512 s0v = _mm512_set1_ps(s0), s1v = _mm512_set1_ps(s1);
    for (int64_t t = 0; t < (TN ? TN : Tn); ++t) {
      const float* xp = x + t * K + j;
      v[t] = _mm512_fmadd_ps(s0v, _mm512_mul_ps(q0, _mm512_loadu_ps(xp)), v[t]);
      v[t] = _mm512_fmadd_ps(s1v, _mm512_mul_ps(q1, _mm512_loadu_ps(xp + 16)), v[t]);
    }
  }
  inline void wsum(__m512 w0, __m512 w1, int64_t j) {  // + w0 . x[j..j+16) + w1 . x[j+16..j+32)
    for (int64_t t = 0; t < (TN ? TN : Tn); ++t) {
      const float* xp = x + t * K + j;
      v[t] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xp), v[t]);
      v2[t] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xp + 16), v2[t]);
    }
  }
  inline void min_term(const float* xs, int64_t nsub, int64_t i, float m) {  // + m * sum(x[32 i .. 32 i + 32))
    for (int64_t t = 0; t < (TN ? TN : Tn); ++t) mins[t] += m * xs[t * nsub + i];
  }
};

// One unit of a row (a 32-weight block, or a 256-weight super-block) into a's sums.
template <int64_t T, int64_t TN>
inline void row_unit(const uint8_t* b, int64_t i, Acc<TN>& a, const float* xs, int64_t nsub) {
  if constexpr (T == kQ4_0 || T == kQ4_1 || T == kQ5_0 || T == kQ5_1 || T == kQ8_0) {
    const float d = f16(b);
    __m128i q0, q1;
    if constexpr (T == kQ8_0) {
      q0 = ld(b + 2);
      q1 = ld(b + 18);
    } else {  // the 32 codes as one 256-bit vector of bytes: weights 0-15 low nibbles, 16-31 high
      constexpr int off = T == kQ4_0 ? 2 : T == kQ4_1 ? 4 : T == kQ5_0 ? 6 : 8;
      const __m128i v = ld(b + off);
      __m256i u = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), _mm256_set1_epi8(0x0F));
      if constexpr (T == kQ5_0 || T == kQ5_1) {
        uint32_t qh;
        std::memcpy(&qh, b + off - 4, 4);
        u = _mm256_mask_add_epi8(u, static_cast<__mmask32>(qh), u, _mm256_set1_epi8(16));
      }
      if constexpr (T == kQ4_0 || T == kQ5_0)
        u = _mm256_sub_epi8(u, _mm256_set1_epi8(T == kQ4_0 ? 8 : 16));
      else
        a.min_term(xs, nsub, i, f16(b + 2));
      q0 = _mm256_castsi256_si128(u);
      q1 = _mm256_extracti128_si256(u, 1);
    }
    a.sub(i8_ps(q0), i8_ps(q1), 32 * i, d);
  } else if constexpr (T == kQ4_K) {
    const float d = f16(b), dmin = f16(b + 2);
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const uint8_t* qs = b + 16;
    for (int p = 0; p < 4; ++p) {
      const __m512i c0 = _mm512_cvtepu8_epi32(ld(qs + 32 * p)), c1 = _mm512_cvtepu8_epi32(ld(qs + 32 * p + 16));
      for (int e = 0; e < 2; ++e) {
        const int sub = 2 * p + e;
        int sc, mn;
        scale_min_k4(sub, b + 4, sc, mn);
        const __m512 table = _mm512_sub_ps(_mm512_mul_ps(iota, _mm512_set1_ps(d * static_cast<float>(sc))),
                                           _mm512_set1_ps(dmin * static_cast<float>(mn)));
        const __m512i i0 = e ? _mm512_srli_epi32(c0, 4) : c0, i1 = e ? _mm512_srli_epi32(c1, 4) : c1;
        a.wsum(_mm512_permutexvar_ps(i0, table), _mm512_permutexvar_ps(i1, table), 256 * i + 32 * sub);
      }
    }
  } else if constexpr (T == kQ5_K) {
    const float d = f16(b), dmin = f16(b + 2);
    const uint8_t* qs = b + (T == kQ5_K ? 48 : 16);
    __m256i h = _mm256_setzero_si256();
    if constexpr (T == kQ5_K) h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16));
    for (int p = 0; p < 4; ++p) {  // sub-blocks 2p (low nibbles) and 2p + 1 (high) of 32 bytes
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * p));
      __m256i q[2] = {_mm256_and_si256(v, _mm256_set1_epi8(0x0F)),
                      _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F))};
      for (int e = 0; e < 2; ++e) {
        const int sub = 2 * p + e;
        int sc, mn;
        scale_min_k4(sub, b + 4, sc, mn);
        if constexpr (T == kQ5_K)
          q[e] = _mm256_mask_add_epi8(q[e], _mm256_test_epi8_mask(h, _mm256_set1_epi8(static_cast<char>(1 << sub))),
                                      q[e], _mm256_set1_epi8(16));
        const int64_t j = 256 * i + 32 * sub;
        a.sub(i8_ps(_mm256_castsi256_si128(q[e])), i8_ps(_mm256_extracti128_si256(q[e], 1)), j,
              d * static_cast<float>(sc));
        a.min_term(xs, nsub, j / 32, -(dmin * static_cast<float>(mn)));
      }
    }
  } else if constexpr (T == kQ6_K) {
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    const float d = f16(b + 208);
    for (int h = 0; h < 2; ++h) {
      const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h));
      for (int c = 0; c < 2; ++c) {  // the 32 low-nibble bytes at 64 h + 32 c: sub-blocks r = c and c + 2
        const __m256i l = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * h + 32 * c));
        for (int s2 = 0; s2 < 2; ++s2) {
          const int r = c + 2 * s2, k = 4 * h + r;
          // the code's low nibble from l (its high nibble where s2) and its two high bits from hb
          // moved to bits 4-5: one bitwise select (bits 0-3 from the first, 4-7 from the second), then
          // bits 6-7 cleared
          const __m256i lo = s2 ? _mm256_srli_epi16(l, 4) : l;
          const __m256i hi = r < 2 ? _mm256_slli_epi16(hb, 4 - 2 * r) : r == 2 ? hb : _mm256_srli_epi16(hb, 2);
          const __m256i v = _mm256_and_si256(_mm256_ternarylogic_epi32(_mm256_set1_epi8(0x0F), lo, hi, 0xCA),
                                             _mm256_set1_epi8(0x3F));
          const __m256i q = _mm256_sub_epi8(v, _mm256_set1_epi8(32));
          const int64_t j = 256 * i + 32 * k;
          a.sub2(i8_ps(_mm256_castsi256_si128(q)), i8_ps(_mm256_extracti128_si256(q, 1)), j,
                 d * static_cast<float>(sc[2 * k]), d * static_cast<float>(sc[2 * k + 1]));
        }
      }
    }
  }
}

template <int64_t TN>
using SimdAcc = Acc<TN>;
#endif


#include "blocks_avx2.h"

#if defined(CHAT_SIMD_BLOCKS)
constexpr int64_t kAheadRows = 4;  // how far ahead the row pairs are prefetched

// y[t, n] for rows [n0, n1) of W in type T's blocks and x's Tn rows, through the accumulator A (the
// AVX-512 Acc or the AVX2 Acc8: start(x, K, Tn), result(t), and a row_unit<T> of its own)
template <int64_t T, int64_t TN, typename A>
void gemv_rows_simd(const float* x, const float* xs, int64_t Tn_, int64_t K, const uint8_t* w, int64_t row_bytes,
                    int64_t N, int64_t n0, int64_t n1, float* y) {
  constexpr bool kq = T == kQ4_K || T == kQ5_K || T == kQ6_K;
  const int64_t nsub = K / 32, units = kq ? K / 256 : nsub, ub = block_shape(T).bytes;
  const int64_t Tn = TN ? TN : Tn_;
  int64_t n = n0;
  if constexpr (TN == 1) {  // two rows at a time: x read once for both, two independent chains
    for (; n + 2 <= n1; n += 2) {
      const uint8_t* b0 = w + n * row_bytes;
      const uint8_t* b1 = b0 + row_bytes;
      // the rows kAheadRows on towards the caches while this pair computes (the weights come
      // from DRAM): with the super-blocks of K-quants a unit's share of those rows at each unit,
      // else all at once (bench/block_gemv.py measures it)
      const char* ahead = reinterpret_cast<const char*>(b0 + kAheadRows * row_bytes);
      const bool prefetch = n + kAheadRows + 2 <= n1;
      if (!kq && prefetch)
        for (int64_t o = 0; o < 2 * row_bytes; o += 64) _mm_prefetch(ahead + o, _MM_HINT_T0);
      A a0, a1;
      a0.start(x, K, Tn);
      a1.start(x, K, Tn);
      for (int64_t i = 0; i < units; ++i) {
        if (kq && prefetch)
          for (int64_t o = 2 * i * ub; o < 2 * (i + 1) * ub + 64; o += 64) _mm_prefetch(ahead + o, _MM_HINT_T0);
        row_unit<T, TN>(b0 + i * ub, i, a0, xs, nsub);
        row_unit<T, TN>(b1 + i * ub, i, a1, xs, nsub);
      }
      y[n] = a0.result(0);
      y[n + 1] = a1.result(0);
    }
  }
  for (; n < n1; ++n) {
    const uint8_t* b = w + n * row_bytes;
    A a;
    a.start(x, K, Tn);
    for (int64_t i = 0; i < units; ++i) row_unit<T, TN>(b + i * ub, i, a, xs, nsub);
    for (int64_t t = 0; t < Tn; ++t) y[t * N + n] = a.result(t);
  }
}
#endif

template <typename F>
void by_type(int64_t type, F&& f) {
  switch (type) {
    case kQ4_0: return f(std::integral_constant<int64_t, kQ4_0>{});
    case kQ4_1: return f(std::integral_constant<int64_t, kQ4_1>{});
    case kQ5_0: return f(std::integral_constant<int64_t, kQ5_0>{});
    case kQ5_1: return f(std::integral_constant<int64_t, kQ5_1>{});
    case kQ8_0: return f(std::integral_constant<int64_t, kQ8_0>{});
    case kQ4_K: return f(std::integral_constant<int64_t, kQ4_K>{});
    case kQ5_K: return f(std::integral_constant<int64_t, kQ5_K>{});
    case kQ6_K: return f(std::integral_constant<int64_t, kQ6_K>{});
  }
  TORCH_CHECK(false, "GGUF block type ", type, " is not read by the CPU kernels");
}

int64_t check_blocks(const Tensor& w, int64_t type) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(), "blocks: [N, row bytes] uint8");
  const BlockShape s = block_shape(type);
  TORCH_CHECK(w.size(1) % s.bytes == 0, "blocks: a row is not whole blocks of type ", type);
  return w.size(1) / s.bytes * s.weights;
}

// What a product of x [T, K] fp32 and blocks W [N, row bytes] starts from: the sizes checked
// (`name` in the message), y [T, N] allocated, the pointers the kernels take
struct BlockProduct {
  int64_t K, N, Tn, rb;
  Tensor y;
  const float* xp;
  const uint8_t* wp;
  float* yp;
};

BlockProduct block_product_of(const Tensor& x, const Tensor& w, int64_t type, const char* name) {
  BlockProduct b;
  b.K = check_blocks(w, type);
  b.N = w.size(0);
  b.Tn = x.size(0);
  b.rb = w.size(1);
  TORCH_CHECK(x.size(1) == b.K, name, ": x has ", x.size(1), " columns, the blocks ", b.K);
  b.y = at::empty({b.Tn, b.N}, x.options());
  b.xp = x.is_contiguous() ? x.data_ptr<float>() : nullptr;
  b.wp = w.data_ptr<uint8_t>();
  b.yp = b.y.data_ptr<float>();
  return b;
}

// blocks [N, row bytes] uint8 → [N, K] fp32: gguf-py's values bit for bit
Tensor block_dequant(const Tensor& w, int64_t type) {
  const int64_t K = check_blocks(w, type), N = w.size(0), rb = w.size(1);
  Tensor y = at::empty({N, K}, w.options().dtype(at::kFloat));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  by_type(type, [&](auto t) {
    at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) { dequant_rows<decltype(t)::value>(wp, rb, K, n0, n1, yp); });
  });
  return y;
}

// fp32 values to bf16, to the nearest with ties to even (as c10::BFloat16; the weights' values
// are fp16 scales times small integers: never subnormal, which AVX512-BF16's form flushes)
inline void to_bf16(const float* s, at::BFloat16* d, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512BF16__)
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(s + i)));
#endif
  for (; i < n; ++i) d[i] = at::BFloat16(s[i]);
}

// rows [n0, n1) of W dequantized (gguf-py's values) and rounded to bf16 into y (K a row)
template <int64_t T>
void dequant_rows_bf16(const uint8_t* w, int64_t row_bytes, int64_t K, int64_t n0, int64_t n1, at::BFloat16* y) {
  constexpr int64_t BW = T == kQ4_K || T == kQ5_K || T == kQ6_K ? 256 : 32;
  const int64_t bytes = block_shape(T).bytes, nb = K / BW;
  alignas(64) float buf[BW];
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t b = 0; b < nb; ++b) {
      dequant_block<T>(w + n * row_bytes + b * bytes, buf);
      to_bf16(buf, y + n * K + b * BW, BW);
    }
}

// Weights dequantized at a time by block_linear_bf16: a chunk of rows of W in bf16 (~2 MiB) that
// stays in the caches while the GEMM reads it (bench/cpu_block_bench.py --rows 512 --cached: the
// bf16 column)
constexpr int64_t kBf16Chunk = int64_t{1} << 20;

// y = x W^T in bf16 products, for a prefill's many rows where rounded inputs are allowed (the
// cpu_int8 setting) and the CPU multiplies bf16 natively (AVX512-BF16: models/kernels/cpu/step.py
// bf16_gemm): x and the dequantized W rounded to bf16, the sums in fp32 by torch's bf16 GEMM
// (oneDNN), its output rounded to bf16, then widened. tests/kernels/test_block_bf16.py bounds it against
// the fp64 product of the rounded operands.
Tensor block_linear_bf16(const Tensor& x, const Tensor& w, int64_t type) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "block_linear_bf16: x must be [T, K] fp32");
  auto [K, N, Tn, rb, y, xp_, wp, yp_] = block_product_of(x, w, type, "block_linear_bf16");
  const Tensor xb = x.to(at::kBFloat16);
  const int64_t chunk = std::min(N, std::max<int64_t>(16, kBf16Chunk / std::max<int64_t>(K, 1)));
  Tensor wd = at::empty({chunk, K}, x.options().dtype(at::kBFloat16));
  Tensor part = at::empty({Tn, chunk}, x.options().dtype(at::kBFloat16));
  for (int64_t n0 = 0; n0 < N; n0 += chunk) {
    const int64_t rows = std::min(chunk, N - n0);
    at::BFloat16* dp = wd.data_ptr<at::BFloat16>();
    by_type(type, [&](auto t) {
      at::parallel_for(0, rows, 16, [&](int64_t a, int64_t b) {
        dequant_rows_bf16<decltype(t)::value>(wp + n0 * rb, rb, K, a, b, dp);
      });
    });
    Tensor out = part.narrow(1, 0, rows);
    at::mm_out(out, xb, wd.narrow(0, 0, rows).t());
    y.narrow(1, n0, rows).copy_(out);
  }
  return y;
}

#include "blocks_int8.h"
#include "rows16_int8.h"

// y = x W^T for x [T, K] fp32 (T <= 8, xp) and W in GGUF blocks [N, row bytes] into yp
void block_product(const float* xp, int64_t Tn, int64_t K, const uint8_t* wp, int64_t rb, int64_t N, int64_t type,
                   float* yp) {
#if defined(CHAT_SIMD_BLOCKS)
  std::vector<float> xs(Tn * (K / 32));  // each 32 inputs' sum, for the minimum terms
  for (int64_t t = 0; t < Tn; ++t)
    for (int64_t i = 0; i < K / 32; ++i) {
      float acc = 0.f;
      for (int j = 0; j < 32; ++j) acc += xp[t * K + 32 * i + j];
      xs[t * (K / 32) + i] = acc;
    }
  by_type(type, [&](auto t) {
    constexpr int64_t T = decltype(t)::value;
    at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
      if (Tn == 1) {
        gemv_rows_simd<T, 1, SimdAcc<1>>(xp, xs.data(), Tn, K, wp, rb, N, n0, n1, yp);
        return;
      }
      for (int64_t c0 = n0; c0 < n1; c0 += 16) {  // 16 rows of W (a few KB) against each run of x's rows
        const int64_t c1 = std::min(n1, c0 + 16);
        row_runs(Tn, [&](auto run, int64_t t0) {
          constexpr int64_t R = decltype(run)::value;
          gemv_rows_simd<T, R, SimdAcc<R>>(xp + t0 * K, xs.data() + t0 * (K / 32), R, K, wp, rb, N, c0, c1,
                                           yp + t0 * N);
        });
      }
    });
  });
#else
  by_type(type, [&](auto t) {
    at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
      gemv_rows<decltype(t)::value>(xp, Tn, K, wp, rb, N, n0, n1, yp);
    });
  });
#endif
}

// Without an int8 dot product here: x~ (exact in fp32) through the fp32 kernels, kMaxRows rows at a time
void rounded_rows_product(const Int8Rows& rows, int64_t Tn, int64_t K, const uint8_t* wp, int64_t rb, int64_t N,
                          int64_t type, float* yp) {
  const std::vector<float> xt = dequantized_rows(rows, Tn);
  for (int64_t t0 = 0; t0 < Tn; t0 += kMaxRows)
    block_product(xt.data() + t0 * K, std::min(kMaxRows, Tn - t0), K, wp, rb, N, type, yp + t0 * N);
}

// Whether a prefill of Tn rows on int8 inputs takes x~ times the dequantized weights by the fp32
// GEMM rather than the int8 tiles: the 32-weight types from 256 rows (a float scale a 32 codes
// and row keeps their tiles slower than the GEMM on x~ at 512 rows; at 128 rows the tiles are as
// fast: bench/cpu_block_bench.py --rows)
bool gemm_prefill(int64_t type, int64_t Tn) { return !k_type(type) && Tn >= 256; }

// y = x W^T for x [T, K] fp32 and W in GGUF blocks [N, row bytes]: T <= 8 (decode's rows) on x
// itself; int8: on x~, x rounded to int8 as llama.cpp rounds it for that type (blocks_int8.h), any
// T (prefill's rows kMaxRows at a time against each few rows of W, which stay in the caches)
Tensor block_linear(const Tensor& x, const Tensor& w, int64_t type, bool int8) {
  if (type >= kRows16) {  // (blocks interleaved 16 rows at a time: rounded inputs only, rows16_int8.h)
    TORCH_CHECK(int8, "block_linear: the rows16 layout takes int8 inputs");
    return rows16_linear(x, w, rows16_code(type).type, rows16_code(type).wide);
  }
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && (int8 || x.size(0) <= kMaxRows),
              "block_linear: x must be [T <= 8, K] contiguous fp32 (any T with int8)");
  auto [K, N, Tn, rb, y, xp, wp, yp] = block_product_of(x, w, type, "block_linear");
  if (!int8) {
    block_product(xp, Tn, K, wp, rb, N, type, yp);
    return y;
  }
  const Int8Rows rows = quantize_rows(xp, Tn, K, type);
  if (gemm_prefill(type, Tn)) {
    // a prefill's x~ (exact in fp32) times the dequantized weights, a chunk of ~16 MiB of rows at
    // a time, by torch's fp32 GEMM: where that is faster than the int8 tiles (gemm_prefill)
    const std::vector<float> xt = dequantized_rows(rows, Tn);
    const Tensor xtt = at::from_blob(const_cast<float*>(xt.data()), {Tn, K}, x.options());
    const int64_t chunk = std::max<int64_t>(1, (int64_t{4} << 20) / std::max<int64_t>(K, 1));
    for (int64_t n0 = 0; n0 < N; n0 += chunk) {
      const int64_t n1 = std::min(N, n0 + chunk);
      const Tensor wd = block_dequant(w.slice(0, n0, n1), type);
      if (n0 == 0 && n1 == N)
        at::mm_out(y, xtt, wd.t());
      else
        y.slice(1, n0, n1).copy_(at::mm(xtt, wd.t()));
    }
    return y;
  }
#if defined(CHAT_INT8_DOT)
  by_type(type, [&](auto t) {
    constexpr int64_t T = decltype(t)::value;
    if (Tn == 1) {
      at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) { gemv_rows_i8<T, 1>(rows, 0, 1, wp, rb, N, n0, n1, yp); });
      return;
    }
    // prefill: the minimum terms apart (sum_terms)
    constexpr bool apart = T == kQ4_K || T == kQ5_K || T == kQ4_1 || T == kQ5_1;
    constexpr bool pairs = !k_type(T);
    if (pairs && K % 64) {  // (the 32-weight types two blocks at a time; an odd count of blocks as decode)
      at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
        for (int64_t t0 = 0; t0 < Tn; t0 += kMaxRows)
          gemv_rows_i8<T, 0>(rows, t0, std::min(kMaxRows, Tn - t0), wp, rb, N, n0, n1, yp);
      });
      return;
    }
    at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
      for (int64_t c0 = n0; c0 < n1; c0 += 16)  // 16 rows of W (a few KB) against every row of x~
        for (int64_t t0 = 0; t0 < Tn; t0 += kMaxRows) {
          const int64_t c1 = std::min(n1, c0 + 16);
          if (Tn - t0 >= kMaxRows) {  // (a whole tile: its sums in registers)
            if constexpr (pairs) gemm_rows_pairs<T, kMaxRows>(rows, t0, kMaxRows, wp, rb, N, c0, c1, yp);
            else gemv_rows_i8<T, kMaxRows, !apart>(rows, t0, kMaxRows, wp, rb, N, c0, c1, yp);
          } else {
            if constexpr (pairs) gemm_rows_pairs<T, 0>(rows, t0, Tn - t0, wp, rb, N, c0, c1, yp);
            else gemv_rows_i8<T, 0, !apart>(rows, t0, Tn - t0, wp, rb, N, c0, c1, yp);
          }
        }
    });
    if constexpr (apart) sum_terms(rows, Tn, wp, rb, N, T, y);
  });
#elif defined(CHAT_INT8_AVX2)
  by_type(type, [&](auto t) {
    constexpr int64_t T = decltype(t)::value;
    if (Tn == 1) {
      at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) { gemv_rows_i8<T, 1>(rows, 0, 1, wp, rb, N, n0, n1, yp); });
      return;
    }
    // the K-quants' whole tiles interleaved (kquant_tiles_avx2.h), their minimum terms apart; the
    // last Tn % kMaxRows rows as below
    int64_t tiled = 0;
    if constexpr (k_type(T)) {
      tiled = Tn / kMaxRows * kMaxRows;
      if (tiled) {
        const Int8Tiles xt = tile_rows(rows, tiled / kMaxRows);
        at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) { gemm_k_tiles<T>(xt, wp, rb, N, n0, n1, yp); });
        sum_terms(rows, tiled, wp, rb, N, T, y);
      }
    }
    if (tiled == Tn) return;
    at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
      for (int64_t c0 = n0; c0 < n1; c0 += 16)  // 16 rows of W against every row of x~, as above
        for (int64_t t0 = tiled; t0 < Tn; t0 += kMaxRows) {
          const int64_t c1 = std::min(n1, c0 + 16);
          if (Tn - t0 >= kMaxRows)
            gemv_rows_i8<T, kMaxRows>(rows, t0, kMaxRows, wp, rb, N, c0, c1, yp);
          else
            gemv_rows_i8<T, 0>(rows, t0, Tn - t0, wp, rb, N, c0, c1, yp);
        }
    });
  });
#else
  rounded_rows_product(rows, Tn, K, wp, rb, N, type, yp);
#endif
  return y;
}

#if defined(CHAT_INT8_DOT) || defined(CHAT_INT8_AVX2)
// One of the matrices below: x~ against W's blocks (type, row bytes)
struct RowsOfMatrix {
  const Int8Rows* x;
  const uint8_t* w;
  int64_t type, rb;
};

// Matrices m = 0 .. M-1 of `rows` rows each against their x~, all in one parallel region: y_m =
// x~_m W_m^T into out + m * rows, each row's sums those of block_linear's one-row kernel
// (gemv_rows_i8), the rows of every matrix shared out between the threads as one range
void matrices_rows_i8(const std::vector<RowsOfMatrix>& ms, int64_t rows, float* out) {
  const int64_t M = static_cast<int64_t>(ms.size());
  at::parallel_for(0, M * rows, 16, [&](int64_t a, int64_t b) {
    while (a < b) {
      const int64_t m = a / rows, n0 = a % rows, n1 = std::min(rows, n0 + (b - a));
      const RowsOfMatrix& r = ms[m];
      by_type(r.type, [&](auto tc) {
        gemv_rows_i8<decltype(tc)::value, 1>(*r.x, 0, 1, r.w, r.rb, rows, n0, n1, out + m * rows);
      });
      a += n1 - n0;
    }
  });
}
#endif

// One token's routed SwiGLU experts in GGUF blocks (quant.BlockExperts' decode): for each chosen
// expert in ascending order, h = SiLU(x G_e^T) * (x U_e^T), y = h D_e^T, and out += y * weight,
// each product block_linear's (on int8 inputs where `int8`): what BlockExperts' per-expert loop
// computes with the same kernel calls, without its dozen dispatched ops an expert (the
// experts' Python loop was about a fifth of a MoE hybrid's decode step: bench/cpu_bench.py,
// a Granite-4.0-H-Tiny-like file). On int8 inputs the chosen experts' gate and up rows are one
// parallel region and their down rows a second, x rounded once (not two regions and two
// roundings an expert, each region's start and end a wait of both threads: the same
// benchmark); the same kernel a row, so the same bits. x [1, H] fp32; gate, up [E, I, row
// bytes], down [E, H, row bytes] uint8; idx [1, k] int64; weights [1, k] fp32. Returns [1, H].
Tensor experts_decode(const Tensor& x, const Tensor& gate, const Tensor& up, const Tensor& down, int64_t tg,
                      int64_t tu, int64_t td, const Tensor& idx, const Tensor& weights, bool int8) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) == 1 && x.scalar_type() == at::kFloat && !x.is_cuda(),
              "experts_decode: x must be one fp32 CPU row [1, H]");
  TORCH_CHECK(gate.dim() == 3 && up.dim() == 3 && down.dim() == 3 && gate.size(0) == up.size(0) &&
              gate.size(0) == down.size(0), "experts_decode: expert stacks [E, rows, row bytes]");
  TORCH_CHECK(idx.scalar_type() == at::kLong && weights.scalar_type() == at::kFloat && idx.numel() == weights.numel(),
              "experts_decode: idx (int64) and weights (fp32) of the chosen experts");
  const Tensor xc = x.contiguous(), ic = idx.contiguous(), wc = weights.contiguous();
  const int64_t k = ic.numel(), E = gate.size(0);
  std::vector<std::pair<int64_t, float>> chosen(k);
  for (int64_t j = 0; j < k; ++j) {
    chosen[j] = {ic.data_ptr<int64_t>()[j], wc.data_ptr<float>()[j]};
    TORCH_CHECK(chosen[j].first >= 0 && chosen[j].first < E, "experts_decode: expert ", chosen[j].first,
                " of ", E);
  }
  std::sort(chosen.begin(), chosen.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  Tensor out = at::zeros_like(xc);
  float* o = out.data_ptr<float>();
  const int64_t H = xc.size(1);
#if defined(CHAT_INT8_DOT) || defined(CHAT_INT8_AVX2)
  const bool blocks = tg < kRows16 && tu < kRows16 && td < kRows16;
  if (int8 && blocks && k > 0 && gate.is_contiguous() && up.is_contiguous() && down.is_contiguous()) {
    const int64_t I = gate.size(1), rb_gate = gate.size(2), rb_up = up.size(2), rb_down = down.size(2);
    TORCH_CHECK(check_blocks(gate.select(0, 0), tg) == H && up.size(1) == I && check_blocks(up.select(0, 0), tu) == H,
                "experts_decode: the gate and up stacks must be [E, I, row bytes] of x's width");
    TORCH_CHECK(check_blocks(down.select(0, 0), td) == I && down.size(1) == H,
                "experts_decode: the down stack must be [E, H, row bytes] of the experts' width");
    const float* xp = xc.data_ptr<float>();
    const Int8Rows xg = quantize_rows(xp, 1, H, tg);
    const Int8Rows xu = tu == tg ? Int8Rows{} : quantize_rows(xp, 1, H, tu);
    std::vector<RowsOfMatrix> ms;
    for (const auto& [e, _] : chosen) ms.push_back({&xg, gate.data_ptr<uint8_t>() + e * I * rb_gate, tg, rb_gate});
    for (const auto& [e, _] : chosen)  // (then their ups)
      ms.push_back({tu == tg ? &xg : &xu, up.data_ptr<uint8_t>() + e * I * rb_up, tu, rb_up});
    std::vector<float> gu(2 * k * I);
    matrices_rows_i8(ms, I, gu.data());
    std::vector<Int8Rows> hs(k);
    std::vector<float> h(I);
    for (int64_t j = 0; j < k; ++j) {
      const float* g = gu.data() + j * I;
      const float* u = gu.data() + (k + j) * I;
      for (int64_t i = 0; i < I; ++i) h[i] = silu_f(g[i]) * u[i];
      hs[j] = quantize_rows(h.data(), 1, I, td);
    }
    ms.clear();
    for (int64_t j = 0; j < k; ++j) ms.push_back({&hs[j], down.data_ptr<uint8_t>() + chosen[j].first * H * rb_down, td, rb_down});
    std::vector<float> ys(k * H);
    matrices_rows_i8(ms, H, ys.data());
    for (int64_t j = 0; j < k; ++j) {  // in ascending expert order, as the loop below adds them
      const float* yp = ys.data() + j * H;
      const float wj = chosen[j].second;
      for (int64_t i = 0; i < H; ++i) o[i] += yp[i] * wj;
    }
    return out;
  }
#endif
  for (int64_t j = 0; j < k; ++j) {
    const int64_t e = chosen[j].first;
    Tensor h = block_linear(xc, gate.select(0, e), tg, int8);
    const Tensor u = block_linear(xc, up.select(0, e), tu, int8);
    float* hp = h.data_ptr<float>();
    const float* up_ = u.data_ptr<float>();
    for (int64_t i = 0; i < h.numel(); ++i) hp[i] = silu_f(hp[i]) * up_[i];
    const Tensor y = block_linear(h, down.select(0, e), td, int8);
    TORCH_CHECK(y.size(1) == H, "experts_decode: the down stack's rows must be x's width");
    const float* yp = y.data_ptr<float>();
    float w = chosen[j].second;
    for (int64_t i = 0; i < H; ++i) o[i] += yp[i] * w;
    // (an expert chosen twice counts twice, as the top-k weights give it)
  }
  return out;
}

// y = x W^T for x [T, K] whose rows a speculative verify feeds together, each row's sums exactly
// those of a one-row call (the decode step's): the decode's accumulators over up to kMaxRows rows
// (each row's operations the one-row ones; a block decoded once for all), or where a type's sums
// would round otherwise, per 16 rows of W (a few KB, in the caches while the T rows pass over them)
// the one-row kernel for each row of x. The decode's bits (tests/engine/test_speculative.py), the weights
// read from memory once rather than T times.
constexpr int64_t kVerifyChunk = 16;

template <typename F>
void rows_by_chunk(int64_t N, int64_t Tn, F&& f) {  // f(t, c0, c1) for each row t of x and chunk of W
  at::parallel_for(0, N, kVerifyChunk, [&](int64_t n0, int64_t n1) {
    for (int64_t c0 = n0; c0 < n1; c0 += kVerifyChunk)
      for (int64_t t = 0; t < Tn; ++t) f(t, c0, std::min(n1, c0 + kVerifyChunk));
  });
}

Tensor block_linear_rows(const Tensor& x, const Tensor& w, int64_t type, bool int8) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "block_linear_rows: x must be [T, K] fp32");
  if (x.size(0) == 1 || type >= kRows16) return block_linear(x, w, type, int8);
  auto [K, N, Tn, rb, y, xp, wp, yp] = block_product_of(x, w, type, "block_linear_rows");
  if (!int8) {  // (the decode's accumulators for several rows: each row's operations are the one-row ones)
    for (int64_t t0 = 0; t0 < Tn; t0 += kMaxRows)
      block_product(xp + t0 * K, std::min(kMaxRows, Tn - t0), K, wp, rb, N, type, yp + t0 * N);
    return y;
  }
  const Int8Rows rows = quantize_rows(xp, Tn, K, type);
#if defined(CHAT_INT8_DOT) || defined(CHAT_INT8_AVX2)
  by_type(type, [&](auto tc) {  // (the same: the decode's accumulators, rows at a time)
    constexpr int64_t T = decltype(tc)::value;
    if constexpr (T == kQ4_1 || T == kQ5_1) {
      // their scalar minimum terms compile to other roundings for several rows (a fused
      // multiply-add or not): the one-row kernel per row, each 16 rows of W in the caches
      rows_by_chunk(N, Tn, [&](int64_t t, int64_t c0, int64_t c1) { gemv_rows_i8<T, 1>(rows, t, 1, wp, rb, N, c0, c1, yp); });
    } else {
      at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
        for (int64_t c0 = n0; c0 < n1; c0 += kVerifyChunk) {  // 16 rows of W against each run (row_runs)
          const int64_t c1 = std::min(n1, c0 + kVerifyChunk);
          row_runs(Tn, [&](auto run, int64_t t0) {
            gemv_rows_i8<T, decltype(run)::value>(rows, t0, decltype(run)::value, wp, rb, N, c0, c1, yp);
          });
        }
      });
    }
  });
#else
  rounded_rows_product(rows, Tn, K, wp, rb, N, type, yp);
#endif
  return y;
}

// A BlockLinear's type as the step's params carry it: the GGUF type, plus kInt8Inputs where the
// module takes int8 inputs (quant.BlockLinear.int8_inputs)
constexpr int64_t kInt8Inputs = 256;

// The linear at params[at_] (weight, int4 scale/zero or None for an fp32 weight, bias or None; for
// GGUF blocks: uint8 blocks, their type as a one-element int64 tensor, bias or None);
// moves at_ past its three entries.
Tensor linear(const Tensor& x, const OptList& p, int64_t& at_) {
  const Tensor w = p.get(at_).value();
  const std::optional<Tensor> sz = p.get(at_ + 1);
  const std::optional<Tensor> bias = p.get(at_ + 2);
  at_ += 3;
  const bool blocks = sz.has_value() && sz->scalar_type() == at::kLong;  // GGUF blocks: sz holds the type
  const int64_t code = blocks ? sz->data_ptr<int64_t>()[0] : 0;
  // Several rows (a speculative verify): each row's bits are the one-row step's (block_linear_rows;
  // torch's int4 kernel sums each row alike; an fp32 weight row by row: its GEMM's are not)
  Tensor y;
  if (blocks)
    y = block_linear_rows(x.contiguous(), w, code % kInt8Inputs, code >= kInt8Inputs);
  else if (sz.has_value())
    y = int4_mm(x, w, *sz);
  else if (x.size(0) == 1)
    y = at::linear(x, w);
  else {
    std::vector<Tensor> rows;
    for (int64_t t = 0; t < x.size(0); ++t) rows.push_back(at::linear(x.narrow(0, t, 1), w));
    y = at::cat(rows, 0);
  }
  if (bias.has_value()) y.add_(*bias);
  return y;
}

// block_linears_row for matrices all in rows16 (rows16_int8.h): x rounded once per width, the
// 16-row groups of every matrix in one parallel region; each output block_linear's bits
Tensor rows16_linears_row(const Tensor& x, const std::vector<Tensor>& ws, const std::vector<int64_t>& codes) {
  const int64_t K = x.size(1), parts = static_cast<int64_t>(ws.size());
  std::vector<int64_t> start(parts + 1, 0), groups(parts + 1, 0);
  for (int64_t i = 0; i < parts; ++i) {
    TORCH_CHECK(check_rows16(ws[i], rows16_code(codes[i]).type) == K, "block_linears_row: x has ", K,
                " columns, a matrix another");
    start[i + 1] = start[i] + ws[i].size(0);
    groups[i + 1] = groups[i] + ws[i].size(0) / kGroupRows;
  }
  Tensor y = at::empty({1, start[parts]}, x.options());
#if defined(CHAT_ROWS16)
  const float* xp = x.data_ptr<float>();
  // (every rows16 type rounds int8 inputs alike, Q8_0's rule: one rounding serves them all; only
  // Int8Rows.init, which the rows16 products do not read, depends on the type)
  std::optional<Int8Rows> rounded;
  std::optional<WideRows> wide;
  for (int64_t c : codes) {
    if (rows16_code(c).wide) {
      if (!wide) wide = quantize_wide(xp, 1, K);
    } else if (!rounded) {
      rounded = quantize_rows(xp, 1, K, rows16_code(c).type);
    }
  }
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, groups[parts], 1, [&](int64_t g0, int64_t g1) {
    for (int64_t i = 0; i < parts; ++i) {
      const int64_t a = std::max(g0, groups[i]), b = std::min(g1, groups[i + 1]);
      if (a >= b) continue;
      const auto [type, wide_inputs] = rows16_code(codes[i]);
      const uint8_t* wp = ws[i].data_ptr<uint8_t>();
      if (wide_inputs)
        rows16_product(*wide, 1, wp, type, ws[i].size(0), a - groups[i], b - groups[i], yp + start[i]);
      else
        rows16_product(*rounded, 1, wp, type, ws[i].size(0), a - groups[i], b - groups[i], yp + start[i]);
    }
  });
#else
  TORCH_CHECK(false, "block_linears_row: this build has no int8 dot product for the rows16 layout");
#endif
  return y;
}

// One row x [1, K] times several GGUF-block matrices that read it (q/k/v, gate/up kept apart: their
// types may differ), outputs side by side in one parallel region, x rounded to int8 once per type
// (or its 32-input sums made once): each output is the one-matrix call's (block_linear's) bits,
// the same row kernels on the same rows of W; the forks and the rounding of the separate calls
// saved (bench/cpu_bench.py, the decode of small GGUF models; tests/engine/test_speculative.py compares
// the decode's bits with a verify's rows, which take the separate calls).
Tensor block_linears_row(const Tensor& x, const std::vector<Tensor>& ws, const std::vector<int64_t>& types, bool int8) {
  const int64_t K = x.size(1), parts = static_cast<int64_t>(ws.size());
  std::vector<int64_t> start(parts + 1, 0);
  const int64_t rows16 = std::count_if(types.begin(), types.end(), [](int64_t t) { return t >= kRows16; });
  if (rows16 == parts) return rows16_linears_row(x, ws, types);
  if (rows16) {  // (a mix of layouts: each matrix on its own)
    std::vector<Tensor> ys;
    for (int64_t i = 0; i < parts; ++i) ys.push_back(block_linear(x, ws[i], types[i], int8));
    return at::cat(ys, 1);
  }
  for (int64_t i = 0; i < parts; ++i) {
    TORCH_CHECK(check_blocks(ws[i], types[i]) == K, "block_linears_row: x has ", K, " columns, a matrix another");
    start[i + 1] = start[i] + ws[i].size(0);
  }
  Tensor y = at::empty({1, start[parts]}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  std::map<int64_t, Int8Rows> rounded;  // (a type's rounding of x: K-quants per 256, the others per 32 with their offset)
#if defined(CHAT_INT8_DOT) || defined(CHAT_INT8_AVX2)
  if (int8)
    for (int64_t t : types)
      if (!rounded.count(t)) rounded.emplace(t, quantize_rows(xp, 1, K, t));
#else
  if (int8) {  // (no int8 dot product here: each matrix as block_linear takes it)
    for (int64_t i = 0; i < parts; ++i) y.narrow(1, start[i], ws[i].size(0)).copy_(block_linear(x, ws[i], types[i], true));
    return y;
  }
#endif
#if defined(CHAT_SIMD_BLOCKS)
  std::vector<float> xs(K / 32);  // each 32 inputs' sum, for the minimum terms (block_product's)
  for (int64_t i = 0; i < K / 32; ++i) {
    float acc = 0.f;
    for (int j = 0; j < 32; ++j) acc += xp[32 * i + j];
    xs[i] = acc;
  }
#endif
  at::parallel_for(0, start[parts], 16, [&](int64_t n0, int64_t n1) {
    for (int64_t i = 0; i < parts; ++i) {
      const int64_t m0 = std::max(n0, start[i]) - start[i], m1 = std::min(n1, start[i + 1]) - start[i];
      if (m0 >= m1) continue;
      const uint8_t* wp = ws[i].data_ptr<uint8_t>();
      const int64_t rb = ws[i].size(1), N = ws[i].size(0);
      float* out = yp + start[i];
      by_type(types[i], [&](auto tc) {
        constexpr int64_t T = decltype(tc)::value;
#if defined(CHAT_INT8_DOT) || defined(CHAT_INT8_AVX2)
        if (int8) {
          gemv_rows_i8<T, 1>(rounded.at(types[i]), 0, 1, wp, rb, N, m0, m1, out);
          return;
        }
#endif
#if defined(CHAT_SIMD_BLOCKS)
        gemv_rows_simd<T, 1, SimdAcc<1>>(xp, xs.data(), 1, K, wp, rb, N, m0, m1, out);
#else
        gemv_rows<T>(xp, 1, K, wp, rb, N, m0, m1, out);
#endif
      });
    }
  });
  return y;
}

// Several linears reading the same input (q/k/v or gate/up kept apart), outputs side by side: one
// row's GGUF blocks of one rounding in one call (block_linears_row), else each linear in turn.
Tensor linears(const Tensor& x, const OptList& p, int64_t& at_, int64_t parts) {
  if (parts == 1) return linear(x, p, at_);
  std::vector<Tensor> ws;
  std::vector<int64_t> types;
  bool int8 = false, joint = x.size(0) == 1 && x.is_contiguous();
  for (int64_t i = 0; i < parts && joint; ++i) {
    const std::optional<Tensor> sz = p.get(at_ + 3 * i + 1);
    joint = sz.has_value() && sz->scalar_type() == at::kLong && !p.get(at_ + 3 * i + 2).has_value();
    if (!joint) break;
    const int64_t code = sz->data_ptr<int64_t>()[0];
    if (i > 0 && (code >= kInt8Inputs) != int8) joint = false;
    int8 = code >= kInt8Inputs;
    ws.push_back(p.get(at_ + 3 * i).value());
    types.push_back(code % kInt8Inputs);
  }
  if (joint) {
    at_ += 3 * parts;
    return block_linears_row(x, ws, types, int8);
  }
  std::vector<Tensor> ys;
  for (int64_t i = 0; i < parts; ++i) ys.push_back(linear(x, p, at_));
  return at::cat(ys, 1);
}

// Rotate-half RoPE over the first r dims of one head, in place: x*cos + roll(x, r/2)*signed_sin.
void rope(float* x, const float* cos, const float* sin, int64_t r) {
  const int64_t h = r / 2;
  float tmp[512];
  for (int64_t d = 0; d < r; ++d) tmp[d] = x[d];
  for (int64_t d = 0; d < h; ++d) x[d] = tmp[d] * cos[d] + tmp[d + h] * sin[d];
  for (int64_t d = h; d < r; ++d) x[d] = tmp[d] * cos[d] + tmp[d - h] * sin[d];
}

// Over an fp32 cache: up to this many live slots the attention runs as per-head loops, above it as
// torch's batched GEMMs, which read a long cache faster. An fp16 cache (head sizes a multiple of
// kFlashLanes, up to 256; AVX-512, or AVX2 with FMA and F16C) takes attend_long at any length, as
// fast as the loops on short ones (bench/cpu_bench.py --context measures both).
constexpr int64_t kLoopSlots = 256;

// Rows of the cache to and from fp32 (vectorised fp16 conversions where AVX-512 or F16C exists; the
// rounding is to nearest even, as Tensor.to does).
#if defined(__AVX512F__)
inline __m512 load16(const at::Half* p) {  // 16 fp16 -> 16 fp32
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#endif
#if defined(__F16C__) && defined(__AVX__)
inline __m256 load8(const at::Half* p) {  // 8 fp16 -> 8 fp32
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
#endif

inline void store_row(const float* src, float* dst, int64_t n) { std::copy(src, src + n, dst); }
inline void load_row(const at::Half* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, load16(src + i));
#endif
#if defined(__F16C__) && defined(__AVX__)
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, load8(src + i));
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}
inline void store_row(const float* src, at::Half* dst, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                        _mm512_cvtps_ph(_mm512_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
#if defined(__F16C__) && defined(__AVX__)
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
  for (; i < n; ++i) dst[i] = at::Half(src[i]);
}

// A cache row as fp32: the row itself, or widened into `buf`.
inline const float* as_f32(const float* row, float*, int64_t) { return row; }
inline const float* as_f32(const at::Half* row, float* buf, int64_t n) {
  load_row(row, buf, n);
  return buf;
}

// The KV cache holds fp32 or fp16 (cpu_step.py: fp16 with 4-bit weights, half the bytes to read).
template <typename T>
void attend_short(const float* q, const T* kc, const T* vc, int64_t ks, int64_t vs, int64_t live,
                  int64_t H, int64_t group, int64_t D, float scale, float* out) {
  float sc[kLoopSlots];
  float row[512];
  for (int64_t h = 0; h < H; ++h) {
    const T* keys = kc + (h / group) * ks;
    const T* values = vc + (h / group) * vs;
    float mx = -INFINITY, sum = 0.f;
    for (int64_t s = 0; s < live; ++s) {
      sc[s] = dot(q + h * D, as_f32(keys + s * D, row, D), D) * scale;
      mx = std::max(mx, sc[s]);
    }
    for (int64_t s = 0; s < live; ++s) sum += (sc[s] = std::exp(sc[s] - mx));
    float* o = out + h * D;
    std::fill(o, o + D, 0.f);
    for (int64_t s = 0; s < live; ++s) {
      const float p = sc[s] / sum;
      const float* vrow = as_f32(values + s * D, row, D);
      for (int64_t d = 0; d < D; ++d) o[d] += p * vrow[d];
    }
  }
}

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#define CHAT_FLASH_DECODE 1
#endif

#if defined(__AVX512F__)
// exp over 16 lanes (Cephes' expf: 2^n e^r with |r| <= ln2/2 and a degree-7 polynomial, within
// ~1 ulp), for the long attention's softmax, where the per-score call of std::exp would cost more
// than reading the cache.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));  // e^-87 ~ 1.6e-38: a zero weight either way
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);  // x - n ln2, ln2 in two parts
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

inline __mmask16 lanes_left(int64_t n) { return n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1); }

#endif

#if defined(CHAT_FLASH_DECODE)
// An fp16 cache (flash decoding): the live slots split in fixed blocks, one block of one KV head per
// work item on torch's threads; a work item reads each key row once for the `group` query heads
// sharing it and leaves, per head, its block's softmax pieces: the max score m, the sum l of
// exp(score - m) and the exp-weighted values. The blocks merge after, in block order: the same
// result on any thread count. One parallel region a layer and no scores through memory; the cache
// comes from DRAM each step (the weights stream through the caches in between), so the rows are
// prefetched: the keys kAhead rows ahead, the block's values while its scores are computed (the
// prefetches and the single region each cut the step's attention time at long contexts:
// bench/cpu_bench.py --context).
constexpr int64_t kSlotBlock = 256;
constexpr int64_t kMaxGroup = 16;
constexpr int64_t kAhead = 16;

#if defined(__AVX512F__)
constexpr int64_t kFlashLanes = 16;
#else
constexpr int64_t kFlashLanes = 8;
#endif

// A block's first kAhead key rows towards L1, before its scores
inline void prefetch_keys(const at::Half* keys, int64_t n, int64_t D) {
  for (int64_t j = 0; j < std::min(n, kAhead); ++j)
    for (int64_t l = 0; l < D * 2; l += 64) _mm_prefetch(reinterpret_cast<const char*>(keys + j * D) + l, _MM_HINT_T0);
}
// At row j's score: the key row kAhead on, and row j's values
inline void prefetch_rows(const at::Half* keys, const at::Half* values, int64_t j, int64_t D) {
  for (int64_t l = 0; l < D * 2; l += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(keys + (j + kAhead) * D) + l, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(values + j * D) + l, _MM_HINT_T0);
  }
}
#endif

#if defined(__AVX512F__)
template <int NV>  // D = 16 NV (AVX-512)
void attend_block(const float* q, const at::Half* keys, const at::Half* values, int64_t n, int64_t group,
                  float scale, float* part) {
  constexpr int D = NV * 16;
  alignas(64) float sc[kMaxGroup][kSlotBlock];
  prefetch_keys(keys, n, D);
  for (int64_t j = 0; j < n; ++j) {  // scores: each key row widened once, for all the group's queries
    prefetch_rows(keys, values, j, D);
    __m512 k[NV];
    for (int i = 0; i < NV; ++i) k[i] = load16(keys + j * D + 16 * i);
    for (int64_t g = 0; g < group; ++g) {
      __m512 a = _mm512_mul_ps(_mm512_loadu_ps(q + g * D), k[0]);
      for (int i = 1; i < NV; ++i) a = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * D + 16 * i), k[i], a);
      sc[g][j] = _mm512_reduce_add_ps(a) * scale;
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    __m512 mv = _mm512_set1_ps(-INFINITY);
    for (int64_t c = 0; c < n; c += 16) {
      const __mmask16 mk = lanes_left(n - c);
      mv = _mm512_mask_max_ps(mv, mk, mv, _mm512_maskz_loadu_ps(mk, sc[g] + c));
    }
    const float m = _mm512_reduce_max_ps(mv);
    __m512 lv = _mm512_setzero_ps();
    for (int64_t c = 0; c < n; c += 16) {  // exp(score - m) in place, and their sum
      const __mmask16 mk = lanes_left(n - c);
      const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, sc[g] + c), _mm512_set1_ps(m)));
      _mm512_mask_storeu_ps(sc[g] + c, mk, e);
      lv = _mm512_mask_add_ps(lv, mk, lv, e);
    }
    __m512 acc[NV];
    for (int i = 0; i < NV; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; ++j) {  // the block's value rows (L1-resident by the next head)
      const __m512 e = _mm512_set1_ps(sc[g][j]);
      for (int i = 0; i < NV; ++i) acc[i] = _mm512_fmadd_ps(e, load16(values + j * D + 16 * i), acc[i]);
    }
    float* o = part + g * (D + 2);
    for (int i = 0; i < NV; ++i) _mm512_storeu_ps(o + 16 * i, acc[i]);
    o[D] = m;
    o[D + 1] = _mm512_reduce_add_ps(lv);
  }
}

#endif

#if defined(CHAT_FLASH_DECODE) && !defined(__AVX512F__)
// The same work item with AVX2, FMA and F16C (8 lanes): exp8 is exp16's polynomial, 2^n made in the
// exponent bits (no scalef); the sums are the AVX-512 form's in another lane order (hsum:
// blocks_int8.h's).
inline float hmax8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
inline __m256 exp8(__m256 x) {  // x <= 0 (a score less the block's max)
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));  // (so 2^n below stays a normal number)
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
// all ones in the lanes i < n of 8
inline __m256 lanes_left8(int64_t n) {
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::min<int64_t>(n, 8))),
                                                _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
}

template <int NV>  // D = 8 NV (AVX2)
void attend_block(const float* q, const at::Half* keys, const at::Half* values, int64_t n, int64_t group,
                  float scale, float* part) {
  constexpr int D = NV * 8;
  alignas(32) float sc[kMaxGroup][kSlotBlock];
  prefetch_keys(keys, n, D);
  for (int64_t j = 0; j < n; ++j) {
    prefetch_rows(keys, values, j, D);
    __m256 k[NV];
    for (int i = 0; i < NV; ++i) k[i] = load8(keys + j * D + 8 * i);
    for (int64_t g = 0; g < group; ++g) {
      __m256 a = _mm256_mul_ps(_mm256_loadu_ps(q + g * D), k[0]);
      for (int i = 1; i < NV; ++i) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * D + 8 * i), k[i], a);
      sc[g][j] = hsum(a) * scale;
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    __m256 mv = _mm256_set1_ps(-INFINITY);
    for (int64_t c = 0; c < n; c += 8)  // (the lanes past n: -inf)
      mv = _mm256_max_ps(mv, _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), _mm256_load_ps(sc[g] + c), lanes_left8(n - c)));
    const float m = hmax8(mv);
    __m256 lv = _mm256_setzero_ps();
    for (int64_t c = 0; c < n; c += 8) {  // exp(score - m) in place, and their sum (the lanes past n: 0)
      const __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(_mm256_load_ps(sc[g] + c), _mm256_set1_ps(m))),
                                     lanes_left8(n - c));
      _mm256_store_ps(sc[g] + c, e);
      lv = _mm256_add_ps(lv, e);
    }
    float* o = part + g * (D + 2);
    for (int i0 = 0; i0 < NV; i0 += 8) {  // 8 vectors of the head at a time: their sums in registers
      const int nv = std::min(8, NV - i0);
      __m256 acc[8];
      for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
      for (int64_t j = 0; j < n; ++j) {
        const __m256 e = _mm256_set1_ps(sc[g][j]);
        const at::Half* vr = values + j * D + 8 * i0;
        for (int i = 0; i < nv; ++i) acc[i] = _mm256_fmadd_ps(e, load8(vr + 8 * i), acc[i]);
      }
      for (int i = 0; i < nv; ++i) _mm256_storeu_ps(o + 8 * (i0 + i), acc[i]);
    }
    o[D] = m;
    o[D + 1] = hsum(lv);
  }
}
#endif

#if defined(CHAT_FLASH_DECODE)
// Whether attend_long takes these sizes.
bool long_fits(int64_t D, int64_t group) { return D % kFlashLanes == 0 && D <= 256 && group <= kMaxGroup; }

// attend_block for D = kFlashLanes nv, nv = 1..256 / kFlashLanes
template <int NV = 1>
void attend_block_nv(int64_t nv, const float* q, const at::Half* keys, const at::Half* values, int64_t n,
                     int64_t group, float scale, float* part) {
  if constexpr (NV <= 256 / kFlashLanes) {
    if (nv == NV) return attend_block<NV>(q, keys, values, n, group, scale, part);
    attend_block_nv<NV + 1>(nv, q, keys, values, n, group, scale, part);
  }
}

void attend_long(const float* q, const at::Half* kc, const at::Half* vc, int64_t ks, int64_t vs,
                 int64_t live, int64_t H, int64_t group, int64_t D, float scale, const at::TensorOptions& opt,
                 float* out) {
  const int64_t KVH = H / group, blocks = (live + kSlotBlock - 1) / kSlotBlock;
  Tensor part_t = at::empty({blocks, H, D + 2}, opt);  // per block and head: weighted values, m, l
  float* part = part_t.data_ptr<float>();
  at::parallel_for(0, KVH * blocks, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t kv = t / blocks, b = t % blocks, s0 = b * kSlotBlock, n = std::min(live - s0, kSlotBlock);
      const float* qg = q + kv * group * D;
      const at::Half* keys = kc + kv * ks + s0 * D;
      const at::Half* values = vc + kv * vs + s0 * D;
      attend_block_nv(D / kFlashLanes, qg, keys, values, n, group, scale, part + (b * H + kv * group) * (D + 2));
    }
  });
  for (int64_t h = 0; h < H; ++h) {  // the merge: blocks rescaled to the largest max, in block order
    float mx = -INFINITY, den = 0.f;
    for (int64_t b = 0; b < blocks; ++b) mx = std::max(mx, part[(b * H + h) * (D + 2) + D]);
    float* o = out + h * D;
    std::fill(o, o + D, 0.f);
    for (int64_t b = 0; b < blocks; ++b) {
      const float* pb = part + (b * H + h) * (D + 2);
      const float w = std::exp(pb[D] - mx);
      den += w * pb[D + 1];
      for (int64_t d = 0; d < D; ++d) o[d] += w * pb[d];
    }
    for (int64_t d = 0; d < D; ++d) o[d] /= den;
  }
}
#endif

// The attention over the first `live` slots as decode_attention computes it (scores, softmax,
// weighted values): attend_long over an fp16 cache; over an fp32 one loops for a short context,
// torch's two batched GEMMs for a long one. q: [H, D] fp32; attn: [1, H D] fp32, written.
template <typename T>
void attend(const float* q, const Tensor& kc, const Tensor& vc, int64_t live, int64_t H, int64_t KVH, int64_t D,
            float scale, const at::TensorOptions& opt, Tensor& attn) {
  const T* kcp = kc.data_ptr<T>();
  const T* vcp = vc.data_ptr<T>();
  const int64_t ks = kc.stride(0), vs = vc.stride(0), group = H / KVH;
#if defined(CHAT_FLASH_DECODE)
  if constexpr (std::is_same_v<T, at::Half>) {
    if (long_fits(D, group)) {
      attend_long(q, kcp, vcp, ks, vs, live, H, group, D, scale, opt, attn.data_ptr<float>());
      return;
    }
  }
#endif
  if (live <= kLoopSlots) {
    attend_short(q, kcp, vcp, ks, vs, live, H, group, D, scale, attn.data_ptr<float>());
    return;
  }
  Tensor qg = at::from_blob(const_cast<float*>(q), {KVH, group, D}, opt);
  Tensor keys = kc.narrow(1, 0, live), values = vc.narrow(1, 0, live);
  if (!std::is_same_v<T, float>) {
    keys = keys.to(at::kFloat);
    values = values.to(at::kFloat);
  }
  Tensor sc = at::bmm(qg, keys.transpose(1, 2)).mul_(scale);
  Tensor heads = attn.view({KVH, group, D});  // [KVH, G, D] is already head-major
  at::bmm_out(heads, at::_softmax(sc, -1, false), values);
}

// The new token's keys and values into the caches at `pos`, then the attention over slots 0..pos.
template <typename T>
void attention(float* q, const float* k, const float* v, const Tensor& kc, const Tensor& vc, int64_t pos,
               int64_t H, int64_t KVH, int64_t D, float scale, const Tensor& x, Tensor& attn) {
  T* kcp = kc.data_ptr<T>();
  T* vcp = vc.data_ptr<T>();
  for (int64_t i = 0; i < KVH; ++i) {
    store_row(k + i * D, kcp + i * kc.stride(0) + pos * D, D);
    store_row(v + i * D, vcp + i * vc.stride(0) + pos * D, D);
  }
  attend<T>(q, kc, vc, pos + 1, H, KVH, D, scale, x.options(), attn);
}

// attention<T> for the caches' dtype (fp16 or fp32)
inline void attention_kv(float* q, const float* k, const float* v, const Tensor& kc, const Tensor& vc, int64_t pos,
                         int64_t H, int64_t KVH, int64_t D, float scale, const Tensor& x, Tensor& attn) {
  if (kc.scalar_type() == at::kHalf)
    attention<at::Half>(q, k, v, kc, vc, pos, H, KVH, D, scale, x, attn);
  else
    attention<float>(q, k, v, kc, vc, pos, H, KVH, D, scale, x, attn);
}

// The step's attention alone, for tests against an exact reference: q [H, D] fp32, caches
// [KVH, S, D] (fp32 or fp16, contiguous rows) of which the first `live` slots are read.
Tensor decode_attention(const Tensor& q, const Tensor& kc, const Tensor& vc, int64_t live, double scale) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kFloat && q.is_contiguous(), "q: [H, D] contiguous fp32");
  TORCH_CHECK(kc.dim() == 3 && kc.sizes() == vc.sizes() && kc.scalar_type() == vc.scalar_type() &&
                  kc.stride(2) == 1 && kc.stride(1) == kc.size(2) && vc.stride(2) == 1 && vc.stride(1) == vc.size(2),
              "caches: [KVH, S, D] of one dtype, contiguous rows");
  const int64_t H = q.size(0), D = q.size(1), KVH = kc.size(0);
  TORCH_CHECK(kc.size(2) == D && H % KVH == 0 && 0 < live && live <= kc.size(1), "shapes do not match");
  Tensor attn = at::empty({1, H * D}, q.options());
  if (kc.scalar_type() == at::kHalf)
    attend<at::Half>(q.data_ptr<float>(), kc, vc, live, H, KVH, D, static_cast<float>(scale), q.options(), attn);
  else
    attend<float>(q.data_ptr<float>(), kc, vc, live, H, KVH, D, static_cast<float>(scale), q.options(), attn);
  return attn.view({H, D});
}

// LFM2's short convolution of one token, in place of attention: bcx [1, 3C] (in_proj's B, C, x'),
// the window st [C, K-1] (the last K-1 of B x', oldest first) shifted by one in place, weight [C, K],
// bias or null; y[c] = C[c] * (sum_j<K-1 st[c, j] w[c, j] + B[c] x'[c] w[c, K-1] + bias[c]), summed
// in that order (causal_conv.conv_step's)
void short_conv(const float* bcx, float* st, const float* w, const float* bias, int64_t C, int64_t K, float* y) {
  const float* b = bcx;
  const float* c = bcx + C;
  const float* xv = bcx + 2 * C;
  for (int64_t ch = 0; ch < C; ++ch) {
    const float bx = b[ch] * xv[ch];
    const float* wr = w + ch * K;
    float* sr = st + ch * (K - 1);
    float s = sr[0] * wr[0];
    for (int64_t j = 1; j < K - 1; ++j) s += sr[j] * wr[j];
    s += bx * wr[K - 1];
    if (bias) s += bias[ch];
    for (int64_t j = 0; j < K - 2; ++j) sr[j] = sr[j + 1];
    sr[K - 2] = bx;
    y[ch] = c[ch] * s;
  }
}

// SwiGLU of each row of h [T, 2 ffn] (gate | up side by side) into [T, ffn], a row at a time (one
// row's elementwise loops, as a one-token step runs them)
Tensor swiglu_rows(const Tensor& gu) {
  const int64_t Tn = gu.size(0), ffn = gu.size(1) / 2;
  Tensor act = Tn == 1 ? Tensor() : at::empty({Tn, ffn}, gu.options());
  for (int64_t t = 0; t < Tn; ++t) {
    const Tensor g = gu.narrow(0, t, 1);
    Tensor a = at::silu(g.narrow(1, 0, ffn));
    a.mul_(g.narrow(1, ffn, ffn));
    if (Tn == 1)
      act = a;
    else
      act.narrow(0, t, 1).copy_(a);
  }
  return act;
}

// x += branch, row by row (the residual stream)
inline void add_rows(Tensor& x, const Tensor& branch) {
  float* xs = x.data_ptr<float>();
  const float* bp = branch.data_ptr<float>();
  for (int64_t i = 0; i < x.numel(); ++i) xs[i] += bp[i];
}

// A pre-norm SwiGLU MLP on the residual stream: h = norm(x) (its weight the next param, offset
// added), x += down(silu(gate h) * up h) (gate/up in gu_parts linears, then down_proj)
void residual_mlp(Tensor& x, Tensor& h, const OptList& params, int64_t& at_, int64_t gu_parts, double eps) {
  const int64_t Tn = x.size(0), hidden = x.size(1);
  const float* norm = params.get(at_++).value().data_ptr<float>();
  for (int64_t t = 0; t < Tn; ++t)
    rms_norm(x.data_ptr<float>() + t * hidden, norm, h.data_ptr<float>() + t * hidden, hidden, eps);
  add_rows(x, linear(swiglu_rows(linears(h, params, at_, gu_parts).contiguous()), params, at_));
}

// What llama_step and hybrid_step (hybrid_step.h) start from: the rows' RoPE tables checked (one
// row per position), the attention's scale, the residual stream x (x_in copied), its normed rows
// h and the attention's output rows
struct StepRows {
  float scale;
  int64_t cs;  // the RoPE tables' row length
  const float* cos;
  const float* sin;
  Tensor x, h, attn;
  float* xs;
  float* hs;
};

StepRows step_rows(const Tensor& x_in, const Tensor& cos_t, const Tensor& sin_t, int64_t H, int64_t D,
                   const char* name) {
  const int64_t Tn = x_in.size(0);
  TORCH_CHECK(Tn >= 1 && cos_t.size(0) == Tn && sin_t.size(0) == Tn && cos_t.is_contiguous() && sin_t.is_contiguous(),
              name, ": x, cos and sin need one row per position");
  StepRows r;
  r.scale = 1.0f / std::sqrt(static_cast<float>(D));
  r.cs = cos_t.size(1);
  r.cos = cos_t.data_ptr<float>();
  r.sin = sin_t.data_ptr<float>();
  r.x = x_in.contiguous().clone();
  r.h = at::empty_like(r.x);
  r.attn = at::empty({Tn, H * D}, r.x.options());
  r.xs = r.x.data_ptr<float>();
  r.hs = r.h.data_ptr<float>();
  return r;
}

// x: [T, hidden] fp32 (the embedded tokens at positions pos..pos+T-1: one for a decode step, more
// for a speculative verify); cos, sin: [T, rotary] fp32 (Rope.cos_sin of each position);
// params: per layer, in order: input norm weight, qkv linears (3 entries each), with qk_norm
// the per-head q and k norm weights, o_proj (a conv layer: in_proj, conv weight [C, K], conv bias
// or None, out_proj), post norm weight, gate/up linears, down_proj; caches: per attention layer
// k, v [KVH, S, D] fp32 or fp16, per conv layer its window [C, K-1] fp32; meta: H, KVH, D, rotary,
// qk_norm (0/1), then per layer (qkv parts, 0 for a conv layer; gate/up parts). Returns the
// residual stream after the last layer, its last branch added. row_windows: empty, or per conv
// layer a [T, C, K-1] fp32 tensor that receives its window after each row.
// Every row is computed as a one-token step at its position computes it, bit for bit: the norms,
// RoPE, attention (over slots 0..its position) and SwiGLU row by row, the linears through
// `linear`'s row-exact forms, a conv window shifted once per row in order. So T rows equal T
// steps, with the weights read once (tests/engine/test_speculative.py compares them).
Tensor llama_step(const Tensor& x_in, const Tensor& cos_t, const Tensor& sin_t, const OptList& params,
                  const std::vector<Tensor>& caches, const std::vector<int64_t>& meta, int64_t pos, double eps,
                  const std::vector<Tensor>& row_windows) {
  const int64_t H = meta[0], KVH = meta[1], D = meta[2], R = meta[3];
  const bool qk_norm = meta[4] != 0;
  const int64_t layers = (static_cast<int64_t>(meta.size()) - 5) / 2;
  const int64_t hidden = x_in.size(1), Tn = x_in.size(0);
  int64_t wi = 0;  // the next conv layer's row_windows entry
  TORCH_CHECK(D <= 512 && R <= D && R % 2 == 0, "cpu_step: head size ", D, " / rotary ", R, " not supported");
  auto [scale, cs, cos, sin, x, h, attn, xs, hs] = step_rows(x_in, cos_t, sin_t, H, D, "cpu_step");
  int64_t at_ = 0, ci = 0;  // the next param, the next cache
  for (int64_t l = 0; l < layers; ++l) {
    const int64_t qkv_parts = meta[5 + 2 * l], gu_parts = meta[6 + 2 * l];
    const float* in_norm = params.get(at_++).value().data_ptr<float>();
    for (int64_t t = 0; t < Tn; ++t) rms_norm(xs + t * hidden, in_norm, hs + t * hidden, hidden, eps);
    if (qkv_parts == 0) {  // a short-convolution layer (LFM2): in_proj, conv weight [C, K], bias, out_proj
      Tensor bcx = linear(h, params, at_).contiguous();
      const Tensor w = params.get(at_++).value();
      const std::optional<Tensor> bias = params.get(at_++);
      const Tensor& st = caches[ci++];
      const int64_t C = w.size(0), K = w.size(1);
      TORCH_CHECK(bcx.size(1) == 3 * C && st.is_contiguous() && st.scalar_type() == at::kFloat &&
                      st.size(0) == C && st.size(1) == K - 1 && K >= 2,
                  "cpu_step: a conv layer's in_proj, weight and window disagree");
      Tensor y = at::empty({Tn, C}, x.options());
      const Tensor* keep = row_windows.empty() ? nullptr : &row_windows[wi++];
      TORCH_CHECK(!keep || (keep->is_contiguous() && keep->scalar_type() == at::kFloat && keep->numel() == Tn * st.numel()),
                  "cpu_step: row_windows needs [T, C, K-1] fp32 per conv layer");
      for (int64_t t = 0; t < Tn; ++t) {
        short_conv(bcx.data_ptr<float>() + t * 3 * C, st.data_ptr<float>(), w.data_ptr<float>(),
                   bias.has_value() ? bias->data_ptr<float>() : nullptr, C, K, y.data_ptr<float>() + t * C);
        if (keep)  // the window after this row: a verify's rollback to it (cpu_step.CpuStep.fixed_after)
          std::copy(st.data_ptr<float>(), st.data_ptr<float>() + st.numel(), keep->data_ptr<float>() + t * st.numel());
      }
      Tensor o = linear(y, params, at_);
      const float* op = o.data_ptr<float>();
      for (int64_t i = 0; i < Tn * hidden; ++i) xs[i] += op[i];
    } else {
      Tensor qkv = linears(h, params, at_, qkv_parts).contiguous();
      const int64_t width = qkv.size(1);
      const float* qw = qk_norm ? params.get(at_++).value().data_ptr<float>() : nullptr;
      const float* kw = qk_norm ? params.get(at_++).value().data_ptr<float>() : nullptr;
      const Tensor& kc = caches[ci++];
      const Tensor& vc = caches[ci++];
      for (int64_t t = 0; t < Tn; ++t) {
        float* q = qkv.data_ptr<float>() + t * width;
        float* k = q + H * D;
        const float* v = k + KVH * D;
        if (qk_norm) {  // Qwen3: RMSNorm over each query and key head before RoPE
          for (int64_t i = 0; i < H; ++i) rms_norm(q + i * D, qw, q + i * D, D, eps);
          for (int64_t i = 0; i < KVH; ++i) rms_norm(k + i * D, kw, k + i * D, D, eps);
        }
        for (int64_t i = 0; i < H; ++i) rope(q + i * D, cos + t * cs, sin + t * cs, R);
        for (int64_t i = 0; i < KVH; ++i) rope(k + i * D, cos + t * cs, sin + t * cs, R);
        Tensor row = attn.narrow(0, t, 1);
        attention_kv(q, k, v, kc, vc, pos + t, H, KVH, D, scale, x, row);
      }
      add_rows(x, linear(attn, params, at_));
    }
    residual_mlp(x, h, params, at_, gu_parts, eps);
  }
  return x;
}

#include "hybrid_step.h"
#include "mamba2_hybrid_step.h"

// y = x W^T for W [N, K] in Q8_0 blocks (int8 codes, one fp32 scale per 32 of a row) and fp32 rows
#if defined(CHAT_FLASH_DECODE) && !defined(__AVX512F__)
inline __m256 i8x8_ps(const int8_t* p) {  // 8 int8 -> 8 fp32
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
#endif

// y = x W^T for W in Q8_0 as quant.Q8Linear holds it (codes [N, K] int8, scale [N, K/32] fp32): the
// LM head of a GGUF with a Q8_0 table (torch's int4 kernel, two 4-bit planes, rounds its sums to
// bf16, enough to flip a near tie). x [T, K] in fp32 throughout: each block's 32 products summed,
// then scaled and added, in a fixed order per output (the same bits on any thread count). int8
// (`cpu_int8: on`): x~ W^T, x rounded as blocks_int8.h rounds it for Q8_0 blocks.
// The head's rows come from DRAM (a vocabulary's worth each token): the row kHeadAhead on is
// prefetched towards the caches while this one computes (4 or 8 on alike, both faster than none:
// SmolLM2's head with int8 inputs on AVX2, bench/cpu_bench.py --cpu-int8 on)
constexpr int64_t kHeadAhead = 4;
inline void prefetch_row(const int8_t* row, int64_t K) {
  for (int64_t o = 0; o < K; o += 64) __builtin_prefetch(row + o, 0, 3);  // (_MM_HINT_T0's)
}

#if defined(__AVX512F__) || defined(CHAT_FLASH_DECODE)
// One row of the Q8_0 head (codes c, scales s) against TN rows of x (row stride K), into y[t N]:
// the row's codes widened once for all TN rows (a compile-time count: the sums stay in
// registers), each row's sums in the one-row order, so that a verify's rows are a step's bits.
template <int TN>
inline void q8_tile(const int8_t* c, const float* s, const float* x, int64_t K, int64_t nb, int64_t N, float* y) {
#if defined(__AVX512F__)
  __m512 acc[TN];
  for (int t = 0; t < TN; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t o = b * 32;
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(c + o))));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(c + o + 16))));
    const __m512 sb = _mm512_set1_ps(s[b]);
    for (int t = 0; t < TN; ++t) {
      const float* xr = x + t * K;
      const __m512 p = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xr + o + 16), _mm512_mul_ps(lo, _mm512_loadu_ps(xr + o)));
      acc[t] = _mm512_fmadd_ps(p, sb, acc[t]);
    }
  }
  for (int t = 0; t < TN; ++t) y[t * N] = _mm512_reduce_add_ps(acc[t]);
#else  // (AVX2, FMA, F16C)
  __m256 acc[TN];
  for (int t = 0; t < TN; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const int8_t* cb = c + b * 32;
    const __m256 w0 = i8x8_ps(cb), w1 = i8x8_ps(cb + 8), w2 = i8x8_ps(cb + 16), w3 = i8x8_ps(cb + 24);
    const __m256 sb = _mm256_set1_ps(s[b]);
    for (int t = 0; t < TN; ++t) {
      const float* xb = x + t * K + b * 32;
      __m256 p = _mm256_mul_ps(w0, _mm256_loadu_ps(xb));
      p = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xb + 8), p);
      p = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xb + 16), p);
      p = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xb + 24), p);
      acc[t] = _mm256_fmadd_ps(p, sb, acc[t]);
    }
  }
  for (int t = 0; t < TN; ++t) y[t * N] = hsum(acc[t]);
#endif
}

inline void q8_tile_rows(int64_t tn, const int8_t* c, const float* s, const float* x, int64_t K, int64_t nb,
                         int64_t N, float* y) {
  switch (tn) {
    case 1: return q8_tile<1>(c, s, x, K, nb, N, y);
    case 2: return q8_tile<2>(c, s, x, K, nb, N, y);
    case 3: return q8_tile<3>(c, s, x, K, nb, N, y);
    case 4: return q8_tile<4>(c, s, x, K, nb, N, y);
    case 5: return q8_tile<5>(c, s, x, K, nb, N, y);
    case 6: return q8_tile<6>(c, s, x, K, nb, N, y);
    case 7: return q8_tile<7>(c, s, x, K, nb, N, y);
    default: return q8_tile<8>(c, s, x, K, nb, N, y);
  }
}
#endif

Tensor q8_linear(const Tensor& x, const Tensor& codes, const Tensor& scale, bool int8) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "q8_linear: x must be [T, K] fp32");
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kChar && codes.is_contiguous(), "q8_linear: codes [N, K] int8");
  const int64_t T = x.size(0), K = x.size(1), N = codes.size(0), nb = K / 32;
  TORCH_CHECK(codes.size(1) == K && K % 32 == 0, "q8_linear: K must match and be a multiple of 32");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == N * nb,
              "q8_linear: scale [N, K/32] fp32");
  Tensor y = at::empty({T, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const int8_t* cp = codes.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  std::vector<float> xt;
  if (int8) {  // x~: x rounded per 32 as Q8_0 (llama.cpp's vec_dot_type for Q8_0 weights)
    const Int8Rows rows = quantize_rows(xp, T, K, kQ8_0);
#if defined(CHAT_INT8_DOT) || defined(CHAT_INT8_AVX2)
    // llama.cpp's ggml_vec_dot_q8_0_q8_0: per block the integer sum of codes times q (the codes'
    // magnitudes against q with their signs), times d dx in fp32, added in block order
    at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
      for (int64_t n = n0; n < n1; ++n) {
        const int8_t* c = cp + n * K;
        const float* s = sp + n * nb;
        if (n + kHeadAhead < n1) prefetch_row(c + kHeadAhead * K, K);
        for (int64_t t = 0; t < T; ++t) {
          const int8_t* q = rows.q.data() + t * K;
          const float* dx = rows.dx.data() + t * nb;
          __m256 acc = _mm256_setzero_ps();
          for (int64_t b = 0; b < nb; ++b) {
            const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 32 * b));
            const __m256i qv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * b));
            acc = _mm256_fmadd_ps(_mm256_set1_ps(s[b] * dx[b]), _mm256_cvtepi32_ps(dot_signed(w, qv)), acc);
          }
          yp[t * N + n] = hsum(acc);
        }
      }
    });
    return y;
#else
    xt = dequantized_rows(rows, T);  // (no int8 dot product here: the fp32 sums below, on x~)
    xp = xt.data();
#endif
  }
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const int8_t* c = cp + n * K;
      const float* s = sp + n * nb;
      if (n + kHeadAhead < n1) prefetch_row(c + kHeadAhead * K, K);
#if defined(__AVX512F__) || defined(CHAT_FLASH_DECODE)
      if (T == 1)
        q8_tile<1>(c, s, xp, K, nb, N, yp + n);
      else
        for (int64_t t0 = 0; t0 < T; t0 += kMaxRows)
          q8_tile_rows(std::min(kMaxRows, T - t0), c, s, xp + t0 * K, K, nb, N, yp + t0 * N + n);
#else
      for (int64_t t = 0; t < T; ++t) {
        const float* xr = xp + t * K;
        float acc[kLanes] = {0};
        for (int64_t b = 0; b < nb; ++b) {
          const int64_t o = b * 32;
          for (int j = 0; j < kLanes; ++j)
            acc[j] += (float(c[o + j]) * xr[o + j] + float(c[o + 16 + j]) * xr[o + 16 + j]) * s[b];
        }
        float total = 0.f;
        for (int j = 0; j < kLanes; ++j) total += acc[j];
        yp[t * N + n] = total;
      }
#endif
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(chat_cpu, m) {
  m.def("q8_linear(Tensor x, Tensor codes, Tensor scale, bool int8=False) -> Tensor", &q8_linear);
  m.def("block_linear(Tensor x, Tensor blocks, int type, bool int8=False) -> Tensor", &block_linear);
  m.def("block_linear_rows(Tensor x, Tensor blocks, int type, bool int8=False) -> Tensor", &block_linear_rows);
  m.def("block_dequant(Tensor blocks, int type) -> Tensor", &block_dequant);
  m.def("block_linear_bf16(Tensor x, Tensor blocks, int type) -> Tensor", &block_linear_bf16);
  m.def("rms_norm_rows(Tensor x, Tensor weight, float eps) -> Tensor", &rms_norm_rows);
  m.def("experts_decode(Tensor x, Tensor gate, Tensor up, Tensor down, int tg, int tu, int td, Tensor idx, "
        "Tensor weights, bool int8=False) -> Tensor", &experts_decode);
  m.def("mamba2_decode(Tensor zxbcdt, Tensor(a!) conv_state, Tensor conv_weight, Tensor? conv_bias, Tensor(b!) ssm, "
        "Tensor A, Tensor dt_bias, Tensor D, Tensor norm_weight, float norm_eps, float dt_min, float dt_max, int H, "
        "int P, int N, int G) -> Tensor", &mamba2_decode);
  m.def("delta_decode(Tensor mixed, Tensor z, Tensor b, Tensor a, Tensor(a!) conv_state, Tensor conv_weight, "
        "Tensor(b!) recurrent, Tensor neg_A, Tensor dt_bias, Tensor q_norm_w, Tensor k_norm_w, Tensor norm_w, "
        "float norm_eps, int nk, int nv, int dk, int dv, float beta_scale) -> Tensor", &delta_decode);
  m.def("llama_step(Tensor x, Tensor cos, Tensor sin, Tensor?[] params, Tensor[] caches, int[] meta, int pos, "
        "float eps, Tensor[] row_windows) -> Tensor", &llama_step);
  m.def("hybrid_step(Tensor x, Tensor cos, Tensor sin, Tensor?[] params, Tensor[] caches, int[] meta, int pos, "
        "float eps, float lin_eps, float beta_scale, Tensor[] row_states) -> Tensor", &hybrid_step);
  m.def("mamba2_hybrid_step(Tensor x, Tensor cos, Tensor sin, Tensor?[] params, Tensor[] caches, int[] meta, "
        "int pos, float eps, float scale, float q_scale, float mix_eps, float dt_min, float dt_max, "
        "Tensor[] row_states) -> Tensor", &mamba2_hybrid_step);
  m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, int live, float scale) -> Tensor",
        &decode_attention);
}
