"""The batch-invariant attention of ``rollout.true_on_policy`` on CUDA: one Triton kernel for the engine's paged
decode, its prefill (a preempted sample's recompute included) and the trainer's forward (issue 61).

One program per (query row, KV head): its tile is the KV head's query heads (padded to 16 rows for `tl.dot`), and it
walks the row's keys from position 0 to the row's own position in blocks of `KEY_BLOCK` under a running fp32 softmax
(`decode_attention._attend_block`, the paged decode kernels' step). A row is never split across programs and no
program holds two rows, so nothing a row's bits are made of depends on how many rows came with it. The two modes
differ only in where a key is read (the constexpr `PAGED`): through the row's page table (prompt pages, then its own;
`reference_paged_decode_attention`'s layout) or at its place in a contiguous sequence packed by ``cu_seqlens``.
The arithmetic is one code path, so the engine's decode, its prefill and the trainer give a row the same bits.

The decode call reads every length on the device (no host sync: a CUDA graph captures it). The result is close to
the plain-PyTorch path (runtime/kernels/batch_invariant.py, what the CPU runs) but not its bits: each side runs one
of the two, the same one.
"""
from __future__ import annotations

import torch

from runtime.rollout.decode_attention import triton_available

KEY_BLOCK = 64  # keys per step of a row's running softmax
_WARPS, _STAGES = 4, 2  # fixed: the dot's layout follows the warps

if triton_available():
    import triton
    import triton.language as tl

    from runtime.rollout.decode_attention import _attend_block

    @triton.jit
    def _row_attention_kernel(Q, K, V, OUT, PT, PLEN, OLEN, FIRST,
                              stride_qr, stride_qh, stride_kp, stride_kt, stride_kh, stride_ptr, stride_or, stride_oh,
                              prefix_cols, scale_log2,
                              REP: tl.constexpr, REP_PAD: tl.constexpr, HD: tl.constexpr, BLOCK_N: tl.constexpr,
                              PAGE: tl.constexpr, PAGED: tl.constexpr):
        r = tl.program_id(0)
        h = tl.program_id(1)
        if PAGED:  # the row's keys: its prompt's positions [0, plen), then its own [0, olen)
            plen = tl.load(PLEN + r).to(tl.int32)
            total = plen + tl.load(OLEN + r).to(tl.int32)
            pt_row = PT + r.to(tl.int64) * stride_ptr
        else:  # the row is position r - first of the sequence starting at row `first`: keys [first, r]
            first = tl.load(FIRST + r).to(tl.int32)
            total = r - first + 1
        rows = tl.arange(0, REP_PAD)
        d = tl.arange(0, HD)
        qh = h * REP + rows
        q = tl.load(Q + r.to(tl.int64) * stride_qr + qh[:, None] * stride_qh + d[None, :], mask=rows[:, None] < REP,
                    other=0.0)
        m = tl.full([REP_PAD], float("-inf"), tl.float32)
        l = tl.zeros([REP_PAD], tl.float32)
        acc = tl.zeros([REP_PAD, HD], tl.float32)
        for start in range(0, total, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            valid = n < total
            if PAGED:
                in_prefix = n < plen
                j = tl.where(in_prefix, n, n - plen)
                col = tl.where(in_prefix, j // PAGE, prefix_cols + j // PAGE)
                page = tl.load(pt_row + col, mask=valid, other=0).to(tl.int64)
                off = page * stride_kp + (j % PAGE).to(tl.int64) * stride_kt + h * stride_kh
            else:
                off = (first + n).to(tl.int64) * stride_kt + h * stride_kh
            m, l, acc = _attend_block(q, K, V, off, valid, d, m, l, acc, scale_log2)
        out = acc / l[:, None]
        tl.store(OUT + r.to(tl.int64) * stride_or + qh[:, None] * stride_oh + d[None, :],
                 out.to(OUT.dtype.element_ty), mask=rows[:, None] < REP)


def row_attention_fits(q: torch.Tensor) -> bool:
    """The kernel serves q: a CUDA tensor, Triton installed, a head dimension it tiles whole (a power of two, >= 16 for
    the tensor-core dot). Both sides ask this of the same model, so both take one path."""
    hd = q.shape[-1]
    return q.is_cuda and triton_available() and hd >= 16 and hd & (hd - 1) == 0


def _launch(q, k, v, table, plen, olen, first, stride_kp, stride_kt, stride_kh, prefix_cols, page, scale, paged):
    rows, nh, hd = q.shape
    nkv = k.shape[-2]
    rep = nh // nkv
    q = q if q.stride(-1) == 1 else q.contiguous()
    out = torch.empty(rows, nh, hd, dtype=q.dtype, device=q.device)
    if rows:
        _row_attention_kernel[(rows, nkv)](
            q, k, v, out, table, plen, olen, first,
            q.stride(0), q.stride(1), stride_kp, stride_kt, stride_kh, table.stride(0), out.stride(0), out.stride(1),
            int(prefix_cols), float(scale) * 1.4426950408889634,
            REP=rep, REP_PAD=max(16, triton.next_power_of_2(rep)), HD=hd, BLOCK_N=KEY_BLOCK, PAGE=page, PAGED=paged,
            num_warps=_WARPS, num_stages=_STAGES)
    return out


def paged_row_attention(q, k_pool, v_pool, page_table, prefix_len, own_len, prefix_cols: int, scale: float):
    """`reference_paged_decode_attention`'s arguments and result (q [B, nh, hd]; pools [pages, page_size, nkv, hd];
    page_table [B, cols], its first `prefix_cols` columns the row's prompt pages; prefix_len/own_len [B]), each row
    by one program per KV head. No host sync."""
    assert k_pool.stride() == v_pool.stride() and k_pool.stride(-1) == 1 and page_table.stride(-1) == 1
    return _launch(q, k_pool, v_pool, page_table, prefix_len, own_len, prefix_len, k_pool.stride(0), k_pool.stride(1),
                   k_pool.stride(2), prefix_cols, k_pool.shape[1], scale, True)


def sequence_row_attention(q, k, v, scale: float, cu_seqlens: torch.Tensor | None = None):
    """Causal attention of contiguous sequences: q [n, nh, hd], k/v [n, nkv, hd], packed by `cu_seqlens` ([S + 1],
    from 0 to n; None: one sequence). Row i of a sequence attends to that sequence's positions [0, i]."""
    n = q.shape[0]
    if cu_seqlens is None:
        first = torch.zeros(n, dtype=torch.long, device=q.device)
    else:  # each row's sequence's first row, on the device
        cu = cu_seqlens.long()
        first = cu[torch.searchsorted(cu, torch.arange(n, device=q.device), right=True) - 1]
    if k.stride() != v.stride() or k.stride(-1) != 1:  # one offset addresses a key and its value
        k, v = k.contiguous(), v.contiguous()
    return _launch(q, k, v, first[None], first, first, first, 0, k.stride(0), k.stride(1), 0, 1, scale, False)


__all__ = ["KEY_BLOCK", "paged_row_attention", "row_attention_fits", "sequence_row_attention"]
