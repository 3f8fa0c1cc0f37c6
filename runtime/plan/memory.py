"""Per-GPU memory estimate for a run: trainer weights, gradients, optimizer, activations, and the
rollout engine's weights and KV cache, for a chosen parallelism and device.

The model follows what our code allocates on the device the run uses, not a generic formula.

Trainer (``runtime.trainer.megatron_trainer``), both devices:

* megatron DDP with an fp32 gradient buffer (``grad_reduce_in_fp32``) and megatron's
  non-distributed mixed-precision optimizer: an fp32 master copy of every parameter (none when the
  weights are already fp32), made when the trainer is built, and Adam's two fp32 moments, made at the
  first optimizer step. Weights, gradients and optimizer are split by tensor parallelism only (data
  parallelism replicates them). A reference copy of the weights when ``kl_coef > 0``.
* activations of one micro-batch, all of them kept for the backward (no recomputation), every
  sample padded to the micro-batch's longest (the estimate takes the worst case: every sample at
  ``max_prompt_len + max_new_tokens``).

On CUDA (what runs on a GPU; ``runtime.mcore.env`` / ``_chunked_logprobs_enabled``):

* attention is ``SdpaCoreAttention`` (flash/cuDNN through torch SDPA): per token and layer the
  tensors the layer saves for its backward, counted from megatron-core 0.16's local spec in bf16:
  the inputs and outputs of the two pre-norms (plus GLM4's two post-norms' inputs), Qwen3's fused
  q/k/v output (kept alive by the k-norm's input view) and the q-norm's input copy, SDPA's q, k at
  its own heads (v is a view of the fused output), its output and fp32 log-sum-exp, and the fused
  SwiGLU's fc1 output and product (``runtime.mcore.fusions``, on by default; with
  ``GRPOFLOW_TRAINER_FUSIONS=none``: k and v copied to every head, a context copy before the output
  projection, and SwiGLU's silu output as well); the norms' fp32 row statistics; one more layer's
  worth for the backward's working set; per position (not per sample) the bf16 cos/sin tables each
  RoPE multiply saves. No ``[heads, s, s]`` scores exist. Measured on the H100 with the fusions:
  1.6-3% above the activations at 768 to 9216 tokens per sample.
* at tensor parallelism 1 the log-probs go through the chunked output layer
  (``runtime/trainer/logprobs.py``): no ``[b, s, vocab]`` fp32 logits; the head's peak is its
  backward: an fp32 ``[vocab, hidden]`` weight-gradient accumulator, the bf16 ``dz^T h`` product and
  its fp32 cast, one chunk's ``[2048, vocab]`` logits gradient, plus the saved response rows and
  the final norm's input. Under TP > 1 megatron's vocab-parallel cross-entropy keeps full logits
  (20 bytes per logit, as on CPU).
* the built-in engine (``runtime.rollout.builtin``) takes the fast path (``static_decode``) when the
  model family has it (``unsupported_config_reason``): the HF weights (not TP-split), and a KV cache
  preallocated once, at the first rollout, by the engine's own policy (``kv_slot_len``,
  ``kv_budget_bytes``, ``kv_slots``): slots of ``round_up(max_prompt_len + max_new_tokens, 64)``
  tokens, as many as the first call's rows (dynamic sampling's over-sampled prompts × samples), at
  most ``max_batch_size`` (= samples per rollout, ``rollout/factory.py``), within half of the GPU
  memory free at that moment; continuous batching refills slots, so the cache never grows with
  length or request count. What is free then: the GPU minus the trainer's weights, gradients and
  master copy (Adam's moments come later, at the first step), the engine's weights and the
  overhead. Beyond the cache: a packed prefill of up to 16,384 prompt tokens and the sampler's
  per-slot vocab-sized temporaries. A family without the fast path decodes with HF's dynamic cache:
  every row of a batch (up to ``max_batch_size``) at full length, one layer's concatenation copy
  and the sampler's temporaries (~40 bytes per logit).
* colocated (``cluster.colocate``), nothing is released between rollout and training: the fast
  path keeps its cache, so the peak is the resident state (with Adam's moments, after the first
  step) + the KV cache + the larger of the training activations and the rollout's working set; the
  slow path's dynamic cache lives for one generate call, so there the peak is the resident state +
  the larger of the activations and the cache with its working set.
* SGLang (``rollout.engine: sglang``): by SGLang's documented ``--mem-fraction-static`` rule its
  weights plus KV pool fill ``mem_fraction × GPU`` minus what other processes hold when it starts
  (the trainer's resident state, when colocated); colocated it runs with ``--enable-memory-saver``
  and releases that memory during training, so the peak is the larger of rollout time and training
  time. Not measured here (SGLang cannot run on the machines we have).

On CPU the code differs and the CPU terms are kept: megatron's unfused ``DotProductAttention``
(``[heads, s, s]`` fp32 softmax output and its cast probabilities per layer), full-vocab fp32
logits (the cross-entropy's contiguous copy and the entropy metric's temporaries: 20 bytes per
logit, 16 for a single-sequence micro-batch) and the engine's slow path.

Measured (``torch.cuda.max_memory_allocated`` on an H100 80GB, torch 2.11, megatron-core 0.16.1,
random Qwen3-0.6B shape, bf16; bench/results/memory_check_H100_2026-11-22*.json): the shipped
qwen3-0.6b-dapo config colocated in one process peaks at 65.31 GiB (the estimate, without its
overhead: 65.20); the engine made 36 KV slots as estimated; one micro-batch's activations at 1 x 9216,
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
import os
from typing import Any

from runtime.devices import resolve_dtype
from runtime.mcore import fusions as megatron_fusions

GIB = 2**30
OVERHEAD_BYTES = 1 * GIB  # CUDA context, cuBLAS workspaces, allocator slack (one process)
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

# CPU path (megatron's unfused attention, full logits): per token and layer, bytes of saved activations
_PRE_NORM_BYTES = 12       # per hidden unit, each of the two pre-norms (fp32 upcast copies)
_POST_NORM_BYTES = 8       # per hidden unit, each GLM4 post-norm
_QK_NORM_BYTES = 8         # per q/k unit, Qwen3's per-head norms
_SWIGLU_ELEMS = 5          # per ffn unit: fc1 output (gate, up), silu(gate), product
_LOGIT_BYTES, _LOGIT_BYTES_SINGLE = 20, 16
_SAMPLER_BYTES_PER_LOGIT = 40
# CUDA path
_LOGPROB_CHUNK = 2048      # rows per output-layer chunk (runtime/trainer/logprobs.py: linear_logprobs)
_BACKWARD_LAYERS = 1       # layers' worth of activations the backward holds on top of the saved ones
_PREFILL_TOKENS = 16384    # StaticDecoder's packed-prefill budget
_FAST_SAMPLER_BYTES_PER_LOGIT = 24  # bf16 logits, fp32 scaled logits, log-softmax, noise, sum


def _dtype_bytes(dtype) -> int:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPE_BYTES)}, not {dtype!r}")
    return _DTYPE_BYTES[name]


def _shape(hf_config) -> dict[str, Any]:
    from runtime.models import get_adapter
    from runtime.models.base import head_dim

    adapter = get_adapter(hf_config)
    kw = adapter.transformer_config_kwargs(hf_config)  # also refuses configs the family cannot map
    d = head_dim(hf_config)
    rot = int(d * float(kw.get("rotary_percent", 1.0)))
    return dict(
        V=int(hf_config.vocab_size), h=kw["hidden_size"], L=kw["num_layers"], f=kw["ffn_hidden_size"],
        nh=kw["num_attention_heads"], ng=kw["num_query_groups"], d=d, rot=rot - rot % 2,
        qkv_bias=bool(kw["add_qkv_bias"]), qk_norm=bool(kw["qk_layernorm"]),
        post_norms=bool(getattr(adapter, "post_norms", False)),
        tied=bool(hf_config.tie_word_embeddings))


def fast_decode_reason(hf_config) -> str | None:
    """None when the built-in engine's fast path (static KV cache) serves this model on CUDA, else why not."""
    from runtime.rollout.static_decode import unsupported_config_reason
    return unsupported_config_reason(hf_config)


def _chunked_logprobs(device: str, tp: int) -> bool:
    """What ``MegatronTrainer._chunked_logprobs_enabled`` decides (TP 1; CUDA unless the env var says)."""
    if tp != 1:
        return False
    flag = os.environ.get("GRPOFLOW_CHUNKED_LOGPROBS")
    if flag is not None:
        return flag not in ("0", "", "false", "False")
    return device == "cuda"


def _flash_attention(device: str) -> bool:
    """What ``megatron_env.build_gpt_model`` builds: SDPA core attention on CUDA unless told 'local'."""
    return device == "cuda" and os.environ.get("GRPOFLOW_MEGATRON_ATTENTION", "sdpa") != "local"


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


def layer_bytes_per_token(hf_config, *, tp: int = 1, dtype="bfloat16", device: str = "cuda") -> int:
    """Bytes one decoder layer saves for its backward per token of a micro-batch (see the module doc)."""
    m = _shape(hf_config)
    e = _dtype_bytes(dtype)
    h, f, nh, ng, d = m["h"], m["f"] // tp, m["nh"] // tp, m["ng"] // tp, m["d"]
    q, kv = nh * d, ng * d
    if not _flash_attention(device):
        return (2 * _PRE_NORM_BYTES * h + (2 * _POST_NORM_BYTES * h if m["post_norms"] else 0)
                + (_QK_NORM_BYTES * (q + kv) if m["qk_norm"] else 0)
                + 2 * e * h                      # norm outputs: inputs of linear_qkv and fc1
                + 4 * e * q                      # q, k and v expanded to all heads, the context
                + _SWIGLU_ELEMS * e * f)
    norms = 2 + (2 if m["post_norms"] else 0)
    hidden = norms * e * h + 2 * e * h           # norm inputs (the residual stream) + pre-norm outputs
    qk_norm = e * (q + 2 * kv) + e * q if m["qk_norm"] else 0  # fused qkv kept by the k-norm's view + q-norm input
    fused = megatron_fusions.active(device)
    if "gqa" in fused:  # q, k at its own heads (v is a view of the fused qkv output), output, lse
        attention = e * q + e * kv + e * q + 4 * nh
    else:               # q, k/v copied to every head, output, lse, context copy
        attention = e * q + 2 * e * q + e * q + 4 * nh + e * q
    # fc1 output (gate|up) and the product; unfused also silu(gate)
    mlp = (3 if "swiglu" in fused else 4) * e * f
    stats = 4 * norms + (4 * (nh + ng) if m["qk_norm"] else 0)  # fp32 rstd per normalised row
    return hidden + qk_norm + attention + mlp + stats


def activation_terms(hf_config, *, tp: int, micro_batch_size: int, seq_len: int, dtype="bfloat16",
                     device: str = "cuda", response_len: int | None = None) -> dict[str, int]:
    """Peak activation bytes of one training micro-batch on one tensor-parallel rank, by part:
    ``layers`` (saved by the decoder layers, plus the backward's working set), ``attention_scores``
    (unfused attention only), ``logprob_head`` (output layer and log-probs), and ``total``.
    ``response_len``: response tokens per sample (default: all of ``seq_len``)."""
    m = _shape(hf_config)
    e = _dtype_bytes(dtype)
    V, h, L, nh = m["V"], m["h"], m["L"], m["nh"]
    b, s = micro_batch_size, seq_len
    r = s if response_len is None else min(response_len, s)
    per_token = layer_bytes_per_token(hf_config, tp=tp, dtype=dtype, device=device)
    if _flash_attention(device):
        layers = (L + _BACKWARD_LAYERS) * b * s * per_token + L * s * 4 * m["rot"] * e  # + RoPE cos/sin (q and k)
        scores = 0
    else:
        layers = L * b * s * per_token
        score_bytes = 4 + (e if e < 4 else 0)  # fp32 softmax output (+ the probabilities cast back)
        scores = L * b * (nh // tp) * s * s * score_bytes
    if _chunked_logprobs(device, tp):
        head = (b * r * h * e + b * s * h * e       # saved response rows, the final norm's input
                + V * h * (4 + e + 4)               # fp32 weight-grad accumulator, dz^T h and its fp32 cast
                + _LOGPROB_CHUNK * V * e)           # one chunk's logits gradient
    else:
        head = b * s * (V // tp) * (_LOGIT_BYTES_SINGLE if b == 1 else _LOGIT_BYTES)
    return {"layers": layers, "attention_scores": scores, "logprob_head": head, "total": layers + scores + head}


def activation_bytes(hf_config, *, tp: int, micro_batch_size: int, seq_len: int, dtype="bfloat16",
                     device: str = "cuda", response_len: int | None = None) -> int:
    """Peak activation bytes of one training micro-batch on one tensor-parallel rank."""
    return activation_terms(hf_config, tp=tp, micro_batch_size=micro_batch_size, seq_len=seq_len, dtype=dtype,
                            device=device, response_len=response_len)["total"]


def builtin_kv_cache(hf_config, *, slot_tokens: int, rows: int, max_slots: int, free_bytes: int,
                     dtype="bfloat16", device: str = "cuda", kv_cache_gb: float | None = None) -> dict[str, int]:
    """The fast path's KV cache by the engine's own policy (``static_decode``): ``bytes``, ``slots``,
    ``slot_len``, ``per_slot``, ``budget``. ``free_bytes``: GPU memory free when the first rollout
    starts. ``slots`` is 0 when one slot does not fit the budget (the engine raises MemoryError)."""
    from runtime.rollout.static_decode import kv_budget_bytes, kv_slot_len, kv_slots
    m = _shape(hf_config)
    slot_len = kv_slot_len(slot_tokens)
    per_slot = slot_len * 2 * m["L"] * m["ng"] * m["d"] * _dtype_bytes(dtype)
    budget = kv_budget_bytes(kv_cache_gb, device, max(int(free_bytes), 0), 0)
    slots = kv_slots(per_slot, budget, rows, max_slots) if per_slot <= budget else 0
    return {"bytes": slots * per_slot, "slots": slots, "slot_len": slot_len, "per_slot": per_slot, "budget": budget,
            "free": int(free_bytes)}


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
                    gpu_mem_gb: float = 80.0, rollout_engines: int = 1, ref_model: bool = False,
                    device: str = "cuda", engine: str = "builtin", max_slots: int | None = None,
                    kv_cache_gb: float | None = None, sglang_mem_fraction: float = 0.7, sglang_tp: int = 1,
                    global_batch_size: int | None = None) -> dict[str, Any]:
    """Peak memory per GPU, in GiB, of training ``hf_config``'s model with GRPO.

    ``seq_len``: the longest sample, prompt + response (``data.max_prompt_len +
    rollout.max_new_tokens``); ``max_new_tokens`` of it are generated, the rest is the prompt.
    ``rollout_batch``: rows of the engine's first generate call (``rollout_batch_size ×
    n_samples_per_prompt``, over-sampled under dynamic sampling), split over ``rollout_engines``;
    ``max_slots``: the built-in engine's ``max_batch_size`` (default ``rollout_batch``).
    ``dp`` replicates the trainer (the optimizer is not distributed) and does not change the
    per-GPU numbers; it is reported. ``ref_model``: a reference copy of the weights (``kl_coef > 0``).
    ``device``: "cuda" (flash attention, chunked log-probs at TP 1, the engine's fast path when the
    family has it) or "cpu" (unfused attention, full logits, the slow path). ``engine``: "builtin" or
    "sglang" (``sglang_mem_fraction``, ``sglang_tp``). ``global_batch_size`` lets the answer name a
    micro-batch size that divides the step.

    Returns ``weights``, ``grads``, ``optimizer``, ``activations``, ``kv_cache``, ``total`` (GiB),
    ``fits`` (bool), the engine's ``engine_weights`` and ``rollout_activations``, the per-role
    totals, ``params``, ``reason`` (None when it fits), ``fit_micro_batch`` (the largest micro-batch
    that fits, 0 if none), the KV cache's ``kv_slots`` / ``kv_slot_len``, ``decode_path`` and
    ``bytes`` (the same numbers, exact).
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
    e = _dtype_bytes(dtype)
    m = _shape(hf_config)
    n_params, per_rank = param_counts(hf_config, tp)
    limit = gpu_mem_gb * GIB

    weights = per_rank * e + (per_rank * e if ref_model else 0)
    grads = per_rank * 4                                   # fp32 DDP grad buffer
    master = per_rank * 4 if e < 4 else 0                  # fp32 master copy, made with the optimizer
    moments = per_rank * 8                                 # Adam m, v: made at the first step
    optimizer = master + moments
    act = activation_terms(hf_config, tp=tp, micro_batch_size=micro_batch_size, seq_len=seq_len, dtype=dtype,
                           device=device, response_len=max_new_tokens)
    activations = act["total"]
    trainer_resident0 = weights + grads + master           # what the trainer holds before its first step

    rows = math.ceil(rollout_batch / rollout_engines)
    slots_max = max_slots if max_slots is not None else rows
    prompt = seq_len - max_new_tokens
    kv_per_token = m["L"] * 2 * m["ng"] * m["d"] * e
    kv_info: dict[str, Any] = {}
    overhead = OVERHEAD_BYTES
    if engine == "sglang":
        decode_path = "sglang"
        engine_weights = n_params * e // sglang_tp
        others = trainer_resident0 if colocate else 0
        static = int(sglang_mem_fraction * limit) - others  # SGLang: weights + KV pool = fraction x GPU - others
        kv_cache = max(static - engine_weights, 0)
        rollout_activations = 0                            # inside SGLang's (1 - mem_fraction) share
        overhead = 2 * OVERHEAD_BYTES if colocate else OVERHEAD_BYTES  # two processes share the GPU
        kv_info = {"mem_fraction": sglang_mem_fraction, "static": static}
    else:
        engine_weights = n_params * e
        fast = device == "cuda" and fast_decode_reason(hf_config) is None
        decode_path = "static" if fast else "dynamic"
        if fast:
            resident_at_rollout = (trainer_resident0 if colocate else 0) + engine_weights + OVERHEAD_BYTES
            kv_info = builtin_kv_cache(hf_config, slot_tokens=seq_len, rows=rows, max_slots=slots_max,
                                       free_bytes=int(limit) - resident_at_rollout, dtype=dtype, device=device,
                                       kv_cache_gb=kv_cache_gb)
            kv_cache = kv_info["bytes"]
            live = max(kv_info["slots"], 1)
            prefill = min(_PREFILL_TOKENS, rows * max(prompt, 1)) * e * (
                3 * m["h"] + 2 * m["nh"] * m["d"] + 2 * m["ng"] * m["d"] + 3 * m["f"])
            decode = live * m["V"] * _FAST_SAMPLER_BYTES_PER_LOGIT
            rollout_activations = max(prefill, decode)
        else:
            batch_rows = min(rows, slots_max)
            kv_cache = batch_rows * seq_len * kv_per_token
            decode_extra = kv_cache // m["L"] + batch_rows * m["V"] * _SAMPLER_BYTES_PER_LOGIT
            prefill = batch_rows * prompt * (kv_per_token + e * (3 * m["f"] + 2 * m["nh"] * m["d"]
                                                                 + 2 * m["ng"] * m["d"] + 3 * m["h"]))
            rollout_activations = max(decode_extra, prefill - kv_cache)  # beyond the cache itself
            kv_info = {"slots": batch_rows, "slot_len": seq_len}

    def totals(act_bytes: int) -> tuple[int, int, int]:
        trainer_total = weights + grads + optimizer + act_bytes + OVERHEAD_BYTES
        rollout_total = engine_weights + kv_cache + rollout_activations + OVERHEAD_BYTES
        if not colocate:
            return trainer_total, rollout_total, max(trainer_total, rollout_total)
        if engine == "sglang":  # released during training (memory saver), back for every rollout
            at_rollout = weights + grads + optimizer + engine_weights + kv_cache + rollout_activations
            at_training = weights + grads + optimizer + act_bytes
            return trainer_total, rollout_total, max(at_rollout, at_training) + overhead
        resident = weights + grads + optimizer + engine_weights + overhead
        if decode_path == "static":  # the preallocated cache stays through training
            return trainer_total, rollout_total, resident + kv_cache + max(act_bytes, rollout_activations)
        # the slow path's dynamic cache lives for one generate call
        return trainer_total, rollout_total, resident + max(act_bytes, kv_cache + rollout_activations)

    trainer_total, rollout_total, total = totals(activations)
    fits = total <= limit and not (engine == "builtin" and decode_path == "static" and kv_info.get("slots") == 0) \
        and not (engine == "sglang" and kv_cache <= 0)
    per_rank_step = (global_batch_size // dp) if global_batch_size else None

    def total_at(b: int) -> int:
        a = activation_bytes(hf_config, tp=tp, micro_batch_size=b, seq_len=seq_len, dtype=dtype, device=device,
                             response_len=max_new_tokens)
        return totals(a)[2]

    fit_mb = _fits_micro_batch(total_at, micro_batch_size, limit, per_rank_step) if fits or micro_batch_size > 1 else 0
    if engine == "builtin" and decode_path == "static" and kv_info.get("slots") == 0:
        fit_mb = 0
    exact = dict(weights=weights, grads=grads, optimizer=optimizer, activations=activations, kv_cache=kv_cache,
                 engine_weights=engine_weights, rollout_activations=rollout_activations,
                 overhead=overhead, trainer_total=trainer_total, rollout_total=rollout_total, total=total,
                 optimizer_master=master, optimizer_moments=moments,
                 act_layers=act["layers"], act_attention_scores=act["attention_scores"],
                 act_logprob_head=act["logprob_head"])
    out: dict[str, Any] = {k: v / GIB for k, v in exact.items()}
    out.update(fits=fits, bytes=exact, params=n_params, params_per_gpu=per_rank, gpu_mem_gb=gpu_mem_gb,
               tp=tp, dp=dp, colocate=colocate, dtype=str(dtype).removeprefix("torch."), rollout_rows=rows,
               micro_batch_size=micro_batch_size, seq_len=seq_len, device=device, engine=engine,
               decode_path=decode_path, attention="flash (SDPA)" if _flash_attention(device) else "unfused",
               logprobs="chunked" if _chunked_logprobs(device, tp) else "full logits",
               kv_slots=kv_info.get("slots"), kv_slot_len=kv_info.get("slot_len"), kv_max_slots=slots_max,
               kv=kv_info, fit_micro_batch=fit_mb)
    out["max_tp"] = math.gcd(m["V"], m["nh"], m["ng"], m["f"])
    out["reason"] = None if fits else _why_not(out)
    return out


def _why_not(est: dict[str, Any]) -> str:
    gpu = est["gpu_mem_gb"]
    state = est["weights"] + est["grads"] + est["optimizer"]
    parts = {"weights+grads+optimizer": state, "activations": est["activations"], "kv_cache": est["kv_cache"],
             "engine_weights": est["engine_weights"]}
    big = sorted(parts.items(), key=lambda kv: -kv[1])[:2]
    hints = []
    state_bound = state + (est["engine_weights"] if est["colocate"] else 0) + est["overhead"] >= 0.75 * gpu
    if state_bound:
        if est["tp"] < est["max_tp"]:
            hints.append(f"more train.tensor_parallel (at most {est['max_tp']} for this model): the trainer's "
                         f"weights, fp32 gradients and fp32 master + Adam state alone take {state:.1f} GiB per GPU")
        else:
            hints.append(f"GPUs with more memory: the trainer's weights, fp32 gradients and fp32 master + Adam "
                         f"state alone take {state:.1f} GiB per GPU at tensor_parallel={est['tp']}, this model's "
                         f"limit, and data parallelism does not shard them (the trainer's optimizer is not "
                         f"distributed and it has no pipeline parallelism)")
    if est["decode_path"] == "static" and not est["kv_slots"]:
        hints.append(f"a smaller rollout.max_new_tokens: one KV slot of {est['kv_slot_len']} tokens "
                     f"({est['kv']['per_slot'] / GIB:.1f} GiB) is over the engine's budget (half the free memory)")
    elif not state_bound and (est["activations"] > 0.25 * gpu or 0 < est["fit_micro_batch"] < est["micro_batch_size"]):
        what = (f"train.micro_batch_size={est['fit_micro_batch']}" if est["fit_micro_batch"]
                else "a smaller train.micro_batch_size or shorter sequences" if est["micro_batch_size"] > 1
                else "shorter sequences (data.max_prompt_len + rollout.max_new_tokens)")
        cause = ("unfused attention keeps heads x seq_len^2 scores per layer" if est["attention"] == "unfused"
                 else f"{est['micro_batch_size']} x {est['seq_len']} tokens keep {est['activations']:.1f} GiB of "
                      f"activations")
        if est["decode_path"] == "static" and est["colocate"]:
            cause += "; the engine's KV cache takes half of the memory free at the first rollout"
        hints.append(f"{what} ({cause})")
    if est["decode_path"] == "dynamic" and est["kv_cache"] > 0.25 * gpu:
        hints.append("fewer samples per rollout or a smaller rollout.max_new_tokens (the engine's slow path "
                     "caches every row at full length)")
    if est["engine"] == "sglang" and est["colocate"] and est["kv_cache"] <= 0:
        hints.append("cluster.colocate=false or a larger rollout.sglang.mem_fraction: SGLang's share of the GPU "
                     "is taken by the trainer before it starts")
    return (f"needs {est['total']:.1f} GiB per GPU but the GPU has {gpu:g}; largest: "
            + ", ".join(f"{k} {v:.1f} GiB" for k, v in big) + "; try " + "; or ".join(hints or ["a larger GPU"]))


def format_estimate(est: dict[str, Any]) -> str:
    """Lines for ``grpoflow validate``."""
    kv_note = ""
    if est["decode_path"] == "static":
        kv_note = (f"{est['kv_slots']} slots x {est['kv_slot_len']} tokens, preallocated at the first rollout "
                   f"(of {est['kv_max_slots']} wanted; half the free memory)")
    elif est["decode_path"] == "dynamic":
        kv_note = f"{est['kv_slots']} rows x {est['kv_slot_len']} tokens (HF dynamic cache, slow path)"
    else:
        kv_note = f"SGLang pool: {est['kv']['mem_fraction']:g} x GPU - weights - others"
    act_note = (f"micro-batch {est['micro_batch_size']} x {est['seq_len']} tokens; {est['attention']} attention, "
                f"{est['logprobs']} log-probs")
    rows = [("weights", est["weights"], ""), ("gradients", est["grads"], "fp32"),
            ("optimizer", est["optimizer"], "fp32 master + Adam m, v" if est["optimizer_master"] else "Adam m, v"),
            ("activations", est["activations"], act_note), ("engine weights", est["engine_weights"], ""),
            ("KV cache", est["kv_cache"], kv_note), ("rollout extra", est["rollout_activations"], ""),
            ("overhead", est["overhead"], "CUDA context, allocator slack")]
    head = (f"memory per GPU (tp={est['tp']}, dp={est['dp']}, {'colocated' if est['colocate'] else 'separate'} "
            f"trainer/rollout, {est['dtype']}, {est['params'] / 1e9:.2f}B params, {est['device']}):")
    lines = [head] + [f"  {name:<15}{gib:8.2f} GiB" + (f"   {note}" if note else "") for name, gib, note in rows]
    verdict = "fits" if est["fits"] else "DOES NOT FIT"
    lines.append(f"  {'total':<15}{est['total']:8.2f} GiB of {est['gpu_mem_gb']:g} GiB: {verdict}")
    if est["reason"]:
        lines.append(f"  {est['reason']}")
    return "\n".join(lines)


def first_rollout_rows(cfg) -> int:
    """Rows of the engine's first generate call (``runtime.grpo.session``): dynamic sampling over-samples prompts."""
    r = cfg.rollout
    prompts = max(r.rollout_batch_size, int(r.rollout_batch_size * r.over_sampling_factor)) \
        if r.dynamic_sampling else r.rollout_batch_size
    return prompts * r.n_samples_per_prompt


def estimate_for_config(cfg, hf_config, *, gpu_mem_gb: float = 80.0, device: str | None = None) -> dict[str, Any]:
    """:func:`estimate_memory` for a ``GrpoConfig`` (training; eval generation is not counted).
    ``device``: default the config's ``cluster.device`` ("auto" counts as a GPU run)."""
    if device is None:
        device = "cpu" if cfg.cluster.device == "cpu" else "cuda"
    dtype = resolve_dtype(cfg, device)
    r = cfg.rollout
    return estimate_memory(
        hf_config, tp=cfg.train.tensor_parallel, dp=cfg.train.data_parallel,
        micro_batch_size=cfg.train.micro_batch_size,
        seq_len=cfg.data.max_prompt_len + r.max_new_tokens,
        rollout_batch=first_rollout_rows(cfg), max_slots=max(cfg.samples_per_rollout, 1),
        max_new_tokens=r.max_new_tokens, dtype=dtype, colocate=cfg.cluster.colocate,
        gpu_mem_gb=gpu_mem_gb, ref_model=cfg.algorithm.kl_coef > 0, device=device, engine=r.engine,
        sglang_mem_fraction=r.sglang.mem_fraction, sglang_tp=r.sglang.tp_size,
        global_batch_size=cfg.train.global_batch_size)
