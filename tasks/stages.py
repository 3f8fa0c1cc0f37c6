"""Prefect tasks for the data stages: retries on transient errors, cache keyed by run id + stage + inputs."""
from __future__ import annotations

from prefect import task

from runtime import stages
from runtime.config import GrpoConfig
from runtime.rundir import RunDir

from .common import RETRIES, retry_delay_s, retry_on_transient


def _stage_key(stage: str, inputs_of):
    def key(context, parameters) -> str:
        cfg, rd = parameters["cfg"], parameters["rd"]
        return f"{rd.run_id}-{stage}-{stages.inputs_hash(inputs_of(cfg))}"
    return key


_common = dict(retries=RETRIES, retry_delay_seconds=retry_delay_s(), retry_condition_fn=retry_on_transient,
               persist_result=True)


@task(name="fetch", cache_key_fn=_stage_key("fetch", stages.fetch_inputs), **_common)
def fetch_task(cfg: GrpoConfig, rd: RunDir) -> dict:
    return stages.fetch(cfg, rd)


@task(name="convert", cache_key_fn=_stage_key("convert", stages.convert_inputs), **_common)
def convert_task(cfg: GrpoConfig, rd: RunDir, fetched: dict) -> dict:
    return stages.convert(cfg, rd, fetched)


@task(name="prepare", cache_key_fn=_stage_key("prepare", stages.prepare_inputs), **_common)
def prepare_task(cfg: GrpoConfig, rd: RunDir, fetched: dict) -> dict:
    return stages.prepare(cfg, rd, fetched)
