"""grpoflow's SGLang client against a real SGLang 0.5.17 server on the GPU machine (issue 58).

    python3 bench/sglang_carry.py install --part .carry-sglang/part-*.tar.xz    # over back-to-back calls
    python3 bench/sglang_real.py --out $OUT                                      # ~4 min on an H200

Everything goes through `SGLangEngine` (runtime/rollout/sglang), the class `rollout.engine: sglang` uses, with the
server started from its own site (bench/sglang_carry.py) through `rollout.sglang.launch`. The model is a random
Qwen3-0.6B shape in bf16 (rollout_bench's `make_model`). Each check is one row: what docs/sglang.md claims, what was
seen. Rows: launch and health; `/generate` with log-probs; the same keyed requests twice (deterministic mode:
same tokens and log-probs); the engine's log-probs against HF's teacher-forced ones on the sampled tokens;
`/update_weights_from_disk` with a weight version (new weights change the samples, the old ones bring them back);
`--enable-memory-saver` release and resume (GPU memory freed and taken back); a SIGKILLed server restarted by the
client; a request the server rejects named once, not retried.
Results: OUT/sglang_real.json.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).resolve().parent
for p in (ROOT, BENCH):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

SERVER_SITE = "/tmp/sglang-site"
# What grpoflow passes beyond its own flags, and why: triton attention keeps the radix cache in deterministic mode
# (the samples of a group share the prompt's prefix) and needs neither FA3's 1.1 GB library nor a JIT; pytorch
# sampling needs no flashinfer JIT; no grammar backend (no constrained decoding in GRPO rollouts)
SERVER_FLAGS = ["--attention-backend", "triton", "--sampling-backend", "pytorch", "--grammar-backend", "none",
                "--skip-server-warmup"]


def launch_prefix(site: str) -> list[str]:
    return ["env", f"PYTHONPATH={site}", "{python}", "-m", "sglang.launch_server", *SERVER_FLAGS]


def gpu_used_gib() -> float:
    import torch
    free, total = torch.cuda.mem_get_info()
    return round((total - free) / 2**30, 2)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    ap.add_argument("--site", default=SERVER_SITE)
    ap.add_argument("--work", default="/tmp/sglang-work")
    ap.add_argument("--max-new", type=int, default=128)
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    import torch

    from rollout_bench import SHAPES, make_model
    from runtime.config import SGLangSection
    from runtime.rollout.base import SampleRequest, SamplingParams
    from runtime.rollout.sglang.engine import SGLangEngine
    from runtime.rollout.sglang.settings import SGLangSettings

    rows: list[dict] = []
    facts = {"device": torch.cuda.get_device_name(0), "date": datetime.date.today().isoformat(), "rows": rows}

    def row(name: str, ok: bool, **seen) -> None:
        rows.append({"check": name, "ok": bool(ok), **seen})
        print(f"{'ok ' if ok else 'BAD'} {name}: {json.dumps(seen)[:300]}", flush=True)
        (out / "sglang_real.json").write_text(json.dumps(facts, indent=1))

    work = Path(a.work)
    model = make_model(SHAPES["gpu"], work)
    model_dir = model["model_dir"]
    section = SGLangSection(launch=launch_prefix(a.site), mem_fraction=0.5, startup_timeout_s=600,
                            scratch_dir=str(work / "scratch"))
    settings = SGLangSettings(section=section, colocate=True, random_seed=1, sync_backend="nccl")
    base = gpu_used_gib()
    t0 = time.time()
    engine = SGLangEngine(settings, model_dir)
    row("launch and health", engine.health()["ok"], start_s=round(time.time() - t0, 1), gpu_gib=gpu_used_gib() - base,
        health=engine.health()["engines"])
    try:
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, 50, (64,), generator=g).tolist() for _ in range(8)]
        reqs = [SampleRequest(prompt_ids=p, key=(1, 0, i, j)) for i, p in enumerate(prompts) for j in range(8)]
        sp = SamplingParams(temperature=1.0, max_new_tokens=a.max_new)
        t0 = time.time()
        first = engine.generate(reqs, sp)
        gen_s = time.time() - t0
        n_tok = sum(len(r.response_ids) for r in first)
        row("/generate with log-probs", all(len(r.response_ids) == len(r.response_logprobs) > 0 for r in first),
            samples=len(first), tokens=n_tok, s=round(gen_s, 2), finish={r.finish_reason for r in first}.__repr__())
        again = engine.generate(reqs, sp)
        same_tok = sum(x.response_ids == y.response_ids for x, y in zip(first, again))
        same_lp = sum(x.response_logprobs == y.response_logprobs for x, y in zip(first, again))
        row("sampling_seed: same keys, same samples (deterministic mode)", same_tok == len(reqs),
            same_tokens=f"{same_tok}/{len(reqs)}", same_logprobs=f"{same_lp}/{len(reqs)}")
        other = engine.generate([SampleRequest(prompt_ids=r.prompt_ids, key=(2, *r.key[1:])) for r in reqs], sp)
        row("another seed, other samples", sum(x.response_ids != y.response_ids for x, y in zip(first, other)) > len(reqs) // 2,
            differing=sum(x.response_ids != y.response_ids for x, y in zip(first, other)))

        # the engine's log-probs against HF's (the trainer's model) on the sampled tokens
        from transformers import AutoModelForCausalLM
        engine.release_memory()
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
        diffs = []
        with torch.no_grad():
            for r in first[:16]:
                ids = torch.tensor([r.prompt_ids + r.response_ids], device="cuda")
                logits = hf(ids).logits[0, len(r.prompt_ids) - 1:-1].float()
                lp = torch.log_softmax(logits, -1).gather(-1, ids[0, len(r.prompt_ids):, None])[:, 0]
                diffs.append((lp - torch.tensor(r.response_logprobs, device="cuda")).abs())
        d = torch.cat(diffs)
        row("engine vs HF log-probs of the sampled tokens", float(d.max()) < 0.5, mean=float(d.mean()),
            p99=float(d.quantile(0.99)), max=float(d.max()), tokens=int(d.numel()))
        named = {k: v.detach() for k, v in hf.state_dict().items()}
        del hf
        torch.cuda.empty_cache()

        # memory saver: released above for HF; resume, then release again and measure
        engine.resume_memory()
        held = gpu_used_gib()
        engine.release_memory()
        freed = gpu_used_gib()
        engine.resume_memory()
        back = gpu_used_gib()
        row("--enable-memory-saver release / resume", freed < held - 1 and back > freed + 1, held_gib=held,
            released_gib=freed, resumed_gib=back)

        # weights from disk with versions: perturbed weights change the samples, the originals bring them back
        noisy = {k: (v + 0.02 * torch.randn_like(v) if v.dim() == 2 else v) for k, v in named.items()}
        t0 = time.time()
        engine.update_weights(noisy, version=1)
        upd_s = time.time() - t0
        moved = engine.generate(reqs, sp)
        engine.update_weights(named, version=2)
        restored = engine.generate(reqs, sp)
        row("/update_weights_from_disk with weight versions",
            engine.weight_version == 2 and sum(x.response_ids != y.response_ids for x, y in zip(first, moved)) > 0
            and all(x.response_ids == y.response_ids for x, y in zip(first, restored)),
            update_s=round(upd_s, 2), version=engine.weight_version,
            changed_by_noise=sum(x.response_ids != y.response_ids for x, y in zip(first, moved)),
            restored_equal=sum(x.response_ids == y.response_ids for x, y in zip(first, restored)))

        # a SIGKILLed server: the client restarts it, re-syncs the weights, and the request goes through
        pid = engine.pids[0]
        os.killpg(os.getpgid(pid), signal.SIGKILL)
        t0 = time.time()
        after = engine.generate(reqs[:8], sp)
        row("SIGKILLed server restarted", engine.pids[0] != pid and len(after) == 8, restart_s=round(time.time() - t0, 1),
            restarts=engine.health()["engines"][0].get("restarts"), version=engine.weight_version,
            same_as_before=sum(x.response_ids == y.response_ids for x, y in zip(first[:8], after)))

        # a request the server rejects: one error named, no restart
        import httpx
        body = {"input_ids": prompts[0], "sampling_params": {"max_new_tokens": 4, "no_such_key": 1}}
        r = httpx.post(engine.urls[0] + "/generate", json=body, timeout=60)
        row("a rejected request (raw)", r.status_code >= 400, status=r.status_code, body=r.text[:300])
    except Exception:  # noqa: BLE001 - the row says what broke; the server log follows
        row("unexpected failure", False, error=traceback.format_exc()[-3000:])
    finally:
        logs = sorted((work / "scratch").rglob("engine-*.log"))
        engine.shutdown()
        for f in logs:
            if f.exists():
                (out / f"server-{f.name}").write_text(f.read_text()[-200_000:])
    print(json.dumps({r["check"]: r["ok"] for r in rows}, indent=1))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
