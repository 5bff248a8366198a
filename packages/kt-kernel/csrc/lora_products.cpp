// LoRA products of the expert op on AVX512_BF16, and on AMX tiles from 16 rows where the CPU
// has them (see lora_products.h).
//
// nt() is the pattern of bf16_packed's x W^T without its shuffle: the factor is packed so that
// each 64-byte load holds 16 output rows' column pairs, and one vdpbf16ps against a broadcast
// pair of x gives 16 outputs; 16 such rows are an AMX B tile. The LoRA factors are small
// (rank x H): packing them each call took about 6 ms of the calling thread at E=128.
//
// grad() sums over the expert's rows, two at a time: a row pair of x, interleaved in
// registers, against a broadcast pair of (a w) for out [J, N]; for out [N, J] the roles turn
// round (a's 16 columns as one vector against a broadcast pair of x) so that each stored
// vector is 16 contiguous outputs.
#include "lora_products.h"

#include <ATen/core/grad_mode.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "amx_tiles.h"
#include "formats.h"
#include "moe_common.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define KT_LORA_SIMD 1
#endif

namespace kt_kernel {
namespace lora {
namespace {

constexpr int64_t kBlock = 16;
constexpr int64_t kAmxRows = 16;  // rows from which nt() takes AMX tiles where the CPU has them

inline int64_t ceil_to(int64_t a, int64_t b) { return (a + b - 1) / b * b; }
inline const uint16_t* rows(const at::Tensor& t) {
  return reinterpret_cast<const uint16_t*>(t.data_ptr());
}

void check_rows(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.dim() == 2 && t.scalar_type() == at::kBFloat16 && t.stride(1) == 1, "lora::",
              what, " must be 2-D bf16 with unit column stride");
}

}  // namespace

std::atomic<bool>& enabled_setting() {
  // On by default: measured no slower at any shape, with and without AMX, and 1.02-1.08x the
  // whole op on AMX (benchmarks/results/bench_lora_products.{amx,avx512}.md).
  // KT_KERNEL_LORA_PRODUCTS=0 starts it off (read once).
  static std::atomic<bool> v{[] {
    const char* e = std::getenv("KT_KERNEL_LORA_PRODUCTS");
    return e == nullptr || std::string(e) != "0";
  }()};
  return v;
}

#ifdef KT_LORA_SIMD

bool available(at::ScalarType dt) {
  return enabled_setting().load(std::memory_order_relaxed) && dt == at::kBFloat16 &&
         has_avx512_bf16();
}


#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")

namespace {

inline uint32_t pair_at(const uint16_t* row, int64_t col) {
  uint32_t v;
  std::memcpy(&v, row + col, 4);
  return v;
}

inline __m512 load_bf16(const uint16_t* p, __mmask16 mask) {
  const __m256i v = _mm256_maskz_loadu_epi16(mask, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

inline void store_bf16(uint16_t* p, __mmask16 mask, __m512 v) {
  _mm256_mask_storeu_epi16(p, mask, (__m256i)_mm512_cvtneps_pbh(v));
}


// One expert of pack(): s is w_e ([N, K], or [K, N] when transposed), d its packed blocks.
void pack_expert(const uint16_t* s, int64_t n, int64_t k, bool transposed, const Packed& p,
                 uint32_t* d) {
  for (int64_t b = 0; b < p.blocks; ++b) {
    uint32_t* db = d + b * p.stride_pairs * kBlock;
    const int64_t live = std::min<int64_t>(kBlock, n - b * kBlock);  // rows of W here
    const __mmask16 lanes = first_lanes(live);
    if (transposed) {  // W[row, c] is w[c, row]: rows c and c + 1 of w, 16 columns each
      for (int64_t q = 0; q < p.stride_pairs; ++q) {
        __m512i v = _mm512_setzero_si512();
        if (q < p.pairs) {
          const uint16_t* r0 = s + 2 * q * n + b * kBlock;
          const __m512i lo = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(lanes, r0));
          __m512i hi = _mm512_setzero_si512();
          if (2 * q + 1 < k) hi = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(lanes, r0 + n));
          v = _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
        }
        _mm512_storeu_si512(db + q * kBlock, v);
      }
      continue;
    }
    // W's 16 rows, 16 column pairs at a time: a 16 x 16 dword transpose.
    for (int64_t q0 = 0; q0 < p.stride_pairs; q0 += 16) {
      const int64_t cols = std::max<int64_t>(0, std::min<int64_t>(32, k - 2 * q0));
      const __mmask32 mk = cols >= 32 ? ~__mmask32{0} : (__mmask32{1} << cols) - 1;
      __m512i r[16];
      for (int64_t l = 0; l < 16; ++l) {
        r[l] = l < live ? _mm512_maskz_loadu_epi16(mk, s + (b * kBlock + l) * k + 2 * q0)
                        : _mm512_setzero_si512();
      }
      transpose16(r);
      for (int64_t j = 0; j < 16; ++j) _mm512_storeu_si512(db + (q0 + j) * kBlock, r[j]);
    }
  }
}

// out[r, 16 j + l] for MR rows and NB blocks: lane l adds x's column pairs against the block's
// in order (fp32), then stores once (or adds s times the sum to out).
template <int MR, int NB, bool Acc>
void nt_tile(const uint16_t* x, int64_t ldx, const uint32_t* w, int64_t bsd, int64_t full,
             bool odd, int last, uint16_t* out, int64_t ldo, float s) {
  __m512 acc[MR][NB];
  for (int r = 0; r < MR; ++r) {
    for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_setzero_ps();
  }
  if constexpr (Acc) {
    // The rows of out read back at the end: with a rank of 16 the products take 8 steps, and
    // without this the loads of out held about half of the up-projections' samples (AMX off).
    for (int r = 0; r < MR; ++r) {
      for (int j = 0; j < NB; ++j) {
        _mm_prefetch(reinterpret_cast<const char*>(out + r * ldo + j * kBlock), _MM_HINT_T0);
      }
    }
  }
  for (int64_t p = 0; p < full; ++p) {
    __m512bh wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(w + j * bsd + p * kBlock);
    for (int r = 0; r < MR; ++r) {
      const auto xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair_at(x + r * ldx, 2 * p)));
      for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xv, wv[j]);
    }
  }
  if (odd) {  // K's last column, paired with a zero (the packed column K is zero too)
    __m512bh wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(w + j * bsd + full * kBlock);
    for (int r = 0; r < MR; ++r) {
      const auto xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[r * ldx + 2 * full]));
      for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xv, wv[j]);
    }
  }
  const __m512 sv = _mm512_set1_ps(s);
  for (int r = 0; r < MR; ++r) {
    for (int j = 0; j < NB; ++j) {
      const __mmask16 mask = j == NB - 1 ? first_lanes(last) : static_cast<__mmask16>(0xFFFF);
      uint16_t* o = out + r * ldo + j * kBlock;
      __m512 v = acc[r][j];
      if constexpr (Acc) v = _mm512_fmadd_ps(v, sv, load_bf16(o, mask));
      store_bf16(o, mask, v);
    }
  }
}

template <int NB, bool Acc>
void nt_rows(const uint16_t* x, int64_t ldx, int64_t m, const uint32_t* w, int64_t bsd,
             int64_t full, bool odd, int last, uint16_t* out, int64_t ldo, float s) {
  int64_t r = 0;
  for (; r + 12 <= m; r += 12) {
    nt_tile<12, NB, Acc>(x + r * ldx, ldx, w, bsd, full, odd, last, out + r * ldo, ldo, s);
  }
  for (; r + 4 <= m; r += 4) {
    nt_tile<4, NB, Acc>(x + r * ldx, ldx, w, bsd, full, odd, last, out + r * ldo, ldo, s);
  }
  for (; r < m; ++r) {
    nt_tile<1, NB, Acc>(x + r * ldx, ldx, w, bsd, full, odd, last, out + r * ldo, ldo, s);
  }
}

template <bool Acc>
void nt_all(const uint16_t* x, int64_t ldx, int64_t m, const Packed& w, int64_t e, uint16_t* out,
            int64_t ldo, float s) {
  const int64_t bsd = w.stride_pairs * kBlock;
  const uint32_t* we = w.data + e * w.blocks * bsd;
  const int64_t full = w.k / 2;
  const bool odd = (w.k & 1) != 0;
  const int rest = static_cast<int>(w.n - (w.blocks - 1) * kBlock);
  int64_t b = 0;
  for (; b + 2 <= w.blocks; b += 2) {
    const int last = b + 2 == w.blocks ? rest : static_cast<int>(kBlock);
    nt_rows<2, Acc>(x, ldx, m, we + b * bsd, bsd, full, odd, last, out + b * kBlock, ldo, s);
  }
  if (b < w.blocks) {
    nt_rows<1, Acc>(x, ldx, m, we + b * bsd, bsd, full, odd, rest, out + b * kBlock, ldo, s);
  }
}

// Dword (i, j) of the result: (a[2i, j] w[2i], a[2i + 1, j] w[2i + 1]) in bf16, zero past m and J;
// jp (a multiple of 16) dwords per row pair. 16 columns of a row pair per step: one scalar
// conversion per element was 1-2% of the op's CPU time at T=2048.
void weighted_pairs(const at::Tensor& a, const float* w, int64_t m, int64_t jcount, int64_t jp,
                    std::vector<uint32_t>& out) {
  const int64_t mp = (m + 1) / 2, lda = a.stride(0);
  out.resize(static_cast<size_t>(mp * jp));
  const uint16_t* src = rows(a);
  // a row's 16 columns from j0 as fp32 lanes times its (bf16-rounded) routing weight, to bf16
  const auto row16 = [&](int64_t i, int64_t j0) -> __m512i {
    if (i >= m) return _mm512_setzero_si512();
    const __m256i bits16 = _mm256_maskz_loadu_epi16(first_lanes(jcount - j0), src + i * lda + j0);
    const __m512i v = _mm512_cvtepu16_epi32(bits16);
    if (!w) return v;
    const __m512 f = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(v, 16)),
                                   _mm512_set1_ps(static_cast<float>(c10::BFloat16(w[i]))));
    return _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(f));
  };
  for (int64_t i = 0; i < mp; ++i) {
    for (int64_t j0 = 0; j0 < jp; j0 += 16) {
      const __m512i lo = row16(2 * i, j0), hi = row16(2 * i + 1, j0);
      _mm512_storeu_si512(out.data() + i * jp + j0, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
  }
}

// unpacklo/hi_epi16 of two rows' 32 columns give lanes 4L + t = column 8L + t (lo) and
// 8L + 4 + t (hi); these put them back in column order.
inline __m512i order_lo() {
  return _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
}
inline __m512i order_hi() {
  return _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
}

// 32 columns of the row pair (r0, r0 + ldx) as dwords (x[2i, n], x[2i + 1, n]) in column order:
// `left` of them exist (zeros past them, and for the second row unless `two`).
inline void pair_chunk(const uint16_t* r0, int64_t ldx, bool two, int64_t left, uint32_t* d) {
  const __mmask32 mk = left >= 32 ? ~__mmask32{0} : (left > 0 ? (__mmask32{1} << left) - 1 : 0);
  const __m512i a = _mm512_maskz_loadu_epi16(mk, r0);
  const __m512i b = two ? _mm512_maskz_loadu_epi16(mk, r0 + ldx) : _mm512_setzero_si512();
  const __m512i lo = _mm512_unpacklo_epi16(a, b);
  const __m512i hi = _mm512_unpackhi_epi16(a, b);
  _mm512_storeu_si512(d, _mm512_permutex2var_epi32(lo, order_lo(), hi));
  _mm512_storeu_si512(d + 16, _mm512_permutex2var_epi32(lo, order_hi(), hi));
}

// out [J, N]: MJ rows of out from column j0, the 64 columns from n0 (`cols` of them exist):
// four accumulators per row, 16 columns each. xw holds x's row pairs for those 64 columns
// as dwords (x[2i, n], x[2i + 1, n]), 64 per row pair, zeros past m and N.
template <int MJ>
void grad_rows_tile(const uint32_t* ap, int64_t jp, int64_t j0, const uint32_t* xw, int64_t mp,
                    int64_t n0, int64_t cols, float s, uint16_t* out, int64_t ldo) {
  __m512 acc[MJ][4];
  for (int j = 0; j < MJ; ++j) {
    for (int v = 0; v < 4; ++v) acc[j][v] = _mm512_setzero_ps();
  }
  for (int64_t i = 0; i < mp; ++i) {
    __m512bh xv[4];
    for (int v = 0; v < 4; ++v) xv[v] = (__m512bh)_mm512_loadu_si512(xw + i * 64 + 16 * v);
    const uint32_t* api = ap + i * jp + j0;
    for (int j = 0; j < MJ; ++j) {
      const auto av = (__m512bh)_mm512_set1_epi32(static_cast<int>(api[j]));
      for (int v = 0; v < 4; ++v) acc[j][v] = _mm512_dpbf16_ps(acc[j][v], av, xv[v]);
    }
  }
  const __m512 sv = _mm512_set1_ps(s);
  for (int j = 0; j < MJ; ++j) {
    uint16_t* o = out + (j0 + j) * ldo + n0;
    for (int v = 0; v < 4 && 16 * v < cols; ++v) {
      store_bf16(o + 16 * v, first_lanes(cols - 16 * v), _mm512_mul_ps(sv, acc[j][v]));
    }
  }
}

// x's row pairs, window by window of 64 columns: [ceil(N/64)][mp][64] dwords, each window's
// rows contiguous. grad_rows' tiles walk down a window once per 6 rows of out; read in place,
// x's rows lay KiBs apart (one page per step at H = 2048, so no hardware prefetch), and
// unpacking them again for each tile put 4 shuffles beside every 24 vdpbf16ps or fewer.
void window_pairs(const uint16_t* x, int64_t ldx, int64_t m, int64_t n,
                  std::vector<uint32_t>& out) {
  const int64_t mp = (m + 1) / 2, windows = (n + 63) / 64;
  out.resize(static_cast<size_t>(windows * mp * 64));
  for (int64_t i = 0; i < mp; ++i) {
    const uint16_t* r0 = x + 2 * i * ldx;
    const bool two = 2 * i + 1 < m;
    for (int64_t c = 0; c < windows * 64; c += 32) {
      pair_chunk(r0 + c, ldx, two, n - c, out.data() + ((c / 64) * mp + i) * 64 + c % 64);
    }
  }
}

// Tiles of 6 rows of out (24 accumulators) or the fewest near-equal tiles: J = 16 as 6, 5, 5.
void grad_rows(const uint32_t* ap, int64_t jp, int64_t jcount, const uint16_t* x, int64_t ldx,
               int64_t m, int64_t n, float s, uint16_t* out, int64_t ldo) {
  thread_local std::vector<uint32_t> xw;
  window_pairs(x, ldx, m, n, xw);
  const int64_t mp = (m + 1) / 2, tiles = (jcount + 5) / 6;
  for (int64_t n0 = 0; n0 < n; n0 += 64) {
    const int64_t cols = std::min<int64_t>(64, n - n0);
    const uint32_t* w = xw.data() + (n0 / 64) * mp * 64;
    int64_t j = 0;
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t even = (jcount - j) / (tiles - t);  // the rest spread evenly
      const int64_t take = even + ((jcount - j) % (tiles - t) != 0);
      with_rows<6>(take, [&](auto mj) {
        grad_rows_tile<decltype(mj)::value>(ap, jp, j, w, mp, n0, cols, s, out, ldo);
      });
      j += take;
    }
  }
}

// out [N, J]: MN rows of out from n0, JB vectors of 16 of a's columns: xp holds x's row pairs
// as dwords (x[2i, n], x[2i + 1, n]), np per row pair.
template <int MN, int JB>
void grad_cols_tile(const uint32_t* ap, int64_t jp, int64_t jcount, const uint32_t* xp,
                    int64_t npd, int64_t mp, int64_t n0, float s, uint16_t* out, int64_t ldo) {
  __m512 acc[MN][JB];
  for (int r = 0; r < MN; ++r) {
    for (int j = 0; j < JB; ++j) acc[r][j] = _mm512_setzero_ps();
  }
  for (int64_t i = 0; i < mp; ++i) {
    __m512bh av[JB];
    for (int j = 0; j < JB; ++j) av[j] = (__m512bh)_mm512_loadu_si512(ap + i * jp + 16 * j);
    const uint32_t* xr = xp + i * npd + n0;
    for (int r = 0; r < MN; ++r) {
      const auto xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(xr[r]));
      for (int j = 0; j < JB; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xv, av[j]);
    }
  }
  const __m512 sv = _mm512_set1_ps(s);
  for (int r = 0; r < MN; ++r) {
    for (int j = 0; j < JB; ++j) {
      store_bf16(out + (n0 + r) * ldo + 16 * j, first_lanes(jcount - 16 * j),
                 _mm512_mul_ps(sv, acc[r][j]));
    }
  }
}

template <int JB>
void grad_cols(const uint32_t* ap, int64_t jp, int64_t jcount, const uint32_t* xp, int64_t npd,
               int64_t mp, int64_t n, float s, uint16_t* out, int64_t ldo) {
  int64_t r = 0;
  for (; r + 12 <= n; r += 12) grad_cols_tile<12, JB>(ap, jp, jcount, xp, npd, mp, r, s, out, ldo);
  for (; r + 4 <= n; r += 4) grad_cols_tile<4, JB>(ap, jp, jcount, xp, npd, mp, r, s, out, ldo);
  for (; r < n; ++r) grad_cols_tile<1, JB>(ap, jp, jcount, xp, npd, mp, r, s, out, ldo);
}

}  // namespace

#pragma GCC pop_options

// AMX-BF16 (where has_amx(), from 16 rows): x's rows as A tiles (in place, or from a
// zero-padded copy), 16 pairs of a block of the packed factor as one B tile, read in place;
// C through fp32 to bf16 (or added to out). oneDNN's small GEMMs on AMX took 25-70 us a call
// at these shapes.
#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")
namespace {

template <bool Acc>
void amx_nt(const uint16_t* x_in, int64_t ldx_in, int64_t m, const Packed& w, int64_t e,
            uint16_t* out, int64_t ldo, float s) {
  const int64_t steps = w.stride_pairs / 16, bsd = w.stride_pairs * kBlock;
  const int64_t rows = ceil_to(m, 32);
  alignas(64) static const uint32_t zero_tile[256] = {};
  // x's whole row tiles are read in place where every 32 of K's columns exist (K = 32 steps,
  // so the zero pairs of the factor's last tile meet no column); the rows after the last whole
  // 32 (and every row where K is not whole) come from a zero-padded copy. Since the op stopped
  // padding each expert's rows to 16, copying all rows had become 2% of its CPU time.
  const int64_t in_place = w.k == 32 * steps ? m / 32 * 32 : 0;
  int64_t ld_tail = 0, rows_tail = 0;
  const uint16_t* tail =
      in_place < m ? padded_rows(x_in + in_place * ldx_in, ldx_in, m - in_place, w.k, ld_tail,
                                 rows_tail)
                   : nullptr;
  alignas(64) float c[4][256];
  const uint32_t* we = w.data + e * w.blocks * bsd;
  _tile_loadconfig(&tile_config_16x64());  // per call: oneDNN loads its own on this thread
  for (int64_t b = 0; b < w.blocks; b += 2) {
    const uint32_t* b0 = we + b * bsd;
    const bool two = b + 1 < w.blocks;
    const uint32_t* b1 = two ? we + (b + 1) * bsd : zero_tile;
    const int64_t b1_step = two ? 256 : 0;  // dwords from one B tile to the next
    for (int64_t m0 = 0; m0 < rows; m0 += 32) {
      if constexpr (Acc) {
        // The next block's rows of out, which it reads: at a row stride of KiBs no hardware
        // prefetcher follows them, and the loads of out waited on L3 or DRAM.
        const bool down = m0 + 32 < rows;
        const int64_t nm = down ? m0 + 32 : 0, nc = down ? b * kBlock : (b + 2) * kBlock;
        if (nc < w.n) {
          for (int64_t r = nm; r < std::min(nm + 32, m); ++r) {
            const char* line = reinterpret_cast<const char*>(out + r * ldo + nc);
            _mm_prefetch(line, _MM_HINT_T0);
            _mm_prefetch(line + 62, _MM_HINT_T0);
          }
        }
      }
      tiles_zero();
      const bool own = m0 < in_place;
      const int64_t ld = own ? ldx_in : ld_tail, sa = ld * 2;
      const uint16_t* a0 = own ? x_in + m0 * ldx_in : tail + (m0 - in_place) * ld_tail;
      if (m0 + 16 < m) {
        for (int64_t t = 0; t < steps; ++t) {
          tile_step(a0 + 32 * t, sa, a0 + 16 * ld + 32 * t, sa, b0 + 256 * t, b1 + b1_step * t,
                    64);
        }
      } else {
        for (int64_t t = 0; t < steps; ++t) {
          tile_step_half(a0 + 32 * t, sa, b0 + 256 * t, b1 + b1_step * t, 64);
        }
      }
      tiles_store(c);
      store_c_tiles<Acc>(c, m0, m, b * kBlock, w.n, out, ldo, s);
    }
  }
  _tile_release();  // no tile state left for the OS to save at a context switch
}

// out [J, N] (or out_t: [N, J]) = s * sum over rows i of a'[i, j] x[i, n] on AMX tiles: A tiles
// are rows of a'^T (apt: [32 j rows][mp16] dwords, pairs of rows i), B tiles 16 row pairs of x
// (xp: [mp16][npd] dwords (x[2i, n], x[2i + 1, n])); both zero-padded.
void amx_grad(const uint32_t* apt, int64_t mp16, const uint32_t* xp, int64_t npd, int64_t jt,
              int64_t jcount, int64_t n, float s, uint16_t* out, int64_t ldo, bool out_t) {
  alignas(64) float c[4][256];
  const __m512 sv = _mm512_set1_ps(s);
  _tile_loadconfig(&tile_config_16x64());
  for (int64_t n0 = 0; n0 < n; n0 += 32) {
    for (int64_t j0 = 0; j0 < jt; j0 += 32) {
      tiles_zero();
      for (int64_t t = 0; t < mp16; t += 16) {
        tile_step(apt + j0 * mp16 + t, mp16 * 4, apt + (j0 + 16) * mp16 + t, mp16 * 4,
                  xp + t * npd + n0, xp + t * npd + n0 + 16, npd * 4);
      }
      tiles_store(c);
      for (int i = 0; i < 2; ++i) {
        for (int h = 0; h < 2; ++h) {
          const int64_t col = n0 + 16 * h;
          if (col >= n) continue;
          const __mmask16 mask = first_lanes(n - col);
          const int64_t j1 = j0 + 16 * i;  // out's j of the tile's row 0
          if (j1 >= jcount) continue;
          if (!out_t) {
            for (int r = 0; r < 16 && j1 + r < jcount; ++r) {
              store_bf16(out + (j1 + r) * ldo + col, mask,
                         _mm512_mul_ps(sv, _mm512_load_ps(c[2 * i + h] + 16 * r)));
            }
            continue;
          }
          // out [N, J]: the tile transposed in registers, a row of 16 j per column
          __m512i t[16];
          for (int r = 0; r < 16; ++r) {
            t[r] = _mm512_castps_si512(_mm512_mul_ps(sv, _mm512_load_ps(c[2 * i + h] + 16 * r)));
          }
          transpose16(t);
          const __mmask16 jm = first_lanes(jcount - j1);
          for (int64_t q = 0; q < std::min<int64_t>(16, n - col); ++q) {
            store_bf16(out + (col + q) * ldo + j1, jm, _mm512_castsi512_ps(t[q]));
          }
        }
      }
    }
  }
  _tile_release();
}

}  // namespace

#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")

Packed pack(const at::Tensor& w, bool transposed, const std::vector<uint8_t>& used) {
  TORCH_CHECK(w.dim() == 3 && w.scalar_type() == at::kBFloat16 && w.is_contiguous(),
              "lora::pack needs a contiguous bf16 [E, ., .] tensor");
  const int64_t experts = w.size(0);
  const int64_t n = transposed ? w.size(2) : w.size(1), k = transposed ? w.size(1) : w.size(2);
  Packed p;
  p.n = n;
  p.k = k;
  p.blocks = (n + kBlock - 1) / kBlock;
  p.pairs = (k + 1) / 2;
  p.stride_pairs = ceil_to(p.pairs, 16);
  const int64_t per = p.blocks * p.stride_pairs * kBlock;  // dwords per expert
  p.buf = std::make_shared<common::Scratch>(experts, per, at::kInt);
  auto* dst = reinterpret_cast<uint32_t*>(p.buf->t.data_ptr());
  p.data = dst;
  const auto* src = rows(w);
  common::run_tasks(experts, [&](int64_t e) {
    if (used[e]) pack_expert(src + e * n * k, n, k, transposed, p, dst + e * per);
  });
  return p;
}

void nt(const at::Tensor& x, const Packed& w, int64_t e, at::Tensor& out, bool accumulate,
        float s) {
  check_rows(x, "nt x");
  check_rows(out, "nt out");
  TORCH_CHECK(x.size(1) == w.k && out.size(1) == w.n && out.size(0) == x.size(0),
              "lora::nt: shapes do not match the packed factor");
  const int64_t m = x.size(0);
  if (m == 0) return;
  const uint16_t* xp = rows(x);
  int64_t ldx = x.stride(0);
  auto* o = reinterpret_cast<uint16_t*>(out.data_ptr());
  if (m >= kAmxRows && has_amx()) {
    if (accumulate) {
      amx_nt<true>(xp, ldx, m, w, e, o, out.stride(0), s);
    } else {
      amx_nt<false>(xp, ldx, m, w, e, o, out.stride(0), 1.0f);
    }
    return;
  }
  // The rows of a register block are read together; at a stride of a multiple of 1 KiB
  // (H = 2048: 4 KiB) twelve of them share too few L1 sets. A copy at a padded stride costs
  // K/32 vector moves per row against N K / 32 products.
  thread_local std::vector<uint16_t> xbuf;
  if ((ldx * 2) % 1024 == 0 && m > 4) {
    const int64_t ld = ceil_to(w.k, 2) + 32;
    xbuf.resize(static_cast<size_t>(m * ld));
    for (int64_t r = 0; r < m; ++r) {
      std::memcpy(xbuf.data() + r * ld, xp + r * ldx, static_cast<size_t>(w.k) * 2);
    }
    xp = xbuf.data();
    ldx = ld;
  }
  if (accumulate) {
    nt_all<true>(xp, ldx, m, w, e, o, out.stride(0), s);
  } else {
    nt_all<false>(xp, ldx, m, w, e, o, out.stride(0), 1.0f);
  }
}

void grad(const at::Tensor& a, const float* w, const at::Tensor& x, float s, at::Tensor& out,
          bool out_t) {
  check_rows(a, "grad a");
  check_rows(x, "grad x");
  check_rows(out, "grad out");
  const int64_t m = a.size(0), jcount = a.size(1), n = x.size(1);
  TORCH_CHECK(x.size(0) == m, "lora::grad: a and x must have the same rows");
  TORCH_CHECK(out_t ? (out.size(0) == n && out.size(1) == jcount)
                    : (out.size(0) == jcount && out.size(1) == n),
              "lora::grad: out has the wrong shape");
  auto* o = reinterpret_cast<uint16_t*>(out.data_ptr());
  if (m == 0) {
    out.zero_();
    return;
  }
  const int64_t jp = ceil_to(jcount, 16);
  thread_local std::vector<uint32_t> ap;
  weighted_pairs(a, w, m, jcount, jp, ap);
  const bool amx = m >= kAmxRows && has_amx();
  if (!out_t && !amx) {
    grad_rows(ap.data(), jp, jcount, rows(x), x.stride(0), m, n, s, o, out.stride(0));
    return;
  }
  // x's row pairs as dwords, for the broadcasts or the B tiles (unpack, then back in column
  // order); AMX takes whole tiles of 16 row pairs (zero rows past m).
  // npd: 16 dwords past whole B tiles keep its rows (B tile rows) off multiples of 4 KiB.
  const int64_t mp = (m + 1) / 2, npd = ceil_to(n, 32) + 16, mp16 = ceil_to(mp, 16);
  thread_local std::vector<uint32_t> xpairs;
  xpairs.resize(static_cast<size_t>((amx ? mp16 : mp) * npd));
  if (amx) std::fill(xpairs.begin() + mp * npd, xpairs.end(), 0u);
  const uint16_t* xr = rows(x);
  const int64_t ldx = x.stride(0);
  for (int64_t i = 0; i < mp; ++i) {
    const uint16_t* r0 = xr + 2 * i * ldx;
    const bool two = 2 * i + 1 < m;
    for (int64_t c = 0; c < n; c += 32) {
      pair_chunk(r0 + c, ldx, two, n - c, xpairs.data() + i * npd + c);
    }
  }
  if (amx) {
    // a'^T: 32 j rows (zeros past J) of mp16 row pairs.
    const int64_t jt = ceil_to(jcount, 32);
    thread_local std::vector<uint32_t> apt;
    apt.assign(static_cast<size_t>(jt * mp16), 0u);
    for (int64_t i0 = 0; i0 < mp; i0 += 16) {  // 16 x 16 dword blocks (ap's J padding is zero)
      for (int64_t j0 = 0; j0 < jp; j0 += 16) {
        __m512i r[16];
        for (int64_t l = 0; l < 16; ++l) {
          r[l] = i0 + l < mp ? _mm512_loadu_si512(ap.data() + (i0 + l) * jp + j0)
                             : _mm512_setzero_si512();
        }
        transpose16(r);
        for (int64_t j = 0; j < 16; ++j) {
          _mm512_storeu_si512(apt.data() + (j0 + j) * mp16 + i0, r[j]);
        }
      }
    }
    amx_grad(apt.data(), mp16, xpairs.data(), npd, jt, jcount, n, s, o, out.stride(0), out_t);
    return;
  }
  if (jp == 16) {
    grad_cols<1>(ap.data(), jp, jcount, xpairs.data(), npd, mp, n, s, o, out.stride(0));
  } else if (jp == 32) {
    grad_cols<2>(ap.data(), jp, jcount, xpairs.data(), npd, mp, n, s, o, out.stride(0));
  } else {
    // Ranks above 32: 32 columns of a at a time (out's column blocks), from a narrowed copy.
    for (int64_t j0 = 0; j0 < jcount; j0 += 32) {
      const int64_t jc = std::min<int64_t>(32, jcount - j0);
      std::vector<uint32_t> sub(static_cast<size_t>(mp * 32), 0u);
      for (int64_t i = 0; i < mp; ++i) {
        std::copy(ap.begin() + i * jp + j0, ap.begin() + i * jp + j0 + jc, sub.begin() + i * 32);
      }
      grad_cols<2>(sub.data(), 32, jc, xpairs.data(), npd, mp, n, s, o + j0, out.stride(0));
    }
  }
}

#pragma GCC pop_options

#else  // no x86-64 GCC: the op never calls these (available() is false)

bool available(at::ScalarType) { return false; }
Packed pack(const at::Tensor&, bool, const std::vector<uint8_t>&) {
  TORCH_CHECK(false, "lora::pack needs AVX512_BF16");
}
void nt(const at::Tensor&, const Packed&, int64_t, at::Tensor&, bool, float) {
  TORCH_CHECK(false, "lora::nt needs AVX512_BF16");
}
void grad(const at::Tensor&, const float*, const at::Tensor&, float, at::Tensor&, bool) {
  TORCH_CHECK(false, "lora::grad needs AVX512_BF16");
}

#endif  // KT_LORA_SIMD

}  // namespace lora
}  // namespace kt_kernel
