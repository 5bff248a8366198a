#!/usr/bin/env bash
# Every GPU correctness check in one run (under 5 minutes), for a CUDA machine that has python3
# with a CUDA torch but none of our packages (prepare.sh builds kt-kernel in place):
#   1. the hybrid step in fp32 against the all-CPU step: synchronous, overlapped, and with
#      8 hot experts per layer on the GPU (check_hybrid.py; tight bounds);
#   2. the tests marked `gpu` (loading with dense_device="cuda", the hybrid hand-over);
#   3. a one-step CLI fine-tune with --device cuda (and one with --gpu-experts), then
#      `generate --device cuda` with its adapter;
#   4. torchrun over every GPU of the machine with NCCL (one rank where there is one GPU);
#   5. unless `device_check.sh quick`: bf16 timings, overlap off and on (small and
#      Qwen3-30B-A3B-sized).
# Each part prints OK/FAILED; the exit status is 1 if any failed. Results go to stdout and,
# where $OUT is set, to $OUT/gpu_check.log (commit it under tests/gpu/results/).
set -uo pipefail
cd "$(dirname "$0")/../.."
log=${OUT:-/tmp}/gpu_check.log
{
  # shellcheck source=tests/gpu/prepare.sh
  source tests/gpu/prepare.sh
  status=0
  part() {  # part NAME COMMAND...: run, report, remember a failure
    local name=$1
    shift
    local t0=$SECONDS
    if "$@"; then
      echo "== $name: OK ($((SECONDS - t0)) s)"
    else
      echo "== $name: FAILED ($((SECONDS - t0)) s)"
      status=1
    fi
  }
  part "hybrid fp32, synchronous" \
    python3 tests/gpu/check_hybrid.py --dtype fp32 --seq 512 --steps 0
  part "hybrid fp32, overlapped" \
    python3 tests/gpu/check_hybrid.py --dtype fp32 --seq 512 --steps 0 --overlap
  part "hybrid fp32, overlapped, 8 hot experts" \
    python3 tests/gpu/check_hybrid.py --dtype fp32 --seq 512 --steps 0 --overlap --gpu-experts 8
  part "pytest -m gpu" \
    python3 -m pytest -c pyproject.toml --rootdir . -p no:cacheprovider -q -m gpu \
    packages/moe-experts/tests/test_loading.py packages/moe-experts/tests/test_hybrid_cuda.py
  cli=/tmp/gpu-cli
  rm -rf "$cli"
  export MOE_EXPERTS_CACHE=/tmp/gpu-cli-cache
  part "finetune --device cuda, 1 step" \
    python3 -m moe_experts.finetune --device cuda --steps 1 --batch-size 2 --seq-len 64 \
    --no-progress --output "$cli/one"
  part "finetune --device cuda --gpu-experts 4, 2 steps" \
    python3 -m moe_experts.finetune --device cuda --gpu-experts 4 --grad-accum 2 --steps 2 \
    --batch-size 4 --seq-len 64 --no-progress --output "$cli/hot"
  part "generate --device cuda" \
    python3 -c "import sys; from moe_experts.finetune.cli import main; sys.exit(main())" \
    generate --adapter "$cli/one/checkpoints" --prompt "Hello" --max-new-tokens 8 --device cuda
  part "torchrun --nproc-per-node $GPUS, NCCL" \
    python3 -m torch.distributed.run --standalone --nproc-per-node "$GPUS" \
    -m moe_experts.finetune --device cuda --steps 2 --batch-size "$((2 * GPUS))" \
    --seq-len 64 --no-progress --output "$cli/nccl"
  if [ "${1:-}" != "quick" ]; then
    part "bf16 timing, small, synchronous" \
      python3 tests/gpu/check_hybrid.py --dtype bf16 --seq 512 --steps 3
    part "bf16 timing, small, overlapped" \
      python3 tests/gpu/check_hybrid.py --dtype bf16 --seq 512 --steps 3 --overlap
    part "bf16 timing, Qwen3-30B-A3B-sized, overlapped" \
      python3 tests/gpu/check_hybrid.py --dtype bf16 --shape qwen3-30b --layers 2 --seq 2048 \
      --steps 2 --overlap
  fi
  echo "device_check status: $status"
  exit $status
} 2>&1 | tee "$log"
