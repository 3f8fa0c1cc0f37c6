"""Scheduled deployments against a real `prefect server start` on loopback, with a real process worker
and a real `grpoflow serve` process: a triggered run trains the tiny pipeline, a cron schedule makes
scheduled runs, overlapping runs of one deployment never run at once, an unfinished run is resumed.
Every process the module starts is stopped by pid (its process group and its descendants) in a finally."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest

from cli.deploy import main as deploy_main
from runtime.placement.ports import free_port

psutil = pytest.importorskip("psutil")
httpx = pytest.importorskip("httpx")

REPO = Path(__file__).resolve().parents[1]
PREFECT = str(Path(sys.executable).parent / "prefect")
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "CRASHED"}


# -- processes ------------------------------------------------------------------------------------
def _start(args: list[str], env: dict, log: Path) -> subprocess.Popen:
    with open(log, "ab") as out:
        return subprocess.Popen(args, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)


def _stop(proc: subprocess.Popen, grace_s: float = 15.0) -> None:
    """SIGTERM the process group and every descendant (flow-run processes have sessions of their own),
    SIGKILL whatever is left after `grace_s`; returns within about grace_s + 5 s."""
    try:
        kids = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        kids = []
    targets = [proc.pid] + [k.pid for k in kids]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in targets:
            for kill in (os.killpg, os.kill):
                try:
                    kill(pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
        try:
            proc.wait(timeout=grace_s if sig == signal.SIGTERM else 5)
        except subprocess.TimeoutExpired:
            continue
        _, alive = psutil.wait_procs(kids, timeout=grace_s if sig == signal.SIGTERM else 5)
        if not alive:
            return
        kids = alive
        targets = [k.pid for k in alive]


def _run(args: list[str], env: dict, timeout: float) -> subprocess.CompletedProcess:
    proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        return subprocess.CompletedProcess(args, proc.returncode, out, "")
    finally:
        _stop(proc)


def _tail(path: Path, n: int = 60) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-n:]) if path.exists() else ""


class _Api:
    """The server's REST API. Like Prefect's own client, retry 429/502/503: the SQLite-backed server answers
    503 when its database is briefly locked on a busy machine. A request may also wait out the server's own lock
    timeout (60 s: its worker heartbeats and queue marking contend for SQLite's one writer, PrefectHQ/prefect#17566
    and #23051; seen once here, a GET held past 30 s): the client waits longer than that, and a GET (never a write,
    which may have been applied) asks again once."""

    def __init__(self, url: str):
        self.client = httpx.Client(base_url=url, timeout=90)

    def request(self, method: str, path: str, **kw) -> httpx.Response:
        timeouts = 0
        for _ in range(40):
            try:
                r = self.client.request(method, path, **kw)
            except httpx.TimeoutException:
                timeouts += 1
                if method != "GET" or timeouts > 1:
                    raise
                continue
            if r.status_code not in (429, 502, 503):
                break
            time.sleep(0.5)
        return r

    def get(self, path: str, **kw) -> httpx.Response:
        return self.request("GET", path, **kw)

    def post(self, path: str, **kw) -> httpx.Response:
        return self.request("POST", path, **kw)

    def delete(self, path: str, **kw) -> httpx.Response:
        return self.request("DELETE", path, **kw)


# -- the server, the worker, the deployment ---------------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("prefect")
    port = free_port()
    url = f"http://127.0.0.1:{port}/api"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env.update({
        "PREFECT_HOME": str(tmp / "home"), "PREFECT_API_URL": url, "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_UI_ENABLED": "false", "PREFECT_LOGGING_LEVEL": "INFO",
        "PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS": "2",          # cron runs appear in seconds
        "PREFECT_SERVER_DEPLOYMENTS_CONCURRENCY_SLOT_WAIT_SECONDS": "2",  # an enqueued run retries every 2 s
        "PREFECT_WORKER_QUERY_SECONDS": "2", "PREFECT_RUNNER_POLL_FREQUENCY": "2",
    })
    log = tmp / "server.log"
    proc = _start([PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)], env, log)
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, f"server did not start:\n{_tail(log)}"
            time.sleep(0.5)
        api = _Api(url)
        try:
            yield {"url": url, "env": env, "tmp": tmp, "api": api, "log": log}
        finally:
            api.client.close()
    finally:
        _stop(proc)


def _deploy(server, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return _run([sys.executable, "-m", "cli.deploy", "deploy", "configs/tiny.yaml", *args],
                env or server["env"], timeout=120)


def _tiny(root: Path) -> list[str]:
    # one chunk of 2 rollouts at half the tiny batch, a small eval, no MLflow: seconds of work per run
    sets = ["train.num_rollout=2", "checkpoint.interval=2", "eval.interval=null", "eval.max_prompts=8",
            "rollout.rollout_batch_size=4", "train.global_batch_size=64", "train.micro_batch_size=32", "tracking.enabled=false",
            f"storage.root={root}"]
    return [a for s in sets for a in ("--set", s)]


def _deployment(api, name: str) -> dict:
    r = api.get(f"/deployments/name/grpo-scheduled/{name}")
    r.raise_for_status()
    return r.json()


def _flow_runs(api, deployment_id: str, state_types: list[str] | None = None) -> list[dict]:
    body = {"deployments": {"id": {"any_": [deployment_id]}}, "sort": "EXPECTED_START_TIME_ASC"}
    if state_types:
        body["flow_runs"] = {"state": {"type": {"any_": state_types}}}
    r = api.post("/flow_runs/filter", json=body)
    r.raise_for_status()
    return r.json()


def _trigger(api, deployment_id: str, parameters: dict | None = None) -> str:
    r = api.post(f"/deployments/{deployment_id}/create_flow_run", json={"parameters": parameters or {}})
    assert r.status_code == 201, r.text
    return r.json()["id"]


def _states(api, flow_run_id: str) -> list[dict]:
    r = api.get("/flow_run_states/", params={"flow_run_id": flow_run_id})
    r.raise_for_status()
    return sorted(r.json(), key=lambda s: _when(s["timestamp"]))


def _when(iso: str) -> datetime:
    return datetime.fromisoformat(iso.replace("Z", "+00:00"))


def _wait_terminal(api, ids: list[str], timeout: float, logs: list[Path]) -> dict[str, dict]:
    deadline = time.monotonic() + timeout
    while True:
        runs = {i: api.get(f"/flow_runs/{i}").json() for i in ids}
        if all(r["state_type"] in TERMINAL for r in runs.values()):
            return runs
        assert time.monotonic() < deadline, (
            f"runs not finished in {timeout} s: {[r.get('state_name') for r in runs.values()]}\n"
            + "\n".join(_tail(p) for p in logs))
        time.sleep(1)


@pytest.fixture(scope="module")
def nightly(server):
    """`grpoflow deploy` of the tiny pipeline (no schedule: runs here come only from triggers), and a
    process worker on its pool for the whole module."""
    root = server["tmp"] / "root"
    no_url = {k: v for k, v in server["env"].items() if k != "PREFECT_API_URL"}  # --api-url instead
    res = _deploy(server, "--name", "nightly", "--cron", "", "--pool", "grpoflow-test", "--api-url", server["url"],
                  *_tiny(root), env=no_url)
    assert res.returncode == 0, res.stdout
    assert "grpo-scheduled/nightly registered" in res.stdout and "(created)" in res.stdout
    log = server["tmp"] / "worker.log"
    worker = _start([PREFECT, "worker", "start", "--pool", "grpoflow-test"], server["env"], log)
    try:
        yield {"root": root, "deployment": _deployment(server["api"], "nightly"), "worker_log": log}
    finally:
        _stop(worker)


@pytest.fixture(scope="module")
def first_run(server, nightly):
    """The deployment triggered once with `prefect deployment run --watch`, as a user would."""
    res = _run([PREFECT, "deployment", "run", "grpo-scheduled/nightly", "--watch", "--watch-timeout", "240"],
               server["env"], timeout=260)
    runs = sorted(p.name for p in (nightly["root"] / "runs").iterdir())
    return {"result": res, "runs": runs}


# -- user mistakes: one line, exit 2, before any API is contacted -------------------------------------
@pytest.mark.parametrize("args, expect", [
    (["--cron", "every night"], "is not a valid schedule"),
    (["--timezone", "Mars/Base"], "is not an IANA timezone"),
    (["--set", "train.nope=1"], "unknown key 'train.nope'"),
    (["--run-prefix", "a b"], "run prefix 'a b'"),
])
def test_deploy_user_errors_are_one_line(args, expect, capsys):
    assert deploy_main(["deploy", "configs/tiny.yaml", "--api-url", "http://127.0.0.1:9/api", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and expect in err and "\n" not in err, err


def test_deploy_without_a_reachable_api_is_a_user_error(capsys):
    port = free_port()  # nothing listens there
    assert deploy_main(["deploy", "configs/tiny.yaml", "--api-url", f"http://127.0.0.1:{port}/api"]) == 2
    err = capsys.readouterr().err.strip()
    assert "cannot reach the Prefect API" in err and "\n" not in err, err


# -- against the server ----------------------------------------------------------------------------
def test_cron_schedule_creates_scheduled_runs(server, tmp_path):
    # a pool with no worker: the every-minute runs are made, never executed
    res = _deploy(server, "--name", "every-minute", "--cron", "* * * * *", "--pool", "idle", *_tiny(tmp_path))
    assert res.returncode == 0, res.stdout
    api = server["api"]
    dep = _deployment(api, "every-minute")
    assert dep["global_concurrency_limit"]["limit"] == 1
    assert dep["concurrency_options"]["collision_strategy"] == "ENQUEUE"
    assert dep["parameters"]["run_prefix"] == "every-minute" and dep["parameters"]["resume_unfinished"] is True
    assert dep["parameters"]["config_path"] == str(REPO / "configs" / "tiny.yaml")
    deadline = time.monotonic() + 60
    while len(runs := _flow_runs(api, dep["id"], ["SCHEDULED"])) < 3:
        assert time.monotonic() < deadline, f"no scheduled runs after 60 s:\n{_tail(server['log'])}"
        time.sleep(1)
    starts = [_when(r["expected_start_time"]) for r in runs[:3]]
    assert all(s.second == 0 and s.microsecond == 0 for s in starts), starts
    assert [(b - a).total_seconds() for a, b in zip(starts, starts[1:])] == [60.0, 60.0]
    api.delete(f"/deployments/{dep['id']}").raise_for_status()


def test_prefect_yaml_deploys_against_a_process_pool(server):
    # pool `grpoflow` has no worker here, so the nightly run at 03:00 is made but never executed
    env = server["env"]
    res = _run([PREFECT, "work-pool", "create", "grpoflow", "--type", "process"], env, timeout=60)
    assert res.returncode == 0, res.stdout
    res = _run([PREFECT, "--no-prompt", "deploy", "--all"], env, timeout=120)
    assert res.returncode == 0, res.stdout
    api = server["api"]
    dep = _deployment(api, "tiny-nightly")
    assert dep["entrypoint"] == "deployments/scheduled.py:scheduled_grpo"
    assert dep["pull_steps"] == [{"prefect.deployments.steps.set_working_directory": {"directory": str(REPO)}}]
    assert dep["global_concurrency_limit"]["limit"] == 1
    assert dep["concurrency_options"]["collision_strategy"] == "ENQUEUE"
    assert [s["schedule"]["cron"] for s in dep["schedules"]] == ["0 3 * * *"]
    deadline = time.monotonic() + 60
    while not (runs := _flow_runs(api, dep["id"], ["SCHEDULED"])):
        assert time.monotonic() < deadline, f"no scheduled runs after 60 s:\n{_tail(server['log'])}"
        time.sleep(1)
    first = _when(runs[0]["expected_start_time"])
    assert (first.hour, first.minute, first.second) == (3, 0, 0), first
    api.delete(f"/deployments/{dep['id']}").raise_for_status()


def test_triggered_deployment_runs_the_tiny_pipeline(first_run, nightly):
    res = first_run["result"]
    assert res.returncode == 0 and "Completed" in res.stdout, res.stdout + _tail(nightly["worker_log"])
    assert len(first_run["runs"]) == 1 and first_run["runs"][0].startswith("nightly-"), first_run["runs"]
    run = nightly["root"] / "runs" / first_run["runs"][0]
    assert (run / "checkpoints" / "rollout_2" / "manifest.json").is_file()
    assert json.loads((run / "checkpoints" / "latest").read_text())["rollout"] == 2


def test_overlapping_runs_wait_and_an_unfinished_run_is_resumed(server, nightly, first_run):
    api, dep = server["api"], nightly["deployment"]
    run = nightly["root"] / "runs" / first_run["runs"][0]
    # The disk state of a run killed during its only chunk: the checkpoint was never renamed into place,
    # `latest` never moved, no eval. (A checkpoint is written under a temp name and renamed, so a kill
    # leaves exactly this.)
    for p in ("checkpoints/rollout_2", "checkpoints/latest", "eval"):
        target = run / p
        shutil.rmtree(target) if target.is_dir() else target.unlink(missing_ok=True)

    ids = [_trigger(api, dep["id"]) for _ in range(2)]
    runs = _wait_terminal(api, ids, timeout=300, logs=[nightly["worker_log"], server["log"]])
    assert [r["state_type"] for r in runs.values()] == ["COMPLETED", "COMPLETED"], \
        [r["state"] for r in runs.values()]

    # never Running at once: each run's Running spans (Running → its next state) are disjoint
    spans, names = [], []
    for i in ids:
        states = _states(api, i)
        names += [s["name"] for s in states]
        for cur, nxt in zip(states, states[1:]):
            if cur["type"] == "RUNNING":
                spans.append((_when(cur["timestamp"]), _when(nxt["timestamp"])))
    spans.sort()
    assert len(spans) == 2 and spans[0][1] <= spans[1][0], spans
    assert "AwaitingConcurrencySlot" in names, names  # the second one was held back by the server

    # the first to run resumed the unfinished run; the second found it finished and started a new one
    now = sorted(p.name for p in (nightly["root"] / "runs").iterdir())
    assert len(now) == 2 and now[0] == run.name, now
    for rid in now:
        latest = json.loads((nightly["root"] / "runs" / rid / "checkpoints" / "latest").read_text())
        assert latest["rollout"] == 2, rid


def test_serve_process_runs_flow_runs_and_stops_on_sigterm(server, tmp_path):
    log = tmp_path / "serve.log"
    serve = _start([sys.executable, "-m", "cli.deploy", "serve", "configs/tiny.yaml", "--name", "served",
                    *_tiny(tmp_path)], server["env"], log)
    api = server["api"]
    try:
        deadline = time.monotonic() + 60
        while api.get("/deployments/name/grpo-scheduled/served").status_code != 200:
            assert serve.poll() is None and time.monotonic() < deadline, _tail(log)
            time.sleep(0.5)
        dep = _deployment(api, "served")
        assert dep["global_concurrency_limit"]["limit"] == 1
        # a run with a bad override: the served flow starts, reads the config and fails with the one-line error
        fr = _trigger(api, dep["id"], {"overrides": ["train.nope=1"]})
        run = _wait_terminal(api, [fr], timeout=120, logs=[log])[fr]
        assert run["state_type"] == "FAILED", run["state"]
        assert "unknown key 'train.nope'" in run["state"]["message"], run["state"]["message"]
        os.killpg(serve.pid, signal.SIGTERM)
        serve.wait(timeout=30)  # stops on SIGTERM (a hang fails here, a bound not a measurement)
    finally:
        _stop(serve)
