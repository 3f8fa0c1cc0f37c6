"""The optimizer's part of a trainer checkpoint, in one format whatever the optimizer's layout.

On disk it is megatron's non-distributed (replicated) optimizer format, the one every checkpoint
written before ``train.distributed_optimizer`` existed has: for each model tensor ``<key>`` (its
torch_dist key, TP-sharded like the weight), ``optimizer.state.exp_avg.<key>`` and
``optimizer.state.exp_avg_sq.<key>``, plus ``optimizer.state.fp32_param.<key>`` (the fp32 master)
when the weights are bf16; in the common part, Adam's step (``common_step``) and the param groups'
hyper-parameters. Nothing in it depends on the data-parallel size, so a checkpoint written at DP=2
with the distributed optimizer loads at DP=1 without it, and the other way round.

* Non-distributed optimizer: megatron's own ``sharded_state_dict`` / ``load_state_dict`` (unchanged, so
  old checkpoints and exact resume stay bitwise).
* Distributed optimizer (master weights and Adam moments sharded over the DP ranks): megatron-core
  0.16's own formats do not fit. ``fully_reshardable`` gathers the whole state on every DP rank (or on
  DP rank 0) at every save and loads all of it on every rank, and names the master ``param``;
  ``dp_reshardable`` is tied to the bucket layout; ``fully_sharded_model_space`` saves ``flattened_range``
  slices, which 0.16's torch_dist strategy no longer writes (``mcore_to_pyt_state_dict`` asserts
  ``flattened_range is None``). So this module writes the replicated format itself:

  - save: each model tensor's state is written by one DP rank, the one holding the largest part of it
    (so most tensors are written where they live; replica_id's DP coordinate set to 0 there, the key
    left out on the others); the other DP ranks' pieces of a tensor that straddles a shard boundary are
    sent to it point to point. No rank holds more than its shard plus the straddling tensors.
  - load: each rank reads the whole (TP-local) tensors it has a piece of, and keeps its slice.

  Resharding is exact: a state saved at one DP size and loaded at another is bitwise the saved state.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

_MOMENTS = ("exp_avg", "exp_avg_sq")


def inner_optimizers(optimizer) -> list:
    """The megatron optimizers inside the trainer's ChainedOptimizer: one, or under expert parallelism the dense
    parameters' and the experts' (megatron gives the experts their own, over the expert-data-parallel group)."""
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def is_distributed(optimizer) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    return isinstance(inner_optimizers(optimizer)[0], DistributedOptimizer)


def sharded_state_dict(optimizer, model, model_sharded_state_dict, is_loading: bool = False) -> dict:
    """The optimizer's sharded state dict for ``dist_checkpointing.save``/``load`` (format: module doc). Under expert
    parallelism megatron's chained layout: the common part (steps, groups) per optimizer, by its index."""
    if not is_distributed(optimizer):
        return optimizer.sharded_state_dict(model_sharded_state_dict, is_loading=is_loading)
    from megatron.core.dist_checkpointing.utils import add_prefix_for_sharding
    layouts = [_DistLayout(opt, model, model_sharded_state_dict) for opt in inner_optimizers(optimizer)]
    if len(layouts) == 1:
        return layouts[0].state_dict(is_loading)
    out = {}
    for i, layout in enumerate(layouts):  # keyed as megatron's ChainedOptimizer keys the replicated ones
        out[i] = layout.state_dict(is_loading)
        add_prefix_for_sharding(out[i], f"chained_{i}.")
    return out


def load_state_dict(optimizer, model, model_sharded_state_dict, loaded: dict) -> None:
    """Put what ``dist_checkpointing.load`` returned for :func:`sharded_state_dict` into the optimizer."""
    if not is_distributed(optimizer):
        optimizer.load_state_dict(loaded)
        return
    opts = inner_optimizers(optimizer)
    for i, opt in enumerate(opts):
        _DistLayout(opt, model, model_sharded_state_dict).load(loaded if len(opts) == 1 else loaded[i])


class _DistLayout:
    """A DistributedOptimizer seen as the replicated optimizer's state dict (module doc)."""

    def __init__(self, opt, model, model_sharded_state_dict):
        from megatron.core.dist_checkpointing.dict_utils import nested_values
        from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories

        self.opt = opt
        self.group = opt.data_parallel_group
        self.dp_rank, self.dp_size = self.group.rank(), self.group.size()
        mine = {id(p) for p in opt.model_param_group_index_map}  # this optimizer's (dense or expert) parameters
        self.params = [(n, p) for n, p in model.named_parameters() if p.requires_grad and id(p) in mine]
        # the weights' own sharding metadata (``data`` is the parameter itself)
        sharded, _ = extract_sharded_tensors_and_factories(model_sharded_state_dict)
        by_tensor = {id(sh.data): sh for sh in nested_values(sharded)}
        missing = [n for n, p in self.params if id(p) not in by_tensor]
        if missing:
            raise ValueError(f"parameters without sharded metadata: {missing[:3]}")
        self.meta = {n: by_tensor[id(p)] for n, p in self.params}
        # this rank's piece of every parameter: [start, end) of the flattened (TP-local) tensor
        self.local: dict[str, tuple[int, int]] = {}
        name_of = {id(p): n for n, p in self.params}
        for gbuf_range_maps in opt.gbuf_ranges:
            for per_bucket in gbuf_range_maps.values():
                for gbuf_range_map in per_bucket:
                    for p, ranges in gbuf_range_map["param_map"].items():
                        r = ranges["param"]
                        if r.end > r.start:
                            self.local[name_of[id(p)]] = (r.start, r.end)
        self.param = dict(self.params)
        # separate fp32 masters exist for bf16 weights; fp32 weights are their own master (the
        # optimizer's shard is a view of the weight, saved and loaded with the model)
        self.has_master = any(p.dtype != torch.float32 for _, p in self.params)

    # -- the optimizer's tensors -------------------------------------------------------------------
    def _tensors(self, name: str) -> dict[str, torch.Tensor]:
        """This rank's shard of the parameter's main param and Adam state (live tensors)."""
        gi, go = self.opt.model_param_group_index_map[self.param[name]]
        main = self.opt.optimizer.param_groups[gi]["params"][go]
        return {"param": main, **self.opt.optimizer.state[main]}

    def _step(self):
        steps = {float(s["step"]) for s in self.opt.optimizer.state.values() if "step" in s}
        if len(steps) > 1:
            raise ValueError(f"Adam's step differs between parameters: {sorted(steps)}")
        return torch.tensor(steps.pop(), dtype=torch.float32) if steps else None

    def _keys(self, stepped: bool) -> list[str]:
        return (list(_MOMENTS) if stepped else []) + (["fp32_param"] if self.has_master else [])

    def _param_groups(self) -> list[dict]:
        from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject
        return [{**{k: v for k, v in g.items() if k != "params"}, "params": LocalNonpersistentObject([])}
                for g in self.opt.optimizer.param_groups]

    def _layout(self, state: dict, fp32: list) -> dict:
        """The replicated optimizer's nesting: FP32Optimizer's for fp32 weights, the mixed-precision one's
        (``optimizer`` + ``fp32_from_fp16_params``) for bf16 weights. Only the common part (step, groups)
        is matched by position on load; tensors are matched by key."""
        inner = {"state": state, "param_groups": self._param_groups()}
        return {"optimizer": inner, "fp32_from_fp16_params": [fp32]} if self.has_master else inner

    # -- save / load -------------------------------------------------------------------------------
    def _owners(self) -> tuple[list[dict[str, tuple[int, int]]], dict[str, int]]:
        """Every DP rank's pieces, and for each parameter the DP rank that writes (and, loading, is the
        main replica of) its state: the one with the largest piece, the lowest of equals."""
        every: list = [None] * self.dp_size
        dist.all_gather_object(every, self.local, group=self.group)
        owners = {}
        for name, _ in self.params:
            held = {r: pc[name] for r, pc in enumerate(every) if name in pc}
            owners[name] = max(held, key=lambda r: (held[r][1] - held[r][0], -r))
        return every, owners

    def _meta(self, name: str, main: bool):
        """The weight's sharding metadata with the DP coordinate of its replica_id set: 0 where this rank
        is the one that writes/reads it as the main replica, 1 elsewhere."""
        from dataclasses import replace
        meta = self.meta[name]
        rid = meta.replica_id
        if not (isinstance(rid, tuple) and len(rid) == 3):
            raise ValueError(f"expected a (PP, TP, DP) replica_id for {name}, got {rid!r}")
        return replace(meta, replica_id=(*rid[:2], 0 if main else 1))

    def state_dict(self, is_loading: bool) -> dict:
        from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor

        step = self._step()
        if is_loading:
            return self._load_request()
        keys = self._keys(step is not None)
        pieces, owners = self._owners()
        ranks = dist.get_process_group_ranks(self.group)
        state: dict[Any, Any] = {}
        fp32 = []
        for i, (name, p) in enumerate(self.params):
            held = {r: pc[name] for r, pc in enumerate(pieces) if name in pc}
            owner = owners[name]
            full = self._gather(name, p, held, owner, keys, ranks)
            if owner != self.dp_rank:  # the key is left out here: the owner writes it
                continue
            meta = self._meta(name, main=True)
            entry = {}
            for key in keys:
                sh = make_sharded_optimizer_tensor(meta, full[key].view(p.shape), prefix=f"optimizer.state.{key}")
                if key == "fp32_param":
                    fp32.append(sh)
                else:
                    entry[key] = sh
            if entry:
                state[i] = entry
        if step is not None:
            state["common_step"] = step
        return self._layout(state, fp32)

    def _gather(self, name, p, held, owner, keys, ranks) -> dict[str, torch.Tensor]:
        """On the owner: the whole (TP-local, flattened) tensor of each key, on the CPU; {} elsewhere."""
        mine = self.local.get(name)
        out: dict[str, torch.Tensor] = {}
        for key in keys:
            src = "param" if key == "fp32_param" else key
            if self.dp_rank == owner:
                full = torch.empty(p.numel(), dtype=torch.float32)
                for r, (s, e) in sorted(held.items()):
                    if r == self.dp_rank:
                        full[s:e].copy_(self._tensors(name)[src].detach().reshape(-1))
                    else:
                        buf = torch.empty(e - s, dtype=torch.float32, device=p.device)
                        dist.recv(buf, src=ranks[r], group=self.group)
                        full[s:e].copy_(buf)
                out[key] = full
            elif mine is not None:  # from the device the weights are on (the state may be on the host)
                dist.send(self._tensors(name)[src].detach().reshape(-1).float().contiguous().to(p.device),
                          dst=ranks[owner], group=self.group)
        return out

    def _load_request(self) -> dict:
        """Whole tensors for the parameters this rank has a piece of (the others' keys are not read)."""
        from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor
        _, owners = self._owners()
        state: dict[Any, Any] = {}
        fp32 = []
        for i, (name, p) in enumerate(self.params):
            if name not in self.local:
                continue
            entry = {}
            # megatron checks that the main replicas of a load cover every tensor exactly once
            meta = self._meta(name, main=owners[name] == self.dp_rank)
            for key in self._keys(True):
                sh = make_sharded_optimizer_tensor(meta, torch.empty(p.shape, dtype=torch.float32),
                                                   prefix=f"optimizer.state.{key}")
                if key == "fp32_param":
                    fp32.append(sh)
                else:
                    entry[key] = sh
            state[i] = entry
        return self._layout(state, fp32)

    @torch.no_grad()
    def load(self, loaded: dict) -> None:
        inner = loaded["optimizer"] if self.has_master else loaded
        fp32 = iter(loaded["fp32_from_fp16_params"][0]) if self.has_master else None
        step = inner["state"].get("common_step")
        opt = self.opt.optimizer
        if step is not None:
            self.opt.init_state_fn(opt, self.opt.config)  # allocates Adam's moments if the state is empty
        for i, (name, p) in enumerate(self.params):
            if name not in self.local:
                continue
            s, e = self.local[name]
            live = self._tensors(name)
            saved = dict(inner["state"].get(i, {}))
            if fp32 is not None:
                saved["param"] = next(fp32)
            for key, t in saved.items():
                if key in _MOMENTS and step is None:
                    continue
                live[key].copy_(t.reshape(-1)[s:e])
            if step is not None:
                opt.state[live["param"]]["step"] = step.clone().to(torch.float32)
        _load_group_hyperparameters(opt.param_groups, inner.get("param_groups", []))


def _load_group_hyperparameters(groups: list[dict], saved: list[dict]) -> None:
    """Saved groups' hyper-parameters onto the live groups, matched as megatron matches them."""
    from megatron.core.optimizer.optimizer import param_group_identifier_keys as keys
    by_id = {tuple(g.get(k) for k in keys): g for g in saved}
    for g in groups:
        src = by_id.get(tuple(g.get(k) for k in keys))
        if src is not None:
            g.update({k: v for k, v in src.items() if k != "params"})
