"""The container itself as proof: the project's Dockerfile built on a local CPU base, booted with
`docker compose up` on the smoke profile through the real entrypoint, then stopped, restarted and
broken the ways a pod is. Runs against a Docker engine the test run starts (engine.py)."""

from __future__ import annotations

import io
import json
import re
import shutil
import subprocess
import tarfile
import time

import pytest
from engine import LABEL, ROOT, engine, image  # noqa: F401 - fixtures

from conftest import free_port, wait_for

pytestmark = [pytest.mark.image, pytest.mark.xdist_group("image"), pytest.mark.timeout(2400)]


def memlock_bytes() -> int:
    hard = subprocess.run(["sh", "-c", "ulimit -Hl"], capture_output=True, text=True).stdout.strip()
    return 1 << 40 if hard == "unlimited" else int(hard) * 1024


def test_the_image_builds_from_the_projects_dockerfile_on_the_cpu_base(engine, image):  # noqa: F811
    cmd = engine.docker("inspect", "--format", "{{json .Config.Entrypoint}} {{.Config.Healthcheck.Test}}",
                        image["tag"]).stdout
    assert '["/entrypoint"]' in cmd and "podkit status --health" in cmd
    r = engine.docker("run", "--rm", "--network", "host", "--label", LABEL, "--entrypoint", "podkit", image["tag"],
                      "config", "--defaults")
    assert r.stdout == (ROOT / "configs/default.yaml").read_text()


def test_a_code_only_change_rebuilds_only_the_last_small_layer(engine, image, tmp_path):  # noqa: F811
    ctx = tmp_path / "ctx"
    shutil.copytree(ROOT, ctx, ignore=shutil.ignore_patterns(".git", ".venv", "workspace", "__pycache__"))
    (ctx / "src/podkit/log.py").write_text((ctx / "src/podkit/log.py").read_text() + "\n# a code change\n")
    build, seconds = engine.build(ctx, "podkit:code-change", image["base"])
    engine.timings["rebuild after a code change"] = seconds
    before, after = engine.layers(image["tag"]), engine.layers("podkit:code-change")
    assert len(before) == len(after)
    changed = [(b, a) for b, a in zip(before, after, strict=True) if b[0] != a[0]]
    # The rebuilt layers are `COPY src`, the pip install of podkit, and the metadata steps after them.
    rebuilt = [a[2] for _, a in changed]
    assert any("COPY dir:" in c for c in rebuilt) and any("pip install --no-deps" in c for c in rebuilt)
    assert not any(re.search(r"apt-get|areal|supervisor", c) for c in rebuilt), rebuilt
    size = sum(a[1] for _, a in changed)
    print(f"\n[layers] rebuilt after a code change: {len(changed)} layers, {size / 1e6:.2f} MB; "
          f"image total {sum(a[1] for a in after) / 1e9:.2f} GB; build {seconds:.0f}s")
    # podkit's own code and its bytecode, twice (COPY src, then its install): some 5 MB; never a dependency's
    assert size < 8e6, "a code change must not rebuild anything large"
    assert build.stdout.count("Using cache") >= 6
    engine.docker("rmi", "podkit:code-change", check=False)


@pytest.fixture(scope="module")
def smoke(engine, image):  # noqa: F811
    project = f"podkit-test-{int(time.time())}"
    env = {"SMOKE_PORT": str(free_port()), "METRICS_PORT": str(free_port()), "MEMLOCK_BYTES": str(memlock_bytes()), "PODKIT_IMAGE": image["tag"]}
    engine.compose(project, "--profile", "smoke", "up", "-d", "--no-build", "smoke", env=env)
    container = engine.compose(project, "--profile", "smoke", "ps", "-q", "smoke", env=env).stdout.strip()
    yield {"project": project, "container": container, "env": env,
           "volume": f"{project}_smoke-workspace"}
    engine.compose(project, "--profile", "smoke", "down", "-v", "--timeout", "15", env=env, check=False)


def state(engine, container):  # noqa: F811
    return json.loads(engine.docker("inspect", container).stdout)[0]["State"]


def status(engine, container):  # noqa: F811
    r = engine.docker("exec", container, "podkit", "status", "--json", check=False)
    return json.loads(r.stdout) if r.returncode in (0, 1) and r.stdout.startswith("{") else None


def read_from_volume(engine, container, path):  # noqa: F811
    """A file under /workspace, read from the container (running or stopped) with `docker cp`."""
    r = subprocess.run(["docker", "cp", f"{container}:/workspace/{path}", "-"], env=engine.env, capture_output=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    with tarfile.open(fileobj=io.BytesIO(r.stdout)) as t:
        return t.extractfile(t.getmembers()[0]).read().decode()


def test_compose_up_smoke_boots_supervisord_as_pid1_trains_and_turns_healthy(engine, smoke):  # noqa: F811
    c = smoke["container"]
    health = wait_for(lambda: (s := state(engine, c))["Health"]["Status"] == "healthy" and s, 180, 1,
                      what="the healthcheck to turn healthy")
    assert health["Running"]
    pid1 = engine.docker("exec", c, "cat", "/proc/1/cmdline").stdout.split("\0")
    assert any(a.endswith("supervisord") for a in pid1) and "-n" in pid1, pid1
    wait_for(lambda: (s := status(engine, c)) and (s["trainer"].get("step") or 0) >= 15, 120, 1,
             what="the trainer to progress")
    # RUNNING once each has stayed up for its startsecs.
    wait_for(lambda: {n: p["state"] for n, p in status(engine, c)["programs"].items()
                      if n in ("sglang", "trainer")} == {"sglang": "RUNNING", "trainer": "RUNNING"}, 60, 1,
             what="both programs RUNNING")
    logs = engine.docker("logs", c).stdout
    assert re.search(r"^sglang +\| .*stand-in", logs, re.M) and re.search(r"^trainer +\| .*step", logs, re.M)
    assert "[podkit:render]" in logs and "exec supervisord" in logs


def test_docker_restart_boots_again_without_a_loop_and_resumes_from_the_checkpoint(engine, smoke):  # noqa: F811
    """Same writable layer: the old run's supervisord socket and pid file are still in the run dir."""
    c = smoke["container"]
    wait_for(lambda: (s := status(engine, c)) and (s["trainer"].get("checkpoint_step") or 0) >= 10, 120, 1,
             what="a checkpoint before the restart")
    run_dir = engine.docker("exec", c, "sh", "-c", "ls -d /tmp/podkit-*").stdout.strip()
    assert "supervisor.sock" in engine.docker("exec", c, "ls", run_dir).stdout
    engine.docker("restart", c, timeout=120)
    logs = wait_for(lambda: "resumed from checkpoint" in (out := engine.docker("logs", c).stdout) and out, 120, 1,
                    what="the trainer to resume after docker restart")
    stopped_at = int(re.search(r"last stop: SIGTERM: the trainer stopped by the pod's stop \(docker stop, a RunPod "
                               r"stop or migration\) at step (\d+)", logs).group(1))
    assert f"resumed from checkpoint step-{stopped_at:08d}.pt" in logs
    st = state(engine, c)
    assert st["Running"] and not st["Restarting"]
    assert len(json.loads(read_from_volume(engine, c, ".podkit/boots.json"))) == 2
    assert logs.count("exec supervisord") == 2 and "safe mode" not in logs.lower()
    wait_for(lambda: (s := status(engine, c)) and (s["trainer"].get("step") or 0) > stopped_at, 60, 1,
             what="training to go on after the restart")


def test_docker_stop_leaves_a_final_checkpoint_and_exits_cleanly(engine, smoke):  # noqa: F811
    c = smoke["container"]
    wait_for(lambda: (s := status(engine, c)) and (s["trainer"].get("step") or 0) >= 5, 120, 1,
             what="training before the stop")
    t0 = time.monotonic()
    engine.docker("stop", c, timeout=60)  # docker's default grace: 10 s, then SIGKILL
    took = time.monotonic() - t0
    st = state(engine, c)
    assert st["ExitCode"] == 0 and not st["OOMKilled"], st
    assert took < 10, f"stop took {took:.1f}s: docker's 10 s grace ran out (SIGKILL)"
    progress = json.loads(read_from_volume(engine, c, ".podkit/progress.json"))
    assert progress["stopped"]["by"] == "SIGTERM"
    assert progress["checkpoint_step"] == progress["step"] == progress["stopped"]["step"]
    ckpts = engine.docker("run", "--rm", "--network", "host", "--label", LABEL, "-v", f"{smoke['volume']}:/workspace",
                          "--entrypoint", "ls", smoke["env"]["PODKIT_IMAGE"], "/workspace/checkpoints").stdout.split()
    assert f"step-{progress['step']:08d}.pt" in ckpts


def test_a_broken_config_waits_in_safe_mode_instead_of_restart_looping(engine, image):  # noqa: F811
    """restart: always would loop a container whose PID 1 exits; podkit's stays up and explains."""
    r = engine.docker("run", "-d", "--network", "host", "--label", LABEL, "--restart", "always",
                      "-e", "PODKIT_CONFIG=/opt/podkit/configs/smoke.yaml",
                      "-e", "PODKIT_TRAINER_STEP_INTERVAL_S=banana", image["tag"])
    c = r.stdout.strip()
    wait_for(lambda: "SAFE MODE" in engine.docker("logs", c).stdout + engine.docker("logs", c).stderr, 60, 1,
             what="safe mode")
    time.sleep(5)
    st = state(engine, c)
    info = json.loads(engine.docker("inspect", c).stdout)[0]
    assert st["Running"] and info["RestartCount"] == 0, (st, info["RestartCount"])
    out = engine.docker("logs", c).stdout + engine.docker("logs", c).stderr
    assert "PODKIT_TRAINER_STEP_INTERVAL_S" in out and "trainer.step_interval_s" in out and "banana" in out
    assert "Traceback" not in out
    engine.docker("rm", "-f", c, check=False)


def test_compose_v2_accepts_the_compose_file(engine):  # noqa: F811
    """`docker compose config` (v2, compose-go) resolves both services, the smoke profile included."""
    r = engine.compose("podkit-config-check", "--profile", "smoke", "config", "--format", "json",
                       env={"PODKIT_IMAGE": "podkit:latest"})
    cfg = json.loads(r.stdout)
    assert set(cfg["services"]) == {"podkit", "smoke"}
    plain = subprocess.run([engine.compose_bin, "-f", str(ROOT / "docker-compose.yml"), "config", "--quiet"],
                           env=engine.env, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert plain.returncode == 0, plain.stderr
