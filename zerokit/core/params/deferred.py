"""`zk.deferred_init()`: build a model without allocating it, recording how its tensors get their values.

    with zk.deferred_init():
        model = LlamaForCausalLM(config)     # no parameter memory; the construction is recorded
    engine = zk.shard(model, torch.optim.AdamW, stage=3, wrap=(LlamaDecoderLayer,))

[Note: recording a construction]
A meta build (core/params/materialize.py) replays every module's `reset_parameters()` and a `param_init_fn`
after the fact. That cannot reproduce a model whose constructor initializes in its own order: a
Hugging Face model runs `post_init` at the end of each sub-model's constructor, so LlamaForCausalLM
draws [defaults of `model.*`, HF init of `model.*`, default of `lm_head`, HF init of `lm_head`], and
HF skips its init altogether under `torch.device("meta")`. So inside `deferred_init()` every tensor a
factory makes (torch.empty, zeros, randn, arange, ...) is a `LazyTensor`: it reports the device it
would have had (the CPU, unless a device was named), holds no memory, and records every op applied to
it. The model's code sees ordinary CPU tensors (`torch.tensor([]).device` is still the CPU, so HF's
init runs), and in-place initialization is recorded in order, against the storage it writes:

  - an op that makes a new tensor becomes a new root, with the op and its inputs (a lazy input as a
    reference to its root at that moment, a real one as a copy);
  - a view (`weight[padding_idx]`, `.data`, `nn.Parameter(t)`) shares its base's root and adds the view
    op to its path;
  - an in-place op (`normal_`, `zero_`, `copy_`, ...) on a lazy tensor or a view of one is appended to
    its root's log;
  - an op that draws random numbers records the generator's state before it, and is also run on a
    scratch tensor of the same size, so the generator advances exactly as in an eager build (dropout
    masks and data order after the build match eager's; the scratch is freed at once);
  - an op whose result must be real (`.item()`, `.tolist()`, a data-dependent shape) computes its lazy
    inputs from their recordings and runs for real.

Values are computed when `zk.shard` asks for a flat param's (`value`): a root's log is replayed from
the last op that overwrites all of it (an overwritten draw is not replayed at all: its values are
never read and the generator is set from the recorded state before each draw), each draw from its
recorded generator state. So each parameter gets the bits the same constructor gives eagerly after the
same seed. Under a process group every rank replays rank 0's recorded states (broadcast once), as an
eager model's values are broadcast from rank 0.

Not recorded, and refused when seen: ops that change a tensor's metadata in place (`resize_`,
`set_`, `as_strided_`, `t_`), assigning `.data`, and a lazy tensor used outside zerokit (printing
works; arithmetic keeps recording; passing one to a C++ kernel that reads memory does not).
"""
from __future__ import annotations

import contextlib
import hashlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

# Ops whose result does not depend on the tensor they write: replaying a root's log starts at the last one
# of these that covers the whole root.
_OVERWRITES = {"normal_", "uniform_", "zero_", "fill_", "copy_", "bernoulli_", "random_", "exponential_",
               "geometric_", "log_normal_", "cauchy_"}


class _Recording:
    """Every random op's generator state, in the order recorded: what rank 0 broadcasts to the others."""

    def __init__(self):
        self.states: list[torch.Tensor] = []  # CPU generator states (uint8), each before one draw
        self.structure: list[tuple] = []  # (op, shape) of every recorded op: what ranks must agree on

    def draw_state(self, generator: torch.Generator | None) -> int:
        self.states.append((generator.get_state() if generator is not None else torch.get_rng_state()).clone())
        return len(self.states) - 1

    def digest(self) -> int:
        return int.from_bytes(hashlib.blake2b(repr(self.structure).encode(), digest_size=8).digest(), "little",
                              signed=True)


class _Root:
    """One storage: the op that made it, and the in-place ops applied to it or to views of it, in order."""
    __slots__ = ("meta", "creator", "log", "recording")

    def __init__(self, meta: torch.Tensor, creator, recording: _Recording):
        self.meta = meta  # a meta tensor: the storage's shape, strides and dtype
        self.creator = creator  # _Op, whose output number `creator.out` is this root
        self.log: list[_Op] = []
        self.recording = recording


class _Op:
    __slots__ = ("func", "args", "kwargs", "out", "draw", "target")

    def __init__(self, func, args, kwargs, out=0, draw=None, target=None):
        self.func, self.args, self.kwargs, self.out = func, args, kwargs, out
        self.draw = draw  # index into the recording's states, when the op draws random numbers
        self.target = target  # an in-place op: the _Ref (root + view path) it writes


class _Ref:
    """A lazy input as it was when captured: its root's value after the first `version` ops of its log,
    then its view path (a snapshot: `p.data = t` later points p elsewhere, not what was recorded)."""
    __slots__ = ("root", "path", "meta", "version")

    def __init__(self, lazy: "LazyTensor"):
        self.root, self.path, self.meta = lazy._zk_root, lazy._zk_path, lazy._zk_meta
        self.version = len(self.root.log)


class _Const:
    __slots__ = ("value",)

    def __init__(self, value: torch.Tensor):
        self.value = value


class _Gen:
    """An explicit torch.Generator argument: replayed from its state before the op."""
    __slots__ = ("draw",)

    def __init__(self, draw: int):
        self.draw = draw


class LazyTensor(torch.Tensor):
    """A tensor recorded, not allocated ([Note: recording a construction])."""

    @staticmethod
    def __new__(cls, meta: torch.Tensor, root: _Root, path: tuple, device: torch.device, requires_grad: bool = False):
        t = torch.Tensor._make_wrapper_subclass(cls, meta.shape, strides=meta.stride(),
                                                storage_offset=meta.storage_offset(), dtype=meta.dtype,
                                                device=device, requires_grad=requires_grad)
        t._zk_meta, t._zk_root, t._zk_path = meta, root, path
        return t

    __torch_function__ = torch._C._disabled_torch_function_impl

    @property
    def data(self):
        return torch.Tensor.data.__get__(self)  # a detached view (aten.detach): recorded

    @data.setter
    def data(self, new: torch.Tensor) -> None:
        """`p.data = t` (and `module.to(dtype)`, which assigns `.data`): p now records t's values."""
        if not isinstance(new, LazyTensor):  # a real tensor: p shares it, as it would eagerly
            meta = new.to("meta")
            new = LazyTensor(meta, _Root(meta, _Op(torch.ops.aten.alias.default, (_Const(new.detach()),), {}),
                                         self._zk_root.recording), (), new.device)
        torch.Tensor.data.__set__(self, new)
        self._zk_meta, self._zk_root, self._zk_path = new._zk_meta, new._zk_root, new._zk_path

    def __repr__(self, *, tensor_contents=None):
        return f"LazyTensor(shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _record(func, args, kwargs or {})


def is_lazy(t) -> bool:
    return isinstance(t, LazyTensor)


_EMPTY = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided"}


def never_written(t: LazyTensor) -> bool:
    """Made by an uninitialized factory (torch.empty) and never overwritten as a whole: garbage, eagerly."""
    root = t._zk_root
    return (root.creator.func.overloadpacket.__name__ in _EMPTY
            and _Replay._last_overwrite(root, len(root.log)) is None)


class _Factories(TorchDispatchMode):
    """Inside deferred_init(): a factory op (no tensor inputs) makes a LazyTensor instead of memory."""

    def __init__(self, recording: _Recording):
        super().__init__()
        self.recording = recording

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(isinstance(a, torch.Tensor) for a in tree_flatten((args, kwargs))[0]):
            return func(*args, **kwargs)  # a lazy input records itself (LazyTensor.__torch_dispatch__)
        device = kwargs.get("device")
        device = torch.device("cpu") if device is None else torch.device(device)
        try:
            meta = func(*args, **{**kwargs, "device": torch.device("meta")})
        except (TypeError, RuntimeError, NotImplementedError):
            return func(*args, **kwargs)  # not a factory with a device (a scalar op): real
        if not isinstance(meta, torch.Tensor) or meta.dim() == 0:
            return func(*args, **kwargs)  # scalars stay real: they cost nothing and are often read
        draw = self._advance(func, args, kwargs)
        op = _Op(func, args, {k: v for k, v in kwargs.items() if k != "generator"}, 0, draw)
        if kwargs.get("generator") is not None:
            op.kwargs["generator"] = _Gen(draw)
        self.recording.structure.append((str(func), tuple(meta.shape), _values_of(tree_flatten((args, kwargs))[0])))
        return LazyTensor(meta, _Root(meta, op, self.recording), (), device)

    def _advance(self, func, args, kwargs) -> int | None:
        if torch.Tag.nondeterministic_seeded not in func.tags:
            return None
        draw = self.recording.draw_state(kwargs.get("generator"))
        func(*args, **{**kwargs, "device": torch.device("cpu")})  # scratch: the generator moves as in eager
        return draw


def _mmap_large_allocations(threshold: int = 1 << 20) -> None:
    """glibc: serve every allocation of `threshold` bytes or more with its own mmap, unmapped when freed.

    By default glibc raises that threshold (up to 32 MiB) each time a large block is freed, after which
    tensors of a few MiB (a unit's weights) come from the heap, whose freed pages stay resident: the RSS
    peak would then count memory no tensor holds. Fixing the threshold keeps the high-water mark close
    to the peak of live tensors (the same effect as MALLOC_MMAP_THRESHOLD_=1048576 in the environment).
    """
    import ctypes
    import ctypes.util
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(-3, threshold)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


@contextlib.contextmanager
def deferred_init():
    """Build a model inside: its tensors are recorded, not allocated; `zk.shard` computes each flat param's
    values from the recording, with the bits an eager build gives ([Note: recording a construction])."""
    _mmap_large_allocations()  # each draw's scratch goes back to the OS when freed: the peak stays one tensor
    recording = _Recording()
    with _Factories(recording):
        yield


# ------------------------------------------------------------------------------------------- recording
def _to_meta(x):
    if isinstance(x, LazyTensor):
        return x._zk_meta
    if isinstance(x, torch.Tensor):
        return x.to("meta")
    if isinstance(x, torch.device):
        return torch.device("meta")
    return x


def _scratch(x):
    """A real stand-in of a lazy input, for running a draw only to advance the generator."""
    if isinstance(x, LazyTensor):
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype).zero_()
    return x


def _capture(x, draw, refs: dict):
    if isinstance(x, LazyTensor):
        return refs.setdefault(id(x), _Ref(x))
    if isinstance(x, torch.Tensor):
        return _Const(x.detach().clone())
    if isinstance(x, torch.Generator):
        return _Gen(draw)
    return x


def _values_of(flat) -> tuple:
    """What ranks must agree on besides the ops: the scalars and real tensors an op reads (a digest of each)."""
    out = []
    for x in flat:
        if isinstance(x, (bool, int, float, complex, str, torch.dtype)):
            out.append(repr(x))
        elif isinstance(x, torch.Tensor) and not isinstance(x, LazyTensor):
            data = x.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            out.append(hashlib.blake2b(data, digest_size=8).hexdigest())
    return tuple(out)


def _recording_of(flat) -> _Recording:
    for x in flat:
        if isinstance(x, LazyTensor):
            return x._zk_root.recording
    raise AssertionError("no lazy input")


def _real(func, args, kwargs):
    """Run for real: every lazy input computed from its recording."""
    real = tree_map(lambda x: value(x) if isinstance(x, LazyTensor) else x, (args, kwargs))
    return func(*real[0], **real[1])


def _record(func, args, kwargs):
    schema = func._schema
    if torch.Tag.inplace_view in func.tags or func.overloadpacket.__name__ in ("set_", "resize_", "resize_as_"):
        raise RuntimeError(f"zk.deferred_init: {func} changes a recorded tensor's shape or storage in place, which a "
                           "recording cannot replay; build this tensor outside deferred_init(), or out of place")
    flat = tree_flatten((args, kwargs))[0]
    recording = _recording_of(flat)
    mutated = [i for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write]

    def arg(i):
        name = schema.arguments[i].name
        return args[i] if i < len(args) else kwargs.get(name)
    written = [arg(i) for i in mutated if arg(i) is not None]
    if any(isinstance(w, torch.Tensor) and not isinstance(w, LazyTensor) for w in written):
        return _real(func, args, kwargs)  # a real tensor written from lazy ones
    try:
        meta_out = func(*tree_map(_to_meta, args), **tree_map(_to_meta, kwargs))
    except (NotImplementedError, RuntimeError):
        return _real(func, args, kwargs)  # no meta kernel, or a data-dependent result
    outs = meta_out if isinstance(meta_out, (tuple, list)) else (meta_out,)
    if not all(isinstance(o, torch.Tensor) for o in outs) or not outs:
        return _real(func, args, kwargs)  # a Python value (item, equal, is_nonzero): needs the values
    draw = None
    if torch.Tag.nondeterministic_seeded in func.tags:
        gen = kwargs.get("generator")
        draw = recording.draw_state(gen)
        func(*tree_map(_scratch, args), **tree_map(_scratch, kwargs))  # scratch: the generator moves as eagerly
    refs: dict[int, _Ref] = {}
    cargs, ckwargs = tree_map(lambda x: _capture(x, draw, refs), (args, kwargs))
    recording.structure.append((str(func), tuple(tuple(o.shape) for o in outs), _values_of(flat)))
    if written:  # in place: the op joins the log of every root it writes; it returns what it wrote
        for w in written:
            w._zk_root.log.append(_Op(func, cargs, ckwargs, 0, draw, target=refs[id(w)]))
        return written[0] if not isinstance(meta_out, (tuple, list)) else tuple(written)
    base = next((x for x in flat if isinstance(x, LazyTensor)), None)
    results = []
    for k, (o, ret) in enumerate(zip(outs, _returns(schema, len(outs)))):
        if ret.alias_info is not None:  # a view of the (first) lazy input: same root, one more step on its path
            results.append(LazyTensor(o, base._zk_root, base._zk_path + ((func, cargs, ckwargs, k),), base.device))
        else:
            device = base.device
            results.append(LazyTensor(o, _Root(o, _Op(func, cargs, ckwargs, k, draw), recording), (), device))
    if isinstance(meta_out, (tuple, list)):
        return type(meta_out)(results) if isinstance(meta_out, tuple) else results
    return results[0]


def _returns(schema, n):
    rets = list(schema.returns)
    if len(rets) == 1 and n > 1:  # Tensor[]: every element aliases as the list does
        return rets * n
    return rets


# ------------------------------------------------------------------------------------------- replay
def value(t: LazyTensor, states: list[torch.Tensor] | None = None) -> torch.Tensor:
    """The values a lazy tensor holds now, computed on the CPU from its recording (a new tensor). The CPU
    generator is left as it was. `states`: the generator states to replay with (rank 0's), by draw index."""
    saved = torch.get_rng_state()
    try:
        with torch.no_grad(), _no_factories():
            return _Replay(states if states is not None else t._zk_root.recording.states)._arg(_Ref(t))
    finally:
        torch.set_rng_state(saved)


@contextlib.contextmanager
def _no_factories():
    """Replay runs for real, even when called inside deferred_init()."""
    from torch.utils._python_dispatch import _pop_mode_temporarily, _get_current_dispatch_mode
    if isinstance(_get_current_dispatch_mode(), _Factories):
        with _pop_mode_temporarily():
            yield
    else:
        yield


class _Replay:
    def __init__(self, states):
        self.states = states
        self.memo: dict[tuple[int, int], torch.Tensor] = {}
        self.live: dict[int, tuple[torch.Tensor, int]] = {}  # id(root) -> (its tensor being replayed, ops done)


    def _path(self, base: torch.Tensor, path: tuple) -> torch.Tensor:
        for func, cargs, ckwargs, k in path:
            first = [True]

            def sub(x):  # the view's input is the first lazy argument: the base computed so far
                if isinstance(x, _Ref) and first[0]:
                    first[0] = False
                    return base
                return self._arg(x)
            a, kw = tree_map(sub, (cargs, ckwargs), is_leaf=lambda x: isinstance(x, (_Ref, _Const, _Gen)))
            out = func(*a, **kw)
            base = out[k] if isinstance(out, (tuple, list)) else out
        return base

    def root(self, root: _Root, version: int) -> torch.Tensor:
        live = self.live.get(id(root))
        if live is not None and live[1] == version:
            return live[0]
        key = (id(root), version)
        if key in self.memo:
            return self.memo[key]
        start = self._last_overwrite(root, version)
        if start is None:
            made = self._run(root.creator)
            made = made[root.creator.out] if isinstance(made, (tuple, list)) else made
            start = 0
        else:
            made = torch.empty_strided(root.meta.shape, root.meta.stride(), dtype=root.meta.dtype)
        outer = self.live.get(id(root))
        for i in range(start, version):
            self.live[id(root)] = (made, i)
            op = root.log[i]
            target = self._path(made, op.target.path)
            self._run(op, target=target, target_ref=(root, i))
        if outer is not None:
            self.live[id(root)] = outer
        else:
            self.live.pop(id(root), None)
        self.memo[key] = made
        return made

    @staticmethod
    def _last_overwrite(root: _Root, version: int) -> int | None:
        for i in range(version - 1, -1, -1):
            op = root.log[i]
            if op.func.overloadpacket.__name__ not in _OVERWRITES:
                continue
            m = op.target.meta
            if (m.numel() == root.meta.numel() and m.storage_offset() == 0
                    and torch._prims_common.is_non_overlapping_and_dense_or_false(m)
                    and not any(isinstance(x, _Ref) and x.root is root and x is not op.target
                                for x in tree_flatten((op.args, op.kwargs),
                                                      is_leaf=lambda x: isinstance(x, (_Ref, _Const, _Gen)))[0])):
                return i
        return None

    def _arg(self, x):
        if isinstance(x, _Ref):
            return self._path(self.root(x.root, x.version), x.path)
        if isinstance(x, _Const):
            return x.value
        if isinstance(x, _Gen):
            g = torch.Generator()
            g.set_state(self.states[x.draw])
            return g
        if isinstance(x, torch.device):
            return torch.device("cpu")
        return x

    def _run(self, op: _Op, target: torch.Tensor | None = None, target_ref=None):
        root, i = target_ref if target_ref is not None else (None, None)

        def sub(x):
            if isinstance(x, _Ref) and root is not None and x is op.target:
                return target
            return self._arg(x)
        a, kw = tree_map(sub, (op.args, op.kwargs), is_leaf=lambda x: isinstance(x, (_Ref, _Const, _Gen)))
        if "device" in kw:
            kw["device"] = torch.device("cpu")
        if op.draw is not None and not any(isinstance(v, torch.Generator) for v in kw.values()):
            torch.set_rng_state(self.states[op.draw])
        return op.func(*a, **kw)
