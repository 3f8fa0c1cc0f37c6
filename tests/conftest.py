"""Session-wide test set-up: one Prefect harness, one reference run of the tiny pipeline, no retry delays."""
from __future__ import annotations

import os
import time
import uuid

# Before Prefect, the hub libraries or Ray are imported anywhere in the session.
os.environ["GRPOFLOW_RETRY_DELAY_S"] = "0"
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402

# A small reference run: 4 rollouts in 2 chunks, shared by every test that compares against it. Resume,
# kill and cluster-loss tests need the loop's structure (chunks, checkpoints), not batch size: 4 prompts x
# 4 samples keeps every path and costs a quarter of the tiny config's 8 x 16. With so few samples a
# rollout's groups can all score alike (zero advantage, no update); the entropy bonus makes every update
# move the weights, so a bitwise comparison can tell any two checkpoints apart.
SMALL_BATCH = ["rollout.rollout_batch_size=4", "rollout.n_samples_per_prompt=4", "train.global_batch_size=16",
               "train.micro_batch_size=8", "algorithm.entropy_coef=0.01"]
REFERENCE_OVERRIDES = ["train.num_rollout=4", "checkpoint.interval=2", "eval.interval=null", *SMALL_BATCH]


@pytest.fixture(scope="session")
def prefect_harness():
    from prefect.testing.utilities import prefect_test_harness
    with prefect_test_harness(server_startup_timeout=90):
        yield


@pytest.fixture(scope="session")
def reference_run(prefect_harness, tmp_path_factory):
    """The tiny pipeline run once through the real flow; returns (root, run_id, flow result)."""
    from flows.pipeline import grpo_pipeline
    root = str(tmp_path_factory.mktemp("ref-root"))
    overrides = REFERENCE_OVERRIDES + [f"storage.root={root}"]
    result = grpo_pipeline(config_path="configs/tiny.yaml", overrides=overrides, run_id="ref")
    return {"root": root, "run_id": "ref", "overrides": overrides, "result": result}


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """The tiny Qwen3 (seed 3) as HF and as megatron torch_dist: (hf_dir, torch_dist_dir), built once."""
    from runtime.mcore.convert import hf_to_torch_dist
    from runtime.models.tiny import build_tiny_qwen3
    root = tmp_path_factory.mktemp("tiny-checkpoint")
    hf = build_tiny_qwen3(root / "hf", seed=3)["path"]
    hf_to_torch_dist(hf, str(root / "td"))
    return str(hf), str(root / "td")


@pytest.fixture(scope="session")
def ray_session(tmp_path_factory):
    """One local Ray cluster for the whole session; grpoflow's Cluster reuses it and leaves it running."""
    import ray
    temp = tmp_path_factory.mktemp("ray")
    ray.init(num_cpus=4, include_dashboard=False, _node_ip_address="127.0.0.1", _temp_dir=str(temp),
             object_store_memory=256 * 2**20, log_to_driver=False)
    yield
    ray.shutdown()


# ---- markers: `pytest -m "not slow"` is the inner loop (< 3 min on 2 cores) ------------------------
# Modules whose tests build megatron trainers, run the pipeline or start servers: minutes, not seconds.
SLOW_MODULES = {
    "test_learning", "test_resume", "test_pipeline", "test_deployments", "test_s3", "test_parallel",
    "test_tracking", "test_sglang", "test_bench_smoke", "test_custom_rollout_run", "test_convert",
    "test_model_families", "test_kill_anywhere", "test_multinode", "test_bad_inputs", "test_resume_repairs",
    "test_demo", "test_report", "test_runs_listing", "test_trainer_memory", "test_partial_rollout", "test_lora",
    "test_lora_engine",
    "test_install",  # resolves the install against the public index (network, ~30 s)
    "test_host_optimizer",
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if fixtures & {"prefect_harness", "reference_run"}:
            item.add_marker(pytest.mark.prefect)
        if "ray_session" in fixtures:
            item.add_marker(pytest.mark.ray)
        if any("CUDA" in str(m.kwargs.get("reason", "")) for m in item.iter_markers("skipif")):
            item.add_marker(pytest.mark.gpu)
        if item.module.__name__.rpartition(".")[2] in SLOW_MODULES or item.get_closest_marker("prefect") \
                or item.get_closest_marker("ray"):
            item.add_marker(pytest.mark.slow)


# ---- no process outlives the session ------------------------------------------------------------------
# Every process the session starts carries this marker in its environment (set before any starts): Ray's
# node processes and workers, Prefect and MLflow servers, spawned trainer ranks, and their orphans too —
# a process whose parent died (say with its Ray node) is no descendant of pytest any more, but it keeps
# the marker. At the end the session waits briefly for those already exiting, then fails on any left.
SESSION_MARKER = "GRPOFLOW_TEST_SESSION"
LEFTOVER_GRACE_S = 30.0


def pytest_configure(config):
    # here, not at import: a Ray worker importing tests.conftest (a test's custom rollout) keeps its marker
    os.environ[SESSION_MARKER] = f"{os.getpid()}-{uuid.uuid4().hex}"


def _session_processes() -> list:
    """Processes of this session still running: the marker in their environment, or a descendant of this
    process (a child forked without exec carries the environment pytest was started with)."""
    import psutil

    me = os.getpid()
    needle = f"\0{SESSION_MARKER}={os.environ[SESSION_MARKER]}\0".encode()
    pids = {p.pid for p in psutil.Process(me).children(recursive=True)}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/environ", "rb") as f:
                    if needle in b"\0" + f.read():
                        pids.add(int(entry.name))
            except OSError:  # gone, or not ours to read
                pass
    # This process's own resource tracker ends when this process does (its pipe closes); nothing else may stay.
    from multiprocessing import resource_tracker
    pids -= {me, getattr(resource_tracker._resource_tracker, "_pid", None)}
    found = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            if p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except psutil.Error:
            pass
    return found


def _describe(p) -> str:
    import psutil
    try:
        return f"pid {p.pid} (parent {p.ppid()}, {p.memory_info().rss >> 20} MiB): {' '.join(p.cmdline())[:200]}"
    except psutil.Error:
        return f"pid {p.pid} (gone)"


def pytest_sessionfinish(session, exitstatus):
    import psutil

    if SESSION_MARKER not in os.environ:
        return
    import sys
    if "runtime.rewards.timeout" in sys.modules:  # this process's reward workers, what its atexit would stop
        sys.modules["runtime.rewards.timeout"].shutdown_pool()
    if "torch._inductor.async_compile" in sys.modules:  # Inductor's compile workers (a GPU test compiled), likewise
        sys.modules["torch._inductor.async_compile"].shutdown_compile_workers()
    deadline = time.monotonic() + LEFTOVER_GRACE_S
    left = _session_processes()
    while left and time.monotonic() < deadline:  # those already exiting (a server told to stop, Ray's workers)
        psutil.wait_procs(left, timeout=max(0.1, deadline - time.monotonic()))
        left = _session_processes()
    if not left:
        return
    lines = [f"{len(left)} process(es) started by this test session outlived it (killed now):"]
    lines += [f"  {_describe(p)}" for p in sorted(left, key=lambda p: p.pid)]
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.ensure_newline()
    for line in lines:
        reporter.write_line(line, red=True) if reporter else print(line)
    for p in left:
        try:
            p.kill()
        except psutil.Error:
            pass
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
