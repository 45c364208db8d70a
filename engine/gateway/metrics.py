"""Prometheus metrics of the gateway and its engine: ``GET /metrics``.

Owns: the gateway's counters (HTTP requests by route, method and status; tokens of
finished replies by kind: prompt, cached prompt, completion; replies by finish reason),
the time-to-first-token histogram (the engine's measure of each reply, from its
submission to its first token), and, read from the engine's status at each scrape, its
state: generations in flight here, the engine's queue, slots by state, KV cache use (the
positions its slots hold, of their capacity), the journal's lag (records published and
not yet durable), its receipts and fsyncs so far, and whether the engine answers. A
registry of its own per application (prometheus-client), exposed in Prometheus' text
format; the key is asked as on every route. Leaves HTTP to ``server.py``.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from aotx.engine import protocol as P

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class _EngineState:
    """A prometheus-client collector of the engine's status taken at the scrape."""

    def __init__(self) -> None:
        self.status: P.StatusReply | None = None
        self.in_flight = 0

    def describe(self) -> list:
        return []

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        st = self.status
        yield GaugeMetricFamily("aotx_engine_up", "1 when the engine answered its status at this scrape",
                                value=1 if st is not None else 0)
        yield GaugeMetricFamily("aotx_gateway_generations_in_flight", "generations this gateway has in flight",
                                value=self.in_flight)
        if st is None:
            return
        yield GaugeMetricFamily("aotx_engine_queue_depth", "requests waiting in line for a slot", value=st.queue)
        slots = GaugeMetricFamily("aotx_engine_slots", "slots by state (free, prefill, decode)", labels=["state"])
        counts: dict[str, int] = {"free": 0, "prefill": 0, "decode": 0}
        for s in st.slots:
            counts[s.state] = counts.get(s.state, 0) + 1
        for k, v in sorted(counts.items()):
            slots.add_metric([k], v)
        yield slots
        used = sum(s.position for s in st.slots)
        cap = len(st.slots) * st.n_ctx
        yield GaugeMetricFamily("aotx_engine_kv_used_tokens", "positions the slots' KV cache holds", value=used)
        yield GaugeMetricFamily("aotx_engine_kv_capacity_tokens", "positions the slots' KV cache can hold", value=cap)
        yield GaugeMetricFamily("aotx_engine_kv_used_ratio", "KV cache use, of its capacity",
                                value=used / cap if cap else 0.0)
        j = st.journal or {}
        if j.get("enabled"):
            last, durable = int(j.get("last_seq", 0)), int(j.get("durable_seq", 0))
            yield GaugeMetricFamily("aotx_journal_lag_records", "records published and not yet durable (receipted)",
                                    value=max(0, last - durable))
            yield GaugeMetricFamily("aotx_journal_durable_seq", "the last sequence number made durable", value=durable)
            yield CounterMetricFamily("aotx_journal_receipts", "receipts the journal issued since the engine started",
                                      value=int(j.get("receipts", 0)))
            yield CounterMetricFamily("aotx_journal_fsyncs", "fsyncs of the journal since the engine started",
                                      value=int(j.get("fsyncs", 0)))
        yield GaugeMetricFamily("aotx_engine_degraded", "1 while the engine holds new work (the journal's disk is "
                                "full)", value=1 if st.degraded else 0)


class Metrics:
    """The metrics of one gateway application."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = r = CollectorRegistry()
        self.requests = Counter("aotx_gateway_requests", "HTTP requests answered", ["route", "method", "status"],
                                registry=r)
        self.tokens = Counter("aotx_gateway_tokens", "tokens of finished replies (prompt counts the cached ones)",
                              ["kind"], registry=r)
        self.replies = Counter("aotx_gateway_replies", "finished replies by finish reason", ["finish"], registry=r)
        self.ttft = Histogram("aotx_gateway_time_to_first_token_seconds",
                              "time from a reply's submission to its first token (the engine's measure)",
                              buckets=TTFT_BUCKETS, registry=r)
        self.engine = _EngineState()
        r.register(self.engine)

    def reply(self, gen: Any, reply: Any) -> None:
        """A reply finished (every choice committed): its tokens, finish and TTFT."""
        self.tokens.labels("prompt").inc(reply.n_prompt)
        self.tokens.labels("cached").inc(reply.n_cached)
        self.tokens.labels("completion").inc(reply.n_completion)
        for c in reply.choices:
            self.replies.labels(c.finish_reason).inc()
        for cm in gen.committed.values():
            t = cm.timings.get("ttft_s") if cm.timings else None
            if t is not None and cm.n_completion > 0:
                self.ttft.observe(float(t))

    def middleware(self, app: Any) -> Any:
        """ASGI middleware counting every HTTP answer by its route's template."""
        metrics = self

        async def counted(scope: dict, receive: Any, send: Any) -> None:
            if scope.get("type") != "http":
                await app(scope, receive, send)
                return
            status = {"code": 500}

            async def watch(message: dict) -> None:
                if message.get("type") == "http.response.start":
                    status["code"] = message.get("status", 500)
                await send(message)

            try:
                await app(scope, receive, watch)
            finally:
                metrics.requests.labels(route_of(scope), scope.get("method", ""), str(status["code"])).inc()

        return counted

    async def endpoint(self, gw: Any, request: Request) -> Response:
        """``GET /metrics``."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        gw._auth(request)
        self.engine.in_flight = gw.inflight.total
        try:
            self.engine.status = await (await gw.link.get()).status()
        except Exception:  # noqa: BLE001 - no engine: aotx_engine_up 0, the gateway's own metrics still
            self.engine.status = None
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)


def route_of(scope: dict) -> str:
    """The request's route as a template (``/v1/models/{name}``): its path with each path
    parameter's value replaced by the parameter's name; "unmatched" for a path no route
    took (so a scan of random paths cannot grow the label set)."""
    if "endpoint" not in scope:
        return "unmatched"
    path = scope.get("path", "")
    for k, v in (scope.get("path_params") or {}).items():
        if isinstance(v, str) and v:
            path = path.replace(v, "{" + k + "}")
    return path
