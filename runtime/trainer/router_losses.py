"""A mixture of experts' router losses in the trainer: the load-balancing loss (the model's
``router_aux_loss_coef``) and the z-loss (``train.router_z_loss_coef``).

megatron-core's router adds them itself: each MoE layer's router attaches its loss to the routing weights
(``MoEAuxLossAutoScaler``), whose backward adds the loss's gradient times a class-wide scale, and records the
unscaled loss per layer in a process-wide tracker. An optimizer step here runs several micro-batches, each
backward on its own, and megatron's DDP averages the gradients over the data-parallel ranks: with the scale
1 / micro-batches the step's gradient is the coefficient times the router loss averaged over micro-batches and
ranks (summed over layers, megatron's form). What the tracker holds is read back as the step's metrics.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

# megatron's tracker name -> our metric
_METRICS = {"load_balancing_loss": "router_aux_loss", "z_loss": "router_z_loss"}


def is_moe(hf_config) -> bool:
    from runtime.models import get_adapter
    return bool(getattr(get_adapter(hf_config), "is_moe", False))


def config_overrides(train) -> dict:
    """TransformerConfig fields the run's settings give a mixture of experts."""
    return {"moe_z_loss_coeff": float(train.router_z_loss_coef) or None}


@dataclass
class _Step:
    moe_layers: int
    micro_batches: int
    losses: tuple[str, ...]  # the tracker's names of the losses this model computes


def begin_step(model, micro_batches: int, device: torch.device) -> _Step | None:
    """Before an optimizer step's first micro-batch: the router losses' gradient scale, the tracker emptied.
    None for a model without experts."""
    from runtime.mcore.env import unwrap_model
    config = unwrap_model(model).config
    if not getattr(config, "num_moe_experts", None):
        return None
    # the tracker is the process's: a name another model left there (emptied) is not this model's
    losses = tuple(name for name, on in (("load_balancing_loss", config.moe_aux_loss_coeff),
                                         ("z_loss", config.moe_z_loss_coeff)) if on)
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler, clear_aux_losses_tracker
    n = max(int(micro_batches), 1)
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0 / n, dtype=torch.float32, device=device))
    clear_aux_losses_tracker()
    return _Step(int(config.num_layers), n, losses)


def end_step(step: _Step | None, dp_size: int) -> dict[str, torch.Tensor]:
    """After the step's last backward: each router loss the model computed, unscaled, averaged over layers and
    micro-batches and divided by ``dp_size`` (summed over the ranks it is their mean). Tensors where they live."""
    if step is None:
        return {}
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker
    out = {}
    tracker = get_moe_layer_wise_logging_tracker()
    for name in step.losses:
        if name in tracker:
            out[_METRICS[name]] = tracker[name]["values"].detach().sum() / (step.moe_layers * step.micro_batches * dp_size)
    clear_aux_losses_tracker()
    return out


@contextlib.contextmanager
def off(model):
    """Within (forward and backward): the model's routers add no router loss and record none. For a micro-batch of
    padding only (expert parallelism, ``runtime/trainer/expert_parallel.py``): with every token masked out the losses
    would be 0 / 0, and the step's scale counts the micro-batches that hold samples."""
    from megatron.core.transformer.moe.router import TopKRouter
    configs = {id(m.config): m.config for m in model.modules() if isinstance(m, TopKRouter)}
    saved = {k: (c.moe_aux_loss_coeff, c.moe_z_loss_coeff) for k, c in configs.items()}
    for c in configs.values():
        c.moe_aux_loss_coeff, c.moe_z_loss_coeff = 0.0, None
    try:
        yield
    finally:
        for k, c in configs.items():
            c.moe_aux_loss_coeff, c.moe_z_loss_coeff = saved[k]
