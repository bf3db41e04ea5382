"""Tool-call parser for the qwen3_coder XML format (used by Nemotron 3 chat templates) -> OpenAI `tool_calls`.

The model writes calls as:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

Parameter values are raw text, so types come from the request's tool schema (`"days": {"type":
"integer"}` -> 3, not "3"); a parameter without a schema is read as JSON if it parses, else as a string.
Models sometimes drop the `<tool_call>` wrapper or the closing `</parameter>`; both are tolerated.

Streaming: plain text before a call is emitted as content as it arrives (text that may be the start
of a tag is held back); each call is emitted whole, as one `tool_calls` delta, once its closing tag
arrives. That is valid OpenAI streaming (clients concatenate `arguments` pieces; one piece is fine)
and it never emits arguments that later turn out to be wrong.

The Hermes format (`hermes`, `granite4`: Granite 4.0's chat templates) wraps one JSON object per call,

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}
    </tool_call>

read by the same streaming machinery (`ToolCallFormat`). Arguments given as a JSON string holding an
object (Granite 4.0 writes them so at times) are read as that object. A block that parses to no call is
passed through as content, tags included, so nothing the model wrote is lost.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
FUNCTION_START = "<function="
FUNCTION_END = "</function>"


_FUNCTION_RE = re.compile(r"<function=([^>\n]*)>(.*?)(?:</function>|\Z)", re.DOTALL)
_PARAM_RE = re.compile(r"<parameter=([^>\n]*)>(.*?)(?=</parameter>|<parameter=|</function>|\Z)", re.DOTALL)


@dataclass
class ParsedToolCall:
    name: str
    arguments: str  # a JSON object, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


def parse_json(text: str) -> Any:
    """`json.loads` of text from a model or a client, with every failure a ValueError: nesting deeper than
    the interpreter's stack (RecursionError) and integers past the digit limit included."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def _schema_types(tools: list[dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """function name -> {parameter name -> its JSON-schema}."""
    out: dict[str, dict[str, Any]] = {}
    for t in tools or []:
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            continue
        params = fn.get("parameters") or {}
        props = params.get("properties") if isinstance(params, dict) else None
        out[fn["name"]] = props if isinstance(props, dict) else {}
    return out


def _types_of(schema: Any) -> list[str]:
    if not isinstance(schema, dict):
        return []
    t = schema.get("type")
    if isinstance(t, str):
        return [t.lower()]
    if isinstance(t, list):
        return [str(x).lower() for x in t]
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            return [x for sub in schema[key] for x in _types_of(sub)]
    if "enum" in schema:
        return ["string"]
    return []


def convert_value(raw: str, schema: Any) -> Any:
    """Read one parameter's raw text as the type its schema declares (falling back to the text)."""
    types = _types_of(schema)
    text = raw
    if text.lower() == "null" and (not types or "null" in types):
        return None
    if not types:
        try:
            return parse_json(text)
        except ValueError:
            return text
    for t in types:
        if t in ("string", "str", "text", "varchar", "char", "enum"):
            return text
    for t in types:
        s = text.strip()
        if t in ("integer", "int") or t.startswith("int") or t.startswith("uint"):
            try:
                return int(s)
            except ValueError:
                pass
        elif t in ("number", "float", "double") or t.startswith("float"):
            try:
                f = float(s)
                return int(f) if f.is_integer() and "." not in s and "e" not in s.lower() else f
            except ValueError:
                pass
        elif t in ("boolean", "bool"):
            if s.lower() in ("true", "false"):
                return s.lower() == "true"
        elif t in ("object", "array", "dict", "list"):
            try:
                return parse_json(s)
            except ValueError:
                pass
    return text


def _strip_one_newline(v: str) -> str:
    # The format puts the value on its own line(s); only that framing newline is not part of the value.
    if v.startswith("\n"):
        v = v[1:]
    if v.endswith("\n"):
        v = v[:-1]
    return v


def _parse_one(name: str, body: str, schemas: dict[str, dict[str, Any]]) -> ParsedToolCall | None:
    name = name.strip()
    if not name:
        return None
    props = schemas.get(name, {})
    args: dict[str, Any] = {}
    for pm in _PARAM_RE.finditer(body):
        pname = pm.group(1).strip()
        if not pname:
            continue
        args[pname] = convert_value(_strip_one_newline(pm.group(2)), props.get(pname))
    return ParsedToolCall(name=name, arguments=json.dumps(args, ensure_ascii=False))


def parse_function_blocks(block: str, schemas: dict[str, dict[str, Any]]) -> list[ParsedToolCall]:
    """`<function=name> <parameter=...>...` (possibly several, possibly without closing tags) -> calls."""
    calls = []
    for m in _FUNCTION_RE.finditer(block):
        call = _parse_one(m.group(1), m.group(2), schemas)
        if call is not None:
            calls.append(call)
    return calls


def _json_arguments(raw: Any) -> str | None:
    """A Hermes call's `arguments` as a JSON object's text: an object, or a string holding one (None
    otherwise)."""
    try:
        if isinstance(raw, str):
            raw = parse_json(raw)
    except ValueError:
        return None
    return json.dumps(raw, ensure_ascii=False) if isinstance(raw, dict) else None


def parse_json_blocks(block: str, schemas: dict[str, dict[str, Any]]) -> list[ParsedToolCall]:
    """A Hermes `<tool_call>` body: a JSON object {"name", "arguments" (or "parameters")}, or a list of them
    -> calls; a body that is not one yields none."""
    try:
        data = parse_json(block)
    except ValueError:
        return []
    calls = []
    for item in data if isinstance(data, list) else [data]:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not item["name"].strip():
            return []
        args = _json_arguments(item.get("arguments", item.get("parameters", {})))
        if args is None:
            return []
        calls.append(ParsedToolCall(name=item["name"].strip(), arguments=args))
    return calls


@dataclass(frozen=True)
class Opening:
    """A tag that opens a call, the tag that closes it, and whether both belong to the parsed block (a
    bare `<function=...>...</function>` is its own block; `<tool_call>` only wraps one)."""

    tag: str
    end: str
    in_block: bool = False


@dataclass(frozen=True)
class ToolCallFormat:
    openings: tuple[Opening, ...]
    parse: Callable[[str, dict[str, dict[str, Any]]], list[ParsedToolCall]]


QWEN3_CODER = ToolCallFormat(
    openings=(Opening(TOOL_CALL_START, TOOL_CALL_END), Opening(FUNCTION_START, FUNCTION_END, in_block=True)),
    parse=parse_function_blocks,
)
HERMES = ToolCallFormat(openings=(Opening(TOOL_CALL_START, TOOL_CALL_END),), parse=parse_json_blocks)
# --tool_parser names (vLLM's spellings) -> formats
TOOL_PARSERS: dict[str, ToolCallFormat] = {
    "qwen3_coder": QWEN3_CODER,
    "qwen3-coder": QWEN3_CODER,
    "qwen3coder": QWEN3_CODER,
    "nemotron_v3": QWEN3_CODER,
    "nemotron-v3": QWEN3_CODER,
    "hermes": HERMES,
    "granite4": HERMES,
}
TOOL_PARSER_NAMES = tuple(TOOL_PARSERS)


def check_tool_parser_name(name: str | None) -> str | None:
    """Validate a `--tool_parser` value at start-up (ValueError names the allowed values)."""
    if name is None or name == "" or name.lower() == "none":
        return None
    if name.lower() not in TOOL_PARSERS:
        raise ValueError(f"tool_parser: {name!r} is not one of {list(TOOL_PARSER_NAMES)}")
    return name.lower()


def _held_suffix(text: str, tags: tuple[str, ...]) -> int:
    best = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:n]):
                best = n
                break
    return best


class ToolCallParser:
    """Incremental parser of one response in a `ToolCallFormat` (default qwen3_coder). Feed content deltas,
    then call `finish()`."""

    def __init__(self, tools: list[dict[str, Any]] | None = None, fmt: ToolCallFormat = QWEN3_CODER) -> None:
        self._schemas = _schema_types(tools)
        self._fmt = fmt
        self._tags = tuple(o.tag for o in fmt.openings)
        self._buf = ""
        self._open: Opening | None = None  # the opening of the call being read
        self.calls: list[ParsedToolCall] = []

    def feed(self, delta: str) -> tuple[str, list[ParsedToolCall]]:
        """Returns (content_delta, tool calls completed by this delta)."""
        self._buf += delta
        content = ""
        new: list[ParsedToolCall] = []
        while self._buf:
            if self._open is None:
                found = [(i, o) for o in self._fmt.openings if (i := self._buf.find(o.tag)) >= 0]
                if not found:
                    hold = _held_suffix(self._buf, self._tags)
                    out = self._buf[: len(self._buf) - hold]
                    self._buf = self._buf[len(self._buf) - hold :]
                    content += self._content_piece(out)
                    break
                i, opening = min(found, key=lambda f: f[0])
                content += self._content_piece(self._buf[:i])
                self._buf = self._buf[i + (0 if opening.in_block else len(opening.tag)) :]
                self._open = opening
                continue
            opening = self._open
            j = self._buf.find(opening.end)
            if j < 0:
                break
            block = self._buf[: j + (len(opening.end) if opening.in_block else 0)]
            self._buf = self._buf[j + len(opening.end) :]
            self._open = None
            calls = self._fmt.parse(block, self._schemas)
            if not calls:  # not a call after all: the model's text, as written
                content += self._unparsed(opening, block, closed=True)
            new.extend(calls)
            self.calls.extend(calls)
        return content, new

    @staticmethod
    def _unparsed(opening: Opening, block: str, *, closed: bool) -> str:
        if opening.in_block:
            return block
        return opening.tag + block + (opening.end if closed else "")

    def _content_piece(self, text: str) -> str:
        # Whitespace between/after calls is framing, not an answer.
        if self.calls and not text.strip():
            return ""
        return text

    def finish(self) -> tuple[str, list[ParsedToolCall]]:
        """End of output: an unterminated call is parsed leniently; leftover text is content."""
        buf, self._buf = self._buf, ""
        if not buf:
            return "", []
        if self._open is not None:
            opening, self._open = self._open, None
            calls = self._fmt.parse(buf, self._schemas)
            if calls:
                self.calls.extend(calls)
                return "", calls
            return self._unparsed(opening, buf, closed=False), []
        return self._content_piece(buf), []

    def parse(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        """Whole-output parse: (content before/around the calls or None, tool calls)."""
        c1, calls1 = self.feed(text)
        c2, calls2 = self.finish()
        content = c1 + c2
        calls = calls1 + calls2
        if calls:
            content = content.strip()
        return (content or None), calls
