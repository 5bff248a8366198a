"""load_pretrained of DeepSeek-V3-style FP8-block checkpoints: shipped bytes, dequantised oracle.

Each tiny model is saved as a FP8 checkpoint (``save_fp8_checkpoint``: every projection as
float8_e4m3fn + ``weight_scale_inv`` per 128x128 block) and, as the oracle, as a plain fp32
checkpoint of the same values dequantised here block by block, which transformers'
``from_pretrained`` loads on its own. Dims are chosen so the 128 blocks apply: I = 128, and
H = 320 for Qwen3-MoE (a partial 64-column block) or 256 for DeepSeek-V3 (whose small MLA
projections are partial blocks) and Lara-Mini (whose FP8 ``linear_attn.in_proj`` is dequantised,
then split as transformers splits it).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from lora_core import LoraConfig
from moe_experts import KernelExperts, LoadError, adapt, is_placeholder, load_pretrained, wrap
from moe_experts.architectures import checkpoint_model_type
from moe_experts.testing import save_fp8_checkpoint, tiny_config

from .conftest import token_batch

SHAPES = {
    "deepseek_v3": {"hidden_size": 256, "moe_intermediate_size": 128, "intermediate_size": 256},
    "qwen3_moe": {"hidden_size": 320, "moe_intermediate_size": 128},
    # Its hub layout's fused linear_attn.in_proj ships FP8 too: dequantised, then split.
    "lara_mini": {"hidden_size": 256, "moe_intermediate_size": 128},
    # Fused in their bf16 releases, per expert in their FP8 ones; transformers converts the
    # per-expert keys of Qwen3.5-MoE but has no converter for Qwen3-VL-MoE's.
    "qwen3_5_moe": {"hidden_size": 320, "moe_intermediate_size": 128},
    "qwen3_vl_moe": {"hidden_size": 320, "moe_intermediate_size": 128},
}
CASES = [
    ("deepseek_v3", "per_expert"),
    ("qwen3_moe", "per_expert"),
    ("qwen3_moe", "fused"),
    ("lara_mini", "per_expert"),
    ("qwen3_5_moe", "unstacked"),
    ("qwen3_vl_moe", "unstacked"),
]
# A per-expert expert weight: (experts module, expert, projection).
_UNSTACKED = re.compile(r"^(.*\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
WORKER = Path(__file__).with_name("fp8_memory_worker.py")


def _dequantize(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """fp32 ``w * s`` one 128x128 block at a time (an oracle independent of kt-kernel's)."""
    out = w.to(torch.float32)
    n, k = w.shape[-2:]
    for i in range((n + 127) // 128):
        for j in range((k + 127) // 128):
            out[..., i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128] *= s[..., i, j, None, None]
    return out


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for shard in sorted(path.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118 (not a dict)
    return out


def _restacked(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert expert weights stacked back into the model's fused ``gate_up [E, 2I, H]`` and
    ``down [E, H, I]``, which ``from_pretrained`` reads for every family."""
    out, groups = {}, {}
    for key, t in tensors.items():
        m = _UNSTACKED.match(key)
        if m is None:
            out[key] = t
        else:
            groups.setdefault(m.group(1), {})[(int(m.group(2)), m.group(3))] = t
    for name, g in groups.items():
        e = range(1 + max(x for x, _ in g))
        gate_up = [torch.cat([g[x, "gate"], g[x, "up"]]) for x in e]
        out[f"{name}.gate_up_proj"] = torch.stack(gate_up)
        out[f"{name}.down_proj"] = torch.stack([g[x, "down"] for x in e])
    return out


def _dequantized_copy(src: Path, dst: Path, restack: bool = False) -> Path:
    """``src`` as a plain fp32 checkpoint: FP8 weights times their scales, scales dropped;
    ``restack``: per-expert expert weights fused again (see :func:`_restacked`)."""
    dst.mkdir()
    tensors = _tensors(src)
    plain = {
        k: _dequantize(t, tensors[k + "_scale_inv"]) if k + "_scale_inv" in tensors else t
        for k, t in tensors.items()
        if not k.endswith("_scale_inv")
    }
    if restack:
        plain = _restacked(plain)
    save_file(plain, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    del config["quantization_config"]
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], tuple[Path, Path]]:
    """``(family, layout) -> (FP8 checkpoint, dequantised fp32 checkpoint)``."""
    out = {}
    for family, layout in CASES:
        torch.manual_seed(1234)
        model = _auto(tiny_config(family).model_type).from_config(
            tiny_config(family, **SHAPES[family])
        )
        root = tmp_path_factory.mktemp(f"fp8-{family}-{layout}")
        fp8 = save_fp8_checkpoint(
            model,
            root / "fp8",
            per_expert=layout == "per_expert",
            unstacked=layout == "unstacked",
            max_shard_size="200KB",
        )
        plain = _dequantized_copy(fp8, root / "plain", restack=layout == "unstacked")
        out[(family, layout)] = (fp8, plain)
    return out


def _kernels(model) -> dict[str, KernelExperts]:
    return {n: m for n, m in model.named_modules() if isinstance(m, KernelExperts)}


def _auto(model_type: str) -> type:
    """The auto class transformers builds this model type with (Qwen3-VL-MoE: image-text)."""
    causal = model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    return AutoModelForCausalLM if causal else AutoModelForImageTextToText


def _from_pretrained(path: Path, dtype: torch.dtype):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        auto = _auto(checkpoint_model_type(path))
        return auto.from_pretrained(path, dtype=dtype).eval()


@pytest.mark.parametrize(("family", "layout"), CASES)
def test_kernel_storage_is_the_checkpoint_bytes(ckpts, family: str, layout: str) -> None:
    fp8, _ = ckpts[(family, layout)]
    model = load_pretrained(fp8)  # default: keep FP8
    tensors = _tensors(fp8)
    kernels = _kernels(model)
    assert len(kernels) == 2  # DeepSeek-V3's first layer is dense
    for name, kernel in kernels.items():
        weights = kernel.expert_weights
        assert weights.weight_dtype == "fp8"
        (gu_w, gu_s), (dn_w, dn_s) = weights.storage
        inter = weights.spec.intermediate_size
        if f"{name}.gate_up_proj" in tensors:  # fused: also Lara-Mini's hub ("per_expert") layout
            want = [(gu_w, f"{name}.gate_up_proj"), (dn_w, f"{name}.down_proj")]
            scales = [
                (gu_s, f"{name}.gate_up_proj_scale_inv"),
                (dn_s, f"{name}.down_proj_scale_inv"),
            ]
        else:
            want, scales = [], []
            for e in range(weights.spec.num_experts):
                pre = f"{name}.{e}"
                want += [
                    (gu_w[e, :inter], f"{pre}.gate_proj.weight"),
                    (gu_w[e, inter:], f"{pre}.up_proj.weight"),
                    (dn_w[e], f"{pre}.down_proj.weight"),
                ]
                scales += [
                    (gu_s[e, :1], f"{pre}.gate_proj.weight_scale_inv"),
                    (gu_s[e, 1:], f"{pre}.up_proj.weight_scale_inv"),
                    (dn_s[e], f"{pre}.down_proj.weight_scale_inv"),
                ]
        for have, key in want:
            assert tensors[key].dtype == torch.float8_e4m3fn
            assert torch.equal(have.view(torch.uint8), tensors[key].view(torch.uint8)), key
        for have, key in scales:
            assert torch.equal(have, tensors[key]), key
        # FP8 bytes plus fp32 scales only: no bf16 copy is held beside them.
        assert weights.nbytes == sum(t.nbytes for t in (gu_w, gu_s, dn_w, dn_s))
        assert weights.nbytes < 0.51 * 2 * (gu_w.numel() + dn_w.numel())


@pytest.mark.parametrize(("family", "layout"), CASES)
def test_logits_match_the_dequantised_model_run_densely(ckpts, family: str, layout: str) -> None:
    fp8, plain = ckpts[(family, layout)]
    ref = _from_pretrained(plain, torch.float32)  # transformers' own experts, fp32
    got = load_pretrained(fp8, dtype=torch.float32)  # FP8 experts computing in bf16
    assert "quantization_config" not in got.config.to_dict()
    ref_sd = ref.state_dict()
    for name, have in got.state_dict().items():
        if not is_placeholder(have):  # dense FP8 weights: dequantised exactly as the oracle
            assert torch.equal(have, ref_sd[name]), name
    ids = token_batch()
    with torch.no_grad():
        want, have = ref(ids).logits, got(ids).logits
    assert have.dtype == torch.float32
    # Only the experts compute in bf16 (x and the weight tiles rounded once): bf16 tolerance
    # against the fp32 oracle (measured 0.5-0.9%; a whole bf16 model is 2-31% off here).
    rel = float((have - want).norm() / want.norm())
    assert 0 < rel < 2e-2, rel
    _own(ref)
    wrap(ref, weight_dtype="bf16")
    ops = torch.ops.kt_kernel
    rows = int(ops.gemv_rows())
    try:
        # Tile + GEMM: exactly the dense-bf16 kernel on the dequantised weights (the FP8 tiles
        # are those values rounded once to bf16, as wrap stores them; the same GEMM).
        ops.set_gemv_rows(0)
        with torch.no_grad():
            assert torch.equal(got(ids).logits, ref(ids).logits)
        # The small-row product (few rows per expert here; bf16 on AVX512_BF16) sums the same
        # exact bf16 products in fp32 in another order than the GEMM (kt-kernel's test_gemv
        # checks that order bitwise), so an expert output may differ by a bf16 rounding:
        # within 2^-8 (measured 5e-4 on DeepSeek-V3, 0 on Qwen3-MoE).
        ops.set_gemv_rows(rows)
        with torch.no_grad():
            have, dense = got(ids).logits, ref(ids).logits
        assert float((have - dense).norm() / dense.norm()) < 2**-8
    finally:
        ops.set_gemv_rows(rows)


def _own(model) -> None:
    """Give every dense parameter aligned memory of its own (see test_loading._reference)."""
    with torch.no_grad():
        for p in model.parameters():
            if not is_placeholder(p):
                p.data = p.data.clone()


@pytest.mark.parametrize(("family", "layout"), CASES)
def test_bf16_dequantises_like_from_pretrained_and_wrap(ckpts, family: str, layout: str) -> None:
    fp8, plain = ckpts[(family, layout)]
    ref = _from_pretrained(plain, torch.bfloat16)
    wrap(ref, weight_dtype="bf16")
    _own(ref)
    got = load_pretrained(fp8, weight_dtype="bf16", dtype=torch.bfloat16)
    for name, want in _kernels(ref).items():
        have = _kernels(got)[name].expert_weights
        assert have.weight_dtype == "bf16"
        assert torch.equal(have.gate_up, want.expert_weights.gate_up), name
        assert torch.equal(have.down, want.expert_weights.down), name
    ids = token_batch()
    with torch.no_grad():
        assert torch.equal(got(ids).logits, ref(ids).logits)


@pytest.mark.parametrize("weight_dtype", ["int4", "fp8"])
def test_plain_checkpoint_quantises_like_wrap(ckpts, weight_dtype: str) -> None:
    _, plain = ckpts[("qwen3_moe", "per_expert")]
    ref = _from_pretrained(plain, torch.bfloat16)
    wrap(ref, weight_dtype=weight_dtype)  # type: ignore[arg-type]
    got = load_pretrained(plain, weight_dtype=weight_dtype)  # type: ignore[arg-type]
    for name, want in _kernels(ref).items():
        have = _kernels(got)[name].expert_weights
        assert have.weight_dtype == weight_dtype
        for a, b in zip(have.storage, want.expert_weights.storage, strict=True):
            assert all(
                torch.equal(x.view(torch.uint8), y.view(torch.uint8))
                for x, y in zip(a, b, strict=True)
            )


def test_lora_finetune_on_fp8_experts(ckpts) -> None:
    fp8, _ = ckpts[("deepseek_v3", "per_expert")]
    model = load_pretrained(fp8)
    for p in model.parameters():
        p.requires_grad_(False)
    result = adapt(model, LoraConfig(enable=True, rank=8, alpha=16, init_seed=5))
    params = list(result.parameters())
    opt = torch.optim.AdamW(params, lr=3e-3)
    ids = torch.randint(
        0, model.config.vocab_size, (4, 32), generator=torch.Generator().manual_seed(3)
    )
    model.train()
    losses = []
    for _ in range(12):
        opt.zero_grad()
        loss = model(ids, labels=ids).loss
        loss.backward()
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in params)
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.9 * losses[0], losses
    for kernel in _kernels(model).values():  # the frozen base stayed FP8
        assert kernel.expert_weights.weight_dtype == "fp8"


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
@pytest.mark.parametrize("weight_dtype", ["fp8", "bf16"])
def test_peak_memory_never_holds_a_bf16_copy(tmp_path_factory, weight_dtype: str) -> None:
    root = tmp_path_factory.getbasetemp() / "fp8-memory"
    if not (root / "ck").exists():
        root.mkdir(exist_ok=True)
        subprocess.run(
            [sys.executable, str(WORKER), "save", str(root / "ck")],
            check=True,
            capture_output=True,
            timeout=600,
        )
    out = subprocess.run(
        [sys.executable, str(WORKER), "load", str(root / "ck"), weight_dtype],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    m = json.loads(out.stdout.strip().splitlines()[-1])
    mib = 2**20
    final = m["rss"] - m["base"]
    footprint = (m["kernel"] + m["dense"]) / mib
    transient = m["peak"] - m["rss"]
    assert m["weight_dtype"] == weight_dtype
    # What stays is the kernel's storage and the dense weights, nothing else...
    assert abs(final - footprint) <= 0.05 * footprint, m
    # ...and on the way there (measured +10 MiB) less than one layer's experts in bf16 (4 layers
    # here) was ever resident beyond it: neither the experts nor one block of them in bf16.
    assert transient < m["layer_bf16"] / mib, m


def _rewrite(path: Path, key: str, new: torch.Tensor | None) -> str:
    """Replace (``None``: drop) ``key`` in its shard; return the shard's file name."""
    index_file = path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    shard = index["weight_map"][key]
    with safe_open(str(path / shard), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (not a dict)
    if new is None:
        del tensors[key], index["weight_map"][key]
        index_file.write_text(json.dumps(index))
    else:
        tensors[key] = new
    save_file(tensors, str(path / shard), metadata={"format": "pt"})
    return shard


@pytest.fixture
def fp8_copy(ckpts, tmp_path: Path):
    def make(family: str = "deepseek_v3", layout: str = "per_expert") -> Path:
        return Path(shutil.copytree(ckpts[(family, layout)][0], tmp_path / f"{family}-{layout}"))

    return make


def _config(path: Path, **quant) -> None:
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"].update(quant)
    (path / "config.json").write_text(json.dumps(config))


EXPERT = "model.layers.1.mlp.experts.3.up_proj.weight"
DENSE = "model.layers.0.self_attn.q_b_proj.weight"


@pytest.mark.parametrize("key", [EXPERT, DENSE])
def test_missing_scale_inv_names_key_and_file(fp8_copy, key: str) -> None:
    path = fp8_copy()
    shard = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"][key]
    _rewrite(path, key + "_scale_inv", None)
    with pytest.raises(LoadError, match=rf"{shard}: tensor '{key}' is float8_e4m3fn but .* no"):
        load_pretrained(path)


@pytest.mark.parametrize("key", [EXPERT, DENSE])
def test_scale_shape_mismatch_names_key_and_file(fp8_copy, key: str) -> None:
    path = fp8_copy()
    scale = key + "_scale_inv"
    shard = _rewrite(path, scale, torch.ones(4, 4))  # a 64x64-block grid
    with pytest.raises(LoadError, match=rf"{shard}: .*'{scale}'.*\[4, 4\]"):
        load_pretrained(path)


def test_bad_configs_and_weight_dtypes(fp8_copy) -> None:
    path = fp8_copy()
    with pytest.raises(LoadError, match=r"config\.json: the checkpoint's experts are FP8.*int8"):
        load_pretrained(path, weight_dtype="int8")
    _config(path, weight_block_size=[64, 64])
    with pytest.raises(LoadError, match=r"config\.json: quantization_config\.weight_block_size"):
        load_pretrained(path)
    _config(path, weight_block_size=[128, 128], quant_method="gptq")
    with pytest.raises(LoadError, match=r"quant_method is 'gptq'"):
        load_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    del config["quantization_config"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(LoadError, match=r"_scale_inv' is a fp8 checkpoint part, but config\.json"):
        load_pretrained(path)


def test_wrong_expert_dtype_and_corrupt_bytes(fp8_copy) -> None:
    path = fp8_copy()
    _rewrite(path, EXPERT, torch.zeros(128, 256, dtype=torch.bfloat16))
    with pytest.raises(LoadError, match=rf"tensor '{EXPERT}' is torch\.bfloat16"):
        load_pretrained(path)
    path = fp8_copy("qwen3_moe", "fused")
    key = "model.layers.0.mlp.experts.down_proj"
    nan = torch.full((8, 320, 128), float("nan")).to(torch.float8_e4m3fn)
    _rewrite(path, key, nan)
    with pytest.raises(LoadError, match=rf"does not fit '{key}'.*NaN"):
        load_pretrained(path)


def test_partial_intermediate_blocks_need_dequantising(tmp_path: Path) -> None:
    torch.manual_seed(7)
    config = tiny_config("qwen3_moe", hidden_size=128, moe_intermediate_size=64)
    fp8 = save_fp8_checkpoint(AutoModelForCausalLM.from_config(config), tmp_path / "fp8")
    with pytest.raises(
        LoadError, match=r"experts: the fp8 experts of qwen3_moe cannot be kept .* I = 64"
    ):
        load_pretrained(fp8)
    got = load_pretrained(fp8, weight_dtype="bf16")
    ref = _from_pretrained(_dequantized_copy(fp8, tmp_path / "plain"), torch.bfloat16)
    wrap(ref, weight_dtype="bf16")
    for name, want in _kernels(ref).items():
        have = _kernels(got)[name].expert_weights
        assert torch.equal(have.gate_up, want.expert_weights.gate_up), name
        assert torch.equal(have.down, want.expert_weights.down), name


# Qwen3-MoE experts in whole 128x128 blocks (H = I = 256) and in partial ones (H = 320: every
# gate/up row ends in a 64-column block, every down tensor in 64 rows), as an independent check
# measured them (4.2e-4 apart at H = 320, I = 128).
BLOCKS = {
    "whole": {"hidden_size": 256, "moe_intermediate_size": 256},
    "partial": {"hidden_size": 320, "moe_intermediate_size": 128},
}


@pytest.mark.parametrize("blocks", BLOCKS)
def test_fp8_against_bf16_wrap_depends_on_the_kernel_path_not_the_blocks(
    tmp_path: Path, blocks: str
) -> None:
    torch.manual_seed(1234)
    config = tiny_config("qwen3_moe", **BLOCKS[blocks])
    fp8 = save_fp8_checkpoint(AutoModelForCausalLM.from_config(config), tmp_path / "fp8")
    got = load_pretrained(fp8, dtype=torch.float32)
    ref = _from_pretrained(_dequantized_copy(fp8, tmp_path / "plain"), torch.float32)
    _own(ref)
    wrap(ref, weight_dtype="bf16")
    ids = token_batch(seq=64)  # 128 tokens: some experts get more than gemv_rows, some fewer
    ops = torch.ops.kt_kernel
    rows = int(ops.gemv_rows())
    try:
        # Tile + GEMM for every expert: bitwise, whole blocks or partial.
        ops.set_gemv_rows(0)
        with torch.no_grad():
            assert torch.equal(got(ids).logits, ref(ids).logits)
        # An expert given at most gemv_rows rows takes FP8's small-row product on AVX512_BF16
        # (dense bf16 has none), the same exact bf16 products summed in fp32 in another order:
        # up to a bf16 rounding of an expert output. Measured 6e-6 (whole) and 1.3e-3 (partial)
        # here, 0 for both with 2 x 9 tokens: the rows each expert gets decide it, not the blocks.
        ops.set_gemv_rows(rows)
        with torch.no_grad():
            have, dense = got(ids).logits, ref(ids).logits
        assert float((have - dense).norm() / dense.norm()) < 2**-8
    finally:
        ops.set_gemv_rows(rows)
