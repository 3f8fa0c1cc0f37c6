"""Does the compiled RMSNorm give the same bits in every process, whatever token count compiled it? (issue 37)

Why: two `grpoflow run`s under Ray on 2 x H100 (2026-11-27), each from empty compile caches, differed at step 0 in the
gradients of 4 norm weights (Adam's moments 1.5e-9 apart at the end), while one process run twice was bitwise
(bench/engine_repeat.py's step sections). The norm is compiled with dynamic shapes, and Inductor sizes a reduction
over a dynamic dimension from the call it is compiled on: the weight gradient, summed over the tokens, is split into
a number of parts read from that token count (torch/_inductor/ir.py ``num_splits``, choices.py
``reduction_split_factor``). Its FX graph cache keys a graph by its symbols, not their values, so the two DP ranks of
a node, which share one cache and first meet different token counts, each get whichever rank's kernel was written
first; a resumed trainer on a fresh node compiles from the token count it meets first, not the unbroken run's.

Each case is a fresh process with its own Inductor and Triton caches that plays a trainer: a first call at one token
count (which compiles the norm), then the same target calls as every other case: hidden 1024 with a bf16 weight (the
layer norms), hidden 128 on tokens x 8 rows (the k norm), and hidden 1024 with an fp32 weight (``1024f``: no rounding
to bf16 hides a sum taken in another order), forward without and with grad and the backward, under the trainer's
deterministic mode. Cases that differ only in their first call must give the same bits. Variants: ``product`` (as
shipped: under ``train.deterministic`` the compiled pieces keep every token apart and torch sums the weight's
gradient, ``fusions.deterministic_norm``); ``one-graph`` (the whole norm, backward included, in one compiled graph in
inductor's deterministic mode, as shipped on 2026-11-27 before this); ``torch-mode`` (the same without inductor's
deterministic mode, as before). Each case also lists the Triton kernels Inductor made, how many configs each had to
choose from (more than one: chosen by timing) and the one it launches. Timings: each target call's forward +
backward, median of 20 (CUDA events).

What an H100 gave (the same bits whatever the first call; pinning the size hint breaks dynamo's guard check):
bench/README.md, `norm_history.py`.

    python3 bench/norm_history.py --out $OUT     # one GPU, ~90 s
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import datetime
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HISTORIES = (3000, 12000)          # token counts of the first micro-batch a trainer process meets
TARGETS = (5000, 9216, 17000)      # the calls every case makes afterwards, compared bit for bit
VARIANTS = ("product", "one-graph", "torch-mode")
NORMS = {"1024": (1024, "bfloat16"), "128": (128, "bfloat16"), "1024f": (1024, "float32")}  # hidden, weight dtype


def norm_as_one_graph(inductor_deterministic: bool) -> None:
    """This process's trainer norm, under ``train.deterministic``, compiled as one graph (its backward, the sum over
    the tokens included): in inductor's deterministic mode as shipped on 2026-11-27, or without it as before (a bench
    variant)."""
    import torch

    from runtime.mcore import fusions as mf
    options = {"options": {"deterministic": True}} if inductor_deterministic else {}
    mf._NORM["compiled"][True] = torch.compile(mf.rms_norm, dynamic=True, fullgraph=True, **options)


def child(variant: str, history: int, out: str) -> None:
    import torch
    from torch._dynamo.utils import counters

    from runtime.mcore import fusions as mf
    from runtime.mcore.determinism import deterministic_kernels, fix_cublas_workspace, strict_if_deterministic

    fix_cublas_workspace()
    if variant != "product":
        norm_as_one_graph(inductor_deterministic=variant == "one-graph")
    norms = {k: mf.CompiledRMSNorm(h, eps=1e-6, device="cuda", dtype=getattr(torch, dt)) for k, (h, dt) in NORMS.items()}
    for k, n in norms.items():
        with torch.no_grad():
            n.weight.copy_(1 + 0.1 * torch.randn(n.weight.shape[0], generator=torch.Generator().manual_seed(n.weight.shape[0])))

    def step(tokens: int, timed: bool = False):
        res = {}
        for k, (h, _) in NORMS.items():
            rows = (tokens, 1, 8, 128) if k == "128" else (tokens, 1, h)
            g = torch.Generator(device="cuda").manual_seed(tokens * 7 + h)
            x = (torch.randn(*rows, device="cuda", generator=g) * 2).bfloat16().requires_grad_()
            gy = torch.randn(*rows, device="cuda", generator=g).bfloat16()
            norm = norms[k]
            norm.weight.grad = None
            with deterministic_kernels(True):
                with torch.no_grad():
                    y0 = norm(x)           # compute_logprobs: the inference graph
                y = norm(x)
                with strict_if_deterministic():
                    y.backward(gy)
            torch.cuda.synchronize()
            digest = hashlib.sha256()
            for t in (y0, y, x.grad, norm.weight.grad):
                digest.update(t.detach().float().cpu().numpy().tobytes())
            res[k] = {"sha": digest.hexdigest()[:16]}
            if timed:
                ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(20)]
                for a, b in ev:
                    a.record()
                    with deterministic_kernels(True):
                        yy = norm(x)
                        with strict_if_deterministic():
                            yy.backward(gy)
                    b.record()
                torch.cuda.synchronize()
                ms = sorted(a.elapsed_time(b) for a, b in ev)
                res[k]["fwd_bwd_ms"] = round(ms[len(ms) // 2], 4)
        return res

    step(history)
    targets = {str(t): step(t, timed=True) for t in TARGETS}
    record = {"variant": variant, "history": history, "targets": targets, "kernels": _autotuners(),
              "graphs": dict(counters["stats"]), "recompiles": dict(counters["recompiles"]),
              "norm_error": mf._NORM["error"], "torch": torch.__version__, "gpu": torch.cuda.get_device_name()}
    Path(out).write_text(json.dumps(record))


def _autotuners() -> list:
    """Every Triton kernel Inductor made in this process: its kind, how many configs it had to choose from (more
    than one: chosen by timing them) and the one it launches."""
    import gc

    from torch._inductor.runtime.triton_heuristics import CachingAutotuner
    found = []
    for o in gc.get_objects():
        try:
            if not isinstance(o, CachingAutotuner):
                continue
        except ReferenceError:  # a weak proxy whose object is gone (seen on an H100, torch 2.11)
            continue
        launchers = getattr(o, "launchers", None) or []
        found.append({"kernel": getattr(o.fn, "__name__", "?"), "kind": str(getattr(o, "heuristic_type", "?")),
                      "configs": len(o.configs or []),
                      "launched": str(launchers[0].config) if len(launchers) == 1 else f"{len(launchers)} launchers"})
    return sorted(found, key=lambda k: k["kernel"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="/tmp/norm_history")
    ap.add_argument("--results-dir", default=None)
    ap.add_argument("--child", nargs=3, metavar=("VARIANT", "HISTORY", "FILE"))
    a = ap.parse_args(argv)
    if a.child:
        child(a.child[0], int(a.child[1]), a.child[2])
        return 0
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}

    def run(case):
        variant, history = case
        f = out / f"{variant}-{history}.json"
        with tempfile.TemporaryDirectory() as cache:
            p = subprocess.run([sys.executable, __file__, "--child", variant, str(history), str(f)],
                               env={**env, "TORCHINDUCTOR_CACHE_DIR": cache, "TRITON_CACHE_DIR": cache + "/triton"},
                               capture_output=True, text=True, timeout=500)
        if p.returncode != 0:
            return {"variant": variant, "history": history, "error": p.stderr[-2000:]}
        return json.loads(f.read_text())

    cases = [(v, h) for v in VARIANTS for h in HISTORIES]
    with cf.ThreadPoolExecutor(len(cases)) as pool:
        results = list(pool.map(run, cases))
    rows = []
    for v in VARIANTS:
        mine = [r for r in results if r["variant"] == v]
        errors = [r["error"] for r in mine if "error" in r]
        if errors:
            rows.append({"variant": v, "error": errors[0]})
            continue
        same = {f"{t}/{k}": len({r["targets"][str(t)][k]["sha"] for r in mine}) == 1 for t in TARGETS for k in NORMS}
        ms = {f"{t}/{k}": [r["targets"][str(t)][k]["fwd_bwd_ms"] for r in mine] for t in TARGETS for k in NORMS}
        kernels = [{(k["kernel"], k["kind"], k["configs"], k["launched"]) for k in r["kernels"]} for r in mine]
        rows.append({"variant": v, "same_kernels_whatever_the_history": kernels[0] == kernels[1],
                     "kernels": [list(map(list, sorted(k))) for k in kernels],
                     "same_bits_whatever_the_history": same, "all_same": all(same.values()),
                     "fwd_bwd_ms_by_history": ms, "graphs": [r["graphs"] for r in mine],
                     "recompiles": [r["recompiles"] for r in mine], "norm_error": [r["norm_error"] for r in mine]})
    first = next((r for r in results if "torch" in r), {})
    now = datetime.datetime.now(datetime.timezone.utc)
    summary = {"benchmark": "norm_history", "date": now.strftime("%Y-%m-%dT%H:%M:%SZ"),
               "device": first.get("gpu", "?"), "torch": first.get("torch", "?"), "histories": HISTORIES,
               "targets": TARGETS, "rows": rows}
    text = json.dumps(summary, indent=1)
    (out / "norm_history.json").write_text(text)
    if a.results_dir:
        name = f"norm_history_{summary['device'].replace(' ', '_')}_{summary['date'][:10]}.json"
        (Path(a.results_dir) / name).write_text(text)
    print(f"norm_history on {summary['device']}, torch {summary['torch']}")
    for r in rows:
        if "error" in r:
            print(f"  {r['variant']:12s} FAILED {r['error'][-400:]}")
            continue
        ms = " ".join(f"{k}:{'/'.join(str(x) for x in v)}" for k, v in r["fwd_bwd_ms_by_history"].items())
        print(f"  {r['variant']:12s} same kernels: {r['same_kernels_whatever_the_history']}; "
              f"kernels chosen among >1 config: {[k for ks in r['kernels'] for k in ks if k[2] > 1]}")
        print(f"  {r['variant']:12s} same bits whatever the history: {r['all_same']} "
              f"{[k for k, s in r['same_bits_whatever_the_history'].items() if not s]}  ms {ms}")
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
