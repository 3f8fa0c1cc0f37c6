"""Which run a scheduled firing works on: the previous run of its prefix when unfinished, else a new one.
Run directories are made with the real config freezer and the real checkpoint writer."""
from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

import pytest

from runtime.run import checkpoint
from runtime import storage
from runtime.config import load_config
from runtime.errors import ConfigError
from runtime.run.scheduled_runs import check_prefix, new_run_id, next_run, runs_of, safe_prefix
from runtime.run.directory import RunDir
from runtime.run.frozen_config import freeze, mark_finished

NOW = datetime(2026, 11, 22, 3, 0, 0, tzinfo=timezone.utc)


def _make_run(root: Path, run_id: str, *, rollouts: int = 0, num_rollout: int = 4, evaluated: bool = False,
              name: str | None = None) -> RunDir:
    """A run directory as the pipeline leaves it: frozen config, `rollouts` trained (checkpoints every 2)."""
    overrides = [f"train.num_rollout={num_rollout}", "checkpoint.interval=2", "eval.interval=null",
                 f"storage.root={root}"] + ([f"name={name}"] if name else [])
    cfg = load_config("configs/tiny.yaml", overrides)
    rd = RunDir(str(root), run_id)
    freeze(cfg, rd)
    for n in range(2, rollouts + 1, 2):
        checkpoint.save(rd, n, lambda p: (Path(p).mkdir(), (Path(p) / "weights.bin").write_bytes(b"w" * 8)),
                        {"cursor": n}, keep_last=3)
    if evaluated:
        for n in cfg.eval_points():
            storage.write_json_atomic(rd.eval_result(n), {"rollout": n, "sets": {}})
        if rollouts >= num_rollout:
            mark_finished(cfg, rd)  # the pipeline's last act: registered, MLflow run ended
    return rd


def test_new_run_id_is_prefix_and_utc_stamp_and_never_reuses_a_directory(tmp_path):
    assert new_run_id(str(tmp_path), "nightly", NOW) == "nightly-20261122T030000Z"
    Path(RunDir(str(tmp_path), "nightly-20261122T030000Z").path).mkdir(parents=True)
    assert new_run_id(str(tmp_path), "nightly", NOW) == "nightly-20261122T030000Z-2"


def test_runs_of_lists_only_this_prefix_with_a_frozen_config_oldest_first(tmp_path):
    for rid in ("nightly-20261121T030000Z", "nightly-20261122T030000Z-10", "nightly-20261122T030000Z-2",
                "nightly-20261120T030000Z", "nightly-extra-20261123T030000Z", "tiny-20261124T000000Z"):
        _make_run(tmp_path, rid)
    Path(tmp_path, "runs", "nightly-20261125T030000Z").mkdir()  # killed before its config was frozen
    Path(tmp_path, "runs", "nightly-notes").mkdir()
    assert runs_of(str(tmp_path), "nightly") == [
        "nightly-20261120T030000Z", "nightly-20261121T030000Z", "nightly-20261122T030000Z-2",
        "nightly-20261122T030000Z-10"]
    assert runs_of(str(tmp_path / "nowhere"), "nightly") == []


def test_first_firing_starts_a_new_run(tmp_path):
    nxt = next_run(str(tmp_path), "nightly", now=NOW)
    assert (nxt.run_id, nxt.resume) == ("nightly-20261122T030000Z", False)


@pytest.mark.parametrize("rollouts", [0, 2])
def test_unfinished_previous_run_is_resumed(tmp_path, rollouts):
    _make_run(tmp_path, "nightly-20261120T030000Z", rollouts=4, evaluated=True)
    _make_run(tmp_path, "nightly-20261121T030000Z", rollouts=rollouts)  # killed after `rollouts` of 4
    nxt = next_run(str(tmp_path), "nightly", now=NOW)
    assert (nxt.run_id, nxt.resume) == ("nightly-20261121T030000Z", True)
    assert "unfinished" in nxt.reason


def test_finished_previous_run_means_a_new_run(tmp_path):
    _make_run(tmp_path, "nightly-20261121T030000Z", rollouts=4, evaluated=True)
    nxt = next_run(str(tmp_path), "nightly", now=NOW)
    assert (nxt.run_id, nxt.resume) == ("nightly-20261122T030000Z", False)


def test_trained_but_not_evaluated_is_unfinished(tmp_path):
    _make_run(tmp_path, "nightly-20261121T030000Z", rollouts=4, evaluated=False)
    assert next_run(str(tmp_path), "nightly", now=NOW).resume


def test_only_the_previous_run_is_considered(tmp_path):
    # an old abandoned run is not dug up once a later run of the schedule has finished
    _make_run(tmp_path, "nightly-20261120T030000Z", rollouts=2)
    _make_run(tmp_path, "nightly-20261121T030000Z", rollouts=4, evaluated=True)
    assert next_run(str(tmp_path), "nightly", now=NOW).run_id == "nightly-20261122T030000Z"


def test_resume_unfinished_off_always_starts_over(tmp_path):
    _make_run(tmp_path, "nightly-20261121T030000Z", rollouts=2)
    nxt = next_run(str(tmp_path), "nightly", resume_unfinished=False, now=NOW)
    assert (nxt.run_id, nxt.resume) == ("nightly-20261122T030000Z", False)


def test_runs_of_another_config_name_are_not_resumed(tmp_path):
    _make_run(tmp_path, "nightly-20261121T030000Z", rollouts=2, name="other")
    assert not next_run(str(tmp_path), "nightly", name="tiny", now=NOW).resume
    assert next_run(str(tmp_path), "nightly", name="other", now=NOW).resume


def test_unreadable_previous_config_starts_a_new_run(tmp_path, caplog):
    rd = _make_run(tmp_path, "nightly-20261121T030000Z", rollouts=2)
    Path(rd.config).write_text("train: {learning_rate: 1}\n")
    nxt = next_run(str(tmp_path), "nightly", now=NOW)
    assert (nxt.run_id, nxt.resume) == ("nightly-20261122T030000Z", False)
    assert "cannot be resumed" in caplog.text


def test_prefixes(tmp_path):
    assert check_prefix("tiny-nightly_1.0") == "tiny-nightly_1.0"
    for bad in ("", "-x", "a b", "a/b"):
        with pytest.raises(ConfigError, match="run prefix"):
            check_prefix(bad)
    assert safe_prefix("my nightly/run ") == "my-nightly-run"
    assert safe_prefix("///") == "grpo"
