"""Expert parallelism (``train.expert_parallel``): its checks, and the experts gathered from their ranks.

megatron cuts the expert groups from the data-parallel ranks (world = TP × EP × expert-DP, the experts' TP that of
the dense layers); each rank of a group holds ``num_experts / EP`` experts, named by their local index
(``...mlp.experts.local_experts.{i}...``; rank r of the group holds global experts r·L .. r·L + L - 1). Whole
models (the rollout engine's weights, HF exports, gradients for the equivalence checks) need every expert under its
global index: :func:`gather_experts` collects them one tensor at a time, onto one rank or onto every rank.
"""
from __future__ import annotations

import re

import torch
import torch.distributed as dist

_LOCAL_EXPERT = re.compile(r"^(.*\.experts\.local_experts\.)(\d+)(\..*)$")


def check(train, hf_config, world_size: int) -> None:
    """One-line refusals of an expert-parallel layout megatron cannot build for this model and world."""
    from runtime.errors import ConfigError
    from runtime.trainer.router_losses import is_moe
    ep = int(train.expert_parallel)
    if ep == 1:
        return
    if not is_moe(hf_config):
        raise ConfigError(f"train.expert_parallel={ep} needs a mixture of experts; {hf_config.model_type} has none: "
                          f"set train.expert_parallel: 1")
    experts = int(hf_config.num_experts)
    if experts % ep:
        raise ConfigError(f"train.expert_parallel={ep} must divide the model's num_experts={experts}")
    if world_size % (ep * train.tensor_parallel):
        raise ConfigError(f"train.expert_parallel={ep} × train.tensor_parallel={train.tensor_parallel} must divide "
                          f"the trainer's {world_size} ranks (the expert groups are cut from the data-parallel ranks)")


def check_resume(path: str, expert_parallel: int) -> None:
    """Refuse a resume that changes ``train.expert_parallel``: the weights reshard across it (megatron names experts
    by their global index), but its optimizer chain does not (one optimizer at EP 1, the experts' own beside it
    above, their common state nested by position). Checkpoints from before the setting are EP 1's."""
    from megatron.core import dist_checkpointing

    from runtime.errors import ConfigError
    saved = int(dist_checkpointing.load_common_state_dict(path).get("expert_parallel", 1))
    if saved != int(expert_parallel):
        raise ConfigError(f"checkpoint {path} was written at train.expert_parallel={saved}, not {expert_parallel}: its "
                          f"optimizer does not reshard across expert parallelism; resume with expert_parallel: {saved}")


def micro_batch_lengths(n_samples: int, steps: int, dp_size: int, micro_batch_size: int,
                        lengths: list[int]) -> list[list[int]]:
    """For each step and micro-batch, the longest sample of that micro-batch on any DP rank: under expert
    parallelism every rank pads its micro-batch to it, because megatron's allgather dispatcher gathers the tokens of
    an expert group into one tensor (equal counts per rank). Every rank holds the whole batch, so each computes this
    alone. The padding is masked out of the loss and never seen by a real token (causal), but the router routes it:
    the load-balancing loss counts it, as it counts a micro-batch's own padding without expert parallelism."""
    from runtime.trainer.batch import step_slices
    per_rank = [step_slices(n_samples, steps, dp_size, r, micro_batch_size, lengths=lengths) for r in range(dp_size)]
    return [[max(lengths[i] for rank in per_rank for i in rank[s][m]) for m in range(len(per_rank[0][s]))]
            for s in range(steps)]


def size() -> int:
    from megatron.core import parallel_state as mpu
    return mpu.get_expert_model_parallel_world_size() if mpu.model_parallel_is_initialized() else 1


def gather_experts(tensors: dict[str, torch.Tensor], to: int | None = None) -> dict[str, torch.Tensor] | None:
    """``tensors`` (parameter names, TP-whole) with every expert of every EP rank under its global index.
    ``to=None``: on every rank (an all-gather per expert tensor). ``to=r``: on global rank ``r`` only, from the ranks
    of its expert group (the other groups hold the same experts and send nothing); every other rank gets None and
    holds no expert but its own at any time. One expert tensor × EP is the most in flight."""
    ep = size()
    if ep == 1:
        return tensors if to is None or dist.get_rank() == to else None
    from megatron.core import parallel_state as mpu
    group = mpu.get_expert_model_parallel_group()
    members = dist.get_process_group_ranks(group)
    if to is not None and to not in members:
        return None
    here = to is None or dist.get_rank() == to
    local = sorted((k for k in tensors if _LOCAL_EXPERT.match(k)),
                   key=lambda k: (_LOCAL_EXPERT.match(k)[1], int(_LOCAL_EXPERT.match(k)[2]), _LOCAL_EXPERT.match(k)[3]))
    per_rank = 1 + max((int(_LOCAL_EXPERT.match(k)[2]) for k in local), default=-1)
    out = {k: v for k, v in tensors.items() if k not in set(local)} if here else None
    for key in local:
        prefix, index, suffix = _LOCAL_EXPERT.match(key).groups()
        t = tensors[key].contiguous()
        parts = [torch.empty_like(t) for _ in range(ep)] if here else None
        if to is None:
            dist.all_gather(parts, t, group=group)
        else:
            dist.gather(t, parts, dst=to, group=group)
        if here:
            for r, part in enumerate(parts):
                out[f"{prefix}{r * per_rank + int(index)}{suffix}"] = part
    return out
