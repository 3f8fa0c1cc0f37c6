"""``train.deterministic``: the trainer's CUDA kernels made the same run to run.

Without it a few kernels of the update accumulate with atomic adds (FlashAttention's dQ across key blocks, the
input embedding's dense backward) or pick a cuBLAS workspace per stream, so two updates from one state differ by
float noise, and Adam turns the flipped sign of a near-zero gradient into a whole step of lr. torch has a
deterministic variant of each under ``use_deterministic_algorithms``; cuBLAS needs a fixed workspace size, read
when the process makes its first cuBLAS handle (so this runs before the trainer's first matmul). CPU kernels are
deterministic already.
"""
from __future__ import annotations

import os
from contextlib import contextmanager

import torch


def use_deterministic_kernels() -> None:
    """This process's kernels deterministic from now on, in warn-only mode: outside the trainer's backward (the
    log-prob forwards, an engine in the same process) an op without a deterministic kernel warns and runs as before,
    rather than stopping a generation. The backward runs in :func:`strict_if_deterministic`."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)


@contextmanager
def strict_if_deterministic():
    """The trainer's backward under deterministic mode: strict, because torch's FlashAttention backward (the packed
    varlen kernel and SDPA's) takes its deterministic kernel only then (aten attention_backward.cu: under
    ``warn_only`` it warns and keeps the atomic dQ); an op there without a deterministic kernel stops the step with
    torch's error naming it. Nothing changes when deterministic mode is off (the default) or already strict."""
    relax = torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
    if relax:
        torch.use_deterministic_algorithms(True, warn_only=False)
    try:
        yield
    finally:
        if relax:
            torch.use_deterministic_algorithms(True, warn_only=True)
