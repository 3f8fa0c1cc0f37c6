"""Secrets in a config never reach a printed line or a stored message (issue 62, class 9): credentials in a source
or root URI are refused in one masked line before anything starts; a token the config takes (a secret-named
query parameter, an ``--api-key`` among rollout.sglang.launch's args) is masked in the plan, in a failed task's
line, in what Prefect stores (flow and task runs, their states, events and logs: its whole database) and in
MLflow's params and tags.
"""
from __future__ import annotations

import glob
import uuid
from pathlib import Path

import pytest

from cli.main import main
from tests.conftest import SMALL_BATCH


def _secret() -> str:
    return f"sekrit{uuid.uuid4().hex[:12]}"  # unique: finding it anywhere is a leak


@pytest.mark.parametrize("field", ["model.source", "data.train.source", "data.eval.copy.source", "storage.root"])
def test_credentials_in_a_uri_are_refused_masked(field, capsys, tmp_path):
    secret = _secret()
    uri = f"s3://alice:{secret}@bucket/x" + ("" if field in ("model.source", "storage.root") else "/train.jsonl")
    for command in ("validate", "run"):
        args = [command, "configs/tiny.yaml", "--set", f"{field}={uri}"]
        if command == "run":
            args += ["--run-id", "creds"] + (["--set", f"storage.root={tmp_path}"] if field != "storage.root" else [])
        assert main(args) == 2
        out, err = capsys.readouterr()
        lines = err.strip().splitlines()
        assert len(lines) == 1 and f"{field}: s3://alice:***@bucket/x" in lines[0], lines
        assert "credentials do not belong in the URI" in lines[0] and "AWS_ACCESS_KEY_ID" in lines[0]
        assert secret not in out + err
    assert not list(tmp_path.iterdir())  # refused before anything was written


def _prefect_stored() -> tuple[str, bytes]:
    """What the harness's Prefect API holds: its flow and task runs as the client reads them, and its database."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_SERVER_DATABASE_CONNECTION_URL
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs() + client.read_task_runs()
        text = "\n".join(r.model_dump_json() for r in runs)
    db = PREFECT_SERVER_DATABASE_CONNECTION_URL.value().split("///", 1)[1]
    return text, b"".join(Path(p).read_bytes() for p in glob.glob(db + "*"))


def _tree_bytes(root: Path) -> bytes:
    return b"".join(p.read_bytes() for p in root.rglob("*") if p.is_file())


def test_a_token_is_masked_in_the_plan_a_failed_task_and_prefect(prefect_harness, capsys, tmp_path):
    """A token in a data source's query: the source is fetched by a Prefect task, which fails (a .jsonl file
    with a query names no file); the plan line, the one error line and Prefect's records of the
    flow and the task hold the source with the token masked, never the token."""
    secret = _secret()
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "copy 3 = ?", "label": "3"}\n')
    source = f"file://{data}?api_token={secret}"
    code = main(["run", "configs/tiny.yaml", "--run-id", "token", "--set", f"storage.root={tmp_path / 'root'}",
                 "--set", f"data.train.source={source}"])
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err[-3000:]
    masked = f"file://{data}?api_token=***"
    assert f"train data    {masked}" in out and masked in lines[0], (out, lines)
    stored, database = _prefect_stored()
    assert "dataset file not found" in stored and masked in stored  # the failed task's state is there
    assert secret not in out + err + stored
    assert secret.encode() not in database
    if (tmp_path / "root").exists():
        assert secret.encode() not in _tree_bytes(tmp_path / "root")


def test_a_secret_in_a_finished_run_is_in_no_record(prefect_harness, capsys, tmp_path):
    """A run that finishes with an --api-key among rollout.sglang.launch's args (read by the SGLang backend only):
    the flow's parameters, Prefect's database, MLflow's params and tags and the run directory hold no secret."""
    from mlflow.tracking import MlflowClient

    from runtime.tracking.mlflow_tracker import store_uri_for_root
    secret = _secret()
    root = tmp_path / "root"
    sets = [f"storage.root={root}", "train.num_rollout=2", "checkpoint.interval=2", "eval.interval=null",
            "eval.max_prompts=4", "eval.n_samples_per_prompt=1", "eval.pass_k=[1]", *SMALL_BATCH,
            f"rollout.sglang.launch=[python, -m, sglang.launch_server, --api-key, {secret}]"]
    code = main(["run", "configs/tiny.yaml", "--run-id", "apikey", *sum((["--set", s] for s in sets), [])])
    out, err = capsys.readouterr()
    assert code == 0, err[-3000:]
    assert secret not in out + err
    stored, database = _prefect_stored()
    assert "--api-key" in stored and secret not in stored  # the flow's parameters: the overrides, masked
    assert secret.encode() not in database
    client = MlflowClient(store_uri_for_root(str(root)))
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert runs
    params = {k: v for r in runs for k, v in {**r.data.params, **r.data.tags}.items()}
    assert "--api-key" in params["rollout.sglang.launch"], params.get("rollout.sglang.launch")
    assert not [k for k, v in params.items() if secret in v]
    assert secret.encode() not in _tree_bytes(root)  # frozen config, lease, MLflow store, checkpoints, exports


@pytest.mark.parametrize("command", ["resume", "runs", "report"])
def test_credentials_in_a_root_argument_are_refused_masked(command, capsys):
    """--root is no config field: the storage layer refuses credentials in any S3 URI it is handed."""
    secret = _secret()
    root = f"s3://alice:{secret}@bucket/x"
    args = {"resume": ["resume", "r1", "--root", root], "runs": ["runs", "--root", root],
            "report": ["report", "r1", "--root", root]}[command]
    assert main(args) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "s3://alice:***@bucket/x" in lines[0] and "credentials do not belong" in lines[0], lines
    assert secret not in out + err


def test_a_tasks_exception_is_masked_before_prefect_stores_it(tmp_path):
    """Any exception leaving a task or the flow (tasks.common.masked_errors), not only our one-line errors: its
    message, an OSError's file name and the exceptions it chains from hold no secret of the loaded config, even
    where a library quotes the secret without its URI; its type is kept (retries are decided by type)."""
    from runtime.config import load_config
    from tasks.common import masked_errors
    secret = _secret()
    load_config("configs/tiny.yaml", [f"data.train.source=s3://bucket/train.jsonl?x-amz-security-token={secret}"])

    @masked_errors
    def fetch_like():
        try:
            raise FileNotFoundError(2, "No such file", f"/cache/bucket/train.jsonl?x-amz-security-token={secret}")
        except FileNotFoundError as err:
            raise ValueError(f'Invalid bucket name "{secret}@bucket"') from err

    with pytest.raises(ValueError) as caught:
        fetch_like()
    cause = caught.value.__cause__
    assert isinstance(cause, FileNotFoundError) and cause.filename.endswith("x-amz-security-token=***")
    assert str(caught.value) == 'Invalid bucket name "***@bucket"'
    assert secret not in str(caught.value) + str(cause)
