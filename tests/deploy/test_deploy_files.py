"""deploy/: the Dockerfile, compose file, systemd unit and Kubernetes manifests.

Docker and Kubernetes cannot run here, so these tests check what the files promise against
the real code: every SWARMAVG_* variable they set is a real setting, the image's entry
command and health check work in a plain venv configured exactly as the image configures
them, and the bootstrap start script computes its --join list as documented.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from swarmavg.peer.daemon import settings as peer_settings
from swarmavg.peer.daemon.settings import CONFIG_ENV, ENV_PREFIX

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
SETTINGS = {s.env for s in peer_settings.SETTINGS} | {CONFIG_ENV}
SWARMAVG = Path(sys.executable).with_name("swarmavg")


# -- Dockerfile ----------------------------------------------------------------------------


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, with line continuations joined and comments dropped."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for raw in (DEPLOY / "Dockerfile").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        keyword, _, rest = (pending + line).partition(" ")
        instructions.append((keyword.upper(), rest.strip()))
        pending = ""
    return instructions


def final_stage() -> list[tuple[str, str]]:
    instructions = dockerfile_instructions()
    last_from = max(i for i, (keyword, _) in enumerate(instructions) if keyword == "FROM")
    return instructions[last_from:]


def image_env() -> dict[str, str]:
    env: dict[str, str] = {}
    for keyword, args in final_stage():
        if keyword == "ENV":
            for item in shlex.split(args):
                key, _, value = item.partition("=")
                env[key] = value
    return env


def test_image_is_python_slim_without_torch() -> None:
    instructions = dockerfile_instructions()
    bases = [args.split()[0] for keyword, args in instructions if keyword == "FROM"]
    assert bases
    assert all(base.startswith("python:") and base.endswith("-slim") for base in bases)
    assert not any("torch" in args for keyword, args in instructions if keyword == "RUN")


def test_image_copies_every_package_of_the_distribution() -> None:
    import tomllib

    package_dirs = set(
        tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"][
            "package-dir"
        ].values()
    )
    copied = {
        args.split()[0].rstrip("/")
        for keyword, args in dockerfile_instructions()
        if keyword == "COPY" and not args.startswith("--from")
    }
    assert package_dirs <= copied
    for source in copied:
        assert (REPO / source).exists(), source


def test_image_runs_swarmavg_peer_as_a_non_root_user_with_a_health_check() -> None:
    stage = dict(final_stage())
    assert json.loads(stage["ENTRYPOINT"]) == ["swarmavg", "peer"]
    user = stage["USER"].split(":")[0]
    assert user not in ("root", "0")
    healthcheck = stage["HEALTHCHECK"]
    assert json.loads(healthcheck[healthcheck.index("CMD") + 3 :])[:2] == ["swarmavg", "status"]


def test_image_sets_only_real_settings() -> None:
    env = image_env()
    swarm_vars = {key for key in env if key.startswith(ENV_PREFIX)}
    assert swarm_vars, "the image configures the daemon through SWARMAVG_* variables"
    assert swarm_vars <= SETTINGS


def _run_status(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    healthcheck = dict(final_stage())["HEALTHCHECK"]
    command = json.loads(healthcheck[healthcheck.index("CMD") + 3 :])
    return subprocess.run(
        [str(SWARMAVG), *command[1:]],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.integration
@pytest.mark.timeout(90)
def test_image_entry_command_and_health_check_work_in_a_plain_venv(tmp_path: Path) -> None:
    """Run ENTRYPOINT with the image's ENV (paths moved under tmp_path, listen on loopback as
    `docker run -e SWARMAVG_LISTEN=...` would), then its HEALTHCHECK, like Docker does."""
    entrypoint = json.loads(dict(final_stage())["ENTRYPOINT"])
    data, run = tmp_path / "data", tmp_path / "run"
    data.mkdir()
    run.mkdir()
    env = {key: value for key, value in os.environ.items() if not key.startswith(ENV_PREFIX)}
    for key, value in image_env().items():
        env[key] = value.replace("/data", str(data)).replace("/run/swarmavg", str(run))
    env["SWARMAVG_LISTEN"] = "127.0.0.1:0"

    def start() -> tuple[subprocess.Popen[str], dict[str, Any]]:
        proc = subprocess.Popen(
            [str(SWARMAVG), *entrypoint[1:]],
            env=env,
            cwd=data,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line:
            proc.kill()
            proc.wait(10)
            proc.stdout.close()
            pytest.fail(f"swarmavg peer exited with {proc.poll()} before its ready line")
        return proc, json.loads(line)

    proc, ready = start()
    try:
        assert ready["event"] == "ready"
        assert ready["run_id"] == image_env()["SWARMAVG_RUN_ID"]
        assert ready["control"] == str(run / "control.sock")
        identity = data / "identity.key"
        assert stat.S_IMODE(identity.stat().st_mode) == 0o600
        health = _run_status(env)
        assert health.returncode == 0, health.stderr
        assert json.loads(health.stdout)["peer_id"] == ready["peer_id"]
        proc.send_signal(signal.SIGTERM)  # docker stop
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        assert proc.stdout is not None
        proc.stdout.close()
    assert _run_status(env).returncode != 0  # unhealthy once the daemon is gone

    # A restarted container with the same volume keeps its peer id.
    proc, again = start()
    try:
        assert again["peer_id"] == ready["peer_id"]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        assert proc.stdout is not None
        proc.stdout.close()


# -- compose -------------------------------------------------------------------------------


def load_yaml(path: Path) -> list[Any]:
    yaml = pytest.importorskip("yaml", reason="checking the YAML files needs PyYAML")
    with path.open() as fh:
        return [doc for doc in yaml.safe_load_all(fh) if doc is not None]


def test_compose_runs_one_bootstrap_and_scalable_volunteers() -> None:
    [compose] = load_yaml(DEPLOY / "compose.yaml")
    services = compose["services"]
    assert set(services) == {"bootstrap", "volunteer"}
    for service in services.values():
        build = service["build"]
        assert (DEPLOY / build["context"] / build["dockerfile"]).resolve() == (
            DEPLOY / "Dockerfile"
        )
        assert {key for key in service["environment"] if key.startswith(ENV_PREFIX)} <= SETTINGS
    bootstrap, volunteer = services["bootstrap"], services["volunteer"]
    assert "SWARMAVG_JOIN" not in bootstrap["environment"]  # it starts the swarm
    join_host, _, join_port = volunteer["environment"]["SWARMAVG_JOIN"].partition(":")
    assert join_host == "bootstrap"
    assert bootstrap["environment"]["SWARMAVG_LISTEN"].endswith(f":{join_port}")
    assert volunteer["depends_on"]["bootstrap"]["condition"] == "service_healthy"
    assert "replicas" in volunteer["deploy"]


# -- systemd -------------------------------------------------------------------------------


def unit_settings() -> dict[str, list[str]]:
    settings: dict[str, list[str]] = {}
    for raw in (DEPLOY / "swarmavg-peer.service").read_text().splitlines():
        line = raw.strip()
        if line and not line.startswith(("#", ";", "[")):
            key, _, value = line.partition("=")
            settings.setdefault(key, []).append(value)
    return settings


def test_systemd_unit_restarts_and_sandboxes_the_daemon() -> None:
    unit = unit_settings()
    [exec_start] = unit["ExecStart"]
    assert exec_start.split()[-2:] == ["swarmavg", "peer"] or exec_start.endswith("swarmavg peer")
    assert unit["Restart"] == ["on-failure"]
    assert unit["User"][0] not in ("root", "0")
    for option, value in [
        ("NoNewPrivileges", "yes"),
        ("ProtectSystem", "strict"),
        ("ProtectHome", "yes"),
        ("PrivateTmp", "yes"),
        ("CapabilityBoundingSet", ""),
        ("RestrictNamespaces", "yes"),
    ]:
        assert unit[option] == [value], option
    environment = dict(item.partition("=")[::2] for item in unit["Environment"])
    assert {key for key in environment if key.startswith(ENV_PREFIX)} <= SETTINGS


def test_systemd_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    # verify insists that ExecStart exists: point it at this venv's swarmavg.
    text = (DEPLOY / "swarmavg-peer.service").read_text()
    unit = tmp_path / "swarmavg-peer.service"
    unit.write_text(text.replace("/opt/swarmavg/bin/swarmavg", str(SWARMAVG)))
    done = subprocess.run(
        [analyze, "verify", str(unit)], capture_output=True, text=True, timeout=60, check=False
    )
    problems = [
        line for line in (done.stdout + done.stderr).splitlines() if "swarmavg-peer.service" in line
    ]
    assert problems == []


# -- Kubernetes ----------------------------------------------------------------------------


def k8s_objects() -> dict[str, dict[str, Any]]:
    [kustomization] = load_yaml(DEPLOY / "k8s" / "kustomization.yaml")
    objects = {}
    for resource in kustomization["resources"]:
        for doc in load_yaml(DEPLOY / "k8s" / resource):
            objects[doc["kind"]] = doc
    return objects


def test_k8s_bootstrap_statefulset_has_stable_names_and_identities() -> None:
    objects = k8s_objects()
    statefulset, service = objects["StatefulSet"], objects["Service"]
    assert service["spec"]["clusterIP"] == "None"  # headless: one DNS name per pod
    assert statefulset["spec"]["serviceName"] == service["metadata"]["name"]
    labels = statefulset["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    [claim] = statefulset["spec"]["volumeClaimTemplates"]
    [container] = statefulset["spec"]["template"]["spec"]["containers"]
    env = {item["name"]: item["value"] for item in container["env"]}
    mounts = {mount["name"]: mount["mountPath"] for mount in container["volumeMounts"]}
    assert env["SWARMAVG_IDENTITY"].startswith(mounts[claim["metadata"]["name"]] + "/")
    assert env["BOOTSTRAP_REPLICAS"] == str(statefulset["spec"]["replicas"])
    # The volunteers' join list names exactly the bootstrap pods.
    join = objects["ConfigMap"]["data"]["SWARMAVG_JOIN"].split(",")
    name, governing = statefulset["metadata"]["name"], service["metadata"]["name"]
    assert join == [f"{name}-{i}.{governing}:31337" for i in range(statefulset["spec"]["replicas"])]


def test_k8s_every_peer_is_probed_through_swarmavg_status_and_runs_unprivileged() -> None:
    objects = k8s_objects()
    settings = set(objects["ConfigMap"]["data"]) - {"start-bootstrap.sh"}
    assert settings <= SETTINGS
    for kind in ("StatefulSet", "Deployment"):
        pod = objects[kind]["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        for container in pod["containers"]:
            probe = container["readinessProbe"]["exec"]["command"]
            assert probe[:2] == ["swarmavg", "status"]
            assert container["securityContext"]["allowPrivilegeEscalation"] is False
            env = {item["name"] for item in container.get("env", [])}
            assert {key for key in env if key.startswith(ENV_PREFIX)} <= SETTINGS


@pytest.mark.parametrize(
    ("hostname", "ready_siblings", "expected_join"),
    [
        ("swarmavg-bootstrap-0", [], ""),
        (
            "swarmavg-bootstrap-1",
            ["swarmavg-bootstrap-0.swarmavg-bootstrap"],
            "swarmavg-bootstrap-0.swarmavg-bootstrap:31337",
        ),
        (
            "swarmavg-bootstrap-0",
            ["swarmavg-bootstrap-1.swarmavg-bootstrap", "swarmavg-bootstrap-2.swarmavg-bootstrap"],
            "swarmavg-bootstrap-1.swarmavg-bootstrap:31337,"
            "swarmavg-bootstrap-2.swarmavg-bootstrap:31337",
        ),
    ],
)
def test_k8s_bootstrap_script_joins_the_ready_siblings(
    tmp_path: Path, hostname: str, ready_siblings: list[str], expected_join: str
) -> None:
    """Run start-bootstrap.sh with stand-ins for getent (DNS of ready pods) and swarmavg."""
    script = tmp_path / "start-bootstrap.sh"
    script.write_text(k8s_objects()["ConfigMap"]["data"]["start-bootstrap.sh"])
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "getent").write_text(
        '#!/bin/sh\ncase " $READY " in *" $2 "*) echo "10.0.0.1 $2"; exit 0;; esac\nexit 2\n'
    )
    (bin_dir / "swarmavg").write_text('#!/bin/sh\necho "$* join=$SWARMAVG_JOIN"\n')
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    done = subprocess.run(
        ["/bin/sh", str(script)],
        env={
            "PATH": f"{bin_dir}:/usr/bin:/bin",
            "HOSTNAME": hostname,
            "BOOTSTRAP_REPLICAS": "3",
            "READY": " ".join(ready_siblings),
        },
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    assert done.stdout.strip() == f"peer join={expected_join}"
