"""Level 0: mount/kubernetes/bmfs.yaml against Kubernetes' own schemas (kubernetes-validate,
offline: the schemas ship in the package), and what a cluster admin expects of it:
a Namespace, a PriorityClass, tolerations, resources, probes on ports that exist, the
metrics port, the cluster secret read from a Secret and never written to a machine.
tests/test_t8_deploy.py runs the containers' commands."""
import copy
import os

import pytest
import yaml

import kubernetes_validate  # (a test dependency: pyproject.toml)
from kubernetes_validate import ValidationError

KUBE = os.path.join(os.path.dirname(__file__), "..", "mount", "kubernetes", "bmfs.yaml")
# the oldest Kubernetes still supported upstream when the manifests were written, and
# the newest the validator knows: fields only in newer releases fail the first
VERSIONS = ("1.29.0", kubernetes_validate.utils.latest_version())


def load() -> list[dict]:
    with open(KUBE) as f:
        return [d for d in yaml.safe_load_all(f) if d]


def validate(docs: list[dict]) -> None:
    """Every object against its kind's schema, strict (unknown fields fail).

    Raises:
        ValidationError: the first object that does not conform.
    """
    for version in VERSIONS:
        for doc in docs:
            kubernetes_validate.validate(doc, version, strict=True)


def by_kind(docs, kind):
    return [d for d in docs if d["kind"] == kind]


def test_the_manifests_conform_to_the_kubernetes_schemas():
    docs = load()
    assert {d["kind"] for d in docs} == {"Namespace", "PriorityClass", "ConfigMap",
                                         "DaemonSet"}
    validate(docs)


def _daemonset(docs, name):
    return [d for d in by_kind(docs, "DaemonSet") if d["metadata"]["name"] == name][0]


@pytest.mark.parametrize("breakage", [
    "a misspelled field", "a port that is not a number", "a container without a name",
    "a toleration with an unknown operator field", "a resource quantity that is not one"])
def test_a_broken_manifest_fails_validation(breakage):
    docs = copy.deepcopy(load())
    pod = _daemonset(docs, "bmfs-node")["spec"]["template"]["spec"]
    c = pod["containers"][0]
    if breakage == "a misspelled field":
        c["volumeMount"] = c.pop("volumeMounts")
    elif breakage == "a port that is not a number":
        c["ports"][0]["containerPort"] = "seven thousand"
    elif breakage == "a container without a name":
        del c["name"]
    elif breakage == "a toleration with an unknown operator field":
        pod["tolerations"][0]["opertor"] = pod["tolerations"][0].pop("operator")
    else:
        c["resources"]["requests"]["memory"] = {"GiB": 1}
    with pytest.raises(ValidationError):
        validate(docs)


def test_what_a_cluster_admin_expects():
    docs = load()
    (ns,) = by_kind(docs, "Namespace")
    (prio,) = by_kind(docs, "PriorityClass")
    for d in docs:
        if d["kind"] not in ("Namespace", "PriorityClass"):  # (cluster-wide kinds)
            assert d["metadata"]["namespace"] == ns["metadata"]["name"], d["metadata"]
    for name, metrics_port in (("bmfs-node", 9101), ("bmfs-mount", 9100)):
        pod = _daemonset(docs, name)["spec"]["template"]["spec"]
        assert pod["priorityClassName"] == prio["metadata"]["name"]
        assert {"operator": "Exists"} in pod["tolerations"]  # GPU machines are tainted
        (c,) = pod["containers"]
        assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]
        assert c["resources"]["limits"]["memory"]
        ports = {p["name"]: p for p in c["ports"]}
        assert ports["metrics"]["containerPort"] == metrics_port
        for p in ports.values():  # host networking: the host's port is the container's
            assert pod["hostNetwork"] and p["hostPort"] == p["containerPort"]
        command = " ".join(c["command"])
        assert f"--metrics $(NODE_IP):{metrics_port}" in command
        assert "readinessProbe" in c
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            port = c.get(probe, {}).get("httpGet", {}).get("port")
            assert port is None or port in ports, f"{name} {probe}: no port {port}"
        # the cluster secret comes from the Secret, read where Kubernetes put it
        secrets = [v for v in pod["volumes"] if "secret" in v]
        assert [v["secret"]["secretName"] for v in secrets] == ["bmfs-volume"]
        assert secrets[0]["secret"]["defaultMode"] == 0o400
    mount = _daemonset(docs, "bmfs-mount")["spec"]["template"]["spec"]["containers"][0]
    assert "livenessProbe" not in mount  # (a restart would unmount under every reader)
    assert "cp /etc/bmfs/volume-secret/secret" not in " ".join(mount["command"])
