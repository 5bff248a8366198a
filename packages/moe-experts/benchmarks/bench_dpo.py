"""A DPO step at Qwen3-30B-A3B layer sizes on the CPU: ours against TRL's DPOTrainer + PEFT.

Both sides build the same model from the same seed (bf16, random weights, ``_common.SHAPE``:
H=2048, I=768, E=128, k=8, V=32000) and train LoRA rank 16 on q/k/v/o, the routers and the
experts with AdamW on one preference pair whose two sequences hold ``--seq`` tokens each:

- ``ours``: experts on kt-kernel (``adapt_model``), the pair packed, log-probabilities over the
  head in chunks, the reference from the same model under ``adapters_disabled``;
- ``trl``: transformers' fused experts with a PEFT ``target_parameters`` adapter, stepped by
  TRL's ``DPOTrainer`` (its defaults, gradient checkpointing on; no MoE aux loss), whose
  reference is the adapter-free model too (``disable_adapter``).

Each side runs with the reference on the fly (one no-grad forward more per step) and
precomputed (``+pre``: the step reads stored values; the one-off reference pass is timed on its
own). Every (repetition, variant) runs in a fresh child process holding only its model, the
order alternating per repetition, so load from other processes hits each alike; the peak is
the child's resident memory sampled during its steps (the model included). The ratios to TRL
are of medians, and per repetition (each ``ours`` child against the TRL child of its round).

Usage: ``python bench_dpo.py --out DIR [--quick] [--layers 4] [--experts 128] [--seq 1024]
[--reps 1] [--steps 2] [--variants ours,ours+pre,trl,trl+pre]``.
Writes ``bench_dpo.json`` and ``bench_dpo.md`` (``bench_dpo_quick.*`` with ``--quick``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import threading
import time
import warnings
from datetime import date
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling _common module
from _common import DENSE, RANK, matmul_peak, shape, write_results

VARIANTS = ("ours", "ours+pre", "trl", "trl+pre")
PROMPT = 64  # prompt tokens of each sequence; the rest of --seq is the response


class _PeakRss:
    """This process's resident memory, sampled every 5 ms while running."""

    def __init__(self) -> None:
        import psutil

        self.proc = psutil.Process()
        self.peak = self.proc.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, self.proc.memory_info().rss)

    def __enter__(self) -> _PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _record(seq: int) -> dict[str, str]:
    """One pair of plain text: with the byte tokenizer, every character is one token."""
    gen = torch.Generator().manual_seed(1)

    def text(n: int) -> str:
        return "".join(chr(97 + int(i)) for i in torch.randint(0, 26, (n,), generator=gen))

    # BOS + prompt + response + EOS = seq tokens for each side.
    return {
        "prompt": text(PROMPT - 1),
        "chosen": text(seq - PROMPT - 1),
        "rejected": text(seq - PROMPT - 1),
    }


def _step_gflop(cfg: dict[str, Any], layers: int, seq: int, reference: bool) -> float:
    """The matmul work (GFLOP) a DPO step cannot avoid: forwards, backward to the inputs only.

    Per forward over the pair's ``2 seq`` tokens: q/k/v/o, the router, ``k`` experts' gate, up
    and down, causal attention (``QK^T`` and ``PV`` below the diagonal) and the head over the
    scored response rows. Backward: the same products once more (the input gradients of the
    frozen weights; attention's four products count twice its forward two), nothing recomputed.
    LoRA's rank-16 products are left out (under 3%): a lower bound for every implementation.
    """
    h, heads, d = cfg["hidden_size"], cfg["num_attention_heads"], cfg["head_dim"]
    kv, e, k, i, v = (
        cfg["num_key_value_heads"], cfg["num_experts"], cfg["num_experts_per_tok"],
        cfg["moe_intermediate_size"], cfg["vocab_size"],
    )  # fmt: skip
    t, rows = 2 * seq, 2 * (seq - PROMPT)
    dense = 2 * t * h * (2 * heads * d + 2 * kv * d + e)  # q and o, k and v, the router
    experts = 2 * t * k * 3 * h * i
    attention = 2 * 2 * heads * d * seq * (seq + 1) / 2  # two sequences, causal
    head = 2 * rows * h * v
    forward = layers * (dense + experts + attention) + head
    backward = forward + layers * attention  # attention's backward is twice its forward
    return (forward * (2 if reference else 1) + backward) / 1e9


def _model(cfg: dict[str, Any], layers: int) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    from moe_experts.testing import tiny_config

    torch.manual_seed(0)
    config = tiny_config("qwen3_moe", **cfg, num_hidden_layers=layers)
    lm = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    for p in lm.parameters():
        p.requires_grad_(False)
    return lm


def _ours(variant: str, cfg: dict[str, Any], layers: int, seq: int, steps: int) -> dict[str, Any]:
    import moe_experts
    from lora_core import LoraConfig
    from moe_experts.finetune.formats import PreferenceFormat
    from moe_experts.finetune.preference import DPOObjective, reference_logps
    from moe_experts.finetune.preference_data import PreferenceBatches, tokenize_pairs
    from moe_experts.finetune.tokenizer import build_byte_tokenizer
    from moe_experts.memory import reuse_freed_host_memory, trim_host_heap

    lm = _model(cfg, layers)
    lora = LoraConfig(
        enable=True,
        rank=RANK,
        alpha=2 * RANK,
        target_modules=DENSE,
        target_parameters=["mlp.gate.weight"],
    )
    result = moe_experts.adapt_model(lm, lora, weight_dtype="bf16")
    trim_host_heap()  # the transformers expert tensors freed by wrap go back to the system
    reuse_freed_host_memory()  # as run_finetune does before the first step
    lm.train()
    sample = PreferenceFormat().parse(_record(seq))
    pairs, _ = tokenize_pairs(Path("bench"), [sample], build_byte_tokenizer(), max_tokens=seq)
    batches = PreferenceBatches(tuple(pairs), 1, 0, seq - 1)
    ref_s = None
    if variant == "ours+pre":
        start = time.perf_counter()
        batches = batches.with_reference(reference_logps(lm, batches.chunks(1), 1))
        ref_s = time.perf_counter() - start
    batch = batches.model_batch(0)
    objective = DPOObjective()
    opt = torch.optim.AdamW(result.parameters(), lr=1e-5)

    def step() -> None:
        parts = objective.loss(lm, batch, objective.totals(batch))
        parts.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return _time(step, steps, ref_s, tokens=batch.num_tokens)


def _trl(variant: str, cfg: dict[str, Any], layers: int, seq: int, steps: int) -> dict[str, Any]:
    import peft
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    from moe_experts.finetune.tokenizer import build_byte_tokenizer

    lm = _model(cfg, layers)
    tok = build_byte_tokenizer()
    pre = variant == "trl+pre"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = DPOTrainer(
            model=lm,
            args=DPOConfig(
                output_dir="/tmp/bench_dpo_trl",
                per_device_train_batch_size=1,
                report_to=[],
                use_cpu=True,
                max_length=None,
                router_aux_loss_coef=0.0,
                precompute_ref_log_probs=pre,
                learning_rate=1e-5,
            ),
            train_dataset=Dataset.from_list([_record(seq)]),
            processing_class=tok,
            peft_config=peft.LoraConfig(
                r=RANK,
                lora_alpha=2 * RANK,
                target_modules=DENSE,
                target_parameters=[
                    "mlp.gate.weight",
                    "mlp.experts.gate_up_proj",
                    "mlp.experts.down_proj",
                ],
            ),
        )
    model = trainer.model
    model.train()
    batch = next(iter(trainer.get_train_dataloader()))
    ref_s = None
    if pre:  # TRL computed it in __init__; time the same pass once more for the record
        start = time.perf_counter()
        trainer.compute_ref_log_probs(model, batch)
        ref_s = time.perf_counter() - start
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)

    def step() -> None:
        loss = trainer.compute_loss(model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    tokens = int(batch["attention_mask"].sum())
    return _time(step, steps, ref_s, tokens=tokens)


def _time(step: Any, steps: int, ref_s: float | None, tokens: int) -> dict[str, Any]:
    step()  # warm-up (allocations, kernel selection)
    times = []
    with _PeakRss() as rss:
        for _ in range(steps):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
    step_s = statistics.median(times)
    return {
        "matmul_peak_gflops": matmul_peak(),
        "step_s": step_s,
        "steps_s": times,
        "tokens": tokens,
        "tokens_per_s": tokens / step_s,
        "peak_rss_gib": rss.peak / 2**30,
        "reference_pass_s": ref_s,
        "load_avg": os.getloadavg()[0],
    }


def _child(args: argparse.Namespace) -> None:
    torch.set_num_threads(os.cpu_count() or 1)
    cfg = json.loads(args.cfg)
    run = _ours if args.child.startswith("ours") else _trl
    out = run(args.child, cfg, args.layers, args.seq, args.steps)
    Path(args.result).write_text(json.dumps(out))


def main() -> None:
    """Run the children, then write the JSON and the Markdown table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    p.add_argument("--quick", action="store_true", help="16 experts, 2 layers, T=256")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=None, help="override E (default: the shape's)")
    p.add_argument("--seq", type=int, default=1024, help="tokens per sequence")
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--steps", type=int, default=2, help="timed steps per child (after 1 warm-up)")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--cfg", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        _child(args)
        return
    cfg = dict(shape(args.quick))
    if args.quick:
        args.layers, args.seq = 2, 256
    if args.experts:
        cfg["num_experts"] = args.experts
    variants = args.variants.split(",")
    args.out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    for rep in range(args.reps):
        order = variants if rep % 2 == 0 else variants[::-1]
        for v in order:
            result = args.out / f".bench_dpo_{v.replace('+', '_')}.json"
            cmd = [
                sys.executable, __file__, "--child", v, "--cfg", json.dumps(cfg),
                "--layers", str(args.layers), "--seq", str(args.seq), "--steps",
                str(args.steps), "--result", str(result),
            ]  # fmt: skip
            print(f"rep {rep} {v} ...", file=sys.stderr, flush=True)
            subprocess.run(cmd, check=True)
            runs[v].append(json.loads(result.read_text()))
            result.unlink()
            # Every finished child on disk at once: a later child's crash (the OOM killer, a
            # TRL child near the machine's memory) must not lose the rounds already timed.
            (args.out / "bench_dpo_children.json").write_text(json.dumps(runs, indent=1))
    rows = []
    for v in variants:
        rs = runs[v]
        step = statistics.median(r["step_s"] for r in rs)
        ref = [r["reference_pass_s"] for r in rs if r["reference_pass_s"] is not None]
        rows.append(
            {
                "variant": v,
                "step_s": step,
                "tokens_per_s": rs[0]["tokens"] / step,
                "peak_rss_gib": max(r["peak_rss_gib"] for r in rs),
                "reference_pass_s": statistics.median(ref) if ref else None,
                "load_avg": [r["load_avg"] for r in rs],
                "runs": rs,
            }
        )
    base = {r["variant"]: r for r in rows}
    for r in rows:
        twin = base.get(r["variant"].replace("ours", "trl"))
        r["x_trl_tokens_per_s"] = r["tokens_per_s"] / twin["tokens_per_s"] if twin else None
        r["x_trl_peak"] = r["peak_rss_gib"] / twin["peak_rss_gib"] if twin else None
        # Each child against its round's TRL child: alternating rounds share the load.
        r["x_trl_per_rep"] = (
            [
                o["tokens_per_s"] / t["tokens_per_s"]
                for o, t in zip(r["runs"], twin["runs"], strict=True)
            ]
            if twin and r["variant"].startswith("ours")
            else None
        )
        # The fraction of the machine's bf16 matmul peak (measured in the same child) that the
        # step's unavoidable matmul work reaches, and the ratio to TRL a step at 100% would give.
        r["gflop"] = _step_gflop(cfg, args.layers, args.seq, not r["variant"].endswith("+pre"))
        r["matmul_peak_gflops"] = statistics.median(x["matmul_peak_gflops"] for x in r["runs"])
        r["fraction_of_peak"] = r["gflop"] / (r["step_s"] * r["matmul_peak_gflops"])
        floor_s = r["gflop"] / r["matmul_peak_gflops"]
        r["x_trl_at_peak"] = twin["step_s"] / floor_s if twin else None
    meta = {
        "date": date.today().isoformat(),
        "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs, "
        f"load average {os.getloadavg()[0]:.1f} at the end",
        "command": shlex.join(["python", "bench_dpo.py", *sys.argv[1:]]),
        "config": {**cfg, "layers": args.layers, "seq": args.seq, "rank": RANK},
        "torch": torch.__version__,
    }
    stem = "bench_dpo_quick" if args.quick else "bench_dpo"
    title = (
        f"# DPO step: ours vs TRL DPOTrainer + PEFT ({meta['date']})\n\n"
        f"Qwen3-MoE, {args.layers} layers, H={cfg['hidden_size']}, E={cfg['num_experts']}, "
        f"k={cfg['num_experts_per_tok']}, I={cfg['moe_intermediate_size']}, "
        f"V={cfg['vocab_size']}, bf16, LoRA rank {RANK} on q/k/v/o + router + experts; one pair, "
        f"T={args.seq} per sequence; {meta['machine']}.\nCommand: `{meta['command']}`. "
        "`+pre`: reference log-probs precomputed (the one-off pass is timed alone). `x TRL per "
        "rep`: each child's tokens/s over its round's TRL child's. "
        "`matmul GFLOP`: the products a step cannot avoid (`_step_gflop`); `% of peak`: that "
        "work over the step time and the same child's bf16 matmul peak; `x TRL at 100% of "
        "peak`: the ratio a step doing that work at the peak would reach."
    )

    def fmt(x: float | None, spec: str) -> str:
        return "-" if x is None else format(x, spec)

    write_results(
        args.out,
        stem,
        meta,
        rows,
        title,
        ["variant", "step (s)", "tokens/s", "x TRL tokens/s", "x TRL per rep", "peak RSS (GiB)",
         "x TRL peak",
         "reference pass (s)", "matmul GFLOP", "bf16 peak (GFLOP/s)", "% of peak",
         "x TRL at 100% of peak"],
        lambda r: [
            r["variant"], f"{r['step_s']:.2f}", f"{r['tokens_per_s']:.0f}",
            fmt(r["x_trl_tokens_per_s"], ".2f"),
            " / ".join(f"{x:.2f}" for x in r["x_trl_per_rep"]) if r["x_trl_per_rep"] else "-",
            f"{r['peak_rss_gib']:.2f}",
            fmt(r["x_trl_peak"], ".2f"), fmt(r["reference_pass_s"], ".2f"),
            f"{r['gflop']:.0f}", f"{r['matmul_peak_gflops']:.0f}",
            f"{100 * r['fraction_of_peak']:.0f}%", fmt(r["x_trl_at_peak"], ".2f"),
        ],
    )  # fmt: skip
    (args.out / "bench_dpo_children.json").unlink(missing_ok=True)  # all in the results now


if __name__ == "__main__":
    main()
