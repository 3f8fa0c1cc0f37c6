"""Partial rollout through a real train session on CPU (tiny Qwen3, the paged decoder): rollouts stop once
enough groups are complete, unfinished samples are carried into the next rollout and trained there, every
prompt drawn is accounted for once, and the carried samples are run state: a session resumed from the
chunk's checkpoint ends bitwise-equal to the unbroken one, with the same metrics."""
from __future__ import annotations

import shutil

import pytest

from runtime.config import load_config
from runtime.errors import ConfigError
from runtime.grpo.session import TrainSession
from runtime.run import stages
from runtime.run.directory import RunDir
from tests.test_resume import assert_same_checkpoint, checkpoint_tensors

# groups of 2 samples with up to 48 new tokens: a random tiny model (about 56 tokens, one of them eos) stops a
# sample at a random length, so groups complete at different steps; 4 groups in flight for 2 trained
PARTIAL = ["rollout.partial=true", "algorithm.use_tis=true", "rollout.decode_path=paged",
           "rollout.rollout_batch_size=2", "rollout.n_samples_per_prompt=2", "rollout.over_sampling_factor=2", "rollout.max_new_tokens=48",
           "rollout.max_staleness=3", "train.global_batch_size=4", "train.micro_batch_size=4", "train.num_rollout=4",
           "checkpoint.interval=2", "eval.interval=null", "tracking.enabled=false"]
TIMING = ("_s", "tok_s")


def _session(root, run_id: str = "partial", sets: tuple[str, ...] = ()) -> TrainSession:
    cfg = load_config("configs/tiny.yaml", PARTIAL + [f"storage.root={root}", *sets])
    rd = RunDir(str(root), run_id)
    if not (root / "runs" / run_id / "model").exists():
        fetched = stages.fetch(cfg, rd)
        stages.convert(cfg, rd, fetched)
        stages.prepare(cfg, rd, fetched)
    return TrainSession(cfg, rd)


def _untimed(metrics: list[dict]) -> list[dict]:
    return [{k: v for k, v in m.items() if not k.endswith(TIMING)} for m in metrics]


@pytest.fixture(scope="module")
def unbroken(tmp_path_factory):
    """4 rollouts in 2 chunks; a copy of the run directory after the first chunk."""
    root = tmp_path_factory.mktemp("partial")
    session = _session(root)
    try:
        first = session.run_chunk(0, 2)["metrics"]
        session.wait_durable(2)  # its checkpoint is written beside the next chunk: durable before the copy
        copy = tmp_path_factory.mktemp("partial-at-2") / "root"
        shutil.copytree(root, copy)
        second = session.run_chunk(2, 4)["metrics"]
        state = dict(session.state)
    finally:
        session.close()
    return {"root": root, "copy": copy, "metrics": first + second, "state": state}


def test_samples_are_carried_over_and_every_prompt_is_accounted_for(unbroken):
    metrics = unbroken["metrics"]
    for m in metrics:
        # the golden rule: exactly rollout_batch_size groups of n samples are trained
        assert m["partial_prompts_drawn"] == (m["partial_prompts_trained"] + m["partial_prompts_filtered"]
                                              + m["partial_prompts_stale"] + m["partial_buffered_groups"])
    assert [m["partial_prompts_trained"] for m in metrics] == [2, 4, 6, 8]
    # unfinished samples were carried out of a rollout, and a later rollout continued and trained them
    assert any(m["partial_buffered_samples"] > 0 for m in metrics[:-1])
    assert any(m["partial_tokens_reused"] > 0 for m in metrics[1:])
    assert all(m["partial_tokens_generated"] > 0 for m in metrics)
    assert 0.0 < metrics[-1]["tis_weight"] <= 2.0  # the carried tokens' old log-probs reach TIS
    state = unbroken["state"]["partial"]
    assert len(state["buffer"]) == metrics[-1]["partial_buffered_groups"]


def test_a_resumed_session_ends_as_the_unbroken_one(unbroken, tmp_path):
    # a new session (new engine and trainer) from the copy taken after chunk 1: the carried samples come
    # from the checkpoint, not from memory
    session = _session(unbroken["copy"])
    try:
        second = session.run_chunk(2, 4)["metrics"]
    finally:
        session.close()
    assert _untimed(second) == _untimed(unbroken["metrics"][2:])
    assert_same_checkpoint(checkpoint_tensors(RunDir(str(unbroken["copy"]), "partial").checkpoint(4), tmp_path),
                           checkpoint_tensors(RunDir(str(unbroken["root"]), "partial").checkpoint(4), tmp_path))


def test_partial_rollout_through_two_engines(ray_session, unbroken, tmp_path):
    """cluster.rollout_gpus=2 (Ray actors on CPU): a chunk of partial rollouts through a pool of two built-in
    engines (the requests split, the stop decided over both, the weights pushed to both) trains the golden
    rule's groups with every prompt accounted for once. (Not sample-equal to the one-engine run: each engine
    has max_batch_size rows, so the pool runs twice the rows at once; test_rollout.py compares samples.)"""
    for part in ("model", "data"):  # the run's inputs as the unbroken run prepared them
        shutil.copytree(unbroken["root"] / "runs" / "partial" / part, tmp_path / "runs" / "partial" / part)
    session = _session(tmp_path, sets=("cluster.backend=ray", "cluster.device=cpu", "cluster.rollout_gpus=2"))
    try:
        metrics = session.run_chunk(0, 2)["metrics"]
        assert session.engine.engines == 2 and session.engine.health()["weight_version"] == 2
    finally:
        session.close()
    assert [m["partial_prompts_trained"] for m in metrics] == [2, 4]
    for m in metrics:
        assert m["partial_prompts_drawn"] == (m["partial_prompts_trained"] + m["partial_prompts_filtered"]
                                              + m["partial_prompts_stale"] + m["partial_buffered_groups"])
        assert m["train_tokens"] > 0 and m["train_rollout_logp_absdiff"] < 1e-4  # engines and trainer agree


def test_partial_needs_tis_and_the_pipelines_own_generation():
    with pytest.raises(ConfigError, match="algorithm.use_tis: true"):
        load_config("configs/tiny.yaml", ["rollout.partial=true"])
    # SGLang continues and aborts samples too (tests/test_sglang.py); a custom rollout makes its own samples
    cfg = load_config("configs/tiny.yaml", ["rollout.partial=true", "algorithm.use_tis=true", "rollout.engine=sglang"])
    assert cfg.rollout.partial and cfg.rollout.engine == "sglang"
    with pytest.raises(ConfigError, match="remove rollout.custom_rollout") as err:
        load_config("configs/tiny.yaml", ["rollout.partial=true", "algorithm.use_tis=true", "rollout.engine=sglang",
                                          "rollout.custom_rollout=tests.test_partial_rollout:_untimed"])
    assert "\n" not in str(err.value)


# ---- killed anywhere with a buffer in flight (the reliability issue's kill moments, SIGKILL, no clean-up) ----

@pytest.mark.kill
@pytest.mark.parametrize("moment", ["generate#3", "checkpoint-model-written#2"],
                         ids=["mid-rollout-3-buffer-in-flight", "checkpoint-write-of-chunk-2"])
def test_killed_with_a_buffer_in_flight_then_resumed_is_bitwise_equal(unbroken, prefect_harness, tmp_path, moment):
    import os
    import signal
    import subprocess
    import sys

    import prefect.settings

    from cli.main import main
    from runtime.run import checkpoint

    root = tmp_path / "root"
    # the checkpoint written inside the step: killed at rollout 3, the one of rollout 2 is then durable whatever the
    # writer's pace (with it in the background it may still be pending there, and a resume starts from rollout 0)
    sets = sum((["--set", s] for s in PARTIAL + [f"storage.root={root}", "checkpoint.background=false"]), [])
    argv = ["run", "configs/tiny.yaml", "--run-id", "partial", *sets]
    env = dict(os.environ, GRPOFLOW_TEST_KILL_AT=moment, PREFECT_API_URL=prefect.settings.PREFECT_API_URL.value())
    log = tmp_path / "killed.log"
    with log.open("w") as out:
        proc = subprocess.run([sys.executable, "-m", "cli.main", *argv], stdout=out, stderr=subprocess.STDOUT, env=env,
                              start_new_session=True, timeout=600)
    assert proc.returncode == -signal.SIGKILL, f"{moment} was never reached:\n{log.read_text()[-3000:]}"
    rd = RunDir(str(root), "partial")
    ck = checkpoint.latest(rd)
    assert ck is not None and ck.rollout == 2 and ck.state["partial"]["buffer"]  # a buffer was in flight
    assert main(["resume", "partial", "--root", str(root)]) == 0
    final = checkpoint.latest(rd)
    assert final.rollout == 4
    assert _untimed(final.state["metrics"]) == _untimed(unbroken["metrics"][2:])
    assert_same_checkpoint(checkpoint_tensors(final.path, tmp_path),
                           checkpoint_tensors(RunDir(str(unbroken["root"]), "partial").checkpoint(4), tmp_path))


def test_a_background_checkpoint_holds_the_state_of_its_chunks_end(tmp_path):
    """The checkpoint is written beside the next chunk, whose rollouts change the live partial buffer in place:
    what is written is the state at the chunk's end, whenever the write is made durable."""
    import copy
    import json

    session = _session(tmp_path)
    try:
        session.run_chunk(0, 2)
        at_end = copy.deepcopy(session.state["partial"])
        assert at_end["buffer"]  # samples in flight: the part a later rollout changes
        session.state["partial"]["buffer"].clear()  # what continuing the buffered samples does to it
        session.wait_durable(2)
    finally:
        session.close()
    written = json.loads((tmp_path / "runs" / "partial" / "checkpoints" / "rollout_2" / "trainer_state.json").read_text())
    assert written["partial"] == json.loads(json.dumps(at_end))
