"""Trains the built-in demo model (`paged-demo-docstrings`) on the Python standard library's docstrings.

    python -m paged.models.demo_model.train [--steps 2400] [--out models/demo_model/checkpoint]

The corpus is the docstrings of the running interpreter's standard library (PSF-licensed text that ships with
every Python), so the checkpoint can be rebuilt anywhere offline. The model is a small Llama (tied
embeddings, grouped-query attention) in Hugging Face's layout, written as `config.json`, `model.safetensors`
(bfloat16, as Hub checkpoints are) and a byte-level BPE tokenizer, so the engine loads it through the same
path as any Hub model. The forward pass here is a plain dense causal transformer: training needs gradients,
not the paged cache. About 20 minutes on two CPU cores; the committed checkpoint came from the defaults.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import pathlib
import sysconfig
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

CHECKPOINT_DIR = pathlib.Path(__file__).parent / "checkpoint"
DRAFT_CHECKPOINT_DIR = pathlib.Path(__file__).parent / "draft_checkpoint"
# Small enough to commit (about 2.0M parameters, 3.9 MB in bfloat16) and to train on a laptop; large enough
# that greedy text is made of real words in docstring-like sentences.
SHAPE = dict(vocab_size=2048, hidden_size=192, intermediate_size=512, num_hidden_layers=4,
             num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=512)
# The draft model for speculative decoding (`--shape draft`): the same tokenizer and corpus, a quarter of the
# width and half the layers, so one forward costs a small fraction of the target's.
DRAFT_SHAPE = dict(SHAPE, hidden_size=96, intermediate_size=256, num_hidden_layers=2, num_attention_heads=3,
                   num_key_value_heads=1)
SHAPES = {"demo": SHAPE, "draft": DRAFT_SHAPE}
SPECIALS = ["<s>", "</s>", "<unk>", "<|user|>", "<|assistant|>", "<|system|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


# Typographic punctuation in pydoc's topics, written as ASCII so the tokenizer's vocabulary goes to words.
_ASCII = str.maketrans({"\u2019": "'", "\u2018": "'", "\u201c": '"', "\u201d": '"', "\u2026": "...",
                        "\u2014": "--", "\u2013": "-"})


def stdlib_docstrings(min_chars: int = 60) -> list[str]:
    """Module, class and function docstrings of the standard library (its tests and IDLE left out), and
    pydoc's help topics."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    docs = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if parts[0] in ("test", "idlelib", "lib2to3", "site-packages", "turtledemo") or "tests" in parts:
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) >= min_chars:
                    docs.append(doc.translate(_ASCII))
    # pydoc's help topics: the language reference's prose, one entry per topic.
    from pydoc_data.topics import topics
    docs.extend(text.strip().translate(_ASCII) for _, text in sorted(topics.items()))
    return [doc for doc in docs if doc.isascii()]


def train_tokenizer(docs: list[str], directory: pathlib.Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=SHAPE["vocab_size"], special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(docs, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", model_max_length=SHAPE["max_position_embeddings"])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(directory))
    return tokenizer


def init_params(key, shape: dict = SHAPE) -> dict[str, jax.Array]:
    """HF Llama tensor names and layouts ([out, in] projections); GPT-2-style scaled init of the outputs."""
    d, f, n = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    head_dim = d // shape["num_attention_heads"]
    kv = shape["num_key_value_heads"] * head_dim
    shapes = {"model.embed_tokens.weight": (shape["vocab_size"], d)}
    for i in range(n):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (d, d), p + "self_attn.k_proj.weight": (kv, d),
                       p + "self_attn.v_proj.weight": (kv, d), p + "self_attn.o_proj.weight": (d, d),
                       p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d),
                       p + "mlp.down_proj.weight": (d, f)})
    params = {}
    for k, (name, shape) in zip(jax.random.split(key, len(shapes)), shapes.items()):
        scale = 0.02 / math.sqrt(2 * n) if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
        params[name] = scale * jax.random.normal(k, shape, jnp.float32)
    for i in range(n):
        params[f"model.layers.{i}.input_layernorm.weight"] = jnp.ones(d)
        params[f"model.layers.{i}.post_attention_layernorm.weight"] = jnp.ones(d)
    params["model.norm.weight"] = jnp.ones(d)
    return params


def _rms_norm(x, w, eps=1e-6):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * w


def _rope(x, theta=10000.0):
    """HF's rotate-half rotary embedding; x: [batch, seq, heads, head_dim]."""
    half = x.shape[-1] // 2
    freqs = 1.0 / theta ** (jnp.arange(half) / half)
    angles = jnp.arange(x.shape[1])[:, None] * freqs[None]
    cos, sin = jnp.cos(angles)[None, :, None], jnp.sin(angles)[None, :, None]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def loss_fn(params, tokens, shape: dict = SHAPE):
    """Mean next-token cross entropy over tokens [batch, seq + 1]."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    b, s = inputs.shape
    heads, kv_heads = shape["num_attention_heads"], shape["num_key_value_heads"]
    head_dim = shape["hidden_size"] // heads
    embed = params["model.embed_tokens.weight"]
    x = embed[inputs]
    causal = jnp.tril(jnp.ones((s, s), bool))
    for i in range(shape["num_hidden_layers"]):
        p = lambda name: params[f"model.layers.{i}.{name}.weight"]
        h = _rms_norm(x, p("input_layernorm"))
        q = _rope((h @ p("self_attn.q_proj").T).reshape(b, s, heads, head_dim))
        k = _rope((h @ p("self_attn.k_proj").T).reshape(b, s, kv_heads, head_dim))
        v = (h @ p("self_attn.v_proj").T).reshape(b, s, kv_heads, head_dim)
        k, v = (jnp.repeat(t, heads // kv_heads, axis=2) for t in (k, v))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(head_dim)
        probs = jax.nn.softmax(jnp.where(causal, scores, -1e30), -1)
        attn = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, -1)
        x = x + attn @ p("self_attn.o_proj").T
        h = _rms_norm(x, p("post_attention_layernorm"))
        x = x + (jax.nn.silu(h @ p("mlp.gate_proj").T) * (h @ p("mlp.up_proj").T)) @ p("mlp.down_proj").T
    logits = _rms_norm(x, params["model.norm.weight"]) @ embed.T
    logp = jax.nn.log_softmax(logits, -1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], -1))


def make_train_step(steps: int, peak_lr: float, shape: dict = SHAPE, warmup: int = 100,
                    weight_decay: float = 0.1):
    """AdamW (beta2 0.95, as small language models are usually trained) with warmup and cosine decay to 10%."""
    b1, b2, eps = 0.9, 0.95, 1e-8

    @jax.jit
    def step(params, m, v, t, tokens):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens, shape)
        norm = jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree.leaves(grads)))
        grads = jax.tree.map(lambda g: g * jnp.minimum(1.0, 1.0 / (norm + 1e-6)), grads)  # clip at 1.0
        progress = jnp.clip((t - warmup) / max(steps - warmup, 1), 0.0, 1.0)
        lr = peak_lr * jnp.minimum(1.0, (t + 1) / warmup) * (0.1 + 0.45 * (1 + jnp.cos(jnp.pi * progress)))
        m = jax.tree.map(lambda m_, g: b1 * m_ + (1 - b1) * g, m, grads)
        v = jax.tree.map(lambda v_, g: b2 * v_ + (1 - b2) * g * g, v, grads)
        correction = jnp.sqrt(1 - b2 ** (t + 1)) / (1 - b1 ** (t + 1))

        def update(name, w):
            decay = weight_decay * w if w.ndim == 2 else 0.0  # norms are not decayed
            return w - lr * (correction * m[name] / (jnp.sqrt(v[name]) + eps) + decay)

        return {name: update(name, w) for name, w in params.items()}, m, v, loss

    return step


def write_checkpoint(params, directory: pathlib.Path, tokenizer, shape: dict = SHAPE) -> None:
    d = shape["hidden_size"]
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **shape,
              "head_dim": d // shape["num_attention_heads"], "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
              "tie_word_embeddings": True, "hidden_act": "silu",
              "bos_token_id": tokenizer.token_to_id("<s>"), "eos_token_id": tokenizer.token_to_id("</s>"),
              "torch_dtype": "bfloat16"}
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tensors = {name: np.ascontiguousarray(np.asarray(w).astype(ml_dtypes.bfloat16)) for name, w in params.items()}
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1600)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=pathlib.Path, default=None,
                        help="default: checkpoint/ for the demo shape, draft_checkpoint/ for the draft")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="demo",
                        help="demo: the built-in model; draft: its speculative-decoding draft (same tokenizer)")
    args = parser.parse_args(argv)
    shape = SHAPES[args.shape]
    if args.out is None:
        args.out = CHECKPOINT_DIR if args.shape == "demo" else DRAFT_CHECKPOINT_DIR
    args.out.mkdir(parents=True, exist_ok=True)
    docs = stdlib_docstrings()
    tokenizer = train_tokenizer(docs, args.out)
    eos = tokenizer.token_to_id("</s>")
    stream = np.concatenate([np.append(np.asarray(e.ids, np.int32), eos)
                             for e in tokenizer.encode_batch(docs)])
    print(f"{len(docs)} docstrings, {sum(map(len, docs)) / 1e6:.1f}M characters, {len(stream) / 1e6:.2f}M tokens")
    # The last 2% of the stream is held out to report a validation loss.
    held_out = stream[-len(stream) // 50:]
    stream = stream[:-len(stream) // 50]
    rng = np.random.default_rng(args.seed)
    params = init_params(jax.random.key(args.seed), shape)
    m = jax.tree.map(jnp.zeros_like, params)
    v = jax.tree.map(jnp.zeros_like, params)
    step = make_train_step(args.steps, args.lr, shape)
    window = args.seq_len + 1
    start = time.perf_counter()
    for t in range(args.steps):
        offsets = rng.integers(0, len(stream) - window, args.batch_size)
        batch = np.stack([stream[o:o + window] for o in offsets])
        params, m, v, loss = step(params, m, v, jnp.float32(t), batch)
        if t % 100 == 0 or t == args.steps - 1:
            print(f"step {t:5d}  loss {float(loss):.3f}  {time.perf_counter() - start:6.0f}s", flush=True)
    windows = np.stack([held_out[o:o + window] for o in range(0, len(held_out) - window, window)][:64])
    print(f"held-out loss {float(jax.jit(lambda p, w: loss_fn(p, w, shape))(params, windows)):.3f} nats/token")
    write_checkpoint(params, args.out, tokenizer, shape)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
