"""Register the scheduled pipeline with a Prefect server (a process work pool runs it), or serve it locally.

The deployment runs `deployments.scheduled:scheduled_grpo` by module path, so a worker needs grpoflow
installed in its Python — nothing is copied or pulled. Runs start in `workdir` (the directory `grpoflow
deploy` was called from), so relative paths in the config mean what they mean to `grpoflow run` there.

Concurrency: the deployment carries a Prefect deployment concurrency limit of 1. With `on_overlap=
"enqueue"` (the default) a run that fires while another run of the deployment is Pending or Running
is put back to Scheduled ("AwaitingConcurrencySlot") by the server and starts when the slot is free —
so a nightly run that outlasts a day delays the next one instead of training beside it. With
`"cancel"` the overlapping run is cancelled (skipped) instead.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator

from runtime.config import load_config
from runtime.errors import ConfigError, UserError
from runtime.run.scheduled_runs import check_prefix, safe_prefix

FLOW_NAME = "grpo-scheduled"
DEFAULT_CRON = "0 3 * * *"  # nightly, 03:00 UTC
DEFAULT_POOL = "grpoflow"
ON_OVERLAP = ("enqueue", "cancel")


def default_name(config_path: str, overrides: list[str] | None = None) -> str:
    return f"{load_config(config_path, overrides).name}-scheduled"


def _concurrency(on_overlap: str):
    from prefect.client.schemas.objects import ConcurrencyLimitConfig, ConcurrencyLimitStrategy
    if on_overlap not in ON_OVERLAP:
        raise ConfigError(f"on_overlap={on_overlap!r}: use one of {', '.join(ON_OVERLAP)}")
    strategy = ConcurrencyLimitStrategy.ENQUEUE if on_overlap == "enqueue" else ConcurrencyLimitStrategy.CANCEL_NEW
    return ConcurrencyLimitConfig(limit=1, collision_strategy=strategy)


def _schedule(cron: str | None, timezone: str | None):
    if not cron:
        return None
    if timezone:
        import zoneinfo
        try:
            zoneinfo.ZoneInfo(timezone)
        except (zoneinfo.ZoneInfoNotFoundError, ValueError):
            raise ConfigError(f"--timezone {timezone!r} is not an IANA timezone (e.g. UTC, Europe/Berlin)") from None
    from prefect.schedules import Cron
    try:
        return Cron(cron, timezone=timezone)
    except ValueError as err:
        first = str(err).strip().splitlines()[-1] if str(err).strip() else "invalid"
        raise ConfigError(f"--cron {cron!r}{f' --timezone {timezone!r}' if timezone else ''} is not a valid "
                          f"schedule ({first}); use five cron fields, e.g. '0 3 * * *' (03:00 daily)") from None


def _parameters(config_path: str, overrides: list[str] | None, run_prefix: str,
                resume_unfinished: bool) -> dict:
    load_config(config_path, overrides)  # a bad config or override fails here, not at 03:00
    return {"config_path": str(Path(config_path).resolve()), "overrides": list(overrides or []),
            "run_prefix": check_prefix(run_prefix), "resume_unfinished": bool(resume_unfinished)}


@contextlib.contextmanager
def _api(api_url: str | None) -> Iterator[str]:
    """Point Prefect at `api_url` (or the configured PREFECT_API_URL) and check that it answers."""
    from prefect.settings import PREFECT_API_URL, temporary_settings
    url = api_url or PREFECT_API_URL.value()
    if not url:
        raise UserError("no Prefect API configured: set PREFECT_API_URL (e.g. http://127.0.0.1:4200/api, "
                        "`prefect server start` serves one) or pass --api-url")
    with temporary_settings(updates={PREFECT_API_URL: url}):
        from prefect.client.orchestration import get_client
        with get_client(sync_client=True) as client:
            problem = client.api_healthcheck()
        if problem is not None:
            raise UserError(f"cannot reach the Prefect API at {url} ({type(problem).__name__}); "
                            "start the server or fix PREFECT_API_URL / --api-url")
        yield url


def ensure_process_pool(name: str) -> bool:
    """Create the process work pool `name` unless it exists; True when it was created."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectNotFound
    from prefect.workers.process import ProcessWorker
    with get_client(sync_client=True) as client:
        try:
            pool = client.read_work_pool(name)
        except ObjectNotFound:
            client.create_work_pool(WorkPoolCreate(
                name=name, type="process", base_job_template=ProcessWorker.get_default_base_job_template()))
            return True
    if pool.type != "process":
        raise UserError(f"work pool {name!r} is of type {pool.type!r}; grpoflow deploys to a process pool: "
                        f"pass --pool with another name (it is created) or an existing process pool")
    return False


def deploy(config_path: str, *, name: str | None = None, cron: str | None = DEFAULT_CRON,
           overrides: list[str] | None = None, work_pool: str = DEFAULT_POOL, api_url: str | None = None,
           timezone: str | None = None, run_prefix: str | None = None, resume_unfinished: bool = True,
           on_overlap: str = "enqueue", workdir: str | None = None) -> dict:
    """Register (or update) deployment `grpo-scheduled/<name>` on the Prefect API; returns what was made."""
    from prefect.types.entrypoint import EntrypointType

    from deployments.scheduled import scheduled_grpo

    name = name or default_name(config_path, overrides)
    params = _parameters(config_path, overrides, run_prefix or safe_prefix(name), resume_unfinished)
    schedule = _schedule(cron, timezone)
    concurrency = _concurrency(on_overlap)
    workdir = str(Path(workdir or os.getcwd()).resolve())
    with _api(api_url) as url:
        created_pool = ensure_process_pool(work_pool)
        deployment_id = scheduled_grpo.deploy(
            name=name, work_pool_name=work_pool, schedule=schedule, concurrency_limit=concurrency,
            parameters=params, job_variables={"working_dir": workdir}, tags=["grpoflow"],
            description=f"grpoflow: GRPO post-training of {params['config_path']} on a schedule",
            entrypoint_type=EntrypointType.MODULE_PATH, build=False, push=False,
            print_next_steps=False, ignore_warnings=True)
    return {"deployment_id": str(deployment_id), "deployment": f"{FLOW_NAME}/{name}", "api_url": url,
            "work_pool": work_pool, "created_pool": created_pool, "cron": cron, "timezone": timezone,
            "on_overlap": on_overlap, "workdir": workdir, "parameters": params}


def serve(config_path: str, *, name: str | None = None, cron: str | None = None,
          overrides: list[str] | None = None, timezone: str | None = None, run_prefix: str | None = None,
          resume_unfinished: bool = True, on_overlap: str = "enqueue") -> None:
    """Create deployment `grpo-scheduled/<name>` and run its flow runs in this process's children until
    SIGINT/SIGTERM (then its schedule is paused). Needs a Prefect API (PREFECT_API_URL)."""
    from prefect.types.entrypoint import EntrypointType

    from deployments.scheduled import scheduled_grpo

    name = name or default_name(config_path, overrides)
    params = _parameters(config_path, overrides, run_prefix or safe_prefix(name), resume_unfinished)
    schedule = _schedule(cron, timezone)
    concurrency = _concurrency(on_overlap)
    with _api(None):
        scheduled_grpo.serve(
            name=name, schedule=schedule, global_limit=concurrency, limit=1, parameters=params,
            tags=["grpoflow"], entrypoint_type=EntrypointType.MODULE_PATH, pause_on_shutdown=True,
            print_starting_message=True)
