"""GLM-Z1-9B, every parameter trained, on 2 x H100 with the optimizer on the host (issue 36).

    python bench/glm9b_host_optimizer.py --sections setup,resume --out $OUT     # nvidia-h100-x2, call 1 (< 10 min)
    python bench/glm9b_host_optimizer.py --sections stage --out $OUT            # call 2 (< 10 min; it runs setup
                                                                                # first if the machine is fresh)
    python bench/glm9b_host_optimizer.py --merge OUT1 OUT2 --results-dir bench/results   # one JSON of both calls
    python bench/glm9b_host_optimizer.py --cpu                                  # CI smoke: a tiny GLM4, same paths

Sections (each its own process; the trainer ranks and engines the local backend spawns are processes of their
own, which import this script as ``__mp_main__``: that is where :func:`_child_hooks` forces the keyed lengths
and samples memory):

  setup   a random-init model with GLM-Z1-9B's config (runtime/models/known_configs), built in bf16 on GPU 0:
          its HF safetensors (what the engines load; the trainer's weights replace them at the first sync) and,
          mapped from the same GPU tensors, megatron's bf16 torch_dist checkpoint (the trainer's): no fp32
          conversion through the host. A bf16 logit probe of the two; prompts of ~1000 tokens.
  stage   the real train stage (runtime.grpo.session.TrainSession, cluster.backend local) of
          configs/glm-z1-9b-dapo-2xh100.yaml on both GPUs (TP 2 trainer with the optimizer on the host, an engine
          beside each rank, the plan's KV pool): 16 prompts x 8 samples whose lengths follow the paged-engine
          bench's keyed schedule (rollout_bench.lengths_for_hashes: log-normal, median 1700, a tail to 8192),
          as many rollouts as fit (2 expected; the first one also pays the first step's allocations and graph
          captures). The weight sync: each engine maps the weights of the TP rank on its GPU by CUDA IPC
          (runtime/placement/cuda_ipc.py; a tensor received by IPC cannot be sent on, so none passes through this
          process). Per rollout:
          generate / train / host optimizer step / weight sync seconds, the engine-vs-trainer log-prob gap on
          the sampled tokens; per GPU the trainer's and the engine's allocated peaks by phase (a trainer rank's
          per call: its update, its share of the weight sync) against the plan's terms and the card's footprint
          (nvidia-smi); after every offload, what each trainer rank's allocator keeps; the host's peak (the node,
          and each process's resident memory) against the plan's host terms.
  resume  save -> resume -> next update on a depth-truncated GLM4 (full width and vocabulary, 4 layers; a whole
          9B checkpoint with its optimizer, ~123 GiB, does not fit the disk beside the model): a TP 2 trainer
          with the optimizer on the host takes 2 updates, saves, takes a 3rd; fresh trainers with the optimizer
          on the host and on the GPU load the checkpoint (their masters must equal the saved ones bitwise: the
          loader restored into the masters the step uses) and take the 3rd update (within 0.01 x lr of the
          unbroken run's, per weight: lr 1e-4 here, so that the bound is above the fp32 rounding of the norms'
          weights at 1.0). The unbroken trainer also loads the checkpoint and takes the 3rd update again (the
          rerun): two updates from one loaded state differ by the GPU's run-to-run noise alone (an atomically
          accumulated backward; Adam turns a flipped sign of a near-zero gradient into ~lr), so a resumed update
          that is off the unbroken one by no more than twice its distance from the rerun is noise, not a bad
          load. Where masters differ at load, the three worst tensors are named, and the tensor-parallel replicas'
          drift from rank 0's copy (the one a checkpoint keeps) is measured. With train.deterministic (the
          default; `--deterministic false` turns it off for every section) the rerun and the resumed update are
          bitwise.

What was cut to fit a call: the stage runs as many rollouts as its budget allows (2 expected, a rollout that would
not finish is not started after the first) and no checkpoint or eval (the resume section checks the checkpoint);
the resume check runs on 4 layers. A rollout that fails (the GPU out of memory, say) ends the stage FAILED with what
it measured up to there: the rollouts before it and the memory report. Results: OUT/results.jsonl (one line per
section), OUT/glm9b_host_optimizer.json (summary), with --results-dir a copy named by device and date.
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

import harness as H
import rollout_bench  # the keyed length schedule
from harness import ROOT

CONFIG = ROOT / "configs" / "glm-z1-9b-dapo-2xh100.yaml"
GLM4_9B = json.loads((ROOT / "runtime" / "models" / "known_configs" / "GLM-4-9B-0414.json").read_text())
SECTIONS = ("setup", "stage", "resume")
SECTION_MAX_S = {"setup": 240, "stage": 570, "resume": 400}
ENV_LENGTHS, ENV_MEMDIR, ENV_METHODS = "GLM9B_BENCH_KEYED_LENGTHS", "GLM9B_BENCH_MEMDIR", "GLM9B_BENCH_TRAINER_METHODS"
ENV_DETERMINISTIC = "GLM9B_BENCH_DETERMINISTIC"  # train.deterministic for every section: "true" or "false"
RESUME_LR = 1e-4
SHAPES = {
    "gpu": dict(device="cuda", dtype="bfloat16", model={}, prompts=16, samples=8, prompt_len=1000,
                max_prompt_len=1024, rollouts=3, rows=96, resume_layers=4, resume_tp=2, resume_samples=16,
                resume_prompt=256, resume_response=512, sets=[], sample_s=0.25,
                resumed=(("resumed_host", True), ("resumed_gpu_optimizer", False)),
                schedule={k: rollout_bench.SHAPES["gpu"][k] for k in ("max_new", "median", "sigma", "min_len")}),
    "cpu": dict(device="cpu", dtype="bfloat16",
                model=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=16, vocab_size=512),
                prompts=2, samples=4, prompt_len=12, max_prompt_len=16, rollouts=2, rows=16,
                resume_layers=2, resume_tp=1, resume_samples=8, resume_prompt=6, resume_response=8, sample_s=0.1,
                # the smoke resumes onto the host optimizer only: that a host checkpoint loads bitwise into
                # megatron's optimizer is tests/test_host_optimizer.py's (and this loop's code is the same)
                resumed=(("resumed_host", True),),
                sets=["train.max_tokens_per_micro_batch=128", "rollout.kv_cache_gb=0.01", "rollout.decode_path=paged"],
                schedule={k: rollout_bench.SHAPES["cpu"][k] for k in ("max_new", "median", "sigma", "min_len")}),
}


# ---- in the spawned trainer and engine processes -------------------------------------------------------

# A trainer rank's train and share_next_weight_unit calls measure their own peak (_call_peaks): the sampler then leaves the
# peak counter alone in that process. The lock keeps a sample's reset from falling inside such a call.
_PEAKS = {"lock": threading.Lock(), "by_call": False}


def _sampler(mem_dir: Path, every_s: float) -> None:
    """Every `every_s`: this process's peak allocated CUDA memory since the last sample (per device it uses; not in a
    trainer rank, whose calls record their own), its allocated and reserved bytes, and its resident host memory
    (VmRSS, and the VmHWM high-water mark)."""
    import torch
    path = mem_dir / f"{os.getpid()}.jsonl"
    with open(path, "a") as f:
        while True:
            row: dict = {"t": time.time(), **_proc_status()}
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                for d in range(torch.cuda.device_count()):
                    if torch.cuda.memory_reserved(d) > 0:
                        with _PEAKS["lock"]:
                            by_call = _PEAKS["by_call"]
                            row.setdefault("cuda", {})[d] = [None if by_call else torch.cuda.max_memory_allocated(d),
                                                             torch.cuda.memory_allocated(d),
                                                             torch.cuda.memory_reserved(d)]
                            if not by_call:
                                torch.cuda.reset_peak_memory_stats(d)
            f.write(json.dumps(row) + "\n")
            f.flush()
            time.sleep(every_s)


def _proc_status(pid: int | str = "self") -> dict:
    out = {}
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith(("VmRSS:", "VmHWM:")):
                out[line.split(":")[0].lower()] = int(line.split()[1]) * 1024
    except OSError:
        pass
    return out


def _bench_trainer_methods() -> None:
    """Methods the resume section calls on each trainer rank: its fp32 masters saved, or compared with saved ones."""
    import torch

    from runtime.trainer.megatron_trainer import MegatronTrainer
    from runtime.trainer.tp_replicas import replicated_parameters

    def masters(self) -> dict:
        self.offload.reload()
        return {n: p.main_param.detach() for n, p in self.model.named_parameters()
                if getattr(p, "main_param", None) is not None}

    def bench_save_masters(self, path: str) -> dict:
        """This rank's masters to ``path``; the names of the tensor-parallel replicas among them (a copy on every
        TP rank, of which a checkpoint keeps TP rank 0's)."""
        live = masters(self)
        Path(path).mkdir(parents=True, exist_ok=True)
        torch.save({n: t.to("cpu") for n, t in live.items()}, f"{path}/rank{self.rank}.pt")
        replicated = {id(w) for w in replicated_parameters(self.model)}
        replicas = sorted(n for n, w in self.model.named_parameters() if n in live and id(w) in replicated)
        return {"elements": sum(t.numel() for t in live.values()), "tp_replicated": replicas}

    def bench_masters_vs(self, path: str) -> dict:
        ref = torch.load(f"{path}/rank{self.rank}.pt", weights_only=True)
        mine = masters(self)
        assert ref.keys() == mine.keys()
        diffs = {n: float((mine[n].to("cpu") - ref[n]).abs().max()) for n in ref}
        worst = sorted(diffs, key=diffs.get, reverse=True)[:3]
        return {"max_abs_diff": max(diffs.values()), "bitwise_equal": all(v == 0 for v in diffs.values()),
                "worst": worst[0], "worst3": {n: diffs[n] for n in worst},
                "tensors_differing": sum(v != 0 for v in diffs.values()),
                "devices": sorted({str(t.device) for t in mine.values()}), "tensors": len(ref)}

    def bench_memory_segments(self) -> dict:
        """What this rank's caching allocator holds (the stage calls it after each offload, while the engine
        generates): allocated and reserved, and the segments kept mostly free, each with the sizes of the live
        blocks that keep it (a segment goes back to the driver only when all of it is free)."""
        if not torch.cuda.is_available():
            return {}
        mib = 2 ** 20
        kept = []
        for seg in torch.cuda.memory_snapshot():
            free = seg["total_size"] - seg["allocated_size"]
            if free >= 64 * mib:
                live = sorted((b["size"] for b in seg["blocks"] if b["state"] == "active_allocated"), reverse=True)
                kept.append({"segment_mib": round(seg["total_size"] / mib, 1), "free_mib": round(free / mib, 1),
                             "live_blocks": len(live), "live_block_mib": [round(b / mib, 2) for b in live[:8]]})
        kept.sort(key=lambda k: -k["free_mib"])
        return {"allocated_gib": round(torch.cuda.memory_allocated() / 2 ** 30, 3),
                "reserved_gib": round(torch.cuda.memory_reserved() / 2 ** 30, 3),
                "free_in_kept_segments_gib": round(sum(k["free_mib"] for k in kept) / 1024, 3),
                "kept_segments": kept[:12]}

    MegatronTrainer.bench_save_masters = bench_save_masters
    MegatronTrainer.bench_masters_vs = bench_masters_vs
    MegatronTrainer.bench_memory_segments = bench_memory_segments
    mem_dir = os.environ.get(ENV_MEMDIR)
    if mem_dir:
        for method, phase in (("train", "train"), ("share_next_weight_unit", "sync")):
            setattr(MegatronTrainer, method, _call_peaks(getattr(MegatronTrainer, method), phase, Path(mem_dir)))


def _call_peaks(fn, phase: str, mem_dir: Path):
    """`fn` that records the peak allocated CUDA memory of each call (its GPU's counter reset at entry), with the
    call's start and end, in <pid>.calls.jsonl: a peak by phase that samples cannot give (the weight sync lasts less
    than a sampling interval and follows the update at once)."""
    import torch

    def wrapper(self, *a, **k):
        on_gpu = str(self.device).startswith("cuda")
        if on_gpu:
            with _PEAKS["lock"]:
                _PEAKS["by_call"] = True
                torch.cuda.reset_peak_memory_stats(self.device)
        t0 = time.time()
        out = fn(self, *a, **k)
        if on_gpu:
            with open(mem_dir / f"{os.getpid()}.calls.jsonl", "a") as f:
                f.write(json.dumps({"phase": phase, "t0": t0, "t1": time.time(),
                                    "peak": torch.cuda.max_memory_allocated(self.device)}) + "\n")
        return out
    return wrapper


def _child_hooks() -> None:
    spec = os.environ.get(ENV_LENGTHS)
    if spec:
        import partial_rollout
        partial_rollout.force_keyed_lengths(json.loads(spec))
    if os.environ.get(ENV_METHODS):
        _bench_trainer_methods()
    mem_dir = os.environ.get(ENV_MEMDIR)
    if mem_dir:
        threading.Thread(target=_sampler, args=(Path(mem_dir), float(os.environ.get("GLM9B_BENCH_SAMPLE_S", "0.25"))),
                         daemon=True).start()


if __name__ == "__mp_main__":
    _child_hooks()


# ---- setup ----------------------------------------------------------------------------------------------

def model_config(S, layers: int | None = None) -> dict:
    cfg = dict(GLM4_9B, **S["model"])
    if layers:
        cfg["num_hidden_layers"] = layers
    return cfg


def hf_config_of(cfg_dict: dict):
    from transformers import Glm4Config
    return Glm4Config(**{k: v for k, v in cfg_dict.items() if k not in ("architectures", "torch_dtype", "model_type")})


def sec_setup(S, W: Path) -> dict:
    """The random model as HF safetensors and as megatron bf16 torch_dist, both from the same tensors on the
    device; prompts."""
    import random

    import torch
    from transformers import AutoTokenizer, GenerationConfig

    import glm4_engine
    from runtime.mcore import env as menv
    from runtime.mcore.convert import _load_mapped_weights, save_model_torch_dist
    from runtime.models import get_adapter

    t0 = time.time()
    H.fresh_setup(W)
    tok = AutoTokenizer.from_pretrained(W / "tok")
    cfg_dict = model_config(S)
    cfg_dict.update(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    device, dtype = S["device"], torch.bfloat16
    model = glm4_engine.build(cfg_dict, device, dtype)  # random init on the device, bf16
    model.config.architectures = ["Glm4ForCausalLM"]
    model.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                                               do_sample=True, temperature=1.0, top_p=1.0, top_k=0)
    t_build = time.time() - t0
    model.save_pretrained(W / "hf", max_shard_size="5GB")
    H.copy_tokenizer(W)
    t_hf = time.time() - t0 - t_build
    # megatron's bf16 model from the same tensors, on the device (no fp32 copy, no trip through the host)
    hf_config = model.config
    menv.init_parallel(device=device)
    gpt = menv.build_gpt_model(hf_config, dtype=dtype, device=device, init_weights=False)
    _load_mapped_weights(gpt, get_adapter(hf_config).from_hf(model.state_dict(), hf_config), W / "hf")
    gpt.eval()
    with torch.no_grad():  # a bf16 probe: megatron's logits against HF's on the same weights
        ids = torch.randint(3, hf_config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0)).to(device)
        pos = torch.arange(ids.shape[1], device=device).unsqueeze(0).expand_as(ids)
        ours = gpt(ids, pos, None if device == "cuda" else menv.causal_attention_mask(2, 64, device)).float()
        ref = model(input_ids=ids).logits.float()
        probe = {"max_abs_logit_diff": float((ours - ref).abs().max()), "max_abs_logit": float(ref.abs().max()),
                 "logprob_absdiff_mean": float((ours.log_softmax(-1) - ref.log_softmax(-1)).abs().mean())}
    n_params = sum(p.numel() for p in gpt.parameters())
    del model, ours, ref
    t1 = time.time()
    save_model_torch_dist(gpt, W / "td")
    t_td = time.time() - t1
    del gpt
    rows = H.word_rows(tok, random.Random(36), S["rows"], S["prompt_len"], S["prompt_len"] + 16)
    prep = H.write_prompts(W, "prompts", rows, tok, max_prompt_len=S["max_prompt_len"])
    size = lambda d: round(sum(f.stat().st_size for f in (W / d).rglob("*") if f.is_file()) / 2**30, 2)  # noqa: E731
    return {"name": "setup", "params": n_params, "build_s": round(t_build, 1), "hf_save_s": round(t_hf, 1),
            "torch_dist_save_s": round(t_td, 1), "hf_GiB": size("hf"), "torch_dist_GiB": size("td"),
            "bf16_probe": probe, "prompts": prep.get("rows"), "total_s": round(time.time() - t0, 1)}


# ---- stage ----------------------------------------------------------------------------------------------

def bench_config(S, W: Path, sets: list[str]):
    """configs/glm-z1-9b-dapo-2xh100.yaml pointed at the random model and prompts, on this machine (local
    backend, the GPU's and the host's memory as found, the plan's KV pool)."""
    import yaml

    from runtime.config import config_with_overrides
    from runtime.plan.memory import plan_choices
    from runtime.plan.summary import model_config_for_plan
    tree = yaml.safe_load(CONFIG.read_text())
    tree["name"] = "bench-glm9b-host-optimizer"
    tree["model"]["source"] = str(W / "hf")
    tree["data"] = {"train": {"source": str(W / "data" / "prompts.jsonl"), "format": "slime"}, "eval": {},
                    "apply_chat_template": False, "max_prompt_len": S["max_prompt_len"], "shuffle": False}
    tree["rollout"].update(reward="bench.trivial_reward:length_mod13", max_new_tokens=S["schedule"]["max_new"],
                           rollout_batch_size=S["prompts"], n_samples_per_prompt=S["samples"])
    tree["train"].update(num_rollout=S["rollouts"], global_batch_size=S["prompts"] * S["samples"])
    tree["eval"] = {"interval": None}
    tree["tracking"] = {"enabled": False}
    gpus = 2 if S["device"] == "cuda" else 0
    tree["cluster"].update(backend="local", device=S["device"], trainer_gpus=gpus, gpu_memory_gb=H.gpu_gib(S),
                           host_memory_gb=round(H.host_meminfo()["MemTotal"] / 2**30, 1))
    tree["storage"] = {"root": str(W / "root")}
    cfg = config_with_overrides(tree, sets, "bench")
    if S["device"] == "cuda":
        hf_config, _ = model_config_for_plan(str(W / "hf"))
        choices = plan_choices(cfg, hf_config)
        cfg = config_with_overrides(tree, sets + [f"{k}={v}" for k, v in choices.items()], "bench")
    return cfg


class NodeSampler:
    """The node's used host memory (MemTotal - MemAvailable) and, on GPUs, each card's used memory as nvidia-smi
    reports it (what every process on it holds, CUDA contexts included), every `every_s` seconds."""

    def __init__(self, every_s: float):
        self.every_s, self.rows, self._stop = every_s, [], threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.smi = shutil.which("nvidia-smi")

    def start(self) -> "NodeSampler":
        self.thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(5)

    def _run(self) -> None:
        while not self._stop.is_set():
            m = H.host_meminfo()
            row = {"t": time.time(), "host_used": m["MemTotal"] - m["MemAvailable"]}
            if self.smi:
                try:
                    out = subprocess.run([self.smi, "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"],
                                         capture_output=True, text=True, timeout=5).stdout
                    row["gpu_used"] = {int(a): int(b) * 2**20 for a, b in (ln.split(",") for ln in out.strip().splitlines())}
                except Exception:  # noqa: BLE001 - no nvidia-smi numbers this time
                    pass
            self.rows.append(row)
            self._stop.wait(self.every_s)


def _timed(obj, name: str, phase: str, phases: list, after=None) -> None:
    """obj.name, recording (phase, start, end) of each call; `after(result)` once it returned."""
    fn = getattr(obj, name)

    def wrapper(*a, **k):
        t0 = time.time()
        try:
            out = fn(*a, **k)
        finally:
            phases.append((phase, t0, time.time()))
        if after is not None:
            after(out)
        return out

    setattr(obj, name, wrapper)


KEEP = ("rollout", "step_time_s", "generate_time_s", "reward_time_s", "train_time_s", "optimizer_step_s",
        "optimizer_host_adam_s", "optimizer_transfer_wait_s", "weight_sync_s", "train_rollout_logp_absdiff",
        "response_len_mean", "response_len_max", "train_tokens", "rollout_tok_s", "train_tok_s", "grad_norm", "loss")


def sec_stage(S, W: Path, sets: list[str], budget_s: float) -> dict:
    t_start = time.time()
    from runtime.grpo.session import TrainSession
    if not (W / "td").is_dir() or not (W / "hf" / "config.json").is_file():
        raise RuntimeError(f"no model under {W}: run the setup section first (same --work)")
    res: dict = {"name": "stage", "sets": list(sets)}
    cfg = bench_config(S, W, sets)
    root = Path(cfg.storage.root)
    rd = H.run_dir_over(root, "bench", H.setup_inputs(W))
    mem_dir = W / "mem"
    shutil.rmtree(mem_dir, ignore_errors=True)
    mem_dir.mkdir(parents=True)
    # the spawned ranks and engines inherit these (_child_hooks)
    os.environ.update({ENV_LENGTHS: json.dumps(S["schedule"]), ENV_MEMDIR: str(mem_dir), ENV_METHODS: "1",
                       "GLM9B_BENCH_SAMPLE_S": str(S["sample_s"])})
    import partial_rollout
    partial_rollout.force_keyed_lengths(S["schedule"])  # an engine in this process (one GPU, CPU) is forced too
    _bench_trainer_methods()  # and a trainer in this process has the bench's methods
    threading.Thread(target=_sampler, args=(mem_dir, S["sample_s"]), daemon=True).start()  # an engine in here
    node = NodeSampler(S["sample_s"] * 2).start()
    time.sleep(S["sample_s"] * 3)
    baseline = dict(node.rows[-1]) if node.rows else {}
    phases: list = []
    sess = TrainSession(cfg, rd)
    res.update(sets=sets, plan_kv_cache_gb=cfg.rollout.kv_cache_gb, gpu_memory_gb=cfg.cluster.gpu_memory_gb,
               host_memory_gb=cfg.cluster.host_memory_gb, engines=cfg.cluster.rollout_gpus, rollouts=[])
    try:
        t0 = time.time()
        sess.ensure_at(None)  # trainer ranks, engines, the first weight sync
        res["build_s"] = round(time.time() - t0, 1)
        pids = {"driver": [os.getpid()]}
        for role, handle in (("trainer", sess.trainer), ("engine", sess.engine)):
            pids[role] = list(getattr(handle.group, "pids", None) or [os.getpid()])
        res["pids"] = pids
        t0 = time.time()
        with H.engine_warm_up(sess, 32):
            pass
        res["engine_warmup_s"] = round(time.time() - t0, 1)
        trainer_group = sess.trainer.group

        def after_offload(moved):  # what each trainer rank keeps beside the engine while it generates
            res["trainer_after_offload"].append({"resident_gib": round((moved or {}).get("resident_bytes", 0) / 2 ** 30, 3),
                                                 "ranks": trainer_group.call("bench_memory_segments")})
        res["trainer_after_offload"] = []
        for name, obj, phase, after in (("collect", sess.collector, "generate", None),
                                        ("train", sess.trainer, "train", None), ("push", sess.weights, "sync", None),
                                        ("offload_state", sess.trainer, "offload", after_offload),
                                        ("reload_state", sess.trainer, "reload", None)):
            _timed(obj, name, phase, phases, after)
        last = 0.0
        for rid in range(S["rollouts"]):
            left = budget_s - (time.time() - t_start)
            if rid and left < 1.15 * last + 20:  # a rollout cut by the section's deadline would lose them all
                res["stopped_early"] = f"no time for rollout {rid} ({left:.0f} s left)"
                break
            t0 = time.time()
            try:
                m = sess.rollout(rid)
            except Exception as e:  # noqa: BLE001 - the memory up to the failure is reported (what explains an OOM)
                traceback.print_exc()
                res.update(status="FAILED", error=f"rollout {rid}: {type(e).__name__}: {e}"[:2000])
                break
            last = time.time() - t0
            row = {k: (round(m[k], 4) if isinstance(m[k], float) else m[k]) for k in KEEP if k in m}
            lengths = scheduled_lengths(S, cfg.train.seed, rid)
            row.update(scheduled_tokens=sum(lengths), scheduled_max=max(lengths))  # what the forced stops give
            row["t0"], row["t1"] = t0, time.time()
            res["rollouts"].append(row)
            print("ROLLOUT", json.dumps(row), flush=True)
    finally:
        sess.close()
        node.stop()
    res["phases"] = [(p, round(a - t_start, 2), round(b - t_start, 2)) for p, a, b in phases]
    res["memory"] = memory_report(S, W, cfg, mem_dir, res["pids"], phases, node.rows, baseline)
    steady = res["rollouts"][1:] or res["rollouts"]
    med = lambda k: round(statistics.median(r[k] for r in steady), 3) if steady and k in steady[0] else None  # noqa: E731
    res["steady"] = {"rollouts": len(steady), **{k: med(k) for k in (
        "step_time_s", "generate_time_s", "train_time_s", "optimizer_step_s", "optimizer_host_adam_s",
        "optimizer_transfer_wait_s", "weight_sync_s", "train_rollout_logp_absdiff", "response_len_mean",
        "train_tokens", "rollout_tok_s", "train_tok_s")}}
    if res["steady"]["train_time_s"] is not None and res["steady"]["optimizer_step_s"] is not None:
        st = res["steady"]
        st["train_without_optimizer_s"] = round(st["train_time_s"] - st["optimizer_step_s"], 3)
    return res


def scheduled_lengths(S, seed: int, rollout: int) -> list[int]:
    """The keyed schedule's response length of every sample of a rollout (keys: runtime/rollout/base.py
    keyed_requests); a sample ends there, or earlier where the random model samples its stop token."""
    import torch

    from runtime.rollout.base import sample_key
    from runtime.rollout.keyed_sampling import sample_key_hash
    keys = torch.tensor([sample_key(seed, rollout, i, j) for i in range(S["prompts"]) for j in range(S["samples"])],
                        dtype=torch.long)
    return rollout_bench.lengths_for_hashes(S["schedule"], sample_key_hash(keys))


def _samples(mem_dir: Path) -> dict[int, list[dict]]:
    out = {}
    for f in mem_dir.glob("*.jsonl"):
        if f.name.endswith(".calls.jsonl"):
            continue
        rows = []
        for line in f.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:  # the last line of a killed process
                pass
        out[int(f.stem)] = rows
    return out


def _call_rows(mem_dir: Path, pid: int) -> list[dict]:
    f = mem_dir / f"{pid}.calls.jsonl"
    return [json.loads(line) for line in f.read_text().splitlines() if line.strip()] if f.exists() else []


def _in(rows, windows, key):
    """Values of `key(row)` for rows whose sampling interval overlaps one of `windows`."""
    return [v for r in rows if any(a - 1.0 < r["t"] < b + 1.0 for a, b in windows) for v in [key(r)] if v is not None]


def memory_report(S, W: Path, cfg, mem_dir: Path, pids: dict, phases: list, node_rows: list, baseline: dict) -> dict:
    """Measured memory by process and phase against the plan's terms (GiB)."""
    from runtime.plan.memory import GIB, estimate_for_config
    from runtime.plan.summary import model_config_for_plan
    hf_config, _ = model_config_for_plan(str(W / "hf"))
    est = estimate_for_config(cfg, hf_config)
    samples = _samples(mem_dir)
    g = lambda x: None if x is None else round(x / GIB, 2)  # noqa: E731
    win = {p: [(a, b) for q, a, b in phases if q == p] for p in ("generate", "train", "sync")}
    # steady windows: after the first rollout's train (its first step allocates Adam's moments)
    first_train_end = min((b for q, a, b in phases if q == "train"), default=0)
    steady = {p: [(a, b) for a, b in w if a >= first_train_end] or w for p, w in win.items()}

    def cuda(row, field):
        c = row.get("cuda") or {}
        return max((v[field] for v in c.values() if v[field] is not None), default=None)

    procs = {}
    for role in ("trainer", "engine"):
        for i, pid in enumerate(pids.get(role, [])):
            rows = samples.get(pid, [])
            def peak(p, rows=rows):
                return g(max(_in(rows, win[p], lambda r: cuda(r, 0)), default=None))

            def median(p, k, rows=rows):
                vals = _in(rows, steady[p], k)
                return g(statistics.median(vals)) if vals else None
            calls = _call_rows(mem_dir, pid)
            procs[f"{role}{i}"] = {
                "pid": pid,
                # a trainer rank: each call's own peak (the first train call also makes the step's lasting buffers)
                "cuda_peak_by_phase": {p: (g(max(c["peak"] for c in calls if c["phase"] == p))
                                           if any(c["phase"] == p for c in calls) else peak(p)) for p in win},
                "cuda_allocated_median_by_phase": {p: median(p, lambda r: cuda(r, 1)) for p in win},
                # reserved beyond allocated: blocks the allocator keeps, which another process on the GPU cannot use
                "cuda_reserved_median_by_phase": {p: median(p, lambda r: cuda(r, 2)) for p in win},
                "rss_median_by_phase": {p: median(p, lambda r: r.get("vmrss")) for p in win},
                "rss_hwm": g(max((r.get("vmhwm", 0) for r in rows), default=None))}
    b = est["bytes"]
    plan = {k: round(v / GIB, 2) for k, v in b.items() if isinstance(v, int)}
    t0 = procs.get("trainer0", {})
    e0 = procs.get("engine0", {})
    compare = {
        # the trainer alone on a GPU, by phase
        "trainer_weights (generating, state off)": (t0.get("cuda_allocated_median_by_phase", {}).get("generate"),
                                                     plan["weights"]),
        "trainer_training_peak (weights+grads+activations)": (
            t0.get("cuda_peak_by_phase", {}).get("train"),
            round((b["weights"] + b["grads"] + b["activations"]) / GIB, 2)),
        "trainer_sync_peak (weights+grads+TP gather)": (t0.get("cuda_peak_by_phase", {}).get("sync"),
                                                          round((b["weights"] + b["grads"] + b["sync_gather"]) / GIB, 2)),
        "engine_generating_peak (weights+KV+rollout extra)": (
            e0.get("cuda_peak_by_phase", {}).get("generate"),
            round((b["engine_weights"] + b["kv_cache"] + b["rollout_activations"]) / GIB, 2)),
        "engine_training (weights, KV released)": (e0.get("cuda_allocated_median_by_phase", {}).get("train"),
                                                   plan["engine_weights"]),
    }
    smi = [r["gpu_used"] for r in node_rows if r.get("gpu_used")]
    per_gpu_footprint = {d: g(max(r.get(d, 0) for r in smi)) for d in (smi[0] if smi else {})}
    host_used = [r["host_used"] for r in node_rows]
    host = est["host"] or {}
    report = {
        "plan": {**plan, "host": {k: (round(v, 2) if isinstance(v, float) else v) for k, v in host.items()
                                  if k != "bytes"}},
        "processes": procs,
        "terms_measured_vs_plan_GiB": {k: {"measured": m, "plan": p, "ratio": None if not m or not p else round(m / p, 3)}
                                       for k, (m, p) in compare.items()},
        "gpu_footprint_peak_GiB (nvidia-smi)": per_gpu_footprint,
        "gpu_plan_total_GiB": round(est["total"], 2),
        "host_node_peak_used_GiB": g(max(host_used, default=None)),
        "host_node_baseline_used_GiB": g(baseline.get("host_used")),
        "host_plan_total_GiB": round(host.get("total", 0.0), 2),
    }
    # each trainer rank's resident memory once Adam's moments exist vs the plan's per-rank host optimizer
    per_rank = host.get("per_rank_bytes")
    if per_rank:
        from runtime.plan.host_memory import PROCESS_BYTES
        for name, p in procs.items():
            if name.startswith("trainer"):
                rss = p["rss_median_by_phase"].get("generate")
                report["terms_measured_vs_plan_GiB"][f"{name}_rss (host optimizer + process)"] = {
                    "measured": rss, "plan": g(per_rank + PROCESS_BYTES),
                    "ratio": None if not rss else round(rss / ((per_rank + PROCESS_BYTES) / GIB), 3)}
    return report


# ---- resume ---------------------------------------------------------------------------------------------

def _resume_batch(S, vocab: int, seed: int):
    import torch

    from runtime.trainer.batch import TrainBatch
    g = torch.Generator().manual_seed(seed)
    n, p, r = S["resume_samples"], S["resume_prompt"], S["resume_response"]
    tokens = [torch.randint(3, vocab, (p + r - (i % 4) * (r // 8),), generator=g).tolist() for i in range(n)]
    masks = [[1] * (len(t) - p) for t in tokens]
    return TrainBatch(tokens, [p] * n, torch.randn(n, generator=g).tolist(), masks,
                      [(-torch.rand(len(m), generator=g) * 4).tolist() for m in masks])


def _tp_replica_drift(masters_dir: Path, names: list[str]) -> dict:
    """How far each rank's copy of the tensor-parallel replicas (norms) is from rank 0's, which the checkpoint
    keeps: a replica that drifted loads as rank 0's."""
    import torch
    files = sorted(masters_dir.glob("rank*.pt"), key=lambda f: int(f.stem[4:]))
    if len(files) < 2 or not names:
        return {"ranks": len(files), "max_abs_diff": 0.0, "tensors_differing": 0}
    # memory-mapped: only the replicas (norms) are read of each rank's whole masters
    ref = torch.load(files[0], weights_only=True, mmap=True)
    diffs = {}
    for f in files[1:]:
        other = torch.load(f, weights_only=True, mmap=True)
        for n in names:
            diffs[f"{f.stem}:{n}"] = float((other[n] - ref[n]).abs().max())
    return {"ranks": len(files), "tensors": len(names), "max_abs_diff": max(diffs.values()),
            "tensors_differing": sum(v != 0 for v in diffs.values())}


def sec_resume(S, W: Path) -> dict:
    """Save -> resume -> next update on the depth-truncated model (module doc)."""
    import torch
    import yaml

    from runtime.config import config_with_overrides
    from runtime.mcore import env as menv
    from runtime.mcore.convert import save_model_torch_dist
    from runtime.placement.cluster import Cluster

    t_start = time.time()
    R = W / "resume"
    deterministic = os.environ.get(ENV_DETERMINISTIC, "true") == "true"
    shutil.rmtree(R, ignore_errors=True)
    (R / "hf").mkdir(parents=True)
    cfg_dict = model_config(S, S["resume_layers"])
    hf_config = hf_config_of(cfg_dict)
    hf_config.architectures = ["Glm4ForCausalLM"]
    hf_config.save_pretrained(R / "hf")
    menv.init_parallel(device=S["device"])
    gpt = menv.build_gpt_model(hf_config, dtype=torch.bfloat16, device=S["device"], init_weights=True)
    params = sum(p.numel() for p in gpt.parameters())
    save_model_torch_dist(gpt, R / "td")
    del gpt
    if S["device"] == "cuda":
        torch.cuda.empty_cache()
    os.environ[ENV_METHODS] = "1"
    tree = yaml.safe_load(CONFIG.read_text())
    sets = [f"train.lr={RESUME_LR}", "cluster.backend=local", f"cluster.device={S['device']}",
            f"cluster.trainer_gpus={S['resume_tp'] if S['device'] == 'cuda' else 0}", "cluster.rollout_gpus=0",
            f"train.tensor_parallel={S['resume_tp']}",
            "cluster.host_memory_gb=null", "cluster.gpu_memory_gb=null", f"data.max_prompt_len={S['max_prompt_len']}",
            f"rollout.max_new_tokens={S['schedule']['max_new']}", *S["sets"],
            f"train.deterministic={str(deterministic).lower()}"]
    batches = [_resume_batch(S, hf_config.vocab_size, s) for s in range(3)]
    res: dict = {"name": "resume", "layers": S["resume_layers"], "tp": S["resume_tp"], "params": params, "lr": RESUME_LR,
                 "deterministic": deterministic,
                 "bound_per_update": 1e-2 * RESUME_LR, "samples_per_update": len(batches[0])}

    def trainer(on_host: bool):
        cfg = config_with_overrides(tree, sets + [f"train.optimizer_on_host={str(on_host).lower()}"], "bench")
        return Cluster(cfg).trainer(in_subprocesses=True, hf_dir=str(R / "hf"), init_checkpoint=str(R / "td"),
                                    train=cfg.train, algorithm=cfg.algorithm, temperature=1.0).group

    ckpt, m2, m3, m3r = R / "ckpt@2", R / "masters@2", R / "masters@3", R / "masters@3-rerun"
    a = trainer(True)
    try:
        res["unbroken"] = [a.call("train", b)[0] for b in batches[:2]]
        t0 = time.time()
        a.call("save", str(ckpt))
        res["save_s"] = round(time.time() - t0, 1)
        replicated = a.call("bench_save_masters", str(m2))[0]["tp_replicated"]
        res["unbroken"].append(a.call("train", batches[2])[0])
        a.call("bench_save_masters", str(m3))
        # the same trainer loads the checkpoint and takes the 3rd update again: it and each fresh trainer below
        # start that update from one loaded state, so what separates them is the GPU's run-to-run noise alone,
        # while a loaded state unlike the saved one would separate both from the unbroken run
        a.call("load", str(ckpt))
        rerun_at_load = a.call("bench_masters_vs", str(m2))
        rerun = a.call("train", batches[2])[0]
        rerun_after = a.call("bench_masters_vs", str(m3))
        a.call("bench_save_masters", str(m3r))
    finally:
        a.kill()
    res["tp_replica_drift"] = _tp_replica_drift(m2, replicated)
    res["rerun"] = {"masters_at_load_bitwise": all(r["bitwise_equal"] for r in rerun_at_load),
                    "at_load": rerun_at_load, "next_update_max_abs_diff": max(r["max_abs_diff"] for r in rerun_after),
                    "grad_norm": rerun["grad_norm"], "train_time_s": rerun.get("train_time_s"), "per_rank": rerun_after}
    res["checkpoint_GiB"] = round(sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file()) / 2**30, 2)
    for name, on_host in S["resumed"]:
        grp = trainer(on_host)
        try:
            t0 = time.time()
            grp.call("load", str(ckpt))
            load_s = time.time() - t0
            at_load = grp.call("bench_masters_vs", str(m2))
            metrics = grp.call("train", batches[2])[0]
            after = grp.call("bench_masters_vs", str(m3))
            after_rerun = grp.call("bench_masters_vs", str(m3r))
        finally:
            grp.kill()
        worst = max(r["max_abs_diff"] for r in after)
        noise = max(r["max_abs_diff"] for r in after_rerun)
        res[name] = {"load_s": round(load_s, 1), "masters_at_load_bitwise": all(r["bitwise_equal"] for r in at_load),
                     "at_load": at_load, "master_devices": sorted({d for r in at_load for d in r["devices"]}),
                     "next_update_max_abs_diff": worst, "within_contract": worst <= 1e-2 * RESUME_LR,
                     "vs_rerun_max_abs_diff": noise, "within_noise": worst <= max(1e-2 * RESUME_LR, 2 * noise),
                     "grad_norm": metrics["grad_norm"], "unbroken_grad_norm": res["unbroken"][2]["grad_norm"],
                     "optimizer_step_s": metrics.get("optimizer_step_s"), "train_time_s": metrics.get("train_time_s"),
                     "per_rank": after}
    for f in (m2, m3, m3r, ckpt):
        shutil.rmtree(f, ignore_errors=True)
    res["unbroken"] = [{k: m.get(k) for k in ("loss", "grad_norm", "train_time_s", "optimizer_step_s",
                                              "optimizer_host_adam_s", "optimizer_transfer_wait_s")}
                       for m in res["unbroken"]]
    # exact where the path is deterministic (the CPU); on a GPU, whose backward is not run-to-run
    # deterministic, the resumed update is as far from the unbroken one as two updates from one loaded state
    res["ok"] = res["rerun"]["masters_at_load_bitwise"] and all(
        res[n]["masters_at_load_bitwise"] and (res[n]["within_contract"] or res[n]["within_noise"])
        for n, _ in S["resumed"])
    res["total_s"] = round(time.time() - t_start, 1)
    return res


# ---- driver ---------------------------------------------------------------------------------------------

def summarize(S, res: dict, env: dict | None = None) -> dict:
    info = env or H.env_info(dict(S, vocab=0))
    info.update(H.gpu_count(S), host_memory_GiB=round(H.host_meminfo()["MemTotal"] / 2**30, 1))
    return {**H.summary_head("glm9b_host_optimizer", info), "config": str(CONFIG.relative_to(ROOT)),
            "shapes": {k: v for k, v in S.items() if k != "model"}, "sections": res}


def print_table(summary: dict) -> None:
    s = summary["sections"]
    st = (s.get("stage") or {}).get("steady") or {}
    mem = (s.get("stage") or {}).get("memory") or {}
    rows = [("stage step s (generate / train w/o opt / host optimizer / weight sync)",
             f"{st.get('step_time_s')} ({st.get('generate_time_s')} / {st.get('train_without_optimizer_s')} / "
             f"{st.get('optimizer_step_s')} / {st.get('weight_sync_s')})"),
            ("host optimizer: AdamW s / waiting on transfers s",
             f"{st.get('optimizer_host_adam_s')} / {st.get('optimizer_transfer_wait_s')}"),
            ("engine vs trainer log-prob gap (mean |d|, sampled tokens)", st.get("train_rollout_logp_absdiff")),
            ("GPU footprint peak GiB (nvidia-smi) vs plan", f"{mem.get('gpu_footprint_peak_GiB (nvidia-smi)')} vs "
                                                            f"{mem.get('gpu_plan_total_GiB')}"),
            ("host node peak GiB vs plan", f"{mem.get('host_node_peak_used_GiB')} vs {mem.get('host_plan_total_GiB')}")]
    for k, v in (mem.get("terms_measured_vs_plan_GiB") or {}).items():
        rows.append((f"  {k}", f"{v['measured']} vs {v['plan']} (x{v['ratio']})"))
    r = s.get("resume") or {}
    if "rerun" in r:
        rows.append(("resume rerun (same trainer): masters bitwise at load / next update max |d| vs unbroken / s",
                     f"{r['rerun']['masters_at_load_bitwise']} / {r['rerun']['next_update_max_abs_diff']:.3g} / "
                     f"{r['rerun'].get('train_time_s')} (deterministic kernels: {r.get('deterministic')})"))
        d = r["tp_replica_drift"]
        rows.append(("resume TP replicas vs rank 0 at save: max |d| / tensors differing",
                     f"{d['max_abs_diff']:.3g} / {d['tensors_differing']}"))
    for n in ("resumed_host", "resumed_gpu_optimizer"):
        if n in r:
            rows.append((f"resume {n}: masters bitwise at load / next update max |d| (bound) / vs rerun",
                         f"{r[n]['masters_at_load_bitwise']} / {r[n]['next_update_max_abs_diff']:.3g} "
                         f"({r['bound_per_update']:.0e}) / {r[n].get('vs_rerun_max_abs_diff', float('nan')):.3g} "
                         f"{r[n]['master_devices']}"))
            worst = {k: f"{v:.3g}" for a in r[n].get("at_load", []) for k, v in a["worst3"].items() if v}
            if worst:
                rows.append((f"  {n} at load, worst", str(worst)[:200]))
    H.print_pairs(rows + H.failed_rows(s))


def main(argv=None) -> int:
    ap = H.parser(__doc__, "glm9b_host_optimizer", 575.0, cpu_help="tiny GLM4 on CPU (CI smoke)", sections=SECTIONS,
                  merge="OUT dirs of earlier calls: one summary of their sections")
    ap.add_argument("--set", dest="sets", action="append", default=None, help="config override for the stage")
    ap.add_argument("--rollouts", type=int, default=None, help="at most this many rollouts in the stage")
    ap.add_argument("--resume-tp", type=int, default=None, help="the resume section's TP size (GPU default 2)")
    ap.add_argument("--resume-layers", type=int, default=None, help="the resume section's depth (GPU default 4)")
    ap.add_argument("--deterministic", choices=("true", "false"), default="true",
                    help="train.deterministic (default true, as the product's: torch's deterministic kernels while "
                         "the trainer computes)")
    a = ap.parse_args(argv)
    S = dict(SHAPES["cpu" if a.cpu else "gpu"])
    if a.rollouts:
        S["rollouts"] = a.rollouts
    for key in ("resume_tp", "resume_layers"):
        if getattr(a, key) is not None:
            S[key] = getattr(a, key)
    sets = S["sets"] + (a.sets or [])
    out, W = H.places(a, "glm9b_host_optimizer")
    # this call's flag, inherited by the section processes (which keep it) and the ranks they spawn
    os.environ.setdefault(ENV_DETERMINISTIC, a.deterministic)
    sets.append(f"train.deterministic={os.environ[ENV_DETERMINISTIC]}")
    H.prepare_env()
    env = None
    if a.merge:
        res, env = H.merge_results(a.merge, keep="ok"), H.merged_env(a.merge, "glm9b_host_optimizer")
    elif a.section:
        left = H.section_budget(a)
        fn = {"setup": sec_setup, "stage": lambda S, W: sec_stage(S, W, sets, left - 20), "resume": sec_resume}[a.section]
        return H.section_exit(H.run_section(a.section, S, W, out, fn))
    else:
        sections = H.sections_of(a, SECTIONS)
        if "stage" in sections and "setup" not in sections and not (W / "td" / "metadata.json").exists():
            sections.insert(sections.index("stage"), "setup")  # a fresh machine: the model first
            print(f"no model under {W}: running setup first", flush=True)
        H.clear_results(out)
        extra = (("--cpu",) if a.cpu else ()) + H.set_args(a.sets or [])
        extra += ("--rollouts", str(S["rollouts"]), "--resume-tp", str(S["resume_tp"]),
                  "--resume-layers", str(S["resume_layers"]))
        H.run_in_turn(Path(__file__), sections, W, out, a.deadline, SECTION_MAX_S, extra)
        res = H.read_results(out)
    return H.finish(summarize(S, res, env), out, "glm9b_host_optimizer", a.results_dir, a.cpu, print_table)


if __name__ == "__main__":
    sys.exit(main())
