"""The `hyserve` command line.

    hyserve serve [MODEL] [--config extra-llm-api-config.yml] [--host H] [--port P] [--max_seq_len N] ...
    hyserve generate [MODEL] (--prompt TEXT | --prompt-ids 1,2,3) [--max-tokens N] [--json] ...
    hyserve make-tiny DIR [--variant dense|moe|latent-moe] [--seed N] [--fp8] [--mtp]
    hyserve bench ...        (registered by hyserve.bench.cli when that module exists)

The serve flags are the ones `trtllm-serve` users already type (`--max_batch_size`, `--tp_size`,
`--kv_cache_free_gpu_memory_fraction`, `--reasoning_parser`, `--config FILE.yml`, ...); each is also
accepted with hyphens (`--max-batch-size`) as vLLM users write them. Precedence: built-in defaults <
YAML file < command-line flags. Everything is validated by `build_engine_config` before the model
loads, and a bad setting exits with status 2 and one line naming the key, not a traceback.

Heavy imports (torch, the engine, FastAPI) happen inside the subcommands so `hyserve --help` and
config errors are instant.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hyserve.config import SCHEDULING_POLICIES

# Accepted for drop-in compatibility with trtllm-serve / vLLM command lines; no effect here.
_IGNORED_FLAGS = ("trust_remote_code",)

EXIT_CONFIG_ERROR = 2


class ConfigError(ValueError):
    """A user-fixable configuration problem (exit status 2, one line)."""


def _flag(
    parser: argparse.ArgumentParser | Any,
    name: str,
    aliases: tuple[str, ...] = (),
    short: tuple[str, ...] = (),
    **kw: Any,
) -> None:
    """Add `--name_with_underscores` and its hyphenated spelling as one option (and `aliases`, the spellings
    of other servers: vLLM's --max-num-seqs; `short`: single-dash ones, vLLM's -tp)."""
    spellings = [*short, f"--{name}"]
    hyphen = f"--{name.replace('_', '-')}"
    if hyphen not in spellings:
        spellings.append(hyphen)
    under = f"--{name.replace('-', '_')}"
    if under not in spellings:
        spellings.append(under)
    spellings += [f"--{a}" for a in aliases]
    parser.add_argument(*spellings, dest=name.replace("-", "_"), **kw)


def _json_object(flag: str) -> Callable[[str], dict[str, Any]]:
    """An argparse type: a JSON object given on the command line (vLLM's --speculative-config)."""

    def parse(text: str) -> dict[str, Any]:
        try:
            v = json.loads(text)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"{flag}: not valid JSON ({e}): {text!r}") from None
        if not isinstance(v, dict):
            raise argparse.ArgumentTypeError(f"{flag}: expected a JSON object, got {text!r}")
        return v

    return parse


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    """The engine options every subcommand that builds an engine takes."""
    _add_model_flags(p)
    _add_scheduler_flags(p)
    _add_runtime_flags(p)
    _add_cache_flags(p)
    _add_trtllm_flags(p)


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    """The model and how its weights load."""
    p.add_argument(
        "model",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="a model directory (Hugging Face layout) or a Hugging Face Hub id (org/name; downloaded to the "
        "Hub cache); omitted -> the built-in tiny model",
    )
    p.add_argument(
        "--model",
        dest="model_option",
        default=None,
        metavar="MODEL",
        help="the model directory or Hub id, as vLLM's --model (the same as MODEL)",
    )
    _flag(
        p,
        "revision",
        default=None,
        metavar="REV",
        help="a Hub model's branch, tag or commit (default: main)",
    )
    _flag(
        p,
        "download_dir",
        default=None,
        metavar="DIR",
        help="where a Hub model is downloaded (default: the Hub cache, $HF_HUB_CACHE or $HF_HOME/hub)",
    )
    _flag(
        p,
        "config",
        metavar="FILE.yml",
        default=None,
        help="YAML options: the keys of trtllm-serve's extra-llm-api-config.yml, or flag names as in vLLM's "
        "--config; flags override it",
    )
    _flag(
        p,
        "extra_llm_api_options",
        metavar="FILE.yml",
        default=None,
        help="trtllm-serve's name for a YAML of options (read as --config; both may be given)",
    )
    _flag(
        p,
        "dtype",
        default=None,
        help="weights/activations dtype: auto, bfloat16, float16 (half), float32 (float)",
    )
    _flag(p, "device", default=None, help="auto, cpu or cuda")
    _flag(p, "load_format", default=None, help="auto, safetensors, or dummy (random weights)")
    _flag(
        p,
        "dummy_init",
        choices=("auto", "host"),
        default=None,
        help="where dummy weights are drawn: auto (the model's device; fast), host (the same values on "
        "every device)",
    )
    _flag(
        p,
        "quantization",
        default=None,
        help="weight format: fp8 (e4m3 weights, quantised at load from a 16-bit checkpoint); an FP8 "
        "checkpoint (ModelOpt, block fp8) is detected without it",
    )


def _add_scheduler_flags(p: argparse.ArgumentParser) -> None:
    """Batch and step sizes, sequence length and the scheduling policy."""
    _flag(
        p,
        "max_batch_size",
        type=int,
        default=None,
        aliases=("max-num-seqs",),
        help="most requests running at once (default: sized from memory, up to 1024 on a GPU)",
    )
    _flag(
        p,
        "max_num_tokens",
        type=int,
        default=None,
        aliases=("max-num-batched-tokens",),
        help="most tokens in one forward step (default: max(8192, max_batch_size))",
    )
    _flag(
        p,
        "max_step_ms",
        default=None,
        help="step-time target for chunked prefill: auto (default: 150 ms on CUDA, calibrated at "
        "start-up), off, or milliseconds",
    )
    _flag(
        p,
        "batch_wait_timeout_iters",
        type=int,
        default=None,
        help="batch waiting, as TensorRT-LLM's: while a full batch decodes and requests queue, admissions "
        "wait up to this many steps for their prompts to fill --batch-wait-max-tokens-ratio of the token "
        "budget, so fewer steps run eagerly (0: off)",
    )
    _flag(
        p,
        "batch_wait_max_tokens_ratio",
        type=float,
        default=None,
        help="batch waiting stops once decode rows and waiting prompts fill this share of max_num_tokens "
        "(default 0.75)",
    )
    _flag(
        p,
        "max_seq_len",
        type=int,
        default=None,
        aliases=("max-model-len", "max_model_len"),
        help="longest prompt + output (default: the model's)",
    )
    _flag(
        p,
        "enable_chunked_prefill",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="split long prompts into chunks that share steps (default on)",
    )
    _flag(
        p,
        "scheduling_policy",
        choices=SCHEDULING_POLICIES,
        default=None,
        help="fcfs (default: arrival order) or priority (each request's `priority`, lower first, then "
        "arrival)",
    )


def _add_runtime_flags(p: argparse.ArgumentParser) -> None:
    """Parallelism, memory, seed, warm-up and the remaining runtime switches."""
    _flag(
        p,
        "tp_size",
        type=int,
        default=None,
        aliases=("tensor-parallel-size", "tensor_parallel_size"),
        short=("-tp",),
        help="tensor parallel size: ranks one model spans (started here, or by torchrun across nodes)",
    )
    _flag(
        p,
        "ep_size",
        type=int,
        default=None,
        aliases=("moe-expert-parallel-size", "moe_expert_parallel_size"),
        help="expert parallel size: MoE experts sharded over this many of the tp_size ranks (divides it)",
    )
    _flag(
        p,
        "enable_expert_parallel",
        action="store_true",
        default=None,
        help="shard the MoE experts over every tensor-parallel rank (ep_size = tp_size), as vLLM's",
    )
    _flag(p, "seed", type=int, default=None, help="engine seed for sampling")
    _flag(
        p,
        "speculative_config",
        type=_json_object("--speculative-config"),
        default=None,
        metavar="JSON",
        help='speculative decoding, as vLLM\'s: \'{"method": "ngram", "num_speculative_tokens": 3}\' '
        "(prompt_lookup_min / prompt_lookup_max: the n-gram lengths looked up; disable_by_batch_size: no "
        "drafting above this many running requests); TensorRT-LLM's decoding_type form too",
    )
    _flag(
        p,
        "warmup",
        choices=("auto", "on", "off"),
        default=None,
        help="compile every kernel variant before ready: auto (on CUDA), on, off",
    )
    _flag(
        p,
        "strict_warmup",
        action="store_true",
        default=None,
        help="fail any step that makes Triton compile after ready (a warm-up gap)",
    )
    _flag(
        p,
        "async_scheduling",
        choices=("on", "off"),
        nargs="?",
        const="on",
        default=None,
        help="overlap the host's per-step work with the next step on the GPU (default on; alone, as vLLM's "
        "flag: on)",
    )
    _flag(
        p,
        "cache_dir",
        default=None,
        metavar="DIR",
        help="persistent kernel cache (Triton variants and autotune results; default ~/.cache/hyserve)",
    )
    _flag(
        p,
        "trust_remote_code",
        action="store_true",
        default=False,
        help="accepted for compatibility; hyserve runs no remote code",
    )


def _add_cache_flags(p: argparse.ArgumentParser) -> None:
    """The cache pools: memory share, dtypes, prefix caching; CUDA graphs."""
    _flag(
        p,
        "kv_cache_free_gpu_memory_fraction",
        type=float,
        default=None,
        help="fraction of the GPU memory free after the weights for the KV cache and Mamba state pools "
        "(default 0.9)",
    )
    _flag(
        p,
        "gpu_memory_utilization",
        type=float,
        default=None,
        help="fraction of the GPU's total memory this server may use in all (weights, activations, pools), "
        "as vLLM's; replaces --kv_cache_free_gpu_memory_fraction",
    )
    _flag(
        p,
        "kv_cache_dtype",
        default=None,
        help="KV cache dtype: auto (the model's), fp8 (fp8_e4m3), bfloat16, float16, float32",
    )
    _flag(
        p,
        "mamba_ssm_cache_dtype",
        default=None,
        help="stored Mamba SSM state: float32 (default; auto), bfloat16, float16",
    )
    _flag(
        p,
        "enable_prefix_caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="prefix caching of KV blocks and Mamba snapshots (default on)",
    )
    _flag(
        p,
        "enforce_eager",
        action="store_true",
        default=None,
        help="run every step without CUDA graphs",
    )
    _flag(
        p,
        "compilation_config",
        short=("-O",),
        default=None,
        metavar="JSON|LEVEL",
        help="vLLM's: cudagraph_mode (NONE, FULL_DECODE_ONLY: no piecewise graphs, FULL_AND_PIECEWISE), "
        "cudagraph_capture_sizes, max_cudagraph_capture_size, or a level (-O0: no CUDA graphs); its "
        "torch.compile keys are accepted without effect",
    )


def _add_trtllm_flags(p: argparse.ArgumentParser) -> None:
    """trtllm-serve flags whose only value hyserve serves is accepted (any other is refused with why)."""
    _flag(p, "backend", default=None, help="trtllm-serve's backend: only pytorch (hyserve's own)")
    _flag(p, "max_beam_width", type=int, default=None, help="only 1: hyserve has no beam search")


def _add_serve_parser(sub: Any) -> None:
    p = sub.add_parser(
        "serve", help="run the OpenAI-compatible server", description="Run the OpenAI-compatible HTTP server."
    )
    _add_engine_flags(p)
    _flag(p, "host", default=None, help="bind address (default 127.0.0.1; 0.0.0.0 for all interfaces)")
    _flag(p, "port", type=int, default=None, help="port (default 8000)")
    _flag(
        p,
        "served_model_name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="names clients may use in `model`; the first is the one responses and metrics report (default: "
        "the directory's name, or the Hub id)",
    )
    _flag(
        p,
        "api_key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1 routes (default: $HYSERVE_API_KEY, else "
        "$VLLM_API_KEY; an empty key is refused: see --no_auth)",
    )
    _flag(
        p,
        "no_auth",
        action="store_true",
        default=None,
        help="serve without authentication even if an (empty) --api_key is given",
    )
    _flag(
        p,
        "reasoning_parser",
        default=None,
        help="split <think> output into reasoning_content: nemotron-v3 (aliases: nemotron_v3, nano_v3, "
        "super_v3, deepseek-r1, qwen3)",
    )
    _flag(
        p,
        "tool_parser",
        default=None,
        aliases=("tool-call-parser", "tool_call_parser"),
        help="parse tool calls: qwen3_coder",
    )
    _add_chat_flags(p)
    _add_limit_flags(p)
    _add_cors_flags(p)
    _add_log_flags(p)
    p.set_defaults(func=cmd_serve)


def _add_cors_flags(p: argparse.ArgumentParser) -> None:
    """CORS, as vLLM's flags (lists as JSON, or comma-separated); without origins, no CORS."""
    _flag(
        p,
        "allowed_origins",
        default=None,
        metavar="JSON_LIST",
        help="origins whose browser pages may call the API, e.g. '[\"https://app.example\"]' (default none: "
        "no CORS headers)",
    )
    _flag(p, "allowed_methods", default=None, metavar="JSON_LIST", help='CORS methods (default ["*"])')
    _flag(
        p, "allowed_headers", default=None, metavar="JSON_LIST", help='CORS request headers (default ["*"])'
    )
    _flag(p, "allow_credentials", action="store_true", default=None, help="CORS: allow credentials")


def _add_chat_flags(p: argparse.ArgumentParser) -> None:
    """Chat template, default sampling from the model's generation config, tool choice."""
    _flag(
        p,
        "enable_auto_tool_choice",
        action="store_true",
        default=None,
        help="as vLLM's: let the model choose tools (needs --tool-call-parser; parsing follows it anyway)",
    )
    _flag(
        p,
        "chat_template",
        default=None,
        metavar="FILE|TEMPLATE",
        help="a Jinja chat template (a file, or the template itself) in place of the checkpoint's",
    )
    _flag(
        p,
        "generation_config",
        default=None,
        metavar="auto|vllm|DIR",
        help="default sampling (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens) of "
        "requests that leave it out: auto (the model's generation_config.json, default), vllm (none), or a "
        "directory holding a generation_config.json",
    )


def _add_limit_flags(p: argparse.ArgumentParser) -> None:
    """Per-request limits and shutdown."""
    _flag(
        p,
        "max_logprobs",
        type=int,
        default=None,
        help="most logprobs / top_logprobs a request may ask for (default 20, the most there is; -1: 20)",
    )
    _flag(
        p,
        "default_max_tokens",
        type=int,
        default=None,
        help="max_tokens for requests that omit it: the room left in max_seq_len, capped at this (8192)",
    )
    _flag(
        p,
        "max_request_body_bytes",
        type=int,
        default=None,
        help="largest request body (default 32 MiB: a 1M-token prompt as token ids, with room); larger is "
        "a 413",
    )
    _flag(
        p,
        "shutdown_timeout",
        type=float,
        default=None,
        help="on SIGTERM, seconds in-flight requests get to finish before they are aborted (default 30)",
    )
    _flag(
        p,
        "max_sequences_per_request",
        type=int,
        default=None,
        help="most sequences (prompts x n) one request may ask for (default 1024); more is a 400",
    )
    _flag(
        p,
        "request_read_timeout",
        type=float,
        default=None,
        help="seconds a request's headers, then its body, may take to arrive (default 30; 0: no limit); "
        "later is a 408",
    )
    _flag(
        p,
        "max_connections",
        type=int,
        default=None,
        help="open connections past which requests are answered 503 (default 8192)",
    )
    _flag(
        p,
        "max_inflight_body_bytes",
        type=int,
        default=None,
        help="bytes of request bodies held at once across requests (default 512 MiB); more is a 503",
    )
    _flag(
        p,
        "engine_process",
        choices=("auto", "on", "off"),
        default=None,
        help="run the engine loop in its own process (on), on a thread of the server's (off), or in its own "
        "process when it runs on CUDA (auto, the default)",
    )


def _add_log_flags(p: argparse.ArgumentParser) -> None:
    """The log: level, format, per-request lines, the periodic stats line."""
    _flag(
        p,
        "log_level",
        default=None,
        aliases=("uvicorn-log-level", "uvicorn_log_level"),
        help="log level of hyserve and uvicorn: critical, error, warning, info (default), debug, trace",
    )
    _flag(p, "log_format", choices=("text", "json"), default=None, help="text (default) or json lines")
    _flag(
        p,
        "disable_log_requests",
        action="store_true",
        default=None,
        aliases=("disable-uvicorn-access-log", "disable_uvicorn_access_log"),
        help="no per-request access log",
    )
    _flag(
        p,
        "enable_log_requests",
        action="store_true",
        default=None,
        help="log each generation request (its id, prompt length and sampling) and how it ended",
    )
    _flag(
        p,
        "disable_log_stats",
        action="store_true",
        default=None,
        help="no stats line every 10 s (throughput, running / waiting, cache usage, prefix hits)",
    )


def _add_generate_parser(sub: Any) -> None:
    p = sub.add_parser(
        "generate",
        help="generate text offline (no server)",
        description="Generate from a prompt with the offline LLM API.",
    )
    _add_engine_flags(p)
    p.add_argument(
        "-p",
        "--prompt",
        action="append",
        default=None,
        metavar="TEXT",
        help="prompt text (repeat for several prompts)",
    )
    _flag(
        p,
        "prompt_ids",
        action="append",
        default=None,
        metavar="1,2,3",
        help="a prompt as comma-separated token ids (repeatable)",
    )
    _flag(p, "max_tokens", type=int, default=32, help="tokens to generate (default 32)")
    _flag(p, "temperature", type=float, default=0.0, help="0 = greedy (default)")
    _flag(p, "top_p", type=float, default=1.0)
    _flag(p, "top_k", type=int, default=0)
    _flag(p, "min_p", type=float, default=0.0)
    _flag(p, "stop", action="append", default=None, metavar="STRING", help="stop string (repeatable)")
    _flag(p, "ignore_eos", action="store_true", default=False)
    _flag(p, "logprobs", type=int, default=None, metavar="K", help="return top-K logprobs per token")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    p.set_defaults(func=cmd_generate)


def _add_make_tiny_parser(sub: Any) -> None:
    p = sub.add_parser(
        "make-tiny",
        help="write a deterministic tiny checkpoint",
        description="Write a tiny NemotronH checkpoint (config, safetensors, tokenizer).",
    )
    p.add_argument("dir", metavar="DIR")
    p.add_argument("--variant", choices=("dense", "moe", "latent-moe"), default="dense")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--fp8",
        action="store_true",
        help="write the projections and experts as FP8 (ModelOpt's layout, per-tensor scales)",
    )
    p.add_argument(
        "--mtp",
        action="store_true",
        help="with a multi-token-prediction block (mtp.* tensors, num_nextn_predict_layers 1), as Nemotron 3 "
        "ships it",
    )
    p.set_defaults(func=cmd_make_tiny)


def _register_optional_subcommands(sub: Any) -> None:
    """Extension point: `hyserve bench` lives in hyserve/bench/cli.py and registers itself with
    `add_parser(subparsers)`, setting `func=` on its parser."""
    import importlib
    import importlib.util

    try:
        spec = importlib.util.find_spec("hyserve.bench.cli")
    except ModuleNotFoundError:
        spec = None
    if spec is None:
        return
    importlib.import_module("hyserve.bench.cli").add_parser(sub)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hyserve", description="Serving engine for hybrid Mamba2 + attention LLMs"
    )
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_serve_parser(sub)
    _add_generate_parser(sub)
    _add_make_tiny_parser(sub)
    _register_optional_subcommands(sub)
    return parser


# ---- options: YAML + flags -> engine options dict ----------------------------------------------------------


def _flag_options(args: argparse.Namespace) -> dict[str, Any]:
    """The options given as flags, by their names (a flag left out is not there)."""
    from hyserve.compat import known_names

    names = known_names()
    out = {k: v for k, v in vars(args).items() if k in names and v is not None and k not in _IGNORED_FLAGS}
    if out.get("async_scheduling") in ("on", "off"):
        out["async_scheduling"] = out["async_scheduling"] == "on"
    positional, flag = getattr(args, "model", None), getattr(args, "model_option", None)
    if positional is not None and flag is not None and positional != flag:
        raise ConfigError(f"MODEL ({positional!r}) and --model ({flag!r}) differ: give the model once")
    if positional is None and flag is not None:
        out["model"] = flag
    return out


def _file_options(args: argparse.Namespace) -> Any:
    """The options of --config and --extra_llm_api_options (one option in both must have one value)."""
    from hyserve import compat
    from hyserve.config import load_yaml_options

    opts = compat.Options("the YAML files")
    for flag in ("config", "extra_llm_api_options"):
        path = getattr(args, flag, None)
        if path:
            opts = compat.combine(
                opts, compat.translate(load_yaml_options(path, flag=f"--{flag}"), f"{path}")
            )
    return opts


def engine_options_from_args(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """(engine options dict, server options, ignored flag names) from parsed arguments: the YAML files'
    options under the flags', in whichever server's spelling (hyserve/compat.py).

    Raises ConfigError for a YAML that can't be read or an option given twice with different values."""
    from hyserve import compat

    try:
        opts = compat.merge(_file_options(args), compat.translate(_flag_options(args), "the command line"))
        engine = compat.finish(opts)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    ignored = [f"--{n}" for n in _IGNORED_FLAGS if getattr(args, n, False)] + opts.ignored
    return engine, opts.server, ignored


def _build_config(opts: dict[str, Any]) -> Any:
    from hyserve.config import build_engine_config

    try:
        return build_engine_config(opts)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _ignored_warning(config: Any, ignored_flags: list[str]) -> str | None:
    keys = list(getattr(config, "ignored_keys", ())) + ignored_flags
    return f"accepted for compatibility but without effect in hyserve: {', '.join(keys)}" if keys else None


def _warn_ignored(config: Any, ignored_flags: list[str], err: Callable[[str], None]) -> None:
    warning = _ignored_warning(config, ignored_flags)
    if warning:
        err(f"hyserve: warning: {warning}")


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---- subcommands -------------------------------------------------------------------------------------------


def _run_if_headless_rank(config: Any) -> None:
    """Under torchrun, ranks > 0 serve nothing and take no prompts: such a rank follows rank 0 here until
    it shuts down, then the process exits with the rank's status. A no-op on rank 0 and without torchrun."""
    from hyserve.engine.parallel.launch import is_headless_rank

    if not is_headless_rank():
        return
    import os

    from hyserve.engine.lifecycle.worker import run_worker

    rc = run_worker(config, log=_stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)  # a broken NCCL communicator can block interpreter teardown


def cmd_serve(args: argparse.Namespace) -> int:
    opts, server, ignored = engine_options_from_args(args)
    config = _build_config(opts)
    _run_if_headless_rank(config)
    server_options = build_server_options(lambda name, default: server.get(name, default), config)
    from hyserve.server.serve import run_server

    warning = _ignored_warning(config, ignored)
    try:
        return run_server(config, server_options, warnings=[warning] if warning else [])
    except (
        ValueError,
        FileNotFoundError,
    ) as e:  # engine start-up: bad model dir, inconsistent capacity settings, a port in use
        raise ConfigError(str(e)) from None


def _strict_bool(pick: Callable[[str, Any], Any], name: str, default: bool) -> bool:
    v = pick(name, default)
    if not isinstance(v, bool):
        raise ConfigError(f"{name}: expected true or false, got {v!r}")
    return v


def _api_key(pick: Callable[[str, Any], Any]) -> str | None:
    """--api_key, else the YAML's api_key, else $HYSERVE_API_KEY / $VLLM_API_KEY; None with --no_auth."""
    from hyserve import envs

    given = pick("api_key", None)
    if _strict_bool(pick, "no_auth", False):
        if given:
            raise ConfigError("--no_auth and a non-empty api_key were both given: choose one")
        return None
    return envs.HYSERVE_API_KEY if given is None else given


def build_server_options(pick: Callable[[str, Any], Any], config: Any) -> Any:
    """The server settings (flag, else YAML key, else default), each checked by `ServerOptions`: a bad one
    is a ConfigError naming its key, before the model loads."""
    from hyserve.server.state import ServerOptions

    api_key = _api_key(pick)
    given = (config.model, (config.model or "").rstrip("/").rsplit("/", 1)[-1])
    aliases = tuple(a for a in (*config.served_names, *given) if a)
    try:
        return ServerOptions(
            host=pick("host", "127.0.0.1"),
            port=pick("port", 8000),
            api_key=api_key,
            reasoning_parser=pick("reasoning_parser", None),
            tool_parser=pick("tool_parser", None),
            model_aliases=aliases,
            served_model_names=config.served_names,
            default_max_tokens=pick("default_max_tokens", 8192),
            log_level=pick("log_level", "info"),
            access_log=not _strict_bool(pick, "disable_log_requests", False),
            max_request_body_bytes=pick("max_request_body_bytes", ServerOptions.max_request_body_bytes),
            shutdown_timeout=pick("shutdown_timeout", ServerOptions.shutdown_timeout),
            chat_template=pick("chat_template", None),
            generation_config=pick("generation_config", "auto"),
            max_logprobs=pick("max_logprobs", ServerOptions.max_logprobs),
            enable_auto_tool_choice=pick("enable_auto_tool_choice", False),
            log_requests=_strict_bool(pick, "enable_log_requests", False),
            log_stats=not _strict_bool(pick, "disable_log_stats", False),
            log_format=pick("log_format", "text"),
            allowed_origins=pick("allowed_origins", ServerOptions.allowed_origins),
            allowed_methods=pick("allowed_methods", ServerOptions.allowed_methods),
            allowed_headers=pick("allowed_headers", ServerOptions.allowed_headers),
            allow_credentials=pick("allow_credentials", False),
            max_sequences_per_request=pick(
                "max_sequences_per_request", ServerOptions.max_sequences_per_request
            ),
            request_read_timeout=pick("request_read_timeout", ServerOptions.request_read_timeout),
            max_connections=pick("max_connections", ServerOptions.max_connections),
            max_inflight_body_bytes=pick("max_inflight_body_bytes", ServerOptions.max_inflight_body_bytes),
            engine_process=pick("engine_process", ServerOptions.engine_process),
        )
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _parse_ids(s: str) -> list[int]:
    try:
        ids = [int(x) for x in s.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise ConfigError(f"--prompt-ids: expected comma-separated integers, got {s!r}") from None
    if not ids:
        raise ConfigError("--prompt-ids: no token ids given")
    return ids


def cmd_generate(args: argparse.Namespace) -> int:
    opts, _server_yaml, ignored = engine_options_from_args(args)
    model_arg = opts.get("model")
    if (
        model_arg
        and not args.prompt
        and not args.prompt_ids
        and not Path(str(model_arg)).expanduser().exists()
        and "/" not in str(model_arg)
    ):
        raise ConfigError(  # `hyserve generate "Hello"`: the text went to MODEL
            f"{model_arg!r} is not a local directory: the first argument of `hyserve generate` is MODEL (a "
            "checkpoint directory; leave it out for the built-in tiny model); give the prompt with -p, as in "
            f"`hyserve generate -p {json.dumps(str(model_arg))}`"
        )
    config = _build_config(opts)  # validate everything before loading anything
    _run_if_headless_rank(config)
    prompts: list[str | list[int]] = list(args.prompt or []) + [
        _parse_ids(s) for s in (args.prompt_ids or [])
    ]
    if not prompts:
        prompts = ["Hello, my name is"]
    _warn_ignored(config, ignored, _stderr)
    from hyserve.engine.errors import RequestRejected
    from hyserve.engine.llm import LLM
    from hyserve.engine.sampling_params import SamplingParams

    try:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            min_p=args.min_p,
            stop=tuple(args.stop or ()),
            ignore_eos=args.ignore_eos,
            logprobs=args.logprobs,
            seed=opts.get("seed"),
        )
    except ValueError as e:
        raise ConfigError(str(e)) from None
    llm_opts = dict(opts)
    model = llm_opts.pop("model", None)
    dtype = llm_opts.pop("dtype", "auto")
    device = llm_opts.pop("device", "auto")
    load_format = llm_opts.pop("load_format", "auto")
    try:
        llm = LLM(model, dtype=dtype, device=device, load_format=load_format, log=_stderr, **llm_opts)
        outputs = llm.generate(prompts, params)
    except RequestRejected as e:
        raise ConfigError(str(e)) from None
    except (ValueError, FileNotFoundError) as e:
        raise ConfigError(str(e)) from None
    for out in outputs:
        if args.json:
            rec: dict[str, Any] = {
                "prompt": out.prompt,
                "prompt_token_ids": out.prompt_token_ids,
                "text": out.text,
                "token_ids": out.token_ids,
                "finish_reason": out.finish_reason,
                "stop_reason": out.stop_reason,
                "num_cached_tokens": out.num_cached_tokens,
                "metrics": out.metrics,
            }
            if out.logprobs is not None:
                rec["logprobs"] = [
                    {
                        "token_id": lp.token_id,
                        "logprob": lp.logprob,
                        "top": {str(k): v for k, v in lp.top.items()},
                    }
                    for lp in out.logprobs
                ]
            print(json.dumps(rec), flush=True)
        else:
            print(out.text if out.text else " ".join(map(str, out.token_ids)), flush=True)
    return 0


def cmd_make_tiny(args: argparse.Namespace) -> int:
    from hyserve.model.tiny import make_tiny

    try:
        path = make_tiny(args.dir, variant=args.variant, seed=args.seed, fp8=args.fp8, mtp=args.mtp)
    except (ValueError, OSError) as e:
        raise ConfigError(str(e)) from None
    print(path, flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.version:
        from importlib import metadata

        try:
            print(metadata.version("hyserve"))
        except metadata.PackageNotFoundError:
            print("unknown")
        return 0
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_CONFIG_ERROR
    try:
        return int(args.func(args) or 0)
    except ConfigError as e:
        one_line = " ".join(str(e).split())  # e.g. YAML parser errors span several lines
        print(f"hyserve {args.command}: error: {one_line}", file=sys.stderr, flush=True)
        return EXIT_CONFIG_ERROR
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
