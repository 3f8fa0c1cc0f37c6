"""SGLang against the built-in engine on one GPU, at the Qwen3-0.6B recipe's keyed lengths (issue 58 item 4).

    PYTHONPATH=/tmp/site:$PWD python3 bench/sglang_speed.py --sections setup,builtin,sglang --deadline 570 --out $OUT
    PYTHONPATH=/tmp/site:$PWD python3 bench/sglang_speed.py --sections sglang-capped,sglang-nondet --deadline 570 ...
    PYTHONPATH=/tmp/site:$PWD python3 bench/sglang_speed.py --sections trainer-gap --deadline 570 --out $OUT
    PYTHONPATH=/tmp/site:$PWD python3 bench/sglang_speed.py --family glm4 --sections setup,builtin,sglang ...  # GLM-Z1-9B
    python bench/sglang_speed.py --cpu     # here: tiny shapes, the built-in engine on CPU, tests/sglang_standin.py

The model: a random-init Qwen3-0.6B (runtime/models/known_configs/Qwen3-0.6B.json) in bf16 with the tiny tokenizer.
The workload is rollout_bench's realistic rollout: 32 prompts x 8 samples x 1.5 over-sampling = 384 requests of
1024-token prompts, each stopped at its keyed length (log-normal, median 1700, a tail to the cap 8192;
`rollout_bench.schedule`), so both engines make exactly the same tokens.
Sections, each a process of its own (one engine on the GPU at a time):
  setup          the model
  builtin        the built-in paged engine (rollout_bench.engine / run_schedule, its 56 GiB pool): tok/s; then the
                 log-prob gap of 16 x 256 sampled tokens against HF's teacher-forced forward in bf16
  sglang         SGLang through `SGLangEngine` (rollout.engine: sglang), deterministic mode (the default): the same
                 384 requests, each `/generate` body the client's (`generate_payload`) with the request's keyed
                 length as `max_new_tokens` and `ignore_eos` (the client's generate takes one length per call), sent
                 at once: tok/s; before it, the short measures: the log-prob gap as above, weight-sync seconds by
                 method through the client: `/update_weights_from_disk`, `/update_weights_from_tensor` (CUDA IPC
                 from this process) and, with a second GPU, the NCCL broadcast (this process rank 0 on GPU 1)
  sglang-capped  the same rollout with `rollout.sglang.concurrency` (64) requests in flight per server, as the
                 client sends them (the product's rollout)
  sglang-nondet  the same rollout without `--enable-deterministic-inference`
  sglang-sync    the deterministic server's short measures alone (log-prob gap, weight sync by `--sync-methods`),
                 no rollout: e.g. the NCCL broadcast of GLM-Z1-9B's 17.5 GiB on two GPUs
  trainer-gap    the product's path: `TrainSession` (local backend, one GPU colocated, SGLang with the memory saver) over
                 the model converted to torch_dist; one rollout and its update (pushed by the product's weight path),
                 then the log-prob gap between SGLang's samples and the megatron trainer's log-probs of them
                 (ray_pipeline.logprob_gap) and the seconds of the trainer-to-server push, `disk` and `tensor`
Results: OUT/results.jsonl (a line per section; a section cut by the deadline keeps what it measured) and
OUT/sglang_speed.json; with --results-dir a copy named by device
and date.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import subprocess
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).resolve().parent
for _p in (ROOT, BENCH):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import harness as H  # noqa: E402
import rollout_bench as rb  # noqa: E402  (the keyed schedule, its requests, the built-in engine's run)
from sglang_real import SERVER_SITE, Rank0, launch_prefix, sendable  # noqa: E402

SECTIONS = ("setup", "builtin", "sglang", "sglang-capped", "sglang-nondet", "sglang-sync", "trainer-gap")
SYNC_METHODS = ("disk", "tensor", "broadcast")
RECIPE = ROOT / "configs" / "qwen3-0.6b-dapo.yaml"
QWEN3_06B = json.loads((ROOT / "runtime" / "models" / "known_configs" / "Qwen3-0.6B.json").read_text())
STANDIN = ROOT / "tests" / "sglang_standin.py"
GAP_SAMPLES, GAP_TOKENS = 16, 256


def shapes(cpu: bool, family: str = "qwen3") -> dict:
    S = dict(rb.SHAPES["cpu" if cpu else "gpu"], family=family)
    if not cpu:  # the known config's shape (rollout_bench's gpu shape is Qwen3-0.6B's; this says where it comes from)
        c = QWEN3_06B if family == "qwen3" else json.loads(rb.GLM4_9B.read_text())
        S.update(hidden=c["hidden_size"], layers=c["num_hidden_layers"], heads=c["num_attention_heads"],
                 kv_heads=c["num_key_value_heads"], head_dim=c["head_dim"], ffn=c["intermediate_size"],
                 vocab=c["vocab_size"])
    return S


def workload(S):
    n_prompts = round(S["prompts"] * S["over_sampling"])
    return rb.requests(S, n_prompts, S["samples"], S["prompt_len"], rollout=3, seed=3), rb.schedule(S)


# ---- the log-prob gap against HF's forward ----------------------------------------------------------------

def gap_samples(S, generate) -> list:
    """16 samples of 256 tokens (their own lengths: eos may stop them) from `generate(requests, sampling)`."""
    from runtime.rollout.base import SamplingParams
    reqs = rb.requests(S, 2, 8, 128, rollout=9, seed=9)
    return generate(reqs, SamplingParams(temperature=1.0, max_new_tokens=GAP_TOKENS if S["device"] == "cuda" else 8))


def hf_gap(S, W: Path, samples) -> dict:
    import torch
    from transformers import AutoModelForCausalLM
    dtype = torch.bfloat16 if S["dtype"] == "bfloat16" else torch.float32
    hf = AutoModelForCausalLM.from_pretrained(W / "hf", dtype=dtype).to(S["device"]).eval()
    diffs = []
    with torch.no_grad():
        for r in samples:
            if not r.response_ids:
                continue
            ids = torch.tensor([r.prompt_ids + r.response_ids], device=S["device"])
            logits = hf(ids).logits[0, len(r.prompt_ids) - 1:-1].float()
            lp = torch.log_softmax(logits, -1).gather(-1, ids[0, len(r.prompt_ids):, None])[:, 0]
            diffs.append((lp - torch.tensor(r.response_logprobs, device=S["device"])).abs())
    d = torch.cat(diffs).float()
    del hf
    if S["device"] == "cuda":
        torch.cuda.empty_cache()
    return {"tokens": int(d.numel()), "mean": round(float(d.mean()), 5), "p99": round(float(d.quantile(0.99)), 5),
            "max": round(float(d.max()), 5)}


# ---- sections -------------------------------------------------------------------------------------------

def sec_setup(S, W: Path, a) -> dict:
    return {"name": "setup", **rb.make_model(S, W)}


def sec_builtin(S, W: Path, a) -> dict:
    reqs, lengths = workload(S)
    t0 = time.time()
    eng = rb.engine(S, W, "paged", S["kv_gib"], len(lengths))
    res = {"name": "builtin", "load_s": round(time.time() - t0, 1)}
    res["rollout"] = {k: v for k, v in rb.run_schedule(S, eng, lengths).items() if k != "trace"}
    samples = gap_samples(S, eng.generate)
    eng.shutdown()
    del eng
    res["logprob_gap_vs_hf"] = hf_gap(S, W, samples)
    return res


def sglang_engine(S, W: Path, a, deterministic: bool, tag: str):
    from runtime.config import SGLangSection
    from runtime.rollout.sglang.engine import SGLangEngine
    from runtime.rollout.sglang.settings import SGLangSettings
    launch = (["{python}", str(STANDIN)] if a.cpu else launch_prefix(a.site))
    section = SGLangSection(launch=launch, mem_fraction=a.mem_fraction, startup_timeout_s=600,
                            scratch_dir=str(W / f"scratch-{tag}"), deterministic=deterministic)
    return SGLangEngine(SGLangSettings(section=section, colocate=False, random_seed=1,
                                       sync_backend="nccl" if S["device"] == "cuda" else "gloo"), str(W / "hf"))


def keyed_rollout(engine, reqs, lengths: list[int], sampling, limit: int | None = None) -> dict:
    """Every request at once (or `limit` in flight), its keyed length as max_new_tokens (ignore_eos), over the
    client's own bodies."""
    import httpx

    from runtime.rollout.sglang.http_protocol import generate_payload, parse_generated
    url = engine.urls[0] + "/generate"

    async def go():
        limits = httpx.Limits(max_connections=len(reqs) + 8, max_keepalive_connections=len(reqs) + 8)
        async with httpx.AsyncClient(timeout=1800, limits=limits) as client:
            gate = asyncio.Semaphore(limit or len(reqs))

            async def one(r, n):
                body = generate_payload(r.key, r.prompt_ids, replace(sampling, max_new_tokens=n))
                body["sampling_params"]["ignore_eos"] = True
                async with gate:
                    resp = await client.post(url, json=body)
                resp.raise_for_status()
                return parse_generated(resp.json())
            return await asyncio.gather(*(one(r, n) for r, n in zip(reqs, lengths)))

    t0 = time.time()
    got = asyncio.run(go())
    s = time.time() - t0
    made = [len(g.ids) for g in got]
    ntok = sum(made)
    return {"requests": len(reqs), "in_flight": limit or len(reqs), "new_tokens": ntok, "s": round(s, 2),
            "tok_s": round(ntok / s), "exact_lengths": made == lengths}


def sec_sglang(S, W: Path, a, deterministic: bool = True, capped: bool = False, sync_only: bool = False) -> dict:
    """One server: for the deterministic one, the log-prob gap and the weight syncs first, then the keyed rollout
    (all requests at once, or `capped`: at the client's concurrency; none if `sync_only`). What is measured is kept
    as it comes (a `partial` line in results.jsonl), so a call cut by its deadline still reports it."""
    from runtime.rollout.base import SamplingParams
    tag = ("sglang-sync" if sync_only else "sglang-capped" if capped else "sglang" if deterministic
           else "sglang-nondet")
    reqs, lengths = workload(S)
    t0 = time.time()
    engine = sglang_engine(S, W, a, deterministic, tag)
    res: dict = {"name": tag, "start_s": round(time.time() - t0, 1), "deterministic": deterministic}
    keep = lambda: H.append_result(Path(a.out), {**res, "status": "partial"})  # noqa: E731
    try:
        sp = SamplingParams(temperature=1.0, max_new_tokens=S["max_new"])
        t0 = time.time()
        keyed_rollout(engine, reqs[:16], [32] * 16, sp)  # warm-up: the same requests, short
        res["warmup_s"] = round(time.time() - t0, 1)
        if deterministic and not capped:  # the short measures first
            res["logprob_gap_vs_hf"] = hf_gap(S, W, gap_samples(S, engine.generate))
            keep()
            res["weight_sync_s"] = weight_sync_times(S, W, engine, methods=a.sync_methods.split(","))
            keep()
        if sync_only:
            return res
        # capped: what the product gets, the client keeping rollout.sglang.concurrency requests in flight per server
        res["rollout"] = keyed_rollout(engine, reqs, lengths, sp,
                                       engine.settings.section.concurrency if capped else None)
        print("ROLLOUT", json.dumps(res["rollout"]), flush=True)
    finally:
        engine.shutdown()
    return res


def weight_sync_times(S, W: Path, engine, methods=SYNC_METHODS, reps: int = 3) -> dict:
    """Seconds of one update of the whole model through the client, by method (each reps times, fresh versions)."""
    import torch
    from safetensors.torch import load_file
    named = {}
    for f in sorted((W / "hf").glob("*.safetensors")):
        named.update(load_file(str(f), device=S["device"]))
    # perturbed and original weights in turn, across the methods too: every update changes what the servers serve (the
    # client's probe sees it; on 2026-11-29 each method began with the perturbed ones, and the first tensor update
    # re-sent the last disk one's: the probe warned, and that update's time stands)
    turns = [{k: (v + 0.02 * torch.randn_like(v) if v.dim() == 2 else v) for k, v in named.items()}, named]
    out: dict = {"GiB": round(sum(t.numel() * t.element_size() for t in named.values()) / 2**30, 3)}
    version = 100
    for method in [m for m in methods if m != "broadcast"]:
        engine.settings.section.weight_sync = method  # read at each update (rollout.sglang.weight_sync)
        times = []
        for i in range(reps):
            version += 1
            t0 = time.time()
            engine.update_weights(turns[(version - 101) % 2], version)
            times.append(round(time.time() - t0, 3))
        out[method] = times
    engine.settings.section.weight_sync = "disk"
    if "broadcast" in methods and S["device"] == "cuda" and torch.cuda.device_count() >= 2:
        try:
            rank0 = Rank0(engine, "cuda:1")
            out["broadcast_join_s"] = rank0.join_s
            out["broadcast"] = []
            for i in range(reps):
                version += 1
                out["broadcast"].append(rank0.push(sendable(turns[(version - 101) % 2]), version))
        except Exception:  # noqa: BLE001 - the rest of the section stands
            out["broadcast_error"] = traceback.format_exc()[-1500:]
    elif "broadcast" in methods:
        out["broadcast"] = "skipped: needs a second GPU (NCCL: one rank per GPU; the server is on GPU 0)"
    return out


def sec_trainer_gap(S, W: Path, a) -> dict:
    if S["family"] != "qwen3":  # a 9B trainer in full (160 GB with its optimizer) does not fit one GPU beside SGLang
        raise SystemExit("trainer-gap runs the 0.6B recipe on one GPU: leave out --family glm4")
    import random

    import yaml
    from transformers import AutoTokenizer

    import ray_pipeline as rp
    from runtime.config import config_from_dict
    from runtime.grpo.session import TrainSession
    cpu = S["device"] != "cuda"
    data = W / "data" / "train.jsonl"
    if not data.exists():
        data.parent.mkdir(parents=True, exist_ok=True)
        tok = AutoTokenizer.from_pretrained(W / "hf")
        rows = H.word_rows(tok, random.Random(58), 64, 256 if not cpu else 12, 264 if not cpu else 20)
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    t0 = time.time()
    inputs = rp.standalone_inputs({"prompt_len": 256 if not cpu else 12}, W)  # converted and prepared once
    convert_s = round(time.time() - t0, 1)
    tree = yaml.safe_load(RECIPE.read_text())
    tree["model"] = {"source": str(W / "hf"), "dtype": S["dtype"]}
    tree["data"] = {**tree["data"], "apply_chat_template": False, "max_prompt_len": 512,
                    "train": {"source": str(data), "format": "slime"}, "eval": {}}
    tree["rollout"].update(engine="sglang", reward="bench.trivial_reward:length_mod13", rollout_batch_size=4,
                           n_samples_per_prompt=8, max_new_tokens=256 if not cpu else 8, dynamic_sampling=False,
                           over_sampling_factor=1.0,
                           sglang={"launch": ["{python}", str(STANDIN)] if cpu else launch_prefix(a.site),
                                   "mem_fraction": a.mem_fraction, "scratch_dir": str(W / "scratch-gap")})
    tree["train"].update(global_batch_size=32, micro_batch_size=4, max_tokens_per_micro_batch=None)
    tree["tracking"] = {"enabled": False}
    tree["cluster"] = {"backend": "local", "device": S["device"], "colocate": True,
                       "trainer_gpus": 0 if cpu else 1, "rollout_gpus": 0 if cpu else 1}
    tree["storage"] = {"root": str(W / "gap-root")}
    cfg = config_from_dict(tree, "trainer-gap")
    sess = TrainSession(cfg, H.run_dir_over(W / "gap-root", "gap", inputs))
    res: dict = {"name": "trainer-gap", "convert_s": convert_s}
    try:
        t0 = time.time()
        sess.ensure_at(None)
        res["build_s"] = round(time.time() - t0, 1)
        m = sess.rollout(0)  # an update, pushed by the product's path (direct: the engine's disk load)
        res["rollout_weight_sync_s"] = round(m["weight_sync_s"], 3)
        res["logprob_gap_vs_trainer"] = rp.logprob_gap(sess, 8, 256 if not cpu else 8)
        engine = sess.engine.group.members[0]  # the SGLangEngine in this process (local backend)
        res["push_s"] = {}
        for method in ("disk", "tensor"):
            engine.settings.section.weight_sync = method  # read at each update (rollout.sglang.weight_sync)
            res["push_s"][method] = rp.time_pushes(sess)
    finally:
        sess.close()
    return res


FUNCS = {"setup": sec_setup, "builtin": sec_builtin, "sglang": sec_sglang,
         "sglang-capped": lambda S, W, a: sec_sglang(S, W, a, capped=True),
         "sglang-nondet": lambda S, W, a: sec_sglang(S, W, a, deterministic=False),
         "sglang-sync": lambda S, W, a: sec_sglang(S, W, a, sync_only=True), "trainer-gap": sec_trainer_gap}


# ---- the call ---------------------------------------------------------------------------------------------

def print_table(results: list[dict]) -> None:
    by = {r["name"]: r for r in results}
    for r in results:
        if "error" in r or r.get("status") == "FAILED":
            print(f"{r['name']:<14} ERROR {str(r.get('error', '')).strip().splitlines()[-1:]}")
            if not any(k in r for k in ("rollout", "logprob_gap_vs_hf", "weight_sync_s")):
                continue
        ro = r.get("rollout") or {}
        line = f"{r['name']:<14} {ro.get('tok_s', '-'):>8} tok/s  {ro.get('new_tokens', '-')} tokens in {ro.get('s', '-')} s"
        if "logprob_gap_vs_hf" in r:
            line += f"; |dlogp| vs HF {r['logprob_gap_vs_hf']}"
        if "weight_sync_s" in r:
            line += f"; weight sync s {r['weight_sync_s']}"
        if "logprob_gap_vs_trainer" in r:
            line += f"; |dlogp| vs the trainer {r['logprob_gap_vs_trainer']}; pushes s {r.get('push_s')}"
        print(line)
    b, s = by.get("builtin", {}).get("rollout", {}), by.get("sglang", {}).get("rollout", {})
    if b.get("tok_s") and s.get("tok_s"):
        print(f"sglang / builtin tok/s: {s['tok_s'] / b['tok_s']:.2f}")
    n = by.get("sglang-nondet", {}).get("rollout", {})
    if n.get("tok_s") and s.get("tok_s"):
        print(f"deterministic mode costs: {s['tok_s']} vs {n['tok_s']} tok/s ({s['tok_s'] / n['tok_s']:.2f})")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sections", default="setup,builtin,sglang")
    ap.add_argument("--section", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--cpu", action="store_true", help="tiny shapes on CPU, the stand-in as SGLang")
    ap.add_argument("--site", default=SERVER_SITE)
    ap.add_argument("--mem-fraction", type=float, default=0.45, help="SGLang's --mem-fraction-static "
                    "(0.45 of an H200: about the built-in engine's 56 GiB pool)")
    ap.add_argument("--family", choices=("qwen3", "glm4"), default="qwen3",
                    help="glm4: GLM-Z1-9B's shape (GLM-4-9B-0414's config) instead of Qwen3-0.6B's")
    ap.add_argument("--sync-methods", default=",".join(SYNC_METHODS),
                    help="the weight-sync methods the sglang and sglang-sync sections time (comma list)")
    ap.add_argument("--deadline", type=float, default=570.0)
    ap.add_argument("--work", default=None)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/sglang_speed_out"))
    ap.add_argument("--results-dir", default=None)
    a = ap.parse_args(argv)
    S = shapes(a.cpu, a.family)
    W = Path(a.work or ("/tmp/sglang_speed_work" + ("_cpu" if a.cpu else "") + ("_glm4" if a.family == "glm4" else "")))
    out = Path(a.out)
    W.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    H.prepare_env()
    if a.section:  # one section, in this process
        if a.cpu:
            import torch
            torch.set_num_threads(1)
        r = H.run_section(a.section, S, W, out, lambda S, W: FUNCS[a.section](S, W, a))
        return 0 if r.get("status") == "ok" else 1
    names = [x for x in a.sections.split(",") if x]
    if unknown := [x for x in names if x not in SECTIONS]:
        raise SystemExit(f"--sections: no section {', '.join(unknown)} (its sections: {', '.join(SECTIONS)})")
    if unknown := [x for x in a.sync_methods.split(",") if x not in SYNC_METHODS]:
        raise SystemExit(f"--sync-methods: no method {', '.join(unknown)} (its methods: {', '.join(SYNC_METHODS)})")
    deadline = time.monotonic() + a.deadline
    for name in names:
        left = deadline - time.monotonic()
        if left < 30:
            H.append_result(out, {"name": name, "status": "SKIPPED", "error": f"{left:.0f} s left of --deadline"})
            continue
        argv2 = [sys.executable, __file__, "--section", name, "--out", str(out), "--work", str(W), "--site", a.site,
                 "--mem-fraction", str(a.mem_fraction), "--family", a.family, "--sync-methods", a.sync_methods,
                 *(["--cpu"] if a.cpu else [])]
        try:
            subprocess.run(argv2, timeout=left, start_new_session=True)
        except subprocess.TimeoutExpired:  # what the section measured before the cut stays
            H.append_result(out, {**H.read_results(out).get(name, {}), "name": name, "status": "FAILED",
                                  "error": f"timed out after {left:.0f} s"})
    results = list(H.read_results(out).values())  # this call's sections and an earlier call's in the same OUT
    summary = {"bench": "sglang_speed", "date": datetime.date.today().isoformat(), "device": _device(a),
               "shape": {k: S[k] for k in ("family", "hidden", "layers", "vocab", "prompts", "samples", "over_sampling",
                                           "prompt_len", "max_new", "median", "sigma")}, "sections": results}
    (out / "sglang_speed.json").write_text(json.dumps(summary, indent=1, default=str))
    if a.results_dir:
        tag = ("cpu_smoke" if a.cpu else f"{summary['device'].replace(' ', '_')}_{summary['date']}") + \
            ("_glm4" if a.family == "glm4" else "")
        (Path(a.results_dir) / f"sglang_speed_{tag}.json").write_text(json.dumps(summary, indent=1, default=str))
    print_table(results)
    return 0 if all(r.get("status") == "ok" for r in results) else 1


def _device(a) -> str:
    if a.cpu:
        return "cpu (stand-in server)"
    import torch
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


if __name__ == "__main__":
    sys.exit(main())
