"""A run's terminal shows the run (plan, live table, summary, grpoflow's own warnings, the error line); what the
libraries say goes to runs/<id>/logs/run.log (runtime/run/run_log.py)."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from runtime.errors import ConfigError
from runtime.run.directory import RunDir
from runtime.run.run_log import RunLog, log_path, settle, terminal_out

# What libraries print in a run, as they print it (MLflow, alembic, Ray, c10d, NCCL, Prefect, warnings).
CHATTER = ["MLflow", "alembic", "Creating initial", "UserWarning", "Warning", "barrier", "NCCL", "token authentication",
           "Token authentication", "Started a local Ray instance", "Created flow run", "Finished in state",
           "Beginning flow run", "HTTP Request", "pid="]


def _say_everything(child: bool = True) -> None:
    """Output by every path a library takes: Python's streams, fd 2 from C, warnings, a library's logger, a
    child process that inherits the fds (a spawned trainer rank, Ray's processes)."""
    print("library stdout line")
    sys.stderr.write("library stderr line\n")
    sys.stderr.flush()
    os.write(2, b"fd2 line as NCCL writes it\n")
    warnings.warn("a UserWarning of a library, barrier()", UserWarning, stacklevel=1)
    logging.getLogger("some.library").warning("library logger line")
    if child:
        subprocess.run([sys.executable, "-c", "import sys; print('child stdout line'); "
                        "print('child stderr line', file=sys.stderr)"], check=True)


def test_library_output_goes_to_the_run_log_and_the_run_to_the_terminal(tmp_path, capfd):
    from cli.main import _setup_logging
    _setup_logging("WARNING")
    rd = RunDir(str(tmp_path / "root"), "r1")
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        with RunLog("r1", "run") as log:
            pending = log._pending
            _say_everything()
            print("rollout 1/2 row", file=terminal_out())
            logging.getLogger("runtime.test").warning("grpoflow's own warning")
            settle(rd)  # the run directory is the run's: the log moves in
            print("library line after the move")
            print("rollout 2/2 row", file=terminal_out())
    out, err = capfd.readouterr()
    assert out.splitlines() == ["rollout 1/2 row", "rollout 2/2 row"], out
    assert "grpoflow's own warning" in err and len(err.strip().splitlines()) == 1, err
    text = log_path(rd).read_text()
    for line in ("library stdout line", "library stderr line", "fd2 line as NCCL writes it", "UserWarning",
                 "library logger line", "child stdout line", "child stderr line", "library line after the move",
                 "grpoflow's own warning"):
        assert line in text, (line, text)
    assert text.startswith("==== grpoflow run r1: ")
    assert not pending.exists()
    # the streams are the process's again
    print("after the run")
    os.write(2, b"fd2 after the run\n")
    out, err = capfd.readouterr()
    assert out == "after the run\n" and err == "fd2 after the run\n"


def test_a_failed_run_shows_where_its_log_is_and_its_last_lines(tmp_path, capfd):
    rd = RunDir(str(tmp_path / "root"), "r2")
    with pytest.raises(RuntimeError):
        with RunLog("r2", "resume"):
            settle(rd)
            print("the last thing a library said")
            raise RuntimeError("boom")
    err = capfd.readouterr().err
    assert f"the run's log: {log_path(rd)}; its last" in err, err
    assert err.strip().splitlines()[-1] == "  | the last thing a library said", err


def test_a_refused_run_leaves_no_log_and_no_tail(tmp_path, capfd):
    with pytest.raises(ConfigError):
        with RunLog("r3", "run") as log:
            pending = log._pending
            print("Prefect's start-up chatter")
            raise ConfigError("a user mistake, said in one line by the CLI")
    assert capfd.readouterr().err == ""
    assert not pending.exists() and not (tmp_path / "root").exists()


def test_with_log_level_the_libraries_stay_on_the_terminal(tmp_path, capfd):
    from cli.main import _parser
    assert _parser().parse_args(["run", "c.yaml", "--log-level", "INFO"]).log_level == "INFO"
    assert _parser().parse_args(["resume", "r", "--log-level", "DEBUG"]).log_level == "DEBUG"
    assert _parser().parse_args(["--log-level", "ERROR", "run", "c.yaml"]).log_level == "ERROR"
    assert _parser().parse_args(["run", "c.yaml"]).log_level is None
    rd = RunDir(str(tmp_path / "root"), "r4")
    with RunLog("r4", "run", quiet=False, level="INFO"):
        settle(rd)
        print("library stdout line")
        logging.getLogger("some.library").warning("library logger line")
    out, _ = capfd.readouterr()
    assert "library stdout line" in out
    assert "library logger line" in log_path(rd).read_text()  # the file keeps the log records


@pytest.mark.ray
def test_grpoflow_run_under_ray_prints_the_run_and_logs_the_libraries(prefect_harness, tmp_path):
    """The product path: `grpoflow run` of the tiny config under Ray, a fresh MLflow store, in a process of its
    own as a user starts it (every warning shown, so the actors have output for Ray to forward)."""
    import prefect.settings
    from tests.conftest import SMALL_BATCH
    root = tmp_path / "root"
    sets = [*SMALL_BATCH, "train.num_rollout=2", "checkpoint.interval=1", "eval.interval=null",
            f"storage.root={root}", "cluster.backend=ray"]
    env = dict(os.environ, PYTHONUNBUFFERED="1", PREFECT_API_URL=prefect.settings.PREFECT_API_URL.value(),
               PYTHONWARNINGS="always")
    env.pop("PREFECT_LOGGING_LEVEL", None)
    proc = subprocess.run([sys.executable, "-m", "cli.main", "run", "configs/tiny.yaml", "--run-id", "out",
                           *sum((["--set", s] for s in sets), [])],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out, err = proc.stdout, proc.stderr
    assert "golden rule" in out and "rollout  elapsed      eta" in out  # the plan and the live table
    stages = [line.split()[0] for line in out.splitlines() if " done in " in line and "│" not in line]
    assert stages == ["fetch", "prepare", "convert"], out  # a line per stage as it ends
    assert "    1/2 " in out and "    2/2 " in out
    assert "register" in out and "run directory:" in out and "next:" in out  # the summary
    log = log_path(RunDir(str(root), "out"))
    assert f"run log:              {log}" in out
    for pattern in CHATTER:
        assert pattern not in out + err, (pattern, out[-3000:], err[-3000:])
    assert err == "", err
    text = log.read_text()
    for pattern in ("Creating initial MLflow database tables", "Started a local Ray instance", "Finished in state",
                    "MegatronTrainer pid=", "DeprecationWarning"):  # the last two: a Ray actor's warnings, forwarded
        assert pattern in text, (pattern, text[-3000:])
