"""A trainer checkpoint holds no copy of the weights their fp32 master determines: 12 bytes a bf16 parameter, not 14.

Megatron's mixed-precision optimizers keep every half-precision trained weight equal to its fp32 master rounded:
the master starts as the weight widened (exact), and every step ends by copying the master into the weight
(``_copy_main_params_to_model_params``: a cast, round to nearest even; the host optimizer rounds the same way,
runtime/trainer/host_optimizer.py). A checkpoint holds the master (``optimizer.state.fp32_param.<key>``,
runtime/trainer/optimizer_checkpoint.py), so the weight beside it is redundant. The trainer's save leaves those
weights out (:func:`split`) and marks the checkpoint (:data:`MARKER`, the weights' dtype); its load takes the
masters and rebuilds the weights from them as a step does (:func:`rebuild`), so a resumed run is bitwise the
unbroken one. An export reads the masters rounded to the marked dtype (:func:`read_weights`): the bytes it wrote
from the weights before. What the masters do not determine stays in the checkpoint's model part: fp32 weights
(their own master: an fp32 run's checkpoint is unchanged), megatron's ``_extra_state`` objects.

A checkpoint without the marker (written before, or by an fp32 run) holds its weights and loads as it did.
"""
from __future__ import annotations

import json
import os

import torch

MARKER = "weights_from_master.json"  # in a checkpoint's model dir: its half-precision weights are their masters
MASTER_PREFIX = "optimizer.state.fp32_param"
_HALF = (torch.bfloat16, torch.float16)


def master_backed(optimizer, model) -> set[int]:
    """``id`` of every weight the optimizer keeps an fp32 master of: the half-precision trained weights under a
    mixed-precision optimizer (megatron's condition); none with fp32 weights."""
    from megatron.core.optimizer.optimizer import MixedPrecisionOptimizer

    from runtime.trainer.optimizer_checkpoint import inner_optimizers
    if not isinstance(inner_optimizers(optimizer)[0], MixedPrecisionOptimizer):
        return set()
    return {id(p) for p in model.parameters() if p.requires_grad and p.dtype in _HALF}


def split(model_sharded_state_dict: dict, backed: set[int]) -> tuple[dict, dict]:
    """(what a checkpoint keeps of the model, the weights left to their masters): entries whose tensor is a
    weight in ``backed`` go to the second."""
    kept, left = {}, {}
    for key, entry in model_sharded_state_dict.items():
        (left if id(getattr(entry, "data", None)) in backed else kept)[key] = entry
    return kept, left


def write_marker(model_dir: str, left: dict) -> None:
    """Mark a checkpoint whose weights ``left`` (:func:`split`) are their masters, with those weights' dtype."""
    from runtime.storage import write_json_atomic
    dtypes = {entry.data.dtype for entry in left.values()}
    if len(dtypes) != 1:
        raise ValueError(f"weights left to their masters in more than one dtype: {sorted(map(str, dtypes))}")
    write_json_atomic(os.path.join(model_dir, MARKER),
                      {"weights": MASTER_PREFIX, "dtype": str(dtypes.pop()).removeprefix("torch.")})


def marked_dtype(model_dir: str) -> torch.dtype | None:
    """The dtype of a checkpoint's weights when they are their masters rounded (:data:`MARKER`); None when it
    holds them."""
    path = os.path.join(str(model_dir), MARKER)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return getattr(torch, json.load(f)["dtype"])


@torch.no_grad()
def rebuild(optimizer) -> None:
    """Every master-backed weight := its (loaded) master rounded, as the optimizer's step leaves it. Collective
    under the distributed optimizer (each rank holds a shard of the masters: megatron's all-gather after a step)."""
    from runtime.trainer.optimizer_checkpoint import inner_optimizers, is_distributed
    opts = inner_optimizers(optimizer)  # the experts' own too, under expert parallelism
    if is_distributed(optimizer):
        for opt in opts:
            opt._copy_main_params_to_model_params()  # this rank's shard of each weight, into DDP's parameter buffer
        for chunk in opts[0].model_chunks:
            chunk.start_param_sync()  # synchronous without overlap_param_gather, as the step runs it (every buffer)
        return
    for opt in opts:
        weights, masters = opt._get_model_and_main_params_data_float16()
        if all(w.device == m.device for w, m in zip(weights, masters)):
            opt._copy_main_params_to_model_params()
        else:  # the host optimizer's masters beside GPU weights: its own rounding (a cast on copy)
            for w, m in zip(weights, masters):
                w.copy_(m)


def read_weights(sharded: dict, model_dir: str, dtype: torch.dtype) -> dict:
    """``dist_checkpointing.load`` of ``sharded`` (a model's sharded state dict, or LoRA's adapters') from a marked
    checkpoint: every weight its master rounded to ``dtype`` (the trainer's weights, bitwise), on the host; the
    other entries as stored."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
    from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor

    weights = {k for k, v in sharded.items() if isinstance(v, (ShardedTensor, ShardedTensorFactory))}
    prefix = _master_prefixes(model_dir)
    request = {k: make_sharded_optimizer_tensor(v, torch.empty(v.data.shape, dtype=torch.float32), prefix(v.key))
               if k in weights else v for k, v in sharded.items()}
    # under "model", as a trainer saved it: the common state (optimizer groups, schedule) comes back beside it
    loaded = dist_checkpointing.load({"model": request}, str(model_dir))["model"]
    return {k: v.to(dtype) if k in weights else v for k, v in loaded.items()}


def _master_prefixes(model_dir: str):
    """``key -> the prefix its master is stored under``: ``optimizer.state.fp32_param``, or under expert parallelism
    ``chained_<i>.optimizer.state.fp32_param`` (megatron's chained optimizers: the dense parameters' and the
    experts'), as the checkpoint's own keys say."""
    from torch.distributed.checkpoint import FileSystemReader
    stored = list(FileSystemReader(str(model_dir)).read_metadata().state_dict_metadata)
    chained = sorted({k.split(".", 1)[0] for k in stored if k.startswith("chained_")})
    candidates = [MASTER_PREFIX] + [f"{c}.{MASTER_PREFIX}" for c in chained]

    def prefix(key: str) -> str:
        return next((p for p in candidates if any(k.startswith(f"{p}.{key}") for k in stored)), MASTER_PREFIX)
    return prefix
