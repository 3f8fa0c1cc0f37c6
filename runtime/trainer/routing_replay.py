"""Rollout routing replay (R3) in the trainer: each MoE layer routes a token to the experts the rollout engine
recorded for it (``rollout.routing_replay``), not to its own top-k.

On megatron-core's router replay (``moe_enable_routing_replay``, megatron/core/transformer/moe/router_replay.py):
in ``REPLAY_FORWARD`` a router takes the given top-k indices and gathers its own scores there, so the routing
weights are the trainer's (softmax over the replayed experts' logits with ``norm_topk_prob``) and gradients reach
the router. An activation recompute inside the backward routes again with the same indices: they stay set until
the micro-batch's backward is done (`replaying`), and megatron's ``REPLAY_BACKWARD`` list (for pipeline schedules,
which this trainer does not run) is not used.

Megatron keeps every ``RouterReplay`` in a class-level list (its static setters address "all layers" through it),
so a second model in the process (a rebuilt trainer, a test's) would add its layers to the first's. Each model's
routers are found in its own modules instead (`routers`), and taken off that list when built (`own_routers`).
"""
from __future__ import annotations

import contextlib

import torch


def config_overrides() -> dict:
    """The TransformerConfig field that gives each router a replay slot (inert while none is set)."""
    return {"moe_enable_routing_replay": True}


def routers(model) -> list:
    """The model's ``RouterReplay`` slots in layer order (empty for a model built without them)."""
    return [m.router_replay for m in model.modules() if getattr(m, "router_replay", None) is not None]


def own_routers(model) -> None:
    """Take the model's replay slots off megatron's class-level list: this model addresses its own."""
    from megatron.core.transformer.moe.router_replay import RouterReplay
    mine = {id(r) for r in routers(model)}
    RouterReplay.global_router_replay_instances[:] = [
        r for r in RouterReplay.global_router_replay_instances if id(r) not in mine]


@contextlib.contextmanager
def replaying(model, routes: torch.Tensor | None):
    """Within: the model's MoE layers route by ``routes`` [layers, tokens, k] (megatron's token order, s-major
    over [s, b]: `runtime.trainer.batch`); None: they route themselves."""
    if routes is None:
        yield
        return
    from megatron.core.transformer.moe.router_replay import RouterReplayAction
    slots = routers(model)
    if len(slots) != routes.shape[0]:
        raise ValueError(f"routing replay: the samples carry routes for {routes.shape[0]} MoE layers, the model has "
                         f"{len(slots)} (built without moe_enable_routing_replay?)")
    for slot, layer in zip(slots, routes):
        slot.set_target_indices(layer)
        slot.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    try:
        yield
    finally:
        for slot in slots:
            slot.clear_indices()
            slot.clear_router_replay_action()
