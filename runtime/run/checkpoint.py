"""Training checkpoints: complete state written under a temp name, renamed, verified on load.

`checkpoints/rollout_<N>/` holds `model/` (torch_dist model + optimizer + LR schedule; bf16 weights as their fp32
masters, runtime/trainer/master_weights.py),
`trainer_state.json` (rollouts done, data cursor, metrics of the chunk) and `manifest.json` (every
file with its size and sha256), written last. `checkpoints/latest` names the newest complete one and
is replaced atomically after it. A checkpoint whose manifest does not match is skipped on load.

A checkpoint is begun (:class:`Writing`: a temp dir the trainer writes its model files into, in the background
with ``checkpoint.background``) and made durable later (:meth:`Writing.complete`); the trainer hashes the files
it writes, so the manifest re-reads none of them. Verification reads every byte only where a checkpoint is
loaded from disk or downloaded: a checkpoint whose state the live actors hold (``latest(held=N)``) is checked
for completeness and sizes only.

On a remote run directory (s3://...) a checkpoint is written into the local scratch dir exactly as
locally, then uploaded to ``checkpoints/rollout_<N>/`` with ``manifest.json`` last, and only then is
``latest`` replaced (one PUT): a half-uploaded checkpoint has no manifest and is never taken. Remote
checkpoints are verified by size against their manifest; ``Checkpoint.path`` is a local copy
(downloaded on first use, verified by sha256 when it was just downloaded).
"""
from __future__ import annotations

import hashlib
import json
import logging
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from runtime import storage
from runtime.errors import TransientError
from runtime.run.directory import RunDir
from runtime.testing.moments import moment

log = logging.getLogger(__name__)
MANIFEST = "manifest.json"
STATE = "trainer_state.json"


@dataclass
class Checkpoint:
    rollout: int
    uri: str  # where it lives: a local dir or a remote prefix
    state: dict
    state_dir: str | None = None  # storage.state_dir: where a remote checkpoint is staged

    @property
    def path(self) -> str:
        """A local directory holding this checkpoint (a remote one is downloaded once, then reused)."""
        return stage(self.uri, self.state_dir)


def stage(uri: str, state_dir: str | None = None) -> str:
    """A local copy of the checkpoint at ``uri``; a fresh download is checked against the manifest (sha256)."""
    if not storage.is_remote(uri):
        return str(uri)
    local, fresh = storage.stage(uri, state_dir)
    if fresh:
        problem = verify(local)
        if problem is not None:
            storage.forget_staged(local)
            raise TransientError(f"checkpoint {uri}: the downloaded copy is damaged ({problem}); retry")
    return local


def read_state(path: str) -> dict:
    """``trainer_state.json`` of the checkpoint at ``path`` (local or remote)."""
    return storage.read_json(storage.join(str(path), STATE))


def sha256_file(path: str | Path) -> str:
    """The sha256 of a file's bytes, read in 4 MiB blocks (a manifest's digest; the background writer's too)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _manifest(root: Path, hashed: dict[str, dict] | None = None) -> dict:
    """Every file under ``root`` with its size and sha256; ``hashed`` (relative path: size, sha256) holds hashes
    the writer took as it wrote, trusted for a file of that size (the writer's own files, hashed off the loop)."""
    hashed = hashed or {}
    files = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.name != MANIFEST:
            rel, size = str(p.relative_to(root)), p.stat().st_size
            known = hashed.get(rel)
            files[rel] = {"size": size, "sha256": known["sha256"] if known and known["size"] == size else sha256_file(p)}
    return {"files": files}


def verify(path: str, hashed: bool = True) -> str | None:
    """None when the checkpoint at `path` is complete and intact, else what is wrong.
    Local: sizes and (``hashed``) sha256 of every file. Remote: sizes (the sha256 is checked when it is staged).
    ``hashed=False`` for a checkpoint whose state this process already holds (nothing is loaded from it)."""
    if storage.is_remote(str(path)):
        return _verify_remote(str(path))
    root = Path(path)
    m = root / MANIFEST
    if not m.is_file():
        return "no manifest (incomplete write)"
    try:
        files = json.loads(m.read_text())["files"]
    except (ValueError, KeyError) as e:
        return f"unreadable manifest ({e})"
    seen = []
    for rel, meta in files.items():
        f = root / rel
        if not f.is_file():
            return f"missing {rel}"
        st = f.stat()
        if st.st_size != meta["size"]:
            return f"{rel} has {st.st_size} bytes, manifest says {meta['size']}"
        seen.append((rel, st.st_size, st.st_mtime_ns))
    if not hashed or _hashed_intact.get(str(root)) == seen:
        return None
    for rel, meta in files.items():
        if sha256_file(root / rel) != meta["sha256"]:
            return f"{rel} checksum mismatch"
    _hashed_intact[str(root)] = seen
    return None


# Local checkpoints this process hashed intact, with their files' sizes and mtimes then: a resume reads `latest`
# several times (is the run finished, which checkpoint, then the load) and hashes it once; a file written since
# (another mtime) is hashed again.
_hashed_intact: dict[str, list] = {}


def _verify_remote(uri: str) -> str | None:
    try:
        files = json.loads(storage.read_text(storage.join(uri, MANIFEST)))["files"]
    except FileNotFoundError:
        return "no manifest (incomplete write)"
    except (ValueError, KeyError) as e:
        return f"unreadable manifest ({e})"
    listing = storage.remote_listing(uri) or {}
    for rel, meta in files.items():
        if rel not in listing:
            return f"missing {rel}"
        if listing[rel]["size"] != meta["size"]:
            return f"{rel} has {listing[rel]['size']} bytes, manifest says {meta['size']}"
    return None


class Writing:
    """Checkpoint ``rollout_<rollout>`` while its model files are being written into :attr:`model_dir` (a temp
    dir; on a remote run dir, in the local scratch dir). :meth:`complete` makes it durable — trainer_state.json,
    then the manifest, then the publish (rename, or upload with the manifest last), then `latest`, then the
    prune —; :meth:`abandon` removes it. A process killed before :meth:`complete` leaves the temp dir, which
    the next prune removes and no resume takes."""

    def __init__(self, rd: RunDir, rollout: int, state: dict, keep_last: int):
        self.rd, self.rollout, self.state, self.keep_last = rd, rollout, state, keep_last
        self.where = rd.checkpoint(rollout)
        self._publish = storage.publish_dir(self.where, last=[MANIFEST], state_dir=rd.state_dir)
        self.tmp = self._publish.__enter__()

    @property
    def model_dir(self) -> str:
        return str(self.tmp / "model")

    def complete(self, hashed: dict[str, dict] | None = None, writer: dict | None = None) -> str:
        """Durable, under its name and named by `latest`; returns where it lives (a local dir or the remote
        prefix). ``hashed``: the hashes the writer took (:func:`_manifest`); ``writer``: its times, kept in
        trainer_state.json."""
        try:
            moment("checkpoint-model-written")
            state = {**self.state, "rollout": self.rollout, **({"writer": writer} if writer else {})}
            storage.write_json_atomic(str(self.tmp / STATE), state)
            storage.write_json_atomic(str(self.tmp / MANIFEST), _manifest(self.tmp, hashed))
            moment("checkpoint-manifest-written")
        except BaseException as e:
            self._publish.__exit__(type(e), e, e.__traceback__)
            raise
        self._publish.__exit__(None, None, None)
        moment("checkpoint-in-place")  # complete under its name (uploaded), `latest` not yet moved
        storage.write_json_atomic(self.rd.latest, {"rollout": self.rollout, "dir": f"rollout_{self.rollout}"})
        moment("checkpoint-latest-moved")
        prune(self.rd, self.keep_last)
        return self.where

    def abandon(self, error: BaseException) -> None:
        """Nothing published; the temp dir removed."""
        try:
            self._publish.__exit__(type(error), error, error.__traceback__)
        except BaseException:  # noqa: BLE001 - the context re-raises the error it was given
            pass


def save(rd: RunDir, rollout: int, write_model: Callable[[str], None], state: dict, keep_last: int) -> str:
    """Write checkpoint `rollout_<rollout>` completely, then point `latest` at it, then prune.
    Returns where it lives (a local dir, or the remote prefix)."""
    writing = Writing(rd, rollout, state, keep_last)
    try:
        write_model(writing.model_dir)
    except BaseException as e:
        writing.abandon(e)
        raise
    return writing.complete()


def _listed(rd: RunDir) -> list[int]:
    if storage.is_remote(rd.checkpoints):
        # Names of prefixes that hold objects (some stores keep an emptied "directory" listed).
        fs, path = storage.fs_for(rd.checkpoints)
        base = path.rstrip("/") + "/"
        with storage.s3_errors(rd.checkpoints):
            try:
                found = fs.find(path, detail=True)
            except FileNotFoundError:
                return []
        names = {name[len(base):].split("/", 1)[0] for name, info in found.items()
                 if name.startswith(base) and "/" in name[len(base):] and info.get("type", "file") == "file"}
    else:
        base = Path(rd.checkpoints)
        if not base.is_dir():
            return []
        names = [p.name for p in base.iterdir()]
    return sorted((int(m.group(1)) for name in names if (m := re.fullmatch(r"rollout_(\d+)", name))), reverse=True)


def prune(rd: RunDir, keep_last: int) -> None:
    latest = _latest_pointer(rd)
    remote = storage.is_remote(rd.checkpoints)
    for n in _listed(rd)[keep_last:]:
        if n == latest:
            continue
        if remote:
            fs, path = storage.fs_for(rd.checkpoint(n))
            with storage.s3_errors(rd.checkpoint(n)):
                fs.rm(path, recursive=True)
            storage.forget_staged(rd.staged(rd.checkpoint(n)))
        else:
            shutil.rmtree(rd.checkpoint(n), ignore_errors=True)
    local_base = rd.staged(rd.checkpoints) if remote else Path(rd.checkpoints)
    for p in local_base.glob(".rollout_*.tmp-*"):  # leftovers of a killed writer
        shutil.rmtree(p, ignore_errors=True)


def _pointer(rd: RunDir) -> tuple[int | None, str | None]:
    """The rollout `latest` names, and what is wrong with the file when it names none (None: no file)."""
    try:
        return int(storage.read_json(rd.latest)["rollout"]), None
    except FileNotFoundError:
        return None, None
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as err:
        return None, f"{type(err).__name__}: {' '.join(str(err).split())[:80]}"


def _latest_pointer(rd: RunDir) -> int | None:
    return _pointer(rd)[0]


# Problems already said in this process: a resume reads `latest` several times (is the run finished, where
# does training start, after a retry), and each problem is said once per run and checkpoint.
_said: set[tuple[str, str]] = set()


def _say_once(where: str, problem: str, message: str) -> None:
    if (where, problem) not in _said:
        _said.add((where, problem))
        log.warning(message)


def latest(rd: RunDir, held: int | None = None) -> Checkpoint | None:
    """The newest intact checkpoint: `latest` if it verifies, else the newest older one that does (an
    unreadable `latest`: the newest one listed that does). Each problem met is warned about once.
    ``held``: the rollout whose state the caller's live actors hold — that checkpoint is checked complete
    (manifest, files, sizes) but not hashed, as nothing is loaded from it; any other is hashed in full."""
    pointed, unreadable = _pointer(rd)
    if unreadable is not None:
        _say_once(rd.latest, unreadable, f"{rd.latest} is unreadable ({unreadable}); using the newest intact checkpoint")
    candidates = _listed(rd)
    if pointed is not None:
        candidates = [pointed] + [n for n in candidates if n < pointed]
    for n in candidates:
        path = rd.checkpoint(n)
        problem = verify(path, hashed=n != held)
        if problem is None:
            return Checkpoint(rollout=n, uri=path, state=read_state(path), state_dir=rd.state_dir)
        _say_once(path, problem, f"checkpoint {path} is unusable ({problem}); falling back to an older one")
    return None


def repair_latest(rd: RunDir) -> Checkpoint | None:
    """Point `latest` at the checkpoint a resume uses (:func:`latest`) when it names another one: it was
    unreadable, or named a damaged checkpoint. Call only while holding the run's lease. A missing `latest` is
    left missing (a writer killed before moving it: the checkpoint it names is the one to use)."""
    pointed, unreadable = _pointer(rd)
    if pointed is None and unreadable is None:
        return latest(rd)
    ck = latest(rd)
    if ck is not None and ck.rollout != pointed:
        storage.write_json_atomic(rd.latest, {"rollout": ck.rollout, "dir": f"rollout_{ck.rollout}"})
        log.info("%s names rollout_%d again", rd.latest, ck.rollout)
    return ck
