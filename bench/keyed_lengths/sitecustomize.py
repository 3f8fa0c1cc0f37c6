"""Bench-only: every Python process started with this folder on PYTHONPATH (Ray actors and spawned workers
inherit it) stops each paged-engine sample at the paged-engine bench's keyed length, so `grpoflow run` on a
random model makes the recipe's length spread (bench/rollout_bench.py: log-normal, median 1700, a tail to
the cap) without a product config key.

On only while GRPOFLOW_BENCH_KEYED_LENGTHS holds the schedule as JSON (max_new, median, sigma, min_len): a
generate call at exactly max_new new tokens is forced; others (eval at another length) are left alone. The
patch is applied when runtime.rollout.paged_decode is first imported, so processes that never decode pay
nothing. With GRPOFLOW_BENCH_GRAD_TRACE set it also patches the trainer module the same way
(bench/grad_trace.py: fingerprints of every step's parameters and gradients) and the built-in engine
(each generate call's weights, state, schedule and draws). Another sitecustomize later on
sys.path (the gpu-cap tool's) still runs after this one.
"""
import importlib.abc
import importlib.util
import json
import os
import runpy
import sys

_TARGET = "runtime.rollout.paged_decode"
_HERE = os.path.dirname(os.path.abspath(__file__))


def _patch(module) -> None:
    schedule = json.loads(os.environ["GRPOFLOW_BENCH_KEYED_LENGTHS"])
    bench = os.path.dirname(_HERE)
    if bench not in sys.path:
        sys.path.append(bench)
    import rollout_bench
    plain = module.PagedDecoder.steps

    def steps(self, prompts, key_hash, sampling, stop_ids, stop_at=None, *rest, **more):  # rest: as the decoder's
        if int(sampling.max_new_tokens) == int(schedule["max_new"]):
            stop_at = rollout_bench.lengths_for_hashes(schedule, key_hash)
        return (yield from plain(self, prompts, key_hash, sampling, stop_ids, stop_at, *rest, **more))

    module.PagedDecoder.steps = steps


def _patch_grad_trace(module) -> None:
    import grad_trace
    grad_trace.patch(module)


def _patch_engine_trace(module) -> None:
    import grad_trace
    grad_trace.patch_engine(module)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def __init__(self, patches: dict):
        self.patches = patches  # module name -> what to do to it once it is loaded

    def find_spec(self, name, path, target=None):
        if name not in self.patches:
            return None
        patch = self.patches.pop(name)
        if not self.patches:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            patch(module)

        spec.loader.exec_module = exec_module
        return spec


_patches = {}
if os.environ.get("GRPOFLOW_BENCH_KEYED_LENGTHS"):
    _patches[_TARGET] = _patch
if os.environ.get("GRPOFLOW_BENCH_GRAD_TRACE"):  # bench/grad_trace.py
    if os.path.dirname(_HERE) not in sys.path:  # importable in every process: Ray unpickles its functions by name
        sys.path.append(os.path.dirname(_HERE))
    _patches["runtime.trainer.megatron_trainer"] = _patch_grad_trace
    _patches["runtime.rollout.builtin"] = _patch_engine_trace
if _patches:
    sys.meta_path.insert(0, _PatchOnImport(_patches))

for _entry in sys.path:
    _other = os.path.join(_entry or ".", "sitecustomize.py")
    if os.path.abspath(os.path.dirname(_other)) != _HERE and os.path.isfile(_other):
        runpy.run_path(_other, run_name="sitecustomize_chained")
        break
