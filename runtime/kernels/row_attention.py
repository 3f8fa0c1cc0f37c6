"""The batch-invariant attention of ``rollout.true_on_policy`` on CUDA: two Triton kernels for the engine's paged
decode, its prefill (a preempted sample's recompute included) and the trainer's forward (issue 61).

A row's keys are split at fixed positions, every `KEY_CHUNK` from 0, so the split follows the row's position alone.
The chunk pass runs one program per (query row, KV head, chunk): its tile is the KV head's query heads (padded to 16
rows for `tl.dot`), walking the chunk's keys in blocks of `KEY_BLOCK` under a running fp32 softmax
(`decode_attention._attend_block`, the paged decode kernels' step), left unnormalised. The merge runs one program
per (query row, KV head) and folds the row's chunks in position order. No program holds two rows, so nothing a
row's bits are made of depends on how many rows came with it; the chunks give a decode step of few long rows many
programs (one per (row, head) left most of an H200 idle: issue 61's cost). The two modes differ only in where a key
is read (the constexpr `PAGED`): through the row's page table (prompt pages, then its own;
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
KEY_CHUNK = 1024  # keys per split of a row: fixed positions [c * KEY_CHUNK, (c + 1) * KEY_CHUNK), never the batch's
SCRATCH_BYTES = 64 * 2**20  # the sequence mode's partial results per launch (more rows: more launches)
_WARPS, _STAGES = 4, 2  # fixed: the dot's layout follows the warps

if triton_available():
    import triton
    import triton.language as tl

    from runtime.rollout.decode_attention import _attend_block

    @triton.jit
    def _row_span(r, row0, PLEN, OLEN, FIRST, PAGED: tl.constexpr):
        # (keys of row r, its prompt's length, its sequence's first row): the paged row's keys are its prompt's
        # positions [0, plen), then its own [0, olen); the packed row row0 + r attends to [first, row0 + r]
        if PAGED:
            plen = tl.load(PLEN + r).to(tl.int32)
            return plen + tl.load(OLEN + r).to(tl.int32), plen, 0
        first = tl.load(FIRST + r).to(tl.int32)
        return row0 + r - first + 1, 0, first

    @triton.jit
    def _row_chunk_kernel(Q, K, V, MPART, LPART, APART, PT, PLEN, OLEN, FIRST,
                          stride_qr, stride_qh, stride_kp, stride_kt, stride_kh, stride_ptr,
                          prefix_cols, scale_log2, row0, CHUNKS,
                          NH: tl.constexpr, REP: tl.constexpr, REP_PAD: tl.constexpr,
                          HD: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, PAGE: tl.constexpr,
                          PAGED: tl.constexpr):
        # one (row, KV head, chunk): the running softmax over the chunk's keys, left unnormalised for the merge
        r = tl.program_id(0)
        h = tl.program_id(1)
        c = tl.program_id(2)
        total, plen, first = _row_span(r, row0, PLEN, OLEN, FIRST, PAGED)
        lo = c * CHUNK
        hi = tl.minimum(total, lo + CHUNK)
        rows = tl.arange(0, REP_PAD)
        d = tl.arange(0, HD)
        qh = h * REP + rows
        q = tl.load(Q + r.to(tl.int64) * stride_qr + qh[:, None] * stride_qh + d[None, :], mask=rows[:, None] < REP,
                    other=0.0)
        m = tl.full([REP_PAD], float("-inf"), tl.float32)
        l = tl.zeros([REP_PAD], tl.float32)
        acc = tl.zeros([REP_PAD, HD], tl.float32)
        pt_row = PT + r.to(tl.int64) * stride_ptr
        for start in range(lo, hi, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            valid = n < hi
            if PAGED:
                in_prefix = n < plen
                j = tl.where(in_prefix, n, n - plen)
                col = tl.where(in_prefix, j // PAGE, prefix_cols + j // PAGE)
                page = tl.load(pt_row + col, mask=valid, other=0).to(tl.int64)
                off = page * stride_kp + (j % PAGE).to(tl.int64) * stride_kt + h * stride_kh
            else:
                off = (first + n).to(tl.int64) * stride_kt + h * stride_kh
            m, l, acc = _attend_block(q, K, V, off, valid, d, m, l, acc, scale_log2)
        part = (r.to(tl.int64) * CHUNKS + c) * NH + qh  # [row, chunk, query head]
        keep = (rows < REP) & (lo < total)
        tl.store(MPART + part, m, mask=keep)
        tl.store(LPART + part, l, mask=keep)
        tl.store(APART + part[:, None] * HD + d[None, :], acc, mask=keep[:, None])

    @triton.jit
    def _row_merge_kernel(OUT, MPART, LPART, APART, PLEN, OLEN, FIRST, stride_or, stride_oh, row0, CHUNKS,
                          NH: tl.constexpr, REP: tl.constexpr, REP_PAD: tl.constexpr,
                          HD: tl.constexpr, CHUNK: tl.constexpr, PAGED: tl.constexpr):
        # one (row, KV head): the row's chunks merged in position order, then normalised
        r = tl.program_id(0)
        h = tl.program_id(1)
        total, plen, first = _row_span(r, row0, PLEN, OLEN, FIRST, PAGED)
        rows = tl.arange(0, REP_PAD)
        d = tl.arange(0, HD)
        qh = h * REP + rows
        mask = rows < REP
        m = tl.full([REP_PAD], float("-inf"), tl.float32)
        l = tl.zeros([REP_PAD], tl.float32)
        acc = tl.zeros([REP_PAD, HD], tl.float32)
        for c in range(0, tl.cdiv(total, CHUNK)):
            part = (r.to(tl.int64) * CHUNKS + c) * NH + qh
            m_c = tl.load(MPART + part, mask=mask, other=0.0)
            l_c = tl.load(LPART + part, mask=mask, other=0.0)
            a_c = tl.load(APART + part[:, None] * HD + d[None, :], mask=mask[:, None], other=0.0)
            m_new = tl.maximum(m, m_c)
            alpha = tl.exp2(m - m_new)
            beta = tl.exp2(m_c - m_new)
            l = l * alpha + l_c * beta
            acc = acc * alpha[:, None] + a_c * beta[:, None]
            m = m_new
        out = acc / l[:, None]
        tl.store(OUT + r.to(tl.int64) * stride_or + qh[:, None] * stride_oh + d[None, :],
                 out.to(OUT.dtype.element_ty), mask=mask[:, None])


def row_attention_fits(q: torch.Tensor) -> bool:
    """The kernel serves q: a CUDA tensor, Triton installed, a head dimension it tiles whole (a power of two, >= 16 for
    the tensor-core dot). Both sides ask this of the same model, so both take one path."""
    hd = q.shape[-1]
    return q.is_cuda and triton_available() and hd >= 16 and hd & (hd - 1) == 0


def _launch(q, k, v, table, plen, olen, first, stride_kp, stride_kt, stride_kh, prefix_cols, page, scale, paged,
            max_keys: int):
    """Rows of q in launches of at most what SCRATCH_BYTES holds of partial results (the decode's: one launch), each
    a chunk pass over (row, KV head, chunk) and a merge over (row, KV head). `max_keys`: no row has more keys."""
    rows, nh, hd = q.shape
    nkv = k.shape[-2]
    rep = nh // nkv
    q = q if q.stride(-1) == 1 else q.contiguous()
    out = torch.empty(rows, nh, hd, dtype=q.dtype, device=q.device)
    chunks = max(1, -(-max_keys // KEY_CHUNK))
    step = max(1, rows if paged else SCRATCH_BYTES // (chunks * nh * (hd + 2) * 4))
    consts = dict(NH=nh, REP=rep, REP_PAD=max(16, triton.next_power_of_2(rep)), HD=hd,
                  CHUNK=KEY_CHUNK, PAGED=paged)
    for row0 in range(0, rows, step):  # the paged mode: row0 = 0, all rows (its grid is a CUDA graph's)
        part = slice(row0, min(rows, row0 + step))
        n = part.stop - row0
        mpart, lpart = (torch.empty(n, chunks, nh, dtype=torch.float32, device=q.device) for _ in range(2))
        apart = torch.empty(n, chunks, nh, hd, dtype=torch.float32, device=q.device)
        qs, os_ = q[part], out[part]
        _row_chunk_kernel[(n, nkv, chunks)](
            qs, k, v, mpart, lpart, apart, table[part] if paged else table, plen[part], olen[part], first[part],
            qs.stride(0), qs.stride(1), stride_kp, stride_kt, stride_kh, table.stride(0), int(prefix_cols),
            float(scale) * 1.4426950408889634, row0, chunks, BLOCK_N=KEY_BLOCK, PAGE=page, num_warps=_WARPS,
            num_stages=_STAGES, **consts)
        _row_merge_kernel[(n, nkv)](os_, mpart, lpart, apart, plen[part], olen[part], first[part], os_.stride(0),
                                    os_.stride(1), row0, chunks, num_warps=_WARPS, **consts)
    return out


def paged_row_attention(q, k_pool, v_pool, page_table, prefix_len, own_len, prefix_cols: int, scale: float):
    """`reference_paged_decode_attention`'s arguments and result (q [B, nh, hd]; pools [pages, page_size, nkv, hd];
    page_table [B, cols], its first `prefix_cols` columns the row's prompt pages; prefix_len/own_len [B]). No host
    sync: the chunk grid is the table's width."""
    assert k_pool.stride() == v_pool.stride() and k_pool.stride(-1) == 1 and page_table.stride(-1) == 1
    return _launch(q, k_pool, v_pool, page_table, prefix_len, own_len, prefix_len, k_pool.stride(0), k_pool.stride(1),
                   k_pool.stride(2), prefix_cols, k_pool.shape[1], scale, True, page_table.shape[1] * k_pool.shape[1])


def sequence_row_attention(q, k, v, scale: float, cu_seqlens: torch.Tensor | None = None, longest: int | None = None):
    """Causal attention of contiguous sequences: q [n, nh, hd], k/v [n, nkv, hd], packed by `cu_seqlens` ([S + 1],
    from 0 to n; None: one sequence). Row i of a sequence attends to that sequence's positions [0, i]. `longest`: the
    longest sequence's length where the caller knows it (else read from `cu_seqlens`: a host sync)."""
    n = q.shape[0]
    if cu_seqlens is None:
        first, longest = torch.zeros(n, dtype=torch.long, device=q.device), n
    else:  # each row's sequence's first row, on the device; the longest sequence sizes the chunk grid
        cu = cu_seqlens.long()
        first = cu[torch.searchsorted(cu, torch.arange(n, device=q.device), right=True) - 1]
        if longest is None:
            longest = int((cu[1:] - cu[:-1]).max()) if n else 0
    if k.stride() != v.stride() or k.stride(-1) != 1:  # one offset addresses a key and its value
        k, v = k.contiguous(), v.contiguous()
    return _launch(q, k, v, first[None], first, first, first, 0, k.stride(0), k.stride(1), 0, 1, scale, False,
                   longest)


__all__ = ["KEY_BLOCK", "KEY_CHUNK", "paged_row_attention", "row_attention_fits", "sequence_row_attention"]
