"""Reasoning parser for Nemotron `<think> ... </think>` output -> `reasoning_content` + `content`.

Nemotron (Nano v2, Nemotron 3) chat templates put `<think>\\n` at the end of the generation prompt when
thinking is on, so the model's output usually does *not* start with `<think>`; it reasons, writes
`</think>`, then answers. Some checkpoints/templates let the model emit the opening tag itself. So:

    thinking on:   [<think>] reasoning ... </think>[\\n\\n] content
                   no `</think>` at all (e.g. cut by max_tokens) -> everything is reasoning
    thinking off:  (`chat_template_kwargs={"enable_thinking": false}` or a `/no_think` system prompt;
                   the template pre-fills an empty think block) -> everything is content

This is the behaviour of the `nemotron-v3` / `deepseek-r1` parsers users know from trtllm-serve and
vLLM. Streaming and non-streaming share one state machine (`parse` = feed everything + finish), so
they can never disagree. Tags split across deltas are held back until they can be decided.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

THINK_START = "<think>"
THINK_END = "</think>"

# Names accepted for `--reasoning_parser` (the spellings trtllm-serve / vLLM / SGLang users type: vLLM's
# Nemotron 3 recipes say nano_v3 or super_v3, trtllm-serve's nemotron-v3); all are one parser.
REASONING_PARSER_NAMES = (
    "nemotron-v3",
    "nemotron_v3",
    "nano_v3",
    "super_v3",
    "nemotron",
    "deepseek-r1",
    "deepseek_r1",
    "qwen3",
)


def check_reasoning_parser_name(name: str | None) -> str | None:
    """Validate a `--reasoning_parser` value at start-up (ValueError names the allowed values)."""
    if name is None or name == "" or name.lower() == "none":
        return None
    if name.lower() not in REASONING_PARSER_NAMES:
        raise ValueError(f"reasoning_parser: {name!r} is not one of {list(REASONING_PARSER_NAMES)}")
    return name.lower()


def thinking_enabled(chat_template_kwargs: dict[str, Any] | None, system_texts: Iterable[str] = ()) -> bool:
    """Whether the prompt asked the model to think (the template default is on)."""
    kw = chat_template_kwargs or {}
    for key in ("enable_thinking", "thinking"):
        if key in kw and kw[key] is not None:
            return bool(kw[key])
    return not any("/no_think" in t for t in system_texts)


def _held_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag` (may still become it)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ReasoningParser:
    """Incremental `<think>` splitter for one response. Feed text deltas, then call `finish()`."""

    def __init__(self, *, enabled: bool = True) -> None:
        self._state = "start" if enabled else "content"
        self._pending = ""  # text held back because it may be the start of a tag
        self._content_started = False  # strip the blank lines right after `</think>`
        self._saw_end = False

    @property
    def saw_end(self) -> bool:
        return self._saw_end

    def feed(self, delta: str) -> tuple[str, str]:
        """Returns (reasoning_delta, content_delta) for this piece of output text."""
        text = self._pending + delta
        self._pending = ""
        reasoning, content = "", ""
        while text:
            if self._state == "start":
                stripped = text.lstrip()
                if stripped.startswith(THINK_START):
                    text = stripped[len(THINK_START) :]
                    self._state = "reasoning"
                    continue
                if THINK_START.startswith(stripped):  # "", "<", "<th", ... undecided
                    self._pending = text
                    return reasoning, content
                self._state = "reasoning"
                continue
            if self._state == "reasoning":
                idx = text.find(THINK_END)
                if idx >= 0:
                    reasoning += text[:idx]
                    text = text[idx + len(THINK_END) :]
                    self._state = "content"
                    self._saw_end = True
                    continue
                hold = _held_suffix(text, THINK_END)
                reasoning += text[: len(text) - hold]
                self._pending = text[len(text) - hold :]
                return reasoning, content
            # content
            if not self._content_started and self._saw_end:
                text = text.lstrip("\n")
                if not text:
                    return reasoning, content
            self._content_started = True
            content += text
            text = ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """Flush held-back text at the end of the output."""
        text, self._pending = self._pending, ""
        if not text:
            return "", ""
        if self._state == "content":
            return "", text
        return text, ""

    def parse(self, text: str) -> tuple[str | None, str | None]:
        """Whole-output parse: (reasoning_content, content), None where empty."""
        r1, c1 = self.feed(text)
        r2, c2 = self.finish()
        reasoning, content = r1 + r2, c1 + c2
        return (reasoning or None), (content or None)
