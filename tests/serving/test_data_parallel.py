"""Serving over several devices: data-parallel replicas behind one `paged serve` (and how requests are routed
between them), and one model over two processes."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import sys
import types

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from paged import LLM, SamplingParams
from paged.block_manager import BlockManager
from paged.request import Request
from paged.serving.replicas import ReplicatedEngine
from tests.serving.server_fixture import Server, free_port

PROMPTS = [[5, 9, 13, 200, 17, 4, 8, 90, 11], [7, 7, 30], list(range(40, 70)), [3], [100, 101, 102, 103, 104],
           [60, 61, 2, 9], list(range(200, 217)), [8, 1]]


def test_data_parallel_2_by_tensor_parallel_2_serves_every_request_on_both_replicas(tiny_model_dir):
    """DP 2 x TP 2 on 4 simulated devices, through the official client: greedy tokens equal one device's,
    and each replica's own metrics show it served requests."""
    engine_flags = ["--block-size", "8", "--max-model-len", "128", "--max-num-seqs", "8", "--num-kv-blocks", "64",
                    "--compilation-cache-dir", "none"]
    llm = LLM(tiny_model_dir, block_size=8, max_model_len=128, max_num_seqs=8, num_kv_blocks=64,
              show_progress=False, compilation_cache_dir=None)
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    expected = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy,
                                                    use_tqdm=False)]
    server = Server(tiny_model_dir, "--data-parallel-size", "2", "--tensor-parallel-size", "2", *engine_flags,
                    env={"XLA_FLAGS": "--xla_force_host_platform_device_count=4"})
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)

        def complete(prompt):
            return client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0,
                                             extra_body={"ignore_eos": True})

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            responses = list(pool.map(complete, PROMPTS))
        for response, want in zip(responses, expected):
            assert response.choices[0].finish_reason == "length"
            assert response.usage.completion_tokens == len(want.token_ids)
        assert [r.choices[0].text for r in responses] == [want.text for want in expected]

        served = {}
        text = httpx.get(server.url + "/metrics").text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "paged:request_success_total":
                    rank = sample.labels["engine"]
                    served[rank] = served.get(rank, 0) + sample.value
        assert set(served) == {"0", "1"} and sum(served.values()) == len(PROMPTS)
        assert all(count > 0 for count in served.values()), served
    finally:
        assert server.stop() in (0, -signal.SIGTERM)  # uvicorn re-raises the signal it shut down on


def _replica(num_blocks=16, block_size=4, alive=True):
    manager = BlockManager(num_blocks, block_size, max_num_seqs=4, max_blocks_per_seq=8, enable_prefix_caching=True)
    config = types.SimpleNamespace(block_size=block_size, enable_prefix_caching=True)
    engine = types.SimpleNamespace(block_manager=manager, config=config, grammars=None)
    return types.SimpleNamespace(engine=engine, alive=alive)


def _request(token_ids):
    return Request("r", None, list(token_ids), SamplingParams(max_tokens=1), seed=0, detokenizer=None)


def _cache(replica, token_ids):
    """Runs a prompt's blocks into the replica's prefix cache, as a finished prefill leaves them."""
    manager = replica.engine.block_manager
    request = _request(token_ids)
    assert manager.allocate(request, len(token_ids))
    request.num_computed_tokens = len(token_ids)
    manager.cache_full_blocks(request)
    manager.free(request)


def test_routing_prefers_the_least_loaded_then_the_emptier_pool():
    replicas = [_replica(), _replica(), _replica()]
    router = ReplicatedEngine(replicas)
    router.in_flight = [3, 1, 1]
    busy = _request(range(20))
    assert replicas[1].engine.block_manager.allocate(busy, 20)  # same load, fuller pool
    assert router.choose([1, 2, 3]) == 2
    replicas[2].alive = False
    assert router.choose(None) == 1


def test_routing_follows_a_cached_prefix_within_the_slack():
    prompt = list(range(50, 63))  # 3 full blocks of 4 before the last token
    replicas = [_replica(), _replica()]
    _cache(replicas[1], prompt)
    router = ReplicatedEngine(replicas, prefix_affinity_slack=2)
    router.in_flight = [0, 2]
    assert router.choose(prompt) == 1 and router.prefix_routed == 1
    router.in_flight = [0, 3]  # beyond the slack: load wins
    assert router.choose(prompt) == 0
    assert router.choose([9, 9, 9, 9, 9]) == 0  # nothing cached anywhere


def test_routing_refuses_when_no_replica_runs():
    from paged.serving.async_engine import EngineDeadError
    router = ReplicatedEngine([_replica(alive=False)])
    with pytest.raises(EngineDeadError):
        router.choose([1, 2])


def test_llm_refuses_data_parallel(tiny_model_dir):
    with pytest.raises(ValueError, match="paged serve"):
        LLM(tiny_model_dir, data_parallel_size=2, show_progress=False)


def test_two_hosts_serve_through_the_leader_and_stop_together(tiny_model_dir, tmp_path):
    """`paged serve` on 2 processes (2 CPU devices each, one tensor-parallel-4 mesh): process 0 serves the
    API with the tokens of one device; process 1 serves no HTTP and exits cleanly when the leader stops."""
    engine_flags = ["--block-size", "8", "--max-model-len", "128", "--num-kv-blocks", "64",
                    "--compilation-cache-dir", "none"]
    llm = LLM(tiny_model_dir, block_size=8, max_model_len=128, num_kv_blocks=64, show_progress=False,
              compilation_cache_dir=None)
    want = llm.generate("Hello world", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].text
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    run = ["--tensor-parallel-size", "4", "--distributed-coordinator-address", f"127.0.0.1:{free_port()}",
           "--distributed-num-processes", "2", *engine_flags]
    with open(tmp_path / "follower.log", "w") as log:
        follower = subprocess.Popen([sys.executable, "-m", "paged.serving.cli", "serve", "--model", tiny_model_dir,
                                     *run, "--distributed-process-id", "1"],
                                    stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "JAX_PLATFORMS": "cpu",
                                                                               **env})
        leader = Server(tiny_model_dir, *run, "--distributed-process-id", "0", env=env)
        try:
            client = openai.OpenAI(base_url=leader.url + "/v1", api_key="none", max_retries=0)
            got = client.completions.create(model="tiny", prompt="Hello world", max_tokens=8, temperature=0,
                                            extra_body={"ignore_eos": True}).choices[0].text
            assert got == want
        finally:
            leader.stop()
        assert follower.wait(60) == 0, (tmp_path / "follower.log").read_text()[-3000:]
    assert "the leader stopped the run" in (tmp_path / "follower.log").read_text()
