"""The memory plan's terms for LoRA (``train.lora``; runtime/trainer/lora.py, runtime/rollout/lora_forward.py).

* The base is frozen: its weights as before (bf16 on a GPU), and no gradient buffer, fp32 master or Adam
  moments for it; those exist for the adapters only. No reference copy: the KL reference is the base with
  the adapters off.
* Adapters, per linear ``r (in + out)`` parameters; on a tensor-parallel rank a column-parallel linear's
  (qkv, fc1) A is whole and B 1/TP, a row-parallel one's (proj, fc2) A 1/TP and B whole.
* Activations: what the layers save does not change (a frozen linear saves no input, but the adapter's first
  matmul saves that same input); each adapted linear adds its ``[tokens, r]`` hidden (saved for B's
  gradient), and with dropout the dropped input and its mask. The output layer is frozen: the chunked
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
    """Bytes the adapters add to one micro-batch's saved activations: per token and adapted linear its
    ``[r]`` hidden (and with dropout its dropped input and mask), in the ``kept_layers`` that keep their
    activations (selective recompute of ``mlp`` recomputes fc1's and fc2's); plus the gradient of the frozen
    embedding's output."""
    per_token = 0
    for target, (fan_in, _) in _dims(m).items():
        if target not in lora["targets"] or (target in ("linear_fc1", "linear_fc2") and "mlp" in recompute_modules):
            continue
        local_in = fan_in if target in _COLUMN else fan_in // tp
        per_token += lora["rank"] * e + (2 * local_in * e if lora.get("dropout", 0) > 0 else 0)
    return kept_layers * tokens * per_token + tokens * m["h"] * e


def config_lora(cfg) -> dict[str, Any] | None:
    """:func:`adapter_params`' description of ``train.lora`` (None when off)."""
    lora = cfg.train.lora
    if not lora.enabled:
        return None
    return {"rank": lora.rank, "targets": tuple(lora.target_modules), "dropout": lora.dropout, "alpha": lora.alpha}
