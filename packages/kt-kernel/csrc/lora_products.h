// The expert op's LoRA products in bf16 on AVX512_BF16, and on AMX-BF16 tiles where the CPU
// has them: rank-r products against packed factors and the factor gradients, each summed in
// fp32 and rounded to bf16 once.
//
// Why: through ATen each of these is a separate small GEMM (e.g. 32 rows x 2048 x 16) whose
// fixed cost is most of its time: 25-70 us a call on an AMX Xeon, 7-23% of the single-thread
// peak on an AVX-512 EPYC (benchmarks/results/history.md, "LoRA products on the kernel's own
// routines"). The op keeps its ATen products wherever available() is false.
#pragma once

#include <ATen/ATen.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

namespace kt_kernel {
namespace common {
struct Scratch;
}  // namespace common

namespace lora {

// Whether the products below run here: bf16 operands, a CPU with AVX512_BF16 at the op's
// AVX-512 level (KT_KERNEL_ISA=avx2 turns them off with the rest) and the switch on.
bool available(at::ScalarType dt);

// The switch (torch.ops.kt_kernel.set_lora_products; KT_KERNEL_LORA_PRODUCTS=0 starts it
// off): off, the op uses ATen's products.
std::atomic<bool>& enabled_setting();

// One LoRA factor of every expert packed for nt(): W_e [N, K] as ceil(N/16) blocks of
// stride_pairs x 16 dwords; dword (p, l) of block b is (W[16b + l, 2p], W[16b + l, 2p + 1]),
// zero past N and K. Sixteen rows p of a block are one AMX-BF16 B tile as they lie. The
// factors change every step, so they are packed once per call.
struct Packed {
  std::shared_ptr<common::Scratch> buf;  // pooled: a fresh multi-MiB tensor page-faults
  const uint32_t* data = nullptr;
  int64_t n = 0, k = 0, blocks = 0, pairs = 0;
  int64_t stride_pairs = 0;  // pairs rounded up to 16 (zeros): whole AMX B tiles per block
};

// Packs w [E, N, K], or with `transposed` the transpose of w [E, K, N], for the experts whose
// `used` entry is nonzero (the others stay unset), on the kernel's threads.
Packed pack(const at::Tensor& w, bool transposed, const std::vector<uint8_t>& used);

// out [m, N] = x [m, K] @ W_e^T; with `accumulate`, out = out + s * (x @ W_e^T) (out is read
// in fp32 and rounded once). x and out: bf16 rows of unit stride.
void nt(const at::Tensor& x, const Packed& w, int64_t e, at::Tensor& out, bool accumulate,
        float s);

// One expert's factor gradient from its m rows: s * a^T diag(w) x, written to out [J, N], or
// with `out_t` to out [N, J]. a [m, J] and x [m, N] bf16 rows of unit stride; w (m floats) may
// be null; a * w is rounded to bf16 before the product, as the op's ATen path rounds it.
void grad(const at::Tensor& a, const float* w, const at::Tensor& x, float s, at::Tensor& out,
          bool out_t);

}  // namespace lora
}  // namespace kt_kernel
