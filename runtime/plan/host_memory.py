"""Host (CPU) memory of one node for a run: what the trainer ranks keep there and the processes themselves.

Per trainer rank (``runtime/trainer``):

* ``train.optimizer_on_host`` (runtime/trainer/host_optimizer.py): the fp32 master weights and Adam's two fp32
  moments of the parameters this rank updates (its TP shard, 1/DP of it with the distributed optimizer):
  12 B per parameter, in ordinary (pageable) memory; the transfer buffers of the step (``RING`` pinned buffers
  each way of ``CHUNK_ELEMS`` gradients and weights, powers of two, so pinning rounds nothing up) and one fp32
  chunk of scratch. The state offload then frees the GPU's gradients without a copy: nothing pinned for it.
* otherwise, with the colocated state offload (``cluster.offload_trainer_state``,
  runtime/trainer/state_offload.py): a pinned buffer per offloaded storage, the DDP gradient buffer and each
  parameter's fp32 master and two moments (its DP shard with the distributed optimizer). PyTorch's caching
  host allocator rounds every pinned allocation up to a power of two (``CachingHostAllocator``'s
  ``PowerOf2Ceil``, default ``pinned_max_round_threshold``): the plan counts each buffer rounded.

With ``checkpoint.background`` (runtime/trainer/checkpoint_writer.py) each rank keeps a host copy of what it writes
of a checkpoint while the files are written beside the next chunk: the tensors it held on the GPU in pinned buffers
kept from save to save (each rounded as pinned), the ones already on the host (the host optimizer's state) cloned.
Summed over the ranks that is the checkpoint, optimizer and model, the half-precision weights left to their
masters (:func:`checkpoint_copy`).

Per process on the node (``PROCESS_BYTES``): the CUDA context, torch, megatron-core and transformers as they sit
in a process's resident memory. The processes: the driver, plus under ``cluster.backend: local`` one per trainer
rank when there are several, one per engine when there are several (one of each runs in the driver), and under
Ray one per actor and Ray's own daemons.

A node holds at most ``NODE_GPUS`` GPUs; a run with more GPUs is counted per node of that many. Not counted:
transients of loading and saving checkpoints (one tensor at a time), the page cache.
"""
from __future__ import annotations

import math
from typing import Any

from runtime.trainer.host_optimizer import CHUNK_ELEMS, RING

GIB = 2**30
# The host memory `validate` assumes per GiB of GPU memory when cluster.host_memory_gb is unset: the ratio of
# the H100 machines here (128 GiB of host memory per 80 GiB card; 256 GiB for 2 x 80).
HOST_GIB_PER_GPU_GIB = 1.6
# Resident memory of one GPU process of a run (CUDA context, cuBLAS/cuDNN handles, the Python libraries)
PROCESS_BYTES = 3 * GIB
NODE_GPUS = 8


def _pinned(nbytes: int) -> int:
    """What a pinned allocation of nbytes takes: the caching host allocator's power-of-two block."""
    return 0 if nbytes <= 0 else 1 << (int(nbytes) - 1).bit_length()


def param_tensor_numels(m: dict[str, Any], tp: int) -> list[int]:
    """Elements of each parameter tensor one tensor-parallel rank holds (megatron's GPTModel, local spec), for the
    model shape ``m`` (runtime/plan/memory.py ``_shape``)."""
    V, h, L, f, nh, ng, d = m["V"], m["h"], m["L"], m["f"], m["nh"], m["ng"], m["d"]
    qkv = (nh + 2 * ng) * d
    if m.get("E"):  # the router, then each expert's fc1 and fc2
        layer = [h, qkv * h // tp, nh * d * h // tp, h, m["E"] * h] + [2 * m["fe"] * h // tp, m["fe"] * h // tp] * m["E"]
    else:
        layer = [h, qkv * h // tp, nh * d * h // tp, h, 2 * f * h // tp, f * h // tp]
    if m["qkv_bias"]:
        layer.append(qkv // tp)
    if m["qk_norm"]:
        layer += [d, d]
    if m["post_norms"]:
        layer += [h, h]
    return [V * h // tp] + layer * L + [h] + ([] if m["tied"] else [V * h // tp])


def host_optimizer(opt_params: int) -> int:
    """``train.optimizer_on_host``: a rank's fp32 master and Adam's two moments, 12 B per parameter it updates."""
    return 12 * opt_params


def host_step_buffers(*, grad_bytes: int, weight_bytes: int) -> int:
    """``train.optimizer_on_host``: the step's pinned transfer buffers each way and its fp32 chunk of scratch."""
    return RING * CHUNK_ELEMS * (grad_bytes + weight_bytes) + 4 * CHUNK_ELEMS


def offload_pinned(numels: list[int], *, grads: int, weight_bytes: int, dp: int, distributed_optimizer: bool) -> int:
    """The state offload's pinned buffers of a rank: its gradient buffer (``grads`` bytes) and each trained tensor's
    fp32 master and two moments (their DP shard with the distributed optimizer), each rounded as pinned."""
    share = (lambda n: -(-n // dp)) if distributed_optimizer else (lambda n: n)
    master = 4 if weight_bytes < 4 else 0
    return _pinned(grads) + sum((_pinned(master * share(n)) if master else 0) + 2 * _pinned(4 * share(n))
                                for n in numels)


def checkpoint_copy(numels: list[int], *, tp: int, dp: int, weight_bytes: int, optimizer_on_host: bool) -> int:
    """The background writer's host copy of one checkpoint, over all ranks: each trained tensor's TP shards as fp32
    weights (their own master) or as the fp32 master of half-precision weights (the weights themselves are left
    out: runtime/trainer/master_weights.py), and its two moments, the master and moments split over the DP ranks
    that write them; pinned (rounded) where they were on the GPU, a plain clone where the host optimizer holds them."""
    master = 4 if weight_bytes < 4 else 0
    model = 0 if master else weight_bytes  # half-precision weights are left to their masters
    state = (lambda n: (master + 8) * n) if optimizer_on_host else \
        (lambda n: dp * sum(_pinned(b * -(-n // dp)) for b in ((master, 4, 4) if master else (4, 4))))
    return tp * sum(_pinned(model * n) + state(n) for n in numels)


def host_terms(shape: dict[str, Any], *, tp: int, dp: int, per_rank: int, opt_params: int, weight_bytes: int,
               grad_bytes: int, distributed_optimizer: bool, optimizer_on_host: bool, offload: bool, trainer_ranks: int,
               processes: int, host_memory_gb: float, trainable_numels: list[int] | None = None,
               background_checkpoint: bool = False) -> dict[str, Any]:
    """Host bytes of one node (module doc), by term; ``fits`` against ``host_memory_gb``. ``trainable_numels``:
    the elements of each trained tensor of a rank when not every parameter is trained (LoRA's adapters: the
    frozen base has no gradients, master or moments to offload); ``per_rank`` then counts them too."""
    optimizer, pinned = 0, 0
    if optimizer_on_host:  # the offload then frees the GPU's gradients without a copy: nothing pinned for it
        optimizer = host_optimizer(opt_params)
        pinned = host_step_buffers(grad_bytes=grad_bytes, weight_bytes=weight_bytes)
        note = "host"
    elif offload:
        numels = param_tensor_numels(shape, tp) if trainable_numels is None else trainable_numels
        pinned = offload_pinned(numels, grads=per_rank * grad_bytes, weight_bytes=weight_bytes, dp=dp,
                                distributed_optimizer=distributed_optimizer)
        note = "offload"
    else:
        note = "none"
    ranks = min(trainer_ranks, NODE_GPUS)
    copy = 0
    if background_checkpoint:  # this node's ranks' share of the checkpoint
        numels = param_tensor_numels(shape, tp) if trainable_numels is None else trainable_numels
        copy = checkpoint_copy(numels, tp=tp, dp=dp, weight_bytes=weight_bytes,
                               optimizer_on_host=optimizer_on_host) * ranks // max(tp * dp, 1)
    exact = {"optimizer": ranks * optimizer, "pinned": ranks * pinned, "checkpoint_copy": copy,
             "processes": processes * PROCESS_BYTES}
    exact["total"] = sum(exact.values())
    limit = host_memory_gb * GIB
    out: dict[str, Any] = {k: v / GIB for k, v in exact.items()}
    out.update(bytes=exact, per_rank_bytes=optimizer + pinned, ranks=ranks, processes_n=processes, mode=note,
               host_memory_gb=host_memory_gb, fits=exact["total"] <= limit)
    return out


def node_layout(cfg) -> dict[str, int]:
    """Trainer ranks, processes and GPUs of one node (module doc) for a ``GrpoConfig``."""
    from runtime.placement import layout
    world = layout.trainer_world_size(cfg)
    engines = layout.rollout_engines(cfg)
    gpus = max(1, layout.gpus_needed(cfg))
    nodes = math.ceil(gpus / NODE_GPUS)
    if cfg.cluster.backend == "ray":
        processes = world + engines + 2  # the actors, the driver, Ray's daemons
    else:
        processes = 1 + (world if world > 1 else 0) + (engines if engines > 1 else 0)
    return {"trainer_ranks": -(-world // nodes), "processes": -(-processes // nodes),
            "gpus": min(gpus, NODE_GPUS)}


def target_host_memory_gb(cfg, override: float | None = None, gpu_mem_gb: float = 80.0) -> tuple[float, str]:
    """The plan's host memory per node and where it came from: ``--host-mem-gb``, else ``cluster.host_memory_gb``,
    else HOST_GIB_PER_GPU_GIB x the GPU memory of the node's GPUs."""
    if override is not None:
        return float(override), "--host-mem-gb"
    if cfg.cluster.host_memory_gb is not None:
        return float(cfg.cluster.host_memory_gb), "cluster.host_memory_gb"
    gpus = node_layout(cfg)["gpus"]
    return HOST_GIB_PER_GPU_GIB * gpu_mem_gb * gpus, \
        f"cluster.host_memory_gb unset: {HOST_GIB_PER_GPU_GIB:g} x {gpus} x {gpu_mem_gb:g} GiB of GPU memory"


def format_host(host: dict[str, Any]) -> list[str]:
    """Lines for ``grpoflow validate``: the host's terms and total."""
    opt_note = {"host": "fp32 master + Adam m, v of each rank's parameters, stepped on the host "
                        "(train.optimizer_on_host)",
                "offload": "", "none": ""}[host["mode"]]
    pin_note = {"host": "transfer buffers of the host step (pinned) and its fp32 scratch",
                "offload": "the trainer state offloaded while generating (pinned, rounded up to powers of two)",
                "none": "no state offload"}[host["mode"]]
    rows = [("optimizer", host["optimizer"], opt_note)] if host["mode"] == "host" else []
    rows += [("pinned buffers", host["pinned"], pin_note),
            *([("checkpoint copy", host["checkpoint_copy"], "a checkpoint's host copy while the background writer "
                                                               "writes it (checkpoint.background)")]
              if host["checkpoint_copy"] else []),
            ("processes", host["processes"], f"{host['processes_n']} x {PROCESS_BYTES / GIB:g} GiB "
                                             f"(CUDA context, libraries)")]
    lines = [f"host memory per node ({host['ranks']} trainer rank{'s' if host['ranks'] != 1 else ''}, "
             f"{host['processes_n']} process{'es' if host['processes_n'] != 1 else ''}):"]
    lines += [f"  {name:<15}{gib:8.2f} GiB" + (f"   {note}" if note else "") for name, gib, note in rows]
    verdict = "fits" if host["fits"] else "DOES NOT FIT"
    lines.append(f"  {'total':<15}{host['total']:8.2f} GiB of {host['host_memory_gb']:g} GiB ({host['source']}): "
                 f"{verdict}")
    return lines
