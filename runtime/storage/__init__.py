"""One file-system view over local paths and object stores (s3://...), with atomic writes.

Atomic here means: readers see the old content or the new content, never a part. Locally that is a
temp name in the same directory and ``os.replace``; on object stores a single PUT is atomic already.

Object stores, in addition:
- every failure of the store (bucket missing, access denied, endpoint unreachable) becomes a one-line
  ``runtime.storage.s3_error_text.StorageError`` naming the URI and the fix (``s3_errors``, ``check_root``);
- readers that need local files (megatron, transformers, the trainer) get a local mirror of a remote
  file or prefix, downloaded once and reused while the remote listing is unchanged (``local_copy``);
- a directory is published by uploading every file with the completion files last (``upload_dir``).
Credentials come only from the environment or the fsspec/boto configuration; nothing here logs them.
"""
from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterable, Iterator
from urllib.parse import urlsplit

import fsspec

from runtime.errors import ConfigError, TransientError, UserError


def is_remote(uri: str) -> bool:
    return "://" in str(uri) and not str(uri).startswith("file://")


def absolute_uri(uri: str) -> str:
    """``uri`` as it resolves from any working directory: a local path becomes the ``file://`` URI of its
    absolute path; a remote URI (``s3://``) or a ``file://`` URI is one already."""
    uri = str(uri)
    if is_remote(uri) or uri.startswith("file://"):
        return uri
    return Path(uri).resolve().as_uri()


def path_of(uri: str) -> str:
    """The local path a ``file://`` URI names (a plain path, or a remote URI, as it is)."""
    from urllib.request import url2pathname

    uri = str(uri)
    return url2pathname(urlsplit(uri).path) if uri.startswith("file://") else uri


def join(base: str, *parts: str) -> str:
    base = str(base)
    if is_remote(base):
        return "/".join([base.rstrip("/"), *[p.strip("/") for p in parts]])
    return str(Path(base, *parts))


def fs_for(uri: str) -> tuple[fsspec.AbstractFileSystem, str]:
    uri = str(uri)
    if is_remote(uri) and "@" in urlsplit(uri).netloc:  # a --root given on the command line, not checked by the config
        from runtime.secrets import redact_uri
        raise ConfigError(f"{redact_uri(uri)}: credentials do not belong in the URI (it is printed and stored); "
                          f"remove them and set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) instead")
    if is_remote(uri):
        # No listings cache: another process (a resumed run, a reader) changes the store under us, and a
        # stale listing would hide a new `latest` or show a deleted checkpoint.
        return fsspec.core.url_to_fs(uri, use_listings_cache=False)
    return fsspec.core.url_to_fs(uri)


def exists(uri: str) -> bool:
    fs, path = fs_for(uri)
    with s3_errors(uri):
        return fs.exists(path)


def read_text(uri: str) -> str:
    fs, path = fs_for(uri)
    with s3_errors(uri), fs.open(path, "r", encoding="utf-8") as f:
        return f.read()


def read_json(uri: str) -> Any:
    return json.loads(read_text(uri))


def write_bytes_atomic(uri: str, data: bytes) -> None:
    uri = str(uri)
    if is_remote(uri):
        fs, path = fs_for(uri)
        with s3_errors(uri):
            fs.pipe_file(path, data)
        return
    with _local_atomic_file(uri) as f:
        f.write(data)


def copy_stream_atomic(src, uri: str) -> None:
    """Write the binary stream `src` to `uri` atomically without holding it in memory (locally)."""
    uri = str(uri)
    if is_remote(uri):
        write_bytes_atomic(uri, src.read())
        return
    with _local_atomic_file(uri) as f:
        shutil.copyfileobj(src, f, length=16 << 20)


@contextmanager
def _local_atomic_file(path: str):
    """A temp file beside `path`, fsynced and renamed onto it on success, removed on failure."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
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
        from runtime.testing.moments import moment
        moment(f"built:{final.parent.name}/{final.name}")  # complete under its temp name, not yet renamed
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


# ---- object stores: errors, the early check -------------------------------------------------------
@contextmanager
def s3_errors(uri: str) -> Iterator[None]:
    """Turn an object-store failure while using ``uri`` into a one-line StorageError (bucket missing,
    access denied, endpoint unreachable). Other errors - a missing object included - pass unchanged."""
    try:
        yield
    except UserError:
        raise
    except Exception as err:
        if is_remote(str(uri)):
            from runtime.storage.s3_error_text import translate

            mapped = translate(err, str(uri))
            if mapped is not None:
                raise mapped from None
        raise


def check_root(root: str, field: str = "storage.root") -> None:
    """Fail early, with one line, when a remote storage root (or input URI, named by ``field``) cannot be
    used: credentials in the URI, a missing bucket, wrong credentials, an unreachable endpoint. A local
    path is always fine here."""
    root = str(root)
    if not is_remote(root):
        return
    parts = urlsplit(root)
    if "@" in parts.netloc or parts.password:
        raise ConfigError(f"{field} {parts.scheme}://...@{parts.netloc.rsplit('@', 1)[-1]}{parts.path}: "
                          f"credentials do not belong in the URI (it is written to the frozen config); "
                          f"set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) instead")
    fs, path = fs_for(root)
    bucket, _, prefix = path.strip("/").partition("/")
    with s3_errors(root):
        if hasattr(fs, "call_s3"):  # s3fs: one LIST (HEAD requests carry no error code)
            fs.call_s3("list_objects_v2", Bucket=bucket, Prefix=(prefix.rstrip("/") + "/") if prefix else "",
                       MaxKeys=1)
        else:
            fs.exists(path)


def check_writable(uri: str, field: str = "storage.root", shown: str | None = None) -> None:
    """Fail early, with one line naming ``field`` and the fix, when a local directory a run writes into (``uri``,
    or the nearest part of it that exists) cannot be written: a read-only file system, no permission, a path
    under a file. Probed by making and removing a temp file there; nothing stays. A remote URI is left to
    the store (:func:`check_root`, :func:`s3_errors`)."""
    uri = str(uri)
    if is_remote(uri):
        return
    shown = shown or uri
    probe = Path(path_of(uri)).expanduser().absolute()
    check_no_link_loop(str(probe), field, shown)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        why = f"{probe} is a file, not a directory"
    else:
        try:
            fd, tmp = tempfile.mkstemp(prefix=".grpoflow-write-check-", dir=probe)
            os.close(fd)
            os.unlink(tmp)
            return
        except OSError as err:
            why = f"{err.strerror or type(err).__name__}: {probe}"
    raise ConfigError(f"{field} {shown} cannot be written ({why}); use a directory this user can write for {field}")


def check_no_link_loop(uri: str, field: str = "storage.root", shown: str | None = None) -> None:
    """One ConfigError when local ``uri`` (or a directory on its way) is a symbolic-link loop: every later
    stat of it would fail with ELOOP, far from the setting that caused it."""
    if is_remote(str(uri)):
        return
    try:
        os.stat(path_of(str(uri)))
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise ConfigError(f"{field} {shown or uri} cannot be used: {err.filename or uri} is a symbolic link loop "
                              f"({err.strerror}); point {field} at a real directory") from None


# ---- a local mirror of remote files -------------------------------------------------------------
STAGED_SUFFIX = ".staged.json"


def scratch_root(state_dir: str | None = None) -> Path:
    """Where local copies of remote files live: ``<state_dir>/scratch``, else $GRPOFLOW_SCRATCH_DIR,
    else a directory under the system temp dir."""
    if state_dir:
        return Path(state_dir).expanduser() / "scratch"
    if os.environ.get("GRPOFLOW_SCRATCH_DIR"):
        return Path(os.environ["GRPOFLOW_SCRATCH_DIR"]).expanduser()
    uid = os.getuid() if hasattr(os, "getuid") else "user"
    return Path(tempfile.gettempdir()) / f"grpoflow-scratch-{uid}"


def staged_path(uri: str, state_dir: str | None = None) -> Path:
    """The local path that mirrors remote ``uri`` (``<scratch>/staged/<scheme>/<bucket>/<key>``)."""
    p = urlsplit(str(uri))
    return scratch_root(state_dir) / "staged" / p.scheme / p.netloc.rsplit("@", 1)[-1] / p.path.strip("/")


def _marker_of(local: Path) -> Path:
    return local.parent / f".{local.name}{STAGED_SUFFIX}"


def _meta(info: dict) -> dict:
    etag = info.get("ETag") or info.get("etag") or info.get("md5") or ""
    return {"size": int(info.get("size") or 0), "etag": str(etag).strip('"')}


def remote_listing(uri: str) -> dict[str, dict] | None:
    """``{relative name: {"size", "etag"}}`` of the objects under remote ``uri`` (a single object is
    ``{"": ...}``); None when nothing is there."""
    fs, path = fs_for(uri)
    path = path.rstrip("/")
    with s3_errors(uri):
        try:
            info = fs.info(path)
        except FileNotFoundError:
            return None
        if info.get("type") == "file":
            return {"": _meta(info)}
        found = fs.find(path, detail=True)
    base = path + "/"
    out = {name[len(base):]: _meta(i) for name, i in found.items()
           if name.startswith(base) and not name.endswith("/") and i.get("type", "file") == "file"}
    return out or None


def _read_marker(marker: Path) -> dict | None:
    try:
        return json.loads(marker.read_text())
    except (OSError, ValueError):
        return None


def _replace_path(tmp: Path, dest: Path) -> None:
    """Move ``tmp`` to ``dest``, replacing a file or directory there."""
    if dest.is_dir() and not dest.is_symlink():
        old = dest.parent / f".{dest.name}.old-{uuid.uuid4().hex[:8]}"
        os.replace(dest, old)
        os.replace(tmp, dest)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, dest)


def forget_staged(local: str | os.PathLike) -> None:
    """Drop a local copy (and its record), e.g. of a pruned checkpoint."""
    local = Path(local)
    _marker_of(local).unlink(missing_ok=True)
    if local.is_dir():
        shutil.rmtree(local, ignore_errors=True)
    else:
        local.unlink(missing_ok=True)


def local_copy(uri: str, state_dir: str | None = None) -> str:
    """A local path holding remote ``uri`` (a file or every object under a prefix); a local ``uri``
    is returned as it is. The copy is made once and reused while the remote listing (names, sizes,
    ETags) is unchanged. Raises FileNotFoundError when nothing is at ``uri``."""
    return stage(uri, state_dir)[0]


def stage(uri: str, state_dir: str | None = None) -> tuple[str, bool]:
    """``local_copy`` that also says whether it downloaded just now (a caller may then verify it)."""
    uri = str(uri)
    if not is_remote(uri):
        return uri.removeprefix("file://"), False
    uri = uri.rstrip("/")
    listing = remote_listing(uri)
    if not listing:
        raise FileNotFoundError(f"{uri}: nothing there")
    dest = staged_path(uri, state_dir)
    marker = _marker_of(dest)
    record = {"uri": uri, "files": listing}
    if dest.exists() and _read_marker(marker) == record:
        return str(dest), False
    dest.parent.mkdir(parents=True, exist_ok=True)
    marker.unlink(missing_ok=True)
    tmp = dest.parent / f".{dest.name}.dl-{uuid.uuid4().hex[:8]}"
    fs, path = fs_for(uri)
    path = path.rstrip("/")
    try:
        with s3_errors(uri):
            if list(listing) == [""]:
                fs.get_file(path, str(tmp))
                got = {"": tmp.stat().st_size}
            else:
                rels = sorted(listing)
                for rel in rels:
                    (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                fs.get([f"{path}/{rel}" for rel in rels], [str(tmp / rel) for rel in rels])
                got = {rel: (tmp / rel).stat().st_size for rel in rels}
        bad = [rel for rel, meta in listing.items() if got.get(rel) != meta["size"]]
        if bad:
            raise TransientError(f"{uri}: {bad[0] or 'the object'} changed while it was downloaded; retry")
        _replace_path(tmp, dest)
    except BaseException:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
        raise
    write_json_atomic(str(marker), record)
    return str(dest), True


def _files_under(local_dir: Path) -> list[str]:
    return sorted(p.relative_to(local_dir).as_posix() for p in local_dir.rglob("*") if p.is_file())


def upload_dir(local_dir: str | os.PathLike, uri: str, *, last: Iterable[str] = (), keep_local: bool = False) -> None:
    """Publish local directory ``local_dir`` at remote prefix ``uri``, replacing what is there.

    The files named in ``last`` (the completion files: a manifest, config.json) are uploaded last, in
    that order, and an older copy of them is deleted first: a reader that finds them finds a complete
    directory. Objects of an older upload that are not in ``local_dir`` are deleted before the last
    files go up. ``keep_local``: ``local_dir`` is the mirror of ``uri`` (``staged_path``); record it so
    ``local_copy`` reuses it without a download.
    """
    local_dir = Path(local_dir)
    uri = str(uri).rstrip("/")
    if not is_remote(uri):
        raise ValueError(f"upload_dir: {uri} is not a remote URI")
    files = _files_under(local_dir)
    tail = [f for f in last if f in files]
    head = [f for f in files if f not in tail]
    fs, root = fs_for(uri)
    root = root.rstrip("/")
    with s3_errors(uri):
        before = remote_listing(uri) or {}
        for rel in tail:
            if rel in before:
                fs.rm_file(f"{root}/{rel}")
        if head:
            fs.put([str(local_dir / rel) for rel in head], [f"{root}/{rel}" for rel in head])
        stale = [f"{root}/{rel}" for rel in before if rel not in files and rel]
        if stale:
            fs.rm(stale)
        for rel in tail:
            fs.put_file(str(local_dir / rel), f"{root}/{rel}")
    if keep_local:
        listing = remote_listing(uri) or {}
        write_json_atomic(str(_marker_of(local_dir)), {"uri": uri, "files": listing})


@contextmanager
def publish_dir(uri: str, *, last: Iterable[str] = (), state_dir: str | None = None) -> Iterator[Path]:
    """Yield a scratch directory to build ``uri`` in; when the block ends without an error, publish it.

    Local ``uri``: the scratch dir is renamed into place (``atomic_dir``: an older copy is replaced
    only once the new one is complete). Remote: the files are uploaded with ``last`` (the completion
    files) last (``upload_dir``), and the local build stays as the staged mirror of ``uri``, so the
    next reader downloads nothing. On an error nothing is published and the scratch is removed.
    """
    uri = str(uri)
    if not is_remote(uri):
        with atomic_dir(uri.removeprefix("file://")) as scratch:
            yield scratch
        return
    mirror = staged_path(uri, state_dir)
    forget_staged(mirror)
    with atomic_dir(mirror) as scratch:
        yield scratch
    upload_dir(mirror, uri, last=last, keep_local=True)


@contextmanager
def output_dir(uri: str, state_dir: str | None = None, *, last: Iterable[str] = ()) -> Iterator[str]:
    """A local directory for a writer that needs one (megatron, save_pretrained) to produce ``uri``.

    Local ``uri``: ``uri`` itself (the writer makes it appear atomically, e.g. with ``atomic_dir``).
    Remote: its local mirror, emptied first, uploaded with ``upload_dir(..., last)`` when the block ends
    without an error, and kept as the mirror.
    """
    uri = str(uri)
    if not is_remote(uri):
        yield uri.removeprefix("file://")
        return
    local = staged_path(uri, state_dir)
    forget_staged(local)
    local.parent.mkdir(parents=True, exist_ok=True)
    yield str(local)
    upload_dir(local, uri, last=last, keep_local=True)


def remove_tree(uri: str) -> None:
    """Delete a directory (local) or every object under a prefix (remote); a missing one is fine."""
    uri = str(uri)
    if not is_remote(uri):
        shutil.rmtree(uri.removeprefix("file://"), ignore_errors=True)
        return
    fs, path = fs_for(uri)
    with s3_errors(uri):
        try:
            fs.rm(path, recursive=True)
        except FileNotFoundError:
            pass
