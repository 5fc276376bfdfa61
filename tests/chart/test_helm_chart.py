"""The Helm chart in charts/sweeper: lint, render, key properties, Kubernetes schemas.

No database and no cluster. For the default values and for ci/all-on-values.yaml this runs
`helm lint --strict`, renders the chart as `helm template` would (hooks included), asserts
what the deployment depends on, and validates every manifest with kubernetes-validate in
strict mode (unknown fields rejected) against the oldest Kubernetes the chart supports and
a recent one.

Helm engine: the real Helm Go SDK, loaded in-process from the `helm-python-sdk` wheel (import
name `helm_python`; it bundles libhelm_c, a C ABI over Helm's Go packages, and no `helm`
CLI). When that package is absent but a `helm` executable is on PATH, the CLI is used. With
neither, or without kubernetes-validate, the tests fail: CI installs both.

ServiceMonitor and PrometheusRule (monitoring.coreos.com/v1) and RabbitmqCluster
(rabbitmq.com/v1beta1) are CRDs that the Kubernetes schemas do not cover; they are exempted
from schema validation by name and checked structurally below.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import tomllib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

import annotated_types
import pytest
from pydantic import ValidationError

from service.config.execution import Execution, ExecutionSettings
from service.config.policies import Policies, resolve_policies
from service.config.settings import Settings

try:
    import yaml
except ImportError:  # reported by the _requirements fixture, as a failure
    yaml = None

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "sweeper"
ALL_ON = CHART / "ci" / "all-on-values.yaml"
RELEASE = "demo"
NAMESPACE = "shop"
FULLNAME = "demo-sweeper"

# The chart's kubeVersion floor and a recent release; both must be in kubernetes-validate.
KUBE_VERSIONS = ("1.27.0", "1.37.0")
# Custom resources the Kubernetes schemas cannot know; checked structurally instead.
CRD_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor"),
             ("monitoring.coreos.com/v1", "PrometheusRule"),
             ("rabbitmq.com/v1beta1", "RabbitmqCluster")}

Doc = dict[str, Any]


class RenderError(Exception):
    """Helm refused the values or a template failed."""


class HelmEngine(Protocol):
    name: str

    def lint(self, values: Mapping[str, Any]) -> list[str]:
        """Findings of `helm lint --strict` (warnings count): empty means clean."""

    def render(self, values: Mapping[str, Any]) -> tuple[list[Doc], str | None]:
        """Manifests of `helm template` (hooks included), and NOTES.txt when available."""


class SdkEngine:
    """Helm's Go SDK in-process, from the helm-python-sdk wheel."""

    def __init__(self, helm: Any) -> None:
        self.helm = helm
        self.name = f"helm-python-sdk (Helm {helm.helm_sdk_version()})"

    def lint(self, values: Mapping[str, Any]) -> list[str]:
        report = self.helm.lint(str(CHART), dict(values), strict=True,
                                kube_version=f"v{KUBE_VERSIONS[-1]}")
        # Severity 2 = warning, 3 = error; --strict fails on both.
        found = [f"{m['path']}: {m['error']}" for m in report["messages"] if m["severity"] >= 2]
        return found + list(report["errors"])

    def render(self, values: Mapping[str, Any]) -> tuple[list[Doc], str | None]:
        try:
            with self.helm.Chart.load(str(CHART)) as chart:
                chart.validate_schema(dict(values))  # `helm template` does this first
                files = chart.render(dict(values), name=RELEASE, namespace=NAMESPACE,
                                     is_install=True)
        except self.helm.HelmError as exc:
            raise RenderError(str(exc)) from exc
        notes = None
        docs: list[Doc] = []
        for path, text in sorted(files.items()):
            if path.endswith("NOTES.txt"):
                notes = text
            elif path.endswith((".yaml", ".yml")):
                docs.extend(d for d in yaml.safe_load_all(text) if d)
        return docs, notes


class CliEngine:
    """A `helm` executable from PATH."""

    def __init__(self, binary: str) -> None:
        self.binary = binary
        version = subprocess.run([binary, "version", "--short"], capture_output=True,
                                 text=True, check=False, timeout=30)
        self.name = f"{binary} ({version.stdout.strip()})"

    def _run(self, args: list[str], values: Mapping[str, Any]) -> subprocess.CompletedProcess[str]:
        with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
            yaml.safe_dump(dict(values), f)
        try:
            return subprocess.run([self.binary, *args, "-f", f.name], capture_output=True,
                                  text=True, check=False, timeout=60)
        finally:
            os.unlink(f.name)

    def lint(self, values: Mapping[str, Any]) -> list[str]:
        done = self._run(["lint", "--strict", str(CHART)], values)
        return [] if done.returncode == 0 else [done.stdout + done.stderr]

    def render(self, values: Mapping[str, Any]) -> tuple[list[Doc], str | None]:
        done = self._run(["template", RELEASE, str(CHART), "--namespace", NAMESPACE], values)
        if done.returncode != 0:
            raise RenderError(done.stderr)
        return [d for d in yaml.safe_load_all(done.stdout) if d], None


@pytest.fixture(scope="module", autouse=True)
def _requirements() -> None:
    if yaml is None:
        pytest.fail("PyYAML is not installed; it comes with the dev dependency "
                    "kubernetes-validate")


@pytest.fixture(scope="module")
def engine() -> HelmEngine:
    try:
        import helm_python
    except ImportError:
        binary = shutil.which("helm")
        if binary is None:
            pytest.fail("no Helm engine: install the dev dependency helm-python-sdk "
                        "(pip install helm-python-sdk) or put a `helm` executable on PATH")
        return CliEngine(binary)
    return SdkEngine(helm_python)


@pytest.fixture(scope="module")
def kubernetes_validate() -> Any:
    try:
        import kubernetes_validate
    except ImportError:
        pytest.fail("kubernetes-validate is not installed: it is a dev dependency "
                    "(pip install kubernetes-validate)")
    return kubernetes_validate


def load_values(path: Path | None) -> dict[str, Any]:
    if path is None:
        return {}
    loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
    assert isinstance(loaded, dict)
    return loaded


def merged(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(dict(base))
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merged(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


VALUE_SETS = {"default": None, "all-on": ALL_ON}


@pytest.fixture(scope="module", params=sorted(VALUE_SETS))
def values_name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


class Rendered:
    """One rendering of the chart, with lookups by kind and name."""

    def __init__(self, docs: list[Doc], notes: str | None, values: dict[str, Any]) -> None:
        self.docs = docs
        self.notes = notes
        self.values = values

    def of_kind(self, kind: str) -> list[Doc]:
        return [d for d in self.docs if d["kind"] == kind]

    def get(self, kind: str, name: str) -> Doc:
        found = [d for d in self.of_kind(kind) if d["metadata"]["name"] == name]
        assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
        return found[0]

    def pod_specs(self) -> Iterator[tuple[str, Doc]]:
        """(owner, pod spec) for every workload."""
        for d in self.docs:
            owner = f"{d['kind']}/{d['metadata']['name']}"
            if d["kind"] in {"Deployment", "Job"}:
                yield owner, d["spec"]["template"]["spec"]
            elif d["kind"] == "CronJob":
                yield owner, d["spec"]["jobTemplate"]["spec"]["template"]["spec"]


_cache: dict[str, Rendered] = {}


def render_set(engine: HelmEngine, name: str) -> Rendered:
    if name not in _cache:
        values = load_values(VALUE_SETS[name])
        docs, notes = engine.render(values)
        _cache[name] = Rendered(docs, notes, values)
    return _cache[name]


@pytest.fixture(scope="module")
def rendered(engine: HelmEngine, values_name: str) -> Rendered:
    return render_set(engine, values_name)


@pytest.fixture(scope="module")
def default(engine: HelmEngine) -> Rendered:
    return render_set(engine, "default")


@pytest.fixture(scope="module")
def all_on(engine: HelmEngine) -> Rendered:
    return render_set(engine, "all-on")


def env_of(container: Doc) -> dict[str, Doc]:
    return {e["name"]: e for e in container.get("env", [])}


def container(spec: Doc, name: str) -> Doc:
    found = [c for c in spec["containers"] if c["name"] == name]
    assert len(found) == 1, f"no container {name}"
    return found[0]


def pod_spec(d: Doc) -> Doc:
    spec: Doc = d["spec"]["template"]["spec"]
    return spec


# --- lint and schemas ------------------------------------------------------------------


def test_lint_strict(engine: HelmEngine, values_name: str) -> None:
    findings = engine.lint(load_values(VALUE_SETS[values_name]))
    assert findings == [], f"{engine.name} lint --strict ({values_name}):\n" + "\n".join(findings)


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
def test_manifests_match_kubernetes_schemas(rendered: Rendered, kubernetes_validate: Any,
                                            kube_version: str) -> None:
    checked = 0
    for doc in rendered.docs:
        what = f"{doc['kind']}/{doc['metadata']['name']}"
        try:
            kubernetes_validate.validate(doc, kube_version, strict=True)
            checked += 1
        except kubernetes_validate.SchemaNotFoundError:
            assert (doc["apiVersion"], doc["kind"]) in CRD_KINDS, f"no schema for {what}"
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(str(p) for p in exc.path)
            pytest.fail(f"{what} is invalid for Kubernetes {kube_version}: {path}: {exc.message}")
    assert checked >= 5


def test_strict_validation_rejects_unknown_fields(default: Rendered,
                                                  kubernetes_validate: Any) -> None:
    """A control: the schemas really are strict, so passing them means something."""
    broken = copy.deepcopy(default.get("Deployment", FULLNAME))
    pod_spec(broken)["containers"][0]["securityContext"]["readOnlyRootFileSystem"] = True
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBE_VERSIONS[-1], strict=True)


def test_values_schema_rejects_unknown_keys(engine: HelmEngine) -> None:
    with pytest.raises(RenderError, match="replicas"):
        engine.render({"replicas": 3})
    with pytest.raises(RenderError, match="secretName"):
        engine.render({"tls": {"enabled": True}})
    assert engine.lint({"cronjob": {"enabled": "yes"}}) != []


def test_chart_metadata() -> None:
    meta = yaml.safe_load((CHART / "Chart.yaml").read_text(encoding="utf-8"))
    assert meta["apiVersion"] == "v2"
    assert meta["appVersion"] == "0.1.0"
    assert meta["kubeVersion"] == f">={KUBE_VERSIONS[0]}-0"
    icon = (CHART / "icon.svg").read_bytes().strip()
    assert meta["icon"] == "data:image/svg+xml;base64," + base64.b64encode(icon).decode()
    schema = json.loads((CHART / "values.schema.json").read_text(encoding="utf-8"))
    assert schema["$schema"] == "http://json-schema.org/draft-07/schema#"
    assert schema["additionalProperties"] is False
    defaults = load_values(CHART / "values.yaml")
    assert set(defaults) <= set(schema["properties"])


def test_readme_documents_every_value() -> None:
    readme = (CHART / "README.md").read_text(encoding="utf-8")
    missing = [key for key in load_values(CHART / "values.yaml") if f"| `{key}" not in readme]
    assert missing == [], f"charts/sweeper/README.md has no row for {missing}"


def test_all_on_values_switch_everything_on() -> None:
    values = load_values(ALL_ON)
    for section in ("ingress", "autoscaling", "serviceMonitor", "cronjob", "worker", "tls",
                    "migration", "podDisruptionBudget", "grafanaDashboard", "prometheusRule",
                    "networkPolicy", "rabbitmqCluster"):
        assert values[section]["enabled"] is True, section
    assert values["broker"]["execution"] == "rabbitmq"
    assert values["worker"]["autoscaling"]["enabled"] is True
    assert values["serviceAccount"]["create"] is True
    assert values["ingress"]["tls"]
    assert values["extraEnv"] and values["envFromSecrets"]


# --- workloads -------------------------------------------------------------------------


def test_every_pod_is_restricted(rendered: Rendered) -> None:
    specs = list(rendered.pod_specs())
    assert specs
    for owner, spec in specs:
        pod_ctx = spec["securityContext"]
        assert pod_ctx["runAsNonRoot"] is True, owner
        assert pod_ctx["seccompProfile"] == {"type": "RuntimeDefault"}, owner
        assert spec["automountServiceAccountToken"] is False, owner
        for c in spec["containers"]:
            ctx = c["securityContext"]
            assert ctx["runAsNonRoot"] is True, owner
            assert isinstance(ctx["runAsUser"], int) and ctx["runAsUser"] > 0, owner
            assert ctx["allowPrivilegeEscalation"] is False, owner
            assert ctx["readOnlyRootFilesystem"] is True, owner
            assert ctx["capabilities"] == {"drop": ["ALL"]}, owner
            assert ctx["seccompProfile"] == {"type": "RuntimeDefault"}, owner
            assert ctx.get("privileged", False) is False, owner
            assert "resources" in c and c["resources"]["limits"]["memory"], owner


def sweeper_workloads(r: Rendered) -> list[tuple[str, Doc, Doc]]:
    """(owner, pod spec, container) of the containers running the Sweeper image."""
    out = []
    for owner, spec in r.pod_specs():
        for c in spec["containers"]:
            if c["name"] != "trigger":  # the CronJob's curl container
                out.append((owner, spec, c))
    return out


def test_sweeper_containers_run_as_10001_with_writable_scratch(rendered: Rendered) -> None:
    workloads = sweeper_workloads(rendered)
    assert len(workloads) >= 2
    for owner, spec, c in workloads:
        assert spec["securityContext"]["runAsUser"] == 10001, owner
        assert c["securityContext"]["runAsUser"] == 10001, owner
        volumes = {v["name"]: v for v in spec["volumes"]}
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        for path in ("/tmp", "/var/lib/sweeper"):  # noqa: S108 - mount paths, not temp files
            assert path in mounts, f"{owner}: {path} not mounted"
            assert "emptyDir" in volumes[mounts[path]], f"{owner}: {path} is not an emptyDir"
        assert env_of(c)["SWEEPER_DATA_DIR"]["value"] == "/var/lib/sweeper"


def test_api_probes(rendered: Rendered) -> None:
    api = container(pod_spec(rendered.get("Deployment", FULLNAME)), "sweeper")
    port_name = api["ports"][0]["name"]
    assert api["ports"][0]["containerPort"] == 8080
    expected = {"livenessProbe": "/healthz", "readinessProbe": "/readyz",
                "startupProbe": "/healthz"}
    for probe, path in expected.items():
        assert api[probe]["httpGet"]["path"] == path, probe
        assert api[probe]["httpGet"]["port"] == port_name, probe
    tls = rendered.values.get("tls", {}).get("enabled", False)
    assert api["readinessProbe"]["httpGet"]["scheme"] == ("HTTPS" if tls else "HTTP")


def test_termination_grace_exceeds_shutdown_grace(rendered: Rendered) -> None:
    for d in rendered.of_kind("Deployment"):
        spec = pod_spec(d)
        c = spec["containers"][0]
        grace = float(env_of(c)["SWEEPER_SHUTDOWN_GRACE_SECONDS"]["value"])
        pre_stop = c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command")
        sleep = float(pre_stop[1]) if pre_stop else 0.0
        assert spec["terminationGracePeriodSeconds"] > grace + sleep, d["metadata"]["name"]


def test_worker_without_concurrency_is_refused(engine: HelmEngine) -> None:
    with pytest.raises(RenderError, match="concurrency"):
        engine.render({"worker": {"enabled": True}, "config": {"workers": 0}})


def test_too_short_termination_grace_is_refused(engine: HelmEngine) -> None:
    with pytest.raises(RenderError, match="terminationGracePeriodSeconds"):
        engine.render({"terminationGracePeriodSeconds": 20})


def test_policies_configmap_is_mounted_and_named(rendered: Rendered) -> None:
    cm = rendered.get("ConfigMap", f"{FULLNAME}-policies")
    toml_text = cm["data"]["policies.toml"]
    effective = merged(load_values(CHART / "values.yaml"), rendered.values)
    assert toml_text.strip() == effective["policies"].strip()
    tomllib.loads(toml_text)
    for d in rendered.of_kind("Deployment"):
        spec = pod_spec(d)
        c = spec["containers"][0]
        volumes = {v["name"]: v for v in spec["volumes"]}
        mount = next(m for m in c["volumeMounts"] if volumes[m["name"]].get("configMap", {})
                     .get("name") == cm["metadata"]["name"])
        assert mount["readOnly"] is True
        policies_file = env_of(c)["SWEEPER_POLICIES_FILE"]["value"]
        assert policies_file == f"{mount['mountPath']}/policies.toml"
        annotations = d["spec"]["template"]["metadata"]["annotations"]
        assert len(annotations["checksum/policies"]) == 64


def all_on_policies(all_on: Rendered) -> Policies:
    """The all-on example's policies file as Sweeper's own loader reads it (every variable
    it names set to a stand-in)."""
    class AnyEnv(dict[str, str]):
        def get(self, key: str, default: Any = None) -> str:  # type: ignore[override]
            return f"value-of-{key}"

    raw = tomllib.loads(all_on.get("ConfigMap", f"{FULLNAME}-policies")["data"]["policies.toml"])
    return resolve_policies(raw, AnyEnv(), source="all-on-values.yaml")


def test_all_on_policies_load_in_sweeper(all_on: Rendered) -> None:
    """The example policies are what Sweeper's own loader accepts, and they declare the
    example's region: a release of the example would start (start-up refuses a
    SWEEPER_REGION the policies file does not declare)."""
    policies = all_on_policies(all_on)
    assert "cart-retention" in policies.policies
    region = all_on.values["region"]
    assert region == "eu"
    assert policies.regions.serving_problems(region) == []
    # a tenant of the example's webhook (X-Shopify-Shop-Domain) is pinned to it
    assert policies.regions.of_tenant("acme.myshopify.com") == region


def test_all_on_pods_serve_the_declared_region(all_on: Rendered) -> None:
    """The API and worker pods of the all-on example start with SWEEPER_REGION=eu, which its
    policies file declares; the migration Job and the CronJob's trigger get no region."""
    regions = all_on_policies(all_on).regions
    containers = sweeper_containers(all_on)
    assert sorted(containers) == sorted([API, WORKER, MIGRATE])
    for name in (API, WORKER):
        entries = [e for e in containers[name]["env"] if e["name"] == "SWEEPER_REGION"]
        assert entries == [{"name": "SWEEPER_REGION", "value": "eu"}], name
        # the value as the service's settings read it, declared by the example's file
        region = ExecutionSettings(region=entries[0]["value"]).region
        assert region == "eu", name
        assert regions.serving_problems(region) == [], name
    assert region_env(containers[MIGRATE]) is None
    cron = all_on.get("CronJob", f"{FULLNAME}-run")
    trigger = container(cron["spec"]["jobTemplate"]["spec"]["template"]["spec"], "trigger")
    assert region_env(trigger) is None
    if all_on.notes is not None:
        assert 'Region "eu" (SWEEPER_REGION)' in all_on.notes


def test_policies_change_rolls_the_pods(engine: HelmEngine, default: Rendered) -> None:
    changed, _ = engine.render({"policies": "# changed\n"})
    before = default.get("Deployment", FULLNAME)["spec"]["template"]["metadata"]["annotations"]
    after = Rendered(changed, None, {}).get("Deployment", FULLNAME)
    assert (after["spec"]["template"]["metadata"]["annotations"]["checksum/policies"]
            != before["checksum/policies"])


def assert_secret_ref(c: Doc, env: str, secret: str, key: str) -> None:
    ref = env_of(c)[env]["valueFrom"]["secretKeyRef"]
    assert (ref["name"], ref["key"]) == (secret, key), env
    assert "value" not in env_of(c)[env]


def test_secret_references(rendered: Rendered) -> None:
    values = rendered.values
    secret = values.get("existingSecret") or FULLNAME
    keys = {"databaseUrl": "database-url", "apiTokens": "api-tokens",
            "operatorTokens": "operator-tokens", "viewerTokens": "viewer-tokens",
            **values.get("secretKeys", {})}
    workloads = sweeper_workloads(rendered)
    for _owner, _spec, c in workloads:
        assert_secret_ref(c, "SWEEPER_DATABASE_URL", secret, keys["databaseUrl"])
        assert_secret_ref(c, "SWEEPER_API_TOKENS", secret, keys["apiTokens"])
        env = env_of(c)
        # the lower roles' tokens: optional keys of the same Secret (one made before roles
        # existed still starts the pods)
        for variable, key in (("SWEEPER_OPERATOR_TOKENS", "operatorTokens"),
                              ("SWEEPER_VIEWER_TOKENS", "viewerTokens")):
            ref = env[variable]["valueFrom"]["secretKeyRef"]
            assert ref == {"name": secret, "key": keys[key], "optional": True}, variable
        for extra in values.get("extraEnv", []):
            assert env[extra["name"]] == extra
        env_from = [e["secretRef"]["name"] for e in c.get("envFrom", [])]
        assert env_from == values.get("envFromSecrets", [])
    assert not rendered.of_kind("Secret"), "the chart must not create Secrets"


KEY_VARIABLES = {"SWEEPER_EVIDENCE_SIGNING_KEY_FILE", "SWEEPER_EVIDENCE_SIGNING_KEY",
                 "SWEEPER_EVIDENCE_PREVIOUS_PUBLIC_KEYS", "SWEEPER_CREDENTIALS_KEY",
                 "SWEEPER_CREDENTIALS_PREVIOUS_KEYS"}


def test_keys_come_from_their_secrets(all_on: Rendered) -> None:
    """The evidence signing key is a read-only file from its Secret in the API pods (they
    serve the exports); the credentials key reaches the API (which stores credentials) and
    the workers (which use them) from its Secret; the migration Job gets neither."""
    signing, credentials = all_on.values["evidenceSigning"], all_on.values["credentialsKey"]
    containers = sweeper_containers(all_on)
    api, worker, migrate = containers[API], containers[WORKER], containers[MIGRATE]
    path = env_of(api)["SWEEPER_EVIDENCE_SIGNING_KEY_FILE"]["value"]
    mount = next(m for m in api["volumeMounts"] if path.startswith(m["mountPath"] + "/"))
    assert mount["readOnly"] is True
    volume = next(v for v in pod_spec(all_on.get("Deployment", API))["volumes"]
                  if v["name"] == mount["name"])
    assert volume["secret"]["secretName"] == signing["secretName"]
    assert volume["secret"]["items"] == [{"key": signing["key"], "path": signing["key"]}]
    assert volume["secret"]["defaultMode"] == 0o440  # the pod's fsGroup reads it, no one else
    assert path == f"{mount['mountPath']}/{signing['key']}"
    assert env_of(api)["SWEEPER_EVIDENCE_PREVIOUS_PUBLIC_KEYS"]["value"] == ",".join(
        signing["previousPublicKeys"])
    for c in (api, worker):
        assert_secret_ref(c, "SWEEPER_CREDENTIALS_KEY", credentials["secretName"],
                          credentials["key"])
        assert_secret_ref(c, "SWEEPER_CREDENTIALS_PREVIOUS_KEYS", credentials["secretName"],
                          credentials["previousKeysKey"])
    for other, spec in ((worker, pod_spec(all_on.get("Deployment", WORKER))),
                        (migrate, all_on.get("Job", MIGRATE)["spec"]["template"]["spec"])):
        assert not {e for e in env_of(other) if "EVIDENCE" in e}, other["name"]
        assert mount["name"] not in [v["name"] for v in spec.get("volumes", [])]
    assert not KEY_VARIABLES & set(env_of(migrate))
    assert not all_on.of_kind("Secret"), "the chart must not create Secrets"


def test_without_keys_the_chart_says_exports_are_unsigned(default: Rendered,
                                                           all_on: Rendered) -> None:
    for name, c in sweeper_containers(default).items():
        assert not KEY_VARIABLES & set(env_of(c)), name
        assert not [m for m in c["volumeMounts"] if "evidence" in m["name"]], name
    if default.notes is not None:  # some engines render no NOTES.txt (test_notes)
        assert "Evidence exports are UNSIGNED" in default.notes
        assert all_on.notes is not None and "UNSIGNED" not in all_on.notes


def test_a_signing_key_from_the_chart_signs(all_on: Rendered, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The API container's settings, with a real key where the chart mounts it, sign."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    api = dict(sweeper_containers(all_on)[API])
    mounted = env_of(api)["SWEEPER_EVIDENCE_SIGNING_KEY_FILE"]["value"]
    key_file = tmp_path / Path(mounted).name
    key_file.write_bytes(Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))
    # the key where the chart mounts it, moved here; the TLS files (another Secret) left out
    api["env"] = [{**e, "value": str(key_file)} if e["name"] ==
                  "SWEEPER_EVIDENCE_SIGNING_KEY_FILE" else e for e in api["env"]
                  if not e["name"].startswith("SWEEPER_TLS_")]
    signer = settings_from(api, monkeypatch).evidence_signer()
    assert signer is not None and len(signer.published) == 2  # the current and the earlier


def test_migration_hook_job(rendered: Rendered) -> None:
    job = rendered.get("Job", f"{FULLNAME}-migrate")
    annotations = job["metadata"]["annotations"]
    assert annotations["helm.sh/hook"] == "pre-install,pre-upgrade"
    assert annotations["helm.sh/hook-delete-policy"] == "before-hook-creation,hook-succeeded"
    spec = pod_spec(job)
    assert spec["restartPolicy"] == "Never"
    c = container(spec, "migrate")
    assert c["args"] == ["migrate"]
    # It runs before the release's other resources exist: no policies ConfigMap, no chart SA.
    env = env_of(c)
    assert "SWEEPER_POLICIES_FILE" not in env
    policies_cm = f"{FULLNAME}-policies"
    assert all(v.get("configMap", {}).get("name") != policies_cm for v in spec["volumes"])
    chart_sas = {sa["metadata"]["name"] for sa in rendered.of_kind("ServiceAccount")}
    assert spec["serviceAccountName"] not in chart_sas
    # ...and the long-running processes then must not migrate themselves.
    for d in rendered.of_kind("Deployment"):
        assert env_of(pod_spec(d)["containers"][0])["SWEEPER_MIGRATE_ON_START"]["value"] == "false"


def test_no_migration_job_means_migrate_on_start(engine: HelmEngine) -> None:
    docs, _ = engine.render({"migration": {"enabled": False}})
    r = Rendered(docs, None, {})
    assert not r.of_kind("Job")
    api = pod_spec(r.get("Deployment", FULLNAME))["containers"][0]
    assert env_of(api)["SWEEPER_MIGRATE_ON_START"]["value"] == "true"


def test_single_deployment_by_default(default: Rendered) -> None:
    assert [d["metadata"]["name"] for d in default.of_kind("Deployment")] == [FULLNAME]
    api = container(pod_spec(default.get("Deployment", FULLNAME)), "sweeper")
    assert api["args"] == ["serve"]
    assert env_of(api)["SWEEPER_WORKERS"]["value"] == "4"
    assert default.get("Deployment", FULLNAME)["spec"]["replicas"] == 2


def test_worker_deployment_when_enabled(all_on: Rendered) -> None:
    names = sorted(d["metadata"]["name"] for d in all_on.of_kind("Deployment"))
    assert names == [FULLNAME, f"{FULLNAME}-worker"]
    api = container(pod_spec(all_on.get("Deployment", FULLNAME)), "sweeper")
    assert api["args"] == ["serve", "--api-only"]
    assert env_of(api)["SWEEPER_WORKERS"]["value"] == "0"
    worker_doc = all_on.get("Deployment", f"{FULLNAME}-worker")
    worker = container(pod_spec(worker_doc), "worker")
    assert worker["args"] == ["worker"]
    assert env_of(worker)["SWEEPER_WORKERS"]["value"] == "16"
    assert [p["name"] for p in worker["ports"]] == ["metrics"]
    assert "SWEEPER_TLS_CERT_FILE" not in env_of(worker)
    assert worker["resources"] == all_on.values["worker"]["resources"]
    # Autoscaled Deployments leave replicas to their HPA.
    assert "replicas" not in worker_doc["spec"]
    assert "replicas" not in all_on.get("Deployment", FULLNAME)["spec"]
    # The API Service selects only API pods.
    service = all_on.get("Service", FULLNAME)
    assert service["spec"]["selector"]["app.kubernetes.io/component"] == "api"


# --- config values of the service's settings --------------------------------------------

API, WORKER, MIGRATE = FULLNAME, f"{FULLNAME}-worker", f"{FULLNAME}-migrate"
# config key -> (service.config.settings.Settings field, the workloads whose process reads it).
# The pool and statement timeouts go to every process (each builds an engine, `sweeper
# migrate` included); the webhook intake, the HTTP server's limits and retention run only in
# `sweeper serve` (`sweeper worker`'s /metrics server is prometheus_client's own).
CONFIG_SETTINGS: dict[str, tuple[str, tuple[str, ...]]] = {
    "dbPoolTimeoutSeconds": ("db_pool_timeout_seconds", (API, WORKER, MIGRATE)),
    "dbStatementTimeoutMs": ("db_statement_timeout_ms", (API, WORKER, MIGRATE)),
    "webhookMaxInFlight": ("webhook_max_in_flight", (API,)),
    "webhookDbPoolSize": ("webhook_db_pool_size", (API,)),
    "maxBodyBytes": ("max_body_bytes", (API,)),
    "bodyReadTimeoutSeconds": ("body_read_timeout_seconds", (API,)),
    "headerReadTimeoutSeconds": ("header_read_timeout_seconds", (API,)),
    "maxConnections": ("max_connections", (API,)),
    "retentionDays": ("retention_days", (API,)),
    "retentionBatchSize": ("retention_batch_size", (API,)),
    "retentionIntervalSeconds": ("retention_interval_seconds", (API,)),
}


def env_name(field: str) -> str:
    return f"SWEEPER_{field.upper()}"


def sweeper_containers(r: Rendered) -> dict[str, Doc]:
    """Workload name -> its Sweeper container."""
    out = {}
    for owner, _spec, c in sweeper_workloads(r):
        kind, name = owner.split("/", 1)
        if kind != "CronJob":
            out[name] = c
    return out


def settings_from(c: Doc, monkeypatch: pytest.MonkeyPatch) -> Settings:
    """The service's Settings as the container's plain env values make them (the secret
    references replaced by valid stand-ins): what the process would start with."""
    for name in list(os.environ):
        if name.startswith("SWEEPER_"):
            monkeypatch.delenv(name)
    for name, entry in env_of(c).items():
        if name.startswith("SWEEPER_") and "value" in entry:
            monkeypatch.setenv(name, entry["value"])
    monkeypatch.setenv("SWEEPER_DATABASE_URL", "postgresql://sweeper:pw@db:5432/sweeper")
    monkeypatch.setenv("SWEEPER_API_TOKENS", "t" * 16)
    if "SWEEPER_BROKER_URL" in env_of(c):  # shaped like the operator's connection_string
        monkeypatch.setenv("SWEEPER_BROKER_URL", OPERATOR_URL)
    return Settings()


def test_config_defaults_are_the_service_defaults(default: Rendered,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    config = load_values(CHART / "values.yaml")["config"]
    containers = sweeper_containers(default)
    assert sorted(containers) == [API, MIGRATE]
    for key, (field, readers) in CONFIG_SETTINGS.items():
        service_default = Settings.model_fields[field].default
        assert config[key] == service_default, key
        for name, c in containers.items():
            env = env_of(c)
            if name in readers:
                assert float(env[env_name(field)]["value"]) == service_default, (name, key)
            else:
                assert env_name(field) not in env, (name, key)
    # ...and the service starts with exactly those from what the chart renders.
    for name, c in containers.items():
        settings = settings_from(c, monkeypatch)
        for key, (field, _readers) in CONFIG_SETTINGS.items():
            assert getattr(settings, field) == Settings.model_fields[field].default, (name, key)


def test_config_values_reach_the_processes_that_read_them(
        engine: HelmEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    # 3600000 would print as "3.6e+06" without the template's int64; the service refuses it.
    chosen = {"dbPoolTimeoutSeconds": 2.5, "dbStatementTimeoutMs": 3_600_000,
              "webhookMaxInFlight": 500, "webhookDbPoolSize": 16,
              "maxBodyBytes": 64 * 1024 * 1024, "bodyReadTimeoutSeconds": 2.5,
              "headerReadTimeoutSeconds": 30, "maxConnections": 1_000_000,
              "retentionDays": 0, "retentionBatchSize": 5_000, "retentionIntervalSeconds": 60}
    docs, _ = engine.render({"worker": {"enabled": True}, "config": chosen})
    containers = sweeper_containers(Rendered(docs, None, {}))
    assert sorted(containers) == sorted([API, WORKER, MIGRATE])
    for name, c in containers.items():
        env = env_of(c)
        settings = settings_from(c, monkeypatch)
        for key, (field, readers) in CONFIG_SETTINGS.items():
            if name in readers:
                assert float(env[env_name(field)]["value"]) == chosen[key], (name, key)
                assert getattr(settings, field) == chosen[key], (name, key)
            else:
                assert env_name(field) not in env, (name, key)
                assert getattr(settings, field) == Settings.model_fields[field].default


def test_config_schema_bounds_match_the_service_settings() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text(encoding="utf-8"))
    config = schema["properties"]["config"]
    for key, (field, _readers) in CONFIG_SETTINGS.items():
        info = Settings.model_fields[field]
        expected: dict[str, Any] = {"type": {int: "integer", float: "number"}[info.annotation]}
        for bound in info.metadata:
            if isinstance(bound, annotated_types.Ge):
                expected["minimum"] = bound.ge
            elif isinstance(bound, annotated_types.Gt):
                expected["exclusiveMinimum"] = bound.gt
            elif isinstance(bound, annotated_types.Le):
                expected["maximum"] = bound.le
        prop = config["properties"][key]
        got = {k: prop[k] for k in ("type", "minimum", "exclusiveMinimum", "maximum")
               if k in prop}
        assert got == expected, key
        assert key in config["required"], key


OUT_OF_BOUNDS = [
    ("dbPoolTimeoutSeconds", 0), ("dbPoolTimeoutSeconds", 120.5),
    ("dbStatementTimeoutMs", 99), ("dbStatementTimeoutMs", 30_000.5),
    ("webhookMaxInFlight", 0), ("webhookMaxInFlight", 100_001),
    ("webhookDbPoolSize", 0), ("webhookDbPoolSize", 201),
    ("maxBodyBytes", 1023), ("maxBodyBytes", 256 * 1024 * 1024 + 1),
    ("bodyReadTimeoutSeconds", 0), ("bodyReadTimeoutSeconds", 600.5),
    ("headerReadTimeoutSeconds", 0), ("headerReadTimeoutSeconds", 600.5),
    ("maxConnections", 0), ("maxConnections", 1_000_001),
    ("retentionDays", -1), ("retentionDays", 36_501),
    ("retentionBatchSize", 0), ("retentionBatchSize", 100_001),
    ("retentionIntervalSeconds", 0), ("retentionIntervalSeconds", 86_400.5),
]


@pytest.mark.parametrize(("key", "value"), OUT_OF_BOUNDS)
def test_config_out_of_bounds_is_refused(engine: HelmEngine, key: str, value: float) -> None:
    with pytest.raises(RenderError, match=key):
        engine.render({"config": {key: value}})
    # The service draws the line at the same place.
    with pytest.raises(ValidationError):
        Settings(**{CONFIG_SETTINGS[key][0]: value})


def test_api_tls_without_ingress(all_on: Rendered) -> None:
    api = container(pod_spec(all_on.get("Deployment", FULLNAME)), "sweeper")
    env = env_of(api)
    mounts = {m["name"]: m["mountPath"] for m in api["volumeMounts"]}
    assert env["SWEEPER_TLS_CERT_FILE"]["value"] == f"{mounts['tls']}/tls.crt"
    assert env["SWEEPER_TLS_KEY_FILE"]["value"] == f"{mounts['tls']}/tls.key"


def test_service(rendered: Rendered) -> None:
    service = rendered.get("Service", FULLNAME)
    assert service["spec"]["type"] == "ClusterIP"
    (port,) = service["spec"]["ports"]
    tls = rendered.values.get("tls", {}).get("enabled", False)
    assert port["name"] == ("https" if tls else "http")
    assert port["targetPort"] == port["name"]
    assert port["port"] == rendered.values.get("service", {}).get("port", 80)


def labels_match(selector: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_selectors_match_their_pods(rendered: Rendered) -> None:
    pods = {d["metadata"]["name"]: d["spec"]["template"]["metadata"]["labels"]
            for d in rendered.of_kind("Deployment")}
    for d in rendered.of_kind("Deployment"):
        assert labels_match(d["spec"]["selector"]["matchLabels"], pods[d["metadata"]["name"]])
    for pdb in rendered.of_kind("PodDisruptionBudget"):
        assert labels_match(pdb["spec"]["selector"]["matchLabels"], pods[pdb["metadata"]["name"]])
    service = rendered.get("Service", FULLNAME)
    assert labels_match(service["spec"]["selector"], pods[FULLNAME])
    for hpa in rendered.of_kind("HorizontalPodAutoscaler"):
        assert hpa["apiVersion"] == "autoscaling/v2"
        assert hpa["spec"]["scaleTargetRef"]["name"] in pods


def test_optional_resources_are_off_by_default(default: Rendered) -> None:
    kinds = sorted({d["kind"] for d in default.docs})
    assert kinds == ["ConfigMap", "Deployment", "Job", "NetworkPolicy", "PodDisruptionBudget",
                     "Service", "ServiceAccount"]
    [account] = default.of_kind("ServiceAccount")
    assert account["automountServiceAccountToken"] is False
    for _, spec in default.pod_specs():
        if spec["serviceAccountName"] != "default":  # the migration hook runs before it exists
            assert spec["serviceAccountName"] == account["metadata"]["name"]


def test_network_policies_open_only_what_each_pod_serves(rendered: Rendered) -> None:
    values = merged(load_values(CHART / "values.yaml"), rendered.values)
    policies = {p["metadata"]["name"]: p["spec"] for p in rendered.of_kind("NetworkPolicy")}
    api = policies[f"{FULLNAME}-api"]
    assert api["ingress"] == [{"ports": [{"port": values["config"]["port"], "protocol": "TCP"}],
                               **({"from": values["networkPolicy"]["apiFrom"]}
                                  if values["networkPolicy"]["apiFrom"] else {})}]
    assert policies[f"{FULLNAME}-jobs"]["ingress"] == []
    assert policies[f"{FULLNAME}-jobs"]["podSelector"]["matchExpressions"][0]["values"] == [
        "cron", "migration"]
    # every pod of the release is selected by exactly one policy
    pods = [d["spec"]["template"]["metadata"]["labels"] if d["kind"] != "CronJob" else
            d["spec"]["jobTemplate"]["spec"]["template"]["metadata"]["labels"]
            for d in rendered.docs if d["kind"] in {"Deployment", "Job", "CronJob"}]
    for labels in pods:
        selecting = [name for name, p in policies.items() if _selects(p["podSelector"], labels)]
        assert len(selecting) == 1, (labels, selecting)
    egress = values["networkPolicy"]["egress"]
    for name, spec in policies.items():
        assert ("Egress" in spec["policyTypes"]) == bool(egress)
        # the API and worker pods also reach the broker; the CronJob's and migration's never
        broker = values["broker"]["execution"] == "rabbitmq" and name != f"{FULLNAME}-jobs"
        assert spec.get("egress", []) == ([*egress, broker_egress(values)] if egress and broker
                                          else egress), name


def _selects(selector: Doc, labels: dict[str, str]) -> bool:
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    return all(labels.get(e["key"]) in e["values"] for e in selector.get("matchExpressions", [])
               if e["operator"] == "In")


def test_optional_resources_when_enabled(all_on: Rendered) -> None:
    kinds = {d["kind"] for d in all_on.docs}
    assert {"CronJob", "HorizontalPodAutoscaler", "Ingress", "ServiceAccount",
            "ServiceMonitor"} <= kinds
    assert len(all_on.of_kind("HorizontalPodAutoscaler")) == 2
    assert len(all_on.of_kind("PodDisruptionBudget")) == 2
    ingress = all_on.get("Ingress", FULLNAME)
    assert ingress["spec"]["tls"] == all_on.values["ingress"]["tls"]
    backend = ingress["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend == {"name": FULLNAME, "port": {"name": "https"}}
    # the ingress terminates TLS from outside FORWARDED_ALLOW_IPS: console cookies are Secure
    api = env_of(container(pod_spec(all_on.get("Deployment", FULLNAME)), "sweeper"))
    assert api["SWEEPER_CONSOLE_SECURE_COOKIES"]["value"] == "true"


def test_console_cookies_follow_the_request_without_an_ingress(default: Rendered) -> None:
    api = env_of(container(pod_spec(default.get("Deployment", FULLNAME)), "sweeper"))
    assert "SWEEPER_CONSOLE_SECURE_COOKIES" not in api


def test_service_monitor(all_on: Rendered) -> None:
    """Structural checks for the CRD the Kubernetes schemas do not cover."""
    sm = all_on.get("ServiceMonitor", FULLNAME)
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert sm["metadata"]["namespace"] == "monitoring"
    assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert sm["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    service = all_on.get("Service", FULLNAME)
    assert labels_match(sm["spec"]["selector"]["matchLabels"], service["metadata"]["labels"])
    (endpoint,) = sm["spec"]["endpoints"]
    assert endpoint["port"] == service["spec"]["ports"][0]["name"]
    assert endpoint["path"] == "/metrics"
    assert endpoint["scheme"] == "https"
    assert set(sm["spec"]) == {"namespaceSelector", "selector", "endpoints"}
    assert set(endpoint) <= {"port", "path", "scheme", "interval", "scrapeTimeout",
                             "tlsConfig", "relabelings", "metricRelabelings"}


def test_worker_probes_use_its_metrics_port(all_on: Rendered, engine: HelmEngine) -> None:
    """`sweeper worker` answers /healthz and /readyz on SWEEPER_METRICS_PORT
    (service/worker/health.py); without that port it has nothing to probe."""
    worker = container(pod_spec(all_on.get("Deployment", f"{FULLNAME}-worker")), "worker")
    expected = {"livenessProbe": ("/healthz", "liveness"),
                "readinessProbe": ("/readyz", "readiness")}
    for probe, (path, timings) in expected.items():
        assert worker[probe]["httpGet"] == {"path": path, "port": "metrics", "scheme": "HTTP"}
        for key, value in all_on.values.get("probes", {}).get(timings, {}).items():
            assert worker[probe][key] == value, (probe, key)
    assert "startupProbe" not in worker  # alive while it starts: its loop has not hung
    values = {"worker": {"enabled": True, "metricsPort": 0}, "config": {"workers": 4}}
    portless = Rendered(*engine.render(values), values)
    bare = container(pod_spec(portless.get("Deployment", f"{FULLNAME}-worker")), "worker")
    assert "livenessProbe" not in bare and "readinessProbe" not in bare and "ports" not in bare


def test_worker_metrics_are_scraped(all_on: Rendered) -> None:
    worker_name = f"{FULLNAME}-worker"
    sm = all_on.get("ServiceMonitor", worker_name)
    service = all_on.get("Service", f"{worker_name}-metrics")
    assert labels_match(sm["spec"]["selector"]["matchLabels"], service["metadata"]["labels"])
    (endpoint,) = sm["spec"]["endpoints"]
    assert endpoint["port"] == service["spec"]["ports"][0]["name"] == "metrics"
    pod = all_on.get("Deployment", worker_name)["spec"]["template"]
    assert labels_match(service["spec"]["selector"], pod["metadata"]["labels"])
    (container,) = pod["spec"]["containers"]
    assert container["ports"] == [{"name": "metrics", "containerPort": 9090, "protocol": "TCP"}]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["SWEEPER_METRICS_PORT"] == "9090"
    assert env["SWEEPER_HOST"] == "0.0.0.0"  # noqa: S104 - a pod listens on its own IP


def test_dashboard_configmap_carries_the_dashboard_file(all_on: Rendered) -> None:
    cm = all_on.get("ConfigMap", f"{FULLNAME}-dashboard")
    assert cm["metadata"]["namespace"] == "monitoring"
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["annotations"] == {"grafana_folder": "Sweeper"}
    shipped = json.loads(cm["data"]["sweeper.json"])
    assert shipped == json.loads((CHART / "dashboards" / "sweeper.json").read_text())


def test_prometheus_rule_carries_the_rules_file(default: Rendered, all_on: Rendered) -> None:
    assert not default.of_kind("PrometheusRule")
    rule = all_on.get("PrometheusRule", FULLNAME)
    assert rule["metadata"]["namespace"] == "monitoring"
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    written = yaml.safe_load((CHART / "alerts" / "sweeper.rules.yaml").read_text())
    base = "https://git.example.com/sweeper/-/blob/main/"
    for group in written["groups"]:
        for alert in group["rules"]:
            alert["labels"]["team"] = "platform"
            alert["annotations"]["runbook_url"] = base + alert["annotations"]["runbook_url"]
    # the file's rules, each with the release's labels and runbook base, nothing else
    assert rule["spec"] == written


def test_every_image_but_sweepers_own_is_pinned_by_digest(rendered: Rendered) -> None:
    """Sweeper's own image is the operator's build (a digest is theirs to set); every other
    image the chart pulls is pinned, so two installs of one chart version run the same bytes."""
    ours = merged(load_values(CHART / "values.yaml"), rendered.values)["image"]["repository"]
    for owner, spec in rendered.pod_specs():
        for c in spec.get("initContainers", []) + spec["containers"]:
            if not c["image"].startswith(ours + ":") and not c["image"].startswith(ours + "@"):
                assert re.search(r"@sha256:[0-9a-f]{64}$", c["image"]), (owner, c["image"])


def test_cronjob_only_when_enabled(default: Rendered, all_on: Rendered) -> None:
    assert not default.of_kind("CronJob")
    cron = all_on.get("CronJob", f"{FULLNAME}-run")
    assert cron["spec"]["schedule"] == "5 * * * *"
    assert cron["spec"]["concurrencyPolicy"] == "Forbid"
    spec = cron["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    c = container(spec, "trigger")
    assert re.fullmatch(r"curlimages/curl:8\.11\.1@sha256:[0-9a-f]{64}", c["image"]), c["image"]
    script = c["args"][0]
    assert "POST" in script and "/v1/runs" in script
    assert 'Idempotency-Key: ${key}' in script and 'key="sweeper-cron-${job}"' in script
    assert "Authorization: Bearer" in script
    env = env_of(c)
    # The Job name carries the scheduled time: the key is stable across pod retries.
    assert (env["JOB_NAME"]["valueFrom"]["fieldRef"]["fieldPath"]
            == "metadata.labels['batch.kubernetes.io/job-name']")
    assert_secret_ref(c, "SWEEPER_API_TOKENS", "sweeper-cron-token", "token")
    assert env["SWEEPER_URL"]["value"] == f"https://{FULLNAME}.{NAMESPACE}.svc:443"
    assert json.loads(env["RUN_BODY"]["value"]) == all_on.values["cronjob"]["body"]
    assert c["args"][1:] == ["sweeper-cron", "--cacert", "/etc/sweeper/tls/ca.crt", "--verbose"]
    # The token never appears on a command line, and the name fits the 52-character limit.
    assert "$token" not in script.split("curl", 1)[1]
    assert len(cron["metadata"]["name"]) <= 52


def test_cronjob_defaults_to_the_main_secret_and_plain_http(engine: HelmEngine) -> None:
    docs, _ = engine.render({"cronjob": {"enabled": True}})
    cron = Rendered(docs, None, {}).get("CronJob", f"{FULLNAME}-run")
    c = cron["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"][0]
    assert_secret_ref(c, "SWEEPER_API_TOKENS", FULLNAME, "api-tokens")
    assert env_of(c)["SWEEPER_URL"]["value"] == f"http://{FULLNAME}.{NAMESPACE}.svc:80"
    assert json.loads(env_of(c)["RUN_BODY"]["value"]) == {}


def test_cronjob_script_sends_the_token_and_key(all_on: Rendered, tmp_path: Path) -> None:
    """Run the trigger script with a stand-in curl: first token, trimmed, on stdin only."""
    c = all_on.get("CronJob", f"{FULLNAME}-run")["spec"]["jobTemplate"]["spec"]["template"][
        "spec"]["containers"][0]
    fake = tmp_path / "curl"
    fake.write_text('#!/bin/sh\ncat > "$OUT.stdin"\nprintf "%s\\n" "$@" > "$OUT.args"\n')
    fake.chmod(0o755)
    out = tmp_path / "call"
    env = {"PATH": f"{tmp_path}:{os.environ['PATH']}", "OUT": str(out),
           "JOB_NAME": "demo-sweeper-run-29412345", "LEGACY_JOB_NAME": "",
           "SWEEPER_URL": "https://sweeper.test", "RUN_BODY": '{"policy":"p"}',
           "SWEEPER_API_TOKENS": " tok-aaaaaaaaaaaaaaaa \n,tok-bbbbbbbbbbbbbbbb"}
    done = subprocess.run(["/bin/sh", "-ec", c["args"][0], *c["args"][1:]], env=env,
                          capture_output=True, text=True, check=False, timeout=10)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "call.stdin").read_text() == \
        'header = "Authorization: Bearer tok-aaaaaaaaaaaaaaaa"\n'
    args = (tmp_path / "call.args").read_text().splitlines()
    assert "Idempotency-Key: sweeper-cron-demo-sweeper-run-29412345" in args
    assert args[-1] == "https://sweeper.test/v1/runs"
    assert args[args.index("--data") + 1] == '{"policy":"p"}'
    assert "--cacert" in args and not any("tok-" in a for a in args)


def test_notes(engine: HelmEngine, default: Rendered, all_on: Rendered) -> None:
    if default.notes is None:
        pytest.skip(f"{engine.name} does not render NOTES.txt in `helm template`")
    assert f"create secret generic {FULLNAME}" in default.notes
    assert "POST /v1/runs" in default.notes
    assert all_on.notes is not None and f"cronjob/{FULLNAME}-run" in all_on.notes
    assert "RabbitMQ" not in default.notes
    assert 'key "connection_string" of the Secret "sweeper-mq-default-user"' in all_on.notes


def test_rendering_is_deterministic(engine: HelmEngine, all_on: Rendered) -> None:
    docs, _ = engine.render(all_on.values)
    digest = hashlib.sha256(json.dumps(docs, sort_keys=True).encode()).hexdigest()
    assert digest == hashlib.sha256(json.dumps(all_on.docs, sort_keys=True).encode()).hexdigest()


# --- execution on a broker (broker, rabbitmqCluster) ---------------------------------------

BROKER_VARIABLES = {"SWEEPER_EXECUTION", "SWEEPER_BROKER_URL", "SWEEPER_BROKER_PREFETCH"}
# What the RabbitMQ Cluster Operator (2.11.0 on) writes under connection_string in the
# "<cluster>-default-user" Secret: amqp://<user>:<password>@<cluster>.<namespace>.svc:<port>/
# (internal/resource/default_user_secret.go); the user is "default_user_" and URL-safe base64.
OPERATOR_URL = f"amqp://default_user_Ab-c_D:pw_Z-9=@sweeper-mq.{NAMESPACE}.svc:5672/"
RABBITMQ = {"broker": {"execution": "rabbitmq", "existingSecret": "sweeper-broker",
                       "urlKey": "url", "prefetch": 64}}


def broker_egress(values: Mapping[str, Any]) -> Doc:
    """The egress rule the API and worker policies get in execution rabbitmq."""
    rule: Doc = {"ports": [{"port": 5672, "protocol": "TCP"}, {"port": 5671, "protocol": "TCP"}]}
    cluster = values.get("rabbitmqCluster", {})
    if values["networkPolicy"].get("brokerTo"):
        rule["to"] = values["networkPolicy"]["brokerTo"]
    elif cluster.get("enabled") and not values["broker"].get("existingSecret"):
        rule["to"] = [{"podSelector": {"matchLabels": {
            "app.kubernetes.io/name": cluster.get("name") or f"{FULLNAME}-rabbitmq",
            "app.kubernetes.io/component": "rabbitmq"}}}]
    return rule


def test_database_execution_by_default_sets_no_broker(default: Rendered) -> None:
    """Today's installs render as before: no broker variable anywhere, no RabbitmqCluster."""
    for name, c in sweeper_containers(default).items():
        assert not BROKER_VARIABLES & set(env_of(c)), name
    assert not default.of_kind("RabbitmqCluster")
    defaults = load_values(CHART / "values.yaml")
    assert defaults["broker"]["execution"] == ExecutionSettings.model_fields["execution"].default
    assert (defaults["broker"]["prefetch"]
            == ExecutionSettings.model_fields["broker_prefetch"].default)
    assert defaults["rabbitmqCluster"]["enabled"] is False


@pytest.mark.parametrize("workers_apart", [False, True], ids=["api-workers", "worker-pods"])
def test_rabbitmq_execution_reads_the_url_from_its_secret(
        engine: HelmEngine, monkeypatch: pytest.MonkeyPatch, workers_apart: bool) -> None:
    """Both the API pods (the leader's relay, and their workers) and the worker pods get the
    three variables, the URL from the Secret only; the migration Job gets none."""
    values = merged(RABBITMQ, {"worker": {"enabled": workers_apart}})
    r = Rendered(*engine.render(values), values)
    containers = sweeper_containers(r)
    runtime = [API, WORKER] if workers_apart else [API]
    assert sorted(containers) == sorted([*runtime, MIGRATE])
    for name in runtime:
        c = containers[name]
        env = env_of(c)
        assert env["SWEEPER_EXECUTION"] == {"name": "SWEEPER_EXECUTION", "value": "rabbitmq"}
        assert_secret_ref(c, "SWEEPER_BROKER_URL", "sweeper-broker", "url")
        assert env["SWEEPER_BROKER_PREFETCH"] == {"name": "SWEEPER_BROKER_PREFETCH",
                                                  "value": "64"}
        settings = settings_from(c, monkeypatch)  # what the process starts with
        assert settings.execution is Execution.RABBITMQ, name
        assert settings.broker_prefetch == 64, name
        assert settings.broker_url is not None
    assert not BROKER_VARIABLES & set(env_of(containers[MIGRATE]))
    assert not r.of_kind("RabbitmqCluster")
    assert not r.of_kind("Secret"), "the chart must not create Secrets"
    # egress stays open (no rules given), so no broker rule either
    for policy in r.of_kind("NetworkPolicy"):
        assert "egress" not in policy["spec"] and policy["spec"]["policyTypes"] == ["Ingress"]


def test_rabbitmq_execution_without_a_url_source_is_refused(engine: HelmEngine) -> None:
    with pytest.raises(RenderError, match=r"broker\.execution=rabbitmq needs the broker URL "
                                          r"\(SWEEPER_BROKER_URL\) from a Secret: set "
                                          r"broker\.existingSecret"):
        engine.render({"broker": {"execution": "rabbitmq"}})
    with pytest.raises(RenderError, match=r"rabbitmqCluster\.enabled=true"):
        engine.render({"broker": {"execution": "rabbitmq"}, "worker": {"enabled": True}})
    # (`helm lint` only logs a template's `fail`; install, upgrade and template refuse it)


@pytest.mark.parametrize(("values", "key"), [
    ({"broker": {"execution": "kafka"}}, "execution"),
    ({"broker": {"prefetch": 0}}, "prefetch"),
    ({"broker": {"prefetch": 1001}}, "prefetch"),
    ({"broker": {"prefetch": 16.5}}, "prefetch"),
    ({"broker": {"urlKey": ""}}, "urlKey"),
    ({"broker": {"url": "amqp://sweeper:pw@mq:5672/sweeper"}}, "url"),  # never inline
    ({"broker": {"existingSecret": "Not_A_Name"}}, "existingSecret"),
    ({"rabbitmqCluster": {"enabled": True, "replicas": 0}}, "replicas"),
    ({"rabbitmqCluster": {"enabled": True, "name": "m" * 43}}, "name"),
    ({"rabbitmqCluster": {"enabled": True, "persistence": {"size": "5Gi"}}}, "size"),
    ({"rabbitmqCluster": {"enabled": True, "storage": "5Gi"}}, "storage"),
])
def test_broker_values_outside_the_schema_are_refused(engine: HelmEngine,
                                                      values: dict[str, Any], key: str) -> None:
    with pytest.raises(RenderError, match=key):
        engine.render(values)


def test_broker_schema_matches_the_service_settings() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text(encoding="utf-8"))
    broker = schema["properties"]["broker"]
    assert broker["additionalProperties"] is False
    assert broker["properties"]["execution"]["enum"] == [e.value for e in Execution]
    prefetch = broker["properties"]["prefetch"]
    expected: dict[str, Any] = {"type": "integer"}
    for bound in ExecutionSettings.model_fields["broker_prefetch"].metadata:
        if isinstance(bound, annotated_types.Ge):
            expected["minimum"] = bound.ge
        elif isinstance(bound, annotated_types.Le):
            expected["maximum"] = bound.le
    assert {k: prefetch[k] for k in ("type", "minimum", "maximum")} == expected
    # the service draws the line at the same place
    for outside in (expected["minimum"] - 1, expected["maximum"] + 1):
        with pytest.raises(ValidationError):
            ExecutionSettings(broker_prefetch=outside)
    assert schema["properties"]["rabbitmqCluster"]["additionalProperties"] is False


def test_rabbitmq_cluster_operator_example(all_on: Rendered) -> None:
    """Structural checks for the CRD the Kubernetes schemas do not cover, and Sweeper wired to
    the Secret the operator writes for it."""
    example = all_on.values["rabbitmqCluster"]
    cluster = all_on.get("RabbitmqCluster", "sweeper-mq")
    assert cluster["apiVersion"] == "rabbitmq.com/v1beta1"
    assert cluster["metadata"]["labels"]["app.kubernetes.io/instance"] == RELEASE
    assert "namespace" not in cluster["metadata"]  # the release's, beside the pods
    assert cluster["spec"] == {"replicas": 3, "image": example["image"],
                               "resources": example["resources"],
                               "persistence": {"storageClassName": "gp3", "storage": "20Gi"},
                               **example["extraSpec"]}
    containers = sweeper_containers(all_on)
    for name in (API, WORKER):
        assert_secret_ref(containers[name], "SWEEPER_BROKER_URL", "sweeper-mq-default-user",
                          "connection_string")
        assert env_of(containers[name])["SWEEPER_BROKER_PREFETCH"]["value"] == "32"
    assert not BROKER_VARIABLES & set(env_of(containers[MIGRATE]))
    # the URL the operator writes there is one Sweeper accepts (vhost "/")
    parsed = ExecutionSettings(execution="rabbitmq", broker_url=OPERATOR_URL)
    assert parsed.broker_url is not None
    assert not all_on.of_kind("Secret"), "the Secret is the operator's, not the chart's"


def test_rabbitmq_cluster_defaults(engine: HelmEngine) -> None:
    values = {"broker": {"execution": "rabbitmq"}, "rabbitmqCluster": {"enabled": True}}
    r = Rendered(*engine.render(values), values)
    cluster = r.get("RabbitmqCluster", f"{FULLNAME}-rabbitmq")
    # three nodes (quorum queues survive one lost); resources and image: the operator's
    assert cluster["spec"] == {"replicas": 3, "persistence": {"storage": "10Gi"}}
    assert_secret_ref(sweeper_containers(r)[API], "SWEEPER_BROKER_URL",
                      f"{FULLNAME}-rabbitmq-default-user", "connection_string")
    # a Secret of one's own wins over the operator's (another user or vhost)
    own = merged(values, {"broker": {"existingSecret": "sweeper-broker"}})
    api = sweeper_containers(Rendered(*engine.render(own), own))[API]
    assert_secret_ref(api, "SWEEPER_BROKER_URL", "sweeper-broker", "broker-url")
    # the name leaves room for what the operator derives from it
    long = merged(values, {"fullnameOverride": "s" * 55})
    [cluster] = Rendered(*engine.render(long), long).of_kind("RabbitmqCluster")
    assert len(cluster["metadata"]["name"]) <= 42
    assert not cluster["metadata"]["name"].endswith("-")


@pytest.mark.parametrize("case", ["existing-secret", "broker-to", "operator", "database"])
def test_closed_egress_lets_the_runtime_pods_reach_the_broker(engine: HelmEngine,
                                                              case: str) -> None:
    dns = [{"ports": [{"port": 53, "protocol": "UDP"}, {"port": 53, "protocol": "TCP"}]}]
    peer = [{"ipBlock": {"cidr": "10.20.0.0/16"}}]
    values = merged(RABBITMQ, {"worker": {"enabled": True}, "networkPolicy": {"egress": dns}})
    if case == "broker-to":
        values["networkPolicy"]["brokerTo"] = peer
    elif case == "operator":
        values = merged(values, {"broker": {"existingSecret": ""},
                                 "rabbitmqCluster": {"enabled": True}})
    elif case == "database":
        values["broker"]["execution"] = "database"
    r = Rendered(*engine.render(values), values)
    policies = {p["metadata"]["name"]: p["spec"] for p in r.of_kind("NetworkPolicy")}
    rule = broker_egress(merged(load_values(CHART / "values.yaml"), values))
    expected_to = {"existing-secret": None, "broker-to": peer, "database": None,
                   "operator": [{"podSelector": {"matchLabels": {
                       "app.kubernetes.io/name": f"{FULLNAME}-rabbitmq",
                       "app.kubernetes.io/component": "rabbitmq"}}}]}[case]
    assert rule.get("to") == expected_to
    for name in (API, WORKER):
        assert policies[f"{name}-api" if name == API else name]["egress"] == (
            dns if case == "database" else [*dns, rule]), name
    assert policies[f"{FULLNAME}-jobs"]["egress"] == dns


# --- regions (region) ----------------------------------------------------------------------

# What the service accepts as SWEEPER_REGION; the values schema must draw the same line.
REGION_NAME = re.compile(r"[a-z]([a-z0-9-]{0,30}[a-z0-9])?")
GOOD_REGIONS = ["eu", "e", "us-east-1", "ap-2", "a" * 32, "a" + "-" * 30 + "z"]
BAD_REGIONS = ["EU", "Eu", "-eu", "eu-", "a" * 33, "e u", "1eu", "eu_west", "eu.west",
               "eü", " eu", "eu\n", "-"]


def region_env(c: Doc) -> Doc | None:
    return env_of(c).get("SWEEPER_REGION")


def test_no_region_by_default(default: Rendered) -> None:
    """Unset: no SWEEPER_REGION in any container, so the workers serve the unpinned tenants.
    (The all-on example sets one: test_all_on_pods_serve_the_declared_region.)"""
    assert load_values(CHART / "values.yaml")["region"] == ""
    for owner, spec in default.pod_specs():
        for c in [*spec["containers"], *spec.get("initContainers", [])]:
            assert region_env(c) is None, owner
    assert default.notes is None or "SWEEPER_REGION" not in default.notes


@pytest.mark.parametrize("execution", ["database", "rabbitmq"])
@pytest.mark.parametrize("workers_apart", [False, True], ids=["api-workers", "worker-pods"])
def test_region_reaches_the_api_and_worker_pods(engine: HelmEngine, execution: str,
                                               workers_apart: bool) -> None:
    values = merged(RABBITMQ if execution == "rabbitmq" else {},
                    {"region": "eu", "worker": {"enabled": workers_apart}})
    assert engine.lint(values) == []
    r = Rendered(*engine.render(values), values)
    containers = sweeper_containers(r)
    runtime = [API, WORKER] if workers_apart else [API]
    assert sorted(containers) == sorted([*runtime, MIGRATE])
    for name in runtime:
        entries = [e for e in containers[name]["env"] if e["name"] == "SWEEPER_REGION"]
        assert entries == [{"name": "SWEEPER_REGION", "value": "eu"}], name
        # beside the execution mode it selects the queues of
        assert (env_of(containers[name]).get("SWEEPER_EXECUTION", {}).get("value", "database")
                == execution), name
    # the migration Job reads no region (the schema is the ledger's, shared by all regions)
    assert region_env(containers[MIGRATE]) is None
    if r.notes is not None:
        assert 'Region "eu" (SWEEPER_REGION)' in r.notes


def test_region_value_is_passed_as_a_string(engine: HelmEngine) -> None:
    """A name YAML would read as something else still reaches the pods verbatim."""
    for name in ("no", "on", "null", "true"):
        values = {"region": name, "worker": {"enabled": True}}
        containers = sweeper_containers(Rendered(*engine.render(values), values))
        for c in (containers[API], containers[WORKER]):
            assert region_env(c) == {"name": "SWEEPER_REGION", "value": name}


@pytest.mark.parametrize("name", GOOD_REGIONS)
def test_region_names_the_service_accepts_render(engine: HelmEngine, name: str) -> None:
    assert REGION_NAME.fullmatch(name)
    api = sweeper_containers(Rendered(*engine.render({"region": name}), {}))[API]
    assert region_env(api) == {"name": "SWEEPER_REGION", "value": name}


@pytest.mark.parametrize("name", BAD_REGIONS)
def test_region_names_outside_the_pattern_are_refused(engine: HelmEngine, name: str) -> None:
    assert not REGION_NAME.fullmatch(name)
    with pytest.raises(RenderError, match="region"):
        engine.render({"region": name})


@pytest.mark.parametrize("value", [7, True, ["eu"], {"name": "eu"}])
def test_region_must_be_a_string(engine: HelmEngine, value: Any) -> None:
    with pytest.raises(RenderError, match="region"):
        engine.render({"region": value})


def test_region_schema() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text(encoding="utf-8"))
    region = schema["properties"]["region"]
    assert region["type"] == "string"
    assert region["description"]
    # the schema's pattern, read as JSON Schema does (a search), takes "" and the names
    pattern = re.compile(region["pattern"])
    for name in ["", *GOOD_REGIONS]:
        assert pattern.search(name), name
    for name in BAD_REGIONS:
        if not name.endswith("\n"):  # Python's $ matches before a final newline, Go's does not
            assert not pattern.search(name), name
