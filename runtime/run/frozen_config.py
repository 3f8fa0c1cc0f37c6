"""Opening a run: its directory, its frozen config, and what may change when it is resumed."""
from __future__ import annotations

import yaml

from runtime import storage
from runtime.config import GrpoConfig, apply_overrides, config_from_dict, dump_config
from runtime.errors import ConfigError
from runtime.run.directory import RunDir

# A resumed run may be extended or re-evaluated; anything that changes what was already trained may not.
# Memory settings that leave every update as it was may change too (resume on another GPU): the KV pool
# (keyed sampling: the same tokens whatever the batching), the target GPU's memory, the state offload
# (a bitwise round trip) and recomputation (bitwise for full and mlp; a few fp32 ulps for the norms').
# Not the micro-batching (train.micro_batch_size, train.max_tokens_per_micro_batch): it changes the
# order in which gradients are summed.
RESUMABLE_CHANGES = {"train.num_rollout", "eval.interval", "eval.before_train", "tracking.uri",
                     "tracking.enabled", "cluster.address", "cluster.backend", "cluster.num_cpus",
                     "cluster.placement_timeout_s", "checkpoint.keep_last", "storage.state_dir",
                     "rollout.kv_cache_gb", "cluster.gpu_memory_gb", "cluster.offload_trainer_state",
                     "train.recompute", "train.recompute_modules", "train.recompute_num_layers"}


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flat(v, key + "."))
        else:
            out[key] = v
    return out


def changed_fields(old: GrpoConfig, new: GrpoConfig) -> list[str]:
    a, b = _flat(old.model_dump(mode="json")), _flat(new.model_dump(mode="json"))
    return sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))


def with_plan_choices(cfg: GrpoConfig) -> GrpoConfig:
    """``cfg`` with what the memory plan chooses for the settings it leaves open (``rollout.kv_cache_gb`` on a
    GPU: runtime/plan/memory.py ``plan_choices``), when the target GPU's memory is known (``cluster.gpu_memory_gb``,
    or this machine's GPU) and the model's config is at hand (local dir, HF cache, or a shipped known config)."""
    from runtime.plan.memory import config_device, plan_choices
    from runtime.plan.summary import model_config_for_plan
    if config_device(cfg) != "cuda" or cfg.rollout.kv_cache_gb is not None:
        return cfg
    gpu = cfg.cluster.gpu_memory_gb
    if gpu is None:
        import torch
        if not torch.cuda.is_available():
            return cfg
        gpu = torch.cuda.get_device_properties(0).total_memory / 2**30
    try:
        hf_config, _ = model_config_for_plan(cfg.model.source)
    except Exception:  # noqa: BLE001 - not at hand before the fetch: the engine sizes its pool itself
        return cfg
    if hf_config is None:
        return cfg
    choices = plan_choices(cfg, hf_config, gpu)
    if not choices:
        return cfg
    tree = cfg.model_dump(mode="json")
    return config_from_dict(apply_overrides(tree, [f"{k}={v}" for k, v in choices.items()]), "plan")


def freeze(cfg: GrpoConfig, rd: RunDir) -> GrpoConfig:
    """Write the run's frozen config, with the memory plan's choices (:func:`with_plan_choices`), and return
    it: the run uses what was frozen. An existing run may only change what RESUMABLE_CHANGES allows."""
    cfg = with_plan_choices(cfg)
    if storage.exists(rd.config):
        old = frozen_config(rd)
        bad = [f for f in changed_fields(old, cfg)
               if f not in RESUMABLE_CHANGES and not f.startswith("eval.") and f != "name"]
        if bad:
            raise ConfigError(
                f"run '{rd.run_id}' already exists with a different {', '.join(bad)}; "
                f"resume it with `grpoflow resume {rd.run_id}` or pick another --run-id")
    storage.write_text_atomic(rd.config, dump_config(cfg))
    return cfg


def frozen_config(rd: RunDir, overrides: list[str] | None = None) -> GrpoConfig:
    if not storage.exists(rd.config):
        raise ConfigError(f"unknown run id '{rd.run_id}': no {rd.config} "
                          f"(list runs under {storage.join(rd.root, 'runs')} or check storage.root / --root)")
    tree = yaml.safe_load(storage.read_text(rd.config)) or {}
    apply_overrides(tree, overrides)
    return config_from_dict(tree, rd.config)


def finished(cfg: GrpoConfig, rd: RunDir) -> bool:
    """Trained to train.num_rollout and evaluated at every eval point (read from the run directory)."""
    from runtime.run import checkpoint
    ck = checkpoint.latest(rd)
    if ck is None or ck.rollout < cfg.train.num_rollout:
        return False
    if cfg.data.eval:
        return all(storage.exists(rd.eval_result(n)) for n in cfg.eval_points())
    return True
