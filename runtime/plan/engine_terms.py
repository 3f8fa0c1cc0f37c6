"""The rollout engine's terms on one GPU: its weights, its KV cache, the rollout's working set beyond them
("rollout extra"), and the per-process overhead.

* The built-in engine (``runtime.rollout.builtin``) takes the fast path when the model family has it
  (``unsupported_config_reason``): the HF weights (not TP-split), the KV pool, and beyond it a packed prefill and
  the sampler's per-row vocab-sized temporaries (rows: at most ``max_batch_size`` = samples per rollout). The
  prefill holds one prompt per group of samples among the rows admitted together, up to 16,384 tokens; rows that
  come back with tokens (partial rollout's continued samples, the preempted rows of a pool that holds fewer
  full-length samples than rows) are prefilled one by one with their tokens and fill those 16,384, by up to one
  prompt more. A family without the fast path decodes with HF's dynamic cache: every row of a batch (up to
  ``max_batch_size``) at full length for one generate call, one layer's concatenation copy and the sampler's
  temporaries.
* The KV pool is ``rollout.kv_cache_gb`` GiB (the paged engine); unset on a GPU, the plan chooses the largest pool,
  in quarter GiB, that leaves ``KV_MARGIN_FRACTION`` of the GPU free in both phases (the room is the composer's:
  runtime/plan/memory.py), and the run writes it into its frozen config.
* SGLang (``rollout.engine: sglang``): by SGLang's documented ``--mem-fraction-static`` rule its weights plus KV pool
  fill ``mem_fraction × GPU`` minus what other processes hold when it starts (the trainer's resident state, when
  colocated); colocated it runs with ``--enable-memory-saver`` and releases that memory during training. Not
  measured here (SGLang cannot run on the machines we have).
* A replica split by its experts (``rollout.expert_shards`` = n, runtime/rollout/expert_shards.py): each engine holds
  1/n of every MoE layer's experts and the rest whole.
* LoRA: the engine's own base (none when it shares the trainer's), and the adapters' buffers, whole.
* FP8 weights (``rollout.weights_dtype: fp8``, runtime/rollout/fp8_weights.py): the linear layers (a mixture's
  experts included) at one byte a weight plus an fp32 scale per output row, the embeddings, head, norms and router
  at the model's dtype; a shared base
  (LoRA) is the trainer's, and the FP8 copy beside it is the engine's. The per-token FP8 copy of a projection's
  input is a quarter of the bf16 tensors the rollout extra already counts for it, not counted.
"""
from __future__ import annotations

from typing import Any, Callable

from runtime.plan import moe_terms
from runtime.plan.shape import GIB, dtype_bytes, model_shape

# CUDA context, cuBLAS workspaces, allocator slack (one process). Measured on the H100 (2026-11-25, colocated,
# bench/results/memory_check_H100_2026-11-25_{24gb,80gb}_empty_cache.json): context 0.61 GiB, and at the peak
# 0.72 GiB (24 GiB) / 0.76 GiB (80 GiB) reserved beyond what is allocated.
OVERHEAD_BYTES = int(1.35 * GIB)
KV_STEP_GIB = 0.25        # the plan's KV pool comes in quarters of a GiB
_SAMPLER_BYTES_PER_LOGIT = 40  # the slow path's sampler (HF generate)
_PREFILL_TOKENS = 16384    # the paged decoder's packed-prefill budget
# the sampler's peak per logit: bf16 logits, their fp32 copy, the scaled logits, the log-softmax, the noise
# (measured 17.6 B on the H100 at 256 rows, where the decode step is the rollout's peak)
_FAST_SAMPLER_BYTES_PER_LOGIT = 18


def overhead(*, colocate: bool, engine: str, engine_apart: bool) -> int:
    """A GPU shared by two processes (SGLang's server, or a built-in engine apart) holds two contexts and two
    slacks."""
    return 2 * OVERHEAD_BYTES if colocate and (engine == "sglang" or engine_apart) else OVERHEAD_BYTES


def fast_decode_reason(hf_config) -> str | None:
    """None when the built-in engine's fast path (the paged decoder) serves this model on CUDA, else why not."""
    from runtime.rollout.decode_model import unsupported_config_reason
    return unsupported_config_reason(hf_config)


def kv_bytes_per_token(hf_config, dtype="bfloat16") -> int:
    """K and V of one token over every layer."""
    m = model_shape(hf_config)
    return m["L"] * 2 * m["ng"] * m["d"] * dtype_bytes(dtype)


def engine_releases_kv() -> bool:
    """Whether the built-in engine gives its KV pool back while the trainer trains (a colocated run calls
    ``release_memory`` before the update): it overrides ``RolloutEngine.release_memory``, a no-op for
    engines that keep their memory. The plan then does not count the pool at training time."""
    from runtime.rollout.base import RolloutEngine
    from runtime.rollout.builtin import BuiltinEngine
    return getattr(BuiltinEngine, "release_memory", None) is not getattr(RolloutEngine, "release_memory", None)


def linear_params(m: dict[str, Any]) -> tuple[int, int]:
    """(weights of the engine's linear layers: q/k/v, o, gate/up, down; their output rows), over every layer; a
    mixture's gate/up and down are every expert's (the router stays in the model's dtype)."""
    h, f, qkv, o = m["h"], m["f"], (m["nh"] + 2 * m["ng"]) * m["d"], m["nh"] * m["d"]
    mlp, mlp_rows = (3 * h * m["fe"] * m["E"], m["E"] * (2 * m["fe"] + h)) if m.get("E") else (3 * h * f, 2 * f + h)
    return m["L"] * (h * qkv + o * h + mlp), m["L"] * (qkv + h + mlp_rows)


def engine_weights(n_params: int, adapters: int, e: int, *, engine: str, sglang_tp: int, shared_base: bool,
                   lora: bool, m: dict[str, Any] | None = None, weights_dtype: str = "bf16",
                   expert_shards: int = 1) -> int:
    if engine == "sglang":
        return n_params * e // sglang_tp
    # a replica split by its experts (rollout.expert_shards): the other shards' experts are not here
    others = 0 if expert_shards == 1 else (
        moe_terms.engine_experts(m, e, engine=engine, weights_dtype=weights_dtype)
        - moe_terms.engine_experts(m, e, engine=engine, weights_dtype=weights_dtype, shards=expert_shards))
    if weights_dtype == "fp8":
        linear, rows = linear_params(m)
        fp8 = linear + 4 * rows  # e4m3 weights, an fp32 scale per row
        return (fp8 if shared_base and lora else (n_params - linear) * e + fp8) + adapters * e - others
    return (0 if shared_base and lora else n_params * e) + adapters * e - others


def paged_extra(m: dict[str, Any], e: int, *, live: int, per_row: bool, seq_len: int, prompt: int,
                samples_per_prompt: int) -> int:
    """The paged engine's working set beyond its pool, for ``live`` rows at once."""
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
    # a mixture of experts: the router's fp32 tensors and the routed copies beside the experts' k x ffn (moe_terms)
    prefill = tokens * (e * (3 * m["h"] + 2 * m["nh"] * m["d"] + 2 * m["ng"] * m["d"] + 3 * m["f"])
                        + moe_terms.engine_prefill_bytes_per_token(m, e))
    return max(prefill, live * m["V"] * _FAST_SAMPLER_BYTES_PER_LOGIT)


def engine_side(hf_config, m: dict[str, Any], e: int, *, engine: str, device: str, n_params: int, adapters: int,
                rows: int, slots_max: int, seq_len: int, max_new_tokens: int, dtype, kv_cache_gb: float | None,
                kv_released: bool, partial: bool, samples_per_prompt: int, sglang_mem_fraction: float, sglang_tp: int,
                shared_base: bool, lora: bool, limit: float, sglang_others: int,
                room: Callable[[int, int], float], weights_dtype: str = "bf16", expert_shards: int = 1) -> dict[str, Any]:
    """The engine's weights, KV cache and rollout extra (bytes), its decode path, whether the pool is released while
    training and whether the plan chose it. ``room(engine_weights, working)``: the bytes a pool may take beside the
    rest at the plan's margin; ``sglang_others``: what the trainer holds when SGLang starts."""
    weights = engine_weights(n_params, adapters, e, engine=engine, sglang_tp=sglang_tp, shared_base=shared_base,
                             lora=lora, m=m, weights_dtype=weights_dtype, expert_shards=expert_shards)
    prompt = seq_len - max_new_tokens
    kv_per_token = kv_bytes_per_token(hf_config, dtype)
    per_sample_kv = seq_len * kv_per_token
    kv_chosen = False
    if engine == "sglang":
        static = int(sglang_mem_fraction * limit) - sglang_others  # SGLang: weights + KV pool = fraction x GPU - others
        return dict(decode_path="sglang", engine_weights=weights, kv_cache=max(static - weights, 0),
                    rollout_activations=0,                 # inside SGLang's (1 - mem_fraction) share
                    kv={"mem_fraction": sglang_mem_fraction, "static": static},
                    kv_released=True, kv_chosen=False, kv_slots=None,  # --enable-memory-saver, colocated
                    per_sample_kv=per_sample_kv)
    if device == "cuda" and fast_decode_reason(hf_config) is None:
        # the paged engine (runtime/rollout/kv_pages.py) takes kv_cache_gb GiB as its pool and admits up to
        # max_batch_size rows
        live = min(rows, slots_max)

        def extra(per_row: bool) -> int:
            return paged_extra(m, e, live=live, per_row=per_row, seq_len=seq_len, prompt=prompt,
                               samples_per_prompt=samples_per_prompt)

        def preempts(pool: int) -> bool:
            # the pool holds fewer full-length samples than rows run at once: rows may be preempted, and come back
            return pool // per_sample_kv < live

        def largest_pool(working: int) -> int:  # in steps of KV_STEP_GIB, leaving the margin free in both phases
            return max(int(room(weights, working) // (KV_STEP_GIB * GIB)), 0) * int(KV_STEP_GIB * GIB)

        if kv_cache_gb is not None:
            pool = int(kv_cache_gb * GIB)
        else:  # the largest pool; one that preempts leaves room for the re-prefills it brings
            kv_chosen = True
            pool = largest_pool(extra(partial))
            if not partial and preempts(pool):
                pool = largest_pool(extra(True))
        return dict(decode_path="paged", engine_weights=weights, kv_cache=pool,
                    rollout_activations=extra(partial or preempts(pool)),
                    kv={"pool": pool, "per_sample": per_sample_kv, "per_token": kv_per_token},
                    kv_released=kv_released, kv_chosen=kv_chosen, kv_slots=pool // per_sample_kv,
                    per_sample_kv=per_sample_kv)
    batch_rows = min(rows, slots_max)
    kv_cache = batch_rows * per_sample_kv
    decode_extra = kv_cache // m["L"] + batch_rows * m["V"] * _SAMPLER_BYTES_PER_LOGIT
    prefill = batch_rows * prompt * (kv_per_token + e * (3 * m["f"] + 2 * m["nh"] * m["d"]
                                                         + 2 * m["ng"] * m["d"] + 3 * m["h"]))
    return dict(decode_path="dynamic", engine_weights=weights, kv_cache=kv_cache,
                rollout_activations=max(decode_extra, prefill - kv_cache),  # beyond the cache itself
                kv={"per_sample": per_sample_kv, "per_token": kv_per_token},
                kv_released=True,                          # the dynamic cache lives for one generate call
                kv_chosen=False, kv_slots=batch_rows, per_sample_kv=per_sample_kv)
