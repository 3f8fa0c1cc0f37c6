"""The flow a scheduled deployment runs: pick the run (resume the previous one if unfinished), then run the pipeline."""
from __future__ import annotations

from prefect import flow, get_run_logger

from runtime.config import load_config
from runtime.run.scheduled_runs import check_prefix, next_run, safe_prefix


def _deployment_name() -> str | None:
    from prefect.runtime import deployment
    return deployment.name


@flow(name="grpo-scheduled")
def scheduled_grpo(config_path: str, overrides: list[str] | None = None, run_prefix: str | None = None,
                   resume_unfinished: bool = True) -> dict:
    """One firing of a schedule. Runs are named `<run_prefix>-<UTC timestamp>`; `run_prefix` defaults to
    the deployment's name (the config's name outside a deployment). With `resume_unfinished`, a previous
    run of the same prefix and config name that is not finished is resumed instead of starting over."""
    cfg = load_config(config_path, overrides)
    prefix = check_prefix(run_prefix) if run_prefix else safe_prefix(_deployment_name() or cfg.name)
    choice = next_run(cfg.storage.root, prefix, name=cfg.name, resume_unfinished=resume_unfinished)
    get_run_logger().info("grpoflow schedule: %s", choice.reason)

    from flows.pipeline import grpo_pipeline  # imported here: registering the deployment needs no torch
    if choice.resume:
        return grpo_pipeline(run_id=choice.run_id, root=cfg.storage.root, resume=True)
    return grpo_pipeline(config_path=config_path, overrides=overrides, run_id=choice.run_id)
