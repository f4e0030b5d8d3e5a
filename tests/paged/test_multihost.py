"""Several processes, one mesh: 2 processes on 127.0.0.1 with 2 CPU devices each run tensor parallel 4 through
jax.distributed, process 0 leading. Each process is a subprocess: the device count and the distributed runtime
are fixed when jax starts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from paged.models.tiny import create_tiny_llama
from paged import LLM, SamplingParams
from tests.serving.server_fixture import free_port

PROMPTS = [[5, 9, 13, 200], [7, 7, 30], list(range(40, 90)), [3]]
GREEDY = dict(temperature=0, max_tokens=10, ignore_eos=True)
SEEDED = dict(temperature=0.9, top_k=40, top_p=0.9, seed=11, max_tokens=10, ignore_eos=True, n=2, logprobs=1)
ENGINE = dict(block_size=8, max_model_len=128, max_num_seqs=8, num_kv_blocks=64, compilation_cache_dir=None)

SCRIPT = textwrap.dedent("""
    import json, sys
    from paged import LLM, SamplingParams
    model_dir, address, process, mode, engine = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
    llm = LLM(model_dir, tensor_parallel_size=4, distributed_coordinator_address=address,
              distributed_num_processes=2, distributed_process_id=process, distributed_heartbeat_timeout_s=5,
              show_progress=False, **json.loads(engine))
    if not llm.is_leader:
        llm.follow()
        print("FOLLOWER DONE", flush=True)
        sys.exit(0)
    prompts = [{"prompt_token_ids": p} for p in json.loads(sys.argv[6])]
    runs = [llm.generate(prompts, SamplingParams(**json.loads(p)), use_tqdm=False) for p in sys.argv[7:]]
    print("RESULT " + json.dumps([[[c.token_ids for c in o.outputs] for o in run] for run in runs]), flush=True)
    if mode == "wait":  # generate again after a line on stdin (the test kills the follower first)
        sys.stdin.readline()
        llm.generate(prompts, SamplingParams(**json.loads(sys.argv[7])), use_tqdm=False)
        print("SECOND RUN DONE", flush=True)
""")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # 4 query heads over 2 KV heads: tensor parallel 4 replicates each KV head on 2 devices, across processes.
    return create_tiny_llama(str(tmp_path_factory.mktemp("multihost-llama")), num_heads=4, num_kv_heads=2)


def _start(model_dir, mode="run", engine=ENGINE, follower_engine=None):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
           "PYTHONUNBUFFERED": "1"}
    address = f"127.0.0.1:{free_port()}"
    procs = []
    for process, options in ((0, engine), (1, follower_engine or engine)):
        args = [sys.executable, "-c", SCRIPT, model_dir, address, str(process), mode, json.dumps(options),
                json.dumps(PROMPTS), json.dumps(GREEDY), json.dumps(SEEDED)]
        procs.append(subprocess.Popen(args, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    return procs


def _finish(proc, timeout=240) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        raise AssertionError(f"process did not end in {timeout} s:\n{out[-3000:]}")
    return proc.returncode, out


def _result(out: str):
    line = next((line for line in out.splitlines() if line.startswith("RESULT ")), None)
    assert line is not None, out[-3000:]
    return json.loads(line[len("RESULT "):])


def test_two_processes_draw_the_tokens_of_one_device(model_dir):
    llm = LLM(model_dir, show_progress=False, **ENGINE)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    expected = [[[c.token_ids for c in o.outputs] for o in llm.generate(prompts, SamplingParams(**params),
                                                                        use_tqdm=False)]
                for params in (GREEDY, SEEDED)]
    leader, follower = _start(model_dir)
    code, out = _finish(leader)
    assert code == 0, out[-3000:]
    assert _result(out) == expected
    code, out = _finish(follower)
    assert code == 0 and "FOLLOWER DONE" in out, out[-3000:]


def test_a_killed_follower_ends_the_leader_with_a_message(model_dir):
    leader, follower = _start(model_dir, mode="wait")
    deadline = time.monotonic() + 240
    lines = []
    while time.monotonic() < deadline:  # until the first run is done: the mesh is up on both
        line = leader.stdout.readline()
        lines.append(line)
        if line.startswith("RESULT ") or not line:
            break
    assert any(line.startswith("RESULT ") for line in lines), "".join(lines)[-3000:]
    follower.send_signal(signal.SIGKILL)
    follower.wait()
    killed = time.monotonic()
    leader.stdin.write("go\n")
    leader.stdin.flush()
    code, out = _finish(leader, timeout=120)
    assert code != 0 and "SECOND RUN DONE" not in out
    assert time.monotonic() - killed < 90  # heartbeats time out after 5 s; nothing waits for the dead process
    assert "stopped sending heartbeats" in out or "another task died" in out, out[-3000:]


def test_a_follower_with_other_options_stops_with_a_message(model_dir):
    leader, follower = _start(model_dir, follower_engine={**ENGINE, "max_num_seqs": 4})
    code, out = _finish(follower)
    assert code != 0 and "differ from the leader's" in out and "max_num_seqs" in out, out[-3000:]
    leader.kill()
    _finish(leader)
