"""The chart's HAProxy follows the pods by DNS: Debian's HAProxy runs the chart's haproxy.cfg
against a DNS server that answers as a cluster's does for the headless Service's pods
(:mod:`tests.integration.dnsserver`: an address per pod name, NXDOMAIN for a pod that does not
exist), each pod an HTTP server on a loopback address of its own. A pod made (``kubectl
scale``, an autoscaler) is found and takes its share of the models; a replaced pod, at a new
address, keeps its share; a deleted pod's models go back where they were; a second HAProxy
replica routes every model to the same pod. The cluster's DNS itself, and the official image,
are not exercised."""

from __future__ import annotations

import http.client
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from mmserver.commands.cluster.balancer import server_stats
from mmserver.commands.procfs import free_port
from tests.e2e.cluster_process import require_haproxy
from tests.integration.dnsserver import DnsServer
from tests.integration.helmchart import FULLNAME, HEADLESS, NAMESPACE, render

MODELS = [f"model-{i}" for i in range(40)]
SERVERS = 4
WAIT_S = 20.0


def pod_name(ordinal: int) -> str:
    return f"{FULLNAME}-{ordinal}.{HEADLESS}.{NAMESPACE}.svc.cluster.local"


class Pod:
    """A pod: an HTTP server on ``address`` answering 200 and its own name to every request
    (``/ping`` included)."""

    def __init__(self, label: str, address: str, port: int) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.answer()

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                self.answer()

            def answer(self) -> None:
                body = label.encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.label = label
        self.address = address
        self.server = ThreadingHTTPServer((address, port), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.stopped = False

    def stop(self) -> None:
        if self.stopped:
            return
        self.stopped = True
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


class HAProxy:
    """The chart's haproxy.cfg run by HAProxy, resolving through ``dns``."""

    def __init__(self, binary: str, config: str, dns: DnsServer, directory: Path) -> None:
        self.port = free_port()
        self.stats_port = free_port()
        text = config.replace("bind 127.0.0.1:8404", f"bind 127.0.0.1:{self.stats_port}")
        text = text.replace("bind 127.0.0.1:8080", f"bind 127.0.0.1:{self.port}")
        assert "    parse-resolv-conf\n" in text
        text = text.replace(
            "    parse-resolv-conf\n", f"    nameserver test 127.0.0.1:{dns.port}\n"
        )
        path = directory / f"haproxy-{self.port}.cfg"
        path.write_text(text)
        self.log = directory / f"haproxy-{self.port}.log"
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                [binary, "-db", "-f", str(path)], stdout=log, stderr=subprocess.STDOUT
            )

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=10)

    def servers(self) -> dict[str, str]:
        """The status of each server by name."""
        assert self.process.poll() is None, self.log.read_text()
        return {name: row["status"] for name, row in server_stats(self.stats_port).items()}

    def up(self) -> set[str] | None:
        """The servers up, when each is up or down for good: ``None`` while one goes up or
        down ("UP 1/2", "DOWN 1/2": still in the ring, or not yet)."""
        statuses = self.servers()
        if any(" " in status and status.split()[1][0].isdigit() for status in statuses.values()):
            return None
        return {name for name, status in statuses.items() if status == "UP"}

    def send(self, model: str) -> tuple[str, str]:
        """(server, pod that answered) of a request for ``model`` (``/models/NAME/invoke``,
        where MODEL_AFFINITY reads the model)."""
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            connection.request("POST", f"/models/{model}/invoke", body=b"[[1]]")
            response = connection.getresponse()
            body = response.read().decode()
            assert response.status == 200, (response.status, body)
            return response.getheader("X-Mmserver-Instance") or "", body
        finally:
            connection.close()

    def route(self) -> dict[str, tuple[str, str]]:
        """(server, pod that answered) of each model."""
        return {model: self.send(model) for model in MODELS}


def until(predicate: Callable[[], bool], what: str) -> None:
    """Wait for HAProxy to see what DNS and its health checks say (it resolves every second
    and checks every 100 ms here): there is no event to wait on in another process."""
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not in {WAIT_S} s: {what}")
        time.sleep(0.05)


@pytest.fixture
def dns() -> Iterator[DnsServer]:
    with DnsServer() as server:
        yield server


def test_haproxy_finds_the_pods_a_scale_adds_and_keeps_each_pods_models(
    dns: DnsServer, tmp_path: Path
) -> None:
    binary = require_haproxy()
    port = free_port()
    config = render(
        {
            "replicas": 2,
            "server": {"port": port},
            "haproxy": {
                "enabled": True,
                "servers": SERVERS,
                "bindAddress": "127.0.0.1",
                "checkIntervalMs": 100,
                # The ring alone: no load bound, under which a request may go on to the next
                # pod while the last one's stream is still being closed.
                "hashBalanceFactor": 0,
            },
        }
    ).haproxy_cfg
    pods: dict[str, Pod] = {}

    def make_pod(ordinal: int, address: str) -> None:
        label = f"pod-{ordinal}@{address}"
        pods[label] = Pod(label, address, port)
        dns.set(pod_name(ordinal), [address])

    balancers: list[HAProxy] = []
    try:
        make_pod(0, "127.0.0.11")
        make_pod(1, "127.0.0.12")
        first = HAProxy(binary, config, dns, tmp_path)
        balancers.append(first)
        names = [f"{FULLNAME}-{i}" for i in range(SERVERS)]
        until(lambda: first.up() == set(names[:2]), "the two pods up")
        # The servers of the pods that do not exist are out of the ring.
        assert {first.servers()[name] for name in names[2:]} == {"MAINT (resolution)"}
        two = first.route()
        assert {server for server, _ in two.values()} == set(names[:2])
        # Server N is pod N.
        assert all(body.startswith(f"pod-{s.rsplit('-', 1)[1]}@") for s, body in two.values())

        # A third pod (kubectl scale --replicas=3): found, and it takes models from the others
        # only; none moves between the two.
        make_pod(2, "127.0.0.13")
        until(lambda: first.up() == set(names[:3]), "the third pod up")
        three = first.route()
        moved = {m for m in MODELS if three[m][0] != two[m][0]}
        assert moved and all(three[m][0] == names[2] for m in moved), (two, three)
        assert len(moved) < len(MODELS) / 2

        # Pod 1 replaced, at another address: the same server, at the same place on the ring.
        on_pod_1 = next(m for m in MODELS if three[m][0] == names[1])
        pods["pod-1@127.0.0.12"].stop()
        dns.remove(pod_name(1))
        make_pod(1, "127.0.0.22")
        until(lambda: first.send(on_pod_1) == (names[1], "pod-1@127.0.0.22"), "pod 1's new address")
        until(lambda: first.up() == set(names[:3]), "the three pods up")
        replaced = first.route()
        assert {m: s for m, (s, _) in replaced.items()} == {m: s for m, (s, _) in three.items()}
        assert {body for s, body in replaced.values() if s == names[1]} == {"pod-1@127.0.0.22"}

        # Another HAProxy replica, started now: the same ring.
        second = HAProxy(binary, config, dns, tmp_path)
        balancers.append(second)
        until(lambda: second.up() == set(names[:3]), "the second balancer sees three pods")
        assert second.route() == replaced

        # Pod 2 deleted (a scale down): its models go back where they were with two pods.
        pods["pod-2@127.0.0.13"].stop()
        dns.remove(pod_name(2))
        until(lambda: first.up() == set(names[:2]), "the third pod gone")
        back = first.route()
        assert {m: s for m, (s, _) in back.items()} == {m: s for m, (s, _) in two.items()}
    finally:
        for balancer in balancers:
            balancer.stop()
        for pod in pods.values():
            pod.stop()
