"""compose.yaml's Prometheus loads berth's alert rules and scrapes every engine worker and berth serve
where they serve their metrics; its Grafana is provisioned with berth's dashboard and that Prometheus;
both on 127.0.0.1 alone."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path, PurePosixPath

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def _services() -> dict:
    return yaml.safe_load(ROOT.joinpath("compose.yaml").read_text())["services"]


def _mounts(service: dict) -> dict[str, Path]:
    """Container path -> the repository file or folder bind-mounted there."""
    found = {}
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith("./"):
            found[target] = ROOT / source
    return found


def _inside(mounts: dict[str, Path], container_path: str) -> Path:
    """The repository file a container sees at ``container_path``, through a file or a folder mount."""
    for target, source in mounts.items():
        path = PurePosixPath(container_path)
        if path == PurePosixPath(target):
            return source
        if PurePosixPath(target) in path.parents:
            return source / path.relative_to(target)
    raise AssertionError(f"nothing of the repository is mounted at {container_path}")


def _metrics_port(service: dict) -> int:
    command, env = service["command"], service.get("environment", {})
    if "--metrics-port" in command:
        return int(command[command.index("--metrics-port") + 1])
    return int(env["BERTH_METRICS_PORT"])


def test_prometheus_loads_the_rules_and_scrapes_the_workers_and_berth_serve():
    services = _services()
    prometheus = services["prometheus"]
    mounts = _mounts(prometheus)
    [config_flag] = [a for a in prometheus["command"] if a.startswith("--config.file=")]
    config = yaml.safe_load(_inside(mounts, config_flag.split("=", 1)[1]).read_text())
    assert [_inside(mounts, f) for f in config["rule_files"]] == [ROOT / "deploy" / "prometheus" / "berth-rules.yml"]
    targets = {}
    for job in config["scrape_configs"]:
        for sd in job.get("dns_sd_configs", []):
            targets.update({name: sd["port"] for name in sd["names"]})
        for static in job.get("static_configs", []):
            targets.update(dict((t.split(":")[0], int(t.split(":")[1])) for t in static["targets"]))
    for name in ("engine-worker", "engine-worker-gpu", "serve"):
        service = services[name]
        assert targets.get(name) == _metrics_port(service), f"Prometheus does not scrape {name}'s metrics port"
        env, command = service.get("environment", {}), service["command"]
        host = (command[command.index("--metrics-host") + 1] if "--metrics-host" in command
                else env["BERTH_METRICS_HOST"])
        assert host == "0.0.0.0", f"{name} serves its metrics where Prometheus's container cannot reach them"
    assert prometheus["ports"] == ["127.0.0.1:9090:9090"]


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed (Debian: apt-get install "
                    "prometheus; the README's test command installs it)")
def test_promtool_accepts_the_compose_prometheus_config(tmp_path):
    config = yaml.safe_load(ROOT.joinpath("deploy", "prometheus", "prometheus.yml").read_text())
    config["rule_files"] = [str(ROOT / "deploy" / "prometheus" / "berth-rules.yml")]  # where compose mounts it
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    checked = subprocess.run(["promtool", "check", "config", str(tmp_path / "prometheus.yml")], capture_output=True,
                             text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_grafana_is_provisioned_with_the_dashboard_and_prometheus():
    services = _services()
    grafana = services["grafana"]
    mounts = _mounts(grafana)
    provisioning = _inside(mounts, "/etc/grafana/provisioning")
    [provider] = yaml.safe_load((provisioning / "dashboards" / "berth.yml").read_text())["providers"]
    assert provider["type"] == "file"
    assert _inside(mounts, provider["options"]["path"] + "/berth.json") == ROOT / "deploy" / "grafana" / "berth.json"
    [source] = yaml.safe_load((provisioning / "datasources" / "berth.yml").read_text())["datasources"]
    assert source["url"] == "http://prometheus:9090" and "prometheus" in services
    assert "prometheus" in grafana["depends_on"]
    assert grafana["ports"] == ["127.0.0.1:3000:3000"]
    assert grafana["environment"]["GF_SECURITY_ADMIN_PASSWORD"].startswith("${GRAFANA_ADMIN_PASSWORD:?")
