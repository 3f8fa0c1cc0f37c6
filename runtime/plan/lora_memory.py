"""The memory plan's terms for LoRA (``train.lora``; runtime/trainer/lora.py, runtime/rollout/lora_forward.py).

* The base is frozen: its weights as before (bf16 on a GPU), and no gradient buffer, fp32 master or Adam
  moments for it; those exist for the adapters only. No reference copy: the KL reference is the base with
  the adapters off.
* Adapters, per linear ``r (in + out)`` parameters; on a tensor-parallel rank a column-parallel linear's
  (qkv, fc1) A is whole and B 1/TP, a row-parallel one's (proj, fc2) A 1/TP and B whole.
* Activations: what the layers save does not change (a frozen linear saves no input, but the adapter's first
  matmul saves that same input); each adapted linear adds its ``[tokens, r]`` hidden (saved for B's
  gradient), and with dropout the dropped input and its mask; at the peak one input-sized gradient or fc1
  result beside the base's working set (:func:`activation_extra`). The output layer is frozen: the chunked
  log-prob head has no fp32 weight-gradient accumulator (``runtime/trainer/logprobs.py``: ``need_w``).
* The engine: the adapters in buffers of the configured rank, whole; the base once more unless it shares the
  trainer's tensors (``runtime/placement/layout.py:shares_base``: colocated in one process at TP 1).
"""
from __future__ import annotations

from typing import Any

_COLUMN = ("linear_qkv", "linear_fc1")


def _dims(m: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """(in, out) features of each target linear, from the plan's model shape."""
    h, f, q, kv = m["h"], m["f"], m["nh"] * m["d"], m["ng"] * m["d"]
    return {"linear_qkv": (h, q + 2 * kv), "linear_proj": (q, h), "linear_fc1": (h, 2 * f), "linear_fc2": (f, h)}


def adapter_params(m: dict[str, Any], lora: dict[str, Any], tp: int = 1) -> tuple[int, int]:
    """(adapter parameters of the whole model, of one tensor-parallel rank)."""
    r, total, rank = lora["rank"], 0, 0
    for target, (fan_in, fan_out) in _dims(m).items():
        if target not in lora["targets"]:
            continue
        total += r * (fan_in + fan_out)
        rank += r * (fan_in + fan_out // tp) if target in _COLUMN else r * (fan_in // tp + fan_out)
    return m["L"] * total, m["L"] * rank


def adapter_tensor_numels(m: dict[str, Any], lora: dict[str, Any], tp: int = 1) -> list[int]:
    """Elements of each adapter tensor (A, then B, per target linear and layer) one tensor-parallel rank holds:
    what the trainer's state offload and the optimizer hold per tensor."""
    r, out = lora["rank"], []
    for target, (fan_in, fan_out) in _dims(m).items():
        if target in lora["targets"]:
            out += [r * fan_in, fan_out // tp * r] if target in _COLUMN else [r * (fan_in // tp), fan_out * r]
    return out * m["L"]


def activation_extra(m: dict[str, Any], lora: dict[str, Any], *, tp: int, tokens: int, e: int,
                     kept_layers: int, recompute_modules: tuple[str, ...] = ()) -> int:
    """Bytes the adapters add to one micro-batch's activations at the training peak (the base's are
    ``runtime/plan/memory.py``'s), with B's product added by one addmm (``runtime.models.base.add_lora_up``: no
    [tokens, out] tensor of its own, forward or backward):

    * saved, per token and adapted linear of the ``kept_layers`` that keep their activations (full recompute: the
      one recomputed; selective recompute of ``mlp`` recomputes fc1's and fc2's): its ``[r]`` hidden, which B's
      gradient needs, and with dropout the dropped input (A's gradient) and the mask (the input's);
    * one transient beside the base's working set, the largest of: in an adapted linear's backward, its input's
      gradient through A before it is summed into the base's (with dropout also that gradient before the mask,
      and in the recomputed forward the mask's draw: fp32 uniforms and a bool keep, 5 bytes per input element);
      in fc1's forward, the addmm's ``[2 ffn]`` result beside the base's output, one ``[ffn]`` more than the base
      holds next (its output and the SwiGLU product). Where the peak falls is not modelled: the largest counts;
    * the gradient of the frozen embedding's output (``attach`` makes it require grad).

    Measured with the three-op add of before (bench/results/lora_grpo_*_2026-11-26.json, full recompute): 4.81 GiB
    of activations on GLM-Z1-9B's shape at 9216 tokens, 2.26 on Qwen3-0.6B's at 18,432, against 4.17 and 1.89
    planned then, the adapters' scaled [tokens, 2 ffn] temporaries of fc1 (0.47 and 0.21 GiB each) not counted;
    with add_lora_up (this count: 4.40 and 1.99), GLM's seed batch measured 4.66-4.72 against 4.40
    (lora_grpo_glm_*_2026-11-26_seed16x8.json)."""
    dropout = lora.get("dropout", 0) > 0
    per_token, transient = 0, 0
    for target, (fan_in, _) in _dims(m).items():
        if target not in lora["targets"]:
            continue
        local_in = fan_in if target in _COLUMN else fan_in // tp
        # the mask is drawn over the whole input, also on a row-parallel rank (lora._dropout_mask)
        transient = max(transient, max(2 * e * local_in, 5 * fan_in) if dropout else e * local_in)
        if target == "linear_fc1":
            transient = max(transient, m["f"] // tp * e)
        if target in ("linear_fc1", "linear_fc2") and "mlp" in recompute_modules:
            continue
        per_token += lora["rank"] * e + (2 * local_in * e if dropout else 0)
    return kept_layers * tokens * per_token + tokens * (transient + m["h"] * e)


def config_lora(cfg) -> dict[str, Any] | None:
    """:func:`adapter_params`' description of ``train.lora`` (None when off)."""
    lora = cfg.train.lora
    if not lora.enabled:
        return None
    return {"rank": lora.rank, "targets": tuple(lora.target_modules), "dropout": lora.dropout, "alpha": lora.alpha}
