"""Live accounting: what a rank really holds, measured, beside the formulas of core/accounting/estimate.py.

[Note: the measured ledger]
`engine.memory()` (core/engine.py) sums, per category, the storages a stage lists in its
`memory_tensors()`, each storage once. Two kinds of bytes are not model states and are added
here:

* comm_buffers: storage a stage keeps only to communicate (reduce-dtype copies of gradients
  and accumulation outputs while their reduce-scatter is in flight, all-gather input clones
  while the gathers run, and at stage 0 the reduce-dtype gradients from backward until step;
  stage 3 reports its gathered units itself, as "unsharded_params" and "unsharded_grads",
  while they are alive). A stage exposes them as `engine.comm_buffer_tensors() -> list of
  tensors` (empty when none is alive, so 0 after step). A storage already counted under a
  model-state category is not counted again here.
* activations: tensors autograd saves for backward. They depend on the batch, not on the
  engine, so they are measured around one forward+backward (`ActivationMeter`) and passed in.

`ledger()` puts each measured category next to `estimate()` for the same configuration
(parameter counts, world size, stage, precision and optimizer read off the engine).
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable

from zerokit.core.accounting.estimate import estimate

MODEL_STATE_CATEGORIES: tuple[str, ...] = ("params", "grads", "master_params", "optimizer_states")


def _storage_key(t: Any) -> tuple[Any, int, int]:
    """Identity of a tensor's storage: (device, data pointer, bytes). Views of one storage share it."""
    s = t.untyped_storage()
    return (str(t.device), s.data_ptr(), s.nbytes())


class _Packed:
    """What the pack hook hands autograd in place of a saved tensor; a finalizer on it sees autograd let go."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: Any) -> None:
        self.tensor = tensor


class ActivationMeter:
    """Peak bytes of tensors autograd saves for backward, inside a `with` block.

    On CPU (and whenever `use_cuda_allocator=False`) every tensor autograd saves passes through
    `torch.autograd.graph.saved_tensors_hooks`; each storage is counted once while at least one
    saved tensor refers to it, and is released when autograd drops the last one (backward frees
    its graph as it goes, so the count falls during backward). `peak_bytes` is the largest total
    seen. Storages of `exclude` (pass the model, or its parameters: weights that autograd saves
    to form input gradients are model states, not activations) and integer tensors (token ids)
    are skipped. The count is taken per storage, so a view saved twice costs its storage once.

    On CUDA (`use_cuda_allocator=True`, the default when CUDA is available) the meter reads the
    allocator instead: `torch.cuda.max_memory_allocated()` minus the allocated bytes on entry,
    which also includes whatever else is alive at the peak (gradient buffers allocated in
    backward, a ZeRO-3 working set, temporaries). `saved_peak_bytes` is kept as well.
    """

    def __init__(self, exclude: Any = (), use_cuda_allocator: bool | None = None) -> None:
        import torch

        self._torch = torch
        # A module is re-read at every pack: ZeRO-3 re-points parameters at gathered buffers
        # during forward, and those weights are model states too (the working set).
        if isinstance(exclude, torch.nn.Module):
            module = exclude
            self._exclude = lambda: {_storage_key(p) for p in module.parameters() if p.numel()}
        else:
            fixed = {_storage_key(t) for t in exclude if t.numel()}
            self._exclude = lambda: fixed
        if use_cuda_allocator is None:
            use_cuda_allocator = torch.cuda.is_available()
        self.use_cuda_allocator = bool(use_cuda_allocator)
        self._refs: dict[tuple, int] = {}  # storage key -> number of saved tensors alive on it
        self._current = 0
        self.saved_peak_bytes = 0
        self._cuda_peak = 0
        self._stack = contextlib.ExitStack()

    @property
    def peak_bytes(self) -> int:
        return self._cuda_peak if self.use_cuda_allocator else self.saved_peak_bytes

    @property
    def current_bytes(self) -> int:
        """Saved-tensor bytes autograd still holds now (0 once every graph has been backwarded or dropped)."""
        return self._current

    def _pack(self, t: Any) -> Any:
        if not t.is_floating_point() or t.untyped_storage().nbytes() == 0:
            return t
        key = _storage_key(t)
        if key in self._exclude():
            return t
        packed = _Packed(t)
        if self._refs.get(key, 0) == 0:
            self._current += key[2]
            self.saved_peak_bytes = max(self.saved_peak_bytes, self._current)
        self._refs[key] = self._refs.get(key, 0) + 1
        weakref.finalize(packed, self._release, key)  # runs when autograd frees the saved variable
        return packed

    def _release(self, key: tuple) -> None:
        self._refs[key] -= 1
        if self._refs[key] == 0:
            del self._refs[key]
            self._current -= key[2]

    @staticmethod
    def _unpack(packed: Any) -> Any:
        return packed.tensor if isinstance(packed, _Packed) else packed

    def __enter__(self) -> "ActivationMeter":
        if self.use_cuda_allocator:
            self._torch.cuda.synchronize()
            self._torch.cuda.reset_peak_memory_stats()
            self._cuda_start = self._torch.cuda.memory_allocated()
        self._stack.enter_context(self._torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack))
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()
        if self.use_cuda_allocator:
            self._torch.cuda.synchronize()
            self._cuda_peak = self._torch.cuda.max_memory_allocated() - self._cuda_start


def measure_activations(fn: Callable[[], Any], exclude: Any = (),
                        use_cuda_allocator: bool | None = None) -> int:
    """Run `fn()` (a forward and backward) and return the peak activation bytes (see ActivationMeter)."""
    with ActivationMeter(exclude, use_cuda_allocator) as meter:
        fn()
    return meter.peak_bytes


def optimizer_kind(optimizer: Any) -> str:
    """The `estimate` optimizer name ("adam", "sgd_momentum", "sgd") of a torch optimizer instance."""
    import torch

    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return "adam"
    if isinstance(optimizer, torch.optim.SGD):
        momentum = max(float(g.get("momentum", 0.0)) for g in optimizer.param_groups)
        return "sgd_momentum" if momentum > 0 else "sgd"
    raise TypeError(f"no state-size rule for {type(optimizer).__name__}; "
                    f"known: Adam, AdamW, SGD (with or without momentum)")


def comm_buffer_bytes(engine: Any, counted: set | None = None) -> int:
    """Bytes of the engine's communication buffers (`engine.comm_buffer_tensors()`), each storage once.

    Storages in `counted` (keys of storages already attributed to a model-state category) are skipped.
    """
    counted = set() if counted is None else counted
    total = 0
    for t in getattr(engine, "comm_buffer_tensors", lambda: [])():
        if t is None or t.untyped_storage().nbytes() == 0:
            continue
        key = _storage_key(t)
        if key not in counted:
            counted.add(key)
            total += key[2]
    return total


def ledger(engine: Any, activation_bytes: int | None = None, predicted_activations: int | None = None) -> dict:
    """This rank's bytes by category, measured, beside `estimate()` for the same configuration.

    Returns {"measured": {category: bytes}, "predicted": {category: bytes or None},
    "relative_error": {category: float or None}, "config": {...}}. Model-state categories come
    from `engine.memory()`; "comm_buffers" from `engine.comm_buffer_tensors()` (no formula:
    predicted None); "activations" is `activation_bytes` (measured by the caller, e.g. with
    `measure_activations`) beside `predicted_activations` (e.g. `activation_bytes_estimate`).
    relative_error = (measured - predicted) / predicted, 0.0 when both are 0, None without a
    prediction. Call it after `step()`, when a stage's transient full-size buffers are gone.
    """
    measured = dict(engine.memory())
    counted = set()
    for tensors in engine.memory_tensors().values():
        counted.update(_storage_key(t) for t in tensors if t is not None)
    measured["comm_buffers"] = comm_buffer_bytes(engine, counted)
    measured["activations"] = activation_bytes

    from zerokit.core.params.flat_param import is_packed  # imports torch: only when a ledger is taken
    params = {id(p): p for p in engine.module.parameters()}.values()
    # A quantized base counts its elements, not its bytes: core/accounting/estimate.py [Note: a quantized base]
    specs = [p.zerokit_packed for p in params if is_packed(p)]
    num_params = sum(p.numel() for p in params if not is_packed(p)) + sum(s.numel for s in specs)
    trainable = sum(p.numel() for p in params if p.requires_grad)
    quant = {}
    if specs:
        quant = {"quantize": specs[0].fmt, "quantized_params": [s.numel for s in specs],
                 "block_size": specs[0].block_size, "double_quant": specs[0].double_quant}
    precision = engine.policy.name
    from zerokit.core.precision import PRECISIONS as DTYPES  # imports torch: only when a ledger is taken
    kind = optimizer_kind(engine.optimizer.optimizer)
    if engine.policy.param_dtype not in DTYPES.values():  # a float64 model: estimate() counts 4-byte params,
        predicted: dict[str, int | None] = {c: None for c in MODEL_STATE_CATEGORIES}  # no formula for it
        precision = "fp64"
    else:
        reduce_precision = next(name for name, dtype in DTYPES.items() if dtype == engine.policy.reduce_dtype)
        est = estimate(num_params, engine.world_size, engine.stage, precision, kind, trainable_params=trainable,
                       reduce_precision=reduce_precision, **quant)
        predicted = {c: getattr(est, c) for c in MODEL_STATE_CATEGORIES}
    if specs and engine.policy.param_dtype in DTYPES.values():
        predicted["quantized_params"] = est.quantized_params
    predicted["comm_buffers"] = None
    predicted["activations"] = predicted_activations

    errors: dict[str, float | None] = {}
    for category, value in measured.items():
        want = predicted.get(category)
        if want is None or value is None:
            errors[category] = None
        elif want == 0:
            errors[category] = 0.0 if value == 0 else float("inf")
        else:
            errors[category] = (value - want) / want
    config = {"stage": engine.stage, "world_size": engine.world_size, "rank": engine.rank,
              "precision": precision, "optimizer": kind, "num_params": num_params, "trainable_params": trainable}
    if specs:
        config["quantize"] = quant["quantize"]
    return {"measured": measured, "predicted": predicted, "relative_error": errors, "config": config}


class PeakMeter:
    """The process's peak memory over each phase of a run: `with meter.phase("build"): ...`, then `meter.peaks`.

    On CPU the kernel's resident-set high-water mark (VmHWM in /proc/self/status), reset at the start of
    each phase by writing "5" to /proc/self/clear_refs, so a phase's peak is its own and includes
    everything resident (the interpreter, torch, allocator slack); `baseline` is the resident set when the
    meter was made, `starts[name]` the resident set as the phase began (so `peaks[name] - starts[name]` is
    what the phase added at its height). On CUDA the caching allocator's peak of allocated bytes (torch.cuda.reset_peak_memory_stats).
    Where neither is available (not Linux), `available` is False and phases record nothing.
    """

    def __init__(self, device: Any = "cpu") -> None:
        import torch
        self.cuda = str(device).startswith("cuda")
        self._torch = torch
        self.available = self.cuda or _read_status("VmRSS") is not None
        if self.available and not self.cuda:
            from zerokit.core.params.deferred import _mmap_large_allocations  # imports torch, as this constructor does
            _mmap_large_allocations()
        self.peaks: dict[str, int] = {}
        self.seconds: dict[str, float] = {}  # each phase's wall time
        self.starts: dict[str, int] = {}  # the resident set (allocated bytes on CUDA) as each phase began
        self.baseline = self.current() if self.available else 0

    def current(self) -> int:
        if self.cuda:
            return self._torch.cuda.memory_allocated()
        return _read_status("VmRSS") or 0

    def _reset(self) -> None:
        if self.cuda:
            self._torch.cuda.reset_peak_memory_stats()
            return
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")

    def _peak(self) -> int:
        return self._torch.cuda.max_memory_allocated() if self.cuda else (_read_status("VmHWM") or 0)

    @contextlib.contextmanager
    def phase(self, name: str):
        import time
        start = time.perf_counter()
        if not self.available:
            yield
            return
        self._reset()
        self.starts[name] = self.current()
        try:
            yield
        finally:
            self.peaks[name] = self._peak()
            self.seconds[name] = time.perf_counter() - start


def _read_status(field: str) -> int | None:
    """A memory field of /proc/self/status in bytes (it is given in kB), None where there is none."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
