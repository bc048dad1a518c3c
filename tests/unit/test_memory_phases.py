"""The save and load phases of a simulated rank (`zerokit memory --simulate`): what each adds to the resident
set is one unit's worth (and this rank's own shards), never the whole model."""
import torch

from zerokit.commands.memory import simulate_rank
from zerokit.models import GPTConfig

# 29M parameters: the whole model in fp32 (118 MB) is 7x its largest unit (the root: the tied embedding), so
# a phase that holds it stands far out of the resident set's noise; a few seconds per run.
WIDE = GPTConfig(vocab_size=8192, block_size=64, n_layer=8, n_head=8, n_embd=512)
N = 64


def _growth(result):
    """Bytes each phase added to the resident set at its height (peak minus the resident set at its start)."""
    return {name: row["growth_bytes"] for name, row in result["phases"]["peaks"].items()}


def _plant_full_gather():
    """Save as before streaming: the full state held at once (what state_dict(full=True) holds); load as a reader
    of the whole model file (every tensor read and kept beside the plan)."""
    from zerokit.checkpoint import loading
    from zerokit.core.engine import Engine

    streaming = Engine.full_state_items

    def whole_at_once(self, rank0_only=False):
        items = [(name, None if t is None else t.clone()) for name, t in streaming(self, rank0_only)]
        yield from items

    Engine.full_state_items = whole_at_once
    per_slice = loading._read_model_file

    def read_whole(engine, directory, meta, plan):
        with loading._open_model(directory, meta) as f:
            whole = [f.get_tensor(k) for k in f.keys()]
        per_slice(engine, directory, meta, plan)
        plan.planted = whole  # held until the plan is dropped, as a whole-model plan would be

    loading._read_model_file = read_whole


def _simulate(planted: bool) -> dict:
    """One simulated rank in this (fresh) process: a resident set's growth is only comparable between runs that
    start from the same heap, so each run gets a process of its own."""
    if planted:
        _plant_full_gather()
    return simulate_rank(WIDE, N, 3, "bf16", build="deferred", save=True)


def _in_fresh_process(planted: bool) -> dict:
    import concurrent.futures
    import multiprocessing

    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_simulate, planted).result(timeout=240)


def test_simulated_save_and_load_add_one_unit_not_the_model():
    """Stage 3, rank 0 of 64: the save (model file streamed one flat param at a time, then the rank file) adds at
    most 2 units to the resident set, the load (this rank's slices of the model file, its rank file) at most 2
    units + this rank's 16Ψ/N; planting a full gather in the save and a whole-file read in the load makes each
    add about the whole model (4Ψ), far over those bounds."""
    result = _in_fresh_process(planted=False)
    assert set(result["phases"]["peaks"]) == {"build", "step", "save", "load"}
    psi, unit = result["config"]["num_params"], result["phases"]["largest_unit_bytes"]
    files = result["saved_bytes"]
    assert files["model.safetensors"] >= 4 * psi - 4 * WIDE.vocab_size * WIDE.n_embd  # fp32, the tie once
    assert set(files) == {"model.safetensors", f"rank0-of-{N}.safetensors"}
    growth = _growth(result)
    assert growth["save"] <= 2 * unit, (growth, unit)
    assert growth["load"] <= 2 * unit + 16 * psi // N, (growth, unit)

    planted = _growth(_in_fresh_process(planted=True))
    assert planted["save"] > 0.9 * 4 * psi and planted["load"] > 0.9 * 4 * psi, (planted, psi)
    assert planted["save"] > 2 * unit and planted["load"] > 2 * unit + 16 * psi // N, (planted, unit)


def test_simulate_skips_save_by_default_in_the_api():
    """simulate_rank(save=False), the API's default, measures build and step only (the command saves)."""
    small = GPTConfig(vocab_size=256, block_size=16, n_layer=1, n_head=2, n_embd=32)
    assert set(simulate_rank(small, 4, 3, "fp32")["phases"]["peaks"]) == {"build", "step"}
