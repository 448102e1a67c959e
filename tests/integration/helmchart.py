"""The Helm chart at ``deploy/helm/mmserver``, rendered offline and validated.

- :func:`render` renders the chart with Helm's own template engine (``helm_python``: Helm's Go
  SDK as a shared library, as ``helm template`` runs it: the values checked against
  ``values.schema.json``, no cluster and no network) and validates every object it renders,
  against Kubernetes' schemas of its kind (``kubernetes_validate``, strict: a field the kind
  does not have is an error) or, for a custom resource (the Prometheus Operator's ServiceMonitor
  and PrometheusRule, KEDA's ScaledObject), against its CRD's schema in ``schemas/``;
- :func:`refusal` is the message of a render the chart refuses (``fail``, or the schema).
"""

from __future__ import annotations

import base64
import copy
import dataclasses
import functools
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import helm_python
import jsonschema
import kubernetes_validate
import yaml

from mmserver.config.server import ServerConfig

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "mmserver"
SCHEMAS = Path(__file__).resolve().parent / "schemas"
RELEASE = "rel"
NAMESPACE = "models"
FULLNAME = "rel-mmserver"
HEADLESS = f"{FULLNAME}-headless"
#: The API groups of the custom resources the chart makes, validated against ``schemas/``.
CRD_GROUPS = ("monitoring.coreos.com", "keda.sh")
#: The Kubernetes version every render is validated against: the newest the validator has.
KUBE_VERSION = kubernetes_validate.latest_version()

#: What every install needs on top of the defaults: a token and a model store.
REQUIRED: dict[str, Any] = {
    "managementToken": {"existingSecret": "mm-token"},
    "modelStore": {"persistentVolumeClaim": {"claimName": "models"}},
}

#: The server's options, by name.
OPTIONS = {f.name for f in dataclasses.fields(ServerConfig)}

#: A topology spread constraint given whole.
SPREAD: dict[str, Any] = {
    "maxSkew": 1,
    "topologyKey": "example.com/rack",
    "whenUnsatisfiable": "DoNotSchedule",
    "labelSelector": {"matchLabels": {"team": "ml"}},
}

#: Every optional object and branch at once.
EVERYTHING_ON: dict[str, Any] = {
    "managementToken": {"existingSecret": "", "value": "s3cret"},
    "modelStore": {
        "type": "s3",
        "s3": {
            "url": "s3://models/prod",
            "region": "eu-west-1",
            "endpointUrl": "http://minio.storage:9000",
            "credentialsSecret": "s3-keys",
        },
    },
    "server": {"grpcPort": 8081, "maxMemoryMb": 1500, "options": {"max_loaded_models": 200}},
    "cache": {"sizeLimit": "10Gi"},
    "state": {"enabled": True, "size": "5Gi", "storageClassName": "fast", "warmReadyTimeout": 90},
    "imagePullSecrets": [{"name": "registry"}],
    "serviceAccount": {"annotations": {"eks.amazonaws.com/role-arn": "arn:aws:iam::1:role/r"}},
    "service": {"annotations": {"a": "b"}},
    "podAnnotations": {"a": "b"},
    "podLabels": {"team": "ml"},
    "nodeSelector": {"pool": "cpu"},
    "tolerations": [{"key": "cpu", "operator": "Exists", "effect": "NoSchedule"}],
    "affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []}},
    "topologySpread": {"topologyKeys": ["kubernetes.io/hostname"], "maxSkew": 2},
    "topologySpreadConstraints": [SPREAD],
    "extraInitContainers": [{"name": "fetch", "image": "busybox", "command": ["true"]}],
    "podDisruptionBudget": {"maxUnavailable": "", "minAvailable": "50%"},
    "autoscaling": {
        "minReplicas": 3,
        "maxReplicas": 12,
        "behavior": {"scaleDown": {"stabilizationWindowSeconds": 600}},
        "hpa": {"enabled": True, "targetCPUUtilizationPercentage": 60},
    },
    "metrics": {
        "serviceMonitor": {
            "enabled": True,
            "interval": "15s",
            "scrapeTimeout": "10s",
            "labels": {"release": "prometheus"},
        },
        "prometheusRule": {"enabled": True, "labels": {"release": "prometheus"}},
    },
    "haproxy": {
        "enabled": True,
        "service": {"annotations": {"a": "b"}},
        "nodeSelector": {"pool": "edge"},
        "tolerations": [{"key": "edge", "operator": "Exists"}],
        "affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []}},
        "topologySpreadConstraints": [SPREAD],
    },
}

#: Every optional object and branch off.
EVERYTHING_OFF: dict[str, Any] = {
    "managementToken": {"existingSecret": "", "insecure": True},
    "modelStore": {"type": "emptyDir"},
    "server": {"options": None},
    "serviceAccount": {"create": False},
    "minReadySeconds": 0,
    "podDisruptionBudget": {"enabled": False},
    "topologySpread": {"topologyKeys": []},
    "haproxy": {"topologySpread": {"topologyKeys": []}},
}


def merge_on(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` over :data:`EVERYTHING_ON`."""
    return merge(EVERYTHING_ON, values)


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over`` on ``base``, maps merged key by key (as Helm merges values files)."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


@functools.cache
def _crd_schema(kind: str, version: str) -> dict[str, Any]:
    """The CRD schema of ``kind`` at ``version`` (``v1``, ``v1alpha1``) from ``schemas/``, made
    strict as ``kubernetes_validate``'s strict schemas are: an object with ``properties`` takes
    no other field (the API server would drop it without a word)."""
    text = (SCHEMAS / f"{kind.lower()}-{version}.yaml").read_text()
    schema: dict[str, Any] = yaml.safe_load(text)

    def strict(node: Any) -> Any:
        if isinstance(node, dict):
            node = {k: strict(v) for k, v in node.items()}
            if (
                "properties" in node
                and "additionalProperties" not in node
                and not node.get("x-kubernetes-preserve-unknown-fields")
            ):
                node["additionalProperties"] = False
            return node
        if isinstance(node, list):
            return [strict(v) for v in node]
        return node

    result: dict[str, Any] = strict(schema)
    return result


def validate(obj: dict[str, Any], version: str = KUBE_VERSION) -> None:
    """Raise ``jsonschema.ValidationError`` when ``obj`` is not a valid object of its kind."""
    _validate_text(json.dumps(obj, sort_keys=True), version)


@functools.cache
def _validate_text(text: str, version: str) -> None:
    # Cached by the object's text: most renders repeat most objects.
    obj = json.loads(text)
    group, _, api_version = obj["apiVersion"].rpartition("/")
    if group in CRD_GROUPS:
        jsonschema.Draft7Validator(_crd_schema(obj["kind"], api_version)).validate(obj)
        return
    kubernetes_validate.validate(obj, version, strict=True)


@dataclass
class Rendered:
    """The objects a render made (NOTES.txt aside), each validated."""

    objects: list[dict[str, Any]]
    notes: str

    def all(self, kind: str) -> list[dict[str, Any]]:
        return [o for o in self.objects if o["kind"] == kind]

    def get(self, kind: str, name: str) -> dict[str, Any] | None:
        found = [o for o in self.all(kind) if o["metadata"]["name"] == name]
        assert len(found) <= 1, f"{len(found)} {kind} objects named {name}"
        return found[0] if found else None

    def one(self, kind: str, name: str = FULLNAME) -> dict[str, Any]:
        found = self.get(kind, name)
        assert found is not None, f"no {kind} {name} in {self.names()}"
        return found

    def names(self) -> list[tuple[str, str]]:
        return sorted((o["kind"], o["metadata"]["name"]) for o in self.objects)

    # The mmserver pods -----------------------------------------------------------------------

    @property
    def pod(self) -> dict[str, Any]:
        """The pod template of the StatefulSet."""
        template: dict[str, Any] = self.one("StatefulSet")["spec"]["template"]
        return template

    @property
    def container(self) -> dict[str, Any]:
        containers = self.pod["spec"]["containers"]
        assert [c["name"] for c in containers] == ["mmserver"]
        result: dict[str, Any] = containers[0]
        return result

    @property
    def env(self) -> dict[str, dict[str, Any]]:
        """The server's environment variables by name (each given once)."""
        names = [e["name"] for e in self.container["env"]]
        assert len(names) == len(set(names)), f"an environment variable set twice: {names}"
        return {e["name"]: e for e in self.container["env"]}

    def env_value(self, name: str) -> str | None:
        entry = self.env.get(name)
        if entry is None:
            return None
        assert "valueFrom" not in entry, f"{name} comes from {entry['valueFrom']}"
        value: str = entry["value"]
        assert isinstance(value, str)
        return value

    def secret_ref(self, name: str) -> tuple[str, str]:
        """(Secret name, key) the variable ``name`` is read from."""
        ref = self.env[name]["valueFrom"]["secretKeyRef"]
        return ref["name"], ref["key"]

    def volume(self, name: str) -> dict[str, Any] | None:
        return next((v for v in self.pod["spec"].get("volumes", ()) if v["name"] == name), None)

    def mount(self, name: str) -> dict[str, Any] | None:
        return next((m for m in self.container.get("volumeMounts", ()) if m["name"] == name), None)

    def secret_text(self, name: str, key: str) -> str:
        return base64.b64decode(self.one("Secret", name)["data"][key]).decode()

    @property
    def haproxy_cfg(self) -> str:
        text: str = self.one("ConfigMap", f"{FULLNAME}-haproxy")["data"]["haproxy.cfg"]
        return text


def _load(values: dict[str, Any] | None, release: str) -> dict[str, str]:
    with helm_python.Chart.load(CHART) as chart:
        return chart.render(values, name=release, namespace=NAMESPACE)


def _documents(manifests: dict[str, str]) -> Iterator[dict[str, Any]]:
    for path, text in sorted(manifests.items()):
        if path.endswith(".yaml"):
            yield from (doc for doc in yaml.safe_load_all(text) if doc)


def render(
    values: dict[str, Any] | None = None, *, release: str = RELEASE, required: bool = True
) -> Rendered:
    """The chart rendered with ``values`` (over :data:`REQUIRED` unless ``required`` is false),
    every object validated."""
    given = merge(REQUIRED, values or {}) if required else values
    manifests = _load(given, release)
    objects = list(_documents(manifests))
    for obj in objects:
        validate(obj)
    return Rendered(objects, manifests.get("mmserver/templates/NOTES.txt", ""))


def refusal(values: dict[str, Any] | None = None, *, required: bool = True) -> str:
    """The message of the render the chart refuses with ``values``."""
    given = merge(REQUIRED, values or {}) if required else values
    try:
        _load(given, RELEASE)
    except helm_python.HelmError as exc:
        return str(exc)
    raise AssertionError(f"the chart rendered {given}")
