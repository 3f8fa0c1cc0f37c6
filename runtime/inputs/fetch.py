"""Fetch: bring a model checkpoint and the raw dataset files into the run directory.

Model sources: ``hf://org/name[@revision]``, a local directory, ``s3://bucket/prefix`` or
``builtin://tiny-qwen3``. Dataset sources: ``hf://org/name[@revision]``, a local or ``s3://``
.jsonl/.json/.parquet file, or ``builtin://arith/<split>[?difficulty=..&n=..&seed=..]``.

Hub downloads go through the shared Hugging Face cache (``$HF_HOME/hub``) and are then copied
(hard-linked where possible) into the run directory. We do not pass ``local_dir`` to
``snapshot_download``: with ``local_dir`` set, an offline call ignores a pre-seeded cache and fails,
and a pre-seeded cache is the only way to fetch on a machine without network.
"""
from __future__ import annotations

import fnmatch
import io
import os
import shutil
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from runtime import storage
from runtime.errors import DataError, ModelError, TransientError, UserError

# Everything a Hugging Face causal LM needs to load and tokenize; no *.bin, no optimizer states,
# no original/ or onnx/ sub-folders (only top-level files are kept).
MODEL_FILE_PATTERNS = (
    "config.json", "generation_config.json",
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
    "added_tokens.json", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json",
    "*.safetensors", "*.safetensors.index.json",
)
DATASET_EXTENSIONS = (".jsonl", ".json", ".parquet")
BUILTIN_MODELS = ("tiny-qwen3", "tiny-qwen3-moe")  # the second: 4 experts, 2 routed per token


def _wanted(name: str) -> bool:
    return "/" not in name and any(fnmatch.fnmatchcase(name, p) for p in MODEL_FILE_PATTERNS)


def _split_hf(source: str, kind: str) -> tuple[str, str | None]:
    """``hf://org/name[@rev]`` → (repo_id, revision or None)."""
    rest = source[len("hf://"):]
    repo_id, _, revision = rest.partition("@")
    if repo_id.count("/") != 1 or not all(repo_id.split("/")):
        err = ModelError if kind == "model" else DataError
        raise err(f"{source}: expected hf://org/name[@revision], e.g. hf://Qwen/Qwen3-0.6B")
    return repo_id, revision or None


def _cause_chain(err: BaseException):
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__ or err.__context__


def _is_passing_network_error(err: BaseException) -> bool:
    """Timeouts, rate limits and server errors: worth a retry. (A refused connection or an unknown host
    means no network at all: retrying does not help, the user must pre-seed the cache.)"""
    for e in _cause_chain(err):
        names = {c.__name__ for c in type(e).__mro__}
        if isinstance(e, TimeoutError) or names & {"TimeoutException", "Timeout", "ReadTimeout", "ConnectTimeout"}:
            return True
        response = getattr(e, "response", None)
        status = getattr(response, "status_code", None)
        if isinstance(status, int) and (status >= 500 or status == 429):
            return True
    return False


def _offline_hint(repo_id: str, repo_type: str, field: str) -> str:
    flag = " --repo-type dataset" if repo_type == "dataset" else ""
    target = "a local file or s3:// URI" if repo_type == "dataset" else "a local dir or s3:// URI"
    return (f"pre-seed the Hugging Face cache: run `hf download {repo_id}{flag}` (huggingface-cli download in "
            f"older versions) on a machine with network and copy its ~/.cache/huggingface (or $HF_HOME) here, "
            f"or set {field} to {target}")


# -- identity of a source --------------------------------------------------------------------------
def source_identity(source: str, *, model: bool = False) -> dict | str | None:
    """What tells one version of ``source`` from another without reading it: size and mtime of a local
    file (every model file of a local directory), size and ETag of the objects under an s3:// URI.
    None for built-in and hf:// sources, whose string (with its ``@revision``) is their identity, and
    "missing" for a path that is not there (fetch then says so)."""
    source = str(source)
    if source.startswith(("builtin://", "hf://")):
        return None
    if storage.is_remote(source):
        fs, path = storage.fs_for(source)
        try:
            with storage.s3_errors(source):
                found = fs.find(path, detail=True) if model else {path: fs.info(path)}
        except (FileNotFoundError, OSError, UserError):
            return "missing"  # fetch reports why, with the fix
        return {name.rsplit("/", 1)[-1]: [info.get("size"), str(info.get("ETag") or info.get("LastModified") or "")]
                for name, info in sorted(found.items()) if not model or _wanted(name.rsplit("/", 1)[-1])}
    local = Path(source.removeprefix("file://")).expanduser()
    try:
        if local.is_dir():
            return {p.name: [p.stat().st_size, p.stat().st_mtime_ns] for p in sorted(local.iterdir())
                    if p.is_file() and _wanted(p.name)}
        st = local.stat()
    except OSError:
        return "missing"
    return [st.st_size, st.st_mtime_ns]


# -- publishing a directory -----------------------------------------------------------------------
def _link_or_copy(src: Path, dst: Path) -> None:
    # Hub cache files are symlinks into blobs/: hard-link the blob when on the same file system
    # (a 9B checkpoint is not stored twice), copy otherwise.
    real = src.resolve()
    try:
        os.link(real, dst)
    except OSError:
        shutil.copyfile(real, dst)


def _publish_dir(build, dest_dir: str) -> None:
    """Run ``build(scratch_dir)`` and make the result appear at ``dest_dir`` all at once
    (``storage.publish_dir``: renamed into place, or uploaded with config.json last)."""
    try:  # bucket missing / access denied / unreachable: one-line StorageError from the upload
        with storage.publish_dir(dest_dir, last=["config.json"]) as scratch:
            build(scratch)
    except PermissionError as err:
        raise ModelError(f"{dest_dir}: access denied ({err}); check the storage credentials") from None
    except OSError as err:
        if not storage.is_remote(dest_dir):
            raise
        raise TransientError(f"{dest_dir}: upload failed ({err})") from err


def _verify_model_dir(path: Path, shown: str) -> list[str]:
    names = sorted(p.name for p in path.iterdir() if p.is_file())
    if "config.json" not in names:
        raise ModelError(f"{shown}: no config.json (not a Hugging Face model directory; give a dir saved with "
                         f"save_pretrained, hf://org/name or s3://...)")
    if not any(n.endswith(".safetensors") for n in names):
        raise ModelError(f"{shown}: no *.safetensors weights (only safetensors are used; re-save the model "
                         f"with save_pretrained(..., safe_serialization=True))")
    return names


# -- model ----------------------------------------------------------------------------------------
def fetch_model(source: str, dest_dir: str, *, builtin_seed: int = 0) -> dict:
    """Fetch a Hugging Face checkpoint into ``dest_dir`` (replacing it as a whole); returns a JSON-able
    report ``{"source", "kind", "path", "files", "bytes"}`` (+ ``"revision"``, the commit, for hf://)."""
    source = str(source)
    extra: dict = {}

    if source.startswith("builtin://"):
        name = source[len("builtin://"):].strip("/")
        if name not in BUILTIN_MODELS:
            raise ModelError(f"model.source={source}: unknown built-in model (known: "
                             f"{', '.join('builtin://' + m for m in BUILTIN_MODELS)})")

        def fill(scratch: Path) -> None:
            from runtime.models.tiny import build_tiny_qwen3  # imports torch: only when asked for

            build_tiny_qwen3(str(scratch), seed=builtin_seed, num_experts=4 if name == "tiny-qwen3-moe" else 0)
        kind = "builtin"
    elif source.startswith("hf://"):
        repo_id, revision = _split_hf(source, "model")
        snapshot = _hf_model_snapshot(source, repo_id, revision)
        _verify_model_dir(snapshot, source)
        extra["revision"] = snapshot.name  # snapshots/<commit>

        def fill(scratch: Path) -> None:
            for p in sorted(snapshot.iterdir()):
                if p.is_file() and _wanted(p.name):
                    _link_or_copy(p, scratch / p.name)
        kind = "hf"
    elif storage.is_remote(source):
        remote_files = _remote_model_files(source)

        def fill(scratch: Path) -> None:
            fs, _ = storage.fs_for(source)
            try:
                with storage.s3_errors(source):  # bucket / access / endpoint: one-line StorageError
                    for name, remote in remote_files.items():
                        fs.get_file(remote, str(scratch / name))
            except PermissionError as err:
                raise ModelError(f"{source}: access denied ({err}); check the storage credentials") from None
            except OSError as err:
                raise TransientError(f"{source}: download failed ({err})") from err
        kind = "remote"
    else:
        local = Path(source.removeprefix("file://")).expanduser()
        if not local.is_dir():
            what = "is not a directory" if local.exists() else "does not exist"
            raise ModelError(f"model path {what}: {local} (give a local dir, hf://org/name or s3://...)")
        _verify_model_dir(local, str(local))

        def fill(scratch: Path) -> None:
            for p in sorted(local.iterdir()):
                if p.is_file() and _wanted(p.name):
                    shutil.copyfile(p.resolve(), scratch / p.name)
        kind = "local"

    sizes: dict[str, int] = {}

    def build(scratch: Path) -> None:
        fill(scratch)
        _verify_model_dir(scratch, source)  # before anything appears at dest_dir
        sizes.update({p.name: p.stat().st_size for p in scratch.iterdir() if p.is_file()})

    _publish_dir(build, str(dest_dir))
    return {"source": source, "kind": kind, "path": str(dest_dir), "files": sorted(sizes),
            "bytes": sum(sizes.values()), **extra}


def _hf_model_snapshot(source: str, repo_id: str, revision: str | None) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError,
                                        RevisionNotFoundError)

    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=list(MODEL_FILE_PATTERNS)))
    except (RepositoryNotFoundError, GatedRepoError) as err:
        raise ModelError(f"{source}: repository not found or gated ({type(err).__name__}); check the name, "
                         f"or log in with `hf auth login` / set HF_TOKEN") from None
    except RevisionNotFoundError:
        raise ModelError(f"{source}: revision {revision!r} not found; check the part after '@'") from None
    except LocalEntryNotFoundError as err:  # includes IncompleteSnapshotError
        # Offline (HF_HUB_OFFLINE=1) or no network, and the cache cannot serve the request: unless the Hub
        # merely timed out or answered 5xx, retrying will not help; the user must pre-seed the cache.
        if _is_passing_network_error(err):
            raise TransientError(f"{source}: the Hub did not answer ({_one_line(err)})") from err
        raise ModelError(f"{source}: not in the local Hugging Face cache and the Hub cannot be reached; "
                         + _offline_hint(repo_id, "model", "model.source")) from None
    except Exception as err:
        # The Hub answered the listing, then a download broke off: the network was there a moment ago.
        if _is_passing_network_error(err) or _is_connection_error(err):
            raise TransientError(f"{source}: download interrupted ({_one_line(err)})") from err
        raise


def _one_line(err: BaseException) -> str:
    return f"{type(err).__name__}: {' '.join(str(err).split())[:200]}"


def _is_connection_error(err: BaseException) -> bool:
    return any(isinstance(e, ConnectionError) or "ConnectError" in {c.__name__ for c in type(e).__mro__}
               or "NetworkError" in {c.__name__ for c in type(e).__mro__} for e in _cause_chain(err))


def _remote_model_files(source: str) -> dict[str, str]:
    fs, root = storage.fs_for(source)
    try:
        storage.check_root(source, "model.source")  # bucket missing / access denied / unreachable: one-line StorageError
        if not fs.isdir(root):
            raise ModelError(f"model path does not exist: {source} (give a local dir, hf://org/name or s3://...)")
        entries = fs.ls(root, detail=True)
    except PermissionError as err:
        raise ModelError(f"{source}: access denied ({err}); check the storage credentials") from None
    except FileNotFoundError:
        raise ModelError(f"model path does not exist: {source} (give a local dir, hf://org/name or s3://...)") from None
    except OSError as err:
        raise TransientError(f"{source}: listing failed ({err})") from err
    files = {e["name"].rstrip("/").rsplit("/", 1)[-1]: e["name"] for e in entries if e.get("type") == "file"}
    wanted = {name: remote for name, remote in files.items() if _wanted(name)}
    if "config.json" not in wanted:
        raise ModelError(f"{source}: no config.json (not a Hugging Face model directory; give a dir saved with "
                         f"save_pretrained, hf://org/name or s3://...)")
    return wanted


# -- dataset --------------------------------------------------------------------------------------
def _field_for(name: str) -> str:
    """The config field a fetched dataset comes from, by the run directory's naming (train, eval-<name>)."""
    return f"data.eval.{name[len('eval-'):]}" if name.startswith("eval-") else f"data.{name}"


def fetch_dataset(source: str, dest_dir: str, name: str, *, split: str = "train", field: str | None = None) -> str:
    """Fetch one raw dataset file to ``<dest_dir>/<name><ext>`` (ext kept from the source); returns its path.

    Hub datasets and built-in ones are written as .parquet / .jsonl. ``field`` names the config section
    in error messages (default: derived from ``name`` — ``train`` → data.train, ``eval-x`` → data.eval.x).
    """
    source = str(source)
    field = field or _field_for(name)
    if source.startswith("builtin://"):
        return _fetch_builtin_dataset(source, dest_dir, name, field)
    if source.startswith("hf://"):
        repo_id, revision = _split_hf(source, "dataset")
        dest = storage.join(dest_dir, f"{name}.parquet")
        dataset = _hf_load_dataset(source, repo_id, revision, split, field)
        buf = io.BytesIO()
        dataset.to_parquet(buf)
        storage.write_bytes_atomic(dest, buf.getvalue())
        return dest
    ext = next((e for e in DATASET_EXTENSIONS if source.lower().endswith(e)), None)
    local = source.removeprefix("file://")
    try:
        storage.check_root(local, f"{field}.source")  # bucket missing / access denied / unreachable: one-line StorageError
        fs, fs_path = storage.fs_for(local)
        found = fs.exists(fs_path)
        is_dir = found and fs.isdir(fs_path)
    except PermissionError as err:
        raise DataError(f"{source}: access denied ({err}); check the storage credentials") from None
    except OSError as err:
        raise TransientError(f"{source}: cannot reach the file ({err})") from err
    if not found:
        raise DataError(f"dataset file not found: {source} (check {field}.source)")
    if is_dir or ext is None:
        raise DataError(f"{source}: {field}.source must be a {', '.join(DATASET_EXTENSIONS)} file, "
                        f"hf://org/name or builtin://arith/<split>")
    dest = storage.join(dest_dir, f"{name}{ext}")
    _copy_file_atomic(local, dest)
    return dest


def _fetch_builtin_dataset(source: str, dest_dir: str, name: str, field: str) -> str:
    from runtime.inputs import synthetic

    parts = urlsplit(source)
    split = parts.path.strip("/")
    if parts.netloc != "arith" or split not in synthetic.DEFAULT_SIZES:
        raise DataError(f"{field}.source={source}: unknown built-in dataset (use builtin://arith/train or "
                        f"builtin://arith/eval, optionally ?difficulty=easy&n=500&seed=0)")
    query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
    unknown = set(query) - {"difficulty", "n", "seed"}
    if unknown:
        raise DataError(f"{field}.source={source}: unknown option(s) {', '.join(sorted(unknown))} "
                        f"(known: difficulty, n, seed)")
    try:
        n = int(query["n"]) if "n" in query else None
        seed = int(query.get("seed", synthetic.DEFAULT_SEED))
        ops = synthetic.resolve_ops(query.get("difficulty", "default"))
    except ValueError as err:
        raise DataError(f"{field}.source={source}: {err}") from None
    dest = storage.join(dest_dir, f"{name}.jsonl")
    return synthetic.write_arith_jsonl(dest, split, n, seed=seed, difficulty=ops)


def _hf_load_dataset(source: str, repo_id: str, revision: str | None, split: str, field: str):
    import datasets
    from datasets.exceptions import DatasetNotFoundError

    try:
        return datasets.load_dataset(repo_id, split=split, revision=revision)
    except DatasetNotFoundError:
        raise DataError(f"{source}: dataset not found or gated on the Hub; check {field}.source, "
                        f"or log in with `hf auth login` / set HF_TOKEN") from None
    except ValueError as err:
        if "split" in str(err).lower():
            raise DataError(f"{source}: no split {split!r} ({' '.join(str(err).split())}); set {field}.split") from None
        raise
    except ConnectionError:
        pass  # the Hub cannot be reached (offline or no network): try the hub file cache below
    # `datasets` offline only knows its own processed cache, not files that `hf download` put in the hub
    # cache. Load those raw files ourselves, so that the fix we suggest (pre-seeding) really works.
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        snapshot = snapshot_download(repo_id, repo_type="dataset", revision=revision, local_files_only=True)
    except (LocalEntryNotFoundError, OSError):
        raise DataError(f"{source}: not in the local Hugging Face cache and the Hub cannot be reached; "
                        + _offline_hint(repo_id, "dataset", f"{field}.source")) from None
    try:
        return datasets.load_dataset(snapshot, split=split)
    except ValueError as err:
        if "split" in str(err).lower():
            raise DataError(f"{source}: no split {split!r} in the cached copy ({' '.join(str(err).split())}); "
                            f"set {field}.split") from None
        raise


def _copy_file_atomic(src: str, dest: str) -> None:
    fs, src_path = storage.fs_for(src)
    try:
        with fs.open(src_path, "rb") as f:
            storage.copy_stream_atomic(f, dest)
    except PermissionError as err:
        raise DataError(f"{src}: access denied ({err}); check the storage credentials") from None
    except FileNotFoundError:
        raise DataError(f"dataset file not found: {src}") from None
    except OSError as err:
        if storage.is_remote(src) or storage.is_remote(dest):
            raise TransientError(f"copying {src} to {dest} failed ({err})") from err
        raise
