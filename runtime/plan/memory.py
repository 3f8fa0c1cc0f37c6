"""A run's plan: per GPU, the sum of named terms, each a small function of its own settings and the model's shape,
composed in :func:`estimate_memory` (the one place that adds them); the host's in runtime/plan/host_memory.py, the
run directory's disk in runtime/plan/disk.py.

The terms, where each is counted:

=================  ============================================  ===========================================
term               settings                                      module
=================  ============================================  ===========================================
weights            model.dtype, train.tensor_parallel,           runtime/plan/trainer_terms.py
                   algorithm.kl_coef, train.lora
gradients          train.grad_dtype                              runtime/plan/trainer_terms.py
optimizer          train.distributed_optimizer,                  runtime/plan/trainer_terms.py
                   train.optimizer_on_host
activations        train.micro_batch_size / max_tokens_per_...,  runtime/plan/activations.py
                   recompute*, fusions, core_attention, ...      (LoRA's: runtime/plan/lora_memory.py)
engine weights     rollout.engine, rollout.sglang.tp_size        runtime/plan/engine_terms.py
KV cache           rollout.kv_cache_gb / sglang.mem_fraction     runtime/plan/engine_terms.py
rollout extra      rollout.n_samples_per_prompt, partial         runtime/plan/engine_terms.py
overhead           cluster.colocate, backend                     runtime/plan/engine_terms.py
host               cluster.host_memory_gb                        runtime/plan/host_memory.py
disk               checkpoint.*, tracking.keep_exports, storage  runtime/plan/disk.py
experts, router,   train.expert_parallel, the model's experts    runtime/plan/moe_terms.py (shares of the rows
dispatcher         and top-k                                     above: a mixture of experts)
=================  ============================================  ===========================================

The model follows what our code allocates on the device the run uses, not a generic formula. How they add up:

* ``cluster.offload_trainer_state``: gradients, fp32 master and Adam moments are off the GPU during the
  rollout phase (``runtime/trainer/state_offload.py``).
* the engine's KV pool counts in the training phase unless the engine gives it back for training
  (``engine_releases_kv``).
* data-parallel rollout (``cluster.rollout_gpus`` > 1 with the built-in engine): one engine on each rollout
  GPU, each with the whole weights, its own KV pool and the working set of its share of the requests
  (``rollout_engines``: the rows split evenly); the per-GPU numbers are those of a GPU that holds an engine.
* colocated: the peak is the largest of the rollout phase (trainer weights, its state unless offloaded,
  engine weights, KV pool, rollout working set), the training phase (trainer weights and state,
  engine weights, the pool unless released, activations) and, under tensor parallelism, the weight sync
  after the update (each TP rank gathers the whole bf16 weights for the engines beside its state).
* SGLang, colocated: the peak is the larger of rollout time and training time (it releases its memory while the
  trainer trains).

On CPU the code differs and the CPU terms are kept: megatron's unfused attention, full-vocab fp32 logits and the
engine's slow path.

Measured (``torch.cuda.max_memory_allocated`` on an H100 80GB, torch 2.11, megatron-core 0.16.1,
random Qwen3-0.6B shape, bf16): the shipped configs on the paged engine
(bench/results/memory_check_H100_2026-11-23_{80gb_paged,24gb_paged,32gb}.json): 80 GiB 71.36 GiB
(estimate without overhead 71.72), 24 GB 20.6 (reserved + context 21.9 of 24.0), 32 GB 27.86 (estimate
28.22). Again on 2026-11-25 after the state offload started handing its freed blocks back
(bench/results/memory_check_H100_2026-11-25_{24gb,80gb}_empty_cache.json): every non-KV term within 10 %, the
rollout's working set (0.652 planned, 0.639 measured) and the overhead (1.35; 1.33 and 1.37) included, and the
total against the card's footprint (peak reserved + context): 21.97 / 21.94 GiB at 24 GiB, 72.72 / 72.73 at 80.
Earlier, with the fixed-slot engine (bench/results/memory_check_H100_2026-11-22*.json): one micro-batch's activations at 1 x 9216,
2 x 4608 and 4 x 2304 tokens measured 18.61 / 18.57 / 18.43 GiB (estimate 18.66 / 18.54 / 18.48); at
micro-batch 4 it ran out of memory, as estimated. Trainer-only steps at 8 x 768 and 16 x 768 tokens
(bench/results/gpu_grpo_H100_2026-11-22_run3.json) measured 13.06 and 23.95 GiB of activations
(estimate 12.97 and 23.88), and the colocated train stage of that run 45.55 GiB (estimate 45.5). The
layer count was derived from the code, not fitted; the one term set by the measurements is the
backward's working set (one layer's worth). The CPU terms are the earlier estimate's (calibrated on
the H100 with megatron's unfused attention and full logits before the CUDA path changed); CPU memory
is not measured. Sizes are GiB (2**30 bytes), what ``nvidia-smi`` and ``torch`` call GB/GiB;
``overhead`` (1 GiB; measured 0.6 GiB of CUDA context + 0.7 GiB reserved-but-unallocated) is what
``max_memory_allocated`` does not see.
"""
from __future__ import annotations

import math
from typing import Any

from runtime.devices import resolve_dtype, this_machine_gpu_gb
from runtime.placement import layout
from runtime.plan import engine_terms, host_memory, lora_memory, moe_terms, trainer_terms
from runtime.plan.fit_search import lora_need, settings_that_fit, show_setting
from runtime.plan.activations import (activation_bytes, activation_terms, layer_bytes_per_token,  # noqa: F401
                                      uses_chunked_logprobs, uses_flash_attention)
from runtime.plan.engine_terms import KV_STEP_GIB, OVERHEAD_BYTES, engine_releases_kv  # noqa: F401
from runtime.plan.shape import GIB, dtype_bytes, expert_params, largest_unit_params, model_shape, param_counts, shape_param_counts  # noqa: F401

_shape = model_shape  # the name tests and benches import


def _fits_micro_batch(total_at, mb: int, limit: float, global_per_rank: int | None) -> int:
    """The largest micro-batch <= mb (a divisor of the per-rank step when known) whose total fits; 0 if none."""
    for b in range(mb, 0, -1):
        if global_per_rank and global_per_rank % b:
            continue
        if total_at(b) <= limit:
            return b
    return 0


def estimate_memory(hf_config, *, tp: int = 1, dp: int = 1, micro_batch_size: int, seq_len: int,
                    rollout_batch: int, max_new_tokens: int, dtype="bfloat16", colocate: bool = True,
                    gpu_mem_gb: float = 80.0, ref_model: bool = False, device: str = "cuda",
                    engine: str = "builtin", max_slots: int | None = None, rollout_engines: int = 1,
                    sglang_mem_fraction: float = 0.7, sglang_tp: int = 1, global_batch_size: int | None = None,
                    kv_cache_gb: float | None = None, offload: bool = False, kv_released: bool | None = None,
                    max_tokens: int | None = None, recompute: str = "none", recompute_modules=("layernorm", "mlp"),
                    recompute_num_layers: int | None = None, fusions="auto", chunked_logprobs: str = "auto",
                    core_attention: str = "auto", distributed_optimizer: bool = False,
                    grad_dtype: str = "float32", optimizer_on_host: bool = False, host_memory_gb: float | None = None,
                    trainer_ranks: int = 1, processes: int = 1, lora: dict | None = None,
                    shared_base: bool = False, samples_per_prompt: int = 1, partial: bool = False,
                    engine_apart: bool = False, deterministic: bool = False,
                    background_checkpoint: bool = False, weights_dtype: str = "bf16", ep: int = 1,
                    weight_sync: str = "direct", expert_shards: int = 1) -> dict[str, Any]:
    """Per-GPU memory of a run (GiB), term by term, for one trainer rank and the engine beside it.

    ``seq_len`` = prompt + response tokens of the longest sample; ``rollout_batch``: rows of the
    engine's first generate call, split over ``rollout_engines``; ``max_slots``: the engine's
    ``max_batch_size``. ``dp`` replicates the trainer and does not change the per-GPU numbers, except with
    ``distributed_optimizer`` (``train.distributed_optimizer``): the fp32 master, Adam's moments and the
    optimizer step's temporaries are then 1/dp per GPU. ``grad_dtype`` (``train.grad_dtype``): the gradient
    buffer's dtype ("float32", or "bfloat16" = the weights' dtype). ``optimizer_on_host``
    (``train.optimizer_on_host``): the fp32 master, Adam's moments and the step in host memory, none of it on the
    GPU. ``host_memory_gb``: the node's host memory, checked by runtime/plan/host_memory.py for ``trainer_ranks``
    trainer ranks and ``processes`` processes per node (None: not checked). ``ref_model``: a reference copy of
    the weights (``kl_coef > 0``). ``ep`` (``train.expert_parallel``): a rank's weights, gradients and optimizer
    state hold 1/ep of the experts, the distributed optimizer shards theirs over dp/ep ranks.
    ``device``: "cuda" or "cpu" (other attention, logits and engine paths, see the module doc).
    ``engine``: "builtin" or "sglang". ``global_batch_size`` lets the answer name a micro-batch that
    divides the step. ``kv_cache_gb``: the built-in engine's KV pool (GiB); None on CUDA: the plan
    chooses the largest that fits (``kv_chosen``). ``offload``: the trainer's gradients and optimizer
    state leave the GPU while the engine generates. ``kv_released``: the engine gives the pool back
    during training (default: :func:`engine_releases_kv`). The trainer's settings (``max_tokens`` for
    packed micro-batches, ``recompute*``, ``fusions``, ``chunked_logprobs``, ``core_attention``,
    ``deterministic``) as in :func:`activation_terms`. ``lora`` (:func:`runtime.plan.lora_memory.config_lora`): the
    base frozen, gradients and optimizer state for the adapters only, no reference copy; ``shared_base``: the engine decodes with the
    trainer's base (``layout.shares_base``), so the base is counted once (runtime/plan/lora_memory.py).
    ``samples_per_prompt``: the rows of a group, which share one prompt prefill in the paged engine; ``partial``
    (``rollout.partial``): continued samples come back with their tokens and are prefilled one by one.
    ``engine_apart`` (``layout.engine_shares_gpu_across_processes``): a colocated built-in engine runs in a process
    of its own beside the trainer rank's (Ray actors, spawned ranks): two CUDA contexts and two allocators' slack.
    ``weights_dtype`` (``rollout.weights_dtype``): the built-in engine's linear layers in "fp8" (runtime/plan/
    engine_terms.py) or the model's dtype ("bf16"). ``weight_sync``: the weights' path to the engines, "broadcast"
    (``cluster.weight_sync``) and "cuda_ipc" (direct between processes on one GPU) stream them a unit at a time (the
    gather a sync holds is the largest unit), "direct" / "host" / "as_is" hand a whole copy over.

    Returns ``weights``, ``grads``, ``optimizer``, ``activations``, ``kv_cache``, ``engine_weights``,
    ``rollout_activations``, ``overhead``, ``total`` (GiB; ``bytes``: the same, exact), ``at_rollout`` /
    ``at_training`` / ``at_sync`` (colocated peaks of each phase; the weight sync's: a TP rank's gather of the
    whole weights, ``sync_gather``, beside its state), ``fits``, ``reason`` (None when it fits),
    ``fit_micro_batch``, ``kv_slots`` (full-length samples the pool holds), ``kv_chosen``.
    """
    for name, v in (("tp", tp), ("dp", dp), ("micro_batch_size", micro_batch_size), ("seq_len", seq_len),
                    ("rollout_batch", rollout_batch), ("max_new_tokens", max_new_tokens),
                    ("rollout_engines", rollout_engines), ("sglang_tp", sglang_tp)):
        if int(v) < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    if max_new_tokens > seq_len:
        raise ValueError(f"seq_len ({seq_len}) is prompt + response and must be >= max_new_tokens ({max_new_tokens})")
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device must be 'cuda' or 'cpu', not {device!r}")
    if engine not in ("builtin", "sglang"):
        raise ValueError(f"engine must be 'builtin' or 'sglang', not {engine!r}")
    if max_tokens is not None and max_tokens < seq_len:
        raise ValueError(f"max_tokens ({max_tokens}) must hold the longest sample ({seq_len} tokens)")
    e = dtype_bytes(dtype)
    m = model_shape(hf_config)
    n_params, per_rank = shape_param_counts(m, tp, ep)  # ep (train.expert_parallel): a rank holds 1/ep of the experts

    limit = gpu_mem_gb * GIB
    if kv_released is None:
        kv_released = engine == "builtin" and engine_releases_kv()
    settings = dict(max_tokens=max_tokens, recompute=recompute, recompute_modules=tuple(recompute_modules),
                    recompute_num_layers=recompute_num_layers, fusions=fusions, chunked_logprobs=chunked_logprobs,
                    core_attention=core_attention, deterministic=deterministic)
    offload = bool(offload and colocate)

    # the trainer's terms: weights, gradients, optimizer state (with LoRA only the adapters are trained)
    grad_bytes = trainer_terms.grad_bytes_per_param(grad_dtype, e)
    adapters, adapters_rank = lora_memory.adapter_params(m, lora, tp) if lora else (0, 0)
    weights = trainer_terms.trainer_weights(per_rank, adapters_rank, e, ref_model=ref_model, lora=bool(lora))
    trained = adapters_rank if lora else per_rank
    grads = trainer_terms.gradients(trained, e, grad_dtype)
    opt = trainer_terms.optimizer(trained, e, dp=dp, distributed_optimizer=distributed_optimizer,
                                  optimizer_on_host=optimizer_on_host,
                                  experts=0 if lora else expert_params(m) // (tp * ep), ep=ep)
    state = grads + opt.on_gpu                             # what offload_state moves

    # activations of one micro-batch, and the adapters' beside them
    act_kw = dict(tp=tp, micro_batch_size=micro_batch_size, seq_len=seq_len, dtype=dtype, device=device,
                  response_len=max_new_tokens, frozen_head=bool(lora), ep=ep, **settings)
    act = activation_terms(hf_config, **act_kw)
    lora_act = _lora_activations(m, lora, e, tp=tp, micro_batch_size=micro_batch_size, seq_len=seq_len,
                                 **settings) if lora else 0
    activations = act["total"] + lora_act

    # the engine's terms: weights, KV cache, rollout extra; the overhead of the processes on the GPU
    overhead = engine_terms.overhead(colocate=colocate, engine=engine, engine_apart=engine_apart)
    rows = math.ceil(rollout_batch / rollout_engines)
    slots_max = max_slots if max_slots is not None else rows

    def room(engine_weights: int, working: int) -> float:
        return _kv_room(limit, colocate=colocate, kv_released=kv_released, weights=weights, state=state,
                        offload=offload, engine_weights=engine_weights, rollout_activations=working,
                        activations=max(activations, opt.step), overhead=overhead)

    eng = engine_terms.engine_side(
        hf_config, m, e, engine=engine, device=device, n_params=n_params, adapters=adapters, rows=rows,
        slots_max=slots_max, seq_len=seq_len, max_new_tokens=max_new_tokens, dtype=dtype, kv_cache_gb=kv_cache_gb,
        kv_released=kv_released, partial=partial, samples_per_prompt=samples_per_prompt,
        sglang_mem_fraction=sglang_mem_fraction, sglang_tp=sglang_tp, shared_base=shared_base, lora=bool(lora),
        limit=limit, sglang_others=weights + (0 if offload else grads + opt.master) if colocate else 0, room=room,
        weights_dtype=weights_dtype, expert_shards=expert_shards)
    engine_weights, kv_cache, rollout_activations = eng["engine_weights"], eng["kv_cache"], eng["rollout_activations"]
    kv_released, decode_path = eng["kv_released"], eng["decode_path"]

    # the weight sync after an update: under TP every trainer rank gathers the whole weights for the engines
    # (runtime/trainer/tp_gather.py), beside its state, before the next rollout offloads it; under EP rank 0 gathers
    # every expert (the other ranks only their own; runtime/trainer/expert_parallel.py). A broadcast and the CUDA IPC
    # path stream them: one unit (the embedding, a layer, the head) gathered at a time
    streamed = weight_sync in ("broadcast", "cuda_ipc") and not lora
    unit = largest_unit_params(m)
    if weight_sync == "cuda_ipc" and expert_shards > 1:  # each rank's unit holds its GPU's engine shard's experts only
        unit -= expert_params(m) // m["L"] * (expert_shards - 1) // expert_shards
    gathered = ((unit if streamed else n_params) * e) if tp > 1 or ep > 1 else 0
    peaks = dict(weights=weights, state=state, opt_step=opt.step, gathered=gathered, engine_weights=engine_weights,
                 kv_cache=kv_cache, rollout_activations=rollout_activations, overhead=overhead, colocate=colocate,
                 offload=offload, kv_released=kv_released)
    trainer_total, rollout_total, at_rollout, at_training, at_sync, total = _phases(activations, **peaks)
    kv_too_small = decode_path == "paged" and kv_cache < eng["per_sample_kv"]
    fits = total <= limit and not kv_too_small and not (engine == "sglang" and kv_cache <= 0)
    host = None
    if host_memory_gb is not None:
        host = host_memory.host_terms(m, tp=tp, dp=dp, per_rank=trained, opt_params=opt.params, weight_bytes=e,
                                      grad_bytes=grad_bytes, distributed_optimizer=bool(distributed_optimizer),
                                      optimizer_on_host=bool(optimizer_on_host), offload=offload,
                                      trainer_ranks=trainer_ranks, processes=processes, host_memory_gb=host_memory_gb,
                                      trainable_numels=lora_memory.adapter_tensor_numels(m, lora, tp) if lora else None,
                                      background_checkpoint=background_checkpoint)
    per_rank_step = (global_batch_size // dp) if global_batch_size else None

    def total_at(b: int) -> int:
        return _phases(activation_bytes(hf_config, **{**act_kw, "micro_batch_size": b}) + lora_act, **peaks)[5]

    fit_mb = 0
    if max_tokens is None and not kv_too_small:
        fit_mb = _fits_micro_batch(total_at, micro_batch_size, limit, per_rank_step) if fits or micro_batch_size > 1 else 0
    exact = dict(weights=weights, grads=grads, optimizer=opt.on_gpu, activations=activations, kv_cache=kv_cache,
                 engine_weights=engine_weights, rollout_activations=rollout_activations,
                 overhead=overhead, trainer_total=trainer_total, rollout_total=rollout_total, total=total,
                 at_rollout=at_rollout, at_training=at_training, at_sync=at_sync, sync_gather=gathered,
                 optimizer_master=opt.master, optimizer_moments=opt.moments,
                 act_layers=act["layers"], act_attention_scores=act["attention_scores"],
                 act_logprob_head=act["logprob_head"], act_lora=lora_act, adapter_weights=adapters_rank * e)
    out: dict[str, Any] = {k: v / GIB for k, v in exact.items()}
    out.update(fits=fits, bytes=exact, params=n_params, params_per_gpu=per_rank, gpu_mem_gb=gpu_mem_gb,
               tp=tp, dp=dp, ep=ep, colocate=colocate, dtype=str(dtype).removeprefix("torch."), rollout_rows=rows,
               engine_weights_dtype=weights_dtype if engine == "builtin" else str(dtype).removeprefix("torch."),
               rollout_engines=rollout_engines,
               micro_batch_size=micro_batch_size, seq_len=seq_len, device=device, engine=engine,
               decode_path=decode_path,
               attention="flash (SDPA)" if uses_flash_attention(device, core_attention, max_tokens is not None)
               else "unfused",
               logprobs="chunked" if uses_chunked_logprobs(device, tp, chunked_logprobs) else "full logits",
               kv_slots=eng["kv_slots"], kv_slot_len=seq_len, kv_max_slots=slots_max, kv=eng["kv"],
               kv_chosen=eng["kv_chosen"], kv_cache_gb=kv_cache / GIB if decode_path == "paged" else None,
               kv_released=kv_released, offload=offload, fit_micro_batch=fit_mb,
               distributed_optimizer=bool(distributed_optimizer), grad_dtype=grad_dtype,
               optimizer_on_host=bool(optimizer_on_host), host=host, gpu_fits=fits,
               lora=None if not lora else {**lora, "params": adapters, "params_per_gpu": adapters_rank},
               shared_base=bool(shared_base and lora), **settings)
    out["moe"] = _moe_shares(m, e, tp=tp, ep=ep, dp=dp, grad_bytes=grad_bytes, opt=opt, lora=bool(lora),
                             ref_model=ref_model, act=act, engine=engine, sglang_tp=sglang_tp,
                             distributed_optimizer=bool(distributed_optimizer), optimizer_on_host=bool(optimizer_on_host),
                             ranks=host["ranks"] if host is not None else 1, weights_dtype=weights_dtype,
                             expert_shards=expert_shards)
    out["fits"] = fits and (host is None or host["fits"])
    # a mixture of experts trains at TP 1 (runtime/placement/layout.py: megatron needs sequence parallelism for it)
    out["max_tp"] = 1 if moe_terms.is_moe(m) else math.gcd(m["V"], m["nh"], m["ng"], m["f"])
    out["reason"] = None if out["fits"] else _why_not(out)
    return out


def _moe_shares(m: dict[str, Any], e: int, *, tp: int, ep: int, dp: int, grad_bytes: int, opt, lora: bool,
                ref_model: bool, act: dict[str, int], engine: str, sglang_tp: int, distributed_optimizer: bool,
                optimizer_on_host: bool, ranks: int, weights_dtype: str = "bf16",
                expert_shards: int = 1) -> dict[str, Any] | None:
    """A mixture of experts' named terms (runtime/plan/moe_terms.py), each a share of a row the plan adds up
    (``weights``, ``grads``, ``optimizer``, ``activations``, ``engine_weights``; ``host_optimizer``: of the host's
    optimizer, over the node's ``ranks``), in GiB, with ``bytes`` and what the notes read; None for a dense model."""
    if not moe_terms.is_moe(m):
        return None
    experts = moe_terms.expert_params_per_rank(m, tp, ep)
    copies = 2 if ref_model and not lora else 1  # the reference model holds its experts and router too
    state = (4 if e < 4 else 0) + 8            # fp32 master (of half-precision weights) + Adam m, v
    exact = dict(experts_weights=copies * experts * e, router_weights=copies * moe_terms.router_params(m) * e,
                 experts_grads=0 if lora else experts * grad_bytes,
                 experts_optimizer=0 if lora or optimizer_on_host else opt.experts * state,
                 host_optimizer=ranks * 12 * opt.experts if optimizer_on_host and not lora else 0,
                 router_activations=act["router"], dispatcher=act["dispatcher"],
                 dispatcher_buffer=act["dispatcher_buffer"], experts_activations=act["experts"],
                 engine_experts=moe_terms.engine_experts(m, e, engine=engine, sglang_tp=sglang_tp,
                                                         weights_dtype=weights_dtype, shards=expert_shards))
    out: dict[str, Any] = {k: v / GIB for k, v in exact.items()}
    out.update(bytes=exact, experts=m["E"], experts_per_rank=m["E"] // ep, topk=m["k"], ffn=m["fe"], ep=ep,
               expert_dp=max(dp // ep, 1), distributed_optimizer=distributed_optimizer, aux=bool(m.get("aux")),
               host_ranks=ranks, engine_shards=expert_shards)
    return out


def _lora_activations(m: dict[str, Any], lora: dict[str, Any], e: int, *, tp: int, micro_batch_size: int,
                      seq_len: int, max_tokens: int | None, recompute: str, recompute_modules: tuple[str, ...],
                      recompute_num_layers: int | None, **_) -> int:
    full = min(recompute_num_layers or m["L"], m["L"]) if recompute == "full" else 0
    return lora_memory.activation_extra(
        m, lora, tp=tp, tokens=max_tokens or micro_batch_size * seq_len, e=e,
        kept_layers=m["L"] - full + (1 if full else 0),
        recompute_modules=tuple(recompute_modules) if recompute == "selective" else ())


def _phases(act_bytes: int, *, weights: int, state: int, opt_step: int, gathered: int, engine_weights: int,
            kv_cache: int, rollout_activations: int, overhead: int, colocate: bool, offload: bool,
            kv_released: bool) -> tuple[int, int, int, int, int, int]:
    """(trainer alone, engine alone, the rollout phase, the training phase, the weight sync, the peak): the one
    place the terms add up."""
    at_sync = weights + state + gathered + (engine_weights + (0 if kv_released else kv_cache) if colocate else 0) \
        + overhead
    trainer_total = weights + state + max(act_bytes, opt_step, gathered) + OVERHEAD_BYTES
    rollout_total = engine_weights + kv_cache + rollout_activations + OVERHEAD_BYTES
    if not colocate:
        return trainer_total, rollout_total, rollout_total, trainer_total, at_sync, max(trainer_total, rollout_total)
    at_rollout = weights + (0 if offload else state) + engine_weights + kv_cache + rollout_activations + overhead
    at_training = weights + state + engine_weights + (0 if kv_released else kv_cache) + max(act_bytes, opt_step) \
        + overhead
    return trainer_total, rollout_total, at_rollout, at_training, at_sync, max(at_rollout, at_training, at_sync)


# 2.05 GiB on the 24 GB config with packed micro-batches of varying size (0.87 GiB at 80 GiB unpacked;
# bench/results/memory_check_H100_2026-11-23_*.json) beside the 1 GiB overhead, and the estimate's error
KV_MARGIN_FRACTION = 0.08


def _kv_room(limit: float, *, colocate: bool, kv_released: bool, weights: int, state: int, offload: bool,
             engine_weights: int, rollout_activations: int, activations: int, overhead: int) -> float:
    margin = KV_MARGIN_FRACTION * limit
    if not colocate:
        return limit - margin - (engine_weights + rollout_activations + overhead)
    room = limit - margin - (weights + (0 if offload else state) + engine_weights + rollout_activations + overhead)
    if not kv_released:  # the pool stays through training
        room = min(room, limit - margin - (weights + state + engine_weights + activations + overhead))
    return room


def _distributed_optimizer_hint(est: dict[str, Any]) -> str | None:
    """The suggestion to shard the optimizer over DP, with what it saves, when it is off at DP > 1."""
    dp = est["dp"]
    if dp <= 1 or est["distributed_optimizer"]:
        return None
    return (f"train.distributed_optimizer: true shards the fp32 master + Adam state over the {dp} data-parallel "
            f"ranks ({est['optimizer']:.1f} -> {est['optimizer'] / dp:.1f} GiB per GPU)")


def _why_not(est: dict[str, Any]) -> str:
    """Why a plan does not fit: the GPU's reason, the host's, or both."""
    host = est.get("host")
    parts = [] if est["gpu_fits"] else [_why_not_gpu(est)]
    if host is not None and not host["fits"]:
        parts.append(_why_not_host(est))
    return "; and ".join(parts)


def _why_not_host(est: dict[str, Any]) -> str:
    host = est["host"]
    what = {"host": f"the fp32 master + Adam state of {host['ranks']} trainer rank(s) on the host take "
                    f"{host['optimizer']:.1f} GiB (train.optimizer_on_host)",
            "offload": f"the pinned buffers of {host['ranks']} trainer rank(s)' state offload take "
                       f"{host['pinned']:.1f} GiB (cluster.offload_trainer_state)",
            "none": f"{host['processes_n']} processes take {host['processes']:.1f} GiB"}[host["mode"]]
    return (f"needs {host['total']:.1f} GiB of host memory per node but the node has {host['host_memory_gb']:g} GiB: "
            f"{what}")


def _why_not_gpu(est: dict[str, Any]) -> str:
    gpu = est["gpu_mem_gb"]
    state = est["weights"] + est["grads"] + est["optimizer"]
    grads = "fp32 gradients" if est["grad_dtype"] == "float32" else f"{est['grad_dtype']} gradients"
    what = f"the trainer's weights, {grads} and fp32 master + Adam state"
    head = f"needs {est['total']:.1f} GiB per GPU but the GPU has {gpu:g} GiB"
    if est["decode_path"] == "paged" and est["kv_cache"] * GIB < est["kv"]["per_sample"]:
        head = (f"the KV pool ({est['kv_cache']:.2f} GiB) does not hold one {est['seq_len']}-token sample "
                f"({est['kv']['per_sample'] / GIB:.2f} GiB) beside the rest (peak {est['total']:.1f} GiB of {gpu:g})")
    hint = _distributed_optimizer_hint(est)
    if state + (est["engine_weights"] if est["colocate"] else 0) + est["overhead"] >= 0.9 * gpu:
        if hint is not None:
            return f"{head}: try {hint}: {what} alone take {state:.1f} GiB per GPU"
        if est["tp"] < est["max_tp"]:
            return (f"{head}: try more train.tensor_parallel (at most {est['max_tp']} for this model): "
                    f"{what} alone take {state:.1f} GiB per GPU")
        sharded = (f"the optimizer is already sharded over dp={est['dp']}" if est["dp"] > 1
                   else "with one data-parallel rank nothing shards them")
        bf16_grads = ("; train.grad_dtype: bfloat16 halves the gradients" if est["grad_dtype"] == "float32"
                      and est["dtype"] != "float32" else "")
        if not est["optimizer_on_host"] and est["dtype"] != "float32" and est.get("ep", 1) == 1:  # config.py: not with EP
            bf16_grads += (f"; train.optimizer_on_host: true moves the fp32 master + Adam state "
                           f"({est['optimizer']:.1f} GiB) to host memory")
        return (f"{head}: try GPUs with more memory: {what} alone take {state:.1f} GiB per GPU at "
                f"tensor_parallel={est['tp']}, this model's limit, and {sharded} (the trainer has no pipeline "
                f"parallelism){bf16_grads}")
    return head if hint is None else f"{head}; {hint}"


def format_estimate(est: dict[str, Any]) -> str:
    """Lines for ``grpoflow validate``."""
    if est["decode_path"] == "paged":
        kv_note = (f"pool of {est['kv_cache']:.2f} GiB: {est['kv_slots']} full-length samples of {est['kv_slot_len']} "
                   f"tokens ({'chosen by the plan' if est['kv_chosen'] else 'rollout.kv_cache_gb'}"
                   f"{'; released while training' if est['kv_released'] and est['colocate'] else ''})")
    elif est["decode_path"] == "dynamic":
        kv_note = f"{est['kv_slots']} rows x {est['kv_slot_len']} tokens (HF dynamic cache, slow path)"
    else:
        kv_note = f"SGLang pool: {est['kv']['mem_fraction']:g} x GPU - weights - others"
    micro = (f"packed micro-batches of <= {est['max_tokens']} tokens" if est["max_tokens"]
             else f"micro-batch {est['micro_batch_size']} x {est['seq_len']} tokens")
    recompute = {"none": "", "selective": f"; recompute {'+'.join(est['recompute_modules'])}",
                 "full": f"; full recompute of {est['recompute_num_layers'] or 'all'} layers"}[est["recompute"]]
    act_note = f"{micro}; {est['attention']} attention, {est['logprobs']} log-probs{recompute}"
    state_note = "; off the GPU while the engine generates" if est["offload"] else ""
    grad_note = "fp32" if est["grad_dtype"] == "float32" else est["dtype"]
    shard_note = f", 1/{est['dp']} of them (distributed optimizer)" if est["distributed_optimizer"] else ""
    lora = est.get("lora")
    weights_note = engine_note = owner = ""
    if lora:
        adapters = est["adapter_weights"]
        weights_note = (f"frozen base {est['weights'] - adapters:.2f} + adapters {adapters * 1024:.0f} MiB "
                        f"(LoRA rank {lora['rank']} on {', '.join(lora['targets'])}: "
                        f"{lora['params_per_gpu'] / 1e6:.1f}M params)")
        owner = "the adapters' "
        act_note += f"; adapters {est['act_lora']:.2f}"
        engine_note = ("the adapters' buffers only: the engine decodes with the trainer's base (one copy)"
                       if est["shared_base"] else "its own base + the adapters' buffers")
    if est.get("engine_weights_dtype") == "fp8":
        engine_note = ("the FP8 copy of the trainer's base + the adapters' buffers" if lora and est["shared_base"] else
                       "linear layers in FP8 (rollout.weights_dtype), embeddings and head " + est["dtype"]
                       + ("; + the adapters' buffers" if lora else ""))
    rows = [("weights", est["weights"], weights_note), ("gradients", est["grads"], owner + grad_note + state_note),
            ("optimizer", est["optimizer"],
             owner + "fp32 master + Adam m, v" + shard_note + " on the host (train.optimizer_on_host): see below"
             if est["optimizer_on_host"] else
             owner + ("fp32 master + Adam m, v" if est["optimizer_master"] else "Adam m, v") + shard_note + state_note),
            ("activations", est["activations"], act_note),
            ("engine weights", est["engine_weights"],
             f"one built-in engine on each of {est['rollout_engines']} rollout GPUs, {est['rollout_rows']} rows of "
             f"the first rollout each" if est["rollout_engines"] > 1 else engine_note),
            ("KV cache", est["kv_cache"], kv_note), ("rollout extra", est["rollout_activations"], ""),
            ("overhead", est["overhead"], "CUDA contexts and allocator slack of two processes (trainer, engine)"
             if est["overhead"] > OVERHEAD_BYTES / GIB else "CUDA context, allocator slack")]
    moe = est.get("moe")
    head = (f"memory per GPU (tp={est['tp']}, dp={est['dp']}, {'colocated' if est['colocate'] else 'separate'} "
            f"trainer/rollout, {est['dtype']}, {est['params'] / 1e9:.2f}B params, {est['device']}):")
    lines = [head] + [f"  {name:<15}{gib:8.2f} GiB" + (f"   {note}" if note else "") for name, gib, note in rows]
    verdict = "fits" if est["fits"] else "DOES NOT FIT"
    phases = (f" (rollout {est['at_rollout']:.2f}, training {est['at_training']:.2f}"
              + (f", weight sync {est['at_sync']:.2f}" if est["sync_gather"] else "") + ")" if est["colocate"] else "")
    lines.append(f"  {'total':<15}{est['total']:8.2f} GiB of {est['gpu_mem_gb']:g} GiB{phases}: {verdict}")
    if moe is not None:
        lines += format_moe(moe)
    if est.get("assumed"):
        lines.append(f"  assumed: {est['assumed']}")
    if est.get("host") is not None:
        lines += host_memory.format_host(est["host"])
    return "\n".join(lines)


def format_moe(moe: dict[str, Any]) -> list[str]:
    """Lines for ``grpoflow validate``: a mixture of experts' terms, each named with the row above it belongs to."""
    per_rank = f"{moe['experts_per_rank']} of {moe['experts']} experts per EP rank (train.expert_parallel {moe['ep']})"
    over = (f"sharded over the {moe['expert_dp']} expert-data-parallel ranks (DP / EP)"
            if moe["distributed_optimizer"] and moe["expert_dp"] > 1 else
            "whole on each rank" + (" (DP / EP = 1: the distributed optimizer has no rank to shard them over)"
                                    if moe["distributed_optimizer"] else ""))
    where = (f"on the host: {moe['host_optimizer']:.2f} GiB of the host's optimizer over {moe['host_ranks']} "
             f"rank(s), 12 B a parameter" if moe["host_optimizer"] else "fp32 master + Adam m, v")
    rows = [("experts' weights", moe["experts_weights"], f"of weights: {per_rank}"),
            ("router weights", moe["router_weights"], f"of weights: [{moe['experts']}, hidden] a layer, on every rank"),
            ("experts' grads", moe["experts_grads"], "of gradients"),
            ("experts' optimizer", moe["experts_optimizer"], f"of optimizer: their own, {over}; {where}"),
            ("router acts", moe["router_activations"],
             "of activations: fp32 " + (f"softmax over {moe['experts']} experts (load-balancing loss), " if moe["aux"]
                                       else "") + f"top-{moe['topk']} indices and probabilities, per token and layer"),
            ("dispatcher", moe["dispatcher"],
             f"of activations: {moe['topk']} routed bf16 copies of each token's hidden state a layer (allgather "
             f"dispatcher)" + (f"; its gather buffer [tokens x EP, hidden] {moe['dispatcher_buffer']:.2f}"
                               if moe["dispatcher_buffer"] else "")),
            ("experts' acts", moe["experts_activations"],
             f"of activations: top-{moe['topk']} x tokens x ffn {moe['ffn']} (fc1 output, SwiGLU product)"),
            ("engine experts", moe["engine_experts"], "of engine weights: every expert of the engine's replica"
             if moe.get("engine_shards", 1) == 1 else f"of engine weights: 1/{moe['engine_shards']} of the experts "
             f"(rollout.expert_shards)")]
    lines = [f"  mixture of experts ({moe['experts']} experts of ffn {moe['ffn']}, top-{moe['topk']}), "
             f"shares of the rows above:"]
    return lines + [f"    {name:<19}{gib:8.2f} GiB   {note}" for name, gib, note in rows]


def first_rollout_rows(cfg) -> int:
    """Rows of the engine's first generate call (``runtime.grpo.session``): dynamic sampling over-samples prompts."""
    r = cfg.rollout
    prompts = max(r.rollout_batch_size, int(r.rollout_batch_size * r.over_sampling_factor)) \
        if r.dynamic_sampling else r.rollout_batch_size
    return prompts * r.n_samples_per_prompt


def config_device(cfg) -> str:
    """The device a config trains on, for the plan ("auto" counts as a GPU run)."""
    return "cpu" if cfg.cluster.device == "cpu" else "cuda"


def offload_enabled(cfg, device: str | None = None) -> bool:
    """``cluster.offload_trainer_state``: on / off, or auto = colocated on a GPU. The loop calls
    ``offload_state()`` before each generate and ``reload_state()`` before each update when this is True."""
    setting = cfg.cluster.offload_trainer_state
    if setting != "auto":
        return setting == "on"
    return bool(cfg.cluster.colocate) and (device or config_device(cfg)) == "cuda"


def target_gpu_memory_gb(cfg, override: float | None = None) -> float:
    """The plan's GPU memory: ``--gpu-mem-gb``, else ``cluster.gpu_memory_gb``, else for a GPU run this machine's
    GPU (a run on one node trains there), else 80. The check before a run and the choices frozen into it
    (``rollout.kv_cache_gb``) both plan for this card: a pool sized for an H200 was refused on resume as not
    fitting 80 GiB."""
    if override is not None:
        return float(override)
    if cfg.cluster.gpu_memory_gb is not None:
        return float(cfg.cluster.gpu_memory_gb)
    local = this_machine_gpu_gb() if config_device(cfg) == "cuda" else None
    return local if local is not None else 80.0


def _weight_path(cfg, device: str) -> str:
    """How the weights go to the engines: "broadcast", or the direct path's transport ("cuda_ipc", "host", "as_is")."""
    mode = layout.weight_sync_mode(cfg)
    return mode if mode == "broadcast" else layout.direct_transport(cfg, device)


def config_kwargs(cfg, device: str | None = None) -> dict[str, Any]:
    """:func:`estimate_memory`'s keywords for a ``GrpoConfig`` (training; eval generation is not counted)."""
    device = device or config_device(cfg)
    dtype = resolve_dtype(cfg, device)
    r, t = cfg.rollout, cfg.train
    return dict(
        tp=t.tensor_parallel, dp=t.data_parallel, micro_batch_size=t.micro_batch_size,
        seq_len=cfg.data.max_prompt_len + r.max_new_tokens, rollout_batch=first_rollout_rows(cfg),
        max_slots=max(cfg.samples_per_rollout, 1), max_new_tokens=r.max_new_tokens, dtype=dtype,
        colocate=cfg.cluster.colocate, ref_model=cfg.algorithm.kl_coef > 0, device=device, engine=r.engine,
        rollout_engines=layout.rollout_engines(cfg),
        sglang_mem_fraction=r.sglang.mem_fraction, sglang_tp=r.sglang.tp_size, global_batch_size=t.global_batch_size,
        kv_cache_gb=r.kv_cache_gb, offload=offload_enabled(cfg, device), max_tokens=t.max_tokens_per_micro_batch,
        recompute=t.recompute, recompute_modules=tuple(t.recompute_modules), recompute_num_layers=t.recompute_num_layers,
        fusions=t.fusions, chunked_logprobs=t.chunked_logprobs, core_attention=t.core_attention,
        deterministic=t.deterministic, distributed_optimizer=t.distributed_optimizer, grad_dtype=t.grad_dtype,
        optimizer_on_host=t.optimizer_on_host, ep=t.expert_parallel, weight_sync=_weight_path(cfg, device),
        lora=lora_memory.config_lora(cfg), shared_base=layout.shares_base(cfg),
        engine_apart=layout.engine_shares_gpu_across_processes(cfg),
        samples_per_prompt=r.n_samples_per_prompt, partial=r.partial, background_checkpoint=cfg.checkpoint.background,
        weights_dtype=r.weights_dtype if r.engine == "builtin" else "bf16",
        expert_shards=r.expert_shards if r.engine == "builtin" else 1,
        **{k: v for k, v in host_memory.node_layout(cfg).items() if k in ("trainer_ranks", "processes")})


def estimate_for_config(cfg, hf_config, *, gpu_mem_gb: float | None = None, device: str | None = None,
                        host_mem_gb: float | None = None, **engine_model) -> dict[str, Any]:
    """:func:`estimate_memory` for a ``GrpoConfig``; ``gpu_mem_gb`` default :func:`target_gpu_memory_gb`, the
    host's ``host_mem_gb`` default ``host_memory.target_host_memory_gb``. When it does not fit, ``fix`` names the
    settings that would (:func:`settings_that_fit`) and ``reason`` ends with them."""
    gpu = target_gpu_memory_gb(cfg, gpu_mem_gb)
    kw = {**config_kwargs(cfg, device), **engine_model}  # engine_model: e.g. kv_released, to model a measurement
    host_source = None
    # on the CPU the per-GPU plan is the host's already: a host of its own only when one is given
    if kw["device"] == "cuda" or host_mem_gb is not None or cfg.cluster.host_memory_gb is not None:
        kw["host_memory_gb"], host_source = host_memory.target_host_memory_gb(cfg, host_mem_gb, gpu)
    est = estimate_memory(hf_config, gpu_mem_gb=gpu, **kw)
    if est["host"] is not None:
        est["host"]["source"] = host_source
    est["fix"] = None
    if not est["fits"]:
        fix = settings_that_fit(estimate_memory, hf_config, gpu, kw)
        if fix is None and est.get("lora") and kw["device"] == "cuda" and kw["engine"] == "builtin":
            est["reason"] = lora_need(estimate_memory, hf_config, kw, est)
        if fix is not None:
            est["fix"] = fix
            host = fix[1]["host"]
            est["reason"] = f"{est['reason']}; fits with " + ", ".join(f"{k}={show_setting(v)}" for k, v in fix[0].items()) \
                + f" (peak {fix[1]['total']:.1f} GiB" \
                + (f", the plan's KV pool {fix[1]['kv_cache']:.2f} GiB" if fix[1]["kv_chosen"] else "") \
                + (f", host {host['total']:.1f} of {host['host_memory_gb']:g} GiB" if host is not None else "") + ")"
    return est


def plan_choices(cfg, hf_config, gpu_mem_gb: float | None = None) -> dict[str, Any]:
    """What the plan chooses for settings the config leaves open, as {config key: value}, to write into
    the frozen config: today ``rollout.kv_cache_gb`` (the built-in engine's pool on a GPU) when unset."""
    if cfg.rollout.kv_cache_gb is not None or config_device(cfg) != "cuda" or cfg.rollout.engine != "builtin":
        return {}
    est = estimate_for_config(cfg, hf_config, gpu_mem_gb=gpu_mem_gb)
    if est["decode_path"] != "paged" or not est["kv_chosen"] or not est["fits"]:
        return {}
    return {"rollout.kv_cache_gb": round(est["kv_cache_gb"], 2)}
