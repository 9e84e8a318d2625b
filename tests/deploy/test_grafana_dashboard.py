"""berth's Grafana dashboard (deploy/grafana/berth.json): every panel queries metrics berth exports
(a panel over a metric nobody exports stays empty, silently), the topics an operator needs are there,
every query is PromQL Prometheus accepts, and the panels name the datasource Grafana is provisioned with."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.support.dashboard import grafana_variables, panels, queries, with_variables
from tests.support.exported_metrics import exported_metric_names, metric_names_in

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "deploy" / "grafana"


def test_every_panel_queries_only_metrics_berth_exports():
    exported = exported_metric_names()
    for panel in panels():
        assert panel["targets"], f"panel {panel['title']!r} has no query"
    for title, expr in queries():
        read = metric_names_in(expr)
        assert read, f"panel {title!r} reads no berth metric: {expr}"
        assert read <= exported, f"panel {title!r} reads metrics berth does not export: {sorted(read - exported)}"


def test_the_dashboard_covers_what_an_operator_watches():
    read = set().union(*(metric_names_in(expr) for _, expr in queries()))
    wanted = {
        "throughput, effective and computed": {"berth_output_tokens_total", "berth_computed_tokens_total"},
        "KV use": {"berth_kv_blocks_used", "berth_kv_blocks_free", "berth_preemptions_total"},
        "queue depth": {"berth_queue_depth"},
        "per-tenant and per-class token shares": {"berth_tenant_output_tokens_total", "berth_computed_tokens_total"},
        "checkpoint lag and writes": {"berth_checkpoint_lag_seconds", "berth_checkpoint_bytes_total"},
        "jobs by state and their deadlines": {"berth_jobs", "berth_job_deadline_timestamp_seconds"},
        "interactive rate limits": {"berth_interactive_rate_limited_total",
                                    "berth_tenant_interactive_tokens_last_minute"},
    }
    for topic, names in wanted.items():
        assert names <= read, f"no panel on {topic}: {sorted(names - read)}"


def test_panels_use_the_provisioned_prometheus_datasource():
    [source] = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "berth.yml").read_text())["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    for panel in panels():
        for target in (panel, *panel["targets"]):
            assert target["datasource"] == {"type": "prometheus", "uid": source["uid"]}, panel["title"]


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed (Debian: apt-get install "
                    "prometheus; the README's test command installs it)")
def test_every_panel_query_is_valid_promql(tmp_path):
    """promtool parses each query as a recording rule's expression (Grafana's variables as it fills them)."""
    rules = [{"record": f"berth_panel_{i}", "expr": with_variables(expr, grafana_variables())}
             for i, (_, expr) in enumerate(queries())]
    path = tmp_path / "panels.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "panels", "rules": rules}]}))
    checked = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr
