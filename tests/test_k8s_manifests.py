"""deploy/k8s: every overlay renders with `kubectl kustomize` and every object is valid for a
current Kubernetes version (kubernetes-validate, strict: unknown fields are errors); the probes
point at real health (the API's livez/readyz, the workers' stream-consumer liveness through
`stack.probe`), checked here against the running stack."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir())
KUBERNETES = "1.33.0"  # a current release (kubernetes-validate knows up to its own version)


def render(overlay: str) -> list[dict]:
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl is needed to render deploy/k8s (kubectl kustomize)"
    credentials = K8S / "overlays" / overlay / "credentials.sh"
    if credentials.exists():  # an overlay that makes its own credentials, as its users run it first
        subprocess.run(["sh", str(credentials)], check=True, capture_output=True, timeout=60)
    out = subprocess.run([kubectl, "kustomize", str(K8S / "overlays" / overlay)], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    return [d for d in yaml.safe_load_all(out) if d]


@pytest.fixture(scope="module", params=OVERLAYS)
def objects(request):
    return request.param, render(request.param)


def _pods(objs):
    for o in objs:
        if o["kind"] in ("Deployment", "StatefulSet", "Job"):
            yield o, o["spec"]["template"]["spec"]


def test_the_gang_overlay_gives_each_gang_pod_the_gpus_its_ranks_use():
    objs = render("gpu-gang")
    config = next(o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "quilt-config")["data"]
    ranks, tensor_parallel = int(config["QUILT_TRAINER_RANKS"]), int(config["QUILT_GEN_TENSOR_PARALLEL"])
    sets = {o["metadata"]["name"]: o["spec"] for o in objs if o["kind"] == "StatefulSet"}
    trainer = sets["quilt-trainer"]["template"]["spec"]["containers"][0]
    assert trainer["command"][:3] == ["python", "-m", "torch.distributed.run"]
    assert trainer["command"][trainer["command"].index("--nproc-per-node") + 1] == str(ranks)
    assert trainer["resources"]["limits"]["nvidia.com/gpu"] == str(ranks)
    gen = sets["quilt-gen"]["template"]["spec"]["containers"][0]
    assert gen["resources"]["limits"]["nvidia.com/gpu"] == str(tensor_parallel)
    for spec in (sets["quilt-trainer"], sets["quilt-gen"]):
        mounts = {m["mountPath"] for m in spec["template"]["spec"]["containers"][0]["volumeMounts"]}
        assert "/dev/shm" in mounts


def test_the_two_node_gang_overlay_starts_its_pods_together_under_one_name():
    objs = render("gpu-gang-nodes")
    config = next(o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "quilt-config")["data"]
    trainer = next(o for o in objs if o["kind"] == "StatefulSet" and o["metadata"]["name"] == "quilt-trainer")["spec"]
    container = trainer["template"]["spec"]["containers"][0]
    command = container["command"]
    nodes, per_node = (int(command[command.index(flag) + 1]) for flag in ("--nnodes", "--nproc-per-node"))
    assert trainer["replicas"] == nodes and nodes * per_node == int(config["QUILT_TRAINER_RANKS"])
    assert container["resources"]["limits"]["nvidia.com/gpu"] == str(per_node)
    assert trainer["podManagementPolicy"] == "Parallel"  # pod 0 is not ready before the whole gang is
    assert command[command.index("--rdzv-endpoint") + 1].startswith(f"quilt-trainer-0.{trainer['serviceName']}:")
    names = {e["name"]: e.get("value") for e in container["env"]}
    assert names["QUILT_TRAINER_CONSUMER_NAME"] == "quilt-trainer-gang"  # every pod's probe judges the gang
    gang = next(o for o in objs
                if o["kind"] == "NetworkPolicy" and o["metadata"]["name"] == "quilt-trainer-gang-ingress")
    trainers = {"app.kubernetes.io/component": "trainer"}
    assert gang["spec"]["podSelector"]["matchLabels"] == trainers
    assert gang["spec"]["ingress"] == [{"from": [{"podSelector": {"matchLabels": trainers}}]}]


def test_every_object_is_valid_kubernetes(objects):
    _, objs = objects
    assert len(objs) >= 12
    for o in objs:
        kubernetes_validate.validate(o, KUBERNETES, strict=True)


def test_every_container_has_resources_and_the_long_running_ones_probes(objects):
    overlay, objs = objects
    for o, pod in _pods(objs):
        for c in pod["containers"]:
            where = f"{overlay}: {o['kind']}/{o['metadata']['name']}/{c['name']}"
            assert c["resources"]["requests"] and c["resources"]["limits"]["memory"], where
            if o["kind"] != "Job" and o["metadata"]["name"] != "quilt-celery-beat":
                assert "livenessProbe" in c, where
    by_name = {o["metadata"]["name"]: o for o in objs if o["kind"] in ("Deployment", "StatefulSet")}
    api = by_name["quilt-api"]["spec"]["template"]["spec"]["containers"][0]
    assert (api["livenessProbe"]["httpGet"]["path"], api["readinessProbe"]["httpGet"]["path"]) == \
        ("/api/v1/livez", "/api/v1/readyz")
    for name, kind in (("quilt-trainer", "trainer"), ("quilt-gen", "gen")):
        c = by_name[name]["spec"]["template"]["spec"]["containers"][0]
        assert c["livenessProbe"]["exec"]["command"] == ["python", "-m", "stack.probe", kind]
        assert "startupProbe" in c, name
    beat = by_name["quilt-celery-beat"]["spec"]
    assert beat["replicas"] == 1 and beat["strategy"]["type"] == "Recreate"
    assert {o["kind"] for o in objs} >= {"PodDisruptionBudget", "Job", "ConfigMap", "PersistentVolumeClaim"}
    images = {c["image"] for _, pod in _pods(objs) for c in pod["containers"]} - {"postgres:16", "redis:7"}
    image = overlay.split("-", 1)[0]  # an overlay over another (gpu-gang over gpu) runs that one's image
    assert images == {f"quilt:{image}"}, images
    assert f"-t quilt:{image}" in (ROOT / "deploy" / "Dockerfile").read_text()


def test_the_gpu_overlay_puts_workers_on_gpus_and_scales_the_api():
    objs = {(o["kind"], o["metadata"]["name"]): o for o in render("gpu")}
    for key in (("StatefulSet", "quilt-trainer"), ("StatefulSet", "quilt-gen")):
        pod = objs[key]["spec"]["template"]["spec"]
        assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1", key
        assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}, key
    hpa = objs[("HorizontalPodAutoscaler", "quilt-api")]["spec"]
    assert hpa["scaleTargetRef"]["name"] == "quilt-api" and hpa["minReplicas"] >= 2
    config = objs[("ConfigMap", "quilt-config")]["data"]
    assert config["QUILT_TRAINER_DEVICE"] == "cuda" and config["QUILT_TRAINER_SHARES_DEVICE"] == "false"
    # Pod quilt-gen-<i> is replica gen-<i>: the API routes among as many as the StatefulSet runs.
    assert int(config["QUILT_GEN_REPLICAS"]) == objs[("StatefulSet", "quilt-gen")]["spec"]["replicas"] == 2
    # Likewise pod quilt-trainer-<i> is shard-<i>, restoring its peers' models from the bucket.
    assert int(config["QUILT_TRAINER_SHARDS"]) == objs[("StatefulSet", "quilt-trainer")]["spec"]["replicas"] == 2
    assert config["QUILT_TRAINER_SNAPSHOTS_IN_STORE"] == "true" and config["QUILT_CHECKPOINT_STORE"] == "s3"
    assert ("Secret", "quilt-secrets") not in objs  # production secrets are the operator's, never in git


def test_probes_answer_from_real_health(stack):
    from stack.ephemeral import TINY

    with stack.http(None) as c:
        assert c.get("/livez").status_code == 200
        ready = c.get("/readyz")
        assert ready.status_code == 200 and ready.json()["checks"]["postgres"]["ok"]
    env = {**os.environ, "QUILT_REDIS_URL": stack.redis_url, "QUILT_DATABASE_URL": stack.database_url,
           "QUILT_TRAINER_BASE_MODEL": TINY, "QUILT_GEN_BASE_MODEL": TINY}

    def probe(kind: str, consumer: str) -> subprocess.CompletedProcess:
        var = "QUILT_TRAINER_CONSUMER_NAME" if kind == "trainer" else "QUILT_GEN_CONSUMER_NAME"
        return subprocess.run([sys.executable, "-m", "stack.probe", kind], cwd=ROOT, capture_output=True, text=True,
                              timeout=60, env={**env, var: consumer})

    for kind, consumer in (("trainer", "trainer-0"), ("gen", "gen-0")):  # the launcher's names
        alive = probe(kind, consumer)
        assert alive.returncode == 0 and "alive" in alive.stdout, alive.stdout + alive.stderr
    dead = probe("trainer", "trainer-that-never-ran")
    assert dead.returncode == 1 and "no liveness key" in dead.stdout
    # With routed replicas a pod is its name's ordinal: quilt-gen-5 of 2 is none of them.
    env["QUILT_GEN_REPLICAS"] = "2"
    misnamed = probe("gen", "quilt-gen-5")
    assert misnamed.returncode == 1 and "must end in -0 ... -1" in misnamed.stdout, misnamed.stdout


def test_the_scaler_may_only_read_and_set_the_worker_statefulsets_replicas(objects):
    overlay, objs = objects
    by = {(o["kind"], o["metadata"]["name"]): o for o in objs}
    celery = by[("Deployment", "quilt-celery")]["spec"]["template"]["spec"]
    assert celery["serviceAccountName"] == "quilt-scaler", overlay
    binding = by[("RoleBinding", "quilt-scaler")]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "quilt-scaler",
                                    "namespace": binding["metadata"]["namespace"]}]
    role = by[(binding["roleRef"]["kind"], binding["roleRef"]["name"])]
    assert role["kind"] == "Role"  # this namespace only
    assert role["rules"] == [{"apiGroups": ["apps"], "resources": ["statefulsets/scale"],
                              "resourceNames": ["quilt-gen", "quilt-trainer"], "verbs": ["get", "patch"]}]
    assert {("StatefulSet", "quilt-gen"), ("StatefulSet", "quilt-trainer")} <= set(by)
    config = by[("ConfigMap", "quilt-config")]["data"]
    assert config["QUILT_SCALER_ACT"] == "false"  # off unless an operator turns it on


def test_nobody_but_the_api_and_quilts_processes_is_reached(objects):
    """NetworkPolicies: ingress denied to every pod of the namespace but the API's port; in the CPU
    overlay the in-cluster stores take connections from Quilt's processes only."""
    overlay, objs = objects
    policies = {o["metadata"]["name"]: o["spec"] for o in objs if o["kind"] == "NetworkPolicy"}
    deny = policies["quilt-default-deny-ingress"]
    assert deny["podSelector"] == {} and deny["policyTypes"] == ["Ingress"] and "ingress" not in deny
    api = policies["quilt-api-ingress"]
    assert api["podSelector"]["matchLabels"] == {"app.kubernetes.io/component": "api"}
    assert api["ingress"] == [{"ports": [{"port": 8000, "protocol": "TCP"}]}]
    components = {pod_o["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]
                  for pod_o, _ in _pods(objs)}
    if overlay == "cpu":
        stores = policies["quilt-stores-ingress"]
        allowed = set(stores["ingress"][0]["from"][0]["podSelector"]["matchExpressions"][0]["values"])
        assert allowed == components - {"postgres", "redis"}, allowed


def test_the_cpu_overlay_ships_no_credentials_and_redis_asks_for_one():
    """Its passwords and secret key are made at random by credentials.sh (git ignores the file),
    never written in the manifests; Redis starts with --requirepass."""
    text = "\n".join(p.read_text() for p in (K8S / "overlays" / "cpu").glob("*.yaml"))
    assert "quilt:quilt@" not in text and "change-me" not in text and "POSTGRES_PASSWORD, value:" not in text
    objs = {(o["kind"], o["metadata"]["name"]): o for o in render("cpu")}
    secret = objs[("Secret", "quilt-secrets")]["data"]
    assert {"POSTGRES_PASSWORD", "REDIS_PASSWORD", "QUILT_DATABASE_URL", "QUILT_REDIS_URL",
            "QUILT_SECRET_KEY"} <= set(secret)
    redis = objs[("StatefulSet", "quilt-redis")]["spec"]["template"]["spec"]["containers"][0]
    assert "--requirepass" in redis["command"][-1]
    ignored = subprocess.run(["git", "check-ignore", "deploy/k8s/overlays/cpu/credentials.env"], cwd=ROOT,
                             capture_output=True, text=True)
    assert ignored.returncode == 0
