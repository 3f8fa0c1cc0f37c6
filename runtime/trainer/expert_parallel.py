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


def group_dp_ranks(dp_rank: int) -> list[int]:
    """The data-parallel ranks of this rank's expert group, in group order: those whose micro-batches this rank's
    must match (one all-gather of ints, once)."""
    from megatron.core import parallel_state as mpu
    group = mpu.get_expert_model_parallel_group()
    ranks: list[int | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(ranks, dp_rank, group=group)
    return [int(r) for r in ranks]


def equal_micro_batches(group: list[list[list[int]]], mine: list[list[int]], lengths: list[int],
                        packed: bool) -> tuple[list[list[int]], list[int]]:
    """One optimizer step's micro-batches of this rank (``mine``), made to pair up with its expert group's
    (``group``: every member's, this rank's among them; every rank holds the whole batch and computes them alone).

    megatron's allgather dispatcher gathers the group's tokens into one tensor in each MoE layer, forward and
    backward, so the group's m-th micro-batches must have one shape and every member as many micro-batches. Returns
    ``mine`` with an empty micro-batch (``[]``: padding only, trained on by no one) for each one a member has more,
    and the length each micro-batch is padded to: right-padded, the longest sample of the group's m-th; packed
    (token budget), the most tokens in the group's m-th. The samples' own micro-batches are unchanged, so the loss
    is the one without expert parallelism; the padding is ``group_padding`` to the routers' losses."""
    count = max(len(mbs) for mbs in group)
    if not packed and any(len(mbs) != count for mbs in group):  # micro_batch_size samples: one count by design
        raise AssertionError(f"right-padded micro-batch counts differ across the expert group: "
                             f"{[len(mbs) for mbs in group]}")

    def size(mb: list[int]) -> int:
        return sum(lengths[i] for i in mb) if packed else max(lengths[i] for i in mb)
    shapes = [max(size(mbs[m]) for mbs in group if m < len(mbs)) for m in range(count)]
    return list(mine) + [[] for _ in range(count - len(mine))], shapes


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


def experts_of_shard(tensors: dict[str, torch.Tensor], index: int, count: int) -> dict[str, torch.Tensor]:
    """``tensors`` (parameter names, TP-whole) with the experts of engine shard ``index`` of ``count`` only, under their
    global index (runtime/rollout/expert_shards.py: shard s holds global experts s·E/count ..): the rest as they are.
    When the engine's shards are this rank's expert group (``count`` = EP, the shard this rank's EP rank) they are the
    experts here, renamed, with nothing sent; otherwise every expert is gathered (:func:`gather_experts`, collective
    over the expert group) and the shard's kept."""
    ep = size()
    local = [k for k in tensors if _LOCAL_EXPERT.match(k)]
    per_rank = 1 + max((int(_LOCAL_EXPERT.match(k)[2]) for k in local), default=-1)
    if ep == count and ep > 1:
        from megatron.core import parallel_state as mpu
        rank = mpu.get_expert_model_parallel_rank()
        if rank != index:
            raise RuntimeError(f"engine shard {index} of {count} beside expert-parallel rank {rank}: the colocated engine "
                               f"on a rank's GPU is expected to hold that rank's experts")
        out = {k: v for k, v in tensors.items() if k not in set(local)}
        for key in local:
            prefix, i, suffix = _LOCAL_EXPERT.match(key).groups()
            out[f"{prefix}{rank * per_rank + int(i)}{suffix}"] = tensors[key]
        return out
    whole = gather_experts(tensors)
    experts = per_rank * ep
    first, n = index * experts // count, experts // count
    return {k: v for k, v in whole.items()
            if not (m := _LOCAL_EXPERT.match(k)) or first <= int(m[2]) < first + n}
