"""The chart's HAProxy (``haproxy.enabled``): its objects, and a haproxy.cfg that says what
``mmserver cluster`` writes (:func:`mmserver.commands.cluster.balancer.render`) for the same pods,
with a server for each name a pod may have, by its DNS name, resolved while HAProxy runs; HAProxy
accepts it. ``test_helm_haproxy_dns.py`` runs it against a DNS server."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from mmserver.commands.cluster import balancer
from tests.e2e.cluster_process import require_haproxy
from tests.integration.helmchart import (
    EVERYTHING_ON,
    FULLNAME,
    HEADLESS,
    NAMESPACE,
    Rendered,
    refusal,
    render,
)

BALANCER = f"{FULLNAME}-haproxy"
#: What the chart adds to each server line of mmserver cluster's configuration, and the section
#: it resolves with.
RESOLVE = " resolvers kubernetes init-addr none"
RESOLVERS = ["resolvers kubernetes", "    parse-resolv-conf", "    hold valid 5s"]
#: haproxy.servers by default.
SERVERS = 16


def significant(text: str) -> list[str]:
    """The lines HAProxy reads: no blank line, no comment."""
    lines = (line.rstrip() for line in text.splitlines())
    return [line for line in lines if line and not line.lstrip().startswith("#")]


def cluster_config(rendered: Rendered, values: dict[str, Any]) -> list[str]:
    """What mmserver cluster writes for the pods of ``rendered``, with the chart's additions."""
    haproxy = values.get("haproxy", {})
    statefulset = rendered.one("StatefulSet")
    servers = max(haproxy.get("servers", SERVERS), statefulset["spec"]["replicas"])
    service = statefulset["spec"]["serviceName"]
    domain = haproxy.get("clusterDomain", "cluster.local")
    port = rendered.container["ports"][0]["containerPort"]
    pods = [f"{statefulset['metadata']['name']}-{i}" for i in range(servers)]
    spec = balancer.BalancerSpec(
        strategy=balancer.Strategy(haproxy.get("strategy", "MODEL_AFFINITY")),
        port=haproxy.get("port", 8080),
        stats_port=haproxy.get("statsPort", 8404),
        servers=tuple((pod, f"{pod}.{service}.{NAMESPACE}.svc.{domain}", port) for pod in pods),
        hash_balance_factor=haproxy.get("hashBalanceFactor", 150),
        check_inter_ms=haproxy.get("checkIntervalMs", 500),
        bind=haproxy.get("bindAddress", "0.0.0.0"),
        stats_bind="127.0.0.1",
    )
    lines = significant(balancer.render(spec))
    lines = [line + RESOLVE if line.lstrip().startswith("server ") else line for line in lines]
    return lines + RESOLVERS


def haproxy(values: dict[str, Any]) -> dict[str, Any]:
    return {"haproxy": {"enabled": True, **values}}


def test_no_balancer_unless_enabled() -> None:
    rendered = render({"haproxy": {"enabled": False}})
    assert [name for _, name in rendered.names() if "haproxy" in name] == []
    assert len(rendered.all("Deployment")) == 0 and len(rendered.all("ConfigMap")) == 0


def test_the_balancer_runs_its_configuration() -> None:
    rendered = render(haproxy({}))
    deployment = rendered.one("Deployment", BALANCER)
    pod = deployment["spec"]["template"]
    assert deployment["spec"]["replicas"] == 2
    (container,) = pod["spec"]["containers"]
    assert container["image"] == "haproxy:3.2"
    assert container["volumeMounts"] == [
        {"name": "config", "mountPath": "/usr/local/etc/haproxy", "readOnly": True}
    ]
    assert pod["spec"]["volumes"] == [{"name": "config", "configMap": {"name": BALANCER}}]
    assert "haproxy.cfg" in rendered.one("ConfigMap", BALANCER)["data"]
    assert container["ports"] == [{"name": "http", "containerPort": 8080, "protocol": "TCP"}]
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["tcpSocket"] == {"port": "http"}
    service = rendered.one("Service", BALANCER)
    assert service["spec"]["ports"] == [
        {"name": "http", "port": 8080, "targetPort": "http", "protocol": "TCP"}
    ]
    # The balancer's Service reaches the balancers alone, the pods' Service the pods alone.
    labels = pod["metadata"]["labels"].items()
    assert service["spec"]["selector"].items() <= labels
    assert not rendered.one("Service")["spec"]["selector"].items() <= labels
    assert not service["spec"]["selector"].items() <= rendered.pod["metadata"]["labels"].items()
    security = pod["spec"]["securityContext"]
    assert security["runAsNonRoot"] is True and security["runAsUser"] == 99
    assert security["seccompProfile"] == {"type": "RuntimeDefault"}
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert container["securityContext"]["readOnlyRootFilesystem"] is True


def test_the_pass_through_values_reach_the_balancer() -> None:
    on = render(EVERYTHING_ON)
    spec = on.one("Deployment", BALANCER)["spec"]["template"]["spec"]
    for key in ("nodeSelector", "tolerations", "affinity"):
        assert spec[key] == EVERYTHING_ON["haproxy"][key], key
    assert spec["imagePullSecrets"] == [{"name": "registry"}]
    assert on.one("Service", BALANCER)["metadata"]["annotations"] == {"a": "b"}
    off = render(haproxy({"topologySpread": {"topologyKeys": []}}))
    spec = off.one("Deployment", BALANCER)["spec"]["template"]["spec"]
    for key in (
        "nodeSelector",
        "tolerations",
        "affinity",
        "imagePullSecrets",
        "topologySpreadConstraints",
    ):
        assert key not in spec, key
    assert "annotations" not in off.one("Service", BALANCER)["metadata"]


def test_the_balancer_outlasts_its_soft_stop() -> None:
    rendered = render(haproxy({"preStopSeconds": 7}))
    pod = rendered.one("Deployment", BALANCER)["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["lifecycle"]["preStop"] == {"exec": {"command": ["sleep", "7"]}}
    assert f"hard-stop-after {balancer.HARD_STOP_AFTER_S}s" in rendered.haproxy_cfg
    assert pod["terminationGracePeriodSeconds"] > 7 + balancer.HARD_STOP_AFTER_S


@pytest.mark.parametrize("strategy", [s.value for s in balancer.Strategy])
@pytest.mark.parametrize(
    "values",
    [
        {"replicas": 1},
        {"replicas": 20, "server": {"port": 9000}, "service": {"port": 80}},
        {
            "replicas": 2,
            "haproxy": {
                "servers": 3,
                "hashBalanceFactor": 125,
                "checkIntervalMs": 150,
                "port": 8000,
                "statsPort": 9404,
                "clusterDomain": "k8s.example",
                "bindAddress": "::",
            },
        },
    ],
    ids=["one-pod", "twenty-pods", "tuned"],
)
def test_the_configuration_is_mmserver_clusters_for_the_same_pods(
    strategy: str, values: dict[str, Any]
) -> None:
    given = {**values, "haproxy": {**values.get("haproxy", {}), "strategy": strategy}}
    rendered = render({**given, "haproxy": {"enabled": True, **given["haproxy"]}})
    assert significant(rendered.haproxy_cfg) == cluster_config(rendered, given)


def servers(values: dict[str, Any]) -> list[list[str]]:
    """The words of each server line."""
    lines = [line.split() for line in significant(render(values).haproxy_cfg)]
    return [words for words in lines if words[0] == "server"]


def test_each_pod_keeps_its_place_on_the_ring() -> None:
    found = servers({"replicas": 3, **haproxy({})})
    assert [(s[1], s[4]) for s in found] == [
        (f"{FULLNAME}-{i}", str(i + 1)) for i in range(SERVERS)
    ]
    for i, words in enumerate(found):
        assert words[2] == f"{FULLNAME}-{i}.{HEADLESS}.{NAMESPACE}.svc.cluster.local:8080"
        assert words[5:] == RESOLVE.split()


@pytest.mark.parametrize(
    ("values", "count"),
    [
        ({"replicas": 3, **haproxy({"servers": 5})}, 5),
        ({"replicas": 3, **haproxy({"servers": 1})}, 3),
        # Every pod an autoscaler may make, whatever replicas says.
        (
            {
                "replicas": 30,
                "autoscaling": {"maxReplicas": 24, "hpa": {"enabled": True}},
                **haproxy({}),
            },
            24,
        ),
    ],
)
def test_a_server_for_every_name_a_pod_may_have(values: dict[str, Any], count: int) -> None:
    assert [s[1] for s in servers(values)] == [f"{FULLNAME}-{i}" for i in range(count)]


@pytest.mark.parametrize("strategy", [s.value for s in balancer.Strategy])
def test_haproxy_accepts_the_configuration(strategy: str, tmp_path: Path) -> None:
    binary = require_haproxy()
    text = render({"replicas": 3, **haproxy({"strategy": strategy})}).haproxy_cfg
    # The cluster's resolver is the pod's resolv.conf; here it is a loopback address, so that
    # the check reaches nothing off this machine.
    assert "    parse-resolv-conf\n" in text
    config = tmp_path / "haproxy.cfg"
    config.write_text(
        text.replace("    parse-resolv-conf\n", "    nameserver local 127.0.0.1:53\n")
    )
    check = subprocess.run(
        [binary, "-c", "-f", str(config)], capture_output=True, text=True, timeout=30, check=False
    )
    assert check.returncode == 0, check.stdout + check.stderr


def test_a_new_configuration_rolls_the_balancers() -> None:
    def checksum(values: dict[str, Any]) -> str:
        rendered = render(values)
        pod = rendered.one("Deployment", BALANCER)["spec"]["template"]
        value: str = pod["metadata"]["annotations"]["checksum/config"]
        return value

    base = checksum(haproxy({}))
    assert checksum(haproxy({})) == base
    assert checksum(haproxy({"strategy": "RANDOM"})) != base
    assert checksum({"replicas": 20, **haproxy({})}) != base
    # Pods within the servers are found by DNS: scaling them does not restart HAProxy.
    assert checksum({"replicas": 5, **haproxy({})}) == base


def test_the_stats_port_is_not_the_balancers_port() -> None:
    message = refusal(haproxy({"statsPort": 8080}))
    assert "statsPort" in message, message
    # Without HAProxy its ports do not matter.
    assert render({"haproxy": {"enabled": False, "statsPort": 8080}}).all("ConfigMap") == []
