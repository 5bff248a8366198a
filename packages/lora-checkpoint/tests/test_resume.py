"""Resume: n steps == k steps, save, new process, load, n-k steps (bitwise, CPU, AdamW)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import lora_checkpoint as lc

SCRIPT = Path(__file__).parent / "scripts" / "resume_train.py"
N, K = 12, 5


def _script():
    spec = importlib.util.spec_from_file_location("resume_train", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.timeout(120)
def test_resume_in_new_process_is_bitwise_identical(tmp_path):
    rt = _script()
    model, result, opt = rt.build()
    rt.seed_fresh_run()
    rt.train(model, opt, 0, N)
    reference = rt.adapter_tensors(result)

    model, result, opt = rt.build()
    rt.seed_fresh_run()
    rt.train(model, opt, 0, K)
    at_k = rt.adapter_tensors(result)
    state = lc.TrainingState.capture(opt, result, step=K, data_position={"batch": K})
    lc.save(tmp_path / "ckpt", result, training_state=state)

    out = tmp_path / "resumed.safetensors"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "resume", str(tmp_path / "ckpt"), str(N), str(out)],
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
        env={"OMP_NUM_THREADS": "1", **__import__("os").environ},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed = load_file(out)
    assert set(resumed) == set(reference)
    for n, ref in reference.items():
        assert not torch.equal(ref, at_k[n]), f"{n} did not train after step {K}"
        assert torch.equal(resumed[n], ref), f"{n} differs after resume"


def test_resume_without_rng_diverges(tmp_path):
    """The RNG state matters: restoring only weights and optimizer gives other numbers."""
    rt = _script()
    model, result, opt = rt.build()
    rt.seed_fresh_run()
    rt.train(model, opt, 0, N)
    reference = rt.adapter_tensors(result)

    model, result, opt = rt.build()
    rt.seed_fresh_run()
    rt.train(model, opt, 0, K)
    lc.save(
        tmp_path, result, training_state=lc.TrainingState.capture(opt, result, step=K, rng=False)
    )
    model, result, opt = rt.build()
    loaded = lc.load(tmp_path)
    lc.restore(result, loaded)
    loaded.training_state.apply(opt, result)
    rt.seed_fresh_run()
    rt.train(model, opt, K, N)
    assert any(not torch.equal(p, reference[n]) for n, p in result.named_optimizer_parameters)
