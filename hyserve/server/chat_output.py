"""One chat choice's output text -> reasoning, content and tool calls, incrementally.

The reasoning split runs first (`reasoning.py`), then tool-call parsing of the content part
(`tool_parser.py`); streaming and whole replies feed the same object, so they cannot disagree. Used by
the chat completions and the Responses routes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hyserve.server.protocol import ChatTool
from hyserve.server.reasoning import ReasoningParser
from hyserve.server.structured import ForcedToolOutput
from hyserve.server.tool_parser import TOOL_PARSERS, ParsedToolCall, ToolCallParser


class ChatOutput:
    """Reasoning split, then tool-call parsing of the content part, for one chat choice."""

    def __init__(
        self, reasoning: ReasoningParser | None, tools: ToolCallParser | None, parallel: bool
    ) -> None:
        self.reasoning = reasoning
        self.tools = tools
        self.parallel = parallel
        self.calls: list[ParsedToolCall] = []

    def _keep(self, calls: list[ParsedToolCall]) -> list[ParsedToolCall]:
        if not self.parallel:
            calls = calls[: max(0, 1 - len(self.calls))]
        self.calls.extend(calls)
        return calls

    def feed(self, text: str) -> tuple[str, str, list[ParsedToolCall]]:
        r, c = self.reasoning.feed(text) if self.reasoning else ("", text)
        calls: list[ParsedToolCall] = []
        if self.tools and c:
            c, calls = self.tools.feed(c)
        return r, c, self._keep(calls)

    def finish(self) -> tuple[str, str, list[ParsedToolCall]]:
        r, c = self.reasoning.finish() if self.reasoning else ("", "")
        calls: list[ParsedToolCall] = []
        if self.tools:
            c2, calls = self.tools.feed(c) if c else ("", [])
            c3, calls3 = self.tools.finish()
            c, calls = c2 + c3, calls + calls3
        return r, c, self._keep(calls)

    def parse(self, text: str) -> tuple[str, str, list[ParsedToolCall]]:
        """A whole output: (reasoning, content, calls); content stripped when there are calls."""
        r1, c1, calls1 = self.feed(text)
        r2, c2, calls2 = self.finish()
        reasoning, content, calls = r1 + r2, c1 + c2, calls1 + calls2
        if calls:
            content = content.strip()
        return reasoning, content, calls


def output_maker(
    *,
    reasoning_parser: str | None,
    tool_parser: str | None,
    think: bool,
    tools: list[ChatTool] | None,
    tool_choice: Any,
    parallel: bool,
    forced: tuple[Any, str | None] | None,
) -> Callable[[], ChatOutput | ForcedToolOutput]:
    """A fresh output object per choice: `ForcedToolOutput` when tool_choice forces calls (`forced`, from
    `structured.tool_choice_spec`), else `ChatOutput`, parsing tool calls when the request has tools, does
    not say tool_choice "none" and the server has a tool parser."""
    parse_tools = bool(tools) and tool_choice != "none" and tool_parser is not None and forced is None
    fmt = TOOL_PARSERS[tool_parser] if parse_tools and tool_parser is not None else None
    tools_dump = [t.model_dump() for t in tools] if tools else None

    def make() -> ChatOutput | ForcedToolOutput:
        reasoning = ReasoningParser(enabled=think) if reasoning_parser else None
        if forced is not None:
            return ForcedToolOutput(reasoning, forced[1])
        return ChatOutput(reasoning, ToolCallParser(tools_dump, fmt) if fmt else None, parallel)

    return make
