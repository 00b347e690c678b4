"""deploy/kubernetes: every rendered manifest is valid against the Kubernetes API schemas (offline,
kubernetes-validate's bundled schemas, strict: unknown fields fail), and the wiring holds: the
ports, probes, Secret and ConfigMap names the workloads use are the ones the nodes read (each
role config is loaded with the container's own --set arguments), the role configs are the
copies of configs/, the HPAs follow the planner's metric over the planner's own bounds. A
changed name or port on one side fails (checked by mutating a rendered copy)."""

import base64
import copy
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the renderer beside this file (k8s_render.py)
from k8s_render import render  # noqa: E402
from pdkv.auth import SECRET_ENV  # noqa: E402
from pdkv.config import load_config  # noqa: E402
from pdkv.config.router import load_router_config  # noqa: E402
from pdkv.planner.config import load_planner_config  # noqa: E402
from pdkv.planner.service import PlannerMetrics  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "kubernetes"
OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir() if p.is_dir())
SOURCES = {"deepseek-r1-1p1d-tp8": "deepseek-r1", "qwen3-coder-1p3d": "qwen3-coder"}
K8S_VERSION = "1.30"


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    """A copy of deploy/ with the cluster secret's env file written (as an operator does)."""
    dst = tmp_path_factory.mktemp("deploy") / "kubernetes"
    shutil.copytree(K8S, dst)
    (dst / "base" / "cluster-secret.env").write_text(f"{SECRET_ENV}=test-secret\n")
    return dst


def by(docs, kind, name):
    hits = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(hits) == 1, f"{kind}/{name}: {len(hits)} documents"
    return hits[0]


def _container(doc):
    return doc["spec"]["template"]["spec"]["containers"][0]


def _port(c, name):
    return next(p["containerPort"] for p in c["ports"] if p["name"] == name)


def _svc_port(svc, name):
    p = next(p for p in svc["spec"]["ports"] if p["name"] == name)
    return p["port"], p["targetPort"]


def _mounted_config(docs, doc, key, tmp: Path) -> Path:
    """Write the ConfigMap mounted at /etc/pdkv (every key of it) into tmp; the path of ``key``."""
    spec = doc["spec"]["template"]["spec"]
    mount = next(m for m in _container(doc)["volumeMounts"] if m["mountPath"] == "/etc/pdkv")
    vol = next(v for v in spec["volumes"] if v["name"] == mount["name"])
    cm = by(docs, "ConfigMap", vol["configMap"]["name"])
    assert [i["key"] for i in vol["configMap"]["items"]] == [key] or key in cm["data"]
    tmp.mkdir(parents=True, exist_ok=True)
    for k, v in cm["data"].items():
        (tmp / k).write_text(v)
    return tmp / key


def _sets(args):
    return [args[i + 1] for i, a in enumerate(args) if a == "--set"]


def check_wiring(docs, tmp: Path) -> list[str]:
    """Every way the workloads and the nodes must agree; the problems found (empty: wired)."""
    bad = []

    def expect(ok, what):
        if not ok:
            bad.append(what)

    secret_names = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Secret"}
    labels = {}
    cfgs = {}
    for role in ("prefill", "decode"):
        sts, svc = by(docs, "StatefulSet", f"pdkv-{role}"), by(docs, "Service", f"pdkv-{role}")
        c = _container(sts)
        labels[role] = sts["spec"]["template"]["metadata"]["labels"]
        expect(c["args"][:3] == ["serve", "-c", "/etc/pdkv/role.yaml"], f"{role}: args {c['args'][:3]}")
        try:
            cfg = load_config(_mounted_config(docs, sts, "role.yaml", tmp / role), _sets(c["args"]), check_paths=False)
        except Exception as e:  # noqa: BLE001 - reported as a wiring problem
            bad.append(f"{role}: the node cannot read its config: {e}")
            continue
        cfgs[role] = cfg
        expect(cfg.role == role, f"{role}: the ConfigMap holds a {cfg.role} config")
        expect(cfg.model.device == "cuda", f"{role}: model.device {cfg.model.device}")
        expect(_port(c, "http") == cfg.server.port, f"{role}: containerPort http {_port(c, 'http')} != server.port "
                                                    f"{cfg.server.port}")
        expect(_svc_port(svc, "http")[1] == "http", f"{role}: Service http does not target the http port")
        expect(svc["spec"]["clusterIP"] == "None" and sts["spec"]["serviceName"] == svc["metadata"]["name"],
               f"{role}: the StatefulSet's serviceName is not its headless Service")
        expect(svc["spec"]["selector"].items() <= labels[role].items(), f"{role}: Service selects no pod")
        for probe in ("readinessProbe", "startupProbe"):
            g = c[probe]["httpGet"]
            expect(g["path"] == "/health" and g["port"] == "http", f"{role}: {probe} {g}")
        env = {e["name"]: e for e in c["env"]}
        ref = env.get(SECRET_ENV, {}).get("valueFrom", {}).get("secretKeyRef", {})
        keys = secret_names.get(ref.get("name"), {}).get("data", {})
        expect(ref.get("name") in secret_names and ref.get("key") in keys,
               f"{role}: ${SECRET_ENV} comes from {ref}, which no rendered Secret has")
        res = c["resources"]
        gpus = res["limits"].get("nvidia.com/gpu")
        expect(gpus == cfg.parallel.tp, f"{role}: {gpus} GPUs for parallel.tp {cfg.parallel.tp}")
        expect(any("rdma" in k or "hostdev" in k for k in res["limits"]), f"{role}: no RDMA resource request")
        expect(res["requests"].get("nvidia.com/gpu") == gpus, f"{role}: GPU requests != limits")
        vols = {v["name"]: v for v in sts["spec"]["template"]["spec"]["volumes"]}
        shm = [m for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm"]
        expect(shm and vols[shm[0]["name"]].get("emptyDir", {}).get("medium") == "Memory", f"{role}: no shm")
        pre = " ".join(c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", []))
        expect("kill -TERM 1" in pre, f"{role}: no draining preStop")
        pdb = by(docs, "PodDisruptionBudget", f"pdkv-{role}")
        expect(pdb["spec"]["selector"]["matchLabels"].items() <= labels[role].items(), f"{role}: PDB selects no pod")
        if role == "prefill":
            expect(_port(c, "control") == cfg.messenger.control_port,
                   f"prefill: containerPort control != messenger.control_port {cfg.messenger.control_port}")
            expect(_svc_port(svc, "control") == (cfg.messenger.control_port, "control"), "prefill: Service control")
    if "prefill" in cfgs and "decode" in cfgs:
        pre_sts = by(docs, "StatefulSet", "pdkv-prefill")
        ok = {f"pdkv-prefill-{i}.pdkv-prefill:{cfgs['prefill'].messenger.control_port}"
              for i in range(pre_sts["spec"]["replicas"])}
        expect(set(cfgs["decode"].messenger.prefill_peers) <= ok and cfgs["decode"].messenger.prefill_peers,
               f"decode: prefill_peers {cfgs['decode'].messenger.prefill_peers} are not prefill pods' control ports")
    # the router: its config's port and its nodes (every decode pod the HPA can reach)
    rt = by(docs, "Deployment", "pdkv-router")
    rc = load_router_config(_mounted_config(docs, rt, "router.yaml", tmp / "router"))
    c = _container(rt)
    expect(_port(c, "http") == rc.port, f"router: containerPort {_port(c, 'http')} != port {rc.port}")
    expect(_svc_port(by(docs, "Service", "pdkv-router"), "http")[1] == "http", "router: Service target")
    hpas = {d["spec"]["scaleTargetRef"]["name"]: d for d in docs if d["kind"] == "HorizontalPodAutoscaler"}
    if "decode" in cfgs:
        dmax = hpas["pdkv-decode"]["spec"]["maxReplicas"]
        want = [f"http://pdkv-decode-{i}.pdkv-decode:{cfgs['decode'].server.port}" for i in range(dmax)]
        expect(list(rc.nodes) == want, f"router: nodes {list(rc.nodes)[:2]}... != the {dmax} decode pods' APIs")
    # the planner: its port, what it observes, its bounds = the HPAs', the metric the HPAs read
    pl = by(docs, "Deployment", "pdkv-planner")
    pc = load_planner_config(_mounted_config(docs, pl, "planner.yaml", tmp / "planner"))
    expect(pc.actuator == "kubernetes", f"planner: actuator {pc.actuator}")
    expect(_port(_container(pl), "http") == pc.port, "planner: containerPort != server.port")
    svc = by(docs, "Service", "pdkv-planner")
    expect(svc["metadata"]["annotations"]["prometheus.io/port"] == str(pc.port), "planner: scrape port")
    metric = PlannerMetrics().desired._name
    for role in ("prefill", "decode"):
        if role not in cfgs:
            continue
        ob = pc.observe.get(role, {})
        expect(ob == {"dns": f"pdkv-{role}", "port": cfgs[role].server.port},
               f"planner: observes {role} at {ob}, not the headless Service pdkv-{role}:{cfgs[role].server.port}")
        h = hpas.get(f"pdkv-{role}")
        if h is None:
            bad.append(f"no HPA scales pdkv-{role}")
            continue
        expect(h["spec"]["scaleTargetRef"]["kind"] == "StatefulSet", f"HPA {role}: target kind")
        m = h["spec"]["metrics"][0]["external"]
        expect(m["metric"]["name"] == metric and m["metric"]["selector"]["matchLabels"] == {"role": role},
               f"HPA {role}: metric {m['metric']} is not {metric}{{role={role}}}")
        expect(m["target"] == {"type": "AverageValue", "averageValue": "1"}, f"HPA {role}: target {m['target']}")
        expect((h["spec"]["minReplicas"], h["spec"]["maxReplicas"]) ==
               (pc.policy.min_nodes[role], pc.policy.max_nodes[role]), f"HPA {role}: bounds != planner nodes.{role}")
        sts = by(docs, "StatefulSet", f"pdkv-{role}")
        expect(h["spec"]["minReplicas"] <= sts["spec"]["replicas"] <= h["spec"]["maxReplicas"],
               f"{role}: replicas outside the HPA's bounds")
    return bad


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_rendered_manifests_are_schema_valid(tree, overlay):
    import kubernetes_validate

    docs = render(tree / "overlays" / overlay)
    kinds = sorted({d["kind"] for d in docs})
    assert kinds == ["ConfigMap", "Deployment", "HorizontalPodAutoscaler", "PodDisruptionBudget", "Secret", "Service",
                     "StatefulSet"]
    for d in docs:
        kubernetes_validate.validate(d, K8S_VERSION, strict=True)  # raises naming the field
    bad = copy.deepcopy(by(docs, "StatefulSet", "pdkv-decode"))
    _container(bad)["readinessProbe"]["httpGett"] = _container(bad)["readinessProbe"].pop("httpGet")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (kustomize built in) is not installed")
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_renderer_equals_kubectl_kustomize(tree, overlay):
    out = subprocess.run(["kubectl", "kustomize", str(tree / "overlays" / overlay)], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    theirs = [d for d in yaml.safe_load_all(out) if d]
    ours = render(tree / "overlays" / overlay)

    def key(d):
        return (d["kind"], d["metadata"]["name"])
    assert sorted(map(key, ours)) == sorted(map(key, theirs))
    t = {key(d): d for d in theirs}
    for d in ours:
        assert d == t[key(d)], key(d)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_wiring(tree, overlay, tmp_path):
    docs = render(tree / "overlays" / overlay)
    assert check_wiring(docs, tmp_path / "ok") == []
    secret = by(docs, "Secret", "pdkv-cluster-secret")
    assert base64.b64decode(secret["data"][SECRET_ENV]) == b"test-secret"
    # the role configs are configs/'s files, unchanged
    src = ROOT / "configs" / SOURCES[overlay]
    for f in (tree / "overlays" / overlay / "configs").iterdir():
        assert f.read_text() == (src / f.name).read_text(), f"{f.name} drifted from configs/{SOURCES[overlay]}"


def _mutations():
    def port(docs):
        _container(by(docs, "StatefulSet", "pdkv-decode"))["ports"][0]["containerPort"] = 8001

    def cm_name(docs):
        by(docs, "ConfigMap", "pdkv-prefill-config")["metadata"]["name"] = "pdkv-prefill-cfg"
        docs.append({"kind": "ConfigMap", "metadata": {"name": "pdkv-prefill-config"},
                     "data": {"role.yaml": (ROOT / "configs" / "decode.yaml").read_text()}})

    def config_port(docs):
        cm = by(docs, "ConfigMap", "pdkv-decode-config")
        cm["data"]["role.yaml"] = cm["data"]["role.yaml"].replace("port: 8000", "port: 8001")

    def secret(docs):
        env = _container(by(docs, "StatefulSet", "pdkv-prefill"))["env"][0]
        env["valueFrom"]["secretKeyRef"]["name"] = "pdkv-secret"

    def probe(docs):
        _container(by(docs, "StatefulSet", "pdkv-prefill"))["readinessProbe"]["httpGet"]["path"] = "/healthz"

    def control(docs):
        svc = by(docs, "Service", "pdkv-prefill")
        svc["spec"]["ports"][1]["port"] = 7101

    def hpa_metric(docs):
        h = by(docs, "HorizontalPodAutoscaler", "pdkv-decode")
        h["spec"]["metrics"][0]["external"]["metric"]["name"] = "pdkv_desired_nodes"

    def hpa_bounds(docs):
        by(docs, "HorizontalPodAutoscaler", "pdkv-prefill")["spec"]["maxReplicas"] = 9

    def gpus(docs):
        _container(by(docs, "StatefulSet", "pdkv-decode"))["resources"]["limits"]["nvidia.com/gpu"] = 4

    def peers(docs):
        c = _container(by(docs, "StatefulSet", "pdkv-decode"))
        c["args"] = [a.replace("pdkv-prefill-0.pdkv-prefill:7100", "prefill-0:7100") for a in c["args"]]
    return [port, cm_name, config_port, secret, probe, control, hpa_metric, hpa_bounds, gpus, peers]


@pytest.mark.parametrize("mutate", _mutations(), ids=lambda f: f.__name__)
def test_a_change_on_one_side_fails_the_wiring(tree, mutate, tmp_path):
    docs = render(tree / "overlays" / OVERLAYS[0])
    mutate(docs)
    assert check_wiring(docs, tmp_path) != []


def test_dockerfile_runs_pdkv_and_copies_what_the_manifests_mount():
    text = (ROOT / "deploy" / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["pdkv"]' in text  # the manifests' args are pdkv's subcommands
    assert "pip install" in text and "COPY configs" in text
