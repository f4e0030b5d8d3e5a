"""Speculative decoding by an EAGLE head (paged/eagle.py, models/eagle.py): a head written in the EAGLE-1
checkpoint format (random weights) loads, proposes what the same head built from transformers' own Llama
layer proposes from transformers' target hidden states, and leaves the target's tokens unchanged."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from safetensors.numpy import save_file

from paged import LLM, SamplingParams
from tests.paged.proposals import first_proposals

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
PROMPTS = [[5, 17, 99, 23, 7, 55], [300, 12, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24], [42, 43]]


def write_eagle_head(directory: str, target_dir: str, seed: int = 1) -> str:
    """An EAGLE-1 head for the target in `target_dir`, as EAGLE's training code saves one: `fc.weight`
    [H, 2H], one Llama layer under `layers.0.` (its input_layernorm, which EAGLE-1 does not use, and its own
    embed_tokens included, as some published heads carry them)."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(target_dir, "config.json")) as f:
        target = json.load(f)
    hidden, inner = target["hidden_size"], target["intermediate_size"]
    heads, kv_heads, head_dim = target["num_attention_heads"], target["num_key_value_heads"], target["head_dim"]
    config = {key: target[key] for key in ("hidden_size", "intermediate_size", "num_attention_heads",
                                           "num_key_value_heads", "head_dim", "vocab_size", "rms_norm_eps",
                                           "rope_theta", "max_position_embeddings", "hidden_act")}
    config.update(architectures=["LlamaForCausalLM"], model_type="llama", num_hidden_layers=1,
                  torch_dtype="float32", bos_token_id=0, eos_token_id=1)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    rng = np.random.default_rng(seed)
    normal = lambda *shape: (rng.standard_normal(shape) * 0.2).astype(np.float32)
    layer = "layers.0."
    save_file({"fc.weight": normal(hidden, 2 * hidden),
               layer + "self_attn.q_proj.weight": normal(heads * head_dim, hidden),
               layer + "self_attn.k_proj.weight": normal(kv_heads * head_dim, hidden),
               layer + "self_attn.v_proj.weight": normal(kv_heads * head_dim, hidden),
               layer + "self_attn.o_proj.weight": normal(hidden, heads * head_dim),
               layer + "mlp.gate_proj.weight": normal(inner, hidden), layer + "mlp.up_proj.weight": normal(inner, hidden),
               layer + "mlp.down_proj.weight": normal(hidden, inner),
               layer + "input_layernorm.weight": 1 + normal(hidden),
               layer + "post_attention_layernorm.weight": 1 + normal(hidden),
               "embed_tokens.weight": normal(target["vocab_size"], hidden)},
              os.path.join(directory, "model.safetensors"))
    return directory


@pytest.fixture(scope="module")
def eagle_head(tiny_model_dir, tmp_path_factory) -> str:
    return write_eagle_head(str(tmp_path_factory.mktemp("eagle-head")), tiny_model_dir)


def _tokens(llm, prompts=PROMPTS, params=GREEDY) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def _eagle(head: str, k: int = 3) -> dict:
    return {"method": "eagle", "model": head, "num_speculative_tokens": k}


def test_the_target_keeps_its_tokens(tiny_model_dir, eagle_head):
    want = _tokens(LLM(tiny_model_dir, show_progress=False))
    llm = LLM(tiny_model_dir, show_progress=False, speculative_config=_eagle(eagle_head))
    assert _tokens(llm) == want
    assert llm.engine.spec_stats.num_draft_tokens > 0


@pytest.mark.torch
def test_proposals_equal_the_head_built_from_transformers_layers(tiny_model_dir, eagle_head):
    """The reference: transformers' target gives each prompt position's final-normed hidden state; the head is
    transformers' LlamaDecoderLayer with its input norm taken out (as vLLM and EAGLE's own code do), fc as a
    torch Linear and the target's LM head, run over the whole sequence again for each proposal."""
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    k = 3
    target = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with open(os.path.join(eagle_head, "config.json")) as f:
        config = LlamaConfig(**json.load(f))
    config._attn_implementation = "eager"
    weights = load_file(os.path.join(eagle_head, "model.safetensors"))
    layer = LlamaDecoderLayer(config, layer_idx=0)
    layer.load_state_dict({name[len("layers.0."):]: w for name, w in weights.items() if name.startswith("layers.0.")})
    layer.input_layernorm = torch.nn.Identity()
    fc = torch.nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
    fc.weight.data = weights["fc.weight"]
    rotary = LlamaRotaryEmbedding(config)

    def reference(prompt: list[int], first: int) -> list[int]:
        with torch.no_grad():
            features = target.model(torch.tensor([prompt])).last_hidden_state[0]  # [L, H], final-normed
            sequence, proposals = [*prompt, first], []
            for _ in range(k):
                n = len(sequence) - 1  # positions 0..n-1 read tokens 1..n
                x = fc(torch.cat([target.model.embed_tokens(torch.tensor(sequence[1:])), features[:n]], dim=-1))
                positions = torch.arange(n)[None]
                mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
                out = layer(x[None], attention_mask=mask, position_ids=positions,
                            position_embeddings=rotary(x[None], positions))[0]
                proposals.append(int(target.lm_head(out[-1]).argmax()))
                sequence.append(proposals[-1])
                features = torch.cat([features, out[-1:]])  # the head's own output is the next feature
            return proposals

    llm = LLM(tiny_model_dir, show_progress=False, dtype="float32", speculative_config=_eagle(eagle_head, k))
    for prompt, first, proposals in first_proposals(llm, PROMPTS):
        assert proposals == reference(prompt, first)


def test_preempted_rows_keep_their_tokens(tiny_model_dir, eagle_head):
    """A pool too small for every row at once: rows are preempted (their head pages go back, and their
    features are recomputed with their K/V) and outputs stay the same."""
    want = _tokens(LLM(tiny_model_dir, show_progress=False))
    llm = LLM(tiny_model_dir, show_progress=False, speculative_config=_eagle(eagle_head), num_kv_blocks=7,
              block_size=8, max_model_len=48)
    assert _tokens(llm) == want
    assert llm.engine.num_preemptions > 0


def test_a_head_of_another_width_is_refused(tiny_model_dir, tmp_path):
    from paged.models.tiny import create_tiny_llama
    other = create_tiny_llama(str(tmp_path / "wide"), hidden_size=96, num_heads=4)
    head = write_eagle_head(str(tmp_path / "head"), other)
    with pytest.raises(ValueError, match="hidden size 96, the target 64"):
        LLM(tiny_model_dir, show_progress=False, speculative_config=_eagle(head))


@pytest.mark.torch
def test_a_target_outside_the_llama_decoders_is_refused_by_name(tmp_path):
    """GPT-2 has no such features (and Gemma scales its embedding, which a head's fc does not expect)."""
    pytest.importorskip("torch")
    from tests.hf_checkpoints import build_checkpoint
    model = build_checkpoint("gpt2", str(tmp_path / "gpt2"))
    with open(os.path.join(model, "config.json")) as f:
        gpt2 = json.load(f)
    shape = tmp_path / "shape"
    shape.mkdir()
    (shape / "config.json").write_text(json.dumps({
        "hidden_size": gpt2["n_embd"], "intermediate_size": 4 * gpt2["n_embd"], "num_attention_heads": gpt2["n_head"],
        "num_key_value_heads": gpt2["n_head"], "head_dim": gpt2["n_embd"] // gpt2["n_head"],
        "vocab_size": gpt2["vocab_size"], "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 512,
        "hidden_act": "silu"}))
    head = write_eagle_head(str(tmp_path / "head"), str(shape))
    with pytest.raises(NotImplementedError, match="EAGLE head for GPT2LMHeadModel is not implemented"):
        LLM(model, show_progress=False, speculative_config=_eagle(head))


def test_the_memory_budget_holds_the_heads_pools_too(tiny_model_dir, eagle_head):
    """Per block of 8 tokens beside the target's 4 KiB of K/V (2 layers, float32): the head's one layer of
    K/V (2 KiB) and the target's feature at each slot (8 x 64 x 4 B = 2 KiB)."""
    options = dict(show_progress=False, block_size=8, max_model_len=64, kv_cache_memory_bytes=400 * 1024)
    llm = LLM(tiny_model_dir, speculative_config=_eagle(eagle_head), **options)
    assert llm.engine.worker.num_blocks == 400 * 1024 // (4096 + 2048 + 2048)


def test_an_fp8_kv_cache_keeps_the_features_in_the_model_dtype(tiny_model_dir, eagle_head):
    """The features are not K/V: with an fp8 pool they (and the head) stay in the model's dtype."""
    want = _tokens(LLM(tiny_model_dir, show_progress=False, kv_cache_dtype="fp8"))
    llm = LLM(tiny_model_dir, show_progress=False, kv_cache_dtype="fp8", speculative_config=_eagle(eagle_head))
    assert llm.engine.worker.runner.hidden_pool.dtype == llm.engine.dtype
    assert _tokens(llm) == want
