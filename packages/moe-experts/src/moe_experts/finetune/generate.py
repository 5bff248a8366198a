"""``moe-experts generate``: sample from the base model with a trained adapter, streaming tokens."""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

from moe_experts.finetune.config import check_seed
from moe_experts.finetune.errors import FinetuneError

__all__ = ["build_parser", "generate", "generate_main", "prompt_ids"]


def build_parser(prog: str = "moe-experts generate") -> argparse.ArgumentParser:
    """The flags of the generate command."""
    p = argparse.ArgumentParser(prog=prog, description="Generate text with a trained adapter.")
    p.add_argument(
        "--model",
        default=None,
        help="built-in model name or local directory (default: the adapter's base)",
    )
    p.add_argument(
        "--adapter",
        type=Path,
        required=True,
        help="a checkpoint root (its latest checkpoint) or one checkpoint directory",
    )
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="0 (default): greedy; above 0: sample at this temperature",
    )
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="where the model generates: cuda (cuda:0; the whole model, as transformers + "
        "PEFT load it), cpu, or auto (cuda when torch sees a GPU; default)",
    )
    p.add_argument(
        "--no-chat-template",
        action="store_true",
        help="feed the prompt as raw text, not as a user turn of the chat template",
    )
    p.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    return p


def prompt_ids(tokenizer: Any, prompt: str, *, chat: bool = True) -> list[int]:
    """Token ids for ``prompt``: a user turn plus the generation header when there is a template."""
    if chat and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return list(tokenizer(prompt)["input_ids"])


def generate(
    model: str | None,
    adapter: Path,
    prompt: str,
    *,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    seed: int = 0,
    chat: bool = True,
    stream: bool = True,
    device: str = "auto",
) -> str:
    """Load base + adapter as a user would (transformers + PEFT) and return the continuation.

    Raises:
        FinetuneError: for a bad checkpoint, model or argument.
    """
    import torch
    from transformers import TextStreamer

    from moe_experts.finetune.adapters import load_with_adapter

    if max_new_tokens < 1:
        raise FinetuneError(f"--max-new-tokens {max_new_tokens}: must be >= 1")
    if not math.isfinite(temperature) or temperature < 0:
        # nan compares false with everything, so it would have sampled nothing: greedy.
        raise FinetuneError(
            f"--temperature {temperature}: must be a finite number >= 0 (0 is greedy)"
        )
    check_seed(seed, "--seed")
    from moe_experts.finetune.devices import resolve_placement

    target = resolve_placement(device).dense  # --device cuda without CUDA: before loading
    loaded = load_with_adapter(model, adapter)
    tok = loaded.tokenizer
    loaded.model.to(target)
    ids = torch.tensor([prompt_ids(tok, prompt, chat=chat)], device=target)
    torch.manual_seed(seed)
    streamer = TextStreamer(tok, skip_prompt=True, skip_special_tokens=True) if stream else None
    sampling: dict[str, Any] = (
        {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
    )
    with torch.no_grad():
        out = loaded.model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id or tok.eos_token_id,
            streamer=streamer,
            **sampling,
        )
    return cast(str, tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True))


def generate_main(argv: Sequence[str] | None = None) -> int:
    """The ``moe-experts generate`` command; returns the exit code."""
    from moe_experts.finetune.cli import report_error

    ns = build_parser().parse_args(argv)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # unannotated in transformers
        generate(
            ns.model,
            ns.adapter,
            ns.prompt,
            max_new_tokens=ns.max_new_tokens,
            temperature=ns.temperature,
            seed=ns.seed,
            chat=not ns.no_chat_template,
            device=ns.device,
        )
    except FinetuneError as exc:
        return report_error(exc, debug=ns.debug)
    return 0
