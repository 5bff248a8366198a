"""Bad inputs and hostile files: one CheckpointError naming the file, never a raw exception,
never a temp directory left behind, never the contents of a file outside the root."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from blake3 import blake3

import lora_checkpoint as lc
from lora_checkpoint import cli
from lora_core.contracts import AdaptationResult, ComponentVersion

DEEP = 100_000  # far past Python's recursion limit


def _leftovers(root):
    return [p.name for p in root.iterdir() if p.name.startswith((".tmp-", ".trash-"))]


def _one_error_line(capsys, code):
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == cli.EXIT_FAILED, err
    assert len(lines) == 1, err
    assert lines[0].startswith("lora-checkpoint: error: "), err
    assert "Traceback" not in err
    return lines[0]


def _plain_result(params):
    return AdaptationResult.create(
        adapted_layers=["x"],
        named_optimizer_parameters=[(n, torch.nn.Parameter(t)) for n, t in params],
        ownership={n: "replicated" for n, _ in params},
        producer=ComponentVersion("lora-core", "0.1.0"),
    )


def _rewrite(ckpt, file, data):
    # Replace a file and record its new size and digest, so only its content is hostile.
    (ckpt / file).write_bytes(data)
    raw = json.loads((ckpt / "manifest.json").read_text())
    for f in raw["files"]:
        if f["file"] == file:
            f["size"], f["digest"] = len(data), blake3(data).hexdigest()
    (ckpt / "manifest.json").write_text(json.dumps(raw))


def _safetensors(header: dict, data: bytes = b"") -> bytes:
    hjson = json.dumps(header).encode()
    return struct.pack("<Q", len(hjson)) + hjson + data


# -- non-finite tensors -------------------------------------------------------------------


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_save_refuses_non_finite_parameter_naming_it(tmp_path, bad):
    result = _plain_result([("ok.weight", torch.ones(3)), ("bad.weight", torch.tensor([1, bad]))])
    with pytest.raises(lc.NonFiniteTensorError, match=r"'bad.weight'") as info:
        lc.save(tmp_path, result, step=1)
    assert "allow_non_finite" in str(info.value)
    assert [t.name for t in info.value.tensors] == ["bad.weight"]
    assert sorted(os.listdir(tmp_path)) == []  # refused before anything was written


def test_save_refuses_non_finite_optimizer_state(tmp_path, result):
    opt = torch.optim.Adam(result.parameters(), lr=0.1)
    for p in result.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    opt.state[result.named_optimizer_parameters[1][1]]["exp_avg"][0, 0] = float("nan")
    state = lc.TrainingState.capture(opt, result, step=1)
    name = result.named_optimizer_parameters[1][0]
    with pytest.raises(lc.NonFiniteTensorError, match=rf"optimizer state '{name}'\['exp_avg'\]"):
        lc.save(tmp_path, result, training_state=state)
    assert _leftovers(tmp_path) == []
    assert not (tmp_path / "latest").exists()


def test_allow_non_finite_then_verify_and_inspect_report_it(tmp_path, capsys):
    values = torch.tensor([1.0, float("nan"), float("inf"), float("nan")])
    result = _plain_result([("ok.weight", torch.ones(3)), ("bad.weight", values)])
    m = lc.save(tmp_path, result, step=1, allow_non_finite=True)
    loaded = lc.load(tmp_path)
    assert torch.equal(loaded.tensors["bad.weight"].isnan(), values.isnan())
    with pytest.raises(lc.NonFiniteTensorError, match=r"'bad.weight' in fused") as info:
        lc.verify(tmp_path)
    (found,) = info.value.tensors
    assert (found.name, found.nan, found.inf) == ("bad.weight", 2, 1)
    assert lc.verify(tmp_path, allow_non_finite=True).name == m.name
    report = lc.inspect(tmp_path)
    assert [(f.name, f.nan, f.inf) for f in report.non_finite] == [("bad.weight", 2, 1)]
    assert lc.inspect(tmp_path).manifest == m

    line = _one_error_line(capsys, cli.main(["verify", str(tmp_path)]))
    assert "NonFiniteTensorError" in line
    assert "bad.weight" in line
    assert cli.main(["verify", "--allow-non-finite", str(tmp_path)]) == cli.EXIT_OK
    assert "'bad.weight' in fused_expert_lora.safetensors: 2 NaN, 1 Inf" in capsys.readouterr().out
    assert cli.main(["inspect", str(tmp_path)]) == cli.EXIT_OK
    out = capsys.readouterr().out
    assert "non-finite tensors: 1" in out
    assert "2 NaN, 1 Inf" in out
    assert cli.main(["inspect", "--json", str(tmp_path)]) == cli.EXIT_OK
    captured = capsys.readouterr()
    assert json.loads(captured.out)["name"] == m.name
    assert "bad.weight" in captured.err


def test_finite_checkpoint_reports_none(tmp_path, result, capsys):
    lc.save(tmp_path, result, step=1)
    assert lc.inspect(tmp_path).non_finite == ()
    assert cli.main(["inspect", str(tmp_path)]) == cli.EXIT_OK
    assert "non-finite tensors: none" in capsys.readouterr().out


# -- names ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        "step-1 ",
        " step-1",
        "step 1",
        "step\t1",
        "step-1\n",
        "a\x00b",
        "a\x1bb",
        "x" * 201,
        "é" * 101,
        "step\u200b1",
        ".hidden",
        "a/b",
        "latest",
        ".lock",
        "",
    ],
)
def test_bad_checkpoint_names_refused_at_save(tmp_path, result, name):
    with pytest.raises(lc.CheckpointError, match="checkpoint name"):
        lc.save(tmp_path / "root", result, name=name)
    assert not (tmp_path / "root").exists()


def test_longest_allowed_name_saves_and_loads(tmp_path, result):
    name = "n" * 200
    lc.save(tmp_path, result, name=name)
    assert lc.load(tmp_path).manifest.name == name


@pytest.mark.parametrize("pname", ["", "__metadata__", "a\nb", "a\x00b"])
def test_bad_parameter_names_refused_before_any_temp_dir(tmp_path, pname):
    result = _plain_result([("ok.weight", torch.ones(2)), (pname, torch.ones(2))])
    with pytest.raises(lc.CheckpointError, match="parameter name"):
        lc.save(tmp_path, result, step=1)
    assert os.listdir(tmp_path) == []


# -- deeply nested JSON --------------------------------------------------------------------


@pytest.fixture
def ckpt(tmp_path, result):
    opt = torch.optim.SGD(result.parameters(), lr=0.1, momentum=0.9)
    state = lc.TrainingState.capture(opt, result, step=1)
    m = lc.save(tmp_path / "root", result, training_state=state)
    return tmp_path / "root" / m.name


def test_deep_json_in_manifest(ckpt, capsys):
    (ckpt / "manifest.json").write_text("[" * DEEP + "]" * DEEP)
    with pytest.raises(lc.ManifestError, match=r"manifest.json.*too deep"):
        lc.load(ckpt)
    line = _one_error_line(capsys, cli.main(["inspect", str(ckpt)]))
    assert "manifest.json" in line


def test_deep_json_inside_a_valid_manifest_field(ckpt, capsys):
    raw = json.loads((ckpt / "manifest.json").read_text())
    text = json.dumps(raw).replace(
        '"lora_config": {', '"lora_config": {"deep": ' + "[" * 900 + "]" * 900 + ", ", 1
    )
    (ckpt / "manifest.json").write_text(text)
    with pytest.raises(lc.ManifestError, match=r"manifest.json.*levels deep"):
        lc.load(ckpt)
    for cmd in ("inspect", "verify"):
        assert "manifest.json" in _one_error_line(capsys, cli.main([cmd, str(ckpt)]))


@pytest.mark.parametrize("verify", [True, False])
def test_deep_json_in_safetensors_header(ckpt, verify):
    hjson = b'{"k": ' + b"[" * DEEP + b"]" * DEEP + b"}"
    _rewrite(ckpt, "fused_expert_lora.safetensors", struct.pack("<Q", len(hjson)) + hjson)
    with pytest.raises(lc.CheckpointError, match=r"fused_expert_lora.safetensors.*deep"):
        lc.load(ckpt, verify=verify)


def test_deep_json_in_training_state(ckpt, capsys):
    _rewrite(ckpt, "training_state-rank00000.json", ("[" * DEEP + "]" * DEEP).encode())
    with pytest.raises(lc.ManifestError, match=r"training_state-rank00000.json.*too deep"):
        lc.load(ckpt)
    assert "training_state" in _one_error_line(capsys, cli.main(["verify", str(ckpt)]))


def test_deep_data_position_refused_at_save(tmp_path, result):
    nested: list = []
    for _ in range(DEEP):
        nested = [nested]
    with pytest.raises(lc.CheckpointError, match=r"data_position.*nested"):
        lc.TrainingState(step=1, data_position={"p": nested})


# -- huge allocations, oversized latest ----------------------------------------------------


def test_header_with_overflowing_shape_refused(ckpt, capsys):
    header = {"k": {"dtype": "F32", "shape": [0, 1 << 40, 1 << 40], "data_offsets": [0, 0]}}
    _rewrite(ckpt, "fused_expert_lora.safetensors", _safetensors(header))
    for verify in (False, True):
        with pytest.raises(lc.CheckpointError, match=r"fused_expert_lora.safetensors"):
            lc.load(ckpt, verify=verify)
    _one_error_line(capsys, cli.main(["verify", str(ckpt)]))


def test_header_asking_for_a_terabyte_refused_before_allocating(ckpt):
    # A sparse file as large as its header claims, with the manifest's size to match: only
    # the manifest's recorded shapes tell that the header lies, and they are checked first.
    path = ckpt / "fused_expert_lora.safetensors"
    nbytes = 1 << 40
    key = "moe.lora_experts.0.weight"
    header = {key: {"dtype": "F32", "shape": [nbytes // 4], "data_offsets": [0, nbytes]}}
    head = _safetensors(header)
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(len(head) + nbytes)
    raw = json.loads((ckpt / "manifest.json").read_text())
    for f in raw["files"]:
        if f["file"] == path.name:
            f["size"] = len(head) + nbytes
    (ckpt / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(lc.CheckpointError, match=rf"fused_expert_lora.safetensors.*{key}"):
        lc.load(ckpt, verify=False)


# Verifies a checkpoint in a fresh process and reports the error and how much the peak RSS
# grew during verify (ru_maxrss is the process's peak, so the growth bounds every buffer).
_RSS_CHILD = r"""
import json, resource, sys
import lora_checkpoint as lc

def peak():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

lc.verify(sys.argv[2])  # a good checkpoint first: warms the pools, imports and allocator
base = peak()
try:
    lc.verify(sys.argv[1])
    got = "no error"
except lc.CheckpointError as exc:
    got = f"{type(exc).__name__}: {exc}"
print(json.dumps({"error": got, "grew": peak() - base}))
"""


def _verify_rss(ckpt: Path, good: Path) -> tuple[str, int]:
    out = subprocess.run(
        [sys.executable, "-c", _RSS_CHILD, str(ckpt), str(good)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    return res["error"], res["grew"]


def _sparse(path: Path, head: bytes, size: int, ckpt: Path | None = None) -> None:
    # ``head`` then zeros up to ``size`` bytes, without writing (or storing) the zeros; with
    # ``ckpt`` the manifest records the new size, so only the content disagrees with it.
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(size)
    if ckpt is not None:
        raw = json.loads((ckpt / "manifest.json").read_text())
        for f in raw["files"]:
            if f["file"] == path.name:
                f["size"] = size
        (ckpt / "manifest.json").write_text(json.dumps(raw))


_BOUND = 96 << 20  # RSS growth allowed while verifying a hostile file (chunks are 4 MiB)


def test_garbled_header_of_a_512mib_file_is_hashed_in_bounded_memory(tmp_path, ckpt):
    # The header matches nothing in the manifest, so the whole file is hashed (to tell a
    # corrupted file from a malformed one): in chunks, never in buffers as large as the file.
    good = shutil.copytree(ckpt.parent, tmp_path / "good") / ckpt.name
    _sparse(
        ckpt / "fused_expert_lora.safetensors",
        b"\x10" + b"\0" * 7 + b"{garbage}" * 2,
        512 << 20,
        ckpt,
    )
    error, grew = _verify_rss(ckpt, good)
    assert error.startswith("DigestMismatchError"), error
    assert "fused_expert_lora.safetensors" in error, error
    assert "safetensors header" in error, error
    assert grew < _BOUND, f"verify grew the peak RSS by {grew / 2**20:.0f} MiB"


def test_64gib_file_the_manifest_does_not_expect_is_refused_before_reading(tmp_path, ckpt):
    good = shutil.copytree(ckpt.parent, tmp_path / "good") / ckpt.name
    path = ckpt / "fused_expert_lora.safetensors"
    _sparse(path, path.read_bytes(), 64 << 30)
    error, grew = _verify_rss(ckpt, good)
    assert error.startswith("DigestMismatchError"), error
    assert f"file has {64 << 30} bytes, the manifest expects" in error, error
    assert grew < _BOUND, f"verify grew the peak RSS by {grew / 2**20:.0f} MiB"


def test_oversized_json_file_refused_before_reading(tmp_path, ckpt):
    # A JSON file is read whole to be parsed: one larger than any we write is refused by its
    # size (the manifest agreeing with it), not read into memory first.
    good = shutil.copytree(ckpt.parent, tmp_path / "good") / ckpt.name
    _sparse(ckpt / "adapter_config.json", b"{", 300 << 20, ckpt)
    error, grew = _verify_rss(ckpt, good)
    assert error.startswith("CheckpointError"), error
    assert "adapter_config.json: file has 314572800 bytes, more than" in error, error
    assert grew < _BOUND, f"verify grew the peak RSS by {grew / 2**20:.0f} MiB"


def test_oversized_latest_read_bounded(ckpt, capsys):
    (ckpt.parent / "latest").write_bytes(b"x" * (8 << 20))
    with pytest.raises(lc.UnsafeFileError, match=r"latest is larger than") as info:
        lc.load(ckpt.parent)
    assert len(str(info.value)) < 500
    _one_error_line(capsys, cli.main(["verify", str(ckpt.parent)]))


# -- paths outside the root ------------------------------------------------------------------


def test_symlinked_checkpoint_dir_outside_root_refused(tmp_path, result, capsys):
    other = tmp_path / "other"
    m = lc.save(other, result, step=1)
    root = tmp_path / "root"
    lc.save(root, result, step=2)
    os.symlink(other / m.name, root / "step-00000009")
    (root / "latest").write_text("step-00000009\n")
    with pytest.raises(lc.UnsafeFileError, match=r"step-00000009 is a symbolic link leading"):
        lc.load(root)
    _one_error_line(capsys, cli.main(["verify", str(root)]))
    # pruning never follows it either
    lc.save(root, result, step=3, keep_last=1)
    assert (other / m.name / "manifest.json").is_file()


SECRET = "TOP-SECRET-7f3a9"


def test_errors_never_echo_files_outside_the_root(tmp_path, ckpt, capsys):
    secret = tmp_path / "secret.txt"
    secret.write_text(SECRET + "\n")
    (ckpt.parent / "latest").unlink()
    os.symlink(secret, ckpt.parent / "latest")
    with pytest.raises(lc.UnsafeFileError) as info:
        lc.load(ckpt.parent)
    assert SECRET not in str(info.value)
    assert SECRET not in _one_error_line(capsys, cli.main(["inspect", str(ckpt.parent)]))

    secret.write_text(json.dumps({"format_version": 2, "name": SECRET}))
    (ckpt / "manifest.json").unlink()
    os.symlink(secret, ckpt / "manifest.json")
    for call in (lambda: lc.load(ckpt), lambda: lc.verify(ckpt), lambda: lc.inspect(ckpt)):
        with pytest.raises(lc.UnsafeFileError) as info:
            call()
        assert SECRET not in str(info.value)
    assert SECRET not in _one_error_line(capsys, cli.main(["inspect", str(ckpt)]))


# -- disk full, read-only file system --------------------------------------------------------


@pytest.mark.timeout(120)
def test_disk_full_and_read_only_on_a_real_tmpfs(tmp_path):
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("mounting a tmpfs needs root and unshare")
    mount = tmp_path / "mnt"
    mount.mkdir()
    script = Path(__file__).parent / "scripts" / "tiny_fs.py"
    proc = subprocess.run(
        [
            "unshare",
            "-m",
            "--propagation",
            "private",
            "sh",
            "-c",
            'mount -t tmpfs -o size=1m tmpfs "$1" || exit 77; exec "$2" "$3" "$1"',
            "sh",
            str(mount),
            sys.executable,
            str(script),
        ],
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
    )
    if proc.returncode == 77:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["small"]["type"] == "ok"
    assert out["enospc"]["type"] == "CheckpointIOError", out["enospc"]
    assert "ENOSPC" in out["enospc"]["message"]
    assert "disk is full" in out["enospc"]["message"]
    assert out["after_enospc"] == {
        "latest": "step-00000001",
        "value": 1.0,
        "leftovers": [],
        "verified": "step-00000001",
    }
    for case in ("erofs", "erofs_new_root"):
        assert out[case]["type"] == "CheckpointIOError", out[case]
        assert "EROFS" in out[case]["message"]
        assert "read-only" in out[case]["message"]
    assert out["after_erofs"] == out["after_enospc"]


INJECT = """
import errno, os, sys, torch
import lora_checkpoint as lc
from lora_core.contracts import AdaptationResult, ComponentVersion
params = [("p", torch.nn.Parameter(torch.ones(64)))]
result = AdaptationResult.create(adapted_layers=["x"], named_optimizer_parameters=params,
    ownership={"p": "replicated"}, producer=ComponentVersion("lora-core", "0.1.0"))
root = sys.argv[1]
lc.save(root, result, step=1)
real = getattr(os, sys.argv[2])
def failing(*args):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
setattr(os, sys.argv[2], failing)
try:
    lc.save(root, result, step=2)
except lc.CheckpointIOError as exc:
    print("CheckpointIOError", " ".join(str(exc).split()))
setattr(os, sys.argv[2], real)
print("LATEST", lc.load(root).manifest.name)
"""


@pytest.mark.parametrize("call", ["write", "fsync"])
def test_injected_enospc_is_a_checkpoint_error(tmp_path, call):
    proc = subprocess.run(
        [sys.executable, "-c", INJECT, str(tmp_path / "root"), call],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    first, second = proc.stdout.splitlines()
    assert first.startswith("CheckpointIOError ")
    assert "ENOSPC" in first
    assert str(tmp_path / "root") in first
    assert second == "LATEST step-00000001"
    assert not [p for p in (tmp_path / "root").iterdir() if p.name.startswith(".tmp-")]


def test_console_script_prints_one_error_line_never_a_traceback(ckpt):
    (ckpt / "manifest.json").write_text("{" * DEEP)
    exe = shutil.which("lora-checkpoint") or str(Path(sys.executable).with_name("lora-checkpoint"))
    for cmd in ("verify", "inspect"):
        proc = subprocess.run(
            [exe, cmd, str(ckpt)], capture_output=True, text=True, timeout=60, check=False
        )
        assert proc.returncode == 1
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1, proc.stderr
        assert lines[0].startswith("lora-checkpoint: error: ManifestError: ")
        assert "manifest.json" in lines[0]
        assert "Traceback" not in proc.stderr


def test_load_of_a_root_without_lock_file_retries_once(tmp_path, result, monkeypatch):
    # A root from before 0.3 has no lock: a checkpoint pruned between resolving `latest` and
    # reading it is resolved again, once. Simulated by deleting the checkpoint that the first
    # resolve returned (exactly what a 0.2 writer's pruning does) and pointing `latest` on.
    from lora_checkpoint import reader

    lc.save(tmp_path, result, step=1)
    lc.save(tmp_path, result, step=2)
    (tmp_path / "latest").write_text("step-00000001\n")
    (tmp_path / ".lock").unlink()
    real = reader.resolve_checkpoint
    calls = []

    def pruned_after_resolve(directory):
        target = real(directory)
        if not calls:
            shutil.rmtree(target)
            (tmp_path / "latest").write_text("step-00000002\n")
        calls.append(target.name)
        return target

    monkeypatch.setattr(reader, "resolve_checkpoint", pruned_after_resolve)
    assert lc.load(tmp_path).manifest.name == "step-00000002"
    assert calls == ["step-00000001", "step-00000002"]
