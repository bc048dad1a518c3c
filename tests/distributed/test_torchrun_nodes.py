"""Two "nodes" on this machine: two torchrun agents meeting through c10d rendezvous, 2 ranks each.

This is the multi-node command of docs/hybrid.md with the endpoint on localhost: each agent is started
as on its own machine (`--nnodes 2 --rdzv-backend c10d`, no `--node-rank`: the rendezvous assigns
it), the small GPT trains at stage 3 with `--shard-group-size 2` (a node's 2 ranks shard, the two
nodes replicate), and the weights it ends with equal, bit for bit, those of stage 0 on 4 ranks
spawned by `zerokit train --nproc 4` (the ordered reduction: core/collectives/hybrid.py [Note: hybrid sharding]).
"""
import os
import re
import socket
import subprocess
import sys
import uuid

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAIN = ["-m", "zerokit", "train", "--model", "small", "--steps", "3", "--batch-size", "2", "--no-progress"]
ABORT = "terminate called"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    env = dict(os.environ)
    env.pop("ZEROKIT_VERBOSE", None)
    env["OMP_NUM_THREADS"] = "1"  # as torchrun sets it, and as `--nproc 4` gives each rank on 2 cores
    return env


def _digest(out: str) -> str:
    found = re.findall(r"weights sha256: ([0-9a-f]{64})", out)
    assert len(found) == 1, out
    return found[0]


def test_two_torchrun_nodes_train_hybrid_stage3_like_stage0():
    port, run_id = _free_port(), uuid.uuid4().hex[:12]
    agent = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
             "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id]
    nodes = [subprocess.Popen(agent + TRAIN + ["--stage", "3", "--shard-group-size", "2"], cwd=REPO, env=_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    try:
        outs = [node.communicate(timeout=240)[0] for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    for node, out in zip(nodes, outs):
        assert node.returncode == 0 and ABORT not in out, out
    report = next(out for out in outs if "weights sha256" in out)  # the node the rendezvous made node 0
    assert "stage 3, 4 rank(s)" in report, report
    assert "hybrid sharding: 2 shard groups of 2 ranks" in report, report
    across = float(re.search(r"and ([0-9.,]+) MB across shard groups", report)[1].replace(",", ""))
    assert across > 0, report
    losses = re.search(r"loss: first ([0-9.]+)  final ([0-9.]+)", report)
    assert float(losses[2]) < float(losses[1]), report  # it trains

    spawned = subprocess.run([sys.executable] + TRAIN + ["--stage", "0", "--nproc", "4"], cwd=REPO, env=_env(),
                             capture_output=True, text=True, timeout=240)
    assert spawned.returncode == 0, spawned.stdout + spawned.stderr
    assert _digest(report) == _digest(spawned.stdout), (report, spawned.stdout)
