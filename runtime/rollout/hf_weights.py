"""The tensors an engine's HF model takes weight updates into, by the names the trainer sends.

The trainer sends a checkpoint's names (`ModelAdapter.to_hf`): for a mixture of experts the hub's one tensor per
expert and projection (``mlp.experts.{e}.gate_proj.weight``, ``up_proj``, ``down_proj``). transformers 5 holds the
experts fused (``mlp.experts.gate_up_proj`` [E, 2F, H] = cat(gate, up) per expert, ``down_proj`` [E, H, F]); each
hub tensor is a contiguous block of those, so it is offered as a view: an update (or a broadcast received in place)
lands in the fused parameter with no copy of its own.
"""
from __future__ import annotations

import torch


def update_targets(model: torch.nn.Module, expert_offset: int = 0) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` (tensors sharing the parameters' storage) plus the hub's per-expert names as views.
    ``expert_offset``: the global index of the model's first expert (an engine holding one shard of the experts,
    runtime/rollout/expert_shards.py): its expert ``i`` is named ``mlp.experts.{offset + i}``."""
    state = model.state_dict()
    for name in [n for n in state if n.endswith("mlp.experts.gate_up_proj")]:
        prefix = name[: -len("gate_up_proj")]
        gate_up, down = state[name], state[prefix + "down_proj"]
        ffn = gate_up.shape[1] // 2
        for e in range(gate_up.shape[0]):
            g = expert_offset + e
            state[f"{prefix}{g}.gate_proj.weight"] = gate_up[e, :ffn]
            state[f"{prefix}{g}.up_proj.weight"] = gate_up[e, ffn:]
            state[f"{prefix}{g}.down_proj.weight"] = down[e]
    return state
