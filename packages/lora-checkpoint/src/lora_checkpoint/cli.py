"""``lora-checkpoint`` command line: ``verify DIR`` and ``inspect DIR``.

Exit codes:
    0: success (``verify``: every file of every rank matches the manifest and no tensor
       holds NaN/Inf, unless ``--allow-non-finite``).
    1: the checkpoint failed verification or could not be read: one ``error:`` line on
       stderr, never a traceback.
    2: usage error (bad arguments, or DIR is not a directory).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence

import torch

from lora_checkpoint._finite import NonFiniteTensor
from lora_checkpoint._st_header import NAME_TO_DTYPE
from lora_checkpoint.manifest import Manifest
from lora_checkpoint.reader import inspect, verify

__all__ = ["EXIT_FAILED", "EXIT_OK", "EXIT_USAGE", "main", "render"]

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2


def _human(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    lines += [
        "  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
    ]
    return "\n".join(lines)


def _one_line(text: str) -> str:
    # Pydantic and nested errors span lines; the CLI prints exactly one.
    return " ".join(text.split())


def _error(exc: BaseException) -> int:
    print(f"lora-checkpoint: error: {type(exc).__name__}: {_one_line(str(exc))}", file=sys.stderr)
    return EXIT_FAILED


def _non_finite_lines(found: Sequence[NonFiniteTensor]) -> list[str]:
    if not found:
        return ["non-finite tensors: none"]
    return [f"non-finite tensors: {len(found)}"] + [f"  {f.describe()}" for f in found]


def render(manifest: Manifest, non_finite: Sequence[NonFiniteTensor] = ()) -> str:
    """Return the human-readable ``inspect`` report of a manifest and its NaN/Inf scan."""
    algorithm = manifest.digest_algorithm.value  # the digest columns' header
    out = [
        f"checkpoint {manifest.name}  format_version {manifest.format_version}  "
        f"digest_algorithm {manifest.digest_algorithm.value}  "
        f"created {manifest.created_at.isoformat()}  world_size {manifest.world_size}  "
        f"peft_compatible {manifest.peft_compatible}",
        "",
        _table([[c.name, c.version] for c in manifest.components], ["component", "version"]),
    ]
    if manifest.lora_config is not None:
        out += ["", "lora_config " + json.dumps(manifest.lora_config, sort_keys=True)]
    if manifest.training_state is not None:
        out += ["", f"training_state step {manifest.training_state.step}"]
    rows = []
    for t in manifest.tensors:
        dtype = NAME_TO_DTYPE.get(t.dtype)
        nbytes = math.prod(t.shape) * (torch.empty((), dtype=dtype).element_size() if dtype else 0)
        rows.append(
            [
                t.name,
                t.kind.value,
                t.file,
                "x".join(map(str, t.shape)) or "scalar",
                t.dtype,
                _human(nbytes) if dtype else "?",
                "-" if t.rank is None else str(t.rank),
                t.digest[:12],
            ]
        )
    out += [
        "",
        _table(rows, ["tensor", "kind", "file", "shape", "dtype", "size", "rank", algorithm]),
    ]
    out += [
        "",
        _table(
            [
                [f.file, _human(f.size), "-" if f.rank is None else str(f.rank), f.digest[:12]]
                for f in manifest.files
            ],
            ["file", "size", "rank", algorithm],
        ),
    ]
    total = sum(f.size for f in manifest.files)
    out += [f"{len(manifest.tensors)} tensors in {len(manifest.files)} files, {_human(total)}"]
    out += _non_finite_lines(non_finite)
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI and return its exit code (see the module docstring)."""
    parser = argparse.ArgumentParser(
        prog="lora-checkpoint",
        description="Verify or inspect a lora-checkpoint directory (a checkpoint or a root "
        "with a 'latest' pointer). Exit codes: 0 ok, 1 verification failed, 2 usage error.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p_verify = sub.add_parser("verify", help="check every file and tensor against the manifest")
    p_verify.add_argument("directory")
    p_verify.add_argument(
        "--allow-non-finite",
        action="store_true",
        help="accept tensors holding NaN/Inf (reported, not a failure)",
    )
    p_inspect = sub.add_parser("inspect", help="print tensors, files, components and versions")
    p_inspect.add_argument("directory")
    p_inspect.add_argument("--json", action="store_true", help="print the manifest as JSON")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits 2 on usage errors, 0 on --help
        return int(exc.code or 0)
    from pathlib import Path

    if not Path(args.directory).is_dir():
        print(
            f"lora-checkpoint: error: {args.directory!r} is not a directory; pass a checkpoint "
            "or a checkpoint root",
            file=sys.stderr,
        )
        return EXIT_USAGE
    try:
        if args.command == "verify":
            manifest = verify(args.directory, allow_non_finite=args.allow_non_finite)
            print(
                f"OK {manifest.name}: {len(manifest.tensors)} tensors in "
                f"{len(manifest.files)} files verified"
            )
            if args.allow_non_finite:
                print("\n".join(_non_finite_lines(inspect(args.directory).non_finite)))
            return EXIT_OK
        report = inspect(args.directory)
        if args.json:
            print(report.manifest.to_json(), end="")
            if report.non_finite:  # stdout stays the manifest's JSON
                print(
                    "warning: " + "; ".join(_non_finite_lines(report.non_finite)), file=sys.stderr
                )
        else:
            print(render(report.manifest, report.non_finite))
        return EXIT_OK
    except Exception as exc:  # a CheckpointError, or a bug: one line either way
        return _error(exc)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
