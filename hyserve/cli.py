"""The `hyserve` command line.

    hyserve serve [MODEL] [--config extra-llm-api-config.yml] [--host H] [--port P] [--max_seq_len N] ...
    hyserve generate [MODEL] (--prompt TEXT | --prompt-ids 1,2,3) [--max-tokens N] [--json] ...
    hyserve make-tiny DIR [--variant dense|moe|latent-moe] [--seed N] [--fp8]
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


def _flag(parser: argparse.ArgumentParser | Any, name: str, aliases: tuple[str, ...] = (), **kw: Any) -> None:
    """Add `--name_with_underscores` and its hyphenated spelling as one option (and `aliases`, the spellings
    of other servers: vLLM's --max-num-seqs)."""
    spellings = [f"--{name}"]
    hyphen = f"--{name.replace('_', '-')}"
    if hyphen not in spellings:
        spellings.append(hyphen)
    under = f"--{name.replace('-', '_')}"
    if under not in spellings:
        spellings.append(under)
    spellings += [f"--{a}" for a in aliases]
    parser.add_argument(*spellings, dest=name.replace("-", "_"), **kw)


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    """The engine options every subcommand that builds an engine takes."""
    _add_model_flags(p)
    _add_scheduler_flags(p)
    _add_runtime_flags(p)


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    """The model and how its weights load."""
    p.add_argument(
        "model",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="model directory (Hugging Face layout); omitted -> the built-in tiny model",
    )
    _flag(
        p,
        "config",
        metavar="FILE.yml",
        default=None,
        help="YAML options (the keys of trtllm-serve's extra-llm-api-config.yml); flags override it",
    )
    _flag(p, "dtype", default=None, help="weights/activations dtype: auto, bfloat16, float16, float32")
    _flag(p, "device", default=None, help="auto, cpu or cuda")
    _flag(p, "load_format", default=None, help="auto, safetensors, or dummy (random weights)")
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
    _flag(p, "max_seq_len", type=int, default=None, help="longest prompt + output (default: the model's)")
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
        help="tensor parallel size: ranks one model spans (started here, or by torchrun across nodes)",
    )
    _flag(
        p,
        "ep_size",
        type=int,
        default=None,
        help="expert parallel size: MoE experts sharded over this many of the tp_size ranks (divides it)",
    )
    _flag(
        p,
        "kv_cache_free_gpu_memory_fraction",
        type=float,
        default=None,
        help="fraction of free GPU memory for the KV cache and Mamba state pools",
    )
    _flag(p, "seed", type=int, default=None, help="engine seed for sampling")
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
        default=None,
        help="overlap the host's per-step work with the next step on the GPU (default on)",
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


def _add_serve_parser(sub: Any) -> None:
    p = sub.add_parser(
        "serve", help="run the OpenAI-compatible server", description="Run the OpenAI-compatible HTTP server."
    )
    _add_engine_flags(p)
    _flag(p, "host", default=None, help="bind address (default 127.0.0.1; 0.0.0.0 for all interfaces)")
    _flag(p, "port", type=int, default=None, help="port (default 8000)")
    _flag(p, "served_model_name", default=None, help="name clients use in `model` (default: the dir name)")
    _flag(
        p,
        "api_key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1 routes (an empty key is refused: see --no_auth)",
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
        help="split <think> output into reasoning_content: nemotron-v3 (aliases: deepseek-r1, qwen3)",
    )
    _flag(p, "tool_parser", default=None, help="parse tool calls: qwen3_coder")
    _flag(
        p,
        "default_max_tokens",
        type=int,
        default=None,
        help="max_tokens for requests that omit it: the room left in max_seq_len, capped at this (8192)",
    )
    _flag(
        p,
        "log_level",
        default=None,
        help="uvicorn log level: critical, error, warning, info (default), debug, trace",
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
    _flag(p, "disable_log_requests", action="store_true", default=False, help="no per-request access log")
    p.set_defaults(func=cmd_serve)


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


def engine_options_from_args(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """(engine options dict, server options from the YAML, ignored flag names) from parsed arguments.

    Raises ConfigError for a YAML that can't be read."""
    from hyserve.config import SERVER_YAML_KEYS, load_yaml_options

    opts: dict[str, Any] = {}
    if getattr(args, "config", None):
        try:
            opts = dict(load_yaml_options(args.config))
        except ValueError as e:
            raise ConfigError(str(e)) from None
    server_yaml = {k: opts.pop(k) for k in SERVER_YAML_KEYS if k in opts}
    if args.model is not None:
        opts["model"] = args.model
    for name in (
        "dtype",
        "device",
        "load_format",
        "quantization",
        "max_batch_size",
        "max_num_tokens",
        "max_step_ms",
        "max_seq_len",
        "scheduling_policy",
        "tp_size",
        "ep_size",
        "seed",
        "served_model_name",
        "warmup",
        "strict_warmup",
        "cache_dir",
        "async_scheduling",
    ):
        v = getattr(args, name, None)
        if v is not None:
            opts[name] = (v == "on") if name == "async_scheduling" else v
    if args.kv_cache_free_gpu_memory_fraction is not None:
        kv = opts.get("kv_cache_config")
        kv = dict(kv) if isinstance(kv, dict) else ({} if kv is None else kv)
        if not isinstance(kv, dict):
            raise ConfigError(f"kv_cache_config: expected a mapping, got {kv!r}")
        kv["free_gpu_memory_fraction"] = args.kv_cache_free_gpu_memory_fraction
        opts["kv_cache_config"] = kv
    ignored = [f"--{n}" for n in _IGNORED_FLAGS if getattr(args, n, False)]
    return opts, server_yaml, ignored


def _build_config(opts: dict[str, Any]) -> Any:
    from hyserve.config import build_engine_config

    try:
        return build_engine_config(opts)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _warn_ignored(config: Any, ignored_flags: list[str], err: Callable[[str], None]) -> None:
    keys = list(getattr(config, "ignored_keys", ())) + ignored_flags
    if keys:
        err(f"hyserve: warning: accepted for compatibility but without effect in hyserve: {', '.join(keys)}")


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _stdout(msg: str) -> None:
    print(msg, flush=True)


# ---- subcommands -------------------------------------------------------------------------------------------


def _run_if_headless_rank(config: Any) -> None:
    """Under torchrun, ranks > 0 serve nothing and take no prompts: such a rank follows rank 0 here until
    it shuts down, then the process exits with the rank's status. A no-op on rank 0 and without torchrun."""
    from hyserve.engine.launch import is_headless_rank

    if not is_headless_rank():
        return
    import os

    from hyserve.engine.worker import run_worker

    rc = run_worker(config, log=_stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)  # a broken NCCL communicator can block interpreter teardown


def cmd_serve(args: argparse.Namespace) -> int:
    opts, server_yaml, ignored = engine_options_from_args(args)
    config = _build_config(opts)
    _run_if_headless_rank(config)

    def pick(name: str, default: Any) -> Any:
        v = getattr(args, name, None)
        if v is not None:
            return v
        return server_yaml.get(name, default)

    server_options = build_server_options(pick, config)
    _warn_ignored(config, ignored, _stdout)
    from hyserve.server.serve import run_server

    try:
        return run_server(config, server_options, log=_stdout)
    except (
        ValueError,
        FileNotFoundError,
    ) as e:  # engine start-up: bad model dir, inconsistent capacity settings
        raise ConfigError(str(e)) from None


def build_server_options(pick: Callable[[str, Any], Any], config: Any) -> Any:
    """The server settings (flag, else YAML key, else default), each checked by `ServerOptions`: a bad one
    is a ConfigError naming its key, before the model loads."""
    from hyserve.server.state import ServerOptions

    api_key = pick("api_key", None)
    no_auth = pick("no_auth", False)
    if not isinstance(no_auth, bool):
        raise ConfigError(f"no_auth: expected true or false, got {no_auth!r}")
    if no_auth:
        if api_key:
            raise ConfigError("--no_auth and a non-empty api_key were both given: choose one")
        api_key = None
    aliases = tuple(a for a in (config.model, (config.model or "").rstrip("/").rsplit("/", 1)[-1]) if a)
    try:
        return ServerOptions(
            host=pick("host", "127.0.0.1"),
            port=pick("port", 8000),
            api_key=api_key,
            reasoning_parser=pick("reasoning_parser", None),
            tool_parser=pick("tool_parser", None),
            model_aliases=aliases,
            default_max_tokens=pick("default_max_tokens", 8192),
            log_level=pick("log_level", "info"),
            access_log=not pick("disable_log_requests", False),
            max_request_body_bytes=pick("max_request_body_bytes", ServerOptions.max_request_body_bytes),
            shutdown_timeout=pick("shutdown_timeout", ServerOptions.shutdown_timeout),
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
        path = make_tiny(args.dir, variant=args.variant, seed=args.seed, fp8=args.fp8)
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
