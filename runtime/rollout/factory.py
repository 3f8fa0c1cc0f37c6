"""Pick the rollout engine a config names."""
from __future__ import annotations

from ..config import GrpoConfig


def make_engine(*, cfg: GrpoConfig, model_dir: str, device: str, dtype: str):
    import torch
    if cfg.rollout.engine == "sglang":
        from .sglang import SGLangEngine
        return SGLangEngine(cfg=cfg, model_dir=model_dir)
    from .builtin import BuiltinEngine
    return BuiltinEngine(model_dir, device=device, dtype={"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype],
                         max_batch_size=max(cfg.samples_per_rollout, 1))
