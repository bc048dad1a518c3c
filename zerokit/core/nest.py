"""Tensors nested in a module's arguments or outputs: find them, or rebuild the nest with new ones.

A model's inputs and outputs are tensors inside tuples, lists and dicts, nested freely
(Hugging Face's `ModelOutput` is an OrderedDict subclass; namedtuples are tuples with
fields). Mixed precision casts the floating-point ones (core/precision.py), stage 3 watches
the gradients of the ones that require grad (core/params/unit.py). Both walk the nest the same way.
"""
from __future__ import annotations

import copy
from typing import Any, Callable

import torch


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """The same nest with every tensor t replaced by fn(t); containers keep their type.

    Namedtuples are rebuilt field by field; dicts are shallow-copied (so OrderedDict,
    defaultdict and ModelOutput keep their type and extras) and their values replaced.
    Non-tensor leaves come back as they are.
    """
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(map_tensors(item, fn) for item in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(item, fn) for item in obj)
    if isinstance(obj, dict):
        out = copy.copy(obj)
        for key, value in obj.items():
            out[key] = map_tensors(value, fn)
        return out
    return obj


def tensors_in(obj: Any) -> list[torch.Tensor]:
    """Every tensor inside the nest, in order."""
    found: list[torch.Tensor] = []
    _walk(obj, found.append)
    return found


def _walk(obj: Any, fn: Callable[[torch.Tensor], Any]) -> None:
    """Call fn on every tensor of the nest, in order, without rebuilding anything."""
    if isinstance(obj, torch.Tensor):
        fn(obj)
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            _walk(item, fn)
    elif isinstance(obj, dict):
        for value in obj.values():
            _walk(value, fn)
