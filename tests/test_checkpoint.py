"""Checkpoint bookkeeping: complete-then-latest, pruning that keeps `latest`, fallback on damage."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

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


# ---- the background writer (runtime/trainer/checkpoint_writer.py) -----------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])  # bf16: weights, an fp32 master and Adam apart
def test_a_background_save_holds_the_state_it_began_with_and_hashes_what_it_wrote(tiny_checkpoint, tmp_path, dtype,
                                                                                 monkeypatch):
    """An update between save_begin and the write (the writer held at its start, the next chunk training) leaves
    the checkpoint as an inline save at the same state writes it, bitwise; the writer's sha256 of each file it
    wrote is the file's. ~6 s each."""
    import threading

    from runtime.models import load_hf_config
    from tests.test_resume import assert_same_checkpoint, checkpoint_tensors
    from tests.test_trainer_memory import _batch, _trainer
    from tests.waiting import wait_reached
    hf, td = tiny_checkpoint
    tr = _trainer({"hf": hf, "td": td}, dtype=dtype)
    vocab = load_hf_config(hf).vocab_size
    tr.train(_batch(vocab, seed=0))
    tr.save(str(tmp_path / "inline" / "model"))
    from collections import Counter

    from runtime.testing import moments
    monkeypatch.setattr(moments, "_hits", Counter())  # hits are counted per process: the other dtype's too
    pause = tmp_path / "pause"
    pause.mkdir()
    monkeypatch.setenv("GRPOFLOW_TEST_PAUSE_AT", "checkpoint-write-started")
    monkeypatch.setenv("GRPOFLOW_TEST_PAUSE_DIR", str(pause))
    began = tr.save_begin(str(tmp_path / "background" / "model"), background=True)
    wait_reached(pause / "checkpoint-write-started.reached", timeout_s=300)
    assert threading.current_thread() is threading.main_thread() and not tr.save_done()
    before = {k: v.clone() for k, v in tr.model.state_dict().items() if torch.is_tensor(v)}
    tr.train(_batch(vocab, seed=1))  # changes the live weights, master and Adam moments before a byte is written
    assert any(not torch.equal(v, tr.model.state_dict()[k]) for k, v in before.items())
    (pause / "checkpoint-write-started.go").touch()
    done = tr.save_finish()
    assert began["stall_s"] >= 0 and done["write_s"] >= 0 and done["hash_s"] >= 0
    assert done["files"] and all(rel.startswith("model/") for rel in done["files"])
    for rel, meta in done["files"].items():
        f = tmp_path / "background" / rel
        assert meta == {"size": f.stat().st_size, "sha256": checkpoint.sha256_file(f)}
    assert_same_checkpoint(checkpoint_tensors(tmp_path / "background", tmp_path),
                           checkpoint_tensors(tmp_path / "inline", tmp_path))
    monkeypatch.delenv("GRPOFLOW_TEST_PAUSE_AT")
    tr.save(str(tmp_path / "after" / "model"))
    with pytest.raises(AssertionError, match="tensors differ"):  # the comparison tells the two states apart
        assert_same_checkpoint(checkpoint_tensors(tmp_path / "after", tmp_path),
                               checkpoint_tensors(tmp_path / "inline", tmp_path))


def test_a_write_that_fails_surfaces_at_finish_and_publishes_nothing(tmp_path):
    """The writer's error is raised where the loop makes the checkpoint durable; nothing is published and the
    temp dir is gone."""
    rd = RunDir(str(tmp_path), "r")
    checkpoint.save(rd, 2, _writer(b"a" * 10), {}, keep_last=3)
    writing = checkpoint.Writing(rd, 4, {"cursor": 4}, keep_last=3)
    _writer(b"b" * 10)(writing.model_dir)
    writing.abandon(OSError("disk full"))
    assert checkpoint.latest(rd).rollout == 2
    assert not any(p.name.startswith(".rollout_4") for p in Path(rd.checkpoints).iterdir())


def test_a_held_checkpoint_is_not_hashed_and_any_other_is(tmp_path):
    """`latest(held=N)`: the live actors hold rollout N, so its files are checked by size only; a checkpoint
    loaded from disk is hashed in full (same size, other bytes: skipped for the previous one)."""
    rd = RunDir(str(tmp_path), "r")
    for n in (2, 4):
        checkpoint.save(rd, n, _writer(bytes([n]) * 10), {"cursor": n}, keep_last=3)
    (Path(rd.checkpoint(4)) / "model" / "weights.bin").write_bytes(b"\x05" * 10)  # same size, other bytes
    assert checkpoint.latest(rd, held=4).rollout == 4
    assert checkpoint.latest(rd).rollout == 2
    (Path(rd.checkpoint(4)) / "model" / "weights.bin").write_bytes(b"\x05" * 9)  # truncated: seen without a hash
    assert checkpoint.latest(rd, held=4).rollout == 2


def test_a_checkpoint_is_hashed_once_per_process_until_a_file_changes(tmp_path, monkeypatch):
    """A resume asks for `latest` several times: the bytes are read once; a file rewritten since (same size,
    other bytes) is read again and found damaged. <1 s."""
    import os
    rd = RunDir(str(tmp_path), "r")
    checkpoint.save(rd, 2, _writer(b"a" * 10), {"cursor": 2}, keep_last=3)
    hashed = []
    real = checkpoint.sha256_file
    monkeypatch.setattr(checkpoint, "sha256_file", lambda p: hashed.append(p) or real(p))
    assert checkpoint.verify(rd.checkpoint(2)) is None
    first = len(hashed)
    assert first >= 2 and checkpoint.verify(rd.checkpoint(2)) is None and len(hashed) == first
    weights = Path(rd.checkpoint(2)) / "model" / "weights.bin"
    weights.write_bytes(b"b" * 10)
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # a later write, whatever the clock's grain
    assert checkpoint.verify(rd.checkpoint(2)) == "model/weights.bin checksum mismatch"


# ---- 12 bytes a parameter: bf16 weights left to their fp32 masters (runtime/trainer/master_weights.py) ---------

@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_bf16_checkpoint_holds_masters_not_weights_and_resumes_bitwise(tiny_checkpoint, tmp_path, monkeypatch, lora):
    """A bf16 checkpoint's tensors are the fp32 masters and Adam's moments, 12 bytes a trained parameter (the
    previous format: 14, the bf16 weights beside them; with LoRA the adapters'). A trainer loading either rebuilds
    the weights bitwise, even over other weights, and its next update is the unbroken one's; the HF export of either
    is the same bytes. ~6 s each."""
    from runtime.models import load_hf_config
    from runtime.tracking.model_registry import EXPORT_MARKER, export_trainer_checkpoint, stored_dtype
    from runtime.trainer import master_weights
    from tests.test_resume import assert_same_checkpoint, checkpoint_tensors
    from tests.test_trainer_memory import _batch, _trainer
    hf, td = tiny_checkpoint
    tiny, vocab = {"hf": hf, "td": td}, load_hf_config(hf).vocab_size
    train = {"lora": {"enabled": True, "rank": 4, "alpha": 8.0}} if lora else {}

    def state(tr) -> dict[str, torch.Tensor]:  # trained weights and their masters, copied
        trained = [(n, p) for n, p in tr.model.named_parameters() if p.requires_grad]
        return {**{n: p.detach().clone() for n, p in trained},
                **{f"{n}.master": p.main_param.detach().clone() for n, p in trained}}

    def assert_same(a: dict, b: dict) -> None:
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])][:3]

    a = _trainer(tiny, dtype="bfloat16", **train)
    a.train(_batch(vocab, seed=0))
    a.save(str(tmp_path / "new" / "model"))
    with monkeypatch.context() as m:  # the previous version's save: every weight kept, no marker
        m.setattr(master_weights, "master_backed", lambda *_: set())
        a.save(str(tmp_path / "old" / "model"))
    saved = state(a)
    a.train(_batch(vocab, seed=1))
    unbroken = state(a)

    from torch.distributed.checkpoint import FileSystemReader
    n = sum(p.numel() for p in a.model.parameters() if p.requires_grad)
    for v, per_param in (("new", 12), ("old", 14)):
        size = sum(f.stat().st_size for f in (tmp_path / v / "model").glob("*.distcp"))
        items = len(FileSystemReader(str(tmp_path / v / "model")).read_metadata().storage_data)
        # each stored tensor in its own torch.save record: ~1.5 KB of header
        assert per_param * n <= size < per_param * n + 2048 * items, (v, size, n, items)
    new, old = (checkpoint_tensors(tmp_path / v, tmp_path) for v in ("new", "old"))
    assert all(k.startswith("optimizer.state.") for k in new) and new.keys() < old.keys()
    assert_same_checkpoint(new, {k: old[k] for k in new})  # the same masters and moments
    assert stored_dtype(tmp_path / "new" / "model") == torch.bfloat16  # as the weights said (LoRA: the base)
    assert stored_dtype(tmp_path / "old" / "model") == (None if lora else torch.bfloat16)

    b = _trainer(tiny, dtype="bfloat16", **train)
    for v in ("old", "new", "old"):  # each load over the weights of the update after the checkpoint
        b.load(str(tmp_path / v / "model"))
        assert_same(state(b), saved)
        b.train(_batch(vocab, seed=1))
        assert_same(state(b), unbroken)

    # the LoRA export's dtype defaults to the base's where the checkpoint does not say it (the old one): fp32 here,
    # bf16 in a bf16 run, whose base is converted in bf16
    base = {"base_dir": td, "dtype": torch.bfloat16} if lora else {}
    exports = {v: export_trainer_checkpoint(tmp_path / v / "model", hf, tmp_path / f"{v}-hf", **base)
               for v in ("new", "old")}
    assert exports["new"]["dtype"] == "bfloat16" and exports["new"]["files"] == exports["old"]["files"]
    for f in exports["new"]["files"]:
        if f != EXPORT_MARKER:  # it names its source
            assert (tmp_path / "new-hf" / f).read_bytes() == (tmp_path / "old-hf" / f).read_bytes(), f
