"""Full, unsharded tensors from a tensor-parallel megatron model (what the rollout engine, exports
and the parallel-equivalence tests need)."""
from __future__ import annotations

import torch


def gather_full(model, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors` keyed by parameter name, each TP-sharded one gathered whole, on every TP rank."""
    from megatron.core import parallel_state as mpu

    tp = mpu.get_tensor_model_parallel_world_size()
    if tp == 1:
        return dict(tensors)
    group = mpu.get_tensor_model_parallel_group()
    params = dict(model.named_parameters())
    out = {}
    for name, t in tensors.items():
        p = params.get(name)
        if p is None or not getattr(p, "tensor_model_parallel", False):
            out[name] = t
            continue
        parts = [torch.empty_like(t) for _ in range(tp)]
        torch.distributed.all_gather(parts, t.contiguous(), group=group)
        if name.endswith(("mlp.linear_fc1.weight", "mlp.linear_fc1.lora_B")) and model.config.gated_linear_unit:
            # Each rank holds [gate_shard; up_shard] (the weight's rows, and its LoRA B's): regroup into [gate; up].
            halves = [torch.chunk(x, 2, dim=0) for x in parts]
            out[name] = torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
        else:
            # Fused QKV shards hold whole query groups, so a plain concat keeps the per-group layout.
            out[name] = torch.cat(parts, dim=p.partition_dim)
    return out


def full_state_dict(model, hf_config=None, to: int | None = None) -> dict[str, torch.Tensor] | None:
    """The model's state dict with every TP-sharded tensor gathered whole, and every expert of the expert-parallel
    ranks (runtime/trainer/expert_parallel.py): on every rank, or (``to``) on that global rank only (None elsewhere)."""
    from runtime.trainer.expert_parallel import gather_experts
    sd = {k: v for k, v in model.state_dict().items() if torch.is_tensor(v) and not k.endswith("_extra_state")}
    return gather_experts(gather_full(model, sd), to)


def gathered_units(model, units: list[tuple[str, tuple[str, ...]]], to: int | None = None,
                   expert_shard: tuple[int, int] | None = None):
    """:func:`full_state_dict` a unit at a time: for each ``(name, prefixes)`` (local-spec megatron name prefixes, as
    an adapter's ``hf_units`` gives them) the tensors under those prefixes, gathered whole (TP shards, every expert)
    under local-spec names. Yields ``(name, tensors)`` on every rank, or (``to``) ``(name, None)`` on the ranks but
    that one; every rank takes part in each unit's gathers, so all must run the whole iteration. At most one unit's
    tensors are whole at a time (the engine's weight sync of a model too large to gather on one GPU). ``expert_shard``
    (index, count; not with ``to``): of a mixture's experts only those of that engine shard
    (`expert_parallel.experts_of_shard`)."""
    from runtime.models.base import normalize_mcore_state_dict
    from runtime.trainer.expert_parallel import experts_of_shard, gather_experts
    sd = {k: v for k, v in model.state_dict().items() if torch.is_tensor(v) and not k.endswith("_extra_state")}
    local_names = {k: next(iter(normalize_mcore_state_dict({k: v}))) for k, v in sd.items()}
    for name, prefixes in units:
        part = {k: sd[k] for k, local in local_names.items() if local.startswith(prefixes)}
        part = gather_full(model, part)
        whole = gather_experts(part, to) if expert_shard is None else experts_of_shard(part, *expert_shard)
        part = None
        yield name, None if whole is None else normalize_mcore_state_dict(whole)
        whole = None  # dropped before the next unit is gathered


def full_grads(model) -> dict[str, torch.Tensor]:
    """The gradients of the last optimizer step (megatron keeps them in `main_grad`), gathered whole (experts too)."""
    from runtime.trainer.expert_parallel import gather_experts
    grads = {n: p.main_grad.detach().clone() for n, p in model.named_parameters() if getattr(p, "main_grad", None) is not None}
    return gather_experts(gather_full(model, grads))
