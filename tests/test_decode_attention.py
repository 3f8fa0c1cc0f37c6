"""The Triton decode kernel against its PyTorch reference, run by Triton's interpreter on the CPU.

The interpreter decides at import time, so the check runs in a child process with TRITON_INTERPRET=1.
Its numpy backend has no bfloat16 matmul, so the dtypes here are fp32 and fp16; bf16 is checked on the
GPU by bench/gpu_grpo.py (engine vs trainer log-probs).
"""
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")


def _check() -> None:
    import torch

    from runtime.rollout.decode_attention import decode_attention, reference_decode_attention

    torch.manual_seed(0)
    slots, s_len, nkv, hd, nh, region = 6, 80, 2, 16, 4, 24
    # rows: two share prefix slot 0; a full prefix; no prefix (an idle row); one prompt token; a long response
    pslot = torch.tensor([0, 0, 3, 5, 1])
    plen = torch.tensor([10, 10, 24, 0, 1])
    own = torch.tensor([1, 40, 56, 1, 7])
    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2e-3)):
        k = torch.randn(slots, s_len, nkv, hd).to(dtype)
        v = torch.randn_like(k)
        q = torch.randn(5, nh, hd).to(dtype)
        ref = reference_decode_attention(q.float(), k.float(), v.float(), pslot, plen, own, region, hd ** -0.5)
        for split_tokens in (16, 32, 80):  # 16: five splits, most of them past the short rows' length
            out = decode_attention(q, k, v, pslot, plen, own, region, hd ** -0.5, split_tokens=split_tokens, block_n=16)
            err = (out.float() - ref).abs().max().item()
            assert out.dtype == dtype and err < tol, (dtype, split_tokens, err)
        # the merge in blocks of 2 splits (three rounds for the longest row)
        out = decode_attention(q, k, v, pslot, plen, own, region, hd ** -0.5, split_tokens=16, block_n=16, merge_block=2)
        assert (out.float() - ref).abs().max().item() < tol
        # the region past own_len and the prefix past prefix_len are never read
        k2, v2 = k.clone(), v.clone()
        for b in range(5):
            k2[pslot[b], plen[b]:region] = 1e4
            v2[b, region + own[b]:] = float("nan")
        kw = dict(split_tokens=32, block_n=16)
        out2 = decode_attention(q, k2, v2, pslot, plen, own, region, hd ** -0.5, **kw)
        assert torch.equal(out2, decode_attention(q, k, v, pslot, plen, own, region, hd ** -0.5, **kw))
    # the reference is plain attention over [prompt of the prefix slot, own response]
    b = 1
    keys = torch.cat([k[pslot[b], :plen[b]], k[b, region:region + own[b]]]).float()
    vals = torch.cat([v[pslot[b], :plen[b]], v[b, region:region + own[b]]]).float()
    qh = q[b].float()
    w = torch.softmax((qh[:, None, :] * keys.repeat_interleave(2, 1).transpose(0, 1)).sum(-1) * hd ** -0.5, -1)
    direct = (w[:, :, None] * vals.repeat_interleave(2, 1).transpose(0, 1)).sum(1)
    assert torch.allclose(ref[b], direct, atol=1e-5)


def test_triton_kernel_matches_the_reference():
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    _check()
