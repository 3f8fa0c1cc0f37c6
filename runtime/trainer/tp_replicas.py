"""Tensor-parallel replicas: the parameters every TP rank holds whole (norm weights, the LoRA factor that a
parallel linear's adapter does not split), each rank stepping its own copy from its own gradient.

Those gradients are equal in exact arithmetic: every TP rank sees the same replicated activations and the same
all-reduced output gradients. On a GPU they are not equal in the last bits (kernels whose reductions are not
run-to-run deterministic), so the copies drift apart a little at every step: on 2 x H100, a GLM4 at TP 2 had 12
of its 17 norm weights differ between the ranks by up to 5.6e-6 after two updates at lr 1e-4
(bench/results/glm9b_host_optimizer_2xH100_2026-11-26_resume*.json). A checkpoint keeps TP rank 0's copy,
so rank 1 resumed from another weight than the one it had, and the model the ranks computed was not one model.

Before each optimizer step the TP ranks take TP rank 0's gradient for these parameters (one broadcast of a few
MB: GLM-Z1-9B's replicas are 0.7 M elements), so the copies stay one tensor. Where the gradients are equal
already (a deterministic path, the CPU) nothing changes. Megatron sums over TP the replicas whose gradients are
partial per rank (norms under sequence parallelism, q/k layernorms); after its sum they are equal on every rank,
so taking rank 0's leaves them as they are.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors


def replicated_parameters(model) -> list[torch.nn.Parameter]:
    """The trained parameters that are not split over the TP ranks (megatron's ``tensor_model_parallel``)."""
    return [p for p in model.parameters() if p.requires_grad and not getattr(p, "tensor_model_parallel", False)]


def _grad(p: torch.nn.Parameter) -> torch.Tensor | None:
    g = getattr(p, "main_grad", None)  # megatron DDP's view into its gradient buffer
    return p.grad if g is None else g


@torch.no_grad()
def take_rank0_gradients(params: list[torch.nn.Parameter], group) -> int:
    """Every rank of ``group`` (the TP group) gets its rank 0's gradients of ``params``, in place; returns the
    elements sent. One broadcast per gradient dtype."""
    if group is None or dist.get_world_size(group) <= 1:
        return 0
    src = dist.get_global_rank(group, 0)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in params:
        g = _grad(p)
        if g is not None:
            by_dtype.setdefault(g.dtype, []).append(g)
    sent = 0
    for grads in by_dtype.values():
        flat = _flatten_dense_tensors(grads)
        dist.broadcast(flat, src=src, group=group)
        for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g.copy_(synced)
        sent += flat.numel()
    return sent
