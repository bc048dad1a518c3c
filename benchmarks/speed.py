"""Step time and allocator bytes of zerokit's stages beside torch's DDP, ZeroRedundancyOptimizer, FSDP1 and FSDP2.

    python benchmarks/speed.py                    # 2 gloo ranks, model small, 30 steps, fp32
    python benchmarks/speed.py --nproc 2 --model small --steps 30 --warmup 5 --precision fp32
    python benchmarks/speed.py --nproc 4 --model small --steps 20 --warmup 5 --precision fp32

docs/design.md ("Speed, from the first line") names torch's implementations as the yardstick. One
spawn of `--nproc` ranks trains, in turn, each configuration below from the same initial
weights (`build_model(seed)`) on the same batches (`CharCorpus.batch`), with the same AdamW
hyperparameters (lr, betas, weight decay 0.1 on matrices and 0 on biases/LayerNorms), through
one loop body (`_timed_steps`, around zerokit/bench.py's `timed_step`). Each zerokit stage is set beside its peers, every peer a run
(and a row) of its own:

    zerokit stage 0  vs  torch DDP (gradient_as_bucket_view=True: grads live in the all-reduce
                         buckets, as zerokit's live in its flat buffers; zerokit's bucket size)
    zerokit stage 1  vs  torch ZeroRedundancyOptimizer over that DDP (parameters_as_bucket_view:
                         DDP all-reduces the grads, each rank steps its own params, then
                         broadcasts them per bucket: torch's ZeRO-1 recipe)
    zerokit stage 2  vs  torch FSDP1 ShardingStrategy.SHARD_GRAD_OP, and torch DDP listed as a
                         reference (replicated: not a stage-2 design, never the "fastest peer")
    zerokit stage 3  vs  torch FSDP1 ShardingStrategy.FULL_SHARD and torch FSDP2 `fully_shard`
                         (reshard_after_forward=True), two rows

Both FSDPs wrap the same units as zerokit's stage 3 (`wrap=(Block,)`): FSDP1 through
`ModuleWrapPolicy({Block})` (the root holds the rest), FSDP2 by `fully_shard` on every Block
and then on the root. FSDP1 runs with `use_orig_params=True`, since only then can AdamW keep
the decay / no-decay groups (flat FlatParameters would mix both; the groups are chosen by
parameter name before wrapping, as FSDP1's sharded views are 1-D), and with
`device_id=torch.device("cpu")` on CPU: torch 2.13's FSDP1 refuses `device_id=None` without an
accelerator ("FSDP needs a non-CPU accelerator device"). A peer that cannot run here is
recorded with its exact error, no number.

Step time. Every run is repeated `--rounds` times from fresh weights, odd rounds in reverse
order, so slow drift of the machine favours neither side. Per run, round and rank: the time of
every step (forward + backward + optimizer step + zero_grad, up to the loss read back to the
host), the local loss of every step, and the model-state bytes this rank holds after the last
optimizer step (zerokit: `engine.memory()`; torch: the storages of the local params, grads and
optimizer states, counted once each). A run's step time is the median over every round's steps
after its `--warmup`, on the slowest rank; tokens/s is the global batch (batch size x block size
x ranks) divided by it; the loss check is the largest |zerokit loss - peer loss| over all steps,
rounds and ranks. ZeroRedundancyOptimizer and FSDP may reduce in another order than zerokit, so
they are held to a stated tolerance, not to equality (at 2 ranks they do agree bit for bit: a
sum of two values has only one order). Each stage's ratio is zerokit's time over its FASTEST
peer's (the reference row excluded), and every pair's own ratio is listed too; beside it, the
lowest and highest of that ratio taken round by round (each round's own medians), the spread
that time alone puts on it.

Allocator bytes. After the timing rounds every run is built once more, untimed, and trained
`--memory-warmup` + `--memory-steps` steps (the same loop body; the first steps create the
optimizer states); over the last `--memory-steps` steps two figures per rank:

    peak in a step         the most allocator bytes live at any moment inside a step
    between steps          the bytes live at a step boundary (before the step's forward)

both counted from just before the run's model is built, so that they hold the run's params,
grads, optimizer states, buckets and caches, and not the batches or another run's leftovers.
The table shows the largest peak over steps and ranks, and the largest over ranks of the median
over boundaries. On CUDA they are `torch.cuda.max_memory_allocated` (its peak reset at every
boundary) and `torch.cuda.memory_allocated`, minus what was allocated before the build.

On CPU torch has no allocator counter to read from Python, so the run (model construction
included) goes under `torch.profiler.profile(profile_memory=True)`, whose allocator events each
carry c10's "Total Allocated", with a probe (a marker around a 4-byte allocation) just before
the build and at every boundary. That counter has two faults for this purpose, both met here:
(1) it is updated only on a thread where profiling is enabled, so frees (and allocations) made
on gloo's worker threads are missing, and a collective's buffer whose last reference gloo drops
stays counted (benchmarks/investigations/cpu_frees.py shows it); (2) it is one counter for the process, carried
from one profiled run to the next. (2) is met by counting from the probe before the build; (1)
by setting c10's `caffe2_report_cpu_memory_usage` flag for the pass (`_all_threads_counter`: the
flag has no Python binding, so it is set through ctypes on libc10's global and put back after),
under which c10 updates the counter for every thread's allocations and frees. The events are
still recorded on the main thread only, so the counter is read at every main-thread allocator
event and probe: a buffer that a gloo thread allocates and frees between two of those is not in
a peak. Where the flag cannot be found (another build or platform), the figures fall back to a
ledger of the main thread's own events, in which a block freed on another thread counts as live
until its address is allocated again (the allocator cannot hand out a live address): upper
bounds as to gloo's frees, labelled as such. With the flag, the JSON keeps that main-thread
ledger beside the counter's figures (`main_thread`; `unseen_free_bytes`, the bytes found freed
unseen by address reuse), which shows what fault (1) alone would have done to the numbers.

torch's optimizers get `foreach=True`: on CPU their default is a Python loop over parameters,
which would time torch's loop rather than its design (zerokit's sharded optimizer steps a few
flat buffers, so it has no such loop to lose). With `--precision bf16/fp16` only zerokit changes
precision; the torch peers stay fp32, as in `zerokit compare`.

With CUDA available the ranks use NCCL, one GPU each, and time with `torch.cuda.synchronize()`;
results go to speed_vs_torch_cuda.*. Without it: gloo on CPU, speed_vs_torch_cpu.*. A world size
other than 2 adds `_n<N>` to the name (`--nproc 4`: speed_vs_torch_cpu_n4.*), so that the two
target world sizes keep a results file each. Both through zerokit/provenance.py (`provenance`,
`write_pair`): command, date, commit, machine, versions.

    python benchmarks/speed.py --peers plain --nproc 1 --model gpt2-medium --precision bf16 \
        --batch-size 8 --steps 15 --warmup 5 --rounds 2 --bucket-numel 4194304

`--peers plain` (world size 1 only) compares every zerokit stage with plain torch on one device
instead: no process group, no wrapper, `torch.optim.AdamW` (foreach, the same decay / no-decay
groups and hyperparameters) over the model's parameters, `loss.backward()`, `opt.step()`,
`opt.zero_grad()` (set_to_none, torch's default). Everything runs in this one process. Under
`--precision bf16` there are two such peers, since plain torch has two common bf16 recipes:

    torch autocast bf16   fp32 params, forward under torch.autocast(dtype=torch.bfloat16),
                          fp32 grads and AdamW states (16 bytes/param, as zerokit's 2+2+4+8)
    torch bf16 params     model.to(torch.bfloat16): bf16 params, grads and AdamW states, no fp32
                          master (8 bytes/param; not the same numerics as zerokit's fp32 master)

under fp32 one, `torch fp32`. zerokit at world size 1 issues no collective, so the ratio is
its per-step overhead (hooks, flat buffers, the sharded optimizer's fp32 master update) over
torch's own loop. The allocator pass is off by default there (`--memory-steps` turns it on),
so that its runs take the time they always did. Results go to
speed_vs_torch_plain_<cpu | cuda>.json and .md.

Paired mode (`--paired`): zerokit beside a torch peer in paired, alternating steps.

    python benchmarks/speed.py --paired                 # 2 gloo ranks, stages 0 and 1, 300 pairs
    python benchmarks/speed.py --paired --nproc 2 --stages 0 1 2 3 --steps 300 --warmup 20

The block mode above runs each engine for a block of steps, then its peer: on a busy machine
the ratio of two such blocks moves with nothing changed (its "by round" spread), so a difference
of a few percent cannot be read from it. Here each rank builds the zerokit stage
and its peer once (the block mode's construction: the same weights, batches, AdamW with the
decay / no-decay split, bucket size), keeps both alive, and runs them in turns: step i of one,
then step i of the other, the order swapped at every pair, each on the same batch. A step is timed
as the block mode times it (forward, backward, optimizer step, the peer's zero_grad, reading
the loss), and a pair's figure is the slowest rank's. Each pair gives one ratio, zerokit's time over
the peer's, taken a few milliseconds apart, so slow drift (a neighbour's load, clock changes)
divides out. Reported: the median of the pair ratios with its distribution-free 95% confidence
interval (order statistics of a binomial(n, 1/2)), the share of pairs zerokit won, the ratio of
the two median step times, and the largest loss difference (0: bit for bit).

The peers of each stage are the block mode's (`PEERS`; not the DDP reference beside stage 2).
Beside the wall time, each step's CPU time: `time.process_time()` of each rank's process over
the same step (the main thread and gloo's), summed over ranks, with its own pair ratios and
interval; a step that waits costs wall time, one that computes more costs CPU time too.
`--model` also takes benchmarks/scaling.py's sizes (1M, 4M, 15M, 50M, 124M), `--bucket-numel
default` gives each library its own default bucket (zerokit's per stage, DDP's 25 MB, as the
sweep runs them), `--precision bf16` puts the peers under bf16 too (as the sweep does),
`--reduction` is zk.shard's ordered_reduction, and `--nproc 1 --peers plain` sets each stage
beside plain torch instead (zerokit's one-rank overhead):

    python benchmarks/speed.py --paired --nproc 2 --model 4M --batch-size 1 --bucket-numel default \
        --stages 0 --steps 300 --warmup 20 --out benchmarks/results/speed_stage0_4m_n2

Both engines issue their collectives on the same gloo group, one step after the other, the same on
every rank. Writes benchmarks/results/paired_steps.json and .md (command, date, commit, machine)."""
from __future__ import annotations

import argparse
import contextlib
import copy
import ctypes
import gc
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from zerokit.bench import decay_groups, no_decay, timed_step, torch_ddp, unique_bytes  # noqa: E402
from zerokit.commands.compare import available_stages, environment  # noqa: E402
from zerokit.launch import run_ranks  # noqa: E402
from zerokit.provenance import command_line, git_commit, provenance, provenance_lines, write_pair  # noqa: E402

# Largest |Δloss| accepted between a pair at fp32. The DDP pairs sum gradients in the same
# order and may agree exactly; ZeroRedundancyOptimizer and FSDP reduce in other orders
# (per-parameter broadcasts, reduce-scatter), which moves the last bits of each step's
# update, and over tens of steps that drift stays around 1e-6..1e-5 on the loss.
FP32_LOSS_TOLERANCE = 1e-4
DDP_DEFAULT_BUCKET_NUMEL = 25 * 2**20 // 4  # DDP's own default cap, bucket_cap_mb=25, in fp32 elements
MODEL_STATES = ("params", "grads", "master_params", "optimizer_states")
ORDERED = {"default": None, "ordered": True, "native": False}  # --reduction -> zk.shard(ordered_reduction=)
DDP, ZERO = "torch DDP", "torch ZeroRedundancyOptimizer"
FSDP1_GRAD_OP, FSDP1_FULL, FSDP2 = "torch FSDP1 SHARD_GRAD_OP", "torch FSDP1 FULL_SHARD", "torch FSDP2 fully_shard"
FSDP = (FSDP1_GRAD_OP, FSDP1_FULL, FSDP2)
# zerokit stage -> [(torch run, why it sits beside this stage)], one row each
PEERS = {
    0: [(DDP, "same idea: replicated model, bucketed gradient all-reduce (gradient_as_bucket_view)")],
    1: [(ZERO, "optimizer states sharded; torch shards whole params and broadcasts them (per bucket) after the "
               "step")],
    2: [(FSDP1_GRAD_OP, "grads and optimizer states sharded, params gathered per Block; unlike ZeRO-2, FSDP1 frees "
                        "the gathered params after backward, so it also holds params sharded between steps"),
        (DDP, "reference, not a peer: replicated params, grads and optimizer states (16 bytes/param), what "
              "stage 2 is meant to save memory against")],
    3: [(FSDP1_FULL, "parameters sharded, one unit per Block plus the root (FSDP1 FlatParameters, "
                     "use_orig_params=True)"),
        (FSDP2, "parameters sharded, fully_shard on every Block and then the root (per-parameter DTensor shards)")],
}
# listed beside a stage without being one of its peers: never its "fastest peer" nor its "lowest peer"
REFERENCES = {(2, DDP)}
# --peers plain: torch on one device, no wrapper (world size 1)
PLAIN_FP32, PLAIN_AUTOCAST, PLAIN_BF16 = "torch fp32", "torch autocast bf16", "torch bf16 params"
PLAIN = {
    PLAIN_FP32: "plain torch loop, fp32 params, grads and AdamW states",
    PLAIN_AUTOCAST: "plain torch loop, fp32 params under torch.autocast(bfloat16): fp32 grads and AdamW states",
    PLAIN_BF16: "plain torch loop, model.to(bfloat16): bf16 params, grads and AdamW states, no fp32 master",
}
# CPU allocator pass: profiler markers at every step boundary and just before the run is built
MARK, BASE = "zerokit.speed_vs_torch.boundary", "zerokit.speed_vs_torch.base"
ALLOCATOR_CPU = ("torch.profiler(profile_memory=True) events' Total Allocated, with c10's "
                 "caffe2_report_cpu_memory_usage set so that every thread's allocations and frees count")
ALLOCATOR_CPU_MAIN = ("torch.profiler(profile_memory=True), main thread only: frees made on gloo's threads are not "
                      "seen (benchmarks/investigations/cpu_frees.py), so an unseen free counts as live until its address is reused")
ALLOCATOR_CUDA = "torch.cuda.max_memory_allocated (reset at every boundary) / torch.cuda.memory_allocated"


def peers_for(stage: int, cfg: dict) -> list[tuple[str, str]]:
    """The torch runs a zerokit stage is compared with: (name, why), one pair each."""
    if cfg.get("peers", "default") != "plain":
        return list(PEERS[stage])
    names = [PLAIN_FP32] if cfg["precision"] == "fp32" else [PLAIN_AUTOCAST, PLAIN_BF16]
    return [(name, PLAIN[name]) for name in names]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2, help="ranks to spawn (default 2; 4 works on 2 cores, slowly)")
    p.add_argument("--model", default="small", help="model preset (default small)")
    p.add_argument("--steps", type=int, default=30, help="steps per run, warm-up included (default 30)")
    p.add_argument("--warmup", type=int, default=5, help="steps of each round left out of the median (default 5)")
    p.add_argument("--rounds", type=int, default=3,
                   help="times every run is repeated, from fresh weights, in alternating order (default 3)")
    p.add_argument("--memory-steps", type=int, default=None,
                   help="steps of the untimed allocator pass whose peak and boundaries are measured (default 3; "
                        "0 with --peers plain; 0 skips the pass)")
    p.add_argument("--memory-warmup", type=int, default=2,
                   help="steps of the allocator pass before those, to create optimizer states (default 2)")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"],
                   help="zerokit's precision; the torch peers always run fp32 (default fp32)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per rank per step (default 8)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--bucket-numel", type=int, default=1 << 16,
                   help="elements per gradient bucket, zerokit and DDP alike (default 65536)")
    p.add_argument("--reduction", default="default", choices=["default", "ordered", "native"],
                   help="zerokit's gradient reduction: its default (ordered on gloo, native on NCCL), the ordered "
                        "all-to-all + rank-order sum + all-gather, or the native all-reduce / reduce-scatter "
                        "(see zerokit/core/collectives/ordered.py [Note: ordered reduction])")
    p.add_argument("--peers", default="default", choices=["default", "plain"],
                   help="default: torch DDP / ZeroRedundancyOptimizer / FSDP1 / FSDP2 on --nproc ranks; plain: torch "
                        "on one device without a wrapper, in this process (needs --nproc 1; see the module docstring)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=1800, help="seconds before the ranks are killed")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = p.parse_args(argv)
    if args.memory_steps is None:
        args.memory_steps = 0 if args.peers == "plain" else 3
    if min(args.nproc, args.steps, args.batch_size, args.rounds) < 1 or not 0 <= args.warmup < args.steps:
        p.error("--nproc, --steps, --batch-size, --rounds must be >= 1 and 0 <= --warmup < --steps")
    if args.memory_steps < 0 or args.memory_warmup < 0:
        p.error("--memory-steps and --memory-warmup must be >= 0")
    if args.peers == "plain" and args.nproc != 1:
        p.error("--peers plain compares world size 1 runs: pass --nproc 1")
    if args.peers == "plain" and args.precision == "fp16":
        p.error("--peers plain has no fp16 peer (plain torch would need a GradScaler); use fp32 or bf16")
    return args


# ----------------------------------------------------------------------------- one rank
# A run's builder makes the model and its wrapper and returns (train_step, zero_grad, memory):
# `train_step(x, y)` runs forward, backward and the optimizer step and returns the loss;
# `zero_grad()` ends the step; `memory()` counts the model-state bytes this rank holds.
Loop = tuple[Callable[[torch.Tensor, torch.Tensor], torch.Tensor], Callable[[], None], Callable[[], dict]]


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a tensor: the local shard of an FSDP2 DTensor, else the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def _torch_memory(params: list[torch.nn.Parameter], state: dict) -> dict[str, int]:
    """Bytes this rank holds for a torch peer, by zerokit's categories (fp32: no master copy)."""
    return {
        "params": unique_bytes(_local(p) for p in params),
        "grads": unique_bytes(_local(p.grad) for p in params if p.grad is not None),
        "master_params": 0,
        "optimizer_states": unique_bytes(_local(t) for s in state.values() for t in s.values()
                                          if torch.is_tensor(t) and t.dim() > 0),
    }


def _clean(name: str) -> str:
    """A parameter's name without FSDP1's wrapper prefixes."""
    return name.replace("_fsdp_wrapped_module.", "")


def _no_decay_names(model: torch.nn.Module) -> set[str]:
    """zerokit's `param_groups=no_decay` split (biases, LayerNorms), by name, taken before any wrapping."""
    return {_clean(n) for n, p in model.named_parameters() if no_decay(n, p)}


def _param_groups(model: torch.nn.Module, no_decay_names: set[str] | None = None) -> list[dict]:
    """zerokit/bench.py's `decay_groups` by the names in `no_decay_names` (default: the model's own).

    The names come from the unwrapped model: FSDP1's sharded parameters are 1-D views, so the
    split cannot be read from their shapes after wrapping.
    """
    names = _no_decay_names(model) if no_decay_names is None else no_decay_names
    return decay_groups(((_clean(n), p) for n, p in model.named_parameters()), names)


def _batches(cfg: dict, rank: int, world_size: int, device: torch.device, n: int) -> list[tuple]:
    """The first `n` batches of this rank, on the device: the same for every run."""
    from zerokit.models import CharCorpus

    corpus = CharCorpus.load()
    return [tuple(t.to(device) for t in corpus.batch(cfg["batch_size"], cfg["block_size"], i, rank, world_size))
            for i in range(n)]


def _timed_steps(cfg: dict, rank: int, world_size: int, device: torch.device,
                 train_step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], zero_grad: Callable[[], None],
                 memory: Callable[[], dict[str, int]]) -> dict:
    """The one loop every run goes through: each step's loss and milliseconds, and this rank's bytes.

    `train_step(x, y)` runs forward, backward and the optimizer step and returns the loss;
    `zero_grad()` ends the step (timed too; a no-op for zerokit, whose step, zerokit/commands/
    step.py, clears the gradients at its start). `memory()` is read once, after the last optimizer
    step and before its zero_grad, so that gradients count for every run alike (FSDP frees its
    sharded grads at zero_grad; zerokit and DDP keep theirs in flat buffers).
    """
    # made before timing: data loading is not what is compared
    batches = _batches(cfg, rank, world_size, device, cfg["steps"])
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    losses, times, held = [], [], {}

    def read_memory() -> None:
        held.update(memory())

    for i, (x, y) in enumerate(batches):
        ms, loss_value = timed_step(train_step, zero_grad, x, y, device,
                                    between=read_memory if i == len(batches) - 1 else None)
        times.append(ms)
        losses.append(loss_value)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return {"losses": losses, "step_ms": times, "peak_bytes": peak, "memory": held}


@contextlib.contextmanager
def _all_threads_counter():
    """Make c10's CPU allocator count every thread's allocations and frees; yield whether it could.

    c10's `ProfiledCPUMemoryReporter` keeps the "Total Allocated" that torch.profiler attaches to
    each allocator event, but updates it only on a thread where profiling is enabled, unless
    c10's flag `caffe2_report_cpu_memory_usage` is set: then every thread's allocations and frees
    (gloo's included) go into it, while the events are still recorded on this thread only. The
    flag has no Python binding; it is the global `FLAGS_caffe2_report_cpu_memory_usage` of
    libc10, set here through ctypes, and put back afterwards. While it is set, c10's log level is
    raised to ERROR: each thousandth free of a block allocated before the flag was set logs a
    warning that does not apply here (such frees are not counted, as they should not be).
    """
    try:
        lib = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libc10.so"))
        flag = ctypes.c_bool.in_dll(lib, "FLAGS_caffe2_report_cpu_memory_usage")
        level = ctypes.c_int.in_dll(lib, "FLAGS_caffe2_log_level")
    except (OSError, ValueError):  # another platform or build: the events' own thread only
        yield False
        return
    before = flag.value, level.value
    flag.value, level.value = True, max(level.value, 2)
    try:
        yield True
    finally:
        flag.value, level.value = before


def _probe(name: str) -> None:
    """A marker with one 4-byte allocation inside, so that the counter is read at this point of the step."""
    from torch.profiler import record_function

    with record_function(name):
        torch.empty(1)


def _allocator_from_profile(prof, all_threads: bool) -> dict:
    """Bytes at every MARK and the most between consecutive MARKs, from the profiler's allocator events.

    Two readings of the same events, both counted from the BASE probe (just before the build):

    - all threads (when `all_threads`): c10's counter, exact for every thread, read at each
      probe and at every allocator event of this thread (so a gloo-thread allocation that comes
      and goes between two of this thread's events is not seen in a peak);
    - main thread: a ledger of this thread's allocations and frees. A free made on another
      thread has no event, so the block stays live until its address is allocated again (the
      allocator cannot hand out a live address, so a second allocation there proves the free);
      the bytes found that way in the measured steps are `unseen_free_bytes`.
    """
    events, probes = [], []

    def walk(node, probe):
        try:
            name = node.name
        except UnicodeDecodeError:  # a name the profiler could not decode: not one of ours
            name = ""
        if type(node.extra_fields).__name__ == "_ExtraFields_Allocation":
            f = node.extra_fields
            if probe is None:
                events.append((node.start_time_ns, f.ptr, f.alloc_size, f.total_allocated))
            elif f.alloc_size > 0:
                probes.append((node.start_time_ns, probe, f.total_allocated - f.alloc_size))
        for child in node.children:
            walk(child, name if name in (MARK, BASE) else probe)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root, None)
    events.sort()  # by time; at one instant, a free (negative size) before an allocation at its address
    probes.sort()
    base = next(value for _, name, value in probes if name == BASE)
    marks = [(t, value - base) for t, name, value in probes if name == MARK]
    counter_peaks, boundaries, peaks = [], [], []
    live: dict[int, int] = {}
    total = peak = unseen = i = 0
    for k, (mark, counted) in enumerate(marks):
        top = marks[k - 1][1] if k else 0
        while i < len(events) and events[i][0] <= mark:
            _, ptr, size, counter = events[i]
            i += 1
            top = max(top, counter - base)
            if size > 0:
                if ptr in live:  # freed where the profiler could not see it
                    total -= live[ptr]
                    unseen += live[ptr] if k else 0
                live[ptr] = size
                total += size
            elif size < 0 and ptr in live:
                total -= live.pop(ptr)
            peak = max(peak, total)
        if k:
            counter_peaks.append(max(top, counted))
            peaks.append(peak)
        boundaries.append(total)
        peak = total
    main = {"between_steps_bytes": boundaries, "peak_step_bytes": peaks, "unseen_free_bytes": unseen}
    if not all_threads:
        return {"method": ALLOCATOR_CPU_MAIN, **main}
    return {"method": ALLOCATOR_CPU, "between_steps_bytes": [c for _, c in marks], "peak_step_bytes": counter_peaks,
            "unseen_free_bytes": unseen, "main_thread": main}


def _allocator_steps(cfg: dict, rank: int, world_size: int, device: torch.device, build: Callable[[], Loop]) -> dict:
    """The untimed allocator pass: build the run afresh, train warm-up + measured steps, and read its bytes.

    Measured: the bytes live at each boundary of the measured steps (before each one, and after
    the last) and the most live inside each of them, counted from just before `build()`. On CUDA
    from the caching allocator's counters; on CPU from torch.profiler's events
    (`_allocator_from_profile`, with the limitations stated in the module docstring).
    """
    warm, n = cfg["memory_warmup"], cfg["memory_steps"]
    batches = _batches(cfg, rank, world_size, device, warm + n)
    gc.collect()  # an earlier run's cycles, freed now rather than inside this one
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        train_step, zero_grad, _ = build()
        boundaries, peaks = [], []
        for i, batch in enumerate(batches + [None]):
            torch.cuda.synchronize(device)
            if i >= warm:
                if i > warm:
                    peaks.append(torch.cuda.max_memory_allocated(device) - base)
                boundaries.append(torch.cuda.memory_allocated(device) - base)
                torch.cuda.reset_peak_memory_stats(device)
            if batch is None:
                break
            loss = train_step(*batch)
            zero_grad()
            float(loss.detach())
        return {"method": ALLOCATOR_CUDA, "between_steps_bytes": boundaries, "peak_step_bytes": peaks,
                "unseen_free_bytes": 0}
    from torch.profiler import ProfilerActivity, profile

    with _all_threads_counter() as all_threads, \
            profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        _probe(BASE)
        train_step, zero_grad, _ = build()
        for i, (x, y) in enumerate(batches):
            if i >= warm:
                _probe(MARK)
            loss = train_step(x, y)
            zero_grad()
            float(loss.detach())
        _probe(MARK)
    return _allocator_from_profile(prof, all_threads)


_INITIAL: dict[tuple[str, int], torch.nn.Module] = {}


def _initial_model(cfg: dict) -> torch.nn.Module:
    """`build_model(model, seed)` on the CPU: the same initial weights for every run.

    With --peers plain every run happens in this one process, so the model is built once and
    each run gets a deep copy (bitwise the same weights; gpt2-medium takes seconds to initialise
    on a CPU core). The multi-rank runs build afresh, as they always did.
    """
    from zerokit.models import build_model

    if cfg.get("peers", "default") != "plain":
        return build_model(cfg["model"], seed=cfg["seed"])
    key = (cfg["model"], cfg["seed"])
    if key not in _INITIAL:
        _INITIAL[key] = build_model(cfg["model"], seed=cfg["seed"])
    return copy.deepcopy(_INITIAL[key])


def _zerokit(cfg: dict, device: torch.device, stage: int) -> Loop:
    import zerokit as zk
    from zerokit.commands.step import train_step
    from zerokit.models import Block

    model = _initial_model(cfg).to(device)
    bucket = {} if cfg["bucket_numel"] is None else {"bucket_numel": cfg["bucket_numel"]}  # None: zerokit's default
    engine = zk.shard(model, torch.optim.AdamW, stage=stage, precision=cfg["precision"], lr=cfg["lr"],
                      weight_decay=0.1, wrap=(Block,), param_groups=no_decay,
                      ordered_reduction=ORDERED[cfg["reduction"]], **bucket)

    def step(x, y):  # zerokit's one step, zero_grad first (commands/step.py): nothing left to end the step
        return train_step(engine, [(x, y)], lambda batch: engine(*batch)[1]).loss

    return step, lambda: None, lambda: {c: engine.memory().get(c, 0) for c in MODEL_STATES}


def _torch_ddp(cfg: dict, device: torch.device, zero: bool) -> Loop:
    """torch DDP; with `zero`, ZeroRedundancyOptimizer over it (torch's documented ZeRO-1 recipe)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    model = _initial_model(cfg).to(device)
    # gradient_as_bucket_view: grads live in the all-reduce buckets, as zerokit's live in its
    # flat buffers (no copy after the all-reduce); the bucket size is zerokit's.
    # `ddp_bucket_numel` (benchmarks/scaling.py): DDP's own cap whatever zerokit's
    cap = cfg.get("ddp_bucket_numel") or cfg["bucket_numel"] or DDP_DEFAULT_BUCKET_NUMEL
    ddp, _ = torch_ddp(model, cap, device, gradient_as_bucket_view=True)
    groups = _param_groups(model)
    if zero:
        # parameters_as_bucket_view: one broadcast per bucket of params instead of one per
        # param, the closest torch gets to zerokit's flat all-gather.
        opt = ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.AdamW, parameters_as_bucket_view=True,
                                      lr=cfg["lr"], weight_decay=0.1, foreach=True)
    else:
        opt = torch.optim.AdamW(groups, lr=cfg["lr"], weight_decay=0.1, foreach=True)

    autocast = _peer_bf16(cfg)

    def train_step(x, y):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            _, loss = ddp(x, y)
        loss.backward()
        opt.step()
        return loss

    # ZeroRedundancyOptimizer keeps this rank's states in its local optimizer
    return (train_step, lambda: opt.zero_grad(set_to_none=False),  # keep the grads as bucket views
            lambda: _torch_memory(list(model.parameters()), opt.optim.state if zero else opt.state))


def _torch_plain(cfg: dict, device: torch.device, variant: str) -> Loop:
    """Plain torch on one device: AdamW over the model's parameters, the loop a user writes without zerokit."""
    model = _initial_model(cfg).to(device)
    if variant == PLAIN_BF16:
        model = model.to(torch.bfloat16)
    autocast = variant == PLAIN_AUTOCAST
    opt = torch.optim.AdamW(_param_groups(model), lr=cfg["lr"], weight_decay=0.1, foreach=True)

    def train_step(x, y):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            _, loss = model(x, y)  # models.GPT takes the loss from fp32 logits in every variant
        loss.backward()
        opt.step()
        return loss

    return train_step, opt.zero_grad, lambda: _torch_memory(list(model.parameters()), opt.state)


def _peer_bf16(cfg: dict) -> bool:
    """Whether the torch peers compute in bf16 too (`peer_precision: "match"` under zerokit bf16, as
    benchmarks/scaling.py sets it): DDP and ZeroRedundancyOptimizer under autocast, FSDP with bf16 params
    and reductions. Otherwise the peers stay fp32, as in `zerokit compare`."""
    return cfg.get("peer_precision") == "match" and cfg["precision"] == "bf16"


def _fsdp2(model: torch.nn.Module, world_size: int, device: torch.device, bf16: bool = False) -> torch.nn.Module:
    """FSDP2: `fully_shard` on every Block (one unit each, as zerokit's wrap=(Block,)), then the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (world_size,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16) if bf16 else \
        MixedPrecisionPolicy()
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    return fully_shard(model, mesh=mesh, mp_policy=mp)


def _fsdp1(model: torch.nn.Module, device: torch.device, strategy: str, bf16: bool = False) -> torch.nn.Module:
    """FSDP1: FullyShardedDataParallel with one unit per Block, the given ShardingStrategy.

    `device_id` is the rank's device on CPU too: torch 2.13's FSDP1 refuses device_id=None
    when no accelerator is present. `use_orig_params=True` keeps one optimizer parameter per
    model parameter, so that AdamW can hold the decay / no-decay groups.
    """
    from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from zerokit.models import Block

    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16) if bf16 else None
    return FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({Block}),
                                    sharding_strategy=getattr(ShardingStrategy, strategy), use_orig_params=True,
                                    device_id=device, mixed_precision=mp)


def _torch_fsdp(cfg: dict, world_size: int, device: torch.device, variant: str) -> Loop:
    """FSDP1 (SHARD_GRAD_OP or FULL_SHARD) or FSDP2 over the model, AdamW over its local shards."""
    model = _initial_model(cfg).to(device)
    names = _no_decay_names(model)
    if variant == FSDP2:
        wrapped = _fsdp2(model, world_size, device, _peer_bf16(cfg))
    else:
        wrapped = _fsdp1(model, device, "SHARD_GRAD_OP" if variant == FSDP1_GRAD_OP else "FULL_SHARD",
                         _peer_bf16(cfg))
    # parameters() after wrapping: FSDP2's are DTensor shards, FSDP1's views of its flat shards
    opt = torch.optim.AdamW(_param_groups(wrapped, names), lr=cfg["lr"], weight_decay=0.1, foreach=True)

    def train_step(x, y):
        _, loss = wrapped(x, y)
        loss.backward()
        opt.step()
        return loss

    # zero_grad sets grads to None: FSDP's reduce-scatter makes fresh sharded grads every step
    return train_step, opt.zero_grad, lambda: _torch_memory(list(wrapped.parameters()), opt.state)


def _builder(name: str, cfg: dict, world_size: int, device: torch.device) -> Callable[[], Loop]:
    """The function that builds run `name` afresh (from the initial weights) on this rank."""
    if name.startswith("zerokit stage "):
        return lambda: _zerokit(cfg, device, int(name.rsplit(" ", 1)[1]))
    if name in PLAIN:
        return lambda: _torch_plain(cfg, device, name)
    if name in FSDP:
        return lambda: _torch_fsdp(cfg, world_size, device, name)
    return lambda: _torch_ddp(cfg, device, zero=name == ZERO)


def _guarded(name: str, fn: Callable[[], dict]) -> dict:
    """A torch peer's result, or its exact error if it cannot run here; zerokit's errors are raised."""
    if name.startswith("zerokit"):
        return fn()
    try:
        return fn()
    except Exception as exc:  # recorded in the results, in place of a number
        return {"error": f"{type(exc).__name__}: {exc}"}


def speed_rank(rank: int, world_size: int, cfg: dict) -> dict[str, list[dict]]:
    """Every run on this rank, `rounds` times: name -> one result per round.

    Each zerokit stage runs right beside its peers, and odd rounds go through the list
    backwards, so that a machine slowly warming up (or a neighbour's load) favours neither side.
    Then, unless `memory_steps` is 0, each run that timed without error once more through the
    allocator pass, its figures under the first round's "allocator".
    """
    device = torch.device("cuda", rank) if cfg["device"] == "cuda" else torch.device("cpu")
    order: dict[str, Callable[[], Loop]] = {}
    for stage in cfg["stages"]:
        order[f"zerokit stage {stage}"] = _builder(f"zerokit stage {stage}", cfg, world_size, device)
        for peer, _ in peers_for(stage, cfg):
            order.setdefault(peer, _builder(peer, cfg, world_size, device))
    runs: dict[str, list[dict]] = {name: [] for name in order}
    for round_index in range(cfg["rounds"]):
        names = list(order) if round_index % 2 == 0 else list(reversed(order))
        for name in names:
            gc.collect()  # the last run's engine and optimizer (reference cycles) go before this one is built
            runs[name].append(_guarded(name, lambda: _timed_steps(cfg, rank, world_size, device, *order[name]())))
    if cfg.get("memory_steps", 0) > 0:
        for name in order:
            if "error" not in runs[name][0]:
                runs[name][0]["allocator"] = _guarded(
                    name, lambda: _allocator_steps(cfg, rank, world_size, device, order[name]))
    return runs


# ----------------------------------------------------------------------------- the parent
def _allocator_summary(ranks: list[dict | None]) -> dict | None:
    """One run's allocator figures over ranks: the largest peak, the largest median boundary."""
    if any(r is None for r in ranks):
        return None
    errors = [r["error"] for r in ranks if "error" in r]
    if errors:
        return {"error": errors[0]}
    return {"method": ranks[0]["method"],
            "peak_step_bytes": max(max(r["peak_step_bytes"]) for r in ranks),
            "between_steps_bytes": max(int(statistics.median(r["between_steps_bytes"])) for r in ranks),
            "unseen_free_bytes": max(r["unseen_free_bytes"] for r in ranks),
            "per_rank": ranks}


def _bytes_of(run: dict, key: str) -> int | None:
    alloc = run.get("allocator")
    return None if not alloc or "error" in alloc else alloc[key]


def summarize(per_rank: list[dict[str, list[dict]]], cfg: dict) -> dict:
    """Runs (all ranks' and rounds' numbers), one pair per (stage, peer), one line per stage.

    A run's step time is the median of its timed steps (every round's, after each round's
    warm-up) on each rank, then the largest over ranks: the slowest rank sets the pace. A stage's
    line sets zerokit beside its fastest peer (references aside) and its lowest-peak peer.
    """
    tokens_per_step = cfg["batch_size"] * cfg["block_size"] * cfg["nproc"]
    runs = {}
    for name, first_rounds in per_rank[0].items():
        first = first_rounds[0]
        if "error" in first:
            runs[name] = {"error": first["error"]}
            continue
        ranks = [r[name] for r in per_rank]  # [rank][round]
        median = max(statistics.median(t for rnd in rounds for t in rnd["step_ms"][cfg["warmup"]:])
                     for rounds in ranks)
        # each round's own median (slowest rank): zerokit and its peers run back to back within a round
        by_round = [max(statistics.median(rounds[k]["step_ms"][cfg["warmup"]:]) for rounds in ranks)
                    for k in range(len(ranks[0]))]
        runs[name] = {
            "step_ms_median": median, "tokens_per_s": tokens_per_step / (median / 1e3), "round_ms": by_round,
            "step_ms": [[rnd["step_ms"] for rnd in rounds] for rounds in ranks],  # [rank][round][step]
            "losses": [[rnd["losses"] for rnd in rounds] for rounds in ranks],  # [rank][round][step]
            "memory": [rounds[0]["memory"] for rounds in ranks],  # [rank]
            "peak_bytes": [rounds[0]["peak_bytes"] for rounds in ranks],  # [rank], CUDA only
            "allocator": _allocator_summary([rounds[0].get("allocator") for rounds in ranks]),
        }
    pairs = []
    for stage in cfg["stages"]:
        for peer, note in peers_for(stage, cfg):
            name = f"zerokit stage {stage}"
            zk_run, peer_run = runs[name], runs[peer]
            pair = {"stage": stage, "zerokit": name, "peer": peer, "note": note,
                    "role": "reference" if (stage, peer) in REFERENCES else "peer",
                    "zerokit_ms": zk_run["step_ms_median"], "zerokit_tokens_per_s": zk_run["tokens_per_s"],
                    "zerokit_memory": zk_run["memory"][0], "peer_ms": None, "peer_tokens_per_s": None, "ratio": None,
                    "ratio_by_round": None,
                    "peer_memory": None, "max_abs_loss_diff": None, "loss_tolerance": None,
                    "loss_within_tolerance": None, "peer_error": peer_run.get("error"),
                    "zerokit_peak_step_bytes": _bytes_of(zk_run, "peak_step_bytes"),
                    "zerokit_between_steps_bytes": _bytes_of(zk_run, "between_steps_bytes"),
                    "peer_peak_step_bytes": _bytes_of(peer_run, "peak_step_bytes"),
                    "peer_between_steps_bytes": _bytes_of(peer_run, "between_steps_bytes")}
            if "error" not in peer_run:
                diff = max(abs(a - b) for zk_rounds, peer_rounds in zip(zk_run["losses"], peer_run["losses"])
                           for zr, pr in zip(zk_rounds, peer_rounds) for a, b in zip(zr, pr))
                tolerance = FP32_LOSS_TOLERANCE if cfg["precision"] == "fp32" else None
                pair.update(peer_ms=peer_run["step_ms_median"], peer_tokens_per_s=peer_run["tokens_per_s"],
                            ratio=zk_run["step_ms_median"] / peer_run["step_ms_median"],
                            ratio_by_round=[z / q for z, q in zip(zk_run["round_ms"], peer_run["round_ms"])],
                            peer_memory=peer_run["memory"][0], max_abs_loss_diff=diff, loss_tolerance=tolerance,
                            loss_within_tolerance=None if tolerance is None else bool(diff <= tolerance))
            pairs.append(pair)
    return {"runs": runs, "pairs": pairs, "stages": stage_lines(pairs), "loss_spread": loss_spread(runs)}


def loss_spread(runs: dict) -> dict:
    """How far apart the losses of zerokit's runs are among themselves, and the torch peers' among themselves
    (the largest |Δloss| over every step, round and rank, and which two runs): the scale of a zerokit vs peer
    difference that only the order of additions explains."""
    out = {}
    for side in ("zerokit", "torch"):
        names = [n for n, r in runs.items() if n.startswith(side) and "error" not in r]
        best = None
        for i, a in enumerate(names):
            for b in names[i + 1:]:
                diff = max(abs(x - y) for ra, rb in zip(runs[a]["losses"], runs[b]["losses"])
                           for sa, sb in zip(ra, rb) for x, y in zip(sa, sb))
                if best is None or diff > best["max_abs_loss_diff"]:
                    best = {"max_abs_loss_diff": diff, "between": [a, b]}
        out[side] = best
    return out


def stage_lines(pairs: list[dict]) -> list[dict]:
    """Per stage: zerokit against its fastest peer (step time) and its lowest peer (peak bytes in a step).

    References (DDP beside stage 2) and peers that did not run are never chosen; the ratio of
    every pair is listed as well.
    """
    lines = []
    for stage in dict.fromkeys(p["stage"] for p in pairs):
        mine = [p for p in pairs if p["stage"] == stage]
        ran = [p for p in mine if p["role"] == "peer" and p["peer_ms"] is not None]
        fastest = min(ran, key=lambda p: p["peer_ms"]) if ran else None
        measured = [p for p in ran if p["peer_peak_step_bytes"] is not None]
        lowest = min(measured, key=lambda p: p["peer_peak_step_bytes"]) if measured else None
        zk_peak = mine[0]["zerokit_peak_step_bytes"]
        lines.append({
            "stage": stage, "zerokit": mine[0]["zerokit"], "zerokit_ms": mine[0]["zerokit_ms"],
            "fastest_peer": fastest and fastest["peer"], "fastest_peer_ms": fastest and fastest["peer_ms"],
            "ratio_vs_fastest": fastest and fastest["ratio"],
            "ratio_by_round_vs_fastest": fastest and fastest["ratio_by_round"],
            "max_abs_loss_diff": fastest and fastest["max_abs_loss_diff"],
            "ratios": {p["peer"]: p["ratio"] for p in mine},  # every pair's, references and errors (None) too
            "zerokit_peak_step_bytes": zk_peak,
            "zerokit_between_steps_bytes": mine[0]["zerokit_between_steps_bytes"],
            "lowest_peak_peer": lowest and lowest["peer"],
            "lowest_peer_peak_step_bytes": lowest and lowest["peer_peak_step_bytes"],
            "lowest_peer_between_steps_bytes": lowest and lowest["peer_between_steps_bytes"],
            "peak_at_most_lowest_peer": None if lowest is None or zk_peak is None
            else bool(zk_peak <= lowest["peer_peak_step_bytes"]),
        })
    return lines


def _kb(memory: dict | None, keys: tuple[str, ...]) -> str:
    return "-" if memory is None else f"{sum(memory[k] for k in keys) / 1e3:,.1f}"


def _mb(n: int | None) -> str:
    return "-" if n is None else f"{n / 1e6:,.2f}"


def _short(peer: str) -> str:
    return peer.removeprefix("torch ")


def table(pairs: list[dict]) -> list[str]:
    """The markdown table, one row per pair; KB = 1000 bytes, rank 0's; allocator MB = 10^6 bytes, when measured."""
    allocator = any(p.get("zerokit_peak_step_bytes") is not None for p in pairs)
    rows = ["| zerokit | torch peer | zerokit ms | peer ms | ratio (zk/peer) | zerokit tok/s | peer tok/s "
            "| max abs Δloss | opt states KB (zk / peer) | model states KB (zk / peer) |"
            + (" peak MB in a step (zk / peer) | MB between steps (zk / peer) |" if allocator else ""),
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if allocator else "")]
    for p in pairs:
        if p["peer_error"]:
            peer_ms = ratio = peer_tps = loss = "-"
        else:
            peer_ms, ratio = f"{p['peer_ms']:.1f}", f"{p['ratio']:.2f}"
            peer_tps, loss = f"{p['peer_tokens_per_s']:,.0f}", f"{p['max_abs_loss_diff']:.1e}"
        peer = p["peer"] + (" (reference)" if p.get("role") == "reference" else "")
        row = (f"| {p['zerokit']} | {peer} | {p['zerokit_ms']:.1f} | {peer_ms} | {ratio} "
               f"| {p['zerokit_tokens_per_s']:,.0f} | {peer_tps} | {loss} "
               f"| {_kb(p['zerokit_memory'], ('optimizer_states',))} / "
               f"{_kb(p['peer_memory'], ('optimizer_states',))} "
               f"| {_kb(p['zerokit_memory'], MODEL_STATES)} / {_kb(p['peer_memory'], MODEL_STATES)} |")
        if allocator:
            row += (f" {_mb(p['zerokit_peak_step_bytes'])} / {_mb(p['peer_peak_step_bytes'])} "
                    f"| {_mb(p['zerokit_between_steps_bytes'])} / {_mb(p['peer_between_steps_bytes'])} |")
        rows.append(row)
    return rows


def stage_table(lines: list[dict]) -> list[str]:
    """The summary: per stage, the ratio against the fastest peer, every pair's ratio, bytes against the lowest peer."""
    rows = ["| zerokit | fastest peer at that stage | zerokit ms | peer ms | step time ratio (zk / fastest; by round) "
            "| every pair's ratio | peak MB in a step (zk / lowest peer) | MB between steps (zk / that peer) |",
            "|---|---|---:|---:|---:|---|---:|---:|"]
    for s in lines:
        ratios = ", ".join(f"{_short(peer)} {'-' if r is None else f'{r:.2f}'}" for peer, r in s["ratios"].items())
        if s["fastest_peer"] is None:
            fastest, peer_ms, ratio = "none ran", "-", "-"
        else:
            fastest, peer_ms, ratio = s["fastest_peer"], f"{s['fastest_peer_ms']:.1f}", f"{s['ratio_vs_fastest']:.2f}"
            by_round = s["ratio_by_round_vs_fastest"]
            if len(by_round) > 1:  # the spread of the rounds' own ratios: how much of the ratio is noise
                ratio += f" ({min(by_round):.2f}-{max(by_round):.2f})"
        low = f" ({_short(s['lowest_peak_peer'])})" if s["lowest_peak_peer"] else ""
        rows.append(f"| {s['zerokit']} | {fastest} | {s['zerokit_ms']:.1f} | {peer_ms} | {ratio} | {ratios} "
                    f"| {_mb(s['zerokit_peak_step_bytes'])} / {_mb(s['lowest_peer_peak_step_bytes'])}{low} "
                    f"| {_mb(s['zerokit_between_steps_bytes'])} / {_mb(s['lowest_peer_between_steps_bytes'])} |")
    return rows


def results_name(peers: str, device: str, nproc: int) -> str:
    """The results files' name, without .json / .md: world size 2 keeps the name it always had."""
    if peers == "plain":
        return f"speed_vs_torch_plain_{device}"
    return f"speed_vs_torch_{device}" + ("" if nproc == 2 else f"_n{nproc}")


def main(argv: list[str] | None = None) -> int:
    from zerokit.models import preset

    argv = sys.argv[1:] if argv is None else list(argv)
    if "--paired" in argv:
        return paired_main(argv)
    if "--quantize" in argv:
        return qlora_main(argv)
    args = parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and args.nproc > torch.cuda.device_count():
        raise SystemExit(f"--nproc {args.nproc} needs {args.nproc} GPUs (NCCL: one per rank); "
                         f"{torch.cuda.device_count()} visible")
    commit = git_commit()  # taken before the run: the code that produced the numbers
    plain = args.peers == "plain"
    prov = provenance(command_line(__file__, argv))  # likewise, before the run
    stages, skipped = available_stages([0, 1, 2, 3])
    for stage, why in skipped.items():
        print(f"zerokit stage {stage} skipped: {why}")
    cfg = {"model": args.model, "block_size": preset(args.model).block_size, "nproc": args.nproc,
           "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds, "precision": args.precision,
           "batch_size": args.batch_size, "lr": args.lr, "bucket_numel": args.bucket_numel, "seed": args.seed,
           "stages": stages, "device": device, "reduction": args.reduction, "peers": args.peers,
           "memory_steps": args.memory_steps, "memory_warmup": args.memory_warmup,
           # what --reduction default means here: core/collectives/ordered.py orders the sum on gloo, not on NCCL
           "reduction_used": {"default": "ordered" if device == "cpu" else "native"}.get(args.reduction,
                                                                                          args.reduction)}
    if plain:  # world size 1 in this process, no process group: zerokit issues no collective
        cfg["reduction_used"] = "none"
    start = time.perf_counter()
    if plain:
        per_rank = [speed_rank(0, 1, cfg)]
    else:
        per_rank = run_ranks(speed_rank, args.nproc, cfg, timeout_s=args.timeout,
                             backend="nccl" if device == "cuda" else "gloo")
    result = summarize(per_rank, cfg)

    meta = environment()
    meta["command"] = " ".join(["python", str(Path(__file__).resolve().relative_to(REPO))]
                               + (sys.argv[1:] if argv is None else list(argv)))
    meta["seconds"] = round(time.perf_counter() - start, 1)
    meta["commit"] = commit
    try:
        with open("/proc/cpuinfo") as f:
            meta["cpu_model"] = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
                                     None)
    except OSError:
        meta["cpu_model"] = None
    record = {"provenance": prov, "meta": meta, "config": cfg,
              "skipped_stages": {str(k): v for k, v in skipped.items()}, **result}

    backend = "NCCL" if device == "cuda" else "gloo"
    print(f"{'one process, no process group' if plain else f'{args.nproc} {backend} rank(s)'}, model {args.model}, "
          f"{args.rounds} rounds of {args.steps} steps ({args.warmup} warm-up) of "
          f"{args.batch_size}x{cfg['block_size']} tokens per rank, AdamW; zerokit {args.precision}, "
          + ("peers: " + ", ".join(peer for peer, _ in peers_for(stages[0], cfg)) if plain and stages
             else "torch fp32"))
    if not plain:
        print("\n".join(stage_table(result["stages"])) + "\n")
    print("\n".join(table(result["pairs"])))
    for name, run in result["runs"].items():
        if "error" in run:
            print(f"{name} did not run: {run['error']}")
        elif run["allocator"] and "error" in run["allocator"]:
            print(f"{name}: allocator pass failed: {run['allocator']['error']}")

    write_pair(args.out / results_name(args.peers, device, args.nproc), record, "\n".join(markdown(record)) + "\n")
    print(f"({meta['seconds']} s)")
    return 0


def markdown(record: dict) -> list[str]:
    """The results page: provenance, the tables, what each column means and what it does not show."""
    meta, cfg = record["meta"], record["config"]
    allocator = cfg.get("memory_steps", 0) > 0
    if cfg.get("peers", "default") == "plain":
        head = [f"# zerokit vs plain torch: step time at world size 1 ({cfg['device']})", "",
                *provenance_lines(record["provenance"]), f"- total: {meta['seconds']} s",
                f"- setup: one process, no process group (world size 1: zerokit issues no collective), model "
                f"`{cfg['model']}`, {cfg['batch_size']} x {cfg['block_size']} tokens per step, AdamW (lr {cfg['lr']}, "
                f"weight decay 0.1, none on biases/LayerNorms), {cfg['rounds']} rounds of {cfg['steps']} steps (the "
                f"first {cfg['warmup']} of each warm-up; rounds alternate the run order), zerokit bucket "
                f"{cfg['bucket_numel']} elements; zerokit {cfg['precision']}"
                + (" (bf16 params and grads, fp32 master and AdamW states)" if cfg["precision"] == "bf16" else "")
                + "; torch: `torch.optim.AdamW(..., foreach=True)` over the model's parameters, `loss.backward()`, "
                "`opt.step()`, `opt.zero_grad()` (set_to_none)", ""]
        summary = []
    else:
        head = [f"# zerokit vs torch: step time and allocator bytes ({cfg['device']})", "",
                *provenance_lines(record["provenance"]), f"- total: {meta['seconds']} s",
                f"- setup: {cfg['nproc']} {'NCCL' if cfg['device'] == 'cuda' else 'gloo'} ranks, model "
                f"`{cfg['model']}`, "
                f"{cfg['batch_size']} x {cfg['block_size']} tokens per rank per step, AdamW (lr {cfg['lr']}, weight "
                f"decay 0.1, none on biases/LayerNorms), {cfg['rounds']} rounds of {cfg['steps']} steps "
                f"(the first {cfg['warmup']} of each "
                f"warm-up; rounds alternate the run order), bucket "
                f"{cfg['bucket_numel']} elements; zerokit {cfg['precision']}, torch peers fp32 with `foreach=True`; "
                "FSDP1 and FSDP2 wrap every Block (zerokit's stage-3 units) and the root, FSDP1 with "
                "`use_orig_params=True`",
                "- zerokit's gradient reduction: " + (
                    "ordered (zerokit's gloo default, so that every stage is bitwise equal at any world size: each "
                    "reduce-scatter is an all-to-all plus a sum in rank order, and stage 0's all-reduce is that plus "
                    "an all-gather (each all-reduce group's all-to-all as it fills, the all-gathers of every group "
                    "together at the end of backward, where DDP launches one all-reduce per bucket), except at 2 "
                    "ranks, where "
                    "it is the native all-reduce (one addition per element: the same bits in any order); `--reduction "
                    "native` times the plain collectives instead)"
                    if cfg["reduction_used"] == "ordered" else
                    "native (torch's all-reduce / reduce-scatter, as DDP and FSDP use)"), ""]
        summary = ["## Each stage against its fastest peer", "", *stage_table(record["stages"]), "",
                   "## Every pair", ""]
    md = head + summary + [
          *table(record["pairs"]), "",
          "- ms: median step time (forward + backward + optimizer step + zero_grad) over every round's timed "
          "steps, on the slowest rank; ratio > 1 means zerokit is slower. tok/s: global tokens per step / that time."
          + ("" if not summary else " A stage's fastest peer is the quickest of its peers that ran (the DDP "
             "reference beside stage 2 is never chosen); every pair's own ratio is listed too. By round: the "
             "lowest and highest of the same ratio taken from each round's own medians (zerokit and its peers run "
             "back to back within a round, the order reversed every other round): how far the ratio moves with "
             "nothing changed but time, on this machine."),
          "- max abs Δloss: largest |zerokit loss - peer loss| over every step, round and rank, same weights and "
          "batches; 0 means bit for bit. "
          + ("zerokit and the torch peers compute in different precisions or recipes here, so it is informational."
             if cfg.get("peers") == "plain" and cfg["precision"] != "fp32" else
             f"Tolerance {FP32_LOSS_TOLERANCE:g}: ZeroRedundancyOptimizer and FSDP may reduce in another order "
             "than zerokit (at 2 ranks a sum of two has one order, so they can still agree exactly)."
             if cfg["precision"] == "fp32" else "zerokit runs a lower precision here, so it is informational."),
          "- KB: rank 0's bytes after the last optimizer step, before its zero_grad (10^3 bytes); "
          "zerokit from `engine.memory()`, torch by counting "
          "the storages of its local params, grads and optimizer states.", ""]
    if allocator:
        md.insert(len(md) - 1, allocator_note(record))
    spread = record.get("loss_spread") or {}
    md += [f"- losses among themselves: {side}'s runs differ by at most {s['max_abs_loss_diff']:.1e} "
           f"({s['between'][0]} vs {s['between'][1]}){' (bit for bit)' if s['max_abs_loss_diff'] == 0 else ''}"
           for side, s in spread.items() if s is not None]
    md += [f"- {p['zerokit']} vs {p['peer']}: {p['note']}"
           + ("" if p["loss_within_tolerance"] in (None, True) else " — LOSS OUTSIDE TOLERANCE")
           + (f". Did not run: `{p['peer_error']}`" if p["peer_error"] else "") for p in record["pairs"]]
    failed = [f"{name}: `{run['allocator']['error']}`" for name, run in record["runs"].items()
              if "error" not in run and run.get("allocator") and "error" in run["allocator"]]
    if failed:
        md.append(f"- allocator pass failed: {'; '.join(failed)}")
    if cfg["device"] == "cpu" and cfg.get("peers") != "plain":
        md += ["", f"On {meta['cpu_count']} CPU cores with {cfg['nproc']} ranks (one thread each) and a model this "
               "small, these timings mostly measure Python overhead per step (hooks, per-tensor bookkeeping, "
               "collective launches) and gloo's latency, not arithmetic or bandwidth; they say which implementation "
               "does less work per step around the math, not how either scales on GPUs."]
    return md


def allocator_note(record: dict) -> str:
    """What the allocator columns are, and on CPU what they cannot see."""
    cfg = record["config"]
    allocs = [run["allocator"] for run in record["runs"].values()
              if "error" not in run and run.get("allocator") and "error" not in run["allocator"]]
    text = (f"- allocator MB (10^6 bytes), from an untimed pass per run after the timing rounds: "
            f"{cfg['memory_warmup']} steps, then {cfg['memory_steps']} measured; counted from just before the run's "
            "model is built (params, grads, optimizer states, buckets, caches; not the batches). Peak in a step: the "
            "most live inside any measured step, largest over ranks. Between steps: live at a step boundary (before "
            "the forward), the median over the boundaries, largest over ranks. ")
    if cfg["device"] == "cuda":
        return text + "CUDA: `torch.cuda.max_memory_allocated` (reset at each boundary) and `memory_allocated`."
    unseen = max((a["unseen_free_bytes"] for a in allocs), default=0)
    if allocs and all(a["method"] == ALLOCATOR_CPU for a in allocs):
        return text + ("CPU: the Total Allocated of `torch.profiler.profile(profile_memory=True)`'s allocator events, "
                       "with c10's `caffe2_report_cpu_memory_usage` flag set for the pass so that frees and "
                       "allocations on gloo's worker threads count too (without it they do not: "
                       "benchmarks/investigations/cpu_frees.py). The events are recorded on the main thread only, so the counter "
                       "is read at each of its allocations and frees: a buffer a gloo thread allocates and frees "
                       "between two of them is not in a peak. Counting the main thread's events alone would have "
                       f"left up to {unseen:,} bytes freed on gloo's threads counted as live in one run's measured "
                       "steps (`main_thread` in the JSON).")
    return text + ("CPU: rebuilt from `torch.profiler.profile(profile_memory=True)` allocation events, which are "
                   "recorded on the main thread only (c10's all-threads counter flag was not available here): what "
                   "gloo's worker threads allocate is missing, and a block they free is counted live until its "
                   "address is allocated again (benchmarks/investigations/cpu_frees.py shows the profiler missing such frees). These "
                   "are main-thread bytes, upper bounds as to frees on gloo's threads; the most bytes corrected by "
                   f"address reuse in one run's measured steps: {unseen:,} (`unseen_free_bytes` in the JSON).")


# ----------------------------------------------------------------------------- --paired
def pairs_of(stages: list[int], cfg: dict | None = None) -> list[tuple[int, str]]:
    """(stage, peer) for every peer `PEERS` sets beside each stage, references left out; with `peers: "plain"`
    in `cfg`, each stage beside plain torch (`peers_for`)."""
    if cfg is not None and cfg.get("peers", "default") == "plain":
        return [(stage, peer) for stage in stages for peer, _ in peers_for(stage, cfg)]
    return [(stage, peer) for stage in stages for peer, _ in PEERS[stage] if (stage, peer) not in REFERENCES]


def model_config(name: str):
    """A --model name: a zerokit.models preset, or one of benchmarks/scaling.py's sizes (1M, 4M, 15M, 50M, 124M:
    the sweep's GPTs at its block size), given as its GPTConfig."""
    from zerokit.models import preset
    if name in ("1M", "4M", "15M", "50M", "124M"):
        import scaling  # benchmarks/scaling.py imports this file; imported here, when asked for, that is no cycle
        return scaling.config(name)
    return preset(name)


def paired_rank(rank: int, world_size: int, cfg: dict) -> dict:
    """For each (stage, peer): both built once, then `steps` pairs of steps in turns, the order swapped every pair.
    Returns "stage|peer" -> {"zerokit": [ms], "peer": [ms], "zerokit_loss": [...], "peer_loss": [...]}."""
    device = torch.device("cpu")
    batches = _batches(cfg, rank, world_size, device, cfg["steps"])
    out = {}
    for stage, peer in pairs_of(cfg["stages"], cfg):
        loops = {"zerokit": _builder(f"zerokit stage {stage}", cfg, world_size, device)(),
                 "peer": _builder(peer, cfg, world_size, device)()}
        record = {"zerokit": [], "peer": [], "zerokit_loss": [], "peer_loss": [], "zerokit_cpu": [], "peer_cpu": []}
        for i, (x, y) in enumerate(batches):
            for name in (("zerokit", "peer") if i % 2 == 0 else ("peer", "zerokit")):
                train_step, zero_grad, _ = loops[name]
                cpu = time.process_time()  # every thread of this rank's process: gloo's too
                ms, loss = timed_step(train_step, zero_grad, x, y, device)  # as the block mode times a step
                record[f"{name}_cpu"].append(1e3 * (time.process_time() - cpu))
                record[name].append(ms)
                record[f"{name}_loss"].append(loss)
        out[f"{stage}|{peer}"] = record
        del loops
        gc.collect()
    return out


def median_interval(values: list[float], level: float = 0.95) -> tuple[float, float]:
    """A distribution-free confidence interval for the median: the order statistics x_(j) and x_(n+1-j)
    with j the largest index such that P(Binomial(n, 1/2) < j) <= (1 - level) / 2 (no assumption on the
    distribution, no resampling)."""
    xs = sorted(values)
    n = len(xs)
    tail, cumulative, j = (1 - level) / 2, 0.0, 0
    while True:
        p = math.comb(n, j) / 2 ** n  # P(Binomial(n, 1/2) == j)
        if cumulative + p > tail:
            break
        cumulative += p
        j += 1
    if j == 0:  # too few pairs for this level: the whole range
        return xs[0], xs[-1]
    return xs[j - 1], xs[n - j]


def paired_summarize(per_rank: list[dict], warmup: int) -> list[dict]:
    rows = []
    for key in per_rank[0]:
        stage, peer = key.split("|")
        zk = [max(rank[key]["zerokit"][i] for rank in per_rank) for i in range(len(per_rank[0][key]["zerokit"]))]
        pe = [max(rank[key]["peer"][i] for rank in per_rank) for i in range(len(per_rank[0][key]["peer"]))]
        zk, pe = zk[warmup:], pe[warmup:]
        ratios = [a / b for a, b in zip(zk, pe)]
        low, high = median_interval(ratios)
        # CPU time: each rank's process time of the step (main thread and gloo's), summed over ranks
        zk_cpu = [sum(rank[key]["zerokit_cpu"][i] for rank in per_rank) for i in range(len(ratios) + warmup)][warmup:]
        pe_cpu = [sum(rank[key]["peer_cpu"][i] for rank in per_rank) for i in range(len(ratios) + warmup)][warmup:]
        cpu_ratios = [a / b for a, b in zip(zk_cpu, pe_cpu) if b > 0]
        cpu_low, cpu_high = median_interval(cpu_ratios)
        dloss = max(abs(a - b) for rank in per_rank
                    for a, b in zip(rank[key]["zerokit_loss"], rank[key]["peer_loss"]))
        rows.append({"stage": int(stage), "peer": peer, "pairs": len(ratios),
                     "median_ratio": statistics.median(ratios), "ci95": [low, high],
                     "zerokit_faster": sum(r < 1 for r in ratios) / len(ratios),
                     "zerokit_ms": statistics.median(zk), "peer_ms": statistics.median(pe),
                     "ratio_of_medians": statistics.median(zk) / statistics.median(pe), "max_abs_dloss": dloss,
                     "cpu_median_ratio": statistics.median(cpu_ratios), "cpu_ci95": [cpu_low, cpu_high],
                     "zerokit_cpu_ms": statistics.median(zk_cpu), "peer_cpu_ms": statistics.median(pe_cpu)})
    return rows


def paired_table(rows: list[dict]) -> list[str]:
    lines = ["| zerokit | torch peer | pairs | median pair ratio (zk / peer) | 95% interval | zerokit faster in "
             "| zerokit ms | peer ms | ratio of medians | CPU time: median pair ratio | 95% interval "
             "| zerokit CPU ms | peer CPU ms | max abs Δloss |",
             "|---|---|---:|---:|---|---:|---:|---:|---:|---:|---|---:|---:|---:|"]
    for r in rows:
        cpu = (f"{r['cpu_median_ratio']:.3f} | {r['cpu_ci95'][0]:.3f}-{r['cpu_ci95'][1]:.3f} | "
               f"{r['zerokit_cpu_ms']:.1f} | {r['peer_cpu_ms']:.1f}") if "cpu_median_ratio" in r else "- | - | - | -"
        lines.append(f"| stage {r['stage']} | {r['peer'].removeprefix('torch ')} | {r['pairs']} | "
                     f"{r['median_ratio']:.3f} | {r['ci95'][0]:.3f}-{r['ci95'][1]:.3f} | "
                     f"{100 * r['zerokit_faster']:.0f}% | {r['zerokit_ms']:.1f} | {r['peer_ms']:.1f} | "
                     f"{r['ratio_of_medians']:.3f} | {cpu} | {r['max_abs_dloss']:.1e} |")
    return lines


def paired_main(argv: list[str]) -> int:
    """--paired: see the module docstring's "Paired mode"."""
    p = argparse.ArgumentParser(description="zerokit beside a torch peer in paired, alternating steps")
    p.add_argument("--paired", action="store_true", required=True, help="this mode")
    p.add_argument("--nproc", type=int, default=2, help="gloo ranks (default 2)")
    p.add_argument("--model", default="small",
                   help="model preset, or a size of benchmarks/scaling.py's sweep (1M, 4M, ...) (default small)")
    p.add_argument("--stages", type=int, nargs="+", default=[0, 1], choices=[0, 1, 2, 3],
                   help="zerokit stages, each beside its peers (default 0 1)")
    p.add_argument("--steps", type=int, default=300, help="pairs of steps per stage and peer, warm-up included")
    p.add_argument("--warmup", type=int, default=20, help="pairs left out at the start (default 20)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per rank per step (default 8)")
    p.add_argument("--bucket-numel", default=str(1 << 16),
                   help="zerokit's bucket_numel and DDP's cap (x 4 bytes); 'default': each library's own "
                        "(zerokit's per-stage default, DDP's 25 MB), as benchmarks/scaling.py runs them")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"],
                   help="zerokit's precision; under bf16 the peers compute in bf16 too, as in the sweep")
    p.add_argument("--reduction", default="default", choices=list(ORDERED), help="zerokit's ordered_reduction")
    p.add_argument("--peers", default="default", choices=["default", "plain"],
                   help="plain: each stage beside plain torch (no wrapper) instead; --nproc 1 only")
    p.add_argument("--timeout", type=float, default=1800, help="deadline for the spawn (s)")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "paired_steps",
                   help="results path without extension (.json and .md are written)")
    args = p.parse_args(argv)
    if min(args.nproc, args.steps, args.batch_size) < 1 or not 0 <= args.warmup < args.steps:
        p.error("--nproc, --steps, --batch-size must be >= 1 and 0 <= --warmup < --steps")
    if args.peers == "plain" and args.nproc != 1:
        p.error("--peers plain compares with plain torch on one device: --nproc 1")
    library_buckets = args.bucket_numel == "default"
    bucket_numel = None if library_buckets else int(args.bucket_numel)
    record = provenance(command_line(__file__, argv))
    model = model_config(args.model)
    cfg = {"model": args.model, "seed": 0, "peers": args.peers, "precision": args.precision,
           "peer_precision": "match", "reduction": args.reduction,
           "batch_size": args.batch_size, "block_size": model.block_size, "steps": args.steps,
           "lr": 3e-3, "bucket_numel": bucket_numel, "stages": args.stages, "device": "cpu"}
    if library_buckets:
        cfg["ddp_bucket_numel"] = DDP_DEFAULT_BUCKET_NUMEL
    start = time.perf_counter()
    rows = paired_summarize(run_ranks(paired_rank, args.nproc, {**cfg, "model": model}, timeout_s=args.timeout),
                            args.warmup)
    result = {**record, "nproc": args.nproc, "config": cfg, "warmup": args.warmup,
              "seconds": round(time.perf_counter() - start, 1), "rows": rows}
    print("\n".join(paired_table(rows)))
    write_pair(args.out, result, _paired_markdown(result))
    return 0


def _paired_markdown(r: dict) -> str:
    c = r["config"]
    return "\n".join([
        "# zerokit beside its torch peers, step by step", "", *provenance_lines(r),
        f"- {r['nproc']} gloo ranks, model {c['model']}, {c['batch_size']} x {c['block_size']} tokens per rank per "
        f"step, zerokit {c.get('precision', 'fp32')} AdamW (lr {c['lr']}, weight decay 0.1, none on "
        f"biases/LayerNorms), {_paired_buckets(c)}; {_paired_reduction(c, r['nproc'])}; {c['steps']} pairs of "
        f"steps per row, the first {r['warmup']} left out; {r['seconds']} s in all", "", *paired_table(r["rows"]), "",
        "Both engines are built once per row and run in turns, one step each on the same batch, the order "
        "swapped at every pair; a step is the slowest rank's time for forward, backward, optimizer step, the "
        "peer's zero_grad and reading the loss (as benchmarks/speed.py times it). A pair's ratio is "
        "zerokit's step over the peer's step beside it, so drift of the machine over seconds divides out; the "
        "interval is the distribution-free 95% confidence interval of the median pair ratio (binomial order "
        "statistics). An interval wholly below 1 says zerokit's step is the faster one on this machine; one "
        "that straddles 1 says the two cannot be told apart here. Max abs Δloss: the largest difference of "
        "the two engines' losses at the same step on any rank (0: bit for bit). CPU time: each rank's "
        "`time.process_time()` over the same step (every thread of the process, gloo's included), summed over "
        "ranks; its pair ratio and interval as for the wall time."]) + "\n"


def _paired_buckets(c: dict) -> str:
    if c["bucket_numel"] is None:
        return "each library's default bucket size (zerokit's per stage, DDP's 25 MB)"
    return f"bucket {c['bucket_numel']} elements (DDP's cap too)"


def _paired_reduction(c: dict, nproc: int) -> str:
    if c.get("reduction", "default") != "default":
        return f"zerokit's reduction {c['reduction']}"
    return {1: "one rank: no collective", 2: "zerokit's default reduction (at 2 ranks torch's all-reduce: "
            "the ordered sum's bits)"}.get(nproc, "zerokit's default reduction (ordered on gloo)")


# ----------------------------------------------------------------------------- --quantize
QLORA_BASES = ("unquantized", "nf4", "int8")


def qlora_rank(rank: int, world_size: int, cfg: dict) -> dict:
    """Stage 3 engines over one LoRA GPT each (base unquantized, nf4, int8), stepped in turns on the same batches."""
    import zerokit as zk
    from zerokit.commands.step import train_step
    from zerokit.models import Block, CharCorpus, build_model
    corpus = CharCorpus(cfg["text"])
    engines = {}
    for base in QLORA_BASES:
        model = build_model(cfg["model"], seed=0)
        model.requires_grad_(False)
        if base != "unquantized":
            zk.quantize(model, base, skip=("lm_head",))
        torch.manual_seed(1)
        zk.lora.inject(model, targets=("q", "v"), rank=8, alpha=1.0)
        engines[base] = zk.shard(model, torch.optim.AdamW, stage=3, precision=cfg["precision"], lr=1e-3,
                                 wrap=(Block,))
    times = {base: [] for base in QLORA_BASES}
    gathered = {}
    for step in range(cfg["steps"]):
        batch = corpus.batch(cfg["batch_size"], engines["nf4"].module.cfg.block_size, step, rank, world_size)
        order = QLORA_BASES if step % 2 == 0 else QLORA_BASES[::-1]  # drift of the machine favours none
        for base in order:
            engine = engines[base]
            before = engine.comm_stats()["all_gather"]
            start = time.perf_counter()
            float(train_step(engine, [batch], lambda b: engine(*b)[1]).loss)
            times[base].append(time.perf_counter() - start)
            gathered[base] = engine.comm_stats()["all_gather"] - before
    return {"times": times, "gathered": gathered}


def qlora_main(argv: list[str]) -> int:
    """--quantize: stage-3 step time of LoRA over an unquantized, NF4 and int8 base, on gloo ranks."""
    from zerokit.models import preset
    p = argparse.ArgumentParser(description="stage-3 step time: LoRA over a quantized vs unquantized base")
    p.add_argument("--quantize", action="store_true", required=True, help="this mode")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--model", default="small")
    p.add_argument("--precision", default="bf16", choices=["fp32", "bf16"])
    p.add_argument("--steps", type=int, default=40, help="steps per engine, warm-up included")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "qlora_speed")
    args = p.parse_args(argv)
    record = provenance(command_line(__file__, argv))
    text = "".join(path.read_text(encoding="utf-8", errors="replace")
                   for path in sorted((REPO / "zerokit").rglob("*.py")))
    cfg = {"model": args.model, "precision": args.precision, "steps": args.steps, "batch_size": args.batch_size,
           "text": text}
    per_rank = run_ranks(qlora_rank, args.nproc, cfg, timeout_s=3600)
    rows = []
    for base in QLORA_BASES:
        slowest = [max(r["times"][base][i] for r in per_rank) for i in range(args.warmup, args.steps)]
        rows.append({"base": base, "median_step_s": statistics.median(slowest),
                     "gathered_per_step": per_rank[0]["gathered"][base]})
    ref = rows[0]
    for r in rows:
        r["time_vs_unquantized"] = r["median_step_s"] / ref["median_step_s"]
        r["gather_vs_unquantized"] = r["gathered_per_step"] / ref["gathered_per_step"]
    lines = ["| base | median step (ms) | vs unquantized | all-gather bytes / step | vs unquantized |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['base']} | {1e3 * r['median_step_s']:.1f} | {r['time_vs_unquantized']:.2f} | "
              f"{r['gathered_per_step']:,} | {r['gather_vs_unquantized']:.3f} |" for r in rows]
    md = ["# Stage-3 step time: LoRA over a quantized frozen base vs an unquantized one", "",
          *provenance_lines(record),
          f"- {args.nproc} gloo ranks (CPU), ZeRO stage 3 wrapping each Block, model {args.model} "
          f"({args.batch_size} x {preset(args.model).block_size} tokens per rank per step), {args.precision}, "
          f"AdamW; every Linear but the tied head quantized (blocks of 64, double-quantized constants), LoRA on q "
          f"and v (r = 8); {args.steps} steps per engine in turns (order reversed every step), the first "
          f"{args.warmup} left out; a step is the slowest rank's", "", *lines, "",
          "On CPU, gloo's all-gather is a memory copy between processes, so the bytes a quantized base saves buy "
          "little time, while each quantized Linear dequantizes its weight in forward and again in backward: the "
          "step-time ratio here says what that dequantization costs on this machine, not what a network-bound GPU "
          "cluster would gain.", ""]
    result = {**record, "config": {k: v for k, v in cfg.items() if k != "text"}, "warmup": args.warmup,
              "nproc": args.nproc, "rows": rows}
    print("\n".join(md))
    write_pair(args.out, result, "\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
