"""Request bodies: read under the size limit (middleware.py refuses a longer one as it streams in), then
parsed and validated with a bounded cost on the event loop.

A small body is parsed in place. A large one is parsed on a worker thread, and in pieces, because a
worker thread only helps if no single call holds the GIL for long: `json.loads` of 32 MB, or one pydantic
validation of a 16M-element list, is one C call of a second or more during which the event loop (every
stream, `/health`) cannot run. So (docs/architecture.md, "Request bodies"):

- a body that is not a JSON object is refused before it is parsed;
- the JSON is walked one value at a time: a value whose text fits in a window of `_WINDOW_CHARS` is parsed
  by one C call on that window (~1-3 ms); a larger object or array is walked member by member, at any
  depth; only a long string is one C call over its whole text (~0.1 s for 28 MB of escapes at worst);
- an array of integers is parsed a slice of characters at a time; one that holds only token ids
  (0 <= id <= 2^31-1) becomes a `TokenIds`, which the prompt fields of protocol.py take without looking at
  each element (the union `str | list[str] | list[int] | ...` used to try `list[str]` first and build one
  error per element: 25M ids froze the loop ~20 s);
- a long list field (chat `messages`, responses `input`) is validated a slice of elements at a time;
- the walk on a worker thread sleeps briefly after every few milliseconds of work, so the event loop gets the
  interpreter lock when it asks rather than after a switch interval each time.

Whatever the body, bad input is a 400 naming the field: an integer of more digits than Python converts
(4,300), nesting deeper than `MAX_BODY_DEPTH` (deeper values could not be serialised back), or more than
`MAX_BODY_CONTAINERS` objects and arrays (each a Python object the garbage collector walks while the request
runs, in passes that hold the GIL).
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import re
import sys
import time
import typing
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel, TypeAdapter, ValidationError
from starlette.requests import Request

from hyserve.server.errors import APIError, bad_request

# Bodies up to this many bytes are parsed and validated in place (well under a millisecond).
INLINE_BODY_BYTES = 64 * 1024
# An integer array is parsed this many characters at a time (~1 ms a slice).
_SLICE_CHARS = 128 * 1024
# A value whose text fits in this many characters is parsed by one C call (~1-3 ms).
_WINDOW_CHARS = 256 * 1024
# A list field longer than this is validated this many elements at a time.
_SLICE_ITEMS = 2_000
# A walk on a worker thread sleeps `_YIELD_S` after each `_HOLD_S` of work: with the interpreter lock in
# turns every 5 ms (sys.getswitchinterval), each of the event loop's lock takes waited up to that long
# behind it, and a `/health` takes several, so it took 50 ms at rest and 321 ms on a loaded 2-CPU machine.
_HOLD_S = 0.002
_YIELD_S = 0.0005
# the walk checks the clock once every this many members
_CHECK_EVERY = 64
TOKEN_ID_MAX = 2**31 - 1
# The deepest nesting of objects and arrays a body may have (the body itself is level 1); JSON schemas and
# tool parameters need a few levels, and a reply that echoes a deeper value cannot be serialised.
MAX_BODY_DEPTH = 128
# The most objects and arrays a (large) body may hold: every one lives as a Python object the garbage
# collector walks, in one pass that holds the GIL (~0.15 s a million), while the request runs.
MAX_BODY_CONTAINERS = 200_000

_WS = re.compile(r"[ \t\n\r]*")
_INT_CHARS = re.compile(r"[0-9, \t\n\r-]*")  # what the inside of an array of integers is made of
# set by JSONDecoder.__init__ (typeshed does not declare it)
_SCAN = json.JSONDecoder().scan_once  # type: ignore[attr-defined]
_NUMBER_START = frozenset("-0123456789")

Path = tuple[str | int, ...]
# the size of the body the current request arrived with (set by `BodyRoute`): a request whose body was large
# has its other large work (rendering its tools and template variables) done off the event loop too
_BODY_BYTES: contextvars.ContextVar[int] = contextvars.ContextVar("body_bytes", default=0)


def large_body() -> bool:
    """Whether the current request's body was larger than `INLINE_BODY_BYTES`."""
    return _BODY_BYTES.get() > INLINE_BODY_BYTES


class TokenIds(list):  # type: ignore[type-arg]
    """A list of ints from the body parser; `checked` when every one is a token id (0 <= id <= 2^31 - 1)."""

    checked: bool = False


class BodyValueError(ValueError):
    """A value JSON allows but a request may not hold; `param` is its field path (`messages[0].content`)."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param


def field_path(path: Path) -> str | None:
    """('messages', 0, 'content') -> 'messages[0].content'."""
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or None


def _too_deep(path: Path) -> BodyValueError:
    where = field_path(path)
    return BodyValueError(
        f"request body is nested too deeply{f' at {where}' if where else ''} (at most {MAX_BODY_DEPTH} "
        "levels of objects and arrays)",
        where,
    )


def _huge_int(path: Path) -> BodyValueError:
    where = field_path(path)
    return BodyValueError(
        f"{where or 'request body'}: an integer has more than {sys.get_int_max_str_digits()} digits", where
    )


def _shape(value: Any, depth_limit: int) -> tuple[int, bool]:
    """(the objects and arrays in `value`, parsed JSON; whether they nest more than `depth_limit` levels)."""
    if not isinstance(value, dict | list):
        return 0, False
    count = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        count += 1
        if depth > depth_limit:
            return count, True
        if isinstance(node, TokenIds):
            continue
        for v in node.values() if isinstance(node, dict) else node:
            if isinstance(v, dict | list):
                stack.append((v, depth + 1))
    return count, False


def nesting_exceeds(value: Any, limit: int) -> bool:
    """Whether `value` (parsed JSON) nests objects and arrays more than `limit` levels deep."""
    return _shape(value, limit)[1]


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


def _on_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


class _Walker:
    """`loads_in_pieces`' parser: values walked one at a time (see the module docstring), each C call on at
    most a window of the text or one string."""

    def __init__(self, s: str) -> None:
        self.s = s
        self.base = 0  # the window is s[base : base + _WINDOW_CHARS]
        self.window = ""
        self.containers = 0  # objects and arrays parsed so far
        # off the event loop's thread, the walk leaves the interpreter lock to it now and then (`_breathe`)
        self.courteous = not _on_event_loop()
        self.countdown = _CHECK_EVERY
        self.since = time.perf_counter()

    def _breathe(self) -> None:
        """Called once a member: on a worker thread, sleep `_YIELD_S` once `_HOLD_S` of work has passed."""
        self.countdown -= 1
        if self.countdown or not self.courteous:
            return
        self.countdown = _CHECK_EVERY
        now = time.perf_counter()
        if now - self.since >= _HOLD_S:
            time.sleep(_YIELD_S)
            self.since = time.perf_counter()

    def _count(self, n: int) -> None:
        self.containers += n
        if self.containers > MAX_BODY_CONTAINERS:
            raise BodyValueError(
                f"request body has more than {MAX_BODY_CONTAINERS} JSON objects and arrays (send long "
                "prompts as text or token ids)",
                None,
            )

    def _slide(self, i: int) -> None:
        self.base, self.window = i, self.s[i : i + _WINDOW_CHARS]

    def _in_window(self, i: int) -> tuple[Any, int] | None:
        """The value at `i` parsed within the window (slid to start at `i` when it does not fit after the
        current start), or None when it does not parse there (too long, or bad: the walk finds where)."""
        truncated = self.base + len(self.window) < len(self.s)
        for attempt in (0, 1):
            if attempt or not self.base <= i < self.base + len(self.window):
                if attempt and self.base == i:
                    return None
                self._slide(i)
                truncated = self.base + len(self.window) < len(self.s)
            try:
                v, end = _SCAN(self.window, i - self.base)
            except (StopIteration, ValueError):
                if not truncated:
                    return None
                continue
            if truncated and end == len(self.window):  # a number may go on past the window
                continue
            return v, self.base + end
        return None

    def scalar(self, i: int, path: Path) -> tuple[Any, int]:
        try:
            return _SCAN(self.s, i)  # type: ignore[no-any-return]
        except StopIteration as e:
            raise json.JSONDecodeError("Expecting value", self.s, e.value) from None
        except json.JSONDecodeError:
            raise
        except ValueError:  # int(): more digits than sys.get_int_max_str_digits()
            raise _huge_int(path) from None

    def value(self, i: int, path: Path, depth: int) -> tuple[Any, int]:
        """The value at `i` of nesting level `depth` (the body object is level 1)."""
        c = self.s[i : i + 1]
        if c not in ("[", "{"):
            return self.scalar(i, path)
        if depth > MAX_BODY_DEPTH:
            raise _too_deep(path)
        self._count(1)
        if c == "[":
            j = _ws(self.s, i + 1)
            if self.s[j : j + 1] in _NUMBER_START:
                try:
                    fast = _int_array(self.s, j)
                except json.JSONDecodeError:
                    raise
                except ValueError:
                    raise _huge_int(path) from None
                if fast is not None:
                    return fast
        if depth > 1:
            hit = self._in_window(i)
            if hit is not None:
                count, deep = _shape(hit[0], MAX_BODY_DEPTH - depth + 1)
                if deep:
                    raise _too_deep(path)
                self._count(count - 1)
                return hit
        return self.array(i, path, depth) if c == "[" else self.object(i, path, depth)

    def array(self, i: int, path: Path, depth: int) -> tuple[list[Any], int]:
        s = self.s
        j = _ws(s, i + 1)
        if s.startswith("]", j):
            return [], j + 1
        items: list[Any] = []
        while True:
            self._breathe()
            j = _ws(s, j)
            v, j = self.value(j, (*path, len(items)), depth + 1)
            items.append(v)
            j = _ws(s, j)
            if s.startswith(",", j):
                j += 1
            elif s.startswith("]", j):
                return items, j + 1
            else:
                raise json.JSONDecodeError("Expecting ',' delimiter", s, j)

    def object(self, i: int, path: Path, depth: int) -> tuple[dict[str, Any], int]:
        s = self.s
        out: dict[str, Any] = {}
        i = _ws(s, i + 1)
        if s.startswith("}", i):
            return out, i + 1
        while True:
            self._breathe()
            if not s.startswith('"', i):
                raise json.JSONDecodeError("Expecting property name enclosed in double quotes", s, i)
            key, i = self.scalar(i, path)
            i = _ws(s, i)
            if not s.startswith(":", i):
                raise json.JSONDecodeError("Expecting ':' delimiter", s, i)
            out[key], i = self.value(_ws(s, i + 1), (*path, key), depth + 1)
            i = _ws(s, i)
            if s.startswith(",", i):
                i = _ws(s, i + 1)
            elif s.startswith("}", i):
                return out, i + 1
            else:
                raise json.JSONDecodeError("Expecting ',' delimiter", s, i)


def loads_in_pieces(s: str) -> Any:
    """`json.loads(s)` of a JSON object, with no single C call over much more than a window of the input
    or one string (see the module docstring); arrays of token ids come back as `TokenIds`. Raises
    `BodyValueError` for what a request may not hold (naming its field), and for anything but an object."""
    i = _ws(s, 0)
    if not s.startswith("{", i):
        raise BodyValueError("request body must be a JSON object", None)
    out, i = _Walker(s).object(i, (), 1)
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


def _not_an_object() -> Exception:
    from fastapi.exceptions import RequestValidationError

    return RequestValidationError(
        [
            {
                "type": "model_attributes_type",
                "loc": ("body",),
                "msg": "Input should be a JSON object",
                "input": None,
            }
        ]
    )


def _loads(text: str, large: bool) -> Any:
    """The body's JSON object: `json.loads` when small (then checked for depth and, on a value JSON allows
    but Python refuses, walked again to name the field), `loads_in_pieces` when large."""
    if large:
        return loads_in_pieces(text)
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        raise
    except ValueError:  # an integer of too many digits: the walk names its field
        return loads_in_pieces(text)
    if text.count("{") + text.count("[") > MAX_BODY_DEPTH and nesting_exceeds(obj, MAX_BODY_DEPTH):
        return loads_in_pieces(text)  # names where
    return obj


def parse_body_sync(body: bytes, model: type[BaseModel]) -> BaseModel:
    """The request model from a JSON body (any size; see `parse_body`)."""
    from fastapi.exceptions import RequestValidationError

    if not body.strip():
        raise bad_request("request body is required (a JSON object)")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad_request(f"request body is not valid UTF-8 (byte {e.start})") from None
    if not text[_ws(text, 0) :].startswith("{"):  # refused before it is parsed, whatever its size
        raise _not_an_object()
    try:
        obj = _loads(text, len(body) > INLINE_BODY_BYTES)
    except RecursionError:
        raise _api_error(_too_deep(())) from None
    except BodyValueError as e:
        raise _api_error(e) from None
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
        raise _not_an_object()
    return _validate_in_slices(model, obj)


def _api_error(e: BodyValueError) -> APIError:
    return bad_request(str(e), param=e.param)


async def parse_body(body: bytes, model: type[BaseModel]) -> BaseModel:
    """Parse and validate a JSON request body: in place when small, else on a worker thread."""
    if len(body) <= INLINE_BODY_BYTES:
        return parse_body_sync(body, model)
    return await asyncio.to_thread(parse_body_sync, body, model)


def check_content_type(value: str | None) -> None:
    """A JSON body must say so: `Content-Type: application/json` (a charset, if given, UTF-8). Anything else
    is a 415, before the body is read: a browser page may post `text/plain`, a form or a typeless body to
    another origin without asking first (no CORS preflight), and curl's `-d` sends a form."""
    media, *params = (value or "").split(";")
    charset = "utf-8"
    for p in params:
        k, _, v = p.partition("=")
        if k.strip().lower() == "charset":
            charset = v.strip().strip('"').lower()
    if media.strip().lower() == "application/json" and charset in ("utf-8", "utf8"):
        return
    got = f"Content-Type {value!r}" if value else "no Content-Type"
    raise APIError(
        f"request bodies are JSON: send Content-Type: application/json (UTF-8); got {got[:100]}",
        status_code=415,
        code="unsupported_media_type",
    )


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
            check_content_type(request.headers.get("content-type"))
            body = await request.body()
            _BODY_BYTES.set(len(body))
            req = await parse_body(body, model)
            kwargs: dict[str, Any] = {name: req}
            if raw_name is not None:
                kwargs[raw_name] = request
            result = await endpoint(**kwargs)
            if isinstance(result, Response):
                return result
            return JSONResponse(jsonable_encoder(result))

        return handler
