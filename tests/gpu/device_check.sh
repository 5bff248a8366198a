#!/usr/bin/env bash
# Every GPU check in one run, for a CUDA machine that has python3 with a CUDA torch but none of
# our packages: builds kt-kernel's extension in place against that torch, then runs the hybrid
# step comparison (fp32, tight), the tests marked `gpu`, and bf16 timings (small and
# Qwen3-30B-A3B-sized); `device_check.sh quick` skips the timings.
# Wheels of missing or too-old Python packages may lie in .whl/ (installed into /tmp/site).
# Results go to stdout and, where $OUT is set, to $OUT/gpu_check.log.
set -uo pipefail
cd "$(dirname "$0")/../.."
log=${OUT:-/tmp}/gpu_check.log
export PYTHONUNBUFFERED=1 KT_KERNEL_REQUIRE_NATIVE=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  echo "cpus: $(nproc)"
  site=""
  if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl && site=/tmp/site:
  fi
  # Run from the source tree; a minimal dist-info per package is what importlib.metadata
  # (the manifests' producer versions) needs.
  mkdir -p /tmp/meta
  for pkg in lora-core kt-kernel moe-experts lora-checkpoint; do
    mod=${pkg//-/_}
    ver=$(sed -n 's/^__version__ = "\(.*\)"/\1/p' "packages/$pkg/src/$mod/_version.py")
    mkdir -p "/tmp/meta/$mod-$ver.dist-info"
    printf 'Metadata-Version: 2.1\nName: %s\nVersion: %s\n' "$pkg" "$ver" \
      > "/tmp/meta/$mod-$ver.dist-info/METADATA"
  done
  export PYTHONPATH="${site}packages/lora-core/src:packages/kt-kernel/src:packages/moe-experts/src:packages/lora-checkpoint/src:/tmp/meta"
  python3 -c "import importlib.metadata as m; print({p: m.version(p) for p in ('lora-core', 'kt-kernel', 'moe-experts', 'lora-checkpoint')})"
  python3 -c "import sys, torch, transformers; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"
  start=$SECONDS
  (cd packages/kt-kernel && MAX_JOBS=$(nproc) python3 setup.py -q build_ext --inplace 2>&1 | grep -E "error|Error" | head -20)
  echo "kt-kernel extension built in $((SECONDS - start)) s"
  python3 -c "import kt_kernel; print(kt_kernel.backend_info())" || exit 2
  status=0
  # Correctness in fp32 (both sides differ only in summation order), then speed in bf16.
  python3 tests/gpu/check_hybrid.py --dtype fp32 --seq 512 --steps 0 || status=1
  python3 -m pytest -c pyproject.toml --rootdir . -p no:cacheprovider -q -m gpu \
    packages/moe-experts/tests/test_loading.py || status=1
  if [ "${1:-}" != "quick" ]; then
    python3 tests/gpu/check_hybrid.py --dtype bf16 --seq 512 --steps 3 || status=1
    python3 tests/gpu/check_hybrid.py --dtype bf16 --shape qwen3-30b --layers 2 --seq 2048 \
      --steps 2 || status=1
  fi
  echo "device_check status: $status"
  exit $status
} 2>&1 | tee "$log"
