"""Several GPUs of one host: the trainer with data or tensor parallelism, and rollout on a GPU of its own
with NCCL weight sync, against one GPU on the same recorded rollout batches.

    python bench/multi_gpu.py --results-dir bench/results     # 2 GPUs, Qwen3-0.6B shape, bf16 (< 10 min)
    python bench/multi_gpu.py --cpu                           # CI smoke: tiny shapes, gloo, same code paths

Sections (each its own process on GPU):
  setup         random HF model + torch_dist checkpoint + prompts (bench/gpu_grpo.py's setup)
  record        the built-in engine on GPU 0 samples R rollouts (16 prompts x 8 x 512 tokens); rewards and
                group advantages make them training batches, saved for replay
  replay_*      the trainer (cluster.backend local: one process per rank, NCCL) replays the recorded
                batches: log-probs of every batch before its update, the update's loss, and the log-probs
                of batch 0 after the last update. 1gpu_a / 1gpu_b: two 1-GPU runs (their gap is the noise
                of bf16 kernels), each also syncing a colocated engine (CUDA IPC) after every update and
                reading its log-probs of 8 recorded samples; dp2: DP=2 on 2 GPUs; tp2: TP=2 on 2 GPUs;
                split: the trainer on GPU 0 and the engine on GPU 1, weights over NCCL, the same engine
                log-probs
  stage_split   the real train stage (TrainSession) with the trainer on GPU 0 and the engine on GPU 1,
                weights over NCCL each rollout: rollout/train tok/s, weight-sync time, engine-vs-trainer
                log-probs after each sync
  stage_dp2     the train stage with DP=2 and the engine colocated on GPU 0 (weights over CUDA IPC)
The verdict compares every replay to 1gpu_a: within twice the 1gpu_a-vs-1gpu_b gap.
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import harness as H
import gpu_grpo as g

LAYOUTS = {"1gpu_a": (1, 1), "1gpu_b": (1, 1), "dp2": (2, 1), "tp2": (1, 2), "split": (1, 1)}
ENGINE_LAYOUTS = ("1gpu_a", "1gpu_b", "split")  # replays that also sync an engine and read its log-probs
ENGINE_ROWS = 8
SECTIONS = ("setup", "record", *(f"replay_{k}" for k in LAYOUTS), "stage_split", "stage_dp2")
SECTION_MAX_S = {"setup": 150, "record": 120, "stage_split": 150, "stage_dp2": 150}
LR = 1e-5  # large enough that an update moves bf16 log-probs measurably


def _cfg(S, W: Path, train: dict | None = None, **cluster) -> dict:
    cfg = g.stage_config(S, W)
    cfg["train"].update(lr=LR, **(train or {}))
    cfg["cluster"].update(cluster)
    return cfg


def sec_record(S, W: Path) -> dict:
    import torch

    from bench.trivial_reward import length_mod13
    from runtime.algo import group_advantages
    from runtime.rollout.base import SamplingParams

    t0 = time.time()
    eng = g._engine(S, W)
    eng.eos_token_ids = set()  # fixed length, as in bench/gpu_grpo.py
    sp = SamplingParams(temperature=1.0, max_new_tokens=S["new"])
    batches, tok_s = [], []
    for r in range(S["rollouts"]):
        H.sync(S)
        t1 = time.perf_counter()
        out = eng.generate(g._requests(S, S["prompts"], S["samples"], rollout=r, seed=r), sp)
        H.sync(S)
        tok_s.append(sum(len(s.response_ids) for s in out) / (time.perf_counter() - t1))
        rewards = torch.tensor([length_mod13(eng.tokenizer.decode(s.response_ids), "") for s in out])
        adv = group_advantages(rewards, S["samples"], normalize_std=True)
        batches.append(H.samples_batch(out, adv.tolist()))
    torch.save(batches, W / "batches.pt")
    return {"name": "record", "rollouts": len(batches), "samples": len(batches[0]),
            "tokens_per_sample": len(batches[0].tokens[0]), "engine_tok_s": [round(x) for x in tok_s],
            "total_s": round(time.time() - t0, 1)}


def sec_replay(S, W: Path, layout: str) -> dict:
    import torch

    from runtime.placement.cluster import Cluster
    from runtime.config import config_from_dict

    from runtime.placement.weight_sync import TrainerToEngine

    dp, tp = LAYOUTS[layout]
    gpus = dp * tp if S["device"] == "cuda" else 0
    cluster_cfg = dict(trainer_gpus=gpus)
    if layout == "split":  # (c): trainer on GPU 0, engine on GPU 1, weights over NCCL
        cluster_cfg.update(colocate=False, rollout_gpus=1 if gpus else 0, weight_sync="broadcast")
    elif layout in ENGINE_LAYOUTS:  # the engine colocated on GPU 0, weights over CUDA IPC
        cluster_cfg.update(rollout_gpus=1 if gpus else 0)
    cfg = config_from_dict(_cfg(S, W, dict(data_parallel=dp, tensor_parallel=tp), **cluster_cfg), "bench")
    batches = torch.load(W / "batches.pt", weights_only=False)
    t0 = time.time()
    cluster = Cluster(cfg)
    trainer = cluster.trainer(
        in_subprocesses=True, hf_dir=str(W / "hf"), init_checkpoint=str(W / "td"), train=cfg.train,
        algorithm=cfg.algorithm, temperature=1.0)
    load_s = time.time() - t0
    engine_lp, sync_s, extra = [], [], {}
    try:
        sync = None
        if layout in ENGINE_LAYOUTS:
            engine = cluster.engine(str(W / "hf"))
            sync = TrainerToEngine(trainer, engine, cluster.weight_sync, transport=cluster.direct_transport, group_name="replay")
            extra = {"engine_device": cluster.engine_device, "weight_sync": cluster.weight_sync}
            rows = [(b.tokens[i][:b.prompt_lens[i]], b.tokens[i][b.prompt_lens[i]:])
                    for b in batches[:1] for i in range(min(ENGINE_ROWS, len(b)))]
        logprobs, metrics = [], []
        for i, b in enumerate(batches):
            logprobs.append(trainer.compute_logprobs(b))
            metrics.append(trainer.train(b))
            if sync is not None:
                H.sync(S)
                t1 = time.perf_counter()
                sync.push(i + 1)
                H.sync(S)
                sync_s.append(time.perf_counter() - t1)
                engine_lp.append([engine.logprobs_of(p, r) for p, r in rows])
        logprobs.append(trainer.compute_logprobs(batches[0]))
    finally:
        trainer.kill()
    torch.save({"logprobs": logprobs, "metrics": metrics, "engine_logprobs": engine_lp}, W / f"replay_{layout}.pt")
    if sync_s:
        extra["weight_sync_s"] = [round(x, 4) for x in sync_s]
    tok_s = [m["train_tokens"] / m["train_time_s"] for m in metrics]
    return {"name": f"replay_{layout}", "dp": dp, "tp": tp, "gpus": gpus, "load_s": round(load_s, 1),
            "loss": [m["loss"] for m in metrics], "grad_norm": [m["grad_norm"] for m in metrics],
            "train_tok_s": [round(x) for x in tok_s],
            "train_tok_s_steady": round(statistics.median(tok_s[1:] or tok_s)), **extra}


def _stage(S, W: Path, name: str, cluster: dict, train: dict | None = None) -> dict:
    from runtime.config import config_from_dict
    from runtime.grpo.session import TrainSession

    cfg = config_from_dict(_cfg(S, W, train, **cluster), "bench")
    root = W / f"root_{name}"
    rd = H.run_dir_over(root, "bench", (W / "hf", W / "td", W / "data" / "train.parquet"))
    t0 = time.time()
    sess = TrainSession(cfg, rd)
    rows = []
    try:
        t_build = time.time()
        sess.ensure_at(None)
        build_s = time.time() - t_build
        for r in range(S["rollouts"]):
            m = sess.rollout(r)
            rows.append({k: m[k] for k in ("rollout_tok_s", "train_tok_s", "weight_sync_s", "step_time_s",
                                           "rollout_time_s", "train_time_s", "train_rollout_logp_absdiff", "loss")})
            print("ROLLOUT", json.dumps(rows[-1]), flush=True)
        weights = sess.weights
        res = {"weight_sync": weights.mode, "engine_device": sess.cluster.engine_device,
               "trainer_in_subprocesses": sess.cluster.trainer_in_subprocesses,
               "tensors": len(weights.metadata) or None}
    finally:
        sess.close()
    steady = rows[1:] or rows
    med = lambda k: round(statistics.median(x[k] for x in steady), 4)  # noqa: E731
    res.update(name=name, cluster=cluster, rollouts=rows, build_s=round(build_s, 1), total_s=round(time.time() - t0, 1),
               rollout_tok_s=med("rollout_tok_s"), train_tok_s=med("train_tok_s"), weight_sync_s=med("weight_sync_s"),
               step_time_s=med("step_time_s"),
               engine_vs_trainer_logp_absdiff_max=max(x["train_rollout_logp_absdiff"] for x in rows))
    return res


def sec_stage_split(S, W: Path) -> dict:
    if S["device"] == "cuda":
        return _stage(S, W, "stage_split", dict(trainer_gpus=1, rollout_gpus=1, colocate=False))
    return _stage(S, W, "stage_split", dict(colocate=False, weight_sync="broadcast"))


def sec_stage_dp2(S, W: Path) -> dict:
    if S["device"] == "cuda":
        return _stage(S, W, "stage_dp2", dict(trainer_gpus=2, rollout_gpus=1, colocate=True))
    return _stage(S, W, "stage_dp2", dict(colocate=True), dict(data_parallel=2))


def _run(name: str, S, W: Path) -> dict:
    if name.startswith("replay_"):
        return sec_replay(S, W, name[len("replay_"):])
    return {"setup": g.sec_setup, "record": sec_record, "stage_split": sec_stage_split, "stage_dp2": sec_stage_dp2}[name](S, W)


def compare(W: Path) -> dict:
    """Every replay against 1gpu_a: max / mean |Δ log-prob| over all snapshots, max |Δ loss|."""
    import torch

    def load(name):
        p = W / f"replay_{name}.pt"
        return torch.load(p, weights_only=False) if p.exists() else None

    ref = load("1gpu_a")
    if ref is None:
        return {}
    out = {}
    for name in LAYOUTS:
        run = load(name)
        if run is None or name == "1gpu_a":
            continue
        diffs, per_snapshot = [], []
        for a, b in zip(ref["logprobs"], run["logprobs"]):
            d = torch.cat([(torch.tensor(x) - torch.tensor(y)).abs() for x, y in zip(a, b)])
            diffs.append(d)
            per_snapshot.append(float(f"{float(d.max()):.3g}"))
        d = torch.cat(diffs)
        # the GRPO loss is ~0 at ratio 1 (advantages sum to zero per group): grad_norm carries the update
        loss = [abs(x["loss"] - y["loss"]) for x, y in zip(ref["metrics"], run["metrics"])]
        gn = [abs(x["grad_norm"] - y["grad_norm"]) / max(abs(x["grad_norm"]), 1e-12)
              for x, y in zip(ref["metrics"], run["metrics"])]
        eng = {}
        if ref.get("engine_logprobs") and run.get("engine_logprobs"):
            e = torch.cat([(torch.tensor(x) - torch.tensor(y)).abs() for a, b in
                           zip(ref["engine_logprobs"], run["engine_logprobs"]) for x, y in zip(a, b)])
            eng = {"engine_logp_absdiff_max": float(e.max()), "engine_logp_absdiff_mean": float(e.mean())}
        out[name] = {**eng, "logp_absdiff_max": float(d.max()), "logp_absdiff_mean": float(d.mean()),
                     "logp_absdiff_max_per_snapshot": per_snapshot, "loss_absdiff_max": max(loss),
                     "grad_norm_rel_max": max(gn)}
    gap = out.get("1gpu_b")
    if gap:
        for name, r in out.items():
            if name != "1gpu_b":
                r["within_2x_1gpu_gap"] = {
                    "logp_max": r["logp_absdiff_max"] <= 2 * gap["logp_absdiff_max"],
                    "logp_mean": r["logp_absdiff_mean"] <= 2 * gap["logp_absdiff_mean"],
                    "loss": r["loss_absdiff_max"] <= 2 * gap["loss_absdiff_max"],
                    "grad_norm": r["grad_norm_rel_max"] <= 2 * gap["grad_norm_rel_max"],
                    **({"engine_logp_max": r["engine_logp_absdiff_max"] <= 2 * gap["engine_logp_absdiff_max"],
                        "engine_logp_mean": r["engine_logp_absdiff_mean"] <= 2 * gap["engine_logp_absdiff_mean"]}
                       if "engine_logp_absdiff_max" in r and "engine_logp_absdiff_max" in gap else {})}
    return out


def main(argv=None) -> int:
    a = H.parser(__doc__, "multi_gpu", 560.0, sections=SECTIONS).parse_args(argv)
    S = dict(g.SHAPES["cpu" if a.cpu else "gpu"])
    out, W = H.start(a, "multi_gpu")
    if a.section:
        return H.section_exit(H.run_section(a.section, S, W, out, lambda S, W: _run(a.section, S, W)))
    t_start = time.time()
    H.clear_results(out)
    H.run_sections_in_processes(Path(__file__), H.sections_of(a, SECTIONS), W, out, a.deadline, SECTION_MAX_S,
                                extra_args=("--cpu",) if a.cpu else ())
    res = H.read_results(out)
    info = {**H.env_info(S), **H.gpu_count(S)}
    summary = {**H.summary_head("multi_gpu", info), "shapes": S, "lr": LR, "comparison": compare(W),
               "sections": res, "total_s": round(time.time() - t_start, 1)}
    H.save_summary(summary, out, "multi_gpu", a.results_dir, a.cpu, name=None if a.cpu else
                   f"multi_gpu_{info.get('gpus', 1)}x{summary['device'].replace(' ', '_')}_{summary['date'][:10]}.json")
    for name, r in res.items():
        keys = ("status", "train_tok_s_steady", "loss", "rollout_tok_s", "train_tok_s", "weight_sync_s",
                "engine_vs_trainer_logp_absdiff_max", "engine_tok_s", "error")
        print(f"{name:18s}", json.dumps({k: r[k] for k in keys if k in r}, default=str)[:300])
    for name, c in summary["comparison"].items():
        print(f"vs 1gpu_a {name:8s}", json.dumps(c))
    return H.exit_code(summary, a.cpu)


if __name__ == "__main__":
    sys.exit(main())
