"""The chart's pages and the README's example stay true: each ``helm install`` they show
renders with its ``--set`` values (Helm's own parsing of them), and docs/kubernetes.md's values
table names every value of ``values.yaml`` with its default."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

import helm_python
import pytest
import yaml

from tests.integration.helmchart import CHART, NAMESPACE, ROOT, merge, render

PAGES = [ROOT / "README.md", ROOT / "docs" / "kubernetes.md", CHART / "README.md"]
TABLE_ROW = re.compile(r"^\| (`[^|]+`) \| ([^|]*) \|", re.M)


def helm_commands(page: Path) -> list[list[str]]:
    """The ``helm install`` and ``helm upgrade`` commands of the page's shell blocks, as
    arguments (continued lines joined)."""
    blocks = re.findall(r"```sh\n(.*?)```", page.read_text(), re.S)
    commands = []
    for block in blocks:
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line)
            if words[:2] in (["helm", "install"], ["helm", "upgrade"]):
                commands.append(words)
    return commands


def install_values(words: list[str]) -> tuple[str, str, dict[str, Any]]:
    """(release, namespace, values) of a ``helm install RELEASE CHART --set ...`` command."""
    release, chart, *options = words[2:]
    assert (ROOT / chart).resolve() == CHART
    values: dict[str, Any] = {}
    namespace = "default"
    for flag, value in zip(options[::2], options[1::2], strict=True):
        if flag == "--set":
            values = merge(values, helm_python.parse_set_string(value))
        elif flag == "--namespace":
            namespace = value
        else:
            raise AssertionError(f"a flag the test does not read: {flag}")
    return release, namespace, values


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_each_install_command_renders(page: Path) -> None:
    commands = helm_commands(page)
    assert commands, f"no helm install in {page}"
    for words in commands:
        release, namespace, values = install_values(words)
        assert namespace == NAMESPACE
        rendered = render(values, release=release, required=False)
        assert rendered.all("StatefulSet"), words


def leaf_values(schema: dict[str, Any], prefix: str = "") -> list[str]:
    """The dotted names of values.schema.json's leaves (a map the chart passes on whole, such as
    ``resources``, is one)."""
    leaves = []
    for name, sub in schema.get("properties", {}).items():
        path = f"{prefix}{name}"
        if "properties" in sub:
            leaves += leaf_values(sub, f"{path}.")
        elif path != "global":
            leaves.append(path)
    return leaves


def default(values: dict[str, Any], path: str) -> Any:
    node: Any = values
    for part in path.split("."):
        node = node[part]
    return node


def table() -> list[tuple[list[str], list[str] | None]]:
    """docs/kubernetes.md's values table: the names of each row, and its defaults when they
    are written as values (each in backquotes)."""
    text = (ROOT / "docs" / "kubernetes.md").read_text().split("## Values", 1)[1]
    rows = []
    for names, defaults in TABLE_ROW.findall(text.split("\n## ", 1)[0]):
        keys = re.findall(r"`([^`]+)`", names)
        given = [d.strip() for d in defaults.split(", ")]
        quoted = all(re.fullmatch(r"`[^`]*`", d) for d in given) and len(given) == len(keys)
        rows.append((keys, [d[1:-1] for d in given] if quoted else None))
    return rows


def test_the_values_table_names_every_value_with_its_default() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    rows = table()
    named = {key for keys, _ in rows for key in keys}
    # Each value named, itself or a map holding it (probes.readiness holds its timings).
    for leaf in leaf_values(schema):
        parts = leaf.split(".")
        assert any(".".join(parts[:n]) in named for n in range(1, len(parts) + 1)), leaf
    for key in named:
        default(values, key)
    checked = 0
    for keys, defaults in rows:
        for key, text in zip(keys, defaults or (), strict=False):
            expected = default(values, key)
            assert yaml.safe_load(text) == expected or text == expected, (key, text, expected)
            checked += 1
    assert checked >= 50, checked
