"""`hyserve bench`: serving benchmark (any OpenAI-compatible server), offline engine throughput, the needle
test of the long-prompt report, tables, JSON results and PNG plots.

    datasets.py     synthetic prompts (random, shared-prefix)
    sharegpt.py     the ShareGPT dataset from a local JSON file
    http_client.py  one streamed request, timed per chunk
    metrics.py      TTFT / TPOT / ITL / E2EL, throughputs, percentiles, run-to-run spread
    arrivals.py     send times: request rate, burstiness (gamma gaps), linear / exponential ramp-ups
    goodput.py      service-level objectives (--goodput) and the rate of requests meeting them
    serve.py        `bench serve`: warm-ups, concurrency, repetitions, concurrency sweeps
    offline.py      `bench offline`: hyserve.LLM throughput
    needle.py       `bench needle`: the report's needle client at chosen prompt sizes
    report.py       environment stamp, records, tables, JSON files
    plots.py        PNGs (matplotlib, optional)
    cli.py          the argparse front end, registered by hyserve/cli.py
"""
