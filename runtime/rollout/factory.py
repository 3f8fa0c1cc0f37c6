"""Pick the rollout engine a config names."""
from __future__ import annotations

from runtime.config import GrpoConfig


def make_engine(*, cfg: GrpoConfig, model_dir: str, device: str, dtype: str):
    import torch
    if cfg.rollout.engine == "sglang":
        from runtime.rollout.sglang import SGLangEngine
        return SGLangEngine(cfg=cfg, model_dir=model_dir)
    from runtime.rollout.builtin import BuiltinEngine
    return BuiltinEngine(model_dir, device=device, dtype={"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype],
                         max_batch_size=max(cfg.samples_per_rollout, 1), decode_path=cfg.rollout.decode_path,
                         kv_cache_gb=cfg.rollout.kv_cache_gb)
