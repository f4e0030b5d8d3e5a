"""`paged serve --speculative-config`: the same completions as without it, and vLLM's spec-decode counters."""

from __future__ import annotations

import json

import httpx
import numpy as np

from paged import LLM, SamplingParams
from tests.serving.server_fixture import Server


def test_a_speculating_server_answers_as_without_and_counts_its_proposals(tiny_model_dir):
    phrase = np.random.default_rng(2).integers(5, 400, 5).tolist()
    prompt = phrase * 5
    want = LLM(tiny_model_dir, show_progress=False).generate(
        {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
        use_tqdm=False)[0].outputs[0].text
    config = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    server = Server(tiny_model_dir, "--speculative-config", json.dumps(config))
    try:
        reply = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 16,
                                                                 "temperature": 0, "ignore_eos": True}, timeout=60)
        assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == want
        # Streamed: a step may add several tokens; the chunks still add up to the same text.
        with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                          json={"model": "tiny", "prompt": prompt, "max_tokens": 16, "temperature": 0,
                                "ignore_eos": True, "stream": True}) as stream:
            chunks = [json.loads(line[len("data: "):]) for line in stream.iter_lines()
                      if line.startswith("data: {")]
        assert "".join(c["choices"][0]["text"] for c in chunks) == want
        metrics = httpx.get(server.url + "/metrics").text
        counts = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                  if line.startswith("paged:spec_decode_num_") and not line.startswith("paged:spec_decode_num_"
                                                                                      "accepted_tokens_per_pos")}
        assert counts["paged:spec_decode_num_drafts_total"] > 0
        assert counts["paged:spec_decode_num_draft_tokens_total"] >= counts["paged:spec_decode_num_accepted_tokens_total"]
    finally:
        server.stop()
