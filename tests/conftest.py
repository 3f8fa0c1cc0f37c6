"""Session-wide test set-up: one Prefect harness, one reference run of the tiny pipeline, no retry delays."""
from __future__ import annotations

import os

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
