"""The adversarial pass over rclone's secrets (issue 56): an AWS secret holding '/' in s3://KEY:SECRET@bucket was read
as a bucket name and shown in 14 places; an unquoted endpoint URL in a connection string ended its parameters at its
':' and put secret_access_key into rclone's argv; a remote with parameters rclone does not read, or a quote never
closed, was shown whole."""

from __future__ import annotations

import subprocess

import pytest

from conftest import PODKIT, free_port, smoke_env
from podkit import rclonesecrets, remote
from podkit.redact import Redactor

pytestmark = pytest.mark.timeout(60)
AWS_SECRET = "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY"
UNQUOTED = ":s3,provider=Minio,endpoint=http://127.0.0.1:60531,access_key_id=AKIA1234,secret_access_key=unquoted0123:b/p"


@pytest.mark.parametrize("url,secret", [
    (f"s3://AKIAIOSFODNN7EXAMPLE:{AWS_SECRET}@ckpts/runs", AWS_SECRET),
    (UNQUOTED, "unquoted0123"),
    ("b2x,account=acc,key=K005SECRETVALUEq", "K005SECRETVALUEq"),
    ('b2x,account=acc,key="K005SECRETVALUEq', "K005SECRETVALUEq"),
])
def test_a_remote_rclone_would_misread_is_refused_and_its_secret_shown_nowhere(url, secret):
    shown = rclonesecrets.shown(url)
    assert secret not in shown, shown
    with pytest.raises(ValueError) as e:
        remote.parse(url)
    assert secret not in str(e.value), e.value
    assert secret not in rclonesecrets.redact_text(f"rclone: failed with {url} now")
    assert secret not in Redactor({})(f"PODKIT_CHECKPOINT_REMOTE={url}")


def test_an_unquoted_url_value_is_refused_with_how_to_quote_it_and_a_quoted_one_works():
    with pytest.raises(ValueError, match="must be quoted, e.g. endpoint='http://host:9000'"):
        remote.parse(UNQUOTED)
    where, options = remote.parse(UNQUOTED.replace("endpoint=http://127.0.0.1:60531", "endpoint='http://127.0.0.1:60531'"))
    assert where == "PODKIT_REMOTE:b/p" and options["ENDPOINT"] == "http://127.0.0.1:60531"


@pytest.mark.parametrize("verb", [["config"], ["render"]])
def test_podkit_config_and_render_with_such_a_remote_echo_no_secret(tmp_path, verb):
    env = smoke_env(tmp_path / "ws", free_port(), PODKIT_CHECKPOINT_REMOTE=f"s3://AKIAIOSFODNN7EXAMPLE:{AWS_SECRET}@b/p")
    r = subprocess.run([*PODKIT, *verb], capture_output=True, text=True, env=env, timeout=60)
    assert AWS_SECRET not in r.stdout + r.stderr, r.stdout + r.stderr
