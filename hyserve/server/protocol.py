"""Request and response models of the OpenAI-compatible API (the subset hyserve serves, plus the
extensions vLLM / trtllm-serve users already send: `top_k`, `min_p`, `ignore_eos`,
`chat_template_kwargs`, `stop_token_ids`, ...).

Why pydantic models rather than raw dicts: FastAPI turns them into the OpenAPI schema (which the
schemathesis fuzz test drives) and validation errors carry the field path, which the error handler
turns into the `param` of a 400. Range checks that depend on the engine (max_seq_len, vocab size) are
not here; they happen in the route and in `SamplingParams`, whose messages name the limit.

Unknown request fields are accepted and ignored (`extra="allow"`), as vLLM does, so clients that send
OpenAI fields hyserve doesn't implement (`user`, `store`, `metadata`, ...) keep working.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainValidator,
    StrictInt,
    TypeAdapter,
    ValidatorFunctionWrapHandler,
    WrapValidator,
)
from pydantic_core import PydanticCustomError

from hyserve.engine.sampling_params import MAX_LOGPROBS
from hyserve.server.body import TokenIds

# torch generators take 64-bit seeds; bounding them here turns an absurd seed into a 400, not a 500.
_SEED_MIN = -(2**63)
_SEED_MAX = 2**63 - 1
# Token ids are int32 everywhere in the engine; the vocabulary bound is checked by the engine.
_TOKEN_ID_MAX = 2**31 - 1
TokenId = Annotated[StrictInt, Field(ge=0, le=_TOKEN_ID_MAX)]  # strict: JSON true/false are not ids


def _json_object(v: Any) -> dict[str, Any]:
    """A JSON object taken as it is: pydantic's `dict[str, Any]` copies it in one C call (0.4 s for 800k
    keys, the event loop held all along); this checks its keys in Python, which lets other threads run."""
    if not isinstance(v, dict) or not all(isinstance(k, str) for k in v):
        raise PydanticCustomError("dict_type", "Input should be a valid dictionary")
    return v


# a JSON object of any content (JSON schemas, tool parameters, template variables)
JsonObject = Annotated[dict[str, Any], PlainValidator(_json_object, json_schema_input_type=dict[str, Any])]


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


# ---- shared pieces -------------------------------------------------------------------------------


class StreamOptions(_Request):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class StructuredOutputsRequest(_Request):
    """vLLM's `structured_outputs` extra parameter: exactly one of these constrains the output."""

    json_: JsonObject | str | None = Field(default=None, alias="json")  # `json` shadows BaseModel.json
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class _SamplingFields(_Request):
    """Fields common to chat and text completions (what becomes `SamplingParams`)."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = None
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    seed: int | None = Field(default=None, ge=_SEED_MIN, le=_SEED_MAX)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    # vLLM's extra field: lower is served earlier under --scheduling-policy priority (the engine refuses
    # anything but 0 under fcfs); strict, so JSON true/false or "1" are not priorities
    priority: StrictInt = 0


# ---- chat ----------------------------------------------------------------------------------------


class ContentPart(_Request):
    """One part of a message's content; only `{"type": "text", "text": ...}` is served (text models)."""

    type: str
    text: str | None = None


class FunctionCall(_Request):
    name: str
    arguments: str | JsonObject = "{}"


class ToolCall(_Request):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class FunctionDefinition(_Request):
    name: str
    description: str | None = None
    parameters: JsonObject | None = None
    strict: bool | None = None


class ChatTool(_Request):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedToolChoiceFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"] = "function"
    function: NamedToolChoiceFunction


class JsonSchemaFormat(_Request):
    name: str | None = None
    description: str | None = None
    schema_: JsonObject | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: str = "text"
    json_schema: JsonSchemaFormat | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = True
    response_format: ResponseFormat | None = None
    chat_template_kwargs: JsonObject | None = None
    documents: list[dict[str, str]] | None = None  # retrieval documents, for templates that take them
    add_generation_prompt: bool = True
    continue_final_message: bool = False


class ChatLogprobTop(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobToken(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[ChatLogprobTop] = Field(default_factory=list)


class ChatChoiceLogprobs(_Response):
    content: list[ChatLogprobToken] | None = None


class ResponseFunctionCall(_Response):
    name: str | None = None
    arguments: str | None = None


class ResponseToolCall(_Response):
    id: str
    type: Literal["function"] = "function"
    function: ResponseFunctionCall


class DeltaToolCall(_Response):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: ResponseFunctionCall | None = None


class ChatResponseMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ResponseToolCall] | None = None  # left out of the reply when there are none


class ChatCompletionChoice(_Response):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class PromptTokensDetails(_Response):
    cached_tokens: int = 0


class UsageInfo(_Response):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class ChatCompletionResponse(_Response):
    id: str = Field(default_factory=lambda: random_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo


class ChatDelta(_Response):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(_Response):
    index: int
    delta: ChatDelta
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


# ---- text completions ----------------------------------------------------------------------------

_IDS = TypeAdapter(list[TokenId])
_IDS_BATCH = TypeAdapter(list[list[TokenId]])


def _prompt_fast(v: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    """Token-id prompts without the union's cost: ids the body parser checked pass as they are, and a list
    that starts with an int (or a list) is validated as ids only; the union would try `list[str]` first
    and build one error per element (25M ids: ~20 s on the event loop)."""
    if isinstance(v, TokenIds) and v.checked:
        return v
    if isinstance(v, list) and v:
        if all(isinstance(x, TokenIds) and x.checked for x in v):
            return v
        if type(v[0]) is int:
            return _IDS.validate_python(v)
        if isinstance(v[0], list) and (not v[0] or type(v[0][0]) is int):
            return _IDS_BATCH.validate_python(v)
    return handler(v)


class CompletionRequest(_SamplingFields):
    # A string, a batch of strings, one token-id prompt, or a batch of token-id prompts.
    prompt: Annotated[str | list[str] | list[TokenId] | list[list[TokenId]], WrapValidator(_prompt_fast)]
    # 0 is allowed with echo: the prompt (and its logprobs) back, nothing generated (legacy OpenAI)
    max_tokens: int | None = Field(default=None, ge=0)
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = None
    best_of: int | None = None
    add_special_tokens: bool = True


class CompletionLogprobs(_Response):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(_Response):
    id: str = Field(default_factory=lambda: random_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class CompletionChunk(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


# ---- models, tokenizer, misc ---------------------------------------------------------------------


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "hyserve"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(_Request):
    """vLLM's /tokenize: either `prompt` (text) or `messages` (rendered with the chat template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: JsonObject | None = None
    tools: list[ChatTool] | None = None
    documents: list[dict[str, str]] | None = None


class TokenizeResponse(_Response):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[TokenId] = Field(max_length=1_000_000)


class DetokenizeResponse(_Response):
    prompt: str


class VersionResponse(_Response):
    version: str


class ErrorInfo(_Response):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(_Response):
    error: ErrorInfo


# ---- the Responses API -----------------------------------------------------------------------------------


class ResponsesTool(_Request):
    """A tool of the Responses API; only `{"type": "function", "name": ..., "parameters": ...}` is served."""

    type: str
    name: str | None = None
    description: str | None = None
    parameters: JsonObject | None = None
    strict: bool | None = None


class ResponsesToolChoiceFunction(_Request):
    type: Literal["function"]
    name: str


class ResponsesTextFormat(_Request):
    type: str = "text"
    name: str | None = None
    description: str | None = None
    schema_: JsonObject | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponsesText(_Request):
    format: ResponsesTextFormat | None = None
    verbosity: str | None = None


class ResponsesReasoning(_Request):
    effort: str | None = None
    summary: str | None = None


class ResponsesRequest(_SamplingFields):
    """`POST /v1/responses` (no stored state: `input` carries the whole conversation)."""

    # a string (one user message) or a list of input items (messages, function calls and their outputs,
    # reasoning items), checked item by item in serving_responses.py so errors name the item
    input: str | list[JsonObject]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    tools: list[ResponsesTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponsesToolChoiceFunction | None = None
    parallel_tool_calls: bool | None = True
    text: ResponsesText | None = None
    reasoning: ResponsesReasoning | None = None
    previous_response_id: str | None = None
    conversation: Any = None
    prompt: Any = None
    background: bool | None = None
    store: bool | None = None
    include: list[str] | None = None
    truncation: str | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    max_tool_calls: int | None = None
    # as OpenAI's: at most 16 pairs, keys of at most 64 characters, string values of at most 512
    metadata: dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]] | None = (
        Field(default=None, max_length=16)
    )
    chat_template_kwargs: JsonObject | None = None


class ResponsesUsage(_Response):
    input_tokens: int
    input_tokens_details: dict[str, int]
    output_tokens: int
    output_tokens_details: dict[str, int]
    total_tokens: int


class ResponsesResponse(_Response):
    """The Response object (output items as the OpenAI API shapes them: message, reasoning, function_call)."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: str
    model: str
    output: list[dict[str, Any]]
    usage: ResponsesUsage | None = None
    error: dict[str, Any] | None = None
    incomplete_details: dict[str, Any] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    parallel_tool_calls: bool = True
    temperature: float | None = None
    top_p: float | None = None
    tool_choice: Any = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    previous_response_id: str | None = None
    store: bool = False
    truncation: str = "disabled"
