"""deploy/kubernetes/: the CPU fleet (cpu/) and a GPU pool beside it (gpu/) render, and every object
validates offline against the Kubernetes schemas (kubernetes-validate bundles them). KEDA's
ScaledObject and TriggerAuthentication are custom resources it has no schema for: their shape is
checked here, against berth's own queue names and the objects they point at."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.support.kustomize import render
from worker.config import Settings
from worker.messaging.topology import Topology

ROOT = Path(__file__).resolve().parents[2]
KUBERNETES = ROOT / "deploy" / "kubernetes"
kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install -e '.[test]' installs it")


def _by_kind(objects: list[dict], kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


@pytest.fixture(scope="module")
def cpu() -> list[dict]:
    return render(KUBERNETES / "cpu")


@pytest.fixture(scope="module")
def gpu() -> list[dict]:
    return render(KUBERNETES / "gpu")


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed: the test's own renderer alone")
@pytest.mark.parametrize("overlay", ["cpu", "gpu"])
def test_kubectl_kustomize_renders_what_the_test_renders(overlay):
    out = subprocess.run(["kubectl", "kustomize", str(KUBERNETES / overlay)], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    key = lambda o: (o["kind"], o["metadata"]["name"])  # noqa: E731
    assert sorted(yaml.safe_load_all(out), key=key) == sorted(render(KUBERNETES / overlay), key=key)


def test_every_object_validates_against_the_kubernetes_schemas(cpu, gpu):
    version = kubernetes_validate.latest_version()
    custom = []
    for obj in cpu + gpu:
        if obj["apiVersion"].startswith("keda.sh/"):
            custom.append(obj)
            continue
        kubernetes_validate.validate(obj, version, strict=True)  # raises on an unknown or misplaced field
    assert {o["kind"] for o in custom} == {"ScaledObject", "TriggerAuthentication"}


def test_the_cpu_fleet_has_every_part_wired_to_its_settings(cpu):
    deployments = _by_kind(cpu, "Deployment")
    assert set(deployments) == {"engine-worker", "berth-serve", "berth-celery", "berth-submit-consumer"}
    [migrate] = _by_kind(cpu, "Job").values()
    assert migrate["spec"]["template"]["spec"]["containers"][0]["command"] == ["berth", "db", "upgrade"]
    assert _by_kind(cpu, "Service")["berth-serve"]["spec"]["selector"] == \
        deployments["berth-serve"]["spec"]["selector"]["matchLabels"]
    [config] = _by_kind(cpu, "ConfigMap").values()
    fields = {f"BERTH_{name.upper()}" for name in Settings.model_fields}
    assert {k for k in config["data"] if k.startswith("BERTH_")} <= fields, "a BERTH_ variable berth does not read"
    assert "Secret" not in {o["kind"] for o in cpu}, "secrets are created by the operator, never kept in the repo"
    for obj in (*deployments.values(), migrate):
        [container] = obj["spec"]["template"]["spec"]["containers"]
        assert container["envFrom"] == [{"configMapRef": {"name": config["metadata"]["name"]}},
                                        {"secretRef": {"name": "berth-secrets"}}], obj["metadata"]["name"]
    assert deployments["berth-celery"]["spec"]["replicas"] == 1, "one beat"
    worker = deployments["engine-worker"]
    assert "replicas" not in worker["spec"], "KEDA owns the engine workers' count"
    drain = float(config["data"].get("BERTH_DRAIN_TIMEOUT", Settings().drain_timeout))
    assert worker["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > drain, \
        "a worker killed before its drain ends loses its running requests' last steps"
    [pdb] = _by_kind(cpu, "PodDisruptionBudget").values()
    assert pdb["spec"]["selector"] == worker["spec"]["selector"] and pdb["spec"]["maxUnavailable"] == 1


def test_keda_scales_each_pool_on_berths_request_queues(cpu, gpu):
    [config] = _by_kind(cpu, "ConfigMap").values()
    topology = Topology(config["data"]["BERTH_QUEUE_PREFIX"])
    auth = _by_kind(cpu, "TriggerAuthentication")
    for objects, pool in ((cpu, "engine-worker"), (gpu, "engine-worker-gpu")):
        scaled = _by_kind(objects, "ScaledObject")[pool]["spec"]
        assert scaled["scaleTargetRef"]["name"] == pool and pool in _by_kind(objects, "Deployment")
        assert 0 <= scaled["minReplicaCount"] <= scaled["maxReplicaCount"]
        [trigger] = scaled["triggers"]
        meta = trigger["metadata"]
        assert trigger["type"] == "rabbitmq" and meta["protocol"] == "http" and meta["mode"] == "QueueLength"
        assert meta["useRegex"] == "true" and meta["operation"] == "sum" and int(meta["value"]) > 0
        queues = re.compile(meta["queueName"])
        assert queues.fullmatch(topology.request_queue("SmolLM2-135M-Instruct", "acme").name)
        for other in (topology.jobs_queue.name, topology.dead_queue.name, topology.celery_queue):
            assert not queues.fullmatch(other), f"{other} is no engine worker's work"
        [ref] = auth[trigger["authenticationRef"]["name"]]["spec"]["secretTargetRef"]
        assert ref["parameter"] == "host" and ref["name"] == "berth-secrets"


def test_the_gpu_overlay_adds_a_gpu_pool_beside_the_cpu_fleet(cpu, gpu):
    names = lambda objects: {(o["kind"], o["metadata"]["name"]) for o in objects}  # noqa: E731
    assert not names(cpu) & names(gpu), "applying gpu/ would replace part of the CPU fleet"
    worker = _by_kind(gpu, "Deployment")["engine-worker-gpu"]
    pod = worker["spec"]["template"]["spec"]
    [container] = pod["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert pod["nodeSelector"] and any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])
    assert {"name": "BERTH_DEVICE", "value": "cuda"} in container["env"]
    cpu_worker = _by_kind(cpu, "Deployment")["engine-worker"]
    labels = worker["spec"]["template"]["metadata"]["labels"]
    assert worker["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert not cpu_worker["spec"]["selector"]["matchLabels"].items() <= labels.items(), \
        "the CPU pool's selector would take the GPU pool's pods"
    [pdb] = _by_kind(gpu, "PodDisruptionBudget").values()
    assert pdb["spec"]["selector"] == worker["spec"]["selector"]
