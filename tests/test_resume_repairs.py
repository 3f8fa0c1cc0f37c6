"""What a killed writer leaves behind, and `resume` repairing it: the last steps of a run (registration,
the MLflow run's end, the lease), temp leftovers; and secrets that must never
be written anywhere on the way.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import pytest

from cli.main import main
from runtime.run.directory import RunDir

FINISHED_MARKER = "finished"  # stages/finished.json, the run's last act


def _copy_reference(reference_run, dest: Path) -> Path:
    shutil.copytree(reference_run["root"], dest)
    return dest


def _mlflow(root: Path, run_id: str):
    """The run's MLflow client and run in the store of ``root`` (the store follows the root: a copied root's run
    is tracked in the copy of the store)."""
    from mlflow.tracking import MlflowClient
    doc = json.loads(Path(RunDir(str(root), run_id).sub("tracking.json")).read_text())
    uri = f"sqlite:///{root}/mlflow.db"
    return MlflowClient(uri, registry_uri=uri), doc["mlflow_run_id"]


def test_resume_finishes_what_a_kill_after_the_last_eval_left_undone(prefect_harness, reference_run, tmp_path, capsys):
    """Killed after the final eval was saved, before registration and the MLflow run's end: the run is not
    finished, and `resume` registers the version, moves `best`, ends the MLflow run and drops the lease."""
    root = _copy_reference(reference_run, tmp_path / "root")
    rd = RunDir(str(root), "ref")
    client, mlflow_run = _mlflow(root, "ref")
    name = "tiny"
    for v in client.search_model_versions(f"name = '{name}'"):
        if v.tags.get("grpoflow.run_id") == "ref":
            client.delete_model_version(name, v.version)
    client.update_run(mlflow_run, status="RUNNING")
    Path(rd.stage_marker(FINISHED_MARKER)).unlink(missing_ok=True)
    dead = os.fork()
    if dead == 0:
        os._exit(0)
    os.waitpid(dead, 0)
    Path(rd.sub("lease.json")).write_text(json.dumps({"token": "killed", "pid": dead, "host": os.uname().nodename,
                                                      "heartbeat": 0}))

    assert main(["resume", "ref", "--root", str(root)]) == 0, capsys.readouterr().err
    assert "resuming run ref" in capsys.readouterr().out
    versions = [v for v in client.search_model_versions(f"name = '{name}'") if v.tags.get("grpoflow.run_id") == "ref"]
    assert [v.tags["grpoflow.rollout"] for v in versions] == ["4"]
    assert client.get_registered_model(name).aliases.get("best") == versions[0].version
    assert client.get_run(mlflow_run).info.status == "FINISHED"
    assert not Path(rd.sub("lease.json")).exists()
    assert Path(rd.stage_marker(FINISHED_MARKER)).is_file()
    # and now it is finished: a second resume says so and changes nothing
    assert main(["resume", "ref", "--root", str(root)]) == 0
    assert "already finished" in capsys.readouterr().out


def test_a_garbage_latest_in_a_finished_run_is_said_once_and_repaired(reference_run, tmp_path, capsys, caplog):
    """`checkpoints/latest` overwritten with garbage after the run finished: `resume` says so once, makes it
    name the final checkpoint again (as any writer does when it takes the lease) and reports the run finished."""
    root = _copy_reference(reference_run, tmp_path / "root")
    rd = RunDir(str(root), "ref")
    Path(rd.latest).write_bytes(b"\x00{not json")
    assert main(["resume", "ref", "--root", str(root)]) == 0, capsys.readouterr().err
    assert "already finished" in capsys.readouterr().out
    said = [r.getMessage() for r in caplog.records if rd.latest in r.getMessage()]
    assert len(said) == 1 and "is unreadable" in said[0], said
    assert json.loads(Path(rd.latest).read_text()) == {"rollout": 4, "dir": "rollout_4"}


def test_temp_leftovers_of_a_killed_writer_are_removed_on_the_next_start(prefect_harness, reference_run, tmp_path):
    root = _copy_reference(reference_run, tmp_path / "root")
    rd = RunDir(str(root), "ref")
    planted = [Path(rd.sub("model", ".hf.tmp-0123abcd")), Path(rd.sub("model", ".torch_dist.tmp-89abcdef")),
               Path(rd.sub("exports", "rollout_4", ".hf.old-deadbeef")), Path(rd.sub("checkpoints", ".rollout_4.tmp-0badf00d"))]
    for p in planted:
        p.mkdir(parents=True)
        (p / "half.safetensors").write_bytes(b"x" * 10)
    stray = Path(rd.sub("data", ".train.parquet.k2j4h5g6.tmp"))
    stray.write_bytes(b"half")
    Path(rd.stage_marker(FINISHED_MARKER)).unlink(missing_ok=True)  # a run killed before its end, so it is resumed
    assert main(["resume", "ref", "--root", str(root)]) == 0
    assert not any(p.exists() for p in planted + [stray])
    assert sorted(p.name for p in Path(rd.sub("model")).iterdir()) == ["hf", "torch_dist"]


def test_a_secret_is_never_written(prefect_harness, tmp_path, capsys):
    """An SGLang --api-key among rollout.sglang.launch's args: masked in the frozen config, in MLflow and in
    the flow-run parameters Prefect stores; a resume must be given it again rather than run with the mask."""
    secret = "S3CRET-7f3a9"
    root = tmp_path / "root"
    launch = f"rollout.sglang.launch=[python, -m, sglang.launch_server, --api-key, {secret}]"
    code = main(["run", "configs/tiny.yaml", "--run-id", "secret", "--set", f"storage.root={root}", "--set", launch,
                 "--set", "train.num_rollout=1", "--set", "checkpoint.interval=1", "--set", "eval.interval=null",
                 "--set", "data.eval={}"])
    assert code == 0, capsys.readouterr().err
    leaked = [str(p) for p in root.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]
    assert not leaked, leaked
    frozen = Path(RunDir(str(root), "secret").config).read_text()
    assert "--api-key" in frozen and "'***'" in frozen
    import prefect.settings
    db = prefect.settings.PREFECT_SERVER_DATABASE_CONNECTION_URL.value().split(":///", 1)[1]
    assert secret.encode() not in b"".join(p.read_bytes() for p in Path(db).parent.glob(Path(db).name + "*"))
    capsys.readouterr()
    assert main(["resume", "secret", "--root", str(root), "--set", "train.num_rollout=2"]) == 2
    err = capsys.readouterr().err.strip()
    assert "rollout.sglang.launch held a secret" in err and len(err.splitlines()) == 1, err


_LOST_CLUSTER_SCRIPT = r'''
import socket, subprocess, sys, threading
from runtime.placement.cluster_watch import ClusterWatch
from runtime.run.directory import RunDir
from runtime.run.lease import RunLease
head = socket.socket(); head.bind(("127.0.0.1", 0)); head.listen()
port = head.getsockname()[1]
child = subprocess.Popen(["sleep", "600"])  # stands for the Prefect server a run starts
print(child.pid, flush=True)
RunLease(RunDir(sys.argv[1], "lost")).acquire()
ClusterWatch(f"127.0.0.1:{port}", lost_after_s=1, every_s=0.2).start()
head.close()  # the cluster's head is gone
threading.Event().wait()  # the main thread blocked, as in a ray.get that never returns
'''


def test_a_lost_cluster_ends_in_one_line_with_the_lease_released_and_no_orphan(tmp_path):
    """The whole Ray cluster gone while the main thread waits on it: one `error:` line, exit 3, the lease
    released and the run's child processes ended — before Ray's own hard exit, which does none of that."""
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, "-c", _LOST_CLUSTER_SCRIPT, str(tmp_path)], capture_output=True,
                          text=True, timeout=300, env=dict(os.environ, PYTHONPATH=os.getcwd()))
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert len(err) == 1 and err[0].startswith("error: lost the Ray cluster"), err
    assert f"grpoflow resume lost --root {tmp_path}" in err[0]
    assert not Path(RunDir(str(tmp_path), "lost").sub("lease.json")).exists()
    child = int(proc.stdout.split()[0])
    with pytest.raises(ProcessLookupError):
        os.kill(child, 0)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT], ids=["sigkill", "ctrl-c"])
def test_a_run_stopped_outright_leaves_no_prefect_server_behind(tmp_path, sig):
    """No Prefect API configured: `grpoflow run` starts a server of its own. SIGKILL of the run alone (not
    its process group: the OOM killer's way) ends that server too — Prefect's own ephemeral server stayed,
    holding its port, for good. A Ctrl-C (SIGINT to the run; the server has a session of its own) ends in
    one line that says how to continue, exit 130, the lease released."""
    import subprocess
    import sys

    import psutil

    from tests.waiting import wait_reached
    pauses, root = tmp_path / "pauses", tmp_path / "root"
    pauses.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API_URL")}
    env.update(PYTHONPATH=os.getcwd(), PREFECT_HOME=str(tmp_path / "prefect"),
               GRPOFLOW_TEST_PAUSE_AT="fetch-datasets-done", GRPOFLOW_TEST_PAUSE_DIR=str(pauses))
    argv = ["run", "configs/tiny.yaml", "--run-id", "k", "--set", "train.num_rollout=2", "--set", "eval.interval=2",
            "--set", f"storage.root={root}"]
    out, err = (tmp_path / "out.log").open("w"), (tmp_path / "err.log").open("w")
    # SIGINT as a terminal delivers it, even where this test runs with it ignored (a background job)
    run = subprocess.Popen([sys.executable, "-m", "cli.main", *argv], env=env, stdout=out, stderr=err,
                           preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        wait_reached(pauses / "fetch-datasets-done.reached", run, timeout_s=300, log=tmp_path / "err.log")
        kids = psutil.Process(run.pid).children(recursive=True)  # the Prefect server: nothing else runs yet
        assert kids
        run.send_signal(sig)
        code = run.wait(timeout=120)
        _, alive = psutil.wait_procs(kids, timeout=60)
        assert not alive, [p.cmdline() for p in alive]
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    if sig == signal.SIGINT:
        lines = (tmp_path / "err.log").read_text().strip().splitlines()
        assert code == 130 and lines == [f"error: interrupted; nothing is lost: continue with "
                                         f"`grpoflow resume k --root {root}`"], lines
        assert not Path(RunDir(str(root), "k").sub("lease.json")).exists()


@pytest.mark.parametrize("how", ["oserror", "wrapped"])
def test_a_full_disk_mid_run_is_one_line_and_resume_continues(prefect_harness, reference_run, tmp_path, capsys,
                                                              monkeypatch, how):
    """~40 s each. The disk fills while a checkpoint is written (the trainer state's write fails with ENOSPC, raw or
    as a checkpoint writer's worker wraps it): exit 3, one line saying the disk is full, where, and the resume
    command; the checkpoints before it intact. Once space is free (the write works again) the resume continues."""
    import errno

    from runtime import storage
    from runtime.run import checkpoint
    root = _copy_reference(reference_run, tmp_path / "root")
    rd = RunDir(str(root), "ref")
    real_write = storage.write_json_atomic

    def full_disk(path, doc, *a, **k):
        if str(path).endswith(checkpoint.STATE):
            if how == "oserror":
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
            raise RuntimeError(f"Worker failure: [Errno {errno.ENOSPC}] {os.strerror(errno.ENOSPC)}")
        return real_write(path, doc, *a, **k)

    monkeypatch.setattr(storage, "write_json_atomic", full_disk)
    assert main(["resume", "ref", "--root", str(root), "--set", "train.num_rollout=6"]) == 3
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: the disk is full (No space left on device) at "), err[-3000:]
    assert (checkpoint.STATE in lines[0]) if how == "oserror" else (f" at {root};" in lines[0]), lines[0]
    assert f"`grpoflow resume ref --root {root}`" in lines[0] and "nothing already written is lost" in lines[0]
    assert "Traceback" not in out + err
    assert checkpoint.latest(rd).rollout == 4 and checkpoint.verify(rd.checkpoint(4)) is None
    assert not Path(rd.sub("lease.json")).exists()

    monkeypatch.setattr(storage, "write_json_atomic", real_write)  # space freed
    assert main(["resume", "ref", "--root", str(root)]) == 0, capsys.readouterr().err[-3000:]
    assert checkpoint.latest(rd).rollout == 6


def test_sigterm_is_ctrl_c_and_the_resume_is_clean(prefect_harness, tmp_path):
    """~60 s (a one-rollout run, then its resume). SIGTERM to a `grpoflow run` process in the middle of training
    (after its first update, inside the train-chunk task) ends it as Ctrl-C does: exit 130 and one line saying
    nothing is lost, no Prefect crash lines, the lease released. The resume then trains to the end with one MLflow
    point per (metric, rollout)."""
    import subprocess
    import sys

    from tests.waiting import wait_reached
    pauses, root = tmp_path / "pauses", tmp_path / "root"
    pauses.mkdir()
    import prefect.settings
    env = dict(os.environ, PYTHONPATH=os.getcwd(), PREFECT_HOME=str(tmp_path / "prefect"),
               PREFECT_API_URL=prefect.settings.PREFECT_API_URL.value(),  # the session's server: no start-up to wait for
               GRPOFLOW_TEST_PAUSE_AT="train-step-done#1", GRPOFLOW_TEST_PAUSE_DIR=str(pauses))
    from tests.conftest import SMALL_BATCH
    argv = ["run", "configs/tiny.yaml", "--run-id", "t", "--set", "train.num_rollout=1", "--set", "checkpoint.interval=1",
            "--set", "eval.interval=null", "--set", "data.eval={}", "--set", f"storage.root={root}", *sum(
                (["--set", s] for s in SMALL_BATCH), [])]
    with (tmp_path / "err.log").open("w") as err:
        run = subprocess.Popen([sys.executable, "-m", "cli.main", *argv], env=env, stdout=subprocess.DEVNULL, stderr=err)
        try:
            wait_reached(pauses / "train-step-done#1.reached", run, timeout_s=600, log=tmp_path / "err.log")
            run.send_signal(signal.SIGTERM)
            code = run.wait(timeout=120)
        finally:
            if run.poll() is None:
                run.kill()
                run.wait()
    # MLflow's own INFO lines when it makes a store are not this test's business (library logs go to a file)
    lines = [line for line in (tmp_path / "err.log").read_text().strip().splitlines() if " INFO mlflow." not in line]
    assert code == 130 and lines == [f"error: interrupted; nothing is lost: continue with "
                                     f"`grpoflow resume t --root {root}`"], lines
    rd = RunDir(str(root), "t")
    assert not Path(rd.sub("lease.json")).exists()
    assert main(["resume", "t", "--root", str(root)]) == 0
    from runtime.run import checkpoint
    assert checkpoint.latest(rd).rollout == 1
    client, mlflow_run = _mlflow(root, "t")
    steps = [m.step for m in client.get_metric_history(mlflow_run, "reward_mean")]
    assert steps == [0], steps


def _store_runs(db: Path, run_id: str):
    from mlflow.tracking import MlflowClient
    client = MlflowClient(f"sqlite:///{db}", registry_uri=f"sqlite:///{db}")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()],
                              filter_string=f"tags.`grpoflow.run_id` = '{run_id}'")
    return client, runs


def test_a_run_moved_to_another_root_is_tracked_there(prefect_harness, reference_run, tmp_path, capsys):
    """~40 s. A run directory moved from a root that is gone to another root, resumed with `--root NEW`: its MLflow
    run is made again in NEW's store from the run directory (the earlier rollouts' metrics equal to the old
    store's, then the new ones; versions registered from NEW's exports), printed paths are NEW's, the old root is
    not made again, and no other store is written."""
    import hashlib

    from runtime.run.frozen_config import frozen_config, frozen_text, rebased
    ref_root = Path(reference_run["root"])
    ref_store = hashlib.sha256((ref_root / "mlflow.db").read_bytes()).hexdigest()
    gone, new_root = tmp_path / "gone", tmp_path / "new"
    shutil.copytree(ref_root / "runs" / "ref", new_root / "runs" / "ref")
    rd = RunDir(str(new_root), "ref")
    # as if it had run under `gone`, tracked in gone's store, and been moved out before that root was removed
    Path(rd.config).write_text(frozen_text(rebased(frozen_config(rd), str(gone))))
    record = json.loads(Path(rd.sub("tracking.json")).read_text())
    Path(rd.sub("tracking.json")).write_text(json.dumps({**record, "tracking_uri": f"sqlite:///{gone}/mlflow.db"}))

    assert main(["resume", "ref", "--root", str(new_root), "--set", "train.num_rollout=6"]) == 0, \
        capsys.readouterr().err[-3000:]
    out = capsys.readouterr().out
    assert f"run ref was tracked in sqlite:///{gone}/mlflow.db; its MLflow run is made again in " \
           f"sqlite:///{new_root}/mlflow.db" in out, out
    assert [line for line in out.splitlines() if str(gone) in line] == [out.splitlines()[0]], out
    assert f"run directory:        {new_root}/runs/ref" in out, out
    assert not gone.exists()
    assert hashlib.sha256((ref_root / "mlflow.db").read_bytes()).hexdigest() == ref_store
    assert frozen_config(rd).storage.root == str(new_root)
    assert json.loads(Path(rd.sub("tracking.json")).read_text())["tracking_uri"] == f"sqlite:///{new_root}/mlflow.db"

    old_client, [old_run] = _store_runs(ref_root / "mlflow.db", "ref")
    new_client, [new_run] = _store_runs(new_root / "mlflow.db", "ref")
    old_points = {(m.step, m.value) for m in old_client.get_metric_history(old_run.info.run_id, "reward_mean")}
    new_points = {(m.step, m.value) for m in new_client.get_metric_history(new_run.info.run_id, "reward_mean")}
    assert old_points < new_points and len(new_points) == len({s for s, _ in new_points}) == 6, (old_points, new_points)
    versions = [v for m in new_client.search_registered_models() for v in new_client.search_model_versions(f"name = '{m.name}'")]
    assert versions and all(str(new_root) in v.source for v in versions), [v.source for v in versions]


@pytest.mark.parametrize("damage", ["cut", "edited", "deleted"])
def test_a_damaged_frozen_config_is_refused_with_how_to_recover(reference_run, tmp_path, capsys, damage):
    """< 2 s each. config.yaml cut before a section, edited by hand, or deleted while checkpoints exist: `resume` and
    `runs` refuse it in one line naming the file and `grpoflow resume ref --root R --config FILE`; nothing changes."""
    root = _copy_reference(reference_run, tmp_path / "root")
    rd = RunDir(str(root), "ref")
    config = Path(rd.config)
    text = config.read_text()
    if damage == "cut":
        config.write_text(text[: text.index("\nstorage:")] + "\n")
    elif damage == "edited":
        config.write_text(text.replace("lr: 0.0005", "lr: 0.005"))
        assert config.read_text() != text
    else:
        config.unlink()
    before = sorted(p.name for p in config.parent.iterdir())
    assert main(["resume", "ref", "--root", str(root)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(config) in err[0] and f"`grpoflow resume ref --root {root} --config FILE`" in err[0], err
    assert ("checksum does not match" in err[0]) if damage != "deleted" else ("holds checkpoints/" in err[0]), err
    assert "nothing of it can be resumed" not in err[0]
    assert sorted(p.name for p in config.parent.iterdir()) == before
    assert main(["runs", "--root", str(root)]) == 0
    assert f"grpoflow resume ref --root {root} --config FILE" in capsys.readouterr().out


def test_resume_with_config_recovers_a_damaged_frozen_config(prefect_harness, reference_run, tmp_path, capsys):
    """~30 s. The recovery the refusal names: `resume ID --config FILE` with the config the run was started with
    replaces the damaged file (kept beside it) and the resume goes on; a FILE that would drop trained rollouts is
    refused."""
    from tests.conftest import REFERENCE_OVERRIDES
    root = _copy_reference(reference_run, tmp_path / "root")
    rd = RunDir(str(root), "ref")
    config = Path(rd.config)
    damaged = config.read_text()[:200]
    config.write_text(damaged)
    sets = sum((["--set", s] for s in REFERENCE_OVERRIDES), [])
    assert main(["resume", "ref", "--root", str(root), "--config", "configs/tiny.yaml", *sets,
                 "--set", "train.num_rollout=2"]) == 2
    assert "holds checkpoints/rollout_4" in capsys.readouterr().err
    assert config.read_text() == damaged
    assert main(["resume", "ref", "--root", str(root), "--config", "configs/tiny.yaml", *sets]) == 0, \
        capsys.readouterr().err[-3000:]
    kept = list(config.parent.glob("config.yaml.replaced-*"))
    assert len(kept) == 1 and kept[0].read_text() == damaged
    from runtime.run.frozen_config import frozen_config
    assert frozen_config(rd).train.num_rollout == 4
