"""`make demo` as a user sees it: `grpoflow run configs/demo.yaml` through the CLI, started from a shell
without the venv on PATH (make runs `.venv/bin/grpoflow`; nothing activates the venv), writing to the
config's relative storage root, ./grpoflow-data.

- Its live table counts rollout i/N with the elapsed time and an ETA at the pace so far.
- The reward it shows climbs from its starting level to a mean >= 0.35 over the last 5 rollouts (seed 1, the
  config's, measured ~0.9 since the grader reads a sample cut at max_new_tokens as stating nothing).
- The commands it prints at the end run, as printed, from that same shell: the report, the registry
  listing and the MLflow UI (which must answer on its port).
- Every registered version whose export retention kept (tracking.keep_exports) opens from another working directory,
  and only the oldest versions' exports are removed.
"""
from __future__ import annotations

import json
import os
import re
import signal
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from tests.waiting import wait_healthy

REPO = Path(__file__).resolve().parents[1]
ROW = re.compile(r"^\s*(\d+)/(\d+)\s+(\d+(?::\d\d)+)\s+(\d+(?::\d\d)+)\s")


def _seconds(clock: str) -> int:
    total = 0
    for part in clock.split(":"):
        total = total * 60 + int(part)
    return total


def _shell_without_the_venv() -> dict[str, str]:
    venv_bin = Path(sys.executable).parent.resolve()
    path = [p for p in os.environ.get("PATH", "").split(os.pathsep) if p and Path(p).resolve() != venv_bin]
    return {**os.environ, "PATH": os.pathsep.join(path or ["/usr/bin", "/bin"])}


def _run_as_printed(line: str, env: dict[str, str]) -> str:
    proc = subprocess.run(["/bin/sh", "-c", line], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"`{line}` exited {proc.returncode}:\n{proc.stdout[-1500:]}{proc.stderr[-1500:]}"
    return proc.stdout


def _serves_as_printed(line: str, env: dict[str, str], log: Path) -> None:
    """Start the printed server command, wait until it answers /health (or exits: failed), then stop it."""
    from runtime.placement.ports import free_port

    port = free_port("127.0.0.1")
    # the port and one worker through MLflow's own variables: the command line stays as printed
    env = {**env, "MLFLOW_PORT": str(port), "MLFLOW_WORKERS": "1"}
    with log.open("w") as out:
        proc = subprocess.Popen(["/bin/sh", "-c", f"exec {line}"], env=env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_healthy(f"http://127.0.0.1:{port}/health", proc, timeout_s=180, log=log)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


@pytest.mark.slow
def test_make_demo_learns_shows_progress_and_its_next_commands_run_as_printed(prefect_harness, tmp_path, capsys,
                                                                               monkeypatch):
    from cli.main import main

    shell = _shell_without_the_venv()
    monkeypatch.setenv("PATH", shell["PATH"])
    user_dir = tmp_path / "user"
    user_dir.mkdir()
    monkeypatch.chdir(user_dir)  # storage.root ./grpoflow-data lands here
    code = main(["run", str(REPO / "configs" / "demo.yaml"), "--run-id", "demo"])
    out, err = capsys.readouterr()
    assert code == 0, err[-3000:]
    lines = out.splitlines()

    # the live table: rollout i/N, elapsed, ETA = rollouts left at the pace so far
    from runtime.config import load_config
    demo = load_config(REPO / "configs" / "demo.yaml")
    n = demo.train.num_rollout
    head = next(line for line in lines if line.split()[:3] == ["rollout", "elapsed", "eta"])
    reward_col = head.split().index("reward")
    rows = [(m, line.split()) for line in lines if (m := ROW.match(line))]
    assert [(int(m[1]), int(m[2])) for m, _ in rows] == [(i, n) for i in range(1, n + 1)], out[-3000:]
    elapsed = [_seconds(m[3]) for m, _ in rows]
    eta = [_seconds(m[4]) for m, _ in rows]
    assert elapsed == sorted(elapsed) and eta[0] > 0 and eta[-1] == 0, (elapsed, eta)
    for i, (e, left) in enumerate(zip(elapsed, eta), start=1):  # clocks round to the second
        assert abs(left - (n - i) * e / i) <= 0.5 * (n - i) / i + 1, (i, e, left)

    # it learns, as the table shows it
    rewards = [float(cells[reward_col]) for _, cells in rows]
    first, last = statistics.fmean(rewards[:5]), statistics.fmean(rewards[-5:])
    assert first < 0.1 and last >= 0.35, (first, last, rewards)

    # the next commands, verbatim, from the same shell
    nxt = [line.strip() for line in lines[lines.index("next:") + 1:] if line.startswith("  ")]
    assert [c.split()[1:3] for c in nxt[:2]] == [["report", "demo"], ["models", "list"]], nxt
    assert nxt[2].split()[1] == "ui", nxt
    assert "report of run demo" in _run_as_printed(nxt[0], shell)
    assert "demo" in _run_as_printed(nxt[1], shell)
    _serves_as_printed(nxt[2], shell, tmp_path / "mlflow-ui.log")

    # the registry's sources resolve through MLflow from anywhere
    import mlflow.artifacts

    from runtime.tracking.mlflow_tracker import make_client, store_uri_for_root
    client = make_client(store_uri_for_root(str(user_dir / "grpoflow-data")))
    monkeypatch.chdir(tmp_path)
    versions = client.search_model_versions("name = 'demo'")
    assert sorted(int(v.tags["grpoflow.rollout"]) for v in versions) == [p for p in demo.eval_points() if p]
    from runtime.tracking.export_retention import EXPORT_REMOVED_TAG
    kept = [v for v in versions if EXPORT_REMOVED_TAG not in v.tags]
    # tracking.keep_exports (2): the exports of best and of the last two versions stay; an older one's is removed
    must_keep = {int(client.get_registered_model("demo").aliases["best"])} | \
        {int(v.version) for v in sorted(versions, key=lambda v: int(v.version))[-2:]}
    assert must_keep <= {int(v.version) for v in kept}, [(v.version, dict(v.tags)) for v in versions]
    for v in kept:
        source = client.get_model_version("demo", v.version).source
        assert source.startswith("file:///"), source
        got = Path(mlflow.artifacts.download_artifacts(artifact_uri=source, dst_path=str(tmp_path / f"v{v.version}")))
        assert json.loads((got / "config.json").read_text())["model_type"] == "qwen3"
        assert (got / "model.safetensors").is_file()
