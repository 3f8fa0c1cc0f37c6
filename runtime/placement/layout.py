"""Where a run's pieces go: trainer ranks, rollout GPUs, weight-sync path, and the checks that the
layout fits the model and the GPUs on offer. Every problem is one line naming the fields to change."""
from __future__ import annotations

from runtime.config import GrpoConfig
from runtime.errors import ConfigError


def trainer_world_size(cfg: GrpoConfig) -> int:
    return cfg.train.data_parallel * cfg.train.tensor_parallel


def rollout_engines(cfg: GrpoConfig) -> int:
    """How many engine actors: one built-in engine per rollout GPU (data-parallel rollout); one SGLangEngine
    (it runs its own servers, `rollout.sglang.num_engines`)."""
    c = cfg.cluster
    return max(c.rollout_gpus, 1) if cfg.rollout.engine == "builtin" else 1


def engine_gpus(cfg: GrpoConfig) -> list[int]:
    """GPU index (on its host) of every built-in engine: colocated, engine i shares trainer rank i's GPU;
    otherwise they take the GPUs after the trainer's, one each."""
    c = cfg.cluster
    first = 0 if c.colocate or not c.rollout_gpus else max(c.trainer_gpus, trainer_world_size(cfg))
    return list(range(first, first + rollout_engines(cfg)))


def gpus_needed(cfg: GrpoConfig) -> int:
    c = cfg.cluster
    return c.trainer_gpus + (0 if c.colocate else c.rollout_gpus)


def weight_sync_mode(cfg: GrpoConfig) -> str:
    """`direct`: the trainer hands tensors over (in-process, CUDA IPC, Ray's object store, or the
    SGLang engine's own disk/tensor path); `broadcast`: a torch.distributed group, trainer rank 0 to
    every engine rank (NCCL between GPUs, gloo on CPU)."""
    c = cfg.cluster
    if c.weight_sync != "auto":
        return c.weight_sync
    return "broadcast" if (not c.colocate and c.rollout_gpus > 0) else "direct"


def trainer_in_subprocesses(cfg: GrpoConfig) -> bool:
    """Under `cluster.backend: local`, whether the trainer ranks run in spawned processes (several ranks, or a
    broadcast group to join) rather than in the driver."""
    return cfg.cluster.backend == "local" and (trainer_world_size(cfg) > 1 or weight_sync_mode(cfg) == "broadcast")


def direct_transport(cfg: GrpoConfig, device: str) -> str:
    """How `direct` weight sync carries the tensors (runtime/placement/weight_sync.py DirectTransport):
    "cuda_ipc" where each built-in engine shares its GPU with a trainer rank in another process (Ray actors
    colocated on GPUs; spawned ranks of the local backend: a tensor received by IPC cannot be sent on), each
    reading that rank's copy in place; "host" for other Ray actors (the object store); else "as_is"."""
    if device == "cuda" and engine_shares_gpu_across_processes(cfg):
        return "cuda_ipc"
    return "host" if cfg.cluster.backend == "ray" else "as_is"


def engine_shares_gpu_across_processes(cfg: GrpoConfig) -> bool:
    """Whether each built-in engine shares its GPU with a trainer rank in another process: Ray actors colocated on
    GPUs, or the local backend's spawned trainer ranks beside engine processes (not one process holding both)."""
    c = cfg.cluster
    if not c.colocate or cfg.rollout.engine != "builtin":
        return False
    return c.trainer_gpus > 0 if c.backend == "ray" else trainer_in_subprocesses(cfg)


def shares_base(cfg: GrpoConfig) -> bool:
    """Whether the built-in engine decodes with the trainer's own base tensors instead of a copy: LoRA (the base
    is frozen), one trainer rank in this process (local backend, TP 1, DP 1, direct weight sync) and one engine
    colocated with it. Elsewhere the engine loads its own base and receives the adapters only."""
    c = cfg.cluster
    return (cfg.train.lora.enabled and c.backend == "local" and c.colocate and trainer_world_size(cfg) == 1
            and weight_sync_mode(cfg) == "direct" and cfg.rollout.engine == "builtin" and rollout_engines(cfg) == 1)


def check_layout(cfg: GrpoConfig, hf_config=None, gpus_available: int | None = None) -> None:
    """Raise ConfigError when the parallel layout cannot run: model shapes vs TP, rollout GPUs vs
    engines, and (when known) the GPUs of this host or cluster."""
    c, t, r = cfg.cluster, cfg.train, cfg.rollout
    tp = t.tensor_parallel
    if hf_config is not None:
        heads = int(getattr(hf_config, "num_attention_heads", 0) or 0)
        kv = int(getattr(hf_config, "num_key_value_heads", None) or heads)
        if heads and heads % tp:
            raise ConfigError(f"train.tensor_parallel={tp} does not divide the model's {heads} attention heads; "
                              f"use a divisor of {heads}")
        if kv and kv % tp:
            raise ConfigError(f"train.tensor_parallel={tp} does not divide the model's {kv} key/value heads; "
                              f"use a divisor of {kv}")
        vocab = int(getattr(hf_config, "vocab_size", 0) or 0)
        if vocab and vocab % tp:
            raise ConfigError(f"train.tensor_parallel={tp} does not divide the vocabulary ({vocab}); use a divisor")
        experts = int(getattr(hf_config, "num_experts", 0) or 0)
        shards = r.expert_shards
        if shards > 1 and (not experts or experts % shards):
            raise ConfigError(f"rollout.expert_shards={shards} must divide the model's experts "
                              f"({experts or 'none: not a mixture of experts'}); set rollout.expert_shards: "
                              f"{'1' if not experts else 'a divisor of ' + str(experts)}")
        if experts and tp > 1:  # megatron-core's MoELayer.forward refuses to train under TP without it
            raise ConfigError(f"train.tensor_parallel={tp} on a mixture of experts ({experts} experts): megatron-core "
                              f"trains MoE layers under tensor parallelism only with sequence parallelism, which the "
                              f"trainer does not turn on; use train.tensor_parallel: 1 (train.expert_parallel splits "
                              f"the experts)")
    if r.engine == "builtin" and c.rollout_gpus > 1 and c.colocate and not c.trainer_gpus and c.device != "cpu":
        raise ConfigError(f"cluster.rollout_gpus={c.rollout_gpus} with cluster.colocate=true puts one built-in engine on "
                          f"each trainer GPU, but cluster.trainer_gpus=0 (one device); set cluster.trainer_gpus >= "
                          f"{c.rollout_gpus}, or colocate=false")
    if r.engine == "sglang" and c.rollout_gpus and c.rollout_gpus != r.sglang.num_engines * r.sglang.tp_size:
        raise ConfigError(f"cluster.rollout_gpus={c.rollout_gpus} but rollout.sglang.num_engines × sglang.tp_size = "
                          f"{r.sglang.num_engines} × {r.sglang.tp_size}; make them equal")
    if c.colocate and c.trainer_gpus and c.rollout_gpus > c.trainer_gpus:
        raise ConfigError(f"cluster.colocate=true shares the trainer's {c.trainer_gpus} GPU(s), but "
                          f"cluster.rollout_gpus={c.rollout_gpus}; lower rollout_gpus to <= {c.trainer_gpus} "
                          f"or set colocate=false")
    if cfg.cluster.weight_sync == "broadcast" and c.backend == "local" and c.colocate and c.trainer_gpus:
        raise ConfigError("cluster.weight_sync=broadcast needs the engine on GPUs of its own (NCCL cannot join two "
                          "ranks on one GPU); set cluster.colocate=false, or weight_sync=auto")
    if gpus_available is not None:
        check_gpus(cfg, gpus_available, where="this machine")


def check_gpus(cfg: GrpoConfig, gpus_available: int, where: str) -> None:
    need = gpus_needed(cfg)
    if need > gpus_available:
        c = cfg.cluster
        raise ConfigError(
            f"the layout needs {need} GPU(s) (cluster.trainer_gpus={c.trainer_gpus}"
            + ("" if c.colocate else f" + rollout_gpus={c.rollout_gpus}")
            + f") but {where} has {gpus_available}; lower train.data_parallel / tensor_parallel or "
            f"cluster.*_gpus, or add GPUs")
