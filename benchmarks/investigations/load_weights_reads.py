"""What engine.load_weights reads per rank into a quantized base (NF4 under LoRA), stages 0 and 3, 2 gloo ranks.

    python -m zerokit.provenance record benchmarks/results/load_weights_reads.txt -- python benchmarks/investigations/load_weights_reads.py

A GPT of 4 blocks, width 512 (12.6M quantized elements), its fp32 weights in one safetensors file; every
Linear but the tied head NF4-quantized (double quantization on, then off), LoRA on q and v. Each rank
builds the engine, then load_weights(file) with every SafetensorsReader read counted: bytes read by the
rank, the file's tensor bytes, the packed bytes the rank keeps, and the load's wall time (2 shared CPUs:
indicative only). tests/distributed/test_load_weights_quantized.py asserts the bits; this prints the reads.
"""
import os
import sys
import tempfile
import time

sys.path[:0] = [str(__import__("pathlib").Path(__file__).resolve().parents[2] / d)
                for d in ("tests", "tests/distributed", "")]
import torch  # noqa: E402

import test_load_weights_quantized as T  # noqa: E402
import zerokit as zk  # noqa: E402
from zerokit.checkpoint.format import SafetensorsReader  # noqa: E402
from zerokit.launch import run_ranks  # noqa: E402
from zerokit.models import GPT, Block, GPTConfig  # noqa: E402

CFG = GPTConfig(vocab_size=97, block_size=64, n_layer=4, n_head=8, n_embd=512)


def _model(double_quant: bool, weights=None):
    torch.manual_seed(0)
    model = GPT(CFG)
    if weights is not None:
        model.load_state_dict(weights)
    model.requires_grad_(False)
    zk.quantize(model, "nf4", skip=("lm_head",), double_quant=double_quant)
    torch.manual_seed(1)
    zk.lora.inject(model, targets=("q", "v"), rank=8)
    return model


def _ranks(rank, world_size, path):
    from safetensors.torch import save_file
    if rank == 0:
        torch.manual_seed(5)
        save_file({k: v for k, v in GPT(CFG).state_dict().items() if k != "lm_head.weight"}, path)
    torch.distributed.barrier()
    with SafetensorsReader(path) as f:
        file_bytes = sum(torch.empty((), dtype=f.dtype(k)).element_size() * T._numel(f.get_slice(k).get_shape())
                         for k in f.keys())
        quantized = sum(T._numel(f.get_slice(k).get_shape()) * 4 for k in f.keys()
                        if ".attn." in k and k.endswith("weight") or ".mlp." in k and k.endswith("weight"))
    out = []
    for dq in (True, False):
        for stage in (0, 3):
            engine = zk.shard(_model(dq), torch.optim.AdamW, stage=stage, wrap=(Block,), lr=1e-4)
            kept = sum(hi - lo for fp in engine.flat_params if not fp.dtype.is_floating_point
                       for lo, hi in [engine.kept_range(fp)])
            torch.distributed.barrier()
            t0 = time.perf_counter()
            with T._CountReads() as reads:
                engine.load_weights(path)
            out.append(dict(dq=dq, stage=stage, read=reads.bytes, kept_packed=kept, seconds=time.perf_counter() - t0,
                            file_bytes=file_bytes, quantized_file_bytes=quantized))
    return out


def main():
    root = tempfile.mkdtemp()
    results = run_ranks(_ranks, 2, os.path.join(root, "w.safetensors"), store_dir=root, timeout_s=600)
    first = results[0][0]
    print(f"file: {first['file_bytes']} tensor bytes (fp32), {first['quantized_file_bytes']} of them the "
          "quantized weights")
    for i, case in enumerate(results[0]):
        for rank, res in enumerate(results):
            c = res[i]
            print(f"nf4 double_quant={c['dq']} stage {c['stage']} rank {rank}: read {c['read']} bytes "
                  f"({c['read'] / c['file_bytes']:.4f} of the file), keeps {c['kept_packed']} packed bytes, "
                  f"load {c['seconds']:.3f} s")


if __name__ == "__main__":
    main()
