"""The GRPO recipe as one Prefect flow: fetch → prepare → convert → train (chunks, evals) → register."""
from __future__ import annotations

from prefect import flow

from runtime import storage
from runtime.config import DEFAULT_ROOT, load_config
from runtime.errors import UserError
from runtime.grpo.preflight import check_fits, check_this_machine, check_trainable
from runtime.run import checkpoint, run_log
from runtime.run.directory import RunDir
from runtime.run.frozen_config import config_to_resume, freeze, mark_finished
from runtime.run.leftovers import remove_temp_leftovers
from runtime.run.lease import RunLease
from runtime.secrets import reveal
from runtime.testing.moments import moment
from runtime.tracking.progress_table import stage_line
from tasks.common import masked_errors
from tasks.stages import convert_task, fetch_task, prepare_task
from tasks.train import train_stage


def _stage(task, *args) -> dict:
    state = task(*args, return_state=True)
    result = state.result()
    if state.name == "Cached":
        result = {**result, "skipped": True}
    stage_line(task.name, result)
    return result


def _tracking_store(cfg) -> None:
    """The run's MLflow SQLite store, made (atomically) before any training writes to it."""
    if cfg.tracking.enabled:
        from runtime.tracking.mlflow_tracker import default_tracking_uri, ensure_store
        ensure_store(default_tracking_uri(cfg))


@flow(name="grpo-pipeline")
@masked_errors
def grpo_pipeline(config_path: str | None = None, overrides: list[str] | None = None,
                  run_id: str | None = None, root: str | None = None, resume: bool = False) -> dict:
    """Run (or resume) one grpoflow run. Finished stages and chunks are read from the run directory and skipped."""
    overrides = reveal(overrides)  # the CLI hands secrets over in-process, never as stored parameters
    if resume:
        probe = RunDir(root or DEFAULT_ROOT, run_id)
        cfg = config_to_resume(probe, overrides)
    else:
        cfg = load_config(config_path, overrides)
    check_trainable(cfg)  # cheap checks before anything is fetched or a GPU is taken
    rd = RunDir(root or cfg.storage.root, run_id, cfg.storage.state_dir)
    check_fits(cfg, rd.path)
    check_this_machine(cfg)
    rd = rd.checked()  # fails early on an unusable S3 root
    new_run = not storage.exists(rd.path)
    try:
        with RunLease(rd, started_with=None if resume else _started_with(config_path, overrides)):  # one writer per run
            moment("leased")
            remove_temp_leftovers(rd)  # of a writer killed mid-write; nobody else writes while we hold the lease
            checkpoint.repair_latest(rd)  # an unreadable `latest`, or one naming a damaged checkpoint
            cfg = freeze(cfg, rd)  # with the memory plan's choices: the run uses what was frozen
            run_log.settle(rd)  # the run directory is this run's now: its log moves in
            moment("frozen")
            fetched = _stage(fetch_task, cfg, rd)
            moment("fetched")
            # Cheap before costly: the data is prepared (and every row checked) before the model is converted.
            prepared = _stage(prepare_task, cfg, rd, fetched)
            moment("prepared")
            converted = _stage(convert_task, cfg, rd, fetched)
            moment("converted")
            _tracking_store(cfg)
            moment("tracking-store-ready")
            trained = train_stage(cfg, rd, converted, prepared)
            moment("trained")
            mark_finished(cfg, rd)
            moment("marked-finished")
    except UserError:
        if new_run and _nothing_trained(rd):
            storage.remove_tree(rd.path)  # a run refused for its inputs leaves nothing behind
            _remove_if_empty(storage.join(rd.root, "runs"))
        raise
    return {"run_id": rd.run_id, "run_dir": rd.path, "fetch": fetched, "convert": converted,
            "prepare": prepared, "train": trained}


def _started_with(config_path: str, overrides: list[str] | None) -> dict:
    """How this run was started, secrets masked: kept in its lease until its config is frozen."""
    from pathlib import Path

    from runtime.secrets import mask_override
    return {"config": str(Path(config_path).resolve()), "overrides": [mask_override(o) for o in overrides or []]}


def _nothing_trained(rd: RunDir) -> bool:
    return not storage.exists(rd.checkpoints)


def _remove_if_empty(local_dir: str) -> None:
    import os
    if not storage.is_remote(local_dir):
        try:
            os.rmdir(local_dir)
        except OSError:
            pass  # not empty (other runs), or not there
