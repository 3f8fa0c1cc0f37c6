"""Per-GPU memory estimate for a run: trainer weights, gradients, optimizer, activations, and the
rollout engine's weights and KV cache, for a chosen parallelism.

The model follows what our code allocates, not a generic formula:

* trainer (``runtime.trainer.megatron_trainer``): megatron DDP with an fp32 gradient buffer
  (``grad_reduce_in_fp32``), a non-distributed Adam (fp32 master copy unless the weights are already
  fp32, plus two fp32 moments), weights, gradients and optimizer split by tensor parallelism only
  (data parallelism replicates them); a reference model when ``kl_coef > 0``;
* activations of one micro-batch on megatron-core's local layer spec without recomputation: per
  token and layer the saved inputs of every linear, RMSNorm's fp32 copies, the SwiGLU
  intermediates, q / expanded k / v and the context, plus unfused attention's [heads, s, s]
  softmax output (fp32) and its cast probabilities; on top, the log-prob head: fp32 logits, the
  cross-entropy's contiguous fp32 copy and the entropy metric's three fp32 temporaries
  (20 bytes per logit; 16 when the micro-batch is a single sequence, whose transpose is free);
* built-in engine (``runtime.rollout.builtin``): a full (not TP-split) HF copy of the weights and a
  dynamic KV cache of every row of a rollout at full length, plus one layer's concatenation copy
  and the sampler's per-row vocab-sized temporaries (~40 bytes per logit).

Colocated (``cluster.colocate``), trainer and engine share each GPU: the trainer's state and the
engine's weights stay resident, and the peak is the larger of the training activations and the
engine's KV cache. Otherwise they are counted on separate GPUs and both must fit.

Calibrated on an H100 (torch 2.11, megatron-core 0.16.1, Qwen3-0.6B shape, bf16): trainer
activations at 7 (micro-batch, length) points from 1×1024 to 1×4096 within 5% of
``torch.cuda.max_memory_allocated``; engine KV peaks at 3 (rows, length) points within 3%. Sizes are
GiB (2**30 bytes), which is what ``nvidia-smi`` and ``torch`` call GB/GiB; ``total`` adds 1 GiB for the
CUDA context and allocator slack.
"""
from __future__ import annotations

import math
from typing import Any

GIB = 2**30
OVERHEAD_BYTES = 1 * GIB  # CUDA context, cuBLAS workspaces, allocator slack
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

# per token and layer, bytes of saved activations (see the module docstring)
_PRE_NORM_BYTES = 12       # per hidden unit, each of the two pre-norms (fp32 upcast copies)
_POST_NORM_BYTES = 8       # per hidden unit, each GLM4 post-norm
_QK_NORM_BYTES = 8         # per q/k unit, Qwen3's per-head norms
_SWIGLU_ELEMS = 5          # per ffn unit: fc1 output (gate, up), silu(gate), product
_LOGIT_BYTES, _LOGIT_BYTES_SINGLE = 20, 16
_SAMPLER_BYTES_PER_LOGIT = 40


def _dtype_bytes(dtype) -> int:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPE_BYTES)}, not {dtype!r}")
    return _DTYPE_BYTES[name]


def _shape(hf_config) -> dict[str, Any]:
    from .models import get_adapter
    from .models.base import head_dim

    adapter = get_adapter(hf_config)
    kw = adapter.transformer_config_kwargs(hf_config)  # also refuses configs the family cannot map
    return dict(
        V=int(hf_config.vocab_size), h=kw["hidden_size"], L=kw["num_layers"], f=kw["ffn_hidden_size"],
        nh=kw["num_attention_heads"], ng=kw["num_query_groups"], d=head_dim(hf_config),
        qkv_bias=bool(kw["add_qkv_bias"]), qk_norm=bool(kw["qk_layernorm"]),
        post_norms=bool(getattr(adapter, "post_norms", False)),
        tied=bool(hf_config.tie_word_embeddings))


def param_counts(hf_config, tp: int = 1) -> tuple[int, int]:
    """(parameters of the model, parameters one tensor-parallel rank holds)."""
    m = _shape(hf_config)
    V, h, L, f, nh, ng, d = m["V"], m["h"], m["L"], m["f"], m["nh"], m["ng"], m["d"]
    if V % tp or nh % tp or ng % tp or f % tp:
        raise ValueError(f"tensor_parallel={tp} must divide vocab_size {V}, attention heads {nh}, "
                         f"key-value heads {ng} and ffn size {f}")
    qkv = (nh + 2 * ng) * d
    split = (1 if m["tied"] else 2) * V * h + L * (h * qkv + (qkv if m["qkv_bias"] else 0) + nh * d * h + 3 * h * f)
    replicated = L * (2 * h + (2 * h if m["post_norms"] else 0) + (2 * d if m["qk_norm"] else 0)) + h
    return split + replicated, split // tp + replicated


def activation_bytes(hf_config, *, tp: int, micro_batch_size: int, seq_len: int, dtype="bfloat16") -> int:
    """Peak activation bytes of one training micro-batch on one tensor-parallel rank."""
    m = _shape(hf_config)
    e = _dtype_bytes(dtype)
    V, h, L, f, nh, ng, d = m["V"], m["h"], m["L"], m["f"], m["nh"], m["ng"], m["d"]
    b, s = micro_batch_size, seq_len
    q, kv = nh * d, ng * d
    per_token_layer = (2 * _PRE_NORM_BYTES * h + (2 * _POST_NORM_BYTES * h if m["post_norms"] else 0)
                       + (_QK_NORM_BYTES * (q + kv) // tp if m["qk_norm"] else 0)
                       + 2 * e * h                      # norm outputs: inputs of linear_qkv and fc1
                       + 4 * e * q // tp                # q, k and v expanded to all heads, the context
                       + _SWIGLU_ELEMS * e * f // tp)
    score_bytes = 4 + (e if e < 4 else 0)  # fp32 softmax output (+ the probabilities cast back)
    scores = b * (nh // tp) * s * s * score_bytes
    logits = b * s * (V // tp) * (_LOGIT_BYTES_SINGLE if b == 1 else _LOGIT_BYTES)
    return L * (b * s * per_token_layer + scores) + logits


def estimate_memory(hf_config, *, tp: int = 1, dp: int = 1, micro_batch_size: int, seq_len: int,
                    rollout_batch: int, max_new_tokens: int, dtype="bfloat16", colocate: bool = True,
                    gpu_mem_gb: float = 80.0, rollout_engines: int = 1, ref_model: bool = False) -> dict[str, Any]:
    """Peak memory per GPU, in GiB, of training ``hf_config``'s model with GRPO.

    ``seq_len``: the longest sample, prompt + response (``data.max_prompt_len +
    rollout.max_new_tokens``); ``max_new_tokens`` of it are generated, the rest is the prompt.
    ``rollout_batch``: samples per rollout (``rollout_batch_size × n_samples_per_prompt``), split
    over ``rollout_engines`` built-in engines, each decoding all of its rows at once.
    ``dp`` replicates the trainer (the optimizer is not distributed) and does not change the
    per-GPU numbers; it is reported. ``ref_model``: a reference copy of the weights (``kl_coef > 0``).

    Returns ``weights``, ``grads``, ``optimizer``, ``activations``, ``kv_cache``, ``total`` (GiB),
    ``fits`` (bool), the engine's ``engine_weights`` and ``rollout_activations``, the per-role
    totals, ``params``, ``reason`` (None when it fits) and ``bytes`` (the same numbers, exact).
    """
    for name, v in (("tp", tp), ("dp", dp), ("micro_batch_size", micro_batch_size), ("seq_len", seq_len),
                    ("rollout_batch", rollout_batch), ("max_new_tokens", max_new_tokens),
                    ("rollout_engines", rollout_engines)):
        if int(v) < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    if max_new_tokens > seq_len:
        raise ValueError(f"seq_len ({seq_len}) is prompt + response and must be >= max_new_tokens ({max_new_tokens})")
    e = _dtype_bytes(dtype)
    m = _shape(hf_config)
    n_params, per_rank = param_counts(hf_config, tp)

    weights = per_rank * e + (per_rank * e if ref_model else 0)
    grads = per_rank * 4                                   # fp32 DDP grad buffer
    optimizer = per_rank * ((4 if e < 4 else 0) + 8)       # fp32 master (unless fp32 already) + Adam m, v
    activations = activation_bytes(hf_config, tp=tp, micro_batch_size=micro_batch_size, seq_len=seq_len, dtype=dtype)

    rows = math.ceil(rollout_batch / rollout_engines)
    prompt = seq_len - max_new_tokens
    kv_per_token = m["L"] * 2 * m["ng"] * m["d"] * e
    kv_cache = rows * seq_len * kv_per_token
    decode_extra = kv_cache // m["L"] + rows * m["V"] * _SAMPLER_BYTES_PER_LOGIT
    prefill = rows * prompt * (kv_per_token + e * (3 * m["f"] + 2 * m["nh"] * m["d"] + 2 * m["ng"] * m["d"] + 3 * m["h"]))
    rollout_activations = max(decode_extra, prefill - kv_cache)  # beyond the cache itself
    engine_weights = n_params * e

    trainer_total = weights + grads + optimizer + activations + OVERHEAD_BYTES
    rollout_total = engine_weights + kv_cache + rollout_activations + OVERHEAD_BYTES
    if colocate:
        total = (weights + grads + optimizer + engine_weights
                 + max(activations, kv_cache + rollout_activations) + OVERHEAD_BYTES)
    else:
        total = max(trainer_total, rollout_total)
    limit = gpu_mem_gb * GIB
    fits = total <= limit
    exact = dict(weights=weights, grads=grads, optimizer=optimizer, activations=activations, kv_cache=kv_cache,
                 engine_weights=engine_weights, rollout_activations=rollout_activations,
                 overhead=OVERHEAD_BYTES, trainer_total=trainer_total, rollout_total=rollout_total, total=total)
    out: dict[str, Any] = {k: v / GIB for k, v in exact.items()}
    out.update(fits=fits, bytes=exact, params=n_params, params_per_gpu=per_rank, gpu_mem_gb=gpu_mem_gb,
               tp=tp, dp=dp, colocate=colocate, dtype=str(dtype).removeprefix("torch."), rollout_rows=rows)
    out["max_tp"] = math.gcd(m["V"], m["nh"], m["ng"], m["f"])
    out["reason"] = None if fits else _why_not(out)
    return out


def _why_not(est: dict[str, Any]) -> str:
    gpu = est["gpu_mem_gb"]
    parts = {"weights+grads+optimizer": est["weights"] + est["grads"] + est["optimizer"],
             "activations": est["activations"], "kv_cache": est["kv_cache"], "engine_weights": est["engine_weights"]}
    big = sorted(parts.items(), key=lambda kv: -kv[1])[:2]
    hints = []
    if est["activations"] > 0.25 * gpu:
        hints.append("a smaller train.micro_batch_size or shorter sequences (unfused attention keeps "
                     "heads x seq_len^2 scores per layer)")
    if est["kv_cache"] > 0.25 * gpu:
        hints.append("fewer samples per rollout or a smaller rollout.max_new_tokens (the engine caches every row)")
    if parts["weights+grads+optimizer"] > 0.25 * gpu:
        hints.append(f"more train.tensor_parallel (at most {est['max_tp']} for this model)"
                     if est["tp"] < est["max_tp"] else
                     f"more GPU memory: tensor_parallel={est['tp']} is this model's limit")
    return (f"needs {est['total']:.1f} GiB per GPU but the GPU has {gpu:g}; largest: "
            + ", ".join(f"{k} {v:.1f} GiB" for k, v in big) + "; try " + "; or ".join(hints or ["a larger GPU"]))


def format_estimate(est: dict[str, Any]) -> str:
    """Lines for ``grpoflow validate``."""
    rows = [("weights", est["weights"]), ("gradients", est["grads"]), ("optimizer", est["optimizer"]),
            ("activations", est["activations"]), ("engine weights", est["engine_weights"]),
            ("KV cache", est["kv_cache"]), ("rollout extra", est["rollout_activations"]),
            ("overhead", est["overhead"])]
    head = (f"memory per GPU (tp={est['tp']}, dp={est['dp']}, {'colocated' if est['colocate'] else 'separate'} "
            f"trainer/rollout, {est['dtype']}, {est['params'] / 1e9:.2f}B params):")
    lines = [head] + [f"  {name:<15}{gib:8.2f} GiB" for name, gib in rows]
    verdict = "fits" if est["fits"] else "DOES NOT FIT"
    lines.append(f"  {'total':<15}{est['total']:8.2f} GiB of {est['gpu_mem_gb']:g} GiB: {verdict}")
    if est["reason"]:
        lines.append(f"  {est['reason']}")
    return "\n".join(lines)


def _rollout_samples(cfg) -> int:
    """Samples one rollout generates: dynamic sampling over-samples prompts."""
    r = cfg.rollout
    prompts = math.ceil(r.rollout_batch_size * r.over_sampling_factor) if r.dynamic_sampling else r.rollout_batch_size
    return prompts * r.n_samples_per_prompt


def estimate_for_config(cfg, hf_config, *, gpu_mem_gb: float = 80.0) -> dict[str, Any]:
    """:func:`estimate_memory` for a ``GrpoConfig`` (training; eval generation is not counted)."""
    dtype = cfg.model.dtype if cfg.model.dtype != "auto" else "bfloat16"
    return estimate_memory(
        hf_config, tp=cfg.train.tensor_parallel, dp=cfg.train.data_parallel,
        micro_batch_size=cfg.train.micro_batch_size,
        seq_len=cfg.data.max_prompt_len + cfg.rollout.max_new_tokens,
        rollout_batch=_rollout_samples(cfg),
        max_new_tokens=cfg.rollout.max_new_tokens, dtype=dtype, colocate=cfg.cluster.colocate,
        gpu_mem_gb=gpu_mem_gb, ref_model=cfg.algorithm.kl_coef > 0)
