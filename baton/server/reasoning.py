"""Reasoning parsers (vLLM's `--reasoning-parser`): a thinking model's output split into its
thoughts (`reasoning_content`) and its answer (`content`) at `</think>`.

qwen3 and glm45: thoughts only where the output (or the prompt, as templates that open the
thinking for the model do) begins with `<think>`; an output without it is all answer. deepseek_r1:
the output is thoughts until `</think>` even without `<think>` (R1's template opens it). The same
function splits a finished output and a stream's text so far: a stream holds back what may still
become a tag, so what it sends only grows and adds up to the finished split.
"""

from __future__ import annotations

from dataclasses import dataclass

START, END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    thinks_without_start: bool = False

    def opens_in_prompt(self, prompt: str | None) -> bool:
        """Whether the rendered prompt already opened the thinking (ends in `<think>`)."""
        return bool(prompt) and prompt.rstrip().endswith(START)

    def split(self, text: str, opened: bool, finished: bool) -> tuple[str, str]:
        """(reasoning, content) of `text`; unfinished, only what no later token can change."""
        thinking = opened or self.thinks_without_start
        if text.startswith(START):
            text, thinking = text[len(START) :], True
        elif not finished and text and START.startswith(text):
            return "", ""  # may yet be `<think>`
        if not thinking:
            return "", text
        end = text.find(END)
        if end >= 0:
            return text[:end], text[end + len(END) :]
        if not finished:
            text = text[: len(text) - _partial_suffix(text, END)]
        return text, ""


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


PARSERS = {
    "qwen3": ReasoningParser("qwen3"),
    "glm45": ReasoningParser("glm45"),
    "deepseek_r1": ReasoningParser("deepseek_r1", thinks_without_start=True),
}
