"""The train stage as the recipe reads: chunks of rollouts, each ending in a checkpoint, with an
evaluation and a registered model version at every eval point.

The steps are injected (`StageSteps`): tasks/train.py runs each as a Prefect task with retries,
a plain caller can pass the session's own methods. Whether a chunk is done is read from the run
directory, so a re-run skips finished work.
"""
from __future__ import annotations

from typing import Any, Protocol

from runtime.config import GrpoConfig
from runtime.plan.summary import counted


class StageSteps(Protocol):
    def chunk(self, start: int, end: int) -> dict: ...
    def log_metrics(self, metrics: list[dict], end: int) -> None: ...
    def evaluate(self, rollout: int) -> dict: ...
    def register(self, rollout: int, results: dict) -> dict | None: ...
    def finish(self) -> None: ...


def train_stage_loop(cfg: GrpoConfig, steps: StageSteps) -> dict[str, Any]:
    eval_points = set(cfg.eval_points()) if cfg.data.eval else set()
    chunks: list[dict] = []
    evals: dict[int, dict] = {}
    versions: dict[int, dict | None] = {}

    def evaluate_and_register(rollout: int) -> None:
        evals[rollout] = steps.evaluate(rollout)
        versions[rollout] = steps.register(rollout, evals[rollout])

    if 0 in eval_points:
        evaluate_and_register(0)
    for start, end in cfg.chunk_bounds():
        chunk = steps.chunk(start, end)
        steps.log_metrics(chunk["metrics"], end)
        chunks.append(chunk)
        if end in eval_points:
            evaluate_and_register(end)
    steps.finish()

    trained = [c for c in chunks if not c["skipped"]]
    last = [m for c in chunks for m in c["metrics"]][-1:] or [{}]
    summary = (f"{counted(cfg.train.num_rollout, 'rollout')} in {counted(len(chunks), 'chunk')} ({len(chunks) - len(trained)} skipped); "
               f"final reward_mean {last[0].get('reward_mean', float('nan')):.3f}")
    return {"status": "done" if trained else "skipped (done before)", "summary": summary, "chunks": chunks,
            "evals": evals, "versions": versions}
