"""The trainer's LoRA adapters in PEFT's layout: ``adapter_config.json`` + ``adapter_model.safetensors`` that
``peft.PeftModel.from_pretrained(<the HF base>, <dir>)`` loads.

The trainer's adapters sit on megatron's fused linears (``runtime/trainer/lora.py``); PEFT's sit on HF's
projections. A fused linear's adapter splits exactly: its output is ``scale * B (A x)``, so the rows of B
that make q (k, v; gate, up) are that projection's B, with the same A. The qkv rows are megatron's
per-group layout and are split with the same map as the weights (``split_qkv``); fc1's with the family's
``fc1_to_hf`` (gate/up, or GLM4's fused ``gate_up_proj`` whole). Pure torch: no megatron, no peft.
"""
from __future__ import annotations

import re

import torch

PEFT_WEIGHTS = "adapter_model.safetensors"
PEFT_CONFIG = "adapter_config.json"
_PREFIX = "base_model.model."
_NAME = re.compile(r"decoder\.layers\.(\d+)\.(?:self_attention|mlp)\.(linear_qkv|linear_proj|linear_fc1|linear_fc2)"
                   r"\.lora_(A|B)$")


def to_peft(adapters: dict[str, torch.Tensor], hf_config) -> dict[str, torch.Tensor]:
    """Whole adapters by megatron parameter name (``decoder.layers.0.self_attention.linear_qkv.lora_A``) ->
    PEFT's tensors (``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``)."""
    from runtime.models import get_adapter
    from runtime.models.base import head_dim, split_qkv

    family = get_adapter(hf_config)
    nh, ng, d = hf_config.num_attention_heads, hf_config.num_key_value_heads, head_dim(hf_config)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, t in adapters.items():
        m = _NAME.search(name)
        if m is None:
            raise ValueError(f"not a LoRA adapter of a decoder linear: {name}")
        pairs.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = t
    out: dict[str, torch.Tensor] = {}
    for (layer, linear), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise ValueError(f"layer {layer} {linear}: lora_A and lora_B go together")
        hp = f"model.layers.{layer}."
        a, b = ab["A"], ab["B"]
        if linear == "linear_qkv":
            q, k, v = split_qkv(b, nh, ng, d)
            modules = {hp + "self_attn.q_proj": q, hp + "self_attn.k_proj": k, hp + "self_attn.v_proj": v}
        elif linear == "linear_proj":
            modules = {hp + "self_attn.o_proj": b}
        elif linear == "linear_fc1":
            modules = {k.removesuffix(".weight"): v for k, v in family.fc1_to_hf(b, hp).items()}
        else:
            modules = {hp + "mlp.down_proj": b}
        for module, rows in modules.items():
            out[f"{_PREFIX}{module}.lora_A.weight"] = a.clone()  # one copy per projection (a file shares none)
            out[f"{_PREFIX}{module}.lora_B.weight"] = rows.contiguous()
    return out


def target_modules(peft_tensors: dict[str, torch.Tensor]) -> list[str]:
    """PEFT's ``target_modules``: the projection names that carry an adapter (q_proj, o_proj, ...)."""
    return sorted({k.removesuffix(".lora_A.weight").rpartition(".")[2] for k in peft_tensors
                   if k.endswith(".lora_A.weight")})


def adapter_config(lora, peft_tensors: dict[str, torch.Tensor], base_model: str) -> dict:
    """``adapter_config.json`` for ``train.lora`` (rank, alpha, dropout) and the adapted projections."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
            "r": int(lora.rank), "lora_alpha": float(lora.alpha), "lora_dropout": float(lora.dropout),
            "target_modules": target_modules(peft_tensors), "bias": "none", "fan_in_fan_out": False,
            "use_rslora": False, "use_dora": False, "init_lora_weights": True, "inference_mode": True,
            "modules_to_save": None, "layers_to_transform": None}


__all__ = ["to_peft", "adapter_config", "target_modules", "PEFT_WEIGHTS", "PEFT_CONFIG"]
