"""Requests split between data-parallel engines: whole groups each, balanced by count, in order.

A group here is a run of consecutive requests for one prompt (same prompt tokens and the same (seed,
slot, prompt index) in their keys): its samples stay on one engine, where they share the prompt's KV
pages. Each engine gets one contiguous range, so the results merge back in request order by
concatenation. Every sample is a pure function of its key (keyed sampling), so which engine makes it
changes nothing in what it is.

(The SGLang backend balances differently, one request at a time to the least-busy server
(`runtime/rollout/sglang/engine_pool.py`): its servers batch whatever arrives. The built-in engine is a
batch decoder called once per share, and a pool that stops on `GroupsDone` must know which engine
holds which request, so its split is fixed in advance.)
"""
from __future__ import annotations

from typing import Sequence

from runtime.rollout.base import SampleRequest


def group_bounds(requests: Sequence[SampleRequest]) -> list[int]:
    """Start index of every group (runs of one prompt and one key prefix), and len(requests) last."""
    bounds = []
    last = None
    for i, r in enumerate(requests):
        ident = (tuple(r.key[:3]), tuple(r.prompt_ids))
        if ident != last:
            bounds.append(i)
            last = ident
    return bounds + [len(requests)]


def split_ranges(requests: Sequence[SampleRequest], parts: int) -> list[range]:
    """`parts` contiguous ranges of request indices covering them all, cut only between groups, each cut
    at the group boundary nearest to its even share (k × len / parts); some may be empty."""
    if parts < 1:
        raise ValueError(f"split_ranges: parts must be >= 1, got {parts}")
    bounds = group_bounds(requests)
    n = len(requests)
    cuts = [0]
    for k in range(1, parts):
        target = k * n / parts
        best = min((b for b in bounds if b >= cuts[-1]), key=lambda b: (abs(b - target), -b))
        cuts.append(best)
    cuts.append(n)
    return [range(a, b) for a, b in zip(cuts, cuts[1:])]
