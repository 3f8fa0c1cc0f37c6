"""Does the compiled RMSNorm give the same bits in every process, whatever shape it met first? (issue 37)

Why: on 2 x H200 (2026-11-26) a `grpoflow run` whose engine actor was killed mid-rollout resumed to final weights
bitwise equal to the unbroken run's, but two optimizer tensors (Adam's moments of Qwen3's k_layernorm weight) were
1 ulp off. The norm is compiled with dynamic shapes, and Inductor sizes a dynamic kernel from the shapes it is first
traced on (the weight gradient's split reduction over rows: torch/_inductor/ir.py ``num_splits``, from the size
hint; the block configs). The unbroken trainer first normed rollout 0's first micro-batch, the rebuilt one rollout
1's: a suspect for the weight gradient summed in another order.

Each case is a fresh process with its own Inductor and Triton caches (nothing another process compiled is reused)
that plays a trainer: a history of norm calls at one token count, then the same target calls as every other case
(hidden 1024 = the layer norms; hidden 128 on tokens x 8 rows = the k norm), forward without and with grad and the
backward, under the trainer's deterministic mode. Cases that differ only in their history must give the same bits.
``product`` is ``runtime.mcore.fusions.CompiledRMSNorm`` as shipped (in inductor's deterministic mode under the
trainer's); ``torch-mode`` the same compiled without inductor's deterministic mode, as before 2026-11-27, when runs
under Ray from empty caches differed in the norm weights' gradients; ``-busy`` with matmuls running on another stream
while it compiles and times its candidate configs, as a colocated engine's might. ``across_all_cases`` compares every
case of a mode, busy or not, whatever its history. Each case also
lists the Triton kernels Inductor made, how many configs each had to choose from (more than one: chosen by timing)
and the one it launches. Timings: each target call's forward + backward, median of 20 (CUDA events).

Found on an H100 (torch 2.11, 2026-11-26, results/norm_history_NVIDIA_H100_80GB_HBM3_2026-11-26.json, made before
the busy case and the kernel list were added): histories of 3000 and 12000 tokens give the same bits on every
target, with the same graphs and no recompile, so the first shape is not what moved the k norm's gradient at these
shapes. Pinning the size hint instead (``torch._dynamo.mark_dynamic(rows, 0, hint_override=12000)``) is no way out:
dynamo's guard check fails on the frame it just compiled ("Guard failed on the same frame it was created": an
Inductor guard taken on the hint, ``5120 <= x.size()[0]``, fails for a real 5000 rows), on torch 2.11 with Triton
and on 2.13 on CPU.

    python3 bench/norm_history.py --out $OUT     # one GPU, ~30 s
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
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HISTORIES = (3000, 12000)          # token counts of the first micro-batch a trainer process meets
TARGETS = (5000, 9216, 17000)      # the calls every case makes afterwards, compared bit for bit
VARIANTS = ("product", "product-busy", "torch-mode", "torch-mode-busy")


def norm_in_torch_mode_only() -> None:
    """This process's trainer norm compiled as before ``train.deterministic`` put it in inductor's deterministic mode:
    torch's deterministic mode alone (a bench variant: the product's compile, without its options)."""
    import torch
    compile_ = torch.compile

    def compile_without_options(fn=None, **kw):
        if getattr(fn, "__name__", "") == "rms_norm_deterministic":
            kw.pop("options", None)
        return compile_(fn, **kw)
    torch.compile = compile_without_options


def child(variant: str, history: int, out: str) -> None:
    import torch
    from torch._dynamo.utils import counters

    from runtime.mcore import fusions as mf
    from runtime.mcore.determinism import deterministic_kernels, fix_cublas_workspace, strict_if_deterministic

    fix_cublas_workspace()
    if variant.startswith("torch-mode"):
        norm_in_torch_mode_only()
    norms = {h: mf.CompiledRMSNorm(h, eps=1e-6, device="cuda", dtype=torch.bfloat16) for h in (1024, 128)}
    for h, n in norms.items():
        with torch.no_grad():
            n.weight.copy_(1 + 0.1 * torch.randn(h, generator=torch.Generator().manual_seed(h)).bfloat16())

    def step(tokens: int, timed: bool = False):
        res = {}
        for h, rows in ((1024, (tokens, 1, 1024)), (128, (tokens, 1, 8, 128))):
            g = torch.Generator(device="cuda").manual_seed(tokens * 7 + h)
            x = (torch.randn(*rows, device="cuda", generator=g) * 2).bfloat16().requires_grad_()
            gy = torch.randn(*rows, device="cuda", generator=g).bfloat16()
            norm = norms[h]
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
            res[h] = {"sha": digest.hexdigest()[:16]}
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
                res[h]["fwd_bwd_ms"] = round(ms[len(ms) // 2], 4)
        return res

    stop = threading.Event()
    if variant.endswith("-busy"):  # another GPU user while Inductor times its candidate configs (the colocated engine)
        def busy():
            a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
            with torch.cuda.stream(torch.cuda.Stream()):
                while not stop.is_set():
                    a @ a
        threading.Thread(target=busy, daemon=True).start()
    step(history)
    stop.set()
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
        same = {f"{t}/{h}": len({r["targets"][str(t)][str(h)]["sha"] for r in mine}) == 1
                for t in TARGETS for h in (1024, 128)}
        ms = {f"{t}/{h}": [r["targets"][str(t)][str(h)]["fwd_bwd_ms"] for r in mine]
              for t in TARGETS for h in (1024, 128)}
        kernels = [{(k["kernel"], k["kind"], k["configs"], k["launched"]) for k in r["kernels"]} for r in mine]
        rows.append({"variant": v, "same_kernels_whatever_the_history": kernels[0] == kernels[1],
                     "kernels": [list(map(list, sorted(k))) for k in kernels],
                     "same_bits_whatever_the_history": same, "all_same": all(same.values()),
                     "fwd_bwd_ms_by_history": ms, "graphs": [r["graphs"] for r in mine],
                     "recompiles": [r["recompiles"] for r in mine], "norm_error": [r["norm_error"] for r in mine]})
    across = {}  # per mode: every case of it, busy or not, whatever its history
    for mode in ("product", "torch-mode"):
        ok = [r for r in results if "error" not in r and r["variant"].startswith(mode)]
        across[mode] = {"same_bits": all(len({r["targets"][str(t)][str(h)]["sha"] for r in ok}) == 1
                                         for t in TARGETS for h in (1024, 128)),
                        "same_kernels": len({frozenset((k["kernel"], k["configs"], k["launched"]) for k in r["kernels"])
                                             for r in ok}) == 1, "cases": len(ok)}
    first = next((r for r in results if "torch" in r), {})
    now = datetime.datetime.now(datetime.timezone.utc)
    summary = {"benchmark": "norm_history", "date": now.strftime("%Y-%m-%dT%H:%M:%SZ"),
               "device": first.get("gpu", "?"), "torch": first.get("torch", "?"), "histories": HISTORIES,
               "targets": TARGETS, "rows": rows, "across_all_cases": across}
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
    for mode, c in across.items():
        print(f"  {mode}: every case (busy or not, either history): same bits {c['same_bits']}, "
              f"same kernels {c['same_kernels']} ({c['cases']} cases)")
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
