"""Embedding throughput: paged's pooling runner against sentence-transformers, same checkpoint, same inputs.

    paged bench embed [--model-shape bge-small | bge-base | minilm | --model DIR] [--sequences 512]
        [--min-words 4] [--max-words 120] [--batch-size 32] [--rounds 3] [--json out.json]

A random-weight checkpoint of the shape is written by transformers and wrapped by sentence-transformers
(mean pooling, normalised, as bge and MiniLM ship); `--model` takes a sentence-transformers directory
instead. Inputs are random texts of the tiny corpus's words, `--min-words` to `--max-words` long, a fresh set
for every round (pooling keeps no prefix cache, and none of the warm-up's inputs recur). Rounds alternate
which of the two goes first, with a second's pause before each timing (torch's and XLA's worker threads spin a
while after their work, which would slow whichever runs next), each encoding the round's texts in full (sentence-transformers in batches of
`--batch-size`, sorted by length as it does; paged with the whole list handed to `LLM.embed`, which
batches by its token budget). Reported: sequences and tokens per second per round, their medians, the ratio of
medians, and the largest cosine distance between the two's vectors (a check that both computed the same thing).
Needs torch and sentence-transformers (the bench extra and the test requirements).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

from paged.benchmarks.common import report

# Encoder shapes of popular embedding models (random weights; the vocabulary is BERT's).
SHAPES = {
    "minilm": dict(hidden_size=384, intermediate_size=1536, num_hidden_layers=6, num_attention_heads=12),
    "bge-small": dict(hidden_size=384, intermediate_size=1536, num_hidden_layers=12, num_attention_heads=12),
    "bge-base": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12),
}


def build_model(shape: str) -> str:
    """A sentence-transformers checkpoint of `shape` (written once under the cache root)."""
    import torch
    import transformers
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    from paged.kernels.cache import cache_root
    from paged.models.tiny import train_encoder_tokenizer
    directory = str(cache_root() / "benchmarks" / f"embed-{shape}")
    if os.path.exists(os.path.join(directory, "modules.json")):
        return directory
    base = directory + "-base"
    train_encoder_tokenizer(base)
    config = transformers.BertConfig(vocab_size=30522, max_position_embeddings=512, type_vocab_size=2,
                                     **SHAPES[shape])
    torch.manual_seed(0)
    transformers.BertModel(config).eval().save_pretrained(base)
    transformer = Transformer(base)
    modules = [transformer, Pooling(transformer.get_embedding_dimension(), pooling_mode="mean"), Normalize()]
    SentenceTransformer(modules=modules, device="cpu").save(directory)
    return directory


def random_texts(count: int, min_words: int, max_words: int, seed: int) -> list[str]:
    from paged.models.tiny import _CORPUS
    words = _CORPUS.split()
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(words, int(rng.integers(min_words, max_words + 1)))) for _ in range(count)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-shape", default="bge-small", choices=sorted(SHAPES))
    parser.add_argument("--model", default=None, help="a sentence-transformers directory (instead of a shape)")
    parser.add_argument("--sequences", type=int, default=512)
    parser.add_argument("--min-words", type=int, default=4)
    parser.add_argument("--max-words", type=int, default=120)
    parser.add_argument("--batch-size", type=int, default=32, help="sentence-transformers' batch size")
    parser.add_argument("--max-num-seqs", type=int, default=64, help="paged's sequences per step")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="paged's tokens per step (default: the engine's, an encoder's max_model_len)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    import torch
    from sentence_transformers import SentenceTransformer

    from paged import LLM
    directory = args.model or build_model(args.model_shape)
    reference = SentenceTransformer(directory, device="cpu")
    max_len = min(reference.max_seq_length or 512, 512)
    llm = LLM(directory, show_progress=False, max_num_seqs=args.max_num_seqs, max_model_len=max_len,
              max_num_batched_tokens=args.max_num_batched_tokens)
    llm.engine.precompile()
    tokenizer = llm.get_tokenizer()

    def run_paged(texts):
        return np.array([o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)])

    def run_reference(texts):
        with torch.inference_mode():
            return reference.encode(texts, batch_size=args.batch_size, convert_to_numpy=True)

    warm = random_texts(args.batch_size, args.min_words, args.max_words, seed=10_000)
    run_paged(warm), run_reference(warm)
    rounds = {"paged": [], "sentence_transformers": []}
    max_distance = 0.0
    for index in range(args.rounds):
        texts = random_texts(args.sequences, args.min_words, args.max_words, seed=index)
        tokens = sum(len(ids) for ids in tokenizer(texts, truncation=True, max_length=max_len)["input_ids"])
        vectors = {}
        order = [("paged", run_paged), ("sentence_transformers", run_reference)]
        for name, run in order if index % 2 == 0 else order[::-1]:  # alternating: neither always goes first
            time.sleep(1.0)  # the other's worker threads stop spinning before this one is timed
            started = time.perf_counter()
            vectors[name] = run(texts)
            seconds = time.perf_counter() - started
            rounds[name].append({"seconds": seconds, "sequences_per_s": len(texts) / seconds,
                                 "tokens_per_s": tokens / seconds, "tokens": tokens})
        a, b = vectors["paged"], vectors["sentence_transformers"]
        cos = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
        max_distance = max(max_distance, float(1 - cos.min()))
    median = {name: statistics.median(r["sequences_per_s"] for r in runs) for name, runs in rounds.items()}
    result = {
        "model": args.model or args.model_shape, "sequences": args.sequences,
        "words_per_text": [args.min_words, args.max_words], "batch_size": args.batch_size,
        "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": llm.engine.config.max_num_batched_tokens,
        "dtype": str(llm.engine.dtype), "torch_threads": torch.get_num_threads(), "rounds": rounds,
        "median_sequences_per_s": median,
        "median_tokens_per_s": {name: statistics.median(r["tokens_per_s"] for r in runs)
                                for name, runs in rounds.items()},
        "paged_over_sentence_transformers": median["paged"] / median["sentence_transformers"],
        "max_cosine_distance": max_distance,
    }
    report(result, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
