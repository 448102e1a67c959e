"""The Prometheus rules shipped in deploy/ (docs/operations.md, *Alerts*): valid for Prometheus,
and their promtool unit tests pass; a rule made wrong makes those tests fail, so they test."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"


def _promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        if os.environ.get("CI"):
            raise AssertionError("promtool is missing: scripts/test installs it (prometheus)")
        pytest.skip("promtool is not installed (Debian's prometheus package; scripts/test)")
    return found


def _run(*args: str, cwd: Path = DEPLOY) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [_promtool(), *args], cwd=cwd, capture_output=True, text=True, timeout=120
    )


def test_the_rules_are_valid_and_their_unit_tests_pass() -> None:
    checked = _run("check", "rules", "mmserver-rules.yml")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS: 11 rules found" in checked.stdout
    tested = _run("test", "rules", "rules-test.yml")
    assert tested.returncode == 0, tested.stdout + tested.stderr
    assert "SUCCESS" in tested.stdout


@pytest.mark.parametrize(
    ("right", "wrong", "failing"),
    [
        # A threshold that lets 0.5% of 503s page.
        ("> 0.01\n", "> 0.001\n", "MMServerQueueSaturated"),
        # An eviction churn alert that forgets the loads.
        ("> 1)\n            and", "> -1)\n            or", "MMServerEvictionChurn"),
        # A budget ratio that leaves out what the backends hold beyond their models.
        ("+ sum by (instance) (mmserver_backend_unaccounted_bytes)", "+ 0", "MMServerMemoryBudget"),
    ],
)
def test_a_wrong_rule_fails_its_tests(tmp_path: Path, right: str, wrong: str, failing: str) -> None:
    rules = (DEPLOY / "mmserver-rules.yml").read_text()
    assert rules.count(right) >= 1, right
    (tmp_path / "mmserver-rules.yml").write_text(rules.replace(right, wrong, 1))
    shutil.copy(DEPLOY / "rules-test.yml", tmp_path / "rules-test.yml")
    tested = _run("test", "rules", "rules-test.yml", cwd=tmp_path)
    assert tested.returncode != 0
    assert failing in tested.stdout + tested.stderr
