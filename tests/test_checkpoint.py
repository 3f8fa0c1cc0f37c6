"""Checkpoint bookkeeping: complete-then-latest, pruning that keeps `latest`, fallback on damage."""
from __future__ import annotations

from pathlib import Path

from runtime.run import checkpoint
from runtime import storage
from runtime.run.directory import RunDir


def _writer(payload: bytes):
    def write(path: str) -> None:
        Path(path).mkdir(parents=True)
        (Path(path) / "weights.bin").write_bytes(payload)
    return write


def test_pruning_keeps_the_newest_and_never_latest(tmp_path):
    rd = RunDir(str(tmp_path), "r")
    for n in (2, 4, 6):
        checkpoint.save(rd, n, _writer(bytes([n]) * 10), {"cursor": n}, keep_last=5)
    # point `latest` back at an old checkpoint (as after a fallback), then prune to one
    storage.write_json_atomic(rd.latest, {"rollout": 2, "dir": "rollout_2"})
    checkpoint.prune(rd, keep_last=1)
    kept = sorted(p.name for p in Path(rd.checkpoints).iterdir() if p.name.startswith("rollout_"))
    assert kept == ["rollout_2", "rollout_6"]
    assert checkpoint.latest(rd).rollout == 2


def test_save_moves_latest_only_after_a_complete_checkpoint(tmp_path):
    rd = RunDir(str(tmp_path), "r")
    checkpoint.save(rd, 2, _writer(b"a" * 10), {}, keep_last=3)

    def broken(path: str) -> None:
        _writer(b"b" * 10)(path)
        raise OSError("disk full")

    try:
        checkpoint.save(rd, 4, broken, {}, keep_last=3)
    except OSError:
        pass
    assert checkpoint.latest(rd).rollout == 2
    assert not Path(rd.checkpoint(4)).exists()
    assert not any(p.name.startswith(".rollout_4") for p in Path(rd.checkpoints).iterdir())


def test_damaged_latest_falls_back_to_the_previous(tmp_path):
    rd = RunDir(str(tmp_path), "r")
    for n in (2, 4):
        checkpoint.save(rd, n, _writer(bytes([n]) * 10), {"cursor": n}, keep_last=3)
    (Path(rd.checkpoint(4)) / "model" / "weights.bin").write_bytes(b"\x04" * 9)  # truncated
    ck = checkpoint.latest(rd)
    assert ck.rollout == 2 and ck.state["cursor"] == 2
    (Path(rd.checkpoint(4)) / "model" / "weights.bin").write_bytes(b"\x05" * 10)  # same size, other bytes
    assert checkpoint.verify(rd.checkpoint(4)) is not None


def test_each_problem_is_said_once_and_repair_points_latest_at_the_checkpoint_used(tmp_path, caplog):
    """A resume reads `latest` several times; a damaged checkpoint or an unreadable `latest` is said once.
    The next writer (holding the lease) makes `latest` name the checkpoint it uses."""
    import json
    import logging

    caplog.set_level(logging.WARNING, logger="runtime.run.checkpoint")
    rd = RunDir(str(tmp_path), "r")
    for n in (2, 4, 6):
        checkpoint.save(rd, n, _writer(bytes([n]) * 10), {"cursor": n}, keep_last=3)
    (Path(rd.checkpoint(6)) / "model" / "weights.bin").write_bytes(b"\x06" * 9)
    assert [checkpoint.latest(rd).rollout for _ in range(3)] == [4, 4, 4]
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "rollout_6 is unusable" in said[0], said
    assert checkpoint.repair_latest(rd).rollout == 4
    assert json.loads(Path(rd.latest).read_text())["rollout"] == 4

    Path(rd.latest).write_bytes(b"\x00{garbage")
    caplog.clear()
    assert [checkpoint.latest(rd).rollout for _ in range(3)] == [4, 4, 4]  # the newest intact one listed
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and f"{rd.latest} is unreadable" in said[0], said
    assert checkpoint.repair_latest(rd).rollout == 4
    assert json.loads(Path(rd.latest).read_text()) == {"rollout": 4, "dir": "rollout_4"}
    assert not caplog.records[1:]  # repaired without a second word

    Path(rd.latest).unlink()  # a writer killed before moving it: left as it is
    assert checkpoint.repair_latest(rd).rollout == 4 and not Path(rd.latest).exists()
