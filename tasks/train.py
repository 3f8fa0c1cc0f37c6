"""The train stage: one Prefect task per chunk of `checkpoint.interval` rollouts over live actors,
then evaluate and register at every eval point."""
from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from runtime.config import GrpoConfig
from runtime.grpo.session import TrainSession, check_trainable
from runtime.tracking.progress_table import RolloutTable
from runtime.run.directory import RunDir
from runtime.run.stages import inputs_hash

from tasks.common import RETRIES, retry_delay_s, retry_on_transient

_retrying = dict(retries=RETRIES, retry_delay_seconds=retry_delay_s(), retry_condition_fn=retry_on_transient,
                 cache_policy=NO_CACHE)


@task(name="train-chunk", task_run_name="train-chunk-{start}-{end}", **_retrying)
def train_chunk(session: TrainSession, start: int, end: int, table: RolloutTable) -> dict:
    # No Prefect cache here: whether a chunk is done is read from the run directory's checkpoints.
    return session.run_chunk(start, end, on_rollout=table.row)


@task(name="evaluate", task_run_name="evaluate-{rollout}", **_retrying)
def evaluate_task(session: TrainSession, rollout: int) -> dict:
    return session.evaluate(rollout)


class LazyTracker:
    """The run's MLflow tracker, attached on first use inside a task, so an MLflow outage is retried."""

    def __init__(self, cfg: GrpoConfig, rd: RunDir):
        self.cfg, self.rd, self._tracker = cfg, rd, None

    def get(self):
        if self._tracker is None:
            from runtime.tracking.mlflow_tracker import Tracker
            self._tracker = Tracker(self.cfg, self.rd)
        return self._tracker


@task(name="log-metrics", task_run_name="log-metrics-{end}", **_retrying)
def log_metrics_task(tracking: LazyTracker, metrics: list[dict], end: int) -> int:
    return tracking.get().log_rollout_metrics(metrics)  # steps already logged are skipped


@task(name="register", task_run_name="register-{rollout}", **_retrying)
def register_task(cfg: GrpoConfig, rd: RunDir, tracking: LazyTracker, rollout: int, results: dict) -> dict | None:
    from runtime.grpo.evaluation import numeric_metrics
    from runtime.tracking.model_registry import export_checkpoint, register_checkpoint
    tracker = tracking.get()
    tracker.log_eval(rollout, results)
    if rollout == 0 or not tracker.enabled:
        return None  # the untrained model is the fetched one: nothing new to register
    export = export_checkpoint(rd, rollout)
    metrics = {f"eval/{name}/{k}": v for name, res in results.items() for k, v in numeric_metrics(res).items()}
    first = next(iter(cfg.data.eval))
    return register_checkpoint(
        tracker, name=cfg.tracking.registered_model or cfg.name, export_uri=export["path"], rollout=rollout,
        run_id=rd.run_id, metrics=metrics, config_hash=inputs_hash(cfg.model_dump(mode="json")),
        primary_metric=f"eval/{first}/avg@{cfg.eval.n_samples_per_prompt}")


def train_stage(cfg: GrpoConfig, rd: RunDir, converted: dict, prepared: dict) -> dict:
    check_trainable(cfg)
    tracking = LazyTracker(cfg, rd)
    session = TrainSession(cfg, rd)
    table = RolloutTable()
    eval_points = set(cfg.eval_points()) if cfg.data.eval else set()
    chunks, evals, versions = [], {}, {}

    def eval_and_register(rollout: int) -> None:
        evals[rollout] = evaluate_task(session, rollout)
        versions[rollout] = register_task(cfg, rd, tracking, rollout, evals[rollout])

    try:
        if 0 in eval_points:
            eval_and_register(0)
        for start, end in cfg.chunk_bounds():
            chunk = train_chunk(session, start, end, table)
            log_metrics_task(tracking, chunk["metrics"], end)
            chunks.append(chunk)
            if end in eval_points:
                eval_and_register(end)
        tracking.get().finish()
    finally:
        session.close()
    done = [c for c in chunks if not c["skipped"]]
    last = [m for c in chunks for m in c["metrics"]][-1:] or [{}]
    summary = (f"{cfg.train.num_rollout} rollouts in {len(chunks)} chunks ({len(chunks) - len(done)} skipped); "
               f"final reward_mean {last[0].get('reward_mean', float('nan')):.3f}")
    return {"status": "done" if done else "skipped (done before)", "summary": summary, "chunks": chunks,
            "evals": evals, "versions": versions, "checkpoint": rd.checkpoint(cfg.train.num_rollout),
            "actor_builds": session.builds, "mlflow_run_id": tracking.get().run_id, "tracking_uri": tracking.get().uri}
