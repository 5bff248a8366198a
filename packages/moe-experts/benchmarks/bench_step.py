"""Training-step tokens/s at Qwen3-30B-A3B layer dimensions: ours vs transformers + PEFT.

One process holds both models built from the same seed (same weights): transformers 5 fused
experts + PEFT ``target_parameters`` (``peft``), and ``moe_experts.adapt_model`` on kernel
storage of the bf16 experts (``--weight-dtype``, default ``auto`` as for users: bf16-packed where
kt-kernel runs its products, else bf16), stepped with the plain fp32 cross-entropy over full logits (``ours``) and with
:func:`moe_experts.losses.chunked_lm_cross_entropy` (``ours+chunked``). LoRA rank 16 on
q/k/v/o, the routers and the experts; AdamW. Repetitions are interleaved (peft, ours,
ours+chunked, peft, ...) so that load from other processes hits every variant alike, and
ratios are taken per repetition before the median. Each step's wall time and this process's
CPU time are both recorded (with the load average per repetition): on a shared machine the CPU
time ratio is the steadier of the two.

A profiled step of each variant splits the time into experts, attention (SDPA forward and
backward), q/k/v/o, router, lm_head, loss, optimizer and the rest: forward ops are labelled
by the module that ran them, backward ops by the forward op they differentiate (autograd's
sequence number), and each op's self time is counted once.

``--isolate`` runs every (repetition, variant) in a fresh child process holding only that
variant's model, alternating the order per repetition (ABBA): PEFT's step was measured 1.5-2x
slower whenever other models were resident in the same process (another PEFT model did the
same, a tiny model did not), which flatters ours in the one-process comparison.

``--variants ours,ours/sdpa`` compares ours with kt-kernel's causal attention (``adapt_model``'s
default on the CPU) and with transformers' SDPA kept (``kernel_attention=False``).

Usage: ``python bench_step.py --out DIR [--quick] [--lengths 512,2048] [--reps N]
[--variants V1,V2] [--isolate]``.
Writes ``bench_step.json`` and ``bench_step.md``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling _common module
from _common import DENSE, RANK

FULL = {
    "num_hidden_layers": 2,
    "hidden_size": 2048,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 768,
    "intermediate_size": 6144,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "initializer_range": 0.02,
}
QUICK = {
    **FULL,
    "hidden_size": 256,
    "num_experts": 16,
    "num_experts_per_tok": 4,
    "moe_intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 4096,
}
# ours/sdpa: ours with transformers' SDPA kept (adapt_model(kernel_attention=False)) instead of
# kt-kernel's causal attention, to measure what the attention op changes in a whole step.
# ours+chunked/torch-norms: ours+chunked with transformers' RMSNorm modules kept
# (adapt_model(kernel_norms=False)) instead of kt-kernel's fused norm.
VARIANTS = ("peft", "ours", "ours+chunked", "ours/sdpa", "ours+chunked/torch-norms")
# Expert storage for ours' variants by default (``--weight-dtype``): what users get, "auto"
# (bf16-packed where kt-kernel runs its products). PEFT keeps transformers' bf16 experts.
DEFAULT_WEIGHT_DTYPE = "auto"
CATEGORIES = ("experts", "attention", "qkvo", "router", "lm_head", "loss", "optimizer", "rest")


def _label_modules(lm: torch.nn.Module) -> None:
    """Run each interesting module's forward inside a ``record_function`` range."""
    for name, mod in lm.named_modules():
        leaf = name.rpartition(".")[2]
        cat = (
            "qkvo"
            if leaf in DENSE
            else "router"
            if name.endswith("mlp.gate")
            else "experts"
            if name.endswith("mlp.experts")
            else "lm_head"
            if leaf == "lm_head"
            else None
        )
        if cat is None:
            continue
        fwd = mod.forward

        def labelled(*a: Any, _f: Callable = fwd, _c: str = cat, **k: Any) -> Any:
            with torch.profiler.record_function(f"cat::{_c}"):
                return _f(*a, **k)

        mod.forward = labelled


def build(
    variant: str, cfg: Any, weight_dtype: str
) -> tuple[torch.nn.Module, torch.nn.Module, list]:
    """Return (causal LM to call, module whose ``.model``/``.lm_head`` we use, LoRA params)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    # A copy: adapt_model switches the attention implementation on the model's config.
    lm = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), dtype=torch.bfloat16)
    for p in lm.parameters():
        p.requires_grad_(False)
    if variant == "peft":
        import peft

        model = peft.get_peft_model(
            lm,
            peft.LoraConfig(
                r=RANK,
                lora_alpha=2 * RANK,
                target_modules=DENSE,
                target_parameters=[
                    "mlp.experts.gate_up_proj",
                    "mlp.experts.down_proj",
                    "mlp.gate.weight",
                ],
            ),
        )
        params = [p for p in model.parameters() if p.requires_grad]
    else:
        import moe_experts
        from lora_core import LoraConfig

        model = lm
        cfg_l = LoraConfig(
            enable=True,
            rank=RANK,
            alpha=2 * RANK,
            target_modules=DENSE,
            target_parameters=list(moe_experts.router_targets(lm)),
        )
        result = moe_experts.adapt_model(
            lm,
            cfg_l,
            weight_dtype=weight_dtype,
            kernel_attention=variant != "ours/sdpa",
            kernel_norms=variant != "ours+chunked/torch-norms",
        )
        want = "sdpa" if variant == "ours/sdpa" else moe_experts.KERNEL_ATTENTION
        if lm.config._attn_implementation != want:
            raise RuntimeError(f"{variant} runs {lm.config._attn_implementation}, not {want}")
        params = result.parameters()
    with torch.no_grad():
        for p in params:  # non-zero B so that every LoRA matmul does real work
            p.normal_(0, 0.02)
    return model, lm, list(params)


def make_step(
    variant: str, model: torch.nn.Module, lm: torch.nn.Module, opt: torch.optim.Optimizer
) -> Callable[[torch.Tensor], float]:
    """One training step (forward, loss, backward, AdamW) on ``ids [1, T]``; returns the loss."""
    from moe_experts.losses import chunked_lm_cross_entropy

    def step(ids: torch.Tensor) -> float:
        opt.zero_grad(set_to_none=True)
        labels = ids[:, 1:]
        if variant.startswith("ours+chunked"):
            hidden = lm.model(input_ids=ids).last_hidden_state[:, :-1]
            with torch.profiler.record_function("cat::loss"):
                loss = chunked_lm_cross_entropy(hidden, lm.lm_head.weight, labels)
        else:
            logits = model(input_ids=ids).logits[:, :-1]
            with torch.profiler.record_function("cat::loss"):
                loss = torch.nn.functional.cross_entropy(
                    logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1)
                )
        loss.backward()
        with torch.profiler.record_function("cat::optimizer"):
            opt.step()
        return loss.item()

    return step


def _category(ev: Any) -> str | None:
    name = ev.name
    if name.startswith("cat::"):
        return name[5:]
    if (
        "scaled_dot_product" in name
        or "ScaledDotProduct" in name
        or name.startswith("kt_kernel::attention")
        or "NativeCausalAttention" in name
    ):
        return "attention"
    return None


def profile_step(step: Callable[[torch.Tensor], float], ids: torch.Tensor) -> dict[str, float]:
    """Seconds of self time per category in one profiled step."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step(ids)
    events = prof.events()
    seq_cat: dict[int, str] = {}
    own: dict[int, str] = {}
    for ev in events:  # forward: the innermost labelled range or SDPA op wins
        cat, node = None, ev
        while node is not None:
            cat = _category(node)
            if cat is not None:
                break
            node = node.cpu_parent
        if cat is not None:
            own[id(ev)] = cat
            if ev.sequence_nr >= 0 and not ev.name.startswith("autograd::"):
                seq_cat.setdefault(ev.sequence_nr, cat)
    totals: dict[str, float] = defaultdict(float)
    for ev in events:
        cat = own.get(id(ev))
        if cat is None:  # backward: the autograd node's sequence number names its forward op
            node = ev
            while node is not None and cat is None:
                if node.name.startswith("autograd::engine::evaluate_function"):
                    cat = seq_cat.get(node.sequence_nr)
                    if "ScaledDotProduct" in node.name:
                        cat = "attention"
                node = node.cpu_parent
        totals[cat or "rest"] += ev.self_cpu_time_total / 1e6
    return {c: totals.get(c, 0.0) for c in CATEGORIES}


def run(
    quick: bool,
    lengths: list[int],
    reps: int,
    do_profile: bool,
    variants: tuple[str, ...] = VARIANTS,
    weight_dtype: str = DEFAULT_WEIGHT_DTYPE,
) -> dict:
    """Build all variants, time interleaved steps at each length, profile one step each."""
    from moe_experts.testing import tiny_config

    warnings.filterwarnings("ignore")
    shape = QUICK if quick else FULL
    cfg = tiny_config("qwen3_moe", **shape)
    cfg._attn_implementation = "sdpa"
    steps: dict[str, Callable] = {}
    built: dict[str, tuple] = {}
    for variant in variants:
        if variant == "ours+chunked" and "ours" in built:
            model, lm, params = built["ours"]
        else:
            model, lm, params = build(variant, cfg, weight_dtype)
            _label_modules(lm)
            built[variant] = (model, lm, params)
        opt = torch.optim.AdamW(params, lr=1e-5)
        steps[variant] = make_step(variant, model, lm, opt)
    out: dict[str, Any] = {"lengths": {}}
    for t in lengths:
        ids = torch.randint(0, cfg.vocab_size, (1, t), generator=torch.Generator().manual_seed(t))
        times: dict[str, list[float]] = {v: [] for v in variants}
        cpu: dict[str, list[float]] = {v: [] for v in variants}
        load: list[float] = []
        losses: dict[str, float] = {}
        for v in variants:  # warm-up: allocator, oneDNN primitives, AdamW state
            losses[v] = steps[v](ids)
        for _ in range(reps):
            load.append(os.getloadavg()[0])
            for v in variants:
                t0, c0 = time.perf_counter(), time.process_time()
                steps[v](ids)
                times[v].append(time.perf_counter() - t0)
                cpu[v].append(time.process_time() - c0)
        # CPU time of this process: less exposed than wall time to other jobs taking the
        # shared cores (not to their cache and memory-bandwidth pressure)
        res: dict[str, Any] = {
            "first_loss": losses,
            "step_s": times,
            "step_cpu_s": cpu,
            "loadavg_per_rep": load,
        }
        _ratios(res, variants, t)
        if do_profile:
            res["profile_s"] = {v: profile_step(steps[v], ids) for v in variants}
        out["lengths"][str(t)] = res
    out["torch_threads"] = torch.get_num_threads()
    out["variants"] = list(variants)
    return out


def _ratios(res: dict[str, Any], variants: tuple[str, ...], length: int) -> None:
    """Per-repetition wall and CPU ratios against the baseline, medians, into ``res``."""
    times, cpu = res["step_s"], res["step_cpu_s"]
    res["step_s_median"] = {v: statistics.median(x) for v, x in times.items()}
    res["tokens_per_s"] = {v: length / s for v, s in res["step_s_median"].items()}
    # Without peft the ratios are against the first variant run (plain "ours" if present).
    base_name = "peft" if "peft" in times else "ours" if "ours" in times else variants[0]
    base = times[base_name]
    res[f"speedup_vs_{base_name}"] = {
        v: statistics.median(p / o for p, o in zip(base, times[v], strict=True)) for v in variants
    }
    res[f"cpu_speedup_vs_{base_name}"] = {
        v: statistics.median(p / o for p, o in zip(cpu[base_name], cpu[v], strict=True))
        for v in variants
    }
    if "ours" in times and "ours+chunked" in times:
        res["chunked_vs_plain_loss"] = statistics.median(
            a / b for a, b in zip(times["ours"], times["ours+chunked"], strict=True)
        )
        res["chunked_vs_plain_loss_cpu"] = statistics.median(
            a / b for a, b in zip(cpu["ours"], cpu["ours+chunked"], strict=True)
        )


def run_isolated(
    quick: bool, lengths: list[int], reps: int, variants: tuple[str, ...], weight_dtype: str
) -> dict:
    """Each (repetition, variant) in its own child process, order alternating per repetition."""
    out: dict[str, Any] = {"lengths": {}, "isolated": True}
    res = {
        t: {
            "step_s": {v: [] for v in variants},
            "step_cpu_s": {v: [] for v in variants},
            "loadavg_per_rep": [],
            "first_loss": {},
        }
        for t in lengths
    }
    for rep in range(reps):
        order = variants if rep % 2 == 0 else variants[::-1]
        for v in order:
            cmd = [
                sys.executable,
                __file__,
                "--out",
                "-",
                "--child",
                v,
                "--lengths",
                ",".join(map(str, lengths)),
                "--weight-dtype",
                weight_dtype,
                *(["--quick"] if quick else []),
            ]
            load = os.getloadavg()[0]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                raise SystemExit(
                    f"the {v} child failed ({done.returncode}):\n{done.stderr[-3000:]}"
                )
            child = json.loads(done.stdout.strip().splitlines()[-1])
            print(
                f"rep {rep + 1} {v}: "
                + ", ".join(
                    f"T={t} {child['lengths'][str(t)]['step_s'][v][0]:.2f} s" for t in lengths
                ),
                file=sys.stderr,
            )
            for t in lengths:
                c = child["lengths"][str(t)]
                res[t]["step_s"][v] += c["step_s"][v]
                res[t]["step_cpu_s"][v] += c["step_cpu_s"][v]
                res[t]["first_loss"][v] = c["first_loss"][v]
                res[t]["loadavg_per_rep"].append(load)
            out["torch_threads"] = child["torch_threads"]
    for t in lengths:
        _ratios(res[t], variants, t)
        out["lengths"][str(t)] = res[t]
    out["variants"] = list(variants)
    return out


def _markdown(payload: dict) -> str:
    m = payload["model"]
    lines = [
        f"# moe-experts training step vs transformers + PEFT ({payload['mode']})",
        "",
        f"Qwen3-MoE, {m['num_hidden_layers']} layers, H={m['hidden_size']}, "
        f"E={m['num_experts']}, k={m['num_experts_per_tok']}, I={m['moe_intermediate_size']}, "
        f"V={m['vocab_size']}, bf16 (ours' experts: {payload.get('weight_dtype', 'bf16')}), "
        f"LoRA rank {RANK} on q/k/v/o + router + experts; "
        f"{payload['torch_threads']} threads, load average {payload['loadavg']}"
        + (
            "; each variant and repetition in its own process."
            if payload.get("isolated")
            else "; all variants in one process."
        ),
        "",
        "| T | variant | step (s) | tokens/s | x baseline (peft, else ours, else the first variant) "
        "| step CPU (s) | x baseline, CPU time |",
        "|---|---|---|---|---|---|---|",
    ]
    vs = payload["variants"]
    for t, r in payload["lengths"].items():
        ratio = next(x for k, x in r.items() if k.startswith("speedup_vs_"))
        cratio = next((x for k, x in r.items() if k.startswith("cpu_speedup_vs_")), {})
        for v in vs:
            c_s = r.get("step_cpu_s", {}).get(v)
            c_cell = f"{statistics.median(c_s):.2f}" if c_s else "-"
            c_ratio = f"{cratio[v]:.2f}" if v in cratio else "-"
            lines.append(
                f"| {t} | {v} | {r['step_s_median'][v]:.2f} | "
                f"{r['tokens_per_s'][v]:.0f} | {ratio[v]:.2f} | {c_cell} | {c_ratio} |"
            )
    for t, r in payload["lengths"].items():
        if "profile_s" not in r:
            continue
        lines += [
            "",
            f"Profile of one step at T={t} (seconds of op self time, share):",
            "",
            "| category | " + " | ".join(vs) + " |",
            "|---" * (len(vs) + 1) + "|",
        ]
        tot = {v: sum(r["profile_s"][v].values()) for v in vs}
        for c in CATEGORIES:
            cells = [
                f"{r['profile_s'][v][c]:.2f} ({100 * r['profile_s'][v][c] / tot[v]:.0f}%)"
                for v in vs
            ]
            lines.append(f"| {c} | " + " | ".join(cells) + " |")
        lines.append("| total | " + " | ".join(f"{tot[v]:.2f}" for v in vs) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    """Parse arguments, run the benchmark, write JSON and markdown."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="directory for JSON + markdown")
    parser.add_argument("--quick", action="store_true", help="small model, T=128 (<1 min)")
    parser.add_argument("--lengths", help="comma-separated sequence lengths (default 512,2048)")
    parser.add_argument("--reps", type=int, help="timed steps per variant and length")
    parser.add_argument(
        "--variants",
        default=",".join(VARIANTS[:3]),
        help="comma-separated subset of " + ",".join(VARIANTS),
    )
    parser.add_argument("--no-profile", action="store_true", help="skip the profiled steps")
    parser.add_argument(
        "--isolate",
        action="store_true",
        help="each variant and repetition in its own process (no profile)",
    )
    parser.add_argument(
        "--weight-dtype",
        default=DEFAULT_WEIGHT_DTYPE,
        help="kernel expert storage for ours' variants (auto, bf16, bf16-packed, int8, ...)",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)  # one variant, one timed step
    args = parser.parse_args()
    lengths = [int(x) for x in (args.lengths or ("128" if args.quick else "512,2048")).split(",")]
    reps = args.reps or (2 if args.quick else 3)
    load0 = os.getloadavg()[0]
    if args.child:
        print(json.dumps(run(args.quick, lengths, 1, False, (args.child,), args.weight_dtype)))
        return
    variants = tuple(v for v in VARIANTS if v in args.variants.split(","))
    if args.isolate:
        result = run_isolated(args.quick, lengths, reps, variants, args.weight_dtype)
    else:
        result = run(args.quick, lengths, reps, not args.no_profile, variants, args.weight_dtype)
    from moe_experts.storage import StoragePlan

    # The model's experts are bf16, so "auto" resolves as for a bf16 checkpoint.
    storage = StoragePlan.resolve(args.weight_dtype, source_dtype=torch.bfloat16).weight_dtype
    payload = {
        "benchmark": "moe-experts/bench_step",
        "mode": "quick" if args.quick else "full",
        "model": {"family": "qwen3_moe", **(QUICK if args.quick else FULL)},
        "lora_rank": RANK,
        "weight_dtype": storage,
        "loadavg": f"{load0:.1f} -> {os.getloadavg()[0]:.1f}",
        **result,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_step.json").write_text(json.dumps(payload, indent=2))
    text = _markdown(payload)
    (args.out / "bench_step.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
