"""The trainer's packed (varlen) causal attention kernels (runtime/mcore/varlen_attention.py: FA2 as torch
ships it, FA4's CuTe kernels where flash-attn-4 is installed), forward + backward at the recipe's packed
micro-batches (issue 17: the profile of a packed step puts 41 % of its GPU time in FA2's kernels).

    python3 bench/varlen_attention.py --kernels flash2,fa4 --out $OUT/varlen_attention.json

Shapes: Qwen3-0.6B attention (16 query heads, 8 KV heads, head dim 128, bf16); micro-batches of
samples of 1024 prompt + log-normal responses (median 1700, cap 8192) packed to a token budget.
Equality: each further kernel's output and gradients against the first one's (max |Δ|).
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import random
import time
import traceback
from pathlib import Path

import torch

import harness  # noqa: F401  (this repository importable)
from runtime.mcore.varlen_attention import KERNELS


def recipe_lengths(budget: int, rng: random.Random, prompt: int = 1024, cap: int = 8192) -> list[int]:
    out, total = [], 0
    while True:
        n = prompt + min(cap, max(16, int(rng.lognormvariate(math.log(1700), 0.8))))
        if total + n > budget and out:
            return out
        out.append(n)
        total += n


def timed(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def one_shape(lengths: list[int], impls: dict, h=16, hk=8, d=128, reps=5) -> dict:
    dev = "cuda"
    t = sum(lengths)
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32, device=dev)
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(t, h, d, device=dev, dtype=torch.bfloat16, generator=g)
    k = torch.randn(t, hk, d, device=dev, dtype=torch.bfloat16, generator=g)
    v = torch.randn(t, hk, d, device=dev, dtype=torch.bfloat16, generator=g)
    dout = torch.randn(t, h, d, device=dev, dtype=torch.bfloat16, generator=g)
    scale = d ** -0.5
    flops = sum(4 * n * n / 2 * d * h for n in lengths)  # causal fwd; bwd ≈ 2.5×
    row = {"tokens": t, "samples": len(lengths), "max_len": max(lengths)}
    ref = None
    for name, fn in impls.items():
        try:
            def fwd_bwd():
                qq, kk, vv = (x.detach().requires_grad_() for x in (q, k, v))
                out = fn(qq, kk, vv, cu, cu, max(lengths), max(lengths), scale)
                out.backward(dout)
                return out, qq.grad, kk.grad, vv.grad
            t0 = time.perf_counter()
            res = fwd_bwd()
            torch.cuda.synchronize()
            first_s = time.perf_counter() - t0
            ms_fwd = timed(lambda: fn(q, k, v, cu, cu, max(lengths), max(lengths), scale), reps)
            ms_all = timed(fwd_bwd, reps)
            r = {"first_call_s": round(first_s, 2), "fwd_ms": round(ms_fwd, 3), "fwd_bwd_ms": round(ms_all, 3),
                 "fwd_bwd_TFLOPs": round(flops * 3.5 / (ms_all / 1e3) / 1e12, 1)}
            if ref is None:
                ref = res
            else:
                r["max_abs_diff"] = {n: float((a.float() - b.float()).abs().max()) for n, a, b in
                                     zip(("out", "dq", "dk", "dv"), res, ref)}
            row[name] = r
        except Exception as e:  # a backend this torch/cuDNN lacks is a result, not a crash
            row[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}",
                         "where": traceback.format_exc().splitlines()[-6:-1]}
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budgets", default="18432,36864")
    ap.add_argument("--kernels", default="flash2", help=f"comma-separated, of {', '.join(KERNELS)}; the first "
                    "is the reference for the differences")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    impls = {name: KERNELS[name] for name in args.kernels.split(",")}
    rng = random.Random(0)
    rows = []
    for budget in [int(b) for b in args.budgets.split(",")]:
        for lengths in (recipe_lengths(budget, rng), [9216] * (budget // 9216)):
            row = one_shape(lengths, impls)
            row["budget"] = budget
            rows.append(row)
            print(json.dumps(row), flush=True)
    res = {"benchmark": "varlen_attention", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
           "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "cudnn": torch.backends.cudnn.version(), "rows": rows}
    print(f"{'budget':>7} {'samples':>7} {'max':>6} | " + " | ".join(f"{n} fwd+bwd ms" for n in impls))
    for r in rows:
        print(f"{r['budget']:>7} {r['samples']:>7} {r['max_len']:>6} | " + " | ".join(
            str(r[n].get("fwd_bwd_ms", r[n].get("error", "")[:40])) for n in impls))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
