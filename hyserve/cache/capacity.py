"""Exact, validated sizing of the KV block pool and the Mamba state pool from a byte budget.

Why: an engine once sized its hybrid pools from a guessed ``avg_seq_len`` (default ``max_seq_len / 2``)
and crashed on a 256k-token prompt with ``max_seq_len = 1M``. Here the longest legal request is
guaranteed first; ``avg_seq_len`` only tunes how the rest is split between KV blocks and prefix-cache
snapshot slots, so it can never make a legal request fail. Pure bookkeeping (no tensors).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from hyserve.config import Int, boolean, check_snapshot_interval, check_token_budget

__all__ = ["CapacityInputs", "CapacityPlan", "device_cache_budget", "plan_capacity"]

# User-facing knob names used in error messages.
KNOB_BUDGET = (
    "kv_cache_config.free_gpu_memory_fraction (or gpu_memory_utilization) / "
    "kv_cache_config.max_gpu_total_bytes"
)
KNOB_MAX_BATCH_SIZE = "max_batch_size"
KNOB_MAX_SEQ_LEN = "max_seq_len"
KNOB_MAX_NUM_TOKENS = "max_num_tokens"
KNOB_TOKENS_PER_BLOCK = "kv_cache_config.tokens_per_block"
KNOB_AVG_SEQ_LEN = "kv_cache_config.avg_seq_len"
KNOB_INTERVAL = "kv_cache_config.mamba_state_config.periodic_snapshot_interval"
KNOB_OFFSETS = "kv_cache_config.mamba_state_config.additional_snapshot_offsets_from_end"
KNOB_MAX_KV_TOKENS = "kv_cache_config.max_tokens"
KNOB_ENABLE_BLOCK_REUSE = "kv_cache_config.enable_block_reuse"
KNOB_ALLOW_OVERSIZED = "kv_cache_config.allow_oversized_max_seq_len"

# Fallback avg_seq_len when the user sets none: one scheduler step's worth of tokens, but at
# least this many, so the snapshot budget is not starved by a small max_num_tokens.
DEFAULT_AVG_SEQ_LEN_MIN = 8192


@dataclass(frozen=True, kw_only=True)
class CapacityInputs:
    """Everything the planner needs; sizes in bytes, lengths in tokens."""

    budget_bytes: int  # bytes for KV pool + state pool together
    kv_bytes_per_token: int  # sum over attention layers (K+V, all KV heads, dtype); 0 = no attention
    state_bytes_per_slot: int  # sum over Mamba layers (conv + ssm); 0 = no Mamba
    max_batch_size: int
    max_seq_len: int
    max_num_tokens: int
    tokens_per_block: int
    enable_block_reuse: bool
    periodic_snapshot_interval: int | None  # tokens; None = no periodic snapshots
    num_snapshot_offsets: int  # len(additional_snapshot_offsets_from_end)
    avg_seq_len: int | None
    num_pad_slots: int  # extra state slots for CUDA-graph padding rows (0 on CPU)
    max_kv_tokens: int | None = None  # user cap on KV tokens (kv_cache_config.max_tokens)
    # If True a max_seq_len request need not fit; longer requests are refused at admission.
    allow_oversized_max_seq_len: bool = False
    # this rank's weights (already resident when the budget is measured on a GPU; reported, not planned)
    weight_bytes: int = 0
    weight_format: str = "16-bit"
    # snapshot slots kept even when KV for max_batch_size requests of avg_seq_len would take their memory
    # (an auto-sized max_batch_size keeps some: cache/batch_sizing.py); never below the KV floor
    min_snapshot_slots: int = 0
    batch_size_source: str = "max_batch_size"  # how max_batch_size was chosen (the report says)


@dataclass(frozen=True)
class CapacityPlan:
    """Result of :func:`plan_capacity`. ``total_bytes <= inputs.budget_bytes`` always."""

    inputs: CapacityInputs
    num_kv_blocks: int
    kv_tokens: int  # num_kv_blocks * tokens_per_block
    kv_bytes: int
    num_live_slots: int  # = max_batch_size
    num_pad_slots: int
    num_snapshot_slots: int
    state_bytes: int  # (live + pad + snapshot slots) * state_bytes_per_slot
    total_bytes: int
    max_request_tokens: int  # longest request (prompt + max_tokens) that fits an empty engine
    avg_seq_len: int
    avg_seq_len_source: str  # "set by user" or how it was derived
    concurrency_at_avg: float  # requests of avg_seq_len that fit at once, capped at max_batch_size
    kv_floor_blocks: int = 0  # blocks reserved before snapshots were sized (step 3)
    desired_snapshot_slots: int = 0  # what step 4 asked for (0 when snapshots are off)
    warnings: tuple[str, ...] = ()  # things the operator should know (printed in the report)

    @property
    def block_bytes(self) -> int:
        return self.inputs.kv_bytes_per_token * self.inputs.tokens_per_block

    @property
    def snapshot_bytes(self) -> int:
        return self.num_snapshot_slots * self.inputs.state_bytes_per_slot

    def report(self) -> str:
        """Multi-line, human-readable capacity report printed at start-up."""
        inp = self.inputs
        s = inp.state_bytes_per_slot
        unused = inp.budget_bytes - self.total_bytes
        lines = [
            f"capacity plan: budget {_fmt_bytes(inp.budget_bytes)}, "
            f"using {_fmt_bytes(self.total_bytes)} (unused {_fmt_bytes(unused)})",
            f"  weights      {_fmt_bytes(inp.weight_bytes):>12}  {inp.weight_format} (resident before the "
            "budget was taken; not part of it)",
            f"  KV cache     {_fmt_bytes(self.kv_bytes):>12}  {self.num_kv_blocks:,} blocks x "
            f"{inp.tokens_per_block} tokens = {self.kv_tokens:,} tokens "
            f"({_fmt_bytes(inp.kv_bytes_per_token)}/token; floor {self.kv_floor_blocks:,} blocks)",
            f"  Mamba state  {_fmt_bytes(self.state_bytes):>12}  "
            f"{self.num_live_slots + self.num_pad_slots + self.num_snapshot_slots:,} slots x "
            f"{_fmt_bytes(s)}",
            f"    live slots      {self.num_live_slots:,} (one per running request, {inp.batch_size_source})",
            f"    pad slots       {self.num_pad_slots:,} (CUDA-graph padding rows)",
            f"    snapshot slots  {self.num_snapshot_slots:,} ({_fmt_bytes(self.snapshot_bytes)}; "
            f"prefix-cache Mamba snapshots, wanted {self.desired_snapshot_slots:,})",
            f"  longest single request: {self.max_request_tokens:,} tokens (max_seq_len {inp.max_seq_len:,})",
            f"  avg_seq_len: {self.avg_seq_len:,} tokens ({self.avg_seq_len_source})",
            f"  concurrency at avg_seq_len: {self.concurrency_at_avg:.1f} requests "
            f"(max_batch_size {inp.max_batch_size})",
        ]
        lines.extend(f"  WARNING: {w}" for w in self.warnings)
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-serialisable dict (benchmarks store it next to their results)."""
        d = dataclasses.asdict(self)
        d["warnings"] = list(self.warnings)
        d["block_bytes"] = self.block_bytes
        d["snapshot_bytes"] = self.snapshot_bytes
        return d


def device_cache_budget(
    free_bytes: int,
    fraction: float,
    reserved_bytes: int,
    cap: int | None = None,
    *,
    total_bytes: int | None = None,
    utilization: float | None = None,
) -> int:
    """The pools' budget on a GPU: `fraction` of the memory free once the weights are resident, less what
    the engine reserves beside the pools (profiled activation peaks, graph logits, allocator slack), at
    most `cap` (kv_cache_config.max_gpu_total_bytes); never negative. Smaller weights (FP8: 1 byte a weight
    plus its scales) leave more free memory, and all of it reaches the pools here.

    With `utilization` (vLLM's gpu_memory_utilization, a share of the GPU's `total_bytes`) the engine holds
    at most that share in all: the pools get it less the memory in use now (the weights, the CUDA context,
    anything else on the GPU) and less the same reserve."""
    if utilization is not None:
        if total_bytes is None:
            raise ValueError("device_cache_budget: utilization needs total_bytes")
        budget = int(total_bytes * utilization) - (total_bytes - free_bytes) - reserved_bytes
    else:
        budget = int(free_bytes * fraction) - reserved_bytes
    if cap is not None:
        budget = min(budget, cap)
    return max(budget, 0)


# --------------------------------------------------------------------------- helpers


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def _validate(inp: CapacityInputs) -> None:
    """The planner's inputs, checked with the config's own checks (hyserve/config.py), so a rule lives in
    one place whether the value came from a YAML or from code."""
    for knob, value, lo in (
        (f"budget_bytes ({KNOB_BUDGET})", inp.budget_bytes, 0),
        ("kv_bytes_per_token (model cache spec)", inp.kv_bytes_per_token, 0),
        ("state_bytes_per_slot (model cache spec)", inp.state_bytes_per_slot, 0),
        (KNOB_MAX_BATCH_SIZE, inp.max_batch_size, 1),
        (KNOB_MAX_SEQ_LEN, inp.max_seq_len, 1),
        (KNOB_MAX_NUM_TOKENS, inp.max_num_tokens, 1),
        (KNOB_TOKENS_PER_BLOCK, inp.tokens_per_block, 1),
        (f"num_snapshot_offsets (len of {KNOB_OFFSETS})", inp.num_snapshot_offsets, 0),
        ("num_pad_slots (CUDA-graph padding)", inp.num_pad_slots, 0),
        ("min_snapshot_slots", inp.min_snapshot_slots, 0),
    ):
        Int(lo=lo).integer(value, knob)
    boolean(inp.enable_block_reuse, KNOB_ENABLE_BLOCK_REUSE)
    boolean(inp.allow_oversized_max_seq_len, KNOB_ALLOW_OVERSIZED)
    check_token_budget(inp.max_num_tokens, inp.max_batch_size)
    Int(lo=1, none_ok=True)(inp.periodic_snapshot_interval, KNOB_INTERVAL)
    check_snapshot_interval(inp.periodic_snapshot_interval, inp.tokens_per_block)
    Int(lo=1, none_ok=True)(inp.avg_seq_len, KNOB_AVG_SEQ_LEN)
    if inp.avg_seq_len is not None and inp.avg_seq_len > inp.max_seq_len:
        raise ValueError(
            f"{KNOB_AVG_SEQ_LEN}={inp.avg_seq_len} exceeds {KNOB_MAX_SEQ_LEN}={inp.max_seq_len}; "
            f"lower it or leave it unset (it only tunes the KV/snapshot split)."
        )
    Int(lo=1, none_ok=True)(inp.max_kv_tokens, KNOB_MAX_KV_TOKENS)


# --------------------------------------------------------------------------- planner


def plan_capacity(inp: CapacityInputs) -> CapacityPlan:
    """Size the pools for ``inp``. Raises ValueError with an actionable message when the settings cannot
    all be honoured.

    Algorithm (all arithmetic in exact Python ints; ``block_bytes = kv_bytes_per_token *
    tokens_per_block``, ``S = state_bytes_per_slot``, ``B = max_batch_size``)::

        1. validate every input; a bad value raises ValueError naming the user-facing knob.
           periodic_snapshot_interval must be a positive multiple of tokens_per_block.
        2. fixed = (B + num_pad_slots) * S              live slots + CUDA-graph pad slots
           budget < fixed + block_bytes                 -> ValueError (bytes needed, what to change)
           avail = budget - fixed
        3. floor = ceil(max_seq_len / tokens_per_block) + (B - 1)
                 one max_seq_len request + one partial block for each other running request
           floor * block_bytes > avail                  -> ValueError with the numbers, unless
                                                           allow_oversized_max_seq_len: then
                                                           floor = avail // block_bytes
           max_kv_tokens < max_seq_len                  -> ValueError (kv_cache_config.max_tokens),
                                                           unless allow_oversized_max_seq_len
        4. snapshots (only if enable_block_reuse and S > 0):
           avg     = avg_seq_len, else min(max_seq_len, max(max_num_tokens, 8192))
           desired = max(B, B * ceil(avg / interval) [0 if no interval] + B * num_snapshot_offsets)
           kv_want = max(floor, B * ceil(avg / tokens_per_block)), at most the max_tokens cap
                     (KV for max_batch_size requests of avg_seq_len comes before snapshots: a Mamba
                     snapshot of a 9B model costs as much as ~8,000 tokens of KV)
           snapshot_slots = min(desired, (avail - min(kv_want, avail // block_bytes) * block_bytes) // S)
           snapshot_slots = max(that, min(min_snapshot_slots, desired, what the floor leaves))
                     (an auto-sized max_batch_size keeps some snapshot slots: cache/batch_sizing.py)
        5. kv_blocks = (avail - snapshot_slots * S) // block_bytes      everything else goes to KV
           if max_kv_tokens: kv_blocks = min(kv_blocks, ceil(max_kv_tokens / tokens_per_block)),
                             then back up to the floor unless oversize is allowed
           memory freed by that cap goes back to snapshot slots, still at most `desired`
        6. kv_bytes_per_token == 0 (no attention layers): kv_blocks = floor, costing 0 bytes
           (blocks are still used for bookkeeping); max_kv_tokens is ignored.

        max_request_tokens = min(max_seq_len, kv_blocks * tokens_per_block)   (max_seq_len if no KV)
        concurrency_at_avg = min(B, kv_blocks / ceil(avg / tokens_per_block))  (B if no KV)

    Because snapshots are sized only from what is left *after* the floor, and KV takes everything
    after the snapshots, ``kv_blocks >= floor`` always holds, so ``avg_seq_len`` cannot reduce the
    longest request. The plan never exceeds the budget.
    """
    _validate(inp)
    bsz = inp.max_batch_size
    tpb = inp.tokens_per_block
    msl = inp.max_seq_len
    state = inp.state_bytes_per_slot
    block_bytes = inp.kv_bytes_per_token * tpb
    warnings: list[str] = []
    fixed, avail = _fixed_state(inp, block_bytes)
    floor, ideal_floor = _kv_floor(inp, fixed, avail, block_bytes, warnings)
    cap_blocks = _kv_cap_blocks(inp, ideal_floor, block_bytes, warnings)
    avg, avg_source = _avg_seq_len(inp)
    kv_blocks, snap_slots, desired = _split(inp, avail, floor, cap_blocks, avg, block_bytes, warnings)

    kv_bytes = kv_blocks * block_bytes
    state_bytes = (bsz + inp.num_pad_slots + snap_slots) * state
    total = kv_bytes + state_bytes
    kv_tokens = kv_blocks * tpb
    max_request_tokens = msl if block_bytes == 0 else min(msl, kv_tokens)
    if block_bytes == 0:
        concurrency = float(bsz)
    else:
        concurrency = min(float(bsz), kv_blocks / _ceil_div(avg, tpb))

    plan = CapacityPlan(
        inputs=inp,
        num_kv_blocks=kv_blocks,
        kv_tokens=kv_tokens,
        kv_bytes=kv_bytes,
        num_live_slots=bsz,
        num_pad_slots=inp.num_pad_slots,
        num_snapshot_slots=snap_slots,
        state_bytes=state_bytes,
        total_bytes=total,
        max_request_tokens=max_request_tokens,
        avg_seq_len=avg,
        avg_seq_len_source=avg_source,
        concurrency_at_avg=concurrency,
        kv_floor_blocks=floor,
        desired_snapshot_slots=desired,
        warnings=tuple(warnings),
    )
    if plan.total_bytes > inp.budget_bytes:  # pragma: no cover - arithmetic guarantee
        raise AssertionError(f"capacity plan exceeds its budget: {plan}")
    return plan


def _fixed_state(inp: CapacityInputs, block_bytes: int) -> tuple[int, int]:
    """2. live + pad state slots are not negotiable: (their bytes, the budget left after them)."""
    bsz, state = inp.max_batch_size, inp.state_bytes_per_slot
    fixed = (bsz + inp.num_pad_slots) * state
    if inp.budget_bytes < fixed + block_bytes:
        need = fixed + block_bytes
        raise ValueError(
            f"cache budget {_fmt_bytes(inp.budget_bytes)} ({inp.budget_bytes:,} bytes) is too small: "
            f"the Mamba state of {KNOB_MAX_BATCH_SIZE}={bsz} running requests + {inp.num_pad_slots} "
            f"CUDA-graph pad slots ({bsz + inp.num_pad_slots} x {_fmt_bytes(state)}) plus one KV block "
            f"({_fmt_bytes(block_bytes)}) needs at least {need:,} bytes ({_fmt_bytes(need)}). "
            f"Lower {KNOB_MAX_BATCH_SIZE} or raise the budget ({KNOB_BUDGET})."
        )
    return fixed, inp.budget_bytes - fixed


def _kv_floor(
    inp: CapacityInputs, fixed: int, avail: int, block_bytes: int, warnings: list[str]
) -> tuple[int, int]:
    """3. the KV floor: the longest legal request must fit next to max_batch_size-1 small ones. Returns
    (the floor in blocks, the ideal floor)."""
    bsz, tpb, msl = inp.max_batch_size, inp.tokens_per_block, inp.max_seq_len
    ideal_floor = _ceil_div(msl, tpb) + (bsz - 1)
    if block_bytes == 0:
        return ideal_floor, ideal_floor
    fit = avail // block_bytes
    if fit >= ideal_floor:
        return ideal_floor, ideal_floor
    single = max(0, fit - (bsz - 1)) * tpb
    if not inp.allow_oversized_max_seq_len:
        need = fixed + ideal_floor * block_bytes
        hint = (
            f"lower {KNOB_MAX_SEQ_LEN} (to at most {single:,})" if single > 0 else f"lower {KNOB_MAX_SEQ_LEN}"
        )
        raise ValueError(
            f"{KNOB_MAX_SEQ_LEN}={msl:,} does not fit in the KV cache: after the Mamba state "
            f"({_fmt_bytes(fixed)}) the budget leaves {avail:,} bytes ({_fmt_bytes(avail)}) = "
            f"{fit:,} blocks = {fit * tpb:,} tokens, but one {KNOB_MAX_SEQ_LEN} request plus one "
            f"block for each of the other {bsz - 1} running requests needs {ideal_floor:,} "
            f"blocks = {ideal_floor * block_bytes:,} bytes ({_fmt_bytes(ideal_floor * block_bytes)} "
            f"at {inp.kv_bytes_per_token:,} bytes/token); only {single:,} tokens fit for a single "
            f"request. Total needed: {need:,} bytes ({_fmt_bytes(need)}), available: "
            f"{inp.budget_bytes:,} bytes ({_fmt_bytes(inp.budget_bytes)}). To fix: {hint}, raise "
            f"{KNOB_BUDGET}, lower {KNOB_MAX_BATCH_SIZE}, or set {KNOB_ALLOW_OVERSIZED}=true to "
            f"refuse longer requests at admission instead."
        )
    warnings.append(
        f"{KNOB_MAX_SEQ_LEN}={msl:,} does not fit ({KNOB_ALLOW_OVERSIZED}): requests longer than "
        f"{min(msl, fit * tpb):,} tokens will be refused at admission"
    )
    return fit, ideal_floor


def _kv_cap_blocks(
    inp: CapacityInputs, ideal_floor: int, block_bytes: int, warnings: list[str]
) -> int | None:
    """kv_cache_config.max_tokens as blocks (None: no cap)."""
    if inp.max_kv_tokens is None:
        return None
    if block_bytes == 0:
        warnings.append(f"{KNOB_MAX_KV_TOKENS} is ignored: the model has no attention KV cache")
        return None
    msl, tpb = inp.max_seq_len, inp.tokens_per_block
    if inp.max_kv_tokens < msl and not inp.allow_oversized_max_seq_len:
        raise ValueError(
            f"{KNOB_MAX_KV_TOKENS}={inp.max_kv_tokens:,} is below {KNOB_MAX_SEQ_LEN}={msl:,}: a "
            f"{KNOB_MAX_SEQ_LEN} request could never fit. Raise {KNOB_MAX_KV_TOKENS} to at least "
            f"{ideal_floor * tpb:,} (one {KNOB_MAX_SEQ_LEN} request + one block per other running "
            f"request), lower {KNOB_MAX_SEQ_LEN}, or set {KNOB_ALLOW_OVERSIZED}=true."
        )
    return _ceil_div(inp.max_kv_tokens, tpb)


def _avg_seq_len(inp: CapacityInputs) -> tuple[int, str]:
    if inp.avg_seq_len is not None:
        return inp.avg_seq_len, "set by user"
    return min(inp.max_seq_len, max(inp.max_num_tokens, DEFAULT_AVG_SEQ_LEN_MIN)), (
        f"{KNOB_AVG_SEQ_LEN} unset; derived as min({KNOB_MAX_SEQ_LEN}, max({KNOB_MAX_NUM_TOKENS}, "
        f"{DEFAULT_AVG_SEQ_LEN_MIN})); it only tunes the KV/snapshot split"
    )


def _split(
    inp: CapacityInputs,
    avail: int,
    floor: int,
    cap_blocks: int | None,
    avg: int,
    block_bytes: int,
    warnings: list[str],
) -> tuple[int, int, int]:
    """4.-6. snapshot slots out of what is left after the floor, KV takes everything else. Returns
    (KV blocks, snapshot slots, snapshot slots wanted)."""
    bsz, tpb, state = inp.max_batch_size, inp.tokens_per_block, inp.state_bytes_per_slot
    allow = inp.allow_oversized_max_seq_len
    desired = 0
    snap_slots = 0
    if inp.enable_block_reuse and state > 0:
        interval = inp.periodic_snapshot_interval
        per_request = _ceil_div(avg, interval) if interval else 0
        desired = max(bsz, bsz * per_request + bsz * inp.num_snapshot_offsets)
        # KV for max_batch_size requests of avg_seq_len first (never less than the floor)
        kv_want = max(floor, bsz * _ceil_div(avg, tpb))
        if cap_blocks is not None:
            kv_want = max(floor if not allow else 0, min(kv_want, cap_blocks))
        if block_bytes:
            kv_want = min(kv_want, avail // block_bytes)
        snap_slots = min(desired, (avail - max(kv_want, floor) * block_bytes) // state)
        floor_left = (avail - floor * block_bytes) // state  # what the KV floor leaves, in slots
        snap_slots = max(snap_slots, min(inp.min_snapshot_slots, desired, floor_left))

    # 5./6. KV takes everything else (or just the floor when blocks cost nothing).
    if block_bytes == 0:
        kv_blocks = floor
    else:
        kv_blocks = (avail - snap_slots * state) // block_bytes
        if cap_blocks is not None and cap_blocks < kv_blocks:
            kv_blocks = cap_blocks
            if kv_blocks < floor and not allow:
                warnings.append(
                    f"{KNOB_MAX_KV_TOKENS}={inp.max_kv_tokens:,} raised to {floor * tpb:,} tokens: one "
                    f"{KNOB_MAX_SEQ_LEN} request plus one block per other running request must fit"
                )
                kv_blocks = floor
    if state > 0 and snap_slots < desired:
        spare = avail - snap_slots * state - kv_blocks * block_bytes
        snap_slots = min(desired, snap_slots + spare // state)
    if desired and snap_slots < desired and not (0 < inp.min_snapshot_slots <= snap_slots):
        if snap_slots == 0:
            warnings.append(
                "no memory left for Mamba snapshot slots: prefix caching cannot reuse Mamba state"
            )
        else:
            warnings.append(
                f"only {snap_slots:,} of {desired:,} wanted Mamba snapshot slots fit; prefix-cache hits "
                f"on long prompts will be rarer"
            )

    return kv_blocks, snap_slots, desired
