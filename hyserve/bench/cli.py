"""`hyserve bench serve | offline | needle | plot`. hyserve/cli.py calls `add_parser(subparsers)`.

Flag names follow `vllm bench serve` where it has one (`--base-url`, `--endpoint`, `--dataset-name`,
`--random-input-len`, `--max-concurrency`, `--request-rate`, `--save-result`, ...). A bad flag value is an
argparse error (exit 2); a problem found while running (server unreachable, unknown model) prints one line
`hyserve bench <cmd>: error: ...` and exits 1.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hyserve.bench.arrivals import RAMP_UP_STRATEGIES, RampUp
from hyserve.bench.datasets import DATASETS
from hyserve.bench.http_client import BenchError, endpoint_kind

EXIT_FAILED = 1
EXIT_USAGE = 2


# ---- argparse value types (errors become "argument --x: ..." usage errors) ------------------------------


def _type(fn: Callable[[str], Any], name: str) -> Callable[[str], Any]:
    def parse(s: str) -> Any:
        try:
            return fn(s)
        except (ValueError, TypeError) as e:
            raise argparse.ArgumentTypeError(str(e) or f"invalid {name}: {s!r}") from None

    parse.__name__ = name
    return parse


def _pos_int(s: str) -> int:
    v = int(s)
    if v < 1:
        raise ValueError(f"must be an integer >= 1, got {s!r}")
    return v


def _nonneg_int(s: str) -> int:
    v = int(s)
    if v < 0:
        raise ValueError(f"must be an integer >= 0, got {s!r}")
    return v


def _nonneg_float(s: str) -> float:
    v = float(s)
    if not (v >= 0 and math.isfinite(v)):
        raise ValueError(f"must be a number >= 0, got {s!r}")
    return v


def _pos_float(s: str) -> float:
    v = float(s)
    if not (v > 0 and math.isfinite(v)):
        raise ValueError(f"must be a number > 0, got {s!r}")
    return v


def _rate(s: str) -> float:
    v = float(s)
    if not v > 0:
        raise ValueError(f"must be > 0 requests/s or inf, got {s!r}")
    return v


def _range_ratio(s: str) -> float:
    v = float(s)
    if not 0 <= v < 1:
        raise ValueError(f"must be in [0, 1), got {s!r}")
    return v


def _fraction(s: str) -> float:
    v = float(s)
    if not 0 <= v <= 1:
        raise ValueError(f"must be in [0, 1], got {s!r}")
    return v


def _pos_int_list(s: str) -> tuple[int, ...]:
    vals = tuple(_pos_int(x) for x in s.split(",") if x.strip())
    if not vals:
        raise ValueError(f"expected comma-separated integers >= 1, got {s!r}")
    return vals


def _percentiles(s: str) -> tuple[float, ...]:
    vals = []
    for x in s.split(","):
        if not x.strip():
            continue
        v = float(x)
        if not 0 < v <= 100:
            raise ValueError(f"percentiles must be in (0, 100], got {x.strip()!r}")
        vals.append(v)
    if not vals:
        raise ValueError(f"expected comma-separated percentiles, got {s!r}")
    return tuple(vals)


def _sizes(s: str) -> tuple[int, ...]:
    from hyserve.bench.needle import parse_size

    vals = tuple(parse_size(x) for x in s.split(",") if x.strip())
    if not vals:
        raise ValueError(f"expected comma-separated sizes such as 1k,8k,1M, got {s!r}")
    return vals


def _fraction_list(s: str) -> tuple[float, ...]:
    vals = tuple(_fraction(x.strip()) for x in s.split(",") if x.strip())
    if not vals:
        raise ValueError(f"expected comma-separated fractions in [0, 1] such as 0,0.5,1, got {s!r}")
    return vals


def _json_object(s: str) -> dict[str, Any] | None:
    try:
        v = json.loads(s)
    except ValueError as e:
        raise ValueError(f"not valid JSON ({e}): {s!r}") from None
    if v is not None and not isinstance(v, dict):
        raise ValueError(f"expected a JSON object, got {s!r}")
    return v


def _endpoint(s: str) -> str:
    try:
        endpoint_kind(s)
    except BenchError as e:
        raise ValueError(str(e)) from None
    return s if s.startswith("/") else "/" + s


def _burstiness(s: str) -> float:
    from hyserve.bench.arrivals import check_burstiness

    return check_burstiness(float(s))


def _latency_metrics(s: str) -> tuple[str, ...]:
    from hyserve.bench.metrics import LATENCY_METRICS

    vals = tuple(x.strip().lower() for x in s.split(",") if x.strip())
    bad = [v for v in vals if v not in LATENCY_METRICS]
    if bad or not vals:
        raise ValueError(f"expected a comma-separated subset of {','.join(LATENCY_METRICS)}, got {s!r}")
    return tuple(dict.fromkeys(vals))


POS_INT = _type(_pos_int, "positive integer")
NONNEG_INT = _type(_nonneg_int, "non-negative integer")
NONNEG_FLOAT = _type(_nonneg_float, "non-negative number")
POS_FLOAT = _type(_pos_float, "positive number")
RATE = _type(_rate, "request rate")
RANGE_RATIO = _type(_range_ratio, "range ratio")
FRACTION = _type(_fraction, "fraction")
POS_INT_LIST = _type(_pos_int_list, "integer list")
PERCENTILES = _type(_percentiles, "percentile list")
SIZES = _type(_sizes, "size list")
FRACTIONS = _type(_fraction_list, "fraction list")
JSON_OBJECT = _type(_json_object, "JSON object")
ENDPOINT = _type(_endpoint, "endpoint")
LATENCY_LIST = _type(_latency_metrics, "metric list")
BURSTINESS = _type(_burstiness, "burstiness")


# ---- parsers ---------------------------------------------------------------------------------------------


def _add_server_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument(
        "--base-url",
        default=None,
        help="server URL, e.g. http://127.0.0.1:8000 (a trailing /v1 is fine); overrides --host/--port",
    )
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=POS_INT, default=8000)
    g.add_argument(
        "--model", default=None, help="model name to send (default: the first id of GET /v1/models)"
    )
    g.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")


def _add_result_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("results")
    g.add_argument(
        "--save-result", action="store_true", help="write the result JSON (and PNGs with matplotlib)"
    )
    g.add_argument("--result-dir", default=".", help="directory for the JSON and PNGs (default: .)")
    g.add_argument(
        "--result-filename", default=None, help="JSON file name (default: <bench>-<model>-<time>.json)"
    )
    g.add_argument(
        "--git-sha", default=None, help="commit to record (default: git rev-parse of this checkout)"
    )
    g.add_argument(
        "--metric-percentiles",
        type=PERCENTILES,
        default=(50.0, 99.0),
        help="comma-separated percentiles to report (default: 50,99; P99 is always reported)",
    )


def _add_dataset_flags(p: argparse.ArgumentParser) -> None:
    """`serve`'s synthetic prompts: which dataset, how many, how long, which token ids."""
    d = p.add_argument_group("dataset")
    d.add_argument(
        "--dataset-name",
        choices=DATASETS,
        default="random",
        help="random: --random-prefix-len common ids + random ids; shared-prefix: --num-prefixes "
        "prefixes of --shared-prefix-len ids, each shared by a group of prompts, + random ids; sharegpt: "
        "the first turns of a local ShareGPT JSON (--dataset-path)",
    )
    d.add_argument(
        "--dataset-path", default=None, metavar="FILE", help="sharegpt: the ShareGPT JSON file (a local path)"
    )
    d.add_argument(
        "--sharegpt-output-len",
        type=POS_INT,
        default=None,
        help="sharegpt: max_tokens of every request (default: the length of the conversation's reply)",
    )
    d.add_argument(
        "--tokenizer",
        default=None,
        metavar="DIR",
        help="sharegpt: count prompt and reply lengths with this model directory's tokenizer.json "
        "(default: words)",
    )
    d.add_argument("--num-prompts", type=POS_INT, default=1000, help="requests per run (default 1000)")
    d.add_argument(
        "--random-input-len",
        type=POS_INT,
        default=1024,
        help="random ids per prompt after the prefix (default 1024)",
    )
    d.add_argument(
        "--random-output-len", type=POS_INT, default=128, help="max_tokens per request (default 128)"
    )
    d.add_argument(
        "--random-range-ratio",
        type=RANGE_RATIO,
        default=0.0,
        help="input/output lengths drawn uniformly from len*(1-r) .. len*(1+r) (default 0)",
    )
    d.add_argument(
        "--random-prefix-len",
        type=NONNEG_INT,
        default=0,
        help="random dataset: ids shared by every prompt, before the random part (default 0)",
    )
    d.add_argument(
        "--shared-prefix-len",
        type=POS_INT,
        default=512,
        help="shared-prefix dataset: ids in each shared prefix (default 512)",
    )
    d.add_argument(
        "--num-prefixes",
        "--shared-prefix-num-prefixes",
        dest="num_prefixes",
        type=POS_INT,
        default=4,
        help="shared-prefix dataset: distinct prefixes, prompts spread evenly over them (default 4)",
    )
    d.add_argument(
        "--vocab-size",
        type=POS_INT,
        default=320,
        help="token ids are drawn below this (default 320, valid for every NemotronH vocabulary; "
        "e.g. 131072 for the real models)",
    )
    d.add_argument(
        "--min-token-id",
        type=NONNEG_INT,
        default=3,
        help="token ids are drawn from at least this (default 3: skips pad/bos/eos)",
    )
    d.add_argument(
        "--seed", type=int, default=0, help="dataset and arrival seed; run i uses seed + i (default 0)"
    )


def _add_traffic_flags(p: argparse.ArgumentParser) -> None:
    """`serve`'s load: concurrency, arrival rate, sweeps and repetitions."""
    t = p.add_argument_group("traffic")
    t.add_argument(
        "--max-concurrency", type=POS_INT, default=None, help="most requests in flight (default: all)"
    )
    t.add_argument(
        "--request-rate",
        type=RATE,
        default=float("inf"),
        help="requests/s, arrivals spaced by --burstiness; inf (default) sends everything at once",
    )
    t.add_argument(
        "--burstiness",
        type=BURSTINESS,
        default=1.0,
        help="with a request rate or a ramp-up: the gamma shape of the gaps between arrivals (1, the "
        "default: Poisson; below 1 burstier, above 1 more even, inf evenly spaced)",
    )
    t.add_argument(
        "--ramp-up-strategy",
        choices=RAMP_UP_STRATEGIES,
        default=None,
        help="raise the request rate over the run from --ramp-up-start-rps to --ramp-up-end-rps, linearly "
        "or exponentially (in place of --request-rate)",
    )
    t.add_argument("--ramp-up-start-rps", type=NONNEG_FLOAT, default=None, help="ramp-up: first rate")
    t.add_argument("--ramp-up-end-rps", type=NONNEG_FLOAT, default=None, help="ramp-up: last rate")
    t.add_argument(
        "--num-warmups",
        type=NONNEG_INT,
        default=0,
        help="requests sent before the benchmark and not measured (default 0)",
    )
    t.add_argument(
        "--sweep-concurrency",
        type=POS_INT_LIST,
        default=None,
        metavar="1,8,32",
        help="run once per max concurrency in the list (throughput vs concurrency)",
    )
    t.add_argument(
        "--reps",
        type=POS_INT,
        default=1,
        help="back-to-back runs per point against the same server; reports run-to-run spread and "
        "the run2/run1 output-throughput ratio (default 1)",
    )


def _add_request_flags(p: argparse.ArgumentParser) -> None:
    """`serve`'s per-request body fields and timeout."""
    r = p.add_argument_group("request")
    r.add_argument(
        "--ignore-eos",
        action="store_true",
        help="send ignore_eos: true so every request generates exactly max_tokens",
    )
    r.add_argument("--temperature", type=NONNEG_FLOAT, default=0.0, help="default 0 (greedy)")
    r.add_argument(
        "--chat-template-kwargs",
        type=JSON_OBJECT,
        default=None,
        metavar="JSON",
        help="chat endpoints: e.g. '{\"enable_thinking\": false}'",
    )
    r.add_argument(
        "--extra-body",
        type=JSON_OBJECT,
        default=None,
        metavar="JSON",
        help="extra fields merged into every request body",
    )
    r.add_argument(
        "--request-timeout",
        type=POS_FLOAT,
        default=6 * 3600.0,
        help="seconds a request may wait for its next bytes (default 21600)",
    )


def _add_serve_parser(sub: Any) -> None:
    p = sub.add_parser(
        "serve",
        help="benchmark an OpenAI-compatible server (like vllm bench serve)",
        description="Send synthetic streaming requests to an OpenAI-compatible server and report throughput "
        "and latency (TTFT, TPOT, ITL, E2EL). Token-id prompts on /v1/completions; text prompts "
        "(one common word per token) on /v1/chat/completions.",
    )
    _add_server_flags(p)
    p.add_argument(
        "--endpoint",
        type=ENDPOINT,
        default="/v1/completions",
        help="/v1/completions (default) or /v1/chat/completions",
    )
    _add_dataset_flags(p)
    _add_traffic_flags(p)
    _add_request_flags(p)
    _add_result_flags(p)
    p.add_argument(
        "--save-detailed",
        action="store_true",
        help="also store every request's inter-token latencies and generated text in the JSON",
    )
    p.add_argument(
        "--goodput",
        nargs="+",
        default=None,
        metavar="METRIC:MS",
        help="service-level objectives in milliseconds, e.g. ttft:500 tpot:50 (ttft, tpot, e2el): also "
        "report the rate of requests that met all of them",
    )
    p.add_argument(
        "--percentile-metrics",
        type=LATENCY_LIST,
        default=("ttft", "tpot", "itl", "e2el"),
        metavar="ttft,tpot,itl,e2el",
        help="the latencies whose statistics the table reports (default: all four; the JSON keeps all)",
    )
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_serve, _parser=p)


def _add_offline_parser(sub: Any) -> None:
    p = sub.add_parser(
        "offline",
        help="engine throughput through hyserve.LLM, no HTTP",
        description="Run random token-id prompts with fixed output lengths (ignore_eos) through hyserve.LLM "
        "and report requests/s and input/output/total tok/s.",
    )
    p.add_argument(
        "--model",
        default=None,
        help="model directory (a config.json alone works with --load-format dummy); "
        "default: the built-in tiny model",
    )
    p.add_argument("--load-format", default="auto", help="auto, safetensors or dummy (random weights)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument(
        "--config",
        default=None,
        metavar="FILE.yml",
        help="engine options (trtllm-serve's extra-llm-api-config.yml keys); flags override it",
    )
    p.add_argument("--input-len", type=POS_INT, default=1024, help="prompt tokens (default 1024)")
    p.add_argument("--output-len", type=POS_INT, default=128, help="generated tokens, exactly (default 128)")
    p.add_argument(
        "--random-range-ratio",
        type=RANGE_RATIO,
        default=0.0,
        help="lengths drawn from len*(1-r) .. len*(1+r) (default 0)",
    )
    p.add_argument("--num-prompts", type=POS_INT, default=1000, help="default 1000")
    p.add_argument("--max-batch-size", type=POS_INT, default=None)
    p.add_argument("--max-num-tokens", type=POS_INT, default=None)
    p.add_argument("--max-seq-len", type=POS_INT, default=None)
    p.add_argument("--kv-cache-free-gpu-memory-fraction", type=FRACTION, default=None)
    p.add_argument("--reps", type=POS_INT, default=1, help="back-to-back runs on the same engine (default 1)")
    p.add_argument("--seed", type=int, default=0, help="prompt seed; run i uses seed + i (default 0)")
    p.add_argument("--temperature", type=NONNEG_FLOAT, default=0.0)
    p.add_argument("--min-token-id", type=NONNEG_INT, default=3)
    _add_result_flags(p)
    p.set_defaults(func=cmd_offline, _parser=p)


def _add_needle_parser(sub: Any) -> None:
    from hyserve.bench.needle import DEFAULT_FILLER, DEFAULT_NEEDLE

    p = sub.add_parser(
        "needle",
        help="needle-in-a-haystack requests at chosen prompt sizes (the long-prompt report's client)",
        description="Send the long-prompt report's needle request (/v1/chat/completions, needle "
        "mid-document) at each size and report prompt tokens, latency, HTTP status or error, whether the "
        "needle came back, and whether the server is still healthy. Exit 1 if a request got no HTTP "
        "response, a 5xx, or left the server unhealthy.",
    )
    _add_server_flags(p)
    p.add_argument(
        "--sizes",
        type=SIZES,
        default=(1000, 8000, 32000),
        metavar="1k,8k,...,1M",
        help="target prompt tokens (k = 1000, M = 1000000; default 1k,8k,32k)",
    )
    p.add_argument("--needle", default=DEFAULT_NEEDLE, help=f"default {DEFAULT_NEEDLE!r}")
    p.add_argument(
        "--needle-answer",
        default=None,
        help="string the answer must contain (default: the needle's last word)",
    )
    p.add_argument("--filler", default=DEFAULT_FILLER, help=f"repeated filler (default {DEFAULT_FILLER!r})")
    p.add_argument("--needle-position", type=FRACTION, default=0.5, help="depth of the needle (default 0.5)")
    p.add_argument(
        "--needle-depths",
        type=FRACTIONS,
        default=(),
        metavar="0,0.25,...,1",
        help="ask every size at each of these depths (one request each; HIT / MISS per size and "
        "depth); overrides --needle-position",
    )
    p.add_argument("--max-tokens", type=POS_INT, default=64)
    p.add_argument("--temperature", type=NONNEG_FLOAT, default=0.0)
    p.add_argument(
        "--chat-template-kwargs",
        type=JSON_OBJECT,
        default={"enable_thinking": False},
        metavar="JSON",
        help="default '{\"enable_thinking\": false}' as in the report; 'null' sends none",
    )
    p.add_argument("--timeout", type=POS_FLOAT, default=1800.0, help="seconds per request (default 1800)")
    _add_result_flags(p)
    p.set_defaults(func=cmd_needle, _parser=p)


def _add_plot_parser(sub: Any) -> None:
    p = sub.add_parser(
        "plot",
        help="render the PNGs of a saved result JSON (needs matplotlib)",
        description="Render the PNG plots of a result JSON written by --save-result.",
    )
    p.add_argument("result", metavar="RESULT.json")
    p.add_argument("--output-dir", default=None, help="where to write the PNGs (default: next to the JSON)")
    p.set_defaults(func=cmd_plot, _parser=p)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `bench` and its subcommands on hyserve's top-level subparsers."""
    p = subparsers.add_parser(
        "bench",
        help="benchmarks: serve, offline, needle, plot",
        description="Benchmarks: serving (any OpenAI-compatible server), offline engine "
        "throughput, the needle test; tables, JSON and PNG plots.",
    )
    _fill(p)
    return p


def _fill(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="bench_command", metavar="BENCH")
    _add_serve_parser(sub)
    _add_offline_parser(sub)
    _add_needle_parser(sub)
    _add_plot_parser(sub)
    p.set_defaults(func=_no_subcommand, _parser=p)


def _no_subcommand(args: argparse.Namespace) -> int:
    args._parser.print_help()
    return EXIT_USAGE


# ---- commands --------------------------------------------------------------------------------------------


def _err(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _out(msg: str) -> None:
    print(msg, flush=True)


def _command(args: argparse.Namespace) -> list[str]:
    return list(getattr(args, "command_argv", None) or sys.argv)


def _base_url(args: argparse.Namespace) -> str:
    return args.base_url or f"http://{args.host}:{args.port}"


def _save(result: dict[str, Any], args: argparse.Namespace, kind: str) -> None:
    from hyserve.bench import plots, report

    path = report.write_json(report.sanitize(result), args.result_dir, args.result_filename, kind)
    _out(f"result: {path}")
    if not plots.matplotlib_available():
        _out(f"{plots.INSTALL_HINT}; then: hyserve bench plot {path}")
        return
    for png in plots.render(json.loads(path.read_text()), path.with_suffix("")):
        _out(f"plot: {png}")


def _guard(name: str, fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        try:
            return fn(args)
        except BenchError as e:
            _err(f"hyserve bench {name}: error: {' '.join(str(e).split())}")
            return EXIT_FAILED

    return run


def _ramp_up(args: argparse.Namespace) -> RampUp | None:
    """The ramp-up of `serve`'s flags (None without --ramp-up-strategy); a usage error names the flag."""
    parser: argparse.ArgumentParser = args._parser
    start, end = args.ramp_up_start_rps, args.ramp_up_end_rps
    choices = "|".join(RAMP_UP_STRATEGIES)
    if args.ramp_up_strategy is None:
        if start is not None or end is not None:
            parser.error(f"--ramp-up-start-rps and --ramp-up-end-rps need --ramp-up-strategy {choices}")
        return None
    if start is None or end is None:
        parser.error(
            f"--ramp-up-strategy {args.ramp_up_strategy} needs both --ramp-up-start-rps and "
            "--ramp-up-end-rps (requests/s)"
        )
    if args.request_rate != float("inf"):
        parser.error(
            "--ramp-up-strategy sets the request rate from --ramp-up-start-rps to --ramp-up-end-rps: "
            "leave out --request-rate"
        )
    if end <= 0:
        parser.error(f"argument --ramp-up-end-rps: must be a number > 0, got {end:g}")
    if start > end:
        parser.error(f"--ramp-up-start-rps ({start:g}) must be at most --ramp-up-end-rps ({end:g})")
    if args.ramp_up_strategy == "exponential" and start == 0:
        parser.error("--ramp-up-strategy exponential multiplies the rate: --ramp-up-start-rps must be > 0")
    return RampUp(strategy=args.ramp_up_strategy, start_rps=start, end_rps=end)


def _arrival_and_slos(args: argparse.Namespace) -> tuple[RampUp | None, dict[str, float]]:
    """The ramp-up (or None) and the goodput objectives of `serve`'s flags, each checked (a usage error
    naming the flag otherwise)."""
    from hyserve.bench.goodput import parse_goodput

    parser: argparse.ArgumentParser = args._parser
    ramp_up = _ramp_up(args)
    if ramp_up is None and args.burstiness != 1.0 and args.request_rate == float("inf"):
        _err(
            "hyserve bench serve: note: --burstiness shapes the gaps between arrivals; with --request-rate "
            "inf every request goes at once and it has no effect"
        )
    try:
        slos = parse_goodput(args.goodput or ())
    except ValueError as e:
        parser.error(f"argument --goodput: {e}")
    if (args.dataset_name == "sharegpt") != (args.dataset_path is not None):
        parser.error("--dataset-path FILE goes with --dataset-name sharegpt, and sharegpt needs it")
    if args.dataset_name != "sharegpt" and (args.sharegpt_output_len or args.tokenizer):
        parser.error("--sharegpt-output-len and --tokenizer go with --dataset-name sharegpt")
    return ramp_up, slos


def _serve(args: argparse.Namespace) -> int:
    from hyserve.bench import report
    from hyserve.bench.serve import DatasetOptions, ServeBenchOptions, run_serve_bench

    parser: argparse.ArgumentParser = args._parser
    ramp_up, slos = _arrival_and_slos(args)
    if args.sweep_concurrency and args.max_concurrency:
        parser.error("use either --max-concurrency or --sweep-concurrency, not both")
    if args.dataset_name == "shared-prefix" and args.random_prefix_len:
        parser.error(
            "--random-prefix-len is for --dataset-name random; shared-prefix uses --shared-prefix-len"
        )
    if args.min_token_id >= args.vocab_size:
        parser.error(f"--min-token-id ({args.min_token_id}) must be below --vocab-size ({args.vocab_size})")
    extra = dict(args.extra_body or {})
    if args.chat_template_kwargs is not None:
        extra["chat_template_kwargs"] = args.chat_template_kwargs
    opts = ServeBenchOptions(
        base_url=_base_url(args),
        endpoint=args.endpoint,
        model=args.model,
        api_key=args.api_key,
        dataset=DatasetOptions(
            name=args.dataset_name,
            num_prompts=args.num_prompts,
            input_len=args.random_input_len,
            output_len=args.random_output_len,
            range_ratio=args.random_range_ratio,
            prefix_len=args.random_prefix_len,
            shared_prefix_len=args.shared_prefix_len,
            num_prefixes=args.num_prefixes,
            vocab_size=args.vocab_size,
            token_low=args.min_token_id,
            path=args.dataset_path,
            sharegpt_output_len=args.sharegpt_output_len,
            tokenizer=args.tokenizer,
        ),
        max_concurrency=args.max_concurrency,
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        ramp_up=ramp_up,
        num_warmups=args.num_warmups,
        goodput=slos,
        percentile_metrics=args.percentile_metrics,
        progress=not args.disable_tqdm,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
        temperature=args.temperature,
        extra_body=extra,
        reps=args.reps,
        sweep_concurrency=args.sweep_concurrency,
        percentiles=args.metric_percentiles,
        request_timeout_s=args.request_timeout,
        save_detailed=args.save_detailed,
    )
    result = report.stamp("serve", _command(args), args.git_sha)
    result.update(run_serve_bench(opts, log=_err))
    result["records"] = report.serve_records(result["points"])
    _out(report.serve_report_text(result))
    if args.save_result:
        _save(result, args, "serve")
    empty = [p["max_concurrency"] for p in result["points"] for m in p["reps"] if m["completed"] == 0]
    if empty:
        _err("hyserve bench serve: error: a run completed no request (see the errors above)")
        return EXIT_FAILED
    return 0


def _offline(args: argparse.Namespace) -> int:
    from hyserve.bench import report
    from hyserve.bench.offline import OfflineOptions, run_offline_bench

    engine_opts: dict[str, Any] = {
        "max_batch_size": args.max_batch_size,
        "max_num_tokens": args.max_num_tokens,
        "max_seq_len": args.max_seq_len,
    }
    if args.kv_cache_free_gpu_memory_fraction is not None:
        engine_opts["kv_cache_config"] = {"free_gpu_memory_fraction": args.kv_cache_free_gpu_memory_fraction}
    opts = OfflineOptions(
        model=args.model,
        load_format=args.load_format,
        dtype=args.dtype,
        device=args.device,
        config_file=args.config,
        engine_options=engine_opts,
        input_len=args.input_len,
        output_len=args.output_len,
        range_ratio=args.random_range_ratio,
        num_prompts=args.num_prompts,
        reps=args.reps,
        seed=args.seed,
        temperature=args.temperature,
        token_low=args.min_token_id,
        percentiles=args.metric_percentiles,
    )
    result = report.stamp("offline", _command(args), args.git_sha)
    if result["gpu"] == "cpu":
        result["gpu"] = _torch_gpu_name()
    result.update(run_offline_bench(opts, log=_err))
    result["records"] = report.offline_records(result["reps"])
    _out(report.offline_report_text(result))
    if args.save_result:
        _save(result, args, "offline")
    return 0


def _torch_gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def _needle(args: argparse.Namespace) -> int:
    from hyserve.bench import report
    from hyserve.bench.needle import NeedleOptions, run_needle_bench, served_cleanly

    opts = NeedleOptions(
        base_url=_base_url(args),
        model=args.model,
        api_key=args.api_key,
        sizes=args.sizes,
        needle=args.needle,
        answer=args.needle_answer,
        filler=args.filler,
        position=args.needle_position,
        depths=args.needle_depths,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        chat_template_kwargs=args.chat_template_kwargs,
        timeout_s=args.timeout,
    )
    result = report.stamp("needle", _command(args), args.git_sha)
    result.update(run_needle_bench(opts, log=_err))
    result["records"] = report.needle_records(result["results"])
    _out(report.needle_report_text(result))
    if args.save_result:
        _save(result, args, "needle")
    bad = [r["target_tokens"] for r in result["results"] if not served_cleanly(r)]
    if bad:
        _err(
            f"hyserve bench needle: error: not served cleanly at {', '.join(f'{t:,}' for t in bad)} tokens "
            "(no response, a 5xx, or the server unhealthy afterwards)"
        )
        return EXIT_FAILED
    return 0


def _plot(args: argparse.Namespace) -> int:
    from hyserve.bench import plots

    path = Path(args.result)
    try:
        result = json.loads(path.read_text())
    except FileNotFoundError:
        raise BenchError(f"no such file: {path}") from None
    except (OSError, ValueError) as e:
        raise BenchError(f"cannot read {path} as JSON: {e}") from None
    if not isinstance(result, dict) or result.get("kind") not in ("serve", "offline", "needle"):
        raise BenchError(f"{path} is not a hyserve bench result (no 'kind' of serve/offline/needle)")
    if not plots.matplotlib_available():
        raise BenchError(plots.INSTALL_HINT)
    out_dir = Path(args.output_dir) if args.output_dir else path.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        pngs = plots.render(result, out_dir / path.stem)
    except (KeyError, TypeError, ValueError) as e:
        raise BenchError(f"{path}: unexpected result layout ({type(e).__name__}: {e})") from None
    for png in pngs:
        _out(f"plot: {png}")
    return 0


cmd_serve = _guard("serve", _serve)
cmd_offline = _guard("offline", _offline)
cmd_needle = _guard("needle", _needle)
cmd_plot = _guard("plot", _plot)


def main(argv: Sequence[str] | None = None) -> int:
    """`hyserve bench ...` on its own (tests and scripts): records `hyserve bench <argv>` as the command."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="hyserve bench", description="hyserve benchmarks")
    _fill(parser)
    args = parser.parse_args(argv)
    args.command_argv = ["hyserve", "bench", *argv]
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
