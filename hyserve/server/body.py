"""Request bodies: read under the size limit (middleware.py refuses a longer one as it streams in), then
parsed and validated with a bounded cost on the event loop.

A small body is parsed in place. A large one is parsed on a worker thread, and in pieces, because a
worker thread only helps if no single call holds the GIL for long: `json.loads` of 32 MB, or one pydantic
validation of a 16M-element list, is one C call of a second or more during which the event loop (every
stream, `/health`) cannot run. So (docs/architecture.md, "Request bodies"):

- the JSON is walked one top-level value at a time, arrays one element at a time, and an array of
  integers is parsed a slice of characters at a time; one that holds only token ids (0 <= id <= 2^31-1)
  becomes a `TokenIds`, which the prompt fields of protocol.py take without looking at each element
  (the union `str | list[str] | list[int] | ...` used to try `list[str]` first and build one error per
  element: 25M ids froze the loop ~20 s);
- a long list field (chat `messages`, responses `input`) is validated a slice of elements at a time.
"""

from __future__ import annotations

import asyncio
import json
import re
import typing
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel, TypeAdapter, ValidationError
from starlette.requests import Request

from hyserve.server.errors import bad_request

# Bodies up to this many bytes are parsed and validated in place (well under a millisecond).
INLINE_BODY_BYTES = 64 * 1024
# An integer array is parsed this many characters at a time (~1 ms a slice).
_SLICE_CHARS = 128 * 1024
# A list field longer than this is validated this many elements at a time.
_SLICE_ITEMS = 2_000
TOKEN_ID_MAX = 2**31 - 1

_WS = re.compile(r"[ \t\n\r]*")
_INT_CHARS = re.compile(r"[0-9, \t\n\r-]*")  # what the inside of an array of integers is made of
# set by JSONDecoder.__init__ (typeshed does not declare it)
_SCAN = json.JSONDecoder().scan_once  # type: ignore[attr-defined]


class TokenIds(list):  # type: ignore[type-arg]
    """A list of ints from the body parser; `checked` when every one is a token id (0 <= id <= 2^31 - 1)."""

    checked: bool = False


def _ws(s: str, i: int) -> int:
    m = _WS.match(s, i)
    assert m is not None
    return m.end()


def _int_piece(s: str, a: int, b: int) -> list[int]:
    piece = s[a:b]
    if not piece.strip():
        raise json.JSONDecodeError("Expecting value", s, a)
    try:
        return json.loads(f"[{piece}]")  # type: ignore[no-any-return]
    except json.JSONDecodeError as e:
        raise json.JSONDecodeError(e.msg, s, a + max(0, e.pos - 1)) from None


def _int_array(s: str, i: int) -> tuple[list[int], int] | None:
    """The array of integers whose first element starts at `i`, parsed a slice at a time, and the index
    after its `]`; None when the array holds anything but integers (the caller parses it generically)."""
    out = TokenIds()
    ok = True
    pos = i
    n = len(s)
    while True:
        stop = min(pos + _SLICE_CHARS, n)
        m = _INT_CHARS.match(s, pos, stop)
        assert m is not None
        end = m.end()
        last = end < stop or stop == n  # the run of integer characters ends in this slice
        if last and (end >= n or s[end] != "]"):
            return None
        cut = end if last else s.rfind(",", pos, end)
        if cut < 0:
            return None  # one number longer than a slice: not a token id anyway
        vals = _int_piece(s, pos, cut)
        ok = ok and min(vals) >= 0 and max(vals) <= TOKEN_ID_MAX
        out.extend(vals)
        if last:
            out.checked = ok
            return out, end + 1
        pos = cut + 1


def _array(s: str, i: int, depth: int) -> tuple[list[Any], int]:
    j = _ws(s, i + 1)
    if s.startswith("]", j):
        return [], j + 1
    if s[j : j + 1] in ("-", "0", "1", "2", "3", "4", "5", "6", "7", "8", "9"):
        fast = _int_array(s, j)
        if fast is not None:
            return fast
    items: list[Any] = []
    while True:
        j = _ws(s, j)
        if s.startswith("[", j) and depth < 8:
            v, j = _array(s, j, depth + 1)
        else:
            v, j = _scan(s, j)
        items.append(v)
        j = _ws(s, j)
        if s.startswith(",", j):
            j += 1
        elif s.startswith("]", j):
            return items, j + 1
        else:
            raise json.JSONDecodeError("Expecting ',' delimiter", s, j)


def _scan(s: str, i: int) -> tuple[Any, int]:
    try:
        return _SCAN(s, i)  # type: ignore[no-any-return]
    except StopIteration as e:
        raise json.JSONDecodeError("Expecting value", s, e.value) from None


def loads_in_pieces(s: str) -> Any:
    """`json.loads(s)`, with no single C call over much more than a slice of the input (see the module
    docstring); arrays of token ids come back as `TokenIds`."""
    i = _ws(s, 0)
    if not s.startswith("{", i):
        return json.loads(s)  # not an object: no request model accepts it; let json / pydantic say why
    out: dict[str, Any] = {}
    i = _ws(s, i + 1)
    if s.startswith("}", i):
        i += 1
    else:
        while True:
            if not s.startswith('"', i):
                raise json.JSONDecodeError("Expecting property name enclosed in double quotes", s, i)
            key, i = _scan(s, i)
            i = _ws(s, i)
            if not s.startswith(":", i):
                raise json.JSONDecodeError("Expecting ':' delimiter", s, i)
            i = _ws(s, i + 1)
            if s.startswith("[", i):
                out[key], i = _array(s, i, 0)
            else:
                out[key], i = _scan(s, i)
            i = _ws(s, i)
            if s.startswith(",", i):
                i = _ws(s, i + 1)
            elif s.startswith("}", i):
                i += 1
                break
            else:
                raise json.JSONDecodeError("Expecting ',' delimiter", s, i)
    if _ws(s, i) != len(s):
        raise json.JSONDecodeError("Extra data", s, i)
    return out


def _list_adapter(model: type[BaseModel], name: str) -> TypeAdapter[Any] | None:
    """A TypeAdapter of field `name`'s list type when it is a list of models (or a union with one)."""
    ann = typing.get_type_hints(model).get(name)
    for t in (ann, *typing.get_args(ann)):
        if typing.get_origin(t) is list:
            (item,) = typing.get_args(t) or (Any,)
            if any(isinstance(x, type) and issubclass(x, BaseModel) for x in (item, *typing.get_args(item))):
                return TypeAdapter(t)
    return None


def _validate_in_slices(model: type[BaseModel], obj: dict[str, Any]) -> BaseModel:
    """`model.model_validate(obj)`, with each long list of models validated a slice at a time first
    (instances pass the final validation without being looked at again)."""
    from fastapi.exceptions import RequestValidationError

    obj = dict(obj)
    for name, v in obj.items():
        if not isinstance(v, list) or len(v) <= _SLICE_ITEMS or isinstance(v, TokenIds):
            continue
        adapter = _list_adapter(model, name)
        if adapter is None:
            continue
        done: list[Any] = []
        for a in range(0, len(v), _SLICE_ITEMS):
            try:
                done.extend(adapter.validate_python(v[a : a + _SLICE_ITEMS]))
            except ValidationError as e:
                errs = [
                    dict(err, loc=("body", name, err["loc"][0] + a, *err["loc"][1:]))
                    if err["loc"] and isinstance(err["loc"][0], int)
                    else dict(err, loc=("body", name, *err["loc"]))
                    for err in e.errors()
                ]
                raise RequestValidationError(errs) from None
        obj[name] = done
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        raise RequestValidationError([dict(err, loc=("body", *err["loc"])) for err in e.errors()]) from None


def parse_body_sync(body: bytes, model: type[BaseModel]) -> BaseModel:
    """The request model from a JSON body (any size; see `parse_body`)."""
    from fastapi.exceptions import RequestValidationError

    if not body.strip():
        raise bad_request("request body is required (a JSON object)")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad_request(f"request body is not valid UTF-8 (byte {e.start})") from None
    try:
        obj = json.loads(text) if len(body) <= INLINE_BODY_BYTES else loads_in_pieces(text)
    except RecursionError:
        raise bad_request("request body is nested too deeply") from None
    except json.JSONDecodeError as e:
        raise RequestValidationError(
            [
                {
                    "type": "json_invalid",
                    "loc": ("body", e.pos),
                    "msg": "JSON decode error",
                    "input": {},
                    "ctx": {"error": e.msg},
                }
            ]
        ) from None
    if not isinstance(obj, dict):
        raise RequestValidationError(
            [
                {
                    "type": "model_attributes_type",
                    "loc": ("body",),
                    "msg": "Input should be a JSON object",
                    "input": None,
                }
            ]
        )
    return _validate_in_slices(model, obj)


async def parse_body(body: bytes, model: type[BaseModel]) -> BaseModel:
    """Parse and validate a JSON request body: in place when small, else on a worker thread."""
    if len(body) <= INLINE_BODY_BYTES:
        return parse_body_sync(body, model)
    return await asyncio.to_thread(parse_body_sync, body, model)


def _body_params(endpoint: Any) -> tuple[str, type[BaseModel], str | None] | None:
    """(the request-model parameter, its model, the `Request` parameter or None) of a route endpoint."""
    hints = typing.get_type_hints(endpoint)
    model = next(
        (
            (n, t)
            for n, t in hints.items()
            if n != "return" and isinstance(t, type) and issubclass(t, BaseModel)
        ),
        None,
    )
    if model is None:
        return None
    raw = next((n for n, t in hints.items() if t is Request), None)
    return model[0], model[1], raw


class BodyRoute(APIRoute):
    """A route whose JSON body is parsed by `parse_body` (bounded cost on the event loop) rather than by
    FastAPI in place; the endpoint signature (and so the OpenAPI schema) stays
    `(req: Model, raw: Request)`."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        params = _body_params(self.endpoint) if self.body_field is not None else None
        if params is None:
            return super().get_route_handler()
        name, model, raw_name = params
        endpoint = self.endpoint

        async def handler(request: Request) -> Response:
            req = await parse_body(await request.body(), model)
            kwargs: dict[str, Any] = {name: req}
            if raw_name is not None:
                kwargs[raw_name] = request
            result = await endpoint(**kwargs)
            if isinstance(result, Response):
                return result
            return JSONResponse(jsonable_encoder(result))

        return handler
