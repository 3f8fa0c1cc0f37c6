"""One layer's four projections at a decode step's rows: bf16 against the FP8 matmuls, one GPU (issue 59 item 2).

    python3 bench/fp8_matmul.py --out $OUT/fp8_matmul.json     # one H200, ~2-3 min (--deadline)

For each model (GLM-Z1-9B's projections of one layer: qkv, o, gate_up, down; Qwen3-0.6B's) and each row count a
decode step meets (8 to 128: the rollout's live samples), the four calls captured in one CUDA graph (as the engine
replays them) and timed over 50 replays:
  bf16            F.linear
  scaled_mm       torch._scaled_mm(x8, W8ᵀ) with rowwise scales, the input already quantised (exact / fast accum)
  scaled_mm_swap  torch._scaled_mm(W8, x8ᵀ): the weight's rows on the tile's long side, the tokens padded to 16
  swapped         runtime/kernels/fp8_matmul.py (Triton, W8 · x8ᵀ, split K) with its shipped tiles (and each
                  projection alone, `swapped_each`), and a sweep of
                  tiles and splits (GLM only; --best-out: the best per row count, for fp8_rollout.py
                  --tiles-from) to show whether the shipped ones are the best
  sgl_kernel      (--sgl-kernel) SGLang's CUTLASS FP8 GEMM, sgl_kernel.fp8_scaled_mm, from the SGLang carry: what a
                  tuned CUDA kernel reaches on the same operands and scales
and, compiled as the engine compiles them (the input's quantisation fused in): bf16, fp8_linear as shipped, and
_scaled_mm's orientation (the path before the swapped kernel). The floor: the layer's e4m3 bytes at the device's
bandwidth (--bandwidth-tbs, H200: 4.8). Every swapped call is checked against _scaled_mm on the same inputs.
"""
from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from runtime.kernels import fp8_matmul as fm  # noqa: E402
from runtime.rollout import fp8_weights  # noqa: E402
from runtime.rollout.fp8_weights import quantize_activation_rows, quantize_rows  # noqa: E402

# (out, in) of one layer's four projections
LAYERS = {"glm9b": ((4608, 4096), (4096, 4096), (27392, 4096), (4096, 13696)),
          "qwen06": ((4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072))}
ROWS = (8, 16, 32, 64, 128)


def graph_ms(calls, replays: int = 50) -> float:
    """Mean ms of one replay of a CUDA graph of `calls` (warmed up first)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            calls()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        calls()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return round(start.elapsed_time(end) / replays, 4)


def scaled_mm_path(x, w8, ws, bias=None):
    """fp8_linear before the swapped kernel: the input quantised, then _scaled_mm(x8, W8ᵀ) (`scaled_product`)."""
    xq, xs = quantize_activation_rows(x)
    out = fp8_weights.scaled_product(xq, xs, w8, ws, x.dtype)
    return (out if bias is None else out + bias).reshape(*x.shape[:-1], w8.shape[0])


def split_of(spec, rows: int, n: int, k: int, tiles, sms: int, rule=None) -> int:
    """A sweep's split: "rule" (the shipped `split_for`, or `rule`), an int (that split), or "xF" (F times the
    rule's, at most MAX_SPLIT and one BLOCK_K a part)."""
    base = (rule or fm.split_for)(rows, n, k, *tiles[:3], sms)
    if spec == "rule":
        return base
    if isinstance(spec, str) and spec.startswith("x"):
        return max(1, min(base * int(spec[1:]), fm.MAX_SPLIT, k // tiles[2]))
    return int(spec)


def candidates(rows: int, splits: bool = False):
    """(tiles, split): tiles (BLOCK_N, BLOCK_M, BLOCK_K, warps, stages) around the shipped ones, each with the
    shipped rule's split ("rule") and with none (1: no partial sums, no second kernel). `splits`: instead the shipped
    tiles and 64 or 128 weight rows, each with the rule's split and 2, 4 and 8 times it (more, smaller programs: an
    even last wave)."""
    if splits:
        bn, bm, bk, warps, stages = fm.tiles_for(rows)
        for bn_, spec in itertools.product(sorted({bn, 64, 128}), ("rule", "x2", "x4", "x8")):
            yield (bn_, bm, bk, warps, stages), spec
        return
    bms = [fm.tiles_for(rows)[1]] if rows <= 32 else [rows // 2, min(rows, 128)]
    bns = (32, 64, 128) if rows <= 64 else (64, 128)
    for bm, bn, (bk, stages), split in itertools.product(bms, bns, ((128, 5), (256, 4)), ("rule", 1)):
        if rows > 64 and bk == 256:
            continue
        for warps in ((4, 8) if bm * bn >= 128 * 64 else (4,)):
            yield (bn, bm, bk, warps, stages), split


def sgl_kernel_rows(qs, ws) -> dict:
    """SGLang's CUTLASS FP8 GEMM on the same operands: the four projections in one graph, each alone, and its largest
    difference from `_scaled_mm` (relative to the largest output); or why it could not be loaded."""
    try:
        import sgl_kernel
    except Exception as e:  # noqa: BLE001 - the SGLang carry is not installed on this machine
        return {"sgl_kernel_error": repr(e)[:200]}

    def call(xq, s, w8, w_s):  # its weight operand is [k, n] column-major: the [n, k] row-major weight transposed
        return sgl_kernel.fp8_scaled_mm(xq, w8.t(), s, w_s.reshape(-1, 1), torch.bfloat16, None)
    diffs = []
    try:
        for (xq, s), (w8, w_s) in zip(qs, ws):
            ref = torch._scaled_mm(xq, w8.t(), scale_a=s, scale_b=w_s, out_dtype=torch.float32)
            diffs.append(((call(xq, s, w8, w_s).float() - ref).abs().max() / ref.abs().max()).item())
    except Exception as e:  # noqa: BLE001 - a shape or layout it refuses is a result too
        return {"sgl_kernel_error": repr(e)[:300]}
    return {"sgl_kernel_ms": graph_ms(lambda: [call(xq, s, w8, w_s) for (xq, s), (w8, w_s) in zip(qs, ws)]),
            "sgl_kernel_each_ms": [graph_ms(lambda xq=xq, s=s, w8=w8, w_s=w_s: call(xq, s, w8, w_s))
                                   for (xq, s), (w8, w_s) in zip(qs, ws)],
            "sgl_kernel_rel_err_vs_scaled_mm": max(diffs)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(Path(os.environ.get("OUT", "/tmp")) / "fp8_matmul.json"))
    ap.add_argument("--deadline", type=float, default=200.0, help="seconds for the tile sweep, shared by the row counts")
    ap.add_argument("--bandwidth-tbs", type=float, default=4.8)
    ap.add_argument("--models", default="glm9b,qwen06")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--sweep-splits", action="store_true", help="sweep larger splits of K instead of tiles")
    ap.add_argument("--sgl-kernel", action="store_true",
                    help="also sgl_kernel.fp8_scaled_mm (SGLang's CUTLASS kernel, per-token x per-channel scales: ours) "
                         "from the SGLang carry's site (bench/sglang_carry.py install; /tmp/sglang-site on the path)")
    ap.add_argument("--rows", default=",".join(map(str, ROWS)))
    ap.add_argument("--best-out", default=None, help="also write the sweep's best (tiles, split) per row count here "
                                                     "(fp8_rollout.py --tiles-from runs the engine with them)")
    a = ap.parse_args()
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    res = {"benchmark": "fp8_matmul", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
           "device": torch.cuda.get_device_name(0), "torch": torch.__version__, "sms": sms, "models": {}}
    g = torch.Generator(device="cuda").manual_seed(0)
    lin_bf16 = torch.compile(lambda xs, ws: [F.linear(x, w) for x, w in zip(xs, ws)])
    lin_fp8 = torch.compile(lambda xs, ws: [fp8_weights.fp8_linear(x, w8, s) for x, (w8, s) in zip(xs, ws)])
    lin_sm = torch.compile(lambda xs, ws: [scaled_mm_path(x, w8, s) for x, (w8, s) in zip(xs, ws)])
    for model in a.models.split(","):
        shapes = LAYERS[model]
        wb = [torch.randn(n, k, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02 for n, k in shapes]
        ws = [quantize_rows(w) for w in wb]
        fp8_bytes = sum(n * k for n, k in shapes)
        per_rows = res["models"][model] = {}
        for m in (int(r) for r in a.rows.split(",")):
            xs = [torch.randn(m, k, device="cuda", generator=g, dtype=torch.bfloat16) for _, k in shapes]
            qs = [quantize_activation_rows(x) for x in xs]
            mp = -(-m // 16) * 16
            qpad = [(torch.cat([xq, xq.new_zeros(mp - m, xq.shape[1])]), torch.cat([s, s.new_ones(mp - m, 1)]))
                    for xq, s in qs]
            row = per_rows[m] = {"floor_ms": round(fp8_bytes / a.bandwidth_tbs / 1e9, 4)}
            row["bf16_ms"] = graph_ms(lambda: [F.linear(x, w) for x, w in zip(xs, wb)])
            for fast in (False, True):
                sfx = "_fast" if fast else ""
                row[f"scaled_mm{sfx}_ms"] = graph_ms(lambda: [
                    torch._scaled_mm(xq, w8.t(), scale_a=s, scale_b=w_s, out_dtype=torch.bfloat16,
                                     use_fast_accum=fast) for (xq, s), (w8, w_s) in zip(qs, ws)])
                row[f"scaled_mm_swap{sfx}_ms"] = graph_ms(lambda: [
                    torch._scaled_mm(w8, xq.t(), scale_a=w_s.t(), scale_b=s.t(), out_dtype=torch.bfloat16,
                                     use_fast_accum=fast) for (xq, s), (w8, w_s) in zip(qpad, ws)])
            flat = [(xq, s.reshape(-1)) for xq, s in qs]
            row["swapped_ms"] = graph_ms(lambda: [fm.swapped_scaled_mm(xq, s, w8, w_s.reshape(-1), None,
                                                                       torch.bfloat16)
                                                  for (xq, s), (w8, w_s) in zip(flat, ws)])
            row["swapped_each_ms"] = [graph_ms(lambda xq=xq, s=s, w8=w8, w_s=w_s: fm.swapped_scaled_mm(
                xq, s, w8, w_s.reshape(-1), None, torch.bfloat16)) for (xq, s), (w8, w_s) in zip(flat, ws)]
            if a.sgl_kernel:
                row.update(sgl_kernel_rows(qs, ws))
            row["shipped"] = {"tiles": list(fm.tiles_for(m)),
                              "splits": [fm.split_for(m, n, k, *fm.tiles_for(m)[:3], sms) for n, k in shapes]}
            diffs = []
            for (xq, s), (w8, w_s) in zip(qs, ws):
                ref = torch._scaled_mm(xq, w8.t(), scale_a=s, scale_b=w_s, out_dtype=torch.float32)
                got = fm.swapped_scaled_mm(xq, s.reshape(-1), w8, w_s.reshape(-1), None, torch.float32)
                diffs.append(((got - ref).abs().max() / ref.abs().max()).item())
            row["swapped_rel_err_vs_scaled_mm"] = max(diffs)
            row["compiled_bf16_ms"] = graph_ms(lambda: lin_bf16(xs, wb))
            row["compiled_fp8_linear_ms"] = graph_ms(lambda: lin_fp8(xs, ws))
            row["compiled_scaled_mm_path_ms"] = graph_ms(lambda: lin_sm(xs, ws))
            if not a.no_sweep and model == "glm9b":
                row["sweep"] = []
                row_end = time.monotonic() + a.deadline / len(a.rows.split(","))
                for tiles, split in candidates(m, a.sweep_splits):
                    if time.monotonic() > row_end:
                        row["sweep_cut"] = "deadline"
                        break
                    outs = [torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for n, _ in shapes]

                    def calls(tiles=tiles, split=split):
                        for (xq, s), (w8, w_s), o in zip(flat, ws, outs):
                            n, k = w8.shape
                            fm.launch(xq, s, w8, w_s.reshape(-1), None, o, tiles, split_of(split, m, n, k, tiles, sms))
                    try:
                        row["sweep"].append({"tiles": list(tiles), "split": split, "ms": graph_ms(calls)})
                    except Exception as e:  # noqa: BLE001 - a tile that does not compile is a row
                        row["sweep"].append({"tiles": list(tiles), "split": split, "error": repr(e)[:200]})
                timed = [t for t in row["sweep"] if "ms" in t]
                if timed:
                    row["sweep_best"] = min(timed, key=lambda t: t["ms"])
            print(f"{model:<7} rows {m:>4}: " + "  ".join(f"{k[:-3]} {v:.3f}" for k, v in row.items()
                                                         if k.endswith("_ms") and not isinstance(v, list))
                  + f"  best {row.get('sweep_best', {}).get('ms', '-')} {row.get('sweep_best', {}).get('tiles', '')}"
                  + f"  err {row['swapped_rel_err_vs_scaled_mm']:.1e}", flush=True)
            out.write_text(json.dumps(res, indent=1))
    out.write_text(json.dumps(res, indent=1))
    if a.best_out:
        best = {m: r["sweep_best"] for m, r in res["models"].get("glm9b", {}).items() if "sweep_best" in r}
        Path(a.best_out).write_text(json.dumps(best, indent=1))
    print(f"written {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
