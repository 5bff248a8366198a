#!/usr/bin/env bash
# The GPU benchmark in one run (under 8 minutes) on a bare CUDA machine (prepare.sh builds
# kt-kernel in place): bench_hybrid.py (Qwen3-30B-A3B- and DeepSeek-V3-shaped, 4 layers,
# T=2048 and 8192; hybrid sequential/overlapped/--gpu-experts 8 and 16, all on the host,
# transformers + PEFT with accelerate's CPU offload and experts4bit-qlora where installed:
# tokens/s, peak GPU memory, GPU-idle fraction), then the activation memory of
# --gradient-checkpointing at T=8192 on the GPU. Rows that do not fit the budget are listed
# as skipped. Tables and JSON go to $OUT/bench (or /tmp/bench), the log to $OUT/gpu_bench.log.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp}
log=$out/gpu_bench.log
{
  # shellcheck source=tests/gpu/prepare.sh
  source tests/gpu/prepare.sh
  status=0
  left=$((450 - SECONDS))  # of 480 s, 30 kept for the checkpointing rows and the copy-out
  python3 packages/moe-experts/benchmarks/bench_hybrid.py --out "$out/bench" --device cuda \
    --models /tmp/bench-models --budget-s "$((left - 90))" || status=1
  timeout 80 python3 packages/moe-experts/benchmarks/bench_checkpointing.py --out "$out/bench" \
    --device cuda --lengths 8192 || status=1
  echo "device_bench status: $status"
  exit $status
} 2>&1 | tee "$log"
