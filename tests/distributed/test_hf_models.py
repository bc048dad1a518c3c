"""Models people bring: Hugging Face GPT-2 (also under its own activation checkpointing), Llama, and
PEFT LoRA on GPT-2, at every stage.

They have what zerokit's own models do not: keyword inputs (`input_ids=`, `attention_mask=`,
`labels=`), an output object (`CausalLMOutputWithCrossAttentions`, an OrderedDict subclass)
whose `.loss` the loop backpropagates, an embedding tied to the head by `tie_weights`,
`model.device` / `num_parameters()` read from the parameters, `generate()`, and
`save_pretrained()` / `from_pretrained()` (PEFT's saves the adapter only). The loop is the one a
user writes: `model.zero_grad()`, `out = engine(**batch)`, `out.loss.backward()`, `engine.step()`.

The reference is torch's DistributedDataParallel with `torch.optim.AdamW` on the same weights and
batches, 2 ranks, dropout off (so that no random numbers are drawn): every stage's losses and
weights equal it bit for bit (at 2 ranks a sum of two gradients has one order). At stage 3
`save_pretrained()` outside `summon_full_params()` is refused with an error that names it
(a read of its values would crash the process: core/params/unit.py [Note: a sharded parameter refuses reads]); inside,
every stage writes a checkpoint that `from_pretrained()` loads back equal to
`engine.state_dict(full=True)`. One spawn runs every case.
"""
from __future__ import annotations

import os

import pytest
import torch

import zerokit as zk
from common import _build_ddp
from zerokit.launch import run_ranks

STAGES = sorted(zk.STAGES)
STEPS, ROWS, SEQ, VOCAB = 3, 3, 12, 61
LR = 1e-2
PARAM_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _gpt2():
    """A 2-layer GPT-2 from a config (nothing downloaded), dropout off, the same weights every call."""
    from transformers import GPT2Config, GPT2LMHeadModel
    config = GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=24, n_layer=2, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    return GPT2LMHeadModel(config)


def _lora(model):
    """PEFT LoRA on every attention projection (GPT-2's Conv1D: fan_in_fan_out); B random, so A trains from step 1."""
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(1)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], fan_in_fan_out=True,
                                             lora_dropout=0.0, init_lora_weights="gaussian"))


def _batch(step: int, rank: int, world_size: int) -> dict:
    """Rank r's rows of the step's global batch; the last two positions padded out by the attention mask."""
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, VOCAB, (ROWS * world_size, SEQ), generator=g)[rank * ROWS:(rank + 1) * ROWS]
    mask = torch.ones_like(ids)
    mask[:, -2:] = 0
    return dict(input_ids=ids, attention_mask=mask, labels=ids)


def _llama():
    """A 2-layer Llama from a config: untied head, rotary-embedding buffers, grouped-query attention, RMSNorm."""
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                         tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def _checkpointed(kwargs):
    """GPT-2 with HF's own activation checkpointing switched on (`gradient_checkpointing_enable`)."""
    def build():
        model = _gpt2()
        model.gradient_checkpointing_enable(**({} if kwargs is None else {"gradient_checkpointing_kwargs": kwargs}))
        return model
    return build


# Other models and settings a user brings, each trained by torch DDP and by every stage (fp32).
VARIANTS = {"llama": _llama, "gpt2 checkpointed (HF default)": _checkpointed(None),
            "gpt2 checkpointed, use_reentrant=False": _checkpointed({"use_reentrant": False}),
            "gpt2 checkpointed, use_reentrant=True": _checkpointed({"use_reentrant": True})}

PROMPT = torch.tensor([[5, 17, 3, 40]])


# ---------------------------------------------------------------------- rank side
def _train(rank, world_size, build, stage, precision="fp32"):
    """STEPS steps of the user's loop over a fresh `build()`; stage None: torch DDP + AdamW.
    Returns (model, engine or None, losses, the last output)."""
    model = build()
    if stage is None:
        run = _build_ddp(model)  # its own group under TORCH_DISTRIBUTED_DEBUG=DETAIL (tests/common.py)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
    else:
        blocks = tuple({type(m) for m in model.modules() if type(m).__name__ in ("GPT2Block", "LlamaDecoderLayer")})
        run = opt = zk.shard(model, torch.optim.AdamW, stage=stage, precision=precision, wrap=blocks, lr=LR)
    losses = []
    for step in range(STEPS):
        model.zero_grad()
        out = run(**_batch(step, rank, world_size))
        out.loss.backward()
        opt.step()
        losses.append(out.loss.detach().float())
    return model, None if stage is None else opt, torch.stack(losses), out


def _full_state(model, engine):
    """The whole model's state_dict on every rank: torch's, or the engine's (a collective)."""
    if engine is None:
        return {k: v.detach().clone() for k, v in model.state_dict().items()}
    return engine.state_dict(full=True)


def _counts(model):
    return model.num_parameters(), model.get_nb_trainable_parameters() if hasattr(model, "peft_config") else None


def _torch_ddp(rank, world_size, build):
    model, _, losses, _ = _train(rank, world_size, build, None)
    with torch.no_grad():
        generated = model.generate(PROMPT, max_new_tokens=4, do_sample=False)
    return dict(losses=losses, generated=generated, params=_full_state(model, None))


def _zerokit(rank, world_size, build, stage, precision, save_dir):
    counts = _counts(build())  # before wrapping
    model, engine, losses, out = _train(rank, world_size, build, stage, precision)
    base = model.get_base_model() if hasattr(model, "peft_config") else model
    res = dict(losses=losses, output_type=type(out).__name__, logits_shape=tuple(out.logits.shape),
               counts=(counts, _counts(model)), device=str(model.device),
               tied=base.lm_head.weight is base.transformer.wte.weight)
    with torch.no_grad():
        try:
            res["generated"] = model.generate(PROMPT, max_new_tokens=4, do_sample=False)
            res["generate_outside"] = None
        except RuntimeError as exc:  # PEFT's generate() calls the inner model, not the wrapped root
            res["generate_outside"] = str(exc)
            with engine.summon_full_params(writeback=False):
                res["generated"] = model.generate(PROMPT, max_new_tokens=4, do_sample=False)
        engine.register_forward_method("generate")  # accepted at every stage; stage 3 gathers the root for it
        res["generated_registered"] = model.generate(PROMPT, max_new_tokens=4, do_sample=False)
        res["gathered_after"] = engine.unsharded_param_bytes() if stage == 3 else 0
    try:  # outside summon_full_params: refused at stage 3, a plain save below it
        if rank == 0:
            model.save_pretrained(os.path.join(save_dir, "outside"))
        res["save_outside"] = None
    except RuntimeError as exc:
        res["save_outside"] = str(exc)
    with engine.summon_full_params(writeback=False):
        if rank == 0:
            model.save_pretrained(os.path.join(save_dir, "inside"))
    res["params"] = engine.state_dict(full=True)
    return res


def _cases(rank, world_size, tmp):
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    out = {}
    for kind, build in (("gpt2", _gpt2), ("lora", lambda: _lora(_gpt2()))):
        out[(kind, "ddp")] = _torch_ddp(rank, world_size, build)
        for stage in STAGES:
            for precision in ("fp32", "bf16"):
                save_dir = os.path.join(tmp, f"{kind}-{stage}-{precision}")
                out[(kind, stage, precision)] = _zerokit(rank, world_size, build, stage, precision, save_dir)
    for name, build in VARIANTS.items():
        for stage in [None] + STAGES:
            model, engine, losses, _ = _train(rank, world_size, build, stage)
            out[(name, stage)] = losses, _full_state(model, engine)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("hf"))
    return tmp, run_ranks(_cases, 2, tmp, store_dir=tmp, timeout_s=280)


# ---------------------------------------------------------------------- tests
@pytest.mark.parametrize("kind", ["gpt2", "lora"])
def test_a_user_loop_over_a_hf_model_trains_like_torch_ddp_at_every_stage(results, kind):
    """fp32: losses and every weight bit for bit equal to torch DDP + AdamW at stages 0-3 (PEFT: the frozen
    base unchanged, the adapters trained alike); bf16: stages 1-3 bit for bit equal to stage 0."""
    _, per_rank = results
    for rank, res in enumerate(per_rank):
        ref = res[(kind, "ddp")]
        bf16_ref = res[(kind, 0, "bf16")]
        for stage in STAGES:
            got = res[(kind, stage, "fp32")]
            assert torch.equal(got["losses"], ref["losses"]), (rank, stage, got["losses"], ref["losses"])
            differ = [k for k in ref["params"] if not torch.equal(got["params"][k], ref["params"][k])]
            assert set(got["params"]) == set(ref["params"]) and not differ, (rank, stage, differ)
            bf16 = res[(kind, stage, "bf16")]
            assert torch.equal(bf16["losses"], bf16_ref["losses"]), (rank, stage, bf16["losses"], bf16_ref["losses"])
            assert torch.isfinite(bf16["losses"]).all()


@pytest.mark.parametrize("kind", ["gpt2", "lora"])
def test_a_hf_models_outputs_ties_counts_and_generate_survive_wrapping(results, kind):
    """The output object keeps its type; the head stays tied to the embedding; num_parameters() (and PEFT's
    trainable count) and model.device read as before wrapping, at stage 3 too; greedy generate() after
    training gives torch DDP's tokens at every stage. PEFT's generate() calls the inner model rather than
    the wrapped PeftModel, so at stage 3 the root unit is not gathered: it raises an error naming
    summon_full_params; inside summon_full_params(writeback=False), or once registered with
    engine.register_forward_method("generate") (accepted at every stage), it gives DDP's tokens, and
    after it no unit is left gathered."""
    _, per_rank = results
    for res in per_rank:
        ref = res[(kind, "ddp")]
        for stage in STAGES:
            got = res[(kind, stage, "fp32")]
            assert got["output_type"] == "CausalLMOutputWithCrossAttentions", (stage, got["output_type"])
            assert got["logits_shape"] == (ROWS, SEQ, VOCAB)
            assert got["tied"], stage
            before, after = got["counts"]
            assert before == after, (stage, before, after)
            assert got["device"] == "cpu"
            assert torch.equal(got["generated"], ref["generated"]), (stage, got["generated"], ref["generated"])
            assert torch.equal(got["generated_registered"], ref["generated"]), (stage, got["generated_registered"])
            assert got["gathered_after"] == 0, (stage, got["gathered_after"])
            if kind == "lora" and stage == 3:  # PeftModel.generate calls the inner model: the root is not gathered
                assert got["generate_outside"] is not None and "summon_full_params" in got["generate_outside"]
            else:
                assert got["generate_outside"] is None, (stage, got["generate_outside"])


@pytest.mark.parametrize("kind", ["gpt2", "lora"])
def test_save_pretrained_is_refused_at_stage3_outside_summon_and_round_trips_inside(results, kind):
    """Stage 3 outside summon_full_params: a RuntimeError naming it (a read would crash the process); stages 0-2
    save there. Inside it, every stage's checkpoint loads with from_pretrained (PEFT: the adapter onto a fresh
    base) equal to engine.state_dict(full=True)."""
    from peft import PeftModel
    from transformers import GPT2LMHeadModel
    tmp, per_rank = results
    rank0 = per_rank[0]
    for stage in STAGES:
        for precision in ("fp32", "bf16"):
            got = rank0[(kind, stage, precision)]
            if stage == 3:
                refused = got["save_outside"]
                assert refused is not None and "summon_full_params" in refused, refused
            else:
                assert got["save_outside"] is None, (stage, got["save_outside"])
            path = os.path.join(tmp, f"{kind}-{stage}-{precision}", "inside")
            if kind == "gpt2":
                loaded = GPT2LMHeadModel.from_pretrained(path).state_dict()
                names = got["params"].keys()
            else:
                loaded = PeftModel.from_pretrained(_gpt2(), path).state_dict()
                names = [k for k in got["params"] if "lora_" in k]
                assert len(names) == 4, names
            for name in names:
                # bf16: the saved params are the fp32 masters' roundings (loaded as saved, or into an fp32 base)
                want = got["params"][name].to(PARAM_DTYPE[precision]).to(loaded[name].dtype)
                assert torch.equal(loaded[name], want), (stage, precision, name)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_llama_and_hf_activation_checkpointing_train_like_torch_ddp_at_every_stage(results, variant):
    """A Llama (untied head, rotary buffers, grouped-query attention) and GPT-2 under HF's own
    `gradient_checkpointing_enable()` (its default, and use_reentrant True and False): losses and every
    weight bit for bit torch DDP's, stages 0-3."""
    _, per_rank = results
    for rank, res in enumerate(per_rank):
        ref_losses, ref_params = res[(variant, None)]
        for stage in STAGES:
            losses, params = res[(variant, stage)]
            assert torch.equal(losses, ref_losses), (rank, stage, losses, ref_losses)
            differ = [k for k in ref_params if not torch.equal(params[k], ref_params[k])]
            assert set(params) == set(ref_params) and not differ, (rank, stage, differ)
