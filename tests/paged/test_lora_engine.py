"""LoRA adapters served by the engine: each adapter's greedy output equals transformers + PEFT with that adapter
applied, in batches mixing adapters and the base model (float32, tiny random bases, adapters written by PEFT)."""

from __future__ import annotations

import numpy as np
import pytest

from paged import LLM, LoRARequest, SamplingParams

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

pytestmark = pytest.mark.torch

# Per family: each adapter's targets and rank (Phi-3's fused projections are adapted as PEFT adapts them).
ADAPTERS = {
    "llama-gqa": [(["q_proj", "v_proj"], 8), (["k_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], 16),
                  (["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"], 4)],
    "qwen2-tied": [(["q_proj", "v_proj"], 8), (["gate_proj", "up_proj", "down_proj"], 16), (["k_proj", "o_proj"], 4)],
    "phi3-fused": [(["qkv_proj"], 8), (["gate_up_proj", "down_proj"], 16), (["qkv_proj", "o_proj", "gate_up_proj"], 4)],
}
MAX_NEW_TOKENS = 8


def write_adapter(base: str, out: str, targets: list[str], rank: int, seed: int, **lora_kwargs) -> str:
    """A PEFT LoRA adapter over `base` with random, non-zero B factors, saved by PEFT."""
    from tests.hf_checkpoints import hf_model
    model = peft.get_peft_model(hf_model(base), peft.LoraConfig(task_type="CAUSAL_LM", r=rank, lora_alpha=2 * rank,
                                                                 target_modules=targets, **lora_kwargs))
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0.0, 0.3)
    model.save_pretrained(out)
    return out


def peft_greedy(base: str, adapter: str | None, prompt: list[int]) -> list[int]:
    """Greedy continuation by transformers with the PEFT adapter applied (the base alone for None)."""
    from tests.hf_checkpoints import hf_greedy, hf_model
    if adapter is None:
        return hf_greedy(base, [prompt], MAX_NEW_TOKENS)[0]
    model = peft.PeftModel.from_pretrained(hf_model(base), adapter).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=MAX_NEW_TOKENS, pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module", params=sorted(ADAPTERS))
def family(request, tmp_path_factory):
    """(base checkpoint, adapter paths) of one family."""
    from tests.hf_checkpoints import build_checkpoint
    directory = tmp_path_factory.mktemp(request.param)
    base = build_checkpoint(request.param, str(directory / "base"))
    adapters = [write_adapter(base, str(directory / f"adapter{i}"), targets, rank, seed=i + 1)
                for i, (targets, rank) in enumerate(ADAPTERS[request.param])]
    return base, adapters


def _prompts(count: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(2, 460, size=int(rng.integers(5, 40))).tolist() for _ in range(count)]


def test_a_mixed_batch_equals_peft(family):
    """One batch: the same prompt under each adapter and the base (so the prefix cache must keep their K/V
    apart), and other prompts spread over them."""
    base, adapter_paths = family
    requests = [LoRARequest(f"adapter{i}", i + 1, path) for i, path in enumerate(adapter_paths)]
    shared, *others = _prompts(5)
    prompts = [shared] * 4 + others
    chosen = [*requests, None, requests[2], None, requests[0], requests[1]]
    llm = LLM(base, dtype="float32", enable_lora=True, max_loras=3, max_lora_rank=16, show_progress=False)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True),
                           use_tqdm=False, lora_request=chosen)
    got = [list(o.outputs[0].token_ids) for o in outputs]
    want = [peft_greedy(base, r.lora_path if r else None, p) for p, r in zip(prompts, chosen)]
    assert got == want
    assert len({tuple(g) for g in got[:4]}) > 1  # the adapters do change the output


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A Llama base and three adapters (the first family's)."""
    from tests.hf_checkpoints import build_checkpoint
    directory = tmp_path_factory.mktemp("llama")
    base = build_checkpoint("llama-gqa", str(directory / "base"))
    return base, [write_adapter(base, str(directory / f"adapter{i}"), targets, rank, seed=i + 1)
                  for i, (targets, rank) in enumerate(ADAPTERS["llama-gqa"])]


def test_more_adapters_than_slots_wait_their_turn(llama):
    """One device slot and one adapter in host memory for three adapters: requests wait for the slot, the
    adapters are read again after eviction, and every output is still its adapter's."""
    base, adapter_paths = llama
    requests = [LoRARequest(f"adapter{i}", i + 1, path) for i, path in enumerate(adapter_paths)]
    prompts = _prompts(6)
    chosen = [requests[0], requests[1], None, requests[2], requests[1], requests[0]]
    llm = LLM(base, dtype="float32", enable_lora=True, max_loras=1, max_cpu_loras=1, max_lora_rank=16,
              show_progress=False, enable_prefix_caching=False)  # both rounds compute the same steps
    compiled = None
    for _ in range(2):  # the second round reloads every adapter into the same slot: nothing compiles
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                               SamplingParams(temperature=0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True),
                               use_tqdm=False, lora_request=chosen)
        if compiled is None:
            compiled = llm.engine.num_compilations
    assert llm.engine.num_compilations == compiled
    want = [peft_greedy(base, r.lora_path if r else None, p) for p, r in zip(prompts, chosen)]
    assert [list(o.outputs[0].token_ids) for o in outputs] == want
    assert llm.engine.lora_slots.slot_users == [0]


@pytest.mark.parametrize("desc_act", [False, True], ids=["plain", "act-order"])
def test_a_gptq_base_with_adapters_equals_peft_on_the_dequantized_weights(llama, tmp_path, desc_act):
    """The adapter reads the layer's input as given (act-order GPTQ regroups it for the quantized product)."""
    from tests.models.test_quantized_checkpoints import _gptq_layer, _write_quantized
    base, adapter_paths = llama
    config = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": desc_act, "sym": False,
              "checkpoint_format": "gptq"}
    quantized, reference = _write_quantized(base, tmp_path / "q", tmp_path / "ref",
                                            lambda w, rng: _gptq_layer(w, 4, 32, desc_act, rng), config)
    requests = [LoRARequest(f"adapter{i}", i + 1, path) for i, path in enumerate(adapter_paths)]
    prompts = _prompts(4)
    chosen = [requests[0], None, requests[1], requests[2]]
    llm = LLM(str(quantized), dtype="float32", enable_lora=True, max_loras=3, show_progress=False)
    assert llm.engine.model_config.weight_quant is not None
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True),
                           use_tqdm=False, lora_request=chosen)
    want = [peft_greedy(str(reference), r.lora_path if r else None, p) for p, r in zip(prompts, chosen)]
    assert [list(o.outputs[0].token_ids) for o in outputs] == want


def test_requests_lora_cannot_serve_are_refused_by_name(llama, tmp_path):
    from tests.hf_checkpoints import build_checkpoint
    base, adapter_paths = llama
    request = LoRARequest("adapter0", 1, adapter_paths[0])
    prompt = {"prompt_token_ids": [5, 6, 7]}
    plain = LLM(base, dtype="float32", show_progress=False)
    with pytest.raises(ValueError, match="but LoRA is not enabled!"):
        plain.generate(prompt, lora_request=request, use_tqdm=False)
    llm = LLM(base, dtype="float32", enable_lora=True, max_lora_rank=8, show_progress=False)
    with pytest.raises(ValueError, match="The lengths of prompts and lora_request must be the same."):
        llm.generate([prompt, prompt], lora_request=[request], use_tqdm=False)
    with pytest.raises(ValueError, match="LoRA rank 16 is greater than max_lora_rank 8"):
        llm.generate(prompt, lora_request=LoRARequest("big", 2, adapter_paths[1]), use_tqdm=False)
    other = build_checkpoint("llama-gqa", str(tmp_path / "wide"), overrides={"hidden_size": 96})
    foreign = write_adapter(other, str(tmp_path / "foreign"), ["q_proj"], 8, seed=5)
    with pytest.raises(ValueError, match="made for another model"):
        llm.generate(prompt, lora_request=LoRARequest("foreign", 3, foreign), use_tqdm=False)
    # Nothing was queued by the refusals, and the engine still serves the adapter it can.
    assert not llm.engine.has_unfinished_requests()
    assert len(llm.generate(prompt, SamplingParams(max_tokens=2), lora_request=request, use_tqdm=False)) == 1


TP_SCRIPT = """
import json, sys
from paged import LLM, LoRARequest, SamplingParams
base, paths, prompts, size = json.loads(sys.argv[1])
requests = [LoRARequest(f"adapter{i}", i + 1, path) for i, path in enumerate(paths)]
chosen = [requests[0], requests[1], None, requests[2]]
llm = LLM(base, dtype="float32", enable_lora=True, max_loras=3, tensor_parallel_size=size, show_progress=False)
outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                       SamplingParams(temperature=0, max_tokens=%d, ignore_eos=True), use_tqdm=False,
                       lora_request=chosen)
layer = llm.engine.worker.runner.params["layers"][0]
shards = lambda leaf: [list(s.data.shape) for s in leaf.addressable_shards]
print("RESULT " + json.dumps({"tokens": [list(o.outputs[0].token_ids) for o in outputs],
                              "q_b": shards(layer["self_attn"]["q_proj"]["lora_b"]),
                              "o_a": shards(layer["self_attn"]["o_proj"]["lora_a"])}))
""" % MAX_NEW_TOKENS


def test_tensor_parallel_splits_the_factors_with_their_kernels(family):
    """Column-parallel layers split B's columns, row-parallel ones A's rows (Phi-3's fused factors cut first).
    The tokens are PEFT's."""
    _tensor_parallel_case(*family, size=2)


def test_tensor_parallel_repeats_kv_factors_with_their_heads(llama):
    """At 4 devices over 2 KV heads, k/v's B columns are repeated with the heads they belong to."""
    _tensor_parallel_case(*llama, size=4)


def _tensor_parallel_case(base: str, adapter_paths: list[str], size: int) -> None:
    import json
    import os
    import subprocess
    import sys
    prompts = _prompts(4)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_force_host_platform_device_count={size}"}
    run = subprocess.run([sys.executable, "-c", TP_SCRIPT, json.dumps([base, adapter_paths, prompts, size])],
                         capture_output=True, text=True, env=env, timeout=600)
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert run.returncode == 0 and lines, run.stderr[-3000:]
    result = json.loads(lines[0][len("RESULT "):])
    chosen = [adapter_paths[0], adapter_paths[1], None, adapter_paths[2]]
    assert result["tokens"] == [peft_greedy(base, path, p) for p, path in zip(prompts, chosen)]
    (slots, rank, q_out), (o_in, _, _) = result["q_b"][0], result["o_a"][0]
    assert len(result["q_b"]) == size and (slots, rank) == (3, 16)
    assert q_out * size == o_in * size == 64  # each device holds 1 / size of q's columns and o's rows


def test_weights_saved_updated_and_restored_keep_adapters_apart(llama, tmp_path):
    """A save holds the base weights only; an Orbax restore with LoRA starts with empty slots, and a weight
    update leaves the adapters in their slots."""
    base, adapter_paths = llama
    request = LoRARequest("adapter1", 2, adapter_paths[1])
    prompt = [{"prompt_token_ids": _prompts(1)[0]}]
    greedy = SamplingParams(temperature=0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    llm = LLM(base, dtype="float32", enable_lora=True, show_progress=False)
    adapted = llm.generate(prompt, greedy, lora_request=request, use_tqdm=False)[0].outputs[0].token_ids
    llm.update_weights(llm.get_params())
    assert llm.generate(prompt, greedy, lora_request=request, use_tqdm=False)[0].outputs[0].token_ids == adapted
    llm.save(str(tmp_path / "saved"))
    restored = LLM(str(tmp_path / "saved"), enable_lora=True, show_progress=False)
    assert restored.generate(prompt, greedy, lora_request=request, use_tqdm=False)[0].outputs[0].token_ids == adapted
    assert (restored.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids
            == llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids)


def test_an_adapted_request_follows_its_structured_output_constraint(llama):
    from paged import StructuredOutputsParams
    base, adapter_paths = llama
    llm = LLM(base, dtype="float32", enable_lora=True, show_progress=False)
    choices = ["alpha", "beta gamma", "delta"]
    params = SamplingParams(temperature=0, max_tokens=12, structured_outputs=StructuredOutputsParams(choice=choices))
    outputs = llm.generate([{"prompt_token_ids": p} for p in _prompts(3)], params, use_tqdm=False,
                           lora_request=LoRARequest("adapter0", 1, adapter_paths[0]))
    assert all(o.outputs[0].text in choices for o in outputs)
