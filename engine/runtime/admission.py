"""Admission, in one place: does a configuration fit the device, does a request fit the envelope.

At start (``plan``): the budget table (bytes per term: weights, KV cache, working
buffers, runtime tables, journal buffers, capsules, media, a draft model) against
the device's memory, refused with every term listed when it does not fit; the
engine reports the table in ``status``.

Per request, against the ``Envelope``: the context (``check_prompt``), journal
credit (``credit_for`` then ``Journal.reserve``, through the store: a message is
held with a notice while the disk is behind, an operation whose records could
never fit is refused), slot availability (``queued_notice``: a request waits in
line, in order) and media (a picture that does not fit the context is left out
with a ``refused_notice``). Every refusal is one type, ``Refusal``: which
resource, how much was asked, how much is free, and what would be accepted.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from aotx.engine.errors import AdmissionError, ErrorCode
from aotx.engine import protocol as P
from aotx.engine.runtime.envelope import Envelope, working_bytes  # noqa: F401 (re-exported)
from aotx.engine.units import fmt_bytes, parse_size  # noqa: F401 (re-exported)

#: journal bytes reserved per reply token (one TokensCommitted record per tick holds
#: ~70 bytes of framing and ids plus the token's ids and text), and for its finish record
REPLY_BYTES_PER_TOKEN = 160
REPLY_FINISH_BYTES = 256


class Refusal(AdmissionError):
    """A request that does not fit: ``resource`` (context | journal | slots | media |
    memory), ``asked`` and ``free`` (tokens or bytes), ``accepts`` what would be
    taken, ``detail`` the longer sentence a client's notice shows ("" for none)."""

    def __init__(self, code: ErrorCode, resource: str, message: str, *, asked: int = 0, free: int = 0,
                 accepts: str = "", detail: str = ""):
        super().__init__(message)
        self.code = code
        self.resource = resource
        self.asked = asked
        self.free = free
        self.accepts = accepts
        self.detail = detail

    def notice(self, rid: int) -> P.Notice | None:
        """The ``refused`` notice that goes before the Error, when there is a detail."""
        if not self.detail:
            return None
        return refused_notice(rid, self.resource, self.detail, self.asked, self.free)


def refused_notice(rid: int, resource: str, message: str, asked: int, free: int) -> P.Notice:
    return P.Notice(id=rid, kind="refused", resource=resource, message=message, asked=asked, free=free)


def check_prompt(n_prompt: int, envelope: Envelope) -> None:
    """Refuse a prompt that leaves no room for a reply in a slot's context, or is empty."""
    ctx = envelope.context_tokens
    if n_prompt + 1 > ctx:
        raise Refusal(ErrorCode.TOO_LONG, "context", f"prompt of {n_prompt} tokens does not fit the context of "
                      f"{ctx} tokens", asked=n_prompt + 1, free=ctx, accepts=f"a prompt of at most {ctx - 1} tokens",
                      detail=f"the prompt is {n_prompt} tokens; the context holds {ctx} (a reply needs at least 1 "
                             f"more)")
    if n_prompt == 0:
        raise Refusal(ErrorCode.BAD_REQUEST, "context", "the prompt is empty", accepts="a prompt of 1 token or more")


def reply_credit(max_tokens: int, envelope: Envelope) -> int:
    """Journal bytes to reserve for a reply of up to ``max_tokens`` tokens: its token
    records and its finish, at most a share of the buffer (a longer reply then borrows
    free space as it goes, as records without credit do)."""
    if not envelope.publication_bytes:
        return 0
    return min(max_tokens * REPLY_BYTES_PER_TOKEN + REPLY_FINISH_BYTES,
               envelope.publication_bytes // (2 * envelope.slots))


def journal_refusal(what: str, asked: int, free: int, capacity: int) -> Refusal:
    """The refusal of an operation whose records have no journal credit: ``too_long``
    when they could never fit the buffer, else ``busy`` (retry when the disk catches up)."""
    if asked > capacity:
        return Refusal(ErrorCode.TOO_LONG, "journal", f"{what} needs {asked} bytes of journal records; the "
                       f"journal's buffer holds {capacity} bytes", asked=asked, free=free,
                       accepts=f"records of at most {capacity} bytes")
    return Refusal(ErrorCode.BUSY, "journal", f"no journal credit for {what}: the journal's buffers are full (the "
                   f"disk is behind: {free} bytes free, {asked} needed); retry when they drain", asked=asked,
                   free=free, accepts=f"{free} bytes now")


def held_notice(rid: int, asked: int, free: int, disk_full: str = "") -> P.Notice:
    """A message waits for journal credit (it is retried when receipts free the buffer).
    ``disk_full``: the journal's degraded line (the disk is full: which, how much it
    needs); the notice then names the disk (resource "disk")."""
    if disk_full:
        return P.Notice(id=rid, kind="held", resource="disk", asked=asked, free=0,
                        message=f"{disk_full}; the message is held")
    return P.Notice(id=rid, kind="held", resource="journal", asked=asked, free=free,
                    message=f"the journal's buffers are full (the disk is behind: {free} bytes free); the message "
                            f"is held until they drain")


def queued_notice(rid: int, position: int, n_slots: int) -> P.Notice:
    """A request waits for a slot at ``position`` in line."""
    return P.Notice(id=rid, kind="queued", resource="slots", position=position, asked=1, free=0,
                    message=f"all {n_slots} slots are busy; queued at position {position}")


def machine_memory_bytes() -> int:
    """Physical RAM in bytes (sysconf), or 8 GiB when unknown."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 8 << 30


def default_cpu_budget() -> int:
    """Default RAM budget on the CPU: half the machine's memory."""
    return machine_memory_bytes() // 2


def default_cuda_budget(device: int = 0) -> int:
    """Default budget on CUDA: the GPU's total memory less 1 GiB for the CUDA context,
    CuPy's pools and cuBLAS workspaces (bytes)."""
    import cupy  # only reached with --device cuda

    _free, total = cupy.cuda.Device(device).mem_info
    return max(1 << 30, int(total) - (1 << 30))


@dataclass(frozen=True)
class Budget:
    """The accounted terms (bytes) against ``total`` bytes of budget."""

    total: int
    terms: tuple[tuple[str, int], ...]

    @property
    def used(self) -> int:
        return sum(v for _, v in self.terms)

    @property
    def free(self) -> int:
        return self.total - self.used

    def table(self) -> str:
        lines = [f"  {name:<16} {fmt_bytes(v):>10}  ({v:,} bytes)" for name, v in self.terms]
        lines.append(f"  {'total':<16} {fmt_bytes(self.used):>10}  ({self.used:,} bytes)")
        lines.append(f"  {'budget':<16} {fmt_bytes(self.total):>10}  ({self.total:,} bytes)")
        return "\n".join(lines)


def plan(cfg, weight_bytes: int, kv_bytes: int, n_slots: int, n_ctx: int, prefill_chunk: int,
         journal_bytes: int, total: int, media_bytes: int = 0, capsule_bytes: int = 0,
         capsule_device_bytes: int = 0, prefill_weight_bytes: int = 0,
         draft_terms: tuple[tuple[str, int], ...] = (), kv_type: str = "f16", expert_cache_bytes: int = 0) -> Budget:
    """The budget of a configuration (bytes; on CUDA ``total`` is GPU memory and the
    capsule share is their device home). ``draft_terms``: a draft model's (name, bytes)
    terms (``DraftModel.budget_terms``: its weights, its KV for every slot, its working
    buffers). ``kv_type``: the KV cache's element type ("f16" | "f32" | "q8_0" | "q4_0"), whose size
    ``kv_bytes`` already is; shown in the table. ``expert_cache_bytes``: a mixture-of-experts
    model's GPU expert cache (sized from what the other terms leave; its experts are not
    in ``weight_bytes`` on CUDA). Raises AdmissionError with every term when it does not fit."""
    tables = n_slots * (n_ctx * 8 + 256)  # slot token lists and table rows
    terms = (("weights", weight_bytes), ("prefill weights", prefill_weight_bytes), (f"kv cache ({kv_type})", kv_bytes),
             ("working buffers", working_bytes(cfg, prefill_chunk, n_slots, n_ctx)),
             ("runtime tables", tables), ("journal buffers", journal_bytes),
             ("capsules (host)", capsule_bytes), ("capsules (device)", capsule_device_bytes), ("media", media_bytes),
             ("experts (gpu cache)", expert_cache_bytes))
    # shown where the backend has them
    optional = {"prefill weights", "capsules (device)", "capsules (host)", "experts (gpu cache)"}
    b = Budget(total, tuple((n, v) for n, v in terms if v or n not in optional) + tuple(draft_terms))
    if b.used > b.total:
        raise AdmissionError(f"the configuration does not fit: {n_slots} slots x {n_ctx} tokens of context "
                             f"needs {fmt_bytes(b.used)} ({b.used:,} bytes), the budget is {fmt_bytes(total)} "
                             f"({total:,} bytes):\n{b.table()}\nlower --slots or --context, "
                             f"{_smaller_kv(kv_type)}or raise --memory-budget")
    return b


def _smaller_kv(kv_type: str) -> str:
    """The advice toward a KV type that takes less memory ("" for the smallest)."""
    smaller = {"f32": "f16 (or q8_0)", "f16": "q8_0 (or q4_0)", "q8_0": "q4_0"}.get(kv_type)
    return f"use --kv-type {smaller}, " if smaller else ""


#: the context below which a default is said out loud (the default before budgets chose it)
CONTEXT_FLOOR = 4096
CONTEXT_STEP = 256  # a chosen context is a multiple of this many tokens


@dataclass(frozen=True)
class ContextChoice:
    """The context a slot serves and why: ``n_ctx`` tokens, ``line`` (the numbers, for the
    start's log), ``notice`` (what a user must hear: "" when nothing was cut short)."""

    n_ctx: int
    line: str
    notice: str = ""


def choose_context(asked: int | None, n_ctx_train: int, fits, kv_bytes, n_slots: int, total: int, kv_type: str,
                   model: str = "the model") -> ContextChoice:
    """The context of each slot: ``asked`` (``--context``) when given, clamped to the
    model's trained context with a notice; else the trained context when ``n_slots`` x it x
    the KV bytes a token fit the budget (``fits(n_ctx)``: the whole budget table of that
    context fits ``total``), else the largest multiple of CONTEXT_STEP that fits, with a
    notice when that is below CONTEXT_FLOOR. ``kv_bytes(n_slots, n_ctx)``: the KV cache's
    bytes. A model that states no trained context gets CONTEXT_FLOOR. When nothing fits, the
    trained context is returned (``plan`` then refuses with every term)."""
    train = n_ctx_train or CONTEXT_FLOOR
    per_token = kv_bytes(1, 1)
    if asked:
        if asked > train:
            return ContextChoice(train, f"context {train:,} tokens per slot", (
                f"--context {asked:,} is more than the {train:,} tokens {model} was trained for: each slot holds "
                f"{train:,} (past it the model's positions mean nothing)"))
        return ContextChoice(asked, f"context {asked:,} tokens per slot (--context)")

    def numbers(n: int) -> str:
        kv = kv_bytes(n_slots, n)
        return (f"{n_slots} slots x {n:,} tokens x {fmt_bytes(per_token)} of {kv_type} KV a token = "
                f"{fmt_bytes(kv)} of the {fmt_bytes(total)} budget")

    if fits(train):
        return ContextChoice(train, f"context {train:,} tokens per slot, the model's trained context: {numbers(train)}")
    lo, hi = 0, train // CONTEXT_STEP        # the largest k with fits(k * STEP)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid * CONTEXT_STEP):
            lo = mid
        else:
            hi = mid - 1
    if lo == 0:
        return ContextChoice(train, f"context {train:,} tokens per slot")
    n = lo * CONTEXT_STEP
    whole = (f"the model's trained {train:,} would need {fmt_bytes(kv_bytes(n_slots, train))} of KV for {n_slots} "
             f"slots")
    line = f"context {n:,} tokens per slot, the most the budget holds ({whole}): {numbers(n)}"
    notice = ""
    if n < CONTEXT_FLOOR <= train:
        notice = (f"the memory budget leaves room for {n:,} tokens of context per slot, below {CONTEXT_FLOOR:,} "
                  f"({numbers(n)}): raise --memory-budget, lower --slots, or use --kv-type "
                  f"{'q8_0' if kv_type in ('f32', 'f16') else 'q4_0'}")
    return ContextChoice(n, line, notice)


#: GPU memory kept free beside the expert cache (allocator slack, copy staging)
EXPERT_CACHE_RESERVE = 256 << 20


def check_experts(plan, total_bytes: int, ram_bytes: int, gpu: bool) -> list[str]:
    """Admission of a mixture-of-experts model's experts (``plan``: engine/model/experts.Plan;
    ``total_bytes``: all routed experts; ``ram_bytes``: the machine's RAM; ``gpu``: the engine
    runs on a GPU). On the CPU the experts are part of the weights the budget table already
    counts. On a GPU, the experts the cache does not hold are computed by the CPU pool from
    host memory: refuses (AdmissionError, with the numbers) when they do not fit the RAM
    less 2 GiB for everything else (each token would read them from disk). Returns the lines
    to report: where the experts live and, on a GPU, that the CPU tier computes all of
    them (the GPU budget left no room for any after the weights, KV and working memory) or
    that the model fits only with some on the CPU, with the speed the calibration predicts."""
    off_gpu = total_bytes - plan.gpu_bytes
    if gpu and off_gpu > ram_bytes - (2 << 30):
        raise AdmissionError(
            f"the experts do not fit: {fmt_bytes(total_bytes)} ({total_bytes:,} bytes) of experts, the GPU cache holds "
            f"{fmt_bytes(plan.gpu_bytes)} and the other {fmt_bytes(off_gpu)} need host memory, but the machine has "
            f"{fmt_bytes(ram_bytes)} of RAM; raise --memory-budget, lower --slots or --context, or use a smaller file")
    lines = [plan.summary()]
    if gpu and plan.count("gpu") == 0:
        lines.append(f"the GPU budget leaves no room for routed experts after the weights, KV and working memory, so "
                     f"the CPU tier computes all {plan.n_experts} of them (a larger --memory-budget puts some on the GPU): "
                     f"expect about {plan.decode_tok_s:.1f} tokens/s decode and {plan.prefill_tok_s:.0f} tokens/s "
                     f"prefill (calibrated on this machine)")
    elif gpu and plan.count("gpu") < plan.n_experts:
        lines.append(f"this model fits the GPU budget only with {plan.n_experts - plan.count('gpu')} of its "
                     f"{plan.n_experts} experts on the CPU: expect about {plan.decode_tok_s:.1f} tokens/s decode and "
                     f"{plan.prefill_tok_s:.0f} tokens/s prefill (calibrated on this machine)")
    return lines
