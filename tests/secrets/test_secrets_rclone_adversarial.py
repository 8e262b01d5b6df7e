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
    from webhook import Receiver

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


# -- the second adversarial pass: remotes inside remotes, other schemes, values cut at ':', odd bytes ------------
NESTED_KEY = "K005nestedB2keyQ7"
WRAPPED = {
    "crypt": f":crypt,remote=':b2,account=0012acctNEST77,key={NESTED_KEY}:bucket/ckpts',password=OBSCUREDpw123:",
    "alias": f":alias,remote=':b2,account=0012acctNEST77,key={NESTED_KEY}:bucket':ckpts",
    "chunker": f":chunker,remote=':b2,account=acc0012,key={NESTED_KEY}:bucket':ckpts",
    "union": f":union,upstreams=':b2,account=acc0012,key={NESTED_KEY}:b1 :local:/tmp/x':ckpts",
    "combine": f":combine,upstreams='a=:b2,account=acc0012,key={NESTED_KEY}:b1':ckpts",
}


@pytest.mark.parametrize("kind", sorted(WRAPPED))
def test_a_remote_wrapped_in_another_shows_its_secrets_nowhere(kind):
    """A crypt (alias, chunker, union, combine) over a connection string: the wrapped remote's key is a secret
    wherever the remote is shown, read for the redactors, or written literally in a template."""
    from podkit import config
    from podkit.redact import literal_secret

    url = WRAPPED[kind]
    assert NESTED_KEY not in rclonesecrets.shown(url), rclonesecrets.shown(url)
    assert NESTED_KEY in config.remote_secrets(url, {}).values()
    assert NESTED_KEY not in rclonesecrets.redact_text(f"rclone: failed: {url} and more")
    assert literal_secret(url.replace("OBSCUREDpw123", "{{ RUNPOD_SECRET_PW }}"), "PODKIT_CHECKPOINT_REMOTE", {})
    inner = f":b2,account=0012acctNEST77,key={NESTED_KEY}:bucket/ckpts"  # RCLONE_CONFIG_X_REMOTE of a crypt X
    for env in ({"RCLONE_CONFIG_X_TYPE": kind, "RCLONE_CONFIG_X_REMOTE": inner}, {"PODKIT_CHECKPOINT_REMOTE": url}):
        said = Redactor.for_pod(object(), env)(f"error: {NESTED_KEY}")
        assert NESTED_KEY not in said, said


def test_a_go_quoted_value_in_rclones_words_is_taken_out_whole():
    """rclone quotes a wrapped remote's value Go-escaped: `pass=\\"Kq,PART2secretB2\\":x` is read to its closing
    quote, not to the backslash."""
    said = rclonesecrets.redact_text('remote ":sftp,host=127.0.0.1,pass=\\"Kq,PART2secretB2\\":x" failed')
    assert "PART2secretB2" not in said and "Kq" not in said, said


@pytest.mark.parametrize("url,secret", [
    ("b2://0012keyid:AppKeySecret0123zz@bucket/ckpts", "AppKeySecret0123zz"),
    ("S3://AKIAKEYID000:wJalrXUtnFEMI/K7MDENG@bucket/p", "wJalrXUtnFEMI"),
    ("https://bob:DAVpassW0rd1234@dav.example.com/dav", "DAVpassW0rd1234"),
    (":webdav,url='https://bob:DAVpassW0rd1234@dav.example.com/remote.php/dav',vendor=nextcloud:ckpts",
     "DAVpassW0rd1234"),
])
def test_credentials_in_a_url_of_any_scheme_are_shown_nowhere(url, secret):
    from podkit.redact import literal_secret

    assert secret not in rclonesecrets.shown(url)
    assert secret not in Redactor({})(f"PODKIT_CHECKPOINT_REMOTE={url}")
    assert literal_secret(url), url  # and deploy refuses it written in a template
    assert secret not in rclonesecrets.redact_text(f"rclone said {url}")
    try:
        remote.parse(url)
    except ValueError as e:
        assert secret not in str(e), e


def test_a_value_cut_at_its_unquoted_colon_is_refused_and_shown_without_the_rest():
    """A service account's JSON, or a SAS URL, unquoted: rclone would end the value at its first ':' and take the
    rest (the private key, the signature) as the path, into its argv."""
    gcs = (":gcs,service_account_credentials=" + json.dumps({"type": "service_account", "private_key":
           "-----BEGIN PRIVATE KEY-----\nMIIEsecretPK\n"}) + ":bucket/ckpts")
    sas = ":azureblob,sas_url=https://acct.blob.core.windows.net/c?sv=2024-01-01&sp=rwdl&sig=SIGsecretQw3rTy0123%3D:c"
    for url, secret in ((gcs, "MIIEsecretPK"), (sas, "SIGsecretQw3rTy")):
        assert secret not in rclonesecrets.shown(url), rclonesecrets.shown(url)
        with pytest.raises(ValueError, match="must be quoted") as e:
            remote.parse(url)
        assert secret not in str(e.value)


def test_a_secret_with_a_byte_that_is_not_utf8_breaks_no_redaction():
    """One secret-named variable with a byte that is not UTF-8 (os.fsdecode keeps it as a surrogate): the
    Redactor still takes every secret out, the B2 key beside it too."""
    import os as _os

    env = {"RCLONE_CONFIG_B_TYPE": "b2", "RCLONE_CONFIG_B_KEY": "K005realB2keyXYZ123",
           "LEGACY_TOKEN": _os.fsdecode(b"tok\xffen12345")}
    said = notify._redacted("key K005realB2keyXYZ123 and tok\udcffen12345", env)
    assert "K005realB2keyXYZ123" not in said and "en12345" not in said, said


def test_rclones_config_password_is_a_secret_whatever_it_looks_like():
    from podkit.redact import literal_secret

    assert literal_secret("40817263", "RCLONE_CONFIG_PASS", {})
    assert "40817263" not in Redactor.for_pod(object(), {"RCLONE_CONFIG_PASS": "40817263"})("pass 40817263")
    assert literal_secret("4096", "MAX_TOKENS", {}) == ""  # a setting under a secret-sounding name stays one


def test_only_the_type_variable_rclone_reads_decides_a_remotes_backend():
    """The environment is case-sensitive: `rclone_config_b2x_type=local` is no variable rclone reads."""
    env = {"rclone_config_b2x_type": "local", "RCLONE_CONFIG_B2X_TYPE": "b2"}
    assert rclonesecrets.secret_env("RCLONE_CONFIG_B2X_KEY", env)
    assert rclonesecrets.secret_params("b2x", {"key": "x"}, env) == ["key"]


# -- the third attack: upstreams as rclone reads them, a cut value one level down, and no false refusal ----------
@pytest.mark.parametrize("url", [
    ":union,upstreams='\":gcs,service_account_credentials=''{\"\"private_key\"\": \"\"PKSECRET0123\"\"}'':bkt\" /tmp/x':",
    ":union,upstreams='\":b2,account=A1,key=PKSECRET0123:bucket\" /tmp/x':",
    ":combine,upstreams='my+docs=:b2,account=A1,key=PKSECRET0123:b':",
    ":union,upstreams=':b2,account=A1,key=PKSECRET0123:b1:ro /tmp/x:nc':",
])
def test_a_union_or_combine_upstream_is_read_as_rclone_reads_it(url):
    """rclone reads `upstreams` as space-separated fields, each maybe double-quoted (holding spaces), a combine's as
    dir=remote:path with any dir name: the wrapped remote's secret is found there, shown nowhere, refused literal."""
    from podkit.redact import literal_secret

    assert "PKSECRET0123" in " ".join(v for _, v in rclonesecrets.secret_values(url))
    assert "PKSECRET0123" not in rclonesecrets.shown(url), rclonesecrets.shown(url)
    assert literal_secret(url, "PODKIT_CHECKPOINT_REMOTE", {})


def test_a_value_cut_inside_a_wrapped_remote_is_refused_before_rclone_can_echo_it():
    url = ":crypt,password=x0bscured,remote=':azureblob,sas_url=http://127.0.0.1:9/c?sv=2020&sig=SIGSECRET9:':"
    with pytest.raises(ValueError, match="must be quoted") as e:
        remote.parse(url)
    assert "SIGSECRET9" not in str(e.value) and "SIGSECRET9" not in rclonesecrets.shown(url)


@pytest.mark.parametrize("url", [":local,case_insensitive=false:/tmp/hive/lr=0.001,bs=64",
                                 ":s3,provider=AWS,env_auth=true:bucket/runs/what?v=2",
                                 ":s3,provider=AWS,env_auth=true:bucket/runs/{a}/\"b\""])
def test_a_path_rclone_takes_is_not_refused_as_a_cut_value(url):
    remote.parse(url)


@pytest.mark.parametrize("value", ["https://files.example.com:8443/shared/alice@example.com/data.tar",
                                   "git+https://git.corp.example:8443/ml/lib.git@v1.2.0",
                                   ":webdav,url='https://dav.example.com:8443/remote.php/dav/files/alice@example.com',"
                                   "pass='{{ RUNPOD_SECRET_DAV }}':ckpts"])
def test_a_url_with_a_port_and_an_at_in_its_path_holds_no_credentials(value):
    """Go's URL parser ends the host part at the first '/': host:8443/.../alice@example.com has no user."""
    from podkit.redact import literal_secret

    assert literal_secret(value, "DATA_URL", {}) == "" and literal_secret(value, "PODKIT_CHECKPOINT_REMOTE", {}) == ""
    url = value if value.startswith(("http", "git")) else value.split("'")[1]
    assert url in rclonesecrets.shown(value) and url in rclonesecrets.redact_text(value)


def test_a_reference_after_a_space_is_unquoted_too():
    assert rclonesecrets.unquoted_reference(":gcs,service_account_credentials= {{ RUNPOD_SECRET_SA }}:bkt") == \
        "service_account_credentials"
    assert rclonesecrets.unquoted_reference(":gcs,service_account_credentials='{{ RUNPOD_SECRET_SA }}':bkt") == ""
