"""`epikv serve --ray`: the same OpenAI routes served by Ray Serve, N replicas of either engine.

Ray Serve's own pieces do the serving: two deployments, the HTTP proxy, a deployment handle, `num_replicas` or an
`autoscaling_config` (between --min-replicas and --max-replicas by ongoing requests) and the replica health checks.
- `EngineReplica` (N replicas): one engine with its own cache behind `app.build_app`, built in the replica. It does
  not face HTTP itself: `forward` runs one HTTP request through that app in-process and streams back the response
  (status and headers with the first body bytes, then each further body chunk: one SSE event per chunk).
- `Router` (the ingress, one replica, no CPU of its own): Serve's proxy hands it each request; it streams it to an
  engine replica through a `DeploymentHandle` (Serve's router picks the replica with fewer ongoing requests of two it
  samples) and relays the answer. Because it outlives the engine replica it streams from, a replica whose process
  dies mid-answer still gives its client a clean end: an SSE `error` event and `data: [DONE]` on a stream, a 503 with
  Retry-After when nothing was sent yet. The controller restarts the replica (`check_health` also replaces one whose
  engine stopped); the other replicas' requests are unaffected. A client that leaves mid-stream cancels the handle's
  call, which cancels the request inside the replica (its cells are released).

What the single server does, each replica does for its own requests: 429 with Retry-After past --max-waiting (the
proxy picks the less loaded replica, so a 429 comes when the replicas sampled are full), --request-timeout, and the
drain: on SIGTERM the command sets a flag every replica reads within half a second (`_Registry`, a named Ray actor),
so each answers 503 with Retry-After to new requests and lets its requests in flight finish (up to --drain-timeout),
then this server's application is deleted (Serve and the cluster's other applications stay; a local Ray instance
stops with the command). A SIGTERM to the whole process group also ends a local instance's own processes: the
command sees them gone and exits without waiting on calls nobody would answer.
/stats is the answering replica's, with every replica's latest figures under "replicas" (each reports every half
second), keyed by replica id; /metrics covers every live replica, each series labelled with its `replica` (the
answering one's series as of the scrape, the others' at most half a second old; the answering replica's id is in
the X-Epikv-Replica header); answer ids carry the replica id.

Several servers share one cluster: each deploys its own application (--ray-app-name, unique by default) with its own
registry actor. Serve runs one HTTP proxy a cluster, so a later server answers on the first one's port under
/<its name> (the URL it prints), and a --port other than the proxy's is refused. Each replica reserves the CPUs its
engine's threads use.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import socket
import sys
import threading
import time

from ..errors import EpiKVError
from .config import ServeConfig

ENGINE = "EngineReplica"  # the engine replicas' deployment (the Router is the app's ingress)
REGISTRY = "epikv-serve-registry"  # + "-<application name>": one a server
NAMESPACE = "epikv-serve"
REPORT_S = 0.5  # how often a replica reports its figures and reads the drain flag


class _Registry:
    """A named Ray actor: every replica's latest /stats and /metrics text (by replica id) and the drain flag."""

    def __init__(self):
        self.replicas: dict[str, tuple[float, dict]] = {}
        self.metrics: dict[str, str] = {}
        self.drain: float | None = None

    def report(self, replica: str, stats: dict, metrics: str = ""):
        self.replicas[replica] = (time.time(), stats)
        self.metrics[replica] = metrics
        return self.drain

    def forget(self, replica: str):
        self.replicas.pop(replica, None)
        self.metrics.pop(replica, None)

    def _live(self, max_age: float) -> list[str]:
        now = time.time()
        return [r for r, (t, _) in sorted(self.replicas.items()) if now - t < max_age]

    def all(self, max_age: float = 5 * REPORT_S) -> dict:
        return {r: self.replicas[r][1] for r in self._live(max_age)}

    def all_metrics(self, max_age: float = 5 * REPORT_S) -> dict:
        return {r: self.metrics[r] for r in self._live(max_age)}

    def set_drain(self, timeout: float):
        self.drain = timeout


class EngineReplica:
    """One engine (either kind, as `epikv serve` builds it from the same options) with its own cache, behind the
    app of serving/app.py, which the Router's handle reaches through `forward`."""

    def __init__(self, cfg: ServeConfig):
        import ray
        from ray import serve

        from .build import prepare

        self.server, self._stop_engine, self.banner = prepare(cfg)()
        ctx = serve.get_replica_context()
        rid = getattr(ctx, "replica_id", None)
        self.replica = str(getattr(rid, "unique_id", None) or getattr(ctx, "replica_tag", os.getpid()))
        self.server.info.update(replica=self.replica, pid=os.getpid())
        self.server.id_prefix = f"http-{self.replica}"
        self.registry = ray.get_actor(registry_name(cfg.ray_app_name), namespace=NAMESPACE)
        self.app = self._build_app()
        self._stopped = threading.Event()
        threading.Thread(target=self._report, name="epikv-replica-report", daemon=True).start()

    def _report(self) -> None:
        import ray

        while not self._stopped.wait(REPORT_S):
            try:
                drain = ray.get(self.registry.report.remote(self.replica, self.server.stats(),
                                                            self.server.metrics.text().decode()), timeout=5)
            except Exception:  # the registry is gone (Serve shutting down): keep serving what is open
                continue
            if drain is not None and not self.server.draining:
                self.server.start_drain(drain)

    def _build_app(self):
        import ray

        from .app import build_app
        from .metrics import merge_replicas

        def replicas() -> dict:
            try:
                return {"replicas": ray.get(self.registry.all.remote(), timeout=5)}
            except Exception as e:  # noqa: BLE001 (stats must never fail the request)
                return {"replicas": {"error": f"{type(e).__name__}: {e}"}}

        def metrics() -> bytes:
            own = self.server.metrics.text().decode()
            try:
                texts = ray.get(self.registry.all_metrics.remote(), timeout=5)
            except Exception:  # noqa: BLE001 (the registry is gone: this replica's series alone)
                texts = {}
            return merge_replicas({**texts, self.replica: own})  # its own series as of now

        return build_app(self.server, extra_stats=replicas, headers={"X-Epikv-Replica": self.replica},
                         metrics_text=metrics)

    async def forward(self, method: str, path: str, query: bytes, headers: list, body: bytes):
        """One HTTP request through this replica's app (a streaming call of the Router's handle): yields the
        response's head with its first body bytes, then each further body chunk."""
        async for part in asgi_forward(self.app, method, path, query, headers, body):
            yield part

    def check_health(self) -> None:
        """Ray Serve's health check: a replica whose engine stopped is replaced."""
        if not self.server.healthy():
            raise RuntimeError(f"replica {self.replica}: the generation loop is not running")

    def __del__(self):
        stopped = getattr(self, "_stopped", None)
        if stopped is None or stopped.is_set():
            return
        stopped.set()
        try:
            self.registry.forget.remote(self.replica)
        except Exception:  # noqa: BLE001
            pass
        self.server.close()
        self._stop_engine()


async def asgi_forward(app, method: str, path: str, query: bytes, headers: list, body: bytes):
    """Run one HTTP request through the ASGI `app` in this process and yield its response: first
    {"status", "headers", "body", "more"} (the head with the first body bytes, so that a non-streaming answer is one
    item), then the bytes of each further body message. Closing the generator early (the caller left) tells the app
    the client disconnected and cancels it, as a server would."""
    import asyncio

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": method, "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "",
             "query_string": query, "headers": [(bytes(k), bytes(v)) for k, v in headers],
             "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0)}
    sent: asyncio.Queue = asyncio.Queue()
    left = asyncio.Event()
    request = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive():
        if request:
            return request.pop()
        await left.wait()  # the app listens for the client leaving while it streams
        return {"type": "http.disconnect"}

    async def send(message):
        await sent.put(message)

    async def run():
        try:
            await app(scope, receive, send)
        finally:
            await sent.put(None)  # the app returned (or failed): no more messages

    task = asyncio.ensure_future(run())
    head = None
    try:
        while True:
            m = await sent.get()
            if m is None:
                if head is None:  # the app ended without a response: let its error surface
                    await task
                    raise RuntimeError("the app sent no response")
                return
            if m["type"] == "http.response.start":
                head = {"status": m["status"], "headers": [(bytes(k), bytes(v)) for k, v in m.get("headers", [])]}
            elif m["type"] == "http.response.body":
                more = m.get("more_body", False)
                if "body" not in head:  # the first body message travels with the head
                    head.update(body=m.get("body", b""), more=more)
                    yield head
                elif m.get("body"):
                    yield m["body"]
                if not more:
                    return
    finally:
        left.set()
        if not task.done():
            task.cancel()
        try:
            await task
        except BaseException:  # noqa: BLE001 (cancelled, or failed after its answer was sent)
            pass


def _error(status: int, message: str, retry_after: int | None = None):
    """app.py's OpenAI error shape, written here so that the router does not import the app (and torch with it)."""
    from starlette.responses import JSONResponse

    return JSONResponse({"error": {"message": message, "type": "server_error", "param": None, "code": None}},
                        status_code=status, headers={"Retry-After": str(retry_after)} if retry_after else None)


class Router:
    """The ingress: streams each request to an engine replica through a deployment handle and relays the answer; a
    replica that dies mid-answer ends it cleanly (an SSE error event, or a 503 when nothing was sent). It answers
    the API key (401) and the body's size (413) itself, before a body travels to a replica."""

    def __init__(self, engines, max_request_bytes: int | None = None, api_key: str | None = None):
        self.engines = engines
        self.max_request_bytes, self.api_key = max_request_bytes, api_key

    async def __call__(self, request):
        from starlette.responses import Response, StreamingResponse

        from .guard import TooLarge, authorized, protected, read_body, too_large, unauthorized

        path, root = request.scope["path"], request.scope.get("root_path", "")
        if root and path.startswith(root):  # the app answers under its route prefix: its own routes start at /
            path = path[len(root):] or "/"
        raw = request.headers.raw
        if self.api_key and protected(path) and not authorized(raw, self.api_key):
            return unauthorized()
        try:
            body = await read_body(request.receive, raw, self.max_request_bytes)
        except TooLarge as e:
            return too_large(self.max_request_bytes, close=not e.drained)
        call = self.engines.options(stream=True).forward.remote(
            request.method, path, request.url.query.encode(), list(request.headers.raw), body)
        try:
            head = await call.__anext__()
        except Exception as e:  # noqa: BLE001 (the replica died or Ray lost it before answering)
            return _error(503, f"the engine replica serving this request stopped before answering "
                               f"({type(e).__name__}); send it again", retry_after=1)
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in head["headers"]
                   if k.lower() != b"content-length"}
        if not head["more"]:
            return Response(head["body"], status_code=head["status"], headers=headers)
        sse = headers.get("content-type", "").startswith("text/event-stream")

        async def relay():
            ended = False
            try:
                yield head["body"]
                async for chunk in call:
                    yield chunk
                ended = True
            except Exception as e:  # noqa: BLE001 (the replica died mid-answer: end the stream, do not hang it)
                ended = True
                if sse:
                    err = {"message": f"the engine replica serving this request stopped mid-answer "
                                      f"({type(e).__name__}); send it again", "type": "server_error",
                           "param": None, "code": None}
                    yield f"data: {json.dumps({'error': err})}\n\ndata: [DONE]\n\n".encode()
            finally:
                if not ended:  # the client left: cancel the request inside the replica (its cells are freed)
                    call.cancel()

        return StreamingResponse(relay(), status_code=head["status"], headers=headers)


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def replica_threads(cfg: ServeConfig) -> int:
    """The CPU threads one replica's engine runs, which its Ray actor reserves: --threads, else llama.cpp's default
    (half the cores; pinned in the replicas' config so that what runs is what was reserved); torch without --threads
    reserves one."""
    if cfg.threads:
        return cfg.threads
    if cfg.engine == "llama.cpp":
        from ..llamacpp.engine import default_threads

        return default_threads()
    return 1


def deployment_options(cfg: ServeConfig) -> dict:
    """Ray Serve's options for the deployment (the CLI checked the bounds): replicas or autoscaling, a high
    max_ongoing_requests (the app does its own admission: 429 past --max-waiting), health checks, the drain's grace
    period, and the CPUs the engine's threads use."""
    auto = cfg.min_replicas is not None or cfg.max_replicas is not None
    opts = {"max_ongoing_requests": 1024, "health_check_period_s": 2.0, "health_check_timeout_s": 30.0,
            "graceful_shutdown_timeout_s": float(cfg.drain_timeout) + 5.0, "graceful_shutdown_wait_loop_s": 0.5,
            "ray_actor_options": {"num_cpus": replica_threads(cfg)}}
    if auto:
        lo, hi = cfg.min_replicas or 1, cfg.max_replicas
        # a replica per `target` requests in flight (a llama.cpp replica decodes --sequences at once)
        target = max(1, (cfg.sequences or 8) // 2)
        opts["autoscaling_config"] = {"min_replicas": lo, "max_replicas": hi, "initial_replicas": lo,
                                      "target_ongoing_requests": target, "upscale_delay_s": 5.0,
                                      "downscale_delay_s": 30.0}
    else:
        opts["num_replicas"] = cfg.replicas or 1
    return opts


def replica_config(cfg: ServeConfig) -> ServeConfig:
    """The config each replica gets: this server's application name (a unique one unless --ray-app-name gave it) and,
    on llama.cpp, the threads its actor reserves (so that a replica on another node runs as many)."""
    return cfg.replace(ray_app_name=cfg.ray_app_name or f"epikv-{secrets.token_hex(4)}",
                       threads=replica_threads(cfg) if cfg.engine == "llama.cpp" else cfg.threads)


def registry_name(app: str) -> str:
    return f"{REGISTRY}-{app}"


def _proxy_address(serve, host: str, port: int) -> tuple[str, int]:
    """Start Serve's HTTP proxy on host:port, or find the one already running on the cluster (one proxy serves every
    application; Serve ignores new HTTP options then): the host and port it listens on."""
    log = logging.getLogger("ray.serve")
    level = log.level
    log.setLevel(logging.ERROR)  # its warning that our HTTP options are ignored: the caller says what happens instead
    try:
        serve.start(http_options={"host": host, "port": port}, logging_config={"log_level": "WARNING"})
    finally:
        log.setLevel(level)
    try:
        from ray.serve.context import _get_global_client

        http = _get_global_client().http_config
        return http.host, int(http.port)
    except Exception:  # noqa: BLE001 (a Ray without this client: assume ours were taken)
        return host, port


def run_ray(cfg: ServeConfig) -> int:
    """`epikv serve --ray`: start (or join) Ray, deploy this server's application (its own name, registry and route)
    behind Serve's proxy, serve until a signal (the first drains every replica, a second stops at once), then delete
    this application alone (other applications on the cluster stay); exit 0."""
    try:
        import ray
        from ray import serve
    except ImportError:
        raise EpiKVError("--ray needs Ray Serve: pip install 'epikv[ray,serve]'") from None
    cfg = replica_config(cfg)
    app = cfg.ray_app_name
    opts = deployment_options(cfg)
    port = cfg.port or _free_port(cfg.host)
    if cfg.log_level not in ("info", "debug"):  # Serve's progress lines in this process ("Started Serve", ...)
        logging.getLogger("ray.serve").setLevel(logging.WARNING)
    ray.init(address=cfg.ray_address, namespace=NAMESPACE, include_dashboard=False, configure_logging=False,
             log_to_driver=cfg.log_level in ("info", "debug"))
    stop = threading.Event()
    signals = []
    deployed = False

    def on_signal(sig, frame):
        signals.append(sig)
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        host, got = _proxy_address(serve, cfg.host, port)
        if cfg.port and got != cfg.port:
            raise EpiKVError(f"Ray Serve on this cluster already listens on port {got} (one HTTP proxy serves every "
                             f"application): give --port {got} or 0")
        others = serve.status().applications
        if app in others:
            raise EpiKVError(f"an application named {app} is already served on this cluster: give another "
                             "--ray-app-name")
        # the first application on the proxy answers at its root; a later one under its own name
        prefix = f"/{app}" if others else "/"
        registry = ray.remote(_Registry).options(name=registry_name(app), namespace=NAMESPACE, num_cpus=0).remote()
        engines = serve.deployment(EngineReplica, name=ENGINE, **opts).bind(cfg)
        router = serve.deployment(Router, name="Router", num_replicas=1, max_ongoing_requests=100_000,
                                  ray_actor_options={"num_cpus": 0}).bind(engines, cfg.max_request_bytes,
                                                                          cfg.api_key)
        try:
            deployed = True  # from here on a failure leaves something of this application to delete
            serve.run(router, name=app, route_prefix=prefix, blocking=False)
        except Exception as e:  # a replica's constructor refused (a bad option, a missing model): one line
            lines = [x for x in str(e).strip().splitlines() if x.strip()]
            raise EpiKVError(f"Ray Serve could not start the replicas: {lines[-1] if lines else type(e).__name__}") \
                from None
        n = opts.get("num_replicas") or f"{opts['autoscaling_config']['min_replicas']}.." \
                                        f"{opts['autoscaling_config']['max_replicas']}"
        where = cfg.ray_address or "a local Ray instance"
        url = f"http://{host}:{got}{'' if prefix == '/' else prefix}"
        print(f"epikv serve: listening on {url} (Ray Serve application {app} on {where}, {n} replica(s) of "
              f"{cfg.engine}, model {cfg.model})", file=sys.stderr, flush=True)
        while not stop.wait(0.2):
            pass
        _drain(registry, cfg.drain_timeout, signals)
    except _RayGone:
        deployed = False
        print("epikv serve: the local Ray instance stopped with the signal (its processes got it too): nothing left "
              "to drain", file=sys.stderr, flush=True)
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if deployed and not _local_ray_gone():
            _delete(serve, app, cfg.drain_timeout + 30)
        ray.shutdown()
    print("epikv serve: stopped", file=sys.stderr, flush=True)
    return 0


def _delete(serve, app: str, timeout: float) -> None:
    """Delete this server's application (its replicas and router; Serve itself and the other applications stay),
    giving up after `timeout` seconds: when the whole process group got the signal, a local Ray instance's own
    processes are gone too and nothing would ever answer."""
    done = threading.Event()
    error: list[BaseException] = []

    def delete():
        try:
            serve.delete(app)
        except BaseException as e:  # noqa: BLE001
            error.append(e)
        done.set()

    threading.Thread(target=delete, name="epikv-serve-delete", daemon=True).start()
    if not done.wait(timeout):
        print(f"epikv serve: warning: Ray Serve did not delete application {app} within {timeout:g} s (is the "
              "cluster gone?)", file=sys.stderr, flush=True)
    elif error:
        print(f"epikv serve: warning: deleting application {app}: {type(error[0]).__name__}: {error[0]}",
              file=sys.stderr, flush=True)
class _RayGone(Exception):
    """The local Ray instance this process started lost its own processes."""


def _local_ray_gone() -> bool:
    """Whether the local Ray instance this process started has lost a process (GCS, raylet): a SIGTERM to the whole
    process group (`timeout`, systemd) reaches them as it reaches us. A joined cluster's processes are not ours:
    never gone here."""
    try:
        import ray

        node = ray._private.worker._global_node  # no public API says whether the local instance still runs
        return bool(node is not None and node.dead_processes())
    except Exception:  # noqa: BLE001 (another Ray: rely on the bounded waits)
        return False


def _get(ref, timeout: float):
    """ray.get with a deadline that also gives up as soon as the local Ray instance is gone (no call would ever
    answer then, and Ray's own wait for its GCS is a minute)."""
    import ray

    end = time.monotonic() + timeout
    while True:
        if _local_ray_gone():
            raise _RayGone()
        ready, _ = ray.wait([ref], timeout=0.25)
        if ready:
            return ray.get(ref)
        if time.monotonic() > end:
            raise ray.exceptions.GetTimeoutError(f"no answer within {timeout:g} s")


def _drain(registry, timeout: float, signals: list) -> None:
    """Every replica stops admitting (503) and finishes what is in flight, up to `timeout` seconds (a second signal
    ends the wait). Raises _RayGone when the local Ray instance went down with the signal (nothing left to drain)."""
    try:
        _get(registry.set_drain.remote(timeout), 10)
        end = time.monotonic() + timeout
        time.sleep(2 * REPORT_S)  # every replica has read the flag
        while time.monotonic() < end and len(signals) < 2:
            reps = _get(registry.all.remote(), 10)
            if all(st["http"]["in_flight"] == 0 for st in reps.values()):
                return
            time.sleep(0.2)
    except _RayGone:
        raise
    except Exception as e:  # noqa: BLE001 (Ray itself is going: nothing left to drain)
        print(f"epikv serve: drain: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return
    print(f"epikv serve: drain: requests still running after {timeout:g} s are ended by the shutdown",
          file=sys.stderr, flush=True)
