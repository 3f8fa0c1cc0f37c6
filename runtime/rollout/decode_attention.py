"""Decode attention over the paged engine's KV pool, each group's prompt pages stored once.

GRPO samples several responses per prompt. The pools (one per layer, [page, token, kv_head, head_dim])
are read through a page table per row whose first `prefix_cols` columns hold the row's prompt pages
(shared by its group: prefilled once, and read from the same addresses by neighbouring programs, so
served from L2 after the first) and the rest its own pages.

`paged_decode_attention` is a split-KV kernel in Triton: one program per (row, KV head, split) handles
all of that KV head's query heads at once (no padding of the query rows to a 128-row tile, as
FlashAttention-2's varlen kernel does), each split streams its share of the row's length, and a second
kernel merges the splits by their log-sum-exp. The caller picks the split size for the rows it has: one
split per row when many are active, many short ones when a few long rows are left. Every length is read
on the device, so the launch is the same at every step and a CUDA graph can replay it.

`cascade_decode_attention` (``rollout.cascade_attention``) computes the same attention with a group's prompt read once:
a prompt pass per line of a group table (up to `group_rows_for(rep)` rows sharing prompt pages, their query heads one
tensor-core tile), each row's own pass, and the merge of both by log-sum-exp (docs/cascade-attention.md);
`reference_cascade_decode_attention` is its PyTorch form.

`reference_paged_decode_attention` is the same function in plain PyTorch (each row's positions gathered
in order, a block at a time under a running softmax): CPU, and the check the kernel is tested against.

Neither depends on the page table's width (the engine widens it for the longest prompt and response it has
met): an engine draws the same bits whatever it generated before.
"""
from __future__ import annotations

import torch

try:  # the CPU wheel of torch comes without Triton; the engine then uses the reference
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


def triton_available() -> bool:
    return triton is not None


REFERENCE_BLOCK = 256  # positions per step of the reference's running softmax


def _running_softmax(qf, blocks):
    """qf [N, nkv, R, hd] (scaled); blocks: (k, v [N, block, nkv, hd], valid [N, block]) in position order ->
    (m, denom, acc) of the softmax over the valid positions, natural exp: m [N, nkv, R] the running maximum
    (-inf where nothing was valid), denom [N, nkv, R], acc [N, nkv, R, hd] unnormalised."""
    m = torch.full(qf.shape[:-1], float("-inf"), device=qf.device)
    denom = torch.zeros_like(m)
    acc = torch.zeros(qf.shape, device=qf.device)
    for k, v, valid in blocks:
        s = torch.einsum("bgrd,bjgd->bgrj", qf, k).masked_fill(~valid[:, None, None, :], float("-inf"))
        m_new = torch.maximum(m, s.amax(-1))
        alpha = torch.exp(m - m_new).nan_to_num(0.0)  # a row's first block: nothing held yet
        p = torch.exp(s - m_new[..., None]).nan_to_num(0.0)
        denom = denom * alpha + p.sum(-1)
        acc = acc * alpha[..., None] + torch.einsum("bgrj,bjgd->bgrd", p, v)
        m = m_new
    return m, denom, acc


def reference_paged_decode_attention(q, k_pool, v_pool, page_table, prefix_len, own_len, prefix_cols: int,
                                     scale: float, block: int = REFERENCE_BLOCK):
    """The paged cache: q [B, nh, hd]; pools [pages, page_size, nkv, hd]; page_table [B, cols] (int) whose
    columns [0, prefix_cols) hold the row's prompt pages and the rest its own pages; prefix_len/own_len [B]
    (long) -> [B, nh, hd]. Row b attends to prompt positions [0, prefix_len[b]) and own positions
    [0, own_len[b]), each read through its pages.

    Each row's positions are taken in order from the start (its own tokens right after its prompt), in
    blocks of `block` positions under a running softmax: a block past every row's length leaves the result's
    bits as they are, so how wide the table is (the engine widens it for the longest prompt and response it
    has met) changes nothing, as it changes nothing in the kernel."""
    b, nh, hd = q.shape
    page_size, nkv = k_pool.shape[1], k_pool.shape[2]
    cols = page_table.shape[1]
    k_flat, v_flat = k_pool.reshape(-1, nkv, hd), v_pool.reshape(-1, nkv, hd)
    table = page_table.long()
    plen, total = prefix_len[:, None], (prefix_len + own_len)[:, None]
    qf = q.float().reshape(b, nkv, nh // nkv, hd) * scale

    def blocks():
        for start in range(0, cols * page_size, block):
            j = torch.arange(start, start + block, device=q.device)[None, :]
            in_prefix = j < plen
            at = torch.where(in_prefix, j, (j - plen).clamp(min=0))  # the position within the prompt or the row's own
            col = torch.where(in_prefix, at // page_size, prefix_cols + at // page_size).clamp(max=cols - 1)
            slot = table.gather(1, col) * page_size + at % page_size
            yield k_flat[slot].float(), v_flat[slot].float(), j < total  # [B, block, nkv, hd]

    m, denom, acc = _running_softmax(qf, blocks())
    return (acc / denom[..., None]).reshape(b, nh, hd).to(q.dtype)


def group_rows_for(rep: int) -> int:
    """Rows of one group a cascade prompt pass takes together: 8 (a GRPO group of 8 samples), fewer where 8 rows x
    `rep` query heads per KV head would make a query tile over 64 rows (GLM-Z1-9B's 16 heads per KV head: 4)."""
    rows = 8
    while rows > 1 and rows * rep > 64:
        rows //= 2
    return rows


def reference_cascade_decode_attention(q, k_pool, v_pool, page_table, prefix_len, own_len, prefix_cols: int,
                                       groups, scale: float, block: int = REFERENCE_BLOCK):
    """:func:`reference_paged_decode_attention` (same arguments, and `groups`) in two passes merged by log-sum-exp,
    as the cascade kernel computes it. groups [G, group_rows] (int): each line the rows (-1: none) that share
    the prompt pages of its first row, which every row with a prompt (prefix_len > 0) is in once.

    The prompt pass reads a group's prompt positions [0, prefix_len) once, through its first row's page table,
    for all its rows' query heads together; the own pass reads each row's own positions [0, own_len). Each is
    a running softmax in blocks of `block` positions from its own start, so the table's width changes no bit."""
    b, nh, hd = q.shape
    page_size, nkv = k_pool.shape[1], k_pool.shape[2]
    rep = nh // nkv
    cols = page_table.shape[1]
    own_cols = cols - prefix_cols
    k_flat, v_flat = k_pool.reshape(-1, nkv, hd), v_pool.reshape(-1, nkv, hd)
    table = page_table.long()
    qf = q.float().reshape(b, nkv, rep, hd) * scale
    # the prompt pass: a group's rows x query heads of a KV head are one query tile
    g = groups.long()
    n_groups, group_rows = g.shape
    member = g >= 0
    rows = g.clamp(min=0)
    first = rows[:, 0]
    group_len = torch.where(member[:, 0], prefix_len[first], 0)[:, None]
    qg = qf[rows].permute(0, 2, 1, 3, 4).reshape(n_groups, nkv, group_rows * rep, hd)
    first_table = table[first]

    def prompt_blocks():
        for start in range(0, prefix_cols * page_size, block):
            j = torch.arange(start, start + block, device=q.device)[None, :]
            col = (j // page_size).clamp(max=prefix_cols - 1).expand(n_groups, -1)
            slot = first_table.gather(1, col) * page_size + j % page_size
            yield k_flat[slot].float(), v_flat[slot].float(), j < group_len

    gm, gd, ga = _running_softmax(qg, prompt_blocks())
    # each group's tile back to its rows; a row in no group has no prompt term (m = -inf)
    pm = torch.full((b, nkv, rep), float("-inf"), device=q.device)
    pd, pa = torch.zeros_like(pm), torch.zeros(b, nkv, rep, hd, device=q.device)
    sel, dst = member.reshape(-1), rows.reshape(-1)[member.reshape(-1)]
    for held, tile in ((pm, gm), (pd, gd)):
        held[dst] = tile.reshape(n_groups, nkv, group_rows, rep).transpose(1, 2).reshape(-1, nkv, rep)[sel]
    pa[dst] = ga.reshape(n_groups, nkv, group_rows, rep, hd).transpose(1, 2).reshape(-1, nkv, rep, hd)[sel]

    def own_blocks():
        for start in range(0, own_cols * page_size, block):
            j = torch.arange(start, start + block, device=q.device)[None, :]
            col = (prefix_cols + (j // page_size).clamp(max=own_cols - 1)).expand(b, -1)
            slot = table.gather(1, col) * page_size + j % page_size
            yield k_flat[slot].float(), v_flat[slot].float(), j < own_len[:, None]

    om, od, oa = _running_softmax(qf, own_blocks())
    # the log-sum-exp merge: each pass weighed by exp(its maximum - the larger)
    m = torch.maximum(pm, om)
    wp, wo = torch.exp(pm - m).nan_to_num(0.0), torch.exp(om - m).nan_to_num(0.0)
    out = (pa * wp[..., None] + oa * wo[..., None]) / (pd * wp + od * wo)[..., None]
    return out.reshape(b, nh, hd).to(q.dtype)


def split_tokens_for(rows: int, kv_heads: int, max_len: int, device: torch.device) -> int:
    """Tokens per split: the largest power of two (256 to 4096) that still gives about four programs per
    SM for `rows` active rows of up to `max_len` tokens. Many rows: one split per row; a few long rows:
    many short splits."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
    want = 4 * sms
    tokens = 4096
    while tokens > 256 and rows * kv_heads * -(-max_len // tokens) < want:
        tokens //= 2
    return tokens


if triton is not None:
    @triton.jit
    def _attend_block(q, K, V, off, valid, d, m, l, acc, scale_log2):
        # one block of keys and values (at offsets ``off``, ``valid`` of them) into the running softmax (m, l, acc)
        # of the query tile q: the step the plain kernel and the cascade's prompt pass share
        k = tl.load(K + off[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k)) * scale_log2
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        v = tl.load(V + off[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        return m_new, l, acc

    @triton.jit
    def _paged_split_kernel(Q, K, V, PT, PLEN, OLEN, OPART, LSE,
                            stride_qb, stride_qh, stride_kp, stride_kt, stride_kh, stride_ptb,
                            stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
                            prefix_cols, scale_log2, split_tokens,
                            REP: tl.constexpr, REP_PAD: tl.constexpr, HD: tl.constexpr, BLOCK_N: tl.constexpr,
                            PAGE: tl.constexpr, OWN_ONLY: tl.constexpr = False):
        # as _split_kernel, but every position is found through the row's page table; OWN_ONLY (the cascade's own
        # pass): the row's own positions only, its prompt read by _group_prompt_kernel
        b = tl.program_id(0)
        h = tl.program_id(1)
        sp = tl.program_id(2)
        if OWN_ONLY:
            plen = 0
        else:
            plen = tl.load(PLEN + b).to(tl.int32)
        olen = tl.load(OLEN + b).to(tl.int32)
        total = plen + olen
        lo = sp * split_tokens
        hi = tl.minimum(lo + split_tokens, total)

        rows = tl.arange(0, REP_PAD)
        d = tl.arange(0, HD)
        qh = h * REP + rows
        q = tl.load(Q + b * stride_qb + qh[:, None] * stride_qh + d[None, :], mask=rows[:, None] < REP, other=0.0)
        m = tl.full([REP_PAD], float("-inf"), tl.float32)
        l = tl.zeros([REP_PAD], tl.float32)
        acc = tl.zeros([REP_PAD, HD], tl.float32)
        pt_row = PT + b.to(tl.int64) * stride_ptb
        for start in range(lo, hi, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            valid = n < hi
            in_prefix = n < plen
            j = tl.where(in_prefix, n, n - plen)  # the position within the prompt or within the row's own tokens
            col = tl.where(in_prefix, j // PAGE, prefix_cols + j // PAGE)
            page = tl.load(pt_row + col, mask=valid, other=0).to(tl.int64)
            off = page * stride_kp + (j % PAGE).to(tl.int64) * stride_kt + h * stride_kh
            m, l, acc = _attend_block(q, K, V, off, valid, d, m, l, acc, scale_log2)
        out = acc / l[:, None]
        lse = m + tl.log2(l)
        keep = (rows < REP) & ((rows * 0 + lo) < total)
        tl.store(OPART + b * stride_ob + qh[:, None] * stride_oh + sp * stride_os + d[None, :], out,
                 mask=keep[:, None])
        tl.store(LSE + b * stride_lb + qh * stride_lh + sp, lse, mask=keep)

    @triton.jit
    def _group_prompt_kernel(Q, K, V, PT, PLEN, GROUPS, OPART, LSE,
                             stride_qb, stride_qh, stride_kp, stride_kt, stride_kh, stride_ptb, stride_g,
                             stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
                             scale_log2, split_tokens,
                             REP: tl.constexpr, GROUP_ROWS: tl.constexpr, TILE: tl.constexpr, HD: tl.constexpr,
                             BLOCK_N: tl.constexpr, PAGE: tl.constexpr):
        # the cascade's prompt pass: one program per (group, KV head, split of the prompt); the query tile is the
        # group's rows x that KV head's query heads (tile row t: row t // REP, head h * REP + t % REP), so each
        # block of the shared prompt is read once for all of them. Writes each row's (output, log-sum-exp) of
        # the split at split index sp (the own pass's splits follow at the merge's prompt_slots).
        g = tl.program_id(0)
        h = tl.program_id(1)
        sp = tl.program_id(2)
        t = tl.arange(0, TILE)
        in_tile = t < GROUP_ROWS * REP
        row = tl.load(GROUPS + g * stride_g + t // REP, mask=in_tile, other=-1)
        member = in_tile & (row >= 0)
        row = tl.maximum(row, 0).to(tl.int64)
        first = tl.load(GROUPS + g * stride_g)
        firstc = tl.maximum(first, 0)
        plen = tl.where(first >= 0, tl.load(PLEN + firstc).to(tl.int32), 0)  # an empty group line: no prompt
        lo = sp * split_tokens
        hi = tl.minimum(lo + split_tokens, plen)

        d = tl.arange(0, HD)
        qh = h * REP + t % REP
        q = tl.load(Q + row[:, None] * stride_qb + qh[:, None] * stride_qh + d[None, :], mask=member[:, None],
                    other=0.0)
        m = tl.full([TILE], float("-inf"), tl.float32)
        l = tl.zeros([TILE], tl.float32)
        acc = tl.zeros([TILE, HD], tl.float32)
        pt_row = PT + firstc.to(tl.int64) * stride_ptb  # the group's prompt pages: its first row's
        for start in range(lo, hi, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            valid = n < hi
            page = tl.load(pt_row + n // PAGE, mask=valid, other=0).to(tl.int64)
            off = page * stride_kp + (n % PAGE).to(tl.int64) * stride_kt + h * stride_kh
            m, l, acc = _attend_block(q, K, V, off, valid, d, m, l, acc, scale_log2)
        out = acc / l[:, None]
        lse = m + tl.log2(l)
        keep = member & ((t * 0 + lo) < plen)
        tl.store(OPART + row[:, None] * stride_ob + qh[:, None] * stride_oh + sp * stride_os + d[None, :], out,
                 mask=keep[:, None])
        tl.store(LSE + row * stride_lb + qh * stride_lh + sp, lse, mask=keep)

    @triton.jit
    def _merge_kernel(OPART, LSE, OUT, PLEN, OLEN, stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_b,
                      stride_h, split_tokens, prompt_slots, prompt_split_tokens, SPLIT_BLOCK: tl.constexpr,
                      HD: tl.constexpr, CASCADE: tl.constexpr = False):
        # in blocks of splits: a few long rows can have ~70 of them, too many to hold at once. CASCADE: the row's
        # prompt splits at [0, n_prompt), its own at [prompt_slots, ...), summed as one list in that order (a
        # table's width moves prompt_slots, not the order)
        b = tl.program_id(0)
        h = tl.program_id(1)
        if CASCADE:
            n_prompt = tl.cdiv(tl.load(PLEN + b).to(tl.int32), prompt_split_tokens)
            n = n_prompt + tl.cdiv(tl.load(OLEN + b).to(tl.int32), split_tokens)
            gap = prompt_slots - n_prompt
        else:
            total = tl.load(PLEN + b).to(tl.int32) + tl.load(OLEN + b).to(tl.int32)
            n = tl.cdiv(total, split_tokens)  # the splits that held part of the row
        sb = tl.arange(0, SPLIT_BLOCK)
        d = tl.arange(0, HD)
        lse_row = LSE + b * stride_lb + h * stride_lh
        m = tl.full([SPLIT_BLOCK], float("-inf"), tl.float32)
        for s0 in range(0, n, SPLIT_BLOCK):
            if CASCADE:
                slot = s0 + sb + tl.where(s0 + sb >= n_prompt, gap, 0)
            else:
                slot = s0 + sb
            m = tl.maximum(m, tl.load(lse_row + slot, mask=s0 + sb < n, other=float("-inf")))
        top = tl.max(m, 0)
        acc = tl.zeros([HD], tl.float32)
        wsum = tl.zeros([SPLIT_BLOCK], tl.float32)
        for s0 in range(0, n, SPLIT_BLOCK):
            used = s0 + sb < n
            if CASCADE:
                slot = s0 + sb + tl.where(s0 + sb >= n_prompt, gap, 0)
            else:
                slot = s0 + sb
            w = tl.exp2(tl.load(lse_row + slot, mask=used, other=float("-inf")) - top)
            o = tl.load(OPART + b * stride_ob + h * stride_oh + slot[:, None] * stride_os + d[None, :],
                        mask=used[:, None], other=0.0)
            acc += tl.sum(o * w[:, None], 0)
            wsum += w
        tl.store(OUT + b * stride_b + h * stride_h + d, (acc / tl.sum(wsum, 0)).to(OUT.dtype.element_ty))


def paged_decode_attention(q, k_pool, v_pool, page_table, prefix_len, own_len, prefix_cols: int, scale: float,
                           split_tokens: int | None = None, block_n: int = 64, num_warps: int = 4, num_stages: int = 2,
                           merge_block: int = 16):
    """The kernel version of :func:`reference_paged_decode_attention` (same arguments and result), the split
    and the merge described above. A row holds at most `page_table.shape[1] * page_size` positions. The merge
    sums a row's splits in blocks of `merge_block` whatever the table's width: a block sized from the width (as
    before 2026-11-27) would sum in another order in an engine whose table a longer prompt had widened."""
    b, nh, hd = q.shape
    page_size, nkv = k_pool.shape[1], k_pool.shape[2]
    rep = nh // nkv
    capacity = page_table.shape[1] * page_size
    if split_tokens is None:
        split_tokens = split_tokens_for(b, nkv, capacity, q.device)
    assert split_tokens % block_n == 0
    splits = -(-capacity // split_tokens)
    assert k_pool.stride() == v_pool.stride() and k_pool.stride(-1) == 1 and q.stride(-1) == 1
    assert page_table.stride(-1) == 1
    o_part = torch.empty(b, nh, splits, hd, dtype=torch.float32, device=q.device)
    lse = torch.empty(b, nh, splits, dtype=torch.float32, device=q.device)
    _paged_split_kernel[(b, nkv, splits)](
        q, k_pool, v_pool, page_table, prefix_len, own_len, o_part, lse,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), k_pool.stride(2), page_table.stride(0),
        o_part.stride(0), o_part.stride(1), o_part.stride(2), lse.stride(0), lse.stride(1),
        int(prefix_cols), float(scale) * 1.4426950408889634, int(split_tokens),
        REP=rep, REP_PAD=max(16, triton.next_power_of_2(rep)), HD=hd, BLOCK_N=block_n, PAGE=page_size,
        num_warps=num_warps, num_stages=num_stages)
    out = torch.empty(b, nh, hd, dtype=q.dtype, device=q.device)
    _merge_kernel[(b, nh)](o_part, lse, out, prefix_len, own_len, o_part.stride(0), o_part.stride(1), o_part.stride(2),
                           lse.stride(0), lse.stride(1), out.stride(0), out.stride(1), int(split_tokens), 0,
                           int(split_tokens), SPLIT_BLOCK=merge_block, HD=hd, num_warps=4)
    return out


def cascade_decode_attention(q, k_pool, v_pool, page_table, prefix_len, own_len, prefix_cols: int, groups,
                             scale: float, split_tokens: int | None = None, prompt_split_tokens: int | None = None,
                             block_n: int = 64, num_warps: int = 4, num_stages: int = 2, merge_block: int = 16,
                             group_warps: int = 4):
    """The kernel version of :func:`reference_cascade_decode_attention` (same arguments and result): the prompt
    pass (`_group_prompt_kernel`, one program per group line, KV head and split of the prompt), the own pass
    (`_paged_split_kernel` over each row's own positions) and the merge of both passes' splits by log-sum-exp.
    The own pass splits at multiples of `split_tokens` from the row's first own token, the prompt pass at multiples
    of `prompt_split_tokens` (default: the same) from the prompt's start: a few groups read their prompts in more,
    shorter splits than many rows their own tokens. Every length and the group table are read on the device: a
    CUDA graph replays it for any groups of the same shape."""
    b, nh, hd = q.shape
    page_size, nkv = k_pool.shape[1], k_pool.shape[2]
    rep = nh // nkv
    n_groups, group_rows = groups.shape
    capacity = page_table.shape[1] * page_size
    if split_tokens is None:
        split_tokens = split_tokens_for(b, nkv, capacity, q.device)
    prompt_split_tokens = prompt_split_tokens or split_tokens
    assert split_tokens % block_n == 0 and prompt_split_tokens % block_n == 0
    prompt_slots = -(-prefix_cols * page_size // prompt_split_tokens)
    own_slots = -(-(capacity - prefix_cols * page_size) // split_tokens)
    assert k_pool.stride() == v_pool.stride() and k_pool.stride(-1) == 1 and q.stride(-1) == 1
    assert page_table.stride(-1) == 1 and groups.stride(-1) == 1
    o_part = torch.empty(b, nh, prompt_slots + own_slots, hd, dtype=torch.float32, device=q.device)
    lse = torch.empty(b, nh, prompt_slots + own_slots, dtype=torch.float32, device=q.device)
    scale_log2 = float(scale) * 1.4426950408889634
    if prompt_slots and n_groups:
        _group_prompt_kernel[(n_groups, nkv, prompt_slots)](
            q, k_pool, v_pool, page_table, prefix_len, groups, o_part, lse,
            q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), k_pool.stride(2), page_table.stride(0),
            groups.stride(0), o_part.stride(0), o_part.stride(1), o_part.stride(2), lse.stride(0), lse.stride(1),
            scale_log2, int(prompt_split_tokens), REP=rep, GROUP_ROWS=group_rows,
            TILE=max(16, triton.next_power_of_2(group_rows * rep)), HD=hd, BLOCK_N=block_n, PAGE=page_size,
            num_warps=group_warps, num_stages=num_stages)
    own_part, own_lse = o_part[:, :, prompt_slots:], lse[:, :, prompt_slots:]
    _paged_split_kernel[(b, nkv, own_slots)](
        q, k_pool, v_pool, page_table, prefix_len, own_len, own_part, own_lse,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), k_pool.stride(2), page_table.stride(0),
        own_part.stride(0), own_part.stride(1), own_part.stride(2), own_lse.stride(0), own_lse.stride(1),
        int(prefix_cols), scale_log2, int(split_tokens),
        REP=rep, REP_PAD=max(16, triton.next_power_of_2(rep)), HD=hd, BLOCK_N=block_n, PAGE=page_size,
        OWN_ONLY=True, num_warps=num_warps, num_stages=num_stages)
    out = torch.empty(b, nh, hd, dtype=q.dtype, device=q.device)
    _merge_kernel[(b, nh)](o_part, lse, out, prefix_len, own_len, o_part.stride(0), o_part.stride(1), o_part.stride(2),
                           lse.stride(0), lse.stride(1), out.stride(0), out.stride(1), int(split_tokens), prompt_slots,
                           int(prompt_split_tokens), SPLIT_BLOCK=merge_block, HD=hd, CASCADE=True, num_warps=4)
    return out


__all__ = ["REFERENCE_BLOCK", "cascade_decode_attention", "group_rows_for", "paged_decode_attention",
           "reference_cascade_decode_attention", "reference_paged_decode_attention", "split_tokens_for",
           "triton_available"]
