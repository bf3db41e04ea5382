"""Tokenizer, chat template and streaming detokenizer.

`Tokenizer` wraps a `tokenizers.Tokenizer` (`tokenizer.json`) plus `tokenizer_config.json` /
`generation_config.json`, so it reads real Nemotron checkpoints as well as the tiny built-in model. Chat
templates render in a sandboxed jinja2 environment that mirrors the one transformers uses
(`raise_exception`, a non-HTML-escaping `tojson`, `strftime_now`, `{% generation %}`), so templates shipped
with checkpoints work unchanged.

The tiny model's tokenizer is built here with no network: byte-level BPE whose ids are

    0 <pad>  1 <s>  2 </s>  |  3 + b for each byte b (256)  |  53 merges  |
    8 added tokens (<|im_start|>, ...)
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Sequence
from datetime import datetime
from functools import cache, cached_property
from pathlib import Path
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from hyserve.model.detokenizer import ByteLevelDetokenizer, Detokenizer, IncrementalDetokenizer

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"


class TokenizerNotFoundError(FileNotFoundError):
    """The model directory has no tokenizer (e.g. a config-only dir run with load_format="dummy")."""


# ---- tiny tokenizer ----------------------------------------------------------------------------------------
PAD, BOS, EOS = "<pad>", "<s>", "</s>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
THINK_START, THINK_END = "<think>", "</think>"
TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
TOOL_RESPONSE_START, TOOL_RESPONSE_END = "<tool_response>", "</tool_response>"
# Control tokens: dropped by decode(skip_special_tokens=True).
TINY_SPECIAL_TOKENS = (IM_START, IM_END)
# Markup tokens: never split, but kept in decoded text so reasoning / tool-call parsers can see them.
TINY_MARKUP_TOKENS = (
    THINK_START,
    THINK_END,
    TOOL_CALL_START,
    TOOL_CALL_END,
    TOOL_RESPONSE_START,
    TOOL_RESPONSE_END,
)

# Merges in the byte-level alphabet ("Ġ" = space, "Ċ" = newline); each part exists before its merge.
TINY_MERGES: tuple[tuple[str, str], ...] = (
    ("Ġ", "t"), ("h", "e"), ("Ġ", "a"), ("i", "n"), ("Ġt", "he"), ("e", "r"), ("o", "n"), ("r", "e"),
    ("a", "t"), ("e", "n"), ("o", "r"), ("Ġ", "s"), ("Ġ", "w"), ("Ġ", "o"), ("Ġ", "c"), ("i", "s"),
    ("i", "t"), ("n", "d"), ("Ġa", "nd"), ("Ġo", "f"), ("Ġt", "o"), ("Ġ", "i"), ("Ġi", "n"), ("a", "r"),
    ("a", "l"), ("Ġ", "b"), ("Ġ", "f"), ("Ġ", "p"), ("Ġ", "m"), ("Ġ", "h"), ("l", "e"), ("s", "t"),
    ("l", "l"), ("Ġi", "s"), ("in", "g"), ("e", "d"), ("o", "u"), ("e", "s"), ("Ġ", "d"), ("Ġ", "l"),
    ("Ġ", "n"), ("Ġ", "e"), ("Ġ", "r"), ("Ġ", "g"), ("a", "n"), ("o", "m"), ("i", "on"), ("Ġ", "y"),
    ("o", "w"), ("Ġ", "u"), ("Ġ", "Ġ"), ("ĠĠ", "ĠĠ"), ("Ċ", "Ċ"),
)  # fmt: skip

TINY_CHAT_TEMPLATE = """\
{%- macro render_content(content) -%}
{%- if content is string -%}{{- content -}}
{%- elif content is iterable and content is not mapping -%}
{%- for part in content -%}{%- if part.type == 'text' -%}{{- part.text -}}{%- endif -%}{%- endfor -%}
{%- endif -%}
{%- endmacro -%}
{%- set thinking = true if enable_thinking is not defined else enable_thinking -%}
{%- if messages and messages[0].role == 'system' -%}
{%- set system_message = render_content(messages[0].content) -%}
{%- set loop_messages = messages[1:] -%}
{%- else -%}
{%- set system_message = '' -%}
{%- set loop_messages = messages -%}
{%- endif -%}
{%- if system_message or tools -%}
{{- '<|im_start|>system\\n' + system_message -}}
{%- if tools -%}
{{- ('\\n\\n' if system_message else '') + '# Tools\\n\\nYou may call one or more functions to assist with \
the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>' -}}
{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:\\n<tool_call>\\n\
{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call>' -}}
{%- endif -%}
{{- '<|im_end|>\\n' -}}
{%- endif -%}
{%- for message in loop_messages -%}
{%- if message.role == 'user' or message.role == 'system' -%}
{{- '<|im_start|>' + message.role + '\\n' + render_content(message.content) + '<|im_end|>\\n' -}}
{%- elif message.role == 'assistant' -%}
{%- set content = render_content(message.content) -%}
{%- if '</think>' in content -%}{%- set content = content.split('</think>')[-1].lstrip() -%}{%- endif -%}
{{- '<|im_start|>assistant\\n<think></think>' + content -}}
{%- if message.tool_calls -%}
{%- for tool_call in message.tool_calls -%}
{%- set fn = tool_call.function if tool_call.function is defined else tool_call -%}
{%- set args = fn.arguments if fn.arguments is string else (fn.arguments | tojson) -%}
{{- ('\\n' if content or not loop.first else '') + '<tool_call>\\n{"name": ' + (fn.name | tojson) + \
', "arguments": ' + args + '}\\n</tool_call>' -}}
{%- endfor -%}
{%- endif -%}
{{- '<|im_end|>\\n' -}}
{%- elif message.role == 'tool' -%}
{{- '<|im_start|>tool\\n<tool_response>\\n' + render_content(message.content) + \
'\\n</tool_response><|im_end|>\\n' -}}
{%- else -%}
{{- raise_exception('Unexpected message role: ' + message.role) -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|im_start|>assistant\\n' + ('<think>\\n' if thinking else '<think></think>') -}}
{%- endif -%}
"""


@cache
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table used by byte-level BPE (printable bytes map to
    themselves)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


@cache
def _unicode_to_bytes() -> dict[str, int]:
    return {c: b for b, c in bytes_to_unicode().items()}


def _byte_level_bytes(raw: str) -> bytes | None:
    """The bytes a byte-level vocabulary entry ('Ġthe') stands for; None if it is not one."""
    table = _unicode_to_bytes()
    if all(c in table for c in raw):
        return bytes(table[c] for c in raw)
    return None


def build_tiny_tokenizer() -> HFTokenizer:
    """The tiny model's tokenizer (deterministic, offline): 320 tokens."""
    vocab: dict[str, int] = {PAD: 0, BOS: 1, EOS: 2}
    byte_chars = bytes_to_unicode()
    for b in range(256):
        vocab[byte_chars[b]] = 3 + b
    for left, right in TINY_MERGES:
        if left not in vocab or right not in vocab:  # pragma: no cover - guards edits of TINY_MERGES
            raise ValueError(f"tiny tokenizer: merge parts {left!r} {right!r} must exist first")
        vocab[left + right] = len(vocab)
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=list(TINY_MERGES)))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 1)]
    )
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in (PAD, BOS, EOS)])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in TINY_SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TINY_MARKUP_TOKENS])
    return tok


def write_tiny_tokenizer(out_dir: str | Path, *, model_max_length: int = 4096) -> HFTokenizer:
    """Write `tokenizer.json` and `tokenizer_config.json` (with the chat template); byte-stable output."""
    out = Path(out_dir)
    tok = build_tiny_tokenizer()
    # Re-serialise with sorted keys so the file does not depend on map iteration order inside `tokenizers`.
    data = json.loads(tok.to_str())
    (out / TOKENIZER_FILE).write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": TINY_CHAT_TEMPLATE,
    }
    (out / TOKENIZER_CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return tok


# ---- chat template environment ---------------------------------------------------------------------------
class _GenerationBlock(Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask marker): renders its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:  # fmt: skip
    # jinja's own tojson HTML-escapes '<', '>' and '&', which would corrupt prompts. Objects and arrays are
    # encoded piece by piece (json.dumps is one C call: ~1 s for a 16 MB tool schema, every other thread
    # held, the server's event loop included); the text is the same.
    enc = json.JSONEncoder(
        ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )
    return "".join(enc.iterencode(x)) if isinstance(x, dict | list) else enc.encode(x)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@cache
def _jinja_env() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


# ---- Tokenizer ---------------------------------------------------------------------------------------------
_BYTE_FALLBACK_RE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _token_content(value: Any) -> str | None:
    """tokenizer_config special tokens are strings or AddedToken dicts ({"content": ...})."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


class Tokenizer:
    """Text <-> token ids and the chat template of one model directory."""

    def __init__(
        self,
        tokenizer: HFTokenizer,
        *,
        config: dict[str, Any] | None = None,
        generation_config: dict[str, Any] | None = None,
        chat_template: str | dict[str, str] | None = None,
    ) -> None:
        self._tok = tokenizer
        self.config = dict(config or {})
        gen = generation_config or {}
        self.generation_config: dict[str, Any] = dict(gen)  # generation_config.json, as read
        self.bos_token = _token_content(self.config.get("bos_token"))
        self.eos_token = _token_content(self.config.get("eos_token"))
        self.pad_token = _token_content(self.config.get("pad_token"))
        self.unk_token = _token_content(self.config.get("unk_token"))
        self.bos_token_id = self._id_or_none(self.bos_token)
        if self.bos_token_id is None and isinstance(gen.get("bos_token_id"), int):
            self.bos_token_id = gen["bos_token_id"]
        self.pad_token_id = self._id_or_none(self.pad_token)
        eos: list[int] = []
        if (eid := self._id_or_none(self.eos_token)) is not None:
            eos.append(eid)
        gen_eos = gen.get("eos_token_id")
        for x in gen_eos if isinstance(gen_eos, list) else [gen_eos]:
            if isinstance(x, int) and x not in eos:
                eos.append(x)
        self.eos_token_ids: tuple[int, ...] = tuple(eos)
        self._templates: dict[str, str] = {}
        if isinstance(chat_template, str):
            self._templates["default"] = chat_template
        elif isinstance(chat_template, dict):
            self._templates.update(chat_template)
        self._added = tokenizer.get_added_tokens_decoder()
        self._byte_level = isinstance(tokenizer.decoder, decoders.ByteLevel)

    # -- construction --
    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        """Load `tokenizer.json` (+ `tokenizer_config.json`, `generation_config.json`,
        `chat_template.jinja`)."""
        d = Path(model_dir)
        tok_path = d / TOKENIZER_FILE
        if not tok_path.is_file():
            raise TokenizerNotFoundError(
                f"{d} has no {TOKENIZER_FILE}, so text cannot be tokenized: prompts for this model must be "
                "given as token ids (e.g. a config-only directory run with load_format='dummy')"
            )
        try:
            tok = HFTokenizer.from_file(str(tok_path))
        except Exception as e:  # tokenizers raises a bare Exception on malformed files
            raise ValueError(f"{tok_path}: cannot be read by the tokenizers library: {e}") from e
        cfg_path = d / TOKENIZER_CONFIG_FILE
        config = _read_json(cfg_path) if cfg_path.is_file() else {}
        gen_path = d / GENERATION_CONFIG_FILE
        gen = _read_json(gen_path) if gen_path.is_file() else None
        template: str | dict[str, str] | None = None
        raw = config.get("chat_template")
        if isinstance(raw, str):
            template = raw
        elif isinstance(raw, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
            template = {t["name"]: t["template"] for t in raw if isinstance(t, dict) and "name" in t}
        if (d / CHAT_TEMPLATE_FILE).is_file():  # transformers >= 4.49 saves it beside the config
            template = (d / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
        return cls(tok, config=config, generation_config=gen, chat_template=template)

    @property
    def backend(self) -> HFTokenizer:
        return self._tok

    def _id_or_none(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    # -- ids <-> text --
    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer knows (added tokens included)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @cached_property
    def max_token_chars(self) -> int:
        """The longest vocabulary entry, in characters: no token covers more characters of a text (a
        byte-level entry has one character per byte, a metaspace entry one per character), so a text of
        c characters needs at least c / max_token_chars tokens."""
        return max((len(t) for t in self._tok.get_vocab(with_added_tokens=True)), default=1)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; add_special_tokens applies the tokenizer's post-processor (e.g. a leading
        BOS)."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """The raw vocabulary entry (byte-level form such as 'Ġthe'); None for an unknown id."""
        return self._tok.id_to_token(token_id)

    def is_special(self, token_id: int) -> bool:
        t = self._added.get(token_id)
        return bool(t is not None and t.special)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (OpenAI logprobs `bytes`); may be part of a UTF-8 character."""
        added = self._added.get(token_id)
        if added is not None:
            return added.content.encode("utf-8")
        raw = self._tok.id_to_token(token_id)
        if raw is None:
            return b""
        if self._byte_level and (b := _byte_level_bytes(raw)) is not None:
            return b
        m = _BYTE_FALLBACK_RE.match(raw)
        if m:
            return bytes([int(m.group(1), 16)])
        if "\u2581" in raw:  # sentencepiece word boundary
            return raw.replace("\u2581", " ").encode("utf-8")
        return self.decode([token_id], skip_special_tokens=False).encode("utf-8")

    def token_text(self, token_id: int) -> str:
        """Text of one token for logprobs; bytes of an incomplete UTF-8 character show as '\\xNN' (as
        OpenAI)."""
        return self.token_bytes(token_id).decode("utf-8", errors="backslashreplace")

    def incremental_detokenizer(
        self, *, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True
    ) -> Detokenizer:
        """A stream's detokenizer: a byte-level tokenizer's concatenates each token's bytes (no decode call
        per token), any other's decodes a sliding window (detokenizer.py)."""
        table = self.stream_bytes
        if table is not None:
            return ByteLevelDetokenizer(table, self.special_ids, skip_special_tokens=skip_special_tokens)
        return IncrementalDetokenizer(self, prompt_ids=prompt_ids, skip_special_tokens=skip_special_tokens)

    @cached_property
    def special_ids(self) -> frozenset[int]:
        return frozenset(i for i, t in self._added.items() if t.special)

    @cached_property
    def stream_bytes(self) -> tuple[bytes, ...] | None:
        """The bytes each token id decodes to, when decoding is the UTF-8 of their concatenation: a plain
        ByteLevel decoder, every vocabulary entry made of byte-level characters, every added token whole
        characters. None otherwise (a sentencepiece-style decoder, say)."""
        if not self._byte_level:
            return None
        out = [b""] * self.vocab_size  # ids the vocabulary skips decode to nothing
        for raw, i in self._tok.get_vocab(with_added_tokens=False).items():
            b = _byte_level_bytes(raw)
            if b is None:
                return None
            out[i] = b
        for i in self._added:  # as decode writes them, whole
            out[i] = self.decode([i], skip_special_tokens=False).encode("utf-8")
        return tuple(out)

    # -- chat --
    @property
    def has_chat_template(self) -> bool:
        return bool(self._templates)

    def with_chat_template(self, source: str) -> Tokenizer:
        """This tokenizer with `source` as its only chat template (a server's --chat-template); raises
        ValueError if the template does not compile."""
        check_chat_template(source)
        other = copy.copy(self)
        other._templates = {"default": source}
        return other

    def _template_for(self, tools: Any) -> str:
        if not self._templates:
            raise ValueError(
                "this tokenizer has no chat template (tokenizer_config.json 'chat_template' or "
                "chat_template.jinja); use the completions API with a plain prompt instead"
            )
        if tools and "tool_use" in self._templates:
            return self._templates["tool_use"]
        if "default" in self._templates:
            return self._templates["default"]
        return next(iter(self._templates.values()))

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        tools: Sequence[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """Render the chat prompt text (tokenize it with `encode(..., add_special_tokens=False)`).

        Extra keyword arguments reach the template (e.g. `enable_thinking=False`). Template errors, including
        `raise_exception(...)` calls, surface as ValueError.
        """
        source = self._template_for(tools)
        try:
            template = _compiled(source)
            return template.render(
                messages=list(messages),
                tools=list(tools) if tools else None,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                pad_token=self.pad_token or "",
                unk_token=self.unk_token or "",
                **template_kwargs,
            )
        except jinja2.exceptions.TemplateError as e:
            raise ValueError(f"chat template error: {e}") from e


@cache
def _compiled(source: str) -> jinja2.Template:
    return _jinja_env().from_string(source)


def check_chat_template(source: str) -> None:
    """Compile a chat template; ValueError with jinja's message (and line) if it cannot."""
    try:
        _compiled(source)
    except jinja2.exceptions.TemplateError as e:
        line = getattr(e, "lineno", None)
        raise ValueError(
            f"the chat template does not compile{f' (line {line})' if line else ''}: {e}"
        ) from None
