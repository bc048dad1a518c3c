"""The GPU tier: tests marked `@pytest.mark.gpus(n)` run only where n CUDA devices and NCCL exist.

Elsewhere they are skipped with the reason (how many GPUs were needed and found), so the
tier can always be collected, and its world-size-1 cases run wherever one GPU exists.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist


def available_gpus() -> int:
    """CUDA devices usable with NCCL here (0 without CUDA or without an NCCL build)."""
    if not torch.cuda.is_available() or not (dist.is_available() and dist.is_nccl_available()):
        return 0
    return torch.cuda.device_count()


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "gpus(n): needs n CUDA devices and NCCL; skipped otherwise")


def pytest_collection_modifyitems(config, items) -> None:
    have = available_gpus()
    for item in items:
        marker = item.get_closest_marker("gpus")
        if marker is None:
            continue
        need = int(marker.args[0]) if marker.args else 1
        if have < need:
            item.add_marker(pytest.mark.skip(reason=f"needs {need} CUDA device(s) with NCCL, found {have}"))
