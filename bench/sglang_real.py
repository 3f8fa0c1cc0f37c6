"""grpoflow's SGLang client against a real SGLang 0.5.17 server on the GPU machine (issue 58).

    python3 bench/sglang_carry.py install --part .carry-sglang/part-*.tar.xz    # over back-to-back calls
    python3 bench/sglang_real.py --out $OUT                                      # ~4 min on an H200

Everything goes through `SGLangEngine` (runtime/rollout/sglang), the class `rollout.engine: sglang` uses, with the
server started from its own site (bench/sglang_carry.py) through `rollout.sglang.launch`. The model is a random
Qwen3-0.6B shape in bf16 (rollout_bench's `make_model`). Each check is one row: what docs/sglang.md claims, what was
seen. Rows: launch and health; `/generate` with log-probs; the same keyed requests twice (deterministic mode:
same tokens and log-probs); the engine's log-probs against HF's teacher-forced ones on the sampled tokens;
`/update_weights_from_disk` with a weight version (new weights change the samples, the old ones bring them back);
`--enable-memory-saver` release and resume (GPU memory freed and taken back); `/update_weights_from_tensor` with
weight versions (CUDA IPC handles from this process: `rollout.sglang.weight_sync: tensor`); the NCCL broadcast
group (`init_weight_sync` + `receive_weights`, this process's rank 0 on GPU 1 and the server on GPU 0: NCCL cannot
put two ranks of one group on one GPU, so the row needs a second GPU and is skipped on one); partial rollout's
abort and continue (`generate(..., until=GroupsDone)`, then the aborted samples continued with `prefix_ids`); a
server SIGKILLed while released (restarted, re-synced, released again, then resumed); a request the server
rejects, raw and through the client (named once, not retried, no restart); the cost of the
deterministic mode (warm tok/s of one workload on this server and on a second one started without
`--enable-deterministic-inference`).
`--skip ROW,...` leaves rows out (restart, det-cost: the two that start a server); `--deadline` skips det-cost when
less than `--start-budget` seconds are left.

`--routes-only` runs one row instead, on a server of its own: routing replay (R3, `rollout.routing_replay`) through
SGLang's `return_routed_experts` (runtime/rollout/sglang/routes.py) on a random Qwen3-MoE of Qwen3-30B-A3B's width
and `--moe-layers` layers (built on the GPU as moe_engine.py, saved as an HF dir with the tiny tokenizer): every
sample's `routed_experts` has the built-in engine's layout [prompt + response - 1, layers, 8], a continued sample
keeps its routes and gets the rest from its last kept token on (the server honours `routed_experts_start_len`), and
SGLang's expert sets against HF's router on the same weights and tokens (the fraction of (token, layer) pairs whose
top-8 set agrees: a bf16 near-tie may round either way; reported, the row's verdict is the layout). `--standin`
runs that row on the CPU against tests/sglang_standin.py (a 2-layer, 8-expert model; its routes are pseudo-random,
so no agreement is computed): the script's smoke.
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


# the server's compiled kernels where bench/sglang_carry.py's save-cache / install-cache find them: a first start on a
# fresh machine took 255 s, a restart with these caches warm 77 s (2026-11-29)
SERVER_CACHES = {"TRITON_CACHE_DIR": "/tmp/sglang-cache/triton", "TORCHINDUCTOR_CACHE_DIR": "/tmp/sglang-cache/inductor"}


def launch_prefix(site: str) -> list[str]:
    return ["env", f"PYTHONPATH={site}", *(f"{k}={v}" for k, v in SERVER_CACHES.items()), "{python}", "-m",
            "sglang.launch_server", *SERVER_FLAGS]


OPTIONAL_ROWS = ("tensor", "broadcast", "partial", "restart", "rejected", "det-cost")
STANDIN = ROOT / "tests" / "sglang_standin.py"


def keyed_requests(seed: int, samples: int, key: int, prompts: int = 8, prompt_len: int = 64):
    """`prompts` random prompts and `samples` keyed requests of each: (prompt ids, requests)."""
    import torch
    from runtime.rollout.base import SampleRequest
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(3, 50, (prompt_len,), generator=g).tolist() for _ in range(prompts)]
    return ids, [SampleRequest(prompt_ids=p, key=(key, 0, i, j)) for i, p in enumerate(ids) for j in range(samples)]


def gpu_used_gib() -> float:
    import torch
    free, total = torch.cuda.mem_get_info()
    return round((total - free) / 2**30, 2)


def keep_logs(scratch: Path, out: Path, tag: str) -> None:
    for f in sorted(scratch.rglob("engine-*.log")):
        if f.exists():
            (out / f"server{tag}-{f.name}").write_text(f.read_text(errors="replace")[-200_000:])


def same(xs, ys) -> int:
    return sum(x.response_ids == y.response_ids for x, y in zip(xs, ys))


def tensor_row(engine, named, noisy, first, reqs, sp, row) -> None:
    """`/update_weights_from_tensor` through the client (`rollout.sglang.weight_sync: tensor`, read at each update):
    the tensors stay on this process's GPU and travel as CUDA IPC handles."""
    engine.settings.section.weight_sync = "tensor"
    try:
        t0 = time.time()
        engine.update_weights(noisy, version=3)
        upd_s = time.time() - t0
        moved = engine.generate(reqs, sp)
        t0 = time.time()
        engine.update_weights(named, version=4)
        back_s = time.time() - t0
        restored = engine.generate(reqs, sp)
    finally:
        engine.settings.section.weight_sync = "disk"
    row("/update_weights_from_tensor with weight versions",
        engine.weight_version == 4 and same(first, moved) < len(reqs) and same(first, restored) == len(reqs),
        update_s=round(upd_s, 2), update_back_s=round(back_s, 2), version=engine.weight_version,
        changed_by_noise=len(reqs) - same(first, moved), restored_equal=same(first, restored))


class Rank0:
    """The trainer's side of a weight-sync group in this process: rank 0 on `device` (threads, as the trainer's actor
    is another process), joined with the engine's servers through the client (`init_weight_sync`); `push` broadcasts
    every tensor while `receive_weights` has the servers take them."""

    def __init__(self, engine, device: str, name: str = "bench_weights"):
        import threading

        import torch

        from runtime.placement.ports import free_port
        from runtime.placement.weight_sync import backend_for, init_group
        self.engine, self.device = engine, device
        host, port, backend = "127.0.0.1", free_port("127.0.0.1"), backend_for(device)
        joined: dict = {}

        def join() -> None:
            try:
                if device.startswith("cuda"):
                    torch.cuda.set_device(torch.device(device))
                joined["group"] = init_group(host, port, 0, 1 + engine.weight_sync_ranks(), backend=backend,
                                             group_name=name)
            except Exception as e:  # noqa: BLE001 - raised below
                joined["error"] = repr(e)
        t0 = time.time()
        th = threading.Thread(target=join, daemon=True)
        th.start()
        engine.init_weight_sync(host, port, 1, 1 + engine.weight_sync_ranks(), name, backend=backend)
        th.join(120)
        self.join_s = round(time.time() - t0, 2)
        if "group" not in joined:
            raise RuntimeError(f"rank 0 did not join the weight-sync group: {joined.get('error')}")
        self.group = joined["group"]

    def push(self, tensors: dict, version: int) -> float:
        import threading

        import torch

        from runtime.placement.weight_sync import metadata_of, send
        sent: dict = {}

        def sender() -> None:
            try:
                if self.device.startswith("cuda"):
                    torch.cuda.set_device(torch.device(self.device))
                sent["bytes"] = send(self.group, tensors, self.device)
                if self.device.startswith("cuda"):
                    torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001
                sent["error"] = repr(e)
        t = threading.Thread(target=sender, daemon=True)
        t0 = time.time()
        t.start()
        self.engine.receive_weights(metadata_of(tensors), version)
        t.join(120)
        if "error" in sent:
            raise RuntimeError(f"rank 0's broadcast failed: {sent['error']}")
        return round(time.time() - t0, 3)


def sendable(named: dict) -> dict:
    """The trainer's names: the tied lm_head is not sent (SGLang's Qwen3 skips it; the trainer's hf_weights too)."""
    return {k: v for k, v in named.items() if k != "lm_head.weight"}


BROADCAST = "NCCL broadcast group (init_weights_update_group + update_weights_from_distributed)"


def broadcast_row(engine, named, noisy, first, reqs, sp, row) -> None:
    """The NCCL weight-sync group through the client: this process is the trainer's rank 0 on GPU 1, the server
    joins as rank 1 from GPU 0, then every tensor is broadcast while `receive_weights` has the server take them.
    Ends with the original weights loaded from disk again (a broadcast leaves no disk copy to re-sync a restarted
    server from)."""
    import torch
    if torch.cuda.device_count() < 2:
        row(BROADCAST, True, skipped="needs a second GPU: NCCL refuses two ranks of one group on one GPU "
                                     "(the server is on GPU 0)")
        return
    rank0 = Rank0(engine, "cuda:1")
    times = [rank0.push(sendable(noisy), 5)]
    moved = engine.generate(reqs, sp)
    times.append(rank0.push(sendable(named), 6))
    restored = engine.generate(reqs, sp)
    version = engine.weight_version
    ok = version == 6 and engine.weight_sync_ready() and same(first, moved) < len(reqs) and same(first, restored) == len(reqs)
    engine.update_weights(named, version=7)  # a disk copy again, for the restart row
    row(BROADCAST, ok, ranks="trainer rank 0 on GPU 1 (this process), server rank 1 on GPU 0", join_s=rank0.join_s,
        broadcast_s=times, tensors=len(sendable(named)), version=version,
        changed_by_noise=len(reqs) - same(first, moved), restored_equal=same(first, restored))


def partial_row(engine, prompts, cap: int, row) -> None:
    """Partial rollout's two asks of the server: stop once enough groups are complete (the rest aborted by rid,
    their tokens so far returned), then continue the aborted samples after their tokens (`prefix_ids`). Groups 0
    and 1 carry a prefix of cap - 8 tokens, so they complete first; the other 6 groups run to the cap."""
    from runtime.rollout.base import GroupsDone, SampleRequest, SamplingParams
    sp = SamplingParams(temperature=1.0, max_new_tokens=cap)
    carried = [(p * 7 + i) % 47 + 3 for i, p in enumerate(range(cap - 8))]
    reqs = [SampleRequest(prompt_ids=p, key=(5, 0, i, j), prefix_ids=carried if i < 2 else [],
                          prefix_logprobs=[-1.0] * len(carried) if i < 2 else [])
            for i, p in enumerate(prompts) for j in range(8)]
    t0 = time.time()
    got = engine.generate(reqs, sp, until=GroupsDone(group_size=8, count=2))
    stop_s = time.time() - t0
    aborted = [i for i, r in enumerate(got) if r.finish_reason == "abort"]
    made = [len(got[i].response_ids) for i in aborted]
    complete_groups = sum(all(got[i].finish_reason != "abort" for i in range(g * 8, g * 8 + 8)) for g in range(8))
    again = [SampleRequest(prompt_ids=reqs[i].prompt_ids, key=reqs[i].key, prefix_ids=got[i].response_ids,
                           prefix_logprobs=got[i].response_logprobs) for i in aborted]
    t0 = time.time()
    cont = engine.generate(again, sp)
    cont_s = time.time() - t0
    kept = sum(c.response_ids[:len(r.prefix_ids)] == r.prefix_ids and c.response_logprobs[:len(r.prefix_ids)]
               == r.prefix_logprobs for c, r in zip(cont, again))
    ended = sum(c.finish_reason in ("stop", "length") and len(c.response_ids) <= cap for c in cont)
    row("partial rollout: abort once enough groups are complete, continue the aborted",
        complete_groups >= 2 and bool(aborted) and kept == len(again) == ended,
        complete_groups=complete_groups, aborted=len(aborted), tokens_at_abort=(min(made), max(made)) if made else None,
        stop_s=round(stop_s, 2), continued=len(again), prefix_kept=kept, continued_to_an_end=ended,
        continue_s=round(cont_s, 2), lengths_after=sorted({len(c.response_ids) for c in cont})[:5])


def restart_released_row(engine, named, first, reqs, sp, row) -> None:
    """A server SIGKILLed while the pool is released (the trainer holds the GPU): the client's check (here
    `weight_sync_ready`, in a run the next call) restarts it, re-syncs the current weights from their disk copy,
    probes it, and releases it again, so the trainer keeps its memory; the resume takes it back and it serves the
    same samples. The original weights are loaded from disk first: the restart re-syncs from that copy (a tensor
    or broadcast update leaves none)."""
    engine.update_weights(named, version=engine.weight_version + 1)
    engine.release_memory()
    released = gpu_used_gib()
    pid, proc = engine.pids[0], engine.pool.servers[0].proc
    os.killpg(os.getpgid(pid), signal.SIGKILL)
    proc.wait(timeout=60)
    t0 = time.time()
    engine.weight_sync_ready()
    restart_s = time.time() - t0
    h = engine.health()["engines"][0]
    after_restart = gpu_used_gib()
    engine.resume_memory()
    resumed = gpu_used_gib()
    after = engine.generate(reqs[:8], sp)
    row("a server SIGKILLed while released: restarted, re-synced, released again",
        engine.pids[0] != pid and h.get("state") == "ready" and bool(h.get("released"))
        and after_restart < resumed - 1 and same(first[:8], after) == 8,
        restart_s=round(restart_s, 1), restarts=h.get("restarts"), released_after_restart=h.get("released"),
        gpu_gib={"released": released, "after_restart": after_restart, "resumed": resumed},
        version=engine.weight_version, same_as_before=same(first[:8], after))


def rejected_rows(engine, prompts, reqs, sp, row) -> None:
    """A request the server rejects (a sampling key 0.5.17 does not know): raw, what the server answers and that it
    stays up; through the client, one line naming it, sent once, no restart, and the server serves on."""
    import httpx

    from runtime.errors import ConfigError
    from runtime.rollout.sglang import http_protocol
    body = {"input_ids": prompts[0], "sampling_params": {"max_new_tokens": 4, "no_such_key": 1}}
    r = httpx.post(engine.urls[0] + "/generate", json=body, timeout=60)
    row("a rejected request (raw)", r.status_code >= 400 and engine.health()["ok"], status=r.status_code,
        body=r.text[:300])
    pid, restarts = engine.pids[0], engine.health()["engines"][0].get("restarts")
    made = http_protocol.sglang_sampling_params
    http_protocol.sglang_sampling_params = lambda sampling, seed: {**made(sampling, seed), "no_such_key": 1}
    error = None
    try:
        engine.generate(reqs[:1], sp)
    except ConfigError as e:
        error = str(e)
    finally:
        http_protocol.sglang_sampling_params = made
    h = engine.health()["engines"][0]
    served = engine.generate(reqs[:8], sp)
    row("a rejected request through the client: one line, no restart",
        error is not None and "\n" not in error and "rejected /generate" in error and engine.pids[0] == pid
        and h.get("restarts") == restarts and len(served) == 8,
        error=error, restarts=h.get("restarts"), same_pid=engine.pids[0] == pid, served_after=len(served))


def throughput(engine, max_new: int) -> dict:
    """Warm tok/s of one workload: 32 prompts of 256 tokens x 8 samples, `max_new` tokens each (a short warm-up
    of the same requests first)."""
    from runtime.rollout.base import SamplingParams
    _, reqs = keyed_requests(seed=11, samples=8, key=9, prompts=32, prompt_len=256)
    engine.generate(reqs, SamplingParams(temperature=1.0, max_new_tokens=16))
    t0 = time.time()
    got = engine.generate(reqs, SamplingParams(temperature=1.0, max_new_tokens=max_new))
    s = time.time() - t0
    n = sum(len(r.response_ids) for r in got)
    return {"samples": len(reqs), "tokens": n, "s": round(s, 2), "tok_s": round(n / s)}


def det_cost_row(a, model_dir: str, work: Path, out: Path, rows: list, row, t_end: float) -> None:
    """A second server without `--enable-deterministic-inference` (`rollout.sglang.deterministic: false`), the
    same workload: what the deterministic mode costs."""
    from runtime.config import SGLangSection
    from runtime.rollout.sglang.engine import SGLangEngine
    from runtime.rollout.sglang.settings import SGLangSettings
    left = t_end - time.monotonic()
    if left < a.start_budget:
        row("throughput without deterministic mode", True, skipped=f"{left:.0f} s left, a server start may take "
                                                                   f"{a.start_budget:.0f} (--start-budget)")
        return
    det = next((r for r in rows if r["check"].startswith("throughput, deterministic")), None)
    section = SGLangSection(launch=launch_prefix(a.site), mem_fraction=0.5, startup_timeout_s=max(60.0, left - 60),
                            scratch_dir=str(work / "scratch-nondet"), deterministic=False)
    try:
        t0 = time.time()
        engine = SGLangEngine(SGLangSettings(section=section, colocate=True, random_seed=1, sync_backend="nccl"),
                              model_dir)
        start_s = time.time() - t0
    except Exception:  # noqa: BLE001
        row("throughput without deterministic mode", False, error=traceback.format_exc()[-2000:])
        keep_logs(work / "scratch-nondet", out, "-nondet")
        return
    try:
        free = throughput(engine, a.tput_max_new)
        cost = {"deterministic_tok_s": det["tok_s"], "ratio": round(free["tok_s"] / det["tok_s"], 3)} if det else {}
        row("throughput without deterministic mode", free["tok_s"] > 0, start_s=round(start_s, 1), **free, **cost)
    except Exception:  # noqa: BLE001
        row("throughput without deterministic mode", False, error=traceback.format_exc()[-2000:])
    finally:
        keep_logs(work / "scratch-nondet", out, "-nondet")
        engine.shutdown()


def make_moe_model(work: Path, layers: int, device: str):
    """(HF dir, the model) of a random Qwen3-MoE: Qwen3-30B-A3B's width and `layers` layers on the GPU (moe_engine's
    TINY on the CPU), eos 2 and the tiny tokenizer as rollout_bench's make_model (its ids stay below the vocab)."""
    import torch
    from transformers import GenerationConfig

    from moe_engine import QWEN3_30B_A3B, TINY, build
    from runtime.models.tiny import build_tiny_qwen3
    cfg = dict(TINY) if device == "cpu" else dict(QWEN3_30B_A3B, num_hidden_layers=layers)
    cfg.update(bos_token_id=None, eos_token_id=2, pad_token_id=0)
    model = build(cfg, device, torch.bfloat16 if device == "cuda" else torch.float32)
    hf = work / f"moe-hf-{device}-{cfg['num_hidden_layers']}"
    if not (hf / "config.json").exists():
        build_tiny_qwen3(work / "tok")
        model.save_pretrained(hf)
        for f in os.listdir(work / "tok"):
            if f.startswith("tokenizer") or f == "special_tokens_map.json":
                (hf / f).write_bytes((work / "tok" / f).read_bytes())
        GenerationConfig(eos_token_id=2, pad_token_id=0).save_pretrained(hf)
    return str(hf), model


def hf_agreement(model, samples) -> dict:
    """Of SGLang's routes against HF's router on the same weights and tokens: the fraction of (token, MoE layer)
    pairs with the same top-k set, and of tokens whose sets agree in every layer."""
    import torch
    pairs = agree = tokens = all_layers = 0
    dev = next(model.parameters()).device
    k = model.config.num_experts_per_tok
    with torch.no_grad():
        for q, r in samples:
            ids = q.prompt_ids + r.response_ids
            logits = model(torch.tensor([ids], device=dev), output_router_logits=True).router_logits
            hf = torch.stack([lg.reshape(len(ids), -1)[:-1].float().topk(k, dim=-1).indices for lg in logits], 1)
            same = (hf.sort(-1).values.cpu() == r.routed_experts.long().sort(-1).values).all(-1)  # [tokens - 1, layers]
            pairs, agree = pairs + same.numel(), agree + int(same.sum())
            tokens, all_layers = tokens + same.shape[0], all_layers + int(same.all(-1).sum())
    return {"pairs_same_set": round(agree / pairs, 4), "tokens_same_in_every_layer": round(all_layers / tokens, 4),
            "pairs": pairs}


def routes_row(a, work: Path, out: Path, row) -> None:
    """Routing replay through SGLang (the module docstring): layout, a continued sample, agreement with HF."""
    import torch

    from runtime.config import SGLangSection
    from runtime.rollout.base import SampleRequest, SamplingParams
    from runtime.rollout.sglang.engine import SGLangEngine
    from runtime.rollout.sglang.settings import SGLangSettings
    device = "cpu" if a.standin else "cuda"
    t0 = time.time()
    model_dir, model = make_moe_model(work, a.moe_layers, device)
    model_s = time.time() - t0
    launch = [sys.executable, str(STANDIN)] if a.standin else launch_prefix(a.site)
    section = SGLangSection(launch=launch, mem_fraction=0.5, startup_timeout_s=600, scratch_dir=str(work / "scratch-routes"))
    settings = SGLangSettings(section=section, colocate=False, random_seed=1, sync_backend="gloo" if a.standin else "nccl",
                              routing_replay=True)
    name = "routing replay: return_routed_experts in the built-in engine's layout"
    try:
        t0 = time.time()
        engine = SGLangEngine(settings, model_dir)
        start_s = time.time() - t0
    except Exception:  # noqa: BLE001
        row(name, False, error=traceback.format_exc()[-2000:])
        keep_logs(work / "scratch-routes", out, "-routes")
        return
    try:
        layers, k = model.config.num_hidden_layers, model.config.num_experts_per_tok
        prompts, reqs = keyed_requests(seed=3, samples=4, key=7)
        sp = SamplingParams(temperature=1.0, max_new_tokens=a.max_new)
        t0 = time.time()
        got = engine.generate(reqs, sp)
        gen_s = time.time() - t0

        def laid_out(q, r) -> bool:
            want = (len(q.prompt_ids) + len(r.response_ids) - 1, layers, k)
            return r.routed_experts is not None and tuple(r.routed_experts.shape) == want and \
                r.routed_experts.dtype == torch.uint8 and int(r.routed_experts.max()) < model.config.num_experts
        shaped = sum(laid_out(q, r) for q, r in zip(reqs, got))
        # continued: each sample of 4+ tokens cut to half, continued on the same weights
        cut = [(q, r, len(r.response_ids) // 2) for q, r in zip(reqs, got) if len(r.response_ids) >= 4]
        again = [SampleRequest(prompt_ids=q.prompt_ids, key=q.key, prefix_ids=r.response_ids[:h],
                               prefix_logprobs=r.response_logprobs[:h], prefix_routes=r.routed_experts)
                 for q, r, h in cut]
        cont = engine.generate(again, sp)
        kept = sum(torch.equal(c.routed_experts[:len(q.prompt_ids) + h - 1], r.routed_experts[:len(q.prompt_ids) + h - 1])
                   for c, (q, r, h) in zip(cont, cut))
        cont_shaped = sum(laid_out(q, c) for q, c in zip(again, cont))
        agreement = None
        if not a.standin:
            try:
                agreement = hf_agreement(model, list(zip(reqs, got))[:8])
            except Exception:  # noqa: BLE001 - the layout rows stand; the comparison says what broke
                agreement = {"error": traceback.format_exc()[-1500:]}
        row(name, shaped == len(reqs) and cont_shaped == kept == len(again) > 0, model_s=round(model_s, 1),
            start_s=round(start_s, 1), generate_s=round(gen_s, 2), samples=len(reqs), laid_out=shaped,
            bytes_per_token=layers * k, continued=len(again), continued_laid_out=cont_shaped, prefix_routes_kept=kept,
            hf_agreement=agreement, health=engine.health()["records_routes"])
    except Exception:  # noqa: BLE001
        row(name, False, error=traceback.format_exc()[-3000:])
    finally:
        keep_logs(work / "scratch-routes", out, "-routes")
        engine.shutdown()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    ap.add_argument("--site", default=SERVER_SITE)
    ap.add_argument("--work", default="/tmp/sglang-work")
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--partial-max-new", type=int, default=512, help="the partial rows' cap")
    ap.add_argument("--tput-max-new", type=int, default=512, help="det-cost: tokens of each of 256 samples")
    ap.add_argument("--skip", default="", help=f"rows to leave out: {', '.join(OPTIONAL_ROWS)}")
    ap.add_argument("--deadline", type=float, default=570.0, help="seconds for the whole call")
    ap.add_argument("--start-budget", type=float, default=200.0, help="seconds a second server start may take")
    ap.add_argument("--routes-only", action="store_true", help="only the routing-replay row (its own server)")
    ap.add_argument("--moe-layers", type=int, default=4, help="routes row: layers of the Qwen3-30B-A3B-wide model")
    ap.add_argument("--standin", action="store_true", help="with --routes-only: on the CPU against the stand-in")
    a = ap.parse_args(argv)
    t_end = time.monotonic() + a.deadline
    skip = {x for x in a.skip.split(",") if x}
    if unknown := skip - set(OPTIONAL_ROWS):
        raise SystemExit(f"--skip: no row {', '.join(sorted(unknown))} (rows: {', '.join(OPTIONAL_ROWS)})")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    import torch

    if a.routes_only:
        rows_only: list[dict] = []
        facts_only = {"device": "cpu (stand-in)" if a.standin else torch.cuda.get_device_name(0),
                      "date": datetime.date.today().isoformat(), "rows": rows_only}

        def row_only(name: str, ok: bool, **seen) -> None:
            rows_only.append({"check": name, "ok": bool(ok), **seen})
            print(f"{'ok ' if ok else 'BAD'} {name}: {json.dumps(seen)[:600]}", flush=True)
            (out / "sglang_real_routes.json").write_text(json.dumps(facts_only, indent=1))
        routes_row(a, Path(a.work), out, row_only)
        return 0 if all(r["ok"] for r in rows_only) else 1

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
        prompts, reqs = keyed_requests(seed=0, samples=8, key=1)
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

        def det_row() -> None:
            det = throughput(engine, a.tput_max_new)
            row("throughput, deterministic mode (this server)", det["tok_s"] > 0, **det)

        for name, fn in (("tensor", lambda: tensor_row(engine, named, noisy, first, reqs, sp, row)),
                         ("broadcast", lambda: broadcast_row(engine, named, noisy, first, reqs, sp, row)),
                         ("partial", lambda: partial_row(engine, prompts, a.partial_max_new, row)),
                         ("det-cost", det_row)):
            if name in skip:
                continue
            try:  # one row's failure is that row's; the original weights are loaded again for the next
                fn()
            except Exception:  # noqa: BLE001
                row(f"{name}: failed", False, error=traceback.format_exc()[-3000:])
                engine.update_weights(named, version=engine.weight_version + 100)
        if "restart" not in skip:
            restart_released_row(engine, named, first, reqs, sp, row)
        if "rejected" not in skip:
            rejected_rows(engine, prompts, reqs, sp, row)
    except Exception:  # noqa: BLE001 - the row says what broke; the server log follows
        row("unexpected failure", False, error=traceback.format_exc()[-3000:])
    finally:
        keep_logs(work / "scratch", out, "")
        engine.shutdown()
    if "det-cost" not in skip:
        det_cost_row(a, model_dir, work, out, rows, row, t_end)
    print(json.dumps({r["check"]: r["ok"] for r in rows}, indent=1))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
