"""The LM-head losses' per-row elementwise work: the torch chain against ``kt_kernel.logit_rows``.

Two measurements, each alternating the two variants in this process ``--repeats`` times:

* ``chunk``: one ``[1024, 32000]`` bf16 logits chunk (``DEFAULT_CHUNK`` rows, the benchmark
  vocabulary) to its log-sum-exp, label logit and bf16 ``softmax - onehot``: the torch chain
  ``chunked_token_logprobs`` ran before (fp32 copy, ``logsumexp``, ``gather``, ``sub_``,
  ``exp_``, ``neg_``, ``scatter_add_``, cast to bf16) against the fused op, once returning a
  new gradient tensor and once writing into one reused ``out=`` buffer (as the losses do: a
  fresh 64 MB tensor costs page faults and zeroing on every call);
* ``logprobs``: ``chunked_token_logprobs`` forward + backward on ``[1920, 2048]`` bf16 hidden
  states and a frozen ``[32000, 2048]`` bf16 head (the policy pass of a DPO step at the
  Qwen3-30B-A3B layer width), the previous implementation (kept here verbatim as
  ``_OldLogProbs``) against the shipped one; the head matmuls are the same in both.

Reported: median and fastest seconds of each and the old/new ratio of the medians. Writes
``bench_logit_rows.json`` and ``.md`` under ``--out``.

Usage: ``python bench_logit_rows.py --out DIR [--repeats N] [--threads N]``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling modules
from _common import kernel_timing, write_results

ROWS, VOCAB, HIDDEN, TOKENS = 1024, 32000, 2048, 1920


def _old_chain(logits: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1)
    out = x.gather(1, y[:, None]).squeeze(1) - lse
    x.sub_(lse[:, None]).exp_().neg_()
    x.scatter_add_(1, y[:, None], torch.ones_like(lse)[:, None])
    return out, x.to(logits.dtype)


class _OldLogProbs(torch.autograd.Function):
    """``_ChunkedLogProbs`` before the fused op (frozen-head path), for the comparison."""

    @staticmethod
    def forward(
        ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int
    ) -> torch.Tensor:
        out = torch.empty(hidden.shape[0], dtype=torch.float32)
        grad_h = torch.empty_like(hidden)
        for start in range(0, hidden.shape[0], chunk):
            h = hidden[start : start + chunk]
            logits = h @ weight.t()
            out[start : start + chunk], g = _old_chain(logits, labels[start : start + chunk])
            torch.matmul(g, weight, out=grad_h[start : start + chunk])
        ctx.save_for_backward(grad_h)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (kept,) = ctx.saved_tensors
        return kept * grad_out.to(kept.dtype)[:, None], None, None, None


def _sample(fn: Callable[[], object]) -> Callable[[], tuple[float, float]]:
    def run() -> tuple[float, float]:
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        return time.perf_counter() - t0, time.process_time() - c0

    return run


def _alternate(old: Callable[[], object], new: Callable[[], object], repeats: int) -> dict:
    # kt-kernel's interleaved rounds: one warm-up each, then the order rotated every round.
    samples = kernel_timing().interleaved({"old": _sample(old), "new": _sample(new)}, repeats)
    a = [wall for wall, _ in samples["old"]]
    b = [wall for wall, _ in samples["new"]]
    return {
        "old_s_median": statistics.median(a),
        "old_s_min": min(a),
        "new_s_median": statistics.median(b),
        "new_s_min": min(b),
        "ratio_median": statistics.median(a) / statistics.median(b),
    }


def measure(repeats: int) -> list[dict[str, Any]]:
    """Time both measurements; one row each."""
    from kt_kernel import logit_rows
    from moe_experts.losses import chunked_token_logprobs

    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(ROWS, VOCAB, generator=g) * 3).to(torch.bfloat16)
    y = torch.randint(0, VOCAB, (ROWS,), generator=g)
    chunk = _alternate(lambda: _old_chain(logits, y), lambda: logit_rows(logits, y), repeats)
    buf = torch.empty_like(logits)  # what the losses do: one gradient buffer for every chunk
    reuse = _alternate(
        lambda: _old_chain(logits, y), lambda: logit_rows(logits, y, out=buf), repeats
    )
    hidden = (torch.randn(TOKENS, HIDDEN, generator=g)).to(torch.bfloat16)
    weight = (torch.randn(VOCAB, HIDDEN, generator=g) * 0.02).to(torch.bfloat16)
    labels = torch.randint(0, VOCAB, (TOKENS,), generator=g)
    up = torch.randn(TOKENS, generator=g)

    def step(fn: Callable[..., torch.Tensor]) -> Callable[[], object]:
        def run() -> object:
            h = hidden.detach().requires_grad_()
            return torch.autograd.grad((fn(h) * up).sum(), h)

        return run

    old = step(lambda h: _OldLogProbs.apply(h, weight, labels, ROWS))  # type: ignore[no-untyped-call]
    new = step(lambda h: chunked_token_logprobs(h, weight, labels, chunk_size=ROWS))
    logprobs = _alternate(old, new, repeats)
    return [
        {"what": f"chunk [{ROWS}, {VOCAB}] bf16: lse, label logit, grad", **chunk},
        {"what": "the same, new writing into a reused out= buffer", **reuse},
        {"what": f"chunked_token_logprobs fwd+bwd [{TOKENS}, {HIDDEN}] x V={VOCAB}", **logprobs},
    ]


def main() -> None:
    """Measure, write JSON and a markdown table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    rows = measure(args.repeats)
    command = "python " + " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])
    machine = (
        f"{platform.machine()}, {os.cpu_count()} CPUs, load average {load_before:.1f} before / "
        f"{os.getloadavg()[0]:.1f} after"
    )
    when = datetime.date.today().isoformat()
    meta = {
        "date": when,
        "machine": machine,
        "command": command,
        "repeats": args.repeats,
        "torch_threads": torch.get_num_threads(),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    write_results(
        args.out,
        "bench_logit_rows",
        meta,
        rows,
        f"LM-head loss elementwise work, torch chain (old) vs kt_kernel.logit_rows (new), "
        f"{args.repeats} alternating repeats, {torch.get_num_threads()} torch threads "
        f"({when}; {machine}; `{command}`)",
        ["what", "old s (median / min)", "new s (median / min)", "old / new (medians)"],
        lambda r: [
            r["what"],
            f"{r['old_s_median']:.4f} / {r['old_s_min']:.4f}",
            f"{r['new_s_median']:.4f} / {r['new_s_min']:.4f}",
            f"{r['ratio_median']:.2f}x",
        ],
    )


if __name__ == "__main__":
    main()
