"""docker/kubernetes/shardtrain.yaml: valid for Kubernetes by its published schemas, and consistent with the
image and the services it runs (ports, probes, flags, user, metrics); docker/kubernetes/servicemonitor.yaml
scrapes the ports the manifest's Services publish."""

from __future__ import annotations

import functools
import pathlib
import re
import subprocess
import sys

import pytest

yaml = pytest.importorskip("yaml", reason="the dev extra installs PyYAML: pip install -e '.[dev]'")
kubernetes_validate = pytest.importorskip("kubernetes_validate",
                                          reason="the dev extra installs kubernetes-validate: pip install -e '.[dev]'")

ROOT = pathlib.Path(__file__).resolve().parents[1]
MANIFEST = ROOT / "docker" / "kubernetes" / "shardtrain.yaml"
SERVICE_MONITOR = ROOT / "docker" / "kubernetes" / "servicemonitor.yaml"
DOCKERFILE = ROOT / "docker" / "Dockerfile"
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")


@functools.cache
def resources() -> dict[str, dict]:
    """The manifest's objects, by "Kind/name"."""
    documents = [document for document in yaml.safe_load_all(MANIFEST.read_text()) if document]
    return {f"{document['kind']}/{document['metadata']['name']}": document for document in documents}


def containers() -> list[dict]:
    return [container for resource in resources().values() if "template" in resource.get("spec", {})
            for container in resource["spec"]["template"]["spec"]["containers"]]


@functools.cache
def help_text(command: str) -> str:
    """What `shardtrain COMMAND --help` prints: the flags the real command takes."""
    done = subprocess.run([sys.executable, "-m", "shardtrain.cli", command, "--help"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_the_manifest_holds_the_coordinator_and_the_shards():
    assert sorted(resources()) == ["Deployment/shardtrain-coordinator", "Secret/shardtrain-token",
                                   "Service/shardtrain-coordinator", "Service/shardtrain-shard",
                                   "StatefulSet/shardtrain-shard"]


@pytest.mark.parametrize("version", ["1.30.0", kubernetes_validate.latest_version()])
@pytest.mark.parametrize("name", sorted(resources()))
def test_every_object_is_valid_by_the_kubernetes_schema(name, version):
    # strict: a misspelt field is an error, not a field the API server would silently drop
    kubernetes_validate.validate(resources()[name], version, strict=True)


def test_the_schema_check_catches_a_misspelt_probe():
    shard = yaml.safe_load(yaml.safe_dump(resources()["StatefulSet/shardtrain-shard"]))
    shard["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"] = {"prot": 50052}
    with pytest.raises(kubernetes_validate.ValidationError, match="prot"):
        kubernetes_validate.validate(shard, "1.30.0", strict=True)


def test_every_probe_asks_grpc_health_on_a_port_its_container_serves():
    for container in containers():
        grpc = next(port["containerPort"] for port in container["ports"] if port["name"] == "grpc")
        probes = [container[name] for name in PROBES if name in container]
        assert {"readinessProbe", "livenessProbe"} <= container.keys(), container["name"]
        assert all(probe["grpc"]["port"] == grpc for probe in probes), (container["name"], grpc)
        assert f"0.0.0.0:{grpc}" in container["args"], "the service binds the port its probes ask"


def test_the_services_reach_the_ports_the_containers_serve_and_the_shards_the_coordinator():
    coordinator = resources()["Service/shardtrain-coordinator"]["spec"]
    shards = resources()["Service/shardtrain-shard"]["spec"]
    shard_set = resources()["StatefulSet/shardtrain-shard"]["spec"]
    assert shards["clusterIP"] == "None" and shard_set["serviceName"] == "shardtrain-shard"
    for service in (coordinator, shards):
        pods = [container for resource in resources().values() if "template" in resource.get("spec", {})
                and resource["spec"]["template"]["metadata"]["labels"] == service["selector"]
                for container in resource["spec"]["template"]["spec"]["containers"]]
        assert len(pods) == 1, service["selector"]
        assert [(port["port"], port["targetPort"]) for port in service["ports"]] == \
               [(port["containerPort"], port["name"]) for port in pods[0]["ports"]]
    shard = shard_set["template"]["spec"]["containers"][0]
    env = {item["name"]: item.get("value") for item in shard["env"]}
    assert env["SHARDTRAIN_COORDINATOR"] == f"shardtrain-coordinator:{coordinator['ports'][0]['port']}"
    advertised = shard["args"][shard["args"].index("--advertise") + 1]
    assert advertised == f"$(POD_NAME).shardtrain-shard.$(POD_NAMESPACE).svc:{shards['ports'][0]['port']}"
    assert {"POD_NAME", "POD_NAMESPACE"} <= env.keys(), "the advertised name is made of the downward API's"


def test_every_pod_serves_metrics_where_its_annotations_and_the_service_monitor_look():
    for resource in resources().values():
        if "template" not in resource.get("spec", {}):
            continue
        annotations = resource["spec"]["template"]["metadata"]["annotations"]
        (container,) = resource["spec"]["template"]["spec"]["containers"]
        port = next(port["containerPort"] for port in container["ports"] if port["name"] == "metrics")
        assert container["args"][container["args"].index("--metrics-port") + 1] == str(port)
        assert annotations == {"prometheus.io/scrape": "true", "prometheus.io/port": str(port),
                               "prometheus.io/path": "/metrics"}, resource["metadata"]["name"]
    # The ServiceMonitor's CRD is the Prometheus Operator's, which kubernetes-validate has no schema for: checked
    # here against the Services it selects instead.
    monitor = yaml.safe_load(SERVICE_MONITOR.read_text())
    assert (monitor["apiVersion"], monitor["kind"]) == ("monitoring.coreos.com/v1", "ServiceMonitor")
    assert set(monitor["spec"]) == {"selector", "endpoints"}
    wanted = monitor["spec"]["selector"]["matchLabels"]
    selected = [resource for name, resource in resources().items() if name.startswith("Service/")
                and wanted.items() <= resource["metadata"]["labels"].items()]
    assert len(selected) == 2, "the coordinator's Service and the shards'"
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics"
    for service in selected:
        assert endpoint["port"] in {port["name"] for port in service["spec"]["ports"]}, service["metadata"]["name"]


def test_each_shard_takes_one_gpu_and_computes_on_it():
    shard = resources()["StatefulSet/shardtrain-shard"]["spec"]["template"]["spec"]["containers"][0]
    assert shard["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert shard["args"][shard["args"].index("--device") + 1] == "cuda:0"  # the one GPU the pod sees


def test_the_commands_flags_and_variables_are_those_of_the_real_commands():
    for container in containers():
        command, *arguments = container["args"]
        flags = [argument for argument in arguments if argument.startswith("--")]
        variables = [item["name"] for item in container["env"] if item["name"].startswith("SHARDTRAIN_")]
        flags += ["--" + name.removeprefix("SHARDTRAIN_").lower().replace("_", "-") for name in variables]
        missing = [flag for flag in flags if not re.search(rf"(^|\s){re.escape(flag)}\b", help_text(command))]
        assert not missing, f"shardtrain {command} has no {missing}"


def test_the_pods_run_as_the_images_user_and_mount_the_token_they_are_told_to_read():
    uid = int(re.search(r"useradd .*--uid (\d+)", DOCKERFILE.read_text()).group(1))
    assert re.search(rf"^USER {uid}$", DOCKERFILE.read_text(), re.MULTILINE)
    secret = resources()["Secret/shardtrain-token"]
    for resource in resources().values():
        if "template" not in resource.get("spec", {}):
            continue
        pod = resource["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] == uid
        mounts = {mount["name"]: mount["mountPath"] for mount in pod["containers"][0]["volumeMounts"]}
        volume = next(volume for volume in pod["volumes"] if volume.get("secret"))
        assert volume["secret"]["secretName"] == secret["metadata"]["name"]
        token_file = next(item["value"] for item in pod["containers"][0]["env"]
                          if item["name"] == "SHARDTRAIN_AUTH_TOKEN_FILE")
        assert token_file == f"{mounts[volume['name']]}/{next(iter(secret['stringData']))}"


def test_the_shipped_secret_holds_no_token_and_a_service_given_it_refuses_to_start(tmp_path):
    secret = resources()["Secret/shardtrain-token"]
    assert secret["stringData"] == {"token": ""}, "a token in the repository would be everyone's"
    (tmp_path / "token").write_text("")
    coordinator = resources()["Deployment/shardtrain-coordinator"]["spec"]["template"]["spec"]["containers"][0]
    arguments = [re.sub(r":\d+$", ":0", argument) for argument in coordinator["args"]]  # no fixed port in tests
    done = subprocess.run([sys.executable, "-m", "shardtrain.cli", *arguments, "--auth-token-file",
                           str(tmp_path / "token")], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "without a token" in done.stderr
