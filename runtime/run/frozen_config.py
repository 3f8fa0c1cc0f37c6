"""Opening a run: its directory, its frozen config, and what may change when it is resumed."""
from __future__ import annotations

import yaml

from runtime import storage
from runtime.config import GrpoConfig, apply_overrides, config_from_dict, dump_config
from runtime.errors import ConfigError
from runtime.run.directory import RunDir

# A resumed run may be extended or re-evaluated; anything that changes what was already trained may not.
RESUMABLE_CHANGES = {"train.num_rollout", "eval.interval", "eval.before_train", "tracking.uri",
                     "tracking.enabled", "cluster.address", "cluster.backend", "cluster.num_cpus",
                     "cluster.placement_timeout_s", "checkpoint.keep_last", "storage.state_dir"}


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


def freeze(cfg: GrpoConfig, rd: RunDir) -> None:
    """Write the run's frozen config; an existing run may only change what RESUMABLE_CHANGES allows."""
    if storage.exists(rd.config):
        old = frozen_config(rd)
        bad = [f for f in changed_fields(old, cfg)
               if f not in RESUMABLE_CHANGES and not f.startswith("eval.") and f != "name"]
        if bad:
            raise ConfigError(
                f"run '{rd.run_id}' already exists with a different {', '.join(bad)}; "
                f"resume it with `grpoflow resume {rd.run_id}` or pick another --run-id")
    storage.write_text_atomic(rd.config, dump_config(cfg))


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
