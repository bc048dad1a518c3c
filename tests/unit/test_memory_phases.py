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
    per_slice = loading.kept_ranges

    def read_whole(engine, f, aliases):
        whole = [f.get_tensor(k) for k in f.keys()]  # held while the ranges are installed
        yield from per_slice(engine, f, aliases)
        del whole

    loading.kept_ranges = read_whole


def _simulate(planted: bool, stage: int) -> dict:
    """One simulated rank in this (fresh) process: a resident set's growth is only comparable between runs that
    start from the same heap, so each run gets a process of its own."""
    if planted:
        _plant_full_gather()
    return simulate_rank(WIDE, N, stage, "bf16", build="deferred", save=True)


def _in_fresh_process(planted: bool, stage: int = 3) -> dict:
    import concurrent.futures
    import multiprocessing

    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_simulate, planted, stage).result(timeout=240)


def test_simulated_save_and_load_add_one_unit_not_the_model():
    """Stage 3, rank 0 of 64: the save (model file streamed one flat param at a time, then the rank file) and the
    load (this rank's range of one flat param at a time, then one master's values and states at a time) each
    add at most 2 units to the resident set; so does the load at stage 2, whose ranges are whole flat params
    (it held the whole model's 4Ψ before it streamed). Planting a full gather in the save and a whole-file
    read in the load makes each add about the whole model (4Ψ), far over those bounds."""
    result = _in_fresh_process(planted=False)
    assert set(result["phases"]["peaks"]) == {"build", "step", "save", "load"}
    psi, unit = result["config"]["num_params"], result["phases"]["largest_unit_bytes"]
    files = result["saved_bytes"]
    assert files["model.safetensors"] >= 4 * psi - 4 * WIDE.vocab_size * WIDE.n_embd  # fp32, the tie once
    assert set(files) == {"model.safetensors", f"rank0-of-{N}.safetensors"}
    growth = _growth(result)
    assert growth["save"] <= 2 * unit and growth["load"] <= 2 * unit, (growth, unit)
    stage2 = _growth(_in_fresh_process(planted=False, stage=2))
    assert stage2["save"] <= 2 * unit and stage2["load"] <= 2 * unit, (stage2, unit)

    planted = _growth(_in_fresh_process(planted=True))
    assert planted["save"] > 0.9 * 4 * psi and planted["load"] > 0.9 * 4 * psi, (planted, psi)
    assert planted["save"] > 2 * unit and planted["load"] > 2 * unit, (planted, unit)


def test_simulate_skips_save_by_default_in_the_api():
    """simulate_rank(save=False), the API's default, measures build and step only (the command saves)."""
    small = GPTConfig(vocab_size=256, block_size=16, n_layer=1, n_head=2, n_embd=32)
    assert set(simulate_rank(small, 4, 3, "fp32")["phases"]["peaks"]) == {"build", "step"}
