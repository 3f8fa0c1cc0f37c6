"""``train.deterministic``: the trainer's CUDA kernels made the same run to run.

Without it a few kernels of the update accumulate with atomic adds (FlashAttention's dQ across key blocks, the
input embedding's dense backward) or pick a cuBLAS workspace per stream, so two updates from one state differ by
float noise, and Adam turns the flipped sign of a near-zero gradient into a whole step of lr. torch has a
deterministic variant of each under ``use_deterministic_algorithms``; cuBLAS needs a fixed workspace size, read
when the process makes its first cuBLAS handle (so :func:`fix_cublas_workspace` runs before the trainer's first
matmul). The trainer's compiled norm, called in this mode, is ``fusions.deterministic_norm``: its kernels do not
depend on the token count that compiled them, and torch sums its weight's gradient. The mode is on only while
the trainer computes: an engine in the same process (one GPU, the local backend)
keeps its own kernels. CPU kernels are deterministic already.
"""
from __future__ import annotations

import functools
import os
from contextlib import contextmanager, nullcontext

import torch


def fix_cublas_workspace() -> None:
    """cuBLAS's workspace of a fixed size for this process (its first handle reads it)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


@contextmanager
def _torch_mode(warn_only: bool):
    """torch's deterministic mode on, strict or warn-only, and the process's mode as it was afterwards."""
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=warn_only)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def deterministic_kernels(enabled: bool):
    """torch's deterministic kernels while the trainer computes, in warn-only mode (kept strict if the process already
    is): outside the backward an op without a deterministic kernel warns and runs as before (the backward runs in
    :func:`strict_if_deterministic`). The process's mode is as it was afterwards."""
    if not enabled:
        return nullcontext()
    strict = torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled()
    return _torch_mode(warn_only=not strict)


def trainer_compute(method):
    """A trainer method that runs the model: under :func:`deterministic_kernels` when its ``train_cfg`` asks."""
    @functools.wraps(method)
    def wrapped(self, *args, **kwargs):
        with deterministic_kernels(self.train_cfg.deterministic):
            return method(self, *args, **kwargs)
    return wrapped


def strict_if_deterministic():
    """The trainer's backward under deterministic mode: strict, because torch's FlashAttention backward (the packed
    varlen kernel and SDPA's) takes its deterministic kernel only then (aten attention_backward.cu: under
    ``warn_only`` it warns and keeps the atomic dQ); an op there without a deterministic kernel stops the step with
    torch's error naming it. Nothing changes when deterministic mode is off or already strict."""
    relax = torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
    return _torch_mode(warn_only=False) if relax else nullcontext()
