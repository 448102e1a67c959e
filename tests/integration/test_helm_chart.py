"""The Helm chart (``deploy/helm/mmserver``): rendered by Helm's template engine with each value
set both ways, every object validated against Kubernetes' schemas (:mod:`tests.integration.
helmchart`), and the fields that make the server run right checked: probes, grace period,
memory budget, token, security, names, monitoring. The model store, the options and the ports
are checked in ``test_helm_store_options.py``, HAProxy in ``test_helm_haproxy.py``, the pages in
``test_helm_docs.py``. Nothing here reaches a cluster or the network."""

from __future__ import annotations

import hashlib
import math
import re
from typing import Any

import helm_python
import jsonschema
import pytest
import yaml
from kubernetes_validate.utils import all_versions

from tests.integration.helmchart import (
    CHART,
    EVERYTHING_OFF,
    EVERYTHING_ON,
    FULLNAME,
    HEADLESS,
    NAMESPACE,
    REQUIRED,
    ROOT,
    SPREAD,
    merge_on,
    refusal,
    render,
    validate,
)


def version_at_least(version: str, minimum: str) -> bool:
    return tuple(map(int, version.split(".")[:2])) >= tuple(map(int, minimum.split(".")[:2]))


# The renderer and the validator -------------------------------------------------------------------


def test_defaults_alone_are_refused_for_want_of_a_token() -> None:
    message = refusal(required=False)
    assert "managementToken" in message and "existingSecret" in message, message


def test_helm_lint_finds_nothing() -> None:
    report = helm_python.lint(CHART, REQUIRED, strict=True)
    # Severity 1 is information ("icon is recommended"); 2 a warning, 3 an error.
    assert report["errors"] == [], report
    assert [m for m in report["messages"] if m["severity"] > 1] == [], report


@pytest.mark.parametrize("values", [EVERYTHING_ON, EVERYTHING_OFF], ids=["on", "off"])
def test_every_object_is_valid_for_every_kubernetes_version_the_chart_supports(
    values: dict[str, Any],
) -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    minimum = re.sub(r"[^0-9.]", "", chart["kubeVersion"].split("-")[0])
    versions = sorted({v for v in all_versions() if version_at_least(v, minimum)})
    assert len(versions) >= 10, versions
    rendered = render(values)
    for version in versions:
        for obj in rendered.objects:
            validate(obj, version)


def test_the_validation_refuses_a_field_the_kind_does_not_have() -> None:
    rendered = render(EVERYTHING_ON)
    statefulset = rendered.one("StatefulSet")
    statefulset["spec"]["template"]["spec"]["containers"][0]["readinessProb"] = {}
    with pytest.raises(jsonschema.ValidationError):
        validate(statefulset)
    monitor = rendered.one("ServiceMonitor")
    monitor["spec"]["endpoints"][0]["scrapeIntervall"] = "15s"
    with pytest.raises(jsonschema.ValidationError):
        validate(monitor)
    monitor = render(EVERYTHING_ON).one("ServiceMonitor")
    monitor["spec"]["endpoints"][0]["interval"] = "15 seconds"
    with pytest.raises(jsonschema.ValidationError):
        validate(monitor)


@pytest.mark.parametrize(
    ("values", "where"),
    [
        ({"replica": 3}, "replica"),
        ({"haproxy": {"strategy": "ROUND_ROBIN"}}, "/haproxy/strategy"),
        ({"haproxy": {"hashBalanceFactor": 100}}, "/haproxy/hashBalanceFactor"),
        ({"modelStore": {"type": "nfs"}}, "/modelStore/type"),
        ({"server": {"port": "8080"}}, "/server/port"),
        ({"server": {"options": {"log_format": ["json"]}}}, "/server/options/log_format"),
    ],
)
def test_the_values_schema_refuses_what_values_yaml_does_not_describe(
    values: dict[str, Any], where: str
) -> None:
    message = refusal(values)
    assert "schema" in message and where in message, message


# Probes and shutdown ------------------------------------------------------------------------------


def test_probes_ask_the_health_paths_on_the_http_port() -> None:
    rendered = render({"server": {"port": 9000}})
    container = rendered.container
    assert container["readinessProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": "http"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/v2/health/live", "port": "http"}
    assert container["startupProbe"]["httpGet"] == {"path": "/v2/health/live", "port": "http"}
    assert container["ports"] == [{"name": "http", "containerPort": 9000, "protocol": "TCP"}]
    assert rendered.env_value("MMSERVER_PORT") == "9000"
    assert rendered.env_value("MMSERVER_HOST") == "0.0.0.0"
    for service in (rendered.one("Service"), rendered.one("Service", HEADLESS)):
        assert [(p["name"], p["targetPort"]) for p in service["spec"]["ports"]] == [
            ("http", "http")
        ]


def test_probe_timings_come_from_the_values() -> None:
    probes = {
        "readiness": {"periodSeconds": 3, "timeoutSeconds": 1, "failureThreshold": 1},
        "liveness": {"periodSeconds": 20, "timeoutSeconds": 4, "failureThreshold": 6},
        "startup": {"periodSeconds": 5, "timeoutSeconds": 3, "failureThreshold": 600},
    }
    container = render({"probes": probes}).container
    for name, timings in probes.items():
        probe = container[f"{name}Probe"]
        assert {k: probe[k] for k in timings} == timings


@pytest.mark.parametrize(
    ("drain", "pause", "margin"), [(30, 5, 15), (0.5, 0, 1), (7.2, 3, 2), (600, 10, 30)]
)
def test_the_grace_period_outlasts_the_pause_and_the_drain(
    drain: float, pause: int, margin: int
) -> None:
    rendered = render(
        {
            "server": {
                "drainTimeout": drain,
                "preStopSeconds": pause,
                "shutdownMarginSeconds": margin,
            }
        }
    )
    grace = rendered.pod["spec"]["terminationGracePeriodSeconds"]
    assert grace == pause + math.ceil(drain) + margin
    assert grace > pause + drain
    assert float(rendered.env_value("MMSERVER_DRAIN_TIMEOUT") or "nan") == drain
    assert rendered.container["lifecycle"]["preStop"] == {
        "exec": {"command": ["sleep", str(pause)]}
    }


# Memory -------------------------------------------------------------------------------------------


def test_by_default_the_memory_limit_sets_the_budget_through_the_cgroup() -> None:
    rendered = render()
    assert rendered.container["resources"]["limits"]["memory"] == "2Gi"
    assert "MMSERVER_MAX_MEMORY_MB" not in rendered.env


def test_an_explicit_budget_is_passed_to_the_server() -> None:
    rendered = render({"server": {"maxMemoryMb": 1500}, "resources": {"limits": {"memory": "4Gi"}}})
    assert rendered.container["resources"]["limits"]["memory"] == "4Gi"
    assert rendered.env_value("MMSERVER_MAX_MEMORY_MB") == "1500"


def test_without_a_memory_limit_an_explicit_budget_is_needed() -> None:
    message = refusal({"resources": {"limits": {"memory": None}}})
    assert "resources.limits.memory" in message and "maxMemoryMb" in message, message
    message = refusal({"resources": {"limits": None}})
    assert "resources.limits.memory" in message, message
    rendered = render({"resources": {"limits": None}, "server": {"maxMemoryMb": 3000}})
    assert "limits" not in rendered.container["resources"]
    assert rendered.env_value("MMSERVER_MAX_MEMORY_MB") == "3000"


# The management token -----------------------------------------------------------------------------


def test_a_token_from_an_existing_secret() -> None:
    rendered = render(
        {"managementToken": {"existingSecret": "ops-token", "existingSecretKey": "bearer"}}
    )
    assert rendered.secret_ref("MMSERVER_MANAGEMENT_TOKEN") == ("ops-token", "bearer")
    assert rendered.all("Secret") == []
    assert "MMSERVER_INSECURE_MANAGEMENT" not in rendered.env
    assert "annotations" not in rendered.pod["metadata"]


def test_a_token_given_as_a_value_goes_into_a_secret_of_the_chart() -> None:
    values = {"managementToken": {"existingSecret": "", "value": "s3cret"}}
    rendered = render(values)
    name = f"{FULLNAME}-management"
    assert rendered.secret_ref("MMSERVER_MANAGEMENT_TOKEN") == (name, "token")
    assert rendered.secret_text(name, "token") == "s3cret"
    assert "s3cret" not in str(rendered.pod), "the token is in the pod spec"
    checksum = rendered.pod["metadata"]["annotations"]["checksum/management-token"]
    assert checksum == hashlib.sha256(b"s3cret").hexdigest()
    other = render({"managementToken": {"existingSecret": "", "value": "other"}})
    assert other.pod["metadata"]["annotations"]["checksum/management-token"] != checksum


def test_an_open_management_api_only_when_asked_for() -> None:
    rendered = render({"managementToken": {"existingSecret": "", "insecure": True}})
    assert rendered.env_value("MMSERVER_INSECURE_MANAGEMENT") == "true"
    assert "MMSERVER_MANAGEMENT_TOKEN" not in rendered.env
    assert rendered.all("Secret") == []
    message = refusal({"managementToken": {"existingSecret": "", "insecure": False}})
    assert "managementToken" in message, message


def test_a_token_from_two_places_is_refused() -> None:
    message = refusal({"managementToken": {"existingSecret": "a", "value": "b"}})
    assert "not both" in message, message


# The pods and their identity ----------------------------------------------------------------------


def test_the_pods_are_a_statefulset_named_through_the_headless_service() -> None:
    rendered = render({"replicas": 3})
    statefulset = rendered.one("StatefulSet")
    assert statefulset["spec"]["replicas"] == 3
    assert statefulset["spec"]["serviceName"] == HEADLESS
    assert statefulset["spec"]["podManagementPolicy"] == "Parallel"
    headless = rendered.one("Service", HEADLESS)["spec"]
    assert headless["clusterIP"] == "None" and headless["publishNotReadyAddresses"] is True
    selector = statefulset["spec"]["selector"]["matchLabels"]
    assert selector.items() <= rendered.pod["metadata"]["labels"].items()
    for service in (rendered.one("Service"), rendered.one("Service", HEADLESS)):
        assert service["spec"]["selector"] == selector


def test_the_pods_run_as_the_images_user_on_a_read_only_root() -> None:
    found = re.search(r"--uid (\d+)", (ROOT / "Dockerfile").read_text())
    assert found is not None
    uid = int(found.group(1))
    rendered = render()
    pod = rendered.pod["spec"]["securityContext"]
    assert pod["runAsNonRoot"] is True and pod["runAsUser"] == uid
    assert pod["seccompProfile"] == {"type": "RuntimeDefault"}
    container = rendered.container["securityContext"]
    assert container["readOnlyRootFilesystem"] is True
    assert container["allowPrivilegeEscalation"] is False
    assert container["capabilities"] == {"drop": ["ALL"]}
    assert rendered.pod["spec"]["automountServiceAccountToken"] is False


@pytest.mark.parametrize(("tag", "image"), [("", "mmserver:0.1.0"), ("1.2", "mmserver:1.2")])
def test_the_image_tag_defaults_to_the_app_version(tag: str, image: str) -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["appVersion"] == "0.1.0"
    rendered = render({"image": {"tag": tag, "pullPolicy": "Always"}})
    assert rendered.container["image"] == image
    assert rendered.container["imagePullPolicy"] == "Always"


@pytest.mark.parametrize(
    ("values", "account", "made"),
    [
        ({}, FULLNAME, True),
        ({"serviceAccount": {"name": "reader"}}, "reader", True),
        ({"serviceAccount": {"create": False}}, "default", False),
        ({"serviceAccount": {"create": False, "name": "reader"}}, "reader", False),
    ],
)
def test_the_service_account(values: dict[str, Any], account: str, made: bool) -> None:
    rendered = render(values)
    assert rendered.pod["spec"]["serviceAccountName"] == account
    accounts = rendered.all("ServiceAccount")
    assert [a["metadata"]["name"] for a in accounts] == ([account] if made else [])
    for made_account in accounts:
        assert "annotations" not in made_account["metadata"]
        assert made_account["automountServiceAccountToken"] is False


def test_the_pass_through_values_reach_the_pods_and_services() -> None:
    on = render(EVERYTHING_ON)
    off = render(EVERYTHING_OFF)
    spec = on.pod["spec"]
    assert spec["imagePullSecrets"] == [{"name": "registry"}]
    assert spec["nodeSelector"] == {"pool": "cpu"}
    assert spec["tolerations"] == EVERYTHING_ON["tolerations"]
    assert spec["affinity"] == EVERYTHING_ON["affinity"]
    assert [c["name"] for c in spec["initContainers"]] == ["fetch"]
    assert on.pod["metadata"]["labels"]["team"] == "ml"
    assert on.pod["metadata"]["annotations"]["a"] == "b"
    assert on.one("Service")["metadata"]["annotations"] == {"a": "b"}
    assert (
        on.one("ServiceAccount")["metadata"]["annotations"]
        == (EVERYTHING_ON["serviceAccount"]["annotations"])
    )
    for key in (
        "imagePullSecrets",
        "nodeSelector",
        "tolerations",
        "affinity",
        "initContainers",
        "topologySpreadConstraints",
    ):
        assert key not in off.pod["spec"], key
    assert "team" not in off.pod["metadata"]["labels"]
    assert "annotations" not in off.pod["metadata"]
    assert "annotations" not in off.one("Service")["metadata"]


def test_the_pods_spread_over_nodes_and_zones_where_they_can() -> None:
    rendered = render({"haproxy": {"enabled": True}})
    balancer = rendered.one("Deployment", f"{FULLNAME}-haproxy")["spec"]
    for pods, spec in [
        (rendered.one("StatefulSet")["spec"], rendered.pod["spec"]),
        (balancer, balancer["template"]["spec"]),
    ]:
        selector = pods["selector"]["matchLabels"]
        assert spec["topologySpreadConstraints"] == [
            {
                "maxSkew": 1,
                "topologyKey": key,
                # Preferred: a pod that cannot spread is scheduled all the same.
                "whenUnsatisfiable": "ScheduleAnyway",
                "labelSelector": {"matchLabels": selector},
            }
            for key in ("kubernetes.io/hostname", "topology.kubernetes.io/zone")
        ]
    on = render(EVERYTHING_ON)
    (hostname, given) = on.pod["spec"]["topologySpreadConstraints"]
    assert (hostname["topologyKey"], hostname["maxSkew"]) == ("kubernetes.io/hostname", 2)
    assert given == SPREAD
    balancer = on.one("Deployment", f"{FULLNAME}-haproxy")["spec"]["template"]["spec"]
    assert balancer["topologySpreadConstraints"][-1] == SPREAD
    assert len(balancer["topologySpreadConstraints"]) == 3


@pytest.mark.parametrize(
    ("release", "values", "prefix"),
    [
        ("mmserver", {}, "mmserver"),
        ("prod", {"fullnameOverride": "models"}, "models"),
        ("prod", {"nameOverride": "serving"}, "prod-serving"),
        ("a-release-name-long-enough-to-pass-kubernetes-limits-on-names", {}, None),
    ],
)
def test_names_stay_within_kubernetes_limits(
    release: str, values: dict[str, Any], prefix: str | None
) -> None:
    rendered = render(merge_on(values), release=release)
    names = [name for _, name in rendered.names()]
    assert all(
        len(name) <= 63 and re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name) for name in names
    ), names
    statefulset = rendered.all("StatefulSet")[0]["metadata"]["name"]
    # A pod's controller-revision-hash label is the StatefulSet's name and a 10-character hash.
    assert len(statefulset) <= 52
    if prefix is not None:
        assert statefulset == prefix


def test_the_notes_say_where_to_connect() -> None:
    notes = render({"server": {"grpcPort": 8081}, "haproxy": {"enabled": True}}).notes
    assert f"service/{FULLNAME}" in notes and "gRPC on port 8081" in notes
    assert f"{FULLNAME}-haproxy" in notes and f"{HEADLESS}.{NAMESPACE}.svc" in notes
    notes = render().notes
    assert "gRPC" not in notes and "haproxy" not in notes


# Metrics ------------------------------------------------------------------------------------------


def test_no_servicemonitor_unless_enabled() -> None:
    assert render().all("ServiceMonitor") == []
    assert render().all("PrometheusRule") == []


def test_the_prometheusrule_holds_the_rules_deploy_ships_and_tests() -> None:
    rendered = render({"metrics": {"prometheusRule": {"enabled": True, "labels": {"r": "p"}}}})
    rule = rendered.one("PrometheusRule")
    validate(rule)
    assert rule["metadata"]["labels"]["r"] == "p"
    shipped = yaml.safe_load((ROOT / "deploy" / "prometheus" / "mmserver-rules.yml").read_text())
    assert rule["spec"] == shipped
    alerts = [r["alert"] for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r]
    assert alerts == [
        "MMServerModelLoadsFailing",
        "MMServerBackendsRestarting",
        "MMServerQueueSaturated",
        "MMServerEvictionChurn",
        "MMServerMemoryBudgetNearlyFull",
        "MMServerModelP99High",
    ]


@pytest.mark.parametrize("timing", [{}, {"interval": "15s", "scrapeTimeout": "10s"}])
@pytest.mark.parametrize("labels", [{}, {"release": "prometheus"}])
def test_the_servicemonitor_scrapes_every_pod_once(
    timing: dict[str, str], labels: dict[str, str]
) -> None:
    rendered = render(
        {"metrics": {"serviceMonitor": {"enabled": True, "labels": labels, **timing}}}
    )
    monitor = rendered.one("ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert labels.items() <= monitor["metadata"]["labels"].items()
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint == {"port": "http", "path": "/metrics", "scheme": "http", **timing}
    # It selects the headless Service alone: its endpoints are every pod, each once.
    selector = monitor["spec"]["selector"]["matchLabels"].items()
    selected = [
        s["metadata"]["name"]
        for s in rendered.all("Service")
        if selector <= s["metadata"]["labels"].items()
    ]
    assert selected == [HEADLESS]
    assert "http" in [p["name"] for p in rendered.one("Service", HEADLESS)["spec"]["ports"]]
