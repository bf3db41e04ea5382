"""Sampling a step's tokens on the device: penalties and logit bias, greedy/temperature/top-k/top-p/min-p,
logprobs, and structured outputs' token masks."""
