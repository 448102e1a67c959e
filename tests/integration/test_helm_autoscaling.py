"""The chart's pods through updates, disruptions and load: the StatefulSet's rolling update, a
pod's own state volume (its warm set, loaded again before it is ready), the PodDisruptionBudget,
and pod autoscaling by a HorizontalPodAutoscaler on CPU or by a KEDA ScaledObject on queued
requests (validated against KEDA's CRD schema in ``schemas/``), whose PromQL query promtool
evaluates over recorded series. Nothing here reaches a cluster."""

from __future__ import annotations

import math
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from tests.integration.helmchart import (
    EVERYTHING_ON,
    FULLNAME,
    HEADLESS,
    NAMESPACE,
    Rendered,
    refusal,
    render,
    validate,
)
from tests.integration.test_alerts import _promtool

PROMETHEUS = "http://prometheus-operated.monitoring.svc:9090"
HPA: dict[str, Any] = {"autoscaling": {"hpa": {"enabled": True}}}
KEDA: dict[str, Any] = {"autoscaling": {"keda": {"enabled": True, "serverAddress": PROMETHEUS}}}


def scaled_object(values: dict[str, Any]) -> dict[str, Any]:
    """The ScaledObject of ``values`` over :data:`KEDA`, validated against KEDA's schema."""
    keda = {**KEDA["autoscaling"]["keda"], **values.get("autoscaling", {}).get("keda", {})}
    given = {**values, "autoscaling": {**values.get("autoscaling", {}), "keda": keda}}
    rendered = render(given)
    assert rendered.all("HorizontalPodAutoscaler") == []
    return rendered.one("ScaledObject")


def server_lines(rendered: Rendered) -> list[str]:
    return [
        line.split()[1]
        for line in rendered.haproxy_cfg.splitlines()
        if line.startswith("    server ")
    ]


# Rolling updates and disruptions ------------------------------------------------------------------


def test_an_update_replaces_one_pod_at_a_time_each_drained() -> None:
    rendered = render()
    spec = rendered.one("StatefulSet")["spec"]
    assert spec["updateStrategy"] == {"type": "RollingUpdate", "rollingUpdate": {"partition": 0}}
    # No maxUnavailable: one pod at a time, the next when the last is ready for minReadySeconds.
    assert spec["minReadySeconds"] == 5
    assert render({"minReadySeconds": 20}).one("StatefulSet")["spec"]["minReadySeconds"] == 20
    # Each pod leaves through the drain: a preStop pause, then SIGTERM within the grace period.
    assert rendered.container["lifecycle"]["preStop"]["exec"]["command"][0] == "sleep"
    assert rendered.pod["spec"]["terminationGracePeriodSeconds"] == 5 + 30 + 15


def test_no_state_volume_by_default() -> None:
    rendered = render()
    assert "volumeClaimTemplates" not in rendered.one("StatefulSet")["spec"]
    assert "MMSERVER_STATE_DIR" not in rendered.env and rendered.mount("state") is None
    # A state_dir of one's own choosing passes through as any option.
    rendered = render({"server": {"options": {"state_dir": "/cache/state"}}})
    assert rendered.env_value("MMSERVER_STATE_DIR") == "/cache/state"


def test_each_pod_keeps_its_warm_set_on_a_claim_of_its_own() -> None:
    state = {"enabled": True, "size": "3Gi", "storageClassName": "ssd", "warmReadyTimeout": 45}
    rendered = render({"state": state})
    (claim,) = rendered.one("StatefulSet")["spec"]["volumeClaimTemplates"]
    assert claim["metadata"]["name"] == "state"
    assert claim["spec"] == {
        "accessModes": ["ReadWriteOnce"],
        "storageClassName": "ssd",
        "resources": {"requests": {"storage": "3Gi"}},
    }
    assert rendered.mount("state") == {"name": "state", "mountPath": "/state"}
    assert rendered.env_value("MMSERVER_STATE_DIR") == "/state"
    # Not ready until the models it had are loaded again, for 45 s at most: the readiness probe
    # (and HAProxy's /ping) tell it, so an update waits for it before the next pod.
    assert rendered.env_value("MMSERVER_WARM_READY_TIMEOUT") == "45"
    assert rendered.container["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    default = render({"state": {"enabled": True}})
    assert default.env_value("MMSERVER_WARM_READY_TIMEOUT") == "120"
    assert (
        "storageClassName"
        not in default.one("StatefulSet")["spec"]["volumeClaimTemplates"][0]["spec"]
    )


@pytest.mark.parametrize("option", ["state_dir", "warm_ready_timeout"])
def test_with_a_state_volume_its_options_are_the_charts(option: str) -> None:
    message = refusal({"state": {"enabled": True}, "server": {"options": {option: "1"}}})
    assert f"server.options.{option}" in message and "state" in message, message


def test_by_default_a_disruption_takes_one_pod_at_a_time() -> None:
    rendered = render()
    budget = rendered.one("PodDisruptionBudget")
    assert budget["apiVersion"] == "policy/v1"
    assert budget["spec"]["maxUnavailable"] == 1 and "minAvailable" not in budget["spec"]
    # It covers the server's pods, all of them, and the balancer's none.
    selector = budget["spec"]["selector"]["matchLabels"]
    assert selector == rendered.one("StatefulSet")["spec"]["selector"]["matchLabels"]
    haproxy = render({"haproxy": {"enabled": True, "servers": 1}}).one(
        "Deployment", f"{FULLNAME}-haproxy"
    )
    assert not selector.items() <= haproxy["spec"]["template"]["metadata"]["labels"].items()


@pytest.mark.parametrize(
    ("budget", "spec"),
    [
        ({"maxUnavailable": "25%"}, {"maxUnavailable": "25%"}),
        ({"maxUnavailable": 0}, {"maxUnavailable": 0}),
        ({"maxUnavailable": "", "minAvailable": 2}, {"minAvailable": 2}),
        ({"maxUnavailable": None, "minAvailable": "50%"}, {"minAvailable": "50%"}),
    ],
)
def test_the_budget_from_the_values(budget: dict[str, Any], spec: dict[str, Any]) -> None:
    found = render({"podDisruptionBudget": budget}).one("PodDisruptionBudget")["spec"]
    assert {k: v for k, v in found.items() if k != "selector"} == spec


def test_a_budget_needs_one_bound_and_no_more() -> None:
    message = refusal({"podDisruptionBudget": {"maxUnavailable": 1, "minAvailable": 1}})
    assert "not both" in message, message
    message = refusal({"podDisruptionBudget": {"maxUnavailable": ""}})
    assert "maxUnavailable or minAvailable" in message, message
    message = refusal({"podDisruptionBudget": {"maxUnavailable": "2"}})
    assert "schema" in message and "maxUnavailable" in message, message
    assert render({"podDisruptionBudget": {"enabled": False}}).all("PodDisruptionBudget") == []


# The HorizontalPodAutoscaler ----------------------------------------------------------------------


def test_no_autoscaler_by_default_and_the_replicas_are_the_charts() -> None:
    rendered = render({"replicas": 3, "haproxy": {"enabled": True, "servers": 1}})
    assert rendered.all("HorizontalPodAutoscaler") == [] and rendered.all("ScaledObject") == []
    assert rendered.one("StatefulSet")["spec"]["replicas"] == 3
    assert len(server_lines(rendered)) == 3


def test_the_hpa_scales_the_statefulset_on_cpu() -> None:
    rendered = render(
        {
            "replicas": 3,
            "haproxy": {"enabled": True, "servers": 1},
            "autoscaling": {
                "minReplicas": 2,
                "maxReplicas": 7,
                "behavior": {"scaleDown": {"stabilizationWindowSeconds": 900}},
                "hpa": {"enabled": True, "targetCPUUtilizationPercentage": 55},
            },
        }
    )
    hpa = rendered.one("HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    statefulset = rendered.one("StatefulSet")
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": statefulset["apiVersion"],
        "kind": "StatefulSet",
        "name": statefulset["metadata"]["name"],
    }
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 7)
    assert hpa["spec"]["metrics"] == [
        {
            "type": "Resource",
            "resource": {
                "name": "cpu",
                "target": {"type": "Utilization", "averageUtilization": 55},
            },
        }
    ]
    assert hpa["spec"]["behavior"] == {"scaleDown": {"stabilizationWindowSeconds": 900}}
    # The replicas are the autoscaler's: an upgrade does not set them back.
    assert "replicas" not in statefulset["spec"]
    # HAProxy has a server for every pod the autoscaler may make.
    assert server_lines(rendered) == [f"{FULLNAME}-{i}" for i in range(7)]
    assert "behavior" not in render(HPA).one("HorizontalPodAutoscaler")["spec"]
    assert "scaled on CPU" in rendered.notes and "2 to 7 pods" in rendered.notes


def test_the_hpa_needs_a_cpu_request() -> None:
    message = refusal({**HPA, "resources": {"requests": {"cpu": None}}})
    assert "resources.requests.cpu" in message, message
    message = refusal({**HPA, "resources": {"requests": None}})
    assert "resources.requests.cpu" in message, message


def test_the_bounds_are_checked() -> None:
    message = refusal(
        {"autoscaling": {"minReplicas": 5, "maxReplicas": 4, "hpa": {"enabled": True}}}
    )
    assert "minReplicas (5) is more than autoscaling.maxReplicas (4)" in message, message
    message = refusal({"autoscaling": {"minReplicas": 0, "hpa": {"enabled": True}}})
    assert "schema" in message and "minReplicas" in message, message


def test_two_autoscalers_are_refused() -> None:
    both = {"autoscaling": {"hpa": {"enabled": True}, "keda": KEDA["autoscaling"]["keda"]}}
    message = refusal(both)
    assert "hpa.enabled and keda.enabled are both set" in message, message


# The KEDA ScaledObject ----------------------------------------------------------------------------


def test_keda_scales_the_statefulset_on_queued_requests_per_pod() -> None:
    obj = scaled_object(
        {
            "autoscaling": {
                "minReplicas": 1,
                "maxReplicas": 20,
                "behavior": {"scaleUp": {"stabilizationWindowSeconds": 0}},
                "keda": {"threshold": 8, "pollingInterval": 30},
            }
        }
    )
    assert obj["apiVersion"] == "keda.sh/v1alpha1"
    spec = obj["spec"]
    assert spec["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "name": FULLNAME,
    }
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (1, 20)
    assert spec["pollingInterval"] == 30
    assert spec["advanced"] == {
        "horizontalPodAutoscalerConfig": {
            "behavior": {"scaleUp": {"stabilizationWindowSeconds": 0}}
        }
    }
    (trigger,) = spec["triggers"]
    # AverageValue: the HPA divides the query's value (every pod's queued requests) by the pods.
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
    assert trigger["metadata"] == {
        "serverAddress": PROMETHEUS,
        "query": (
            f'sum(avg_over_time(mmserver_queue_length{{namespace="{NAMESPACE}", '
            f'pod=~"{FULLNAME}-[0-9]+"}}[1m]))'
        ),
        "threshold": "8",
    }
    assert "advanced" not in scaled_object({})["spec"]


def test_the_query_and_a_fractional_threshold_from_the_values() -> None:
    query = 'sum(mmserver_queue_length{job="mmserver"})'
    (trigger,) = scaled_object({"autoscaling": {"keda": {"query": query, "threshold": 2.5}}})[
        "spec"
    ]["triggers"]
    assert trigger["metadata"]["query"] == query and trigger["metadata"]["threshold"] == "2.5"


def test_keda_needs_its_prometheus() -> None:
    message = refusal({"autoscaling": {"keda": {"enabled": True}}})
    assert "autoscaling.keda.serverAddress" in message, message


def test_keda_owns_the_replicas_and_haproxy_knows_every_pod() -> None:
    values = {
        "haproxy": {"enabled": True, "servers": 1},
        "autoscaling": {"maxReplicas": 4, **KEDA["autoscaling"]},
    }
    rendered = render(values)
    assert "replicas" not in rendered.one("StatefulSet")["spec"]
    assert server_lines(rendered) == [f"{FULLNAME}-{i}" for i in range(4)]
    assert "scaled on queued requests" in rendered.notes


def test_kedas_schema_refuses_a_wrong_scaledobject() -> None:
    obj = scaled_object({})
    validate(obj)
    for path, value in [
        (("spec", "maxReplicas"), 10),  # maxReplicaCount's name in an HPA
        (("spec", "triggers", 0, "metadata", "threshold"), 5),  # metadata values are strings
        (("spec", "triggers"), []),  # at least one trigger
        (("spec", "scaleTargetRef", "nam"), "x"),
    ]:
        wrong = yaml.safe_load(yaml.safe_dump(obj))
        node = wrong
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        with pytest.raises(jsonschema.ValidationError):
            validate(wrong)


def test_everything_on_has_one_autoscaler() -> None:
    rendered = render(EVERYTHING_ON)
    assert len(rendered.all("HorizontalPodAutoscaler")) == 1
    assert rendered.all("ScaledObject") == []
    budget = rendered.one("PodDisruptionBudget")["spec"]
    assert budget["minAvailable"] == "50%" and "maxUnavailable" not in budget


# The query, evaluated by promtool over recorded series ------------------------------------------

#: Series as Prometheus records them from the ServiceMonitor's scrapes (one each 15 s): three
#: pods of the release, one with metrics_model_label=all (a series per loaded model) and one
#: whose queue spikes; and series the query must leave out: another release's pod, a pod of
#: the same name in another namespace.
SERIES = [
    (f'{{namespace="{NAMESPACE}", pod="{FULLNAME}-0", model="a"}}', "3 3 3 3 3 3 3 3 3"),
    (f'{{namespace="{NAMESPACE}", pod="{FULLNAME}-0", model="b"}}', "1 1 1 1 1 1 1 1 1"),
    (f'{{namespace="{NAMESPACE}", pod="{FULLNAME}-1"}}', "0 0 0 0 6 6 6 6 6"),
    # A dip to 2 and a spike to 8 at the last scrape: the minute's average is 5.
    (f'{{namespace="{NAMESPACE}", pod="{FULLNAME}-2"}}', "5 5 5 5 5 2 5 5 8"),
    (f'{{namespace="{NAMESPACE}", pod="other-mmserver-0"}}', "40 40 40 40 40 40 40 40 40"),
    (f'{{namespace="staging", pod="{FULLNAME}-0"}}', "50 50 50 50 50 50 50 50 50"),
]


def promtool_test(query: str, expected: float, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """``promtool test rules`` of ``query`` at 2 minutes over :data:`SERIES`."""
    test = {
        "rule_files": [],
        "evaluation_interval": "15s",
        "tests": [
            {
                "name": "queued requests of the release's pods",
                "interval": "15s",
                "input_series": [
                    {"series": f"mmserver_queue_length{labels}", "values": values}
                    for labels, values in SERIES
                ],
                "promql_expr_test": [
                    {
                        "expr": query,
                        "eval_time": "2m",
                        "exp_samples": [{"labels": "{}", "value": expected}],
                    }
                ],
            }
        ],
    }
    (tmp_path / "keda-query-test.yml").write_text(yaml.safe_dump(test, sort_keys=False))
    return subprocess.run(
        [_promtool(), "test", "rules", "keda-query-test.yml"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_the_query_sums_the_queued_requests_of_the_releases_pods(tmp_path: Path) -> None:
    (trigger,) = scaled_object({})["spec"]["triggers"]
    # 3 + 1 on pod 0, 6 on pod 1, 5 on pod 2 (averaged over the minute).
    tested = promtool_test(trigger["metadata"]["query"], 15, tmp_path)
    assert tested.returncode == 0, tested.stdout + tested.stderr
    # KEDA's HPA then wants ceil(15 / 5) pods.
    assert math.ceil(15 / float(trigger["metadata"]["threshold"])) == 3


@pytest.mark.parametrize(
    ("right", "wrong", "got"),
    [
        # Another release's pods in the namespace.
        (', pod=~"rel-mmserver-[0-9]+"', "", "5.5E+01"),
        # The same release's name in another namespace.
        ('namespace="models", ', "", "6.5E+01"),
        # The last scrape alone: the spike counts whole.
        ("avg_over_time(", "last_over_time(", "1.8E+01"),
    ],
)
def test_a_wrong_query_fails_the_test(right: str, wrong: str, got: str, tmp_path: Path) -> None:
    (trigger,) = scaled_object({})["spec"]["triggers"]
    query = trigger["metadata"]["query"]
    assert right in query
    tested = promtool_test(query.replace(right, wrong), 15, tmp_path)
    assert tested.returncode != 0
    assert f"got: {{}} {got}" in tested.stdout + tested.stderr, tested.stdout + tested.stderr


def test_each_pod_sends_management_calls_on_to_the_others_by_the_headless_service() -> None:
    rendered = render()
    # Every pod's address, ready or not (the headless Service publishes them all).
    assert rendered.env_value("MMSERVER_PEERS") == f"dns:{HEADLESS}.{NAMESPACE}.svc:8080"
    assert render({"server": {"peers": False}}).env_value("MMSERVER_PEERS") is None
