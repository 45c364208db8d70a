"""``aotx status``: what the running engine has and does, as a table (or JSON).

Owns: the status output (model, device, budget terms, loaded models, slots, capsules) and
the journal's state in words (``journal_line``). Leaves connecting to ``client.py``.
"""

from __future__ import annotations

from aotx.engine.cli.client import _jprint, connect


async def status(args) -> int:
    """``aotx status``: the running engine's model, device, budget table, loaded models,
    slots, capsules and journal (``--json``: every field)."""
    from aotx.engine.units import fmt_bytes

    client = await connect(args, spawn=False)
    try:
        st = await client.status()
    finally:
        await client.close()
    if args.json:
        _jprint({"model": st.model, "model_path": st.model_path, "device": st.device, "ready": st.ready,
                 "budget_bytes": st.budget_bytes, "used_bytes": st.used_bytes,
                 "free_bytes": st.budget_bytes - st.used_bytes,
                 "budget": {b.name: b.bytes for b in st.budget}, "n_ctx": st.n_ctx, "queue": st.queue,
                 "tick": st.tick, "slots": [{"slot": s.slot, "state": s.state, "conversation": s.conv_id,
                                             "position": s.position} for s in st.slots],
                 "journal": st.journal, "capsules": st.capsules, "profile": st.profile, "stats": st.stats,
                 "fingerprint": st.fingerprint, "draft_model": st.draft_model,
                 "draft_model_path": st.draft_model_path, "degraded": st.degraded, "notices": st.notices})
        return 0
    print(f"model   {st.model} ({st.model_path})")
    if st.draft_model:
        print(f"draft   {st.draft_model} ({st.draft_model_path}): its own KV per slot, counted below")
    print(f"device  {st.device}   ready: {'yes' if st.ready else 'NO'}"
          f"{'   DEGRADED: new work is held' if st.degraded else ''}   context {st.n_ctx} tokens per slot")
    if st.degraded:
        print(f"disk    {st.degraded}")
    for line in st.notices:
        print(f"notice  {line}")
    print("budget")
    for b in st.budget:
        print(f"  {b.name:<16} {fmt_bytes(b.bytes):>10}  ({b.bytes:,} bytes)")
    print(f"  {'used':<16} {fmt_bytes(st.used_bytes):>10}  ({st.used_bytes:,} bytes)")
    print(f"  {'free':<16} {fmt_bytes(st.budget_bytes - st.used_bytes):>10}  "
          f"({st.budget_bytes - st.used_bytes:,} bytes of {st.budget_bytes:,})")
    if len(st.models) > 1:
        print("models  (loaded)")
        for m in st.models:
            what = "remote" if m.kind == "remote" else fmt_bytes(m.needs_bytes)
            busy = f"generating ({m.busy})" if m.busy else f"idle {m.idle_s:.0f} s"
            print(f"  {'*' if m.default else ' '} {m.name:<36} {what:>10}  {busy}")
    print(f"slots   ({st.queue} queued)")
    several = len({s.model for s in st.slots}) > 1
    for s in st.slots:
        owner = f"{s.model}: " if several else ""
        print(f"  {owner}{s.slot:>3}  {s.state:<8} {s.conv_id or '-':<14} {s.position} tokens in KV")
    if st.capsules:
        c = st.capsules
        if c.get("device_budget"):
            print(f"capsules device {fmt_bytes(c.get('device_bytes', 0))} in {c.get('device_count', 0)} of "
                  f"{fmt_bytes(c.get('device_budget', 0))}")
        print(f"capsules host {fmt_bytes(c.get('host_bytes', 0))} in {c.get('host_count', 0)} of "
              f"{fmt_bytes(c.get('host_budget', 0))}   disk {fmt_bytes(c.get('disk_bytes', 0))} in "
              f"{c.get('disk_count', 0)} of {fmt_bytes(c.get('disk_budget', 0))}   (least recently used evicted first)")
    if st.journal:
        print("journal " + journal_line(st.journal))
    return 0


def journal_line(j: dict) -> str:
    """The journal's state in words: where it writes, what is durable, the buffer, and only
    what is unusual (a checkpoint running, a disk that is full, a failure); ``--json`` has
    every counter."""
    from aotx.engine.units import fmt_bytes

    if not j.get("enabled", True):
        return "off (--no-journal): nothing is made durable"
    parts = [f"segment {j.get('segment', '?')} ({fmt_bytes(j.get('segment_bytes', 0))})",
             f"durable up to seq {j.get('durable_seq', 0)} of {j.get('last_seq', 0)}",
             f"buffer {fmt_bytes(j.get('used', 0))} of {fmt_bytes(j.get('capacity', 0))} in use",
             f"{j.get('fsyncs', 0):,} fsyncs"]
    if j.get("checkpointing"):
        parts.append("writing a checkpoint")
    if j.get("degraded"):
        parts.append(f"DEGRADED: {j['degraded']}")
    if j.get("failed"):
        parts.append(f"FAILED: {j['failed']}")
    return ", ".join(parts)
