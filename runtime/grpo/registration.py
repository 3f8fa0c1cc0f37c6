"""What happens at an eval point after the evaluation: log it, export the checkpoint to HF, and
register it as a model version (idempotent: the same checkpoint gives the same version)."""
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
    from runtime.grpo.evaluation import numeric_metrics
    from runtime.tracking.model_registry import export_checkpoint, register_checkpoint
    tracker.log_eval(rollout, results)
    if rollout == 0 or not tracker.enabled:
        return None  # the untrained model is the fetched one: nothing new to register
    export = export_checkpoint(rd, rollout)
    metrics = {f"eval/{name}/{k}": v for name, res in results.items() for k, v in numeric_metrics(res).items()}
    first = next(iter(cfg.data.eval))
    return register_checkpoint(
        tracker, name=cfg.tracking.registered_model or cfg.name, export_uri=export["path"], rollout=rollout,
        run_id=rd.run_id, metrics=metrics, config_hash=inputs_hash(cfg.model_dump(mode="json")),
        primary_metric=f"eval/{first}/avg@{cfg.eval.n_samples_per_prompt}",
        weights=export.get("weights", "full"), adapter_uri=export.get("adapter"))
