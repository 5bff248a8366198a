// The dense bf16 "nn" product out [m, K] = in [m, N] @ W [N, K] on AVX512_BF16 for few rows
// (the op's dx = dgu W_gu and dh = dy W_down), reading W in place: no second copy of it.
//
// Why: at 16-64 rows per expert oneDNN's bf16 GEMM on weights streamed from memory reaches
// about half the single-thread peak for this product (benchmarks/results/bench_profile.md).
// Here each strip of up to 256 columns of W is read from memory once, interleaved into row
// pairs (the operand layout of vdpbf16ps) in a per-thread buffer of N x 256 bf16 (0.8-1.4 MiB
// at N = 1536-2816, mostly in L2), and every row of `in` is multiplied against it from there,
// 6 rows x 64 columns at a time in registers. Strips of 64 and 128 columns were 1.0-1.2x and
// 512 no better than 256 (one-thread cold-weight rates, 2026-12-05). Sums are fp32 over N in
// a fixed order (row pairs, odd row first; no dependence on threads), rounded once to bf16.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "dense_nn.h"
#include "formats.h"

#ifndef KT_DENSE_NN_COLS
#define KT_DENSE_NN_COLS 256
#endif

namespace kt_kernel {
namespace {

constexpr int64_t kCols = 256;  // columns of W per strip at most (the last may be 64-192)
constexpr int64_t kSub = 64;  // columns per register tile: 4 zmm of fp32 sums per row
constexpr int kRows = 6;       // rows of `in` per register tile: 6 x 4 = 24 accumulators

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,bmi2")

// Rows 2p and 2p+1 of W's strip [c0, c0 + 64) interleaved into pairs: packed[p] holds 4 zmm,
// (lo, hi) of columns 0-31 then of 32-63; unpack{lo,hi}_epi16 permute columns within 128-bit
// lanes, which store_rows undoes.
void pack_strip(const uint16_t* w, int64_t n, int64_t k, int64_t c0, int64_t cols,
                uint16_t* packed) {
  const int64_t pairs = n / 2;
  for (int64_t p = 0; p < pairs; ++p) {
    const uint16_t* r0 = w + (2 * p) * k + c0;
    const uint16_t* r1 = r0 + k;
    __m512i* dst = reinterpret_cast<__m512i*>(packed + p * 2 * cols);
    for (int h = 0; h < cols / 32; ++h) {
      const __m512i a = _mm512_loadu_si512(r0 + 32 * h);
      const __m512i b = _mm512_loadu_si512(r1 + 32 * h);
      _mm512_store_si512(dst + 2 * h, _mm512_unpacklo_epi16(a, b));
      _mm512_store_si512(dst + 2 * h + 1, _mm512_unpackhi_epi16(a, b));
    }
  }
  if (n % 2) {  // the last row paired with zeros
    const uint16_t* r0 = w + (n - 1) * k + c0;
    __m512i* dst = reinterpret_cast<__m512i*>(packed + pairs * 2 * cols);
    const __m512i z = _mm512_setzero_si512();
    for (int h = 0; h < cols / 32; ++h) {
      const __m512i a = _mm512_loadu_si512(r0 + 32 * h);
      _mm512_store_si512(dst + 2 * h, _mm512_unpacklo_epi16(a, z));
      _mm512_store_si512(dst + 2 * h + 1, _mm512_unpackhi_epi16(a, z));
    }
  }
}

// R rows of `in` against the packed strip: out[r, c0 : c0 + 64].
template <int R>
void rows_tile(const uint16_t* in, int64_t ldi, int64_t n, const uint16_t* packed,
               int64_t cols, uint16_t* out, int64_t ldo) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  const int64_t pairs = n / 2;
  const __m512i* pw = reinterpret_cast<const __m512i*>(packed);
  const int64_t step = cols / 16;  // zmm per packed pair
  for (int64_t p = 0; p < pairs; ++p, pw += step) {
    const __m512bh w0 = (__m512bh)_mm512_load_si512(pw);
    const __m512bh w1 = (__m512bh)_mm512_load_si512(pw + 1);
    const __m512bh w2 = (__m512bh)_mm512_load_si512(pw + 2);
    const __m512bh w3 = (__m512bh)_mm512_load_si512(pw + 3);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      int32_t v;
      std::memcpy(&v, in + r * ldi + 2 * p, sizeof v);
      const __m512bh x = (__m512bh)_mm512_set1_epi32(v);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], x, w0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], x, w1);
      acc[r][2] = _mm512_dpbf16_ps(acc[r][2], x, w2);
      acc[r][3] = _mm512_dpbf16_ps(acc[r][3], x, w3);
    }
  }
  if (n % 2) {
    for (int r = 0; r < R; ++r) {
      const int32_t v = in[r * ldi + n - 1];  // paired with a zero (never the next element)
      const __m512bh x = (__m512bh)_mm512_set1_epi32(v);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], x, (__m512bh)_mm512_load_si512(pw));
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], x, (__m512bh)_mm512_load_si512(pw + 1));
      acc[r][2] = _mm512_dpbf16_ps(acc[r][2], x, (__m512bh)_mm512_load_si512(pw + 2));
      acc[r][3] = _mm512_dpbf16_ps(acc[r][3], x, (__m512bh)_mm512_load_si512(pw + 3));
    }
  }
  // lo holds columns {0-3, 8-11, 16-19, 24-27} of its 32, hi {4-7, 12-15, 20-23, 28-31}.
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second =
      _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int r = 0; r < R; ++r) {
    for (int h = 0; h < 2; ++h) {
      const __m512 a = _mm512_permutex2var_ps(acc[r][2 * h], first, acc[r][2 * h + 1]);
      const __m512 b = _mm512_permutex2var_ps(acc[r][2 * h], second, acc[r][2 * h + 1]);
      _mm512_storeu_si512(out + r * ldo + 32 * h, (__m512i)_mm512_cvtne2ps_pbh(b, a));
    }
  }
}

void nn_avx512bf16(const uint16_t* in, int64_t ldi, int64_t m, const uint16_t* w, int64_t n,
                   int64_t k, uint16_t* out, int64_t ldo) {
  // Per thread; grows to the largest N seen (N x 256 bf16: 1.4 MiB at N = 2816).
  // (std::vector of __m512i is not 64-byte aligned here, so the pointer is aligned by hand.)
  thread_local std::vector<uint16_t> buf;
  const size_t need = static_cast<size_t>((n + 1) / 2) * 2 * kCols + 32;
  if (buf.size() < need) buf.resize(need);
  const uintptr_t base = reinterpret_cast<uintptr_t>(buf.data());
  uint16_t* packed = reinterpret_cast<uint16_t*>((base + 63) & ~uintptr_t{63});
  for (int64_t c0 = 0; c0 < k; c0 += kCols) {
    const int64_t cols = std::min(kCols, k - c0);
    pack_strip(w, n, k, c0, cols, packed);
    int64_t r0 = 0;
    for (int64_t s0 = 0; s0 < cols; s0 += kSub) {
    const uint16_t* ps = packed + 2 * s0;
    for (r0 = 0; r0 + kRows <= m; r0 += kRows) {
      rows_tile<kRows>(in + r0 * ldi, ldi, n, ps, cols, out + r0 * ldo + c0 + s0, ldo);
    }
    const uint16_t* ir = in + r0 * ldi;
    uint16_t* orow = out + r0 * ldo + c0 + s0;
    const uint16_t* packed = ps;
    switch (m - r0) {
      case 5: rows_tile<5>(ir, ldi, n, packed, cols, orow, ldo); break;
      case 4: rows_tile<4>(ir, ldi, n, packed, cols, orow, ldo); break;
      case 3: rows_tile<3>(ir, ldi, n, packed, cols, orow, ldo); break;
      case 2: rows_tile<2>(ir, ldi, n, packed, cols, orow, ldo); break;
      case 1: rows_tile<1>(ir, ldi, n, packed, cols, orow, ldo); break;
      default: break;
    }
    }
  }
}

#pragma GCC pop_options

}  // namespace

bool dense_bf16_nn(const void* in, int64_t ldi, int64_t m, const void* w, int64_t n, int64_t k,
                   void* out, int64_t ldo) {
  if (!has_avx512_bf16() || k % kSub != 0 || n < 1 || m < 1) return false;
  nn_avx512bf16(static_cast<const uint16_t*>(in), ldi, m, static_cast<const uint16_t*>(w), n,
                k, static_cast<uint16_t*>(out), ldo);
  return true;
}

}  // namespace kt_kernel
