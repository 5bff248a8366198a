// bf16 weights repacked once at load for the kernel's own products: the "bf16_packed" format.
//
// Part 0 of one expert's W [N, K] is bf16 [ceil(N/16), 16 Kp + 32], Kp = K rounded up to even.
// Row b of it (block b: output rows 16b .. 16b + 15) holds, for each column pair p < Kp/2 and
// row pair g < 8, the 2x2 tile W[16b + 2g + s, 2p + h] at p * 32 + g * 4 + h * 2 + s (s, h < 2),
// then 32 zeros; the rows past N and the column past an odd K hold zeros. Part 1 is int64 [2]:
// N and K.
//
// Why this layout: oneDNN repacks a weight matrix on every call, which costs most at the 16-64
// rows per expert of a 512-token batch, and its small-M products stall on DRAM. Here the one
// stored copy is what the products stream:
// - dy W (the backward): 64 bytes are 8 row pairs' (W[n, k], W[n + 1, k]) for columns 2p and
//   2p + 1 in alternate lanes; vdpbf16ps against dy's row pairs makes each lane sum a row pair,
//   and the 8 lanes of each column are added at the end. No transposed second copy. From
//   kNnWideRows rows an 8 x 8 qword transpose per block and 16 columns turns the same bytes
//   into W's row pairs across the columns, built once per 32 columns and used by every row
//   (nn_wide; the AMX products' B tiles are the same).
// - x W^T: one in-lane byte shuffle turns the same 64 bytes into 16 rows' (W[n, 2p],
//   W[n, 2p + 1]) pairs; one vdpbf16ps against a broadcast pair of x gives 16 outputs. The
//   shuffle sits here because x W^T reuses each shuffled vector for 12 rows of x, dy W for 4
//   (with it in dy W, dy W ran at 84-86% of the peak from 128 rows, 0.87-0.91x oneDNN).
// - Each block is read front to back by x W^T.
// - The 64 zero bytes ending each block keep the blocks' stride off multiples of 4 KiB: dy W
//   walks down a column of blocks, and at a 4 KiB stride every step mapped to the same L1 and
//   L2 sets (benchmarks/results/history.md, "bf16-packed"). x's rows are copied to a padded
//   stride for the same reason.
// Dequantising (the tile loader) is a permutation, exact on every ISA. The products run where
// the CPU has AVX512_BF16 and the compute dtype is bf16; elsewhere gemv declines and the op
// takes tile + GEMM.
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "amx_tiles.h"
#include "formats.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define KT_PACKED_SIMD 1
#endif

namespace kt_kernel {
namespace formats {
namespace {

constexpr int64_t kBlock = 16;  // output rows per block
constexpr int64_t kPad = 32;    // zero elements ending each block (64 bytes)
// x W^T prefetches each block's line this many column pairs ahead (4 KiB): at 12-32 rows the
// first row tile of a block pair waits on DRAM otherwise (on the AMX Xeon with AMX off, gate_up
// at 12 rows ran at 37% of the peak without it, 95% with it; 16-32 pairs ahead gave 90-93%).
constexpr int64_t kNtAhead = 64;
// dy W's register block: 6 column pairs x 4 rows = 24 accumulators (measured against 4 x 6,
// 0.93-0.98x of it from 64 rows up, and 8 x 3, 0.89-0.98x).
constexpr int kNnPairs = 6;
// Rows from which dy W takes nn_wide (without AMX): one thread, weights from DRAM, nn_wide ran
// 0.8-0.9x nn() at 16 rows, about even at 32, 1.0-1.15x at 64 and 1.05-1.2x at 128-256.
constexpr int64_t kNnWideRows = 48;

inline int64_t even_up(int64_t k) { return k + (k & 1); }
inline int64_t block_elems(int64_t k) { return kBlock * even_up(k) + kPad; }
// Offset within its block of W[16b + l, j].
inline int64_t at(int64_t l, int64_t j) { return (j / 2) * 32 + (l / 2) * 4 + (j & 1) * 2 + (l & 1); }

void check_packed(const std::vector<at::Tensor>& parts, int64_t e, int64_t n, int64_t k,
                  const char* what) {
  TORCH_CHECK_VALUE(parts.size() == 2, what, " (bf16_packed) must be 2 tensors, got ",
                    parts.size());
  check_part(parts[0], what, 0, "packed", at::kBFloat16, {e, ceil_div(n, kBlock), block_elems(k)});
  check_part(parts[1], what, 1, "shape", at::kLong, {e, 2});
}

void load_packed(const ExpertView& w, int64_t row0, int64_t col0, int64_t rows, int64_t cols,
                 c10::ScalarType out_dtype, void* out, int64_t ldo) {
  const auto* p = static_cast<const uint16_t*>(w.part[0]);
  const int64_t bs = block_elems(w.k);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t n = row0 + r;
    const uint16_t* src = p + (n / kBlock) * bs;
    const int64_t l = n % kBlock;
    if (out_dtype == at::kBFloat16) {
      auto* dst = static_cast<uint16_t*>(out) + r * ldo;
      for (int64_t c = 0; c < cols; ++c) {
        const int64_t j = col0 + c;
        dst[c] = src[at(l, j)];
      }
    } else {
      auto* dst = static_cast<float*>(out) + r * ldo;
      for (int64_t c = 0; c < cols; ++c) {
        const int64_t j = col0 + c;
        const uint32_t bits = static_cast<uint32_t>(src[at(l, j)]) << 16;
        std::memcpy(dst + c, &bits, 4);
      }
    }
  }
}

#ifdef KT_PACKED_SIMD
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")

inline uint32_t pair_at(const uint16_t* row, int64_t col) {
  uint32_t v;
  std::memcpy(&v, row + col, 4);
  return v;
}

// out[r, 16 j + l] for MR rows and NB blocks: lane l adds x[2p] W[n, 2p] + x[2p + 1] W[n, 2p + 1]
// for p = 0, 1, ... in order (fp32), then rounds once to bf16. `last` is how many of the last
// block's 16 outputs exist.
template <int MR, int NB>
void nt_tile(const uint16_t* x, int64_t ldx, const uint16_t* blk, int64_t bs, int64_t pairs,
             int last, uint16_t* out, int64_t ldo) {
  const __m512i sh = to_rows();
  __m512 acc[MR][NB];
  for (int r = 0; r < MR; ++r) {
    for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_setzero_ps();
  }
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh wv[NB];
    for (int j = 0; j < NB; ++j) {
      _mm_prefetch(reinterpret_cast<const char*>(blk + j * bs + (p + kNtAhead) * 2 * kBlock),
                   _MM_HINT_T0);
    }
    for (int j = 0; j < NB; ++j) {
      wv[j] = (__m512bh)_mm512_shuffle_epi8(
          _mm512_loadu_si512(blk + j * bs + p * 2 * kBlock), sh);
    }
    for (int r = 0; r < MR; ++r) {
      const auto xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair_at(x + r * ldx, 2 * p)));
      for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xv, wv[j]);
    }
  }
  const __mmask16 tail = static_cast<__mmask16>((1u << last) - 1);
  for (int r = 0; r < MR; ++r) {
    for (int j = 0; j < NB; ++j) {
      const __m256i v = (__m256i)_mm512_cvtneps_pbh(acc[r][j]);
      _mm256_mask_storeu_epi16(out + r * ldo + j * kBlock, j == NB - 1 ? tail : 0xFFFF, v);
    }
  }
}

// The last m (0 < m < MR) rows as one register block of m rows: tile(integral_constant<m>).
// Why one block: each register block is a pass over the weights, and a pass of one row (2
// accumulators) ran at a fraction of the peak, so a few left-over rows cost as many as a
// dozen (17-45 rows per expert at T=512, E=128).
template <int MR, class Tile>
inline void tail_rows(int64_t m, const Tile& tile) {
  if constexpr (MR > 1) {
    if (m > 0) with_rows<MR - 1>(m, tile);
  }
}

// Rows in register blocks of 12 (two blocks of outputs: 24 accumulators), then the rest in one.
template <int NB>
void nt_rows(const uint16_t* x, int64_t ldx, int64_t m, const uint16_t* blk, int64_t bs,
             int64_t pairs, int last, uint16_t* out, int64_t ldo) {
  int64_t r = 0;
  for (; r + 12 <= m; r += 12) {
    nt_tile<12, NB>(x + r * ldx, ldx, blk, bs, pairs, last, out + r * ldo, ldo);
  }
  tail_rows<12>(m - r, [&](auto mr) {
    nt_tile<decltype(mr)::value, NB>(x + r * ldx, ldx, blk, bs, pairs, last, out + r * ldo, ldo);
  });
}

void nt(const uint16_t* p, int64_t n, int64_t k, const uint16_t* x_in, int64_t ldx_in, int64_t m,
        uint16_t* out, int64_t ldo) {
  const int64_t bs = block_elems(k), blocks = ceil_div(n, kBlock), pairs = even_up(k) / 2;
  // The rows of a register block are read together; at a row stride of a multiple of 4 KiB
  // (K = 2048) they share one L1 set. A copy with 64 bytes more per row spreads them. An odd
  // K's last pair gets a zero for x[K] (column K of the weights is zero too).
  const int64_t ldx = even_up(k) + kPad;
  thread_local std::vector<uint16_t> xbuf;
  xbuf.resize(static_cast<size_t>(m * ldx));
  for (int64_t r = 0; r < m; ++r) {
    std::memcpy(xbuf.data() + r * ldx, x_in + r * ldx_in, static_cast<size_t>(k) * 2);
    if (k & 1) xbuf[r * ldx + k] = 0;
  }
  const uint16_t* x = xbuf.data();
  const int rest = static_cast<int>(n - (blocks - 1) * kBlock);  // outputs of the last block
  int64_t b = 0;
  for (; b + 2 <= blocks; b += 2) {
    const int last = b + 2 == blocks ? rest : kBlock;
    nt_rows<2>(x, ldx, m, p + b * bs, bs, pairs, last, out + b * kBlock, ldo);
  }
  if (b < blocks) nt_rows<1>(x, ldx, m, p + b * bs, bs, pairs, rest, out + b * kBlock, ldo);
}

// out[r, 2 (p0 + j)] and out[r, 2 (p0 + j) + 1] for MR rows and KB column pairs. `dup` row r
// holds, per block, 16 dwords: dy's row pair (2q, 2q + 1) of the block in dwords 2q and 2q + 1.
// Each lane sums over the blocks in order; the 8 lanes of a column are added in a fixed tree.
// The 12 columns of 6 accumulators (lane 2q + h of accumulator j: column 2j + h), summed in
// the scalar path's tree (lanes i + 8, then i + 4, then i + 2) for 6 at a time, rounded to
// bf16 in one instruction and stored with one masked store of `cols` (<= 12) columns.
inline void store_columns6(const __m512 (&a)[kNnPairs], int cols, uint16_t* out) {
  // lanes i and i + 8: two accumulators per vector, 8 lanes each
  const auto fold8 = [](__m512 x, __m512 y) {
    return _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x44), _mm512_shuffle_f32x4(x, y, 0xEE));
  };
  const __m512 s01 = fold8(a[0], a[1]), s23 = fold8(a[2], a[3]), s45 = fold8(a[4], a[5]);
  // lanes i and i + 4: four accumulators per vector, 4 lanes each
  const auto fold4 = [](__m512 x, __m512 y) {
    return _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x88), _mm512_shuffle_f32x4(x, y, 0xDD));
  };
  const __m512 t0 = fold4(s01, s23), t1 = fold4(s45, s45);
  // lanes i and i + 2: columns (even, odd) in lanes 0, 1 of each 128-bit lane
  const __m512 u0 = _mm512_add_ps(t0, _mm512_permute_ps(t0, 0x4E));
  const __m512 u1 = _mm512_add_ps(t1, _mm512_permute_ps(t1, 0x4E));
  const __m512i pick = _mm512_setr_epi32(0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 0, 0, 0, 0);
  const __m512 cols12 = _mm512_permutex2var_ps(u0, pick, u1);
  const __m256i bf = (__m256i)_mm512_cvtneps_pbh(cols12);
  _mm256_mask_storeu_epi16(out, static_cast<__mmask16>((1u << cols) - 1), bf);
}

// `cols` (<= 2 KB) is how many of the tile's output columns exist (an odd K drops the last).
template <int MR, int KB>
void nn_tile(const uint32_t* dup, int64_t ldd, const uint16_t* p, int64_t bs, int64_t blocks,
             int cols, uint16_t* out, int64_t ldo, bool prefetch) {
  __m512 acc[MR][KB];
  for (int r = 0; r < MR; ++r) {
    for (int j = 0; j < KB; ++j) acc[r][j] = _mm512_setzero_ps();
  }
  for (int64_t b = 0; b < blocks; ++b) {
    const uint16_t* src = p + b * bs;
    if (prefetch) {
      // The next column pairs of this block: the next pass down the blocks reads them.
      for (int j = 0; j < KB; ++j) {
        _mm_prefetch(reinterpret_cast<const char*>(src + (KB + j) * 2 * kBlock), _MM_HINT_T1);
      }
    }
    __m512bh wv[KB];
    for (int j = 0; j < KB; ++j) {
      wv[j] = (__m512bh)_mm512_loadu_si512(src + j * 2 * kBlock);
    }
    for (int r = 0; r < MR; ++r) {
      const auto a = (__m512bh)_mm512_loadu_si512(dup + r * ldd + b * kBlock);
      for (int j = 0; j < KB; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], a, wv[j]);
    }
  }
  for (int r = 0; r < MR; ++r) {
    if constexpr (KB == kNnPairs) {
      store_columns6(acc[r], cols, out + r * ldo);
    } else {
      for (int j = 0; j < KB; ++j) {
        const __m512 v = acc[r][j];
        const __m256 h = _mm256_add_ps(
            _mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
        __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
        q = _mm_add_ps(q, _mm_movehl_ps(q, q));  // lane 0: even lanes (column 2p), lane 1: odd
        out[r * ldo + 2 * j] = c10::BFloat16(_mm_cvtss_f32(q)).x;
        if (2 * j + 1 < cols) {
          out[r * ldo + 2 * j + 1] = c10::BFloat16(_mm_cvtss_f32(_mm_shuffle_ps(q, q, 1))).x;
        }
      }
    }
  }
}

// Rows in register blocks of 24 / KB (4 for kNnPairs, 24 for the single-pair tail), then the
// rest: in one block for kNnPairs, row by row for the (rare) single-pair tail.
template <int KB>
void nn_rows(const uint32_t* dup, int64_t ldd, int64_t m, const uint16_t* p, int64_t bs,
             int64_t blocks, int cols, uint16_t* out, int64_t ldo) {
  int64_t r = 0;
  constexpr int MR = 24 / KB;
  for (; r + MR <= m; r += MR) {
    nn_tile<MR, KB>(dup + r * ldd, ldd, p, bs, blocks, cols, out + r * ldo, ldo, r == 0);
  }
  if constexpr (KB == kNnPairs) {
    tail_rows<MR>(m - r, [&](auto mr) {
      nn_tile<decltype(mr)::value, KB>(dup + r * ldd, ldd, p, bs, blocks, cols, out + r * ldo,
                                       ldo, r == 0);
    });
  } else {
    for (; r < m; ++r) {
      nn_tile<1, KB>(dup + r * ldd, ldd, p, bs, blocks, cols, out + r * ldo, ldo, r == 0);
    }
  }
}

void nn(const uint16_t* p, int64_t n, int64_t k, const uint16_t* dy, int64_t ldi, int64_t m,
        uint16_t* out, int64_t ldo) {
  const int64_t bs = block_elems(k), blocks = ceil_div(n, kBlock), pairs = even_up(k) / 2;
  // dy's rows zero-padded to whole blocks, plus 64 bytes so the rows a register block reads
  // together do not share an L1 set (a row of 2048 dwords is 8 KiB).
  const int64_t ldd = blocks * kBlock + kBlock;
  thread_local std::vector<uint32_t> dup;
  dup.resize(static_cast<size_t>(m * ldd));
  const __m512i twice = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  for (int64_t r = 0; r < m; ++r) {
    const uint16_t* row = dy + r * ldi;
    uint32_t* d = dup.data() + r * ldd;
    int64_t i = 0;
    for (; i + kBlock <= n; i += kBlock) {  // 8 row pairs, each twice
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + i));
      _mm512_storeu_si512(d + i, _mm512_permutexvar_epi32(twice, _mm512_castsi256_si512(v)));
    }
    for (; i < n; i += 2) {
      const uint32_t hi = i + 1 < n ? row[i + 1] : 0;
      d[i] = d[i + 1] = row[i] | (hi << 16);
    }
    std::fill(d + i, d + ldd, 0u);
  }
  int64_t p0 = 0;
  for (; p0 + kNnPairs <= pairs; p0 += kNnPairs) {
    const int cols = static_cast<int>(std::min<int64_t>(2 * kNnPairs, k - 2 * p0));
    nn_rows<kNnPairs>(dup.data(), ldd, m, p + p0 * 2 * kBlock, bs, blocks, cols, out + 2 * p0, ldo);
  }
  for (; p0 < pairs; ++p0) {
    const int cols = static_cast<int>(std::min<int64_t>(2, k - 2 * p0));
    nn_rows<1>(dup.data(), ldd, m, p + p0 * 2 * kBlock, bs, blocks, cols, out + 2 * p0, ldo);
  }
}

// Rows g of W's row pairs (g < 8 of block `blk`) for the 16 columns from column pair p0: the
// 8 x 8 qword transpose of the 64 bytes of pairs p0 .. p0 + 7 (zeros past `pairs`).
inline void transpose8(const uint16_t* blk, int64_t p0, int64_t pairs, uint16_t* t) {
  __m512i v[8];
  for (int i = 0; i < 8; ++i) {
    v[i] = p0 + i < pairs ? _mm512_loadu_si512(blk + (p0 + i) * 2 * kBlock)
                          : _mm512_setzero_si512();
  }
  transpose8_qwords(v, t);
}

// Step s of dy W's B tiles for the 32 output columns from c0 (tile j: columns c0 + 16 j ...):
// rows 8 h + g are row pair g of block 2 s + h (zeros past the blocks). The AMX products and
// nn_wide read the same tiles.
inline void nn_step_tiles(const uint16_t* p, int64_t bs, int64_t blocks, int64_t pairs,
                          int64_t c0, int64_t s, uint16_t* dst) {
  for (int j = 0; j < 2; ++j) {
    uint16_t* t = dst + j * kTile;
    const int64_t p0 = (c0 + 16 * j) / 2;
    for (int h = 0; h < 2; ++h) {
      const int64_t b = 2 * s + h;
      if (b < blocks) {
        transpose8(p + b * bs, p0, pairs, t + 8 * 32 * h);
      } else {
        std::fill(t + 8 * 32 * h, t + 8 * 32 * (h + 1), uint16_t{0});
      }
    }
  }
}

// dy W from kNnWideRows rows on. Per 32 output columns, the steps' B tiles (W's row pairs
// across the 32 columns) are built once into this thread's pass buffer, then x W^T's register
// blocks run over them: 12 rows x 2 vectors, each weight vector used by 12 rows and each
// broadcast pair of dy by 2 vectors. nn() reads a weight vector per 4 rows and a doubled copy
// of dy (4 bytes a value) per 6 vectors; in the op at 128-256 rows it ran at 81-87% of the
// peak, bound by those reads from L2. Each output sums W's row pairs in order (fp32), then
// rounds once; dy comes zero-padded (padded_rows), so an odd N's last pair adds dy[N-1] alone.
template <int MR>
void nn_wide_tile(const uint16_t* dy, int64_t ld, const uint16_t* t, int64_t npairs, int cols,
                  uint16_t* out, int64_t ldo) {
  __m512 acc[MR][2];
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t q0 = 0; q0 < npairs; q0 += 16) {
    const uint16_t* ts = t + (q0 / 16) * 2 * kTile;
    const int64_t qn = std::min<int64_t>(16, npairs - q0);
    for (int64_t i = 0; i < qn; ++i) {
      const auto w0 = (__m512bh)_mm512_load_si512(ts + 32 * i);
      const auto w1 = (__m512bh)_mm512_load_si512(ts + kTile + 32 * i);
      for (int r = 0; r < MR; ++r) {
        const auto a = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair_at(dy + r * ld, 2 * (q0 + i))));
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, w0);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, w1);
      }
    }
  }
  const __mmask16 mask[2] = {first_lanes(cols), first_lanes(cols - 16)};
  for (int r = 0; r < MR; ++r) {
    for (int j = 0; j < 2; ++j) {
      const __m256i v = (__m256i)_mm512_cvtneps_pbh(acc[r][j]);
      _mm256_mask_storeu_epi16(out + r * ldo + 16 * j, mask[j], v);
    }
  }
}

void nn_wide(const uint16_t* p, int64_t n, int64_t k, const uint16_t* dy_in, int64_t ldi,
             int64_t m, uint16_t* out, int64_t ldo) {
  const int64_t bs = block_elems(k), blocks = ceil_div(n, kBlock), pairs = even_up(k) / 2;
  const int64_t steps = ceil_div(blocks, 2), npairs = (n + 1) / 2;
  int64_t ld = 0, rows = 0;
  const uint16_t* dy = padded_rows(dy_in, ldi, m, n, ld, rows);
  uint16_t* t = pass_buffer(steps);
  for (int64_t c0 = 0; c0 < k; c0 += 32) {
    for (int64_t s = 0; s < steps; ++s) {
      // The next strip's 1 KiB of both blocks, for the next build.
      if (c0 + 32 < k) {
        for (int64_t b = 2 * s; b < std::min(2 * s + 2, blocks); ++b) {
          prefetch_kib(p + b * bs + (c0 + 32) * kBlock, false);
        }
      }
      nn_step_tiles(p, bs, blocks, pairs, c0, s, t + s * 2 * kTile);
    }
    const int cols = static_cast<int>(std::min<int64_t>(32, k - c0));
    int64_t r = 0;
    for (; r + 12 <= m; r += 12) {
      nn_wide_tile<12>(dy + r * ld, ld, t, npairs, cols, out + r * ldo + c0, ldo);
    }
    tail_rows<12>(m - r, [&](auto mr) {
      nn_wide_tile<decltype(mr)::value>(dy + r * ld, ld, t, npairs, cols, out + r * ldo + c0, ldo);
    });
  }
}

#pragma GCC pop_options

// AMX-BF16 (Sapphire Rapids and later): the same bytes feed 16 x 32 x 16 tile products. A
// B tile is 16 rows of 64 bytes, each row one pair of the reduced dimension for 16 outputs:
// - x W^T: row p of block b's tile is to_rows() of the block's 64 bytes at pair p, as in
//   nt_tile.
// - dy W: row g (a pair of W's rows) for 16 columns is qword g of the 64 bytes of 8
//   consecutive column pairs: an 8 x 8 qword transpose per block and 16 columns.
// A pass (two blocks of x W^T, 32 columns of dy W) builds its B tiles while its first row tile
// multiplies them, with the weights prefetched a few steps ahead (pass_tiles).
// x (or dy) is copied to a zero-padded buffer (rows to a multiple of 32, columns to a
// multiple of 32), so every A tile is whole; C tiles go through an fp32 buffer to bf16 once.
#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")
namespace amx {

void nt(const uint16_t* p, int64_t n, int64_t k, const uint16_t* x_in, int64_t ldx_in, int64_t m,
        uint16_t* out, int64_t ldo) {
  const int64_t bs = block_elems(k), blocks = ceil_div(n, kBlock), pairs = even_up(k) / 2;
  const int64_t steps = ceil_div(pairs, 16);  // 32 columns of x per tile product
  int64_t ld = 0, rows = 0;
  const uint16_t* x = padded_rows(x_in, ldx_in, m, k, ld, rows);
  uint16_t* bt0 = pass_buffer(steps);
  const __m512i sh = to_rows();
  _tile_loadconfig(&tile_config_16x64());  // per call: oneDNN loads its own on this thread
  for (int64_t b = 0; b < blocks; b += 2) {
    // B tile j of step s: row r is to_rows() of block b + j's 64 bytes at pair 16 s + r.
    const auto build = [&](int64_t s, uint16_t* dst) {
      if (b + 1 < blocks && 16 * s + 16 <= pairs) {  // branch-free: all but the edges
        const uint16_t* s0 = p + b * bs + s * 32 * kBlock;
#pragma GCC unroll 16
        for (int r = 0; r < 16; ++r) {
          _mm512_store_si512(dst + 32 * r, _mm512_shuffle_epi8(_mm512_loadu_si512(s0 + 32 * r), sh));
          _mm512_store_si512(dst + kTile + 32 * r,
                             _mm512_shuffle_epi8(_mm512_loadu_si512(s0 + bs + 32 * r), sh));
        }
        return;
      }
      for (int j = 0; j < 2; ++j) {
        const uint16_t* src = p + (b + j) * bs;
        for (int64_t r = 0; r < 16; ++r) {
          const int64_t q = 16 * s + r;
          __m512i v = _mm512_setzero_si512();
          if (b + j < blocks && q < pairs) {
            v = _mm512_shuffle_epi8(_mm512_loadu_si512(src + q * 2 * kBlock), sh);
          }
          _mm512_store_si512(dst + j * kTile + 32 * r, v);
        }
      }
    };
    // Step t reads 1 KiB of each of the pass's two blocks.
    const auto fetch = [&](int64_t ahead, int64_t t, bool near) {
      for (int64_t j = 2 * ahead; j < 2 * ahead + 2 && b + j < blocks; ++j) {
        const uint16_t* line = p + (b + j) * bs + t * 32 * kBlock;
        prefetch_kib(line, near);
      }
    };
    pass_tiles(x, ld, rows, m, bt0, steps, b * kBlock, n, out, ldo, build, fetch);
  }
  _tile_release();
}

void nn(const uint16_t* p, int64_t n, int64_t k, const uint16_t* dy_in, int64_t ldi, int64_t m,
        uint16_t* out, int64_t ldo) {
  const int64_t bs = block_elems(k), blocks = ceil_div(n, kBlock), pairs = even_up(k) / 2;
  const int64_t steps = ceil_div(blocks, 2);  // 32 rows of W (columns of dy) per tile product
  int64_t ld = 0, rows = 0;
  const uint16_t* dy = padded_rows(dy_in, ldi, m, n, ld, rows);
  uint16_t* bt0 = pass_buffer(steps);
  _tile_loadconfig(&tile_config_16x64());
  for (int64_t c0 = 0; c0 < k; c0 += 32) {
    // B tile j of step s (the 16 output columns c0 + 16 j ...): W's rows 32 s ... from blocks
    // 2 s and 2 s + 1.
    const auto build = [&](int64_t s, uint16_t* dst) {
      nn_step_tiles(p, bs, blocks, pairs, c0, s, dst);
    };
    // Step t reads 1 KiB (the 32 columns' 16 pairs) of blocks 2 t and 2 t + 1.
    const auto fetch = [&](int64_t ahead, int64_t t, bool near) {
      const int64_t p1 = (c0 + 32 * ahead) / 2;
      if (p1 >= pairs) return;
      for (int64_t h = 0; h < 2 && 2 * t + h < blocks; ++h) {
        const uint16_t* strip = p + (2 * t + h) * bs + p1 * 2 * kBlock;
        prefetch_kib(strip, near);
      }
    };
    pass_tiles(dy, ld, rows, m, bt0, steps, c0, k, out, ldo, build, fetch);
  }
  _tile_release();
}

}  // namespace amx
#pragma GCC pop_options
#endif  // KT_PACKED_SIMD

// Rows from which the AMX tile products take over from the AVX-512 ones.
constexpr int64_t kAmxRows = 16;

bool gemv_packed(const ExpertView& w, bool nn_product, const void* in, int64_t ldi, int64_t m,
                 c10::ScalarType out_dtype, void* out, int64_t ldo) {
#ifdef KT_PACKED_SIMD
  if (out_dtype != at::kBFloat16 || !has_avx512_bf16()) return false;
  const auto* p = static_cast<const uint16_t*>(w.part[0]);
  const auto* x = static_cast<const uint16_t*>(in);
  auto* o = static_cast<uint16_t*>(out);
  if (m >= kAmxRows && has_amx()) {
    if (nn_product) {
      amx::nn(p, w.n, w.k, x, ldi, m, o, ldo);
    } else {
      amx::nt(p, w.n, w.k, x, ldi, m, o, ldo);
    }
    return true;
  }
  if (nn_product) {
    if (m >= kNnWideRows) {
      nn_wide(p, w.n, w.k, x, ldi, m, o, ldo);
    } else {
      nn(p, w.n, w.k, x, ldi, m, o, ldo);
    }
  } else {
    nt(p, w.n, w.k, x, ldi, m, o, ldo);
  }
  return true;
#else
  (void)w, (void)nn_product, (void)in, (void)ldi, (void)m, (void)out_dtype, (void)out, (void)ldo;
  return false;
#endif
}

}  // namespace

// Rows padded to 16 as for dense; the products serve every row count where the CPU has
// AVX512_BF16.
KT_REGISTER_FORMAT(bf16_packed, Format{"bf16_packed", 2, check_packed, load_packed, 16,
                                       gemv_packed, has_avx512_bf16});

}  // namespace formats
}  // namespace kt_kernel
