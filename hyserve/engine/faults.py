"""Deterministic fault injection (`envs.HYSERVE_FAULT_INJECT`, off by default): make chosen requests fail
in the model forward, in sampling, on the host (token append / detokenizer) or in the engine loop outside
any request's guard, so tests and soak runs can show a failing request fails alone (docs/architecture.md,
"One step"). The spec is comma-separated `site:substring[@n]`: a request whose id contains `substring`
fails at `site` each time it gets there with at least `n` output tokens (default 0: its first prefill)."""

from __future__ import annotations

from dataclasses import dataclass

from hyserve.engine.scheduler.scheduler import ScheduledSeq

SITES = ("forward", "sample", "host", "engine")


class InjectedFault(RuntimeError):
    """Raised by an injected fault."""


@dataclass(frozen=True, kw_only=True)
class Fault:
    site: str
    match: str  # a substring of the request id
    after: int  # fires once the request has this many output tokens


class FaultInjector:
    def __init__(self, faults: list[Fault]) -> None:
        self.faults = faults
        self.fired: dict[str, int] = dict.fromkeys(SITES, 0)  # how often each site raised

    @classmethod
    def parse(cls, spec: str, *, source: str = "HYSERVE_FAULT_INJECT") -> FaultInjector | None:
        """The injector for `spec`, or None for an empty spec (off)."""
        faults = []
        for item in (p.strip() for p in spec.split(",")):
            if not item:
                continue
            site, sep, rest = item.partition(":")
            match, at, n = rest.partition("@")
            if not sep or site not in SITES or not match:
                raise ValueError(
                    f"{source}: {item!r} is not site:request-id-substring[@n] with site one of {list(SITES)}"
                )
            if at and not (n.isdigit()):
                raise ValueError(
                    f"{source}: {item!r}: the count after '@' must be an integer >= 0, got {n!r}"
                )
            faults.append(Fault(site=site, match=match, after=int(n) if at else 0))
        return cls(faults) if faults else None

    def check(self, site: str, request_id: str, num_output_tokens: int) -> None:
        for f in self.faults:
            if f.site == site and f.match in request_id and num_output_tokens >= f.after:
                self.fired[site] += 1
                raise InjectedFault(f"injected fault ({site}:{f.match}@{f.after}) for request {request_id!r}")

    def check_rows(self, site: str, seqs: list[ScheduledSeq]) -> None:
        """Raise for the first of a step's rows that a fault at `site` names."""
        for s in seqs:
            self.check(site, s.request_id, s.num_output_tokens)
