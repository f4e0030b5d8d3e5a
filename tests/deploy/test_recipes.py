"""The deployment recipes that cannot run here (no container registry, no cluster), checked as far as the
tools allow: the Kubernetes manifests load as the `kubernetes` client's own models with no field lost, their
container arguments and the container recipe's parse as `paged serve` flags, the container recipe installs
with the README's commands, and the Prometheus configurations pass `promtool check config`."""

from __future__ import annotations

import json
import re
import subprocess
import tomllib

import pytest
import yaml
from dockerfile_parse import DockerfileParser
from kubernetes.client import ApiClient

from paged.serving.api_keys import parse_api_keys
from paged.serving.cli import build_parser
from tests.deploy.components import DEPLOY, binary

ROOT = DEPLOY.parent
MANIFESTS = sorted((DEPLOY / "kubernetes").glob("*.yaml"))


def documents() -> list[dict]:
    return [doc for path in MANIFESTS for doc in yaml.safe_load_all(path.read_text()) if doc]


def _model_name(doc: dict) -> str:
    """apps/v1 Deployment -> V1Deployment, autoscaling/v2 HorizontalPodAutoscaler -> V2HorizontalPodAutoscaler."""
    version = doc["apiVersion"].split("/")[-1]
    return version[0].upper() + version[1:] + doc["kind"]


def _normalized(value):
    """What the client writes back for what YAML read: quantities and int-or-string ports as written."""
    if isinstance(value, dict):
        return {k: _normalized(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_normalized(v) for v in value]
    return value


@pytest.mark.parametrize("doc", documents(), ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_manifest_loads_as_a_kubernetes_object_without_losing_a_field(doc):
    client = ApiClient()
    obj = client._ApiClient__deserialize(doc, _model_name(doc))  # the client's own deserializer: its models
    # A misspelled or misplaced field is dropped by the models: the round trip shows it.
    assert _normalized(client.sanitize_for_serialization(obj)) == _normalized(doc)


def _by_kind() -> dict[str, dict]:
    return {doc["kind"]: doc for doc in documents()}


def test_the_deployment_serves_what_the_service_and_autoscaler_point_at():
    docs = _by_kind()
    deployment, service, hpa = docs["Deployment"], docs["Service"], docs["HorizontalPodAutoscaler"]
    pod = deployment["spec"]["template"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert hpa["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    (container,) = pod["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert service["spec"]["ports"][0]["targetPort"] in ports
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(ports["http"])

    # The container's arguments are flags `paged serve` takes (after the image's entrypoint).
    entrypoint = _dockerfile_json("ENTRYPOINT")
    args = build_parser().parse_args(entrypoint[1:] + container["args"])
    assert args.port == ports["http"] and args.host == "0.0.0.0"
    # Kubernetes kills the pod after terminationGracePeriodSeconds: in-flight requests get --shutdown-grace-s
    # after the preStop pause.
    pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert args.shutdown_grace_s + pre_stop < pod["spec"]["terminationGracePeriodSeconds"]
    # The keys file it reads is the Secret's, and parses.
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "api-keys"]
    assert args.api_keys_file == f"{mount['mountPath']}/keys.json"
    keys_json = docs["Secret"]["stringData"]["keys.json"]
    path = ROOT / ".pytest-keys.json"
    try:
        path.write_text(keys_json)
        assert [k.name for k in parse_api_keys(None, str(path))] == ["team-a", "team-b"]
    finally:
        path.unlink()


def test_the_autoscaler_metric_is_the_adapter_rule_of_a_real_series():
    docs = [d for d in documents() if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "prometheus-adapter-paged"]
    (rule,) = yaml.safe_load(docs[0]["data"]["config.yaml"])["rules"]
    series = re.match(r"^([a-z_:]+)\{", rule["seriesQuery"]).group(1)
    from paged.serving.metrics import EngineMetrics
    assert series in {m.name for m in EngineMetrics("x").registry.collect()}
    renamed = re.sub(rule["name"]["matches"], rule["name"]["as"].replace("${1}", r"\1"), series)
    (metric,) = _by_kind()["HorizontalPodAutoscaler"]["spec"]["metrics"]
    assert metric["pods"]["metric"]["name"] == renamed


def _dockerfile() -> DockerfileParser:
    parser = DockerfileParser(fileobj=open(DEPLOY / "Dockerfile", "rb"))
    return parser


def _dockerfile_json(instruction: str) -> list[str]:
    (value,) = [i["value"] for i in _dockerfile().structure if i["instruction"] == instruction]
    return json.loads(value)


def _readme_installs() -> dict[str, str]:
    """The README's install lines by extra ("cpu" for the runtime alone)."""
    readme = (ROOT / "README.md").read_text()
    block = readme.split("## Install", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    installs = {}
    for line in block.splitlines():
        command = line.split("#", 1)[0].strip()
        if command.startswith("pip install"):
            extra = re.search(r'\.\[(\w+)\]', command)
            installs[extra.group(1) if extra else "cpu"] = command
    return installs


def test_the_container_recipe_installs_with_the_readmes_commands():
    dockerfile = _dockerfile()
    assert dockerfile.baseimage.startswith("python:3.11")  # the interpreter CI tests on
    runs = [i["value"] for i in dockerfile.structure if i["instruction"] == "RUN"]
    (install,) = [r for r in runs if r.startswith("case ")]
    arms = dict(re.findall(r'(\w+)\) (pip install [^;]+?) ;;', install))
    readme = _readme_installs()
    assert set(arms) == {"cpu", "cuda", "cuda13", "tpu"}
    for variant, command in arms.items():
        expected = readme.get(variant) or readme["cuda"].replace("[cuda]", f"[{variant}]")
        assert command == expected, variant
    assert dockerfile.args["VARIANT"] == "cpu"
    # It copies every package pyproject.toml installs.
    copied = {i["value"].split()[0].rstrip("/") for i in dockerfile.structure if i["instruction"] == "COPY"}
    folders = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    assert {"paged", *folders.values()} <= copied
    # Its command line is `paged serve` with flags the CLI takes.
    args = build_parser().parse_args(_dockerfile_json("ENTRYPOINT")[1:] + _dockerfile_json("CMD"))
    assert args.model_positional == "paged-demo-docstrings" and args.port == 8000
    (health,) = [i["value"] for i in dockerfile.structure if i["instruction"] == "HEALTHCHECK"]
    assert f"127.0.0.1:{args.port}/health" in health


@pytest.mark.parametrize("config", ["prometheus/prometheus.yml", "kubernetes/prometheus-config.yaml"])
def test_prometheus_configs_pass_promtool(config, tmp_path):
    promtool = binary("promtool")
    text = (DEPLOY / config).read_text()
    if config.startswith("kubernetes"):
        parsed = yaml.safe_load(yaml.safe_load(text)["data"]["prometheus.yml"])
        # Debian's Prometheus is built without Kubernetes discovery: its relabelling is checked here, with the
        # discovery swapped for a static target; the discovery block itself is two fields.
        (job,) = parsed["scrape_configs"]
        assert job.pop("kubernetes_sd_configs") == [{"role": "pod"}]
        job["static_configs"] = [{"targets": ["127.0.0.1:8000"]}]
        text = yaml.safe_dump(parsed)
    (tmp_path / "prometheus.yml").write_text(text)
    result = subprocess.run([promtool, "check", "config", str(tmp_path / "prometheus.yml")],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout + result.stderr
