"""Floating-point inputs under mixed precision, and full parameters in the middle of a step.

* `engine(...)` casts floating-point tensors among its arguments (nested in lists, tuples and
  dicts) to the param dtype under bf16/fp16, leaves integer and bool tensors alone, and
  `cast_inputs=False` turns that off (torch's own dtype error comes back).
* `engine.state_dict(full=True)` and `engine.summon_full_params()` may be called between
  forward and backward (or anywhere else in a step) at every stage: training continues bit
  for bit as if they had not been called; at stage 3 the units the step gathered keep their
  storage, so the views autograd saved stay valid. At stages 0-2 `summon_full_params` is a
  context whose writes still reach the fp32 masters.

Every comparison is bitwise: the calls under test must change nothing. World sizes 2 and 3
run one spawn each with every case inside it; every rank returns what it saw.
"""
from __future__ import annotations

import collections

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zerokit as zk
from common import OddBlock, odd_batch, odd_model
from zerokit.commands.step import train_step
from zerokit.core.precision import cast_floating_tensors
from zerokit.launch import run_ranks

STAGES = sorted(zk.STAGES)  # an import failure of a stage fails the spawn, never a silent skip
PARAM_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
ADAMW = dict(lr=3e-2, weight_decay=0.1)
STEPS, BATCH = 3, 3
FLOAT_STEPS = 10  # enough AdamW steps for the regression loss to fall clearly
# fp16: a scale that does not overflow on this model, so no step is skipped and the losses
# measure learning, not the scaler's search.
FP16_SCALER = dict(init_scale=2.0 ** 10)


# ---------------------------------------------------------------------- models
class Layer(nn.Module):
    def __init__(self, n_in: int, n_out: int):
        super().__init__()
        self.fc = nn.Linear(n_in, n_out)

    def forward(self, x):
        return torch.tanh(self.fc(x))


class LinearStack(nn.Module):
    """Linear layers fed fp32 features (torch.randn): the input every regression model gets."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Layer(7, 15), Layer(15, 15)])  # stage 3 units
        self.out = nn.Linear(15, 3)  # in the root unit

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


class Probe(nn.Module):
    """Records the dtypes its (nested) arguments arrive in; computes with batch["x"]."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)
        self.seen = None

    def forward(self, batch, pair, scale=None, *, mask):
        self.seen = _dtypes(dict(batch=batch, pair=pair, scale=scale, mask=mask))
        return self.fc(batch["x"])


def _dtypes(obj):
    if isinstance(obj, torch.Tensor):
        return obj.dtype
    if isinstance(obj, (list, tuple)):
        return [_dtypes(item) for item in obj]
    if isinstance(obj, dict):
        return {k: _dtypes(v) for k, v in obj.items()}
    return obj


TEACHER = 0.3 * torch.randn(7, 3, generator=torch.Generator().manual_seed(5))  # the map the stack learns
FLOAT_BATCH = 16  # rows per rank: the per-step loss must be a fair sample for "it learns" to show


def _float_batch(step: int, rank: int, world_size: int):
    """Rank r's rows of a global batch of fp32 features and their targets x @ TEACHER."""
    g = torch.Generator().manual_seed(2000 + step)
    x = torch.randn(FLOAT_BATCH * world_size, 7, generator=g)
    rows = slice(rank * FLOAT_BATCH, (rank + 1) * FLOAT_BATCH)
    return x[rows], (x @ TEACHER)[rows]


def _probe_inputs():
    g = torch.Generator().manual_seed(3)
    batch = {"x": torch.randn(3, 4, generator=g).requires_grad_(), "ids": torch.randint(0, 9, (3,), generator=g)}
    pair = [torch.randn(3, 4, generator=g).double(), (torch.ones(3, dtype=torch.bool), 7)]
    return batch, pair, torch.tensor(2.0), torch.ones(3, dtype=torch.int32)


# ---------------------------------------------------------------------- rank side
def _train_floats(rank, world_size, stage, precision, manual_cast=False, **kw):
    """LinearStack on fp32 features; manual_cast: cast_inputs=False and the loop casts x itself."""
    torch.manual_seed(0)
    model = LinearStack()
    if precision == "fp16":
        kw["loss_scaler"] = FP16_SCALER
    engine = zk.shard(model, torch.optim.AdamW, stage=stage, precision=precision, wrap=(Layer,),
                      cast_inputs=not manual_cast, **kw, **ADAMW)
    losses, out_dtypes = [], set()

    def loss_fn(batch):
        x, y = batch
        out = engine(x.to(PARAM_DTYPE[precision]) if manual_cast else x)
        out_dtypes.add(out.dtype)
        return F.mse_loss(out.float(), y)

    for step in range(FLOAT_STEPS):
        losses.append(train_step(engine, [_float_batch(step, rank, world_size)], loss_fn).loss)
    return dict(losses=torch.stack(losses), params=engine.state_dict(full=True), out_dtypes=out_dtypes)


def _dtype_error(stage, precision):
    torch.manual_seed(0)
    engine = zk.shard(LinearStack(), torch.optim.AdamW, stage=stage, precision=precision, wrap=(Layer,),
                      cast_inputs=False, **ADAMW)
    try:
        engine(torch.randn(BATCH, 7))
    except RuntimeError as exc:
        return str(exc)
    return None


def _train_tokens(rank, world_size, stage, cast_inputs):
    """The odd model (integer token ids in, integer targets) under bf16."""
    engine = zk.shard(odd_model(), torch.optim.AdamW, stage=stage, precision="bf16", wrap=(OddBlock,),
                      cast_inputs=cast_inputs, **ADAMW)
    losses = [train_step(engine, [odd_batch(step, BATCH, rank, world_size)], lambda b: engine(*b)).loss.float()
              for step in range(STEPS)]
    return dict(losses=torch.stack(losses), params=engine.state_dict(full=True))


def _probe(stage, precision):
    torch.manual_seed(0)
    model = Probe()
    engine = zk.shard(model, torch.optim.AdamW, stage=stage, precision=precision, **ADAMW)
    batch, pair, scale, mask = _probe_inputs()
    out = engine(batch, pair, scale, mask=mask)
    engine.backward(out.float().sum())
    engine.step()
    return dict(seen=model.seen, out_dtype=out.dtype, x_grad_dtype=batch["x"].grad.dtype,
                x_grad_finite=bool(torch.isfinite(batch["x"].grad).all()))


def _root_storage(engine):
    """Stage 3: (data_ptr, nbytes) of every unsharded buffer (what autograd's saved views point into)."""
    return [(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in engine.flat_data]


def _train_midstep(rank, world_size, stage, precision, mode, **kw):
    """The odd model for STEPS steps; `mode` says what the loop does between forward and backward.

    "none": nothing. "state_dict": engine.state_dict(full=True). "summon": read a weight inside
    engine.summon_full_params(). "everywhere": state_dict before forward, between forward and
    backward, between backward and step, and a summon between forward and backward.
    """
    model = odd_model()
    engine = zk.shard(model, torch.optim.AdamW, stage=stage, precision=precision, wrap=(OddBlock,), **kw, **ADAMW)
    losses, checks = [], []
    for step in range(STEPS):
        engine.zero_grad()
        before = engine.state_dict(full=True) if mode == "everywhere" else None
        x, y = odd_batch(step, BATCH, rank, world_size)
        loss = engine(x, y)
        storage = _root_storage(engine) if stage == 3 else None
        if mode in ("state_dict", "everywhere"):
            mid = engine.state_dict(full=True)
            if before is not None:
                checks.append(("state_dict between forward and backward = before forward",
                               all(torch.equal(mid[k], before[k]) for k in before)))
        if mode in ("summon", "everywhere"):
            with engine.summon_full_params():
                weight = model.blocks[1].fc2.weight.detach().clone()  # (7, 15) whole, every stage
            reference = engine.state_dict(full=True)["blocks.1.fc2.weight"].to(PARAM_DTYPE[precision])
            checks.append(("summon shows the whole weight", weight.shape == (7, 15) and torch.equal(weight, reference)))
        if stage == 3:
            checks.append(("stage 3 storage kept for backward", _root_storage(engine) == storage))
        engine.backward(loss)
        if mode == "everywhere":
            after = engine.state_dict(full=True)
            checks.append(("state_dict between backward and step = before forward",
                           all(torch.equal(after[k], before[k]) for k in before)))
        engine.step()
        losses.append(loss.detach().float())
    return dict(losses=torch.stack(losses), params=engine.state_dict(full=True), checks=checks)


def _summon_write(rank, world_size, stage, precision):
    """Write a bias inside summon_full_params, then train two steps."""
    model = odd_model()
    engine = zk.shard(model, torch.optim.AdamW, stage=stage, precision=precision, wrap=(OddBlock,), **ADAMW)
    with engine.summon_full_params():
        with torch.no_grad():
            model.blocks[1].fc2.bias.fill_(0.25)  # exact in bf16: the master must hold exactly 0.25
    written = engine.state_dict(full=True)["blocks.1.fc2.bias"]
    losses = [train_step(engine, [odd_batch(step, BATCH, rank, world_size)], lambda b: engine(*b)).loss.float()
              for step in range(2)]
    return dict(written=written, losses=torch.stack(losses), params=engine.state_dict(full=True))


# ---------------------------------------------------------------------- stage 3: a parameter outside forward
class TaggedParameter(nn.Parameter):
    """A parameter class of the user's own: it must survive sharding (isinstance, and its class when gathered)."""


def _attempt(fn) -> str | None:
    """None if fn() ran; the RuntimeError's message if it raised one (anything else propagates)."""
    try:
        fn()
    except RuntimeError as exc:
        return str(exc)
    return None


def _sharded_reads(rank, world_size, precision):
    """What user code may do with a stage-3 parameter outside forward and backward, and what it is refused.

    Every refusal must be an exception (a read of a sharded parameter's 0-byte storage would
    crash the process) naming the parameter and `summon_full_params`; metadata, `.grad`,
    clipping, counting and a torch optimizer's `zero_grad()` keep working; inside forward and
    inside summon_full_params the parameters read as usual.
    """
    import copy
    import io
    model = odd_model()
    model.gain = TaggedParameter(model.gain.detach().clone())  # in the root unit
    psi = sum(p.numel() for p in model.parameters())
    engine = zk.shard(model, torch.optim.AdamW, stage=3, precision=precision, wrap=(OddBlock,), **ADAMW)
    weight = model.blocks[0].fc1.weight  # (15, 7), unit blocks.0
    seen_in_forward = []
    model.blocks[0].fc1.register_forward_pre_hook(
        lambda module, args: seen_in_forward.append((type(module.weight), float(module.weight.float().sum()))))
    torch_opt = torch.optim.SGD(model.parameters(), lr=0.1)  # built over the sharded parameters: zero_grad only
    out = {"refused": {}, "between": {}}
    for step in range(2):
        torch_opt.zero_grad()
        x, y = odd_batch(step, BATCH, rank, world_size)
        loss = engine(x, y)
        if step == 0:  # between forward and backward: blocks.0 is freed again, the root stays gathered for backward
            out["between"] = dict(block=_attempt(lambda: weight.sum()), root=_attempt(lambda: model.gain.sum()))
        loss.backward()
        out.setdefault("norms", []).append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
        engine.step()
    attempts = {
        "sum": lambda: weight.sum(), "norm": lambda: weight.norm(), "float": lambda: float(weight[0, 0]),
        "mul": lambda: weight * 2, "matmul": lambda: torch.ones(3, 7) @ weight.T, "data": lambda: weight.data,
        "detach": lambda: weight.detach(), "tolist": lambda: weight.tolist(),
        "fill_": lambda: torch.no_grad()(weight.fill_)(0.0),
        "assign_data": lambda: setattr(weight, "data", torch.zeros(15, 7)),
        "state_dict": lambda: model.state_dict(),
        "torch.save": lambda: torch.save(model.blocks[0].state_dict(), io.BytesIO()),
        "load_state_dict": lambda: model.blocks[0].load_state_dict({k: torch.zeros(v.shape) for k, v in
                                                                     model.blocks[0].named_parameters()}, strict=False),
        "deepcopy": lambda: copy.deepcopy(model.blocks[0]),
        "root param": lambda: model.gain + 1,
    }
    out["refused"] = {name: _attempt(fn) for name, fn in attempts.items()}
    out["repr"] = repr(weight)
    out["metadata"] = dict(shape=tuple(weight.shape), dtype=str(weight.dtype), device=str(weight.device),
                           is_parameter=isinstance(weight, nn.Parameter), requires_grad=weight.requires_grad,
                           numel=sum(p.numel() for p in model.parameters()), psi=psi,
                           first_device=str(next(model.parameters()).device),
                           grad=type(weight.grad).__name__, tagged=isinstance(model.gain, TaggedParameter),
                           in_set=weight in set(model.parameters()))
    with engine.summon_full_params():
        inside = dict(sum=float(weight.float().sum()), type=type(weight), gain_type=type(model.gain),
                      state=model.state_dict()["blocks.0.fc1.weight"].clone())  # the param dtype
    full = engine.state_dict(full=True)
    out["summon"] = dict(sum=inside["sum"], plain=inside["type"] is nn.Parameter,
                         gain_own_class=inside["gain_type"] is TaggedParameter,
                         equal_full=torch.equal(inside["state"], full["blocks.0.fc1.weight"].to(inside["state"].dtype)),
                         after=_attempt(lambda: weight.sum()))  # the fp32 master, rounded as the param is
    out["forward"] = [(t is nn.Parameter, s) for t, s in seen_in_forward]
    return out


# Stage 3 variants whose units stay gathered after forward (or are prefetched differently):
# the call must keep exactly those gathered.
STAGE3_VARIANTS = {"reshard": {}, "keep": dict(reshard_after_forward=False), "prefetch0": dict(prefetch=0)}
MODES = ("none", "state_dict", "summon", "everywhere")


def _configs():
    for stage in STAGES:
        for name, kw in (STAGE3_VARIANTS.items() if stage == 3 else [("", {})]):
            yield stage, name, kw


def _cases(rank, world_size):
    out = {}
    for precision in ("bf16", "fp16"):
        for stage in STAGES:
            out[("floats", precision, stage)] = _train_floats(rank, world_size, stage, precision)
            out[("floats_manual", precision, stage)] = _train_floats(rank, world_size, stage, precision,
                                                                     manual_cast=True)
            out[("dtype_error", precision, stage)] = _dtype_error(stage, precision)
    for stage in STAGES:
        for cast in (True, False):
            out[("tokens", stage, cast)] = _train_tokens(rank, world_size, stage, cast)
        for precision in ("fp32", "bf16"):
            out[("probe", precision, stage)] = _probe(stage, precision)
            out[("summon_write", precision, stage)] = _summon_write(rank, world_size, stage, precision)
    for precision in ("fp32", "bf16"):
        out[("sharded_reads", precision)] = _sharded_reads(rank, world_size, precision)
    for stage, variant, kw in _configs():
        for precision in ("fp32", "bf16"):
            for mode in MODES:
                out[("midstep", stage, variant, precision, mode)] = _train_midstep(rank, world_size, stage,
                                                                                   precision, mode, **kw)
    return out


@pytest.fixture(scope="module", params=[2, 3])
def results(request, tmp_path_factory):
    return request.param, run_ranks(_cases, request.param, store_dir=str(tmp_path_factory.mktemp("rdzv")),
                                    timeout_s=280)


def _differences(a: dict, b: dict) -> list[str]:
    """Where two runs' losses and full state_dicts are not bitwise equal (empty: equal)."""
    out = []
    if not torch.equal(a["losses"], b["losses"]):
        out.append(f"losses {a['losses'].tolist()} != {b['losses'].tolist()}")
    for k in b["params"]:
        if a["params"][k].dtype != b["params"][k].dtype or not torch.equal(a["params"][k], b["params"][k]):
            out.append(f"{k}: max |diff| {(a['params'][k].float() - b['params'][k].float()).abs().max().item():.3g}")
    return out


# ---------------------------------------------------------------------- cast_inputs
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_float_inputs_train_at_every_stage_under_mixed_precision(results, precision):
    """A Linear stack fed torch.randn trains at every stage under bf16/fp16; stages 1-3 equal stage 0 bitwise."""
    world_size, per_rank = results
    for res in per_rank:
        ref = res[("floats", precision, 0)]
        for stage in STAGES:
            got = res[("floats", precision, stage)]
            assert got["out_dtypes"] == {PARAM_DTYPE[precision]}, (stage, got["out_dtypes"])  # not cast back
            assert torch.isfinite(got["losses"]).all(), (stage, got["losses"])
            # it learns: observed ~1.0 -> ~0.25 over 10 steps at 2 and 3 ranks; half is far from both
            assert got["losses"][-3:].mean() < 0.5 * got["losses"][:3].mean(), (stage, got["losses"].tolist())
            assert not _differences(got, ref), (world_size, stage, _differences(got, ref))


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_input_cast_is_exactly_one_cast_to_the_param_dtype(results, precision):
    """cast_inputs=True trains bit for bit like cast_inputs=False with the loop casting x to the param dtype."""
    _, per_rank = results
    for res in per_rank:
        for stage in STAGES:
            got, manual = res[("floats", precision, stage)], res[("floats_manual", precision, stage)]
            assert not _differences(got, manual), (stage, _differences(got, manual))


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_cast_inputs_false_gives_torchs_dtype_error(results, precision):
    """cast_inputs=False passes fp32 inputs through: torch's own dtype-mismatch error, at every stage."""
    _, per_rank = results
    for res in per_rank:
        for stage in STAGES:
            message = res[("dtype_error", precision, stage)]
            assert message is not None and "same dtype" in message, (stage, message)


def test_integer_inputs_are_not_cast(results):
    """Token ids and integer targets: bf16 training is bitwise the same with cast_inputs on or off, every stage."""
    _, per_rank = results
    for res in per_rank:
        for stage in STAGES:
            on, off = res[("tokens", stage, True)], res[("tokens", stage, False)]
            assert not _differences(on, off), (stage, _differences(on, off))


def test_nested_inputs_cast_floating_tensors_only(results):
    """Dict/list/tuple args and kwargs: float tensors reach the model in bf16, int/bool untouched; fp32: no-op."""
    _, per_rank = results
    b, f32, f64 = torch.bfloat16, torch.float32, torch.float64
    expected = {
        "bf16": dict(batch={"x": b, "ids": torch.int64}, pair=[b, [torch.bool, 7]], scale=b, mask=torch.int32),
        "fp32": dict(batch={"x": f32, "ids": torch.int64}, pair=[f64, [torch.bool, 7]], scale=f32, mask=torch.int32),
    }
    for res in per_rank:
        for stage in STAGES:
            for precision in ("fp32", "bf16"):
                got = res[("probe", precision, stage)]
                assert got["seen"] == expected[precision], (stage, precision, got["seen"])
                assert got["out_dtype"] == PARAM_DTYPE[precision], (stage, precision, got["out_dtype"])
                # the cast is differentiable: the fp32 input gets an fp32 gradient through it
                assert got["x_grad_dtype"] == f32 and got["x_grad_finite"], (stage, precision, got)


def test_cast_floating_tensors_keeps_structure_and_types():
    """The cast walks lists, tuples, namedtuples and dict subclasses, keeping their types and non-float leaves."""
    Pair = collections.namedtuple("Pair", "a b")
    d = collections.defaultdict(list, {"f": torch.ones(2), "i": torch.ones(2, dtype=torch.int64)})
    obj = ([torch.ones(2, dtype=torch.float64)], Pair(torch.ones(2), "s"), collections.OrderedDict(k=d),
           torch.ones(2, dtype=torch.complex64), torch.ones(2, dtype=torch.bool), 3.0)
    out = cast_floating_tensors(obj, torch.bfloat16)
    assert isinstance(out, tuple) and isinstance(out[0], list) and isinstance(out[1], Pair)
    assert isinstance(out[2], collections.OrderedDict) and isinstance(out[2]["k"], collections.defaultdict)
    assert out[0][0].dtype == torch.bfloat16 and out[1].a.dtype == torch.bfloat16 and out[1].b == "s"
    assert out[2]["k"]["f"].dtype == torch.bfloat16 and out[2]["k"]["i"].dtype == torch.int64
    assert out[3].dtype == torch.complex64 and out[4].dtype == torch.bool and out[5] == 3.0
    same = torch.ones(2, dtype=torch.bfloat16)
    assert cast_floating_tensors(same, torch.bfloat16) is same  # already in the dtype: no copy


# ---------------------------------------------------------------------- mid-step calls
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("mode", ["state_dict", "summon", "everywhere"])
def test_midstep_call_leaves_training_bitwise_unchanged(results, mode, precision):
    """state_dict(full=True) / summon_full_params between forward and backward: losses and weights bitwise
    equal to the run without the call, 3 steps, every stage (stage 3 also with units kept or not prefetched)."""
    world_size, per_rank = results
    for res in per_rank:
        for stage, variant, _ in _configs():
            ref = res[("midstep", stage, variant, precision, "none")]
            got = res[("midstep", stage, variant, precision, mode)]
            assert not _differences(got, ref), (world_size, stage, variant, _differences(got, ref))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_midstep_calls_see_the_current_weights_and_keep_stage3_storage(results, precision):
    """Mid-step state_dict equals the one before forward; summon shows whole weights at every
    stage; at stage 3 every unsharded buffer keeps its storage (pointer and size) across the call."""
    _, per_rank = results
    for res in per_rank:
        for stage, variant, _ in _configs():
            for mode in MODES:
                checks = res[("midstep", stage, variant, precision, mode)]["checks"]
                failed = [name for name, ok in checks if not ok]
                assert not failed, (stage, variant, mode, failed)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_summon_writes_reach_the_masters_at_every_stage(results, precision):
    """A write inside summon_full_params shows in state_dict (exactly) and trains the same at every stage."""
    _, per_rank = results
    for res in per_rank:
        ref = res[("summon_write", precision, 0)]
        for stage in STAGES:
            got = res[("summon_write", precision, stage)]
            assert torch.equal(got["written"], torch.full((7,), 0.25)), (stage, got["written"])
            assert not _differences(got, ref), (stage, _differences(got, ref))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_stage3_parameter_outside_forward_refuses_reads_naming_summon_instead_of_crashing(results, precision):
    """Outside forward and backward a stage-3 parameter's storage is 0 bytes; reading it would crash the
    process (`p.sum()`: a segmentation fault). Every read or write of its values, and the torch calls that
    make them (`model.state_dict()`, `torch.save`, `load_state_dict`, `copy.deepcopy`), is a RuntimeError
    naming the parameter and `summon_full_params`; between forward and backward so is a freed unit's, while
    the root, gathered for backward, reads normally."""
    _, per_rank = results
    for res in per_rank:
        got = res[("sharded_reads", precision)]
        for name, message in got["refused"].items():
            assert message is not None, f"{name} on a sharded parameter did not raise"
            assert "zerokit stage 3" in message and "summon_full_params" in message, (name, message)
        for name in ("sum", "norm", "float", "mul", "data", "detach", "fill_", "assign_data"):
            assert "'blocks.0.fc1.weight' (shape (15, 7))" in got["refused"][name], (name, got["refused"][name])
        assert "'gain'" in got["refused"]["root param"]
        assert "blocks.0.fc1.weight" in got["between"]["block"], got["between"]
        assert got["between"]["root"] is None, got["between"]
        assert "blocks.0.fc1.weight" in got["repr"] and "summon_full_params" in got["repr"], got["repr"]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_sharded_parameter_keeps_its_metadata_grad_and_class_and_reads_whole_when_gathered(results, precision):
    """What user code does with parameters it does not read keeps working on sharded ones: shape, dtype,
    device, numel summed over model.parameters() (the unwrapped count), isinstance (a user's Parameter
    subclass too), hashing, `.grad` (a ShardedGrad), clip_grad_norm_ and a torch optimizer's zero_grad.
    Inside forward (a forward pre-hook) and inside summon_full_params the parameter is its own class
    again and reads whole (equal to state_dict(full=True)); after the block it is sharded again."""
    _, per_rank = results
    dtype = str(PARAM_DTYPE[precision])
    for res in per_rank:
        got = res[("sharded_reads", precision)]
        meta = got["metadata"]
        assert meta["shape"] == (15, 7) and meta["dtype"] == dtype and meta["device"] == "cpu", meta
        assert meta["numel"] == meta["psi"] and meta["first_device"] == "cpu", meta
        assert meta["is_parameter"] and meta["requires_grad"] and meta["tagged"] and meta["in_set"], meta
        assert meta["grad"] == "ShardedGrad", meta
        assert len(got["norms"]) == 2 and all(n == n and 0 < n < float("inf") for n in got["norms"]), got["norms"]
        summon = got["summon"]
        assert summon["plain"] and summon["gain_own_class"] and summon["equal_full"], summon
        assert summon["after"] is not None and "summon_full_params" in summon["after"], summon
        assert len(got["forward"]) == 2 and all(plain for plain, _ in got["forward"]), got["forward"]
