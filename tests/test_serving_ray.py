"""`epikv serve --ray` on one local Ray instance for the module (Ray's start-up is slow on a shared 2-core machine):
two replicas of the torch engine behind Ray Serve's proxy, the same tiny model and options as test_serving_http's
single server. Answers equal the library's run of the same prompts (as the single server's do), whichever replica
serves them; a sampled request's seed gives the same answer on any replica; /stats reports every replica by id and
/metrics every replica's series, labelled;
429 with Retry-After when the replicas' waiting queues are full; a replica killed mid-stream ends its stream with
an SSE error event and [DONE] (no hang, no cut connection); a client that leaves mid-stream frees its request in
the replica; the next requests are answered and Ray restarts the replica; SIGTERM drains (in flight
finishes, new requests get 503) and exits 0."""

import contextlib
import json
import os
import re
import shutil
import signal
import tempfile
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("ray.serve")
pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from test_serving_http import (MODEL, SERVE, Served, _prompt_ids, _texts, cb_internals,  # noqa: E402,F401
                               lib)

REPLICAS = 2


@pytest.fixture(scope="module")
def ray_served():
    s = Served(["--ray", "--replicas", str(REPLICAS), *SERVE, "--max-waiting", "3", "--drain-timeout", "60"])
    yield s
    if s.proc.poll() is None:
        s.proc.send_signal(signal.SIGTERM)
        try:
            s.proc.wait(90)
        except Exception:  # noqa: BLE001
            s.proc.kill()


def _replica(answer_id: str) -> str:
    return answer_id.split("-")[2]  # cmpl-http-<replica>-<n>-<random>


def _replicas(s, n=REPLICAS, timeout=120):
    end = time.monotonic() + timeout
    while True:
        reps = s.get("/stats")["replicas"]
        if len(reps) == n or time.monotonic() > end:
            return reps
        time.sleep(0.5)


def test_answers_equal_the_library_on_every_replica(ray_served, lib):
    texts = _texts(8)
    want = lib([_prompt_ids(lib.tok, t) for t in texts])
    client = ray_served.client.with_options(max_retries=8)  # a 429 (Retry-After) is retried, as clients do

    def ask(i):
        if i % 2:
            parts = list(client.completions.create(model=MODEL, prompt=texts[i], stream=True))
            return parts[0].id, [t for p in parts for t in p.choices[0].model_extra["token_ids"]]
        r = client.completions.create(model=MODEL, prompt=texts[i])
        return r.id, r.choices[0].model_extra["token_ids"]

    got = []
    for _ in range(3):  # until both replicas have answered (the proxy picks the less loaded of two)
        with ThreadPoolExecutor(4) as ex:
            got += list(ex.map(ask, range(len(texts))))
        if len({_replica(i) for i, _ in got}) == REPLICAS:
            break
    assert [ids for _, ids in got] == want * (len(got) // len(texts))
    assert len({_replica(i) for i, _ in got}) == REPLICAS


def test_models_health_stats_per_replica(ray_served):
    assert ray_served.get("/health") == {"status": "ok"}
    assert [x.id for x in ray_served.client.models.list().data] == [MODEL]
    end = time.monotonic() + 30
    while True:  # once idle, no replica holds a page (the figures are at most half a second old)
        reps = _replicas(ray_served)
        if all(r["engine"]["pages_in_use"] == 0 and not r["http"]["in_flight"] for r in reps.values()) \
                or time.monotonic() > end:
            break
        time.sleep(0.2)
    assert len(reps) == REPLICAS and len({r["server"]["pid"] for r in reps.values()}) == REPLICAS
    assert all(r["server"]["replica"] == k and r["engine"]["pages_in_use"] == 0 for k, r in reps.items()), reps
    st = ray_served.get("/stats")
    assert st["server"]["replica"] in reps
    # /metrics covers every replica: one series per replica, labelled, agreeing with each replica's /stats
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(ray_served.url + "/metrics", timeout=30) as r:
        fams = {f.name: f for f in text_string_to_metric_families(r.read().decode())}
    done = {s.labels["replica"]: s.value for s in fams["epikv_requests"].samples
            if s.name == "epikv_requests_total" and s.labels["outcome"] == "completed"}
    assert set(done) == set(reps), (done, list(reps))
    assert all(done[k] == r["http"]["completed"] for k, r in reps.items()), (done, reps)
    kw = dict(model=MODEL, prompt=_texts(3)[2], max_tokens=20, temperature=0.6, top_p=0.95, seed=11)
    answers = {}
    for _ in range(8):  # the same seed, the same answer, on either replica
        r = ray_served.client.completions.create(**kw)
        answers.setdefault(_replica(r.id), set()).add(r.choices[0].text)
    assert len({t for v in answers.values() for t in v}) == 1, answers


def test_429_with_retry_after_when_full(ray_served):
    body = json.dumps({"model": MODEL, "prompt": _texts(8)[7], "max_tokens": 8}).encode()
    rejected0 = sum(r["http"]["rejected"] for r in _replicas(ray_served).values())

    def post(_):
        req = urllib.request.Request(ray_served.url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                return r.status, None
        except urllib.error.HTTPError as e:
            return e.code, e.headers.get("Retry-After")

    with ThreadPoolExecutor(24) as ex:
        got = list(ex.map(post, range(48)))
    codes = [c for c, _ in got]
    assert set(codes) <= {200, 429} and codes.count(200) >= REPLICAS and codes.count(429) > 0, codes
    assert all(int(ra) >= 1 for c, ra in got if c == 429)
    end = time.monotonic() + 10
    while True:  # every replica's counters (reported every half second) add up to the 429s seen
        rejected = sum(r["http"]["rejected"] for r in ray_served.get("/stats")["replicas"].values())
        if rejected - rejected0 >= codes.count(429) or time.monotonic() > end:
            break
        time.sleep(0.2)
    assert rejected - rejected0 == codes.count(429)


def _open_stream(s, body):
    req = urllib.request.Request(s.url + "/v1/completions", data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=60)


def _events(resp):
    """The SSE events of a stream, as they come (data lines only)."""
    for line in resp:
        line = line.decode().strip()
        if line.startswith("data: "):
            yield line[len("data: "):]


def test_killed_replica_ends_its_stream_with_an_error_event_and_is_restarted(ray_served):
    """The client of a replica that dies mid-stream gets an SSE error event and [DONE], not a cut connection or a
    hang (the Router outlives the replica); the next requests are answered, and Ray restarts the replica.
    Mutant: the Router's except clause removed: the stream ends without the error event and this fails."""
    before = _replicas(ray_served)
    resp = _open_stream(ray_served, {"model": MODEL, "prompt": "A long one", "max_tokens": 6000, "ignore_eos": True})
    events = _events(resp)
    first = json.loads(next(events))
    victim = _replica(first["id"])
    pid = before[victim]["server"]["pid"]
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    rest = list(events)  # to the end of the stream: an error, not a hang
    assert time.monotonic() - t0 < 60, "the stream hung"
    assert rest[-1] == "[DONE]", rest[-3:]
    err = json.loads(rest[-2])["error"]
    assert err["type"] == "server_error" and "replica" in err["message"] and "stopped mid-answer" in err["message"]
    assert all("choices" in json.loads(e) for e in rest[:-2])  # tokens up to the death, then the error
    ok = 0
    end = time.monotonic() + 60
    while ok < 3 and time.monotonic() < end:  # the next requests are answered (the other replica, then a new one)
        try:
            ray_served.client.completions.create(model=MODEL, prompt="next", max_tokens=4)
            ok += 1
        except openai.APIError:
            time.sleep(0.5)
    assert ok == 3
    end = time.monotonic() + 180
    while time.monotonic() < end:  # Ray restarted the replica: two again, the victim gone
        reps = ray_served.get("/stats")["replicas"]
        if len(reps) == REPLICAS and victim not in reps:
            break
        time.sleep(1)
    assert len(reps) == REPLICAS and victim not in reps and pid not in {r["server"]["pid"] for r in reps.values()}


def test_a_client_that_leaves_mid_stream_frees_its_request_in_the_replica(ray_served):
    """A client that closes its stream cancels the Router's call, which cancels the request inside the replica: no
    replica keeps it in flight (its cells are released), and it ends as cancelled, not run on to completion.
    Mutant: asgi_forward's clean-up removed (the app is neither told the client left nor cancelled): the request runs
    on and this fails. (Removing the Router's own call.cancel() is not caught here: Ray Serve also propagates the
    proxy's cancellation to the handle's call; test_ray_router catches that one.)"""

    def count(reps, what):
        return sum(r["http"][what] for r in reps.values())

    before = _replicas(ray_served)
    resp = _open_stream(ray_served, {"model": MODEL, "prompt": "Leave early", "max_tokens": 6000, "ignore_eos": True})
    events = _events(resp)
    for _ in range(3):
        next(events)
    resp.close()
    end = time.monotonic() + 30
    while time.monotonic() < end:
        reps = ray_served.get("/stats")["replicas"]
        if count(reps, "in_flight") == 0 and count(reps, "cancelled") > count(before, "cancelled"):
            break
        time.sleep(0.5)
    # ended as cancelled (not run on to its 6,000 tokens and completed), nothing left in flight
    assert count(reps, "cancelled") == count(before, "cancelled") + 1, {k: r["http"] for k, r in reps.items()}
    assert count(reps, "completed") == count(before, "completed")
    assert count(reps, "in_flight") == 0


def test_sigterm_drains_every_replica(ray_served):
    s = ray_served
    done = {}

    def long():
        r = s.client.completions.create(model=MODEL, prompt="Finish me", max_tokens=1500,
                                        extra_body={"ignore_eos": True})
        done["tokens"] = r.usage.completion_tokens

    t = threading.Thread(target=long)
    t.start()
    end = time.monotonic() + 30
    while not any(r["http"]["in_flight"] for r in s.get("/stats")["replicas"].values()) and time.monotonic() < end:
        time.sleep(0.05)
    s.proc.send_signal(signal.SIGTERM)
    time.sleep(3 * 0.5)  # every replica has read the drain flag
    with pytest.raises(openai.APIStatusError) as e:
        s.client.completions.create(model=MODEL, prompt="late", max_tokens=4)
    assert e.value.status_code == 503 and int(e.value.response.headers["retry-after"]) >= 1
    t.join(120)
    assert done == {"tokens": 1500}  # the request in flight finished, whole
    rc = s.proc.wait(120)
    err = "".join(s.err)
    assert rc == 0 and "epikv serve: stopped" in err, err[-2000:]


def _watch(stream, marker: str) -> tuple[threading.Event, list[str]]:
    """Read a process's output on a thread: the lines so far, and an event set at `marker` (or when it ends)."""
    seen = threading.Event()
    lines: list[str] = []

    def read():
        for line in stream:
            lines.append(line)
            if marker in line:
                seen.set()
        seen.set()

    threading.Thread(target=read, daemon=True).start()
    return seen, lines


@contextlib.contextmanager
def _ray_head(monkeypatch, cpus=4):
    """A Ray cluster started apart (`ray start --head --block`, as on a real cluster's head), in a temp dir of its
    own; yields its address and stops it after."""
    import secrets
    import socket
    import subprocess
    import sys
    from pathlib import Path

    from test_serving_http import _env

    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    ray_cli = str(Path(sys.executable).with_name("ray"))
    # a token of the test's own for the cluster and the server (Ray >= 2.52 authenticates when a token exists: one
    # left in ~/.ray by an earlier local instance would otherwise be half-used); older Rays ignore both variables
    monkeypatch.setenv("RAY_AUTH_MODE", "token")  # the head and Served() both start with this environment
    monkeypatch.setenv("RAY_AUTH_TOKEN", secrets.token_hex(32))
    # a temp dir of its own: the head writes its address there, not to /tmp/ray/ray_current_cluster, where every
    # later ray.init() of the session would find it and try to join this cluster once it is gone (short: Ray's socket
    # paths must fit 107 characters)
    temp_dir = tempfile.mkdtemp(prefix="epr", dir="/tmp")
    head = subprocess.Popen([ray_cli, "start", "--head", "--block", f"--port={port}", f"--num-cpus={cpus}",
                             f"--temp-dir={temp_dir}", "--include-dashboard=false", "--disable-usage-stats"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env())
    started, head_out = _watch(head.stdout, "Ray runtime started")
    try:
        assert started.wait(180) and head.poll() is None, "".join(head_out)[-3000:]
        yield f"127.0.0.1:{port}", head
    finally:
        head.send_signal(signal.SIGTERM)  # `ray start --block` stops the cluster's processes as it exits
        try:
            head.wait(60)
        except Exception:  # noqa: BLE001
            head.kill()
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_joins_an_existing_cluster_and_autoscales_under_load(monkeypatch):
    """--ray-address joins a Ray cluster started apart (`ray start --head --block`, as on a real cluster's head), and
    --min-replicas 1 --max-replicas 2 starts one replica, then adds the second while more requests are in flight
    than a replica's target (Serve's autoscaling_config); the answers keep coming meanwhile; SIGTERM exits 0 and
    leaves the cluster up (it is not ours to stop)."""
    import subprocess
    import sys

    from test_serving_http import _env

    with _ray_head(monkeypatch) as (addr, head):
        s = None
        try:
            s = Served(["--ray", "--ray-address", addr, "--ray-app-name", "epikv-auto", "--min-replicas", "1",
                        "--max-replicas", "2", *SERVE])
            assert f"Ray Serve application epikv-auto on {addr}, 1..2 replica(s)" in "".join(s.err)
            assert len(_replicas(s, 1)) == 1
            stop = threading.Event()
            answered = []

            def load():  # long streams, more in flight than the target of 4 a replica
                while not stop.is_set():
                    stream = s.client.completions.create(model=MODEL, prompt="Keep going", max_tokens=4000, stream=True,
                                                         extra_body={"ignore_eos": True})
                    for n, part in enumerate(stream):
                        answered.append(part.id)
                        if stop.is_set() or n > 400:
                            stream.close()
                            break

            workers = [threading.Thread(target=load, daemon=True) for _ in range(12)]
            for w in workers:
                w.start()
            end = time.monotonic() + 180
            reps = {}
            while time.monotonic() < end:
                reps = s.get("/stats")["replicas"]
                if len(reps) == 2:
                    break
                time.sleep(1)
            stop.set()
            for w in workers:
                w.join(60)
            assert len(reps) == 2, f"no second replica within 180 s: {list(reps)}"
            assert len({_replica(i) for i in answered}) >= 1 and len(answered) > 100
            # the replicas run on the cluster we started (not on a local instance of the server's own)
            probe = ("import ray; from ray import serve; ray.init(address=%r, namespace='epikv-serve', "
                     "configure_logging=False, log_to_driver=False); a = serve.status().applications['epikv-auto']; "
                     "print('REPLICAS', sum(a.deployments['EngineReplica'].replica_states.values()))" % addr)
            out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, env=_env())
            assert "REPLICAS 2" in out.stdout, out.stdout + out.stderr[-2000:]
            s.proc.send_signal(signal.SIGTERM)
            assert s.proc.wait(120) == 0, "".join(s.err)[-2000:]
            assert head.poll() is None, "stopping the server stopped the cluster it joined"
        finally:
            if s is not None and s.proc.poll() is None:
                s.proc.kill()


def test_two_servers_share_a_cluster_and_stopping_one_leaves_the_other(monkeypatch):
    """Two `epikv serve --ray` on one cluster: each its own application (a unique name, its own registry actor), the
    second under /<its name> on the proxy the first started (Serve runs one HTTP proxy a cluster); each answers with
    its own policy. A --port other than the proxy's is refused in one line (it would print a dead port). Stopping
    the second deletes its application alone: the first goes on answering.
    Mutants: serve.shutdown() for serve.delete(app) (the first server stops answering); a fixed application name
    (the second is refused, or replaced the first's application before the fix)."""
    from test_serving_http import _cli

    with _ray_head(monkeypatch) as (addr, _):
        a = b = None
        try:
            a = Served(["--ray", "--ray-address", addr, *SERVE])
            b = Served(["--ray", "--ray-address", addr, "--model", MODEL, "--policy", "full", "--page", "16",
                        "--num-blocks", "32", "--max-tokens", "8"])
            root, name = re.match(r"(http://[^/]+)/(epikv-[0-9a-f]+)$", b.url).groups()
            assert a.url == root, (a.url, b.url)  # one proxy: the second server's URL is the first's port + /name
            assert name in "".join(b.err) and name not in "".join(a.err)
            assert a.get("/stats")["server"]["policy"] == "epikv" and b.get("/stats")["server"]["policy"] == "full"
            assert b.client.completions.create(model=MODEL, prompt="Hi", max_tokens=3).usage.completion_tokens == 3
            port = int(root.rsplit(":", 1)[1])
            r = _cli("serve", "--ray", "--ray-address", addr, *SERVE, "--port", str(port + 1 if port < 65535 else 1))
            lines = [x for x in r.stderr.splitlines() if x.strip() and "Token authentication" not in x]  # Ray's
            assert r.returncode == 2 and len(lines) == 1 and f"already listens on port {port}" in lines[0], r.stderr
            b.proc.send_signal(signal.SIGTERM)
            assert b.proc.wait(120) == 0, "".join(b.err)[-2000:]
            time.sleep(2)  # what a shutdown of Serve would take down has gone by now
            assert a.get("/health") == {"status": "ok"}
            assert a.client.completions.create(model=MODEL, prompt="Hi", max_tokens=3).usage.completion_tokens == 3
        finally:
            for s in (a, b):
                if s is not None and s.proc.poll() is None:
                    s.proc.send_signal(signal.SIGTERM)
                    try:
                        s.proc.wait(60)
                    except Exception:  # noqa: BLE001
                        s.proc.kill()


def test_sigterm_to_the_process_group_ends_a_local_server(monkeypatch, tmp_path):
    """`timeout` and systemd signal the whole process group: the local Ray instance's own processes (GCS, raylet)
    end with the server's. The server sees its instance gone and exits 0 within seconds (before the fix it waited
    on Ray calls that never answer until Ray killed it, exit 1, after a minute).
    Mutant: _local_ray_gone() always False: the process outlives the 45 s bound."""
    import subprocess
    import sys

    from test_serving_http import _env

    temp = tempfile.mkdtemp(prefix="epg", dir="/tmp")  # short: Ray's socket paths must fit 107 characters
    env = dict(_env(), RAY_TMPDIR=temp)
    proc = subprocess.Popen([sys.executable, "-m", "epikv.cli", "serve", "--ray", *SERVE, "--port", "0"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    ready, err = _watch(proc.stderr, "listening on")
    try:
        assert ready.wait(300) and proc.poll() is None, "".join(err)[-3000:]
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            rc = proc.wait(45)
        except subprocess.TimeoutExpired:
            rc = None
        assert rc == 0, "".join(err)[-3000:]
        assert "stopped with the signal" in "".join(err) and "epikv serve: stopped" in "".join(err)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
        shutil.rmtree(temp, ignore_errors=True)


@pytest.mark.parametrize("argv, needle", [
    (["--replicas", "2"], "--replicas is an option of --ray"),
    (["--ray", "--replicas", "2", "--max-replicas", "3"], "a fixed count or the autoscaling's bounds"),
    (["--ray", "--min-replicas", "3", "--max-replicas", "2"], "--min-replicas 3 is above --max-replicas 2"),
    (["--ray", "--min-replicas", "2"], "--min-replicas needs --max-replicas"),
])
def test_replica_options_refused_in_one_line(argv, needle):
    from test_serving_http import _cli

    r = _cli("serve", *SERVE, *argv)
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode == 2 and len(lines) == 1 and needle in lines[0], r.stderr


def test_autoscaling_options():
    from epikv.serving.config import ServeConfig
    from epikv.serving.ray_serve import deployment_options

    cfg = ServeConfig(ray=True, min_replicas=1, max_replicas=4, sequences=8, drain_timeout=30.0)
    auto = deployment_options(cfg)["autoscaling_config"]
    assert (auto["min_replicas"], auto["max_replicas"], auto["target_ongoing_requests"]) == (1, 4, 4)
    fixed = deployment_options(cfg.replace(min_replicas=None, max_replicas=None, replicas=3))
    assert fixed["num_replicas"] == 3 and "autoscaling_config" not in fixed
    assert fixed["max_ongoing_requests"] > 100  # the app admits (429), not Serve's queue


def test_each_replica_reserves_the_cpus_its_engine_threads_use():
    """A llama.cpp replica reserves --threads CPUs (else llama.cpp's default, pinned in the replicas' config so that
    what runs is what was reserved); a torch replica its --threads, else one. Each server gets its own application
    name (and so its own registry actor) unless one is given.
    Mutant: ray_actor_options {"num_cpus": 1} again: the first assertion fails."""
    from epikv.llamacpp.engine import default_threads
    from epikv.serving.config import ServeConfig
    from epikv.serving.ray_serve import deployment_options, registry_name, replica_config

    cpus = lambda cfg: deployment_options(cfg)["ray_actor_options"]["num_cpus"]  # noqa: E731
    lcpp = ServeConfig(ray=True, engine="llama.cpp", sequences=4)
    assert cpus(lcpp.replace(threads=3)) == 3
    assert cpus(lcpp) == default_threads() == replica_config(lcpp).threads
    assert cpus(ServeConfig(ray=True, threads=2)) == 2 and cpus(ServeConfig(ray=True)) == 1
    assert replica_config(ServeConfig(ray=True)).threads is None  # torch keeps its own default
    a, b = replica_config(lcpp), replica_config(lcpp)
    assert a.ray_app_name != b.ray_app_name and registry_name(a.ray_app_name) != registry_name(b.ray_app_name)
    assert replica_config(lcpp.replace(ray_app_name="mine")).ray_app_name == "mine"
