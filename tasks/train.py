"""The train stage's steps as Prefect tasks with retries; the loop itself is runtime/grpo/loop.py."""
from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from runtime.config import GrpoConfig
from runtime.grpo.loop import train_stage_loop
from runtime.grpo.preflight import check_trainable
from runtime.grpo.registration import LazyTracker, register_eval_point
from runtime.grpo.session import TrainSession
from runtime.run.directory import RunDir
from runtime.tracking.progress_table import RolloutTable

from tasks.common import RETRIES, masked_errors, retry_delay_s, retry_on_transient

# No Prefect cache: whether a chunk, eval or registration is done is read from the run directory.
_retrying = dict(retries=RETRIES, retry_delay_seconds=retry_delay_s(), retry_condition_fn=retry_on_transient,
                 cache_policy=NO_CACHE)


@task(name="start-session", **_retrying)
@masked_errors
def start_session(cfg: GrpoConfig, rd: RunDir) -> TrainSession:
    return TrainSession(cfg, rd)  # a Ray cluster that times out starting up is tried again


@task(name="train-chunk", task_run_name="train-chunk-{start}-{end}", **_retrying)
@masked_errors
def train_chunk(session: TrainSession, start: int, end: int, table: RolloutTable) -> dict:
    return session.run_chunk(start, end, on_rollout=table.row)


@task(name="log-metrics", task_run_name="log-metrics-{end}", **_retrying)
@masked_errors
def log_metrics_task(tracking: LazyTracker, metrics: list[dict], end: int) -> int:
    return tracking.get().log_rollout_metrics(metrics)  # steps already logged are skipped


@task(name="evaluate", task_run_name="evaluate-{rollout}", **_retrying)
@masked_errors
def evaluate_task(session: TrainSession, rollout: int) -> dict:
    return session.evaluate(rollout)


@task(name="register", task_run_name="register-{rollout}", **_retrying)
@masked_errors
def register_task(cfg: GrpoConfig, rd: RunDir, tracking: LazyTracker, rollout: int, results: dict) -> dict | None:
    return register_eval_point(cfg, rd, tracking.get(), rollout, results)


class _PrefectSteps:
    def __init__(self, cfg: GrpoConfig, rd: RunDir, session: TrainSession, tracking: LazyTracker):
        self.cfg, self.rd, self.session, self.tracking = cfg, rd, session, tracking
        self.table = RolloutTable(total=cfg.train.num_rollout)  # rollout i/N and an ETA

    def chunk(self, start: int, end: int) -> dict:
        return train_chunk(self.session, start, end, self.table)

    def log_metrics(self, metrics: list[dict], end: int) -> None:
        log_metrics_task(self.tracking, metrics, end)

    def evaluate(self, rollout: int) -> dict:
        return evaluate_task(self.session, rollout)

    def register(self, rollout: int, results: dict) -> dict | None:
        self.session.wait_durable(rollout)  # only a durable checkpoint is registered (its export reads it)
        return register_task(self.cfg, self.rd, self.tracking, rollout, results)

    def finish(self) -> None:
        self.session.wait_durable()  # the last checkpoint durable before the run is marked finished
        self.tracking.get().finish()


def train_stage(cfg: GrpoConfig, rd: RunDir, converted: dict, prepared: dict) -> dict:
    check_trainable(cfg)
    tracking = LazyTracker(cfg, rd)
    session = start_session(cfg, rd)
    try:
        result = train_stage_loop(cfg, _PrefectSteps(cfg, rd, session, tracking))
    finally:
        session.close()
    tracker = tracking.get()
    return {**result, "checkpoint": rd.checkpoint(cfg.train.num_rollout), "actor_builds": session.builds,
            "mlflow_run_id": tracker.run_id, "tracking_uri": tracker.uri}
