"""The train stage: one Prefect task per chunk of `checkpoint.interval` rollouts, over live actors."""
from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from runtime.config import GrpoConfig
from runtime.grpo import TrainSession, check_trainable
from runtime.progress import RolloutTable
from runtime.rundir import RunDir

from .common import RETRIES, retry_delay_s, retry_on_transient


@task(name="train-chunk", cache_policy=NO_CACHE, retries=RETRIES, retry_delay_seconds=retry_delay_s(), retry_condition_fn=retry_on_transient,
      task_run_name="train-chunk-{start}-{end}")
def train_chunk(session: TrainSession, start: int, end: int, table: RolloutTable) -> dict:
    # No Prefect cache here: whether a chunk is done is read from the run directory's checkpoints.
    return session.run_chunk(start, end, on_rollout=table.row)


def train_stage(cfg: GrpoConfig, rd: RunDir, converted: dict, prepared: dict) -> dict:
    check_trainable(cfg)
    session = TrainSession(cfg, rd)
    table = RolloutTable()
    chunks = []
    try:
        for start, end in cfg.chunk_bounds():
            chunks.append(train_chunk(session, start, end, table))
    finally:
        session.close()
    done = [c for c in chunks if not c["skipped"]]
    last = [m for c in chunks for m in c["metrics"]][-1:] or [{}]
    summary = (f"{cfg.train.num_rollout} rollouts in {len(chunks)} chunks ({len(chunks) - len(done)} skipped); "
               f"final reward_mean {last[0].get('reward_mean', float('nan')):.3f}")
    return {"status": "done" if done else "skipped (done before)", "summary": summary, "chunks": chunks,
            "checkpoint": rd.checkpoint(cfg.train.num_rollout), "actor_builds": session.builds}
