"""One file-system view over local paths and object stores (s3://...), with atomic writes.

Atomic here means: readers see the old content or the new content, never a part. Locally that is a
temp name in the same directory and ``os.replace``; on object stores a single PUT is atomic already.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import fsspec


def is_remote(uri: str) -> bool:
    return "://" in str(uri) and not str(uri).startswith("file://")


def join(base: str, *parts: str) -> str:
    base = str(base)
    if is_remote(base):
        return "/".join([base.rstrip("/"), *[p.strip("/") for p in parts]])
    return str(Path(base, *parts))


def fs_for(uri: str) -> tuple[fsspec.AbstractFileSystem, str]:
    fs, path = fsspec.core.url_to_fs(str(uri))
    return fs, path


def exists(uri: str) -> bool:
    fs, path = fs_for(uri)
    return fs.exists(path)


def read_text(uri: str) -> str:
    with fsspec.open(str(uri), "r", encoding="utf-8") as f:
        return f.read()


def read_json(uri: str) -> Any:
    return json.loads(read_text(uri))


def write_bytes_atomic(uri: str, data: bytes) -> None:
    uri = str(uri)
    if is_remote(uri):
        fs, path = fs_for(uri)
        fs.pipe_file(path, data)
        return
    target = Path(uri)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_text_atomic(uri: str, text: str) -> None:
    write_bytes_atomic(uri, text.encode("utf-8"))


def write_json_atomic(uri: str, obj: Any) -> None:
    write_text_atomic(uri, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


@contextmanager
def atomic_dir(final: str | os.PathLike) -> Iterator[Path]:
    """Yield a scratch directory beside ``final``; on success it is renamed to ``final``.

    An existing ``final`` is replaced only after the new one is complete. On failure the scratch
    directory is removed and ``final`` is untouched.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
        if final.exists():
            old = final.parent / f".{final.name}.old-{uuid.uuid4().hex[:8]}"
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
