"""The adversarial pass over rclone's secrets (issue 56): an AWS secret holding '/' in s3://KEY:SECRET@bucket was read
as a bucket name and shown in 14 places; an unquoted endpoint URL in a connection string ended its parameters at its
':' and put secret_access_key into rclone's argv; a remote with parameters rclone does not read, or a quote never
closed, was shown whole. Then: rclone's error quoting a secret Go-escaped, and a notification quoting one."""

from __future__ import annotations

import json
import subprocess

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import PODKIT, free_port, smoke_env
from podkit import notify
from podkit.redact import Redactor, go_quoted
from podkit.remote import mover, rclonesecrets, remote

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


def test_rclones_error_quoting_a_secret_go_escaped_shows_it_nowhere(tmp_path):
    """An Azure SAS URL pasted with its line's carriage return: the real rclone refuses it and quotes it with Go's
    %q (`sig=...\\r`), which is not the raw value; the remote's error holds no piece of it."""
    sas = "https://127.0.0.1:9/c?sv=2020&sig=SuperSecretSig123\r"
    env = {"RCLONE_CONFIG_AZ_TYPE": "azureblob", "RCLONE_CONFIG_AZ_SAS_URL": sas, "PATH": "/usr/bin:/bin",
           "HOME": str(tmp_path)}
    r = remote.Remote("az:ckpts", "exp/trial", timeout_s=30, environ=env)
    with pytest.raises(mover.RemoteError) as e:
        r.rclone("lsf", r.base, timeout=30)
    assert "SuperSecretSig123" not in str(e.value) and "***" in str(e.value), e.value


@pytest.mark.parametrize("secret", ["ab\"cd\\ef0123", "tab\there0123", "nul\x00bell\x07x", "ünï\u2028cødé99",
                                    "emoji\U0001f600xyz"])
def test_a_secret_in_any_form_an_error_quotes_it_is_taken_out(secret):
    """The forms a text carries a secret in (raw, JSON, Go's %q, URL-encoded), by the bundle's Redactor and the
    remote's own."""
    import json
    from urllib.parse import quote

    r = remote.Remote.__new__(remote.Remote)
    r.secrets = [secret]
    for form in (secret, go_quoted(secret), json.dumps(secret)[1:-1], quote(secret, safe="")):
        text = f'rclone: parse "{form}": failed'
        assert secret not in r._redact(text) and form not in r._redact(text), (form, r._redact(text))
        said = Redactor({"env RCLONE_CONFIG_AZ_SAS_URL": secret})(text)
        assert form not in said and "<redacted: env RCLONE_CONFIG_AZ_SAS_URL>" in said, said


def test_a_notification_quoting_a_secret_of_the_pods_environment_carries_none(tmp_path):
    """An event's words quote an error (rclone's refusal, a git URL): what reaches the channel has the pod's
    secrets, rclone's by their backend's word, taken out."""
    from test_notify import Receiver

    hook = Receiver()
    env = {notify.ENV: hook.url, "RUNPOD_POD_ID": "pod1", "RCLONE_CONFIG_B2X_TYPE": "b2",
           "RCLONE_CONFIG_B2X_KEY": "K005b2SecretKey77", "RUNPOD_API_KEY": "rpa_NOTAREALKEY0123456789"}
    try:
        t = notify.send("durability", 'rclone: "K005b2SecretKey77" refused; :s3,secret_access_key=plain0123:b; '
                        f"https://user:pw0123456@git.example/r.git; key rpa_NOTAREALKEY0123456789; {hook.url}",
                        None, environ=env)
        t.join(30)
        text = json.dumps(hook.posts)
        assert hook.events() == ["durability"], hook.posts
        for secret in ("K005b2SecretKey77", "plain0123", "pw0123456", "rpa_NOTAREALKEY", "not-a-real-secret"):
            assert secret not in text, (secret, text)
        assert "rclone:" in text and "refused" in text
    finally:
        hook.close()


# The invariant behind the cases above: a secret of 6 characters or more that is no setting word (true, 4096)
# leaves no trace in any form a text carries it in, whatever surrounds it.
_SECRET = st.text(min_size=6, max_size=40).filter(lambda s: s.strip() and not s.strip().isdigit()
                                                    and s.strip().lower() not in ("true", "false", "none", "null"))


@settings(max_examples=300, deadline=None)
@given(secret=_SECRET, before=st.text(max_size=20), after=st.text(max_size=20),
       how=st.sampled_from(["raw", "go", "json", "url"]))
def test_no_form_of_a_secret_survives_redaction(secret, before, after, how):
    import json
    from urllib.parse import quote

    form = {"raw": secret, "go": go_quoted(secret), "json": json.dumps(secret)[1:-1],
            "url": quote(secret, safe="")}[how]
    said = Redactor({"env X_TOKEN": secret})(before + form + after)
    assert form not in said, (form, said)
    r = remote.Remote.__new__(remote.Remote)
    r.secrets = [secret]
    assert form not in r._redact(before + form + after)
