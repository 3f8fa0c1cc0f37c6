"""What every grpoflow task shares: retry only on transient trouble, and stage cache keys."""
from __future__ import annotations

import functools
import os

from runtime.errors import TransientError
from runtime.secrets import redact_exception

RETRIES = int(os.environ.get("GRPOFLOW_TASK_RETRIES", "2"))


def retry_delay_s() -> float:
    # Tests set GRPOFLOW_RETRY_DELAY_S=0: a retry then costs no wall time.
    return float(os.environ.get("GRPOFLOW_RETRY_DELAY_S", "10"))


def _is_transient(exc: BaseException) -> bool:
    if isinstance(exc, (TransientError, ConnectionError, TimeoutError)):
        return True
    # Ray's dead-actor / lost-node errors: the chunk is rebuilt from `latest` on retry.
    return type(exc).__name__ in {"ActorDiedError", "RayActorError", "ActorUnavailableError", "NodeDiedError",
                                  "WorkerCrashedError", "OwnerDiedError", "ObjectLostError"}


def retry_on_transient(task, task_run, state) -> bool:
    """Prefect retry condition: config and data errors fail at once, network/IO/actor loss retry."""
    try:
        state.result(raise_on_failure=True)
    except BaseException as exc:  # noqa: BLE001 - we classify, never swallow
        return _is_transient(exc)
    return False


def masked_errors(fn):
    """``fn`` whose exceptions carry no secret (runtime.secrets): Prefect stores a failure's message in the task's
    or flow's state and its events, and the CLI prints it. Under ``@task``/``@flow``, keeping ``fn``'s signature."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except BaseException as err:
            redact_exception(err)
            raise
    return wrapper
