"""A training loop's hooks: weights updated in place after optax steps give what transformers gives on the same
weights, without recompiling and without reusing K/V from the old weights; sleep / wake_up free and restore the
KV pool."""

from __future__ import annotations

import gc
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from paged import LLM, SamplingParams
from tests.hf_checkpoints import build_checkpoint, hf_greedy

optax = pytest.importorskip("optax")

PROMPTS = [[5, 9, 13, 200, 31, 17, 8, 40, 41, 42, 7], [7, 7, 30, 12, 90, 91, 92, 93, 3]]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return build_checkpoint("llama-gqa", str(tmp_path_factory.mktemp("llama-gqa")))


def _engine(model_dir: str) -> LLM:
    # float32 and XLA's matmul: the tree is plain [in, out] kernels, as the test maps them back to HF names.
    return LLM(model_dir, dtype="float32", linear_backend="xla", block_size=8, max_model_len=64, num_kv_blocks=32,
               max_num_seqs=4, show_progress=False, enable_prefix_caching=True)


def _greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params,
                                                          use_tqdm=False)]


def _optax_steps(params: dict, steps: int = 3) -> dict:
    """A few Adam steps pulling every weight toward a random target (the loop's own loss does not matter here:
    what is checked is that the engine runs the weights it is given)."""
    rng = np.random.default_rng(0)
    targets = jax.tree.map(lambda p: p + 0.5 * rng.standard_normal(p.shape).astype(p.dtype), params)
    loss = lambda p: sum(jnp.mean((a - b) ** 2) for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(targets)))
    optimizer = optax.adam(0.05)
    state = optimizer.init(params)
    for _ in range(steps):
        updates, state = optimizer.update(jax.grad(loss)(params), state, params)
        params = optax.apply_updates(params, updates)
    return params


def _as_hf_checkpoint(llm: LLM, params: dict, source_dir: str, out_dir: str) -> str:
    """`params` written back under the source checkpoint's tensor names (each name's place in the tree as the
    model declares it), for transformers to run."""
    shutil.copytree(source_dir, out_dir)
    model = llm.engine.worker.model
    tensors = {}
    for name, original in load_file(os.path.join(source_dir, "model.safetensors")).items():
        key, index, transpose = model.checkpoint_target(name)
        index = () if index is None else (index,) if isinstance(index, int) else tuple(index)
        node = params
        if key[0] == "layers" and isinstance(params["layers"], list):  # the unrolled loop's list of layers
            node, key, index = params["layers"][index[0]], key[1:], index[1:]
        for part in key:
            node = node[part]
        array = np.asarray(node)[index] if index else np.asarray(node)
        tensors[name] = np.ascontiguousarray(array.T if transpose else array).astype(original.dtype)
        assert tensors[name].shape == original.shape, name
    save_file(tensors, os.path.join(out_dir, "model.safetensors"))
    return out_dir


def test_updated_weights_give_transformers_tokens_on_those_weights(hf_dir, tmp_path):
    llm = _engine(hf_dir)
    assert _greedy(llm) == hf_greedy(hf_dir, PROMPTS, MAX_TOKENS)  # the prefix cache now holds these prompts
    compiled = llm.engine.num_compilations
    trained = _optax_steps(jax.tree.map(np.asarray, llm.get_params()))
    llm.update_weights(trained)
    hits = llm.engine.kv_stats()["prefix_cache_hits"]
    tokens = _greedy(llm)
    updated_dir = _as_hf_checkpoint(llm, trained, hf_dir, str(tmp_path / "updated"))
    assert tokens == hf_greedy(updated_dir, PROMPTS, MAX_TOKENS)
    assert tokens != hf_greedy(hf_dir, PROMPTS, MAX_TOKENS)  # the steps moved the weights enough to tell
    assert llm.engine.kv_stats()["prefix_cache_hits"] == hits  # no K/V of the old weights was reused
    assert llm.engine.num_compilations == compiled
    # The same weights from a checkpoint path (here transformers' layout, read with the engine's settings).
    llm.update_weights(hf_dir)
    assert _greedy(llm) == hf_greedy(hf_dir, PROMPTS, MAX_TOKENS)
    llm.update_weights(updated_dir)
    assert _greedy(llm) == tokens and llm.engine.num_compilations == compiled


def test_weights_that_do_not_fit_change_nothing(hf_dir):
    llm = _engine(hf_dir)
    before = _greedy(llm)
    params = jax.tree.map(np.asarray, llm.get_params())
    wrong = jax.tree.map(lambda p: p, params)
    wrong["embed_tokens"]["embedding"] = wrong["embed_tokens"]["embedding"][:, :-1]
    with pytest.raises(ValueError, match="embed_tokens.*embedding.*expected float32"):
        llm.update_weights(wrong)
    with pytest.raises(ValueError, match="tree differs"):
        llm.update_weights({"embed_tokens": params["embed_tokens"]})
    halves = jax.tree.map(lambda p: p.astype(np.float16), params)
    with pytest.raises(ValueError, match="expected float32"):
        llm.update_weights(halves)
    assert _greedy(llm) == before
    engine = llm.engine
    engine.add_request(engine.make_request("busy", None, PROMPTS[0], SamplingParams(max_tokens=2), None))
    with pytest.raises(RuntimeError, match="idle engine"):
        llm.update_weights(params)
    while engine.has_unfinished_requests():
        engine.step()


def test_sleep_frees_the_kv_pool_and_wake_up_restores_it(hf_dir):
    llm = _engine(hf_dir)
    tokens = _greedy(llm)
    compiled = llm.engine.num_compilations
    def live() -> int:
        """Bytes of live device arrays, with what earlier tests left for the collector gone first."""
        gc.collect()
        return sum(array.nbytes for array in jax.live_arrays())

    awake = live()
    gc.disable()  # nothing else is freed while the pool is: the difference is the pool's
    try:
        llm.sleep()
        asleep = sum(array.nbytes for array in jax.live_arrays())
    finally:
        gc.enable()
    assert awake - asleep == llm.engine.kv_pool_bytes  # the pool, and only the pool
    with pytest.raises(RuntimeError, match="asleep"):
        _greedy(llm)
    llm.wake_up()
    assert live() == awake
    assert _greedy(llm) == tokens and llm.engine.num_compilations == compiled
