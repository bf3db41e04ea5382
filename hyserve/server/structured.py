"""Request fields -> one structured-outputs constraint (`StructuredOutputsParams`), and the tool calls of
a constrained output.

    response_format {"type": "json_object"}                    any JSON object
    response_format {"type": "json_schema", "json_schema": {"schema": ...}}   that schema (strict)
    text.format (Responses API), the same two
    structured_outputs {"json" | "json_object" | "regex" | "choice" | "grammar": ...}  (vLLM's extra body)
    tool_choice "required"        a JSON array of {"name", "parameters"} calls of the request's tools
    tool_choice {"function": {"name": F}}   a JSON object of F's arguments

With a reasoning parser on and thinking enabled the constraint starts after `</think>`, so the thinking
section stays free. Compiling happens in the engine's validation, which the routes run on a worker thread
(`AppState.validate_async`); a spec that cannot compile is a 400 naming the field and the problem.
"""

from __future__ import annotations

import json
from typing import Any

from hyserve.engine.sampling_params import StructuredOutputsParams
from hyserve.server.errors import bad_request
from hyserve.server.protocol import ChatTool, ResponseFormat, StructuredOutputsRequest
from hyserve.server.reasoning import THINK_END
from hyserve.server.tool_parser import ParsedToolCall, parse_json


def _params(param: str, **kw: Any) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**kw)
    except ValueError as e:
        raise bad_request(str(e).replace("structured_outputs", param, 1), param=param) from None


def from_extra(so: StructuredOutputsRequest, start_after: str | None) -> StructuredOutputsParams:
    return _params(
        "structured_outputs",
        json=so.json_,
        json_object=bool(so.json_object),
        regex=so.regex,
        choice=tuple(so.choice) if so.choice is not None else None,
        grammar=so.grammar,
        start_after=start_after,
    )


def from_format(
    kind: str, schema: dict[str, Any] | None, param: str, start_after: str | None
) -> StructuredOutputsParams | None:
    """`response_format` / Responses `text.format`: None for "text"."""
    if kind == "text":
        return None
    if kind == "json_object":
        return _params(param, json_object=True, start_after=start_after)
    if kind == "json_schema":
        if schema is None:
            raise bad_request(f"{param} json_schema needs a `schema`", param=f"{param}.schema")
        return _params(param, json=schema, start_after=start_after)
    raise bad_request(
        f"{param} type {kind!r} is not supported; use text, json_object or json_schema", param=f"{param}.type"
    )


def from_response_format(
    rf: ResponseFormat | None, start_after: str | None
) -> StructuredOutputsParams | None:
    if rf is None:
        return None
    schema = rf.json_schema.schema_ if rf.json_schema is not None else None
    return from_format(rf.type, schema, "response_format", start_after)


def _parameters(t: ChatTool) -> dict[str, Any]:
    p = t.function.parameters
    return p if isinstance(p, dict) and p else {"type": "object", "properties": {}}


def tool_choice_spec(
    tools: list[ChatTool] | None, tool_choice: Any, parallel: bool, start_after: str | None
) -> tuple[StructuredOutputsParams, str | None] | None:
    """The constraint of tool_choice "required" or a named function, and that function's name (None for
    "required"); None for "auto" / "none"."""
    if tool_choice is None or tool_choice in ("auto", "none"):
        return None
    if not tools:
        raise bad_request("tool_choice 'required' or a named function needs `tools`", param="tool_choice")
    if tool_choice == "required":
        calls = {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {"name": {"const": t.function.name}, "parameters": _parameters(t)},
                    "required": ["name", "parameters"],
                    "additionalProperties": False,
                }
                for t in tools
            ]
        }
        schema: dict[str, Any] = {"type": "array", "items": calls, "minItems": 1}
        if not parallel:
            schema["maxItems"] = 1
        return _params("tool_choice", json=schema, start_after=start_after), None
    name = tool_choice.function.name if hasattr(tool_choice, "function") else tool_choice.name
    match = [t for t in tools if t.function.name == name]
    if not match:
        raise bad_request(
            f"tool_choice names the function {name!r}, which is not in `tools` "
            f"({[t.function.name for t in tools]})",
            param="tool_choice",
        )
    return _params("tool_choice", json=_parameters(match[0]), start_after=start_after), name


def one_constraint(*specs: tuple[str, StructuredOutputsParams | None]) -> StructuredOutputsParams | None:
    """At most one source of a constraint per request."""
    given = [(name, s) for name, s in specs if s is not None]
    if len(given) > 1:
        raise bad_request(
            f"{' and '.join(n for n, _ in given)} both constrain the output; send one", param=given[1][0]
        )
    return given[0][1] if given else None


def start_marker(reasoning_parser: str | None, think: bool) -> str | None:
    return THINK_END if reasoning_parser and think else None


class ForcedToolOutput:
    """A choice whose content is constrained to tool calls (tool_choice "required" or named): the reasoning
    split as usual, the content collected and read as JSON calls at the end (the `ChatOutput` interface)."""

    def __init__(self, reasoning: Any, name: str | None) -> None:
        self.reasoning = reasoning
        self.name = name
        self._content = ""
        self.calls: list[ParsedToolCall] = []

    def feed(self, text: str) -> tuple[str, str, list[ParsedToolCall]]:
        r, c = self.reasoning.feed(text) if self.reasoning else ("", text)
        self._content += c
        return r, "", []

    def finish(self) -> tuple[str, str, list[ParsedToolCall]]:
        r, c = self.reasoning.finish() if self.reasoning else ("", "")
        self._content += c
        text, self._content = self._content.strip(), ""
        try:
            value = parse_json(text)
        except ValueError:  # cut by max_tokens: the text as it is, no calls
            return r, text, []
        if self.name is not None:
            calls = [ParsedToolCall(name=self.name, arguments=json.dumps(value, ensure_ascii=False))]
        else:
            calls = [
                ParsedToolCall(name=c["name"], arguments=json.dumps(c["parameters"], ensure_ascii=False))
                for c in value
                if isinstance(c, dict) and "name" in c and "parameters" in c
            ]
        self.calls.extend(calls)
        return r, "", calls

    def parse(self, text: str) -> tuple[str, str, list[ParsedToolCall]]:
        r1, _, _ = self.feed(text)
        r2, c, calls = self.finish()
        return r1 + r2, c, calls
