"""PEFT adapters read into per-module factors, against PEFT's own layers on the same inputs."""

from __future__ import annotations

import json

import numpy as np
import pytest

from paged.lora import LoRAConfig, LoRARequest, read_peft_adapter

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")


def _adapter(tmp_path, name="llama-gqa", **lora_kwargs):
    """A tiny base written by transformers, an adapter written by PEFT with random (non-zero) B factors."""
    import transformers

    from tests.hf_checkpoints import build_checkpoint
    base = build_checkpoint(name, str(tmp_path / "base"))
    model = transformers.AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
    config = peft.LoraConfig(task_type="CAUSAL_LM", **{"r": 8, "lora_alpha": 16,
                                                          "target_modules": ["q_proj", "v_proj", "down_proj"],
                                                          **lora_kwargs})
    lora_model = peft.get_peft_model(model, config)
    torch.manual_seed(0)
    with torch.no_grad():
        for parameter_name, parameter in lora_model.named_parameters():
            if "lora_B" in parameter_name:
                parameter.normal_(0.0, 0.2)
    out = str(tmp_path / "adapter")
    lora_model.save_pretrained(out)
    return out, lora_model


@pytest.mark.torch
@pytest.mark.parametrize("lora_kwargs", [{}, {"use_rslora": True},
                                         {"rank_pattern": {"down_proj": 4}, "alpha_pattern": {"v_proj": 32}}],
                         ids=["plain", "rslora", "patterns"])
def test_factors_equal_peft_layers(tmp_path, lora_kwargs):
    path, lora_model = _adapter(tmp_path, **lora_kwargs)
    adapter = read_peft_adapter("a", path, max_lora_rank=16)
    assert len(adapter.modules) == 3 * 2  # three targets in each of two layers
    rng = np.random.default_rng(0)
    for module_name, module in lora_model.named_modules():
        if not hasattr(module, "lora_A") or "default" not in module.lora_A:
            continue
        key = module_name.removeprefix("base_model.model.")
        a, b = adapter.modules[key]
        x = rng.normal(size=(3, a.shape[0])).astype(np.float32)
        with torch.no_grad():
            # PEFT's own delta: its layer's output minus the base layer's.
            xt = torch.from_numpy(x)
            want = (module(xt) - module.base_layer(xt)).numpy()
        np.testing.assert_allclose(x @ a @ b, want, rtol=1e-4, atol=1e-5)


@pytest.mark.torch
@pytest.mark.parametrize("lora_kwargs, message", [
    ({"use_dora": True}, "DoRA"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"bias": "lora_only"}, "biases"),
    ({"r": 32}, "LoRA rank 32 is greater than max_lora_rank 16"),
], ids=["dora", "modules-to-save", "bias", "rank"])
def test_what_cannot_be_applied_is_refused_by_name(tmp_path, lora_kwargs, message):
    path, _ = _adapter(tmp_path, **lora_kwargs)
    with pytest.raises(ValueError, match=message):
        read_peft_adapter("a", path, max_lora_rank=16)


def test_a_missing_adapter_is_named(tmp_path):
    with pytest.raises(ValueError, match="no adapter found"):
        read_peft_adapter("a", str(tmp_path), max_lora_rank=16)
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 8}))
    (tmp_path / "adapter_model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="lacks lora_alpha, target_modules"):
        read_peft_adapter("a", str(tmp_path), max_lora_rank=16)


def test_requests_and_config_as_vllm_checks_them():
    assert LoRARequest("sql", 1, "/p") == LoRARequest("sql", 2, "/q")  # same name, same adapter
    assert len({LoRARequest("sql", 1, "/p"), LoRARequest("chat", 2, "/p")}) == 2
    with pytest.raises(ValueError, match="must be > 0"):
        LoRARequest("sql", 0, "/p")
    with pytest.raises(ValueError, match="lora_path cannot be empty"):
        LoRARequest("sql", 1)
    assert LoRAConfig(max_loras=2).host_capacity == 2
    with pytest.raises(ValueError, match="max_lora_rank must be one of"):
        LoRAConfig(max_lora_rank=12)
    with pytest.raises(ValueError, match=r"max_cpu_loras \(1\) must be >= max_loras \(2\)"):
        LoRAConfig(max_loras=2, max_cpu_loras=1)


def _slots(max_loras=2, max_cpu_loras=None):
    from paged.lora import LoRAAdapter
    from paged.lora_slots import LoRASlots
    reads, writes = [], []
    slots = LoRASlots(LoRAConfig(max_loras=max_loras, max_cpu_loras=max_cpu_loras),
                      lambda r: reads.append(r.lora_name) or LoRAAdapter(r.lora_name, r.lora_path, 8, {}),
                      lambda slot, adapter: writes.append((slot, adapter.name)))
    return slots, reads, writes


def _request(name, i):
    return LoRARequest(name, i, f"/adapters/{name}")


def test_slots_are_shared_reused_and_refilled_least_recent_first():
    slots, reads, writes = _slots(max_loras=2, max_cpu_loras=3)
    a, b, c = _request("a", 1), _request("b", 2), _request("c", 3)
    assert slots.acquire(a) == 0 and slots.acquire(a) == 0  # two requests of one adapter share its slot
    assert slots.acquire(b) == 1
    assert slots.acquire(c) is None  # both slots in use by other adapters: c waits
    slots.release(1)
    assert slots.acquire(c) == 1 and writes == [(0, "a"), (1, "b"), (1, "c")]
    assert slots.running_adapters() == ["a", "c"]
    slots.release(0), slots.release(0), slots.release(1)
    # b comes back from host memory without a second read, into the slot idle the longest (a's).
    assert slots.acquire(b) == 0 and reads == ["a", "b", "c"] and writes[-1] == (0, "b")


def test_host_memory_keeps_max_cpu_loras_and_never_drops_an_adapter_in_a_slot():
    slots, reads, _ = _slots(max_loras=1, max_cpu_loras=2)
    for i, name in enumerate("abc", 1):
        slot = slots.acquire(_request(name, i))
        slots.release(slot)
    assert list(slots.host) == ["b", "c"]  # a, least recently used and in no slot, went first
    slots.acquire(_request("a", 1))
    assert reads == ["a", "b", "c", "a"] and "a" in slots.host


def test_removed_adapters_leave_idle_slots_and_stay_while_running():
    slots, reads, writes = _slots(max_loras=2)
    slot = slots.acquire(_request("a", 1))
    assert slots.remove("a") and slots.slot_adapter[slot] == "a"  # still running
    # Loaded again (perhaps another adapter under the name) while the old one runs: a fresh read, another slot.
    again = slots.acquire(_request("a", 2))
    assert again != slot and reads == ["a", "a"] and writes == [(slot, "a"), (again, "a")]
    slots.release(slot)
    assert slots.slot_adapter[slot] is None  # emptied once its last request ended
    slots.release(again)
    assert slots.remove("a") and slots.slot_adapter[again] is None
    assert not slots.remove("never-loaded")
    with pytest.raises(RuntimeError, match="released more often"):
        slots.release(slot)
