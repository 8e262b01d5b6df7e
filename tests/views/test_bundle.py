"""`podkit doctor --bundle`: a bug report gathered from a pod, with the secrets taken out, from a running
smoke stack (real supervisord) and from workspaces that are broken, planted or full of secrets."""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import subprocess
import tarfile
from pathlib import Path

import pytest

from conftest import PODKIT

pytestmark = pytest.mark.timeout(120)
SECRETS = {"GIT_TOKEN": "gt-0123456789abcdef", "SGLANG_API_KEY": "sgl-key-5f4dcc3b5aa765d61d83",
           "RUNPOD_API_KEY": "rpa_ZYXWVUTSRQPONMLKJIHG", "HF_TOKEN": "hf_qwertyuiopasdfghjkl",
           "PODKIT_NOTIFY_WEBHOOK_URL": "https://hooks.example/services/T000/B000/XXXXXXXXXXXXXXXX",
           "PODKIT_METRICS_KEY": "mk-8c1f0a2b9d3e"}
URL_TOKEN = "urltok-9f8e7d6c5b4a"


def bundle(env: dict, out: Path, *extra: str) -> tuple[subprocess.CompletedProcess, dict[str, bytes]]:
    r = subprocess.run([*PODKIT, "doctor", "--bundle", str(out), *extra], capture_output=True, text=True,
                       env=env, timeout=90)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    with tarfile.open(out) as tar:
        files = {m.name.removeprefix("podkit-doctor/"): tar.extractfile(m).read() for m in tar.getmembers()}
    return r, files


def stand_in_nvidia_smi(tmp_path: Path) -> Path:
    """This machine has no GPU: a stand-in nvidia-smi script answers the three questions the bundle asks."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text('#!/bin/sh\ncase "$1" in\n  -q) echo "Driver Version : 550.54.15"; echo "Compute Mode : Default";;\n'
                   '  topo) echo "GPU0 X";;\n  --query-gpu=driver_version) echo "550.54.15";;\n'
                   '  *) echo "index, name, compute_mode"; echo "0, NVIDIA A40, Default";;\nesac\n')
    smi.chmod(0o755)
    return bin_dir


def test_a_bundle_of_a_running_smoke_stack_holds_what_a_bug_report_needs(stack_factory, tmp_path):
    """Versions, the resolved config and its file, the records, each log's end, status with the programs
    up, doctor's findings, the rendered supervisord.conf and the GPU facts; a 0600 file."""
    s = stack_factory().start()
    s.wait_step(3)
    out = tmp_path / "report.tar.gz"
    env = {**s.env, "PATH": f"{stand_in_nvidia_smi(tmp_path)}:{os.environ['PATH']}"}
    r, files = bundle(env, out)
    assert out.stat().st_mode & 0o777 == 0o600 and f"wrote {out}" in r.stderr + r.stdout
    v = json.loads(files["versions.json"])
    assert v["podkit"] == md.version("podkit") and v["supervisor"] == md.version("supervisor")
    assert files["driver.txt"].strip() == b"550.54.15" and b"Compute Mode" in files["gpu/nvidia-smi-q.txt"]
    assert b"NVIDIA A40" in files["gpu/compute-mode.txt"] and b"GPU0" in files["gpu/topology.txt"]
    assert json.loads(files["records/progress.json"])["step"] >= 3
    assert {"boots.json", "current.json"} <= {n.split("/")[1] for n in files if n.startswith("records/")}
    status = json.loads(files["status.json"])
    assert status["programs"]["trainer"]["state"] in ("STARTING", "RUNNING") and status["supervisord"]["reachable"]
    assert "findings" in json.loads(files["doctor.json"])
    assert b"kind: standin" in files["config.yaml"] and b"step_interval_s: 0.1" in files["config.yaml"]  # env too
    assert files["config-file.yaml"] == Path(s.env["PODKIT_CONFIG"]).read_bytes()
    assert b"[program:trainer]" in files["supervisord.conf"] and b"PODKIT_TRAINER_KIND=fake" in files["run/podkit.env"]
    assert b"step 1 loss" in files["logs/trainer.log"] and "logs/supervisord.log" in files
    assert b"MemTotal:" in files["system.txt"] and b"GiB free of" in files["system.txt"]
    manifest = json.loads(files["MANIFEST.json"])
    assert {m["file"] for m in manifest} >= set(files) - {"MANIFEST.json"}
    assert s.stop() == 0


def test_no_secret_reaches_the_bundle_by_value_or_by_shape(tmp_path):
    """Secrets of the environment and a token in repo.url, planted in a log, a record, a stack dump and
    the config file, plus secrets podkit cannot know by value (a key prefix, a password field): none of
    their bytes is in any file of the bundle, and each place says what was redacted."""
    ws = tmp_path / "ws"
    (ws / ".podkit").mkdir(parents=True)
    (ws / "logs").mkdir()
    cfg = tmp_path / "pod.yaml"
    cfg.write_text(f"repo:\n  url: https://alice:{URL_TOKEN}@git.example/team/train.git\n")
    every = [*SECRETS.values(), URL_TOKEN, "ghp_unknownbyvalue12345", "hunter2hunter2"]
    (ws / "logs" / "trainer.log").write_text(
        f"starting with SGLANG_API_KEY={SECRETS['SGLANG_API_KEY']}\n"
        f"cloning https://alice:{URL_TOKEN}@git.example/team/train.git\n"
        f"HF login with {SECRETS['HF_TOKEN']} then ghp_unknownbyvalue12345\n")
    (ws / "logs" / "stacks-42.txt").write_text(f"  server_args=ServerArgs(api_key='{SECRETS['SGLANG_API_KEY']}')\n")
    (ws / ".podkit" / "safe-mode.json").write_text(json.dumps(
        {"stage": "sync", "message": f"git: https://x:{SECRETS['GIT_TOKEN']}@h/r", "password": "hunter2hunter2"}))
    env = {"PATH": os.environ["PATH"], "PODKIT_WORKSPACE": str(ws), "PODKIT_CONFIG": str(cfg), **SECRETS}
    _, files = bundle(env, tmp_path / "b.tar.gz")
    for name, data in files.items():
        for secret in every:
            assert secret.encode() not in data, (name, secret)
    log = files["logs/trainer.log"].decode()
    assert "<redacted: env SGLANG_API_KEY>" in log and "https://<redacted>@git.example" in log
    assert "<redacted: env HF_TOKEN> then <redacted>" in log
    assert b"<redacted" in files["logs/stacks-42.txt"] and b"<redacted" in files["records/safe-mode.json"]
    assert b"https://<redacted>@git.example" in files["config-file.yaml"]
    env_txt = files["environment.txt"].decode()
    assert "GIT_TOKEN=<redacted>\n" in env_txt and "PODKIT_NOTIFY_WEBHOOK_URL=<redacted>\n" in env_txt
    assert "PODKIT_METRICS_KEY=<redacted>\n" in env_txt  # a secret podkit adds, named without "token" or "api"


def test_every_secret_podkit_reads_from_the_environment_is_one_the_redaction_knows():
    from podkit import notify, redact
    from podkit.areal import checks

    for name in (checks.API_KEY_ENV, checks.METRICS_KEY_ENV, notify.ENV, "RUNPOD_API_KEY"):
        assert name in redact.PODKIT_SECRET_ENV and redact.secret_name(name), name


def test_planted_links_fifos_huge_logs_and_a_foreign_run_dir_are_not_followed(tmp_path):
    """A log that is a symlink to a key, a record that is a symlink, a FIFO among the logs (opening it
    would block), a 20 MB log, and current.json naming a run dir anyone can write: the bundle reads no
    link, never blocks, takes the huge log's end from a whole line, and says what it skipped."""
    ws = tmp_path / "ws"
    (ws / ".podkit").mkdir(parents=True)
    (ws / "logs").mkdir()
    key = tmp_path / "id_ed25519"
    key.write_text("-----BEGIN OPENSSH PRIVATE KEY----- not for the bundle\n")
    (ws / "logs" / "sglang.log").symlink_to(key)
    (ws / ".podkit" / "progress.json").symlink_to(key)
    os.mkfifo(ws / "logs" / "watchdog.log")
    with open(ws / "logs" / "trainer.log", "w") as f:
        for i in range(400_000):
            f.write(f"line {i:07d} of the trainer's log, padded out to fifty bytes\n")
    foreign = tmp_path / "foreign-run"
    foreign.mkdir(mode=0o777)
    foreign.chmod(0o777)
    (foreign / "podkit.env").write_text("PLANTED=1\n")
    (ws / ".podkit" / "current.json").write_text(json.dumps({"run_dir": str(foreign)}))
    env = {"PATH": os.environ["PATH"], "PODKIT_WORKSPACE": str(ws)}
    _, files = bundle(env, tmp_path / "b.tar.gz")
    assert not any(b"PRIVATE KEY" in data or b"PLANTED" in data for data in files.values())
    assert "logs/sglang.log" not in files and "records/progress.json" not in files
    assert "logs/watchdog.log" not in files and "run/podkit.env" not in files
    tail = files["logs/trainer.log"]
    assert 200_000 < len(tail) <= 256 << 10 and tail.startswith(b"line ") and tail.endswith(b"0399999 of the "
                                                                                            b"trainer's log, padded "
                                                                                            b"out to fifty bytes\n")
    notes = {m["source"]: m["note"] for m in json.loads(files["MANIFEST.json"])}
    assert notes[str(ws / "logs" / "sglang.log")] == "a symlink, not followed"
    assert notes[str(ws / ".podkit" / "progress.json")] == "a symlink, not followed"
    assert notes[str(ws / "logs" / "watchdog.log")] == "not a regular file"
    assert notes[str(ws / "logs" / "trainer.log")].startswith("last ")
    assert "not a private directory" in notes[str(foreign)]


def test_a_bundle_is_written_under_a_config_that_does_not_load(tmp_path):
    """The pod waits in safe mode over a bad key: the bundle is what a user sends, so it must still be
    written, with the error and the file that has it."""
    ws = tmp_path / "ws"
    ws.mkdir()
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  checkpoint_evry: 5\n")
    env = {"PATH": os.environ["PATH"], "PODKIT_WORKSPACE": str(ws), "PODKIT_CONFIG": str(bad)}
    r, files = bundle(env, tmp_path / "b.tar.gz")
    assert "checkpoint_evry" in r.stderr
    head = files["config.yaml"].decode().split("\n", 3)
    assert head[0].startswith("# config error") and "checkpoint_evry: unknown key" in head[1], head
    assert files["config-file.yaml"] == bad.read_bytes()


def test_what_the_review_found_holds(tmp_path):
    """A review's cases, together: logs/ a symlink to a key's directory, a secret in a file name, a token
    as the user of repo.url, short secrets and harmless secret-sounding settings, a secret cut at the
    tail's edge between \\r-separated progress bars, a 256 KiB line with no space (quadratic for a naive
    pattern), and a hanging nvidia-smi: the bundle is written in seconds and leaks none of them."""
    import time

    ws = tmp_path / "ws"
    (ws / ".podkit").mkdir(parents=True)
    keys = tmp_path / "ssh"
    keys.mkdir()
    (keys / "id_ed25519").write_text("-----BEGIN OPENSSH PRIVATE KEY-----\n")
    (ws / "logs").symlink_to(keys)
    hf = SECRETS["HF_TOKEN"]
    (ws / ".podkit" / f"trainer-{hf}.json").write_text("{}")
    bar = "\r".join(f"step {i} [{'#' * 40}]" for i in range(20_000))
    # The 256 KiB tail of state_dir's big file begins inside the secret.
    big = "a" * (300 << 10) + "\n" + hf + "\r" + bar
    cut_at = len(big) - (1 << 20)
    big = big[:cut_at - len(hf) // 2] + hf + big[cut_at - len(hf) // 2:]
    (ws / ".podkit" / "huge.log").write_text(big)
    cfg = tmp_path / "pod.yaml"
    cfg.write_text(f"repo:\n  url: https://{URL_TOKEN}-abcdefgh@git.example/team/train.git\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\nexec sleep 60\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "PODKIT_WORKSPACE": str(ws), "PODKIT_CONFIG": str(cfg),
           "HF_TOKEN": hf, "PIN_SECRET": "abc", "TOKENIZERS_PARALLELISM": "false"}
    t0 = time.monotonic()
    _, files = bundle(env, tmp_path / "b.tar.gz")
    assert time.monotonic() - t0 < 60
    for name, data in files.items():
        for secret in (hf, hf[len(hf) // 2:], hf[:len(hf) // 2 + 1], f"{URL_TOKEN}-abcdefgh", "PRIVATE KEY"):
            assert secret.encode() not in data and secret not in name, (name, secret)
    assert not any(n.startswith("logs/") for n in files)
    env_txt = files["environment.txt"].decode()
    assert "PIN_SECRET=<redacted>" in env_txt and "TOKENIZERS_PARALLELISM=<redacted>" in env_txt
    json.loads(files["status.json"])  # "false" elsewhere is left alone
    assert "versions.json" in files and b"https://<redacted: config repo.user>@git.example" in files["config-file.yaml"]
    notes = {m["source"]: m["note"] for m in json.loads(files["MANIFEST.json"])}
    assert notes[str(ws / "logs")] == "a symlink, not followed"
    assert any("did not answer" in n for n in notes.values()), notes


@pytest.mark.parametrize("where", ["no/such/dir/b.tar.gz", "."])
def test_a_bundle_path_that_cannot_be_written_is_a_clear_error(tmp_path, where):
    r = subprocess.run([*PODKIT, "doctor", "--bundle", where], capture_output=True, text=True, timeout=60,
                       cwd=tmp_path, env={"PATH": os.environ["PATH"], "PODKIT_WORKSPACE": str(tmp_path)})
    assert r.returncode == 1 and "cannot write" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_the_pieces_and_encodings_of_a_known_secret_are_redacted_too():
    """A webhook URL's password quoted alone by an error, its token path segment, and a key in base64
    are the secret as much as the whole value is."""
    from podkit.redact import Redactor

    scrub = Redactor({"env PODKIT_NOTIFY_WEBHOOK_URL": "http://ntfy:S3cretPassw0rdXYZ@hooks.example/T0/Bxyz0123456789abc",
                      "env RUNPOD_API_KEY": "rpa_ZYXWVUTSRQPONMLK"})
    import base64

    text = ("InvalidURL: nonnumeric port: 'S3cretPassw0rdXYZ@hooks.example' path Bxyz0123456789abc key "
            + base64.b64encode(b"rpa_ZYXWVUTSRQPONMLK").decode())
    out = scrub(text)
    for piece in ("S3cretPassw0rdXYZ", "Bxyz0123456789abc", base64.b64encode(b"rpa_ZYXWVUTSRQPONMLK").decode()[:16]):
        assert piece not in out, out
