"""The image and compose files, checked without an engine: hadolint on the Dockerfile, shellcheck on
every shell script, the compose specification's schema on docker-compose.yml, and what a user of
each relies on. (tests/image/ builds and boots the image where a Docker engine can be started.)"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import ROOT

pytestmark = pytest.mark.timeout(60)
BIN = Path(sys.executable).parent


def tool(name: str) -> str:
    path = BIN / name
    assert path.exists(), f"{name} comes with the test extras (pip install -e '.[test]')"
    return str(path)


def run(*argv, cwd=ROOT):
    return subprocess.run(argv, capture_output=True, text=True, cwd=cwd, timeout=50)


def shell_scripts() -> list[str]:
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    out = []
    for f in files:
        p = ROOT / f
        if p.is_file() and not p.is_symlink():
            with open(p, "rb") as fh:
                first = fh.readline()
            if re.match(rb"#!.*\b(sh|bash|dash)\b", first):
                out.append(f)
    return out


def test_dockerfile_is_hadolint_clean():
    r = run(tool("hadolint"), "Dockerfile")
    assert r.returncode == 0, r.stdout + r.stderr


def test_hadolint_does_find_problems(tmp_path):
    """The linter is live: an unpinned base and apt without cleanup are reported."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu\nRUN apt-get update && apt-get install -y curl\n")
    r = run(tool("hadolint"), str(bad))
    assert r.returncode != 0 and "DL3006" in r.stdout and "DL3009" in r.stdout


def test_every_shell_script_is_shellcheck_clean():
    scripts = shell_scripts()
    assert {"entrypoint", ".ci/run", "rehearse/env.sh"} <= set(scripts), scripts
    r = run(tool("shellcheck"), *scripts)
    assert r.returncode == 0, r.stdout + r.stderr


def test_shellcheck_does_find_problems(tmp_path):
    bad = tmp_path / "bad.sh"
    bad.write_text("#!/bin/sh\nrm -rf $DIR/*\n")
    r = run(tool("shellcheck"), str(bad))
    assert r.returncode != 0 and "SC2086" in r.stdout


def test_entrypoint_execs_podkit_boot():
    text = (ROOT / "entrypoint").read_text()
    assert os.access(ROOT / "entrypoint", os.X_OK)
    assert [ln for ln in text.splitlines() if ln and not ln.startswith("#")] == ['exec podkit boot "$@"']


def dockerfile() -> list[tuple[str, str]]:
    """(instruction, arguments), continuation lines joined."""
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    return [(m.group(1).upper(), m.group(2).strip()) for ln in text.splitlines()
            if (m := re.match(r"^\s*([A-Za-z]+)\s+(.*)$", ln)) and not ln.lstrip().startswith("#")]


def test_dockerfile_base_is_a_pinned_build_argument():
    steps = dockerfile()
    assert steps[0][0] == "ARG" and steps[0][1].startswith("BASE_IMAGE=")
    base = steps[0][1].split("=", 1)[1]
    assert re.fullmatch(r"lmsysorg/sglang:v0\.5\.10\.post1[\w.-]*", base), "SGLang at the version AReaL 1.0.4 pins"
    assert steps[1] == ("FROM", "${BASE_IMAGE}")


def test_a_code_change_rebuilds_only_the_last_small_layer():
    """Everything after `COPY src` is one pip install of podkit alone: dependencies come before."""
    steps = dockerfile()
    i = next(n for n, (ins, args) in enumerate(steps) if ins == "COPY" and args.startswith("src "))
    after = [s for s in steps[i + 1:] if s[0] in ("RUN", "COPY", "ADD")]
    assert after == [("RUN", "python3 -m pip install --no-deps --no-build-isolation /opt/podkit")]
    heavy = [n for n, (ins, args) in enumerate(steps) if ins == "RUN" and ("areal" in args or "supervisor" in args)]
    assert heavy and max(heavy) < i


def test_dockerfile_entrypoint_healthcheck_and_no_secrets():
    steps = dict((ins, args) for ins, args in dockerfile() if ins in ("ENTRYPOINT", "HEALTHCHECK"))
    assert steps["ENTRYPOINT"] == '["/entrypoint"]'
    assert 'CMD ["podkit", "status", "--health"]' in steps["HEALTHCHECK"]
    env = " ".join(args for ins, args in dockerfile() if ins in ("ENV", "ARG"))
    assert not re.search(r"(TOKEN|SECRET|API_KEY|PASSWORD)\w*=", env)
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".env", ".git", ".venv", "workspace"} <= set(ignored)


def test_compose_file_matches_the_compose_specification():
    r = run(tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", "docker-compose.yml")
    assert r.returncode == 0, r.stdout + r.stderr


def test_compose_schema_check_does_find_problems(tmp_path):
    bad = tmp_path / "compose.yml"
    bad.write_text("services:\n  x:\n    image: a\n    ipc: [host]\n    deploy: {resources: {reservations: "
                   "{devices: [{capabilities: gpu}]}}}\n")
    r = run(tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(bad))
    assert r.returncode != 0


def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_compose_gpu_service_has_what_training_needs():
    svc = compose()["services"]["podkit"]
    devices = svc["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}]
    assert svc.get("ipc") == "host" or svc.get("shm_size")
    assert svc["ulimits"]["memlock"] == -1 and svc["ulimits"]["stack"] >= 64 << 20
    assert any(v.endswith(":/workspace") for v in svc["volumes"])
    assert svc["env_file"][0]["path"] == ".env" and svc["env_file"][0]["required"] is False
    assert svc["healthcheck"]["test"] == ["CMD", "podkit", "status", "--health"]
    assert svc["environment"]["PODKIT_CONFIG"].endswith("/opt/podkit/configs/a40-1gpu.yaml}")
    assert svc["init"] is False, "supervisord is PID 1 and reaps orphans; an init would stand between"
    # Long enough for the trainer's own stop grace (a step, then a recover checkpoint).
    from podkit import config

    grace = config.load(ROOT / "configs/a40-1gpu.yaml", environ={}).trainer.stop_grace_s
    assert int(svc["stop_grace_period"].rstrip("s")) > grace


def test_compose_smoke_profile_runs_the_smoke_config_without_gpus():
    services = compose()["services"]
    smoke = services["smoke"]
    assert smoke["profiles"] == ["smoke"] and "deploy" not in smoke
    assert smoke["environment"]["PODKIT_CONFIG"] == "/opt/podkit/configs/smoke.yaml"
    assert smoke["image"] == services["podkit"]["image"], "one image, three ways to run it"
    assert (ROOT / "configs/smoke.yaml").is_file()
    from podkit import config

    grace = config.load(ROOT / "configs/smoke.yaml", environ={}).trainer.stop_grace_s
    assert int(smoke["stop_grace_period"].rstrip("s")) > grace
