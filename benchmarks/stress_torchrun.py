"""Stress the torchrun tests that ever lost a rank to SIGABRT, under CPU load; count aborts.

On demand only (not in CI, not a ``bench_*`` script): each test runs ``--reps`` times in its
own pytest process while one busy loop per core competes for the CPUs, the way a loaded CI
machine delays threads. An abort is counted from two sources, so that one in a run whose test
still passes (a rank of the first run of the SIGTERM test) is not missed:

- a core file: ``RLIMIT_CORE`` is raised for the pytest process tree and each rep runs in
  its own empty directory, where the kernel's ``core_pattern`` (``core``) writes the dump of
  any rank killed by SIGABRT; the first one's aborting thread is kept as evidence (gdb);
- the text ``terminate called without an active exception`` (or SIGABRT) in the output.

Writes ``stress_torchrun.json`` and ``stress_torchrun.md`` into ``--out`` (``--label`` names
the run: "fixed", "unfixed"). ``--repo`` runs the tests of another checkout (its
``packages/*/src`` first on ``PYTHONPATH``), e.g. the code before a fix.

    python benchmarks/stress_torchrun.py --reps 30 --out benchmarks/results
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Every torchrun test that ever lost a rank to "terminate called without an active exception".
TESTS = [
    "packages/moe-experts/tests/test_shared_experts.py::"
    "test_two_local_ranks_map_one_copy_and_train_as_one_process[wrap]",
    "packages/moe-experts/tests/test_shared_experts.py::"
    "test_a_failure_on_one_rank_outside_the_hand_over_stops_every_rank"
    "[wrap-fail-selfcheck-SelfCheckError-model.layers.1.mlp.experts: ]",
    "tests/test_finetune_distributed.py::test_sigterm_under_torchrun_saves_one_step_on_all_ranks",
    # Seen aborting in CI on 2026-12-05 (rank 1 of the fsdp x2 scenario), after the fix above:
    # the test workers of lora-core and lora-checkpoint, which end FSDP runs themselves.
    "packages/lora-core/tests/test_fsdp.py",
    "packages/lora-checkpoint/tests/test_distributed.py",
]
ABORT_TEXT = re.compile(r"terminate called without an active exception|SIGABRT|Signal 6\b")
# The mechanism alone, without our code: a one-rank gloo world runs collectives and exits. With
# the world group still held after destroy_process_group ("held": what importing
# torch.distributed.nn after init_process_group, or torch's DTensor caches after FSDP, do) its
# worker threads meet the interpreter's finalisation; freed, they are joined before it.
MECHANISM = """
import sys
from datetime import timedelta
import torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1,
                        timeout=timedelta(seconds=60))
held = dist.group.WORLD if sys.argv[2] == "held" else None
for _ in range(20):
    t = torch.ones(1000)
    dist.all_reduce(t)
    del t
dist.destroy_process_group()
"""
ENV = {
    "KT_KERNEL_REQUIRE_NATIVE": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def _machine() -> str:
    model = platform.processor() or platform.machine()
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        model = next(
            (line.split(":", 1)[1].strip() for line in out.splitlines() if "Model name" in line),
            model,
        )
    except OSError:
        pass
    return f"{model}, {len(os.sched_getaffinity(0))} cores, Python {platform.python_version()}"


def _aborting_thread(core: Path, python: str) -> list[str]:
    """The frames of the thread that called abort, from a core file (empty without gdb)."""
    if shutil.which("gdb") is None:
        return []
    out = subprocess.run(
        ["gdb", "-batch", "-ex", "thread apply all bt 30", python, str(core)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    ).stdout
    for block in out.split("\nThread ")[1:]:
        if "abort" in block:
            return [line for line in block.splitlines() if line.startswith("#")][:26]
    return []


def _run_once(test: str, repo: Path, python: str, env: dict[str, str]) -> dict:
    with tempfile.TemporaryDirectory(prefix="stress-") as tmp:
        start = time.monotonic()
        proc = subprocess.run(
            [
                python,
                "-m",
                "pytest",
                "-c",
                str(repo / "pyproject.toml"),
                "--rootdir",
                str(repo),
                "-p",
                "no:cacheprovider",
                "-q",
                "-x",
                str(repo / test),
            ],
            cwd=tmp,  # the ranks inherit it: their core files land here
            env=env,
            capture_output=True,
            text=True,
            timeout=1800,
            check=False,
        )
        cores = sorted(Path(tmp).glob("core*"))
        evidence = _aborting_thread(cores[0], python) if cores else []
        text = proc.stdout + proc.stderr
        return {
            "rc": proc.returncode,
            "seconds": round(time.monotonic() - start, 1),
            "cores": len(cores),
            "abort_text": len(ABORT_TEXT.findall(text)),
            "evidence": evidence,
            "tail": text[-1500:] if proc.returncode else "",
        }


def _mechanism(mode: str, reps: int, python: str) -> dict:
    """Run :data:`MECHANISM` ``reps`` times; count the runs that aborted."""
    aborted = 0
    for _ in range(reps):
        with tempfile.TemporaryDirectory(prefix="stress-") as tmp:
            proc = subprocess.run(
                [python, "-c", MECHANISM, f"{tmp}/rdzv", mode],
                cwd=tmp,
                capture_output=True,
                text=True,
                timeout=300,
                check=False,
            )
            aborted += bool(list(Path(tmp).glob("core*")) or ABORT_TEXT.search(proc.stderr))
    return {"mode": mode, "reps": reps, "aborted_runs": aborted}


def _write(
    args: argparse.Namespace,
    results: dict[str, list[dict]],
    mechanism: list[dict],
    started: datetime.datetime,
) -> list[str]:
    """Write the JSON and the markdown table of what has run so far; returns the table."""
    with open("/proc/sys/kernel/core_pattern") as f:
        core_pattern = f.read().strip()
    rows = []
    for test, runs in results.items():
        rows.append(
            {
                "test": test,
                "reps": len(runs),
                "passed": sum(r["rc"] == 0 for r in runs),
                "aborted_runs": sum(bool(r["cores"] or r["abort_text"]) for r in runs),
                "cores": sum(r["cores"] for r in runs),
                "median_s": sorted(r["seconds"] for r in runs)[len(runs) // 2] if runs else 0,
                "evidence": next((r["evidence"] for r in runs if r["evidence"]), []),
                "failures": [r["tail"] for r in runs if r["rc"]][:3],
            }
        )
    command = " ".join(["python", "benchmarks/stress_torchrun.py", *sys.argv[1:]])
    report = {
        "date": started.strftime("%Y-%m-%d %H:%M UTC"),
        "machine": _machine(),
        "label": args.label,
        "command": command,
        "busy_loops": args.load,
        "core_pattern": core_pattern,
        "rows": rows,
        "mechanism": mechanism,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"stress_torchrun_{args.label}"
    (args.out / f"{name}.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [
        f"# torchrun stress: {args.label}",
        "",
        f"{report['date']}; {report['machine']}; {args.load} busy loops beside the tests.",
        "",
        f"    {command}",
        "",
        "| test | runs | passed | runs with an abort | core files | median s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| `{row['test'].split('::')[-1]}` | {row['reps']} | {row['passed']} | "
            f"{row['aborted_runs']} | {row['cores']} | {row['median_s']} |"
        )
    if mechanism:
        lines += [
            "",
            "The bare mechanism (a one-rank gloo world: 20 all_reduce, then exit), same load:",
            "",
            "| world group after destroy_process_group | runs | runs with an abort |",
            "|---|---:|---:|",
            *(f"| {m['mode']} | {m['reps']} | {m['aborted_runs']} |" for m in mechanism),
        ]
    (args.out / f"{name}.md").write_text("\n".join(lines) + "\n")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--label", default="fixed")
    p.add_argument("--repo", type=Path, default=ROOT, help="the checkout whose tests run")
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--load", type=int, default=len(os.sched_getaffinity(0)), help="busy loops")
    p.add_argument("-k", dest="only", default="", help="run only tests containing this text")
    p.add_argument(
        "--mechanism", type=int, default=0, help="also run the bare mechanism this many times"
    )
    args = p.parse_args()
    repo = args.repo.resolve()
    env = {**os.environ, **ENV}
    # The checkout's own sources first, whatever an editable install of the venv points at.
    src = [str(s) for s in sorted((repo / "packages").glob("*/src"))]
    env["PYTHONPATH"] = os.pathsep.join([*src, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    tests = [t for t in TESTS if args.only in t]
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
    results: dict[str, list[dict]] = {t: [] for t in tests}
    mechanism: list[dict] = []
    started = datetime.datetime.now(datetime.UTC)
    try:
        # First, so that a run stopped early still has it.
        mechanism = [
            _mechanism(mode, args.mechanism, args.python)
            for mode in ("held", "freed")
            if args.mechanism
        ]
        for rep in range(args.reps):
            for test in tests:  # interleaved, so machine noise hits every test alike
                r = _run_once(test, repo, args.python, env)
                results[test].append(r)
                aborted = r["cores"] or r["abort_text"]
                print(
                    f"rep {rep + 1}/{args.reps} rc={r['rc']} cores={r['cores']} "
                    f"abort_text={r['abort_text']} {r['seconds']}s {test.split('::')[-1][:70]}",
                    flush=True,
                )
                if aborted and r["evidence"]:
                    print("\n".join(r["evidence"][:20]), flush=True)
            _write(args, results, mechanism, started)  # a run stopped early leaves its figures
    finally:
        for b in busy:
            b.kill()
            b.wait()
    print("\n".join(_write(args, results, mechanism, started)))


if __name__ == "__main__":
    main()
