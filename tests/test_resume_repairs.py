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
    from mlflow.tracking import MlflowClient
    doc = json.loads(Path(RunDir(str(root), run_id).sub("tracking.json")).read_text())
    return MlflowClient(doc["tracking_uri"], registry_uri=doc["tracking_uri"]), doc["mlflow_run_id"]


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
