"""`paged bench device_memory` on the tiny model: what each device holds at tensor parallel 1 and 2."""

from __future__ import annotations

import json

from paged.serving.cli import main


def test_device_memory_halves_the_split_weights_and_the_pool(tiny_model_dir, tmp_path):
    out = tmp_path / "device_memory.json"
    assert main(["bench", "device_memory", "--model", tiny_model_dir, "--sizes", "1", "2", "--num-kv-blocks", "17",
                 "--max-model-len", "256", "--json", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    one, two = results["1"], results["2"]
    assert len(one["weights_per_device"]) == 1 and len(two["weights_per_device"]) == 2
    # Every byte is somewhere: the two devices hold the split half each, the replicated norms both.
    replicated = two["replicated_weight_bytes"]
    assert sum(two["weights_per_device"]) == one["weights_total"] + replicated
    assert two["weights_per_device"][0] == (one["weights_total"] - replicated) // 2 + replicated
    assert two["kv_per_device"] == [one["kv_total"] // 2] * 2  # 2 KV heads: one per device
