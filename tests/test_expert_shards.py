"""A built-in engine replica split by its experts (``rollout.expert_shards``, runtime/rollout/expert_shards.py) on the
CPU: two engine processes over gloo, each holding 2 of a tiny Qwen3-MoE's 4 experts, against one engine holding all 4
(fp32). The replica samples what the whole engine samples (its sums of the experts' outputs are in another order:
log-probs within float noise), records the same routes, stops a partial rollout at the same check point, and takes
weight updates by HF name, each shard its own experts. Through `grpoflow run`: tests/test_export_retention.py."""
from __future__ import annotations

import pytest
import torch

from runtime.rollout.base import GroupsDone, SampleRequest, SamplingParams

pytestmark = pytest.mark.timeout(300, method="thread")  # a shard left alone in a collective would wait forever


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from runtime.models.tiny import build_tiny_qwen3
    return build_tiny_qwen3(tmp_path_factory.mktemp("expert-shards") / "moe", seed=0, num_experts=4)["path"]


@pytest.fixture(scope="module")
def engines(moe_dir):
    """(one whole engine in this process, a replica of two expert shards in processes of their own)."""
    from runtime.placement.handles import EngineHandle
    from runtime.placement.ports import free_port
    from runtime.placement.subprocess_group import SubprocessGroup
    from runtime.rollout.builtin import BuiltinEngine
    from runtime.rollout.expert_shards import ShardSpec
    port = free_port()
    group = SubprocessGroup("runtime.rollout.builtin:BuiltinEngine",
                            [dict(model_dir=moe_dir, routing_replay=True, sync_every=4,
                                  expert_shard=ShardSpec(i, 2, "127.0.0.1", port, "test_shards")) for i in range(2)])
    replica = EngineHandle(group, expert_shards=2)
    try:
        yield BuiltinEngine(moe_dir, routing_replay=True, sync_every=4), replica
    finally:
        group.kill()


def _requests(n_prompts: int = 3, samples: int = 4) -> list[SampleRequest]:
    return [SampleRequest(prompt_ids=[5, 6, 7, 8 + p], key=(0, 0, p, s)) for p in range(n_prompts) for s in range(samples)]


def _agree(whole, split) -> None:
    assert [r.response_ids for r in split] == [r.response_ids for r in whole]
    assert [r.finish_reason for r in split] == [r.finish_reason for r in whole]
    for a, b in zip(whole, split):
        assert torch.equal(a.routed_experts, b.routed_experts)
        assert max((abs(x - y) for x, y in zip(a.response_logprobs, b.response_logprobs)), default=0.0) < 1e-5


def test_each_shard_holds_its_experts_and_the_replica_samples_as_one_whole_engine(engines):  # ~15 s with the fixture
    whole, replica = engines
    each = replica.health()["engines"]
    assert [h["expert_shard"] for h in each] == [[0, 2], [1, 2]]
    sampling = SamplingParams(max_new_tokens=12, temperature=1.0)
    _agree(whole.generate(_requests(), sampling), replica.generate(_requests(), sampling))
    # a partial rollout's stop: where it stops depends on the requests and the weights, so both stop alike
    until, sampling = GroupsDone(group_size=4, count=1), SamplingParams(max_new_tokens=48, stop_token_ids=[5, 6, 7])
    stopped = replica.generate(_requests(), sampling, until)
    assert "abort" in {r.finish_reason for r in stopped}  # the test is about a stop
    _agree(whole.generate(_requests(), sampling, until), stopped)


def test_a_weight_update_reaches_each_shards_experts_by_hf_name(engines):
    from runtime.rollout.hf_weights import update_targets
    whole, replica = engines
    prompt, response = [5, 6, 7, 9], [11, 12, 13, 14, 15]
    before = replica.logprobs_of(prompt, response)
    assert max(abs(x - y) for x, y in zip(before, whole.logprobs_of(prompt, response))) < 1e-5
    # layer 0's experts 1 (shard 0's) and 2, 3 (shard 1's) and its router changed: each shard takes its own experts
    # and passes over the others'
    state = update_targets(whole.model)
    names = [f"model.layers.0.mlp.experts.{e}.{p}_proj.weight" for e in (1, 2, 3) for p in ("gate", "up", "down")]
    gen = torch.Generator().manual_seed(0)
    changed = {n: state[n] * (1.0 + 0.2 * torch.randn(state[n].shape, generator=gen))
               for n in names + ["model.layers.0.mlp.gate.weight"]}
    whole.update_weights(changed, 1)
    replica.update_weights(changed, 1)
    after, expected = replica.logprobs_of(prompt, response), whole.logprobs_of(prompt, response)
    assert max(abs(x - y) for x, y in zip(before, after)) > 1e-3
    assert max(abs(x - y) for x, y in zip(after, expected)) < 1e-5
    assert replica.health()["weight_version"] == 1
    with pytest.raises(ValueError, match="not in the model"):  # a name no shard has is still an error
        replica.update_weights({"model.layers.0.mlp.experts.9.up_proj.weight": changed[
            "model.layers.0.mlp.experts.1.up_proj.weight"]}, 2)


def test_expert_shards_settings_are_checked_in_one_line(moe_dir, tmp_path):
    from runtime.config import GrpoConfig
    from runtime.errors import ConfigError
    from runtime.models import load_hf_config
    from runtime.models.tiny import build_tiny_qwen3
    from runtime.placement.layout import check_layout

    def config(**rollout):
        return GrpoConfig.model_validate({"cluster": {"backend": "local", "device": "cpu", "rollout_gpus": 2},
                                          "rollout": {"expert_shards": 2, **rollout}})
    with pytest.raises(ValueError, match="rollout.expert_shards=2 splits the built-in engine"):
        config(engine="sglang")
    with pytest.raises(ValueError, match=r"must divide the engines, one per rollout GPU \(cluster.rollout_gpus=2\)"):
        config(expert_shards=3)
    with pytest.raises(ValueError, match="not with rollout.decode_path: hf"):
        config(decode_path="hf")
    dense = build_tiny_qwen3(tmp_path / "dense", seed=0)["path"]
    with pytest.raises(ConfigError, match="none: not a mixture of experts"):
        check_layout(config(), hf_config=load_hf_config(dense))
    check_layout(config(), hf_config=load_hf_config(moe_dir))
    with pytest.raises(ConfigError, match="must divide the model's experts"):
        check_layout(GrpoConfig.model_validate({"cluster": {"backend": "local", "device": "cpu", "rollout_gpus": 3},
                                                "rollout": {"expert_shards": 3}}), hf_config=load_hf_config(moe_dir))


def test_a_broadcast_reaches_each_shard_which_keeps_its_own_experts(engines):
    """cluster.weight_sync broadcast: the trainer's rank 0 (here this process) sends every tensor once; each shard
    receives all of them and keeps its own experts (the rest dropped as they come)."""
    import threading

    from runtime.placement import weight_sync
    from runtime.placement.ports import free_port
    from runtime.rollout.hf_weights import update_targets
    whole, replica = engines
    prompt, response = [5, 6, 8], [9, 10, 11, 12]
    before = replica.logprobs_of(prompt, response)
    state = update_targets(whole.model)
    gen = torch.Generator().manual_seed(1)
    sent = {n: state[n] * (1.0 + 0.2 * torch.randn(state[n].shape, generator=gen))
            for n in [f"model.layers.1.mlp.experts.{e}.down_proj.weight" for e in range(4)]
            + ["model.layers.1.self_attn.o_proj.weight"]}
    port, joined = free_port(), {}
    host = threading.Thread(target=lambda: joined.setdefault("group", weight_sync.init_group(
        "127.0.0.1", port, 0, 3, group_name="test_shards_sync")))
    host.start()
    replica.init_weight_sync("127.0.0.1", port, 1, 3, "test_shards_sync")
    host.join()
    sender = threading.Thread(target=weight_sync.send, args=(joined["group"], sent, "cpu"))
    sender.start()
    replica.receive_weights(weight_sync.metadata_of(sent), 7)
    sender.join()
    whole.update_weights(sent, 7)
    got, expected = replica.logprobs_of(prompt, response), whole.logprobs_of(prompt, response)
    assert max(abs(x - y) for x, y in zip(got, expected)) < 1e-5 < max(abs(x - y) for x, y in zip(got, before))
    assert replica.health()["weight_version"] == 7
    weight_sync.destroy_group(joined["group"])


def test_a_shards_model_is_read_tensor_by_tensor_and_a_missing_expert_is_named(moe_dir, tmp_path):
    """`local_expert_model` fills each parameter from the checkpoint's tensors (the hub's per-expert keys here): one
    shard of one holds what transformers loads, and a checkpoint missing one expert's tensor is refused in one line."""
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from runtime.placement.ports import free_port
    from runtime.rollout.expert_shards import ExpertShard, ShardSpec, local_expert_model
    shard = ExpertShard(ShardSpec(0, 1, "127.0.0.1", free_port(), "test_one_shard"), 4, torch.device("cpu"))
    try:
        got = local_expert_model(moe_dir, torch.float32, "sdpa", shard, torch.device("cpu")).state_dict()
        expected = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).state_dict()
        assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in expected)
        broken = tmp_path / "broken"
        shutil.copytree(moe_dir, broken)
        weights = load_file(str(broken / "model.safetensors"))
        del weights["model.layers.1.mlp.experts.2.up_proj.weight"]
        save_file(weights, str(broken / "model.safetensors"))
        with pytest.raises(ValueError, match=r"broken: the checkpoint lacks 1 weight\(s\) of this model, e.g. "
                                             r"\['model.layers.1.mlp.experts.gate_up_proj'\]"):
            local_expert_model(str(broken), torch.float32, "sdpa", shard, torch.device("cpu"))
    finally:
        shard.close()


def _experts_calls(device: str, experts: int = 8, hidden: int = 64, ffn: int = 32, tokens: int = 24,
                   topk: int = 2) -> dict:
    """One routed batch in bf16 (what CUDA's grouped GEMM and its meta function take) and the experts' part of it as
    `_experts_mlp` calls: the whole engine's and each of two shards'."""
    from runtime.rollout.decode_model import _experts_mlp
    g = torch.Generator(device=device).manual_seed(0)
    bf16 = dict(device=device, dtype=torch.bfloat16, generator=g)
    gu = 0.1 * torch.randn(experts, 2 * ffn, hidden, **bf16)
    down = 0.1 * torch.randn(experts, hidden, ffn, **bf16)
    x = torch.randn(tokens, hidden, **bf16)
    routed = torch.randint(0, experts, (tokens, topk), device=device, generator=g)
    weights = torch.rand(tokens, topk, device=device, generator=g)
    half = experts // 2
    return {"whole": lambda: _experts_mlp(x, weights, routed, gu, down, ffn),
            "shard 0": lambda: _experts_mlp(x, weights, routed, gu[:half], down[:half], ffn, first=0),
            "shard 1": lambda: _experts_mlp(x, weights, routed, gu[half:], down[half:], ffn, first=half)}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA graph's capture: a GPU")
def test_on_a_gpu_the_experts_part_is_captured_in_a_cuda_graph_whole_and_by_shard():
    """The experts' part of a decode step, eager as the shards' pieces run, is captured in a CUDA graph: no host read
    (eager bincount had one, and every shard's capture failed on an H200)."""
    got = {}
    for name, fn in _experts_calls("cuda").items():
        eager = fn()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager), name
        got[name] = out
    # the shards' parts add up to the whole (bf16: a token's slots summed in another grouping)
    torch.testing.assert_close((got["shard 0"].float() + got["shard 1"].float()), got["whole"].float(),
                               rtol=2e-2, atol=2e-2)


def test_the_experts_part_compiles_whole_without_a_graph_break():
    """torch.compile takes the experts' part in one graph, whole and as a shard: a break (bincount's data-dependent
    size did it) runs the op between the graphs eager, and the engine's CUDA graphs cannot capture it."""
    torch._dynamo.reset()
    for name, fn in _experts_calls("cpu", experts=4, hidden=16, ffn=8, tokens=6).items():
        explained = torch._dynamo.explain(fn)()
        assert explained.graph_break_count == 0, (name, [str(b.reason) for b in explained.break_reasons])
