"""Tiles of the FP8-weight matmul (runtime/kernels/fp8_weight_matmul.py) against bf16, one GPU (issue 59 item 2).

    python3 bench/fp8_matmul_tiles.py --out $OUT/fp8_matmul_tiles.json     # one H200, ~3 min (--deadline)

For each row count a decode step meets (8, 32, 64, 128: the rollout's live samples) and each model (GLM-Z1-9B's four
projections of one layer: qkv, o, gate_up, down; Qwen3-0.6B's), the four calls captured in one CUDA graph (as the
engine replays them) and timed over 50 replays: bf16 `F.linear`, the kernel as shipped (`tiles_for`, `split_for`),
the kernel with the contiguous-dimension mask forced on (the first version's loads), and every candidate tile
(BLOCK_N, BLOCK_K, warps, stages; BLOCK_M the smallest tensor-core tile over the rows; the split by `split_for`'s
rule for that tile). Prints the best per row count and writes every timing: the evidence for `TILES`.
The weight floor: the layer's e4m3 bytes at the device's bandwidth (--bandwidth-tbs, H200: 4.8).
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

from runtime.kernels import fp8_weight_matmul as mm  # noqa: E402
from runtime.rollout.fp8_weights import quantize_rows  # noqa: E402

# (out, in) of one layer's four projections
LAYERS = {"glm9b": ((4608, 4096), (4096, 4096), (27392, 4096), (4096, 13696)),
          "qwen06": ((4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072))}
ROWS = (8, 32, 64, 128)


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
    return start.elapsed_time(end) / replays


def split_rule(m: int, n: int, k: int, bm: int, bn: int, sms: int) -> int:
    programs = -(-m // bm) * -(-n // bn)
    split = 1
    while split < mm.MAX_SPLIT and programs * split < 0.9 * sms and k // (2 * split) >= mm.MIN_K_PER_SPLIT:
        split *= 2
    return split


def candidates(m: int):
    bm = 16 if m <= 16 else 32 if m <= 32 else 64
    bks = (128, 256) if m <= 32 else (64, 128)
    warps = (4,) if m <= 32 else (4, 8)
    for bn, bk, w, st in itertools.product((32, 64, 128), bks, warps, (3, 5)):
        yield (bm, bn, bk, w, st)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(Path(os.environ.get("OUT", "/tmp")) / "fp8_matmul_tiles.json"))
    ap.add_argument("--deadline", type=float, default=240.0, help="seconds for the whole sweep")
    ap.add_argument("--bandwidth-tbs", type=float, default=4.8)
    ap.add_argument("--models", default="glm9b,qwen06")
    ap.add_argument("--splits", default="", help="instead: these splits of K forced (e.g. 1,2,4,8,16) at 8 and 32 "
                                                 "rows, with the shipped tile and the 32-wide one")
    a = ap.parse_args()
    t_end = time.monotonic() + a.deadline
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    res = {"benchmark": "fp8_matmul_tiles", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
           "device": torch.cuda.get_device_name(0), "torch": torch.__version__, "sms": sms, "models": {}}
    g = torch.Generator(device="cuda").manual_seed(0)
    for model in a.models.split(","):
        shapes = LAYERS[model]
        ws = [quantize_rows(torch.randn(n, k, device="cuda", generator=g, dtype=torch.bfloat16)) for n, k in shapes]
        wb = [torch.randn(n, k, device="cuda", generator=g, dtype=torch.bfloat16) for n, k in shapes]
        fp8_bytes = sum(n * k for n, k in shapes)
        per_rows = res["models"][model] = {}
        for m in ROWS:
            xs = [torch.randn(m, k, device="cuda", generator=g, dtype=torch.bfloat16) for _, k in shapes]
            outs = [torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for n, _ in shapes]
            row = per_rows[m] = {"floor_ms": round(fp8_bytes / a.bandwidth_tbs / 1e9, 4),
                                 "bf16_ms": round(graph_ms(lambda: [F.linear(x, w) for x, w in zip(xs, wb)]), 4),
                                 "shipped_ms": round(graph_ms(lambda: [mm.w8_linear(x, w8, s) for x, (w8, s)
                                                                       in zip(xs, ws)]), 4),
                                 "shipped_tiles": list(mm.tiles_for(m)), "tiles": []}

            def run(tiles, even_k=None):
                def calls():
                    for x, (w8, s), o in zip(xs, ws, outs):
                        n, k = w8.shape
                        split = split_rule(m, n, k, tiles[0], tiles[1], sms)
                        mm.launch_tiled(x, w8, s.reshape(-1), None, o, tiles, split, even_k=even_k)
                return round(graph_ms(calls), 4)
            if a.splits:
                if m > 32:
                    continue
                for tiles in (mm.tiles_for(m), (mm.tiles_for(m)[0], 32, 256, 4, 3)):
                    for split in (int(x) for x in a.splits.split(",")):
                        def forced():
                            for x, (w8, s), o in zip(xs, ws, outs):
                                mm.launch_tiled(x, w8, s.reshape(-1), None, o, tiles, split)
                        t = round(graph_ms(forced), 4)
                        row["tiles"].append({"tiles": list(tiles), "split": split, "ms": t})
                        print(f"{model} rows {m} tiles {tiles} split {split}: {t} ms (bf16 {row['bf16_ms']}, floor "
                              f"{row['floor_ms']})", flush=True)
                out.write_text(json.dumps(res, indent=1))
                continue
            row["masked_k_ms"] = run(mm.tiles_for(m), even_k=False)
            for tiles in candidates(m):
                if time.monotonic() > t_end:
                    row["cut"] = "deadline"
                    break
                try:
                    row["tiles"].append({"tiles": list(tiles), "ms": run(tiles)})
                except Exception as e:  # noqa: BLE001 - a tile that does not compile (shared memory) is a row
                    row["tiles"].append({"tiles": list(tiles), "error": repr(e)[:200]})
            timed = [t for t in row["tiles"] if "ms" in t]
            if timed:
                row["best"] = min(timed, key=lambda t: t["ms"])
            best = row.get("best", {})
            print(f"{model:<7} rows {m:>4}: floor {row['floor_ms']:.3f}  bf16 {row['bf16_ms']:.3f}  shipped "
                  f"{row['shipped_ms']:.3f}  masked-k {row['masked_k_ms']:.3f}  best {best.get('ms', '-')} "
                  f"{best.get('tiles', '')}  ({len(timed)} tiles)", flush=True)
            out.write_text(json.dumps(res, indent=1))
    out.write_text(json.dumps(res, indent=1))
    print(f"written {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
