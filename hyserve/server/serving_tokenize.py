"""`POST /tokenize` and `POST /detokenize` (vLLM's routes): text or chat messages -> token ids, and
back."""

from __future__ import annotations

from fastapi import FastAPI

from hyserve.server.chat import chat_chars, encode_text, render_chat_prompt
from hyserve.server.errors import bad_request
from hyserve.server.protocol import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse
from hyserve.server.state import ERROR_RESPONSES, OFF_LOOP_CHARS, AppState


async def tokenize_request(state: AppState, req: TokenizeRequest) -> TokenizeResponse:
    tok = state.tok
    state.check_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("send exactly one of `prompt` (text) or `messages` (chat)", param="prompt")
    if req.messages is not None and not req.messages:
        raise bad_request("messages must not be empty", param="messages")

    def render_and_encode() -> list[int]:
        if req.messages is not None:
            text = render_chat_prompt(
                tok,
                req.messages,
                tools=req.tools,
                add_generation_prompt=req.add_generation_prompt,
                chat_template_kwargs=req.chat_template_kwargs,
                documents=req.documents,
            )
            state.check_prompt_chars(len(text), "messages")  # the tools and template count too
            return encode_text(tok, text, add_special_tokens=False, param="messages")
        return encode_text(tok, req.prompt or "", add_special_tokens=req.add_special_tokens)

    n_chars = chat_chars(req.messages) if req.messages is not None else len(req.prompt or "")
    state.check_prompt_chars(n_chars, "messages" if req.messages is not None else "prompt")
    ids = await state.off_loop(render_and_encode, n_chars >= OFF_LOOP_CHARS)
    return TokenizeResponse(count=len(ids), max_model_len=state.engine.max_seq_len, tokens=ids)


def detokenize_request(state: AppState, req: DetokenizeRequest) -> DetokenizeResponse:
    tok = state.tok
    state.check_model(req.model)
    if tok is None:
        raise bad_request(
            "this model has no tokenizer, so token ids cannot be turned into text", param="tokens"
        )
    vocab = getattr(tok, "vocab_size", None)
    if isinstance(vocab, int):
        bad = [t for t in req.tokens if t >= vocab]
        if bad:
            raise bad_request(
                f"token ids must be < the vocabulary size {vocab}; got {bad[:5]}", param="tokens"
            )
    try:
        text = tok.decode(req.tokens)
    except Exception as e:
        raise bad_request(f"cannot decode these token ids: {e}", param="tokens") from None
    return DetokenizeResponse(prompt=text)


def add_routes(app: FastAPI, state: AppState) -> None:
    @app.post("/tokenize", response_model=TokenizeResponse, responses=ERROR_RESPONSES)
    async def tokenize(req: TokenizeRequest) -> TokenizeResponse:
        return await tokenize_request(state, req)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=ERROR_RESPONSES)
    async def detokenize(req: DetokenizeRequest) -> DetokenizeResponse:
        return detokenize_request(state, req)
