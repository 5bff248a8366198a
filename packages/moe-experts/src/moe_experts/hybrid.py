"""Dense layers on one device, routed experts on the host kernel: the hand-over, overlapped.

Each routed-experts call becomes two autograd nodes around a :class:`_HostCall`:

- forward: ``_Launch`` copies the hidden states, expert ids and routing weights to the host
  (on CUDA: on a side stream, into pinned memory from torch's caching host allocator, which
  reuses its blocks) and hands the kernel to the host worker thread; the caller then runs the
  work that does not depend on the routed experts (shared experts that the block would only
  call afterwards, hot experts resident on the device); ``_Collect`` waits for the kernel and
  copies its output back on the side stream, and the consumer's stream waits on that copy's
  event, not on the host.
- backward: ``_Collect``'s backward copies ``dy`` to the host and starts the kernel's
  backward on the worker; autograd meanwhile runs the other ready nodes (their sequence
  numbers are higher: the shared experts' and the dense layers' gradients); ``_Launch``'s
  backward waits and copies ``dx`` and ``d topk_weights`` back.

The kernel's own autograd graph lives on the host between the two (built on detached leaf
copies of its inputs), so its save/recompute policy is untouched and the LoRA gradients land
in the kernel's LoRA parameters as before. On the CPU the same code runs with the worker
thread in place of the streams, and its results equal the synchronous call bit for bit.

Where the block calls its shared experts *before* the routed experts (Qwen2-MoE, HunYuan,
Gemma-4's dense ``mlp``), their work is queued before the hand-over and is not overlapped.
"""

from __future__ import annotations

import contextvars
import threading
from collections import defaultdict, deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

import kt_kernel

if TYPE_CHECKING:
    from moe_experts.kernel_experts import KernelExperts

__all__ = [
    "GpuIdleMeter",
    "HostReplay",
    "enable_overlap",
    "host_replay",
    "idle_meter",
    "routed_experts",
]

_LOCK = threading.Lock()
_WORKER: ThreadPoolExecutor | None = None
_SIDE_STREAMS: dict[torch.device, Any] = {}
_REPLAY: contextvars.ContextVar[HostReplay | None] = contextvars.ContextVar(
    "moe_experts_host_replay", default=None
)
_METER: contextvars.ContextVar[GpuIdleMeter | None] = contextvars.ContextVar(
    "moe_experts_idle_meter", default=None
)


def _worker() -> ThreadPoolExecutor:
    """The one host thread the kernel calls run on (MoE layers follow each other anyway)."""
    global _WORKER
    with _LOCK:
        if _WORKER is None:
            _WORKER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moe-host-experts")
        return _WORKER


def _side_stream(device: torch.device) -> Any:
    with _LOCK:
        stream = _SIDE_STREAMS.get(device)
        if stream is None:
            stream = _SIDE_STREAMS[device] = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        return stream


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


@contextmanager
def _own_saved_tensors() -> Iterator[None]:
    """The kernel keeps its saved tensors itself, whatever outer hooks (checkpointing) say.

    Only the innermost pair of saved-tensor hooks applies, so identity hooks shield the
    kernel's graph from an activation checkpoint's pack/unpack hooks.
    """
    with torch.autograd.graph.saved_tensors_hooks(_identity, _identity):
        yield


# ----------------------------------------------------------------------------- GPU idle


@dataclass
class GpuIdleMeter:
    """GPU time spent waiting for the host experts, measured with CUDA events.

    Around each wait of the dense stream for the host (forward and backward), one event is
    recorded before the host thread blocks (the GPU reaches it when its queued work is done)
    and one after the stream's wait on the copy back (the GPU reaches it when it resumes);
    their distance is idle time. :meth:`step` brackets a step with two more events.

    Use as ``with idle_meter(meter): ...``; only CUDA dense devices record anything.
    """

    pairs: list[tuple[Any, Any]] = field(default_factory=list)
    bounds: list[Any] = field(default_factory=list)

    def _event(self) -> Any:
        event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        event.record()
        return event

    def begin_step(self) -> None:
        """Mark the start of a step on the current CUDA stream (clears earlier records)."""
        self.pairs.clear()
        self.bounds = [self._event()]

    def end_step(self) -> None:
        """Mark the end of the step."""
        self.bounds.append(self._event())

    def idle_start(self) -> Any:
        """Record the event the GPU reaches once its queued work is done."""
        return self._event()

    def idle_end(self, start: Any) -> None:
        """Record the event the GPU reaches when it resumes after the wait."""
        self.pairs.append((start, self._event()))

    def idle_fraction(self) -> float:
        """Idle milliseconds over the step's milliseconds (synchronises the device)."""
        if len(self.bounds) != 2:
            raise RuntimeError("GpuIdleMeter: call begin_step() and end_step() around a step")
        self.bounds[1].synchronize()
        total = self.bounds[0].elapsed_time(self.bounds[1])
        idle = sum(a.elapsed_time(b) for a, b in self.pairs)
        return idle / total if total > 0 else 0.0


@contextmanager
def idle_meter(meter: GpuIdleMeter | None) -> Iterator[GpuIdleMeter | None]:
    """Record the host waits of the code inside into ``meter`` (CUDA only)."""
    token = _METER.set(meter)
    try:
        yield meter
    finally:
        _METER.reset(token)


# ------------------------------------------------------------- checkpoint replay (memo)


class HostReplay:
    """The host experts' outputs of one checkpointed forward, replayed in its recompute.

    Activation checkpointing recomputes a decoder layer in backward; the host kernel's call is
    not part of that: its output is kept from the forward (``[T, H]`` on the dense device)
    and its backward runs on the graph the kernel kept under its own save/recompute policy.
    """

    def __init__(self) -> None:
        """An empty record."""
        self._outputs: dict[int, deque[torch.Tensor]] = defaultdict(deque)
        self.replaying = False

    def push(self, experts: nn.Module, y: torch.Tensor) -> None:
        """Keep one call's output."""
        self._outputs[id(experts)].append(y.detach())

    def pop(self, experts: nn.Module) -> torch.Tensor:
        """The next kept output of ``experts``, as a leaf that requires grad like the original.

        Raises:
            RuntimeError: the recompute calls the experts more often than the forward did.
        """
        queue = self._outputs.get(id(experts))
        if not queue:
            raise RuntimeError(
                "activation checkpointing: the recompute called a routed-experts module more "
                "often than the forward did; the layer's forward is not deterministic"
            )
        # A leaf requiring grad, so ops after it save what they saved in the forward.
        return queue.popleft().requires_grad_(True)

    @contextmanager
    def recording(self) -> Iterator[None]:
        """The original forward: record each host call's output."""
        token = _REPLAY.set(self)
        try:
            yield
        finally:
            _REPLAY.reset(token)

    @contextmanager
    def replay(self) -> Iterator[None]:
        """The recompute: give back the recorded outputs instead of calling the kernel."""
        token = _REPLAY.set(self)
        self.replaying = True
        try:
            yield
        finally:
            self.replaying = False
            _REPLAY.reset(token)


def host_replay() -> HostReplay | None:
    """The replay record active in this thread (inside a checkpointed layer), or ``None``."""
    return _REPLAY.get()


# --------------------------------------------------------------------------- the call


class _HostCall:
    """One routed-experts call on the host kernel: its copies, its graph, its pending work."""

    def __init__(
        self,
        experts: KernelExperts,
        ids: torch.Tensor,
        use_lora: bool,
        cold: torch.Tensor | None,
    ) -> None:
        self.experts = experts
        self.ids = ids
        self.use_lora = use_lora
        self.cold = cold  # [E] bool on the host: experts the kernel runs (None: all)
        self.asynchronous = bool(experts.overlap)
        self.future: Future[Any] | None = None
        self.result: Any = None
        self.device = ids.device
        self.cuda = self.device.type == "cuda"
        self.meter = _METER.get() if self.cuda else None
        self.x_leaf: torch.Tensor | None = None
        self.w_leaf: torch.Tensor | None = None
        self.y_inner: torch.Tensor | None = None
        self.dtypes: tuple[torch.dtype, torch.dtype] = (torch.float32, torch.float32)
        self.grad = False  # whether the kernel's graph is built (set by the caller)

    # -- plumbing
    def _run(self, fn: Callable[[], Any], grad: bool) -> None:
        def task() -> Any:
            with torch.set_grad_enabled(grad), _own_saved_tensors():
                return fn()

        if self.asynchronous:
            self.future = _worker().submit(task)
        else:
            self.future, self.result = None, task()

    def _wait(self) -> Any:
        meter = self.meter
        start = meter.idle_start() if meter is not None else None
        out = self.future.result() if self.future is not None else self.result
        self.future, self.result = None, None
        return out, start

    def _to_host(self, *tensors: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], Any]:
        """Copies to the host (side stream, pinned, non-blocking on CUDA) and their event."""
        if not self.cuda:
            return tuple(t.detach() for t in tensors), None
        main = torch.cuda.current_stream(self.device)
        side = _side_stream(self.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            out = tuple(t.detach().to("cpu", non_blocking=True) for t in tensors)
            copied = torch.cuda.Event()  # type: ignore[no-untyped-call]
            copied.record(side)
        for t in tensors:
            t.record_stream(side)  # the caching allocator must not reuse them before the copy
        return out, copied

    def _to_device(self, start: Any, *tensors: torch.Tensor | None) -> tuple[Any, ...]:
        """Copies back (side stream, from pinned memory); the current stream waits on them."""
        if not self.cuda:
            out = tuple(t for t in tensors)
        else:
            main = torch.cuda.current_stream(self.device)
            side = _side_stream(self.device)
            with torch.cuda.stream(side):
                out = tuple(
                    None if t is None else t.to(self.device, non_blocking=True) for t in tensors
                )
                done = torch.cuda.Event()  # type: ignore[no-untyped-call]
                done.record(side)
            main.wait_event(done)
            for t in out:
                if t is not None:
                    t.record_stream(main)
        if self.meter is not None and start is not None:
            self.meter.idle_end(start)
        return out

    # -- forward
    def start_forward(self, hidden: torch.Tensor, w: torch.Tensor, grad: bool) -> None:
        """Copy the inputs over and start the kernel's forward."""
        (x_h, ids_h, w_h), copied = self._to_host(hidden, self.ids, w)
        experts, use_lora, cold = self.experts, self.use_lora, self.cold
        kernel_dtype = experts.expert_weights.dtype
        self.dtypes = (hidden.dtype, w.dtype)
        pin = self.cuda

        def forward() -> torch.Tensor:
            if copied is not None:
                copied.synchronize()
            x_leaf = x_h.to(kernel_dtype).requires_grad_(grad and hidden.requires_grad)
            w_leaf = w_h.requires_grad_(grad and w.requires_grad)
            self.x_leaf, self.w_leaf = x_leaf, w_leaf
            lora = experts.call_lora(use_lora)
            if cold is None:
                y = kt_kernel.moe_experts_forward(
                    x_leaf, ids_h, w_leaf, experts.expert_weights, lora, policy=experts.policy
                )
            else:
                y = _cold_forward(experts, x_leaf, ids_h, w_leaf, lora, cold)
            self.y_inner = y if y.requires_grad else None
            out = y.detach()
            return out.pin_memory() if pin else out

        self._run(forward, grad)

    def finish_forward(self) -> torch.Tensor:
        """Wait for the kernel's output and bring it to the dense device."""
        y, start = self._wait()
        (out,) = self._to_device(start, y)
        result: torch.Tensor = out
        return result

    # -- backward
    def start_backward(self, dy: torch.Tensor) -> None:
        """Copy ``dy`` over and start the kernel's backward."""
        (dy_h,), copied = self._to_host(dy)
        pin = self.cuda

        def backward() -> tuple[torch.Tensor | None, torch.Tensor | None]:
            if copied is not None:
                copied.synchronize()
            x, w, y = self.x_leaf, self.w_leaf, self.y_inner
            self.y_inner = None
            if y is None:
                return None, None
            torch.autograd.backward(y, dy_h.to(y.dtype))
            dx = None if x is None or x.grad is None else x.grad
            dw = None if w is None or w.grad is None else w.grad
            self.x_leaf = self.w_leaf = None
            if pin:
                dx = None if dx is None else dx.pin_memory()
                dw = None if dw is None else dw.pin_memory()
            return dx, dw

        self._run(backward, grad=False)

    def finish_backward(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Wait for ``dx`` and ``d topk_weights`` and bring them to the dense device."""
        (dx, dw), start = self._wait()
        dx, dw = self._to_device(start, dx, dw)
        x_dtype, w_dtype = self.dtypes
        return (
            None if dx is None else dx.to(x_dtype),
            None if dw is None else dw.to(w_dtype),
        )


def _cold_forward(
    experts: KernelExperts,
    x: torch.Tensor,
    ids: torch.Tensor,
    w: torch.Tensor,
    lora: kt_kernel.LoraBuffers | None,
    cold: torch.Tensor,
) -> torch.Tensor:
    """The kernel over the (token, slot) pairs routed to host experts only: ``[T, H]`` fp32.

    Each pair is one row of a top-1 call (the kernel computes only the experts it is given),
    and the rows are summed per token in fp32.
    """
    tok, slot = cold[ids].nonzero(as_tuple=True)
    y = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32)
    if tok.numel() == 0:  # every pair went to a resident expert: nothing for the host
        return y
    out = kt_kernel.moe_experts_forward(
        x[tok],
        ids[tok, slot].unsqueeze(1),
        w[tok, slot].unsqueeze(1),
        experts.expert_weights,
        lora,
        policy=experts.policy,
    )
    return y.index_add(0, tok, out.float())


class _Launch(torch.autograd.Function):
    """Forward: start the host call. Backward: wait for ``dx`` / ``d topk_weights``."""

    @staticmethod
    def forward(
        ctx: Any, call: _HostCall, hidden: torch.Tensor, w: torch.Tensor, *anchors: torch.Tensor
    ) -> torch.Tensor:
        """Copy and start; the returned empty token orders ``_Collect`` after this node."""
        call.start_forward(hidden, w, grad=call.grad)  # grad mode is off inside forward
        ctx.call = call
        ctx.n_anchors = len(anchors)
        return hidden.new_empty(0)

    @staticmethod
    def backward(ctx: Any, _token: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """The host gradients of the hidden states and routing weights."""
        dx, dw = ctx.call.finish_backward()
        # The LoRA anchors got their gradients from the kernel's own graph already.
        return (None, dx, dw, *([None] * ctx.n_anchors))


class _Collect(torch.autograd.Function):
    """Forward: wait for the kernel's output. Backward: start the kernel's backward."""

    @staticmethod
    def forward(ctx: Any, call: _HostCall, token: torch.Tensor) -> torch.Tensor:
        """``[T, H]`` routed output on the dense device."""
        ctx.call = call
        ctx.token = (token.dtype, token.device)
        return call.finish_forward()

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[None, torch.Tensor]:
        """Hand ``dy`` to the host and return at once (the token's gradient is empty)."""
        ctx.call.start_backward(dy.contiguous())
        dtype, device = ctx.token
        return None, torch.empty(0, dtype=dtype, device=device)


# ----------------------------------------------------------------- independent work


class _SharedCache:
    """Runs a block's shared experts early, while the host works, and hands their output on.

    A forward pre-hook on the block keeps its input; when the routed experts are called before
    the shared experts have run in this block call, :meth:`precompute` runs them on that input
    and the shared experts' next call with the same tensor returns the result.
    """

    def __init__(self, block: nn.Module, shared: list[nn.Module]) -> None:
        self.shared = shared
        self.block_input: torch.Tensor | None = None
        self.called: set[int] = set()
        self.ready: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.hits = 0  # shared outputs served from the precompute (tests read this)
        self.handles = [
            block.register_forward_pre_hook(self._enter, with_kwargs=True),
            block.register_forward_hook(self._leave, always_call=True),
        ]
        self.originals: list[tuple[nn.Module, Any]] = []
        for module in shared:
            self.originals.append((module, module.__dict__.get("forward")))
            module.forward = self._forward_of(module, module.forward)

    def _enter(self, _block: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        first = args[0] if args else kwargs.get("hidden_states")
        self.block_input = first if isinstance(first, torch.Tensor) else None
        self.called.clear()
        self.ready.clear()

    def _leave(self, *_: Any) -> None:
        self.block_input = None
        self.ready.clear()

    def _forward_of(self, module: nn.Module, original: Callable[..., Any]) -> Callable[..., Any]:
        key = id(module)

        def forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self.called.add(key)
            hit = self.ready.pop(key, None)
            if hit is not None and not args and not kwargs and hit[0] is x:
                self.hits += 1
                return hit[1]
            return original(x, *args, **kwargs)

        return forward

    def precompute(self) -> None:
        """Run every shared expert the block has not called yet on the block's input."""
        x = self.block_input
        if x is None:
            return
        for module in self.shared:
            key = id(module)
            if key not in self.called and key not in self.ready:
                self.ready[key] = (x, module(x))
                self.called.discard(key)  # the block's own call is still to come

    def remove(self) -> None:
        """Take the hooks and the forward overrides away."""
        for handle in self.handles:
            handle.remove()
        for module, original in self.originals:
            if original is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = original


def enable_overlap(model: nn.Module, enabled: bool = True) -> int:
    """Switch every routed-experts module of ``model`` to the overlapped hand-over (or back).

    Shared experts that a block calls after its routed experts are run while the host
    kernel works. Results are unchanged: on the CPU bit for bit, on a GPU up to the order of
    its own floating-point work.

    Args:
        model: a model wrapped by :func:`moe_experts.wrap` or :func:`moe_experts.load_pretrained`.
        enabled: ``False`` restores the synchronous hand-over.

    Returns:
        The number of experts modules switched.
    """
    from moe_experts.wrapping import experts_sites

    count = 0
    for site, experts in experts_sites(model):
        old = experts.shared_cache
        if old is not None:
            old.remove()
            experts.shared_cache = None
        experts.overlap = enabled
        shared = [getattr(site.block, a, None) for a in site.arch.shared_expert_attrs]
        modules = [m for m in shared if isinstance(m, nn.Module)]
        if enabled and modules:
            experts.shared_cache = _SharedCache(site.block, modules)
        count += 1
    return count


def routed_experts(
    experts: KernelExperts,
    hidden: torch.Tensor,
    ids: torch.Tensor,
    w: torch.Tensor,
    use_lora: bool,
) -> torch.Tensor:
    """``[T, H]`` routed output through the host hand-over (overlapped, hot experts, replay).

    Args:
        experts: the :class:`~moe_experts.KernelExperts` module.
        hidden: ``[T, H]`` on the dense device.
        ids: ``[T, k]`` expert ids.
        w: ``[T, k]`` routing weights.
        use_lora: whether the LoRA applies (PEFT may have switched it off).

    Returns:
        ``[T, H]`` in ``hidden.dtype``, equal to the synchronous call.
    """
    replay = _REPLAY.get()
    hot = experts.hot
    if hot is not None and not (replay is not None and replay.replaying):
        hot.observe(ids)
    resident = hot if hot is not None and hot.resident else None
    cache = experts.shared_cache if experts.overlap else None
    if replay is not None and replay.replaying:
        if cache is not None:
            cache.precompute()
        hot_y = resident.forward(experts, hidden, ids, w, use_lora) if resident else None
        y = replay.pop(experts)
    else:
        call = _HostCall(experts, ids, use_lora, resident.cold if resident else None)
        anchors = experts.lora_leaves(use_lora) if torch.is_grad_enabled() else ()
        call.grad = torch.is_grad_enabled() and (
            hidden.requires_grad or w.requires_grad or bool(anchors)
        )
        if call.grad:
            # The LoRA leaves ride along as inputs so the node exists even when neither the
            # hidden states nor the routing weights need a gradient.
            token = _Launch.apply(call, hidden, w, *anchors)  # type: ignore[no-untyped-call]
        else:
            call.start_forward(hidden, w, grad=False)
            token = None
        if cache is not None:
            cache.precompute()  # the GPU works on these while the host computes
        hot_y = resident.forward(experts, hidden, ids, w, use_lora) if resident else None
        y = (
            _Collect.apply(call, token)  # type: ignore[no-untyped-call]
            if token is not None
            else call.finish_forward()
        )
        if replay is not None:
            replay.push(experts, y)
    if hot_y is not None:
        y = y.float() + hot_y
    out = y.to(hidden.dtype)
    if use_lora and experts.lora_experts is not None:
        out = out + experts.lora_experts(hidden)
    return out
