"""berth's alert rules (deploy/prometheus/berth-rules.yml): valid for Prometheus, each with its runbook,
over metrics berth exports, and each proven by `promtool test rules` to fire on its failing series and to
stay quiet on a healthy one (deploy/prometheus/tests/). CI installs Debian's `prometheus`, which ships
promtool."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.support.exported_metrics import exported_metric_names, metric_names_in

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS = ROOT / "deploy" / "prometheus"
RULES = PROMETHEUS / "berth-rules.yml"
UNIT_TESTS = sorted((PROMETHEUS / "tests").glob("*.yml"))
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed (Debian: apt-get install "
                                    "prometheus; the README's test command installs it)")


def _alerts() -> list[dict]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if "alert" in r]


def test_each_alert_says_what_it_means_and_what_to_do_over_metrics_berth_exports():
    exported = exported_metric_names()
    alerts = _alerts()
    assert {a["alert"] for a in alerts} >= {
        "BerthKVMemoryPressure", "BerthWorkerCrashLooping", "BerthJobWillMissWindow", "BerthThroughputDropped",
        "BerthQueueStalled", "BerthWebhooksBackingUp", "BerthDatabaseUnreachable", "BerthBrokerUnreachable",
        "BerthTenantAtBudget"}
    for alert in alerts:
        runbook, summary = alert["annotations"].get("runbook", ""), alert["annotations"].get("summary", "")
        assert runbook and "\n" not in runbook.strip() and summary, f"{alert['alert']}: a one-line runbook, a summary"
        read = metric_names_in(alert["expr"])
        assert read, f"{alert['alert']} reads no berth metric"
        assert read <= exported, f"{alert['alert']} reads metrics berth does not export: {sorted(read - exported)}"
        assert alert["labels"]["severity"] in ("info", "warning", "critical")


def test_each_alert_has_a_case_where_it_fires_and_one_where_it_stays_quiet():
    fires, quiet = set(), set()
    for path in UNIT_TESTS:
        spec = yaml.safe_load(path.read_text())
        assert [str((path.parent / f).resolve()) for f in spec["rule_files"]] == [str(RULES)]
        for case in spec["tests"]:
            for check in case.get("alert_rule_test", []):
                (fires if check.get("exp_alerts") else quiet).add(check["alertname"])
    names = {a["alert"] for a in _alerts()}
    assert names - fires == set(), f"alerts never shown to fire: {sorted(names - fires)}"
    assert names - quiet == set(), f"alerts never shown to stay quiet: {sorted(names - quiet)}"


@needs_promtool
def test_promtool_accepts_the_rules_and_their_unit_tests_pass():
    checked = subprocess.run([PROMTOOL, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(_alerts())} rules found" in checked.stdout
    tested = subprocess.run([PROMTOOL, "test", "rules", *map(str, UNIT_TESTS)], capture_output=True, text=True,
                            timeout=120, cwd=PROMETHEUS / "tests")
    assert tested.returncode == 0, tested.stdout + tested.stderr


@needs_promtool
def test_a_rule_that_cannot_fire_fails_its_unit_test(tmp_path):
    """The unit tests bite: the same tests against rules whose broker alert can no longer fire fail."""
    (tmp_path / "tests").mkdir()
    broken = RULES.read_text().replace("expr: berth_broker_up == 0", "expr: berth_broker_up == 2")
    assert broken != RULES.read_text()
    (tmp_path / RULES.name).write_text(broken)
    for path in UNIT_TESTS:
        shutil.copy(path, tmp_path / "tests" / path.name)
    tested = subprocess.run([PROMTOOL, "test", "rules", *(p.name for p in UNIT_TESTS)], capture_output=True,
                            text=True, timeout=120, cwd=tmp_path / "tests")
    assert tested.returncode != 0 and "BerthBrokerUnreachable" in tested.stdout + tested.stderr
