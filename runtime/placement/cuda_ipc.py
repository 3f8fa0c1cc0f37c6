"""Tensors handed between processes on the same GPU by CUDA IPC handle: no copy through host memory.

The sender keeps its tensors alive and sends, per tensor, the handle of the allocation that holds it
(`torch.multiprocessing.reductions.reduce_tensor`: plain bytes and ints, so any transport carries them,
Ray's included). The receiver maps that allocation into its own address space and reads it in place.

Under Ray, two actors sharing a GPU may each see it under another index (each one's CUDA_VISIBLE_DEVICES),
so a handle names its GPU by UUID and the receiver opens it on its own device of that UUID.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

# reduce_tensor's rebuild arguments for a CUDA tensor: the storage's device index is the 7th
_DEVICE_ARG = 6


@dataclass
class SharedTensors:
    """What crosses the process boundary: the GPU's UUID and, per name, reduce_tensor's (rebuild, args)."""

    gpu: str
    handles: dict[str, tuple[Any, tuple]]


def gpu_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def share(named: dict[str, torch.Tensor]) -> SharedTensors:
    """Handles to CUDA tensors on one GPU. The caller keeps `named` alive until every receiver is done."""
    from torch.multiprocessing.reductions import reduce_tensor
    devices = {t.device for t in named.values()}
    if len(devices) != 1 or next(iter(devices)).type != "cuda":
        raise ValueError(f"CUDA IPC shares tensors of one GPU; got devices {sorted(map(str, devices))}")
    device = next(iter(devices))
    index = torch.cuda.current_device() if device.index is None else device.index
    return SharedTensors(gpu_uuid(index), {name: reduce_tensor(t.detach()) for name, t in named.items()})


def open_shared(shared: SharedTensors) -> dict[str, torch.Tensor]:
    """The sender's tensors, mapped into this process on the GPU they live on (no copy). Raises when this
    process does not see that GPU."""
    index = next((i for i in range(torch.cuda.device_count()) if gpu_uuid(i) == shared.gpu), None)
    if index is None:
        raise RuntimeError(f"CUDA IPC: the weights are on GPU {shared.gpu}, which this process does not see "
                           f"(its GPUs: {[gpu_uuid(i) for i in range(torch.cuda.device_count())]}); the engine must "
                           f"share its trainer rank's GPU")
    out = {}
    for name, (rebuild, args) in shared.handles.items():
        args = list(args)
        args[_DEVICE_ARG] = index
        out[name] = rebuild(*args)
    return out
