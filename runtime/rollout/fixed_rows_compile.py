"""A compiled piece whose kernels do not depend on the calls that came before it.

`torch.compile(dynamic=True)` compiles a piece at its first call, and inductor sizes each kernel (its
block sizes, whether a long reduction is split in two) from that call's row count. A different
configuration sums in a different order, so the same rows later come out a few ulps apart. An engine's
first call is the first prefill of whatever it generates first: a fresh engine (rebuilt after a fault,
or resumed on another node) compiled on rollout 1's prompts, the unbroken one on rollout 0's, and the
two then drew rollout 1 with log-probs apart (2 x H200, 2026-11-27). The first call also decides which
sizes become constants: a row count that equals a weight's dimension is merged with it, so the next
row count compiles again.

`on_fixed_rows` makes the first compile of every engine the same: before its first real call the piece
runs once on `FIRST_ROWS` rows of zeros (the caller's other arguments as they are), a count that
equals none of the arguments' sizes, so the rows stay one free size. Every later call of two or more
rows meets that kernel; one row compiles its own (always the same one).
"""
from __future__ import annotations

from typing import Callable

import torch

FIRST_ROWS = (63, 61, 59, 57, 55, 53)  # the first that no argument's size equals; 64 when rounded up


def free_row_count(args: tuple) -> int:
    sizes = {int(d) for a in args if isinstance(a, torch.Tensor) for d in a.shape}
    sizes |= {a for a in args if isinstance(a, int) and not isinstance(a, bool)}
    return next(n for n in FIRST_ROWS if n not in sizes)


def on_fixed_rows(fn: Callable, row_args: tuple[int, ...]) -> Callable:
    """`fn` (compiled) whose first call is preceded by one on `free_row_count` rows of zeros: the positional
    arguments `row_args` are the per-row ones (first dimension: rows); the result of that call is dropped."""
    first = [True]

    def call(*args):
        if first[0]:
            rows = free_row_count(args)
            fn(*(a.new_zeros((rows, *a.shape[1:])) if i in row_args else a for i, a in enumerate(args)))
            first[0] = False
        return fn(*args)

    call.__wrapped__ = fn
    return call


__all__ = ["FIRST_ROWS", "free_row_count", "on_fixed_rows"]
