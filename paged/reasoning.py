"""Reasoning parsers (`--reasoning-parser`): a reasoning model's thinking, written between `<think>` and
`</think>`, is separated from its answer (chat's `reasoning_content` beside `content`).

The parsers differ in where the thinking starts:
- `deepseek_r1`: the output starts inside the thinking. DeepSeek-R1's template opens the block itself (later
  versions of the model write `<think>` again, which is dropped); everything before `</think>` is reasoning,
  and an output that never closes the block is reasoning only.
- `qwen3`: the output holds thinking only when it starts with `<think>` (Qwen3 with `enable_thinking=False`
  writes none), or when the rendered prompt already ends inside an opened block (the Qwen3 "Thinking"
  models' templates); otherwise all of it is the answer.

Both work on the text so far, so a stream and a whole reply split alike: text that may be the start of a
marker (`</th` at the end of a chunk) is held back until the next chunk, or the end, settles it.
"""

from __future__ import annotations

import dataclasses

START, END = "<think>", "</think>"


@dataclasses.dataclass(frozen=True)
class Split:
    """reasoning: the thinking so far (None: this output has none); content: the answer so far (text that may
    be part of a marker is in neither until it is settled)."""

    reasoning: str | None
    content: str


@dataclasses.dataclass(frozen=True)
class ReasoningParser:
    name: str
    starts_inside: bool  # the output begins inside the thinking whatever the prompt says

    def opens_in(self, prompt_text: str) -> bool:
        """Whether an output after `prompt_text` begins inside the thinking."""
        return self.starts_inside or _ends_inside_block(prompt_text)

    def constraint_after(self, prompt_text: str) -> str | None:
        """Where a structured-output constraint starts in an output after `prompt_text`: after the thinking
        (`</think>`), unless the prompt already closed the block (Qwen3 with enable_thinking=False renders an
        empty one); None: from the first token. As vLLM does, a model that writes no thinking at all leaves
        such a constraint waiting for a `</think>` that never comes, so a server for models that do not think
        should not be given a reasoning parser."""
        tail = prompt_text.rstrip()
        closed = tail.rfind(END) > tail.rfind(START) >= 0
        return None if closed else END

    def split(self, text: str, inside: bool, final: bool) -> Split:
        """Splits the output text so far. `inside`: it begins inside the thinking (`opens_in`); `final`: no
        more text comes (nothing is held back)."""
        offset = 0
        if text.startswith(START):
            inside, offset = True, len(START)
        elif not final and START.startswith(text):
            return Split(None, "")  # a start marker may be arriving: wait
        if not inside:
            return Split(None, text)
        end = text.find(END, offset)
        if end >= 0:
            return Split(text[offset:end], text[end + len(END):])
        held = 0 if final else _partial_marker(text, END, offset)
        return Split(text[offset:len(text) - held], "")


def _ends_inside_block(prompt_text: str) -> bool:
    tail = prompt_text.rstrip()
    return tail.rfind(START) > tail.rfind(END)


def _partial_marker(text: str, marker: str, start: int) -> int:
    """The length of the longest end of text[start:] that is a proper start of `marker`."""
    for length in range(min(len(marker) - 1, len(text) - start), 0, -1):
        if marker.startswith(text[len(text) - length:]):
            return length
    return 0


REASONING_PARSERS = {"deepseek_r1": ReasoningParser("deepseek_r1", starts_inside=True),
                     "qwen3": ReasoningParser("qwen3", starts_inside=False)}


def prepare_reasoning(name: str | None, prompt_tail: str, params) -> tuple[ReasoningParser | None, bool]:
    """For a request under the server's parser `name` (None: no parser), whose rendered prompt ends with
    `prompt_tail`: the parser and whether the output begins inside the thinking. A structured-output
    constraint in `params` is set to start after the thinking, so it shapes the answer only."""
    parser = REASONING_PARSERS.get(name)
    if parser is None:
        return None, False
    if params.structured_outputs is not None:
        params.structured_outputs_after = parser.constraint_after(prompt_tail)
    return parser, parser.opens_in(prompt_tail)


class ReasoningStream:
    """One streamed choice's deltas: each call takes the text so far and returns the new reasoning and the new
    answer text since the last call."""

    def __init__(self, parser: ReasoningParser, inside: bool):
        self.parser, self.inside = parser, inside
        self.sent_reasoning = 0
        self.sent_content = 0
        self.answer = ""  # the answer so far

    def delta(self, text: str, final: bool) -> tuple[str, str]:
        split = self.parser.split(text, self.inside, final)
        self.answer = split.content
        reasoning = (split.reasoning or "")[self.sent_reasoning:]
        content = split.content[self.sent_content:]
        self.sent_reasoning += len(reasoning)
        self.sent_content += len(content)
        return reasoning, content
