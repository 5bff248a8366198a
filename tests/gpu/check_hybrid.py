"""GPU check (run by hand on a machine with CUDA, < 5 min): dense layers on the GPU, experts on
the CPU kernel, one training step against the all-CPU step.

Builds a Qwen3-MoE model (H=1024, E=32, 4 layers, bf16), saves it, loads it twice with
``moe_experts.load_pretrained`` (``dense_device="cpu"`` and ``"cuda"``), puts expert LoRA on
both with ``moe_experts.adapt`` (rank 8, B filled so gradients reach A), runs one forward and
backward on the same batch and compares the loss and every expert LoRA gradient within bf16
tolerance; then times a few hybrid steps and prints tokens/s. Exit status 1 on a mismatch.

Usage: ``python tests/gpu/check_hybrid.py [--seq 512] [--steps 3]``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time

import torch


def main() -> int:
    """Run the comparison; print a summary line per check."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 0
    from transformers import AutoModelForCausalLM

    import moe_experts
    from lora_core import LoraConfig
    from moe_experts.testing import tiny_config

    cfg = tiny_config("qwen3_moe", hidden_size=1024, moe_intermediate_size=256, num_experts=32,
                      num_experts_per_tok=4, num_hidden_layers=4, intermediate_size=2048,
                      head_dim=64, num_attention_heads=16, num_key_value_heads=4,
                      vocab_size=4096, max_position_embeddings=args.seq)
    torch.manual_seed(0)
    path = tempfile.mkdtemp(prefix="check-hybrid-")
    AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(path)
    lora = LoraConfig(enable=True, rank=8, alpha=16, init_seed=3)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (1, args.seq), generator=gen)

    def step(device: str) -> tuple[float, dict[str, torch.Tensor], torch.nn.Module, list]:
        model = moe_experts.load_pretrained(path, weight_dtype="bf16", dtype=torch.bfloat16,
                                            dense_device=device)
        result = moe_experts.adapt(model, lora)
        params = [p for _, p in result.named_optimizer_parameters]
        with torch.no_grad():
            for n, p in result.named_optimizer_parameters:
                if "lora_b" in n:  # B starts at zero; a fixed fill makes A's gradient non-zero
                    p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(5)) * 0.01)
        model.train()
        x = ids.to(device)
        loss = model(x, labels=x).loss
        loss.backward()
        grads = {n: p.grad.detach().float().cpu() for n, p in result.named_optimizer_parameters}
        return float(loss), grads, model, params

    loss_cpu, grads_cpu, _, _ = step("cpu")
    loss_gpu, grads_gpu, model, params = step("cuda")
    ok = abs(loss_cpu - loss_gpu) <= 2e-2 * abs(loss_cpu)
    print(f"loss cpu {loss_cpu:.5f} hybrid {loss_gpu:.5f} {'OK' if ok else 'MISMATCH'}")
    for n, g in grads_cpu.items():
        rel = float((grads_gpu[n] - g).norm() / g.norm().clamp_min(1e-30))
        good = rel <= 5e-2
        ok &= good
        print(f"grad {n}: relative difference {rel:.3e} {'OK' if good else 'MISMATCH'}")
    opt = torch.optim.AdamW(params, lr=1e-4)
    x = ids.cuda()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.steps):
        model(x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize()
    tps = args.steps * args.seq / (time.perf_counter() - start)
    print(f"hybrid training step: {tps:.0f} tokens/s (T={args.seq}, {args.steps} steps)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
