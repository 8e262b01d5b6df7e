"""Secrets stay secret: a token inside repo.url, the SGLang API key, and what `podkit deploy` would send.
The token is looked for everywhere a person or another process could read it."""

from __future__ import annotations

import os
import subprocess

import pytest

from conftest import PODKIT, ROOT
from gitserver import HTTPRemote, Remote
from podkit import config
from podkit.deploy.template import literal_secret, load_template
from podkit.programs import sglang

pytestmark = pytest.mark.timeout(120)
TOKEN = "ghp_inlineTokenInTheUrl0123456789"


def test_a_token_inside_repo_url_syncs_and_shows_nowhere(stack_factory, tmp_path):
    """PODKIT_REPO_URL=https://user:TOKEN@host/repo clones, and the token is in none of: `podkit
    config`, `podkit render`, the run dir's env file, boot's output, any program's environment or
    command line, .git/config."""
    remote = Remote(tmp_path / "remotes")
    remote.commit("train.py", "print('hi')\n")
    http = HTTPRemote(remote.bare.parent, token=TOKEN)
    try:
        url = http.url("train.git").replace("http://", f"http://x-access-token:{TOKEN}@")
        s = stack_factory(PODKIT_REPO_URL=url).start()
        s.wait_step(2)
        assert (s.workspace / "repo" / "train.py").exists()
        run_dir = s.current()["run_dir"]
        env = {**s.env}
        shown = [subprocess.run([*PODKIT, verb], capture_output=True, text=True, env=env, timeout=60).stdout
                 for verb in ("config", "render")]
        assert all(http.url("train.git") in out for out in shown[:1])
        places = {"podkit config": shown[0], "podkit render": shown[1], "boot output": s.stdout(),
                  "podkit.env": open(os.path.join(run_dir, "podkit.env")).read(),
                  ".git/config": (s.workspace / "repo" / ".git" / "config").read_text()}
        for name in ("sglang", "trainer", "watchdog", "logs"):
            pid = s.pid(name)
            places[f"{name} environment"] = open(f"/proc/{pid}/environ", "rb").read().decode(errors="replace")
            places[f"{name} command line"] = open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace")
        places["supervisord environment"] = open(f"/proc/{s.proc.pid}/environ", "rb").read().decode(errors="replace")
        leaked = [where for where, text in places.items() if TOKEN in text]
        assert not leaked, f"the token shows in {leaked}"
        assert s.stop() == 0
    finally:
        http.close()
    assert not [c for c in http.seen_cmdlines if TOKEN in c]


def test_the_config_keeps_the_clean_url_and_the_token_apart():
    cfg = config.load(environ={"PODKIT_REPO_URL": f"https://me:{TOKEN}@git.example.com/team/train.git",
                               "PODKIT_WORKSPACE": "/workspace"})
    assert cfg.repo.url == "https://git.example.com/team/train.git"
    assert cfg.secrets == {"repo.user": "me", "repo.token": TOKEN}
    assert TOKEN not in repr(cfg.as_env()) and TOKEN not in repr(cfg.as_dict())


@pytest.mark.parametrize("url", [f"ssh://git:{TOKEN}@git.example.com/team/train.git",
                                 f"git://me:{TOKEN}@git.example.com:9418/train.git"])
def test_a_password_in_a_url_git_cannot_pass_it_to_is_a_config_error_that_does_not_show_it(url, tmp_path):
    """An ssh (or git://) URL is not split by https's rule: its password was kept in the URL, rendered and
    logged. git gives such a password to nobody: a config error, exit 2, the password in no output."""
    from podkit.errors import ConfigError

    with pytest.raises(ConfigError, match="with a password in it") as e:
        config.load(environ={"PODKIT_REPO_URL": url, "PODKIT_WORKSPACE": "/workspace"})
    assert TOKEN not in str(e.value) and TOKEN not in e.value.hint and "git.example.com" in e.value.hint
    r = subprocess.run([*PODKIT, "config"], capture_output=True, text=True, timeout=30,
                       env={"PATH": os.environ["PATH"], "PODKIT_REPO_URL": url, "PODKIT_WORKSPACE": str(tmp_path)})
    assert r.returncode == 2 and TOKEN not in r.stdout + r.stderr and "Traceback" not in r.stderr, r.stderr


@pytest.mark.parametrize("value, why", [
    (f"https://bob:{TOKEN}@github.com/x/y", "credentials inside a URL"),
    ("  hf_abcdefghijklmnopqrstu  ", "starts with hf_"),
    ('"sk-proj-abcdefghijklmnop"', "starts with sk-"),
    ("github_pat_11ABCDEFG0123456789", "starts with github_pat_"),
    ("rpa_ABCDEFGHIJKLMNOP", "starts with rpa_"),
    ("AKIAABCDEFGHIJKLMNOP", "starts with AKIA"),
    # Beside a RunPod secret reference, what is written literally is still read: the reference exempts
    # only itself.
    (f"https://{TOKEN}:{{{{ RUNPOD_SECRET_GIT_PASSWORD }}}}@github.com/x/y", "a token as a URL's user"),
    ("https://{{ RUNPOD_SECRET_GIT_USER }}:hunter2hunter2@github.com/x/y", "credentials inside a URL"),
    ("hf_abcdefghijklmnopqrstu {{ RUNPOD_SECRET_HF_TOKEN }}", "hf_... beside a RunPod secret reference"),
    ("{{ RUNPOD_SECRET_HF_USER }}:a1b2c3d4e5f6a7b8c9d0e1f2", "a literal value under HF_TOKEN"),
    ("{{ RUNPOD_SECRET_HF_USER }}:hunter2", "a literal value under HF_TOKEN"),
    ("abcdefghijklmnopqrstuvwx==", "a literal value under HF_TOKEN"),  # padding is part of the value
    # Whatever its length: the rule for a literal under a secret name is not a guess at entropy.
    ("hunter2pass", "a literal value under HF_TOKEN"),
    ("pw", "a literal value under HF_TOKEN"),
])
def test_deploy_refuses_a_literal_secret_in_the_template(tmp_path, value, why):
    tpl = tmp_path / "t.yaml"
    tpl.write_text((ROOT / "runpod" / "template.yaml").read_text().replace(
        'HF_TOKEN: "{{ RUNPOD_SECRET_HF_TOKEN }}"', f"HF_TOKEN: {value!r}"))
    from podkit.errors import ConfigError

    with pytest.raises(ConfigError, match=why):
        load_template(tpl)


@pytest.mark.parametrize("name, value", [("HF_TOKEN", "{{ RUNPOD_SECRET_HF_TOKEN }}"), ("GIT_TOKEN", ""),
                                         ("PODKIT_REPO_REF", "main"),
                                         ("PODKIT_CONFIG", "/opt/podkit/configs/a40-1gpu.yaml"),
                                         ("PODKIT_REPO_URL", "https://github.com/x/y.git"),
                                         ("PODKIT_REPO_URL", "https://x-access-token:{{ RUNPOD_SECRET_GH }}@github.com/x/y"),
                                         ("PODKIT_REPO_URL", "https://{{ RUNPOD_SECRET_GH }}@github.com/x/y"),
                                         ("PODKIT_NOTIFY_WEBHOOK_URL", "https://hooks.example.com/{{ RUNPOD_SECRET_HOOK }}"),
                                         ("AUTH_TOKEN", "Bearer {{RUNPOD_SECRET_A}}"),
                                         ("HF_TOKEN", "{{ RUNPOD_SECRET_hf-token.v2 }}"),
                                         ("TOKENIZERS_PARALLELISM", "false"), ("MAX_TOKENS", "4096"),
                                         ("HF_TOKEN_PATH", "/workspace/hf/token")])
def test_deploy_accepts_references_and_plain_values(name, value):
    assert literal_secret(value, name) == ""


def test_a_short_literal_sglang_api_key_is_refused_by_deploy(tmp_path):
    """SGLANG_API_KEY: hunter2pass (11 characters) in the template is a literal secret RunPod would show in
    the pod's settings: refused, exit 2, naming the key and the reference to use instead."""
    tpl = tmp_path / "t.yaml"
    tpl.write_text((ROOT / "runpod" / "template.yaml").read_text() + "  SGLANG_API_KEY: hunter2pass\n")
    r = subprocess.run([*PODKIT, "deploy", "--template", str(tpl), "--dry-run"], capture_output=True, text=True,
                       timeout=60, env={"PATH": os.environ["PATH"], "HOME": str(tmp_path)})
    assert r.returncode == 2 and "env.SGLANG_API_KEY" in r.stderr and "hunter2pass" not in r.stderr, r.stderr
    assert "RUNPOD_SECRET_SGLANG_API_KEY" in r.stderr and "Traceback" not in r.stderr


def test_the_sglang_api_key_reaches_sglang_through_a_private_file_not_its_command_line(tmp_path):
    """SGLANG_API_KEY goes into a 0600 YAML file in the run dir that argv names with --config (SGLang's
    launcher merges it in-process); the key is on no command line and not in SGLang's environment.
    tests/trainer/test_validate.py runs SGLang's own merge on that file."""
    cfg = config.load(ROOT / "configs" / "a40-4gpu.yaml",
                      environ={"PODKIT_WORKSPACE": str(tmp_path), "PODKIT_RUN_DIR": str(tmp_path / "run"),
                               "PODKIT_INFERENCE_HOST": "0.0.0.0"})
    (tmp_path / "run").mkdir(mode=0o700)
    environ = {"SGLANG_API_KEY": 'k-"quoted"-123456'}
    path = sglang.write_secrets(cfg, environ)
    argv = sglang.command(cfg, environ=environ, secrets_file=path)
    assert argv[argv.index("--config") + 1] == path and not [a for a in argv if "123456" in a]
    assert os.stat(path).st_mode & 0o777 == 0o600
    import yaml

    assert yaml.safe_load(open(path)) == {"api-key": 'k-"quoted"-123456'}
    assert sglang.write_secrets(cfg, {}) is None and "--config" not in sglang.command(cfg, environ={})


@pytest.mark.timeout(30)
def test_sglang_printing_its_api_key_at_start_up_reaches_the_logs_masked(tmp_path):
    """SGLang logs `server_args=ServerArgs(..., api_key='<key>')` (entrypoints/engine.py:648). With a
    key, `podkit run sglang` stays its parent and masks the key in what it passes on; SIGTERM reaches
    SGLang and its exit status comes back."""
    import signal
    import subprocess
    import sys
    import time

    key = "sk-live-0123456789abcdef"
    fake_sglang = ("import signal, sys, time\n"
                   "signal.signal(signal.SIGTERM, lambda *_: sys.exit(3))\n"
                   f"print(\"server_args=ServerArgs(model_path='m', api_key='{key}', port=1)\", flush=True)\n"
                   "print('The server is fired up and ready to roll!', flush=True)\n"
                   "time.sleep(60)\n")
    runner = ("import sys; from podkit.programs.sglang import run_masked; "
              f"sys.exit(run_masked([sys.executable, '-c', {fake_sglang!r}], {{}}, {key!r}))")
    p = subprocess.Popen([sys.executable, "-c", runner], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        first = p.stdout.readline().decode()
        second = p.stdout.readline().decode()
        time.sleep(0.2)
        p.send_signal(signal.SIGTERM)
        rest = p.communicate(timeout=20)[0].decode()
    finally:
        if p.poll() is None:
            p.kill()
    assert "api_key='***'" in first and key not in first + second + rest
    assert "fired up" in second
    assert p.returncode == 3
