"""What ships for deployment, checked without Docker, a GPU or a cluster: the pinned versions
(docker/versions.env) and that the images' dependencies resolve for the images' Python, the Dockerfiles
(hadolint, layer order, user, health check), the TensorRT-LLM configs and build flags against what the
pinned release reads (captured in docker/trtllm/), the compose file with Prometheus and Grafana, the
Kubernetes manifests (offline schema validation), and the GPU smoke script's behaviour without a GPU."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
DOCKERFILES = sorted(DOCKER.rglob("Dockerfile*"))
TRT_REPO = DOCKER / "trtllm" / "model_repository"
BUILD = ROOT / "scripts" / "build_trtllm_engine.py"
BIN = Path(sys.executable).parent
KUBERNETES_VERSION = "1.33.0"  # a cluster version the manifests must suit (kubernetes-validate ships its schemas)


def versions() -> dict[str, str]:
    lines = (DOCKER / "versions.env").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if line.strip() and not line.startswith("#"))


def load_module(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def config(name: str) -> model_config_pb2.ModelConfig:
    return text_format.Parse((TRT_REPO / name / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())


def dry_run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BUILD), "--dry-run", *args], check=False, capture_output=True, text=True,
                          env=env, timeout=60)


def sections(path: Path) -> dict[str, set[str]]:
    """A data file of `[section]` headers and one entry a line (# comments)."""
    found: dict[str, set[str]] = {}
    current = None
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            current = found.setdefault(line.strip("[]"), set())
        else:
            current.add(line)
    return found


# -- the pin ---------------------------------------------------------------------------------------

def test_both_dockerfiles_take_their_release_from_versions_env():
    pinned = versions()
    assert re.fullmatch(r"\d\d\.\d\d", pinned["TRITON_RELEASE"]), pinned["TRITON_RELEASE"]
    for dockerfile in DOCKERFILES:
        text = dockerfile.read_text()
        args = dict(re.findall(r"^ARG (\w+)=(\S+)", text, re.MULTILINE))
        assert args.get("TRITON_RELEASE") == pinned["TRITON_RELEASE"], dockerfile
        mismatched = {k: v for k, v in args.items() if k in pinned and pinned[k] != v}
        assert not mismatched, f"{dockerfile} ARG defaults differ from docker/versions.env: {mismatched}"
        assert re.search(r"^FROM nvcr\.io/nvidia/tritonserver:\$\{TRITON_RELEASE\}-", text, re.MULTILINE), dockerfile


def test_the_gpu_image_installs_no_second_torch():
    requirements = load_module(DOCKER / "image_requirements.py")
    gpu = requirements.requirements(ROOT / "pyproject.toml", ("torch",))
    cpu = requirements.requirements(ROOT / "pyproject.toml")
    assert not [r for r in gpu if requirements.requirement_name(r) == "torch"] and len(cpu) == len(gpu) + 1
    text = (DOCKER / "trtllm" / "Dockerfile").read_text()
    assert "--image-provides torch" in text and "--system-site-packages" in text
    assert re.search(r"pip install [^\n]*--no-deps -e \.", text), "the package must be installed without its deps"


@pytest.mark.slow  # NOTE: tooling beside serving; make test-slow runs it (make test stays under 10 min)
def test_the_images_dependencies_resolve_for_the_images_python(tmp_path):
    """pip resolves (downloads nothing but metadata) each image's requirement list for the Python its base
    image ships, so a pin the image cannot install fails here. A pin known not to exist for Python 3.10
    is refused, so the check is not vacuous."""
    requirements = load_module(DOCKER / "image_requirements.py")
    python = versions()["PYTHON_VERSION"]

    def resolve(reqs: list[str], version: str, target: Path) -> subprocess.CompletedProcess:
        return subprocess.run([str(BIN / "pip"), "install", "--dry-run", "--quiet", "--disable-pip-version-check",
                               "--python-version", version, "--only-binary=:all:", "--target", str(target), *reqs],
                              check=False, capture_output=True, text=True, timeout=240)

    jobs = {"gpu image": (requirements.requirements(ROOT / "pyproject.toml", ("torch",)), python),
            "cpu image": (requirements.requirements(ROOT / "pyproject.toml"), python),
            "control": (["matplotlib==3.11.2"], "3.10")}
    with ThreadPoolExecutor(len(jobs)) as pool:
        done = {name: pool.submit(resolve, reqs, version, tmp_path / name.replace(" ", "_"))
                for name, (reqs, version) in jobs.items()}
        results = {name: future.result() for name, future in done.items()}
    for name in ("gpu image", "cpu image"):
        assert results[name].returncode == 0, f"{name}, Python {python}:\n{results[name].stderr[-3000:]}"
    assert results["control"].returncode != 0 and "matplotlib" in results["control"].stderr


# -- the images --------------------------------------------------------------------------------------

def test_hadolint_passes_on_every_dockerfile():
    assert len(DOCKERFILES) == 2, DOCKERFILES
    done = subprocess.run([str(BIN / "hadolint"), "--no-color", *map(str, DOCKERFILES)], check=False,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"hadolint:\n{done.stdout}{done.stderr}"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_an_image_installs_its_dependencies_before_its_sources_as_a_user(dockerfile):
    lines = [line.strip() for line in dockerfile.read_text().replace("\\\n", " ").splitlines()]
    install = next(i for i, line in enumerate(lines) if "pip install" in line and " -r " in line)
    sources = next(i for i, line in enumerate(lines) if re.match(r"COPY .*\bbatchlm \./batchlm", line))
    assert install < sources, "dependencies must be installed before the sources are copied (layer cache)"
    for line in lines:
        if "pip install" in line:
            assert "--no-cache-dir" in line, line
    assert "PIP_NO_CACHE_DIR=1" in dockerfile.read_text()
    users = [line.split()[1] for line in lines if line.startswith("USER ")]
    assert users and users[-1].split(":")[0] not in ("root", "0"), users
    assert any(line.startswith("HEALTHCHECK") and "/v2/health/ready" in line for line in lines)
    assert any(re.match(r"COPY .*locustfiles", line) for line in lines)


def test_the_build_context_leaves_host_state_out():
    ignored = set((ROOT / ".dockerignore").read_text().split())
    assert {".git", ".venv", ".triton", ".cache", "models", "engines", "results"} <= ignored


DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), DOCKER / "README.md", *DOCKERFILES,
             ROOT / "scripts" / "gpu_smoke.sh"]


def commands(path: Path) -> str:
    """The command text of a document: a markdown file's code blocks, or a Dockerfile's or script's
    whole text, with continuation lines joined (inside comments too)."""
    text = path.read_text()
    if path.suffix == ".md":
        text = "\n".join(re.findall(r"^```[a-z]*\n(.*?)^```", text, re.MULTILINE | re.DOTALL))
    return re.sub(r"\\\n\s*(#\s*)?", " ", text)


def test_every_documented_docker_run_sets_shared_memory_and_ulimits():
    found = 0
    for path in DOCUMENTS:
        for command in re.findall(r"docker run [^\n`]*", commands(path)):
            found += 1
            assert "--shm-size" in command and "--ulimit memlock" in command, f"{path.name}: {command}"
    assert found >= 3


# -- TensorRT-LLM: configs and build flags against the pinned release ----------------------------------

def test_tensorrt_llm_config_keys_are_ones_the_pinned_backend_reads():
    lines = (DOCKER / "trtllm" / "backend_parameters.txt").read_text().splitlines()
    allowed = {line.strip() for line in lines if line.strip() and not line.startswith("#")}
    engine = config("tensorrt_llm")
    unknown = sorted(set(engine.parameters) - allowed)
    assert not unknown, f"keys the pinned backend does not read (a typo is silently ignored): {unknown}"
    # read with no default by the pinned backend: a missing one fails the load
    assert {"tokenizer_dir", "xgrammar_tokenizer_info_path", "guided_decoding_backend"} <= set(engine.parameters)
    assert {"max_tokens_in_paged_kv_cache", "enable_kv_cache_reuse", "gpu_device_ids"} <= set(engine.parameters)


def test_tensorrt_llm_queue_and_kv_cache_fit_the_front():
    engine, front = config("tensorrt_llm"), config("continuous_batching_trtllm")
    in_flight = int(front.parameters["max_in_flight"].string_value)
    max_model_len = int(front.parameters["max_model_len"].string_value)
    assert engine.HasField("dynamic_batching")
    # every request the front holds, and a stop request for each, fit Triton's and the executor's queue
    assert engine.dynamic_batching.default_queue_policy.max_queue_size >= 2 * in_flight
    kv_tokens = int(engine.parameters["max_tokens_in_paged_kv_cache"].string_value)
    assert kv_tokens >= engine.max_batch_size * max_model_len  # guaranteed_no_evict can fill every slot


def test_the_build_passes_only_flags_of_the_pinned_release():
    plan = json.loads(dry_run("--tp-size", "2", "--pp-size", "2").stdout)
    flags = sections(DOCKER / "trtllm" / "build_flags.txt")
    assert plan["trtllm_build"][0] == "trtllm-build"
    for step, known in (("trtllm_build", flags["trtllm-build"]), ("convert", flags["convert_checkpoint"])):
        passed = {arg.split("=", 1)[0] for arg in plan[step] if arg.startswith("--")}
        assert passed and not passed - known, f"{step}: flags the pinned release lacks: {sorted(passed - known)}"
    assert "--kv_cache_type=paged" in plan["trtllm_build"]
    assert not [a for a in plan["trtllm_build"] if a.startswith("--paged_kv_cache")]  # deprecated
    assert {"--tp_size=2", "--pp_size=2"} <= set(plan["convert"]) and (plan["tp_size"], plan["pp_size"]) == (2, 2)


@pytest.mark.parametrize("args, flag", [(("--max-num-tokens", "100"), "--max-num-tokens"),
                                        (("--tokens-per-block", "48"), "--tokens-per-block"),
                                        (("--tp-size", "0"), "--tp-size")])
def test_the_build_refuses_a_plan_it_cannot_run_naming_the_flag(args, flag):
    done = dry_run(*args)
    assert done.returncode != 0 and flag in done.stderr, done.stderr


def test_the_engine_is_built_again_for_another_gpu_architecture(tmp_path):
    """The plan carries the compute capability nvidia-smi reports (none here); an engine built on an
    H100 (9.0) is not served on another architecture."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text("#!/bin/sh\necho 9.0\necho 9.0\n")
    (fake / "nvidia-smi").chmod(0o755)
    env = {**os.environ, "PATH": f"{fake}{os.pathsep}{os.environ['PATH']}"}
    engine = tmp_path / "engine"
    hopper = json.loads(dry_run("--out", str(engine), env=env).stdout)
    here = json.loads(dry_run("--out", str(engine)).stdout)
    assert hopper["gpu_compute_capability"] == ["9.0"] and here["gpu_compute_capability"] is None
    serve = load_module(ROOT / "scripts" / "serve_trtllm.py")
    engine.mkdir()
    for name in serve.ENGINE_FILES:
        (engine / name).write_text("{}")
    (engine / serve.PLAN_FILE).write_text(json.dumps({**hopper, "tensorrt_llm": versions()["TENSORRT_LLM_VERSION"]}))
    assert serve.why_build(engine, hopper, versions()["TENSORRT_LLM_VERSION"]) is None
    assert "gpu_compute_capability" in serve.why_build(engine, {**hopper, "gpu_compute_capability": ["8.0"]}, None)
    assert "tp_size" in serve.why_build(engine, {**hopper, "tp_size": 2}, None)


def test_a_parallel_engine_gets_one_gpu_per_rank(tmp_path):
    out = tmp_path / "repo"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "serve_trtllm.py"), "--prepare-only", "--out", str(out),
                    "--engine-dir", str(tmp_path / "engine"), "--tp-size", "2", "--pp-size", "2"],
                   check=True, capture_output=True, timeout=60)
    engine = text_format.Parse((out / "tensorrt_llm" / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    assert engine.parameters["gpu_device_ids"].string_value == "0,1,2,3"
    assert config("tensorrt_llm").parameters["gpu_device_ids"].string_value == "0"


# -- compose, Prometheus, Grafana -----------------------------------------------------------------------

def published_metrics() -> set[str]:
    return set(re.findall(r'"(batchlm_\w+)"', (ROOT / "batchlm" / "backend" / "metrics.py").read_text()))


def test_compose_serves_on_a_gpu_with_prometheus_grafana_and_locust():
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())["services"]
    server = compose["server"]
    assert server["build"]["dockerfile"] == "docker/trtllm/Dockerfile" and server["shm_size"]
    assert server["ulimits"]["memlock"] == -1
    assert server["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    assert any(v.endswith(":/opt/batchlm/engines") for v in server["volumes"])
    assert "8002:8002" in server["ports"]
    prometheus = yaml.safe_load((DOCKER / "prometheus" / "prometheus.yml").read_text())
    targets = [t for job in prometheus["scrape_configs"] for c in job["static_configs"] for t in c["targets"]]
    assert targets == ["server:8002"]
    assert "./prometheus/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in compose["prometheus"]["volumes"]
    grafana = compose["grafana"]["volumes"]
    assert {"./grafana/provisioning:/etc/grafana/provisioning:ro",
            "./grafana/dashboards:/var/lib/grafana/dashboards:ro"} <= set(grafana)
    for volume in (*grafana, *compose["prometheus"]["volumes"]):
        assert (DOCKER / volume.split(":")[0]).exists(), volume
    worker = compose["locust-worker"]
    assert "--worker" in worker["command"] and worker["command"][worker["command"].index("--master-host") + 1] \
        == "locust-master" and worker["deploy"]["replicas"] >= 1
    assert "--master" in compose["locust-master"]["command"]


def test_the_grafana_dashboard_plots_the_published_metrics():
    dashboard = json.loads((DOCKER / "grafana" / "dashboards" / "batchlm.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    used = {name for expr in exprs for name in re.findall(r"batchlm_\w+", expr)}
    assert used <= published_metrics(), f"not published by any model: {sorted(used - published_metrics())}"
    assert {"batchlm_forward_sequences_total", "batchlm_forward_passes_total", "batchlm_waiting_requests",
            "batchlm_kv_blocks_used", "batchlm_kv_blocks_total", "batchlm_time_to_first_token_seconds_sum",
            "batchlm_time_to_first_token_seconds_count", "batchlm_generated_tokens_total"} <= used
    assert any("rate(batchlm_generated_tokens_total" in e for e in exprs)
    source = yaml.safe_load((DOCKER / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text())
    uids = {d["uid"] for d in source["datasources"]}
    assert {p["datasource"]["uid"] for p in dashboard["panels"]} <= uids


# -- Kubernetes -----------------------------------------------------------------------------------------

MANIFESTS = sorted((DOCKER / "kubernetes").rglob("*.yaml"))


def documents(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def test_kubernetes_manifests_validate_offline_against_the_schemas():
    assert MANIFESTS
    errors = []
    for path in MANIFESTS:
        for doc in documents(path):
            try:
                kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
            except kubernetes_validate.ValidationError as exc:
                errors.append(f"{path.relative_to(ROOT)} {doc['kind']}/{doc['metadata']['name']}: {exc.message}")
    assert not errors, "\n".join(errors)


def test_the_schema_check_refuses_a_misspelt_field():
    deployment = next(d for d in documents(DOCKER / "kubernetes" / "cpu" / "triton.yaml") if d["kind"] == "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    container["livenesProbe"] = container.pop("livenessProbe")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("variant", ["cpu", "gpu"])
def test_replicas_are_probed_scraped_and_scaled_on_a_batchlm_load_metric(variant):
    docs = {(d["kind"], d["metadata"]["name"]): d for p in (DOCKER / "kubernetes" / variant).glob("*.yaml")
            for d in documents(p)}
    deployment = docs["Deployment", "batchlm-triton"]
    pod = deployment["spec"]["template"]
    container = pod["spec"]["containers"][0]
    assert container["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    assert container["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    startup = container["startupProbe"]
    budget = startup["periodSeconds"] * startup["failureThreshold"]
    assert budget >= (900 if variant == "gpu" else 120), budget  # the GPU image may build its engine
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == "8002"
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    gpus = container["resources"].get("limits", {}).get("nvidia.com/gpu")
    assert (gpus == 1) if variant == "gpu" else gpus is None
    service = docs["Service", "batchlm-triton"]
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    hpa = docs["HorizontalPodAutoscaler", "batchlm-triton"]
    (metric,) = hpa["spec"]["metrics"]
    adapter = documents(DOCKER / "kubernetes" / "prometheus-adapter-rules.yaml")[0]
    rules = yaml.safe_load(adapter["data"]["config.yaml"])["rules"]
    served = {rule["name"]["as"]: rule["metricsQuery"] for rule in rules}
    assert metric["type"] == "Pods" and metric["pods"]["metric"]["name"] in served
    queried = set(re.findall(r"batchlm_\w+", served[metric["pods"]["metric"]["name"]]))
    assert queried and queried <= published_metrics()
    assert queried <= {"batchlm_running_requests", "batchlm_waiting_requests", "batchlm_kv_blocks_used",
                       "batchlm_kv_blocks_total"}  # load that rises on the decoupled models


def serves_openai_on_every_interface(dockerfile: Path) -> bool:
    """Whether the image's command starts the OpenAI-compatible frontend bound to every interface."""
    (command,) = [json.loads(line[len("CMD "):]) for line in dockerfile.read_text().splitlines()
                  if line.startswith("CMD ")]
    return "scripts/serve.py" in command and "--no-frontend" not in command and \
        command[command.index("--frontend-host") + 1] == "0.0.0.0"


def api_key_source(env: list[dict] | dict | None) -> dict | None:
    """The `valueFrom` (Kubernetes) or value (compose) that sets BATCHLM_API_KEY in `env`; None: unset."""
    if isinstance(env, dict):
        return env.get("BATCHLM_API_KEY")
    return next((e.get("valueFrom", e) for e in env or () if e["name"] == "BATCHLM_API_KEY"), None)


@pytest.mark.parametrize("variant, dockerfile", [("cpu", "Dockerfile"), ("gpu", "trtllm/Dockerfile")])
def test_an_image_that_serves_openai_on_every_interface_reads_its_api_key_from_a_secret(variant, dockerfile):
    """The CPU image's frontend binds 0.0.0.0: its replicas read the key from a Secret, not from an argument
    or a value in the manifest, and the Secret itself is the operator's (applying the folder again would
    otherwise reset it). The GPU image runs no frontend, so it needs none."""
    docs = [d for p in (DOCKER / "kubernetes" / variant).glob("*.yaml") for d in documents(p)]
    assert not [d for d in docs if d["kind"] == "Secret"], "a key committed in a manifest is no secret"
    deployment = next(d for d in docs if (d["kind"], d["metadata"]["name"]) == ("Deployment", "batchlm-triton"))
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    source = api_key_source(container.get("env"))
    arguments = (*container.get("command", ()), *container.get("args", ()))
    assert not any("api-key" in a or "API_KEY" in a for a in arguments)
    if serves_openai_on_every_interface(DOCKER / dockerfile):
        assert variant == "cpu"
        assert source == {"secretKeyRef": {"name": "batchlm-api-key", "key": "api-key"}}, source
        assert {"name": "openai", "containerPort": 9000} in container["ports"]
    else:
        assert source is None


def test_compose_gives_the_api_key_only_where_its_image_serves_openai():
    """The compose file's server runs the GPU image, which serves no OpenAI frontend: no key to set; were
    it to serve one on every interface, its key would have to come from the environment or an .env file."""
    server = yaml.safe_load((DOCKER / "compose.yaml").read_text())["services"]["server"]
    source = api_key_source(server.get("environment"))
    if serves_openai_on_every_interface(DOCKER / server["build"]["dockerfile"].removeprefix("docker/")):
        assert source is not None and source.startswith("${BATCHLM_API_KEY"), source
    else:
        assert source is None and "9000:9000" not in server["ports"]


def test_locust_workers_run_as_a_deployment_against_the_service():
    docs = {(d["kind"], d["metadata"]["name"]): d for d in documents(DOCKER / "kubernetes" / "locust.yaml")}
    worker = docs["Deployment", "batchlm-locust-worker"]["spec"]["template"]["spec"]["containers"][0]["command"]
    master = docs["Deployment", "batchlm-locust-master"]["spec"]["template"]["spec"]["containers"][0]["command"]
    assert worker[worker.index("--master-host") + 1] == "batchlm-locust-master"
    assert ("Service", "batchlm-locust-master") in docs
    assert master[master.index("--host") + 1].startswith("batchlm-triton:")


# -- the GPU smoke script and the docs ----------------------------------------------------------------------

def test_gpu_smoke_skips_cleanly_without_a_gpu_and_refuses_an_old_driver(tmp_path):
    script = ROOT / "scripts" / "gpu_smoke.sh"
    bare = {**os.environ, "PATH": "/usr/bin:/bin"}  # no nvidia-smi
    done = subprocess.run(["bash", str(script)], check=False, capture_output=True, text=True, env=bare, timeout=60)
    assert done.returncode == 0 and done.stdout.startswith("skipped: no GPU"), done.stdout + done.stderr
    (tmp_path / "nvidia-smi").write_text('#!/bin/sh\necho "NVIDIA H100 80GB HBM3, 535.104.05, 9.0"\n')
    (tmp_path / "nvidia-smi").chmod(0o755)
    old = {**bare, "PATH": f"{tmp_path}{os.pathsep}{bare['PATH']}"}
    done = subprocess.run(["bash", str(script)], check=False, capture_output=True, text=True, env=old, timeout=60)
    assert done.returncode == 1 and f"needs {versions()['DRIVER_MIN']} or later" in done.stdout, done.stdout


def test_the_gpu_docs_state_the_pinned_versions():
    pinned = versions()
    for doc in (ROOT / "docs" / "gpu.md", DOCKER / "README.md"):
        text = doc.read_text()
        assert "versions.env" in text, doc
        assert f"{pinned['TRITON_RELEASE']}-trtllm-python-py3" in text, doc
        assert "24.10" not in text, f"{doc.name} names the old release"
    gpu = (ROOT / "docs" / "gpu.md").read_text()
    for key in ("TENSORRT_LLM_VERSION", "PYTHON_VERSION", "CUDA_VERSION", "DRIVER_MIN"):
        assert pinned[key] in gpu, key
    assert len(gpu.splitlines()) <= 250
