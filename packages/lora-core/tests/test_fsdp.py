"""Multi-process tests of ``lora_core.fsdp``: real gloo process groups on CPU, real FSDP2.

Each scenario spawns one process per rank running ``_dist_worker.py`` as a script (so the
installed ``lora_core`` is what runs) and is shared by several tests through a module-scoped
fixture. Every spawn has a deadline: a hang kills the ranks and fails the test.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.multiprocess

WORKER = Path(__file__).with_name("_dist_worker.py")
SPAWN_DEADLINE_S = 150.0
SKIPPED = "layers.1.mlp.up_proj"
N_LORA = 2 * 6 * 2  # A and B x six targets x two blocks


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _launch(scenario: str, world: int, out: Path, *extra: str) -> list[dict[str, Any]]:
    """Run ``world`` ranks of ``scenario``; return each rank's results (fails on hang/error)."""
    out.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    procs = []
    logs = []
    for rank in range(world):
        env = dict(os.environ)
        env.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
            PYTHONWARNINGS="ignore",
        )
        if sys.platform.startswith("linux"):
            env["GLOO_SOCKET_IFNAME"] = "lo"  # loopback only, never a real interface
        log = (out / f"log{rank}.txt").open("w")
        logs.append(log)
        procs.append(
            subprocess.Popen(
                [sys.executable, str(WORKER), "--scenario", scenario, "--out", str(out), *extra],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        )
    deadline = time.monotonic() + SPAWN_DEADLINE_S
    timed_out = False
    try:
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out = True
                break
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
        for log in logs:
            log.close()
    tails = "\n".join(
        f"--- rank {r} (rc={p.returncode}) ---\n" + (out / f"log{r}.txt").read_text()[-3000:]
        for r, p in enumerate(procs)
    )
    if timed_out:
        pytest.fail(f"{scenario} x{world} did not finish in {SPAWN_DEADLINE_S}s:\n{tails}")
    if any(p.returncode != 0 for p in procs):
        pytest.fail(f"{scenario} x{world} failed:\n{tails}")
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(world)]


@pytest.fixture(scope="module")
def _fsdp_runs() -> dict[int, list[dict[str, Any]]]:
    """World size -> results, so each spawn serves every test that needs it."""
    return {}


def _fsdp(world: int, cache: dict[int, Any], factory: pytest.TempPathFactory) -> Any:
    if world not in cache:
        cache[world] = _launch("fsdp", world, factory.mktemp(f"fsdp{world}"))
    return cache[world]


@pytest.fixture(params=[2, 3], ids=["2ranks", "3ranks"])
def fsdp_run(request: pytest.FixtureRequest, _fsdp_runs, tmp_path_factory):
    """The 1-D FSDP2 scenario on 2 and 3 ranks."""
    return _fsdp(request.param, _fsdp_runs, tmp_path_factory)


@pytest.fixture
def fsdp2_run(_fsdp_runs, tmp_path_factory):
    """The 2-rank run, which also covers the native path and plain tensors."""
    return _fsdp(2, _fsdp_runs, tmp_path_factory)


@pytest.fixture(scope="module")
def hsdp_run(tmp_path_factory: pytest.TempPathFactory):
    """A 2x2 HSDP mesh on 4 ranks."""
    return _launch("hsdp", 4, tmp_path_factory.mktemp("hsdp"))


def _hand_average(runs: list[dict[str, Any]], name: str) -> torch.Tensor:
    ref = runs[0]["post_grads"][name]
    grads = [r["pre_grads"][name] for r in runs]
    return sum(torch.zeros_like(ref) if g is None else g for g in grads) / len(runs)


@pytest.mark.timeout(240)
def test_replicate_turns_lora_into_replicated_dtensors_on_fsdp_mesh(fsdp_run):
    """Every A/B is a Replicate DTensor on FSDP's mesh; a model without DTensor bases is left."""
    for r in fsdp_run:
        assert r["replicated"] == N_LORA == r["n_lora"]
        assert r["placements"] == ["(Replicate(),)"]
        assert r["mesh_reused"]
        assert r["rebound"]  # rebind_parameters points the result at the DTensor params
        assert r["replicated_again"] == N_LORA  # idempotent
        assert r["same_objects_after_again"]


@pytest.mark.timeout(240)
def test_replicate_broadcasts_from_rank0_and_warns_the_rank_that_differed(fsdp_run):
    """The last rank perturbs one adapter before replication: it is warned and overwritten."""
    world = len(fsdp_run)
    for r in fsdp_run:
        assert torch.equal(r["odd_value"], fsdp_run[0]["odd_value"])
        if r["rank"] == world - 1:
            assert len(r["odd_warnings"]) == 1
            message = r["odd_warnings"][0]
            assert f"rank {world - 1}" in message
            assert "layers.0.attn.q_proj.lora_A.weight" in message
        else:
            assert r["odd_warnings"] == []
        assert len(r["names"]) == N_LORA
        assert all(".lora_A." in n or ".lora_B." in n for n in r["names"])
        assert r["plain_model_replicated"] == 0
        assert r["plain_model_unchanged"]


@pytest.mark.timeout(240)
def test_uneven_forward_gradients_equal_hand_average(fsdp_run):
    """The last rank skips a LoRA layer; no hang, and every grad is the by-hand average."""
    world = len(fsdp_run)
    last = fsdp_run[-1]
    skipped = {f"{SKIPPED}.lora_A.weight", f"{SKIPPED}.lora_B.weight"}
    assert {n for n, g in last["pre_grads"].items() if g is None} == skipped
    assert all(g is not None for r in fsdp_run[:-1] for g in r["pre_grads"].values())
    for name in fsdp_run[0]["names"]:
        expected = _hand_average(fsdp_run, name)
        for r in fsdp_run:
            torch.testing.assert_close(r["post_grads"][name], expected, rtol=1e-6, atol=1e-7)
    # Non-trivial gradients on both A and B (the test would pass vacuously on zeros).
    assert all(g.abs().sum() > 0 for g in fsdp_run[0]["post_grads"].values())
    for name in skipped:
        # The zero-filled rank adds nothing: the average is the others' sum over world.
        others = sum(r["pre_grads"][name] for r in fsdp_run[:-1])
        torch.testing.assert_close(last["post_grads"][name], others / world)
    for r in fsdp_run:
        assert r["synced"] == N_LORA
        params, zero_filled, skipped_n, buckets, collectives = r["stats"]
        assert params == N_LORA
        assert zero_filled == (2 if r["rank"] == world - 1 else 0)
        assert skipped_n == 0
        # One fingerprint exchange plus one bucket for 24 parameters.
        assert (buckets, collectives) == (1, 2)


@pytest.mark.timeout(240)
def test_ten_steps_leave_lora_bitwise_identical_and_bases_frozen(fsdp_run):
    """After 10 AdamW steps every rank holds the same adapters, and the bases never moved."""
    ref = fsdp_run[0]["final"]
    assert set(ref) == set(fsdp_run[0]["names"])
    for r in fsdp_run[1:]:
        for name, value in ref.items():
            assert torch.equal(r["final"][name], value), name
    for r in fsdp_run:
        assert r["bases_unchanged"]
        assert len(r["base_names_unchanged"]) > N_LORA  # every frozen base tensor was checked
    # Training did move the adapters (B starts at zero).
    assert any(v.abs().sum() > 0 for n, v in ref.items() if "lora_B" in n)
    # Ranks saw different data: different losses, same adapters.
    assert fsdp_run[0]["losses"] != fsdp_run[1]["losses"]


@pytest.mark.timeout(240)
def test_fsdp_native_path_matches_replicate_path(fsdp2_run):
    """prepare_for_fsdp=True (A/B in FSDP's groups) gives the same adapters and losses."""
    for r in fsdp2_run:
        assert r["native_placements"] == ["(Shard(dim=0),)"]
        assert r["native_synced"] == 0  # FSDP reduce-scatters them; the sync must not
        assert "FSDP-native path" in r["native_replicate_error"]
        torch.testing.assert_close(
            torch.tensor(r["native_losses"]), torch.tensor(r["losses"]), rtol=1e-5, atol=1e-6
        )
        assert set(r["native_final"]) == set(r["final"])
        for name, value in r["final"].items():
            torch.testing.assert_close(r["native_final"][name], value, rtol=1e-4, atol=1e-6)


@pytest.mark.timeout(240)
def test_plain_tensors_from_adaptation_result_are_averaged_over_world(fsdp2_run):
    """moe-experts style plain buffers: averaged over WORLD, zero-filled, rank-local left."""
    r0, r1 = fsdp2_run
    for r in fsdp2_run:
        assert r["plain_synced"] == 4
        for i, post in enumerate(r["plain_post"]):
            pre = [x["plain_pre"][i] for x in fsdp2_run]
            expected = sum(torch.zeros_like(post) if g is None else g for g in pre) / 2
            torch.testing.assert_close(post, expected)
            assert torch.equal(r["tiny_bucket_post"][i], post)
        assert torch.equal(r["rank_local_after"], torch.full((4,), float(r["rank"])))
        assert r["tiny_bucket_stats"] == [4, 5]  # one bucket per tensor at bucket_bytes=1
        assert r["many_stats"] == [300, 2]  # 300 tensors, one bucket + one fingerprint
        assert r["many_value"] == 0.5
        assert r["mixed_stats"] == [2, 3]  # fp32 and bf16 buckets, plus the fingerprint
        assert r["mixed_post"][0].dtype == torch.float32
        assert r["mixed_post"][1].dtype == torch.bfloat16
        assert torch.equal(r["mixed_post"][1], torch.full((3,), 1.5, dtype=torch.bfloat16))
    assert r0["plain_pre"][2] is not None
    assert r1["plain_pre"][2] is None
    assert r0["plain_stats"] == [1, 2, 0]
    assert r1["plain_stats"] == [1, 2, 1]


@pytest.mark.timeout(240)
def test_extra_or_missing_lora_parameter_raises_naming_rank_and_parameter(fsdp_run):
    """A rank with an extra (or without a) parameter: every rank raises, none hangs."""
    world = len(fsdp_run)
    for r in fsdp_run:
        message, rank, parameter = r["mismatch"]
        assert rank == world - 1
        assert parameter == "layers.0.attn.extra_proj.lora_A.weight"
        assert f"rank {world - 1}" in message
        assert parameter in message
        message, rank, parameter = r["missing"]
        assert parameter == "layers.1.attn.v_proj.lora_B.weight"
        assert parameter in message
        if world > 2:  # a majority exists, so the odd rank 0 is named
            assert rank == 0
            assert "rank 0 lacks" in message


@pytest.mark.timeout(240)
def test_hsdp_mesh_averages_over_both_replicated_dims(hsdp_run):
    """2x2 HSDP: bases (Replicate, Shard(0)); LoRA (Replicate, Replicate) averaged over 4."""
    for r in hsdp_run:
        assert r["replicated"] == N_LORA
        assert r["base_placements"] == ["(Replicate(), Shard(dim=0))"]
        assert r["placements"] == ["(Replicate(), Replicate())"]
        # Fingerprint + one bucket reduced over each of the two mesh dims.
        assert r["stats"][3:] == [1, 3]
        assert r["bases_unchanged"]
    assert [r["coordinate"] for r in hsdp_run] == [[0, 0], [0, 1], [1, 0], [1, 1]]
    assert {n for n, g in hsdp_run[3]["pre_grads"].items() if g is None} == {
        f"{SKIPPED}.lora_A.weight",
        f"{SKIPPED}.lora_B.weight",
    }
    for name in hsdp_run[0]["names"]:
        expected = _hand_average(hsdp_run, name)
        for r in hsdp_run:
            torch.testing.assert_close(r["post_grads"][name], expected, rtol=1e-6, atol=1e-7)
    for r in hsdp_run[1:]:
        for name, value in hsdp_run[0]["final"].items():
            assert torch.equal(r["final"][name], value), name


@pytest.mark.timeout(240)
def test_hsdp_plain_tensors_use_given_group_and_skip_sharded_dtensors(hsdp_run):
    """``group=mesh['replicate']`` averages over that dim only; (Replicate, Shard) is FSDP's."""
    for r in hsdp_run:
        peers = [x["rank"] for x in hsdp_run if x["coordinate"][1] == r["coordinate"][1]]
        expected = torch.arange(5, dtype=torch.float32) * sum(p + 1 for p in peers) / len(peers)
        torch.testing.assert_close(r["sub_post"], expected)
        assert r["sub_synced"] == 1
        assert r["sub_skipped"] == 1
        assert r["sharded_grad_untouched"]


@pytest.mark.timeout(240)
def test_model_prepared_for_another_world_size_raises_naming_rank_and_parameter(tmp_path):
    """Ranks 0-1 prepare for world size 2, then meet rank 2 in a world of 3: error, no hang."""
    runs = _launch("stale", 3, tmp_path, "--port2", str(_free_port()))
    assert runs[0]["replicated"] == runs[1]["replicated"] == N_LORA
    for r in runs:
        message, rank, parameter = r["stale"]
        assert rank == 0
        assert parameter is not None
        assert parameter.endswith((".lora_A.weight", ".lora_B.weight"))
        assert parameter in message
        assert "world size 2" in message
        assert "world size 3" in message
    message, waited = runs[0]["absent"]
    assert "did not call this function" in message
    assert 2.5 < waited < 30
