"""What happens at an eval point after the evaluation: log it, export the checkpoint to HF, register it as a
model version (idempotent: the same checkpoint gives the same version), then apply the registry's retention
(``tracking.keep_exports``) to this run's older versions."""
from __future__ import annotations

from runtime.config import GrpoConfig
from runtime.run.directory import RunDir
from runtime.run.stages import inputs_hash


class LazyTracker:
    """The run's MLflow tracker, attached on first use (inside a retried step, so an outage is retried)."""

    def __init__(self, cfg: GrpoConfig, rd: RunDir):
        self.cfg, self.rd, self._tracker = cfg, rd, None

    def get(self):
        if self._tracker is None:
            from runtime.tracking.mlflow_tracker import Tracker
            self._tracker = Tracker(self.cfg, self.rd)
        return self._tracker


def register_eval_point(cfg: GrpoConfig, rd: RunDir, tracker, rollout: int, results: dict) -> dict | None:
    from runtime.devices import resolve_device, resolve_dtype
    from runtime.grpo.evaluation import numeric_metrics
    from runtime.tracking.export_retention import prune_exports
    from runtime.tracking.mlflow_tracker import mlflow_errors
    from runtime.tracking.model_registry import (checkpoint_tag, export_checkpoint, find_checkpoint_version,
                                                 register_checkpoint)
    tracker.log_eval(rollout, results)
    if rollout == 0 or not tracker.enabled:
        return None  # the untrained model is the fetched one: nothing new to register
    name = cfg.tracking.registered_model or cfg.name
    with mlflow_errors(tracker.uri, f"look up {name} {checkpoint_tag(rd.run_id, rollout)}"):
        registered = find_checkpoint_version(tracker.client, name, checkpoint_tag(rd.run_id, rollout))
    # A registered checkpoint (a resumed run passes its eval points again) is not exported again: its export
    # is there, or retention removed it on purpose (and the checkpoint may be gone too).
    export = {"path": rd.export(rollout)} if registered is not None else export_checkpoint(
        rd, rollout, dtype=resolve_dtype(cfg, resolve_device(cfg)))
    metrics = {f"eval/{s}/{k}": v for s, res in results.items() for k, v in numeric_metrics(res).items()}
    first = next(iter(cfg.data.eval))
    info = register_checkpoint(
        tracker, name=name, export_uri=export["path"], rollout=rollout,
        run_id=rd.run_id, metrics=metrics, config_hash=inputs_hash(cfg.model_dump(mode="json")),
        primary_metric=f"eval/{first}/avg@{cfg.eval.n_samples_per_prompt}",
        weights=export.get("weights", "full"), adapter_uri=export.get("adapter"), run_root=rd.root)
    with mlflow_errors(tracker.uri, f"registry retention of {name}"):
        info["exports_removed"] = prune_exports(tracker.client, tracking_uri=tracker.uri, name=name, rd=rd,
                                                keep=cfg.tracking.keep_exports, mlflow_run_id=tracker.run_id)
    return info
