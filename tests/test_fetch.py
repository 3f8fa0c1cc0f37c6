"""fetch_model / fetch_dataset: local copies, built-ins, and the Hugging Face hub offline.

The hub tests run in a subprocess because huggingface_hub and datasets read HF_HUB_OFFLINE and
HF_HOME when they are imported, exactly as a user's process does.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from runtime.inputs import synthetic
from runtime.errors import DataError, ModelError, TransientError
from runtime.inputs.fetch import fetch_dataset, fetch_model

REPO_ROOT = Path(__file__).resolve().parents[1]
SHA = "0123456789abcdef0123456789abcdef01234567"


def make_model_dir(path: Path, *, config: bool = True, weights: bool = True) -> Path:
    path.mkdir(parents=True)
    if config:
        (path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    if weights:
        (path / "model.safetensors").write_bytes(b"weights")
    (path / "tokenizer.json").write_text("{}")
    (path / "tokenizer_config.json").write_text("{}")
    (path / "pytorch_model.bin").write_bytes(b"legacy")  # not fetched: safetensors only
    (path / "optimizer.pt").write_bytes(b"state")
    (path / "original").mkdir()
    (path / "original" / "consolidated.safetensors").write_bytes(b"dup")  # sub-folders are not fetched
    return path


# -- models: local ---------------------------------------------------------------------------------
def test_local_model_dir_is_copied_with_only_the_needed_files(tmp_path):
    src = make_model_dir(tmp_path / "src")
    dest = tmp_path / "run" / "model" / "hf"
    report = fetch_model(str(src), str(dest))
    assert sorted(p.name for p in dest.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json",
                                                      "tokenizer_config.json"]
    assert report["kind"] == "local" and report["path"] == str(dest) and report["files"] == sorted(
        p.name for p in dest.iterdir())
    assert report["bytes"] == sum(p.stat().st_size for p in dest.iterdir())
    json.dumps(report)

    # a second fetch replaces the directory as a whole (a stale file does not survive) and leaves no scratch
    (dest / "stale.json").write_text("{}")
    fetch_model("file://" + str(src), str(dest))
    assert not (dest / "stale.json").exists()
    assert sorted(p.name for p in dest.parent.iterdir()) == ["hf"]


def test_missing_model_dir(tmp_path):
    with pytest.raises(ModelError) as err:
        fetch_model(str(tmp_path / "nope"), str(tmp_path / "dest"))
    assert str(err.value) == (f"model path does not exist: {tmp_path / 'nope'} "
                              f"(give a local dir, hf://org/name or s3://...)")
    assert not (tmp_path / "dest").exists()


def test_model_dir_without_config_or_weights(tmp_path):
    no_config = make_model_dir(tmp_path / "a", config=False)
    with pytest.raises(ModelError, match=rf"^{no_config}: no config.json \(not a Hugging Face model directory"):
        fetch_model(str(no_config), str(tmp_path / "dest"))
    no_weights = make_model_dir(tmp_path / "b", weights=False)
    with pytest.raises(ModelError, match=r"no \*.safetensors weights"):
        fetch_model(str(no_weights), str(tmp_path / "dest"))
    assert not (tmp_path / "dest").exists()


def test_bad_sources(tmp_path):
    with pytest.raises(ModelError, match="unknown built-in model"):
        fetch_model("builtin://huge-model", str(tmp_path / "d"))
    with pytest.raises(ModelError, match=r"expected hf://org/name\[@revision\]"):
        fetch_model("hf://just-a-name", str(tmp_path / "d"))


# -- models: built-in --------------------------------------------------------------------------------
def test_builtin_model_calls_the_tiny_builder_into_a_scratch_dir(tmp_path, monkeypatch):
    calls = []

    def build_tiny_qwen3(dest_dir, seed=0, num_experts=0):
        calls.append((dest_dir, seed, num_experts))
        make_model_dir(Path(dest_dir) / "x")  # lay out a model, then move it up into dest_dir
        for p in (Path(dest_dir) / "x").iterdir():
            if p.is_file():
                p.rename(Path(dest_dir) / p.name)

    fake = types.ModuleType("runtime.models.tiny")
    fake.build_tiny_qwen3 = build_tiny_qwen3
    monkeypatch.setitem(sys.modules, "runtime.models.tiny", fake)
    dest = tmp_path / "model" / "hf"
    report = fetch_model("builtin://tiny-qwen3", str(dest), builtin_seed=5)
    assert calls and calls[0][1:] == (5, 0) and calls[0][0] != str(dest)  # built beside, then renamed
    assert report["kind"] == "builtin" and (dest / "config.json").is_file()
    fetch_model("builtin://tiny-qwen3-moe", str(tmp_path / "moe"), builtin_seed=5)
    assert calls[1][1:] == (5, 4)  # the mixture of experts: 4 of them


def test_builtin_model_with_the_real_builder(tmp_path):
    pytest.importorskip("runtime.models.tiny", reason="runtime/models/tiny.py not written yet")
    dest = tmp_path / "hf"
    report = fetch_model("builtin://tiny-qwen3", str(dest), builtin_seed=0)
    assert (dest / "config.json").is_file() and any(n.endswith(".safetensors") for n in report["files"])


# -- models: how hub failures are classified ------------------------------------------------------------
def test_hub_failures_split_into_transient_and_user_errors(tmp_path, monkeypatch):
    import httpx2
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    def raising(exc):
        def snapshot_download(*args, **kwargs):
            raise exc
        return snapshot_download

    def wrapped(cause):
        try:
            raise LocalEntryNotFoundError("cannot find the files") from cause
        except LocalEntryNotFoundError as err:
            return err

    request = httpx2.Request("GET", "https://huggingface.co/api/models/org/name")
    cases = [
        (wrapped(httpx2.ReadTimeout("timed out", request=request)), TransientError),
        (wrapped(httpx2.ConnectError("Name or service not known", request=request)), ModelError),
        (httpx2.ReadError("connection reset", request=request), TransientError),  # mid-download
    ]
    for exc, expected in cases:
        monkeypatch.setattr(huggingface_hub, "snapshot_download", raising(exc))
        with pytest.raises(expected):
            fetch_model("hf://org/name", str(tmp_path / "d"))


# -- the hub, offline, in a fresh process ---------------------------------------------------------------
OFFLINE_SCRIPT = """
import json, sys
from runtime.inputs.fetch import fetch_dataset, fetch_model
from runtime.errors import UserError
out = []
for fn, args, kwargs in json.loads(sys.argv[1]):
    try:
        out.append({"ok": {"fetch_model": fetch_model, "fetch_dataset": fetch_dataset}[fn](*args, **kwargs)})
    except UserError as err:
        out.append({"error": type(err).__name__, "message": str(err)})
print("RESULT " + json.dumps(out))
"""


def run_offline(hf_home: Path, calls: list) -> list[dict]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_DATASETS_CACHE", "HF_TOKEN")}
    env.update(HF_HUB_OFFLINE="1", HF_HOME=str(hf_home), HF_DATASETS_OFFLINE="1", PYTHONPATH=str(REPO_ROOT))
    proc = subprocess.run([sys.executable, "-c", OFFLINE_SCRIPT, json.dumps(calls)], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def test_offline_with_an_empty_cache_says_how_to_pre_seed(tmp_path):
    home = tmp_path / "hf-home"
    home.mkdir()
    model, dataset = run_offline(home, [
        ("fetch_model", ["hf://Qwen/Qwen3-0.6B", str(tmp_path / "m")], {}),
        ("fetch_dataset", ["hf://BytedTsinghua-SIA/DAPO-Math-17k", str(tmp_path / "raw"), "train"], {}),
    ])
    assert model["error"] == "ModelError" and "\n" not in model["message"]
    assert model["message"].startswith("hf://Qwen/Qwen3-0.6B: not in the local Hugging Face cache")
    assert "`hf download Qwen/Qwen3-0.6B`" in model["message"] and "~/.cache/huggingface" in model["message"]
    assert "model.source" in model["message"]
    assert dataset["error"] == "DataError" and "\n" not in dataset["message"]
    assert "`hf download BytedTsinghua-SIA/DAPO-Math-17k --repo-type dataset`" in dataset["message"]
    assert "data.train.source" in dataset["message"]
    assert not (tmp_path / "m").exists()


def seed_hub_cache(home: Path) -> None:
    """Lay out what `hf download` leaves in $HF_HOME/hub: blobs, snapshot symlinks, refs/main."""
    repo = home / "hub" / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / SHA
    snap.mkdir(parents=True)
    files = {"config.json": b'{"model_type": "qwen3"}', "model.safetensors": b"weights",
             "tokenizer.json": b"{}", "pytorch_model.bin": b"legacy"}
    for i, (name, data) in enumerate(files.items()):
        (repo / "blobs" / f"blob{i}").write_bytes(data)
        (snap / name).symlink_to(f"../../blobs/blob{i}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(SHA)

    ds = home / "hub" / "datasets--org--arith"
    (ds / "snapshots" / SHA / "data").mkdir(parents=True)
    pq.write_table(pa.table({"prompt": ["1 + 2 = ?", "copy 3 = ?"], "label": ["3", "3"]}),
                   ds / "snapshots" / SHA / "data" / "train-00000-of-00001.parquet")
    (ds / "refs").mkdir()
    (ds / "refs" / "main").write_text(SHA)


def test_offline_with_a_pre_seeded_cache(tmp_path):
    home = tmp_path / "hf-home"
    seed_hub_cache(home)
    raw = tmp_path / "raw"
    by_ref, by_sha, missing_ref, ds, no_split = run_offline(home, [
        ("fetch_model", ["hf://org/tiny", str(tmp_path / "m1")], {}),
        ("fetch_model", [f"hf://org/tiny@{SHA}", str(tmp_path / "m2")], {}),
        ("fetch_model", ["hf://org/tiny@v2", str(tmp_path / "m3")], {}),
        ("fetch_dataset", ["hf://org/arith", str(raw), "train"], {}),
        ("fetch_dataset", ["hf://org/arith", str(raw), "eval-arith"], {"split": "test"}),
    ])
    for got, dest in ((by_ref, "m1"), (by_sha, "m2")):
        assert got["ok"]["revision"] == SHA and got["ok"]["kind"] == "hf"
        assert sorted(p.name for p in (tmp_path / dest).iterdir()) == ["config.json", "model.safetensors",
                                                                       "tokenizer.json"]
        assert (tmp_path / dest / "config.json").read_bytes() == b'{"model_type": "qwen3"}'
        assert not (tmp_path / dest / "config.json").is_symlink()
    assert missing_ref["error"] == "ModelError" and "hf download org/tiny" in missing_ref["message"]
    assert ds["ok"] == str(raw / "train.parquet")
    assert pq.read_table(raw / "train.parquet").to_pydict() == {"prompt": ["1 + 2 = ?", "copy 3 = ?"],
                                                                 "label": ["3", "3"]}
    assert no_split["error"] == "DataError" and "no split 'test'" in no_split["message"]
    assert "data.eval.arith.split" in no_split["message"]


# -- datasets: local and built-in ---------------------------------------------------------------------
def test_local_dataset_files_are_copied_keeping_the_extension(tmp_path):
    raw = tmp_path / "run" / "data" / "raw"
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text('{"prompt": "p", "label": "1"}\n')
    as_json = tmp_path / "b.json"
    as_json.write_text('[{"prompt": "p", "label": "1"}]')
    parquet = tmp_path / "c.parquet"
    pq.write_table(pa.table({"prompt": ["p"], "label": ["1"]}), parquet)

    assert fetch_dataset(str(jsonl), str(raw), "train") == str(raw / "train.jsonl")
    assert fetch_dataset("file://" + str(as_json), str(raw), "eval-x") == str(raw / "eval-x.json")
    assert fetch_dataset(str(parquet), str(raw), "eval-y") == str(raw / "eval-y.parquet")
    assert (raw / "train.jsonl").read_bytes() == jsonl.read_bytes()
    assert (raw / "eval-x.json").read_bytes() == as_json.read_bytes()
    assert (raw / "eval-y.parquet").read_bytes() == parquet.read_bytes()
    assert sorted(p.name for p in raw.iterdir()) == ["eval-x.json", "eval-y.parquet", "train.jsonl"]


def test_local_dataset_errors(tmp_path):
    with pytest.raises(DataError) as err:
        fetch_dataset(str(tmp_path / "nope.jsonl"), str(tmp_path / "raw"), "eval-aime")
    assert str(err.value) == f"dataset file not found: {tmp_path / 'nope.jsonl'} (check data.eval.aime.source)"
    (tmp_path / "t.csv").write_text("a,b\n")
    with pytest.raises(DataError, match=r"data.train.source must be a .jsonl, .json, .parquet file"):
        fetch_dataset(str(tmp_path / "t.csv"), str(tmp_path / "raw"), "train")
    with pytest.raises(DataError, match="must be a .jsonl"):
        fetch_dataset(str(tmp_path), str(tmp_path / "raw"), "train")


def test_builtin_arith_dataset(tmp_path):
    raw = tmp_path / "raw"
    train = fetch_dataset("builtin://arith/train", str(raw), "train")
    evals = fetch_dataset("builtin://arith/eval", str(raw), "eval-arith", split="train")  # the URI's split wins
    assert train == str(raw / "train.jsonl") and evals == str(raw / "eval-arith.jsonl")
    read = lambda p: [json.loads(line) for line in Path(p).read_text().splitlines()]  # noqa: E731
    assert read(train) == synthetic.generate_arith("train")
    assert read(evals) == synthetic.generate_arith("eval")

    easy = fetch_dataset("builtin://arith/train?difficulty=copy&n=30&seed=2", str(raw), "easy")
    assert read(easy) == synthetic.generate_arith("train", 30, seed=2, difficulty="copy")
    with pytest.raises(DataError, match="unknown built-in dataset"):
        fetch_dataset("builtin://arith/test", str(raw), "train")
    with pytest.raises(DataError, match=r"unknown option\(s\) size"):
        fetch_dataset("builtin://arith/train?size=3", str(raw), "train")
    with pytest.raises(DataError, match="difficulty"):
        fetch_dataset("builtin://arith/train?difficulty=mul", str(raw), "train")


# -- object stores: the fsspec code path, on fsspec's in-memory file system (S3 itself is tested elsewhere) --
def test_remote_model_and_dataset_through_fsspec(tmp_path):
    import fsspec

    mem = fsspec.filesystem("memory")
    root = f"memory://grpoflow-test-{os.getpid()}-{tmp_path.name}"
    src = make_model_dir(tmp_path / "src")
    for p in src.iterdir():
        if p.is_file():
            mem.pipe_file(f"{root}/models/tiny/{p.name}".removeprefix("memory://"), p.read_bytes())
    mem.pipe_file(f"{root}/data/train.jsonl".removeprefix("memory://"), b'{"prompt": "p", "label": "1"}\n')
    try:
        # remote source → local run dir
        report = fetch_model(f"{root}/models/tiny", str(tmp_path / "hf"))
        assert report["kind"] == "remote"
        assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["config.json", "model.safetensors",
                                                                       "tokenizer.json", "tokenizer_config.json"]
        # local source → remote run dir
        fetch_model(str(src), f"{root}/run/model/hf")
        assert mem.cat_file(f"{root}/run/model/hf/config.json".removeprefix("memory://")) == (
            src / "config.json").read_bytes()
        with pytest.raises(ModelError, match="model path does not exist"):
            fetch_model(f"{root}/models/none", str(tmp_path / "x"))

        got = fetch_dataset(f"{root}/data/train.jsonl", f"{root}/run/data/raw", "train")
        assert got == f"{root}/run/data/raw/train.jsonl"
        assert mem.cat_file(got.removeprefix("memory://")) == b'{"prompt": "p", "label": "1"}\n'
        with pytest.raises(DataError, match="dataset file not found"):
            fetch_dataset(f"{root}/data/none.jsonl", str(tmp_path / "raw"), "train")
    finally:
        mem.rm(root.removeprefix("memory://"), recursive=True)
