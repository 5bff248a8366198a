// Weight formats of the frozen expert base, native side: the tile-loader interface.
//
// A projection (gate_up or down) is logically W [E, N, K]: E experts, N output rows, K input
// columns (gate_up: N = 2I, K = H; down: N = H, K = I). A format stores it as up to
// kMaxParts tensors ("parts"), each contiguous with the expert as dim 0 (for INT8: q [E, N, K]
// int8 and scale [E, N] fp32). The Python class of the format (kt_kernel.formats, the
// WeightFormat protocol) builds the parts and hands them to the one native op in the order
// of its `native_args()`; the op looks the format up by name in this registry.
//
// Adding a format is ONE registration in ONE new .cpp file (setup.py compiles csrc/*.cpp):
//
//   namespace kt_kernel::formats {
//   namespace {
//   void check_int4(const std::vector<at::Tensor>& parts, int64_t e, int64_t n, int64_t k,
//                   const char* what) { ... TORCH_CHECK(..., what, "...") ... }
//   void load_int4(const ExpertView& w, int64_t row0, int64_t col0, int64_t rows, int64_t cols,
//                  c10::ScalarType out_dtype, void* out, int64_t ldo) { ... }
//   }
//   KT_REGISTER_FORMAT(int4, Format{"int4", 2, check_int4, load_int4, 8});
//   }
//
// and ONE Python class registered in kt_kernel.formats (register_format). Nothing in the op,
// the autograd Function or ops.py changes.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <string>
#include <vector>

namespace kt_kernel {

// ----------------------------------------------------------------------------- ISA level
// The instruction set every native loop may use: the best the CPU supports, capped by the
// environment variable KT_KERNEL_ISA=avx512|avx2|scalar (read once, at the first native call;
// an unknown value is an error at that call). Loaders pick their code path from this, so one
// setting forces every loop (elementwise, scatter, tile loaders) onto one path for tests.
enum class Isa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };
Isa isa_level();
// True when isa_level() is kAvx512 and the CPU has AVX512_BF16 (vcvtne2ps2bf16).
bool has_avx512_bf16();
// True when has_avx512_bf16(), the CPU has AMX-TILE and AMX-BF16, the OS enables tile state
// (XCR0 bits 17-18) and this process may use it (Linux arch_prctl); KT_KERNEL_AMX=0 turns it
// off. Read once.
bool has_amx();
// True when has_amx() and the CPU has AMX-INT8 (TDPBSSD); KT_KERNEL_AMX=0 turns it off too.
bool has_amx_int8();
// "avx512", "avx2" or "scalar".
const char* isa_name(Isa isa);

// The table of a per-ISA loop family that isa_level() allows: each family's .cpp includes its
// *_body.h once per ISA, into namespaces isa_avx512 and isa_avx2 (x86-64 GCC) and isa_base,
// and each copy defines `make_table(const char* isa_name)`. KT_ISA_TABLE() picks one there.
template <class T>
T pick_isa_table(T (*avx512)(const char*), T (*avx2)(const char*), T (*scalar)(const char*)) {
  switch (isa_level()) {
    case Isa::kAvx512:
      return avx512("avx512");
    case Isa::kAvx2:
      return avx2("avx2");
    default:
      return scalar("scalar");
  }
}
#if defined(__x86_64__) && defined(__GNUC__)
#define KT_ISA_TABLE() \
  ::kt_kernel::pick_isa_table(&isa_avx512::make_table, &isa_avx2::make_table, &isa_base::make_table)
#else
#define KT_ISA_TABLE() isa_base::make_table("scalar")
#endif

namespace formats {

constexpr int kMaxParts = 4;

// One expert's storage of one projection, as a loader receives it.
struct ExpertView {
  // part[i] = parts[i].data_ptr() + e * parts[i].stride(0) * element_size: expert e's slice of
  // part i, contiguous, in the part's own dtype (the loader knows which; its checker verified
  // it). Unused entries are nullptr.
  const void* part[kMaxParts];
  // sizes[i][d] = parts[i].size(d + 1) for d < dims[i] (the per-expert shape of part i, at
  // most 3 dims), e.g. a loader derives its group size as K / sizes[1][1].
  int64_t sizes[kMaxParts][3];
  int dims[kMaxParts];
  int64_t n, k;  // the logical W_e is [N, K]
};

// Dequantise the tile W_e[row0 : row0 + rows, col0 : col0 + cols] into `out`:
//   out[r * ldo + c] = W_e[row0 + r, col0 + c]   for r < rows, c < cols,
// as out_dtype, which is at::kFloat or at::kBFloat16 (the compute dtype of the call; bf16 is
// raw uint16 bits). `out` is a per-thread scratch the loader only writes; ldo >= cols.
// The op calls it with two shapes of tile: row blocks (col0 = 0, cols = K; for `x W^T`) and
// column blocks (row0 = 0, rows = N; for `dy W`), so row0/col0 can be any value in range
// (they are multiples of 16 except possibly at 0 — do not rely on more).
// Contract: the value of each element is the format's dequantised weight formed in fp32 and
// rounded ONCE to out_dtype (round to nearest even), exactly as the Python format's
// `dequantize` computes it; every ISA path must give bitwise the same tile (the determinism
// and the oracle tests rely on it). Called concurrently from many threads; no state.
using TileLoader = void (*)(const ExpertView& w, int64_t row0, int64_t col0, int64_t rows,
                            int64_t cols, c10::ScalarType out_dtype, void* out, int64_t ldo);

// Optional small-row product, for the few rows per expert of small batches: the same products
// as a tile loader followed by a GEMM, without the tile (its weights decoded in registers):
//   nn == false: out[r, i] = sum_j in[r, j] * W_e[i, j]   (in [m, K], out [m, N]: x W^T)
//   nn == true:  out[r, j] = sum_i in[r, i] * W_e[i, j]   (in [m, N], out [m, K]: dy W)
// for r < m; in and out are out_dtype rows (float or bf16 bits) with row strides ldi and ldo.
// Each weight is formed exactly as the loader forms it, sums are fp32 in an order fixed by
// the shape alone (never by the thread count); every ISA path computes in fp32, though not
// necessarily with the same summation order (the oracle tests bound them, as for GEMMs).
// The op calls it for tasks of at most gemv_rows() rows (moe_common.h), or of any size where the
// format's gemv_all_rows() holds (its own products here). It returns false,
// having written nothing, where it has no fast path (an ISA or dtype): the op then takes the
// tile loader and a GEMM.
using GemvFn = bool (*)(const ExpertView& w, bool nn, const void* in, int64_t ldi, int64_t m,
                        c10::ScalarType out_dtype, void* out, int64_t ldo);

// Validate a projection's parts against the logical [experts, n, k]: count, dtype,
// contiguity, every size. Throw with TORCH_CHECK naming `what` ("gate_up" or "down") and
// the part, e.g. "gate_up part 1 (scale) must be a contiguous float32 [E=8, 64] tensor, got ...".
// The op calls it on every call before any pointer is read.
using Checker = void (*)(const std::vector<at::Tensor>& parts, int64_t experts, int64_t n,
                         int64_t k, const char* what);

struct Format {
  std::string name;  // == the Python format's `name`
  int num_parts;     // number of tensors in `native_args()` per projection
  Checker check;
  TileLoader load;   // nullptr only for "dense": its GEMMs read the storage itself
  int64_t row_pad;   // each expert's row block is padded to a multiple of this (8 or 16)
  GemvFn gemv = nullptr;  // optional: the small-row product (tile + GEMM when absent)
  // Whether the format's own products take every row count on this CPU (bf16_packed with
  // AVX512_BF16, int8_packed and int4_packed with AMX): gemv then serves every task unless small-row products are off
  // (gemv_rows() == 0), and the op stops padding rows for oneDNN. nullptr: never.
  bool (*gemv_all_rows)() = nullptr;

  // gemv_all_rows() where the format has it, else false.
  bool all_rows_here() const { return gemv_all_rows != nullptr && gemv_all_rows(); }
};

// Adds `f` to the registry (at library load, through KT_REGISTER_FORMAT); returns true.
bool register_format(const Format& f);
// The registered format `name`, or an error listing the registered names.
const Format& find_format(const std::string& name);
// Names of every registered format (for errors and tests).
std::vector<std::string> format_names();

// Overflow-safe index arithmetic for every entry's checks (the arguments come from Python
// unchecked; `start + len` of two int64 can wrap and pass a naive `<= total`).
// True when [start, start + len) lies within [0, total), len >= 0.
inline bool range_within(int64_t start, int64_t len, int64_t total) {
  return start >= 0 && len >= 0 && start <= total && len <= total - start;
}
// ceil(a / b) for a >= 0, b > 0, without the `a + b - 1` that wraps near INT64_MAX.
inline int64_t ceil_div(int64_t a, int64_t b) { return a / b + (a % b != 0 ? 1 : 0); }

// Helper for checkers: TORCH_CHECK that `t` is a contiguous `dtype` tensor of exactly `sizes`,
// with a message naming `what`, the part index and `part_name`.
void check_part(const at::Tensor& t, const char* what, int index, const char* part_name,
                at::ScalarType dtype, at::IntArrayRef sizes);

}  // namespace formats
}  // namespace kt_kernel

#define KT_FORMAT_CONCAT_(a, b) a##b
#define KT_REGISTER_FORMAT(ident, ...)                                          \
  static const bool KT_FORMAT_CONCAT_(kt_format_registered_, ident) [[maybe_unused]] = \
      ::kt_kernel::formats::register_format(__VA_ARGS__)
