"""The GRPO recipe as one Prefect flow: fetch → convert → prepare → train (chunks, evals) → register."""
from __future__ import annotations

from prefect import flow

from runtime.config import DEFAULT_ROOT, load_config
from runtime.grpo.preflight import check_fits, check_trainable
from runtime.run.lease import RunLease
from runtime.run.directory import RunDir
from runtime.run.frozen_config import freeze, frozen_config
from tasks.stages import convert_task, fetch_task, prepare_task
from tasks.train import train_stage


def _stage(task, *args) -> dict:
    state = task(*args, return_state=True)
    result = state.result()
    if state.name == "Cached":
        result = {**result, "skipped": True}
    return result


@flow(name="grpo-pipeline")
def grpo_pipeline(config_path: str | None = None, overrides: list[str] | None = None,
                  run_id: str | None = None, root: str | None = None, resume: bool = False) -> dict:
    """Run (or resume) one grpoflow run. Finished stages and chunks are read from the run directory and skipped."""
    if resume:
        probe = RunDir(root or DEFAULT_ROOT, run_id)
        cfg = frozen_config(probe, overrides)
    else:
        cfg = load_config(config_path, overrides)
    check_trainable(cfg)  # cheap checks before anything is fetched or a GPU is taken
    check_fits(cfg)
    rd = RunDir(root or cfg.storage.root, run_id, cfg.storage.state_dir).checked()  # fails early on an unusable S3 root
    with RunLease(rd):  # one writer per run
        cfg = freeze(cfg, rd)  # with the memory plan's choices: the run uses what was frozen
        fetched = _stage(fetch_task, cfg, rd)
        converted = _stage(convert_task, cfg, rd, fetched)
        prepared = _stage(prepare_task, cfg, rd, fetched)
        trained = train_stage(cfg, rd, converted, prepared)
    return {"run_id": rd.run_id, "run_dir": rd.path, "fetch": fetched, "convert": converted,
            "prepare": prepared, "train": trained}
