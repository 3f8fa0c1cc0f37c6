"""Prefect tasks for the data stages: retries on transient errors, cache keyed by run id + stage + inputs."""
from __future__ import annotations

import hashlib
import uuid

from prefect import task

from runtime.run import stages
from runtime import storage
from runtime.config import GrpoConfig
from runtime.run.directory import RunDir

from tasks.common import RETRIES, masked_errors, retry_delay_s, retry_on_transient


def _stage_key(stage: str, inputs_of):
    """run id + stage + inputs, and the stage's marker in the run directory.

    The marker makes the run directory the authority: a stage not finished there never hits a
    cached result, even when an earlier run with the same id and inputs left one in Prefect's store.
    """
    def key(context, parameters) -> str:
        cfg, rd = parameters["cfg"], parameters["rd"]
        marker = rd.stage_marker(stage)
        if not storage.exists(marker):
            return f"{rd.run_id}-{stage}-{uuid.uuid4().hex}"
        done = hashlib.sha256(storage.read_text(marker).encode()).hexdigest()[:16]
        return f"{rd.run_id}-{stage}-{stages.inputs_hash([inputs_of(cfg), rd.path, done])}"
    return key


_common = dict(retries=RETRIES, retry_delay_seconds=retry_delay_s(), retry_condition_fn=retry_on_transient,
               persist_result=True)


@task(name="fetch", cache_key_fn=_stage_key("fetch", stages.fetch_inputs), **_common)
@masked_errors
def fetch_task(cfg: GrpoConfig, rd: RunDir) -> dict:
    return stages.fetch(cfg, rd)


@task(name="convert", cache_key_fn=_stage_key("convert", stages.convert_inputs), **_common)
@masked_errors
def convert_task(cfg: GrpoConfig, rd: RunDir, fetched: dict) -> dict:
    return stages.convert(cfg, rd, fetched)


@task(name="prepare", cache_key_fn=_stage_key("prepare", stages.prepare_inputs), **_common)
@masked_errors
def prepare_task(cfg: GrpoConfig, rd: RunDir, fetched: dict) -> dict:
    return stages.prepare(cfg, rd, fetched)
