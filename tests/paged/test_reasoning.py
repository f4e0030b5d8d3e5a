"""Reasoning parsers: the whole-reply split, and streamed deltas that add up to it however the text is cut."""

from __future__ import annotations

import random

import pytest

from paged.reasoning import REASONING_PARSERS, ReasoningStream

# (output text, begins inside the thinking) -> (reasoning, content) per parser
CASES = [
    ("<think>step one\nstep two</think>\n\nThe answer is 4.", False,
     {"deepseek_r1": ("step one\nstep two", "\n\nThe answer is 4."),
      "qwen3": ("step one\nstep two", "\n\nThe answer is 4.")}),
    ("step one</think>The answer", False,  # R1's template opened the block; Qwen3 without one: all answer
     {"deepseek_r1": ("step one", "The answer"), "qwen3": (None, "step one</think>The answer")}),
    ("step one</think>The answer", True,  # a Qwen3 Thinking template opened the block
     {"deepseek_r1": ("step one", "The answer"), "qwen3": ("step one", "The answer")}),
    ("still thinking when max_tokens ran out", False,
     {"deepseek_r1": ("still thinking when max_tokens ran out", ""),
      "qwen3": (None, "still thinking when max_tokens ran out")}),
    ("<think>cut short", False, {"deepseek_r1": ("cut short", ""), "qwen3": ("cut short", "")}),
    ("<think></think>{\"a\": 1}", False, {"deepseek_r1": ("", "{\"a\": 1}"), "qwen3": ("", "{\"a\": 1}")}),
    ("a < b and </t is not a marker</think>ok", True,
     {"deepseek_r1": ("a < b and </t is not a marker", "ok"), "qwen3": ("a < b and </t is not a marker", "ok")}),
    ("<thinking is not the marker", False,
     {"deepseek_r1": ("<thinking is not the marker", ""), "qwen3": (None, "<thinking is not the marker")}),
    ("", False, {"deepseek_r1": ("", ""), "qwen3": (None, "")}),
]


@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
@pytest.mark.parametrize("text, inside, want", CASES, ids=range(len(CASES)))
def test_a_whole_reply_splits_at_the_markers(name, text, inside, want):
    parser = REASONING_PARSERS[name]
    split = parser.split(text, parser.starts_inside or inside, final=True)
    assert (split.reasoning, split.content) == want[name]


@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
@pytest.mark.parametrize("text, inside, want", CASES, ids=range(len(CASES)))
def test_streamed_deltas_add_up_to_the_whole_split_however_the_text_is_cut(name, text, inside, want):
    parser = REASONING_PARSERS[name]
    rng = random.Random(len(text))
    cuts = [sorted(rng.sample(range(1, len(text)), min(k, max(len(text) - 1, 0)))) for k in (1, 3, 8, 40)]
    cuts.append(list(range(1, len(text))))  # a character at a time: every marker arrives split
    for points in cuts:
        stream = ReasoningStream(parser, parser.starts_inside or inside)
        reasoning, content = "", ""
        for end in [*points, len(text)]:
            r, c = stream.delta(text[:end], final=end == len(text))
            reasoning, content = reasoning + r, content + c
            assert "<think>" not in reasoning + content or "<think>" in want[name][1]
            assert "</think>" not in reasoning
        assert (reasoning if want[name][0] is not None else None, content) == want[name], points


def test_a_block_the_prompt_opened_is_seen_from_the_prompt():
    qwen3 = REASONING_PARSERS["qwen3"]
    assert qwen3.opens_in("<|im_start|>assistant\n<think>\n")
    assert not qwen3.opens_in("<|im_start|>assistant\n")
    assert not qwen3.opens_in("<think>old</think> answer<|im_start|>assistant\n")
    assert REASONING_PARSERS["deepseek_r1"].opens_in("anything")


def test_llm_chat_splits_the_thinking_and_constrains_only_the_answer(tmp_path):
    """LLM.chat with a reasoning_parser, on a model whose greedy reply is `<think>Let</think>The answer is 4`
    (tests/serving/scripted_model.py): the split, and a choice constraint that starts after the thinking."""
    from paged import LLM, SamplingParams, StructuredOutputsParams
    from tests.serving.scripted_model import create_scripted_llama

    model = create_scripted_llama(str(tmp_path), "<think>Let</think>The answer is 4")
    conversation = [{"role": "user", "content": "2 + 2?"}]
    greedy = SamplingParams(temperature=0, max_tokens=30)
    plain = LLM(model, show_progress=False, max_model_len=128, enforce_eager=True)
    (output,) = plain.chat(conversation, greedy, use_tqdm=False)
    assert output.outputs[0].text == "<think>Let</think>The answer is 4"
    assert output.outputs[0].reasoning_content is None and output.outputs[0].content is None
    del plain
    for name in sorted(REASONING_PARSERS):
        llm = LLM(model, show_progress=False, max_model_len=128, enforce_eager=True, reasoning_parser=name)
        (output,) = llm.chat(conversation, greedy, use_tqdm=False)
        completion = output.outputs[0]
        assert (completion.reasoning_content, completion.content) == ("Let", "The answer is 4")
        # The thinking is written as the model wants; the answer is one of the choices (the model's "The" is
        # masked). Without the constraint starting after </think>, "<think>" itself would be masked.
        choice = SamplingParams(temperature=0, max_tokens=30,
                                structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
        (output,) = llm.chat(conversation, choice, use_tqdm=False)
        completion = output.outputs[0]
        assert completion.reasoning_content == "Let" and completion.content in ("yes", "no"), completion
        assert choice.structured_outputs_after is None  # the caller's params are left as they were
        del llm
    with pytest.raises(ValueError, match="reasoning_parser must be one of"):
        LLM(model, show_progress=False, reasoning_parser="nope")

