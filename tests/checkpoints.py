"""torch_dist checkpoints read back in tests, layout-free (whole tensors), without megatron."""
from __future__ import annotations

import re
from pathlib import Path

import torch


def checkpoint_tensors(path, scratch: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint at ``path`` (converted through a file in ``scratch``)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    out = Path(scratch) / f"{abs(hash(str(path)))}.pt"
    dcp_to_torch_save(str(path), str(out))
    return {k: v for k, v in torch.load(out, weights_only=False).items() if torch.is_tensor(v)}


def fp32_masters(path, scratch: Path) -> dict[str, torch.Tensor]:
    """The optimizer's fp32 master weights of a checkpoint, by key (under expert parallelism each of megatron's
    chained optimizers' keys start with ``chained_<i>.``)."""
    return {k: v for k, v in checkpoint_tensors(path, scratch).items()
            if re.match(r"(chained_\d+\.)?optimizer\.state\.fp32_param\.", k)}
