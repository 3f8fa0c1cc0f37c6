"""A warm process that forks one `grpoflow` CLI run per request: tests that kill a run process
(SIGKILL of its process group) pay the heavy imports (torch, megatron, Prefect, MLflow) once, not per run.

Protocol (one JSON object per line): stdin ``{"argv": [...], "env": {...}, "log": path}``; stdout
``{"pid": n, "exit": code}`` or ``{"pid": n, "signal": s}`` when the child has ended. The child starts a
session of its own (its process group is what a moment's kill reaches), writes stdout and stderr to
``log`` and runs ``cli.main.main(argv)`` exactly as the command line does. Nothing is imported that
starts a thread before the fork (checked), so the child is a clean copy.
"""
from __future__ import annotations

import json
import os
import sys
import threading

import cli.main  # noqa: F401  (the imports a run needs, done once)
import flows.pipeline  # noqa: F401
import runtime.grpo.session  # noqa: F401
import runtime.rollout.builtin  # noqa: F401
import runtime.tracking.model_registry  # noqa: F401
import runtime.trainer.megatron_trainer  # noqa: F401
import tasks.train  # noqa: F401


def _warm_imports() -> None:
    """What a run imports lazily (MLflow's SQL stores and migrations, megatron's model and checkpointing,
    the HF model class, the report's plotting, parquet): imported here once, not in every forked run."""
    import importlib

    for name in ("mlflow", "mlflow.tracking", "mlflow.store.tracking.sqlalchemy_store",
                 "mlflow.store.model_registry.sqlalchemy_store", "mlflow.store.db.utils", "alembic.command",
                 "sqlalchemy.dialects.sqlite", "megatron.core.models.gpt", "megatron.core.dist_checkpointing",
                 "megatron.core.dist_checkpointing.strategies.torch", "megatron.core.optimizer",
                 "transformers.models.qwen3.modeling_qwen3", "matplotlib.figure", "matplotlib.backends.backend_agg",
                 "pyarrow.parquet", "prefect.flow_engine", "prefect.task_engine", "runtime.inputs.fetch",
                 "runtime.inputs.datasets", "runtime.inputs.synthetic", "runtime.models.tiny", "runtime.mcore.env",
                 "runtime.mcore.convert", "runtime.grpo.evaluation", "runtime.tracking.report"):
        importlib.import_module(name)


def _child(req: dict) -> None:
    os.setsid()
    fd = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.update(req.get("env", {}))
    code = 1
    try:
        from cli.main import main
        code = main(req["argv"])
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001 - reported in the log, as the CLI would
        import traceback
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def serve() -> None:
    _warm_imports()
    assert threading.active_count() == 1, [t.name for t in threading.enumerate()]  # fork-safe
    print(json.dumps({"ready": os.getpid()}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(req)
        _, status = os.waitpid(pid, 0)
        out = {"pid": pid, "signal": os.WTERMSIG(status)} if os.WIFSIGNALED(status) else \
            {"pid": pid, "exit": os.WEXITSTATUS(status)}
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    serve()
