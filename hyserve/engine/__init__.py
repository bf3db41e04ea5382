"""The engine: requests, scheduler, model runner, sampler, the step loop, and the offline/async APIs."""
