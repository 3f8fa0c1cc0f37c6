"""`grpoflow runs`: one line per run under a storage root — finished, running (who holds the lease),
stopped at a stage or at rollout N of M — with its last checkpoint, best eval and the command that
resumes it, read from the run directories (local and on S3). The runs are copies of the reference run,
cut back to what a run killed at that point leaves behind."""
from __future__ import annotations

import json
import os
import shutil
import socket
import time
from pathlib import Path

import pytest

from runtime import storage
from runtime.run.directory import RunDir
from runtime.run.lease import RunLease
from runtime.run.listing import list_runs
from tests.test_s3 import ROOT as S3_ROOT, s3  # noqa: F401 - the S3 server fixture


def _stopped_mid_training(rd: Path) -> None:
    """What a kill during the second chunk leaves: checkpoint 2 is latest, nothing of rollout 4."""
    shutil.rmtree(rd / "checkpoints" / "rollout_4")
    (rd / "checkpoints" / "latest").write_text(json.dumps({"rollout": 2, "dir": "rollout_2"}))
    for p in (rd / "eval" / "rollout_4.json", ):
        p.unlink()
    shutil.rmtree(rd / "exports", ignore_errors=True)


def _stopped_in_convert(rd: Path) -> None:
    for stage in ("convert", "prepare"):
        (rd / "stages" / f"{stage}.json").unlink()
    shutil.rmtree(rd / "checkpoints")
    shutil.rmtree(rd / "eval")
    shutil.rmtree(rd / "exports", ignore_errors=True)


@pytest.fixture(scope="module")
def runs_root(reference_run, tmp_path_factory):
    src = Path(reference_run["root"], "runs", reference_run["run_id"])
    root = tmp_path_factory.mktemp("runs-root")
    ignore = shutil.ignore_patterns("report", "lease.json")
    for name in ("done", "mid", "early", "live", "dead"):
        shutil.copytree(src, root / "runs" / name, ignore=ignore)
    _stopped_mid_training(root / "runs" / "mid")
    _stopped_in_convert(root / "runs" / "early")
    _stopped_mid_training(root / "runs" / "dead")
    # a holder that died on this host without releasing the lease: not running
    (root / "runs" / "dead" / "lease.json").write_text(json.dumps(
        {"token": "x", "pid": 2 ** 22 + 1, "host": socket.gethostname(), "heartbeat": time.time()}))
    (root / "runs" / "empty").mkdir()  # a run that died before freezing its config
    return str(root)


def test_local_root_one_line_per_run(runs_root, reference_run, capsys):
    from cli.main import main
    eval4 = reference_run["result"]["train"]["evals"][4]["copy"]["avg@4"]
    with RunLease(RunDir(runs_root, "live")):
        by_id = {r.run_id: r for r in list_runs(runs_root)}
        assert main(["runs", "--root", runs_root]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["RUN", "CONFIG", "STATE", "CHECKPOINT", "BEST", "EVAL", "RESUME"]
    assert [ln.split()[0] for ln in lines[1:]] == ["dead", "done", "early", "empty", "live", "mid"]

    done = by_id["done"]
    assert (done.state, done.checkpoint, done.resume) == ("finished", 4, "-")
    assert done.config_name == "tiny" and done.best_eval == f"copy avg@4 {eval4:.3f} at 4"

    live = by_id["live"]
    assert live.state == "running" and f"pid {os.getpid()} on {socket.gethostname()}" in live.detail
    assert live.resume == "-"

    for rid in ("mid", "dead"):
        r = by_id[rid]
        assert (r.state, r.detail, r.checkpoint, r.best_eval) == ("stopped", "at rollout 2 of 4", 2, "-")
        assert r.resume == f"grpoflow resume {rid} --root {runs_root}"

    early = by_id["early"]
    assert (early.state, early.detail, early.checkpoint) == ("stopped", "at stage convert", None)
    empty = by_id["empty"]  # a run directory without its frozen config (nor a lease that says how it started)
    assert (empty.state, empty.detail) == ("stopped", "before its config was frozen")
    assert empty.resume == f"grpoflow run CONFIG --run-id empty --set storage.root={runs_root}"

    line = next(ln for ln in lines if ln.startswith("mid "))
    assert "stopped (at rollout 2 of 4)" in line and line.endswith(f"grpoflow resume mid --root {runs_root}")


def test_the_resume_command_it_prints_continues_the_run(runs_root):
    """The printed command is what `grpoflow resume` accepts for that run (it refuses a finished one)."""
    from runtime.run.frozen_config import finished, frozen_config
    for rid, done in (("done", True), ("mid", False)):
        rd = RunDir(runs_root, rid)
        assert finished(frozen_config(rd), rd) is done


def test_s3_root(s3, runs_root):  # noqa: F811
    root = f"{S3_ROOT}-listing"
    for rid in ("done", "mid"):
        storage.upload_dir(Path(runs_root, "runs", rid), storage.join(root, "runs", rid))
    by_id = {r.run_id: r for r in list_runs(root)}
    assert sorted(by_id) == ["done", "mid"]
    assert (by_id["done"].state, by_id["done"].checkpoint) == ("finished", 4)
    assert (by_id["mid"].state, by_id["mid"].detail) == ("stopped", "at rollout 2 of 4")
    assert by_id["mid"].resume == f"grpoflow resume mid --root {root}"
