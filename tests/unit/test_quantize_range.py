"""zerokit.quant.quantize_range: any byte range of quantize_tensor's output, bit for bit, from the blocks it needs.

engine.load_weights (zerokit/checkpoint/weights.py) quantizes a stage-3 shard's part of a weight this way.
Every range of small weights (NF4 and int8, with and without double quantization, read a block or many at a
time), and which elements each range reads: the blocks of its codes; without double quantization those of
its absmax bytes; with it, a range touching the constants reads every block, each once.
"""
import itertools

import pytest
import torch

from zerokit.quant import QuantSpec, quantize_range, quantize_tensor, range_blocks

SPECS = [QuantSpec(fmt, shape, bs, dq) for fmt in ("nf4", "int8") for dq in (True, False)
         for shape, bs in (((6, 40), 16), ((7, 10), 2), ((520, 2), 4))]  # (520, 2) / 4: 260 blocks, 2 scale2


def _weight(spec: QuantSpec) -> torch.Tensor:
    w = torch.randn(spec.shape, generator=torch.Generator().manual_seed(spec.numel))
    w.view(-1)[:spec.block_size] = 0  # an all-zero block: absmax 0
    return w


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_every_range_equals_quantize_tensor(spec):
    w = _weight(spec)
    flat = w.reshape(-1)
    full = quantize_tensor(w, spec)
    code_end = spec.parts()["codes"][1]
    starts = sorted(set(range(0, spec.nbytes + 1, max(1, spec.nbytes // 20)))
                    | {code_end - 1, code_end, code_end + 1, code_end + 5, spec.nbytes - 4, spec.nbytes})
    for a, b in itertools.product(starts, repeat=2):
        if a <= b:
            for chunk in (3 * spec.block_size, 1 << 22):  # 3 blocks at a time, or all
                got = quantize_range(lambda e0, e1: flat[e0:e1], spec, a, b, chunk_numel=chunk)
                assert torch.equal(got, full[a:b]), (a, b, chunk)


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_reads_only_the_blocks_a_range_depends_on(spec):
    flat = _weight(spec).reshape(-1)
    code_end = spec.parts()["codes"][1]
    for a, b in [(0, 1), (code_end - 1, code_end), (code_end, code_end + 1), (spec.nbytes - 1, spec.nbytes),
                 (0, spec.nbytes), (code_end // 3, code_end // 2)]:
        reads = []

        def read(e0, e1):
            reads.append((e0, e1))
            return flat[e0:e1]
        got_bytes = quantize_range(read, spec, a, b, chunk_numel=spec.block_size)  # a block at a time
        assert torch.equal(got_bytes, quantize_tensor(flat.reshape(spec.shape), spec)[a:b])
        (c0, c1), (m0, m1) = range_blocks(spec, a, b)
        wanted = set(range(c0, c1)) | set(range(m0, m1))
        got = [k for e0, e1 in reads for k in range(e0 // spec.block_size, e1 // spec.block_size)]
        assert sorted(got) == sorted(wanted), (a, b, reads)  # each needed block read once, no other
        if b > code_end and spec.double_quant:
            assert wanted == set(range(spec.nblocks))  # the mean couples every constant to every block
        if b <= code_end:
            per_block = spec.block_size // 2 if spec.fmt == "nf4" else spec.block_size
            assert wanted == set(range(a // per_block, -(-b // per_block)))


def test_a_range_outside_the_bytes_is_refused():
    spec = SPECS[0]
    with pytest.raises(ValueError, match="outside"):
        quantize_range(lambda e0, e1: torch.zeros(e1 - e0), spec, 0, spec.nbytes + 1)
