"""``python -m moe_experts.finetune`` (also the entry point under ``torchrun``)."""

from moe_experts.finetune.cli import finetune_main

raise SystemExit(finetune_main(prog="python -m moe_experts.finetune"))
