"""`zerokit train`: train the built-in GPT on the built-in corpus at any ZeRO stage.

The same loop body (commands/step.py `train_step`) runs for every stage; only `stage=`
changes. Not under torchrun it spawns `--nproc` gloo ranks on this machine itself; under
`torchrun --standalone --nproc-per-node 2 -m zerokit train` it joins torchrun's group.
`--save DIR` writes a sharded checkpoint after the last step, and every K steps with
`--save-every K`; `--resume DIR` loads one, at any stage, world size or precision, and continues
from that step; `--resume auto` does so from --save's DIR when it holds a committed checkpoint
and starts fresh when it holds none, so a restarted or resubmitted job reruns the same command.
`--max-shard-size SIZE` writes each checkpoint's model as Hugging Face's sharded files and index
(checkpoint/format.py [Note: sharded model files]). A checkpoint holds the whole training position
([Note: the training position]). SIGTERM or SIGUSR1 to any rank stops every rank after the same
step, which is saved: exit status 75 (EX_TEMPFAIL, "try again"); core/preemption.py [Note:
agreeing to stop].

[Note: the training position]
What a step computes is a function of the weights, the optimizer and loss-scaler state (in the
checkpoint) and of the step's global micro-batch indices: the data of micro-batch g is
corpus.batch(..., g) (tree) or a slice of it (linear), and torch's generators are seeded from
(seed, g) before its forward, so a dropout draw belongs to the sample, not to the rank. meta.json's
`extra` holds the step (saves happen at step boundaries: micro-step 0), the global micro-batches
consumed and the run's configuration; a resume that changes the model, the optimizer's
hyperparameters, the seed or the data stream (batch size, micro-batches per step, reduction)
is refused naming the option. World size, stage and precision may change; under
`--reduction tree` with the same micro-batches per step the resumed run's bits equal those of
the run never stopped.

`--shard-group-size S` shards stages 1-3 within groups of S ranks and replicates across them
(core/collectives/hybrid.py); across two machines, run on each (node rank 0 and 1, HOST the first's address):

    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \
        --rdzv-id job1 -m zerokit train --stage 3 --shard-group-size 2

`--reduction tree` (core/collectives/tree.py) numbers the step's micro-batches globally, M = nproc ×
accumulate of them, rank r taking r·accumulate ... (r+1)·accumulate - 1, so that runs with
the same M at different --nproc train on the same data; they then print the same weights
digest (`weights sha256`), bit for bit.
"""
from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import time
import traceback

import torch


def add_arguments(p: argparse.ArgumentParser) -> None:
    from zerokit.cli import non_negative_float, non_negative_int, positive_float, positive_int

    p.add_argument("--stage", type=int, default=2, choices=[0, 1, 2, 3], help="ZeRO stage (0 = DDP)")
    p.add_argument("--nproc", type=positive_int, default=2, help="ranks to spawn when not under torchrun (>= 1)")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--reduce-dtype", default=None, choices=["fp32", "bf16", "fp16"],
                   help="dtype gradients are reduced in (default: the param dtype)")
    p.add_argument("--model", default="small", help="model preset (tiny, small, ...)")
    p.add_argument("--steps", type=positive_int, default=300, help="optimizer steps in total (>= 1)")
    p.add_argument("--batch-size", type=positive_int, default=8, help="sequences per rank per micro-step (>= 1)")
    p.add_argument("--accumulate", type=positive_int, default=1,
                   help="micro-steps per optimizer step (no_sync; >= 1)")
    p.add_argument("--reduction", default="linear", choices=["linear", "tree"],
                   help="tree: the same weights, bit for bit, at every --nproc with the same --nproc x --accumulate "
                        "(both powers of two); see core/collectives/tree.py")
    p.add_argument("--shard-group-size", type=positive_int, default=None, metavar="S",
                   help="hybrid sharding: stages 1-3 shard over groups of S ranks (a node's) and replicate across "
                        "them; S divides the world size (default: the whole world); see core/collectives/hybrid.py")
    p.add_argument("--lr", type=non_negative_float, default=3e-3)
    p.add_argument("--weight-decay", type=non_negative_float, default=0.1)
    p.add_argument("--clip", type=non_negative_float, default=1.0, help="global gradient-norm clip (0 = off)")
    p.add_argument("--bucket-numel", type=positive_int, default=1 << 16)
    p.add_argument("--prefetch", type=non_negative_int, default=1, help="stage 3: units gathered ahead")
    p.add_argument("--lora", action="store_true", help="train LoRA adapters on q and v (r=8, alpha=1) only")
    p.add_argument("--checkpointing", action="store_true", help="activation checkpointing per block")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--timeout", type=positive_float, default=600, metavar="SECONDS",
                   help="how long a collective waits for the other ranks before failing: the process-group "
                        "timeout (default 600, as zk.init_distributed)")
    p.add_argument("--save", metavar="DIR", default=None,
                   help="write a sharded checkpoint (engine.save) into DIR after the last step, and after a "
                        "stop signal (SIGTERM, SIGUSR1)")
    p.add_argument("--save-every", type=positive_int, default=None, metavar="K",
                   help="with --save: also commit a checkpoint every K optimizer steps")
    p.add_argument("--max-shard-size", type=shard_size, default=None, metavar="SIZE",
                   help="with --save: write the model as Hugging Face's sharded files of at most SIZE each "
                        "(\"5GB\", \"500MB\", or bytes) and model.safetensors.index.json, as save_pretrained("
                        "max_shard_size=SIZE) does (default: one model.safetensors)")
    p.add_argument("--resume", metavar="DIR|auto", default=None,
                   help="load a checkpoint (any stage / world size / precision) and continue from its step "
                        "up to --steps in total; auto: from --save's DIR if it holds a committed checkpoint, "
                        "else start fresh")


def shard_size(text: str) -> str:
    """--max-shard-size: checked as engine.save reads it (checkpoint/format.py `parse_shard_size`), kept as given."""
    from zerokit.checkpoint.format import parse_shard_size
    try:
        parse_shard_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


EXIT_STOPPED = 75  # EX_TEMPFAIL: stopped by a signal after committing; rerun the command to continue
RUN_FIELDS = ("model", "lora", "seed", "lr", "weight_decay", "clip", "batch_size", "micro_batches_per_step",
              "reduction")  # [Note: the training position]: a resume that changes one is refused


def train_loop(rank: int, world_size: int, cfg: dict) -> dict:
    """One rank's training; returns its summary (losses, memory, throughput)."""
    import zerokit as zk
    from zerokit import bench
    from zerokit.commands.step import train_step
    from zerokit.core import preemption
    from zerokit.models import Block, CharCorpus, build_model

    corpus = CharCorpus.load()
    model = build_model(cfg["model"], seed=cfg["seed"])
    model.checkpointing = cfg["checkpointing"]
    if cfg["lora"]:
        zk.lora.inject(model, targets=("q", "v"), rank=8, alpha=1.0)

    engine = zk.shard(model, torch.optim.AdamW, stage=cfg["stage"], precision=cfg["precision"],
                      reduce_dtype=cfg.get("reduce_dtype"), lr=cfg["lr"], weight_decay=cfg["weight_decay"],
                      bucket_numel=cfg["bucket_numel"], wrap=(Block,), prefetch=cfg["prefetch"],
                      param_groups=bench.no_decay, reduction=cfg.get("reduction", "linear"),
                      shard_group_size=cfg.get("shard_group_size"))
    first_step = 0
    resume = resume_directory(cfg)
    if resume:
        meta = engine.load(resume)  # raises on every rank for a missing file or another model
        if "step" not in meta["extra"]:
            raise ValueError(f"{resume}: its meta.json holds no training step; it was not written by "
                             "`zerokit train --save`")
        first_step = int(meta["extra"]["step"])  # batches continue where the saved run stopped
        if first_step > cfg["steps"] or (first_step == cfg["steps"] and cfg.get("resume") != "auto"):
            raise ValueError(f"--steps {cfg['steps']} is the total step count, and {resume} is already at "
                             f"step {first_step}: pass a larger --steps")
    block = model.cfg.block_size
    every = cfg.get("save_every")
    tokens_per_step = cfg["batch_size"] * block * cfg["accumulate"] * world_size
    losses, skipped, stopped, bar = [], 0, None, None
    try:
        engine.stop_requested()  # the first call installs the stop handlers (core/preemption.py)
        if rank == 0 and not cfg["no_progress"]:
            from zerokit.commands.progress import progress  # a bar on a terminal, plain lines in a log
            bar = progress(cfg["steps"], first_step, f"stage {cfg['stage']} x{world_size} {cfg['precision']}")
        start = time.perf_counter()
        for step in range(first_step, cfg["steps"]):
            micro_batches = [(micro_index(cfg, step, micro, rank, world_size),
                              _micro_batch(corpus, cfg, block, step, micro, rank, world_size))
                             for micro in range(cfg["accumulate"])]
            result = train_step(engine, micro_batches, lambda item: _loss(engine, cfg, *item),
                                clip=cfg["clip"] if cfg["clip"] > 0 else None)
            if not result.stepped:
                skipped += 1
            losses.append(float(result.loss))  # a sync point, once per step: fine for a demo
            done = step + 1
            stop = engine.stop_requested()  # a collective: every rank stops after the same step
            if cfg.get("save") and (stop or done == cfg["steps"] or (every and done % every == 0)):
                engine.save(cfg["save"], extra=position(cfg, done, world_size),  # a collective
                            max_shard_size=cfg.get("max_shard_size"))
            if bar is not None:
                elapsed = time.perf_counter() - start
                bar.set_postfix(loss=f"{losses[-1]:.3f}", tok_s=f"{tokens_per_step * len(losses) / elapsed:,.0f}")
                bar.update(1)
            if stop:
                stopped = {"step": done, "signal": preemption.received_signal(), "time": time.time()}
                break
        elapsed = time.perf_counter() - start
    finally:
        if bar is not None:
            bar.close()
        preemption.SIGNALS.release()
    digest = weights_digest(engine.state_dict(full=True))  # a collective at stages 1-3: every rank calls it
    return {
        "rank": rank, "first_step": first_step, "losses": losses, "weights_sha256": digest, "skipped_steps": skipped, "memory": engine.memory(),
        "tokens_per_s": tokens_per_step * len(losses) / elapsed if losses else 0.0, "seconds": elapsed,
        "comm_bytes": engine.comm_stats(), "comm_bytes_by_group": engine.comm_stats(by_group=True),
        "loss_scale": engine.loss_scale, "stopped": stopped, "resumed_from": resume,
        "num_params": sum(p.numel() for p in model.parameters()),
        "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
    }


def _loss(engine, cfg: dict, index: int, batch) -> torch.Tensor:
    """Micro-batch `index`'s loss; torch's generators are seeded from (seed, index) first ([Note: the training
    position]): the built-in GPT draws nothing, a model with dropout would draw the same at any world size."""
    torch.manual_seed((cfg["seed"] << 32) + index)
    return engine(*batch)[1]


def micro_index(cfg: dict, step: int, micro: int, rank: int, world_size: int) -> int:
    """The global index of this rank's micro-batch `micro` of `step` (M = world size x accumulate per step)."""
    k = cfg["accumulate"]
    if cfg.get("reduction", "linear") == "tree":
        return step * k * world_size + rank * k + micro
    return (step * k + micro) * world_size + rank


def run_config(cfg: dict, world_size: int) -> dict:
    """What a resume must not change ([Note: the training position])."""
    values = {k: cfg.get(k) for k in RUN_FIELDS if k != "micro_batches_per_step"}
    values["reduction"] = values["reduction"] or "linear"
    values["micro_batches_per_step"] = world_size * cfg["accumulate"]
    return values


def position(cfg: dict, step: int, world_size: int) -> dict:
    """meta.json's `extra` after `step` optimizer steps: the training position and the run's configuration."""
    return {"step": step, "micro_step": 0, "micro_batches": step * world_size * cfg["accumulate"],
            "model": cfg["model"], "lora": cfg["lora"], "seed": cfg["seed"], "run": run_config(cfg, world_size)}


def resume_directory(cfg: dict) -> str | None:
    """The checkpoint directory to resume from: --resume DIR, or for --resume auto --save's DIR when it holds a
    committed checkpoint (None: start fresh). A directory that holds something else is refused."""
    from zerokit import checkpoint
    resume = cfg.get("resume")
    if resume != "auto":
        return resume
    directory = cfg["save"]
    if os.path.isfile(os.path.join(directory, checkpoint.POINTER_FILE)):
        return directory
    if os.path.isfile(os.path.join(directory, checkpoint.META_FILE)):
        checkpoint.committed_snapshot(directory)  # raises, saying what the directory holds instead
    return None  # absent, empty, or only a first save that never committed


def _micro_batch(corpus, cfg: dict, block: int, step: int, micro: int, rank: int, world_size: int):
    """This rank's micro-batch `micro` of `step`.

    linear: each micro-step draws one global batch of nproc × batch-size rows, split by rank.
    tree: the step's M = nproc × accumulate micro-batches are numbered globally and rank r takes
    the contiguous run r·accumulate ... — the leaves core/collectives/tree.py's binary tree expects, and
    the same data for every split of M into ranks and micro-steps.
    """
    if cfg.get("reduction", "linear") == "tree":
        k = cfg["accumulate"]
        return corpus.batch(cfg["batch_size"], block, step * k * world_size + rank * k + micro)
    return corpus.batch(cfg["batch_size"], block, step * cfg["accumulate"] + micro, rank, world_size)


def weights_digest(state: dict[str, torch.Tensor]) -> str:
    """sha256 over a state_dict's names, dtypes, shapes and bytes: equal digests are equal weights, bit for bit."""
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def check_arguments(cfg: dict) -> None:
    """The mistakes that can be found before any rank starts: raise ValueError naming the option and the fix.

    Run in the parent before it spawns ranks (and, under torchrun, in every rank before the
    process group exists), so a typo costs no spawn and prints one line.
    """
    from zerokit import checkpoint
    from zerokit.models import PRESETS

    if cfg["model"] not in PRESETS:
        raise ValueError(f"unknown --model {cfg['model']!r}; presets: {', '.join(PRESETS)}")
    if cfg.get("reduction") == "tree":
        nproc = int(os.environ.get("WORLD_SIZE", cfg["nproc"]))
        for flag, value in (("--nproc (or torchrun's world size)", nproc), ("--accumulate", cfg["accumulate"])):
            if value & (value - 1):
                raise ValueError(f"--reduction tree needs {flag} to be a power of two (1, 2, 4, ...), got {value}: "
                                 "the binary tree over micro-batches has no other shape")
    if cfg.get("shard_group_size") is not None:
        from zerokit.core.collectives.hybrid import check_shard_group_size
        nproc = int(os.environ.get("WORLD_SIZE", cfg["nproc"]))
        try:
            check_shard_group_size(cfg["shard_group_size"], nproc)
        except ValueError as exc:
            raise ValueError(f"--shard-group-size: {exc}") from None
    if cfg.get("save_every") is not None and not cfg.get("save"):
        raise ValueError("--save-every K commits a checkpoint into --save DIR every K steps: pass --save DIR")
    if cfg.get("max_shard_size") is not None and not cfg.get("save"):
        raise ValueError("--max-shard-size SIZE splits the model file of --save DIR's checkpoints: pass --save DIR")
    if cfg.get("resume") == "auto" and not cfg.get("save"):
        raise ValueError("--resume auto resumes from --save DIR when it holds a checkpoint: pass --save DIR")
    if cfg.get("resume") and cfg["resume"] != "auto" and not os.path.isdir(cfg["resume"]):
        raise ValueError(f"--resume {cfg['resume']}: no such directory")
    resume = resume_directory(cfg)  # raises ValueError for a directory that holds no committed checkpoint
    if resume:
        snapshot = checkpoint.committed_snapshot(resume)
        with open(os.path.join(snapshot, "meta.json")) as f:
            extra = json.load(f).get("extra", {})
        if "step" not in extra:
            raise ValueError(f"--resume {resume}: its meta.json holds no training step; it was not written by "
                             "`zerokit train --save`")
        if extra.get("model", cfg["model"]) != cfg["model"]:
            raise ValueError(f"--resume {resume} holds model {extra['model']!r}, this run builds {cfg['model']!r}: "
                             f"pass --model {extra['model']}")
        check_run_config(extra.get("run"), cfg, int(os.environ.get("WORLD_SIZE", cfg["nproc"])), resume)
        step = int(extra["step"])
        if step > cfg["steps"] or (step == cfg["steps"] and cfg["resume"] != "auto"):
            raise ValueError(f"--steps {cfg['steps']} is the total step count, and {resume} is already at step "
                             f"{extra['step']}: pass a larger --steps")


def check_run_config(saved: dict | None, cfg: dict, world_size: int, resume: str) -> None:
    """Refuse a resume that changes the model, the optimizer's hyperparameters, the seed or the data stream,
    naming the option ([Note: the training position]); checkpoints without a saved configuration pass."""
    if not saved:
        return
    mine = run_config(cfg, world_size)
    for field in RUN_FIELDS:
        if field in saved and saved[field] != mine[field]:
            if field == "micro_batches_per_step":
                raise ValueError(f"--resume {resume} was trained on {saved[field]} micro-batches per step (world size "
                                 f"x --accumulate), this run takes {mine[field]} ({world_size} x {cfg['accumulate']}): "
                                 f"pick --accumulate so that the product is {saved[field]}")
            flag = "--" + field.replace("_", "-")
            raise ValueError(f"--resume {resume} was trained with {flag} {saved[field]}, this run has {flag} "
                             f"{mine[field]}: pass {flag} {saved[field]} (or start a fresh run in another directory)")


def _torchrun_entry(cfg: dict) -> list[dict]:
    """One torchrun rank: join the group, train, gather every rank's summary (rank 0; the others return their
    own only); the group is destroyed on every path.

    Teardown order (see zerokit/launch.py [Note: process-group teardown]): train_loop's frames, the
    engine and its hooks are released and collected first, then the process group is
    destroyed, all before this function returns, never at interpreter exit.
    """
    import torch.distributed as dist

    import zerokit as zk
    if cfg.get("reduction") == "tree":
        torch.set_num_threads(1)  # see run()
    rank, world_size = zk.init_distributed(timeout_s=cfg.get("timeout", 600))
    try:
        summary = train_loop(rank, world_size, cfg)
        everyone = [None] * world_size
        dist.all_gather_object(everyone, summary)
        if rank != 0:
            everyone = [summary]  # only rank 0 reports; every rank returns the exit status
    except BaseException as exc:
        traceback.clear_frames(exc.__traceback__)  # still printable; the engine in train_loop's locals is let go
        raise
    finally:
        gc.collect()  # hooks make the engine a reference cycle: free it while the group still exists
        dist.destroy_process_group()
    return everyone


def report(summaries: list[dict], cfg: dict) -> None:
    first = summaries[0]
    digests = {s["weights_sha256"] for s in summaries}
    if len(digests) != 1:
        raise RuntimeError(f"zerokit train: the ranks ended with different weights: {sorted(digests)}")
    losses = first["losses"]
    tail = losses[-10:]
    print(f"\nstage {cfg['stage']}, {len(summaries)} rank(s), {cfg['precision']}, model {cfg['model']} "
          f"({first['num_params']:,} params, {first['trainable_params']:,} trainable)")
    if losses:
        print(f"loss: first {losses[0]:.4f}  final {losses[-1]:.4f}  mean of last {len(tail)} "
              f"{sum(tail) / len(tail):.4f}"
              + (f"  (skipped steps: {first['skipped_steps']}, loss scale {first['loss_scale']:g})"
                 if cfg["precision"] == "fp16" else ""))
        print(f"throughput: {first['tokens_per_s']:,.0f} tokens/s over {first['seconds']:.1f} s")
    else:
        print(f"no steps left to train: {first['resumed_from']} is at step {first['first_step']} of {cfg['steps']}")
    print(f"weights sha256: {first['weights_sha256']}"
          + (f"  (reduction tree: the same at any --nproc with --nproc x --accumulate = "
             f"{len(summaries) * cfg['accumulate']})" if cfg.get("reduction") == "tree" else ""))
    size = cfg.get("shard_group_size")
    if size is not None and size < len(summaries) and cfg["stage"] > 0:
        groups = first["comm_bytes_by_group"]
        within, across = (sum(groups[g].values()) for g in ("shard_group", "replicate_group"))
        print(f"hybrid sharding: {len(summaries) // size} shard groups of {size} ranks; rank 0 sent "
              f"{within / 1e6:,.2f} MB within its shard group and {across / 1e6:,.2f} MB across shard groups "
              f"over {len(losses)} steps (ZeRO accounting)")
    if first["resumed_from"]:
        print(f"resumed from {first['resumed_from']} at step {first['first_step']}")
    elif cfg.get("resume") == "auto":
        print(f"started fresh: {cfg['save']} holds no committed checkpoint (--resume auto)")
    stopped = first["stopped"]
    if stopped:
        print(f"stopped by {stopped['signal'] or 'a signal to another rank'} after step {stopped['step']}"
              + (f"; checkpoint committed to {cfg['save']} (step {stopped['step']})" if cfg.get("save") else
                 "; nothing saved (no --save)") + f": exit status {EXIT_STOPPED}")
    elif cfg.get("save") and losses:
        print(f"checkpoint written to {cfg['save']} (step {cfg['steps']})")
    categories = list(first["memory"])
    print("per-rank memory (bytes): " + "  ".join(f"{c:>16}" for c in categories))
    for s in summaries:
        print(f"  rank {s['rank']:<18}" + "  ".join(f"{s['memory'][c]:>16,}" for c in categories))


def run(args: argparse.Namespace) -> int:
    cfg = {k: v for k, v in vars(args).items() if k not in ("command", "verbose")}
    check_arguments(cfg)
    # --reduction tree: a CPU matmul's bits can depend on its thread count (how it blocks its sums), so
    # every rank computes with one thread at every --nproc; the tree then makes the reduction agree too.
    threads = 1 if cfg.get("reduction") == "tree" else None
    rank = 0
    if "WORLD_SIZE" in os.environ:  # under torchrun: this process is one rank
        rank = int(os.environ.get("RANK", "0"))
        summaries = _torchrun_entry(cfg)
    elif args.nproc > 1:
        from zerokit.launch import run_ranks
        # The run may take a day; each collective still fails after --timeout seconds.
        summaries = run_ranks(train_loop, args.nproc, cfg, timeout_s=24 * 3600, collective_timeout_s=cfg["timeout"],
                              threads_per_rank=threads)
    else:
        before = torch.get_num_threads()
        torch.set_num_threads(threads or before)
        try:
            summaries = [train_loop(0, 1, cfg)]
        finally:
            torch.set_num_threads(before)
    if rank == 0:
        report(summaries, cfg)
    return EXIT_STOPPED if summaries[0]["stopped"] else 0
