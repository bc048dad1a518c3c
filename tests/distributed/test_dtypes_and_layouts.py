"""Dtypes and layouts are the user's: a float64 model trains in float64, and parameters keep their strides.

float64 (core/precision.py [Note: float64 models]): `model.double()` then `zk.shard(..., precision="fp32")`
trains in float64 at every stage, bitwise equal to torch DDP with the same torch optimizer on the same
float64 model (2 gloo ranks, 4 steps, AdamW and SGD with momentum); the flat buffers, `.grad`, optimizer
states and checkpoints are float64, and the communication ledger counts 8 bytes per element. What would
silently round is refused naming the fix.

Layouts (core/params/flat_param.py [Note: parameters keep their strides]): a channels_last conv net (Conv2d +
BatchNorm2d + Linear) and a model with a transposed parameter, stages 0-3 beside DDP: bitwise after 4
steps, `p.stride()` / `p.grad.stride()` / channels_last-ness as DDP's before and after the steps, and a
checkpoint saved from a channels_last model loads into a contiguous one (and back) with equal values.

The loops are plain torch: `model.zero_grad()`, `loss = engine(x, y)`, `loss.backward()`, `engine.step()`.
"""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zerokit as zk
from common import OddBlock, _build_ddp, odd_batch, odd_model
from zerokit.launch import run_ranks

STEPS, BATCH = 4, 3
STAGES = (0, 1, 2, 3)
BUCKET = 40  # elements: many buckets, parameters straddling shard boundaries
OPTIMIZERS = {
    "adamw": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    "sgd": (torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
}


# -- models ---------------------------------------------------------------------------------------------
class ConvNet(nn.Module):
    """Conv2d + BatchNorm2d + Linear: the conv weights are 4-D, so channels_last changes their strides."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(6)
        self.conv2 = nn.Conv2d(6, 5, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(5)
        self.fc = nn.Linear(5 * 4 * 4, 3)

    def forward(self, x, y):
        h = F.relu(self.bn1(self.conv1(x)))
        h = F.relu(self.bn2(self.conv2(h)))
        return F.cross_entropy(self.fc(h.flatten(1)), y)


class Transposed(nn.Module):
    """A Parameter made from `torch.randn(8, 4).t()` (strides (1, 4)), beside an ordinary Linear."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 4).t())  # (4, 8), column-major
        self.lin = nn.Linear(8, 3)

    def forward(self, x, y):
        return F.cross_entropy(self.lin(torch.tanh(x @ self.w)), y)


def conv_model(seed=0, channels_last=True):
    torch.manual_seed(seed)
    model = ConvNet()
    return model.to(memory_format=torch.channels_last) if channels_last else model


def conv_batch(step, rank, world_size):
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(BATCH, 3, 4, 4, generator=g).to(memory_format=torch.channels_last)
    return x, torch.randint(0, 3, (BATCH,), generator=g)


def transposed_model(seed=0):
    torch.manual_seed(seed)
    return Transposed()


def transposed_batch(step, rank, world_size):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(BATCH, 4, generator=g), torch.randint(0, 3, (BATCH,), generator=g)


def fp64_model(seed=0):
    return odd_model(seed).double()


def fp64_model_fine(seed=0):
    """fp64_model with values fp32 cannot hold (the odd model's initial values are fp32 ones, cast up)."""
    model = fp64_model(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.full_like(p, 1e-12))
    return model


def fp64_batch(step, rank, world_size):
    return odd_batch(step, BATCH, rank, world_size)


MODELS = {"fp64": (fp64_model, fp64_batch, (OddBlock,)),
          "channels_last": (conv_model, conv_batch, None),
          "transposed": (transposed_model, transposed_batch, None)}


# -- the loops ------------------------------------------------------------------------------------------
def _layout(model):
    return {n: (p.dtype, p.stride(), p.is_contiguous(memory_format=torch.channels_last) if p.dim() == 4 else None)
            for n, p in model.named_parameters()}


def _grad_layout(model):
    return {n: (p.grad.dtype, p.grad.stride()) for n, p in model.named_parameters() if p.grad is not None}


def _values(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def train(rank, world_size, family, optimizer, stage):
    """STEPS plain steps; stage None is torch DDP. Returns losses, values, layouts and, for zerokit, the engine."""
    make, batch, wrap = MODELS[family]
    cls, kw = OPTIMIZERS[optimizer]
    model = make()
    out = {"layout_before": _layout(model)}
    if stage is None:
        wrapped, opt = _build_ddp(model), cls(model.parameters(), **kw)
    else:
        wrapped = opt = zk.shard(model, cls, stage=stage, bucket_numel=BUCKET, wrap=wrap, **kw)
    out["layout_built"] = _layout(model)
    losses = []
    for step in range(STEPS):
        model.zero_grad()
        loss = wrapped(*batch(step, rank, world_size))
        loss.backward()
        if step == STEPS - 1 and stage in (None, 0):  # stage 0's .grad is the whole gradient, as DDP's
            out["grad_layout"] = _grad_layout(model)
        opt.step()
        losses.append(loss.detach().clone())
    out.update(losses=torch.stack(losses), layout_after=_layout(model))
    out["values"] = _values(model) if stage in (None, 0) else wrapped.state_dict(full=True)
    if stage is not None:
        out["engine"] = wrapped
    return out


def _max_diff(a, b):
    return max([(a[k].double() - b[k].double()).abs().max().item() for k in a] + [0.0])


# -- float64 ----------------------------------------------------------------------------------------------
def _fp64_cases(rank, world_size, tmp):
    res = {}
    for optimizer in OPTIMIZERS:
        ref = train(rank, world_size, "fp64", optimizer, None)
        res[(optimizer, "ddp")] = {k: ref[k] for k in ("losses", "values")}
        for stage in STAGES:
            got = train(rank, world_size, "fp64", optimizer, stage)
            engine = got.pop("engine")
            got["flat_dtypes"] = sorted({str(t.dtype) for t in engine.flat_data})
            got["state_dtypes"] = sorted({str(t.dtype) for t in engine.optimizer.state_tensors()})
            got["grad_shard_dtypes"] = sorted({str(t.dtype) for t in engine.grad_shards()}) if stage else []
            got["max_diff"] = max(_max_diff(got["values"], ref["values"]),
                                  (got["losses"] - ref["losses"]).abs().max().item())
            if optimizer == "adamw":
                path = f"{tmp}/fp64_stage{stage}"
                engine.save(path)
                fresh = zk.shard(fp64_model(seed=1), torch.optim.AdamW, stage=stage, bucket_numel=BUCKET,
                                 wrap=(OddBlock,), **OPTIMIZERS["adamw"][1])
                fresh.load(path)
                got["loaded"] = fresh.state_dict(full=True)
                got["loaded_states"] = [t.clone() for t in fresh.optimizer.state_tensors()]
                got["saved_states"] = [t.clone() for t in engine.optimizer.state_tensors()]
                # one more step from both: the load restored everything the next step reads
                for e in (engine, fresh):
                    e.zero_grad()
                    e(*fp64_batch(STEPS, rank, world_size)).backward()
                    e.step()
                got["next"], got["loaded_next"] = engine.state_dict(full=True), fresh.state_dict(full=True)
            res[(optimizer, stage)] = got
    # gradient norms: torch's clip_grad_norm_ over model.parameters() and engine.clip_grad_norm_, in float64
    norms = {}
    model = fp64_model()
    ddp = _build_ddp(model)
    ddp(*fp64_batch(0, rank, world_size)).backward()
    norms["ddp"] = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
    for stage in STAGES:
        model = fp64_model()
        engine = zk.shard(model, torch.optim.SGD, stage=stage, bucket_numel=BUCKET, wrap=(OddBlock,), lr=0.1)
        model.zero_grad()
        engine(*fp64_batch(0, rank, world_size)).backward()
        norms[("torch", stage)] = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
        norms[("engine", stage)] = engine.clip_grad_norm_(1e9)
    res["norms"] = norms
    res["load_weights"] = _load_weights_case(rank, tmp, "fp64", fp64_model_fine, lambda: fp64_model(seed=4),
                                             (OddBlock,))
    # the communication ledger: 8 bytes per element of a float64 gradient (4 for the same model in fp32)
    moved = {}
    for name, make in (("fp64", fp64_model), ("fp32", odd_model)):
        engine = zk.shard(make(), torch.optim.SGD, stage=0, bucket_numel=10 ** 6, wrap=(OddBlock,), lr=0.1)
        engine.comm.reset_stats()
        engine(*fp64_batch(0, rank, world_size)).backward()
        engine.step()
        numel = sum(fp.padded_numel for fp in engine.flat_params if fp.requires_grad)
        moved[name] = (engine.comm.stats()["all_reduce"], numel)
    res["ledger"] = moved
    # refusals, each naming its fix
    refusals = {}
    mixed = fp64_model()
    mixed.norm.float()
    for what, build in {
        "mixed": lambda: zk.shard(mixed, torch.optim.SGD, stage=1, lr=0.1),
        "bf16": lambda: zk.shard(fp64_model(), torch.optim.SGD, stage=1, precision="bf16", lr=0.1),
        "fp16": lambda: zk.shard(fp64_model(), torch.optim.SGD, stage=2, precision="fp16", lr=0.1),
        "reduce_dtype": lambda: zk.shard(fp64_model(), torch.optim.SGD, stage=2, reduce_dtype=torch.float32, lr=0.1),
        "tree": lambda: zk.shard(fp64_model(), torch.optim.SGD, stage=1, reduction="tree", lr=0.1),
    }.items():
        try:
            build()
            refusals[what] = None
        except ValueError as exc:
            refusals[what] = str(exc)
    res["refusals"] = refusals
    return res


@pytest.fixture(scope="module")
def fp64(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fp64")
    return run_ranks(_fp64_cases, 2, str(tmp), store_dir=str(tmp_path_factory.mktemp("rdzv")), timeout_s=280)


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_float64_model_trains_in_float64_bitwise_as_ddp(fp64, optimizer):
    """model.double() under precision="fp32": every stage's losses and weights equal DDP's bit for bit, and
    the flat buffers, optimizer states and grad shards are float64."""
    for res in fp64:
        ref = res[(optimizer, "ddp")]
        assert {v.dtype for v in ref["values"].values()} == {torch.float64}
        for stage in STAGES:
            got = res[(optimizer, stage)]
            assert got["losses"].dtype == torch.float64
            assert torch.equal(got["losses"], ref["losses"]), (stage, got["losses"] - ref["losses"])
            for k, v in ref["values"].items():
                assert got["values"][k].dtype == torch.float64, (stage, k)
                assert torch.equal(got["values"][k], v), (stage, k, (got["values"][k] - v).abs().max())
            assert got["flat_dtypes"] == ["torch.float64"], (stage, got["flat_dtypes"])
            assert got["state_dtypes"] == ["torch.float64"], (stage, got["state_dtypes"])
            assert got["grad_shard_dtypes"] in ([], ["torch.float64"]), (stage, got["grad_shard_dtypes"])
            assert all(d == torch.float64 for d, _, _ in got["layout_after"].values()), stage


def test_float64_checkpoint_keeps_float64(fp64):
    """engine.save / engine.load of a float64 engine: float64 values and optimizer states come back exactly,
    and the next step from the loaded engine equals the next step from the saved one."""
    for res in fp64:
        for stage in STAGES:
            got = res[("adamw", stage)]
            for k, v in got["values"].items():
                assert got["loaded"][k].dtype == torch.float64 and torch.equal(got["loaded"][k], v), (stage, k)
            assert len(got["loaded_states"]) == len(got["saved_states"])
            for a, b in zip(got["loaded_states"], got["saved_states"]):
                assert a.dtype == torch.float64 and torch.equal(a, b), stage
            for k, v in got["next"].items():
                assert torch.equal(got["loaded_next"][k], v), (stage, k)


def test_float64_communication_counts_8_bytes_per_element(fp64):
    """Stage 0's all-reduce of a float64 model's gradients counts 8 bytes per element (an all-reduce of B
    bytes counts 2B: core/collectives/comm.py), twice the same model's in fp32."""
    for res in fp64:
        (moved64, numel), (moved32, numel32) = res["ledger"]["fp64"], res["ledger"]["fp32"]
        assert numel == numel32 and moved64 == 2 * 8 * numel and moved32 == 2 * 4 * numel, res["ledger"]


def test_float64_gradient_norms_are_float64(fp64):
    """torch.nn.utils.clip_grad_norm_(model.parameters()) and engine.clip_grad_norm_ at every stage return a
    float64 norm, as DDP's does, equal to it to float64 rounding (the sum runs in another order: not bitwise)."""
    for res in fp64:
        ref = res["norms"]["ddp"]
        assert ref.dtype == torch.float64
        for stage in STAGES:
            for how in ("torch", "engine"):
                got = res["norms"][(how, stage)]
                assert got.dtype == torch.float64, (how, stage, got.dtype)
                assert abs(got.item() - ref.item()) <= 1e-13 * ref.item(), (how, stage, got.item(), ref.item())


@pytest.mark.parametrize("case", ["fp64", "channels_last"])
def test_load_weights_keeps_float64_and_fills_strided_parameters(fp64, layouts, case):
    """engine.load_weights of a safetensors file: a float64 model gets the file's float64 bits (no fp32
    rounding on the way), a channels_last one the file's logical values, at every stage."""
    for res in (fp64 if case == "fp64" else layouts):
        got = res["load_weights"]
        if case == "fp64":  # the file holds values fp32 would round
            assert any(not torch.equal(v, v.float().double()) for v in got["file"].values())
        for stage in STAGES:
            for k, v in got["file"].items():
                assert got[stage][k].dtype == v.dtype and torch.equal(got[stage][k], v), (stage, k)


def test_float64_refusals_name_the_fix(fp64):
    """What would silently round a float64 model is refused at zk.shard, naming the fix."""
    for res in fp64:
        r = res["refusals"]
        assert r["mixed"] is not None and "model.double()" in r["mixed"] and "'norm.weight'" in r["mixed"], r
        for what in ("bf16", "fp16"):
            assert r[what] is not None and "model.float()" in r[what], r
        assert r["reduce_dtype"] is not None and "drop reduce_dtype=" in r["reduce_dtype"], r
        assert r["tree"] is not None and "reduction='linear'" in r["tree"], r


# -- strides and memory format ----------------------------------------------------------------------------
def _layout_cases(rank, world_size, tmp):
    res = {}
    for family in ("channels_last", "transposed"):
        for optimizer in OPTIMIZERS:
            ref = train(rank, world_size, family, optimizer, None)
            res[(family, optimizer, "ddp")] = ref
            for stage in STAGES:
                got = train(rank, world_size, family, optimizer, stage)
                engine = got.pop("engine")
                got["max_diff"] = max(_max_diff(got["values"], ref["values"]),
                                      (got["losses"] - ref["losses"]).abs().max().item())
                if family == "channels_last" and optimizer == "adamw":
                    # a channels_last checkpoint into a contiguous model, and that one's back into channels_last
                    path, back = f"{tmp}/cl_stage{stage}", f"{tmp}/contiguous_stage{stage}"
                    engine.save(path)
                    plain = zk.shard(conv_model(seed=1, channels_last=False), torch.optim.AdamW, stage=stage,
                                     bucket_numel=BUCKET, **OPTIMIZERS["adamw"][1])
                    plain.load(path)
                    got["into_contiguous"] = plain.state_dict(full=True)
                    plain.save(back)
                    again = zk.shard(conv_model(seed=2), torch.optim.AdamW, stage=stage, bucket_numel=BUCKET,
                                     **OPTIMIZERS["adamw"][1])
                    again.load(back)
                    got["back_into_channels_last"] = again.state_dict(full=True)
                    # the next step from all three: optimizer states followed the values
                    for e in (engine, plain, again):
                        e.zero_grad()
                        e(*conv_batch(STEPS, rank, world_size)).backward()
                        e.step()
                    got["next"] = [e.state_dict(full=True) for e in (engine, plain, again)]
                res[(family, optimizer, stage)] = got
    res["load_weights"] = _load_weights_case(rank, tmp, "channels_last",
                                             lambda: conv_model(seed=3, channels_last=False),
                                             lambda: conv_model(seed=4), None)
    return res


def _load_weights_case(rank, tmp, name, source, target, wrap):
    """engine.load_weights of a plain safetensors file (contiguous tensors, as torch saves them) at every stage:
    the values the engine then holds, per stage, beside the file's."""
    from safetensors.torch import save_file
    path = f"{tmp}/{name}_weights.safetensors"
    weights = {k: v.detach().contiguous().clone() for k, v in source().state_dict().items()}
    if rank == 0:
        save_file({k: v for k, v in weights.items() if k != "head.weight"}, path)  # a tie saved once
    torch.distributed.barrier()
    out = {"file": weights}
    for stage in STAGES:
        engine = zk.shard(target(), torch.optim.AdamW, stage=stage, bucket_numel=BUCKET, wrap=wrap, lr=1e-2)
        engine.load_weights(path)
        out[stage] = engine.state_dict(full=True)
    return out


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("layouts")
    return run_ranks(_layout_cases, 2, str(tmp), store_dir=str(tmp_path_factory.mktemp("rdzv")), timeout_s=280)


@pytest.mark.parametrize("family", ["channels_last", "transposed"])
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_parameters_keep_their_strides_and_train_bitwise_as_ddp(layouts, family, optimizer):
    """channels_last conv weights and a transposed parameter: every stage keeps p.stride() (and
    channels_last-ness) as DDP does, before and after the steps; stage 0's .grad strides are DDP's; losses
    and weights equal DDP's bit for bit."""
    for res in layouts:
        ref = res[(family, optimizer, "ddp")]
        strided = [n for n, (_, stride, _) in ref["layout_after"].items()
                   if stride != torch.empty(ref["values"][n].shape).stride()]
        assert strided, "the model must hold parameters whose strides are not the contiguous ones"
        assert ref["layout_after"] == ref["layout_before"]
        for stage in STAGES:
            got = res[(family, optimizer, stage)]
            assert got["layout_built"] == ref["layout_before"], stage
            assert got["layout_after"] == ref["layout_after"], stage
            if stage == 0:
                assert got["grad_layout"] == ref["grad_layout"], stage
            assert torch.equal(got["losses"], ref["losses"]), (stage, got["losses"] - ref["losses"])
            for k, v in ref["values"].items():
                assert torch.equal(got["values"][k], v), (stage, k, (got["values"][k] - v).abs().max())


def test_channels_last_checkpoint_loads_into_contiguous_and_back(layouts):
    """engine.save of a channels_last model loads into a contiguous one with equal values (and that one's
    save back into channels_last); the next step from each equals the next step from the saved engine."""
    for rank, res in enumerate(layouts):
        for stage in STAGES:
            got = res[("channels_last", "adamw", stage)]
            for key in ("into_contiguous", "back_into_channels_last"):
                for k, v in got["values"].items():
                    if rank == 0 or k in dict(ConvNet().named_parameters()):  # buffers: rank 0's are saved
                        assert torch.equal(got[key][k], v), (stage, key, k)
            first, *others = got["next"]
            for other in others:
                for k, v in first.items():
                    assert torch.equal(other[k], v), (stage, k)
