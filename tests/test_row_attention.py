"""The batch-invariant Triton attention of rollout.true_on_policy (runtime/kernels/row_attention.py): a row decoded
from the paged pool has the bits the same row gets in a packed causal call (the engine's prefill, the trainer's
forward), alone or among many rows and sequences, and both are close to the plain-PyTorch path.

On the CPU by Triton's interpreter, which decides at import time: a child process with TRITON_INTERPRET=1 (as
tests/test_decode_attention.py); and the kernel compiled for sm_90 without a GPU, its two modes' floating-point
instructions compared. On a GPU (`-k gpu`) through the dispatch itself (`common_decode`, `common_prefill`,
`common_attention`, `trainable_attention`) at the recipe's head shape, a CUDA graph's replay included.
"""

import pytest

pytest.importorskip("triton")

from tests.triton_checks import has_nvidia_backend, interpreter_reads_loop_bounds, run_interpreted  # noqa: E402


def _case(device, dtype, nh, nkv, hd, page, plen, lens, seed=0):
    """Sequences A (no prompt), B and C (C's first `plen` positions are B's: a GRPO group's shared prompt) packed
    [A, B, C]; the pool holds A and each of B and C as the engine does (B's prompt pages shared by C's rows, then
    each sample's own pages, page ids shuffled, every slot no row reaches NaN). Decode rows: (sequence, own length)."""
    import torch
    g = torch.Generator().manual_seed(seed)
    la, lb, lc = lens
    n = la + lb + lc
    q, k, v = (torch.randn(n, h, hd, generator=g) for h in (nh, nkv, nkv))
    for t in (q, k, v):
        t[la + lb:la + lb + plen] = t[la:la + plen]  # C's prompt is B's
    start = {"A": 0, "B": la, "C": la + lb}
    pre = {"A": 0, "B": plen, "C": plen}
    length = {"A": la, "B": lb, "C": lc}
    pcols = -(-plen // page)
    own_cols = {s: -(-(length[s] - pre[s]) // page) for s in "ABC"}
    width = pcols + max(own_cols.values())
    ids = (torch.randperm(pcols + sum(own_cols.values()), generator=g) + 1).tolist()  # page 0: the null page
    kp, vp = (torch.full((len(ids) + 1, page, nkv, hd), float("nan")) for _ in range(2))
    prompt_pages, own_pages = ids[:pcols], {}
    for t in range(plen):
        kp[prompt_pages[t // page], t % page], vp[prompt_pages[t // page], t % page] = k[la + t], v[la + t]
    rest = ids[pcols:]
    for s in "ABC":
        own_pages[s], rest = rest[:own_cols[s]], rest[own_cols[s]:]
        for t in range(length[s] - pre[s]):
            at = start[s] + pre[s] + t
            kp[own_pages[s][t // page], t % page], vp[own_pages[s][t // page], t % page] = k[at], v[at]
    return dict(q=q.to(device, dtype), k=k.to(device, dtype), v=v.to(device, dtype), kp=kp.to(device, dtype),
                vp=vp.to(device, dtype), start=start, pre=pre, length=length, pcols=pcols, width=width,
                prompt_pages=prompt_pages, own_pages=own_pages, scale=hd ** -0.5,
                cu=torch.tensor([0, la, la + lb, n], dtype=torch.int32, device=device))


def _decode_args(c, picks):
    """(q rows, page_table, prefix_len, own_len) of decode rows `picks` [(sequence, own length)], and the packed rows
    that are the same queries."""
    import torch
    table = torch.zeros(len(picks), c["width"], dtype=torch.int32)
    packed = []
    for i, (s, o) in enumerate(picks):
        if c["pre"][s]:
            table[i, :c["pcols"]] = torch.tensor(c["prompt_pages"])
        table[i, c["pcols"]:c["pcols"] + len(c["own_pages"][s])] = torch.tensor(c["own_pages"][s])
        packed.append(c["start"][s] + c["pre"][s] + o - 1)
    dev = c["q"].device
    rows = torch.tensor(packed, device=dev)
    plen = torch.tensor([c["pre"][s] for s, _ in picks], device=dev)
    own = torch.tensor([o for _, o in picks], device=dev)
    return c["q"][rows], table.to(dev), plen, own, rows


def _check(c, picks, decode, packed, one_sequence, tol):
    """decode(q, kp, vp, table, plen, own, pcols, scale); packed(q, k, v, cu, scale); one_sequence(q, k, v, scale)."""
    import torch

    import torch.nn.functional as F

    from runtime.rollout.decode_attention import reference_paged_decode_attention
    q, k, v, scale = c["q"], c["k"], c["v"], c["scale"]
    full = packed(q, k, v, c["cu"], scale)
    cu = c["cu"].tolist()
    for s, e in zip(cu[:-1], cu[1:]):
        if s:  # B and C alone (from row 0): the bits they have packed after the others
            assert torch.equal(one_sequence(q[s:e], k[s:e], v[s:e], scale), full[s:e])
        rep = q.shape[1] // k.shape[1]
        qh, kh, vh = (t[s:e].float().repeat_interleave(r, 1).transpose(0, 1)[None] for t, r in ((q, 1), (k, rep),
                                                                                                (v, rep)))
        ref = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)[0].transpose(0, 1)
        err = (full[s:e].float() - ref).abs().max().item()
        assert full.dtype == q.dtype and err < tol, (q.dtype, err)
    qd, table, plen, own, rows = _decode_args(c, picks)
    args = (c["kp"], c["vp"], table, plen, own, c["pcols"], scale)
    batch = decode(qd, *args)
    assert torch.equal(batch, full[rows])  # decoded from the pages: the packed call's bits
    for i in (0, len(picks) // 2, len(picks) - 1):  # a row alone: its bits in the batch
        one = decode(qd[i:i + 1], c["kp"], c["vp"], table[i:i + 1], plen[i:i + 1], own[i:i + 1], c["pcols"], scale)
        assert torch.equal(one, batch[i:i + 1])
    many = torch.arange(len(picks), device=q.device).repeat(3).flip(0)  # three times the rows, in another order
    assert torch.equal(decode(qd[many], c["kp"], c["vp"], table[many], plen[many], own[many], c["pcols"], scale),
                       batch[many])
    kf, vf = (torch.nan_to_num(t.float()) for t in (c["kp"], c["vp"]))
    ref = reference_paged_decode_attention(qd.float(), kf, vf, table, plen, own, c["pcols"], scale)
    assert (batch.float() - ref).abs().max().item() < tol
    return full, batch


def _check_interpreted() -> None:
    """fp32 and fp16: the interpreter's bf16 dot is wrong (Triton 3.7: it multiplies the raw bits), and fp16 takes the
    same path (p rounded to the K/V dtype for the second dot). Key blocks of 16 and chunks of 32 (the module's
    constants, set here so a short sequence crosses blocks and chunks; both modes read them)."""
    import torch

    from runtime.kernels import row_attention
    from runtime.kernels.row_attention import paged_row_attention, sequence_row_attention

    row_attention.KEY_BLOCK, row_attention.KEY_CHUNK = 16, 32
    row_attention.SCRATCH_BYTES = 40 * 2 * 4 * (16 + 2) * 4  # 40 packed rows a launch: the rows cut in three
    # one, two and three key blocks, one and two chunks; B's and C's own pages of other lengths; A with no prompt
    picks = [("B", 1), ("B", 2), ("C", 1), ("B", 5), ("B", 6), ("C", 22), ("B", 34), ("A", 1), ("A", 16), ("A", 20)]
    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2e-3)):
        c = _case("cpu", dtype, nh=4, nkv=2, hd=16, page=4, plen=11, lens=(20, 45, 33))
        _check(c, picks, paged_row_attention, lambda q, k, v, cu, s: sequence_row_attention(q, k, v, s, cu),
               sequence_row_attention, tol)


@pytest.mark.skipif(not interpreter_reads_loop_bounds(), reason="Triton < 3.7: its interpreter cannot run the kernel")
def test_a_row_has_the_same_bits_decoded_from_pages_packed_or_alone():
    run_interpreted(__file__, timeout=600)


if __name__ == "__main__":  # run_interpreted's child (the repository root on its path)
    _check_interpreted()


@pytest.mark.skipif(not has_nvidia_backend(), reason="Triton without its NVIDIA backend")
@pytest.mark.parametrize("rep", [2, 16], ids=["qwen3-0.6b", "glm4-9b"])
def test_both_modes_compile_to_the_same_float_instructions(rep):
    """No GPU needed: the chunk pass and the merge compiled for an H100/H200 (sm_90, bf16, head dim 128, the query heads
    per KV head of Qwen3-0.6B and GLM-4-9B) in their paged and their sequence mode; the floating-point instructions of
    each kernel's two PTX listings (the dots, exp2, max, the sums, the casts) are the same sequence: only address
    arithmetic differs."""
    import inspect
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from runtime.kernels.row_attention import KEY_BLOCK, KEY_CHUNK, _row_chunk_kernel, _row_merge_kernel
    float_op = re.compile(r"^\s*(?:@!?%p\d+\s+)?((?:mma|fma|mul|add|sub|ex2|lg2|max|min|div|rcp|cvt|shfl|selp|neg|abs)"
                          r"\.\S*)", re.M)

    def float_ops(kernel, paged: bool) -> list[str]:
        names = list(inspect.signature(kernel.fn).parameters)
        types = {n: "i32" for n in names}
        types.update({n: "*bf16" for n in ("Q", "K", "V", "OUT")}, PT="*i32", PLEN="*i64", OLEN="*i64", FIRST="*i64",
                     MPART="*fp32", LPART="*fp32", APART="*fp32", scale_log2="fp32")
        consts = dict(NH=8 * rep, REP=rep, REP_PAD=max(16, rep), HD=128, BLOCK_N=KEY_BLOCK, CHUNK=KEY_CHUNK, PAGE=16,
                      PAGED=paged)
        consts = {n: x for n, x in consts.items() if n in names}
        types.update({n: "constexpr" for n in consts})
        src = ASTSource(fn=kernel, signature={n: types[n] for n in names},
                        constexprs={(i,): consts[n] for i, n in enumerate(names) if n in consts})
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, num_stages=2)).asm["ptx"]
        return [op for op in float_op.findall(ptx) if re.search(r"f32|bf16|f16", op) or op.startswith("shfl")]

    chunk = float_ops(_row_chunk_kernel, True)
    assert any(op.startswith("mma") for op in chunk) and any(op.startswith("ex2") for op in chunk)
    assert chunk == float_ops(_row_chunk_kernel, False)
    merge = float_ops(_row_merge_kernel, True)
    assert any(op.startswith("ex2") for op in merge) and any(op.startswith("div") for op in merge)
    assert merge == float_ops(_row_merge_kernel, False)


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="the kernel compiled for a GPU")
def test_on_a_gpu_engine_decode_prefill_and_trainer_give_a_row_the_same_bits():
    """The recipe's head shape (16 query heads over 8 KV heads of 128), a 1000-token shared prompt, own lengths to
    ~1000, 96 decode rows, through the dispatch each side binds; the decode replayed from a CUDA graph too."""
    import torch

    from runtime.kernels.batch_invariant import (common_attention, common_decode, common_prefill,
                                                 trainable_attention)
    picks = ([("B", o) for o in (1, 2, 23, 24, 25, 300, 477)] + [("C", o) for o in (1, 2, 23, 24, 25, 299, 300)]
             + [("A", o) for o in (1, 64, 65, 1200)])  # each within its sequence's own tokens (477, 300, 1200)
    picks = picks * 5  # 90 rows: more than a FIXED_ROWS block

    def packed(q, k, v, cu, scale):
        m = int((cu[1:] - cu[:-1]).max())
        return common_prefill(q, k, v, cu, cu, m, m, True, scale)

    def trainer(q, k, v, scale):  # the training forward: its bits, SDPA's gradient
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
        out = trainable_attention(qg, kg, vg, scale)
        out.float().square().sum().backward()
        assert all(t.grad is not None and t.grad.isfinite().all() for t in (qg, kg, vg))
        assert torch.equal(out.detach(), common_attention(q, k, v, scale))
        return out.detach()

    for dtype, tol in ((torch.bfloat16, 2e-2), (torch.float32, 5e-3)):  # fp32: the dots in TF32
        c = _case("cuda", dtype, nh=16, nkv=8, hd=128, page=16, plen=1000, lens=(1200, 1477, 1300))
        full, batch = _check(c, picks, common_decode, packed, trainer, tol)
        qd, table, plen, own, _ = _decode_args(c, picks)
        args = (c["kp"], c["vp"], table, plen, own, c["pcols"], c["scale"])
        out = torch.empty_like(batch)
        graph = torch.cuda.CUDAGraph()
        common_decode(qd, *args)  # compiled before the capture
        with torch.cuda.graph(graph):
            out.copy_(common_decode(qd, *args))
        graph.replay()
        assert torch.equal(out, batch)
