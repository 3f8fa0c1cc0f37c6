"""Per-GPU memory estimate for a run: trainer weights, gradients, optimizer, activations, and the
rollout engine's weights and KV cache, for a chosen parallelism and device.

The model follows what our code allocates on the device the run uses, not a generic formula.

Trainer (``runtime.trainer.megatron_trainer``), both devices:

* megatron DDP with a gradient buffer of every parameter, fp32 (``train.grad_dtype: float32``, megatron's
  ``grad_reduce_in_fp32``) or in the weights' dtype (``bfloat16``), and megatron's mixed-precision
  optimizer: an fp32 master copy of every parameter (none when the weights are already fp32), made when
  the trainer is built, and Adam's two fp32 moments, made at the first optimizer step. Weights and
  gradients are split by tensor parallelism only (data parallelism replicates them); the master and
  moments too, unless ``train.distributed_optimizer`` shards them over the data-parallel ranks (1/DP each;
  its gradient buffer stays whole: megatron reduce-scatters in place). A reference copy of the weights
  when ``kl_coef > 0``.
* activations of one micro-batch: ``micro_batch_size`` samples padded to the longest (the worst case:
  every sample at ``max_prompt_len + max_new_tokens``), or with ``train.max_tokens_per_micro_batch``
  a packed micro-batch of that many tokens (no padding; the worst case: the budget full). Without
  recomputation every layer keeps what it saves for its backward; ``train.recompute: selective``
  drops what the named modules save (the pre-norm outputs for ``layernorm``, the SwiGLU tensors for
  ``mlp``); ``full`` keeps only each recomputed layer's bf16 input. The backward's working set is one
  layer's worth in every case (the recomputed layer).
* ``cluster.offload_trainer_state``: gradients, fp32 master and Adam moments are off the GPU during the
  rollout phase (``runtime/trainer/state_offload.py``).
* ``train.lora``: the base frozen (its weights only), gradients / master / Adam for the adapters, the adapters'
  activations, and the engine's base not counted when it shares the trainer's (``runtime/plan/lora_memory.py``).
* the engine's KV pool is ``rollout.kv_cache_gb`` GiB (the paged engine); unset on a GPU, the plan chooses the largest
  pool, in quarter GiB, that leaves ``KV_MARGIN_FRACTION`` of the GPU free in both phases, and the run
  writes it into its frozen config. The pool counts in the training phase unless the engine gives it
  back for training (``engine_releases_kv``).

On CUDA (what runs on a GPU; ``runtime.mcore.env`` / ``_chunked_logprobs_enabled``):

* attention is ``SdpaCoreAttention`` (flash/cuDNN through torch SDPA): per token and layer the
  tensors the layer saves for its backward, counted from megatron-core 0.16's local spec in bf16:
  the inputs and outputs of the two pre-norms (plus GLM4's two post-norms' inputs), Qwen3's fused
  q/k/v output (kept alive by the k-norm's input view) and the q-norm's input copy, SDPA's q, k at
  its own heads (v is a view of the fused output), its output and fp32 log-sum-exp, and the fused
  SwiGLU's fc1 output and product (``runtime.mcore.fusions``, on by default; with
  ``train.fusions: none``: k and v copied to every head, a context copy before the output
  projection, and SwiGLU's silu output as well); the norms' fp32 row statistics; one more layer's
  worth for the backward's working set; per position (not per sample) the bf16 cos/sin tables each
  RoPE multiply saves. No ``[heads, s, s]`` scores exist. Measured on the H100 with the fusions:
  1.6-3% above the activations at 768 to 9216 tokens per sample.
  ``train.deterministic`` adds to the backward's working set the deterministic kernel's fp32 dQ buffer per
  split (``deterministic_dq_bytes``, from FlashAttention-2's allocation; not measured on its own).
* at tensor parallelism 1 the log-probs go through the chunked output layer
  (``runtime/trainer/logprobs.py``): no ``[b, s, vocab]`` fp32 logits; the head's peak is its
  backward: an fp32 ``[vocab, hidden]`` weight-gradient accumulator, the bf16 ``dz^T h`` product and
  its fp32 cast, one chunk's ``[2048, vocab]`` logits gradient, plus the saved response rows and
  the final norm's input. Under TP > 1 megatron's vocab-parallel cross-entropy keeps full logits
  (20 bytes per logit, as on CPU).
* the built-in engine (``runtime.rollout.builtin``) takes the fast path when the model family has it
  (``unsupported_config_reason``): the HF weights (not TP-split), the KV pool above, and beyond it a
  packed prefill and the sampler's per-row vocab-sized temporaries (rows: at most ``max_batch_size`` =
  samples per rollout). The prefill holds one prompt per group of samples among the rows admitted together,
  up to 16,384 tokens; rows that come back with tokens (partial rollout's continued samples, the preempted rows
  of a pool that holds fewer full-length samples than rows) are prefilled one by one with their tokens and
  fill those 16,384, by up to one prompt more. A family without
  the fast path decodes with HF's dynamic cache: every row of a batch (up to ``max_batch_size``) at full
  length for one generate call, one layer's concatenation copy and the sampler's temporaries.
* data-parallel rollout (``cluster.rollout_gpus`` > 1 with the built-in engine): one engine on each rollout
  GPU, each with the whole weights, its own KV pool and the working set of its share of the requests
  (``rollout_engines``: the rows split evenly); the per-GPU numbers are those of a GPU that holds an engine.
* colocated: the peak is the largest of the rollout phase (trainer weights, its state unless offloaded,
  engine weights, KV pool, rollout working set), the training phase (trainer weights and state,
  engine weights, the pool unless released, activations) and, under tensor parallelism, the weight sync
  after the update (each TP rank gathers the whole bf16 weights for the engines beside its state).
* ``train.optimizer_on_host``: no fp32 master, Adam moments or step temporaries on the GPU; the host's side
  (and every run's host memory per node) is runtime/plan/host_memory.py's.
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
from runtime.plan import host_memory
from runtime.mcore import fusions as megatron_fusions
from runtime.plan import lora_memory

GIB = 2**30
# CUDA context, cuBLAS workspaces, allocator slack (one process). Measured on the H100 (2026-11-25, colocated,
# bench/results/memory_check_H100_2026-11-25_{24gb,80gb}_empty_cache.json): context 0.61 GiB, and at the peak
# 0.72 GiB (24 GiB) / 0.76 GiB (80 GiB) reserved beyond what is allocated.
OVERHEAD_BYTES = int(1.35 * GIB)
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
# FlashAttention-2's deterministic backward (train.deterministic) accumulates dQ in one fp32 buffer per split instead
# of one shared by atomic adds: ceil(SMs / (sequences x heads)) splits. The SM count of the H100 and H200 we measure on.
_FLASH_SMS = 132
_PREFILL_TOKENS = 16384    # the paged decoder's packed-prefill budget
# the sampler's peak per logit: bf16 logits, their fp32 copy, the scaled logits, the log-softmax, the noise
# (measured 17.6 B on the H100 at 256 rows, where the decode step is the rollout's peak)
_FAST_SAMPLER_BYTES_PER_LOGIT = 18
_OPT_STEP_BYTES_PER_PARAM = 4  # transient of the optimizer step, beside its state


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
    """None when the built-in engine's fast path (the paged decoder) serves this model on CUDA, else why not."""
    from runtime.rollout.decode_model import unsupported_config_reason
    return unsupported_config_reason(hf_config)


def _chunked_logprobs(device: str, tp: int, setting: str = "auto") -> bool:
    """What ``MegatronTrainer._chunked_logprobs_enabled`` decides (TP 1; ``train.chunked_logprobs``)."""
    if tp != 1:
        return False
    if setting != "auto":
        return setting == "on"
    return device == "cuda"


def _flash_attention(device: str, core_attention: str = "auto", packed: bool = False) -> bool:
    """What ``runtime.mcore.env.build_gpt_model`` builds: SDPA core attention (``uses_sdpa_attention``)."""
    if core_attention == "sdpa":
        return True
    if core_attention == "megatron":
        return False
    return device == "cuda" or packed


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


def layer_bytes_per_token(hf_config, *, tp: int = 1, dtype="bfloat16", device: str = "cuda", fusions="auto",
                          core_attention: str = "auto", packed: bool = False,
                          recompute_modules: tuple[str, ...] = ()) -> int:
    """Bytes one decoder layer saves for its backward per token of a micro-batch (see the module doc).
    ``recompute_modules``: selective recomputation's modules (their saved tensors are not kept)."""
    m = _shape(hf_config)
    e = _dtype_bytes(dtype)
    h, f, nh, ng, d = m["h"], m["f"] // tp, m["nh"] // tp, m["ng"] // tp, m["d"]
    q, kv = nh * d, ng * d
    if not _flash_attention(device, core_attention, packed):
        return (2 * _PRE_NORM_BYTES * h + (2 * _POST_NORM_BYTES * h if m["post_norms"] else 0)
                + (_QK_NORM_BYTES * (q + kv) if m["qk_norm"] else 0)
                + 2 * e * h                      # norm outputs: inputs of linear_qkv and fc1
                + 4 * e * q                      # q, k and v expanded to all heads, the context
                + _SWIGLU_ELEMS * e * f)
    norms = 2 + (2 if m["post_norms"] else 0)
    # norm inputs (the residual stream) + the two pre-norm outputs (dropped when the norms are recomputed)
    hidden = norms * e * h + (0 if "layernorm" in recompute_modules else 2 * e * h)
    qk_norm = e * (q + 2 * kv) + e * q if m["qk_norm"] else 0  # fused qkv kept by the k-norm's view + q-norm input
    fused = megatron_fusions.active(device, fusions)
    if "gqa" in fused:  # q, k at its own heads (v is a view of the fused qkv output), output, lse
        attention = e * q + e * kv + e * q + 4 * nh
    else:               # q, k/v copied to every head, output, lse, context copy
        attention = e * q + 2 * e * q + e * q + 4 * nh + e * q
    if "core_attn" in recompute_modules:  # the checkpoint keeps q, k, v; the output and lse are recomputed
        attention -= e * q + 4 * nh
    # fc1 output (gate|up) and the product; unfused also silu(gate); recomputed: none of them
    mlp = 0 if "mlp" in recompute_modules else (3 if "swiglu" in fused else 4) * e * f
    stats = 4 * norms + (4 * (nh + ng) if m["qk_norm"] else 0)  # fp32 rstd per normalised row
    return hidden + qk_norm + attention + mlp + stats


def activation_terms(hf_config, *, tp: int, micro_batch_size: int, seq_len: int, dtype="bfloat16",
                     device: str = "cuda", response_len: int | None = None, max_tokens: int | None = None,
                     recompute: str = "none", recompute_modules=("layernorm", "mlp"),
                     recompute_num_layers: int | None = None, fusions="auto", chunked_logprobs: str = "auto",
                     core_attention: str = "auto", frozen_head: bool = False,
                     deterministic: bool = False) -> dict[str, int]:
    """Peak activation bytes of one training micro-batch on one tensor-parallel rank, by part:
    ``layers`` (saved by the decoder layers, plus the backward's working set), ``attention_scores``
    (unfused attention only), ``logprob_head`` (output layer and log-probs), and ``total``.
    ``response_len``: response tokens per sample (default: all of ``seq_len``). ``max_tokens``: packed
    micro-batches of at most that many tokens (the worst case: the budget full) instead of
    ``micro_batch_size`` samples of ``seq_len``. ``recompute*``: ``train.recompute`` and its modules/layers.
    ``frozen_head``: the output layer is frozen (LoRA): the chunked head keeps no weight-gradient accumulator.
    ``deterministic`` (``train.deterministic``): flash attention's backward holds :func:`deterministic_dq_bytes` more.
    """
    m = _shape(hf_config)
    e = _dtype_bytes(dtype)
    V, h, L, nh = m["V"], m["h"], m["L"], m["nh"]
    s = seq_len
    r = s if response_len is None else min(response_len, s)
    packed = max_tokens is not None
    tokens = max_tokens if packed else micro_batch_size * s       # tokens of the micro-batch's forward
    resp_tokens = tokens * r // s if packed else micro_batch_size * r
    longest = min(s, tokens)                                      # one sample's length (attention, RoPE tables)
    flash = _flash_attention(device, core_attention, packed)
    selective = tuple(recompute_modules) if recompute == "selective" else ()
    per_token = layer_bytes_per_token(hf_config, tp=tp, dtype=dtype, device=device, fusions=fusions,
                                      core_attention=core_attention, packed=packed)
    kept = layer_bytes_per_token(hf_config, tp=tp, dtype=dtype, device=device, fusions=fusions,
                                 core_attention=core_attention, packed=packed, recompute_modules=selective)
    full = (min(recompute_num_layers or L, L)) if recompute == "full" else 0
    # full recompute: those layers keep only their input (the residual stream, e x h per token)
    saved = (L - full) * tokens * kept + full * tokens * e * h
    # RoPE cos/sin (q and k), per position, saved by the layers that keep their activations (and the one
    # being recomputed)
    rope = (L - full + (1 if full else 0)) * (tokens if packed else s) * 4 * m["rot"] * e
    if flash:
        layers = saved + rope
        backward = _BACKWARD_LAYERS * tokens * per_token
        if deterministic and device == "cuda":
            backward += deterministic_dq_bytes(m, tp=tp, tokens=tokens, sequences=-(-tokens // longest) if packed
                                               else micro_batch_size, padded_len=None if packed else s)
        scores = 0
    else:
        layers = saved + (_BACKWARD_LAYERS * tokens * per_token if recompute != "none" else 0)
        score_bytes = 4 + (e if e < 4 else 0)  # fp32 softmax output (+ the probabilities cast back)
        # unfused: [heads, s, s] per sample; packed (block-causal SDPA on CPU): [heads, t, t] per micro-batch
        span = tokens if packed else longest
        scores = (L if recompute == "none" else 1) * (1 if packed else micro_batch_size) * (nh // tp) * span * span \
            * score_bytes
        backward = 0
    if _chunked_logprobs(device, tp, chunked_logprobs):
        head = (resp_tokens * h * e + tokens * h * e        # saved response rows, the final norm's input
                + (0 if frozen_head else V * h * (4 + e + 4))  # fp32 weight-grad accumulator, dz^T h, its fp32 cast
                + _LOGPROB_CHUNK * V * e)                   # one chunk's logits gradient
    else:
        head = tokens * (V // tp) * (_LOGIT_BYTES_SINGLE if (micro_batch_size == 1 or packed) else _LOGIT_BYTES)
    # the head's backward (its weight-gradient accumulators) runs first, before any layer's backward
    # (or recomputation) holds its working set: they peak one after the other, beside what the layers keep
    return {"layers": layers + backward, "attention_scores": scores, "logprob_head": head,
            "total": layers + scores + (max(head, backward) if flash else head)}


def deterministic_dq_bytes(m: dict, *, tp: int, tokens: int, sequences: int, padded_len: int | None) -> int:
    """What FlashAttention-2's deterministic backward holds beyond its usual fp32 dQ accumulator, at its largest:
    ``tokens`` in ``sequences`` (the fewest the micro-batch can hold: the most splits), varlen (packed) or padded
    to ``padded_len``. 0 where there is one split (sequences x heads >= the SMs)."""
    heads, d = m["nh"] // tp, -(-m["d"] // 32) * 32
    splits = -(-_FLASH_SMS // (sequences * heads))
    rows = tokens + 128 * sequences if padded_len is None else sequences * -(-padded_len // 128) * 128
    return (splits - 1) * rows * heads * d * 4


def activation_bytes(hf_config, **kwargs) -> int:
    """Peak activation bytes of one training micro-batch on one tensor-parallel rank (:func:`activation_terms`)."""
    return activation_terms(hf_config, **kwargs)["total"]


def kv_bytes_per_token(hf_config, dtype="bfloat16") -> int:
    """K and V of one token over every layer."""
    m = _shape(hf_config)
    return m["L"] * 2 * m["ng"] * m["d"] * _dtype_bytes(dtype)


def engine_releases_kv() -> bool:
    """Whether the built-in engine gives its KV pool back while the trainer trains (a colocated run calls
    ``release_memory`` before the update): it overrides ``RolloutEngine.release_memory``, a no-op for
    engines that keep their memory. The plan then does not count the pool at training time."""
    from runtime.rollout.base import RolloutEngine
    from runtime.rollout.builtin import BuiltinEngine
    return getattr(BuiltinEngine, "release_memory", None) is not getattr(RolloutEngine, "release_memory", None)


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
                    engine_apart: bool = False, deterministic: bool = False) -> dict[str, Any]:
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
    the weights (``kl_coef > 0``).
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
    e = _dtype_bytes(dtype)
    m = _shape(hf_config)
    n_params, per_rank = param_counts(hf_config, tp)
    limit = gpu_mem_gb * GIB
    if kv_released is None:
        kv_released = engine == "builtin" and engine_releases_kv()
    settings = dict(max_tokens=max_tokens, recompute=recompute, recompute_modules=tuple(recompute_modules),
                    recompute_num_layers=recompute_num_layers, fusions=fusions, chunked_logprobs=chunked_logprobs,
                    core_attention=core_attention, deterministic=deterministic)

    if grad_dtype not in ("float32", "bfloat16"):
        raise ValueError(f"grad_dtype must be float32 or bfloat16, not {grad_dtype!r}")
    adapters, adapters_rank = lora_memory.adapter_params(m, lora, tp) if lora else (0, 0)
    # with LoRA the base is frozen (no reference copy: adapters off) and only the adapters are trained
    weights = per_rank * e + adapters_rank * e + (per_rank * e if ref_model and not lora else 0)
    trained = adapters_rank if lora else per_rank
    grads = trained * (4 if grad_dtype == "float32" else e)  # DDP grad buffer: fp32, or the weights' dtype
    # the parameters whose optimizer state this rank holds: all of its TP shard, or 1/dp of it (distributed)
    opt_params = -(-trained // dp) if distributed_optimizer else trained
    master = opt_params * 4 if e < 4 else 0                # fp32 master copy, made with the optimizer
    moments = opt_params * 8                               # Adam m, v: made at the first step
    optimizer = 0 if optimizer_on_host else master + moments  # on the GPU (the host's: runtime/plan/host_memory.py)
    state = grads + optimizer                              # what offload_state moves
    # Adam's step (torch's foreach implementation) holds about one fp32 copy of the parameters it updates in
    # temporaries: measured 2.27 GiB for Qwen3-0.6B's 2.22 GiB (bench/results/memory_check_H100_2026-11-23_24gb.json)
    opt_step = 0 if optimizer_on_host else _OPT_STEP_BYTES_PER_PARAM * opt_params
    act_kw = dict(tp=tp, micro_batch_size=micro_batch_size, seq_len=seq_len, dtype=dtype, device=device,
                  response_len=max_new_tokens, frozen_head=bool(lora), **settings)
    act = activation_terms(hf_config, **act_kw)
    lora_act = 0
    if lora:
        full = min(recompute_num_layers or m["L"], m["L"]) if recompute == "full" else 0
        lora_act = lora_memory.activation_extra(
            m, lora, tp=tp, tokens=max_tokens or micro_batch_size * seq_len, e=e,
            kept_layers=m["L"] - full + (1 if full else 0),
            recompute_modules=tuple(recompute_modules) if recompute == "selective" else ())
    activations = act["total"] + lora_act

    rows = math.ceil(rollout_batch / rollout_engines)
    slots_max = max_slots if max_slots is not None else rows
    prompt = seq_len - max_new_tokens
    kv_per_token = kv_bytes_per_token(hf_config, dtype)
    per_sample_kv = seq_len * kv_per_token
    kv_info: dict[str, Any] = {}
    # a GPU shared by two processes (SGLang's server, or a built-in engine apart) holds two contexts and two slacks
    overhead = 2 * OVERHEAD_BYTES if colocate and (engine == "sglang" or engine_apart) else OVERHEAD_BYTES
    kv_chosen = False
    offload = bool(offload and colocate)
    if engine == "sglang":
        decode_path = "sglang"
        engine_weights = n_params * e // sglang_tp
        others = weights + (0 if offload else grads + master) if colocate else 0
        static = int(sglang_mem_fraction * limit) - others  # SGLang: weights + KV pool = fraction x GPU - others
        kv_cache = max(static - engine_weights, 0)
        rollout_activations = 0                            # inside SGLang's (1 - mem_fraction) share
        kv_info = {"mem_fraction": sglang_mem_fraction, "static": static}
        kv_released = True                                 # --enable-memory-saver, colocated
    else:
        # the engine's own base (none when it shares the trainer's), and the adapters' buffers, whole
        engine_weights = (0 if shared_base and lora else n_params * e) + adapters * e
        fast = device == "cuda" and fast_decode_reason(hf_config) is None
        decode_path = "paged" if fast else "dynamic"
        if fast:
            # the paged engine (runtime/rollout/kv_pages.py) takes kv_cache_gb GiB as its pool and admits
            # up to max_batch_size rows
            live = min(rows, slots_max)

            def extra(per_row: bool) -> int:
                # one after the other: a packed prefill (a layer's q/k/v and attention output are still held while its
                # MLP runs), then the sampler over the admitted rows' first logits or, at each decode step, over the
                # live rows (the larger). What one prefill packs (runtime/rollout/paged_decode.py, the admission):
                # fresh rows share their group's prompt, prefilled once, so a pack holds the prompts of the groups
                # among the rows admitted - consecutive requests, a group's samples together: `live` of them meet at
                # most ceil((live - 1) / samples_per_prompt) + 1 groups - up to the budget of _PREFILL_TOKENS (the
                # first sequence goes in whole). A row that comes back with tokens (``per_row``: a partial rollout's
                # continued sample, or a preempted row) is prefilled alone with its prompt and its tokens, and such
                # rows fill the budget (the prompt counted, recomputed even where its group holds its pages). LoRA's
                # adapters add no [tokens, out] tensor (runtime.models.base.add_lora_up writes into the projection's
                # output, also compiled), only one [tokens, rank] hidden at a time: under 0.2 % of a token's bytes
                # here, not counted.
                # Measured on the H100 at the recipe's 80 GiB and 24 GiB configs: 0.576 GiB with prefills only (a pack
                # of 16 prompts of 1024 tokens: 0.563 by this count), 0.639 GiB with the decode (planned 0.652). With
                # LoRA on GLM-Z1-9B's shape, 8 prompts x 8 and no preemption (bench/results/lora_grpo_glm_*_2026-11-26
                # .json): 1.30 GiB over one pack of 8 prompts (0.95 by this count) with the three-op LoRA add of then.
                # With add_lora_up and the seed's 16 x 8, whose pool of 23 samples preempts (..._seed16x8.json):
                # 1.77 GiB against 2.01 counted then for a pack of the budget and a prompt, which the engine allowed
                # while it left the prompt out of the budget; 1.89 by this count, and 1.77 measured again with the
                # engine keeping to it (largest pack 16,384 = the budget; ..._seed16x8_prefill-fix.json)
                if per_row:
                    tokens = max(_PREFILL_TOKENS, seq_len)
                else:
                    groups = min(live, -(-(live - 1) // samples_per_prompt) + 1)
                    tokens = min(groups * max(prompt, 1), max(_PREFILL_TOKENS, prompt))
                prefill = tokens * e * (3 * m["h"] + 2 * m["nh"] * m["d"] + 2 * m["ng"] * m["d"] + 3 * m["f"])
                return max(prefill, live * m["V"] * _FAST_SAMPLER_BYTES_PER_LOGIT)

            def preempts(pool: int) -> bool:
                # the pool holds fewer full-length samples than rows run at once: rows may be preempted, and come back
                return pool // per_sample_kv < live

            def largest_pool(working: int) -> int:  # in steps of KV_STEP_GIB, leaving the margin free in both phases
                room = _kv_room(limit, colocate=colocate, kv_released=kv_released, weights=weights, state=state,
                                offload=offload, engine_weights=engine_weights, rollout_activations=working,
                                activations=max(activations, opt_step), overhead=overhead)
                return max(int(room // (KV_STEP_GIB * GIB)), 0) * int(KV_STEP_GIB * GIB)

            if kv_cache_gb is not None:
                budget = int(kv_cache_gb * GIB)
            else:  # the largest pool; one that preempts leaves room for the re-prefills it brings
                kv_chosen = True
                budget = largest_pool(extra(partial))
                if not partial and preempts(budget):
                    budget = largest_pool(extra(True))
            kv_cache = budget
            rollout_activations = extra(partial or preempts(kv_cache))
            kv_info = {"pool": kv_cache, "per_sample": per_sample_kv, "per_token": kv_per_token}
        else:
            batch_rows = min(rows, slots_max)
            kv_cache = batch_rows * per_sample_kv
            decode_extra = kv_cache // m["L"] + batch_rows * m["V"] * _SAMPLER_BYTES_PER_LOGIT
            prefill = batch_rows * prompt * (kv_per_token + e * (3 * m["f"] + 2 * m["nh"] * m["d"]
                                                                 + 2 * m["ng"] * m["d"] + 3 * m["h"]))
            rollout_activations = max(decode_extra, prefill - kv_cache)  # beyond the cache itself
            kv_info = {"per_sample": per_sample_kv, "per_token": kv_per_token}
            kv_released = True                             # the dynamic cache lives for one generate call
    kv_slots = kv_cache // per_sample_kv if decode_path == "paged" else (
        min(rows, slots_max) if decode_path == "dynamic" else None)

    # the weight sync after an update: under TP every trainer rank gathers the whole weights for the engines
    # (runtime/trainer/tp_gather.py), beside its state, before the next rollout offloads it
    gathered = n_params * e if tp > 1 else 0
    at_sync = weights + state + gathered + (engine_weights + (0 if kv_released else kv_cache) if colocate else 0) \
        + overhead

    def totals(act_bytes: int) -> tuple[int, int, int, int, int]:
        trainer_total = weights + state + max(act_bytes, opt_step, gathered) + OVERHEAD_BYTES
        rollout_total = engine_weights + kv_cache + rollout_activations + OVERHEAD_BYTES
        if not colocate:
            return trainer_total, rollout_total, rollout_total, trainer_total, max(trainer_total, rollout_total)
        at_rollout = weights + (0 if offload else state) + engine_weights + kv_cache + rollout_activations + overhead
        at_training = weights + state + engine_weights + (0 if kv_released else kv_cache) \
            + max(act_bytes, opt_step) + overhead
        return trainer_total, rollout_total, at_rollout, at_training, max(at_rollout, at_training, at_sync)

    trainer_total, rollout_total, at_rollout, at_training, total = totals(activations)
    kv_too_small = decode_path == "paged" and kv_cache < per_sample_kv
    fits = total <= limit and not kv_too_small and not (engine == "sglang" and kv_cache <= 0)
    host = None
    if host_memory_gb is not None:
        host = host_memory.host_terms(m, tp=tp, dp=dp, per_rank=trained, opt_params=opt_params, weight_bytes=e,
                                      grad_bytes=4 if grad_dtype == "float32" else e,
                                      distributed_optimizer=bool(distributed_optimizer),
                                      optimizer_on_host=bool(optimizer_on_host), offload=offload,
                                      trainer_ranks=trainer_ranks, processes=processes, host_memory_gb=host_memory_gb,
                                      trainable_numels=lora_memory.adapter_tensor_numels(m, lora, tp) if lora else None)
    per_rank_step = (global_batch_size // dp) if global_batch_size else None

    def total_at(b: int) -> int:
        return totals(activation_bytes(hf_config, **{**act_kw, "micro_batch_size": b}) + lora_act)[4]

    fit_mb = 0
    if max_tokens is None and not kv_too_small:
        fit_mb = _fits_micro_batch(total_at, micro_batch_size, limit, per_rank_step) if fits or micro_batch_size > 1 else 0
    exact = dict(weights=weights, grads=grads, optimizer=optimizer, activations=activations, kv_cache=kv_cache,
                 engine_weights=engine_weights, rollout_activations=rollout_activations,
                 overhead=overhead, trainer_total=trainer_total, rollout_total=rollout_total, total=total,
                 at_rollout=at_rollout, at_training=at_training, at_sync=at_sync, sync_gather=gathered,
                 optimizer_master=master, optimizer_moments=moments,
                 act_layers=act["layers"], act_attention_scores=act["attention_scores"],
                 act_logprob_head=act["logprob_head"], act_lora=lora_act, adapter_weights=adapters_rank * e)
    out: dict[str, Any] = {k: v / GIB for k, v in exact.items()}
    out.update(fits=fits, bytes=exact, params=n_params, params_per_gpu=per_rank, gpu_mem_gb=gpu_mem_gb,
               tp=tp, dp=dp, colocate=colocate, dtype=str(dtype).removeprefix("torch."), rollout_rows=rows,
               rollout_engines=rollout_engines,
               micro_batch_size=micro_batch_size, seq_len=seq_len, device=device, engine=engine,
               decode_path=decode_path,
               attention="flash (SDPA)" if _flash_attention(device, core_attention, max_tokens is not None)
               else "unfused",
               logprobs="chunked" if _chunked_logprobs(device, tp, chunked_logprobs) else "full logits",
               kv_slots=kv_slots, kv_slot_len=seq_len, kv_max_slots=slots_max, kv=kv_info,
               kv_chosen=kv_chosen, kv_cache_gb=kv_cache / GIB if decode_path == "paged" else None,
               kv_released=kv_released, offload=offload, fit_micro_batch=fit_mb,
               distributed_optimizer=bool(distributed_optimizer), grad_dtype=grad_dtype,
               optimizer_on_host=bool(optimizer_on_host), host=host, gpu_fits=fits,
               lora=None if not lora else {**lora, "params": adapters, "params_per_gpu": adapters_rank},
               shared_base=bool(shared_base and lora), **settings)
    out["fits"] = fits and (host is None or host["fits"])
    out["max_tp"] = math.gcd(m["V"], m["nh"], m["ng"], m["f"])
    out["reason"] = None if out["fits"] else _why_not(out)
    return out


KV_STEP_GIB = 0.25        # the plan's KV pool comes in quarters of a GiB
# of the GPU, left free by the pool the plan chooses: the allocator's slack (reserved - allocated) measured
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
        if not est["optimizer_on_host"] and est["dtype"] != "float32":
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
    head = (f"memory per GPU (tp={est['tp']}, dp={est['dp']}, {'colocated' if est['colocate'] else 'separate'} "
            f"trainer/rollout, {est['dtype']}, {est['params'] / 1e9:.2f}B params, {est['device']}):")
    lines = [head] + [f"  {name:<15}{gib:8.2f} GiB" + (f"   {note}" if note else "") for name, gib, note in rows]
    verdict = "fits" if est["fits"] else "DOES NOT FIT"
    phases = (f" (rollout {est['at_rollout']:.2f}, training {est['at_training']:.2f}"
              + (f", weight sync {est['at_sync']:.2f}" if est["sync_gather"] else "") + ")" if est["colocate"] else "")
    lines.append(f"  {'total':<15}{est['total']:8.2f} GiB of {est['gpu_mem_gb']:g} GiB{phases}: {verdict}")
    if est.get("assumed"):
        lines.append(f"  assumed: {est['assumed']}")
    if est.get("host") is not None:
        lines += host_memory.format_host(est["host"])
    return "\n".join(lines)


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
        optimizer_on_host=t.optimizer_on_host,
        lora=lora_memory.config_lora(cfg), shared_base=layout.shares_base(cfg),
        engine_apart=layout.engine_shares_gpu_across_processes(cfg),
        samples_per_prompt=r.n_samples_per_prompt, partial=r.partial,
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
        fix = settings_that_fit(hf_config, gpu, kw)
        if fix is None and est.get("lora") and kw["device"] == "cuda" and kw["engine"] == "builtin":
            est["reason"] = _lora_need(hf_config, kw, est)
        if fix is not None:
            est["fix"] = fix
            host = fix[1]["host"]
            est["reason"] = f"{est['reason']}; fits with " + ", ".join(f"{k}={_show(v)}" for k, v in fix[0].items()) \
                + f" (peak {fix[1]['total']:.1f} GiB" \
                + (f", the plan's KV pool {fix[1]['kv_cache']:.2f} GiB" if fix[1]["kv_chosen"] else "") \
                + (f", host {host['total']:.1f} of {host['host_memory_gb']:g} GiB" if host is not None else "") + ")"
    return est


def _lora_need(hf_config, kw: dict[str, Any], est: dict[str, Any]) -> str:
    """Why a LoRA run does not fit, with what it would need: the least memory this batch can take (every layer
    recomputed, one longest sample per micro-batch, the smallest KV pool that holds one sample)."""
    per_sample = est["kv"]["per_sample"] / GIB
    pool = math.ceil(per_sample / KV_STEP_GIB) * KV_STEP_GIB
    least = estimate_memory(hf_config, gpu_mem_gb=1e9, **dict(
        kw, recompute="full", recompute_num_layers=None, max_tokens=kw["seq_len"], kv_cache_gb=pool,
        offload=kw["colocate"]))
    base = est["weights"] - est["adapter_weights"]
    return (f"needs {est['total']:.1f} GiB per GPU but the GPU has {est['gpu_mem_gb']:g} GiB: LoRA keeps the "
            f"frozen {est['dtype']} base ({base:.1f} GiB) once, and with every layer recomputed, one "
            f"{kw['seq_len']}-token sample per micro-batch and a KV pool of one sample ({pool:g} GiB) this batch "
            f"still needs {least['total']:.1f} GiB; use a bigger GPU or shorter samples (rollout.max_new_tokens; "
            f"a quantized base is not supported)")


def _show(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(str(x) for x in v) + "]"
    return "null" if v is None else (f"{v:g}" if isinstance(v, float) else str(v))


def settings_that_fit(hf_config, gpu_mem_gb: float, kw: dict[str, Any]):
    """The cheapest change of the memory settings that makes ``kw`` (:func:`config_kwargs`) fit, as
    ({config key: value}, estimate), or None. Searched, cheapest first: the distributed optimizer at
    DP > 1 (free: reduce-scatter + all-gather move what the all-reduce did), the trainer's state offloaded
    while generating (free), packed micro-batches by a token budget (faster), selective recompute
    (norms + MLP, ~1/3 more compute per layer), the optimizer on the host (``train.optimizer_on_host``: the AdamW
    step on the CPU, seconds per step for billions of parameters; or off, when the host is what does not fit), full
    recompute (one more forward), bf16 gradients (``train.grad_dtype``: accumulated in bf16), a smaller KV pool (a
    slower rollout); each with the largest token budget that fits."""
    if kw["device"] != "cuda" or kw["engine"] != "builtin":
        return None
    seq = kw["seq_len"]
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
    hosts = [kw["optimizer_on_host"], not kw["optimizer_on_host"]] if kw["dtype"] != "float32" and not kw.get("lora") \
        else [False]
    # gradients in the weights' bf16 (half the gradient memory; accumulated in bf16)
    grads = [kw["grad_dtype"]] + (["bfloat16"] if kw["grad_dtype"] == "float32" and kw["dtype"] != "float32" else [])
    dists = [kw["distributed_optimizer"]] + ([True] if kw["dp"] > 1 and not kw["distributed_optimizer"] else [])
    pools: list = [kw["kv_cache_gb"]]
    if kw["kv_cache_gb"] is not None:
        pools += [round(kw["kv_cache_gb"] * f / KV_STEP_GIB) * KV_STEP_GIB for f in (0.75, 0.5, 0.25)]
        pools.append(None)  # what the plan leaves free
    for min_slots in sorted({min(n, kw["rollout_batch"]) for n in (_SEARCH_MIN_KV_SAMPLES, 4, 1)}, reverse=True):
        found = _search(hf_config, gpu_mem_gb, kw, pools, recomputes, offloads, budgets, min_slots, dists, hosts,
                        grads)
        if found is not None:
            return found
    return None


_SEARCH_MIN_KV_SAMPLES = 8  # the search prefers pools that hold a group of full-length samples at once


def _search(hf_config, gpu_mem_gb, kw, pools, recomputes, offloads, budgets, min_slots, dists=(False,),
            hosts=(False,), grads=("float32",)):
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
                    for di, distributed in enumerate(dists):
                        # least significant: the distributed optimizer is preferred to any other change
                        cost = (pi, level, oi, bi, di)
                        if best is not None and cost >= best[0]:
                            continue
                        trial = dict(kw, kv_cache_gb=pool, recompute=rec, recompute_modules=mods, offload=off,
                                     max_tokens=budget, distributed_optimizer=distributed,
                                     optimizer_on_host=on_host, grad_dtype=grad,
                                     recompute_num_layers=None if rec != "full" else kw["recompute_num_layers"])
                        est = estimate_memory(hf_config, gpu_mem_gb=gpu_mem_gb, **trial)
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
             "optimizer_on_host": "train.optimizer_on_host", "grad_dtype": "train.grad_dtype"}
    changed: dict[str, Any] = {}
    for k, name in names.items():
        if trial[k] != kw[k] and not (k == "recompute_modules" and trial["recompute"] != "selective"):
            changed[name] = ("on" if trial[k] else "off") if k == "offload" else trial[k]
    if trial["kv_cache_gb"] is None and kw["kv_cache_gb"] is not None:
        changed["rollout.kv_cache_gb"] = round(est["kv_cache_gb"], 2)
    return changed, est


def plan_choices(cfg, hf_config, gpu_mem_gb: float | None = None) -> dict[str, Any]:
    """What the plan chooses for settings the config leaves open, as {config key: value}, to write into
    the frozen config: today ``rollout.kv_cache_gb`` (the built-in engine's pool on a GPU) when unset."""
    if cfg.rollout.kv_cache_gb is not None or config_device(cfg) != "cuda" or cfg.rollout.engine != "builtin":
        return {}
    est = estimate_for_config(cfg, hf_config, gpu_mem_gb=gpu_mem_gb)
    if est["decode_path"] != "paged" or not est["kv_chosen"] or not est["fits"]:
        return {}
    return {"rollout.kv_cache_gb": round(est["kv_cache_gb"], 2)}
