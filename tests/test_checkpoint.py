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
