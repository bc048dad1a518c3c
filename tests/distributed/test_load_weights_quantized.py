"""engine.load_weights into a quantized base (zk.quantize, NF4 / int8) under LoRA, on 2 gloo ranks, at every stage.

The weights of an eagerly built tiny GPT (seed 5) are written as plain float safetensors (original keys,
`blocks.0.attn.q.weight`: a 2-file Hugging Face-style index, and one file), the tied head stored once. The
reference is that model loaded eagerly, frozen but ln_f, quantized (`zk.quantize`, the tied head skipped),
LoRA-injected (seed 1) and sharded. The loaded engine is built the same way from a model of other values
(seed 0) and calls `load_weights`, which quantizes each weight as it arrives. It must hold exactly the
reference's state (packed bytes, adapters, ln_f's fp32 masters; optimizer state empty) and train 2 AdamW
steps bit for bit like it: NF4 and int8 with double quantization, NF4 without, stages 0-3, fp32 and bf16.

Also: Hugging Face GPT-2, whose Conv1D weights are stored (in, out), at stages 0 and 3; a file of packed
bytes (`<layer>.weight_quant`, as zerokit's own state_dict and checkpoints write them); a bf16 file (the
values zk.quantize sees are the file's, cast to the model's dtype). Stage 0 reads each stored tensor
exactly once; at stage 3 each rank reads less than that. Refused on every rank, naming the key: a
mis-shaped weight, packed bytes of the wrong size, both forms of one weight, a missing weight, an
integer weight.
"""
import json
import os

import pytest
import torch

import zerokit as zk
from zerokit.checkpoint import format as ckpt_format
from zerokit.checkpoint.weights import weight_files
from zerokit.launch import run_ranks
from zerokit.models import GPT, Block, preset

from common import train_on_tokens

FORMATS = (("nf4", True), ("int8", True), ("nf4", False))  # (format, double quantization)


def _write_hf_index(directory: str, state: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    keys = sorted(state)
    halves = {"model-00001-of-00002.safetensors": keys[: len(keys) // 2],
              "model-00002-of-00002.safetensors": keys[len(keys) // 2:]}
    for name, part in halves.items():
        save_file({k: state[k].contiguous() for k in part}, os.path.join(directory, name))
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": {k: name for name, part in halves.items() for k in part}}, f)


def _qlora_gpt(fmt: str, double_quant: bool, weights: dict | None = None) -> torch.nn.Module:
    torch.manual_seed(0)
    model = GPT(preset("tiny"))
    if weights is not None:
        model.load_state_dict(weights)
    model.requires_grad_(False)
    model.ln_f.requires_grad_(True)  # one trainable base parameter: its fp32 masters come from the file too
    zk.quantize(model, fmt, skip=("lm_head",), double_quant=double_quant)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        zk.lora.inject(model, targets=("q", "v"), rank=4)
    return model


def _hf_gpt2(weights: dict | None = None) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=61, n_positions=16, n_embd=24, n_layer=2, n_head=2,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    if weights is not None:
        result = model.load_state_dict(weights, strict=False)  # the tied head is saved once
        assert not result.unexpected_keys and set(result.missing_keys) <= {"lm_head.weight"}, result
    model.requires_grad_(False)
    zk.quantize(model, "nf4", skip=("lm_head",))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        zk.lora.inject(model, targets=("c_attn",), rank=4)
    return model


def _gpt2_blocks(model) -> tuple:
    return tuple({type(m) for m in model.modules() if type(m).__name__ == "GPT2Block"})


def _train_hf(engine, steps: int, seed: int) -> list[float]:
    g = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, 61, (2, 12), generator=g)
        loss = engine(input_ids=ids, labels=ids).loss
        loss.backward()
        engine.step()
        engine.zero_grad()
        losses.append(loss.item())
    return losses


class _CountReads:
    """Bytes every SafetensorsReader in this process reads, while active."""

    def __enter__(self):
        self.bytes, self._orig = 0, ckpt_format.SafetensorsReader._read_bytes  # where every read ends
        orig = self._orig

        def counted(reader, key, start, out):
            orig(reader, key, start, out)
            self.bytes += out.numel()
        ckpt_format.SafetensorsReader._read_bytes = counted
        return self

    def __exit__(self, *exc):
        ckpt_format.SafetensorsReader._read_bytes = self._orig


def _masters(engine) -> list[torch.Tensor]:
    return [m.detach().clone() for m in engine.optimizer.master_shards]


def _compare(reference, loaded, train) -> dict:
    a, b = reference.state_dict(), loaded.state_dict()
    start = (a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
             and all(torch.equal(x, y) for x, y in zip(_masters(reference), _masters(loaded)))
             and not any(loaded.optimizer.state_of(m) for m in loaded.optimizer.master_shards))
    differ = sorted(k for k in a if not torch.equal(a[k], b.get(k, torch.empty(0))))
    losses = (train(reference), train(loaded))
    end = all(torch.equal(v, loaded.state_dict()[k]) for k, v in reference.state_dict().items())
    return dict(start_equal=bool(start), differ=differ[:4], losses_equal=losses[0] == losses[1], end_equal=end,
                packed=sum(k.endswith("weight_quant") for k in b))


def _cases(rank: int, world_size: int, root: str) -> dict:
    from safetensors.torch import save_file

    torch.manual_seed(5)
    weights = {k: v.clone() for k, v in GPT(preset("tiny")).state_dict().items()}
    hf = {k: v for k, v in weights.items() if k != "lm_head.weight"}  # a tie saved once
    index_dir, single, bf16 = (os.path.join(root, n) for n in ("index", "single.safetensors", "bf16.safetensors"))
    gpt2_dir, packed = os.path.join(root, "gpt2"), os.path.join(root, "packed.safetensors")
    bad = {name: os.path.join(root, f"{name}.safetensors")
           for name in ("bad_shape", "bad_packed", "both", "missing", "int_weight")}
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(5)
    gpt2 = {k: v.clone() for k, v in GPT2LMHeadModel(GPT2Config(vocab_size=61, n_positions=16, n_embd=24, n_layer=2,
                                                                 n_head=2)).state_dict().items()
            if k != "lm_head.weight"}
    packed_state = {k: v for k, v in _qlora_gpt("nf4", True, weights).state_dict().items()
                    if "lora_" not in k and k != "lm_head.weight"}
    if rank == 0:
        os.makedirs(index_dir, exist_ok=True)
        os.makedirs(gpt2_dir, exist_ok=True)
        _write_hf_index(index_dir, hf)
        _write_hf_index(gpt2_dir, gpt2)
        save_file(hf, single)
        save_file({k: v.to(torch.bfloat16) for k, v in hf.items()}, bf16)
        save_file(packed_state, packed)
        save_file({**hf, "blocks.0.attn.q.weight": torch.zeros(3, 3)}, bad["bad_shape"])
        save_file({**packed_state, "blocks.0.attn.k.weight_quant": torch.zeros(7, dtype=torch.uint8)},
                  bad["bad_packed"])
        save_file({**hf, "blocks.0.attn.v.weight_quant": packed_state["blocks.0.attn.v.weight_quant"]}, bad["both"])
        save_file({k: v for k, v in hf.items() if k != "blocks.1.mlp.fc.weight"}, bad["missing"])
        save_file({**hf, "blocks.0.attn.o.weight": torch.zeros(32, 32, dtype=torch.int32)}, bad["int_weight"])
    torch.distributed.barrier()
    data_bytes = {}
    for name, path in (("index", index_dir), ("single", single)):
        files = set(weight_files(path).values())
        total = 0
        for file in files:
            with ckpt_format.SafetensorsReader(file) as f:
                total += sum(torch.empty((), dtype=f.dtype(k)).element_size() * _numel(f.get_slice(k).get_shape())
                             for k in f.keys())
        data_bytes[name] = total
    out = {"data_bytes": data_bytes}

    def train(engine):
        return train_on_tokens(engine, 2, 20 + rank, 64)

    for fmt, dq in FORMATS:
        for stage in (0, 1, 2, 3):
            for precision in ("fp32", "bf16"):
                kw = dict(stage=stage, precision=precision, wrap=(Block,), lr=1e-2)
                reference = zk.shard(_qlora_gpt(fmt, dq, weights), torch.optim.AdamW, **kw)
                loaded = zk.shard(_qlora_gpt(fmt, dq), torch.optim.AdamW, **kw)
                source = "index" if stage % 2 == 0 else "single"
                with _CountReads() as reads:
                    report = loaded.load_weights(index_dir if source == "index" else single)
                case = _compare(reference, loaded, train)
                out[(fmt, dq, stage, precision)] = dict(case, report=report, read=reads.bytes, source=source)
    for stage in (0, 3):  # Conv1D: W.t() stored (in, out)
        reference = _hf_gpt2(gpt2)
        reference = zk.shard(reference, torch.optim.AdamW, stage=stage, wrap=_gpt2_blocks(reference), lr=1e-2)
        model = _hf_gpt2()
        loaded = zk.shard(model, torch.optim.AdamW, stage=stage, wrap=_gpt2_blocks(model), lr=1e-2)
        report = loaded.load_weights(gpt2_dir)
        out[("gpt2", stage)] = dict(_compare(reference, loaded, lambda e: _train_hf(e, 2, 30 + rank)), report=report)
    for stage in (1, 3):  # packed bytes, as zerokit saves them
        kw = dict(stage=stage, wrap=(Block,), lr=1e-2)
        reference = zk.shard(_qlora_gpt("nf4", True, weights), torch.optim.AdamW, **kw)
        loaded = zk.shard(_qlora_gpt("nf4", True), torch.optim.AdamW, **kw)
        report = loaded.load_weights(packed)
        out[("packed", stage)] = dict(_compare(reference, loaded, train), report=report)
    # a bf16 file: the eager reference loads it into its fp32 model (exact), then quantizes
    rounded = {k: v.to(torch.bfloat16).float() for k, v in weights.items()}
    kw = dict(stage=3, wrap=(Block,), lr=1e-2)
    reference = zk.shard(_qlora_gpt("nf4", True, rounded), torch.optim.AdamW, **kw)
    loaded = zk.shard(_qlora_gpt("nf4", True), torch.optim.AdamW, **kw)
    loaded.load_weights(bf16)
    out["bf16_file"] = _compare(reference, loaded, train)
    for name, path in bad.items():
        engine = zk.shard(_qlora_gpt("nf4", True), torch.optim.AdamW, stage=3, wrap=(Block,), lr=1e-2)
        before = engine.state_dict()
        try:
            engine.load_weights(path)
            out[name] = "not refused"
        except ValueError as exc:
            after = engine.state_dict()
            out[name] = str(exc) if all(torch.equal(before[k], after[k]) for k in before) else "changed the engine"
    return out


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("qweights")
    return run_ranks(_cases, 2, str(root), store_dir=str(tmp_path_factory.mktemp("rdzv")), timeout_s=400)


ADAPTERS = sorted(f"blocks.{i}.attn.{m}.{p}" for i in (0, 1) for m in ("q", "v") for p in ("lora_A", "lora_B"))


@pytest.mark.parametrize("fmt, double_quant", FORMATS)
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_load_weights_quantizes_as_zk_quantize_on_the_loaded_model(results, fmt, double_quant, stage, precision):
    for rank, result in enumerate(results):
        case = result[(fmt, double_quant, stage, precision)]
        assert case["start_equal"] and case["losses_equal"] and case["end_equal"], (rank, case)
        assert case["packed"] == 12, case  # q k v o fc proj in each of the 2 blocks
        assert case["report"] == {"missing": ADAPTERS, "unexpected": []}, case["report"]


def test_each_rank_reads_what_it_keeps(results):
    """Stage 0 reads every stored tensor exactly once; a stage-3 rank reads less (its shards, plus the whole of
    a weight whose double-quant constants it keeps)."""
    for result in results:
        for fmt, dq in FORMATS:
            for precision in ("fp32", "bf16"):
                assert result[(fmt, dq, 0, precision)]["read"] == result["data_bytes"]["index"]
                assert result[(fmt, dq, 1, precision)]["read"] == result["data_bytes"]["single"]
                assert result[(fmt, dq, 3, precision)]["read"] < result["data_bytes"]["single"]


@pytest.mark.parametrize("case", [("gpt2", 0), ("gpt2", 3), ("packed", 1), ("packed", 3), "bf16_file"])
def test_conv1d_packed_and_bf16_sources(results, case):
    for rank, result in enumerate(results):
        got = result[case]
        assert got["start_equal"] and got["losses_equal"] and got["end_equal"], (rank, case, got)


@pytest.mark.parametrize("name, needle", [
    ("bad_shape", "'blocks.0.attn.q.weight' has shape (3, 3), this model's is (32, 32)"),
    ("bad_packed", "'blocks.0.attn.k.weight_quant' holds torch.uint8 (7,)"),
    ("both", "'blocks.0.attn.v.weight' and 'blocks.0.attn.v.weight_quant' are one quantized weight"),
    ("missing", "lacks 1 parameter(s) of this model: 'blocks.1.mlp.fc.weight'"),
    ("int_weight", "'blocks.0.attn.o.weight' has dtype torch.int32")])
def test_bad_quantized_weights_are_refused_on_every_rank_naming_the_key(results, name, needle):
    for result in results:
        assert needle in result[name], result[name]
        assert "rank 0" in result[name] and "rank 1" in result[name]
