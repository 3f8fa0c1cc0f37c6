"""Pick the rollout engine a config names."""
from __future__ import annotations

from runtime.config import GrpoConfig
from runtime.devices import DTYPES


def make_engine(*, cfg: GrpoConfig, model_dir: str, device: str, dtype: str, shared_base: dict | None = None,
                expert_shard=None):
    """shared_base: the trainer's frozen base tensors, for a built-in engine in its process (LoRA at TP 1).
    expert_shard: this built-in engine's place in a replica split by its experts (`expert_shards.ShardSpec`)."""
    if cfg.rollout.engine == "sglang":
        from runtime.rollout.sglang import SGLangEngine
        return SGLangEngine.from_config(cfg, model_dir)
    from runtime.rollout.builtin import BuiltinEngine
    return BuiltinEngine(model_dir, device=device, dtype=DTYPES[dtype], max_batch_size=max(cfg.samples_per_rollout, 1),
                         decode_path=cfg.rollout.decode_path, kv_cache_gb=cfg.rollout.kv_cache_gb,
                         sync_every=cfg.rollout.sync_every, gpu_memory_gb=cfg.cluster.gpu_memory_gb,
                         deterministic=cfg.rollout.deterministic, weights_dtype=cfg.rollout.weights_dtype,
                         lora=cfg.train.lora if cfg.train.lora.enabled else None, shared_base=shared_base,
                         routing_replay=cfg.rollout.routing_replay, cascade_attention=cfg.rollout.cascade_attention,
                         true_on_policy=cfg.rollout.true_on_policy, expert_shard=expert_shard)
