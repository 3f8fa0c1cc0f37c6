"""The search for settings that make a plan fit (``grpoflow validate``'s "fits with ..."), and what a LoRA run that
cannot fit would need. ``estimate`` is runtime/plan/memory.py's ``estimate_memory`` (passed in: that module calls
this one)."""
from __future__ import annotations

import math
from typing import Any

from runtime.plan.engine_terms import KV_STEP_GIB
from runtime.plan.shape import GIB


def lora_need(estimate, hf_config, kw: dict[str, Any], est: dict[str, Any]) -> str:
    """Why a LoRA run does not fit, with what it would need: the least memory this batch can take (every layer
    recomputed, one longest sample per micro-batch, the smallest KV pool that holds one sample)."""
    per_sample = est["kv"]["per_sample"] / GIB
    pool = math.ceil(per_sample / KV_STEP_GIB) * KV_STEP_GIB
    least = estimate(hf_config, gpu_mem_gb=1e9, **dict(
        kw, recompute="full", recompute_num_layers=None, max_tokens=kw["seq_len"], kv_cache_gb=pool,
        offload=kw["colocate"]))
    base = est["weights"] - est["adapter_weights"]
    return (f"needs {est['total']:.1f} GiB per GPU but the GPU has {est['gpu_mem_gb']:g} GiB: LoRA keeps the "
            f"frozen {est['dtype']} base ({base:.1f} GiB) once, and with every layer recomputed, one "
            f"{kw['seq_len']}-token sample per micro-batch and a KV pool of one sample ({pool:g} GiB) this batch "
            f"still needs {least['total']:.1f} GiB; use a bigger GPU or shorter samples (rollout.max_new_tokens; "
            f"a quantized base is not supported)")


def show_setting(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(str(x) for x in v) + "]"
    return "null" if v is None else (f"{v:g}" if isinstance(v, float) else str(v))


def settings_that_fit(estimate, hf_config, gpu_mem_gb: float, kw: dict[str, Any]):
    """The cheapest change of the memory settings that makes ``kw`` (:func:`config_kwargs`) fit, as
    ({config key: value}, estimate), or None. Searched, cheapest first: the distributed optimizer at
    DP > 1 (free: reduce-scatter + all-gather move what the all-reduce did), the trainer's state offloaded
    while generating (free), packed micro-batches by a token budget (faster), selective recompute
    (norms + MLP, ~1/3 more compute per layer), the optimizer on the host (``train.optimizer_on_host``: the AdamW
    step on the CPU, seconds per step for billions of parameters; or off, when the host is what does not fit), full
    recompute (one more forward), bf16 gradients (``train.grad_dtype``: accumulated in bf16), a smaller KV pool (a
    slower rollout); each with the largest token budget that fits; and where the host is short, the checkpoint
    written inside the step (``checkpoint.background`` off: no host copy, the write's seconds in the step)."""
    if kw["device"] != "cuda" or kw["engine"] != "builtin":
        return None
    seq = kw["seq_len"]
    expert_parallel = kw.get("ep", 1) > 1  # config.py refuses the host optimizer with it
    budgets = [kw["max_tokens"]] if kw["max_tokens"] else [None]
    budgets += [seq * k for k in (16, 8, 4, 2, 1) if not kw["max_tokens"] or seq * k < kw["max_tokens"]]
    recomputes = [(kw["recompute"], kw["recompute_modules"])]
    for r in (("selective", ("layernorm", "mlp")), ("full", kw["recompute_modules"])):
        if r[0] != kw["recompute"] and not (kw["recompute"] == "full" and r[0] == "selective"):
            recomputes.append(r)
    offloads = [kw["offload"]] + ([True] if kw["colocate"] and not kw["offload"] else [])
    # the optimizer on the host (a slower step, see runtime/trainer/host_optimizer.py), or back on the GPU when
    # the host is what does not fit
    # the host (LoRA's adapters: megabytes of state, kept on the GPU, config.py)
    hosts = [kw["optimizer_on_host"], not kw["optimizer_on_host"]] \
        if kw["dtype"] != "float32" and not kw.get("lora") and not expert_parallel else [False]
    # gradients in the weights' bf16 (half the gradient memory; accumulated in bf16)
    grads = [kw["grad_dtype"]] + (["bfloat16"] if kw["grad_dtype"] == "float32" and kw["dtype"] != "float32" else [])
    dists = [kw["distributed_optimizer"]] + ([True] if kw["dp"] > 1 and not kw["distributed_optimizer"] else [])
    pools: list = [kw["kv_cache_gb"]]
    if kw["kv_cache_gb"] is not None:
        pools += [round(kw["kv_cache_gb"] * f / KV_STEP_GIB) * KV_STEP_GIB for f in (0.75, 0.5, 0.25)]
        pools.append(None)  # what the plan leaves free
    for min_slots in sorted({min(n, kw["rollout_batch"]) for n in (_SEARCH_MIN_KV_SAMPLES, 4, 1)}, reverse=True):
        found = _search(estimate, hf_config, gpu_mem_gb, kw, pools, recomputes, offloads, budgets, min_slots, dists,
                        hosts, grads, [kw.get("background_checkpoint", False)] + ([False] if kw.get("background_checkpoint") else []))
        if found is not None:
            return found
    return None


_SEARCH_MIN_KV_SAMPLES = 8  # the search prefers pools that hold a group of full-length samples at once


def _search(estimate, hf_config, gpu_mem_gb, kw, pools, recomputes, offloads, budgets, min_slots, dists=(False,),
            hosts=(False,), grads=("float32",), backgrounds=(False,)):
    seq = kw["seq_len"]
    best = None
    for pi, pool in enumerate(pools):
        for rec, mods, on_host, grad in ((r, m, h, g) for r, m in recomputes for h in hosts for g in grads):
            # cheapest first: selective recompute < the optimizer on the host < both < full recompute < bf16
            # gradients (free in time, not in precision)
            level = {kw["recompute"]: 0, "selective": 1}.get(rec, 4) \
                + (2 if on_host and not kw["optimizer_on_host"] else 0) + (8 if grad != kw["grad_dtype"] else 0)
            for oi, off in enumerate(offloads):
                for bi, budget in enumerate(budgets):
                    if budget is not None and budget < seq:
                        continue
                    for (di, distributed), (gi, background) in ((d, g) for d in enumerate(dists)
                                                                for g in enumerate(backgrounds)):
                        # least significant: the distributed optimizer is preferred to any other change
                        cost = (pi, level, oi, bi, gi, di)
                        if best is not None and cost >= best[0]:
                            continue
                        trial = dict(kw, kv_cache_gb=pool, recompute=rec, recompute_modules=mods, offload=off,
                                     max_tokens=budget, distributed_optimizer=distributed,
                                     optimizer_on_host=on_host, grad_dtype=grad,
                                     recompute_num_layers=None if rec != "full" else kw["recompute_num_layers"])
                        if "background_checkpoint" in kw:
                            trial["background_checkpoint"] = background
                        est = estimate(hf_config, gpu_mem_gb=gpu_mem_gb, **trial)
                        if est["fits"] and (est["kv_slots"] or 0) >= min_slots:
                            best = (cost, trial, est)
                            break
    if best is None:
        return None
    _, trial, est = best
    names = {"distributed_optimizer": "train.distributed_optimizer",
             "kv_cache_gb": "rollout.kv_cache_gb", "recompute": "train.recompute",
             "recompute_modules": "train.recompute_modules", "offload": "cluster.offload_trainer_state",
             "max_tokens": "train.max_tokens_per_micro_batch", "recompute_num_layers": "train.recompute_num_layers",
             "optimizer_on_host": "train.optimizer_on_host", "grad_dtype": "train.grad_dtype",
             "background_checkpoint": "checkpoint.background"}
    changed: dict[str, Any] = {}
    for k, name in names.items():
        if k in trial and trial[k] != kw[k] and not (k == "recompute_modules" and trial["recompute"] != "selective"):
            changed[name] = ("on" if trial[k] else "off") if k == "offload" else trial[k]
    if trial["kv_cache_gb"] is None and kw["kv_cache_gb"] is not None:
        changed["rollout.kv_cache_gb"] = round(est["kv_cache_gb"], 2)
    return changed, est

