"""The figures behind tests/distributed/test_quant_sharded.py's claims, printed (the test asserts them).

    python -m zerokit.provenance record benchmarks/results/qlora_parity.txt -- python benchmarks/investigations/qlora_parity.py

Runs the test's cases (one spawn of 2 ranks, one of 3) and prints, per world size, format and
precision, for each stage: the largest |adapter - torch DDP reference adapter| after 5 steps, the
distance of the two runs' updates relative to the reference's update, and the largest difference
from the same run at stage 0; then stage 3's all-gather bytes per step, memory by category beside
the formula, Hugging Face GPT-2 / Llama and the checkpointing + no_sync + clipping cases.
"""
import sys, tempfile
sys.path[:0] = [str(__import__("pathlib").Path(__file__).resolve().parents[2] / d) for d in ("tests", "tests/distributed", "")]
import test_quant_sharded as T
from zerokit.launch import run_ranks

def main():
    root = tempfile.mkdtemp()
    ws = {2: run_ranks(T._cases, 2, root, store_dir=root, timeout_s=600), 3: run_ranks(T._cases, 3, root, store_dir=root, timeout_s=600)}
    for n, res in ws.items():
        for fmt in T.FORMATS:
            ref = T.ok(res, ("ddp", fmt))
            for precision in T.PRECISIONS:
                cells = []
                for stage in T.STAGES:
                    runs = T.ok(res, ("zk", fmt, precision, stage))
                    d = max(T.max_diff(r["adapters"], x["adapters"]) for r, x in zip(runs, ref))
                    u = max(T.update_distance(r["adapters"], x) for r, x in zip(runs, ref))
                    s0 = max(T.max_diff(r["adapters"], b["adapters"]) for r, b in zip(runs, T.ok(res, ("zk", fmt, precision, 0))))
                    cells.append(f"s{stage}: max|Δ| {d:.3g} upd.dist {u:.3g} vs-s0 {s0:.3g}")
                print(f"N={n} {fmt} {precision}: " + "; ".join(cells))
    g = {fmt: T.ok(ws[2], ("zk", fmt, "fp32", 3))[0]["gathered_per_step"] for fmt in ("nf4", "int8", None)}
    gb = {fmt: T.ok(ws[2], ("zk", fmt, "bf16", 3))[0]["gathered_per_step"] for fmt in ("nf4", "int8")}
    print("stage-3 gather bytes/step fp32 N=2:", g, "nf4/unq", g["nf4"] / g[None], "int8/unq", g["int8"] / g[None])
    print("stage-3 gather bytes/step bf16 N=2:", gb)
    for n in (2, 3):
        worst = 0
        for fmt in T.FORMATS + (None,):
            for precision in (("fp32", "bf16") if fmt else ("fp32",)):
                for stage in T.STAGES:
                    for r in T.ok(ws[n], ("zk", fmt, precision, stage)):
                        est = T.estimate(r["psi"], n, stage, precision, "adamw", trainable_params=r["psi_t"], quantize=fmt, quantized_params=r["quantized"] or None).as_dict()
                        for c, b in est.items():
                            if c != "activations":
                                worst = max(worst, abs(r["memory"].get(c, 0) - b))
                        if n == 2 and r is T.ok(ws[n], ("zk", fmt, precision, stage))[0]:
                            print(f"mem N={n} {fmt} {precision} s{stage}: measured {dict((k, v) for k, v in r['memory'].items() if k != 'comm_buffers')} formula {dict((k, v) for k, v in est.items() if k != 'activations')}")
        print(f"N={n}: largest |measured - formula| over every category, case and rank: {worst} B")
    for kind in ("gpt2", "llama"):
        ref = T.ok(ws[2], ("hf", kind, None))
        print(kind, [max(T.max_diff(r, d) for r, d in zip(T.ok(ws[2], ("hf", kind, s)), ref)) for s in T.STAGES])
    acc = T.ok(ws[2], ("acc", "ddp"))
    print("ckpt+no_sync+clip", [max(T.max_diff(r["adapters"], d["adapters"]) for r, d in zip(T.ok(ws[2], ("acc", s)), acc)) for s in (2, 3)])
    print("fp16 losses", T.ok(ws[2], ("fp16",))[0]["losses"].tolist())


if __name__ == '__main__':
    main()
