"""What is a secret (rclonesecrets.py, redact.py), where mutation testing (bench/MUTATION.md, issue 56's code) found
the earlier tests silent: most of them reach these rules through `podkit deploy` or rclone in a subprocess, which a
mutant in this process does not change. Here each rule is called as it is, with its whole answer: which variable
and which parameter holds a secret (by the remote's own backend), how a connection string is read and shown, each
message in its words, the forms a secret travels in, and what the Redactor puts in its place."""

from __future__ import annotations

import base64

import pytest

from podkit.redact import Redactor, forms, go_quoted, literal_secret
from podkit.remote import rclonesecrets
from podkit.remote.rclonesecrets import Invalid, redact_text, secret_env, secret_params, shown, split

pytestmark = pytest.mark.timeout(60)
B2 = {"RCLONE_CONFIG_MINE_TYPE": "b2"}  # a remote `mine` of B2: account and key are secret, user is not
REF = "{{ RUNPOD_SECRET_K }}"


# -- which environment variable holds a secret --------------------------------------------------------------------
@pytest.mark.parametrize("name, secret", [
    ("RCLONE_CONFIG_PASS", True), ("rclone_config_pass", True),  # the config file's password, however written
    ("RCLONE_B2_KEY", True), ("RCLONE_S3_SECRET_ACCESS_KEY", True),  # every remote of that backend
    ("RCLONE_B2_ENDPOINT", False), ("RCLONE_S3_REGION", False),  # the backend's options that are not secret
    ("RCLONE_CLIENT_PASS", True), ("RCLONE_TRANSFERS", False),  # rclone's global options
    ("RCLONE_KEY", False), ("B2_KEY", False)])
def test_an_rclone_variable_is_secret_where_its_backend_or_rclone_says_so(name, secret):
    assert secret_env(name) is secret


def test_the_variable_of_a_backends_secret_option_is_secret_without_a_remote_type():
    assert secret_env("RCLONE_CONFIG_PASS", {"RCLONE_CONFIG_PASS_TYPE": "local"}) is True
    assert secret_env("RCLONE_GCS_CLIENT_SECRET") is True  # the prefix of "google cloud storage"


def test_a_backend_named_by_its_name_tells_its_env_prefix_and_secret_options():
    prefix, opts = rclonesecrets.backend("google cloud storage")
    assert prefix == "gcs" and "client_secret" in opts
    assert rclonesecrets.backend(" b2 ")[0] == "b2"
    assert rclonesecrets.backend(None) is None and rclonesecrets.backend("nosuch") is None


# -- which connection-string parameter holds a secret --------------------------------------------------------------
@pytest.mark.parametrize("name, params, environ, want", [
    ("mine", {"type": "b2", "user": "bob", "key": "k"}, None, ["key"]),  # its own type= decides
    ("mine", {"Type": "local", "pass": "p"}, None, []),  # type= in any case
    ("mine", {"pass": "p", "type": "local"}, None, []),  # wherever type= is
    ("mine", {"type": "b2", "user": "bob"}, {"RCLONE_CONFIG_MINE_TYPE": "sftp"}, []),  # over the variable's
    ("mine", {"user": "bob", "key": "k"}, B2, ["key"]),  # else RCLONE_CONFIG_<NAME>_TYPE
    ("mine", {"user": "bob", "key": "k"}, {"rclone_config_mine_type": "b2"}, ["user", "key"]),  # not rclone's name
    ("mine", {"user": "bob", "key": "k"}, None, ["user", "key"]),  # unknown: any backend's
    ("mine", {"user": "bob", "key": "k"}, {"RCLONE_CONFIG_OTHER_TYPE": "b2"}, ["user", "key"]),
    (":local", {"pass": "p"}, None, []),  # an on-the-fly remote: its name
    (":b2", {"user": "bob", "Key": "k", "type": "sftp"}, None, ["Key"]),  # its name over type=
    ("xlocal", {"pass": "p"}, None, ["pass"]),  # a named remote's name is no backend
])
def test_a_connection_strings_secret_parameters_are_its_own_backends(name, params, environ, want):
    assert secret_params(name, params, environ) == want


# -- how rclone reads a connection string --------------------------------------------------------------------------
@pytest.mark.parametrize("remote, want", [
    ("a,k=v:p", ("a", {"k": "v"}, "p")),
    ("a,k=v,j=w:p/q", ("a", {"k": "v", "j": "w"}, "p/q")),
    ("a,flag,k=v:p", ("a", {"flag": "true", "k": "v"}, "p")),  # a parameter alone is true
    ("a,flag:p", ("a", {"flag": "true"}, "p")),
    ("a,k=Xval:p", ("a", {"k": "Xval"}, "p")),
    ("a,k='x',j='y':p", ("a", {"k": "x", "j": "y"}, "p")),  # each quoted value ends at its own quote
    ("a,k='it''s',j=w:p", ("a", {"k": "it's", "j": "w"}, "p")),  # a doubled quote is one
    ("a,k='a''b''c':p", ("a", {"k": "a'b'c"}, "p")),
    ('a,k="x:y,z":p', ("a", {"k": "x:y,z"}, "p")),
    ("a,k=:p", ("a", {"k": ""}, "p")),
    ("remote:path", None), ("local/path", None),  # no parameters
    (":bad!:path,x", None),  # not a backend's name before the first ','
])
def test_a_connection_string_is_read_into_its_name_parameters_and_path(remote, want):
    assert split(remote) == want


@pytest.mark.parametrize("remote, message", [
    (":bad!,x:y", "':bad!' is not a backend's name (letters, digits, _ . + @ -)"),
    ("a,,x:y", "a: a parameter without a name (rclone: config parameters can't be empty)"),
    ("a,k$=v:y", "a: a parameter name may only hold A-Z a-z 0-9 _ and . (rclone's rule)"),
    (":b2,key", ":b2: parameter key must end with , or : (rclone's rule)"),
    (":b2,key=", ":b2: the value of key must end with , or : (rclone's rule)"),
    (":b2,key=K005secret", ":b2: the value of key must end with , or : (rclone's rule)"),
    ("a,key='K005secret:p", "a: the quoted value of key is not closed (rclone's rule)"),
    ("a,key='K005secret'x:p", "a: after the quoted value of key, rclone expects , or :"),
])
def test_a_connection_string_rclone_refuses_is_invalid_in_words_without_its_value(remote, message):
    with pytest.raises(Invalid) as e:
        split(remote)
    assert str(e.value) == message


# -- a remote as a message shows it --------------------------------------------------------------------------------
@pytest.mark.parametrize("remote, environ, want", [
    ("s3://bucket/a/b", None, "s3://bucket/a/b"),
    ("s3://KEY:sec@ret@bucket/p", None, "s3://<redacted>@bucket/p"),  # all up to the last '@'
    ("s3://KEY@ID:secret@bucket/p", None, "s3://<redacted>@bucket/p"),
    ("s3://tok@bucket/a@b/c", None, "s3://<redacted>@bucket/a@b/c"),  # a user alone; the path's '@' stays
    ("s3://a@b@bucket/p", None, "s3://<redacted>@bucket/p"),
    ("remote:path", None, "remote:path"),
    ("bad!name,key=secret:b", None, "bad!name,<redacted>"),  # parameters rclone does not read
    ('b2x,account=acc,key="K0:b', None, "b2x,<redacted>"),  # one it refuses
    ("b2x,hard_delete,endpoint='http://h:9',note=\"it's\",x=Xval,key=k:b/p", None,
     "b2x,hard_delete,endpoint='http://h:9',note='it''s',x=Xval,key=<redacted>:b/p"),
    ("b2x,a=1,b=x\"y,key=k:b", None, "b2x,a=1,b='x\"y',key=<redacted>:b"),
    ("mine,user=bob,key=k:b", B2, "mine,user=bob,key=<redacted>:b"),  # the remote's own backend decides
    ("mine,user=bob,key=k:b", None, "mine,user=<redacted>,key=<redacted>:b"),
])
def test_a_remote_is_shown_with_its_secrets_taken_out_and_the_rest_as_it_is(remote, environ, want):
    assert shown(remote, environ) == want


@pytest.mark.parametrize("remote, creds", [
    ("s3://KEY:SECRET@bucket/p", True), ("s3://KEY@ID:SECRET@bucket/p", True), ("s3://tok@bucket/p", False),
    ("s3://bucket/p", False), ("s3://bucket/a:b", False)])
def test_an_s3_urls_credentials_are_a_key_and_secret_before_its_last_at(remote, creds):
    assert rclonesecrets.s3_credentials(remote) is creds


@pytest.mark.parametrize("path, value, cut", [
    ("//127.0.0.1:9000/b", "http", True), ("9000,secret_access_key=x:b", "host", True), ("9000,KEY=x:b", "", True),
    ('"service_account","private_key":"k"}', '{"type"', True), ("x", "[1", True), ("x", " {", True),
    ("bucket/p", "", False), ("bucket/a,b", "", False), ("b//c", "", False), ("bucket/lr=0.001,bs=64", "", False),
    ("runs/what?v=2", "", False), ("runs/{a}", "v", False), ("p", "plain", False)])
def test_a_path_that_is_the_rest_of_a_cut_value_is_told_and_a_users_own_path_is_not(path, value, cut):
    assert rclonesecrets.cut_value(path, value) is cut


# -- secrets taken out of any text ---------------------------------------------------------------------------------
@pytest.mark.parametrize("text, want", [
    ("export RCLONE_B2_KEY=abc123 RCLONE_B2_ENDPOINT=e.example",
     "export RCLONE_B2_KEY=<redacted> RCLONE_B2_ENDPOINT=e.example"),
    ('{"RCLONE_CONFIG_PASS": "hunter2secret", "RCLONE_TRANSFERS": "4"}',
     '{"RCLONE_CONFIG_PASS": "<redacted>", "RCLONE_TRANSFERS": "4"}'),
    ("copy to s3://AKIA:se/cret@bucket/p", "copy to s3://<redacted>@bucket/p"),
    ("rclone :b2,account=acc,key=k,user=bob:bucket failed",
     "rclone :b2,account=<redacted>,key=<redacted>,user=bob:bucket failed"),  # an on-the-fly one: its backend's
    ("rclone :local,pass=abc:/p failed", "rclone :local,pass=abc:/p failed"),  # its own backend: none secret
    ("gdrive,pass=hunter2,user=bob:p", "gdrive,pass=<redacted>,user=<redacted>:p"),  # a named one: any backend's
    ("no secret here", "no secret here"),
])
def test_rclones_secrets_in_a_log_line_are_taken_out_and_nothing_else(text, want):
    assert redact_text(text) == want


# -- a secret written literally in a template ---------------------------------------------------------------------
@pytest.mark.parametrize("value, name, environ, why", [
    ("https://bob:hunter2@host/x", "", None, "credentials inside a URL"),
    ("hf_abcdefgX", "", None, "starts with hf_"),  # the shortest key a prefix makes
    ("hf_abcdefg", "", None, ""),
    ("Xghp_0123456789abcdef", "", None, ""),  # a prefix not at the start
    (f"https://bob:hunter2@{REF}/x", "", None, "credentials inside a URL"),
    (f"https://user:pass:{REF}@host/p", "", None, "credentials inside a URL"),  # the password is pass:...
    (f"https://ghp_0123456789abcdef@{REF}/x", "", None, "a token as a URL's user"),
    (f"{REF}:hf_abcdefgX", "", None, "hf_... beside a RunPod secret reference"),
    (f"{REF}:hf_abcdefg", "", None, ""),
    (f"  {REF} ", "GIT_TOKEN", None, ""),
    (":b2,account=acc,key=K005abc:bucket", "", None, "a literal account in an rclone connection string"),
    (":b2,key=XXXX:bucket", "", None, "a literal key in an rclone connection string"),  # a placeholder is one
    (f":b2,key={REF}:bucket", "", None, ""),
    (f":b2,key=\"'{REF}'\":bucket", "", None, ""),  # a reference quoted twice
    ("remote,endpoint=e:p", "", None, ""),
    ("a,key='unclosed:b", "", None, ""),  # rclone refuses it: no parameter of it is read
    ("mine,user=bob:p", "", B2, ""),  # the template's env says the remote's backend
    ("mine,user=bob:p", "", None, "a literal user in an rclone connection string"),
    ("bob", "RCLONE_CONFIG_MINE_USER", B2, ""),
    ("bob", "RCLONE_CONFIG_MINE_USER", None, "a literal value under RCLONE_CONFIG_MINE_USER"),
    (f"user01{REF}", "RCLONE_CONFIG_MINE_USER", B2, ""),
    (f"user01{REF}", "RCLONE_CONFIG_MINE_USER", None, "a literal value under RCLONE_CONFIG_MINE_USER"),
])
def test_a_literal_secret_in_a_template_is_told_with_why(value, name, environ, why):
    assert literal_secret(value, name, environ) == why


# -- the forms a secret travels in ---------------------------------------------------------------------------------
def test_go_quoting_writes_each_character_as_gos_strconv_quote_does():
    assert go_quoted("\a\b\f\n\r\t\v\\\"") == "\\a\\b\\f\\n\\r\\t\\v\\\\\\\""
    assert go_quoted("a b\x00\x7f") == "a b\\x00\\x7f"
    assert go_quoted("\x80\u00e9\u2028\U000e0001\U0001F600") == "\\u0080\u00e9\\u2028\\U000e0001\U0001F600"


def test_a_secrets_forms_are_each_way_a_text_carries_it_longest_first():
    assert forms("ü\n x/") == ["%C3%BC%0A%20x%2F", "%C3%BC%0A+x%2F", "\\u00fc\\n x/", "ü\\n x/", "ü\n x/"]
    assert forms("a\"b") == ["a%22b", "a\\\"b", "a\"b"]
    # JSON with and without ensure_ascii, and Go, each its own form of a control character beside a non-ASCII one
    assert forms("ü\x01") == ["\\u00fc\\u0001", "%C3%BC%01", "ü\\u0001", "ü\\x01", "ü\x01"]


# -- what the Redactor puts in a secret's place ----------------------------------------------------------------
@pytest.mark.parametrize("text, want", [
    ("s3://AKIA:sec/ret@bucket/p", "s3://<redacted>@bucket/p"),
    ("https://bob:hunter2@host/x", "https://<redacted>@host/x"),
    ("https://abcdefghijklmnop1234@github.com/x", "https://<redacted>@github.com/x"),
    ("see ghp_0123456789abcdef here", "see <redacted> here"),
    ("Authorization: Bearer abc.def", "Authorization: Bearer <redacted>"),
    ("password=hunter2", "password=<redacted>"),
    ("RCLONE_B2_KEY=abc123", "RCLONE_B2_KEY=<redacted>"),
])
def test_a_secret_by_its_shape_is_replaced_by_redacted_and_the_rest_kept(text, want):
    assert Redactor({})(text) == want


def test_a_known_secret_is_named_in_its_place_in_every_form_and_whole():
    b64 = base64.b64encode(b"hunter2secret").decode().rstrip("=")
    r = Redactor({"env A": "hunter2secret", "env B": "hunter2secret99"})
    assert r(f"x hunter2secret99 y {b64} z") == "x <redacted: env B> y <redacted: env A> z"
    # a value whose base64 holds + and /: its URL-safe base64 too
    v = "s3cret>>>???"
    std = base64.b64encode(v.encode()).decode()
    assert "+" in std and "/" in std
    assert Redactor({"env K": v})(f"[{std.replace('+', '-').replace('/', '_')}]") == "[<redacted: env K>]"
    # a base64 with its padding left off, and one that ends in a padding-like character
    assert Redactor({"env P": "secret1"})("auth c2VjcmV0MQ.") == "auth <redacted: env P>."
    assert Redactor({"env W": "hunteW"})("[aHVudGVX]") == "[<redacted: env W>]"


def test_a_value_too_short_or_plain_to_be_a_secret_is_left_and_the_others_still_taken_out():
    r = Redactor({"env A": "abc", "env B": "true", "env C": "", "env D": "secret123"})
    assert r("abc true secret123") == "abc true <redacted: env D>"


def test_the_redactors_longest_form_is_the_overlap_a_streaming_reader_needs():
    assert Redactor({}).longest == 0
    assert Redactor({"k": "abcdef"}).longest == 8  # base64 "YWJjZGVm"
