"""Deterministic initialisation: values depend only on (seed, name, shape)."""

from __future__ import annotations

import hashlib
import math
import os
import subprocess
import sys

import pytest
import torch

from lora_core import init_lora_tensor
from lora_core.initialization import lora_generator_seed

NAMES = [
    "model.layers.0.self_attn.q_proj.lora_A",
    "model.layers.0.self_attn.v_proj.lora_A",
    "model.layers.1.self_attn.q_proj.lora_A",
    "model.layers.3.mlp.experts.gate.lora_A",
]


def _digest(seed: int) -> str:
    h = hashlib.sha256()
    for name in NAMES:
        for shape in ((4, 16), (3, 4, 16)):
            h.update(init_lora_tensor(name, shape, torch.float32, seed=seed).numpy().tobytes())
    return h.hexdigest()


def test_a_is_uniform_within_kaiming_a_sqrt5_bounds() -> None:
    t = init_lora_tensor("x.lora_A", (64, 256), torch.float32, seed=0)
    bound = 1.0 / math.sqrt(256)
    assert t.dtype == torch.float32
    assert t.shape == (64, 256)
    assert t.abs().max().item() <= bound
    # kaiming_uniform_(a=sqrt(5)) on an [r, in] weight has the same bound.
    ref = torch.empty(64, 256)
    torch.nn.init.kaiming_uniform_(ref, a=math.sqrt(5))
    assert ref.abs().max().item() <= bound
    # A uniform distribution on [-b, b] has mean 0 and std b/sqrt(3).
    assert abs(t.mean().item()) < 0.05 * bound
    assert t.std().item() == pytest.approx(bound / math.sqrt(3), rel=0.02)


def test_fan_in_is_last_dim_for_per_expert_a() -> None:
    t = init_lora_tensor("m.experts.gate.lora_A", (8, 4, 100), torch.float32, seed=1)
    assert t.abs().max().item() <= 0.1
    assert t.abs().max().item() > 0.09


def test_b_is_zeros_in_requested_dtype() -> None:
    t = init_lora_tensor("x.lora_B", (16, 4), torch.bfloat16, seed=3)
    assert t.dtype == torch.bfloat16
    assert torch.equal(t, torch.zeros(16, 4, dtype=torch.bfloat16))


def test_cast_happens_after_float32_draw() -> None:
    f32 = init_lora_tensor("x.lora_A", (4, 8), torch.float32, seed=5)
    bf16 = init_lora_tensor("x.lora_A", (4, 8), torch.bfloat16, seed=5)
    assert torch.equal(bf16, f32.to(torch.bfloat16))


def test_pure_function_of_seed_name_shape() -> None:
    a = init_lora_tensor(NAMES[0], (4, 16), torch.float32, seed=0)
    torch.manual_seed(1234)  # global RNG state must not matter
    torch.rand(10)
    assert torch.equal(a, init_lora_tensor(NAMES[0], (4, 16), torch.float32, seed=0))
    assert not torch.equal(a, init_lora_tensor(NAMES[1], (4, 16), torch.float32, seed=0))
    assert not torch.equal(a, init_lora_tensor(NAMES[0], (4, 16), torch.float32, seed=1))


def test_generator_seed_is_stable_hash() -> None:
    # Pinned: changing the hash would silently change every adapter ever initialised.
    digest = hashlib.blake2b(b"a.lora_A", digest_size=8).digest()
    assert lora_generator_seed("a.lora_A", 3) == (3 + int.from_bytes(digest, "little")) % 2**32
    assert 0 <= lora_generator_seed("a.lora_A", -5) < 2**32


def test_thread_count_does_not_matter() -> None:
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = init_lora_tensor("x.lora_A", (64, 512), torch.float32, seed=0)
        torch.set_num_threads(2)
        two = init_lora_tensor("x.lora_A", (64, 512), torch.float32, seed=0)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


@pytest.mark.timeout(120)
def test_same_bytes_in_a_separate_process() -> None:
    code = (
        "import hashlib, torch\n"
        "torch.set_num_threads(1)\n"
        "torch.manual_seed(999)\n"
        "from lora_core import init_lora_tensor\n"
        f"names = {NAMES!r}\n"
        "names = list(reversed(names))\n"
        "vals = {n: {s: init_lora_tensor(n, s, torch.float32, seed=11).numpy().tobytes()\n"
        "        for s in ((4, 16), (3, 4, 16))} for n in names}\n"
        "h = hashlib.sha256()\n"
        f"for n in {NAMES!r}:\n"
        "    for s in ((4, 16), (3, 4, 16)):\n"
        "        h.update(vals[n][s])\n"
        "print(h.hexdigest())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        timeout=100,
        env={**os.environ, "PYTHONHASHSEED": "12345", "OMP_NUM_THREADS": "1"},
    )
    assert out.stdout.strip() == _digest(11)


@pytest.mark.parametrize(
    "name", ["x.lora_A.weight", "x.lora_C", "x_lora_A", "lora_Ax", "x.weight", ""]
)
def test_other_names_refused(name: str) -> None:
    with pytest.raises(ValueError, match=r"must end with '\.lora_A' or '\.lora_B'"):
        init_lora_tensor(name, (2, 2), torch.float32, seed=0)


def test_weight_suffix_gets_a_hint() -> None:
    with pytest.raises(ValueError, match=r"drop the trailing '\.weight'"):
        init_lora_tensor("q.lora_A.weight", (2, 2), torch.float32, seed=0)


def test_root_level_names_allowed() -> None:
    assert init_lora_tensor("lora_B", (2, 3), torch.float32, seed=0).shape == (2, 3)
    assert init_lora_tensor("lora_A", (2, 3), torch.float32, seed=0).abs().sum() > 0


@pytest.mark.parametrize("shape", [(), (0, 4), (4, 0), (2, -1)])
def test_bad_shapes_refused(shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match=r"shape for 'x\.lora_A' must be"):
        init_lora_tensor("x.lora_A", shape, torch.float32, seed=0)


def test_bad_dtype_and_seed_refused() -> None:
    with pytest.raises(ValueError, match=r"dtype .* floating-point"):
        init_lora_tensor("x.lora_A", (2, 2), torch.int64, seed=0)
    with pytest.raises(TypeError, match=r"seed must be an int"):
        init_lora_tensor("x.lora_A", (2, 2), torch.float32, seed=1.0)  # type: ignore[arg-type]
