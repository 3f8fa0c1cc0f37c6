"""One batch-invariant set of kernels for the engine and the trainer (``rollout.true_on_policy``, issue 61).

A row's bits must not depend on how many rows came with it, nor on which side computes it: the engine's decode
step (the live rows), its prefill (packed prompts, a preempted sample's recompute) and the trainer's forward (one
sequence, or several packed) all call these, in plain PyTorch but for the attention and the RMS norm on CUDA.
Every call a kernel's configuration may follow runs on rows in blocks of `FIXED_ROWS` (the last block padded): one
shape, one configuration (cuBLAS picks a GEMM kernel by the row count, torch's reductions lay out their work by the
number of outputs). On CUDA the RMS norm is one Triton kernel, one program per row (runtime/kernels/row_norm.py):
its bits follow the width alone, no blocks needed. The attention of a query row runs over its positions [0, i] in
key blocks from 0 under a running fp32 softmax, a row decoded from the pages, recomputed in a prefill and scored by
the trainer the same sum in the same order: on CUDA by one Triton kernel, one program per row and KV head
(runtime/kernels/row_attention.py); elsewhere in PyTorch, in blocks of `REFERENCE_BLOCK` as the engine's paged
decode reference (runtime/rollout/decode_attention.py).

Where a class of kernel is row-local and the two sides rounded differently, both take one form: the RMS norm is
the trainer's (fp32 inside, the weight multiplied in fp32, one cast; HF's rounds before the weight), a linear's
bias is added to the rounded GEMM output (megatron's), and the sampled token's log-prob is the trainer's
logsumexp form (runtime/trainer/logprobs.py `_fwd_math`). The bench that attributed the gap
(bench/logp_gap_attribution.py) imports these. Autograd runs through all of them (the trainer trains through its
forward; the backward's bits need match nothing).
"""
from __future__ import annotations

import torch

from runtime.kernels.row_attention import paged_row_attention, row_attention_fits, sequence_row_attention
from runtime.kernels.row_norm import row_norm_fits, row_rms_norm

FIXED_ROWS = 64  # rows per call of every kernel whose configuration may follow the row count
REFERENCE_BLOCK = 256  # positions per step of the attention's running softmax (the decode reference's)


def fixed_shape_mm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ w[N, K].T (+ b): rows in blocks of FIXED_ROWS (the last block zero-padded), one GEMM per block, so
    every call on a weight has one shape and cuBLAS one kernel. The bias is added after the GEMM in the output
    dtype, as megatron's linear does."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()  # one leading dimension on both sides: cuBLAS picks by it too
    n = rows.shape[0]
    pad = (-n) % FIXED_ROWS
    if pad:
        rows = torch.cat([rows, rows.new_zeros(pad, rows.shape[1])])
    wt = w.t()
    out = torch.cat([torch.mm(block, wt) for block in rows.split(FIXED_ROWS)])  # views: autograd cats the grads
    out = (out.split(n)[0] if pad else out).view(*x.shape[:-1], w.shape[0])
    return out if b is None else out + b


def rope_inv_freq(base: float, dim: int) -> torch.Tensor:
    """RoPE's inverse frequencies [dim / 2], fp32, computed on the host (HF's and megatron's expression; megatron
    computes it on the GPU, where `pow` may round another way): both sides take this one table."""
    return 1.0 / (float(base) ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))


def fixed_shape_addmm(out: torch.Tensor, h: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """``out + scale * h b^T`` (a LoRA adapter's up-projection added to its linear's output, one rounding:
    runtime/models/base.py `add_lora_up`) with rows in blocks of FIXED_ROWS, one addmm per block. Not in place."""
    rows, acc = h.reshape(-1, h.shape[-1]), out.reshape(-1, out.shape[-1])
    n = rows.shape[0]
    pad = (-n) % FIXED_ROWS
    if pad:
        rows = torch.cat([rows, rows.new_zeros(pad, rows.shape[1])])
        acc = torch.cat([acc, acc.new_zeros(pad, acc.shape[1])])
    bt = b.t()
    res = torch.cat([torch.addmm(a, r, bt, alpha=scale) for a, r in zip(acc.split(FIXED_ROWS), rows.split(FIXED_ROWS))])
    return (res.split(n)[0] if pad else res).view(out.shape)


def fixed_rows(fn, x: torch.Tensor, *per_row: torch.Tensor) -> tuple:
    """fn(x_block, *per_row_blocks) -> tuple of per-row tensors (or None), on rows in blocks of FIXED_ROWS (the last
    block padded with copies of row 0), each block contiguous: every call of `fn` has one shape and layout, whatever
    the row count. Blocks are `split`'s views (a gather or a slice would cost autograd a full-size gradient per
    block)."""
    outs = []
    for blocks in zip(*(t.split(FIXED_ROWS) for t in (x, *per_row))):
        rows = blocks[0].shape[0]
        pad = FIXED_ROWS - rows
        if pad:
            blocks = [torch.cat([b, t[:1].expand(pad, *t.shape[1:])]) for b, t in zip(blocks, (x, *per_row))]
        r = fn(*(b.contiguous() for b in blocks))
        outs.append(tuple(t[:rows] if t is not None else None for t in r))
    return tuple(torch.cat(ts) if ts[0] is not None else None for ts in zip(*outs))


def _rms_rows(x: torch.Tensor, w: torch.Tensor, eps: float) -> tuple:
    xf = x.float()
    return ((xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)) * w.float()).to(x.dtype),


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS norm over the last dimension, the trainer's rounding (fp32 inside, weight in fp32, one cast). On CUDA the
    Triton kernel (`row_norm.row_rms_norm`: one program per row, the PyTorch form's gradient); elsewhere rows in
    fixed blocks."""
    flat = x.reshape(-1, x.shape[-1])
    if row_norm_fits(flat):
        return row_rms_norm(flat, w, eps).view(x.shape)
    return fixed_rows(lambda r: _rms_rows(r, w, eps), flat.contiguous())[0].view(x.shape)


def logprob_math(zb: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool = False):
    """From a block's logits to (log p(target), lse, entropy|None), all fp32: runtime/trainer/logprobs.py
    `_fwd_math`'s expressions, eager."""
    z = zb.to(torch.float32) / temperature
    lse = torch.logsumexp(z, dim=-1)
    logp = z.gather(-1, targets[:, None]).squeeze(-1) - lse
    ent = lse - (torch.exp(z - lse[:, None]) * z).sum(-1) if with_entropy else None
    return logp, lse, ent


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool = False):
    """(log p(target), lse, entropy|None) of logits [n, V] / temperature, rows in fixed blocks."""
    return fixed_rows(lambda z, t: logprob_math(z, t, temperature, with_entropy), logits, targets)


def common_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     rows: int | None = FIXED_ROWS) -> torch.Tensor:
    """Causal attention of one sequence (q [n, nh, hd], k/v [n, nkv, hd]) with every query row as the engine's
    decode computes one. On CUDA the Triton kernel (`row_attention.sequence_row_attention`). Elsewhere the decode
    reference's PyTorch: its positions [0, i] in blocks of REFERENCE_BLOCK from 0 under a running fp32 softmax, K/V
    laid out [rows, block, nkv, hd] as the reference gathers them, query rows `rows` at a time (the last block padded
    with the last row): every einsum and reduction has one shape. `rows=None`: all rows in one call (what the
    bench's first GPU run did)."""
    if row_attention_fits(q):
        return sequence_row_attention(q, k, v, scale)
    n = q.shape[0]
    if rows is None:
        return _attention_rows(q, k, v, scale, torch.arange(n, device=q.device))
    out = []
    for s in range(0, n, rows):
        idx = torch.arange(s, s + rows, device=q.device).clamp(max=n - 1)
        out.append(_attention_rows(q, k, v, scale, idx)[:min(rows, n - s)])
    return torch.cat(out)


class _TrainableAttention(torch.autograd.Function):
    """`common_attention` forward; the backward of plain causal attention (SDPA: FlashAttention's on a GPU) on the
    same inputs: the forward's bits are what must equal the engine's, the Triton kernel has no backward, and autograd
    through the PyTorch form would keep every block's [rows, block, kv heads, head dim] copies and scatter-add into
    them."""

    @staticmethod
    def forward(ctx, q, k, v, scale: float):
        ctx.save_for_backward(q, k, v)
        ctx.scale = scale
        return common_attention(q, k, v, scale)

    @staticmethod
    def backward(ctx, grad):
        q, k, v = ctx.saved_tensors
        with torch.enable_grad():
            qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
            rep = q.shape[1] // k.shape[1]
            qh, kh, vh = (t.transpose(0, 1)[None] for t in (qg, kg.repeat_interleave(rep, 1),
                                                              vg.repeat_interleave(rep, 1)))
            out = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=ctx.scale)
            dq, dk, dv = torch.autograd.grad(out[0].transpose(0, 1), (qg, kg, vg), grad)
        return dq, dk, dv, None


def trainable_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """`common_attention` of one sequence (q [n, nh, hd], k/v [n, nkv, hd]) for a forward that trains: the same
    bits, a plain causal attention's gradient."""
    return _TrainableAttention.apply(q, k, v, scale)


def _attention_rows(q, k, v, scale: float, idx):
    """The query rows `idx` of one causal sequence, each over its positions [0, idx] (see `common_attention`)."""
    block = REFERENCE_BLOCK
    n, nh, hd = q.shape
    nkv = k.shape[1]
    b = idx.shape[0]
    total = (idx + 1)[:, None]
    qf = q.index_select(0, idx).float().reshape(b, nkv, nh // nkv, hd) * scale
    m = torch.full((b, nkv, nh // nkv), float("-inf"), device=q.device)
    denom = torch.zeros_like(m)
    acc = torch.zeros(b, nkv, nh // nkv, hd, device=q.device)
    for start in range(0, int(idx.max()) + 1, block):
        j = torch.arange(start, start + block, device=q.device)[None, :]
        at = j[0].clamp(max=n - 1)
        kb = k[at][None].expand(b, block, nkv, hd).contiguous().float()
        vb = v[at][None].expand(b, block, nkv, hd).contiguous().float()
        sc = torch.einsum("bgrd,bjgd->bgrj", qf, kb).masked_fill(~(j < total)[:, None, None, :], float("-inf"))
        m_new = torch.maximum(m, sc.amax(-1))
        alpha = torch.exp(m - m_new).nan_to_num(0.0)
        p = torch.exp(sc - m_new[..., None]).nan_to_num(0.0)
        denom = denom * alpha + p.sum(-1)
        acc = acc * alpha[..., None] + torch.einsum("bgrj,bjgd->bgrd", p, vb)
        m = m_new
    return (acc / denom[..., None]).reshape(b, nh, hd).to(q.dtype)


def common_decode(q, k_pool, v_pool, table, prefix_len, own_len, prefix_cols: int, scale: float, split_tokens=None):
    """The engine's paged-attention signature. On CUDA the Triton kernel in its paged mode (`paged_row_attention`:
    a row's bits are `common_attention`'s on CUDA); elsewhere the decode reference on the live rows FIXED_ROWS at a
    time (the last block padded with copies of row 0), so its einsums and reductions have `common_attention`'s shapes
    whatever the number of live rows. No host sync (a CUDA graph can capture it); `split_tokens` is the split
    kernel's, unused: a row is never split."""
    if row_attention_fits(q):
        return paged_row_attention(q, k_pool, v_pool, table, prefix_len, own_len, prefix_cols, scale)
    from runtime.rollout.decode_attention import reference_paged_decode_attention as ref
    B = q.shape[0]
    out = []
    for s in range(0, B, FIXED_ROWS):
        idx = torch.arange(s, s + FIXED_ROWS, device=q.device)
        idx = torch.where(idx < B, idx, torch.zeros_like(idx))
        sel = lambda t: t.index_select(0, idx)  # noqa: E731
        out.append(ref(sel(q), k_pool, v_pool, sel(table), sel(prefix_len), sel(own_len), prefix_cols, scale,
                       block=REFERENCE_BLOCK)[:min(FIXED_ROWS, B - s)])
    return torch.cat(out)


def common_prefill(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, seqused_k=None):
    """The engine's prefill-attention signature (`decode_model._flash`, causal self-attention: `cu_k` is `cu_q`): each
    packed sequence as `common_attention` computes it (on CUDA all of them in one launch)."""
    assert causal, "the common attention is causal self-attention"
    if row_attention_fits(q):
        return sequence_row_attention(q, k, v, scale, cu_q, longest=int(max_q))
    cu = cu_q.tolist()
    return torch.cat([common_attention(q[s:e], k[s:e], v[s:e], scale) for s, e in zip(cu[:-1], cu[1:])])


__all__ = ["FIXED_ROWS", "REFERENCE_BLOCK", "rope_inv_freq", "fixed_shape_mm", "fixed_shape_addmm", "fixed_rows",
           "rms_norm", "logprob_math", "token_logprobs", "common_attention", "trainable_attention", "common_decode",
           "common_prefill"]
