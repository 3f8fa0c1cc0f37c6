"""The resume contract under real faults: SIGKILL of the run process while the next chunk trains beside a
checkpoint write, a killed trainer actor, a damaged newest checkpoint, finished and unknown runs, and the
one-writer lease (a kill at every other moment of a run: tests/test_kill_anywhere.py).

Every resumed run must end with the same weights and optimizer state, bit for bit, as the
uninterrupted reference run of the session (same config, same seed).
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from cli.main import main
from runtime.run import checkpoint
from runtime.run.lease import RunBusyError, RunLease
from runtime.run.directory import RunDir


def checkpoint_tensors(path: str | Path, scratch: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a torch_dist checkpoint (model and optimizer), read without megatron."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    out = scratch / f"{abs(hash(str(path)))}.pt"
    dcp_to_torch_save(str(Path(path) / "model"), str(out))
    state = torch.load(out, weights_only=False)
    return {k: v for k, v in state.items() if torch.is_tensor(v)}


def assert_same_checkpoint(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"{len(different)} tensors differ, e.g. {different[:3]}"


@pytest.fixture(scope="module")
def reference_final(reference_run, tmp_path_factory):
    rd = RunDir(reference_run["root"], "ref")
    return checkpoint_tensors(rd.checkpoint(4), tmp_path_factory.mktemp("ref-tensors"))


def _overrides(root: Path) -> list[str]:
    from tests.conftest import REFERENCE_OVERRIDES
    return REFERENCE_OVERRIDES + [f"storage.root={root}"]


@pytest.mark.race
def test_sigkill_while_the_next_chunk_trains_beside_the_checkpoint_write(prefect_harness, reference_final, tmp_path,
                                                                        monkeypatch):
    """checkpoint.background: rollout 2's checkpoint has its tensors on disk but is not finalized (its writer held
    after the files, before the manifest) while rollout 2 trains; killed there, the resume discards it, redoes
    the first chunk and ends as the reference's weights. train.deterministic (the default, what makes this equality
    hold on GPUs; on CPU the kernels are deterministic either way) is frozen with the run, and the resumed trainer
    computes under it while the engine beside it, in the same process, does not. (Kills at every other moment, and
    the MLflow points and registry of the resumed run: tests/test_kill_anywhere.py.)"""
    root = tmp_path / "root"
    rd = RunDir(str(root), "k3")
    pauses = tmp_path / "pauses"
    pauses.mkdir()
    env = dict(os.environ, PYTHONUNBUFFERED="1", GRPOFLOW_TEST_PAUSE_AT="checkpoint-files-written#1",
               GRPOFLOW_TEST_PAUSE_DIR=str(pauses), GRPOFLOW_TEST_KILL_AT="checkpoint-pending#1")
    sets = sum((["--set", o] for o in _overrides(root)), [])
    log = tmp_path / "run.log"
    proc = subprocess.run([sys.executable, "-m", "cli.main", "run", "configs/tiny.yaml", "--run-id", "k3", *sets],
                          stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True, timeout=600)
    assert proc.returncode == -signal.SIGKILL, log.read_text()[-3000:]
    assert (pauses / "checkpoint-files-written#1.reached").is_file()  # the writer was held with its files written
    temps = [p for p in Path(rd.checkpoints).iterdir() if p.name.startswith(".rollout_2.tmp-")]
    assert temps and list((temps[0] / "model").glob("*.distcp")) and not (temps[0] / "manifest.json").exists()
    assert checkpoint.latest(rd) is None
    assert yaml.safe_load(Path(rd.config).read_text())["train"]["deterministic"] is True  # frozen with the run
    modes: dict[str, set[bool]] = {"trainer": set(), "engine": set()}  # deterministic mode while each computes

    def seen(who):
        modes[who].add(torch.are_deterministic_algorithms_enabled())
    hook = torch.nn.modules.module.register_module_forward_pre_hook(lambda *_: seen("trainer"))  # megatron's modules
    from runtime.rollout.builtin import BuiltinEngine
    decode = BuiltinEngine.advance_generation
    monkeypatch.setattr(BuiltinEngine, "advance_generation", lambda self: (seen("engine"), decode(self))[1])
    try:
        assert main(["resume", "k3", "--root", str(root)]) == 0
    finally:
        hook.remove()
    assert modes == {"trainer": {True}, "engine": {False}}
    final = checkpoint.latest(rd)
    assert final.rollout == 4 and final.state["metrics"][-1]["checkpoint_write_s"] >= 0
    assert [m["rollout"] for m in final.state["metrics"]] == [2, 3]  # the chunk ran exactly its rollouts
    assert not any(p.name.startswith(".rollout_") for p in Path(rd.checkpoints).iterdir())
    assert_same_checkpoint(checkpoint_tensors(final.path, tmp_path), reference_final)


def _copy_reference(reference_run, dest: Path) -> Path:
    src = Path(reference_run["root"]) / "runs" / "ref"
    shutil.copytree(src, dest / "runs" / "ref")
    return dest


def test_damaged_newest_checkpoint_falls_back_and_finishes(prefect_harness, reference_run, reference_final,
                                                           tmp_path, caplog):
    root = _copy_reference(reference_run, tmp_path / "root")
    rd = RunDir(str(root), "ref")
    victim = sorted((Path(rd.checkpoint(4)) / "model").glob("*.distcp"))[0]
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    with pytest.raises(AssertionError, match="tensors differ"):  # the comparison can tell checkpoints apart
        assert_same_checkpoint(checkpoint_tensors(rd.checkpoint(2), tmp_path), reference_final)
    assert main(["resume", "ref", "--root", str(root)]) == 0
    # said once, though a resume reads `latest` several times (finished? where does training start?)
    said = [r.getMessage() for r in caplog.records if "unusable" in r.getMessage()]
    assert len(said) == 1 and "rollout_4 is unusable" in said[0], said
    final = checkpoint.latest(rd)
    assert final.rollout == 4
    assert_same_checkpoint(checkpoint_tensors(final.path, tmp_path), reference_final)


def test_resume_finished_run_says_so_and_extends(prefect_harness, reference_run, tmp_path, capsys):
    root = _copy_reference(reference_run, tmp_path / "root")
    # the run directory alone was copied: the first resume makes its MLflow run again in this root's store
    assert main(["resume", "ref", "--root", str(root)]) == 0
    assert f"its MLflow run is made again in sqlite:///{root}/mlflow.db" in capsys.readouterr().out
    assert main(["resume", "ref", "--root", str(root)]) == 0
    assert "already finished (4 rollouts)" in capsys.readouterr().out
    assert main(["resume", "ref", "--root", str(root), "--set", "train.num_rollout=6"]) == 0
    rd = RunDir(str(root), "ref")
    final = checkpoint.latest(rd)
    assert final.rollout == 6 and [m["rollout"] for m in final.state["metrics"]] == [4, 5]


def test_resume_unknown_run(tmp_path, capsys):
    assert main(["resume", "no-such-run", "--root", str(tmp_path)]) == 2
    assert "unknown run id 'no-such-run'" in capsys.readouterr().err


def test_lease_refuses_a_second_writer_and_takes_over_stale_ones(tmp_path):
    rd = RunDir(str(tmp_path), "leased")
    with RunLease(rd, timeout_s=30):
        with pytest.raises(RunBusyError, match="is being written by pid"):
            RunLease(rd, timeout_s=30).acquire()
    # released: a new writer gets it at once
    RunLease(rd, timeout_s=30).acquire().release()
    # a dead holder on this host is taken over although its heartbeat is fresh
    storage_path = Path(rd.sub("lease.json"))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    storage_path.write_text(f'{{"token": "x", "pid": {dead.pid}, "host": "{os.uname().nodename}", '
                            f'"heartbeat": {time.time()}}}')
    RunLease(rd, timeout_s=30).acquire().release()
    # a live holder elsewhere whose heartbeat went silent is taken over after the timeout
    storage_path.write_text(f'{{"token": "y", "pid": 1, "host": "other-host", "heartbeat": {time.time() - 31}}}')
    RunLease(rd, timeout_s=30).acquire().release()


def test_run_on_a_leased_run_is_refused(prefect_harness, tmp_path, capsys):
    rd = RunDir(str(tmp_path), "busy")
    with RunLease(rd, timeout_s=60):
        code = main(["run", "configs/tiny.yaml", "--run-id", "busy", "--set", f"storage.root={tmp_path}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "is being written by pid" in err and len(err.splitlines()) == 1


@pytest.mark.race
def test_killed_trainer_actor_is_rebuilt_by_the_chunk_retry(prefect_harness, ray_session, reference_final, tmp_path,
                                                           monkeypatch):
    import psutil

    import tasks.train
    from flows.pipeline import grpo_pipeline
    from runtime.tracking.progress_table import RolloutTable
    root = tmp_path / "root"
    rd = RunDir(str(root), "ray-kill")
    killed: list[int] = []

    class KillAfterFirstRolloutOfSecondChunk(RolloutTable):
        """Kills the trainer actor when rollout 2 is done, so rollout 3 meets a dead trainer mid-chunk."""

        def row(self, m: dict) -> None:
            super().row(m)
            if m["rollout"] == 2 and not killed:
                for proc in psutil.process_iter(["pid", "cmdline"]):
                    if "ray::MegatronTrainer" in " ".join(proc.info["cmdline"] or []):
                        proc.kill()
                        killed.append(proc.info["pid"])

    monkeypatch.setattr(tasks.train, "RolloutTable", KillAfterFirstRolloutOfSecondChunk)
    result = grpo_pipeline(config_path="configs/tiny.yaml", run_id="ray-kill",
                           overrides=_overrides(root) + ["cluster.backend=ray"])
    assert killed, "no trainer actor was found to kill"
    assert result["train"]["actor_builds"] == 2  # rebuilt once, from checkpoints/latest
    final = checkpoint.latest(rd)
    assert final.rollout == 4
    assert_same_checkpoint(checkpoint_tensors(final.path, tmp_path), reference_final)


def test_mlflow_outage_during_registration_is_retried_then_named(prefect_harness, reference_run, tmp_path,
                                                                 capsys, monkeypatch):
    """Registration against an unreachable MLflow server: the task retries, then one line naming the URI;
    the checkpoints are untouched."""
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    root = _copy_reference(reference_run, tmp_path / "root")
    rd = RunDir(str(root), "ref")
    before = {p: p.stat().st_size for p in Path(rd.checkpoints).rglob("*") if p.is_file()}
    # a fresh eval point forces evaluate + register at rollout 4 against the dead server
    for f in Path(rd.sub("eval")).glob("*.json"):
        f.unlink()
    code = main(["resume", "ref", "--root", str(root), "--set", f"tracking.uri={dead}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 3 and dead in err[-1] and "after retries" in err[-1], err
    after = {p: p.stat().st_size for p in Path(rd.checkpoints).rglob("*") if p.is_file()}
    assert after == before


def test_a_ray_cluster_that_will_not_start_is_retried_then_named(prefect_harness, reference_run, tmp_path, capsys,
                                                                monkeypatch):
    """Ray failing to start its local cluster (under load its processes time out, said as a bare Exception):
    the train task retries, then one line that says to resume later; the checkpoints are untouched. The
    failure is injected: a real start-up timeout cannot be provoked on purpose."""
    import ray

    from tasks.common import RETRIES
    starts = []

    def init(**kw):
        starts.append(kw)
        raise Exception("The current node timed out during startup. This could happen because some of the Ray "
                        "processes failed to startup.")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # the session's cluster aside
    monkeypatch.setattr(ray, "init", init)
    root = _copy_reference(reference_run, tmp_path / "root")
    rd = RunDir(str(root), "ref")
    before = {p: p.stat().st_size for p in Path(rd.checkpoints).rglob("*") if p.is_file()}
    code = main(["resume", "ref", "--root", str(root), "--set", "train.num_rollout=6", "--set", "cluster.backend=ray"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 3, err
    assert err[-1].startswith("error: could not start a local Ray cluster: The current node timed out during startup")
    assert "resume the run later" in err[-1] and not any("Traceback" in line for line in err), err
    assert len(starts) == 1 + RETRIES
    assert {p: p.stat().st_size for p in Path(rd.checkpoints).rglob("*") if p.is_file()} == before
