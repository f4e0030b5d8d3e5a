"""Speculative decoding by an EAGLE-3 head (method "eagle3"; models/eagle.py `Eagle3Head`): heads written in
EAGLE-3's own checkpoint format and in the speculators format (random weights, a pruned draft vocabulary with
its d2t map) load, propose what the same head built from transformers' Llama modules proposes from
transformers' own intermediate hidden states, and leave the target's tokens unchanged."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from safetensors.numpy import save_file

from paged import LLM, SamplingParams
from paged.models.tiny import create_tiny_llama
from tests.paged.proposals import first_proposals

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
PROMPTS = [[5, 17, 99, 23, 7, 55], [300, 12, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24], [42, 43]]
DRAFT_VOCAB = 96


def write_eagle3_head(directory: str, target_dir: str, *, layout: str = "eagle3", hidden: int | None = None,
                      aux_layer_ids: list[int] | None = None, embed_tokens: bool = False, seed: int = 1) -> str:
    """An EAGLE-3 head for the target in `target_dir`. layout "eagle3": EAGLE's own (config
    LlamaForCausalLMEagle3, flat; the layer under `midlayer.`); "speculators": vLLM's speculators format
    (Eagle3Speculator, the layer's config under transformer_layer_config; the layer under `layers.0.`).
    The draft vocabulary is DRAFT_VOCAB of the target's ids, chosen at random, mapped back by d2t."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(target_dir, "config.json")) as f:
        target = json.load(f)
    target_hidden, vocab = target["hidden_size"], target["vocab_size"]
    hidden = hidden or target_hidden
    heads, kv_heads, inner = 4, 2, 2 * hidden
    head_dim = hidden // heads
    layer_config = dict(hidden_size=hidden, intermediate_size=inner, num_attention_heads=heads,
                        num_key_value_heads=kv_heads, head_dim=head_dim, vocab_size=vocab, rms_norm_eps=1e-6,
                        rope_theta=10000.0, max_position_embeddings=1024, hidden_act="silu", num_hidden_layers=1,
                        model_type="llama", torch_dtype="float32")
    extra = dict(draft_vocab_size=DRAFT_VOCAB, target_hidden_size=target_hidden)
    if aux_layer_ids is not None:
        extra["eagle_aux_hidden_state_layer_ids"] = aux_layer_ids
    if layout == "eagle3":
        config = {**layer_config, **extra, "architectures": ["LlamaForCausalLMEagle3"]}
        prefix = "midlayer."
    else:
        config = {**extra, "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
                  "transformer_layer_config": {**layer_config, "architectures": ["LlamaForCausalLM"]}}
        prefix = "layers.0."
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    rng = np.random.default_rng(seed)
    normal = lambda *shape: (rng.standard_normal(shape) * 0.2).astype(np.float32)
    draft_ids = np.sort(rng.choice(vocab, DRAFT_VOCAB, replace=False))
    tensors = {
        "fc.weight": normal(hidden, 3 * target_hidden), "norm.weight": 1 + normal(hidden),
        "lm_head.weight": normal(DRAFT_VOCAB, hidden),
        "d2t": (draft_ids - np.arange(DRAFT_VOCAB)).astype(np.int64),
        "t2d": np.isin(np.arange(vocab), draft_ids),
        prefix + "self_attn.q_proj.weight": normal(heads * head_dim, 2 * hidden),
        prefix + "self_attn.k_proj.weight": normal(kv_heads * head_dim, 2 * hidden),
        prefix + "self_attn.v_proj.weight": normal(kv_heads * head_dim, 2 * hidden),
        prefix + "self_attn.o_proj.weight": normal(hidden, heads * head_dim),
        prefix + "mlp.gate_proj.weight": normal(inner, hidden), prefix + "mlp.up_proj.weight": normal(inner, hidden),
        prefix + "mlp.down_proj.weight": normal(hidden, inner),
        prefix + "input_layernorm.weight": 1 + normal(hidden), prefix + "hidden_norm.weight": 1 + normal(hidden),
        prefix + "post_attention_layernorm.weight": 1 + normal(hidden)}
    if embed_tokens:
        tensors["embed_tokens.weight"] = normal(vocab, hidden)
    save_file(tensors, os.path.join(directory, "model.safetensors"))
    return directory


def _eagle3(head: str, k: int = 3) -> dict:
    return {"method": "eagle3", "model": head, "num_speculative_tokens": k}


def _tokens(llm, prompts=PROMPTS, params=GREEDY) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture(scope="module")
def four_layer_target(tmp_path_factory) -> str:
    """Four layers: vLLM's default streams (2, L // 2, L - 3) are then (2, 2, 1)."""
    return create_tiny_llama(str(tmp_path_factory.mktemp("tiny-llama-4")), num_layers=4)


@pytest.mark.parametrize("layout", ["eagle3", "speculators"])
def test_the_target_keeps_its_tokens(tiny_model_dir, tmp_path, layout):
    head = write_eagle3_head(str(tmp_path / "head"), tiny_model_dir, layout=layout, aux_layer_ids=[1, 0, 1])
    want = _tokens(LLM(tiny_model_dir, show_progress=False))
    llm = LLM(tiny_model_dir, show_progress=False, speculative_config=_eagle3(head))
    assert _tokens(llm) == want
    assert llm.engine.spec_stats.num_draft_tokens > 0


def test_preempted_rows_keep_their_tokens(tiny_model_dir, tmp_path):
    head = write_eagle3_head(str(tmp_path / "head"), tiny_model_dir, aux_layer_ids=[0, 1, 1])
    want = _tokens(LLM(tiny_model_dir, show_progress=False))
    llm = LLM(tiny_model_dir, show_progress=False, speculative_config=_eagle3(head), num_kv_blocks=7,
              block_size=8, max_model_len=48)
    assert _tokens(llm) == want
    assert llm.engine.num_preemptions > 0


def _reference_proposer(target_dir: str, head: str, k: int):
    """The head from transformers' Llama modules: LlamaAttention with its q/k/v projections widened to 2H (as
    vLLM's EAGLE-3 layer does), LlamaMLP and LlamaRMSNorm, run over the whole sequence again for each proposal.
    Its features: fc over the target's `output_hidden_states` at the head's layer ids."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, LlamaConfig
    from transformers.models.llama.modeling_llama import (LlamaAttention, LlamaMLP, LlamaRMSNorm,
                                                          LlamaRotaryEmbedding)

    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    with open(os.path.join(head, "config.json")) as f:
        raw = json.load(f)
    layer_raw = raw.get("transformer_layer_config", raw)
    config = LlamaConfig(**{key: value for key, value in layer_raw.items() if key != "architectures"})
    config._attn_implementation = "eager"
    layers = target.config.num_hidden_layers
    ids = raw.get("eagle_aux_hidden_state_layer_ids") or [2, layers // 2, layers - 3]
    weights = load_file(os.path.join(head, "model.safetensors"))
    prefix = "midlayer." if "midlayer.input_layernorm.weight" in weights else "layers.0."
    part = lambda name: {key[len(name):]: w for key, w in weights.items() if key.startswith(name)}
    h, vocab = config.hidden_size, target.config.vocab_size
    attention = LlamaAttention(config, layer_idx=0)
    for proj in ("q_proj", "k_proj", "v_proj"):
        out = getattr(attention, proj).out_features
        setattr(attention, proj, torch.nn.Linear(2 * h, out, bias=False))
    attention.load_state_dict(part(prefix + "self_attn."))
    mlp = LlamaMLP(config)
    mlp.load_state_dict(part(prefix + "mlp."))
    norms = {}
    for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm", "norm"):
        norms[name] = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        norms[name].weight.data = weights[name + ".weight" if name == "norm" else prefix + name + ".weight"]
    fc = torch.nn.Linear(3 * target.config.hidden_size, h, bias=False)
    fc.weight.data = weights["fc.weight"]
    lm_head = torch.nn.Linear(h, weights["lm_head.weight"].shape[0], bias=False)
    lm_head.weight.data = weights["lm_head.weight"]
    to_target = torch.arange(lm_head.out_features) + weights["d2t"]
    embed = torch.nn.Embedding(vocab, h)
    embed.weight.data = weights["embed_tokens.weight"] if "embed_tokens.weight" in weights else \
        target.model.embed_tokens.weight.data
    rotary = LlamaRotaryEmbedding(config)

    def layer(embedded, features):
        n = embedded.shape[0]
        x = torch.cat([norms["input_layernorm"](embedded), norms["hidden_norm"](features)], dim=-1)[None]
        positions = torch.arange(n)[None]
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        attended = attention(x, position_embeddings=rotary(x, positions), attention_mask=mask)[0][0]
        stream = features + attended
        return stream + mlp(norms["post_attention_layernorm"](stream))  # before the final norm

    def propose(prompt: list[int], first: int) -> list[int]:
        with torch.no_grad():
            streams = target.model(torch.tensor([prompt]), output_hidden_states=True).hidden_states
            features = fc(torch.cat([streams[i][0] for i in ids], dim=-1))  # [P, H]
            sequence, proposals = [*prompt, first], []
            for _ in range(k):
                n = len(sequence) - 1  # positions 0..n-1 read tokens 1..n
                out = layer(embed(torch.tensor(sequence[1:])), features[:n])
                proposals.append(int(to_target[lm_head(norms["norm"](out[-1])).argmax()]))
                sequence.append(proposals[-1])
                features = torch.cat([features, out[-1:]])  # the head's own output is the next feature
            return proposals
    return propose


@pytest.mark.torch
@pytest.mark.parametrize("layout,hidden,embed_tokens", [("eagle3", None, False), ("speculators", 32, True)])
def test_proposals_equal_the_head_built_from_transformers_modules(four_layer_target, tmp_path, layout, hidden,
                                                                  embed_tokens):
    """EAGLE-3's layout reading the target's embedding at the default streams; the speculators layout with a
    narrower head (target_hidden_size 64, hidden 32) and its own embedding."""
    pytest.importorskip("torch")
    k = 3
    head = write_eagle3_head(str(tmp_path / "head"), four_layer_target, layout=layout, hidden=hidden,
                             embed_tokens=embed_tokens)
    reference = _reference_proposer(four_layer_target, head, k)
    llm = LLM(four_layer_target, show_progress=False, dtype="float32", speculative_config=_eagle3(head, k))
    for prompt, first, proposals in first_proposals(llm, PROMPTS):
        assert proposals == reference(prompt, first)


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_nothing_compiles_after_precompile(tiny_model_dir, tmp_path, method):
    from tests.paged.test_eagle import write_eagle_head
    head = write_eagle_head(str(tmp_path / "head"), tiny_model_dir) if method == "eagle" else \
        write_eagle3_head(str(tmp_path / "head"), tiny_model_dir, aux_layer_ids=[1, 0, 1])
    llm = LLM(tiny_model_dir, show_progress=False, max_num_batched_tokens=64, max_num_seqs=8,
              speculative_config={"method": method, "model": head, "num_speculative_tokens": 3})
    llm.engine.precompile()
    compiled = llm.engine.num_compilations
    lengths = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 9, 17)]
    _tokens(llm, PROMPTS, lengths)
    _tokens(llm, [p * 5 for p in PROMPTS])
    assert llm.engine.num_compilations == compiled


def test_layer_ids_outside_the_target_are_refused(tiny_model_dir, tmp_path):
    """vLLM's default (2, L // 2, L - 3) does not fit a two-layer target; the error names the ids."""
    head = write_eagle3_head(str(tmp_path / "head"), tiny_model_dir)
    with pytest.raises(ValueError, match=r"reads the target's layers \[2, 1, -1\].*in \[0, 2\)"):
        LLM(tiny_model_dir, show_progress=False, speculative_config=_eagle3(head))


def test_a_head_for_another_width_is_refused(tiny_model_dir, tmp_path):
    other = create_tiny_llama(str(tmp_path / "wide"), hidden_size=96, num_heads=4)
    head = write_eagle3_head(str(tmp_path / "head"), other, aux_layer_ids=[0, 1, 1])
    with pytest.raises(ValueError, match="features of width 96, the target's hidden size is 64"):
        LLM(tiny_model_dir, show_progress=False, speculative_config=_eagle3(head))


TP_SCRIPT = """
import json, sys
from paged import LLM, SamplingParams
from tests.paged.proposals import first_proposals
model, heads, prompts = json.loads(sys.argv[1])
results = {}
for method, head in heads:
    spec = {"method": method, "model": head, "num_speculative_tokens": 3}
    llm = LLM(model, show_progress=False, dtype="float32", tensor_parallel_size=2, speculative_config=spec)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    results[method] = {"tokens": [list(o.outputs[0].token_ids) for o in outputs],
                       "first_proposals": first_proposals(llm, prompts)}
print("RESULT " + json.dumps(results))
"""


def test_tensor_parallel_targets_propose_and_keep_their_tokens(tiny_model_dir, tmp_path):
    """A target split over two devices: each head (EAGLE-1 and EAGLE-3) proposes what it proposes beside the
    same target on one device, and the target's tokens are its own."""
    import subprocess
    import sys
    from tests.paged.test_eagle import write_eagle_head
    heads = [("eagle", write_eagle_head(str(tmp_path / "eagle"), tiny_model_dir)),
             ("eagle3", write_eagle3_head(str(tmp_path / "eagle3"), tiny_model_dir, aux_layer_ids=[1, 0, 1]))]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    run = subprocess.run([sys.executable, "-c", TP_SCRIPT, json.dumps([tiny_model_dir, heads, PROMPTS])],
                         capture_output=True, text=True, env=env, timeout=600, cwd=repo)
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert run.returncode == 0 and lines, run.stderr[-3000:]
    sharded = json.loads(lines[0][len("RESULT "):])
    want = _tokens(LLM(tiny_model_dir, show_progress=False, dtype="float32"))
    for method, head in heads:
        assert sharded[method]["tokens"] == want
        one_device = LLM(tiny_model_dir, show_progress=False, dtype="float32",
                         speculative_config={"method": method, "model": head, "num_speculative_tokens": 3})
        assert [list(row) for row in first_proposals(one_device, PROMPTS)] == sharded[method]["first_proposals"]
