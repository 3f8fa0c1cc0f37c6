"""MLflow tracking and the model registry against a real MLflow (SQLite store in tmp, and one real
`mlflow server`), plus the HF export of a real trainer checkpoint."""
from __future__ import annotations

import math
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.waiting import wait_healthy

from runtime.config import GrpoConfig
from runtime.errors import TransientError, UserError
from runtime.grpo.evaluation import save_eval
from runtime.tracking.model_registry import aliases_of, register_checkpoint, should_move_best
from runtime.placement.ports import free_port
from runtime.run.directory import RunDir
from runtime.secrets import redact_uri
from runtime.tracking.mlflow_tracker import Tracker, flatten_params, sqlite_uri

pytest.importorskip("mlflow")


@pytest.fixture(autouse=True)
def _fast_mlflow_client(monkeypatch):
    # the client's own retries, kept short: an unreachable server must fail in seconds, not minutes
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """One storage root (so one SQLite store, created once) for the module; tests use distinct run ids."""
    return tmp_path_factory.mktemp("grpoflow-data")


def make_cfg(root: Path, **sections) -> GrpoConfig:
    tree = {"name": "tiny", "storage": {"root": str(root)}}
    for section, values in sections.items():
        tree.setdefault(section, {}).update(values)
    return GrpoConfig.model_validate(tree)


def client_for(uri: str):
    from mlflow.tracking import MlflowClient
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


# ---- runs, params, metrics ------------------------------------------------------------------------
def test_one_mlflow_run_per_grpoflow_run_reattached_on_resume(root):
    cfg = make_cfg(root)
    rd = RunDir(str(root), "reattach-1")
    first = Tracker(cfg, rd)
    assert first.uri == sqlite_uri(root) and (root / "mlflow.db").is_file()
    assert not first.resumed
    second = Tracker(cfg, rd)  # a resume (new process, same run dir)
    assert second.resumed and second.run_id == first.run_id
    other = Tracker(cfg, RunDir(str(root), "reattach-2"))
    assert other.run_id != first.run_id

    c = client_for(first.uri)
    exp = c.get_experiment_by_name("grpoflow")
    runs = c.search_runs([exp.experiment_id], filter_string="tags.`grpoflow.run_id` = 'reattach-1'")
    assert [r.info.run_id for r in runs] == [first.run_id]
    assert runs[0].info.run_name == "reattach-1"
    assert exp.artifact_location.startswith((root / "mlartifacts").as_uri())  # beside the DB, not ./mlruns
    import json
    doc = json.loads((Path(rd.path) / "tracking.json").read_text())
    assert doc["mlflow_run_id"] == first.run_id and doc["run_id"] == "reattach-1"
    # a finished run becomes RUNNING again when resumed
    second.finish()
    assert c.get_run(first.run_id).info.status == "FINISHED"
    assert Tracker(cfg, rd).run_id == first.run_id
    assert c.get_run(first.run_id).info.status == "RUNNING"


def test_overlapping_metric_logs_end_with_one_point_per_step(root):
    cfg = make_cfg(root)
    rd = RunDir(str(root), "metrics-1")
    t1 = Tracker(cfg, rd)
    rollouts = [{"rollout": r, "loss": 1.0 / (r + 1), "reward_mean": 0.1 * r, "note": "text is skipped",
                 "flag": True} for r in range(4)]
    assert t1.log_rollout_metrics(rollouts[:3]) == 6
    assert t1.log_rollout_metrics(rollouts[:3]) == 0  # same tracker again: nothing new
    t2 = Tracker(cfg, rd)  # resumed: replays rollouts 1..3 (1, 2 already logged)
    assert t2.log_rollout_metrics(rollouts[1:]) == 2
    c = client_for(t1.uri)
    for key in ("loss", "reward_mean"):
        steps = sorted(m.step for m in c.get_metric_history(t1.run_id, key))
        assert steps == [0, 1, 2, 3], key
    assert "note" not in c.get_run(t1.run_id).data.metrics and "flag" not in c.get_run(t1.run_id).data.metrics
    hist = {m.step: m.value for m in c.get_metric_history(t1.run_id, "loss")}
    assert hist[3] == pytest.approx(0.25)

    # eval: eval/<set>/<metric> at step = rollouts done; '@' is not allowed in MLflow names
    results = {"arith": {"avg@4": 0.25, "pass@1": 0.25, "pass@4": 0.5, "n_prompts": 8, "details": [{"x": 1}]}}
    save_eval(rd, 4, results)
    assert t2.log_eval(4, results) == 4
    assert Tracker(cfg, rd).log_eval(4, results) == 0
    hist = c.get_metric_history(t1.run_id, "eval/arith/avg_at_4")
    assert [(m.step, m.value) for m in hist] == [(4, 0.25)]
    arts = [f.path for f in c.list_artifacts(t1.run_id, "eval")]
    assert arts == ["eval/rollout_4.json"]


def test_changed_params_on_resume_become_override_tags(root):
    rd = RunDir(str(root), "params-1")
    cfg = make_cfg(root, train={"num_rollout": 6}, eval={"interval": 2})
    t1 = Tracker(cfg, rd)
    c = client_for(t1.uri)
    params = c.get_run(t1.run_id).data.params
    assert params["train.num_rollout"] == "6" and params["train.lr"] == "0.001"
    assert params["data.eval.arith.source"] == "builtin://arith/eval"

    resumed = make_cfg(root, train={"num_rollout": 10}, eval={"interval": 4})
    t2 = Tracker(resumed, rd)  # must not crash on MLflow's immutable params
    run = c.get_run(t2.run_id)
    assert run.data.params["train.num_rollout"] == "6"  # the value first logged stays
    assert run.data.tags["grpoflow.override.train.num_rollout"] == "10"
    assert run.data.tags["grpoflow.override.eval.interval"] == "4"
    Tracker(cfg, rd)  # back to the logged values: the override tags go
    tags = c.get_run(t2.run_id).data.tags
    assert not [k for k in tags if k.startswith("grpoflow.override.")]


def test_secrets_are_stripped_from_params(root):
    flat = flatten_params({
        "hub": {"hf_token": "hf_abc", "api_key": "k1", "password": "p", "aws_secret_access_key": "s",
                "credentials": "c", "key": "k2"},
        "rollout": {"max_new_tokens": 16, "top_k": -1, "sglang": {"launch": ["--api-key", "sk-1", "--port", "30000",
                                                                                     "--admin-token=tok"]}},
        "data": {"input_key": "question", "label_key": "answer", "source": "https://user:pw@host/d.jsonl"},
    })
    assert not any(k.startswith("hub.") for k in flat), flat
    assert flat["rollout.max_new_tokens"] == "16" and flat["rollout.top_k"] == "-1"
    assert flat["data.input_key"] == "question" and flat["data.label_key"] == "answer"
    assert "pw" not in flat["data.source"] and flat["data.source"] == "https://user:***@host/d.jsonl"
    assert "sk-1" not in flat["rollout.sglang.launch"] and "tok" not in flat["rollout.sglang.launch"].replace("token", "")
    assert "30000" in flat["rollout.sglang.launch"]
    assert redact_uri("http://u:secret@h:5000/x") == "http://u:***@h:5000/x"

    cfg = make_cfg(root, rollout={"sglang": {"launch": ["--api-key", "sk-live-123"]}},
                   # (credentials in the URI itself are refused by the config; a secret-named query parameter is not)
                   model={"source": "s3://models-bucket/m?access_token=hunter2"})
    t = Tracker(cfg, RunDir(str(root), "secrets-1"))
    params = client_for(t.uri).get_run(t.run_id).data.params
    everything = " ".join(f"{k}={v}" for k, v in params.items())
    assert "sk-live-123" not in everything and "hunter2" not in everything
    assert params["rollout.sglang.launch"] == "['--api-key', '***']"


def test_disabled_tracker_is_a_no_op(tmp_path):
    cfg = make_cfg(tmp_path, tracking={"enabled": False})
    rd = RunDir(str(tmp_path), "off-1")
    t = Tracker(cfg, rd)
    assert not t.enabled and t.run_id is None
    assert t.log_rollout_metrics([{"rollout": 0, "loss": 1.0}]) == 0
    assert t.log_eval(2, {"a": {"avg@1": 1.0}}) == 0
    t.log_artifact_file(str(tmp_path / "nothing.json"))
    t.finish()
    assert register_checkpoint(t, name="m", export_uri=str(tmp_path), rollout=2, run_id="off-1") is None
    assert not (tmp_path / "mlflow.db").exists() and not (Path(rd.path) / "tracking.json").exists()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when the socket goes


def test_unreachable_mlflow_is_a_transient_error_naming_the_uri(tmp_path):
    uri = f"http://127.0.0.1:{_closed_port()}"
    cfg = make_cfg(tmp_path, tracking={"uri": uri})
    t0 = time.time()
    with pytest.raises(TransientError, match=uri.replace(".", r"\.")):
        Tracker(cfg, RunDir(str(tmp_path), "down-1"))
    with pytest.raises(TransientError, match="127.0.0.1"):
        register_checkpoint(client_for(uri), name="m", export_uri=str(tmp_path), rollout=2, run_id="down-1",
                            mlflow_run_id="0" * 32)
    assert time.time() - t0 < 20


# ---- registry ---------------------------------------------------------------------------------------
def test_should_move_best_over_a_crafted_sequence():
    best, moves = None, []
    for score in (0.2, 0.5, 0.4, 0.5, 0.7, float("nan")):  # improve, improve, regress, tie, improve, NaN
        move = should_move_best(best, score)
        moves.append(move)
        if move:
            best = score
    assert moves == [True, True, False, False, True, False]
    assert best == 0.7
    assert should_move_best(float("nan"), 0.1)  # an unreadable current best is replaced
    assert not should_move_best(0.1, None)


def register_sequence(tracker, root: Path, name: str, run_id: str, scores) -> list[dict]:
    out = []
    for i, score in enumerate(scores):
        rollout = 2 * (i + 1)
        export = root / "runs" / run_id / "exports" / f"rollout_{rollout}" / "hf"
        export.mkdir(parents=True, exist_ok=True)
        (export / "config.json").write_text("{}")
        out.append(register_checkpoint(
            tracker, name=name, export_uri=str(export), rollout=rollout, run_id=run_id,
            metrics={"eval/arith/avg@4": score, "eval/arith/pass@4": min(1.0, 2 * score)}, config_hash="abc123",
            primary_metric="eval/arith/avg@4"))
    return out


def test_registration_is_idempotent_and_aliases_move_right(root, capsys):
    from cli.models import models_list, models_show

    cfg = make_cfg(root)
    tracker = Tracker(cfg, RunDir(str(root), "reg-1"))
    infos = register_sequence(tracker, root, "tiny-reg", "reg-1", [0.2, 0.5, 0.4])
    c = client_for(tracker.uri)
    assert [i["version"] for i in infos] == [1, 2, 3] and all(i["created"] for i in infos)
    assert infos[0]["aliases"] == ["best", "latest"]
    assert infos[1]["aliases"] == ["best", "latest"]
    assert infos[2]["aliases"] == ["latest"]  # 0.4 < 0.5: best stays on version 2
    # best is a real MLflow alias; "latest" is MLflow's reserved name for the newest version
    assert {a: int(v) for a, v in c.get_registered_model("tiny-reg").aliases.items()} == {"best": 2}
    assert aliases_of(c, "tiny-reg") == {"latest": 3, "best": 2}

    # the same checkpoint again (a re-run flow): the same version, no new one, latest not moved back
    again = register_checkpoint(tracker, name="tiny-reg", export_uri=infos[1]["export_uri"], rollout=4,
                                run_id="reg-1", metrics={"eval/arith/avg@4": 0.9}, primary_metric="eval/arith/avg@4")
    assert again["version"] == 2 and not again["created"]
    assert len(c.search_model_versions("name='tiny-reg'")) == 3
    assert aliases_of(c, "tiny-reg") == {"latest": 3, "best": 2}
    v2 = c.get_model_version("tiny-reg", "2")
    assert v2.source == Path(infos[1]["export_uri"]).resolve().as_uri() and v2.run_id == tracker.run_id
    assert v2.tags["grpoflow.checkpoint"] == "reg-1/rollout_4" and v2.tags["grpoflow.config_hash"] == "abc123"
    assert float(v2.tags["grpoflow.metric.eval/arith/avg_at_4"]) == 0.5  # first registration's metrics stay
    # the rule that scored those metrics (evaluation's grader) is on the version
    from importlib.metadata import version

    assert {k: v for k, v in v2.tags.items() if k.startswith("grpoflow.grader.")} == {
        "grpoflow.grader.grader": "math", "grpoflow.grader.rule_version": "math-4",
        "grpoflow.grader.math_verify_version": version("math-verify")}

    # the CLI views
    capsys.readouterr()
    assert models_list(None, root=str(root)) == 0
    out = capsys.readouterr().out
    assert "tiny-reg" in out and "reg-1" in out and "arith/avg@4=0.5" in out
    for v in ("1", "2", "3"):
        assert any(line.split("│")[2].strip() == v for line in out.splitlines() if "tiny-reg" in line), v
    assert models_show("tiny-reg@best", None, root=str(root)) == 0
    out = capsys.readouterr().out
    assert "tiny-reg version 2" in out and "(aliases: best)" in out and "(primary)" in out
    assert f'AutoModelForCausalLM.from_pretrained("{infos[1]["export_uri"]}")' in out
    assert models_show("tiny-reg/1", None, root=str(root)) == 0
    assert "tiny-reg version 1" in capsys.readouterr().out
    assert models_show("tiny-reg", None, root=str(root)) == 0  # NAME = its latest
    assert "tiny-reg version 3  (aliases: latest)" in capsys.readouterr().out
    assert models_show("tiny-reg@latest", None, root=str(root)) == 0
    assert "tiny-reg version 3" in capsys.readouterr().out
    for spec, msg in (("nope", "unknown model 'nope'"), ("tiny-reg@gold", "no alias 'gold'"),
                      ("tiny-reg/9", "no version 9"), ("a/b/", "NAME, NAME@alias or NAME/version")):
        with pytest.raises(UserError, match=msg) as err:
            models_show(spec, None, root=str(root))
        assert "\n" not in str(err.value)


def test_models_list_without_a_store_creates_nothing(tmp_path, capsys):
    from cli.models import models_list

    assert models_list(None, root=str(tmp_path)) == 0
    assert "No registered models" in capsys.readouterr().out
    assert not (tmp_path / "mlflow.db").exists()


# ---- a real mlflow server ---------------------------------------------------------------------------
def test_tracker_and_registry_through_a_real_mlflow_server(tmp_path, capsys):
    from cli.models import models_show

    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    mlflow_bin = Path(sys.executable).with_name("mlflow")
    proc = subprocess.Popen(
        [str(mlflow_bin), "server", "--backend-store-uri", f"sqlite:///{tmp_path / 'server.db'}",
         "--artifacts-destination", str(tmp_path / "server-artifacts"), "--host", "127.0.0.1", "--port", str(port),
         "--workers", "1"],
        stdout=subprocess.DEVNULL, stderr=open(tmp_path / "server.log", "wb"), start_new_session=True,
        env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})  # no job-runner processes
    try:
        wait_healthy(f"{uri}/health", proc, timeout_s=90, log=tmp_path / "server.log")

        root = tmp_path / "data"
        cfg = make_cfg(root, tracking={"uri": uri, "experiment": "served"})
        rd = RunDir(str(root), "served-1")
        t = Tracker(cfg, rd)
        assert Tracker(cfg, rd).run_id == t.run_id
        t.log_rollout_metrics([{"rollout": 0, "loss": 0.5}, {"rollout": 1, "loss": 0.25}])
        Tracker(cfg, rd).log_rollout_metrics([{"rollout": 1, "loss": 0.25}])
        assert [m.step for m in client_for(uri).get_metric_history(t.run_id, "loss")] == [0, 1]
        assert not (root / "mlflow.db").exists()  # tracking.uri wins over the default store

        def fake_export(rollout: int) -> Path:
            export = Path(rd.export(rollout))
            export.mkdir(parents=True)
            (export / "config.json").write_text("{}")
            (export / "grpoflow_export.json").write_text("{}")
            return export

        export = fake_export(2)
        info = register_checkpoint(t, name="served-model", export_uri=str(export), rollout=2, run_id="served-1",
                                   metrics={"eval/arith/avg@4": 0.5}, primary_metric="eval/arith/avg@4")
        # a server refuses local paths outside the run's artifacts: the export is uploaded to the run
        assert info["version"] == 1 and info["source"] == f"runs:/{t.run_id}/exports/rollout_2"
        assert info["aliases"] == ["best", "latest"]
        again = register_checkpoint(t, name="served-model", export_uri=str(export), rollout=2, run_id="served-1")
        assert again["version"] == 1 and not again["created"]
        arts = {Path(f.path).name for f in client_for(uri).list_artifacts(t.run_id, "exports/rollout_2")}
        assert arts == {"config.json", "grpoflow_export.json"}
        capsys.readouterr()
        assert models_show("served-model@latest", uri) == 0
        out = capsys.readouterr().out
        assert "served-model version 1" in out and f'from_pretrained("{export}")' in out

        # retention: a better version 2 takes best and latest; with keep_exports=0 version 1's export goes,
        # on disk and its upload to the server's artifact store; the version stays
        from runtime.tracking.export_retention import EXPORT_REMOVED_TAG, prune_exports
        export4 = fake_export(4)
        v2 = register_checkpoint(t, name="served-model", export_uri=str(export4), rollout=4, run_id="served-1",
                                 metrics={"eval/arith/avg@4": 0.75}, primary_metric="eval/arith/avg@4")
        assert v2["aliases"] == ["best", "latest"]
        c = client_for(uri)
        prune = dict(tracking_uri=uri, name="served-model", rd=rd, keep=0, mlflow_run_id=t.run_id)
        assert prune_exports(c, **prune) == [1]
        assert not list(c.list_artifacts(t.run_id, "exports/rollout_2")) and not export.parent.exists()
        stored = [p for p in (tmp_path / "server-artifacts").rglob("*") if "rollout_2" in str(p)]
        assert stored == [], stored  # gone from the server's artifact store itself
        assert {Path(f.path).name for f in c.list_artifacts(t.run_id, "exports/rollout_4")} == {
            "config.json", "grpoflow_export.json"}
        v1 = c.get_model_version("served-model", "1")
        assert v1.source == f"runs:/{t.run_id}/exports/rollout_2" and EXPORT_REMOVED_TAG in v1.tags
        assert prune_exports(c, **prune) == []  # idempotent
        assert models_show("served-model/1", uri) == 0
        out = capsys.readouterr().out
        assert "export removed by retention (tracking.keep_exports=0)" in out and "cannot be exported again" in out
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)  # the server and its worker: the group this test started
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


# ---- export of a trainer checkpoint -------------------------------------------------------------------
def test_export_of_a_trainer_checkpoint_loads_in_transformers_and_generates(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from runtime.run import checkpoint
    from runtime.mcore.convert import hf_to_torch_dist
    from runtime.models.tiny import build_tiny_qwen3, builtin_corpus
    from runtime.tracking.model_registry import export_checkpoint
    from runtime.trainer.megatron_trainer import MegatronTrainer

    rd = RunDir(str(tmp_path), "export-1")
    build_tiny_qwen3(rd.hf_model, seed=3, corpus=builtin_corpus(0, 300))
    hf_to_torch_dist(rd.hf_model, rd.torch_dist)
    base = GrpoConfig()
    trainer = MegatronTrainer(hf_dir=rd.hf_model, init_checkpoint=rd.torch_dist, train=base.train,
                              algorithm=base.algorithm, temperature=1.0)
    with torch.no_grad():  # make the checkpoint differ from the fetched model, so the export must carry it
        for p in trainer.model.parameters():
            p.add_(0.01)
    checkpoint.save(rd, 2, trainer.save, {"cursor": {}}, keep_last=3)
    expected = trainer.hf_weights()

    info = export_checkpoint(rd, 2)
    assert not info["skipped"] and info["path"] == rd.export(2)
    assert export_checkpoint(rd, 2)["skipped"]  # complete: not written twice
    model = AutoModelForCausalLM.from_pretrained(rd.export(2)).eval()
    tok = AutoTokenizer.from_pretrained(rd.export(2))
    got = model.state_dict()
    for k, v in expected.items():
        assert torch.equal(got[k], v.to(got[k].dtype)), k
    ids = tok("What is 2 + 3?", return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=6, do_sample=False)
    assert out.shape == (1, ids.shape[1] + 6) or out.shape[1] > ids.shape[1]
    assert math.isfinite(model(ids).logits.abs().max().item())
