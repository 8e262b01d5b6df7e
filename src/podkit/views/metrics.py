"""`podkit run metrics`: a Prometheus endpoint for the pod, built with the Prometheus client library.
Each scrape reads what `podkit status` reads (the records, supervisord's answer), so the healthcheck,
`podkit status` and `/metrics` never disagree: each program's state, restarts and last exit; the
trainer's step, seconds since it, loss and reward; the last checkpoint's step and age; the last
weight update's duration; the boots in the guard's window; safe mode (served by the waiting boot).

Bound to `metrics.host` (loopback by default) on `metrics.port` (0: off). Beyond loopback it needs
PODKIT_METRICS_KEY, and every scrape then sends `Authorization: Bearer <key>` (Prometheus:
`authorization: {credentials: ...}`). SGLang's own /metrics, by contrast, is open even with its key.
"""

from __future__ import annotations

import hmac
import os
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from podkit import log, records
from podkit.areal.checks import METRICS_KEY_ENV as KEY_ENV
from podkit.areal.checks import loopback, usable_key
from podkit.host import supervisord
from podkit.judge import ending, standing
from podkit.money import spend
from podkit.views import status, web

_log = log.get("metrics")


class PodCollector:
    """The pod's figures, read at each scrape. `safe_mode` is the waiting boot's own view (no supervisord)."""

    def __init__(self, workspace: Path, window_s: float, state_dir: Path | None = None,
                 remote: bool | None = None) -> None:
        self.ws, self.window_s, self.remote = Path(workspace), window_s, remote
        self.state = Path(state_dir) if state_dir is not None else self.ws / ".podkit"  # this node's records

    def collect(self):
        """The families, each label value as UTF-8 can carry it: a lone surrogate (a non-UTF-8 byte in a path,
        decoded by the filesystem's rules) made every scrape a 500."""
        for fam in self._families():
            for i, smp in enumerate(fam.samples):
                if any(not _utf8(v) for v in smp.labels.values()):
                    fam.samples[i] = smp._replace(labels={k: v if _utf8(v) else v.encode("utf-8", "backslashreplace")
                                                          .decode("utf-8") for k, v in smp.labels.items()})
            yield fam

    def _families(self):
        st = status.collect(self.ws, self.state, self.remote)
        now = time.time()  # after the read: a step recorded while status read is not in the future
        safe = st.get("safe_mode") or {}
        g = GaugeMetricFamily("podkit_safe_mode", "1 while the pod waits in safe mode, by the stage that failed",
                              labels=["stage"])
        g.add_metric([str(safe.get("stage", ""))], 1.0 if safe else 0.0)
        yield g
        yield GaugeMetricFamily("podkit_supervisord_up", "1 when supervisord answers",
                                value=1.0 if st["supervisord"].get("reachable") else 0.0)
        state = GaugeMetricFamily("podkit_program_state", "1 for each program's current supervisord state",
                                  labels=["program", "state"])
        up = GaugeMetricFamily("podkit_program_up", "1 when the program is STARTING or RUNNING", labels=["program"])
        restarts = CounterMetricFamily("podkit_program_restarts", "starts of the program after its first, "
                                       "under this supervisord", labels=["program"])
        exit_status = GaugeMetricFamily("podkit_program_last_exit_status", "the program's last exit status",
                                        labels=["program"])
        for name, p in sorted(st["programs"].items()):
            state.add_metric([name, p["state"]], 1.0)
            up.add_metric([name], 1.0 if p["state"] in supervisord.UP else 0.0)
            restarts.add_metric([name], float(p["restarts"]))
            exit_status.add_metric([name], float(p["exitstatus"] or 0))
        yield from (state, up, restarts, exit_status)
        t = st["trainer"]
        ra = t.get("reattach") or {}
        reattach = CounterMetricFamily("podkit_inference_reattaches", "inference restarts the AReaL trainer went on "
                                       "through without a restart of its own (re-attached), and those that fell "
                                       "back to a trainer restart (counted in podkit_program_restarts too)",
                                       labels=["outcome"])
        for outcome, key in (("reattached", "count"), ("fell_back", "fell_back")):
            reattach.add_metric([outcome], float(ra.get(key) or 0))
        yield reattach
        for metric, doc, value in (
                ("podkit_trainer_step", "the trainer's last completed step", t.get("step")),
                ("podkit_trainer_last_step_timestamp_seconds", "when that step completed", t.get("last_progress")),
                ("podkit_trainer_seconds_since_step", "seconds since the last step",
                 max(0.0, now - t["last_progress"]) if t.get("last_progress") else None),
                ("podkit_trainer_loss", "the last step's loss", t.get("loss")),
                ("podkit_trainer_reward", "the last step's mean reward (AReaL)", t.get("reward")),
                ("podkit_checkpoint_step", "the step of the last checkpoint written", t.get("checkpoint_step")),
                ("podkit_checkpoint_age_seconds", "seconds since the last checkpoint was written",
                 max(0.0, now - t["checkpoint_time"]) if t.get("checkpoint_time") else None),
                ("podkit_weight_update_seconds", "how long the last weight update to inference took",
                 t.get("weight_update_s"))):
            if isinstance(value, (int, float)):
                yield GaugeMetricFamily(metric, doc, value=float(value))
        s = st["standing"]  # judged once by status.collect (standing.py): rendered here, never worked out again
        last = s.get("last") or {}
        final = s["run"] == standing.CANNOT and last.get("this_run") and last.get("family") == ending.FINAL
        g = GaugeMetricFamily("podkit_trainer_stopped_for_good", "1 while the trainer stays stopped because it cannot "
                              "train, by why (ending.py's final kinds: config-error, never-trained, and the loop "
                              "bound's crash-loop, hang-loop, oom-loop, outside-loop)", labels=["by"])
        for by in ending.FINAL_KINDS:
            g.add_metric([by], 1.0 if final and last.get("kind") == by else 0.0)
        yield g
        g = GaugeMetricFamily("podkit_run_standing", "1 for what the run is doing (standing.py: training, starting, "
                              "restarting, finished, stopped, cannot-train, ended, not-running, unknown, safe-mode, "
                              "no-trainer)", labels=["run"])
        for run in standing.RUNS:
            g.add_metric([run], 1.0 if s["run"] == run else 0.0)
        yield g
        if s["can_train"] is not None:  # unknown (supervisord does not answer): no sample rather than a guess
            yield GaugeMetricFamily("podkit_can_train", "1 while the run can still train (0: finished, or cannot: "
                                    "podkit status says why)", value=1.0 if s["can_train"] else 0.0)
        d = st.get("durable")
        if d:  # checkpoint.remote is set: what is off the pod
            for metric, doc, value in (
                    ("podkit_durable_step", "the last step whose checkpoint is whole on checkpoint.remote", d["step"]),
                    ("podkit_durable_age_seconds", "seconds since that checkpoint reached the remote", d["age_s"]),
                    ("podkit_at_risk_steps", "steps trained since the last durable checkpoint", d["at_risk_steps"]),
                    ("podkit_at_risk_dollars", "what the pod has cost since the last durable checkpoint (an "
                     "estimate at the price in force)", d["at_risk_usd"])):
                if isinstance(value, (int, float)):
                    yield GaugeMetricFamily(metric, doc, value=float(value))
            yield GaugeMetricFamily("podkit_upload_failing", "1 while the last upload to checkpoint.remote failed",
                                    value=1.0 if d["failing"] else 0.0)
            yield GaugeMetricFamily("podkit_upload_blocked", "1 while another pod holds the run's lease on "
                                    "checkpoint.remote (this pod uploads nothing)",
                                    value=1.0 if d.get("blocked") else 0.0)
            yield GaugeMetricFamily("podkit_remote_ahead_step", "the step of a newer checkpoint of this lineage on "
                                    "checkpoint.remote than this pod trains from (0: none)",
                                    value=float((d.get("ahead") or {}).get("step") or 0))
            yield GaugeMetricFamily("podkit_restore_failed", "1 while the boot's restore gave up: the trainer "
                                    "started without the remote's newest checkpoint",
                                    value=1.0 if (d.get("restore") or {}).get("outcome") == "failed" else 0.0)
        c = st.get("cost")
        if c:  # on RunPod: this pod's spend and the run's across its pods, each with how sure it is
            g = GaugeMetricFamily("podkit_spent_dollars", "USD spent, by scope (pod: this pod; run: the run across "
                                  "its pods, what guard.max_spend acts on) and how sure (billed, read, estimated)",
                                  labels=["scope", "source"])
            run = c.get("total") or {}
            for scope, value, source in (("pod", c.get("spent"), c.get("source")),
                                         ("run", spend.total(c), run.get("source") or c.get("source"))):
                if isinstance(value, (int, float)):
                    g.add_metric([scope, str(source)], float(value))
            yield g
        loop = records.TRAINER_LOOP.read(self.state)
        if loop.get("boot") != records.CURRENT.read(self.state).get("started"):
            loop = {}  # an earlier boot's count
        yield GaugeMetricFamily("podkit_trainer_failures_in_a_row", "the trainer's failures in a row without a new "
                                "step (the loop bound stops it at trainer.max_failures)",
                                value=float(loop.get("failures") or 0))
        g = GaugeMetricFamily("podkit_trainer_ends_in_a_row", "the loop bound's counts of the trainer's ends in a row "
                              "without a new step, by count: failures (the script's), hangs, ooms, outside (not the "
                              "script's: inference down, a network error, a kill)", labels=["count"])
        for c in ending.COUNTS.values():
            n = loop.get(c.key)
            g.add_metric([c.key], float(n) if isinstance(n, int) and not isinstance(n, bool) and 0 <= n < 10**6 else 0.0)
        yield g
        code = t.get("code") or {}
        if code.get("entry"):  # what trains: a run is traceable to its code
            info = GaugeMetricFamily("podkit_trainer_code_info", "1, labelled with the trainer's entry, the synced "
                                     "commit and whether the checkout had uncommitted changes",
                                     labels=["entry", "commit", "dirty"])
            info.add_metric([str(code["entry"]), str(code.get("commit") or ""), str(bool(code.get("dirty"))).lower()],
                            1.0)
            yield info
        timeline = st.get("startup") or {}
        if timeline.get("phases"):
            g = GaugeMetricFamily("podkit_startup_phase_seconds", "the last start-up, from the boot to the "
                                  "trainer's first step: how long each phase took (podkit status shows them)",
                                  labels=["phase"])
            for p in timeline["phases"]:
                g.add_metric([p["phase"]], float(p["took_s"]))
            yield g
        boots = records.BOOTS.read(self.state)
        yield GaugeMetricFamily("podkit_boots_in_window", "boots within guard.window_s (the crash-loop guard's count)",
                                value=float(sum(1 for b in boots if now - b.get("time", 0) <= self.window_s)))


def registry(workspace: Path, window_s: float, state_dir: Path | None = None,
             remote: bool | None = None) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(PodCollector(workspace, window_s, state_dir, remote))
    return reg


def _utf8(v: str) -> bool:
    try:
        v.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


# A scrape sends its request at once. A connection that has not within IDLE_S is closed, and at most
# MAX_CONNECTIONS are served at a time: a new one past that closes the oldest that has not sent its request
# yet, so idle connections pin neither threads nor fds, nor keep a real scrape waiting (web.Server).
IDLE_S = 5.0
MAX_CONNECTIONS = 32


class _Server(web.Server):
    max_connections = MAX_CONNECTIONS
    request_s = IDLE_S

    def handle_error(self, request, client_address) -> None:
        pass  # an evicted or vanished client: nothing to report, and no traceback in the log


def endpoint(host: str, key: str) -> tuple[str, str]:
    """Where /metrics may be served and with which key: beyond loopback only with a usable key (the
    check's rule, applied again where the socket is made, so no caller can serve what the check
    refused); otherwise loopback."""
    if key and not usable_key(key):
        key = ""
    return (host if loopback(host) or key else "127.0.0.1"), key


def server(host: str, port: int, reg: CollectorRegistry, key: str = "") -> ThreadingHTTPServer:
    """GET /metrics (with `Authorization: Bearer <key>` when a key is set); everything else 404."""
    if (host, key) != endpoint(host, key):
        raise ValueError(f"/metrics on {host} needs a {KEY_ENV} of visible ASCII")
    expected = f"Bearer {key}".encode()

    class Handler(BaseHTTPRequestHandler):
        timeout = IDLE_S

        def parse_request(self):
            ok = super().parse_request()  # the headers too: a client trickling them a byte a second stays a reader
            self.server.heard(self.connection)  # all in (a GET has no body): no longer the first to close
            return ok

        def do_GET(self):
            if self.path.split("?", 1)[0] != "/metrics":
                return self._answer(404, b"only /metrics here\n", "text/plain")
            # Bytes, as they came (http.server decodes headers as latin-1): any header compares, none raises.
            sent = self.headers.get("Authorization", "").encode("latin-1", "replace")
            if key and not hmac.compare_digest(sent, expected):
                return self._answer(401, b"Authorization: Bearer <PODKIT_METRICS_KEY>\n", "text/plain")
            try:
                body = generate_latest(reg)
            except Exception as e:  # noqa: BLE001 - a scrape that fails must say why, not kill the server
                return self._answer(500, f"{type(e).__name__}: {e}\n".encode(), "text/plain")
            self._answer(200, body, CONTENT_TYPE_LATEST)

        def _answer(self, code: int, body: bytes, ctype: str) -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_):
            pass

    return _Server((host, port), Handler)


def serve_in_background(host: str, port: int, workspace: Path, window_s: float, key: str = "",
                        state_dir: Path | None = None) -> bool:
    """For the boot waiting in safe mode: the same endpoint from a thread; False when it cannot bind.
    Safe mode may be explaining the very setting that made the endpoint unsafe: then loopback only."""
    if (host, key) != endpoint(host, key):
        _log.warn(f"serving /metrics on 127.0.0.1 only: {host} needs a usable {KEY_ENV}")
        host, key = endpoint(host, key)
    try:
        httpd = server(host, port, registry(workspace, window_s, state_dir), key)
    except OSError as e:
        _log.warn(f"cannot serve metrics on {host}:{port} ({e.strerror})")
        return False
    threading.Thread(target=httpd.serve_forever, name="metrics", daemon=True).start()
    return True


def _stop(*_):
    raise SystemExit(0)


def main(cfg) -> int:
    m = cfg.metrics
    signal.signal(signal.SIGTERM, _stop)
    if not m.port:
        from podkit.programs import idle

        return idle("metrics", "metrics.port is 0: no metrics endpoint")
    try:
        httpd = server(m.host, m.port, registry(cfg.workspace_path, cfg.guard.window_s, cfg.state_dir,
                                                  bool(cfg.checkpoint.remote)), os.environ.get(KEY_ENV, ""))
    except ValueError as e:  # what the boot's check refuses; not served here either
        _log.error(f"{e}; not serving /metrics")
        return 1
    except OSError as e:
        _log.error(f"cannot listen on {m.host}:{m.port} ({e.strerror}); set metrics.port to a free port (0: off)")
        return 1
    _log.info(f"serving /metrics on http://{m.host}:{m.port}/metrics" + (" (bearer key)" if os.environ.get(KEY_ENV)
                                                                         else ""))
    httpd.serve_forever()
    return 0
