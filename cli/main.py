"""`grpoflow` — the command line. User mistakes print one line and exit 2; nothing heavy starts before the config is valid."""
from __future__ import annotations

import argparse
import logging
import os
import sys

from runtime.config import DEFAULT_ROOT


def _prefect_env() -> None:
    # The ephemeral API needs 10-18 s to start on a small machine; the default 20 s is too tight.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("PREFECT_LOGGING_TO_API_ENABLED", "false")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    # the Hub client's per-retry warnings: an unreachable Hub ends in the fetch stage's own one line
    logging.getLogger("huggingface_hub").setLevel(logging.ERROR)
    # a line per HTTP request to Prefect's API, MLflow's or S3's: noise in run.log, and on the terminal where a
    # library's handler (Prefect's console handler) takes it from the root at a run's INFO
    logging.getLogger("httpx").setLevel(logging.WARNING)


def _start_prefect_api() -> None:
    """The run's own Prefect server when none is configured: it ends with the run, even a killed one."""
    from prefect.settings import PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS

    from cli.prefect_api import ensure_api
    ensure_api(PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value())


class _HideUserErrors(logging.Filter):
    """Prefect logs every failed task with its traceback; a user mistake, a Ctrl-C or SIGTERM, a full disk is
    printed once, as one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        from runtime.errors import UserError
        from prefect.exceptions import TerminationSignal

        from runtime.os_errors import os_cause
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, (UserError, KeyboardInterrupt, TerminationSignal)) or os_cause(exc) is not None:
            return False
        msg = record.getMessage() if record.levelno >= logging.ERROR else ""
        if "aborted by an interrupt signal" in msg or "aborted by a termination signal" in msg or os_cause(Exception(msg)):
            return False
        return not any(f"exception {cls.__name__}" in msg or f"{cls.__name__}(" in msg for cls in _user_error_types())


def _user_error_types() -> list[type]:
    from runtime.errors import UserError
    todo, seen = [UserError], []
    while todo:
        cls = todo.pop()
        seen.append(cls)
        todo.extend(cls.__subclasses__())
    return seen


def _quiet_prefect_user_errors() -> None:
    # Logger filters (not handler filters): they survive Prefect re-running its logging set-up.
    for name in ("prefect.flow_runs", "prefect.task_runs", "prefect.flow_engine", "prefect.task_engine"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _HideUserErrors) for f in logger.filters):
            logger.addFilter(_HideUserErrors())


LOG_LEVELS = ["DEBUG", "INFO", "WARNING", "ERROR"]


def _positive_gib(text: str) -> float:
    try:
        gib = float(text)
    except ValueError:
        gib = float("nan")
    if not gib > 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of GiB")
    return gib


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="grpoflow", description="GRPO post-training as a resumable Prefect pipeline")
    p.add_argument("--log-level", default=None, choices=LOG_LEVELS,
                   help="how much of grpoflow's own log to show on stderr (default WARNING)")
    sub = p.add_subparsers(dest="cmd", required=True)

    def with_log_level(sp):
        sp.add_argument("--log-level", default=argparse.SUPPRESS, choices=LOG_LEVELS,
                        help="show the run's log (libraries included) on the terminal at this level; without it "
                             "the terminal shows the plan, the live table and the summary, and the log goes to "
                             "runs/<id>/logs/run.log")

    def with_overrides(sp):
        sp.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override a config value, e.g. --set train.lr=1e-5 (repeatable)")

    v = sub.add_parser("validate", help="check a config and print the plan")
    v.add_argument("config")
    v.add_argument("--gpu-mem-gb", type=_positive_gib, default=None,
                   help="GPU memory of the target machine in GiB (default: cluster.gpu_memory_gb, else this machine's GPU, "
                        "else 80); "
                        "a config that does not fit is an error (exit 2) naming settings that would")
    v.add_argument("--host-mem-gb", type=_positive_gib, default=None,
                   help="host (CPU) memory of one target node in GiB (default: cluster.host_memory_gb, else 1.6 GiB "
                        "per GiB of the node's GPU memory)")
    with_overrides(v)

    r = sub.add_parser("run", help="run the pipeline (fetch → convert → prepare → train → eval → register)")
    r.add_argument("config")
    r.add_argument("--run-id", default=None, help="default: <config name>-<UTC timestamp>")
    with_overrides(r)
    with_log_level(r)

    rs = sub.add_parser("resume", help="continue a run from its frozen config and latest checkpoint")
    rs.add_argument("run_id")
    rs.add_argument("--root", default=None, help=f"storage.root of the run (default {DEFAULT_ROOT})")
    rs.add_argument("--config", default=None, metavar="FILE",
                    help="replace the run's frozen config with FILE (the config it was started with), e.g. when "
                         "runs/<id>/config.yaml is damaged or missing; the file found is kept beside it")
    with_overrides(rs)
    with_log_level(rs)

    m = sub.add_parser("models", help="browse the model registry")
    msub = m.add_subparsers(dest="models_cmd", required=True)
    for name, helptext in (("list", "registered models, versions, aliases and eval metrics"),
                           ("show", "one version: NAME, NAME@alias or NAME/version"),
                           ("export", "export a version again from its checkpoint (after registry retention "
                                      "removed its export)")):
        sp = msub.add_parser(name, help=helptext)
        if name in ("show", "export"):
            sp.add_argument("spec")
        sp.add_argument("--tracking-uri", default=None, help="default: the SQLite store under --root")
        sp.add_argument("--root", default=DEFAULT_ROOT)

    rp = sub.add_parser("report", help="write a run's HTML report (curves, evals, versions, config) into its run directory")
    rp.add_argument("run_id")
    rp.add_argument("--root", default="./grpoflow-data", help="storage.root of the run")
    rp.add_argument("--tracking-uri", default=None, help="default: the run's tracking.uri, else the SQLite store of --root")
    rp.add_argument("--against", action="append", default=[], metavar="RUN_ID",
                    help="another run under --root, tracked in the same store, whose reward and eval curves are drawn "
                         "beside this run's (repeatable)")

    ls = sub.add_parser("runs", help="the runs under a storage root: state, last checkpoint, best eval, how to resume")
    ls.add_argument("--root", default="./grpoflow-data", help="storage.root (a local dir or s3://bucket/prefix)")

    from cli.deploy import add_parsers
    add_parsers(sub)  # deploy, serve
    return p


def _print_plan(cfg) -> None:
    from runtime.plan.summary import plan_lines
    from runtime.secrets import redact_text
    for line in plan_lines(cfg):
        print(redact_text(line))


def _headline(res: dict) -> str:
    """One eval set's result as its headline metric (avg@n) and its pass@k."""
    n = res.get("n_samples")
    parts = [f"avg@{n} {res[f'avg@{n}']:.3f}"] if f"avg@{n}" in res else []
    parts += [f"{k} {v:.3f}" for k, v in res.items() if k.startswith("pass@") and isinstance(v, (int, float))]
    return " ".join(parts) or "-"


def _current_aliases(versions: list[dict], tracking_uri: str | None) -> dict[tuple[str, int], list[str]] | None:
    """(model, version) -> its aliases now (registration-time aliases move as later versions arrive);
    None when the registry cannot be read."""
    if not versions or not tracking_uri:
        return None
    try:
        from runtime.tracking.mlflow_tracker import make_client
        from runtime.tracking.model_registry import aliases_of
        client = make_client(tracking_uri)
        out: dict[tuple[str, int], list[str]] = {}
        for name in {v["name"] for v in versions}:
            for alias, version in aliases_of(client, name).items():
                out.setdefault((name, int(version)), []).append(alias)
        return {k: sorted(v) for k, v in out.items()}
    except Exception:  # noqa: BLE001 - the summary falls back to the aliases recorded at registration
        return None


def as_typed(script: str) -> str:
    """How to type ``script`` (a command of this installation, e.g. grpoflow, mlflow) so that it runs from
    the shell that started this process: its bare name when that shell's PATH finds this installation's
    (the venv activated), else its path — relative when it lies under the working directory, as
    `.venv/bin/grpoflow` does after `make demo`."""
    import shlex
    import shutil
    from pathlib import Path

    path = Path(sys.executable).parent / script  # the venv's bin/, not resolved past its python symlink
    if not path.is_file():
        return script
    found = shutil.which(script)
    if found and Path(found).resolve() == path.resolve():
        return script
    try:
        return shlex.quote(str(path.relative_to(Path.cwd())))
    except ValueError:
        return shlex.quote(str(path))


def next_commands(run_id: str, root: str, tracking_uri: str | None) -> list[str]:
    """What to type next: the report, the registry, the MLflow UI for this run's store — each runnable
    as printed from the shell that started this run (:func:`as_typed`)."""
    from runtime.secrets import redact_uri
    from runtime.tracking.mlflow_tracker import store_uri_for_root

    grpoflow = as_typed("grpoflow")
    root_arg = "" if root == "./grpoflow-data" else f" --root {root}"
    lines = [f"{grpoflow} report {run_id}{root_arg}"]
    if not tracking_uri:
        return lines
    try:
        default_store = tracking_uri == store_uri_for_root(root)
    except Exception:  # noqa: BLE001 - a remote root has no default store without state_dir
        default_store = False
    lines.append(f"{grpoflow} models list" + (root_arg if default_store else f" --tracking-uri {redact_uri(tracking_uri)}"))
    if tracking_uri.startswith(("http://", "https://")):
        lines.append(f"open {redact_uri(tracking_uri)} in a browser (the MLflow server of this run)")
    else:
        lines.append(f"{as_typed('mlflow')} ui --backend-store-uri {tracking_uri}")
    return lines


def _summary(result: dict, root: str, report: str | None = None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(title=f"run {result['run_id']}", show_lines=False)
    table.add_column("stage")
    table.add_column("status")
    table.add_column("output")
    for stage in ("fetch", "convert", "prepare"):
        res = result[stage]
        status = "skipped (done before)" if res.get("skipped") else f"done in {res.get('seconds', 0)} s"
        if stage == "fetch":
            out = res["model_dir"]
        elif stage == "convert":
            out = f"{res['torch_dist']} (parity max|Δlogit| {res['parity']['max_abs_logit_diff']:.2e})"
        else:
            out = f"{res['train']['path']} ({res['train']['rows_out']} rows)" + "".join(
                f", {v['path']} ({v['rows_out']} rows)" for v in res["eval"].values())
        table.add_row(stage, status, out)
    train = result.get("train") or {}
    if train:
        table.add_row("train", train.get("status", ""), train.get("summary", ""))
    evals = train.get("evals") or {}
    for rollout in sorted(evals, key=int):
        out = "; ".join(f"{name} {_headline(res)}" for name, res in evals[rollout].items())
        table.add_row(f"eval after {rollout}", "done", out)
    versions = [v for _, v in sorted((train.get("versions") or {}).items(), key=lambda kv: int(kv[0])) if v]
    aliases = _current_aliases(versions, train.get("tracking_uri"))
    for v in versions:
        now = (v.get("aliases") or []) if aliases is None else aliases.get((v["name"], int(v["version"])), [])
        status = "registered" if v.get("created", True) else "registered before"
        table.add_row("register", status, f"{v['name']} version {v['version']} ({v['checkpoint']})"
                      f" aliases: {', '.join(now) or '-'}")
    console.print(table)
    # Plain lines, never wrapped, so they can be copied or grepped.
    print(f"run directory:        {result['run_dir']}")
    print(f"converted checkpoint: {result['convert']['torch_dist']}")
    print(f"train data:           {result['prepare']['train']['path']}")
    for name, res in result["prepare"]["eval"].items():
        print(f"{f'eval data ({name}):':<22}{res['path']}")
    if train.get("checkpoint"):
        print(f"final checkpoint:     {train['checkpoint']}")
    if report:
        print(f"report:               {report}")
    from runtime.run.run_log import last_path
    if last_path():
        print(f"run log:              {last_path()}")
    print("next:")
    for line in next_commands(result["run_id"], root, train.get("tracking_uri")):
        print(f"  {line}")


def _write_report_after_run(cfg, rd, tracking_uri: str | None) -> str | None:
    """The run's report, written at the end of every run; a failure is one warning line, never a failed run."""
    if not tracking_uri:
        return None
    from runtime.tracking.report import write_report
    try:
        return write_report(cfg, rd, tracking_uri)
    except Exception as err:  # noqa: BLE001 - the run itself succeeded
        print(f"warning: the run's report was not written ({type(err).__name__}: {' '.join(str(err).split())[:200]}); "
              f"try `grpoflow report {rd.run_id}`", file=sys.stderr)
        return None


def _report_command(args) -> int:
    from runtime.run.directory import RunDir
    from runtime.run.frozen_config import frozen_config
    from runtime.tracking.mlflow_tracker import store_uri_for_root
    from runtime.tracking.report import write_report

    cfg = frozen_config(RunDir(args.root, args.run_id))  # unknown run id: one line
    rd = RunDir(args.root, args.run_id, cfg.storage.state_dir).checked()  # the report is written into it
    uri = args.tracking_uri or cfg.tracking.uri
    if uri is None and cfg.tracking.enabled:
        uri = store_uri_for_root(args.root, cfg.storage.state_dir)
    against = [(frozen_config(RunDir(args.root, other)), RunDir(args.root, other)) for other in args.against]
    path = write_report(cfg, rd, uri, against=against)
    print(f"report of run {args.run_id}: {path}" + (f" (beside {', '.join(args.against)})" if args.against else ""))
    if not path.startswith("s3://"):
        from pathlib import Path
        print(f"open {Path(path).resolve().as_uri()}")
    return 0


def _runs_command(args) -> int:
    from runtime.run.listing import format_runs, list_runs
    runs = list_runs(args.root)
    if not runs:
        print(f"no runs under {args.root}")
        return 0
    for line in format_runs(runs):
        print(line)
    return 0


def _resume(args) -> dict | None:
    """Resume a run; None when it is finished already (nothing to do but say so)."""
    from runtime.run.directory import RunDir
    from runtime.run.frozen_config import check_changes, finished, frozen_config
    from runtime.run.lease import RunLease
    root = args.root or DEFAULT_ROOT
    rd = RunDir(root, args.run_id)  # a bad run id: one line, before anything is read or written
    if args.config:
        from runtime.config import load_config
        from runtime.run.frozen_config import replace_frozen
        replace_frozen(rd, load_config(args.config, args.overrides))
        print(f"run {args.run_id}: frozen config replaced by {args.config}")
    cfg = frozen_config(rd, args.overrides)  # unknown run id: fail before Prefect starts
    if args.overrides:
        check_changes(frozen_config(rd), cfg, rd, given_root=args.root is not None)
    from runtime.tracking.mlflow_tracker import moved_store_line
    moved = moved_store_line(cfg, rd)
    if moved:
        print(moved)
    if finished(cfg, rd) and not moved:
        # The lease of a writer killed after its last step: taken over and dropped (a live one refuses),
        # and whatever that writer left under a temp name with it.
        from runtime.run.checkpoint import repair_latest
        from runtime.run.leftovers import remove_temp_leftovers
        with RunLease(rd.checked()):
            remove_temp_leftovers(rd)
            repair_latest(rd)  # an unreadable `latest` (said once) names the final checkpoint again
        print(f"run {args.run_id} is already finished ({cfg.train.num_rollout} rollouts); to train further, "
              f"resume it with --set train.num_rollout=N (N > {cfg.train.num_rollout})")
        return None
    print(f"resuming run {args.run_id}")
    _start_prefect_api()
    from flows.pipeline import grpo_pipeline
    from runtime.secrets import hold
    with _run_log(args, args.run_id):
        return grpo_pipeline(overrides=hold(args.overrides), run_id=args.run_id, root=root, resume=True)


class _MaskedFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        from runtime.secrets import redact_text
        return redact_text(super().format(record))


def _sigterm_as_interrupt() -> None:
    """SIGTERM (a `kill`, a scheduler stopping the job) ends a command as Ctrl-C does: the same unwinding (the
    lease released, children ended), the same one line and exit code. During a flow Prefect's own handler takes
    SIGTERM first, marks the run crashed and then hands the signal on to this one."""
    import signal
    import threading

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    if threading.current_thread() is threading.main_thread():  # main() called from a thread: signals are not its
        signal.signal(signal.SIGTERM, interrupt)


def _setup_logging(level: str) -> None:
    """One handler for grpoflow's loggers (named by module: runtime.*, tasks.*, flows.*, cli.*), on the terminal
    also while a run's log holds the process's streams (runtime/run/run_log.py); secrets masked."""
    from runtime.run.run_log import OWN_LOGGERS, TerminalHandler
    handler = TerminalHandler(sys.stderr)
    handler.setFormatter(_MaskedFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
    handler.setLevel(level)
    for name in OWN_LOGGERS:
        logger = logging.getLogger(name)
        logger.setLevel(level)
        for old in [h for h in logger.handlers if getattr(h, "grpoflow", False)]:
            logger.removeHandler(old)  # the level of this command, not of an earlier main() in this process
        handler.grpoflow = True  # type: ignore[attr-defined]
        logger.addHandler(handler)


def _run_log(args, run_id: str):
    """Library output into runs/<id>/logs/run.log while the run runs; on the terminal with --log-level."""
    from runtime.run.run_log import RunLog
    return RunLog(run_id, args.cmd, quiet=args.log_level is None, level=args.log_level or "INFO")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    _setup_logging(args.log_level or "WARNING")
    from runtime.errors import TransientError, UserError, error_line
    from runtime.run.directory import resume_command

    resume_with = None  # how to continue the run this command works on, once it has an id
    where = getattr(args, "root", None)  # the storage root it writes under, once known
    _sigterm_as_interrupt()
    try:
        if args.cmd == "validate":
            from runtime.config import load_config
            cfg = load_config(args.config, args.overrides)
            from runtime.errors import ConfigError
            from runtime.plan.summary import disk_report, layout_lines, memory_report
            placement = layout_lines(cfg)  # before any output: a layout that cannot run is one line
            from runtime.grpo.preflight import check_trainable
            check_trainable(cfg)
            _print_plan(cfg)
            memory, does_not_fit = memory_report(cfg, args.gpu_mem_gb, args.host_mem_gb)
            from runtime.secrets import redact_text
            disk, disk_does_not_fit = disk_report(cfg)
            for line in placement + memory + disk:
                print(redact_text(line))
            does_not_fit = does_not_fit or disk_does_not_fit
            if does_not_fit:
                raise ConfigError(f"{args.config}: {does_not_fit}")
            print("config is valid")
            return 0
        if args.cmd == "report":
            return _report_command(args)
        if args.cmd == "runs":
            return _runs_command(args)
        if args.cmd == "models":
            from cli.models import models_export, models_list, models_show
            if args.models_cmd == "list":
                return models_list(args.tracking_uri, root=args.root)
            if args.models_cmd == "export":
                return models_export(args.spec, args.tracking_uri, root=args.root)
            return models_show(args.spec, args.tracking_uri, root=args.root)
        if args.cmd in ("run", "resume") and "prefect" not in sys.modules:  # read once, at Prefect's import
            os.environ.setdefault("PREFECT_LOGGING_LEVEL", args.log_level or "INFO")  # its flow/task lines: logged
        _prefect_env()
        _quiet_prefect_user_errors()
        if args.cmd in ("deploy", "serve"):
            from cli.deploy import deploy_command, serve_command
            return deploy_command(args) if args.cmd == "deploy" else serve_command(args)
        if args.cmd == "run":
            from runtime.config import load_config
            from runtime.plan.summary import default_run_id
            from runtime.run.directory import check_run_id
            cfg = load_config(args.config, args.overrides)
            run_id = check_run_id(args.run_id) if args.run_id is not None else default_run_id(cfg)
            print(f"run id: {run_id}")
            resume_with, where = resume_command(run_id, cfg.storage.root), cfg.storage.root
            _print_plan(cfg)
            _start_prefect_api()
            from flows.pipeline import grpo_pipeline
            from runtime.secrets import hold
            with _run_log(args, run_id):
                result = grpo_pipeline(config_path=args.config, overrides=hold(args.overrides), run_id=run_id)
            from runtime.run.directory import RunDir
            root, rd = cfg.storage.root, RunDir(cfg.storage.root, run_id, cfg.storage.state_dir)
        elif args.cmd == "resume":
            resume_with = resume_command(args.run_id, args.root or DEFAULT_ROOT)
            result = _resume(args)
            if result is None:
                return 0
            from runtime.run.directory import RunDir
            from runtime.run.frozen_config import frozen_config
            root = args.root or DEFAULT_ROOT
            cfg = frozen_config(RunDir(root, args.run_id))
            rd = RunDir(root, args.run_id, cfg.storage.state_dir)
        report = _write_report_after_run(cfg, rd, (result.get("train") or {}).get("tracking_uri"))
        _summary(result, root, report)
        return 0
    except UserError as err:
        print(f"error: {error_line(err)}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        # every write that matters is atomic and the lease is released on the way out
        print("error: interrupted" + (f"; nothing is lost: continue with `{resume_with}`" if resume_with else ""),
              file=sys.stderr)
        return 130
    except TransientError as err:
        from runtime.os_errors import os_error_line
        if os_error_line(err) is not None:  # a store's write on a full disk: not a reason to retry
            print(f"error: {os_error_line(err, where, resume_with)}", file=sys.stderr)
            return 3
        # still failing after the task's retries: nothing is lost, `grpoflow resume` continues later
        print(f"error: {error_line(err)} (still failing after retries; resume the run later)",
              file=sys.stderr)
        return 3
    except Exception as err:
        from runtime.os_errors import DISK_FULL, os_cause, os_error_line
        line = os_error_line(err, where, resume_with)
        if line is not None:  # a full disk, a link loop: the machine's state, said in one line wherever it surfaced
            print(f"error: {line}", file=sys.stderr)
            return 3 if os_cause(err).errno in DISK_FULL else 2
        from tasks.common import _is_transient
        if not _is_transient(err):
            raise
        # a lost Ray actor or node, a dropped connection: the same, said in one line
        print(f"error: {type(err).__name__}: {error_line(err, 300)} (still failing after retries; resume the run later)",
              file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main())
