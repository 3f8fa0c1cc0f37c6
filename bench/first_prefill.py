"""Does the built-in engine draw the same bits whatever it was asked first? (issue 37, the split layout)

Why: on two H100s (2026-11-27) a split run whose engine was rebuilt after a kill drew rollout 1 with 48 of its 96
samples apart from the unbroken run's, each from its first token on: the prompts of the rebuilt engine's first
prefill, 8 prompts of 256 tokens, 2048 tokens = nh * hd of Qwen3-0.6B. Dynamo took that token count for the
attention's width (duck sizing) and compiled the MLP piece for 2048 tokens alone; the unbroken engine, compiled on
other counts first, ran its dynamic graph, whose reductions Inductor had blocked for another size. The engine now
compiles its pieces on a shape of its own before any call (`FusedModel.settle_compiled`).

Each case is a fresh process with fresh Inductor and Triton caches and a Qwen3-0.6B-shaped random model (bf16): a
`fresh` engine whose first call is the target (that 2048-token first prefill, 64 rows, 128 new tokens), and a
`history` engine that first generates other prompts (200 tokens each), then the same target. `settled` runs the
engine as shipped, `unsettled` with `settle_compiled` switched off (as before). Compared bit for bit per variant:
the samples apart and where in them. Timed: the target again, warm, per decode step and prefill (the cost of
compiling on the settle shape instead of the first call's).

    python3 bench/first_prefill.py --out $OUT      # one GPU, ~4 min
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import engine_repeat  # dynamo's recompiles, as logged
import grad_trace  # two calls' draws compared

CASES = ("settled-fresh", "settled-history", "unsettled-fresh", "unsettled-history")
QWEN3_0_6B = dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                  head_dim=128, intermediate_size=3072, vocab_size=151936, tie_word_embeddings=True)
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=128, vocab_size=512, tie_word_embeddings=True)  # --cpu: the wiring


def run_case(case: str, out: Path, cpu: bool) -> dict:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from runtime.rollout.base import SamplingParams
    from runtime.rollout.decode_model import FusedModel
    from runtime.rollout.paged_decode import PagedDecoder
    variant, first = case.split("-")
    if variant == "unsettled":
        FusedModel.settle_compiled = lambda self, samplers=(): None
    recompiled = engine_repeat.recompiles()
    torch.manual_seed(0)
    cfg = Qwen3Config(**(TINY if cpu else QWEN3_0_6B))
    model = Qwen3ForCausalLM(cfg).to("cpu" if cpu else "cuda", torch.float32 if cpu else torch.bfloat16).eval()
    dec = PagedDecoder(model, max_rows=64, compile=True, kv_cache_gb=0.05 if cpu else None)
    g = torch.Generator().manual_seed(1)
    width = dec.nh * dec.hd  # the first prefill: 8 prompts of width / 8 tokens
    target = [torch.randint(10, cfg.vocab_size, (width // 8,), generator=g).tolist() for _ in range(8)]
    before = [torch.randint(10, cfg.vocab_size, (width // 10,), generator=g).tolist() for _ in range(8)]
    rows = [p for p in target for _ in range(8)]
    keys = torch.arange(len(rows), dtype=torch.long) * 7919 + 17
    sampling = SamplingParams(temperature=1.0, max_new_tokens=16 if cpu else 128)
    if first == "history":
        dec.generate([p for p in before for _ in range(8)], keys + 5, SamplingParams(temperature=1.0, max_new_tokens=32),
                     stop_ids=set())
    ids, lps, _ = dec.generate(rows, keys, sampling, stop_ids=set())
    first_pack = dec.stats["prefill_pack_max"]
    times = []
    sync = (lambda: None) if cpu else torch.cuda.synchronize
    for _ in range(3):  # warm: the cost of the settle shape's kernels
        sync()
        dec.generate(rows, keys, sampling, stop_ids=set())
        sync()
        st = dec.stats
        times.append((st["decode_s"] / max(st["decode_steps"], 1) * 1e3, st["prefill_s"] * 1e3))
    (out / f"{case}.json").write_text(json.dumps({"tokens": ids, "logprobs": lps}))
    return {"case": case, "first_pack_tokens": first_pack, "nh_x_hd": dec.nh * dec.hd, "recompiled": recompiled,
            "ms_per_decode_step": sorted(t[0] for t in times)[1], "prefill_ms": sorted(t[1] for t in times)[1]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or "/tmp/first_prefill")
    ap.add_argument("--cpu", action="store_true", help="tiny shapes on CPU: the wiring")
    ap.add_argument("--case", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.case:
        print("CASE", json.dumps(run_case(a.case, out, a.cpu)), flush=True)
        return 0
    import torch
    res = {}
    for case in CASES:
        with tempfile.TemporaryDirectory() as caches:  # a fresh node's compile caches
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": f"{caches}/inductor", "TRITON_CACHE_DIR": f"{caches}/triton"}
            t0 = time.time()
            p = subprocess.run([sys.executable, __file__, "--out", str(out), "--case", case] + ["--cpu"] * a.cpu, env=env,
                               capture_output=True, text=True)
            line = [x for x in p.stdout.splitlines() if x.startswith("CASE ")]
            res[case] = json.loads(line[0][5:]) if line else {"case": case, "error": p.stderr[-2000:]}
            res[case]["wall_s"] = round(time.time() - t0, 1)
            print(json.dumps(res[case])[:600], flush=True)
    dumps = {c: json.loads((out / f"{c}.json").read_text()) for c in CASES if (out / f"{c}.json").exists()}
    compare = {v: grad_trace.draws_apart(dumps[f"{v}-fresh"], dumps[f"{v}-history"]) for v in ("settled", "unsettled")
               if f"{v}-fresh" in dumps and f"{v}-history" in dumps}
    summary = {"benchmark": "first_prefill", "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
               "device": "cpu" if a.cpu else torch.cuda.get_device_name(0), "torch": torch.__version__, "cases": res,
               "fresh_vs_history": compare}
    for c in CASES:
        (out / f"{c}.json").unlink(missing_ok=True)
    (out / "first_prefill.json").write_text(json.dumps(summary, indent=1))
    print("fresh vs history:", json.dumps({v: {k: c[k] for k in ("samples", "apart", "first_apart_at")}
                                            for v, c in compare.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
