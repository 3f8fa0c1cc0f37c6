"""The activations term: what one training micro-batch holds at its peak on one tensor-parallel rank.

* ``micro_batch_size`` samples padded to the longest (the worst case: every sample at ``max_prompt_len +
  max_new_tokens``), or with ``train.max_tokens_per_micro_batch`` a packed micro-batch of that many tokens (no
  padding; the worst case: the budget full). Without recomputation every layer keeps what it saves for its
  backward; ``train.recompute: selective`` drops what the named modules save (the pre-norm outputs for
  ``layernorm``, the SwiGLU tensors for ``mlp``); ``full`` keeps only each recomputed layer's bf16 input. The
  backward's working set is one layer's worth in every case (the recomputed layer).
* On CUDA attention is ``SdpaCoreAttention`` (flash/cuDNN through torch SDPA): per token and layer the tensors the
  layer saves for its backward, counted from megatron-core 0.16's local spec in bf16: the inputs and outputs of the
  two pre-norms (plus GLM4's two post-norms' inputs), Qwen3's fused q/k/v output (kept alive by the k-norm's input
  view) and the q-norm's input copy, SDPA's q, k at its own heads (v is a view of the fused output), its output and
  fp32 log-sum-exp, and the fused SwiGLU's fc1 output and product (``runtime.mcore.fusions``, on by default; with
  ``train.fusions: none``: k and v copied to every head, a context copy before the output projection, and SwiGLU's
  silu output as well); the norms' fp32 row statistics; one more layer's worth for the backward's working set; per
  position (not per sample) the bf16 cos/sin tables each RoPE multiply saves. No ``[heads, s, s]`` scores exist.
  ``train.deterministic`` adds to the backward's working set the deterministic kernel's fp32 dQ buffer per split
  (``deterministic_dq_bytes``, from FlashAttention-2's allocation; not measured on its own).
* At tensor parallelism 1 the log-probs go through the chunked output layer (``runtime/trainer/logprobs.py``): no
  ``[b, s, vocab]`` fp32 logits; the head's peak is its backward: an fp32 ``[vocab, hidden]`` weight-gradient
  accumulator, the bf16 ``dz^T h`` product and its fp32 cast, one chunk's ``[2048, vocab]`` logits gradient, plus
  the saved response rows and the final norm's input. Under TP > 1 megatron's vocab-parallel cross-entropy keeps
  full logits (20 bytes per logit, as on CPU).
* A mixture of experts: the experts' activations are the MLP's at ffn = k x the expert's ffn; each MoE layer also
  keeps its router's and its token dispatcher's tensors, and the dispatcher's gather buffer is one for the model
  (runtime/plan/moe_terms.py); ``recompute_modules: [mlp]`` does not recompute a MoE layer.
* On CPU: megatron's unfused ``DotProductAttention`` (``[heads, s, s]`` fp32 softmax output and its cast
  probabilities per layer), full-vocab fp32 logits (the cross-entropy's contiguous copy and the entropy metric's
  temporaries: 20 bytes per logit, 16 for a single-sequence micro-batch).

Measurements: runtime/plan/memory.py's module doc.
"""
from __future__ import annotations

from runtime.mcore import fusions as megatron_fusions
from runtime.plan import moe_terms
from runtime.plan.shape import dtype_bytes, model_shape

# CPU path (megatron's unfused attention, full logits): per token and layer, bytes of saved activations
_PRE_NORM_BYTES = 12       # per hidden unit, each of the two pre-norms (fp32 upcast copies)
_POST_NORM_BYTES = 8       # per hidden unit, each GLM4 post-norm
_QK_NORM_BYTES = 8         # per q/k unit, Qwen3's per-head norms
_SWIGLU_ELEMS = 5          # per ffn unit: fc1 output (gate, up), silu(gate), product
_LOGIT_BYTES, _LOGIT_BYTES_SINGLE = 20, 16
# CUDA path
_LOGPROB_CHUNK = 2048      # rows per output-layer chunk (runtime/trainer/logprobs.py: linear_logprobs)
_BACKWARD_LAYERS = 1       # layers' worth of activations the backward holds on top of the saved ones
# FlashAttention-2's deterministic backward (train.deterministic) accumulates dQ in one fp32 buffer per split instead
# of one shared by atomic adds: ceil(SMs / (sequences x heads)) splits. The SM count of the H100 and H200 we measure on.
_FLASH_SMS = 132


def uses_chunked_logprobs(device: str, tp: int, setting: str = "auto") -> bool:
    """What ``MegatronTrainer._chunked_logprobs_enabled`` decides (TP 1; ``train.chunked_logprobs``)."""
    if tp != 1:
        return False
    if setting != "auto":
        return setting == "on"
    return device == "cuda"


def uses_flash_attention(device: str, core_attention: str = "auto", packed: bool = False) -> bool:
    """What ``runtime.mcore.env.build_gpt_model`` builds: SDPA core attention (``uses_sdpa_attention``)."""
    if core_attention == "sdpa":
        return True
    if core_attention == "megatron":
        return False
    return device == "cuda" or packed


def layer_bytes_per_token(hf_config, *, tp: int = 1, dtype="bfloat16", device: str = "cuda", fusions="auto",
                          core_attention: str = "auto", packed: bool = False,
                          recompute_modules: tuple[str, ...] = ()) -> int:
    """Bytes one decoder layer saves for its backward per token of a micro-batch (see the module doc).
    ``recompute_modules``: selective recomputation's modules (their saved tensors are not kept)."""
    m = model_shape(hf_config)
    e = dtype_bytes(dtype)
    h, f, nh, ng, d = m["h"], m["f"] // tp, m["nh"] // tp, m["ng"] // tp, m["d"]
    q, kv = nh * d, ng * d
    # a MoE layer's router and dispatcher (the experts' part is the MLP's, at f = k x the expert's ffn)
    moe = moe_terms.router_bytes_per_token(m) + moe_terms.dispatcher_bytes_per_token(m, e)
    if not uses_flash_attention(device, core_attention, packed):
        return (2 * _PRE_NORM_BYTES * h + (2 * _POST_NORM_BYTES * h if m["post_norms"] else 0)
                + (_QK_NORM_BYTES * (q + kv) if m["qk_norm"] else 0)
                + 2 * e * h                      # norm outputs: inputs of linear_qkv and fc1
                + 4 * e * q                      # q, k and v expanded to all heads, the context
                + _SWIGLU_ELEMS * e * f + moe)
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
    # fc1 output (gate|up) and the product; unfused also silu(gate); recomputed: none of them (megatron recomputes
    # "mlp" in dense layers only)
    mlp = 0 if "mlp" in recompute_modules and not moe_terms.is_moe(m) else (3 if "swiglu" in fused else 4) * e * f
    stats = 4 * norms + (4 * (nh + ng) if m["qk_norm"] else 0)  # fp32 rstd per normalised row
    return hidden + qk_norm + attention + mlp + stats + moe


def activation_terms(hf_config, *, tp: int, micro_batch_size: int, seq_len: int, dtype="bfloat16",
                     device: str = "cuda", response_len: int | None = None, max_tokens: int | None = None,
                     recompute: str = "none", recompute_modules=("layernorm", "mlp"),
                     recompute_num_layers: int | None = None, fusions="auto", chunked_logprobs: str = "auto",
                     core_attention: str = "auto", frozen_head: bool = False,
                     deterministic: bool = False, ep: int = 1) -> dict[str, int]:
    """Peak activation bytes of one training micro-batch on one tensor-parallel rank, by part:
    ``layers`` (saved by the decoder layers, plus the backward's working set), ``attention_scores``
    (unfused attention only), ``logprob_head`` (output layer and log-probs), and ``total``.
    ``response_len``: response tokens per sample (default: all of ``seq_len``). ``max_tokens``: packed
    micro-batches of at most that many tokens (the worst case: the budget full) instead of
    ``micro_batch_size`` samples of ``seq_len``. ``recompute*``: ``train.recompute`` and its modules/layers.
    ``frozen_head``: the output layer is frozen (LoRA): the chunked head keeps no weight-gradient accumulator.
    ``deterministic`` (``train.deterministic``): flash attention's backward holds :func:`deterministic_dq_bytes` more.
    A mixture of experts (``ep``: ``train.expert_parallel``): ``layers`` includes the dispatcher's gather buffer, and
    ``router``, ``dispatcher`` and ``experts`` are their shares of it (runtime/plan/moe_terms.py).
    """
    m = model_shape(hf_config)
    e = dtype_bytes(dtype)
    V, h, L, nh = m["V"], m["h"], m["L"], m["nh"]
    s = seq_len
    r = s if response_len is None else min(response_len, s)
    packed = max_tokens is not None
    tokens = max_tokens if packed else micro_batch_size * s       # tokens of the micro-batch's forward
    resp_tokens = tokens * r // s if packed else micro_batch_size * r
    longest = min(s, tokens)                                      # one sample's length (attention, RoPE tables)
    flash = uses_flash_attention(device, core_attention, packed)
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
    if uses_chunked_logprobs(device, tp, chunked_logprobs):
        head = (resp_tokens * h * e + tokens * h * e        # saved response rows, the final norm's input
                + (0 if frozen_head else V * h * (4 + e + 4))  # fp32 weight-grad accumulator, dz^T h, its fp32 cast
                + _LOGPROB_CHUNK * V * e)                   # one chunk's logits gradient
    else:
        head = tokens * (V // tp) * (_LOGIT_BYTES_SINGLE if (micro_batch_size == 1 or packed) else _LOGIT_BYTES)
    # a mixture of experts: the layers that hold their tensors (those not recomputed, and the one the backward
    # works on) each keep the router's, dispatcher's and experts' share; the gather buffer is one for the model
    held = (L - full) + (1 if flash or recompute != "none" else 0)
    elems = (3 if "swiglu" in megatron_fusions.active(device, fusions) else 4) if flash else _SWIGLU_ELEMS
    experts_per_token = moe_terms.expert_bytes_per_token(m, e, tp=tp, elems=elems)
    buffer = moe_terms.dispatcher_gather_buffer(m, e, tokens=tokens, tp=tp, ep=ep)
    moe = {"router": held * tokens * moe_terms.router_bytes_per_token(m),
           "dispatcher": held * tokens * moe_terms.dispatcher_bytes_per_token(m, e) + buffer,
           "dispatcher_buffer": buffer, "experts": held * tokens * experts_per_token}
    layers += buffer
    # the head's backward (its weight-gradient accumulators) runs first, before any layer's backward
    # (or recomputation) holds its working set: they peak one after the other, beside what the layers keep
    return {"layers": layers + backward, "attention_scores": scores, "logprob_head": head,
            "total": layers + scores + (max(head, backward) if flash else head), **moe}


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


