"""Optional training state: optimizer state keyed by parameter name, step, RNG, data position.

Stored as one safetensors file (tensors) and one JSON file (everything else) per rank;
never as pickle.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from lora_checkpoint._dist import is_dtensor
from lora_checkpoint._jsonio import MAX_JSON_DEPTH, loads_bounded
from lora_checkpoint.errors import (
    CheckpointError,
    ManifestError,
    MissingTensorError,
    UnexpectedTensorError,
)
from lora_core.contracts import AdaptationResult

__all__ = ["OptimizerState", "RngState", "TrainingState"]

TRAINING_STATE_SCHEMA_VERSION = 1
_RNG_TORCH_KEY = "rng/torch_cpu"
_JSON_SCALARS = (bool, int, float, str, type(None))
# The data position and optimizer values are written inside the training-state document,
# which readers accept up to MAX_JSON_DEPTH levels: leave room for its own few levels.
_MAX_USER_DEPTH = MAX_JSON_DEPTH - 8


def _jsonable(value: Any, where: str, depth: int = 0) -> Any:
    if isinstance(value, _JSON_SCALARS):
        return value
    if depth >= _MAX_USER_DEPTH:
        raise CheckpointError(
            f"{where}: nested more than {_MAX_USER_DEPTH} levels deep (or it contains itself); "
            "store a flatter structure"
        )
    if isinstance(value, (list, tuple)):
        return [_jsonable(v, where, depth + 1) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: _jsonable(v, where, depth + 1) for k, v in value.items()}
    raise CheckpointError(
        f"{where}: value of type {type(value).__name__} cannot be stored as JSON; "
        "use numbers, strings, lists and dicts with str keys"
    )


def _global(t: torch.Tensor) -> torch.Tensor:
    # A DTensor's optimizer state is saved whole (a collective for sharded ones: every rank
    # calls this in one order), so a run may resume at another world size; the parameters
    # themselves are stored whole too.
    if is_dtensor(t):
        t = t.full_tensor()
    return t.detach().to("cpu").clone()


def _param_ids_to_names(optimizer: torch.optim.Optimizer, result: AdaptationResult) -> list[str]:
    by_id = {id(p): n for n, p in result.named_optimizer_parameters}
    names: list[str] = []
    for gi, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) not in by_id:
                raise CheckpointError(
                    f"optimizer param_groups[{gi}] holds a parameter of shape {list(p.shape)} "
                    "that is not in result.named_optimizer_parameters; build the optimizer "
                    "from result.parameters()"
                )
            names.append(by_id[id(p)])
    return names


@dataclass(frozen=True)
class OptimizerState:
    """``Optimizer.state_dict()`` with parameter indices replaced by parameter names.

    Attributes:
        param_groups: each group's hyper-parameters, with ``"params"`` as a list of names.
        state: name -> {state key -> tensor or JSON scalar} (e.g. ``exp_avg``, ``step``).
    """

    param_groups: tuple[dict[str, Any], ...]
    state: Mapping[str, Mapping[str, Any]]


@dataclass(frozen=True)
class RngState:
    """Random generator states to resume bit-exactly.

    Attributes:
        torch_cpu: ``torch.get_rng_state()``, a ``uint8`` tensor.
        python: ``random.getstate()`` as JSON (``[version, [ints], gauss_next]``).
        numpy: ``numpy.random.get_state()`` as JSON, or None when numpy is absent.
    """

    torch_cpu: torch.Tensor
    python: list[Any]
    numpy: list[Any] | None = None

    @classmethod
    def capture(cls) -> RngState:
        """Snapshot the torch CPU, python ``random`` and numpy global generators."""
        version, internal, gauss = random.getstate()
        np_state: list[Any] | None = None
        try:
            import numpy as np
        except ImportError:
            np = None  # type: ignore[assignment]
        if np is not None:
            name, keys, pos, has_gauss, cached = np.random.get_state()
            np_state = [name, [int(k) for k in keys], int(pos), int(has_gauss), float(cached)]
        return cls(torch.get_rng_state().clone(), [version, list(internal), gauss], np_state)

    def apply(self) -> None:
        """Restore every generator captured here."""
        torch.set_rng_state(self.torch_cpu.to(torch.uint8))
        version, internal, gauss = self.python
        random.setstate((int(version), tuple(int(i) for i in internal), gauss))
        if self.numpy is not None:
            import numpy as np

            name, keys, pos, has_gauss, cached = self.numpy
            np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))


@dataclass(frozen=True)
class TrainingState:
    """What a run needs besides the adapter weights to continue exactly where it stopped.

    Attributes:
        step: the number of optimizer steps taken.
        data_position: where the data loader is (any JSON-able dict, e.g. ``{"epoch": 1}``).
        optimizer: the optimizer state keyed by parameter name, or None.
        rng: generator states, or None.
    """

    step: int
    data_position: Mapping[str, Any] = field(default_factory=dict)
    optimizer: OptimizerState | None = None
    rng: RngState | None = None

    def __post_init__(self) -> None:
        """Reject a negative or non-integer step and a non-JSON data position."""
        if isinstance(self.step, bool) or not isinstance(self.step, int) or self.step < 0:
            raise CheckpointError(f"TrainingState.step must be an int >= 0, got {self.step!r}")
        _jsonable(dict(self.data_position), "TrainingState.data_position")

    @classmethod
    def capture(
        cls,
        optimizer: torch.optim.Optimizer | None,
        result: AdaptationResult,
        *,
        step: int,
        data_position: Mapping[str, Any] | None = None,
        rng: bool = True,
    ) -> TrainingState:
        """Snapshot the optimizer (keyed by ``result``'s names), the RNGs and the position.

        Args:
            optimizer: an optimizer over ``result.parameters()`` (or None).
            result: names the optimizer's parameters.
            step: optimizer steps taken so far.
            data_position: JSON-able description of the data loader position.
            rng: also capture the torch CPU, python and numpy generators.

        Raises:
            CheckpointError: if the optimizer holds a parameter the result does not name, or
                a state value that is neither a tensor nor JSON-able.
        """
        opt_state = None
        if optimizer is not None:
            names = _param_ids_to_names(optimizer, result)
            sd = optimizer.state_dict()
            groups = []
            for g in sd["param_groups"]:
                hyper = {
                    k: _jsonable(v, f"optimizer param_group[{k!r}]")
                    for k, v in g.items()
                    if k != "params"
                }
                hyper["params"] = [names[i] for i in g["params"]]
                groups.append(hyper)
            state: dict[str, dict[str, Any]] = {}
            # Index order: the same on every rank, which the gathers of _global need.
            for idx, s in sorted(sd["state"].items()):
                state[names[idx]] = {
                    k: (
                        _global(v)
                        if isinstance(v, torch.Tensor)
                        else _jsonable(v, f"optimizer state[{names[idx]!r}][{k!r}]")
                    )
                    for k, v in s.items()
                }
            opt_state = OptimizerState(tuple(groups), state)
        return cls(
            step=step,
            data_position=dict(data_position or {}),
            optimizer=opt_state,
            rng=RngState.capture() if rng else None,
        )

    def apply(self, optimizer: torch.optim.Optimizer | None, result: AdaptationResult) -> None:
        """Load the optimizer state into ``optimizer`` and restore the RNGs exactly.

        Args:
            optimizer: an optimizer over ``result.parameters()``, in any group order.
            result: maps the saved names onto the optimizer's parameters.

        Raises:
            MissingTensorError: a parameter of the optimizer has no saved group/state.
            UnexpectedTensorError: the saved state names a parameter the optimizer lacks.
            CheckpointError: the group structure differs.
        """
        if optimizer is not None and self.optimizer is not None:
            names = _param_ids_to_names(optimizer, result)
            index = {n: i for i, n in enumerate(names)}
            saved = [n for g in self.optimizer.param_groups for n in g["params"]]
            missing = sorted(set(names) - set(saved))
            extra = sorted(set(saved) - set(names))
            if missing:
                raise MissingTensorError(
                    f"training state has no optimizer entry for parameters {missing[:8]}; "
                    "it was saved for a different set of adapter parameters"
                )
            if extra:
                raise UnexpectedTensorError(
                    f"training state has optimizer entries for unknown parameters {extra[:8]}; "
                    "the optimizer does not hold them"
                )
            current = optimizer.state_dict()["param_groups"]
            if len(current) != len(self.optimizer.param_groups):
                raise CheckpointError(
                    f"optimizer has {len(current)} param groups, the training state "
                    f"{len(self.optimizer.param_groups)}; build the optimizer the same way"
                )
            groups = []
            for cur, g in zip(current, self.optimizer.param_groups, strict=True):
                hyper = {}
                for k, v in g.items():
                    # JSON turned tuples (e.g. AdamW betas) into lists; give them back.
                    hyper[k] = tuple(v) if isinstance(cur.get(k), tuple) else v
                hyper["params"] = [index[n] for n in g["params"]]
                groups.append(hyper)
            params = dict(result.named_optimizer_parameters)
            state = {}
            for n, s in self.optimizer.state.items():
                state[index[n]] = {
                    k: _as_param_like(v, params[n], f"{n}/{k}") for k, v in s.items()
                }
            optimizer.load_state_dict({"state": state, "param_groups": groups})
        if self.rng is not None:
            self.rng.apply()

    # -- serialisation (used by save/load; not public API) ------------------------------

    def to_files(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Split into safetensors tensors and a JSON document."""
        tensors: dict[str, torch.Tensor] = {}
        doc: dict[str, Any] = {
            "schema_version": TRAINING_STATE_SCHEMA_VERSION,
            "step": self.step,
            "data_position": _jsonable(dict(self.data_position), "data_position"),
            "optimizer": None,
            "rng": None,
        }
        if self.optimizer is not None:
            state_doc: dict[str, dict[str, Any]] = {}
            # Parameter order, not the optimizer's insertion order (which a resumed run
            # changes), so the same state always writes the same file bytes.
            ordered = [
                n
                for g in self.optimizer.param_groups
                for n in g["params"]
                if n in self.optimizer.state
            ]
            for i, n in enumerate(ordered):
                s = self.optimizer.state[n]
                entry: dict[str, Any] = {}
                for k, v in s.items():
                    if isinstance(v, torch.Tensor):
                        key = f"optimizer/{i}/{k}"
                        tensors[key] = v
                        entry[k] = {"tensor": key}
                    else:
                        entry[k] = {"value": v}
                state_doc[n] = entry
            doc["optimizer"] = {
                "param_groups": list(self.optimizer.param_groups),
                "state": state_doc,
            }
        if self.rng is not None:
            tensors[_RNG_TORCH_KEY] = self.rng.torch_cpu
            doc["rng"] = {"python": self.rng.python, "numpy": self.rng.numpy}
        return tensors, doc

    @classmethod
    def from_files(
        cls, tensors: Mapping[str, torch.Tensor], raw: bytes, file: str
    ) -> TrainingState:
        """Rebuild from what :meth:`to_files` produced.

        Raises:
            ManifestError: the JSON is malformed or names tensors that are absent.
        """
        doc = loads_bounded(raw, file, "training state", ManifestError)
        try:
            if doc.get("schema_version") != TRAINING_STATE_SCHEMA_VERSION:
                raise ManifestError(
                    f"{file}: training-state schema_version {doc.get('schema_version')!r} is not "
                    f"supported; expected {TRAINING_STATE_SCHEMA_VERSION}"
                )
            opt = None
            if doc["optimizer"] is not None:
                state: dict[str, dict[str, Any]] = {}
                for n, entry in doc["optimizer"]["state"].items():
                    s: dict[str, Any] = {}
                    for k, v in entry.items():
                        if "tensor" in v:
                            if v["tensor"] not in tensors:
                                raise MissingTensorError(
                                    f"{file}: optimizer state {n!r}/{k!r} names tensor "
                                    f"{v['tensor']!r}, which the safetensors file lacks"
                                )
                            s[k] = tensors[v["tensor"]]
                        else:
                            s[k] = v["value"]
                    state[n] = s
                groups = tuple(dict(g) for g in doc["optimizer"]["param_groups"])
                opt = OptimizerState(groups, state)
            rng = None
            if doc["rng"] is not None:
                if _RNG_TORCH_KEY not in tensors:
                    raise MissingTensorError(f"{file}: RNG state tensor {_RNG_TORCH_KEY!r} missing")
                rng = RngState(tensors[_RNG_TORCH_KEY], doc["rng"]["python"], doc["rng"]["numpy"])
            return cls(step=doc["step"], data_position=doc["data_position"], optimizer=opt, rng=rng)
        except CheckpointError:
            raise
        except (KeyError, TypeError, AttributeError, ValueError, IndexError) as exc:
            raise ManifestError(f"{file}: malformed training state: {exc!r}") from exc


def _as_param_like(value: Any, param: torch.Tensor, what: str) -> Any:
    """Optimizer state ``value`` laid out like ``param`` (this rank's part of a DTensor).

    Raises:
        CheckpointError: a tensor of ``param``'s rank fits neither its whole shape nor (a file
            written before whole state was saved) this rank's shard.
    """
    if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.dim() != param.dim():
        return value
    if is_dtensor(param):
        from torch.distributed.tensor import DTensor, distribute_tensor

        if value.shape == param.shape:
            # Whole state: this rank takes its part (every rank holds the whole; no traffic).
            return distribute_tensor(
                value.to(param.to_local().device),
                param.device_mesh,
                param.placements,
                src_data_rank=None,
            )
        if value.shape == param.to_local().shape:
            # A shard saved by an older version at this very world size. Pass the global
            # shape: FSDP shards unevenly (e.g. 259 rows as 130 + 129), and from_local would
            # otherwise infer local_rows * world_size.
            return DTensor.from_local(
                value,
                param.device_mesh,
                param.placements,
                run_check=False,
                shape=param.shape,
                stride=param.stride(),
            )
    elif value.shape == param.shape:
        return value
    raise CheckpointError(
        f"optimizer state {what} has shape {list(value.shape)}, but the parameter is "
        f"{list(param.shape)}: it was saved as one rank's shard (by lora-checkpoint < 0.3) at "
        "another world size; resume with the world size that saved it"
    )
