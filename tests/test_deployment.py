"""What a deployment exposes: compose.yaml publishes only what a user needs, on 127.0.0.1 alone,
with passwords from .env that compose refuses to run without; the worker's metrics page listens
on 127.0.0.1 unless told otherwise."""

from __future__ import annotations

import re
import socket
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.support.processes import free_port
from worker.config import Settings
from worker.metrics import WorkerMetrics

ROOT = Path(__file__).resolve().parent.parent
_VARIABLE = re.compile(r"\$\{([A-Z_][A-Z0-9_]*)(?::\?([^}]*))?\}")



def _compose() -> dict:
    return yaml.safe_load(ROOT.joinpath("compose.yaml").read_text())


def _env_example() -> dict[str, str]:
    lines = ROOT.joinpath(".env.example").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if line.strip() and not line.startswith("#"))


def _interpolate(text: str, env: dict[str, str]) -> str:
    """compose's ``${VAR:?message}``: the value, or an error with the message when unset or empty."""
    def value(m: re.Match) -> str:
        if not env.get(m.group(1)):
            raise LookupError(m.group(2) or f"{m.group(1)} is not set")
        return env[m.group(1)]

    return _VARIABLE.sub(value, text)


def test_compose_publishes_only_on_loopback_and_not_the_database_or_broker():
    services = _compose()["services"]
    published = {name: service.get("ports", []) for name, service in services.items()}
    for name, ports in published.items():
        for port in ports:
            assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port} beyond this machine"
    assert not published["postgres"] and not published["migrate"], "the database needs no published port"
    assert all(not str(p).endswith(":5672") for p in published["rabbitmq"]), "AMQP needs no published port"
    assert published["engine-worker"] == ["127.0.0.1:9100-9115:9100"]
    command = services["engine-worker"]["command"]
    assert command[command.index("--metrics-host") + 1] == "0.0.0.0", \
        "inside its container the worker must listen where the published port reaches it"


def test_compose_takes_every_password_from_env_and_refuses_to_start_without_one():
    text = ROOT.joinpath("compose.yaml").read_text()
    assert not re.search(r"(PASS(WORD)?|SECRET[A-Z_]*): *[\"']?[A-Za-z0-9-]+[\"']?$", text, re.M), \
        "a fixed password is left in compose.yaml"
    variables = {m.group(1): m.group(2) for m in _VARIABLE.finditer(text)}
    assert set(variables) == set(_env_example()) == {"POSTGRES_PASSWORD", "RABBITMQ_PASSWORD", "MINIO_ROOT_PASSWORD",
                                                                  "GRAFANA_ADMIN_PASSWORD"}
    assert all(f"set {name} in .env" in (message or "") for name, message in variables.items()), \
        "each variable needs ${VAR:?message}"
    assert all(not v.strip() for v in _env_example().values()), "the example must not hold usable passwords"
    env = {name: f"pw-{name.lower()}" for name in variables}
    resolved = yaml.safe_load(_interpolate(text, env))
    assert resolved["x-berth-env"]["BERTH_DATABASE_URL"] == \
        "postgresql+psycopg://berth:pw-postgres_password@postgres:5432/berth"
    assert resolved["services"]["postgres"]["environment"]["POSTGRES_PASSWORD"] == "pw-postgres_password"
    assert resolved["services"]["engine-worker"]["environment"]["BERTH_BROKER_URL"] == \
        "amqp://berth:pw-rabbitmq_password@rabbitmq:5672//"
    for name in variables:
        with pytest.raises(LookupError, match=f"set {name} in .env"):
            _interpolate(text, {**env, name: ""})
    ignored = ROOT.joinpath(".gitignore").read_text().splitlines()
    assert ".env" in ignored and ".env.example" not in ignored


def test_metrics_listen_on_loopback_unless_told_otherwise(monkeypatch):
    monkeypatch.delenv("BERTH_METRICS_HOST", raising=False)
    assert Settings().metrics_host == "127.0.0.1"
    monkeypatch.setenv("BERTH_METRICS_HOST", "0.0.0.0")
    assert Settings().metrics_host == "0.0.0.0"
    metrics = WorkerMetrics()
    port = free_port()
    metrics.serve(port)
    assert b"berth_output_tokens_total" in urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
    listening = [c for c in _listening_sockets() if c[1] == port]
    assert listening and all(addr == "127.0.0.1" for addr, _ in listening), listening


def _listening_sockets() -> list[tuple[str, int]]:
    """(address, port) of this machine's listening TCP sockets, from /proc/net/tcp{,6}."""
    found = []
    for name, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        path = Path("/proc/net", name)
        if not path.exists():
            pytest.skip("no /proc/net to read listening sockets from")
        for line in path.read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            if state != "0A":  # LISTEN
                continue
            addr, port = local.split(":")
            raw = bytes.fromhex(addr)
            if family == socket.AF_INET:
                raw = raw[::-1]
            else:  # four little-endian 32-bit words
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
            found.append((socket.inet_ntop(family, raw), int(port, 16)))
    return found


@pytest.mark.slow
def test_the_images_warm_up_leaves_a_checked_tokenizer_and_the_kernel_in_the_cache(tmp_path):
    """The Dockerfile derives, at build time, what a start would otherwise derive once (the
    tokenizer's conversion and check, the C kernel): its command must keep working as the code changes."""
    import json
    import os
    import subprocess
    import sys

    dockerfile = ROOT.joinpath("Dockerfile").read_text().replace("\\\n", "")
    [command] = [line.removeprefix("RUN ") for line in dockerfile.splitlines()
                 if line.startswith("RUN python -c") and "load_tokenizer" in line]
    code = command.removeprefix('python -c "').removesuffix('"')
    env = {**os.environ, "BERTH_CACHE_DIR": str(tmp_path)}
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, check=True, timeout=300)
    [entry] = (tmp_path / "tokenizers").iterdir()
    assert json.loads((entry / "berth-tokenizer.json").read_text())["verdict"] is None
    assert list((tmp_path / "kernels").glob("cpu_decode-*.so"))
    assert any(line.startswith("ENV ") and "BERTH_CACHE_DIR=" in line for line in dockerfile.splitlines()), \
        "the image must keep the cache it built where every container reads it"


def test_compose_runs_a_fleet_on_minio_over_s3():
    """Every berth container stores job files and checkpoints in MinIO's bucket over S3 (no shared
    volume), engine workers scale (one published metrics port each), and a GPU worker runs under a
    profile with the device reserved."""
    compose = _compose()
    services, env = compose["services"], compose["x-berth-env"]
    assert env["BERTH_STORAGE_URL"].startswith("s3://berth/") and env["AWS_ENDPOINT_URL"] == "http://minio:9000"
    init = " ".join(services["minio-init"]["entrypoint"])
    assert "mc mb --ignore-existing local/berth" in init, "the bucket the storage URL names is made"
    berth_services = [name for name, s in services.items() if s.get("environment") is env
                      or (isinstance(s.get("environment"), dict) and "BERTH_STORAGE_URL" in s["environment"])]
    assert {"engine-worker", "engine-worker-gpu", "celery-worker", "submit-consumer", "cli"} <= set(berth_services)
    for name in berth_services:
        assert not services[name].get("volumes"), f"{name} keeps state on a volume instead of the object store"
        if name != "migrate":
            assert services[name]["depends_on"]["minio-init"]["condition"] == "service_completed_successfully"
    assert "berth-store" not in compose["volumes"]
    # scaling: no fixed host port that a second replica would collide on
    low, high = services["engine-worker"]["ports"][0].split(":")[1].split("-")
    assert int(high) - int(low) >= 7
    gpu = services["engine-worker-gpu"]
    assert gpu["profiles"] == ["gpu"] and gpu["environment"]["BERTH_DEVICE"] == "cuda"
    device = gpu["deploy"]["resources"]["reservations"]["devices"][0]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    dockerfile = ROOT.joinpath(gpu["build"]["dockerfile"]).read_text()
    assert re.search(r"^FROM nvidia/cuda:\S+", dockerfile, re.M), "the GPU image starts from CUDA's runtime"
    pinned = re.search(r'"torch==([\d.]+)"', ROOT.joinpath("pyproject.toml").read_text()).group(1)
    assert f"pip install torch=={pinned}" in dockerfile and "'.[gpu]'" in dockerfile
    low_gpu = int(gpu["ports"][0].split(":")[1].split("-")[0])
    assert low_gpu > int(high), "the GPU workers' metrics ports do not overlap the CPU workers'"


def test_the_cpu_image_installs_the_cpu_build_of_torch():
    """PyPI's torch for Linux x86_64 is the CUDA build: the CPU image takes PyTorch's CPU index, at the
    version pyproject.toml pins; the GPU image takes PyPI's."""
    pinned = re.search(r'"torch==([0-9.]+)"', ROOT.joinpath("pyproject.toml").read_text()).group(1)
    cpu = [line for line in ROOT.joinpath("Dockerfile").read_text().splitlines() if "pip install torch" in line]
    assert cpu == [f"RUN pip install torch=={pinned} --index-url https://download.pytorch.org/whl/cpu"]
    gpu = [line for line in ROOT.joinpath("Dockerfile.gpu").read_text().splitlines() if "pip install torch" in line]
    assert gpu == [f"RUN pip install torch=={pinned}"]
