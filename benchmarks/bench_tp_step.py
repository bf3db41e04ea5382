"""What rank 0 pays per step to tell the other ranks the step (CPU, two gloo ranks; no GPU needed).

Under tensor parallelism rank 0 sends every `ScheduledBatch` to the workers before running it
(`hyserve/engine/parallel/step_channel.py`). This measures, for decode steps of 1 / 64 / 256 rows at a
context of `--context` tokens (block tables of context / 64 entries):

    encode     encode_seqs + pickle (what goes on the wire), against pickling the ScheduledBatch itself
    send       StepChannel.send on rank 0, back to back with rank 1's recv (so a row count's figure includes
               rank 1 decoding it), and a heartbeat for the fixed cost; against torch's broadcast_object_list
               (`hyserve.distributed.broadcast_object`) for the same messages

    python -m benchmarks.bench_tp_step            # writes benchmarks/results/tp_step_<date>_<sha>.json

On the GPU the send runs while the previous step computes (async scheduling), so it costs nothing as long
as it stays below the step's GPU time.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import multiprocessing as mp
import pickle
import platform
import socket
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from hyserve.bench.report import git_sha  # noqa: E402
from hyserve.engine.parallel.step_channel import HEARTBEAT, STEP, encode_seqs  # noqa: E402
from hyserve.engine.sampling_params import SamplingParams  # noqa: E402
from hyserve.engine.scheduler.scheduler import ScheduledBatch, ScheduledSeq  # noqa: E402

ROWS = (1, 64, 256)


def decode_batch(rows: int, context: int, tokens_per_block: int = 64) -> ScheduledBatch:
    nb = -(-context // tokens_per_block)
    seqs = [
        ScheduledSeq(
            request_id=f"req-{i}",
            token_ids=[0],
            start_pos=context - 1,
            block_ids=list(range(i * nb, (i + 1) * nb)),
            state_src=None,
            state_dst=i,
            sample=True,
            snapshots=[],
            params=SamplingParams(max_tokens=512, temperature=0.7, top_p=0.95, seed=i),
            num_output_tokens=17,
            feed_row=i,
        )
        for i in range(rows)
    ]
    return ScheduledBatch(seqs=seqs, num_decodes=rows)


def _median_us(fn, n: int) -> float:  # noqa: ANN001
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    ts.sort()
    return ts[len(ts) // 2] * 1e6


def encode_costs(context: int, n: int) -> list[dict]:
    out = []
    for rows in ROWS:
        b = decode_batch(rows, context)
        wire = pickle.dumps((STEP, encode_seqs(b), rows, rows, False))
        out.append(
            {
                "rows": rows,
                "wire_bytes": len(wire),
                "encode_pickle_us": _median_us(lambda b=b: pickle.dumps(encode_seqs(b)), n),
                "unpickle_us": _median_us(lambda w=wire: pickle.loads(w), n),
                "dataclass_pickle_us": _median_us(lambda b=b: pickle.dumps(b), n),
                "dataclass_bytes": len(pickle.dumps(b)),
            }
        )
    return out


def _rank(rank: int, port: int, context: int, n: int, q: mp.Queue) -> None:  # type: ignore[type-arg]
    import torch

    torch.set_num_threads(1)
    from hyserve.distributed import broadcast_object, init_distributed
    from hyserve.engine.parallel.step_channel import StepChannel

    init_distributed(tp_size=2, device="cpu", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}")
    ch = StepChannel.open()
    msgs = [("heartbeat", (HEARTBEAT,))]
    msgs += [
        (f"decode {rows} rows", (STEP, encode_seqs(decode_batch(rows, context)), rows, rows, False))
        for rows in ROWS
    ]
    res = {}
    for name, msg in msgs:
        ch.gather_ints([0])  # both ranks here: rank 1 is waiting in recv before each timed send
        if rank == 0:
            res[name] = _median_us(lambda msg=msg: ch.send(msg), n)
        else:
            for _ in range(n):
                ch.recv()
        ch.gather_ints([0])
        if rank == 0:
            res[f"{name} (broadcast_object_list)"] = _median_us(
                lambda msg=msg: broadcast_object(msg, ch.control), n
            )
        else:
            for _ in range(n):
                broadcast_object(None, ch.control)
    if rank == 0:
        q.put(res)


def send_costs(context: int, n: int) -> dict[str, float]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, context, n, q)) for r in range(2)]
    for p in procs:
        p.start()
    res = q.get(timeout=300)
    for p in procs:
        p.join(timeout=60)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--n", type=int, default=200)
    args = ap.parse_args()
    enc = encode_costs(args.context, args.n)
    send = send_costs(args.context, args.n)
    print(f"context {args.context} tokens; medians of {args.n}")
    print(
        f"{'rows':>5} {'wire B':>8} {'encode+pickle us':>17} {'unpickle us':>12} {'dataclass pickle us':>20} "
        f"{'send us':>9} {'broadcast_object_list us':>25}"
    )
    for e in enc:
        s = send[f"decode {e['rows']} rows"]
        e["send_us"] = s
        e["broadcast_object_list_us"] = b = send[f"decode {e['rows']} rows (broadcast_object_list)"]
        print(
            f"{e['rows']:>5} {e['wire_bytes']:>8} {e['encode_pickle_us']:>17.1f} {e['unpickle_us']:>12.1f} "
            f"{e['dataclass_pickle_us']:>20.1f} {s:>9.1f} {b:>25.1f}"
        )
    print(
        f"heartbeat send: {send['heartbeat']:.1f} us "
        f"(broadcast_object_list {send['heartbeat (broadcast_object_list)']:.1f} us)"
    )
    sha = git_sha()
    date = _dt.date.today().isoformat()
    out = ROOT / "benchmarks" / "results" / f"tp_step_{date}_{sha}.json"
    out.write_text(
        json.dumps(
            {
                "date": date,
                "git_sha": sha,
                "gpu": "cpu",
                "host": platform.processor() or platform.machine(),
                "command": sys.argv,
                "context": args.context,
                "n": args.n,
                "decode": enc,
                "heartbeat_send_us": send["heartbeat"],
                "heartbeat_broadcast_object_list_us": send["heartbeat (broadcast_object_list)"],
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
