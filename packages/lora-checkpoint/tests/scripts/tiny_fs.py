"""Disk-full and read-only saves on a real tmpfs (run inside ``unshare -m`` as root).

Usage: ``tiny_fs.py MOUNTPOINT`` where MOUNTPOINT is a 1 MiB tmpfs of this mount namespace.
Prints one JSON object: for each case the exception type and message (or "ok"), and what
``load`` returns afterwards.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

import lora_checkpoint as lc
from lora_core.contracts import AdaptationResult, ComponentVersion


def result_of(elements: int, fill: float) -> AdaptationResult:
    """One parameter of ``elements`` float32 values, all ``fill``."""
    params = [("p", torch.nn.Parameter(torch.full((elements,), fill)))]
    return AdaptationResult.create(
        adapted_layers=["x"],
        named_optimizer_parameters=params,
        ownership={"p": "replicated"},
        producer=ComponentVersion("lora-core", "0.1.0"),
    )


def attempt(fn) -> dict[str, str]:
    """Run ``fn`` and describe how it ended."""
    try:
        fn()
    except BaseException as exc:  # the test asserts the type
        return {"type": type(exc).__name__, "message": str(exc)}
    return {"type": "ok", "message": ""}


def state(root: Path) -> dict[str, object]:
    """What a reader sees in ``root`` now."""
    loaded = lc.load(root)
    return {
        "latest": loaded.manifest.name,
        "value": float(loaded.tensors["p"][0]),
        "leftovers": sorted(p.name for p in root.iterdir() if p.name.startswith((".tmp", ".tr"))),
        "verified": lc.verify(root).name,
    }


def main() -> None:
    mount = Path(sys.argv[1])
    root = mount / "root"
    out: dict[str, object] = {}
    out["small"] = attempt(lambda: lc.save(root, result_of(1024, 1.0), step=1))
    # 4 MiB on a 1 MiB file system
    out["enospc"] = attempt(lambda: lc.save(root, result_of(1 << 20, 2.0), step=2))
    out["after_enospc"] = state(root)
    subprocess.run(["mount", "-o", "remount,ro", str(mount)], check=True)
    out["erofs"] = attempt(lambda: lc.save(root, result_of(16, 3.0), step=3))
    out["erofs_new_root"] = attempt(lambda: lc.save(mount / "new", result_of(16, 3.0), step=3))
    out["after_erofs"] = state(root)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
