// The weight-format registry, the ISA level every native loop obeys, and the dense format.
#include "formats.h"

#include <c10/util/Exception.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <sstream>

namespace kt_kernel {

namespace {

Isa detect_isa() {
  // KT_KERNEL_ISA caps the choice; the CPU's features bound it.
  Isa cap = Isa::kAvx512;
  if (const char* s = std::getenv("KT_KERNEL_ISA")) {
    if (std::strcmp(s, "avx512") == 0) {
      cap = Isa::kAvx512;
    } else if (std::strcmp(s, "avx2") == 0) {
      cap = Isa::kAvx2;
    } else if (std::strcmp(s, "scalar") == 0) {
      cap = Isa::kScalar;
    } else if (s[0] != '\0') {
      TORCH_CHECK_VALUE(false, "KT_KERNEL_ISA must be avx512, avx2 or scalar, got '", s,
                        "'; unset it to use the best ISA of this CPU");
    }
  }
  Isa best = Isa::kScalar;
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) best = Isa::kAvx2;
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")) {
    best = Isa::kAvx512;
  }
#endif
  return static_cast<int>(cap) < static_cast<int>(best) ? cap : best;
}

std::map<std::string, formats::Format>& registry() {
  static auto* r = new std::map<std::string, formats::Format>();  // never destroyed
  return *r;
}

std::mutex& registry_mu() {
  static auto* m = new std::mutex();
  return *m;
}

}  // namespace

Isa isa_level() {
  static const Isa level = detect_isa();
  return level;
}

bool has_avx512_bf16() {
#if defined(__x86_64__) && defined(__GNUC__)
  static const bool v = isa_level() == Isa::kAvx512 && __builtin_cpu_supports("avx512bf16");
  return v;
#else
  return false;
#endif
}

namespace {
#if defined(__x86_64__) && defined(__GNUC__)
bool detect_amx() {
  const char* env = std::getenv("KT_KERNEL_AMX");
  if ((env != nullptr && std::strcmp(env, "0") == 0) || !has_avx512_bf16()) return false;
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  if (!(d & (1u << 24)) || !(d & (1u << 22))) return false;  // AMX-TILE, AMX-BF16
  if (!(c & (1u << 27))) return false;                         // OSXSAVE (xgetbv)
  unsigned lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  if ((lo & (3u << 17)) != (3u << 17)) return false;
#if defined(__linux__)
  constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
#else
  return false;
#endif
}
#endif
}  // namespace

bool has_amx() {
#if defined(__x86_64__) && defined(__GNUC__)
  static const bool v = detect_amx();
  return v;
#else
  return false;
#endif
}

bool has_amx_int8() {
#if defined(__x86_64__) && defined(__GNUC__)
  static const bool v = [] {
    if (!has_amx()) return false;
    unsigned a = 0, b = 0, c = 0, d = 0;
    return __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d & (1u << 25)) != 0;  // AMX-INT8
  }();
  return v;
#else
  return false;
#endif
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAvx512:
      return "avx512";
    case Isa::kAvx2:
      return "avx2";
    default:
      return "scalar";
  }
}

namespace formats {

bool register_format(const Format& f) {
  std::lock_guard<std::mutex> lock(registry_mu());
  registry()[f.name] = f;
  return true;
}

std::vector<std::string> format_names() {
  std::lock_guard<std::mutex> lock(registry_mu());
  std::vector<std::string> out;
  for (const auto& kv : registry()) out.push_back(kv.first);
  return out;
}

const Format& find_format(const std::string& name) {
  {
    std::lock_guard<std::mutex> lock(registry_mu());
    auto it = registry().find(name);
    if (it != registry().end()) return it->second;
  }
  std::ostringstream known;
  for (const auto& n : format_names()) known << " " << n;
  TORCH_CHECK_VALUE(false, "format: unknown weight format '", name, "'; registered:", known.str());
}

void check_part(const at::Tensor& t, const char* what, int index, const char* part_name,
                at::ScalarType dtype, at::IntArrayRef sizes) {
  TORCH_CHECK_VALUE(t.defined(), what, " part ", index, " (", part_name, ") is undefined");
  TORCH_CHECK_TYPE(t.scalar_type() == dtype, what, " part ", index, " (", part_name,
                   ") must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.sizes() == sizes && t.is_contiguous() && t.device().is_cpu(), what,
                    " part ", index, " (", part_name, ") must be a contiguous CPU tensor of shape ",
                    sizes, ", got ", t.sizes(), t.is_contiguous() ? "" : " (non-contiguous)");
}

namespace {

// Dense: one part, W itself, in the compute dtype (checked against x by the op).
void check_dense(const std::vector<at::Tensor>& parts, int64_t e, int64_t n, int64_t k,
                 const char* what) {
  TORCH_CHECK_VALUE(parts.size() == 1, what, " (dense) must be 1 tensor, got ", parts.size());
  const auto dt = parts[0].defined() ? parts[0].scalar_type() : at::kFloat;
  TORCH_CHECK_TYPE(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kDouble, what,
                   " (dense) must be float32, bfloat16 or float64, got ", dt);
  check_part(parts[0], what, 0, "weight", dt, {e, n, k});
}

}  // namespace

// Rows of each expert padded to 16 (oneDNN caches one primitive per GEMM shape; see route()).
KT_REGISTER_FORMAT(dense, Format{"dense", 1, check_dense, nullptr, 16});

}  // namespace formats
}  // namespace kt_kernel
