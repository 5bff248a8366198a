# Sourced by device_check.sh and device_bench.sh (from the repository root): a bare CUDA machine
# with python3 and a CUDA torch but none of our packages. Installs wheels of missing or too-old
# Python packages from .whl/ (into /tmp/site), points PYTHONPATH at the source tree (plus a
# minimal dist-info per package, which importlib.metadata needs for the manifests' producer
# versions) and builds kt-kernel's extension in place against this torch. Prints what it found.
export PYTHONUNBUFFERED=1 KT_KERNEL_REQUIRE_NATIVE=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
export GPUS
echo "cpus: $(nproc), gpus: $GPUS"
site=""
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && site=/tmp/site:
fi
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
for opt in peft accelerate safetensors pydantic yaml tqdm; do
  python3 -c "import $opt" 2>/dev/null && echo "have $opt" || echo "missing $opt (wheel in .whl/ to add it)"
done
start=$SECONDS
(cd packages/kt-kernel && MAX_JOBS=$(nproc) python3 setup.py -q build_ext --inplace 2>&1 | grep -E "error|Error" | head -20)
echo "kt-kernel extension built in $((SECONDS - start)) s"
python3 -c "import kt_kernel; print(kt_kernel.backend_info())" || exit 2
