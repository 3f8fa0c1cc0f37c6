"""A root's MLflow store is shared by every run under it: one that is busy is waited for and then named, one that
is not sound is refused, and neither is ever moved or changed (it holds every run's history)."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cli.main import main

# Another process in a write transaction on the store (as `mlflow ui`, a notebook or a second run can be):
# it says "locked" once it holds the lock, and commits when told to on stdin.
_HOLDER = r'''
import sqlite3, sys
con = sqlite3.connect(sys.argv[1], isolation_level=None)
con.execute("BEGIN IMMEDIATE")
con.execute("UPDATE experiments SET name = name || '-renamed-by-holder' WHERE experiment_id = 0")
print("locked", flush=True)
sys.stdin.readline()
con.execute("COMMIT")
print("committed", flush=True)
'''


@pytest.fixture(scope="module")
def made_store(tmp_path_factory):
    """A root whose store holds one run and one registered version (what other runs have put there); ~15 s
    of MLflow's migrations, once."""
    from runtime.tracking.mlflow_tracker import make_client, sqlite_uri
    root = tmp_path_factory.mktemp("shared-store")
    client = make_client(sqlite_uri(root))
    run = client.create_run(client.create_experiment("other"))
    client.create_registered_model("other-model")
    client.create_model_version("other-model", source=str(root / "somewhere"), run_id=run.info.run_id)
    return root / "mlflow.db"


@pytest.fixture
def store(made_store, tmp_path):
    shutil.copy(made_store, tmp_path / "mlflow.db")
    return tmp_path


def _siblings(root: Path) -> list[str]:
    """The store and anything beside it but SQLite's own journal (a copy moved aside, a temp store)."""
    return sorted(p.name for p in root.iterdir() if p.name.startswith(("mlflow.db", ".mlflow.db.tmp"))
                  and not p.name.endswith(("-journal", "-wal", "-shm")))


def test_a_locked_store_is_waited_for_then_named_and_never_moved(store, capsys, monkeypatch):
    """~2 s. Locked past the wait: exit 3 and one line naming the store; nothing moved, the other run's version
    still listed once the holder commits. Released during the wait: the command goes on and sees the holder's
    commit."""
    from runtime.tracking import mlflow_tracker
    db = store / "mlflow.db"
    monkeypatch.setattr(mlflow_tracker, "STORE_LOCK_WAIT_S", 0.5)
    mlflow_tracker._sound.clear()
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(db)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        before = _siblings(store)
        assert main(["models", "list", "--root", str(store)]) == 3
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and str(db) in err[0] and "locked by another process" in err[0], err
        assert _siblings(store) == before == ["mlflow.db"]

        # released while a command waits: it goes on (the holder lets go when the check is about to begin)
        def release(name, index=None):
            if name == "mlflow-store-checking" and holder.poll() is None:
                holder.stdin.write("go\n")
                holder.stdin.flush()
        monkeypatch.setattr(mlflow_tracker, "STORE_LOCK_WAIT_S", 60.0)
        monkeypatch.setattr(mlflow_tracker, "moment", release)
        assert main(["models", "list", "--root", str(store)]) == 0, capsys.readouterr().err
        assert holder.stdout.readline().strip() == "committed"
        assert "other-model" in capsys.readouterr().out
    finally:
        holder.kill()
        holder.wait()
    from runtime.tracking.mlflow_tracker import make_client, sqlite_uri
    client = make_client(sqlite_uri(store))
    assert client.get_experiment("0").name.endswith("-renamed-by-holder")  # the holder's write landed, in place
    assert [int(v.version) for v in client.search_model_versions("name = 'other-model'")] == [1]


@pytest.mark.parametrize("damage", ["garbage", "cut", "not-mlflow", "half-made", "directory"])
def test_a_store_that_is_not_sound_is_refused_in_one_line_and_left_as_it_is(store, capsys, damage):
    """< 1 s each. A store overwritten, cut short, some other SQLite file, one half-made by older code, or a
    directory in its place: `models list` (and a run, through the same check) refuses it in one line naming it;
    its bytes are left as they were, nothing is moved aside."""
    import sqlite3

    from runtime.tracking import mlflow_tracker
    db = store / "mlflow.db"
    mlflow_tracker._sound.clear()
    if damage == "garbage":
        data = bytearray(db.read_bytes())
        data[4096:12288] = b"\xde\xad\xbe\xef" * 2048  # pages 2-3: the schema's tables
        db.write_bytes(bytes(data))
    elif damage == "cut":
        db.write_bytes(db.read_bytes()[: db.stat().st_size // 3])
    elif damage == "not-mlflow":
        db.unlink()
        with sqlite3.connect(db) as con:
            con.execute("CREATE TABLE notes (t TEXT)")
    elif damage == "half-made":  # what a kill in the first migration step of an older, non-atomic creation left
        from mlflow.store.db.utils import InitialBase
        from sqlalchemy import create_engine
        db.unlink()
        engine = create_engine(f"sqlite:///{db}")
        InitialBase.metadata.create_all(engine)
        engine.dispose()
    else:
        db.unlink()
        db.mkdir()
        (db / "kept.txt").write_text("mine")
    before = db.read_bytes() if db.is_file() else (db / "kept.txt").read_text()
    assert main(["models", "list", "--root", str(store)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(db) in err[0], err
    assert ("not a file" if damage == "directory" else "not a sound MLflow store") in err[0], err
    assert _siblings(store) == ["mlflow.db"]
    assert (db.read_bytes() if db.is_file() else (db / "kept.txt").read_text()) == before
