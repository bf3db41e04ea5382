"""Scheduling: which requests run in a step and how many tokens each feeds (chunked prefill, prefix hits,
preemption), and the step cost model that sizes prefill chunks to a target step time."""
