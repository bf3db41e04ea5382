"""Chat messages -> prompt text, through the checkpoint's own chat template.

The template (from `tokenizer_config.json` / `chat_template.jinja`) decides everything model-specific:
BOS, role markers, how tools are described, and whether the generation prompt pre-fills `<think>`
(Nemotron's `enable_thinking`). The server only normalises OpenAI message shapes into what HF-style
templates expect and turns template failures into 400s:

- content given as a list of parts -> the concatenated text (only text parts: these are text models);
- assistant `tool_calls[].function.arguments` given as a JSON string (as OpenAI clients send it) ->
  a dict, because templates iterate it (`arguments|items` in the qwen3_coder style templates);
- `chat_template_kwargs` are passed to the template as variables (e.g. `enable_thinking`);
- `documents` (vLLM's retrieval field: a list of string-valued objects) reach the template as `documents`
  (Granite 4.0's templates list them in the system turn).
"""

from __future__ import annotations

from typing import Any

from hyserve.server.errors import APIError, bad_request, internal_error
from hyserve.server.protocol import ChatMessage, ChatTool
from hyserve.server.tool_parser import parse_json

# Names the template call sets itself; a client must not override them through chat_template_kwargs.
_RESERVED_TEMPLATE_VARS = frozenset(
    {
        "messages",
        "tools",
        "documents",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "conversation",
    }
)


def _content_text(msg: ChatMessage, i: int) -> str | None:
    c = msg.content
    if c is None or isinstance(c, str):
        return c
    pieces: list[str] = []
    for j, part in enumerate(c):
        if part.type != "text" or part.text is None:
            raise bad_request(
                f"messages[{i}].content[{j}]: content part type {part.type!r} is not supported; "
                "this server serves text models and accepts only {'type': 'text', 'text': ...} parts",
                param=f"messages[{i}].content[{j}].type",
            )
        pieces.append(part.text)
    return "".join(pieces)


def _arguments_for_template(arguments: str | dict[str, Any]) -> Any:
    if isinstance(arguments, dict):
        return arguments
    try:
        parsed = parse_json(arguments) if arguments.strip() else {}
    except ValueError:
        return arguments
    return parsed if isinstance(parsed, dict) else arguments


def messages_to_template_input(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """OpenAI message models -> the plain dicts HF chat templates read."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        # `developer` is OpenAI's newer name for the system role; checkpoint templates know only `system`
        role = "system" if m.role == "developer" else m.role
        d: dict[str, Any] = {"role": role, "content": _content_text(m, i)}
        if m.name is not None:
            d["name"] = m.name
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.reasoning_content is not None:
            d["reasoning_content"] = m.reasoning_content
        if m.tool_calls:
            d["tool_calls"] = [
                {
                    "id": tc.id,
                    "type": "function",
                    "function": {
                        "name": tc.function.name,
                        "arguments": _arguments_for_template(tc.function.arguments),
                    },
                }
                for tc in m.tool_calls
            ]
        out.append(d)
    return out


def tools_to_template_input(tools: list[ChatTool] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    out = []
    for t in tools:  # the parameters as they came (a dump would copy them in one long C call)
        d = t.model_dump(exclude_none=True, exclude={"function": {"parameters"}})
        if t.function.parameters is not None:
            d["function"]["parameters"] = t.function.parameters
        out.append(d)
    return out


# Template text per chat message, counted with the contents (so a request of many tiny messages renders
# off the loop too).
_CHARS_PER_MESSAGE = 16


def chat_chars(messages: list[ChatMessage]) -> int:
    """The characters chat messages render to, roughly (contents plus a per-message allowance)."""
    n = _CHARS_PER_MESSAGE * len(messages)
    for m in messages:
        if isinstance(m.content, str):
            n += len(m.content)
        elif m.content:
            n += sum(len(p.text or "") for p in m.content)
    return n


def system_texts(messages: list[ChatMessage]) -> list[str]:
    """Text of system/developer messages (Nemotron Nano v2 reads `/think` and `/no_think` there)."""
    out = []
    for m in messages:
        if m.role in ("system", "developer") and isinstance(m.content, str):
            out.append(m.content)
    return out


def render_chat_prompt(
    tokenizer: Any,
    messages: list[ChatMessage],
    *,
    tools: list[ChatTool] | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template_kwargs: dict[str, Any] | None = None,
    documents: list[dict[str, str]] | None = None,
) -> str:
    """Render the conversation with the model's chat template (raises APIError 400 on failure)."""
    if tokenizer is None:
        raise bad_request(
            "this model has no tokenizer (a config-only checkpoint with random weights): chat requests need "
            "one; send token ids to /v1/completions instead",
            param="messages",
        )
    if continue_final_message and add_generation_prompt:
        raise bad_request(
            "continue_final_message and add_generation_prompt cannot both be true",
            param="continue_final_message",
        )
    if continue_final_message and messages[-1].role != "assistant":
        raise bad_request(
            "continue_final_message needs the last message to be an assistant message",
            param="continue_final_message",
        )
    kwargs = {k: v for k, v in (chat_template_kwargs or {}).items() if k not in _RESERVED_TEMPLATE_VARS}
    conv = messages_to_template_input(messages)
    if documents is not None:
        kwargs["documents"] = documents
    try:
        text = tokenizer.apply_chat_template(
            conv,
            tools=tools_to_template_input(tools),
            add_generation_prompt=add_generation_prompt,
            **kwargs,
        )
    except APIError:
        raise
    except Exception as e:  # jinja's TemplateError, raise_exception(...) in templates, missing template
        raise bad_request(
            f"cannot apply the chat template: {type(e).__name__}: {e}", param="messages"
        ) from None
    if not isinstance(text, str):
        raise internal_error(
            "the chat template did not render to text", f"it returned a {type(text).__name__}"
        )
    if continue_final_message:
        # Templates close the last turn; continuing it means cutting everything after its content.
        last = conv[-1].get("content") or ""
        k = text.rfind(last) if last else -1
        if k >= 0:
            text = text[: k + len(last)]
    return text


def encode_text(tokenizer: Any, text: str, *, add_special_tokens: bool, param: str = "prompt") -> list[int]:
    """Text -> token ids (chat prompts pass add_special_tokens=False: the template already has BOS)."""
    if tokenizer is None:
        raise bad_request(
            "this model has no tokenizer (a config-only checkpoint with random weights): send the prompt as "
            "a list of token ids",
            param=param,
        )
    check_unicode(text, param)
    try:
        return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
    except TypeError:
        return list(tokenizer.encode(text))


def check_unicode(text: str, param: str) -> None:
    """JSON's \\uXXXX escapes can carry a lone UTF-16 surrogate, which is not Unicode text: no tokenizer can
    encode it. A 400 that says where, instead of the tokenizer's TypeError."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise bad_request(
            f"{param} is not valid Unicode: a lone UTF-16 surrogate (U+{ord(text[e.start]):04X}) at "
            f"character {e.start}; escape characters outside the basic plane as a surrogate pair, or send "
            "UTF-8",
            param=param,
        ) from None
