"""Kill anywhere, resume, and end exactly where an unbroken run ends.

One uninterrupted reference run (4 rollouts in 2 chunks, eval and registration after each chunk) copies
its storage root at each stage boundary (runtime/testing/moments.py, GRPOFLOW_TEST_SNAPSHOT_AT). Then,
for each moment below — stage boundaries and points inside every stage: fetch, prepare, convert, the
MLflow store's creation, rollouts, checkpoint writes (inside the background writer, and an evaluation
running beside it), metric logging, eval, export, registration, the
MLflow run's end, the finished marker — the root is restored from the boundary before it, a
`grpoflow` run process is started there with GRPOFLOW_TEST_KILL_AT=<moment> (it SIGKILLs its own
process group on reaching it: no clean-up of any kind), and `grpoflow resume` is run. Every resumed
run must end bitwise-equal to the reference (every model and optimizer tensor of the final
checkpoint), with one MLflow point per (metric, rollout), one registry version per eval point, `best`
where the reference put it, the MLflow run FINISHED, no lease and no temp leftovers.

The killed runs are forked from one warm process (tests/cli_zygote.py) and talk to the session's
Prefect server; every run uses the same root path, so the paths recorded inside the store match.

FP8 engine weights with cascade attention (issue 59) and the tiny mixture of experts with routing replay (issue 60)
have a reference run each and two moments. LoRA (train.lora) has a reference run of its own and a few moments where its state differs: an update of
adapters that start from keyed initial values, a checkpoint of adapters being written, its two exports
(the PEFT adapter, then the merged model), the registry version, and an update after resuming from an
adapter checkpoint.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from cli.main import main
from tests.conftest import SMALL_BATCH
from runtime.run import checkpoint
from runtime.run.directory import RunDir
from runtime.run.leftovers import temp_leftovers

pytestmark = pytest.mark.kill

RUN = "ref"
SETS = ["train.num_rollout=4", "checkpoint.interval=2", "eval.interval=2", "eval.max_prompts=8", *SMALL_BATCH]
# Counted hits (name#k) are counted per process: in the reference, metrics are logged by chunk 1 (#1),
# eval 2 (#2), chunk 2 (#3), eval 4 (#4); a resumed process re-registers eval points it finds done.
BOUNDARIES = ["fetched", "prepared", "converted", "tracking-store-ready", "mlflow-metrics-logged#1",
              "registry-aliases-moved#1", "mlflow-metrics-logged#3"]

# (moment to kill at, boundary the killed run starts from: None = an empty root, a fresh `grpoflow run`)
MOMENTS = [
    ("fetch-datasets-done", None),                   # fetch: datasets in, model not yet
    ("built:model/hf", None),                        # fetch: model complete under its temp name
    ("prepare-work-done", "fetched"),                # prepare: parquet written, marker not
    ("built:model/torch_dist", "prepared"),          # convert: checkpoint complete under its temp name
    ("mlflow-store-built", "converted"),             # MLflow store built under its temp name
    ("generate#1", "tracking-store-ready"),          # rollout 0 sampling
    ("train-step-done#2", "tracking-store-ready"),   # rollout 1 updated, not saved
    ("checkpoint-files-written#1", "tracking-store-ready"),  # background write: tensors on disk, no metadata
    ("checkpoint-model-written#1", "tracking-store-ready"),  # finalized at the registration, no manifest
    ("checkpoint-in-place#1", "tracking-store-ready"),      # complete, `latest` not moved
    ("checkpoint-latest-moved#1", "tracking-store-ready"),  # durable, the version not registered
    ("mlflow-metrics-logged#1", "tracking-store-ready"),    # logged, the chunk task not returned
    ("checkpoint-pending#1", "tracking-store-ready"),  # eval at rollout 2 starts, its checkpoint still being written
    # the boundary holds rollout 2's checkpoint unfinished (written beside the eval) and rollouts 0-1's metrics
    # logged: rollout 0 is redone, sampling, and its points are not logged twice
    ("generate#1", "mlflow-metrics-logged#1"),
    ("eval-saved#1", "mlflow-metrics-logged#1"),     # eval saved, nothing registered
    ("built:rollout_2/hf", "mlflow-metrics-logged#1"),  # export complete under its temp name
    ("registry-version-created#1", "mlflow-metrics-logged#1"),  # version made, `best` not moved
    ("train-step-done#1", "registry-aliases-moved#1"),  # rollout 2 updated
    ("checkpoint-manifest-written#1", "registry-aliases-moved#1"),
    ("mlflow-metrics-logged#1", "registry-aliases-moved#1"),
    ("eval-sampled#1", "mlflow-metrics-logged#3"),   # final eval scored, not saved
    ("registry-aliases-moved#2", "mlflow-metrics-logged#3"),  # final version registered, run not ended
    ("mlflow-run-ending#1", "mlflow-metrics-logged#3"),
    ("marked-finished", "mlflow-metrics-logged#3"),  # finished marker written, lease not released
]


LORA_SETS = ["train.lora.enabled=true", "train.lora.rank=4", "train.lora.alpha=8", "train.lr=1e-2"]
LORA_MOMENTS = [
    ("train-step-done#2", "tracking-store-ready"),          # rollout 1's adapters updated, not saved
    ("checkpoint-model-written#1", "tracking-store-ready"),  # adapters + optimizer written, no manifest
    ("adapter-exported#1", "mlflow-metrics-logged#1"),      # PEFT adapter published, merged export not
    ("registry-version-created#1", "mlflow-metrics-logged#1"),
    ("train-step-done#1", "registry-aliases-moved#1"),      # an update after resuming from rollout 2's adapters
]


# configs/tiny.yaml's run on the tiny mixture of experts with rollout routing replay (issue 60): the routes travel
# with the samples into the trainer; a kill between an update and its checkpoint, and one inside the checkpoint write
MOE_SETS = ["model.source=builtin://tiny-qwen3-moe", "rollout.routing_replay=true"]
MOE_MOMENTS = [
    ("train-step-done#2", "tracking-store-ready"),
    ("checkpoint-model-written#1", "tracking-store-ready"),
]

# the engine's speed settings (issue 59): FP8 weights re-quantised at each sync and cascade attention; a kill
# between an update and its checkpoint (the resumed engine quantises the checkpoint's weights), and one while a
# rollout samples after a resume
ENGINE_SETS = ["rollout.weights_dtype=fp8", "rollout.cascade_attention=true"]
ENGINE_MOMENTS = [
    ("train-step-done#2", "tracking-store-ready"),
    ("generate#1", "mlflow-metrics-logged#1"),
]


class Zygote:
    def __init__(self, env: dict):
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.cli_zygote"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)
        ready = json.loads(self.proc.stdout.readline())
        assert "ready" in ready, ready

    def start(self, argv: list[str], env: dict, log: Path) -> None:
        self.proc.stdin.write(json.dumps({"argv": argv, "env": env, "log": str(log)}) + "\n")
        self.proc.stdin.flush()

    def wait(self) -> dict:
        return json.loads(self.proc.stdout.readline())

    def run(self, argv: list[str], env: dict, log: Path) -> dict:
        self.start(argv, env, log)
        return self.wait()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def _state(root: Path, lora: bool = False) -> dict:
    """What a finished run must look like, read from its root (the checkpoint tensors aside)."""
    from mlflow.tracking import MlflowClient
    rd = RunDir(str(root), RUN)
    doc = json.loads(Path(rd.sub("tracking.json")).read_text())
    client = MlflowClient(doc["tracking_uri"], registry_uri=doc["tracking_uri"])
    run = client.get_run(doc["mlflow_run_id"])
    points = {k: sorted(m.step for m in client.get_metric_history(run.info.run_id, k)) for k in run.data.metrics}
    found = [v for v in client.search_model_versions("name = 'tiny'") if v.tags.get("grpoflow.run_id") == RUN]
    versions = sorted((int(v.tags["grpoflow.rollout"]), int(v.version)) for v in found)
    assert {v.tags.get("grpoflow.weights") for v in found} == {"lora-merged" if lora else "full"}
    best = int(client.get_registered_model("tiny").aliases["best"])
    return {"status": run.info.status, "points": points, "rollouts_registered": [r for r, _ in versions],
            "best_rollout": dict((v, r) for r, v in versions)[best],
            "mlflow_runs": len(client.search_runs([run.info.experiment_id])),
            "lease": Path(rd.sub("lease.json")).exists(),
            "leftovers": [str(p) for p in temp_leftovers(rd)] + [str(p) for p in root.glob(".mlflow.db.tmp-*")],
            "latest": checkpoint.latest(rd).rollout}


@pytest.fixture(scope="module")
def zygote(prefect_harness):
    import prefect.settings
    zygote_env = dict(os.environ, PYTHONPATH=os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""),
                      PREFECT_API_URL=prefect.settings.PREFECT_API_URL.value())
    z = Zygote(zygote_env)
    yield z
    z.close()


def _reference(base: Path, sets: list[str], zygote: Zygote, lora: bool = False) -> dict:
    """The uninterrupted run, with a copy of its root at every boundary; returns its final facts."""
    from runtime.testing import moments
    from tests.test_resume import checkpoint_tensors
    root, snaps = base / "root", base / "snapshots"
    moments._hits.clear()  # moments are counted per process: the other reference ran in this one too
    root.mkdir()
    env = {"GRPOFLOW_TEST_SNAPSHOT_AT": ",".join(BOUNDARIES), "GRPOFLOW_TEST_SNAPSHOT_ROOT": str(root),
           "GRPOFLOW_TEST_SNAPSHOT_DIR": str(snaps)}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        assert main(_run_argv(root, sets)) == 0
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    assert sorted(p.name for p in snaps.iterdir()) == sorted(BOUNDARIES)
    rd = RunDir(str(root), RUN)
    state = _state(root, lora)
    assert state["rollouts_registered"] == [2, 4] and state["status"] == "FINISHED"
    # the chunk's metrics as the checkpoint holds them, the loop's checkpoint stall among them: what a resume that
    # reads the chunk back logs (with checkpoint.background false the checkpoint is durable before they are logged)
    assert "checkpoint_stall_s" in checkpoint.read_state(rd.checkpoint(4))["metrics"][-1]
    tensors = checkpoint_tensors(rd.checkpoint(4), base)
    return {"root": root, "snaps": snaps, "state": state, "tensors": tensors, "zygote": zygote, "base": base,
            "sets": sets, "lora": lora}


@pytest.fixture(scope="module")
def reference(zygote, tmp_path_factory):
    return _reference(tmp_path_factory.mktemp("kill-anywhere"), SETS, zygote)


@pytest.fixture(scope="module")
def lora_reference(zygote, tmp_path_factory):
    ref = _reference(tmp_path_factory.mktemp("kill-anywhere-lora"), SETS + LORA_SETS, zygote, lora=True)
    # a LoRA checkpoint holds the adapters and their optimizer state, not the base
    assert ref["tensors"] and all(".lora_" in k for k in ref["tensors"])
    return ref


@pytest.fixture(scope="module")
def moe_reference(zygote, tmp_path_factory):
    ref = _reference(tmp_path_factory.mktemp("kill-anywhere-moe"), SETS + MOE_SETS, zygote)
    assert any(".mlp.experts." in k for k in ref["tensors"])  # the experts are in the compared checkpoint
    return ref


@pytest.fixture(scope="module")
def engine_settings_reference(zygote, tmp_path_factory):
    return _reference(tmp_path_factory.mktemp("kill-anywhere-engine"), SETS + ENGINE_SETS, zygote)


def _close_stores(root: Path) -> None:
    """MLflow keeps pooled SQLite connections per store URI in this process; the file is about to be
    replaced, and a connection to the old one would read a deleted file."""
    from mlflow.store.model_registry.sqlalchemy_store import SqlAlchemyStore as RegistryStore
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore as TrackingStore
    for cls in (TrackingStore, RegistryStore):
        for uri, engine in list(cls._engine_map.items()):
            if str(root) in uri:
                engine.dispose()


def _run_argv(root: Path, sets: list[str] = SETS) -> list[str]:
    return ["run", "configs/tiny.yaml", "--run-id", RUN, *sum((["--set", s] for s in sets + [f"storage.root={root}"]), [])]


@pytest.mark.parametrize("moment, start", MOMENTS, ids=[f"{m}@{s or 'empty'}" for m, s in MOMENTS])
def test_killed_at_a_moment_then_resumed_ends_as_the_reference(reference, moment, start, tmp_path, capsys):
    _kill_and_resume(reference, moment, start, tmp_path, capsys)


@pytest.mark.parametrize("moment, start", LORA_MOMENTS, ids=[f"{m}@{s}" for m, s in LORA_MOMENTS])
def test_lora_killed_at_a_moment_then_resumed_ends_as_the_reference(lora_reference, moment, start, tmp_path, capsys):
    _kill_and_resume(lora_reference, moment, start, tmp_path, capsys)


@pytest.mark.parametrize("moment, start", MOE_MOMENTS, ids=[f"{m}@{s}" for m, s in MOE_MOMENTS])
def test_moe_with_routing_replay_killed_at_a_moment_then_resumed_ends_as_the_reference(moe_reference, moment, start,
                                                                                     tmp_path, capsys):
    _kill_and_resume(moe_reference, moment, start, tmp_path, capsys)


@pytest.mark.parametrize("moment, start", ENGINE_MOMENTS, ids=[f"{m}@{s}" for m, s in ENGINE_MOMENTS])
def test_fp8_weights_and_cascade_attention_killed_at_a_moment_then_resumed_end_as_the_reference(
        engine_settings_reference, moment, start, tmp_path, capsys):
    _kill_and_resume(engine_settings_reference, moment, start, tmp_path, capsys)


def test_a_lora_version_shows_its_adapter_and_both_printed_loaders_run(lora_reference, capsys):
    """`grpoflow models show` of a LoRA run's version names the adapter by an absolute URI, and the two loaders
    it prints (the merged model with transformers; the adapter alone with peft, on the base its
    adapter_config.json names) run as printed and give the same logits."""
    import torch
    assert main(["models", "show", "tiny@best", "--root", str(lora_reference["root"])]) == 0
    out = capsys.readouterr().out
    adapter = next(line for line in out.splitlines() if line.startswith("adapter:"))
    assert adapter.split()[1].startswith("file:///")
    merged_code, peft_code = out.split("load it with:\n", 1)[1].split("or the adapter alone, on the base its "
                                                                       "adapter_config.json names:\n")
    merged, adapted = {}, {}
    exec(merged_code, merged)  # noqa: S102 - the code the CLI tells a user to run
    exec(peft_code, adapted)  # noqa: S102
    ids = torch.tensor([[3, 17, 42, 5, 9, 11]])
    with torch.no_grad():
        a, b = merged["model"](ids).logits, adapted["model"](ids).logits
        with adapted["model"].disable_adapter():
            base = adapted["model"](ids).logits
    assert torch.allclose(a, b, atol=1e-4), (a - b).abs().max()
    assert (a - base).abs().max() > 1e-3  # the adapters trained: the check compares something


def _kill_and_resume(reference: dict, moment: str, start: str | None, tmp_path: Path, capsys) -> None:
    from tests.test_resume import assert_same_checkpoint, checkpoint_tensors
    root = reference["root"]
    _close_stores(root)
    shutil.rmtree(root)
    if start is None:
        root.mkdir()
    else:
        shutil.copytree(reference["snaps"] / start, root)
    argv = _run_argv(root, reference["sets"]) if start is None else ["resume", RUN, "--root", str(root)]
    log = tmp_path / "killed.log"
    ended = reference["zygote"].run(argv, {"GRPOFLOW_TEST_KILL_AT": moment}, log)
    assert ended.get("signal") == signal.SIGKILL, f"moment {moment} was never reached: {ended}\n{log.read_text()[-3000:]}"

    assert main(["resume", RUN, "--root", str(root)]) == 0, capsys.readouterr().err[-3000:]
    state = _state(root, reference["lora"])
    assert state == reference["state"]
    assert_same_checkpoint(checkpoint_tensors(RunDir(str(root), RUN).checkpoint(4), tmp_path), reference["tensors"])


def test_killed_before_its_config_was_frozen_resume_says_how_to_start_it(reference, tmp_path, capsys):
    """Killed holding the lease, before the config was frozen: there is nothing to resume. `resume` says so in
    one line with the command that started the run (kept in its lease), changes nothing, and that command,
    run as printed, takes the dead writer's lease over and ends as the reference."""
    import shlex

    from tests.test_resume import assert_same_checkpoint, checkpoint_tensors
    root = reference["root"]
    _close_stores(root)
    shutil.rmtree(root)
    root.mkdir()
    log = tmp_path / "killed.log"
    ended = reference["zygote"].run(_run_argv(root), {"GRPOFLOW_TEST_KILL_AT": "leased"}, log)
    assert ended.get("signal") == signal.SIGKILL, f"never reached: {ended}\n{log.read_text()[-3000:]}"
    rd = RunDir(str(root), RUN)
    assert Path(rd.sub("lease.json")).is_file() and not Path(rd.config).exists()
    before = {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}

    assert main(["resume", RUN, "--root", str(root)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"run '{RUN}' was stopped before its config was frozen" in err, err
    command = shlex.split(err.split("`")[1])
    assert command == ["grpoflow", "run", str(Path("configs/tiny.yaml").resolve()), *_run_argv(root)[2:]], command
    assert {p: p.read_bytes() for p in root.rglob("*") if p.is_file()} == before

    assert main(command[1:]) == 0, capsys.readouterr().err[-3000:]
    assert _state(root) == reference["state"]
    assert_same_checkpoint(checkpoint_tensors(rd.checkpoint(4), tmp_path), reference["tensors"])
