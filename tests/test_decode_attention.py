"""The Triton paged decode kernel against its PyTorch reference, run by Triton's interpreter on the CPU.

The interpreter decides at import time, so the check runs in a child process with TRITON_INTERPRET=1.
Its numpy backend has no bfloat16 matmul, so the dtypes here are fp32 and fp16; bf16 is checked on the
GPU by bench/rollout_bench.py and bench/gpu_grpo.py (engine vs trainer log-probs).
"""

import pytest

pytest.importorskip("triton")

from tests.triton_checks import interpreter_reads_loop_bounds, run_interpreted  # noqa: E402


def _check_paged() -> None:
    import torch

    import torch.nn.functional as F

    from runtime.rollout.decode_attention import paged_decode_attention, reference_paged_decode_attention

    torch.manual_seed(0)
    pages, page, nkv, hd, nh = 20, 4, 2, 16, 4
    prefix_cols, own_cols = 3, 6
    # rows: two share prompt pages [5, 9, 2]; a row whose prompt fills its columns; an idle row on the null
    # page; one prompt token; pages out of order
    table = torch.zeros(5, prefix_cols + own_cols, dtype=torch.int32)
    table[0, :3], table[1, :3] = torch.tensor([5, 9, 2]), torch.tensor([5, 9, 2])
    table[0, 3:4], table[1, 3:8] = torch.tensor([7]), torch.tensor([11, 3, 14, 1, 6])
    table[2, :3], table[2, 3:9] = torch.tensor([4, 8, 10]), torch.tensor([12, 13, 15, 16, 17, 18])
    table[4, :1], table[4, 3:5] = torch.tensor([19]), torch.tensor([2 - 1, 6])  # page 1 and 6 are shared own pages
    plen = torch.tensor([10, 10, 12, 0, 1])
    own = torch.tensor([1, 17, 24, 1, 7])
    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2e-3)):
        k = torch.randn(pages, page, nkv, hd).to(dtype)
        v = torch.randn_like(k)
        q = torch.randn(5, nh, hd).to(dtype)
        ref = reference_paged_decode_attention(q.float(), k.float(), v.float(), table, plen, own, prefix_cols, hd ** -0.5)
        for split_tokens in (16, 32):
            out = paged_decode_attention(q, k, v, table, plen, own, prefix_cols, hd ** -0.5, split_tokens=split_tokens,
                                         block_n=16)
            err = (out.float() - ref).abs().max().item()
            assert out.dtype == dtype and err < tol, (dtype, split_tokens, err)
        # pages not in a row's table, and positions past its lengths, are never read
        k2, v2 = k.clone(), v.clone()
        used = {(int(table[b, c]), t) for b in range(5) for c in range(prefix_cols + own_cols) for t in range(page)
                if (c < prefix_cols and c * page + t < plen[b]) or (c >= prefix_cols and (c - prefix_cols) * page + t < own[b])}
        for p in range(pages):
            for t in range(page):
                if (p, t) not in used:
                    k2[p, t], v2[p, t] = 1e4, float("nan")
        kw = dict(split_tokens=16, block_n=16)
        assert torch.equal(paged_decode_attention(q, k2, v2, table, plen, own, prefix_cols, hd ** -0.5, **kw),
                           paged_decode_attention(q, k, v, table, plen, own, prefix_cols, hd ** -0.5, **kw))
        # a wider table (the engine widens it for the longest prompt and response it has met) changes no bit:
        # 2 more prompt columns, 9 more own ones; split sizes that give 2 and 3 splits at the old width
        wide = torch.zeros(5, prefix_cols + 2 + own_cols + 9, dtype=torch.int32)
        wide[:, :prefix_cols], wide[:, prefix_cols + 2:prefix_cols + 2 + own_cols] = table[:, :prefix_cols], table[:, prefix_cols:]
        for split_tokens in (16, 32):
            kw = dict(split_tokens=split_tokens, block_n=16)
            assert torch.equal(paged_decode_attention(q, k, v, wide, plen, own, prefix_cols + 2, hd ** -0.5, **kw),
                               paged_decode_attention(q, k, v, table, plen, own, prefix_cols, hd ** -0.5, **kw))
        for block in (16, 256):  # the reference's running softmax over 3 and 5 blocks, or one
            narrow = reference_paged_decode_attention(q.float(), k.float(), v.float(), table, plen, own, prefix_cols,
                                                      hd ** -0.5, block=block)
            assert torch.equal(reference_paged_decode_attention(q.float(), k.float(), v.float(), wide, plen, own,
                                                                prefix_cols + 2, hd ** -0.5, block=block), narrow)
            assert (narrow - ref).abs().max() < 1e-6
    # the paged reference is plain attention over [the row's prompt pages, its own pages]
    b = 1
    keys = torch.cat([k[table[b, :3].long()].reshape(-1, nkv, hd)[:10], k[table[b, 3:].long()].reshape(-1, nkv, hd)[:17]])
    vals = torch.cat([v[table[b, :3].long()].reshape(-1, nkv, hd)[:10], v[table[b, 3:].long()].reshape(-1, nkv, hd)[:17]])
    keys, vals = (t.float().transpose(0, 1)[None].repeat_interleave(nh // nkv, 1) for t in (keys, vals))
    direct = F.scaled_dot_product_attention(q[b:b + 1, :, None].float(), keys, vals, scale=hd ** -0.5)[:, :, 0]
    assert torch.allclose(ref[b:b + 1], direct, atol=1e-5)


def _cascade_case(dtype):
    """Rows 0, 1, 5 share prompt pages [5, 9, 2] (10 tokens), cut into two group lines of 2 rows; row 2 its own
    prompt; row 3 idle (no prompt, one token on the null page); row 4 a 1-token prompt; an empty group line."""
    import torch
    torch.manual_seed(1)
    pages, page, nkv, hd, nh = 24, 4, 2, 16, 4
    prefix_cols, own_cols = 3, 6
    table = torch.zeros(6, prefix_cols + own_cols, dtype=torch.int32)
    for r in (0, 1, 5):
        table[r, :3] = torch.tensor([5, 9, 2])
    table[0, 3:4], table[1, 3:8], table[5, 3:5] = torch.tensor([7]), torch.tensor([11, 3, 14, 1, 6]), torch.tensor([20, 21])
    table[2, :3], table[2, 3:9] = torch.tensor([4, 8, 10]), torch.tensor([12, 13, 15, 16, 17, 18])
    table[4, :1], table[4, 3:5] = torch.tensor([19]), torch.tensor([22, 23])
    plen = torch.tensor([10, 10, 12, 0, 1, 10])
    own = torch.tensor([1, 17, 24, 1, 7, 5])
    groups = torch.tensor([[5, 0], [1, -1], [2, -1], [-1, -1], [4, -1]], dtype=torch.int32)
    k = torch.randn(pages, page, nkv, hd).to(dtype)
    return dict(q=torch.randn(6, nh, hd).to(dtype), k=k, v=torch.randn_like(k), table=table, plen=plen, own=own,
                prefix_cols=prefix_cols, groups=groups, scale=hd ** -0.5)


def _check_cascade() -> None:
    """The cascade kernel (a group's prompt read once for its rows, merged with each row's own pass by log-sum-exp)
    against its reference and the plain paged one."""
    import torch

    from runtime.rollout.decode_attention import (cascade_decode_attention, reference_cascade_decode_attention,
                                                  reference_paged_decode_attention)

    def args_of(c):
        return c["table"], c["plen"], c["own"], c["prefix_cols"], c["groups"], c["scale"]

    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2e-3)):
        c = _cascade_case(dtype)
        q, k, v = c["q"], c["k"], c["v"]
        ref = reference_cascade_decode_attention(q.float(), k.float(), v.float(), *args_of(c))
        table, plen, own, pc, groups, scale = args_of(c)
        plain = reference_paged_decode_attention(q.float(), k.float(), v.float(), table, plen, own, pc, scale)
        assert (ref - plain).abs().max() < 1e-5
        for split_tokens, prompt_split in ((16, None), (32, 16), (16, 32)):
            out = cascade_decode_attention(q, k, v, *args_of(c), split_tokens=split_tokens,
                                           prompt_split_tokens=prompt_split, block_n=16)
            err = (out.float() - ref).abs().max().item()
            assert out.dtype == dtype and err < tol, (dtype, split_tokens, prompt_split, err)
    # fp32 (the interpreter is slow): pages and positions outside a row's prompt and own lengths are never read
    kw = dict(split_tokens=32, prompt_split_tokens=16, block_n=16)
    base = cascade_decode_attention(q.float(), k.float(), v.float(), *args_of(c), **kw)
    k2, v2 = k.float(), v.float()
    used = {(int(table[b, col]), t) for b in range(6) for col in range(table.shape[1]) for t in range(4)
            if (col < pc and col * 4 + t < plen[b]) or (col >= pc and (col - pc) * 4 + t < own[b])}
    for p in range(k.shape[0]):
        for t in range(4):
            if (p, t) not in used:
                k2[p, t], v2[p, t] = 1e4, float("nan")
    assert torch.equal(cascade_decode_attention(q.float(), k2, v2, *args_of(c), **kw), base)
    # a wider table (2 more prompt columns, 9 more own ones) changes no bit, in the kernel or the reference
    wide = torch.zeros(6, table.shape[1] + 11, dtype=torch.int32)
    wide[:, :pc], wide[:, pc + 2:table.shape[1] + 2] = table[:, :pc], table[:, pc:]
    assert torch.equal(cascade_decode_attention(q.float(), k.float(), v.float(), wide, plen, own, pc + 2, groups,
                                                scale, **kw), base)
    assert torch.equal(reference_cascade_decode_attention(q.float(), k.float(), v.float(), wide, plen, own, pc + 2,
                                                          groups, scale), ref)


def test_the_cascade_reference_is_the_paged_reference():
    """On CPU without Triton's interpreter: the prompt pass per group line and the own pass per row, merged by
    log-sum-exp, are plain paged attention; a group cut into lines of any size gives the same."""
    import torch

    from runtime.rollout.decode_attention import (reference_cascade_decode_attention,
                                                  reference_paged_decode_attention)
    c = _cascade_case(torch.float32)
    args = (c["q"], c["k"], c["v"], c["table"], c["plen"], c["own"], c["prefix_cols"])
    plain = reference_paged_decode_attention(*args, c["scale"])
    one_line = torch.tensor([[0, 1, 5], [2, -1, -1], [4, -1, -1]], dtype=torch.int32)
    for groups in (c["groups"], one_line):
        for block in (8, 256):
            out = reference_cascade_decode_attention(*args, groups, c["scale"], block=block)
            assert (out - plain).abs().max() < 1e-5


@pytest.mark.skipif(not interpreter_reads_loop_bounds(), reason="Triton < 3.7: its interpreter cannot run the kernel")
def test_triton_kernel_matches_the_reference():
    run_interpreted(__file__, timeout=300)


if __name__ == "__main__":  # run_interpreted's child (the repository root on its path)
    _check_paged()
    _check_cascade()


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="the kernel's own reduction order: a GPU")
def test_on_a_gpu_a_wider_table_changes_no_bit():
    """The merge summed a row's splits in blocks sized from the table's width, so an engine whose table a longer
    prompt had widened could sum in another order than a fresh engine. Here 8 splits of the narrow table's
    capacity and 9 of the wide one's (a block of 8 against 16 before), with rows of every length up to it."""
    import torch

    from runtime.rollout.decode_attention import paged_decode_attention
    torch.manual_seed(0)
    rows, page, nkv, hd, nh, pages = 24, 16, 8, 128, 16, 1200
    narrow_cols, wide_extra, prefix_cols = 128, 16, 8  # 2048 positions, 2304
    k = torch.randn(pages, page, nkv, hd, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(rows, nh, hd, device="cuda", dtype=torch.bfloat16)
    table = torch.randint(1, pages, (rows, narrow_cols), device="cuda", dtype=torch.int32)
    plen = torch.randint(1, prefix_cols * page, (rows,), device="cuda")
    own = torch.randint(1, (narrow_cols - prefix_cols) * page, (rows,), device="cuda")
    wide = torch.zeros(rows, narrow_cols + wide_extra, device="cuda", dtype=torch.int32)
    wide[:, :prefix_cols], wide[:, prefix_cols + wide_extra:] = table[:, :prefix_cols], table[:, prefix_cols:]
    out = paged_decode_attention(q, k, v, table, plen, own, prefix_cols, hd ** -0.5, split_tokens=256)
    assert torch.equal(out, paged_decode_attention(q, k, v, wide, plen, own, prefix_cols + wide_extra, hd ** -0.5,
                                                   split_tokens=256))


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="the cascade kernel in bf16: a GPU")
def test_on_a_gpu_the_cascade_kernel_matches_the_plain_one_and_a_wider_table_changes_no_bit():
    """The recipe's shape: groups of 8 rows (16 query rows a tile), 1024-token prompts, own lengths up to 2048."""
    import torch

    from runtime.rollout.decode_attention import (cascade_decode_attention, group_rows_for, paged_decode_attention,
                                                  reference_paged_decode_attention)
    torch.manual_seed(0)
    rows, page, nkv, hd, nh, pages = 32, 16, 8, 128, 16, 8000
    prefix_cols, own_cols = 64, 129
    k = torch.randn(pages, page, nkv, hd, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(rows, nh, hd, device="cuda", dtype=torch.bfloat16)
    table = torch.randint(1, pages, (rows, prefix_cols + own_cols), device="cuda", dtype=torch.int32)
    gr = group_rows_for(nh // nkv)
    for g in range(0, rows, gr):
        table[g:g + gr, :prefix_cols] = table[g, :prefix_cols]
    plen = torch.full((rows,), 1000, device="cuda")
    own = torch.randint(1, 2048, (rows,), device="cuda")
    groups = torch.full((rows, gr), -1, device="cuda", dtype=torch.int32)
    groups[:rows // gr] = torch.arange(rows, device="cuda", dtype=torch.int32).view(-1, gr)
    ref = reference_paged_decode_attention(q.float(), k.float(), v.float(), table, plen, own, prefix_cols, hd ** -0.5)
    plain = paged_decode_attention(q, k, v, table, plen, own, prefix_cols, hd ** -0.5, split_tokens=512)
    kw = dict(split_tokens=512, prompt_split_tokens=256)
    out = cascade_decode_attention(q, k, v, table, plen, own, prefix_cols, groups, hd ** -0.5, **kw)
    assert (out.float() - ref).abs().max() <= 2 * (plain.float() - ref).abs().max() + 1e-3
    wide = torch.zeros(rows, prefix_cols + 16 + own_cols, device="cuda", dtype=torch.int32)
    wide[:, :prefix_cols], wide[:, prefix_cols + 16:] = table[:, :prefix_cols], table[:, prefix_cols:]
    assert torch.equal(out, cascade_decode_attention(q, k, v, wide, plen, own, prefix_cols + 16, groups, hd ** -0.5,
                                                     **kw))
