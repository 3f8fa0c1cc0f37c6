"""Peak GPU memory of the shipped Qwen3-0.6B DAPO config, measured term by term against
``runtime/plan/memory.py``'s estimate (the plan is only useful if it lands near the measured peak).

    python bench/memory_check.py                  # CUDA (H100): configs/qwen3-0.6b-dapo.yaml shapes, < 4 min
    python bench/memory_check.py --device cpu     # smoke: tiny model on CPU, same code paths, seconds
    python bench/memory_check.py --full-step      # all 64 micro-batches of the optimizer step (slower)

What runs, in one process, in the order ``cluster.backend: local`` builds a run
(``runtime.grpo.session.TrainSession``): a random model of the config's model shape (bench/gpu_grpo.py's
setup: HF checkpoint, tokenizer, torch_dist conversion, in a child process), then

1. the trainer (``MegatronTrainer`` with the config's train/algorithm sections);
2. the engine (``rollout/factory.make_engine``: BuiltinEngine, fast path on CUDA, its production
   ``max_batch_size`` and KV policy) and a weight sync;
3. one rollout's generate: the first call's rows (dynamic sampling's over-sampled prompts x
   samples), prompts of ``max_prompt_len`` random tokens and the config's ``max_new_tokens``, so the
   KV cache is allocated exactly as in production. The decode is cut short by stop tokens (a set of
   ids whose total probability under the random model gives ~``--decode-mean`` tokens per row): the
   cache is preallocated, so its size, and the peak, do not depend on how many steps run;
4. the optimizer step on a replayed synthetic batch at full length (every sample
   ``max_prompt_len + max_new_tokens`` tokens, the worst case) at the config's micro-batch: a first
   step of one micro-batch (Adam's moments are made at the first step) and a steady step of
   ``--train-micro-batches`` micro-batches (default 2; every micro-batch frees its activations after
   its backward, so the peak is the same as over all 64; ``--full-step`` runs the whole step);
5. if the config's micro-batch runs out of memory, the same at the largest micro-batch the estimate
   says fits, and the estimate for that layout;
6. activation points: one micro-batch at a few (micro-batch, length) pairs, estimate vs measured.

Printed: the estimate lines first (so a failure still yields them), then a table term by term,
estimate vs measured, and the ratio of the totals (estimate minus its CUDA-context overhead vs
``torch.cuda.max_memory_allocated``). JSON goes to ``--out`` (default
``bench/results/memory_check_<device>_<date>.json``).
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import re
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
BENCH = Path(__file__).resolve().parent
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import gpu_grpo  # noqa: E402  (its setup section builds the random model and its torch_dist copy)

GIB = 2**30
DEFAULT_CONFIG = ROOT / "configs" / "qwen3-0.6b-dapo.yaml"
# CPU smoke: the shipped config shrunk to the tiny model (same sections, same code paths)
CPU_OVERRIDES = ["data.max_prompt_len=12", "rollout.max_new_tokens=8", "rollout.rollout_batch_size=2",
                 "rollout.n_samples_per_prompt=2", "train.global_batch_size=4", "train.micro_batch_size=2",
                 "model.dtype=float32"]
GPU_POINTS = "1x9216,2x4608,4x2304"
CPU_POINTS = "1x20,2x10"


def _torch():
    import torch
    return torch


class Meter:
    """Allocator statistics on CUDA; None everywhere on CPU (there the run only checks the code paths)."""

    def __init__(self, device: str):
        self.cuda = device == "cuda"
        self.torch = _torch()

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize()

    def allocated(self):
        return self.torch.cuda.memory_allocated() if self.cuda else None

    def reserved(self):
        return self.torch.cuda.memory_reserved() if self.cuda else None

    def peak(self):
        return self.torch.cuda.max_memory_allocated() if self.cuda else None

    def peak_reserved(self):
        return self.torch.cuda.max_memory_reserved() if self.cuda else None

    def reset(self):
        if self.cuda:
            self.sync()
            self.torch.cuda.reset_peak_memory_stats()

    def free_total(self):
        return self.torch.cuda.mem_get_info() if self.cuda else (None, None)

    def cleanup(self):
        gc.collect()
        if self.cuda:
            self.torch.cuda.empty_cache()


def gib(x):
    return None if x is None else round(x / GIB, 3)


def _diff(a, b):
    return None if a is None or b is None else a - b


def _oom_types():
    torch = _torch()
    return tuple(t for t in (getattr(torch, "OutOfMemoryError", None), getattr(torch.cuda, "OutOfMemoryError", None),
                             MemoryError) if t is not None)


# ---- the model and the config -----------------------------------------------------------------------

def shapes(device: str) -> dict:
    """gpu_grpo's shapes (GPU: Qwen3-0.6B's) with a small data set for its setup section."""
    S = dict(gpu_grpo.SHAPES["gpu" if device == "cuda" else "cpu"])
    S.update(prompt_len=8, prompts=2, rollouts=1)  # setup prepares a few short prompts; ours are synthetic
    return S


def hf_config_of(S):
    """The HF config gpu_grpo's setup writes (checked against the saved one after setup)."""
    from transformers import Qwen3Config
    cfg = Qwen3Config(vocab_size=S["vocab"], hidden_size=S["hidden"], intermediate_size=S["ffn"],
                      num_hidden_layers=S["layers"], num_attention_heads=S["heads"], num_key_value_heads=S["kv_heads"],
                      head_dim=S["head_dim"], hidden_act="silu", max_position_embeddings=40960, rms_norm_eps=1e-6,
                      tie_word_embeddings=True, attention_bias=False,
                      rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    cfg.architectures = ["Qwen3ForCausalLM"]
    return cfg


def load_cfg(path: str, overrides: list[str], device: str):
    from runtime.config import load_config
    extra = (CPU_OVERRIDES if device == "cpu" else []) + [f"cluster.device={device}", "cluster.backend=local"]
    return load_config(path, extra + list(overrides))


def estimate(cfg, hf_config, gpu_gib: float, device: str, micro_batch: int | None = None) -> dict:
    from runtime.plan.memory import estimate_for_config
    if micro_batch is not None and micro_batch != cfg.train.micro_batch_size:
        cfg = cfg.model_copy(deep=True)
        cfg.train.micro_batch_size = micro_batch
    return estimate_for_config(cfg, hf_config, gpu_mem_gb=gpu_gib, device=device)


def _short_device(name: str) -> str:
    m = re.search(r"\b([A-Z]{1,2}\d{2,4}[A-Za-z]*)\b", name)
    return m.group(1) if m else re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_") or "gpu"


# ---- measurement ------------------------------------------------------------------------------------

def _synthetic_batch(n: int, prompt: int, response: int, vocab: int, seed: int):
    torch = _torch()
    from runtime.trainer.batch import TrainBatch
    g = torch.Generator().manual_seed(seed)
    toks = torch.randint(3, vocab, (n, prompt + response), generator=g).tolist()
    lp = -float(torch.log(torch.tensor(float(vocab))))
    return TrainBatch(tokens=toks, prompt_lens=[prompt] * n, advantages=[1.0 if i % 2 else -1.0 for i in range(n)],
                      loss_masks=[[1] * response] * n, rollout_logprobs=[[lp] * response] * n)


def _train_once(M: Meter, tr, batch, mb: int) -> dict:
    """One trainer.train call: allocated before/after, peak (allocated and reserved), time; OOM recorded."""
    tr.train_cfg["micro_batch_size"] = mb
    M.reset()
    before = M.allocated()
    t0 = time.time()
    rec = {"samples": len(batch), "micro_batch": mb, "micro_batches": -(-len(batch) // mb)}
    try:
        out = tr.train(batch)
        M.sync()
        rec.update(ok=True, loss=out.get("loss"), grad_norm=out.get("grad_norm"))
    except _oom_types() as e:
        rec.update(ok=False, oom=True, error=f"{type(e).__name__}: {str(e)[:400]}")
    rec.update(seconds=round(time.time() - t0, 2), allocated_before=before, allocated_after=M.allocated(),
               peak=M.peak(), peak_reserved=M.peak_reserved())
    if not rec["ok"]:
        # an OOM inside the compiled log-prob math switches it to eager for good (logprobs._call): undo
        # that, so the next measurement runs the production (compiled) path again
        from runtime.trainer import logprobs
        logprobs._FNS.clear()
        M.cleanup()
        rec["allocated_after_cleanup"] = M.allocated()
    return rec


def measure_train(M: Meter, tr, cfg, mb: int, n_steady: int, vocab: int, seed: int = 0) -> dict:
    P, R = cfg.data.max_prompt_len, cfg.rollout.max_new_tokens
    first = _train_once(M, tr, _synthetic_batch(mb, P, R, vocab, seed), mb)
    res = {"micro_batch": mb, "seq_len": P + R, "first_step": first}
    if not first["ok"]:
        return res
    steady = _train_once(M, tr, _synthetic_batch(mb * n_steady, P, R, vocab, seed + 1), mb)
    res["steady_step"] = steady
    if steady["ok"] and M.cuda:
        res["activations"] = steady["peak"] - steady["allocated_before"]
    return res


def optimizer_state_bytes(tr) -> tuple[int, int]:
    """(fp32 master copies, Adam moments) held by megatron's optimizer(s), from the tensors themselves."""
    model_ids = {id(p) for p in tr.model.parameters()}
    opts = getattr(tr.optimizer, "chained_optimizers", None) or [tr.optimizer]
    master = moments = 0
    for opt in opts:
        for group in opt.param_groups:
            for p in group["params"]:
                if id(p) not in model_ids:
                    master += p.numel() * p.element_size()
        inner = getattr(opt, "optimizer", opt)
        for st in getattr(inner, "state", {}).values():
            for k, v in st.items():
                if k != "step" and hasattr(v, "numel"):
                    moments += v.numel() * v.element_size()
    return master, moments


def _unique_bytes(tensors) -> int:
    seen = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def measure(cfg, S, W: Path, args, est: dict, hf_config, log) -> dict:
    torch = _torch()
    from runtime.plan.memory import first_rollout_rows
    from runtime.rollout.base import SampleRequest, SamplingParams
    from runtime.rollout.factory import make_engine
    from runtime.trainer.megatron_trainer import MegatronTrainer

    dev = args.device
    M = Meter(dev)
    res: dict = {}
    if M.cuda:
        torch.cuda.init()
        torch.zeros(1, device="cuda")  # the context
        free, total = M.free_total()
        res["gpu_total"] = total
        res["context_and_others"] = total - free  # before any tensor of ours: CUDA context + other processes
    M.reset()
    dtype = S["dtype"]

    # 1. trainer
    t0 = time.time()
    tr = MegatronTrainer(hf_dir=str(W / "hf"), init_checkpoint=str(W / "td"), train=cfg.train.model_dump(),
                         algorithm=cfg.algorithm.model_dump(), temperature=cfg.rollout.temperature,
                         device=dev, dtype=dtype)
    M.sync()
    master, _ = optimizer_state_bytes(tr)
    res["trainer"] = {
        "build_s": round(time.time() - t0, 1), "allocated": M.allocated(),
        "weights": sum(p.numel() * p.element_size() for p in tr.model.parameters()),
        "grads": sum(p.main_grad.numel() * p.main_grad.element_size()
                     for p in tr.model.parameters() if getattr(p, "main_grad", None) is not None),
        "optimizer_master": master, "chunked_logprobs": tr._chunked_logprobs_enabled(),
        "core_attention": type(tr.model.decoder.layers[0].self_attention.core_attention).__name__,
        "optimizer": type(tr.optimizer).__name__}
    log(f"trainer built in {res['trainer']['build_s']} s: allocated {gib(M.allocated())} GiB")

    # 2. engine (the production factory: max_batch_size = samples per rollout, default KV policy) + weight sync
    t0 = time.time()
    a = M.allocated()
    eng = make_engine(cfg=cfg, model_dir=str(W / "hf"), device=dev, dtype=dtype)
    M.sync()
    res["engine"] = {"build_s": round(time.time() - t0, 1), "allocated_delta": _diff(M.allocated(), a),
                     "weights": _unique_bytes(eng.model.parameters()), "decode_path": eng.health()["decode_path"],
                     "max_batch_size": eng.max_batch_size}
    eng.update_weights(tr.hf_weights(to_cpu=False), 1)
    M.sync()
    free, _ = M.free_total()
    res["before_rollout"] = {"allocated": M.allocated(), "reserved": M.reserved(), "free": free}
    log(f"engine built in {res['engine']['build_s']} s ({res['engine']['decode_path']} decode); before the rollout: "
        f"allocated {gib(M.allocated())} GiB, reserved {gib(M.reserved())} GiB, free {gib(free)} GiB")

    # 3. one rollout's generate (production KV allocation; decode cut short by stop tokens)
    r = cfg.rollout
    rows = first_rollout_rows(cfg)
    V = S["vocab"]
    g = torch.Generator().manual_seed(1)
    prompt_ids = torch.randint(3, V, (rows, cfg.data.max_prompt_len), generator=g).tolist()
    reqs = [SampleRequest(prompt_ids=p, key=(11, 0, i // r.n_samples_per_prompt, i % r.n_samples_per_prompt))
            for i, p in enumerate(prompt_ids)]
    k = max(1, V // max(args.decode_mean, 1))
    sp = SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_new_tokens=r.max_new_tokens,
                        stop_token_ids=list(range(3, 3 + k)))
    M.reset()
    a = M.allocated()
    t0 = time.time()
    rollout: dict = {"rows": rows, "prompt_len": cfg.data.max_prompt_len, "max_new_tokens": r.max_new_tokens,
                     "stop_ids": k}
    try:
        out = eng.generate(reqs, sp)
        M.sync()
        lens = [len(x.response_ids) for x in out]
        rollout.update(ok=True, new_tokens=sum(lens), len_mean=round(sum(lens) / len(lens), 1), len_max=max(lens))
    except _oom_types() as e:
        rollout.update(ok=False, error=f"{type(e).__name__}: {str(e)[:400]}")
    fast = getattr(eng, "fast", None)
    rollout.update(seconds=round(time.time() - t0, 1), allocated_before=a, allocated_after=M.allocated(),
                   peak=M.peak(), peak_reserved=M.peak_reserved())
    if fast is not None:
        st = fast.stats
        rollout.update(kv_cache=fast.kv_cache_bytes(), slots=fast.slots, slot_len=fast.slot_len,
                       decode_steps=st.get("decode_steps"), graphs=st.get("graphs"), compiled=st.get("compiled"),
                       cuda_graphs=st.get("cuda_graphs"), attention=st.get("attention"),
                       fallbacks=st.get("fallbacks"))
        if M.cuda:
            rollout["extra"] = rollout["peak"] - a - rollout["kv_cache"]
    res["rollout"] = rollout
    log(f"rollout: {rows} rows in {rollout['seconds']} s, {rollout.get('slots')} slots x {rollout.get('slot_len')} "
        f"tokens, KV {gib(rollout.get('kv_cache'))} GiB, peak {gib(rollout['peak'])} GiB"
        + ("" if rollout["ok"] else f"; FAILED: {rollout['error']}"))

    # 4. the optimizer step at the config's micro-batch, full length
    mb = cfg.train.micro_batch_size
    n_steady = (cfg.train.global_batch_size // mb) if args.full_step else args.train_micro_batches
    res["train"] = measure_train(M, tr, cfg, mb, n_steady, V)
    res["train"]["adam_state_allocated"] = (_diff(res["train"]["first_step"]["allocated_after"],
                                                  res["train"]["first_step"]["allocated_before"])
                                            if res["train"]["first_step"]["ok"] else None)
    log(_train_line(res["train"]))

    # 5. the largest micro-batch the estimate says fits, when the config's does not
    fit_mb = est.get("fit_micro_batch") or 0
    if not _train_ok(res["train"]) and 0 < fit_mb < mb and not args.no_fallback:
        res["train_fit"] = measure_train(M, tr, cfg, fit_mb, n_steady if args.full_step else args.train_micro_batches,
                                         V, seed=5)
        log("at the micro-batch the estimate says fits: " + _train_line(res["train_fit"]))

    if "train_fit" in res and res["train_fit"]["first_step"]["ok"]:
        f = res["train_fit"]["first_step"]
        res["train_fit"]["adam_state_allocated"] = _diff(f["allocated_after"], f["allocated_before"])
    res["trainer"]["optimizer_moments"] = optimizer_state_bytes(tr)[1]  # Adam's state exists after a first step

    # 6. activation points
    res["points"] = []
    for b, s in args.points_list:
        if time.time() - args.t_start > args.deadline:
            res["points"].append({"micro_batch": b, "seq_len": s, "skipped": "deadline"})
            continue
        p = max(1, round(s * cfg.data.max_prompt_len / (cfg.data.max_prompt_len + r.max_new_tokens)))
        rec = _train_once(M, tr, _synthetic_batch(b, p, s - p, V, seed=100 + b), b)
        rec.update(seq_len=s, response_len=s - p)
        if rec["ok"] and M.cuda:
            rec["activations"] = rec["peak"] - rec["allocated_before"]
        res["points"].append(rec)
    M.sync()
    res["final"] = {"allocated": M.allocated(), "reserved": M.reserved()}
    eng.shutdown()
    return res


def _train_ok(t: dict) -> bool:
    return bool(t.get("first_step", {}).get("ok") and t.get("steady_step", {}).get("ok"))


def _train_line(t: dict) -> str:
    f, s = t.get("first_step", {}), t.get("steady_step", {})
    if not f.get("ok"):
        return f"train at micro-batch {t['micro_batch']} x {t['seq_len']}: first step FAILED ({f.get('error')})"
    if not s.get("ok"):
        return f"train at micro-batch {t['micro_batch']} x {t['seq_len']}: steady step FAILED ({s.get('error')})"
    return (f"train at micro-batch {t['micro_batch']} x {t['seq_len']}: first step {f['seconds']} s, steady step "
            f"({s['micro_batches']} micro-batches) {s['seconds']} s, activations {gib(t.get('activations'))} GiB, "
            f"peak {gib(s['peak'])} GiB")


# ---- report ----------------------------------------------------------------------------------------

def compare(est: dict, res: dict, train_key: str) -> dict:
    """Term by term: estimate vs measured (bytes), and the totals' ratio."""
    b = est["bytes"]
    tr, en, ro, t = res.get("trainer", {}), res.get("engine", {}), res.get("rollout", {}), res.get(train_key, {})
    steady = t.get("steady_step", {})
    opt = (tr.get("optimizer_master") or 0) + (tr.get("optimizer_moments") or 0) if tr else None
    peaks = [x for x in (ro.get("peak") if ro.get("ok") else None,
                         steady.get("peak") if steady.get("ok") else None) if x is not None]
    peaks_res = [x for x in (ro.get("peak_reserved") if ro.get("ok") else None,
                             steady.get("peak_reserved") if steady.get("ok") else None) if x is not None]
    measured_total = max(peaks) if len(peaks) == 2 else None
    ctx = res.get("context_and_others")
    rows = [
        ("weights", b["weights"], tr.get("weights"), "trainer parameters' bytes"),
        ("gradients", b["grads"], tr.get("grads"), "DDP main_grad buffers"),
        ("optimizer", b["optimizer"], opt, "fp32 master params + Adam state tensors"),
        ("activations", b["activations"], t.get("activations"), "steady step: peak - allocated before"),
        ("engine weights", b["engine_weights"], en.get("allocated_delta") if en.get("allocated_delta") is not None
         else en.get("weights"), "allocated by building the engine (CPU: its tensors' bytes)"),
        ("KV cache", b["kv_cache"], ro.get("kv_cache"), "StaticDecoder.kv_cache_bytes()"),
        ("rollout extra", b["rollout_activations"], ro.get("extra"), "generate peak - before - KV"),
        ("overhead", b["overhead"], (ctx + max(peaks_res) - measured_total) if ctx is not None and measured_total
         and peaks_res else None, "CUDA context + (peak reserved - peak allocated)"),
    ]
    terms = [{"term": n, "estimate_GiB": gib(e), "measured_GiB": gib(m),
              "ratio": round(e / m, 3) if m else None, "measured_how": how} for n, e, m, how in rows]
    est_alloc = b["total"] - b["overhead"]
    total = {"estimate_GiB": gib(b["total"]), "estimate_without_overhead_GiB": gib(est_alloc),
             "measured_peak_allocated_GiB": gib(measured_total),
             "measured_peak_reserved_GiB": gib(max(peaks_res)) if len(peaks_res) == 2 else None,
             "measured_peak_reserved_plus_context_GiB": gib(max(peaks_res) + ctx) if len(peaks_res) == 2 and ctx else None,
             "ratio": round(est_alloc / measured_total, 3) if measured_total else None}
    total["within_20pct"] = None if total["ratio"] is None else abs(total["ratio"] - 1) <= 0.2
    return {"micro_batch": est["micro_batch_size"], "terms": terms, "total": total,
            "kv_slots": {"estimate": est.get("kv_slots"), "measured": ro.get("slots")},
            "free_at_first_rollout_GiB": {"estimate": gib((est.get("kv") or {}).get("free")),
                                          "measured": gib(res.get("before_rollout", {}).get("free"))}}


def print_table(cmp: dict, est: dict, log) -> None:
    log(f"\nestimate vs measured, micro-batch {cmp['micro_batch']} (GiB):")
    log(f"  {'term':<15}{'estimate':>10}{'measured':>10}{'ratio':>8}   measured as")
    for t in cmp["terms"]:
        m = "-" if t["measured_GiB"] is None else f"{t['measured_GiB']:.2f}"
        r = "-" if t["ratio"] is None else f"{t['ratio']:.2f}"
        log(f"  {t['term']:<15}{t['estimate_GiB']:>10.2f}{m:>10}{r:>8}   {t['measured_how']}")
    tot = cmp["total"]
    m = "-" if tot["measured_peak_allocated_GiB"] is None else f"{tot['measured_peak_allocated_GiB']:.2f}"
    r = "-" if tot["ratio"] is None else f"{tot['ratio']:.3f}"
    log(f"  {'total':<15}{tot['estimate_without_overhead_GiB']:>10.2f}{m:>10}{r:>8}   estimate without overhead vs "
        f"max_memory_allocated (reserved {tot['measured_peak_reserved_GiB']}, + context "
        f"{tot['measured_peak_reserved_plus_context_GiB']}; estimate with overhead {tot['estimate_GiB']})")
    log(f"  KV slots: estimate {cmp['kv_slots']['estimate']}, engine {cmp['kv_slots']['measured']}; "
        f"within ±20%: {tot['within_20pct']}")


def _env(device: str) -> dict:
    S = {"device": device}
    return gpu_grpo.env_info(S)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--config", default=str(DEFAULT_CONFIG))
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="config override, section.key=value")
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/memory_check_<device>_<date>.json)")
    ap.add_argument("--work", default=None, help="scratch dir for the random model (default /tmp/memory_check_<device>)")
    ap.add_argument("--train-micro-batches", type=int, default=2, help="micro-batches of the measured steady step")
    ap.add_argument("--full-step", action="store_true", help="the steady step runs the config's whole global batch")
    ap.add_argument("--decode-mean", type=int, default=64, help="mean response length of the shortened decode")
    ap.add_argument("--points", default=None, help=f"activation points 'BxS,...' (GPU default {GPU_POINTS}; '' none)")
    ap.add_argument("--no-fallback", action="store_true", help="do not re-measure at the micro-batch that fits")
    ap.add_argument("--reuse", action="store_true", help="reuse the work dir's model if it is there")
    ap.add_argument("--deadline", type=float, default=210.0, help="seconds after which the optional points are skipped")
    ap.add_argument("--stage", default=None, help=argparse.SUPPRESS)  # 'setup': the child process
    args = ap.parse_args(argv)
    args.t_start = time.time()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    S = shapes(args.device)
    W = Path(args.work or f"/tmp/memory_check_{args.device}")
    if args.stage == "setup":
        if args.device == "cpu":
            _torch().set_num_threads(1)
        r = gpu_grpo.sec_setup(S, W)
        print("SETUP", json.dumps(r, default=str), flush=True)
        return 0

    lines: list[str] = []

    def log(msg: str = "") -> None:
        print(msg, flush=True)
        lines.append(msg)

    torch = _torch()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --device cpu for the smoke mode", file=sys.stderr)
        return 2
    info = _env(args.device)
    date = datetime.datetime.now(datetime.timezone.utc)
    device_name = info.get("gpu", "cpu")
    out = Path(args.out) if args.out else (
        ROOT / "bench" / "results" / f"memory_check_{_short_device(device_name) if args.device == 'cuda' else 'cpu'}_"
                                     f"{date:%Y-%m-%d}.json")
    cfg = load_cfg(args.config, args.overrides, args.device)
    hf_config = hf_config_of(S)
    gpu_gib = (torch.cuda.get_device_properties(0).total_memory / GIB) if args.device == "cuda" else 80.0
    report: dict = {"benchmark": "memory_check", "date": date.strftime("%Y-%m-%dT%H:%M:%SZ"), "device": device_name,
                    "env": info, "config": str(args.config), "overrides": args.overrides, "shapes": S,
                    "gpu_mem_GiB": round(gpu_gib, 2), "status": "started",
                    "notes": ["The engine's decode is cut short by stop tokens; its KV cache is preallocated at the "
                              "production size before the first step, so the peak does not depend on the steps run.",
                              "The steady train step runs --train-micro-batches micro-batches (default 2), not all of "
                              "the global batch: each micro-batch frees its activations after its backward, so the "
                              "peak over 2 is the peak over all (use --full-step to run them all)."]}

    def dump():
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1, default=str))

    est = estimate(cfg, hf_config, gpu_gib, args.device)
    log(f"config {args.config} ({cfg.name}), device {device_name}, GPU memory {gpu_gib:.2f} GiB")
    from runtime.plan.memory import format_estimate
    for line in format_estimate(est).splitlines():
        log(line)
    report["estimate"] = _est_json(est)
    report["estimate_80GiB_lines"] = format_estimate(estimate(cfg, hf_config, 80.0, args.device)).splitlines()
    dump()

    # the random model, in a child process (conversion starts its own gloo group)
    t0 = time.time()
    if not (args.reuse and (W / "hf" / "config.json").exists() and (W / "td").exists()):
        cmd = [sys.executable, str(Path(__file__).resolve()), "--stage", "setup", "--device", args.device, "--work", str(W)]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if p.returncode != 0:
            report.update(status="FAILED", error="setup: " + (p.stdout[-2000:] + p.stderr[-3000:]))
            dump()
            log(report["error"])
            return 1
    report["setup_s"] = round(time.time() - t0, 1)
    from runtime.plan.memory import param_counts
    from runtime.models import load_hf_config
    saved = load_hf_config(str(W / "hf"))
    assert param_counts(saved) == param_counts(hf_config), "setup wrote another model shape than estimated"
    log(f"random model + torch_dist conversion: {report['setup_s']} s")

    points = args.points if args.points is not None else (GPU_POINTS if args.device == "cuda" else CPU_POINTS)
    args.points_list = [tuple(int(x) for x in p.lower().split("x")) for p in points.split(",") if p.strip()]
    try:
        res = measure(cfg, S, W, args, est, hf_config, log)
    except Exception as e:  # noqa: BLE001 - the estimate is already out; say what broke
        traceback.print_exc()
        report.update(status="FAILED", error=f"{type(e).__name__}: {e}"[:3000])
        dump()
        return 1
    report["measured"] = res
    main_ok = _train_ok(res["train"]) and res["rollout"].get("ok")
    report["comparison"] = compare(est, res, "train")
    print_table(report["comparison"], est, log)
    if "train_fit" in res:
        est_fit = estimate(cfg, hf_config, gpu_gib, args.device, micro_batch=res["train_fit"]["micro_batch"])
        report["estimate_fit"] = _est_json(est_fit)
        report["comparison_fit"] = compare(est_fit, res, "train_fit")
        log(f"\nthe config's micro-batch {cfg.train.micro_batch_size} did not fit (the estimate said "
            f"{'it fits' if est['fits'] else 'so'}); at micro-batch {res['train_fit']['micro_batch']}:")
        print_table(report["comparison_fit"], est_fit, log)
    from runtime.plan.memory import activation_bytes
    pts = []
    for p in res["points"]:
        if p.get("skipped"):
            continue
        e = activation_bytes(hf_config, tp=1, micro_batch_size=p["micro_batch"], seq_len=p["seq_len"],
                             dtype=S["dtype"], device=args.device, response_len=p["response_len"])
        pts.append({"micro_batch": p["micro_batch"], "seq_len": p["seq_len"], "estimate_GiB": gib(e),
                    "measured_GiB": gib(p.get("activations")), "ok": p["ok"],
                    "ratio": round(e / p["activations"], 3) if p.get("activations") else None})
    report["activation_points"] = pts
    if pts:
        log("\nactivations of one micro-batch (GiB): " + "; ".join(
            f"{p['micro_batch']}x{p['seq_len']}: est {p['estimate_GiB']} / measured {p['measured_GiB']}"
            f" ({p['ratio']})" for p in pts))
    report["status"] = "ok" if main_ok else "ok (the config's layout ran out of memory)"
    report["total_s"] = round(time.time() - args.t_start, 1)
    report["lines"] = lines
    dump()
    log(f"\nJSON: {out}  ({report['total_s']} s)")
    return 0


def _est_json(est: dict) -> dict:
    keep = ("fits", "reason", "total", "weights", "grads", "optimizer", "activations", "kv_cache", "engine_weights",
            "rollout_activations", "overhead", "kv_slots", "kv_slot_len", "kv_max_slots", "decode_path", "attention",
            "logprobs", "micro_batch_size", "seq_len", "fit_micro_batch", "gpu_mem_gb", "params", "bytes", "kv")
    return {k: est.get(k) for k in keep}


if __name__ == "__main__":
    sys.exit(main())
