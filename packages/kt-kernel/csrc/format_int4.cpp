// The weight-only INT4 format (kt_kernel.formats_int4.Int4Grouped), registered once per group
// size G as "int4_g32", "int4_g64" and "int4_g128". Parts per expert:
//   packed uint8 [ceil(N/2), K]: byte [p, k] = (q[2p, k] + 8) | (q[2p+1, k] + 8) << 4,
//   scale  bf16  [N, ceil(K/G)].
// W[n, k] = q[n, k] * scale[n, k / G], formed in fp32 (exact: a 4-bit integer times an
// 8-bit-significand scale) and, for bf16 tiles, rounded once to nearest even. Every ISA path
// computes exactly that, so tiles are bitwise equal to the Python dequantize on every path.
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "format_simd.h"
#include "formats.h"

namespace kt_kernel {
namespace formats {
namespace {

// One output row: out[c - col0] = W[n, c] for c in [col0, col0 + cols). `src` is the packed row
// pair holding row n, `shift` 0 (even n) or 4 (odd n), `scale` row n's group scales.
struct RowArgs {
  const uint8_t* src;
  int shift;
  const c10::BFloat16* scale;
  int64_t col0, cols;
  void* out;
};
// `gshift` = log2(G): the group of column c is c >> gshift (G is a power of two; a 64-bit
// division per 16 columns measured as a large part of the loader's time).
using RowFn = void (*)(const RowArgs& a, int gshift);

inline float w_at(const RowArgs& a, int64_t c, int gshift) {
  const int q = static_cast<int>((a.src[c] >> a.shift) & 0xF) - 8;
  return static_cast<float>(q) * static_cast<float>(a.scale[c >> gshift]);
}

void row_f32_scalar(const RowArgs& a, int gshift) {
  float* o = static_cast<float*>(a.out);
  for (int64_t j = 0; j < a.cols; ++j) o[j] = w_at(a, a.col0 + j, gshift);
}

void row_bf16_scalar(const RowArgs& a, int gshift) {
  c10::BFloat16* o = static_cast<c10::BFloat16*>(a.out);
  for (int64_t j = 0; j < a.cols; ++j) o[j] = c10::BFloat16(w_at(a, a.col0 + j, gshift));
}

#ifdef KT_FMT_SIMD
// Columns before the first multiple of 16 (col0 is one in every call the op makes) go through
// the scalar path; from there every 16-column unit lies inside one group (G % 16 == 0).
inline int64_t head_cols(const RowArgs& a) {
  return std::min(a.cols, (16 - a.col0 % 16) % 16);
}

// 16 packed bytes (or the first `m` of them) -> 16 fp32 weights of one group.
KT_FMT_AVX512 inline __m512 unit16_avx512(const uint8_t* p, __mmask16 m, __m128i shift,
                                          __m512 s) {
  __m512i v = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m, p));
  v = _mm512_and_si512(_mm512_srl_epi32(v, shift), _mm512_set1_epi32(0xF));
  return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(v, _mm512_set1_epi32(8))), s);
}

// One row on AVX-512. STORE(j, m, w) writes the 16 (masked: m) weights w at output column j;
// a macro rather than a template so each variant carries only the target features it uses.
#define KT_INT4_ROW_AVX512(NAME, ATTR, SCALAR, STORE)                                    \
  ATTR void NAME(const RowArgs& a, int gshift) {                                        \
    const int64_t head = head_cols(a);                                                     \
    if (head > 0) {                                                                        \
      RowArgs h = a;                                                                       \
      h.cols = head;                                                                       \
      SCALAR(h, gshift);                                                                    \
    }                                                                                      \
    const __m128i shift = _mm_cvtsi32_si128(a.shift);                                      \
    for (int64_t j = head; j < a.cols; j += 16) {                                          \
      const int64_t c = a.col0 + j;                                                        \
      const int64_t left = std::min<int64_t>(16, a.cols - j);                              \
      const __mmask16 m = static_cast<__mmask16>(left == 16 ? 0xFFFFu : (1u << left) - 1u); \
      const __m512 s = _mm512_set1_ps(static_cast<float>(a.scale[c >> gshift]));             \
      const __m512 w = unit16_avx512(a.src + c, m, shift, s);                              \
      STORE(j, m, w);                                                                      \
    }                                                                                      \
  }


KT_INT4_ROW_AVX512(row_f32_avx512, KT_FMT_AVX512, row_f32_scalar, KT_STORE_F32)
KT_INT4_ROW_AVX512(row_bf16_avx512bf16, KT_FMT_AVX512BF16, row_bf16_scalar, KT_STORE_BF16_NATIVE)
// Without AVX512_BF16 (Skylake-X, Ice Lake): the same rounding done with integer ops.
KT_INT4_ROW_AVX512(row_bf16_avx512, KT_FMT_AVX512, row_bf16_scalar, KT_STORE_BF16_INT)

// 8 packed bytes -> 8 fp32 weights of one group.
KT_FMT_AVX2 inline __m256 unit8_avx2(const uint8_t* p, __m128i shift, __m256 s) {
  __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  v = _mm256_and_si256(_mm256_srl_epi32(v, shift), _mm256_set1_epi32(0xF));
  return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(v, _mm256_set1_epi32(8))), s);
}

template <bool Bf16>
KT_FMT_AVX2 void row_avx2_impl(const RowArgs& a, int gshift) {
  const int64_t head = head_cols(a);
  const int64_t body = head + (a.cols - head) / 8 * 8;
  const __m128i shift = _mm_cvtsi32_si128(a.shift);
  for (int64_t j = head; j < body; j += 8) {
    const int64_t c = a.col0 + j;
    const __m256 w =
        unit8_avx2(a.src + c, shift, _mm256_set1_ps(static_cast<float>(a.scale[c >> gshift])));
    simd::store8_avx2<Bf16>(a.out, j, w);
  }
  const auto scalar = [&](const RowArgs& r) {
    if (Bf16) {
      row_bf16_scalar(r, gshift);
    } else {
      row_f32_scalar(r, gshift);
    }
  };
  simd::scalar_cols<Bf16>(a, 0, head, scalar);
  simd::scalar_cols<Bf16>(a, body, a.cols, scalar);
}

KT_FMT_AVX2 void row_f32_avx2(const RowArgs& a, int gshift) { row_avx2_impl<false>(a, gshift); }
KT_FMT_AVX2 void row_bf16_avx2(const RowArgs& a, int gshift) { row_avx2_impl<true>(a, gshift); }
#endif

KT_ROW_TABLE(RowFn)

template <int G>
void load_int4(const ExpertView& w, int64_t row0, int64_t col0, int64_t rows, int64_t cols,
               c10::ScalarType dt, void* out, int64_t ldo) {
  TORCH_CHECK_TYPE(dt == c10::ScalarType::Float || dt == c10::ScalarType::BFloat16,
                   "int4 format: compute dtype must be float32 or bfloat16, got ", dt);
  const auto* packed = static_cast<const uint8_t*>(w.part[0]);
  const auto* scale = static_cast<const c10::BFloat16*>(w.part[1]);
  static_assert(G > 0 && (G & (G - 1)) == 0, "the int4 group size must be a power of two");
  constexpr int kShift = __builtin_ctz(G);
  const int64_t groups = (w.k + G - 1) / G;
  const bool bf16 = dt == c10::ScalarType::BFloat16;
  const RowFn fn = bf16 ? rows_table().bf16 : rows_table().f32;
  const size_t esize = bf16 ? 2 : 4;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t n = row0 + r;
    RowArgs a{packed + (n >> 1) * w.k, static_cast<int>(n & 1) * 4, scale + n * groups, col0,
              cols, static_cast<char*>(out) + static_cast<size_t>(r * ldo) * esize};
    fn(a, kShift);
  }
}

// ------------------------------------------------------------------ small-row product
// With few rows per expert (T=64, E=64, k=8: about 8) a tile GEMM is dominated by writing the
// dequantised tile and reading it back; here the packed weights are decoded in registers and
// FMAed straight into the rows (formats.h, GemvFn), reading 0.27x the bytes of bf16.

struct Int4Mat {
  const uint8_t* packed;
  const c10::BFloat16* scale;
  int64_t n, k, groups;
  int gshift;
};

// Where a product's fp32 sums go: out [m, ld] of float or bf16 (rounded to nearest even).
struct OutRows {
  void* out;
  int64_t ld;
  bool bf16;
  void put(int64_t r, int64_t c, float v) const {
    if (bf16) {
      static_cast<c10::BFloat16*>(out)[r * ld + c] = c10::BFloat16(v);
    } else {
      static_cast<float*>(out)[r * ld + c] = v;
    }
  }
};

#ifdef KT_FMT_SIMD
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma")
namespace gemv_avx512 {
struct V {
  using F = __m512;
  static constexpr int L = 16;
  static constexpr int kRows = 8;  // 2 x 8 accumulators + weights + input of 32 registers
  static inline F zero() { return _mm512_setzero_ps(); }
  static inline F loadu(const float* p) { return _mm512_loadu_ps(p); }
  static inline void storeu(float* p, F v) { _mm512_storeu_ps(p, v); }
  static inline F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static inline F set1(float s) { return _mm512_set1_ps(s); }
  static inline float hsum(F v) { return _mm512_reduce_add_ps(v); }
  static inline F round_bf16(F v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb);
    return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32(~0xFFFF)));
  }
  static inline void decode(const uint8_t* p, float s0, float s1, F& w0, F& w1) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m512i eight = _mm512_set1_epi32(8);
    const __m512i lo = _mm512_sub_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0xF)), eight);
    const __m512i hi = _mm512_sub_epi32(_mm512_srli_epi32(b, 4), eight);
    w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(lo), _mm512_set1_ps(s0));
    w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(hi), _mm512_set1_ps(s1));
  }
};
#include "int4_gemv_body.h"
}  // namespace gemv_avx512
#pragma GCC pop_options

// bf16 compute on AVX512_BF16: vdpbf16ps on the bf16 input rows as they are. The weights are
// the tile loader's bf16 values (vcvtneps2bf16 rounds to nearest even), every product of two
// bf16 is exact in fp32, and the sums are fp32: the same values as the fp32-FMA path up to the
// order of the sums, with half its instructions and half its input bytes.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")
namespace gemv_avx512bf16 {

// 16 packed bytes -> the pair's two rows of 16 fp32 weights.
static inline void dec16(const uint8_t* p, __m512 s0, __m512 s1, __m512& w0, __m512& w1) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512i eight = _mm512_set1_epi32(8);
  w0 = _mm512_mul_ps(
      _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0xF)), eight)),
      s0);
  w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_srli_epi32(b, 4), eight)), s1);
}

static inline __m512 bf16_scale(const c10::BFloat16* s) {
  return _mm512_set1_ps(static_cast<float>(*s));
}

// nt on 32-column steps (one group: G % 32 == 0); x bf16 [MB, k rounded up to 32], zero-padded.
template <int MB>
static void nt_block(const Int4Mat& g, const uint16_t* x, int64_t ldx, const OutRows& o,
                     int64_t r0) {
  const int64_t pairs = (g.n + 1) / 2;
  const int64_t kfull = g.k / 32 * 32;
  for (int64_t p = 0; p < pairs; ++p) {
    const uint8_t* src = g.packed + p * g.k;
    const c10::BFloat16* s0p = g.scale + 2 * p * g.groups;
    const bool two = 2 * p + 1 < g.n;
    __m512 a0[MB], a1[MB];
    for (int r = 0; r < MB; ++r) a0[r] = a1[r] = _mm512_setzero_ps();
    const auto step = [&](const uint8_t* bp, int64_t c) {
      const int64_t grp = c >> g.gshift;
      const __m512 s0 = bf16_scale(s0p + grp);
      const __m512 s1 = two ? bf16_scale(s0p + g.groups + grp) : _mm512_setzero_ps();
      __m512 w0a, w1a, w0b, w1b;
      dec16(bp, s0, s1, w0a, w1a);
      dec16(bp + 16, s0, s1, w0b, w1b);
      const __m512bh b0 = _mm512_cvtne2ps_pbh(w0b, w0a);  // columns c..c+15 in the low half
      const __m512bh b1 = _mm512_cvtne2ps_pbh(w1b, w1a);
#pragma GCC unroll 16
      for (int r = 0; r < MB; ++r) {
        const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + r * ldx + c);
        a0[r] = _mm512_dpbf16_ps(a0[r], b0, xv);
        a1[r] = _mm512_dpbf16_ps(a1[r], b1, xv);
      }
    };
    for (int64_t c = 0; c < kfull; c += 32) step(src + c, c);
    if (kfull < g.k) {
      uint8_t tail[32];
      std::memset(tail, 8, sizeof(tail));  // 8: weight 0
      std::memcpy(tail, src + kfull, static_cast<size_t>(g.k - kfull));
      step(tail, kfull);
    }
    for (int r = 0; r < MB; ++r) {
      o.put(r0 + r, 2 * p, _mm512_reduce_add_ps(a0[r]));
      if (two) o.put(r0 + r, 2 * p + 1, _mm512_reduce_add_ps(a1[r]));
    }
  }
}

// nn: each lane j of a step takes the bf16 pair (W[2p, c + j], W[2p + 1, c + j]) against the
// input pair (x[r, 2p], x[r, 2p + 1]) in one vdpbf16ps; x bf16 [MB, 2 * pairs], zero-padded;
// acc fp32 [MB, lda], lda a multiple of 32. A step is 32 columns (two vectors share each
// input broadcast), and row pairs go in blocks of kPairBlock: their bytes lie K apart, and
// with K a multiple of 2 KiB a larger block maps onto too few L1 sets to stay there while
// the 32-byte halves of its cache lines are read in turn.
template <int MB>
static void nn_block(const Int4Mat& g, const uint16_t* x, int64_t ldx, float* acc, int64_t lda) {
  constexpr int64_t kPairBlock = 16;
  const int64_t pairs = (g.n + 1) / 2;
  const __m512i interleave =
      _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                       6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  for (int64_t p0 = 0; p0 < pairs; p0 += kPairBlock) {
    const int64_t p1 = std::min(pairs, p0 + kPairBlock);
    for (int64_t c = 0; c < g.k; c += 32) {
      const int64_t grp = c >> g.gshift;
      __m512 a[MB], b[MB];
      for (int r = 0; r < MB; ++r) {
        a[r] = _mm512_loadu_ps(acc + r * lda + c);
        b[r] = _mm512_loadu_ps(acc + r * lda + c + 16);
      }
      const auto step = [&](const uint8_t* bp, int64_t p) {
        const c10::BFloat16* s0p = g.scale + 2 * p * g.groups + grp;
        const __m512 s0 = bf16_scale(s0p);
        const __m512 s1 = 2 * p + 1 < g.n ? bf16_scale(s0p + g.groups) : _mm512_setzero_ps();
        __m512 w0a, w1a, w0b, w1b;
        dec16(bp, s0, s1, w0a, w1a);
        dec16(bp + 16, s0, s1, w0b, w1b);
        // words 0-15 = row 2p, 16-31 = row 2p + 1 -> interleaved (2p, 2p + 1) per column
        const __m512bh wa = (__m512bh)_mm512_permutexvar_epi16(
            interleave, (__m512i)_mm512_cvtne2ps_pbh(w1a, w0a));
        const __m512bh wb = (__m512bh)_mm512_permutexvar_epi16(
            interleave, (__m512i)_mm512_cvtne2ps_pbh(w1b, w0b));
#pragma GCC unroll 16
        for (int r = 0; r < MB; ++r) {
          int32_t xp;
          std::memcpy(&xp, x + r * ldx + 2 * p, 4);
          const __m512bh xv = (__m512bh)_mm512_set1_epi32(xp);
          a[r] = _mm512_dpbf16_ps(a[r], wa, xv);
          b[r] = _mm512_dpbf16_ps(b[r], wb, xv);
        }
      };
      if (c + 32 <= g.k) {
        for (int64_t p = p0; p < p1; ++p) step(g.packed + p * g.k + c, p);
      } else {
        for (int64_t p = p0; p < p1; ++p) {
          uint8_t tail[32];
          std::memset(tail, 8, sizeof(tail));  // 8: weight 0
          std::memcpy(tail, g.packed + p * g.k + c, static_cast<size_t>(g.k - c));
          step(tail, p);
        }
      }
      for (int r = 0; r < MB; ++r) {
        _mm512_storeu_ps(acc + r * lda + c, a[r]);
        _mm512_storeu_ps(acc + r * lda + c + 16, b[r]);
      }
    }
  }
}

static void nt(const Int4Mat& g, const uint16_t* x, int64_t ldx, int64_t m, const OutRows& o) {
  for_row_blocks<8>(m, [&]<int R>(int64_t r0) { nt_block<R>(g, x + r0 * ldx, ldx, o, r0); });
}

static void nn(const Int4Mat& g, const uint16_t* x, int64_t ldx, int64_t m, float* acc,
               int64_t lda) {
  for_row_blocks<8>(m, [&]<int R>(int64_t r0) {
    nn_block<R>(g, x + r0 * ldx, ldx, acc + r0 * lda, lda);
  });
}

}  // namespace gemv_avx512bf16
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace gemv_avx2 {
struct V {
  using F = __m256;
  static constexpr int L = 8;
  static constexpr int kRows = 4;  // 16 ymm registers: 2 x 4 accumulators + the rest
  static inline F zero() { return _mm256_setzero_ps(); }
  static inline F loadu(const float* p) { return _mm256_loadu_ps(p); }
  static inline void storeu(float* p, F v) { _mm256_storeu_ps(p, v); }
  static inline F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static inline F set1(float s) { return _mm256_set1_ps(s); }
  static inline float hsum(F v) {  // fixed order: halves, then pairs
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
  }
  static inline F round_bf16(F v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb);
    return _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32(~0xFFFF)));
  }
  static inline void decode(const uint8_t* p, float s0, float s1, F& w0, F& w1) {
    const __m256i b =
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const __m256i eight = _mm256_set1_epi32(8);
    const __m256i lo = _mm256_sub_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0xF)), eight);
    const __m256i hi = _mm256_sub_epi32(_mm256_srli_epi32(b, 4), eight);
    w0 = _mm256_mul_ps(_mm256_cvtepi32_ps(lo), _mm256_set1_ps(s0));
    w1 = _mm256_mul_ps(_mm256_cvtepi32_ps(hi), _mm256_set1_ps(s1));
  }
};
#include "int4_gemv_body.h"
}  // namespace gemv_avx2
#pragma GCC pop_options
#endif

namespace gemv_scalar {
struct V {
  using F = float;
  static constexpr int L = 1;
  static constexpr int kRows = 8;
  static inline F zero() { return 0.0f; }
  static inline F loadu(const float* p) { return *p; }
  static inline void storeu(float* p, F v) { *p = v; }
  static inline F fma(F a, F b, F c) { return a * b + c; }
  static inline F set1(float s) { return s; }
  static inline float hsum(F v) { return v; }
  static inline F round_bf16(F v) { return static_cast<float>(c10::BFloat16(v)); }
  static inline void decode(const uint8_t* p, float s0, float s1, F& w0, F& w1) {
    w0 = static_cast<float>(static_cast<int>(*p & 0xF) - 8) * s0;
    w1 = static_cast<float>(static_cast<int>(*p >> 4) - 8) * s1;
  }
};
#include "int4_gemv_body.h"
}  // namespace gemv_scalar

// fp32 copy of rows [0, m) x cols [0, cols) of `in` (float or bf16, row stride ldi), zero up
// to `ld` columns: the kernels read whole vectors past the last column.
const float* rows_f32(const void* in, int64_t ldi, int64_t m, int64_t cols, int64_t ld,
                      bool bf16, std::vector<float>& buf) {
  buf.assign(static_cast<size_t>(m * ld), 0.0f);
  for (int64_t r = 0; r < m; ++r) {
    float* d = buf.data() + r * ld;
    if (bf16) {
      const auto* s = static_cast<const c10::BFloat16*>(in) + r * ldi;
      for (int64_t c = 0; c < cols; ++c) d[c] = static_cast<float>(s[c]);
    } else {
      std::memcpy(d, static_cast<const float*>(in) + r * ldi, static_cast<size_t>(cols) * 4);
    }
  }
  return buf.data();
}

template <int G>
bool gemv_int4(const ExpertView& w, bool nn, const void* in, int64_t ldi, int64_t m,
               c10::ScalarType dt, void* out, int64_t ldo) {
  TORCH_CHECK_TYPE(dt == c10::ScalarType::Float || dt == c10::ScalarType::BFloat16,
                   "int4 format: compute dtype must be float32 or bfloat16, got ", dt);
  const Int4Mat g{static_cast<const uint8_t*>(w.part[0]),
                  static_cast<const c10::BFloat16*>(w.part[1]), w.n, w.k, (w.k + G - 1) / G,
                  __builtin_ctz(G)};
  const bool bf16 = dt == c10::ScalarType::BFloat16;
  const int64_t kpad = (w.k + 15) / 16 * 16;
  const Isa isa = isa_level();
  thread_local std::vector<float> xbuf, abuf;
#ifdef KT_FMT_SIMD
  if (bf16 && has_avx512_bf16()) {
    thread_local std::vector<uint16_t> hbuf;
    if (!nn) {
      const int64_t k32 = (w.k + 31) / 32 * 32;
      gemv_avx512bf16::nt(g, rows_bf16(in, ldi, m, w.k, k32, hbuf), k32, m,
                          OutRows{out, ldo, true});
      return true;
    }
    const int64_t npad = (w.n + 1) / 2 * 2, k32 = (w.k + 31) / 32 * 32;
    abuf.assign(static_cast<size_t>(m * k32), 0.0f);
    gemv_avx512bf16::nn(g, rows_bf16(in, ldi, m, w.n, npad, hbuf), npad, m, abuf.data(), k32);
    const OutRows o{out, ldo, true};
    for (int64_t r = 0; r < m; ++r) {
      for (int64_t c = 0; c < w.k; ++c) o.put(r, c, abuf[r * k32 + c]);
    }
    return true;
  }
#endif
  if (!nn) {
    const float* x = rows_f32(in, ldi, m, w.k, kpad, bf16, xbuf);
    const OutRows o{out, ldo, bf16};
#ifdef KT_FMT_SIMD
    if (isa == Isa::kAvx512) {
      gemv_avx512::nt(g, x, kpad, m, bf16, o);
    } else if (isa == Isa::kAvx2) {
      gemv_avx2::nt(g, x, kpad, m, bf16, o);
    } else {
      gemv_scalar::nt(g, x, kpad, m, bf16, o);
    }
#else
    gemv_scalar::nt(g, x, kpad, m, bf16, o);
#endif
    return true;
  }
  const int64_t npad = (w.n + 1) / 2 * 2;
  const float* x = rows_f32(in, ldi, m, w.n, npad, bf16, xbuf);
  abuf.assign(static_cast<size_t>(m * kpad), 0.0f);
  float* acc = abuf.data();
#ifdef KT_FMT_SIMD
  if (isa == Isa::kAvx512) {
    gemv_avx512::nn(g, x, npad, m, bf16, acc, kpad);
  } else if (isa == Isa::kAvx2) {
    gemv_avx2::nn(g, x, npad, m, bf16, acc, kpad);
  } else {
    gemv_scalar::nn(g, x, npad, m, bf16, acc, kpad);
  }
#else
  gemv_scalar::nn(g, x, npad, m, bf16, acc, kpad);
#endif
  const OutRows o{out, ldo, bf16};
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t c = 0; c < w.k; ++c) o.put(r, c, acc[r * kpad + c]);
  }
  return true;
}

template <int G>
void check_int4(const std::vector<at::Tensor>& parts, int64_t e, int64_t n, int64_t k,
                const char* what) {
  TORCH_CHECK_VALUE(parts.size() == 2, what, " (int4_g", G,
                    ") must be 2 tensors (packed, scale), got ", parts.size());
  TORCH_CHECK_VALUE(n >= 0 && k >= 0, what, " (int4_g", G, "): n and k must be >= 0, got ", n,
                    " and ", k);
  check_part(parts[0], what, 0, "packed", at::kByte, {e, ceil_div(n, 2), k});
  check_part(parts[1], what, 1, "scale", at::kBFloat16, {e, n, ceil_div(k, G)});
}

}  // namespace

// Rows padded to 8 as for INT8 (few rows per expert at small T).
KT_REGISTER_FORMAT(int4_g32, Format{"int4_g32", 2, check_int4<32>, load_int4<32>, 8,
                                                gemv_int4<32>});
KT_REGISTER_FORMAT(int4_g64, Format{"int4_g64", 2, check_int4<64>, load_int4<64>, 8,
                                                gemv_int4<64>});
KT_REGISTER_FORMAT(int4_g128, Format{"int4_g128", 2, check_int4<128>, load_int4<128>, 8,
                                                gemv_int4<128>});

}  // namespace formats
}  // namespace kt_kernel
