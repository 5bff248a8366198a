// INT4 group-wise weights repacked once at load for the AMX products: the "int4_packed_g{G}"
// formats (G = 32, 64, 128), one registration per group size, as int4's.
//
// Part 0 of one expert's W [N, K] is uint8 [ceil(N/16), 16 Ps + 64], Ps = ceil(K/2) rounded
// up to 16: row b (block b: output rows 16b .. 16b + 15) holds, for each column pair p < Ps
// and row l < 8, the bytes at 16 p + 2 l + h (h < 2): q[16b + l, 2p + h] + 8 in the low nibble
// and q[16b + 8 + l, 2p + h] + 8 in the high one; then 64 zero bytes. Rows past N and columns
// past K hold q = 0. Part 1 is bf16 [ceil(N/16), 16 ceil(K/G)]: at 16 g + l, row 16b + l's scale of
// group g (zero past N). Part 2 is int64 [2]: N and K. W[n, k] = q[n, k] * scale[n, k / G],
// formed in fp32 (exact) and rounded once: int4's values and int4's dequantize, bitwise.
//
// Why: int4 keeps row pairs in a byte ([ceil(N/2), K]) and its tile loader dequantises a bf16
// tile for oneDNN, 0.79x dense bf16 at T=512 on an AMX CPU (bench_formats.amx_e128_quantised);
// here a tile step of the AMX products (amx_packed_ints.h) reads 256 contiguous bytes per block
// and 32 bytes of its scales (a step's 32 columns lie in one group, G being a multiple of 32).
// The products run where the CPU has AMX and the compute dtype is bf16; the tile loader serves
// the rest (with AVX512_BF16 for bf16 tiles, amx_packed_ints.h's load_bf16; else scalar).
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>

#include <cstdint>

#include "amx_packed_ints.h"
#include "formats.h"

namespace kt_kernel {
namespace formats {
namespace {

using amx_ints::kPadBytes;
using amx_ints::kRows;
inline int64_t block_bytes(int64_t k) { return 16 * amx_ints::stride_pairs(k) + kPadBytes; }

template <int G>
void check_int4_packed(const std::vector<at::Tensor>& parts, int64_t e, int64_t n, int64_t k,
                       const char* what) {
  TORCH_CHECK_VALUE(parts.size() == 3, what, " (int4_packed_g", G,
                    ") must be 3 tensors (packed, scale, shape), got ", parts.size());
  const int64_t blocks = ceil_div(n, kRows);
  check_part(parts[0], what, 0, "packed", at::kByte, {e, blocks, block_bytes(k)});
  check_part(parts[1], what, 1, "scale", at::kBFloat16, {e, blocks, kRows * ceil_div(k, G)});
  check_part(parts[2], what, 2, "shape", at::kLong, {e, 2});
}

template <int G>
void load_int4_scalar(const ExpertView& w, int64_t row0, int64_t col0, int64_t rows,
                      int64_t cols, c10::ScalarType out_dtype, void* out, int64_t ldo) {
  const auto* q = static_cast<const uint8_t*>(w.part[0]);
  const auto* scale = static_cast<const c10::BFloat16*>(w.part[1]);
  const int64_t bb = block_bytes(w.k), sb = kRows * ceil_div(w.k, G);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t n = row0 + r, l = n % kRows, shift = 4 * (l / 8);
    const uint8_t* blk = q + (n / kRows) * bb + 2 * (l % 8);
    const c10::BFloat16* s = scale + (n / kRows) * sb + l;
    for (int64_t c = 0; c < cols; ++c) {
      const int64_t j = col0 + c;
      const int v = ((blk[16 * (j / 2) + (j & 1)] >> shift) & 0xF) - 8;
      const float f = static_cast<float>(v) * static_cast<float>(s[kRows * (j / G)]);
      amx_ints::put_weight(out_dtype, out, r * ldo + c, f);
    }
  }
}

#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")
// A pair row is 16 bytes: the low nibbles hold rows 0-7's pairs, the high nibbles rows 8-15's,
// so the widened halves come out in the order of a B-tile row, with no shuffle.
struct Int4Scales {
  amx_ints::Scales s;
  __m512 lo8, hi8;  // -8 times s.lo, s.hi (exact)
};

template <int G>
struct Int4Codec {
  static constexpr int64_t kPairBytes = 16;
  const uint8_t* q;
  const uint16_t* scale;
  int64_t n, k, block_bytes, scale_stride;
  static Int4Codec of(const ExpertView& w) {
    return {static_cast<const uint8_t*>(w.part[0]), static_cast<const uint16_t*>(w.part[1]), w.n,
            w.k, formats::block_bytes(w.k), kRows * ceil_div(w.k, G)};
  }
  const uint8_t* block(int64_t b) const { return q + b * block_bytes; }
  // The bf16 scales of group 2p / G, widened exactly to fp32.
  Int4Scales scales(int64_t b, int64_t p) const {
    const auto* s = scale + b * scale_stride + kRows * (2 * p / G);
    const __m512i u =
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s)));
    const amx_ints::Scales sp =
        amx_ints::spread_scales(_mm512_castsi512_ps(_mm512_slli_epi32(u, 16)));
    const __m512 m8 = _mm512_set1_ps(-8.0f);
    return {sp, _mm512_mul_ps(sp.lo, m8), _mm512_mul_ps(sp.hi, m8)};
  }
  // (u - 8) * s as u * s - 8 s in one fma: both products are exact (a 4-bit integer times a
  // bf16 scale), so the one rounding gives the product's fp32 value, as int4's dequantize.
  __m512i row(const uint8_t* r, const Int4Scales& s) const {
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r)));
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(0xF)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
    return (__m512i)_mm512_cvtne2ps_pbh(_mm512_fmadd_ps(hi, s.s.hi, s.hi8),
                                        _mm512_fmadd_ps(lo, s.s.lo, s.lo8));
  }
};
#pragma GCC pop_options
#endif

template <int G>
void load_int4_packed(const ExpertView& w, int64_t row0, int64_t col0, int64_t rows,
                      int64_t cols, c10::ScalarType out_dtype, void* out, int64_t ldo) {
#if defined(__x86_64__) && defined(__GNUC__)
  if (out_dtype == at::kBFloat16 && has_avx512_bf16()) {
    amx_ints::load_bf16(Int4Codec<G>::of(w), row0, col0, rows, cols, static_cast<uint16_t*>(out), ldo);
    return;
  }
#endif
  load_int4_scalar<G>(w, row0, col0, rows, cols, out_dtype, out, ldo);
}

template <int G>
bool gemv_int4_packed(const ExpertView& w, bool nn_product, const void* in, int64_t ldi,
                      int64_t m, c10::ScalarType out_dtype, void* out, int64_t ldo) {
#if defined(__x86_64__) && defined(__GNUC__)
  return amx_ints::products(Int4Codec<G>::of(w), nn_product, in, ldi, m, out_dtype, out, ldo);
#else
  (void)w, (void)nn_product, (void)in, (void)ldi, (void)m, (void)out_dtype, (void)out, (void)ldo;
  return false;
#endif
}

template <int G>
Format int4_packed(const char* name) {
  // Rows padded to 8 as int4's; with AMX the products serve every row count.
  return Format{name, 3, check_int4_packed<G>, load_int4_packed<G>, 8, gemv_int4_packed<G>,
                has_amx};
}

}  // namespace

KT_REGISTER_FORMAT(int4_packed_g32, int4_packed<32>("int4_packed_g32"));
KT_REGISTER_FORMAT(int4_packed_g64, int4_packed<64>("int4_packed_g64"));
KT_REGISTER_FORMAT(int4_packed_g128, int4_packed<128>("int4_packed_g128"));

}  // namespace formats
}  // namespace kt_kernel
