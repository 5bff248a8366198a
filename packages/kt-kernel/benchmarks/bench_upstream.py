"""Benchmark our expert op against KTransformers' own kernel (PyPI ``kt-kernel==0.7.2``), optional.

Usage: ``python bench_upstream.py --upstream-python PY --out DIR [--shapes S ...]
[--tokens T ...] [--rounds N] [--reps N] [--wait-quiet S] [--retries N] [--quick]``. ``PY``
(default ``$KT_UPSTREAM_PYTHON``) is the python of a separate virtual environment holding
upstream's wheel (its import name is ``kt_kernel`` too, so it can never sit beside ours; the
wheel pins torch 2.9.1 but its extensions do not link libtorch, so it is installed with
``--no-deps`` over a CPU torch); without it, or when its ``kt_kernel`` is not 0.7.2, one line
says the baseline is skipped and how to make that environment, and the exit status is 0.
Writes ``DIR/bench_upstream.json`` and ``DIR/bench_upstream.md``. The cores are shared:
``--wait-quiet S`` waits up to S seconds for idle cores before each child, ``--retries N``
reruns a child during which other processes used more than ``QUIET_CORES``.

1. Per (shape, T) the parent draws the inputs once: bf16 ``gate_up [E, 2I, H]`` and
   ``down [E, H, I]`` (``_timing.make_weights``), ``x``, top-k ids, routing weights and ``dy``
   (``_timing.make_inputs``), and a rank-16 LoRA on gate, up and down (alpha 32, scaling 2;
   A and B random so every LoRA product does work), and writes them to one safetensors file.
2. Child processes alternate, ours, upstream, ours, upstream (``--rounds`` pairs): each loads
   the file, builds its kernel's weights and adapter, runs one warm-up forward+backward, then
   ``--reps`` timed ones, with 2 threads; it reports the median wall ms, median process CPU
   seconds of a step (``time.process_time``, all threads) and its peak RSS over the steps (the
   whole process, expert weights included). Ours: ``moe_experts_forward`` (bf16 weights,
   ``layout="split"`` bf16 LoRA, the per-projection adapters upstream has; policy save; native).
   Upstream: ``kt_kernel.sft.amx.AMXSFTMoEWrapper(method="AMXBF16_SFT")`` forward and
   backward (``_upstream_child.py``); on a CPU without AMX its loader takes the AVX-512-BF16
   build.
3. Correctness before timing: the first pair's warm-up step saves y, dx, the routing-weight
   gradient and the six LoRA gradients; the parent compares upstream with ours (max abs error,
   max abs error over ours' max abs, relative Frobenius) and, up to ``--reference-tokens``,
   both with the fp32 reference (our ``backend="reference"`` on fp32 copies of the same values).
4. The bf16 matmul peak (``_timing.matmul_peak``) before and after; our share of it uses
   ``_impls.flops`` (base and LoRA, forward+backward).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling modules (a script)
import _impls
import _timing as tm

import kt_kernel as kk

HERE = Path(__file__).resolve().parent
UPSTREAM_VERSION = "0.7.2"
THREADS = 2
RANK = 16
ALPHA = 32.0  # scaling alpha / r = 2 in both kernels
LORA_NAMES = ("gate_lora_a", "gate_lora_b", "up_lora_a", "up_lora_b", "down_lora_a", "down_lora_b")
# (H, I, E, k): the shape and the Qwen3-30B-A3B layer (the default), a smoke test.
SHAPES = {
    "issue": (2048, 1408, 64, 6),
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "smoke": (512, 256, 8, 2),
}
DEFAULT_SHAPES = ["issue", "qwen3-30b-a3b"]
# Upstream and ours both round through bf16; two such results agree to about twice either's
# error against fp32 (ours is about 5e-3 relative Frobenius, history.md "Formats").
TOLERANCE_REL_FRO = 2e-2
# A child during which other processes kept more than this many cores busy is disturbed
# (the machine's 2 cores are shared with other users): --retries runs it again.
QUIET_CORES = 0.15
MAKE_VENV = (
    "python3 -m venv /tmp/upvenv && echo torch==2.13.0 > /tmp/upc.txt && "
    "/tmp/upvenv/bin/pip install -c /tmp/upc.txt torch==2.13.0 numpy safetensors gguf packaging "
    "&& /tmp/upvenv/bin/pip download --no-deps -d /tmp/ktdl kt-kernel==0.7.2 && "
    "/tmp/upvenv/bin/pip install --no-deps /tmp/ktdl/kt_kernel-0.7.2-*.whl"
)


def upstream_version(python: str | None) -> tuple[str | None, str]:
    """Upstream's ``kt_kernel.__version__`` in ``python``'s environment, or None and why not."""
    if not python:
        return None, "no --upstream-python given"
    if not Path(python).exists():
        return None, f"{python} does not exist"
    try:
        res = subprocess.run(
            [python, "-c", "import kt_kernel; print(kt_kernel.__version__)"],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=tempfile.gettempdir(),  # not a directory holding our kt_kernel sources
        )
    except subprocess.TimeoutExpired:
        return None, "importing kt_kernel timed out"
    if res.returncode != 0:
        return None, (res.stderr.strip().splitlines() or ["import kt_kernel failed"])[-1]
    return res.stdout.strip().splitlines()[-1], ""


def _child_env() -> dict[str, str]:
    """The environment of a timed child: 2 OpenMP threads, nothing of ours on the path."""
    env = dict(os.environ, OMP_NUM_THREADS=str(THREADS), KT_KERNEL_THREADS=str(THREADS))
    env.pop("PYTHONPATH", None)
    return env


def write_inputs(path: Path, shape: str, tokens: int, seed: int) -> dict:
    """Draw one configuration's inputs, write ``path`` (+ ``.json`` metadata); return the meta."""
    h, i, e, k = SHAPES[shape]
    gate_up, down = tm.make_weights(h, i, e, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    x, ids, w, dy = tm.make_inputs(tokens, h, e, k, gen)
    tensors = {"gate_up": gate_up, "down": down, "x": x, "ids": ids, "w": w, "dy": dy}
    for name, shp in kk.lora_shapes(kk.ExpertSpec(e, h, i), RANK, "split").items():
        tensors[name] = (torch.randn(shp, generator=gen) / shp[-1] ** 0.5).to(torch.bfloat16)
    save_file(tensors, str(path))
    meta = {"shape": shape, "T": tokens, "H": h, "I": i, "E": e, "k": k, "r": RANK, "alpha": ALPHA}
    path.with_suffix(".json").write_text(json.dumps(meta))
    return meta


def _ours_lora(spec: kk.ExpertSpec, tensors: dict[str, torch.Tensor]) -> kk.LoraBuffers:
    """Our split-layout adapter adopting ``tensors`` as parameters (one per projection)."""
    params = {n: torch.nn.Parameter(tensors[n]) for n in LORA_NAMES}
    return kk.LoraBuffers.from_tensors(spec, RANK, ALPHA, "split", params)


def _ours_grads(
    inp: dict[str, torch.Tensor], weights: kk.ExpertWeights, lora: kk.LoraBuffers, backend: str
) -> dict[str, torch.Tensor]:
    """y, dx, the routing-weight gradient and the LoRA gradients of one forward+backward."""
    for p in lora.parameters():
        p.grad = None
    dtype = weights.dtype
    xg = inp["x"].detach().to(dtype).requires_grad_(True)
    wg = inp["w"].detach().requires_grad_(True)
    y = kk.moe_experts_forward(xg, inp["ids"], wg, weights, lora, policy="save", backend=backend)
    y.backward(inp["dy"].to(dtype))
    out = {"y": y.detach(), "dx": xg.grad, "dw": wg.grad}
    out.update({"d_" + n: getattr(lora, n).grad for n in LORA_NAMES})
    return out


def _status_bytes(field: str) -> int:
    """A ``/proc/self/status`` memory field in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def ours_child(
    inputs: Path, result: Path, reps: int, save: Path | None, weight_dtype: str = "bf16"
) -> None:
    """Our side of one timed child (same protocol as ``_upstream_child.py``)."""
    torch.set_num_threads(THREADS)
    kk.set_num_threads(THREADS)
    # Own copies: a tensor of load_file's keeps the whole file's mapping (and its touched
    # pages, counted in RSS) alive; the copies of the weights are freed once stored.
    inp = {n: t.clone() for n, t in load_file(str(inputs)).items()}
    meta = json.loads(inputs.with_suffix(".json").read_text())
    spec = kk.ExpertSpec(meta["E"], meta["H"], meta["I"])
    weights = kk.ExpertWeights.from_fused(
        spec, inp.pop("gate_up"), inp.pop("down"), weight_dtype=weight_dtype
    )
    lora = _ours_lora(spec, {n: inp.pop(n) for n in LORA_NAMES})
    gc.collect()
    rss_setup = _status_bytes("VmRSS")
    with contextlib.suppress(OSError):  # peak RSS over the steps, as upstream's child
        Path("/proc/self/clear_refs").write_text("5")
    out = _ours_grads(inp, weights, lora, "native")  # the warm-up
    if save is not None:
        save_file({n: t.contiguous() for n, t in out.items()}, str(save))
    samples = [
        tm.step(inp["x"], inp["ids"], inp["w"], inp["dy"], weights, lora) for _ in range(reps)
    ]
    res = {
        "impl": "ours",
        "version": kk.__version__,
        "isa": kk.backend_info().isa,
        "threads": kk.get_num_threads(),
        "reps": reps,
        "wall_ms": tm.median_wall(samples) * 1e3,
        "wall_ms_all": [s[0] * 1e3 for s in samples],
        "cpu_s": tm.median_cpu(samples),
        "cpu_s_all": [s[1] for s in samples],
        "rss_setup_bytes": rss_setup,
        "peak_rss_bytes": _status_bytes("VmHWM"),
    }
    result.write_text(json.dumps(res))


def _busy_s() -> float:
    """CPU seconds all cores have been busy since boot (``/proc/stat``, steal included)."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _children_cpu_s() -> float:
    """CPU seconds of this process's finished children."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def run_child(cmd: list[str], result: Path, timeout: float) -> dict:
    """Run one child; its JSON result, or ``{"error": ...}`` with its last line of output.

    ``others_cores``: the cores other processes kept busy on average while it ran (all busy
    CPU time less the child's and this process's): the cores are shared with other users.
    """
    t0 = time.perf_counter()
    busy0, kids0, self0 = _busy_s(), _children_cpu_s(), time.process_time()
    try:
        res = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, env=_child_env(), cwd=HERE.parent
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    if res.returncode != 0 or not result.exists():
        lines = (res.stderr + res.stdout).strip().splitlines() or [f"exit {res.returncode}"]
        return {"error": lines[-1][:300], "returncode": res.returncode}
    out = json.loads(result.read_text())
    result.unlink()
    out["child_s"] = time.perf_counter() - t0
    own = _children_cpu_s() - kids0 + time.process_time() - self0
    out["others_cores"] = max(0.0, _busy_s() - busy0 - own) / out["child_s"]
    # Upstream's C++ prints which backend its BF16 MoE took (e.g. "backend=AVX512-BF16").
    for line in (res.stdout + res.stderr).splitlines():
        if "backend=" in line:
            out["backend_line"] = line.strip()
            break
    return out


def wait_quiet(max_s: float, sample_s: float = 2.0) -> dict:
    """Wait (up to ``max_s``) until other processes use under ``QUIET_CORES`` cores.

    Returns the seconds waited and the last sample's cores of others; with ``max_s`` 0 it
    returns at once (nothing waited, nothing sampled).
    """
    t0 = time.perf_counter()
    cores = None
    while time.perf_counter() - t0 < max_s:
        busy0, self0 = _busy_s(), time.process_time()
        time.sleep(sample_s)
        cores = max(0.0, _busy_s() - busy0 - (time.process_time() - self0)) / sample_s
        if cores < QUIET_CORES:
            break
    return {"waited_s": time.perf_counter() - t0, "others_cores_before": cores}


def _errors(got: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """Max abs error, it over ``ref``'s max abs, and the relative Frobenius error."""
    diff = (got.float() - ref.float()).abs()
    scale = ref.float().abs().max().item()
    return {
        "max_abs": diff.max().item(),
        "max_rel": diff.max().item() / scale if scale else float("inf"),
        "rel_fro": ((got.float() - ref.float()).norm() / ref.float().norm()).item(),
    }


def reference(inputs: Path) -> dict[str, torch.Tensor]:
    """The fp32 reference (ours, ``backend="reference"``) on fp32 copies of the inputs."""
    inp = load_file(str(inputs))
    meta = json.loads(inputs.with_suffix(".json").read_text())
    spec = kk.ExpertSpec(meta["E"], meta["H"], meta["I"])
    weights = kk.ExpertWeights.from_parts(
        spec, kk.Dense(torch.float32), (inp.pop("gate_up").float(),), (inp.pop("down").float(),)
    )
    lora = _ours_lora(spec, {n: inp.pop(n).float() for n in LORA_NAMES})
    return _ours_grads(inp, weights, lora, "reference")


def check(ours: Path, upstream: Path, inputs: Path, with_reference: bool) -> dict:
    """Upstream against ours per tensor, and both against fp32 when ``with_reference``."""
    a, b = load_file(str(ours)), load_file(str(upstream))
    out: dict = {"upstream_vs_ours": {n: _errors(b[n], a[n]) for n in a}}
    if with_reference:
        ref = reference(inputs)
        out["ours_vs_fp32"] = {n: _errors(a[n], ref[n]) for n in a}
        out["upstream_vs_fp32"] = {n: _errors(b[n], ref[n]) for n in a}
    worst = max(v["rel_fro"] for v in out["upstream_vs_ours"].values())
    out["worst_rel_fro"] = worst
    out["agree"] = worst <= TOLERANCE_REL_FRO
    return out


def run_config(shape: str, tokens: int, args: argparse.Namespace, tmp: Path, seed: int = 0) -> dict:
    """Inputs once, then the correctness pair and the alternating timed children."""
    inputs = tmp / f"{shape}_{tokens}.safetensors"
    meta = write_inputs(inputs, shape, tokens, seed)
    gc.collect()
    h, i, e, k = SHAPES[shape]
    fl = _impls.flops(_impls.Shape(shape, h, i, e, k, RANK), tokens, True)
    cmds = {
        "ours": [
            sys.executable,
            str(HERE / "bench_upstream.py"),
            "--ours-weight-dtype",
            args.ours_weight_dtype,
            "--ours-child",
        ],
        "upstream": [args.upstream_python, str(HERE / "_upstream_child.py")],
    }
    runs: dict[str, list[dict]] = {"ours": [], "upstream": []}
    disturbed: dict[str, list[dict]] = {"ours": [], "upstream": []}
    correctness: dict | None = None
    saved = {n: tmp / f"{n}_out.safetensors" for n in cmds}
    for rnd in range(args.rounds):
        for name in ("ours", "upstream"):  # alternate: neither always runs second
            result = tmp / f"{name}.json"
            cmd = [*cmds[name], str(inputs), str(result), "--reps", str(args.reps)]
            if rnd == 0:
                cmd += ["--save", str(saved[name])]
            for attempt in range(args.retries + 1):
                quiet = wait_quiet(args.wait_quiet)
                r = {**run_child(cmd, result, args.child_timeout), **quiet}
                r["loadavg"] = tm.loadavg()
                print(
                    f"[{shape} T={tokens} round {rnd}] {name}: "
                    + (
                        f"{r['wall_ms']:.0f} ms, {r['cpu_s']:.2f} CPU-s, "
                        f"other processes {r['others_cores']:.2f} cores"
                        if "wall_ms" in r
                        else r["error"]
                    ),
                    flush=True,
                )
                if r.get("others_cores", 0.0) <= QUIET_CORES or attempt == args.retries:
                    break
                disturbed[name].append(r)  # kept in the JSON, left out of the medians
            runs[name].append(r)
        if rnd == 0:
            if not all(p.exists() for p in saved.values()):
                break  # a child failed: nothing to compare, no point timing further
            correctness = check(
                saved["ours"], saved["upstream"], inputs, tokens <= args.reference_tokens
            )
            print(
                f"[{shape} T={tokens}] upstream vs ours: worst rel Frobenius "
                f"{correctness['worst_rel_fro']:.2e} ({'agree' if correctness['agree'] else 'DIFFER'})",
                flush=True,
            )
    inputs.unlink()
    inputs.with_suffix(".json").unlink()
    for p in saved.values():
        p.unlink(missing_ok=True)
    row: dict = {
        **meta,
        "gflop": fl / 1e9,
        "runs": runs,
        "disturbed": disturbed,
        "correctness": correctness,
    }
    for name, rs in runs.items():
        ok = [r for r in rs if "wall_ms" in r]
        if ok:
            row[name] = {
                "wall_ms": statistics.median(r["wall_ms"] for r in ok),
                "cpu_s": statistics.median(r["cpu_s"] for r in ok),
                "peak_rss_bytes": max(r["peak_rss_bytes"] for r in ok),
                "rss_setup_bytes": max(r["rss_setup_bytes"] for r in ok),
            }
    # The most any child saw of other processes: a large value marks a disturbed row.
    row["others_cores_max"] = max(
        (r.get("others_cores", 0.0) for rs in runs.values() for r in rs), default=0.0
    )
    return row


def summarize(rows: list[dict], peak: float) -> None:
    """Add ratios and our share of the matmul peak to every row that has both sides."""
    for row in rows:
        o, u = row.get("ours"), row.get("upstream")
        if o:
            o["gflops"] = row["gflop"] / (o["wall_ms"] / 1e3)
            o["fraction_of_peak"] = o["gflops"] / peak
        if o and u:
            u["gflops"] = row["gflop"] / (u["wall_ms"] / 1e3)
            u["fraction_of_peak"] = u["gflops"] / peak
            row["wall_upstream_over_ours"] = u["wall_ms"] / o["wall_ms"]
            row["cpu_upstream_over_ours"] = u["cpu_s"] / o["cpu_s"]


def _gib(n: int | None) -> str:
    """``n`` bytes in GiB with two decimals, or a dash."""
    return "—" if n is None else f"{n / 2**30:.2f}"


def write_markdown(path: Path, meta: dict, rows: list[dict]) -> None:
    """The timing table, the correctness table and the set-up."""
    lines = [
        "# kt-kernel vs KTransformers kt-kernel 0.7.2 (forward+backward, bf16, LoRA r=16)",
        "",
        f"Date {meta['date']}; command `{meta['command']}`. {meta['threads']} threads per child "
        f"on {meta['cpus']} cores ({meta['isa']}, torch {meta['torch']}); ours kt_kernel "
        f"{meta['kt_kernel']}, upstream {meta['upstream_version']} "
        f"({meta.get('upstream_variant', '?')}, {meta.get('upstream_backend', '?')}). "
        f"{meta['rounds']} rounds of alternating child processes (ours, upstream), "
        f"{meta['reps']} timed steps after one warm-up in each; medians of the children's "
        f"medians. bf16 matmul peak {meta['peak_gflops']:.0f} GFLOP/s (start "
        f"{meta['peak_gflops_start']:.0f}, end {meta['peak_gflops_end']:.0f}). Load average "
        f"(1, 5, 15 min) at start {meta['loadavg_start']}, at end {meta['loadavg_end']}.",
        "",
        "| shape (H, I, E, k) | T | ours ms | upstream ms | ours CPU-s | upstream CPU-s "
        "| CPU-s upstream/ours | wall upstream/ours | ours % of peak | upstream % of peak "
        "| peak RSS ours GiB (set-up) | peak RSS upstream GiB (set-up) | other load, cores |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        o, u = r.get("ours", {}), r.get("upstream", {})
        name = f"{r['shape']} ({r['H']}, {r['I']}, {r['E']}, {r['k']})"
        if not o or not u:
            err = next((x.get("error") for x in r["runs"]["upstream"] if "error" in x), "")
            lines.append(f"| {name} | {r['T']} | {o.get('wall_ms', 0):.0f} | failed: {err} |")
            continue
        lines.append(
            f"| {name} | {r['T']} | {o['wall_ms']:.0f} | {u['wall_ms']:.0f} | {o['cpu_s']:.2f} "
            f"| {u['cpu_s']:.2f} | {r['cpu_upstream_over_ours']:.2f} "
            f"| {r['wall_upstream_over_ours']:.2f} | {100 * o['fraction_of_peak']:.0f} "
            f"| {100 * u['fraction_of_peak']:.0f} "
            f"| {_gib(o['peak_rss_bytes'])} ({_gib(o['rss_setup_bytes'])}) "
            f"| {_gib(u['peak_rss_bytes'])} ({_gib(u['rss_setup_bytes'])}) "
            f"| {r['others_cores_max']:.2f} |"
        )
    lines += [
        "",
        f"Children rerun because other processes used more than {QUIET_CORES} cores during "
        f"them (kept in the JSON under `disturbed`, left out of the medians): "
        f"{sum(len(v) for r in rows for v in r['disturbed'].values())}.",
        "",
        "Correctness (first round's warm-up step, same inputs): relative Frobenius error "
        "(max abs error / ours' max abs in brackets) of upstream against ours; both against "
        f"the fp32 reference where T <= {meta['reference_tokens']}. Agreement threshold "
        f"{TOLERANCE_REL_FRO:g} relative Frobenius.",
        "",
        "| shape | T | tensor | upstream vs ours | ours vs fp32 | upstream vs fp32 |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        c = r.get("correctness")
        if not c:
            continue
        for n, v in c["upstream_vs_ours"].items():
            refs = [
                f"{c[key][n]['rel_fro']:.2e}" if key in c else "—"
                for key in ("ours_vs_fp32", "upstream_vs_fp32")
            ]
            lines.append(
                f"| {r['shape']} | {r['T']} | {n} | {v['rel_fro']:.2e} ({v['max_rel']:.1e}) "
                f"| {refs[0]} | {refs[1]} |"
            )
        lines.append(
            f"| {r['shape']} | {r['T']} | **verdict** | "
            f"{'agree' if c['agree'] else 'DIFFER'} (worst {c['worst_rel_fro']:.2e}) | | |"
        )
    lines += [
        "",
        f"Ours: `moe_experts_forward` on `ExpertWeights` in "
        f"`{meta.get('ours_weight_dtype', 'bf16')}`, split bf16 LoRA (per-projection "
        "A and B, as upstream), policy save, native backend. Upstream: "
        "`kt_kernel.sft.amx.AMXSFTMoEWrapper(method='AMXBF16_SFT')`, `forward` + `backward`. "
        "CPU-s: process CPU time of one step (all threads). Peak RSS: the child's high-water "
        "mark over the steps (reset after set-up), expert weights included; in brackets its RSS "
        "once weights and adapter are in place. Other load: the most CPU other processes used "
        "(cores, averaged over a child's run) while any child of the row ran. % of peak: "
        "`_impls.flops` (base and LoRA, forward+backward) per wall second over the peak.",
        "",
    ]
    path.write_text("\n".join(lines))


def main() -> None:
    """Parse, skip without upstream, run every configuration, write the results."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--upstream-python",
        default=os.environ.get("KT_UPSTREAM_PYTHON"),
        help="python of the upstream venv (default: $KT_UPSTREAM_PYTHON)",
    )
    ap.add_argument("--out", type=Path, default=None, help="output directory")
    ap.add_argument("--quick", action="store_true", help="the smoke shape at T=64, one round")
    ap.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=None)
    ap.add_argument("--tokens", nargs="+", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=None, help="alternating (ours, upstream) pairs")
    ap.add_argument("--reps", type=int, default=3, help="timed steps per child")
    ap.add_argument("--reference-tokens", type=int, default=512, help="fp32 check up to this T")
    ap.add_argument("--child-timeout", type=float, default=900.0)
    ap.add_argument(
        "--wait-quiet", type=float, default=0.0, help="seconds to wait for idle cores per child"
    )
    ap.add_argument(
        "--retries", type=int, default=0, help="reruns of a child other processes disturbed"
    )
    ap.add_argument(
        "--ours-weight-dtype",
        default="bf16",
        choices=sorted(kk.FORMATS),
        help="our expert storage (bf16-packed: kt-kernel's own layout; upstream repacks too)",
    )
    ap.add_argument("--ours-child", nargs=2, type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--save", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.ours_child is not None:
        ours_child(*args.ours_child, args.reps, args.save, args.ours_weight_dtype)
        return
    if args.out is None:
        ap.error("--out is required")
    args.shapes = args.shapes or (["smoke"] if args.quick else DEFAULT_SHAPES)
    args.tokens = args.tokens or ([64] if args.quick else [512, 2048])
    args.rounds = args.rounds or (1 if args.quick else 2)
    version, why = upstream_version(args.upstream_python)
    if version != UPSTREAM_VERSION:
        reason = why or f"its kt_kernel is {version}, not {UPSTREAM_VERSION}"
        line = (
            f"bench_upstream: upstream baseline skipped ({reason}); make its venv with: {MAKE_VENV}"
        )
        print(line)
        # A note in DIR, so a results summary shows the baseline was skipped and why.
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_upstream.json").write_text(json.dumps({"skipped": reason}))
        (args.out / "bench_upstream.md").write_text(f"# kt-kernel vs KTransformers\n\n{line}\n")
        return
    torch.set_num_threads(THREADS)
    command = "python " + " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])
    meta: dict = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": command,
        **tm.machine(),
        "upstream_version": version,
        "rounds": args.rounds,
        "reps": args.reps,
        "reference_tokens": args.reference_tokens,
        "ours_weight_dtype": args.ours_weight_dtype,
        "loadavg_start": tm.loadavg(),
    }
    wait_quiet(args.wait_quiet)
    meta["peak_gflops_start"] = tm.matmul_peak(torch.bfloat16, 4096)
    print(f"bf16 matmul peak {meta['peak_gflops_start']:.0f} GFLOP/s", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_upstream_") as tmp:
        for shape in args.shapes:
            for tokens in args.tokens:
                rows.append(run_config(shape, tokens, args, Path(tmp)))
    wait_quiet(args.wait_quiet)
    meta["peak_gflops_end"] = tm.matmul_peak(torch.bfloat16, 4096)
    meta["peak_gflops"] = max(meta["peak_gflops_start"], meta["peak_gflops_end"])
    meta["loadavg_end"] = tm.loadavg()
    for r in rows:
        for u in r["runs"]["upstream"]:
            meta.setdefault("upstream_variant", u.get("cpu_variant"))
            if "backend_line" in u:
                meta.setdefault(
                    "upstream_backend", u["backend_line"].split("backend=")[-1].rstrip(")")
                )
    summarize(rows, meta["peak_gflops"])
    tm.write_results(
        args.out,
        "bench_upstream",
        {"meta": meta, "rows": rows},
        lambda p: write_markdown(p, meta, rows),
    )


if __name__ == "__main__":
    main()
