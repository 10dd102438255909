"""Prometheus metrics of the router, fed by the scheduler's observer hooks.

Each server owns its own CollectorRegistry, so tests can run several servers in one process. Names
follow the glossary: drafted, accepted, recovered, bonus, step, gamma.

    specd_request_latency_seconds        histogram, by finish reason
    specd_time_to_first_token_seconds    histogram
    specd_generated_tokens_total         counter (tokens/s = rate of it)
    specd_request_tokens_per_second      histogram of completion tokens / total time per request
    specd_queue_depth, specd_running_requests                      gauges
    specd_drafted_tokens_total, specd_accepted_tokens_total        counters by drafter version
    specd_acceptance_rate                gauge, accepted / drafted since start
    specd_accepted_length                histogram of tokens emitted per step (accepted + 1)
    specd_tokens_per_step                gauge, (accepted + recovered + bonus) / steps since start
    specd_mean_accepted_length           gauge, 1 + accepted / steps that drafted, since start
    specd_position_drafted_total, specd_position_accepted_total    counters by draft position
    specd_gamma                          histogram of the γ each step used (tree: its depth)
    specd_drafter_version_info           gauge = 1 for the version each replica last used
    specd_worker_busy_fraction           gauge by replica and worker (target, drafter)
    specd_pipeline_overlap_fraction      gauge by replica
    specd_goodput_predicted_tokens_per_second, specd_goodput_measured_tokens_per_second
                                         gauges by replica: the goodput controller's estimate of its plans
                                         vs what the steps delivered (EMAs; 0 when no request uses it)
    specd_guard_speculation_allowed      gauge by replica: 1 while the speculation guard lets drafting run
    specd_guard_tokens_per_second        gauge by replica and mode (on, off): decode tokens per busy second
                                         of the guard's recent windows at the current load
    specd_guard_windows_total            counter by replica and mode: the guard's measured windows
    specd_guard_skipped_steps_total      counter by replica: steps the guard kept from drafting
    specd_server_insecure                gauge: 1 while serving off loopback without a token
    specd_router_info                    info: this router's name (ray.router_id: a pod's name), so that
                                         the series of several routers behind one Service tell apart
    specd_http_requests_total            counter by endpoint and status: the OpenAI-compatible HTTP API
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, start_http_server

from specd.cluster.redact import redact_text
from specd.cluster.scheduler import SchedulerObserver, ServedStats
from specd.workers.engine.types import Draft, FinishReason, VerifyResult

_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128)
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16)
_RATE_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500)
_STEP_BUCKETS = tuple(range(0, 17))


class SpecdMetrics(SchedulerObserver):
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.latency = Histogram("specd_request_latency_seconds", "Request latency, arrival to last token",
                                 ["reason"], buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("specd_time_to_first_token_seconds", "Arrival to first generated token",
                              buckets=_TTFT_BUCKETS, registry=r)
        self.tokens = Counter("specd_generated_tokens", "Generated (completion) tokens", registry=r)
        self.tokens_per_s = Histogram("specd_request_tokens_per_second",
                                      "Completion tokens over total time, per request",
                                      buckets=_RATE_BUCKETS, registry=r)
        self.http_requests = Counter("specd_http_requests", "HTTP API requests by endpoint and status",
                                     ["endpoint", "status"], registry=r)
        self.queue_depth = Gauge("specd_queue_depth", "Requests waiting for a slot", registry=r)
        self.live = Gauge("specd_live_config", "Live-tunable speculation settings now in force", ["key"],
                          registry=r)
        self.live_policy = Gauge("specd_live_policy_info", "Default γ policy and drafter version pin",
                                 ["policy", "version_pin"], registry=r)
        self.live_changes = Counter("specd_live_config_sets", "Times the live settings were set (start "
                                    "included)", registry=r)
        self.running = Gauge("specd_running_requests", "Requests holding a slot", registry=r)
        self.requests = Counter("specd_requests", "Finished requests", ["reason"], registry=r)
        self.drafted = Counter("specd_drafted_tokens", "Drafted tokens", ["drafter_version"], registry=r)
        self.accepted = Counter("specd_accepted_tokens", "Accepted draft tokens", ["drafter_version"],
                                registry=r)
        self.acceptance_rate = Gauge("specd_acceptance_rate", "accepted / drafted since start", registry=r)
        self.accepted_length = Histogram("specd_accepted_length", "Tokens emitted per step (accepted + 1)",
                                         buckets=_STEP_BUCKETS, registry=r)
        self.tokens_per_step = Gauge("specd_tokens_per_step",
                                     "(accepted + recovered + bonus) / steps since start", registry=r)
        self.mean_accepted_length = Gauge("specd_mean_accepted_length",
                                          "1 + accepted / steps that drafted, since start", registry=r)
        self.position_drafted = Counter("specd_position_drafted", "Steps with a draft at this position",
                                        ["position", "drafter_version"], registry=r)
        self.position_accepted = Counter("specd_position_accepted",
                                         "Steps whose draft at this position was accepted",
                                         ["position", "drafter_version"], registry=r)
        self.gamma = Histogram("specd_gamma", "Draft positions used per step (γ; tree: depth)",
                               buckets=_STEP_BUCKETS, registry=r)
        self.drafter_failures = Counter("specd_drafter_failures", "Drafter calls that failed (the "
                                        "drafter died, or raised)", ["replica"], registry=r)
        self.drafter_fallback = Counter("specd_drafter_fallback_requests", "Requests that went on by "
                                        "target-only decoding because their drafter failed", ["replica"],
                                        registry=r)
        self.drafter_down = Gauge("specd_drafter_down", "1 while a replica's drafter has failed and not "
                                  "answered again (its requests are decoded target-only)", ["replica"],
                                  registry=r)
        self.server_insecure = Gauge("specd_server_insecure", "1 while the gRPC port listens off loopback "
                                     "without a bearer token (server.insecure=true)", registry=r)
        self.router = Info("specd_router", "This router: its name (ray.router_id, else the host name)",
                           registry=r)
        self.compiled_calls = Counter("specd_compiled_graph_calls", "Router calls to a worker that a "
                                      "compiled Ray graph carried (ray.compiled_calls)",
                                      ["replica", "worker"], registry=r)
        self._graph_counts: dict[tuple[str, str], int] = {}
        self._drafter_counts: dict[str, tuple[int, int]] = {}
        self.drafter_version = Gauge("specd_drafter_version_info", "Drafter version a replica last used",
                                     ["replica", "drafter_version"], registry=r)
        self.busy = Gauge("specd_worker_busy_fraction", "Worker compute time / time with requests",
                          ["replica", "worker"], registry=r)
        self.vllm_unfinished = Gauge("specd_vllm_unfinished_requests",
                                     "vllm backend: requests the vLLM engine holds (running or queued)",
                                     ["replica"], registry=r)
        self.overlap = Gauge("specd_pipeline_overlap_fraction",
                             "Least share of active time with drafting and verifying at once", ["replica"],
                             registry=r)
        self.goodput_predicted = Gauge("specd_goodput_predicted_tokens_per_second",
                                       "Tokens/s the goodput controller expected of its γ plans (EMA)",
                                       ["replica"], registry=r)
        self.goodput_measured = Gauge("specd_goodput_measured_tokens_per_second",
                                      "Tokens/s the drafted steps delivered (EMA)", ["replica"], registry=r)
        self.guard_allowed = Gauge("specd_guard_speculation_allowed", "1 while the speculation guard lets "
                                   "drafting run (workers/core/guard.py)", ["replica"], registry=r)
        self.guard_tokens_per_s = Gauge("specd_guard_tokens_per_second", "Decode tokens per busy second of "
                                        "the guard's recent windows at the current load", ["replica", "mode"],
                                        registry=r)
        self.guard_windows = Counter("specd_guard_windows", "Windows the speculation guard measured",
                                     ["replica", "mode"], registry=r)
        self.guard_skipped = Counter("specd_guard_skipped_steps", "Steps the speculation guard kept from "
                                     "drafting", ["replica"], registry=r)
        self._guard_counts: dict[str, tuple[int, int, int]] = {}
        self._versions: dict[int, str] = {}
        self._sum_drafted = self._sum_accepted = self._sum_emitted = self._steps = self._drafting_steps = 0

    # ---- SchedulerObserver ---------------------------------------------------------------------
    def set_live_config(self, bounds, version_pin: str | None) -> None:
        """Gauges of the settings `specd admin set` changes (cluster/admin.py), set at start and on
        every change."""
        values = {"spec_enabled": float(bounds.spec_enabled), "gamma_default": bounds.gamma_default,
                  "gamma_min": bounds.gamma_min, "gamma_max": bounds.gamma_max,
                  "tree_width_default": bounds.tree_width_default, "tree_width_max": bounds.tree_width_max}
        for key, value in values.items():
            self.live.labels(key=key).set(value)
        self.live_policy.clear()
        self.live_policy.labels(policy=str(bounds.policy_default),
                                version_pin=redact_text(version_pin or "")).set(1)
        self.live_changes.inc()

    def on_queue(self, waiting: int, running: int) -> None:
        self.queue_depth.set(waiting)
        self.running.set(running)

    def on_first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def on_step(self, replica: int, draft: Draft, result: VerifyResult, depth: int) -> None:
        version = draft.drafter_version or "none"
        self.drafted.labels(version).inc(result.num_drafted)
        self.accepted.labels(version).inc(result.num_accepted)
        for pos in range(depth):
            self.position_drafted.labels(str(pos), version).inc()
        for pos in range(min(result.num_accepted, depth)):
            self.position_accepted.labels(str(pos), version).inc()
        self.gamma.observe(depth)
        self.accepted_length.observe(len(result.new_tokens))
        self._sum_drafted += result.num_drafted
        self._sum_accepted += result.num_accepted
        self._sum_emitted += len(result.new_tokens)
        self._steps += 1
        self._drafting_steps += int(result.num_drafted > 0)
        if self._drafting_steps:
            self.mean_accepted_length.set(1.0 + self._sum_accepted / self._drafting_steps)
        if self._sum_drafted:
            self.acceptance_rate.set(self._sum_accepted / self._sum_drafted)
        self.tokens_per_step.set(self._sum_emitted / self._steps)
        # Only a step that drafted says which version serves: a step the plan kept from drafting (γ 0, the
        # guard, a suffix-only draft) carries no version, and once flipped the gauge to "none".
        if draft.drafter_version and result.num_drafted > 0 and self._versions.get(replica) != version:
            old = self._versions.get(replica)
            if old is not None:
                self.drafter_version.remove(str(replica), old)
            self._versions[replica] = version
            self.drafter_version.labels(str(replica), version).set(1)

    def on_finish(self, reason: FinishReason, stats: ServedStats) -> None:
        self.requests.labels(reason).inc()
        self.latency.labels(reason).observe(stats.total_time)
        self.tokens.inc(stats.completion_tokens)
        if stats.total_time > 0 and stats.completion_tokens:
            self.tokens_per_s.observe(stats.completion_tokens / stats.total_time)

    # ---- polled --------------------------------------------------------------------------------
    def set_worker_stats(self, stats: list[dict]) -> None:
        """Gauges from Scheduler.worker_stats() (polled: busy time lives in the workers)."""
        for s in stats:
            replica = str(s["replica"])
            self.busy.labels(replica, "target").set(s["target_busy_fraction"])
            self.busy.labels(replica, "drafter").set(s["drafter_busy_fraction"])
            self.overlap.labels(replica).set(s["overlap_fraction"])
            if "drafter_failures" in s:
                # counted in the scheduler's steps; the poll adds what is new since the last one
                before = self._drafter_counts.get(replica, (0, 0))
                now = (s["drafter_failures"], s["drafter_fallback_requests"])
                self.drafter_failures.labels(replica).inc(max(0, now[0] - before[0]))
                self.drafter_fallback.labels(replica).inc(max(0, now[1] - before[1]))
                self._drafter_counts[replica] = now
                self.drafter_down.labels(replica).set(1.0 if s["drafter_down"] else 0.0)
            for worker, n in s.get("compiled_calls", {}).items():
                before = self._graph_counts.get((replica, worker), 0)
                self.compiled_calls.labels(replica, worker).inc(max(0, n - before))
                self._graph_counts[(replica, worker)] = n
            if "guard_allowed" in s:
                self._set_guard(replica, s)
            if "vllm_unfinished" in s:
                self.vllm_unfinished.labels(replica).set(s["vllm_unfinished"])
            if "goodput_predicted" in s:
                self.goodput_predicted.labels(replica).set(s["goodput_predicted"])
                self.goodput_measured.labels(replica).set(s["goodput_measured"])

    def _set_guard(self, replica: str, s: dict) -> None:
        self.guard_allowed.labels(replica).set(1.0 if s["guard_allowed"] else 0.0)
        self.guard_tokens_per_s.labels(replica, "on").set(s["guard_on_tokens_per_s"])
        self.guard_tokens_per_s.labels(replica, "off").set(s["guard_off_tokens_per_s"])
        # counted in the scheduler's guard; the poll adds what is new since the last one
        now = (s["guard_windows_on"], s["guard_windows_off"], s["guarded_steps"])
        before = self._guard_counts.get(replica, (0, 0, 0))
        self.guard_windows.labels(replica, "on").inc(max(0, now[0] - before[0]))
        self.guard_windows.labels(replica, "off").inc(max(0, now[1] - before[1]))
        self.guard_skipped.labels(replica).inc(max(0, now[2] - before[2]))
        self._guard_counts[replica] = now

    def serve_http(self, port: int, host: str = "0.0.0.0"):
        """Expose /metrics; returns the HTTP server (call .shutdown() to stop) and the port it bound."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return server, server.server_address[1]
