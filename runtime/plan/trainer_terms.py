"""The trainer's resident terms on one GPU (``runtime.trainer.megatron_trainer``): weights, gradients, the
optimizer's state, and the optimizer step's transient.

megatron DDP keeps a gradient buffer of every trained parameter, fp32 (``train.grad_dtype: float32``, megatron's
``grad_reduce_in_fp32``) or in the weights' dtype (``bfloat16``); its mixed-precision optimizer an fp32 master copy
of every parameter (none when the weights are already fp32), made when the trainer is built, and Adam's two fp32
moments, made at the first optimizer step. Weights and gradients are split by tensor parallelism only (data
parallelism replicates them); the master and moments too, unless ``train.distributed_optimizer`` shards them over
the data-parallel ranks (1/DP each; its gradient buffer stays whole: megatron reduce-scatters in place). A reference
copy of the weights when ``kl_coef > 0``. ``train.optimizer_on_host``: no fp32 master, Adam moments or step
temporaries on the GPU (the host's side: runtime/plan/host_memory.py). ``train.lora``: the base frozen (its weights
only), gradients / master / Adam for the adapters (runtime/plan/lora_memory.py).
"""
from __future__ import annotations

from dataclasses import dataclass

# Adam's step (torch's foreach implementation) holds about one fp32 copy of the parameters it updates in
# temporaries: measured 2.27 GiB for Qwen3-0.6B's 2.22 GiB (bench/results/memory_check_H100_2026-11-23_24gb.json)
OPT_STEP_BYTES_PER_PARAM = 4


def trainer_weights(per_rank: int, adapters_rank: int, e: int, *, ref_model: bool, lora: bool) -> int:
    """The rank's weights, its adapters, and the reference copy (none with LoRA: the reference is the base with the
    adapters off)."""
    return per_rank * e + adapters_rank * e + (per_rank * e if ref_model and not lora else 0)


def grad_bytes_per_param(grad_dtype: str, e: int) -> int:
    if grad_dtype not in ("float32", "bfloat16"):
        raise ValueError(f"grad_dtype must be float32 or bfloat16, not {grad_dtype!r}")
    return 4 if grad_dtype == "float32" else e


def gradients(trained: int, e: int, grad_dtype: str) -> int:
    """The DDP gradient buffer of the parameters the rank trains: fp32, or the weights' dtype."""
    return trained * grad_bytes_per_param(grad_dtype, e)


@dataclass(frozen=True)
class Optimizer:
    params: int    # the parameters whose state this rank holds: all of its TP shard, or 1/dp of it (distributed)
    master: int    # fp32 master copy, made with the optimizer
    moments: int   # Adam m, v: made at the first step
    on_gpu: int    # what of master + moments is on the GPU
    step: int      # the step's transient on the GPU, beside the state
    experts: int = 0  # of ``params``, the experts' (their own optimizer: runtime/plan/moe_terms.py)


def optimizer(trained: int, e: int, *, dp: int, distributed_optimizer: bool, optimizer_on_host: bool,
              experts: int = 0, ep: int = 1) -> Optimizer:
    """``experts``: of the ``trained`` parameters, the rank's experts (already 1/ep of them, runtime/plan/shape.py);
    megatron gives them their own optimizer, which the distributed optimizer shards over the expert-data-parallel
    ranks (dp / ep of them) instead of over all dp."""
    if distributed_optimizer:
        experts_share = -(-experts // max(dp // ep, 1))
        params = -(-(trained - experts) // dp) + experts_share
    else:
        params, experts_share = trained, experts
    master = params * 4 if e < 4 else 0
    moments = params * 8
    return Optimizer(params=params, master=master, moments=moments,
                     on_gpu=0 if optimizer_on_host else master + moments,
                     step=0 if optimizer_on_host else OPT_STEP_BYTES_PER_PARAM * params, experts=experts_share)
