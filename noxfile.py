"""The integration matrix: per-package tests in isolation, constraint cells, demo, bench, lint.

`python3 -m nox` runs what CI runs (lint, every `tests-<package>`, every `integration-<combo>`).
`python3 -m nox -l` lists every session with its docstring.

Every install goes through a constraints file that pins torch (an unpinned torch pulls a CUDA
build of several GB). Wheels are built once per source hash into `.nox/_wheelhouse` and reused
by every session, so the C++ extension of kt-kernel compiles once per run.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import nox

ROOT = Path(__file__).parent
PACKAGES_DIR = ROOT / "packages"
CONSTRAINTS_DIR = ROOT / "constraints"
WHEELHOUSE = ROOT / ".nox" / "_wheelhouse"
BENCH_OUT = ROOT / "bench-results"
PYPROJECT = str(ROOT / "pyproject.toml")

# Sibling dependencies, in install order; a package's tests run with exactly these beside it.
LOCAL_DEPS: dict[str, tuple[str, ...]] = {
    "lora-core": (),
    "kt-kernel": (),
    "lora-checkpoint": ("lora-core",),
    "moe-experts": ("lora-core", "kt-kernel"),
}
# Sibling packages that an extra pulls in (``moe-experts[train]`` brings lora-checkpoint).
EXTRA_LOCAL_DEPS: dict[tuple[str, str], tuple[str, ...]] = {
    ("moe-experts", "train"): ("lora-core", "lora-checkpoint"),
}
# The packages whose wheels contain compiled code built against the session's torch.
NATIVE = {"kt-kernel"}
# Extras installed in the integration cells (all four packages, their test deps, the train CLI).
INTEGRATION_REQUIREMENTS = ("lora-core[test]", "kt-kernel[test]", "lora-checkpoint[test]",
                            "moe-experts[test,train]")
COMBOS = sorted(p.stem for p in CONSTRAINTS_DIR.glob("*.txt"))
DEFAULT_CONSTRAINTS = CONSTRAINTS_DIR / "current.txt"
ENV = {
    # A kt-kernel whose native extension fails to load must fail the tests, not fall back.
    "KT_KERNEL_REQUIRE_NATIVE": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}

nox.options.default_venv_backend = "venv"
nox.options.error_on_external_run = True
nox.options.sessions = [
    "lint",
    *(f"tests-{name}" for name in LOCAL_DEPS),
    *(f"integration-{combo}" for combo in COMBOS),
]


def _source_digest(package: str) -> str:
    """Hash every file that goes into a package's wheel, so a stale wheel is never reused."""
    h = hashlib.sha256()
    base = PACKAGES_DIR / package
    for path in sorted(base.rglob("*")):
        rel = path.relative_to(base)
        if path.is_file() and not {"build", "__pycache__", "tests", "benchmarks"} & set(rel.parts) \
                and not path.name.endswith((".so", ".pyc")) and ".egg-info" not in str(rel):
            h.update(str(rel).encode())
            h.update(path.read_bytes())
    return h.hexdigest()[:16]


def _pip_env(constraints: Path) -> dict[str, str]:
    """Environment that makes pip's isolated build environments obey the same pins."""
    return {**ENV, "PIP_CONSTRAINT": str(constraints)}


def _install_torch(session: nox.Session, constraints: Path) -> None:
    """Install the pinned torch first, so nothing later can resolve another build."""
    session.install("-c", str(constraints), "torch", "setuptools>=69", "wheel",
                    env=_pip_env(constraints))


def _wheel(session: nox.Session, package: str, constraints: Path) -> Path:
    """Build (or reuse) the wheel of one package and return its path."""
    key = _source_digest(package)
    if package in NATIVE:
        # Read from metadata: importing torch may print warnings into the captured output.
        torch_version = session.run(
            "python", "-c", "import importlib.metadata as m; print(m.version('torch'))",
            silent=True).strip().splitlines()[-1]
        key += "-torch" + torch_version
    out = WHEELHOUSE / package / key
    wheels = sorted(out.glob("*.whl"))
    if wheels:
        return wheels[0]
    tmp = out.with_name(key + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    args = ["python", "-m", "pip", "wheel", "--no-deps", "-w", str(tmp)]
    if package in NATIVE:
        # Builds against the torch already in this venv: the exact ABI it will run with.
        args.append("--no-build-isolation")
    session.run(*args, str(PACKAGES_DIR / package), env=_pip_env(constraints))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return sorted(out.glob("*.whl"))[0]


def _install_packages(session: nox.Session, requirements: list[str], constraints: Path) -> None:
    """Install packages (``name`` or ``name[extra]``) from wheels built in this run."""
    deps: list[str] = []
    for req in requirements:
        name, _, extras = req.partition("[")
        for extra in filter(None, extras.rstrip("]").split(",")):
            deps += EXTRA_LOCAL_DEPS.get((name, extra.strip()), ())
        deps += [*LOCAL_DEPS[name], name]
    needed = list(dict.fromkeys(deps))
    wheels = {n: _wheel(session, n, constraints) for n in needed}
    specs = []
    for n in needed:
        extra = next((r[len(n):] for r in requirements if r.split("[")[0] == n), "")
        specs.append(f"{wheels[n]}{extra}")
    session.install("-c", str(constraints), *specs, env=_pip_env(constraints))


def _pytest(session: nox.Session, *paths: str) -> None:
    """Run pytest with the root configuration; pass-through arguments go last."""
    session.run("python", "-m", "pytest", "-c", PYPROJECT, "--rootdir", str(ROOT),
                *paths, *session.posargs, env=ENV)


def _make_tests_session(package: str) -> None:
    def tests(session: nox.Session) -> None:
        _install_torch(session, DEFAULT_CONSTRAINTS)
        _install_packages(session, [f"{package}[test]"], DEFAULT_CONSTRAINTS)
        session.chdir(ROOT / "packages" / package)  # so nothing imports from the source tree
        _pytest(session, "tests")

    tests.__doc__ = f"Install {package} alone (with only its dependencies) and run its tests."
    nox.session(name=f"tests-{package}")(tests)


def _make_integration_session(combo: str) -> None:
    constraints = CONSTRAINTS_DIR / f"{combo}.txt"

    def integration(session: nox.Session) -> None:
        _install_torch(session, constraints)
        _install_packages(session, list(INTEGRATION_REQUIREMENTS), constraints)
        session.run("python", "-m", "pip", "list", silent=False)
        _pytest(session, str(ROOT / "tests"))

    integration.__doc__ = (f"Install all four wheels pinned by constraints/{combo}.txt and run "
                           "the cross-package tests in tests/.")
    nox.session(name=f"integration-{combo}")(integration)


for _package in LOCAL_DEPS:
    _make_tests_session(_package)
for _combo in COMBOS:
    _make_integration_session(_combo)


@nox.session
def lint(session: nox.Session) -> None:
    """Run ruff over every package, the root tests and this noxfile."""
    session.install("-c", str(DEFAULT_CONSTRAINTS), "ruff")
    session.run("ruff", "check", str(ROOT), *session.posargs)


@nox.session
def demo(session: nox.Session) -> None:
    """The main job: a real LoRA fine-tune of a tiny MoE model on CPU (pass CLI flags after --)."""
    _install_torch(session, DEFAULT_CONSTRAINTS)
    _install_packages(session, ["moe-experts[train]"], DEFAULT_CONSTRAINTS)
    out = ROOT / "demo-output"
    # --overwrite: a second `nox -s demo` starts the demo again instead of refusing the
    # output directory the first one left behind.
    args = session.posargs or ["--output", str(out), "--overwrite"]
    session.run("moe-experts", "finetune", *args, env=ENV)


@nox.session
def bench(session: nox.Session) -> None:
    """Run every benchmark (`-- --quick` for a short run); JSON and tables in bench-results/."""
    _install_torch(session, DEFAULT_CONSTRAINTS)
    _install_packages(session, list(INTEGRATION_REQUIREMENTS), DEFAULT_CONSTRAINTS)
    session.install("-c", str(DEFAULT_CONSTRAINTS), "psutil")
    scripts = sorted(PACKAGES_DIR.glob("*/benchmarks/bench_*.py")) + sorted(
        (ROOT / "benchmarks").glob("bench_*.py"))
    BENCH_OUT.mkdir(exist_ok=True)
    for script in scripts:
        out = BENCH_OUT / script.stem
        session.run("python", str(script), "--out", str(out), *session.posargs,
                    env={**ENV, "OMP_NUM_THREADS": str(os.cpu_count() or 1)})
    session.run("python", str(ROOT / "benchmarks" / "summarize.py"), str(BENCH_OUT))
