"""MLflow tracking: one MLflow run per grpoflow run, re-attached on resume, never a duplicate point.

The MLflow run is found again by its tag ``grpoflow.run_id`` in the experiment (its id is also kept
in ``<run dir>/tracking.json``), so a resumed run, a re-run flow or a second process continue the same
MLflow run. Metrics are logged with step = rollout id; before the first write of a metric the
tracker reads that metric's history once and skips every step already there, so re-running a chunk
(or replaying a finished chunk's metrics) never adds a second point for a (metric, step).

Params are the frozen config flattened (``section.key``), secrets stripped. MLflow params are
immutable: a value that changed on resume is recorded as the tag ``grpoflow.override.<key>``.

MLflow is imported inside functions only, so ``import runtime.tracking.mlflow_tracker`` works without it.
Transient trouble (server unreachable, 5xx, a locked SQLite file) raises ``TransientError`` naming
the URI, after the MLflow client's own retries (``MLFLOW_HTTP_REQUEST_MAX_RETRIES``/``_TIMEOUT``).
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator

from runtime import storage
from runtime.errors import ConfigError, TransientError
from runtime.run.directory import RunDir
from runtime.secrets import is_secret_key, redact_uri, redact_value
from runtime.testing.moments import moment

if TYPE_CHECKING:  # pragma: no cover
    from runtime.config import GrpoConfig

log = logging.getLogger(__name__)

RUN_TAG = "grpoflow.run_id"
OVERRIDE_TAG = "grpoflow.override."
TRACKING_FILE = "tracking.json"
MAX_PARAM_LEN = 6000  # mlflow.utils.validation.MAX_PARAM_VAL_LENGTH
MAX_TAG_LEN = 8000
_BATCH = 100  # params/tags per log_batch (MLflow's limit)
_METRIC_BATCH = 1000
# MLflow error codes worth a retry.
_TRANSIENT_CODES = {"INTERNAL_ERROR", "TEMPORARILY_UNAVAILABLE", "REQUEST_LIMIT_EXCEEDED", "DEADLINE_EXCEEDED",
                    "ABORTED", "CANCELLED", "UNAVAILABLE"}


def flatten_params(tree: dict, prefix: str = "") -> dict[str, str]:
    """``{"train": {"lr": 1e-3}}`` -> ``{"train.lr": "0.001"}``; secret keys dropped, secret values
    (passwords in URIs, ``--api-key X`` in arg lists) redacted; values cut to MLflow's limit."""
    out: dict[str, str] = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if is_secret_key(str(k)):
            continue
        if isinstance(v, dict):
            out.update(flatten_params(v, key + "."))
            continue
        v = redact_value(v)
        text = "None" if v is None else (str(v) if not isinstance(v, (list, tuple)) else repr(list(v)))
        if len(text) > MAX_PARAM_LEN:
            text = text[:MAX_PARAM_LEN - 3] + "..."
        out[_safe_name(key)] = text
    return out


def _safe_name(name: str) -> str:
    """A name MLflow accepts for a param, metric or tag: ``@`` -> ``_at_``, other odd characters -> ``_``."""
    name = str(name).replace("@", "_at_")
    return re.sub(r"[^\w./\- :]", "_", name)


def metric_key(name: str) -> str:
    """The MLflow metric name of one of our metrics (``eval/aime/pass@1`` -> ``eval/aime/pass_at_1``)."""
    return _safe_name(name)


# ---- where the store is ---------------------------------------------------------------------------
def sqlite_uri(directory: str | os.PathLike) -> str:
    return f"sqlite:///{Path(directory).expanduser().resolve() / 'mlflow.db'}"


def store_uri_for_root(root: str, state_dir: str | None = None) -> str:
    """The default MLflow store of a storage root: SQLite under the root when it is local, under
    ``state_dir`` when the root is remote (SQLite cannot live on S3)."""
    if storage.is_remote(root):
        if not state_dir:
            raise ConfigError(f"storage.root {root} is remote: set storage.state_dir (a local dir for the MLflow "
                              f"SQLite store) or tracking.uri (an MLflow server)")
        return sqlite_uri(state_dir)
    return sqlite_uri(root.removeprefix("file://"))


def default_tracking_uri(cfg: "GrpoConfig") -> str:
    """``tracking.uri`` when set, else the SQLite store of :func:`store_uri_for_root`."""
    if cfg.tracking.uri:
        return cfg.tracking.uri
    return store_uri_for_root(cfg.storage.root, cfg.storage.state_dir)


def sqlite_path(uri: str) -> Path | None:
    """The database file of a ``sqlite:///`` URI (None for any other store)."""
    if not uri.startswith("sqlite:"):
        return None
    path = uri.split(":///", 1)[-1].split("?", 1)[0]
    return Path(path) if path and path != ":memory:" else None


def _artifact_location(uri: str, root: str | None = None) -> str | None:
    """Where a new experiment of a SQLite store keeps artifacts: beside the database (MLflow's own
    default is ./mlruns of the current directory), or ``<root>/mlartifacts`` when the storage root is
    remote (MLflow uploads with boto3: MLFLOW_S3_ENDPOINT_URL or AWS_ENDPOINT_URL). None: the server decides."""
    db = sqlite_path(uri)
    if db is not None and root and storage.is_remote(root):
        return storage.join(root, "mlartifacts")
    return (db.parent / "mlartifacts").resolve().as_uri() if db is not None else None


def moved_store_line(cfg: "GrpoConfig", rd: RunDir) -> str | None:
    """One line when the run's MLflow record (``tracking.json``) is in another store than the one its root gives
    now, and that store has no run of it: a run directory moved or copied to another root. Its MLflow run is then
    made again in the new store from what the run directory holds (the checkpoints' metrics, eval results, exports
    to register), as a resume re-logs them anyway; the old store is left as it is (it may be gone, or another
    root's). None when nothing moved, or when the store came along."""
    if not cfg.tracking.enabled:
        return None
    try:
        was = storage.read_json(rd.sub(TRACKING_FILE)).get("tracking_uri")
        now = redact_uri(default_tracking_uri(cfg))
    except (FileNotFoundError, ValueError, OSError, ConfigError):
        return None
    if not was or was == now:
        return None
    uri = default_tracking_uri(cfg)
    try:
        client = make_client(uri)
        with mlflow_errors(uri, f"look for run {rd.run_id}"):
            exp = client.get_experiment_by_name(cfg.tracking.experiment)
            if exp is not None and client.search_runs([exp.experiment_id], max_results=1,
                                                      filter_string=f"tags.`{RUN_TAG}` = '{rd.run_id}'"):
                return None  # the store came along (a whole root copied): the run is attached there as it is
    except TransientError:
        return None  # a server not answering now: the run's tracker says so, after its retries
    return (f"run {rd.run_id} was tracked in {was}; its MLflow run is made again in {now} from the run directory "
            f"(metrics of the checkpoints it keeps, evals, registered versions); the old store is left as it is")


# ---- errors ---------------------------------------------------------------------------------------
def is_transient(err: BaseException) -> bool:
    from mlflow.exceptions import MlflowException

    from runtime.os_errors import os_cause
    if os_cause(err) is not None:
        return False  # a full disk: said as such at once (cli/main.py), a retry would only fail again

    if isinstance(err, MlflowException):
        code = str(getattr(err, "error_code", "") or "")
        msg = str(err)
        if code in _TRANSIENT_CODES:
            return True
        return "API request to" in msg and "failed" in msg  # the REST client gave up
    names = {c.__module__.split(".")[0] + "." + c.__name__ for c in type(err).__mro__}
    return bool(names & {"requests.ConnectionError", "requests.Timeout", "sqlalchemy.OperationalError",
                         "urllib3.MaxRetryError", "builtins.ConnectionError", "builtins.TimeoutError"})


@contextlib.contextmanager
def mlflow_errors(uri: str, what: str) -> Iterator[None]:
    """Turn MLflow's transient failures into TransientError naming the (redacted) URI."""
    try:
        yield
    except TransientError:
        raise
    except Exception as err:
        if is_transient(err):
            first = " ".join(str(err).split())[:300]
            raise TransientError(f"MLflow at {redact_uri(uri)} is unreachable or failing ({what}): {first}") from err
        raise


def make_client(uri: str):
    """An ``MlflowClient`` for tracking and registry at ``uri`` (a SQLite store is created first, atomically)."""
    try:
        from mlflow.tracking import MlflowClient
    except ImportError:
        raise ConfigError("tracking is enabled but MLflow is not installed: pip install mlflow, "
                          "or set tracking.enabled=false") from None
    ensure_store(uri)
    with mlflow_errors(uri, "connect"):
        return MlflowClient(tracking_uri=uri, registry_uri=uri)


# ---- opening a SQLite store ----------------------------------------------------------------------
# Several runs under one root share its store, and `mlflow ui` or a notebook may hold a write transaction
# on it for a while: a store that is busy is waited for, this long, then named. A minute covers MLflow's
# own writes (milliseconds) and a migration (seconds) with room, and is short enough to tell a user
# something rather than hang.
STORE_LOCK_WAIT_S = 60.0
_sound: set[Path] = set()  # stores this process has checked (a full check reads every page once)


def _check_store(db: Path, uri: str) -> None:
    """Refuse, in one line, a store that is not a sound MLflow database, or that another process keeps locked
    longer than STORE_LOCK_WAIT_S. Nothing is moved or changed: the store holds every run's history."""
    import sqlite3

    if not db.is_file():
        raise ConfigError(f"{db} is not a file (a {'directory' if db.is_dir() else 'special file'}), so it cannot be "
                          f"the MLflow store: move it out of the way, or set tracking.uri to another store")
    moment("mlflow-store-checking")
    try:
        with contextlib.closing(sqlite3.connect(f"file:{db}?mode=rw", uri=True, timeout=STORE_LOCK_WAIT_S,
                                                isolation_level=None)) as con:
            try:  # waits (bounded) for another writer to finish, as MLflow's own writes will have to
                con.execute("BEGIN IMMEDIATE")
            except sqlite3.OperationalError as err:
                if "readonly" not in str(err):
                    raise
                con.execute("BEGIN")  # a store this user may only read (`models list` of a shared one)
            try:
                if db not in _sound:
                    verdict = con.execute("PRAGMA quick_check").fetchone()[0]
                    if verdict != "ok":
                        raise sqlite3.DatabaseError(f"quick_check: {verdict}")
                tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
            finally:
                con.execute("ROLLBACK")
    except sqlite3.OperationalError as err:
        if "locked" in str(err) or "busy" in str(err):
            raise StoreLockedError(f"MLflow store {db} is locked by another process (waited {STORE_LOCK_WAIT_S:.0f} s "
                                   f"for its write transaction to end); let that process finish (e.g. close the "
                                   f"notebook or `mlflow` command holding it) and run the command again - nothing "
                                   f"was changed") from None
        raise _unsound(db, err) from None
    except sqlite3.DatabaseError as err:
        raise _unsound(db, err) from None
    if "alembic_version" not in tables or "runs" not in tables:
        raise _unsound(db, "MLflow's tables are missing: not an MLflow database, or one left half-made by a killed "
                           "older grpoflow")
    _sound.add(db)


def _unsound(db: Path, why) -> ConfigError:
    return ConfigError(f"{db} is not a sound MLflow store ({' '.join(str(why).split())[:160]}); nothing was changed: "
                       f"restore it from a backup, or move it away to start an empty store there (runs keep their "
                       f"files; their MLflow history is in that file)")


class StoreLockedError(ConfigError):
    exit_code = 3  # nothing is wrong with the store: the same command works once the other process is done


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    import fcntl
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def ensure_store(uri: str) -> None:
    """Make sure the SQLite store of ``uri`` exists and is sound (other stores: nothing to do).

    MLflow creates its tables in dozens of migration steps, and a process killed in between would leave a
    store every later open fails on; so a new store is built under a temp name and renamed into place,
    under a lock: it is either absent or complete. An existing one is only ever checked, never moved."""
    db = sqlite_path(uri)
    if db is None:
        return
    if os.path.lexists(db):
        _check_store(db, uri)
        return
    db.parent.mkdir(parents=True, exist_ok=True)
    with _locked(db.parent / f".{db.name}.lock"):
        if os.path.lexists(db):  # made by another process meanwhile
            _check_store(db, uri)
            return
        for stale in db.parent.glob(f".{db.name}.tmp-*"):  # a creator killed before its rename
            stale.unlink(missing_ok=True)
        tmp = db.with_name(f".{db.name}.tmp-{os.getpid()}")
        tmp_uri = f"sqlite:///{tmp}"
        from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore
        with mlflow_errors(uri, "create the store"):
            SqlAlchemyStore(tmp_uri, _artifact_location(uri) or str(db.parent / "mlartifacts"))
        engine = SqlAlchemyStore._engine_map.pop(tmp_uri, None)
        if engine is not None:
            engine.dispose()
        moment("mlflow-store-built")
        os.replace(tmp, db)
        moment("mlflow-store-in-place")


# ---- the tracker ----------------------------------------------------------------------------------
class Tracker:
    """The MLflow side of one grpoflow run. ``tracking.enabled=False`` gives a tracker that does nothing."""

    def __init__(self, cfg: "GrpoConfig", rd: RunDir):
        self.cfg, self.rd = cfg, rd
        self.enabled = bool(cfg.tracking.enabled)
        self.uri: str | None = None
        self.client = None
        self.run_id: str | None = None  # the MLflow run id
        self.experiment_id: str | None = None
        self.resumed = False
        self._steps: dict[str, set[int]] = {}
        if not self.enabled:
            return
        self.uri = default_tracking_uri(cfg)
        self.client = make_client(self.uri)
        with mlflow_errors(self.uri, f"attach run {rd.run_id}"):
            self.experiment_id = self._experiment()
            self.run_id, self.resumed = self._attach()
            self._log_params()
        moment("mlflow-run-attached")
        self._write_tracking_file()

    def __repr__(self) -> str:
        if not self.enabled:
            return "Tracker(disabled)"
        return f"Tracker(uri={redact_uri(self.uri or '')!r}, run={self.run_id}, resumed={self.resumed})"

    # -- attach ----------------------------------------------------------------------------------
    def _experiment(self) -> str:
        from mlflow.exceptions import MlflowException

        name = self.cfg.tracking.experiment
        exp = self.client.get_experiment_by_name(name)
        if exp is None:
            try:
                return self.client.create_experiment(name, artifact_location=_artifact_location(self.uri, self.rd.root))
            except MlflowException as err:  # created by someone else meanwhile
                if getattr(err, "error_code", "") != "RESOURCE_ALREADY_EXISTS":
                    raise
                exp = self.client.get_experiment_by_name(name)
        if exp.lifecycle_stage != "active":
            raise ConfigError(f"MLflow experiment '{name}' at {redact_uri(self.uri)} is deleted; restore it "
                              f"(mlflow experiments restore --experiment-id {exp.experiment_id}) or set "
                              f"tracking.experiment to another name")
        return exp.experiment_id

    def _attach(self) -> tuple[str, bool]:
        run_id = self.rd.run_id
        runs = []
        if re.fullmatch(r"[\w.\-:]+", run_id):
            runs = self.client.search_runs([self.experiment_id], filter_string=f"tags.`{RUN_TAG}` = '{run_id}'",
                                           order_by=["attributes.start_time ASC"], max_results=10)
        else:  # an id a filter string cannot quote: look through the experiment
            runs = [r for r in self.client.search_runs([self.experiment_id], max_results=50000)
                    if r.data.tags.get(RUN_TAG) == run_id]
        if runs:
            run = runs[0]
            if len(runs) > 1:
                log.warning("%d MLflow runs carry %s=%s; using the oldest, %s", len(runs), RUN_TAG, run_id,
                            run.info.run_id)
            if run.info.status != "RUNNING":
                self.client.update_run(run.info.run_id, status="RUNNING")
            return run.info.run_id, True
        tags = {RUN_TAG: run_id, "mlflow.runName": run_id, "grpoflow.config_name": self.cfg.name,
                "grpoflow.root": redact_uri(self.rd.root)}
        run = self.client.create_run(self.experiment_id, tags=tags, run_name=run_id)
        return run.info.run_id, False

    def _log_params(self) -> None:
        from mlflow.entities import Param, RunTag

        wanted = flatten_params(self.cfg.model_dump(mode="json"))
        run = self.client.get_run(self.run_id)
        logged, tags = run.data.params, run.data.tags
        new = [Param(k, v) for k, v in wanted.items() if k not in logged]
        set_tags, del_tags = [], []
        for k, v in wanted.items():
            tag = _safe_name(OVERRIDE_TAG + k)
            if k in logged and logged[k] != v:
                if tags.get(tag) != v[:MAX_TAG_LEN]:
                    set_tags.append(RunTag(tag, v[:MAX_TAG_LEN]))
            elif tag in tags:  # back to the logged value
                del_tags.append(tag)
        for i in range(0, len(new), _BATCH):
            self.client.log_batch(self.run_id, params=new[i:i + _BATCH])
        for i in range(0, len(set_tags), _BATCH):
            self.client.log_batch(self.run_id, tags=set_tags[i:i + _BATCH])
        for tag in del_tags:
            self.client.delete_tag(self.run_id, tag)
        if set_tags:
            log.info("config changed on resume: %s (recorded as %s* tags; MLflow params are immutable)",
                     ", ".join(t.key.removeprefix(OVERRIDE_TAG) for t in set_tags), OVERRIDE_TAG)

    def _write_tracking_file(self) -> None:
        doc = {"tracking_uri": redact_uri(self.uri or ""), "experiment": self.cfg.tracking.experiment,
               "experiment_id": self.experiment_id, "mlflow_run_id": self.run_id, "run_id": self.rd.run_id}
        path = self.rd.sub(TRACKING_FILE)
        try:
            if storage.exists(path) and storage.read_json(path) == doc:
                return
        except (ValueError, OSError):
            pass
        storage.write_json_atomic(path, doc)

    # -- metrics ---------------------------------------------------------------------------------
    def _known_steps(self, key: str) -> set[int]:
        steps = self._steps.get(key)
        if steps is None:
            steps = self._steps[key] = {int(m.step) for m in self.client.get_metric_history(self.run_id, key)}
        return steps

    def _log_points(self, points: Iterable[tuple[str, Any, int]]) -> int:
        if not self.enabled:
            return 0
        from mlflow.entities import Metric

        with mlflow_errors(self.uri, "log metrics"):
            now = int(time.time() * 1000)
            batch, seen = [], set()
            for key, value, step in points:
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    continue
                if (key, step) in seen or step in self._known_steps(key):
                    continue
                seen.add((key, step))
                batch.append(Metric(key, float(value), now, step))
            for i in range(0, len(batch), _METRIC_BATCH):
                part = batch[i:i + _METRIC_BATCH]
                self.client.log_batch(self.run_id, metrics=part)
                moment("mlflow-metrics-logged")
                for m in part:
                    self._steps[m.key].add(m.step)
        return len(batch)

    def log_rollout_metrics(self, metrics: Iterable[dict[str, Any]], step_key: str = "rollout") -> int:
        """Each dict is one rollout's metrics; its ``step_key`` entry (the rollout id) is the step.
        Non-numeric entries are skipped. Returns the number of points written."""
        points = []
        for m in metrics:
            if step_key not in m:
                raise ValueError(f"log_rollout_metrics: a metrics dict has no '{step_key}' entry")
            step = int(m[step_key])
            points += [(metric_key(k), v, step) for k, v in m.items() if k != step_key]
        return self._log_points(points)

    def log_eval(self, rollout: int, metrics_by_set: dict[str, dict[str, Any]], *, artifact: bool = True) -> int:
        """``eval/<set>/<metric>`` at step = rollout (rollouts trained so far), and the eval JSON of
        that point (``eval/rollout_<N>.json``, if written) as an artifact under ``eval/``."""
        if not self.enabled:
            return 0
        points = [(metric_key(f"eval/{name}/{k}"), v, int(rollout))
                  for name, res in metrics_by_set.items() for k, v in res.items()]
        n = self._log_points(points)
        path = self.rd.eval_result(rollout)
        if artifact and storage.exists(path):
            self.log_artifact_file(path, "eval")
        return n

    # -- artifacts, tags, end --------------------------------------------------------------------
    def log_artifact_file(self, path: str, artifact_path: str | None = None) -> None:
        """Upload one file (local or remote URI) to the run's artifacts; re-uploading replaces it."""
        if not self.enabled:
            return
        with mlflow_errors(self.uri, f"log artifact {path}"):
            if storage.is_remote(path):
                with tempfile.TemporaryDirectory() as tmp:
                    local = Path(tmp) / str(path).rstrip("/").rsplit("/", 1)[-1]
                    fs, fs_path = storage.fs_for(path)
                    local.write_bytes(fs.cat_file(fs_path))
                    self.client.log_artifact(self.run_id, str(local), artifact_path)
            else:
                self.client.log_artifact(self.run_id, str(path), artifact_path)

    def set_tags(self, tags: dict[str, Any]) -> None:
        if not self.enabled or not tags:
            return
        from mlflow.entities import RunTag

        items = [RunTag(_safe_name(k), str(v)[:MAX_TAG_LEN]) for k, v in tags.items()]
        with mlflow_errors(self.uri, "set tags"):
            for i in range(0, len(items), _BATCH):
                self.client.log_batch(self.run_id, tags=items[i:i + _BATCH])

    def finish(self, status: str = "FINISHED") -> None:
        """Mark the MLflow run ended (FINISHED / FAILED / KILLED); a later resume sets it RUNNING again."""
        if not self.enabled:
            return
        moment("mlflow-run-ending")
        with mlflow_errors(self.uri, "end run"):
            self.client.set_terminated(self.run_id, status=status)
        moment("mlflow-run-ended")


__all__ = [
    "Tracker", "ensure_store", "moved_store_line", "default_tracking_uri", "store_uri_for_root", "sqlite_uri", "sqlite_path", "make_client",
    "flatten_params", "metric_key", "mlflow_errors", "is_transient",
]
