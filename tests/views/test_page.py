"""The run at a glance (podkit run page), as a person sees it: a real run of the smoke stack (a failure after
progress, then a restart) drawn in a real headless browser after a login through the browser itself; the token
tried from outside with plain HTTP; a `<script>` planted in the user's exception shown as text and never run.
Beside them, the history record's bound and the config's rule. The browser is Debian's chromium (`make
sysdeps` installs it); the screenshot is kept in pytest's temp dir (docs/testing.md)."""

from __future__ import annotations

import http.client
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from chromium import CHROMIUM, browser
from conftest import PODKIT, Procs, Stack, smoke_env, wait_for
from harness import free_port
from podkit import records
from podkit.views import page, pageview

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240), pytest.mark.xdist_group("page")]

TOKEN = "page-token-5f0c2a9e71d84b36"  # 16+ visible ASCII characters, as the check wants
PLANTED = "<script>document.title='pwned'</script><img src=x onerror=\"document.title='pwned-img'\">"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One smoke run for the module: its trainer fails once at step 6 (after progress: restarted at once, resumed
    from its checkpoint at step 5), then trains on; the page on its own port, behind TOKEN."""
    procs = Procs()
    root = tmp_path_factory.mktemp("page")
    s = Stack(procs, root / "ws", FAKE_TRAINER_FAIL_AT_STEP="6:once", PODKIT_PAGE_TOKEN=TOKEN,
              PODKIT_TRAINER_CHECKPOINT_EVERY="5")
    s.page_port = int(s.env["PODKIT_PAGE_PORT"])
    s.root = root
    try:
        s.start()
        wait_for(lambda: (s.progress().get("step") or 0) >= 14 and s.status()["programs"]["trainer"]["restarts"] >= 1,
                 120, what="the trainer to fail once at step 6, restart and reach step 14")
        wait_for(lambda: "serving the run at a glance" in s.log("page"), 30, what="the page to listen")
        yield s
    finally:
        if s.proc and s.proc.poll() is None:
            s.stop()
        procs.cleanup()


def request(s, method: str, path: str, body: str = "", headers: dict | None = None) -> http.client.HTTPResponse:
    c = http.client.HTTPConnection("127.0.0.1", s.page_port, timeout=30)
    c.request(method, path, body=body or None, headers=headers or {})
    r = c.getresponse()
    r.body = r.read()
    c.close()
    return r


def login(s, token: str = TOKEN) -> http.client.HTTPResponse:
    return request(s, "POST", "/login", f"token={token}", {"Content-Type": "application/x-www-form-urlencoded"})


def browser_login(s, profile: Path) -> None:
    """A person's login, done by the browser: the page's own form (its action, method and field, read from the
    login page) filled with the token and submitted. The answer's cookie lands in the profile's jar."""
    form = request(s, "GET", "/").body.decode()
    m = re.search(r'<form method="(\w+)" action="([^"]+)">.*?<input type="password" name="(\w+)"', form, re.S)
    assert m, form
    method, action, field = m.groups()
    helper = profile.parent / "login.html"
    helper.write_text(f'<!doctype html><form method="{method}" action="http://127.0.0.1:{s.page_port}{action}">'
                      f'<input name="{field}" value="{TOKEN}"></form><script>document.forms[0].submit()</script>')
    browser(profile, "--virtual-time-budget=5000", "--dump-dom", helper.as_uri())
    wait_for(lambda: "a login: a new session" in s.log("page"), 10, what="the page to take the browser's login")


@pytest.fixture(scope="module")
def profile(run):
    if not CHROMIUM:  # `make test` installs it: in CI a missing browser is a failure, not a skip
        (pytest.fail if os.environ.get("CI") else pytest.skip)("chromium is not installed: `make sysdeps` installs "
                                                               "Debian's (as root)")
    p = run.root / "chromium-profile"
    browser_login(run, p)
    return p


def test_a_person_logs_in_and_sees_the_run_its_pictures_and_its_failure_in_a_browser(run, profile,
                                                                                       tmp_path_factory):
    """After a login through the browser, the page in a real chromium shows the step the trainer is at, the
    pictures with a point per step drawn and the restart and the failure marked on the step axis, the failure in
    the script's own words, the programs, and the start-up; a screenshot is kept."""
    dom = browser(profile, "--dump-dom", f"http://127.0.0.1:{run.page_port}/")
    assert "log in" not in dom.split("</title>")[0], dom[:2000]
    step = run.progress()["step"]
    facts = dict(re.findall(r"<dt>(.*?)</dt><dd>(.*?)</dd>", dom))
    shown = int(facts["step"])
    assert 14 <= shown <= step, facts  # the step a person came for: the trainer's, as of the page's read
    lines = (run.workspace / ".podkit" / "history.jsonl").read_text().splitlines()
    assert len(lines) >= shown  # a line per step the trainer made, the resumed ones again
    counts = [int(n) for n in re.findall(r'<polyline class="line" data-points="(\d+)"', dom)]
    # loss and step time, a point per step at this length (step time: not across the restart, nor before step 2)
    assert len(counts) == 2 and counts[0] >= shown and counts[1] >= shown - 2, (counts, shown)
    points = re.findall(r'<polyline class="line" data-points="\d+" points="([^"]+)"', dom)[0].split()
    assert len(points) == counts[0] and all(re.fullmatch(r"[\d.]+,[\d.]+", p) for p in points)
    assert 'class="m-restart"' in dom and 'class="m-fail"' in dom, "the restart and the failure on the step axis"
    assert "injected failure at step 6 (FAKE_TRAINER_FAIL_AT_STEP)" in dom, "the failure in the script's own words"
    for program in ("trainer", "sglang", "page"):
        assert f"<td>{program}</td><td>RUNNING</td>" in dom
    assert "Start-up" in dom and "first step" in dom and "<script" not in dom.lower()
    # a phone's width and a laptop's, kept as the test's artefacts (PODKIT_DOCS_SHOTS=docs/img: the docs' copies)
    shots = tmp_path_factory.mktemp("page-artefacts")
    for width, height in ((412, 2600), (1280, 1800)):
        shot = shots / f"page-{width}.png"
        browser(profile, f"--screenshot={shot}", f"--window-size={width},{height}", "--hide-scrollbars",
                f"http://127.0.0.1:{run.page_port}/")
        assert shot.stat().st_size > 10_000 and png_size(shot) == (width, height), png_size(shot)
        if os.environ.get("PODKIT_DOCS_SHOTS"):
            shutil.copy(shot, Path(os.environ["PODKIT_DOCS_SHOTS"]) / shot.name)
        print(f"screenshot: {shot}")


def png_size(path: Path) -> tuple[int, int]:
    """A PNG's width and height, from its IHDR chunk."""
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", head
    return int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")


def test_the_pages_token_is_in_the_page_programs_hands_alone(run):
    """The token was in the environment of every program supervisord runs, the user's trainer among them: now the
    render stage hands it to the page alone (a 0600 file in the run dir), and the login still takes it."""
    for name in ("trainer", "sglang", "watchdog"):
        environ = open(f"/proc/{run.pid(name)}/environ", "rb").read().split(b"\0")
        assert not any(e.startswith(b"PODKIT_PAGE_TOKEN=") for e in environ), name
        assert TOKEN.encode() not in b"\0".join(environ), name
    from podkit.boot import render

    held = run.env.get("PODKIT_RUN_DIR")
    files = [p for p in ([Path(held)] if held else []) if (p / render.PAGE_TOKEN_FILE).exists()]
    assert all(os.stat(p / render.PAGE_TOKEN_FILE).st_mode & 0o077 == 0 for p in files)
    assert login(run).status == 303


def test_without_the_token_the_page_answers_nothing_and_a_token_in_a_url_is_refused_and_never_logged(run):
    """No cookie, a wrong token, a forged or lapsed cookie: the login form and nothing of the run. A token in a
    query string: refused, and in no log. The right token: an HttpOnly SameSite=Strict cookie that is not the token,
    and the page. Every answer carries the strict policy."""
    for r in (request(run, "GET", "/"), request(run, "GET", "/", headers={"Cookie": "podkit_page=9999999999.00"}),
              request(run, "GET", "/", headers={"Cookie": f"podkit_page={page.Session(TOKEN).cookie(now=1e9)}"})):
        assert r.status == 401 and b"<form" in r.body and b"step" not in r.body and b"<svg" not in r.body, r.body[:300]
    wrong = login(run, TOKEN[:-1] + "x")
    assert wrong.status == 401 and wrong.getheader("Set-Cookie") is None
    queried = [request(run, "GET", f"/?token={TOKEN}"), request(run, "GET", f"/login?token={TOKEN}"),
               request(run, "POST", f"/login?token={TOKEN}", "x=1", {"Content-Type": "application/x-www-form-urlencoded"})]
    assert {r.status for r in queried} == {400} and all(TOKEN.encode() not in r.body for r in queried)
    ok = login(run)
    cookie = ok.getheader("Set-Cookie")
    assert ok.status == 303 and ok.getheader("Location") == "/", ok.status
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and TOKEN not in cookie, cookie
    page_ = request(run, "GET", "/", headers={"Cookie": cookie.split(";")[0]})
    assert page_.status == 200 and b"<svg" in page_.body
    for r in (*queried, wrong, ok, page_, request(run, "GET", "/nowhere"), request(run, "PUT", "/")):
        csp = r.getheader("Content-Security-Policy") or ""
        assert "default-src 'none'" in csp and "script-src" not in csp and "frame-ancestors 'none'" in csp, r.status
        assert r.getheader("X-Content-Type-Options") == "nosniff" and r.getheader("Referrer-Policy") == "no-referrer"
    wait_for(lambda: "refused a request with a query string (GET /)" in run.log("page"), 10, what="the refusal said")
    logs = [*(run.workspace / "logs").rglob("*.log*"), run.out_path]
    leaked = [str(p) for p in logs if TOKEN.encode() in p.read_bytes()]
    assert not leaked, f"the token is written in {leaked}"


def test_a_script_planted_in_the_users_exception_is_shown_as_text_and_never_runs(run, profile):
    """The trainer stopped, its record says it failed with a `<script>` (and an `<img onerror>`) in the script's
    message: the browser's DOM holds them as text, the title is the page's own, no element of them exists."""
    run.rpc().supervisor.stopProcess("trainer", True)
    rec = records.PROGRESS.read(run.workspace / ".podkit")
    rec["stopped"] = {"by": "script-error", "time": time.time(), "step": rec.get("step"), "message": PLANTED,
                      "hint": "fix </p><script>alert(1)</script>"}
    records.PROGRESS.write(run.workspace / ".podkit", rec)
    dom = browser(profile, "--dump-dom", f"http://127.0.0.1:{run.page_port}/")
    title = re.search(r"<title>(.*?)</title>", dom).group(1)
    assert title == "ws: stopped", title
    assert "<script" not in dom.lower() and "<img" not in dom.lower()
    assert "&lt;script&gt;document.title='pwned'&lt;/script&gt;" in dom  # shown, as text
    assert "fix </p>" not in dom and "fix &lt;/p&gt;&lt;script&gt;alert(1)&lt;/script&gt;" in dom


# -- without a stack ---------------------------------------------------------------------------------------------


class Small(records.History):
    MAX_LINES = 40


@pytest.mark.timeout(60)
def test_a_long_run_keeps_a_bounded_history_along_all_its_steps_with_its_last_steps_whole(tmp_path):
    """Past its bound the history is compacted: never more lines than the bound, the first step kept, the older
    steps thinned to a stride (never denser than newer ones, no hole wider than a run this long needs), the last
    steps one by one."""
    h = Small()
    for step in range(1, 1001):
        assert h.append(tmp_path, step, 0.5, 1.0 / step, now=1.7e9 + step)
        assert len((tmp_path / "history.jsonl").read_bytes().splitlines()) <= Small.MAX_LINES
    steps = [p[0] for p in h.read(tmp_path)]
    assert steps[0] == 1 and steps[-10:] == list(range(991, 1001))
    gaps = [b - a for a, b in zip(steps[1:], steps[2:], strict=False)]
    assert gaps == sorted(gaps, reverse=True) and max(gaps) <= 4 * 1000 // Small.MAX_LINES, steps


@pytest.mark.timeout(30)
def test_a_history_of_repeated_step_zero_lines_is_compacted_and_the_append_returns(tmp_path):
    """Lines that are all step 0 (written by something else) are kept at every stride: the compaction must still
    end, and the file stay bounded by what it can thin."""
    h = Small()
    assert all(h.append(tmp_path, 0, 0.1, 0.2) for _ in range(3 * Small.MAX_LINES))
    assert h.append(tmp_path, 1, 0.1, 0.2)


@pytest.mark.timeout(60)
def test_a_corrupt_huge_history_is_read_bounded_and_its_bad_lines_skipped(tmp_path):
    """50 MB of junk, a torn line, a line of the wrong shape, a NaN loss: the reader takes the last 2 MiB only,
    skips what is not a step, keeps the NaN; the page still draws and stays small."""
    p = tmp_path / "history.jsonl"
    with open(p, "wb") as f:
        f.write(b"x" * (50 << 20) + b"\n")
        for step in range(1, 2001):
            f.write(json.dumps({"step": step, "time": 1.7e9 + step, "reward": 0.1, "loss": 1.0}).encode() + b"\n")
        f.write(b'{"step": "7", "time": 1}\n{"step": 2001, "time": 1700002001, "reward": null, "loss": NaN}\n')
        f.write(b'{"step": 2002, "ti')
    t0 = time.perf_counter()
    pts = records.HISTORY.read(tmp_path)
    assert time.perf_counter() - t0 < 2.0
    assert [x[0] for x in pts] == list(range(1, 2002)) and pts[-1][2] is None and pts[-1][3] != pts[-1][3]
    assert repr(page.HistoryCache(p).get()) == repr(pts)
    svg = pageview.chart("loss", [(x[0], x[3]) for x in pts], 1, 2001, [])
    assert 'data-points="210"' in svg and len(svg) < 20_000


@pytest.mark.timeout(60)
def test_a_history_that_cannot_be_written_is_said_once_and_training_goes_on(tmp_path, capsys):
    """An append that fails (here the record's name is a directory) returns False, raises nothing, and is logged
    once however many steps follow."""
    (tmp_path / "history.jsonl").mkdir()
    h = records.History()
    assert not any(h.append(tmp_path, step, 0.1, 0.2) for step in range(1, 6))
    assert capsys.readouterr().out.count("cannot append to") == 1


@pytest.mark.timeout(60)
def test_the_pages_token_never_keeps_a_pod_from_training_and_without_a_usable_one_the_page_stays_on_loopback(tmp_path):
    """page.host 0.0.0.0 with no PODKIT_PAGE_TOKEN, RunPod's reference left unfilled (a secret never created) or a
    short one: the boot goes on and says the page stays on 127.0.0.1 (a short one on loopback: no login, said);
    a token of 16+ characters: served as asked, nothing said."""
    for i, (host, token, said) in enumerate((
            ("0.0.0.0", "", "on 127.0.0.1 only, not 0.0.0.0: PODKIT_PAGE_TOKEN is not set"),
            ("0.0.0.0", "{{ RUNPOD_SECRET_PODKIT_PAGE_TOKEN }}", "PODKIT_PAGE_TOKEN is RunPod's secret reference, not filled in"),
            ("0.0.0.0", "short", "on 127.0.0.1 only, not 0.0.0.0: PODKIT_PAGE_TOKEN is 5 characters; 16 or more"),
            ("127.0.0.1", "short", "without a login: PODKIT_PAGE_TOKEN is 5 characters; 16 or more are needed"))):
        env = smoke_env(tmp_path / f"ws{i}", free_port(), PODKIT_PAGE_HOST=host, PODKIT_PAGE_TOKEN=token)
        r = subprocess.run([*PODKIT, "preflight"], env=env, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and said in r.stdout + r.stderr, (token, r.stdout + r.stderr)
    assert page.endpoint("0.0.0.0", "") == page.endpoint("0.0.0.0", "{{RUNPOD_SECRET_PODKIT_PAGE_TOKEN_X}}") == \
        page.endpoint("0.0.0.0", "short") == "127.0.0.1"
    env = smoke_env(tmp_path / "ok", free_port(), PODKIT_PAGE_HOST="0.0.0.0", PODKIT_PAGE_TOKEN=TOKEN)
    r = subprocess.run([*PODKIT, "preflight"], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "the page is served" not in r.stdout + r.stderr, r.stderr
    assert page.endpoint("0.0.0.0", TOKEN) == "0.0.0.0"


@pytest.mark.timeout(60)
def test_a_page_without_a_token_answers_its_own_machine_only_and_a_forged_form_is_refused_in_one_line(tmp_path):
    """Loopback without a token (podkit up): a request naming another host (a web page elsewhere that points
    its own name at 127.0.0.1) gets nothing; localhost and 127.0.0.1 get the page. A login body with more
    fields than a form has: 400, no traceback in the log."""
    import contextlib
    import io
    import threading

    class Fixed:
        def page(self):
            return b"<p>run data</p>"

    httpd = page.server("127.0.0.1", 0, Fixed(), "")
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    port = httpd.server_address[1]
    s = type("S", (), {"page_port": port})()
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            for host, code in ((f"rebind.example:{port}", 421), (f"127.0.0.1:{port}", 200),
                               (f"localhost:{port}", 200), (f"[::1]:{port}", 200)):
                r = request(s, "GET", "/", headers={"Host": host})
                assert r.status == code and (b"run data" in r.body) == (code == 200), (host, r.status)
            tokened = page.server("127.0.0.1", 0, Fixed(), TOKEN)
            threading.Thread(target=tokened.serve_forever, daemon=True).start()
            t = type("S", (), {"page_port": tokened.server_address[1]})()
            r = request(t, "POST", "/login", "&".join(f"a{i}=1" for i in range(9)) + f"&token={TOKEN}",
                        {"Content-Type": "application/x-www-form-urlencoded"})
            assert r.status == 400 and r.getheader("Set-Cookie") is None, r.status
            tokened.shutdown()
            tokened.server_close()
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert "Traceback" not in err.getvalue(), err.getvalue()


@pytest.mark.timeout(60)
def test_a_secret_in_an_exception_on_the_step_axis_is_redacted_in_the_pictures_too(tmp_path):
    """The marks' words (the loop bound's `what`: an exception's first line) reach the charts' <title>s: redacted
    there as everywhere else on the page."""
    from podkit import config

    secret = "hf_" + "a1B2c3D4e5F6g7H8i9J0k1L2m3N4o5P6"
    ws = tmp_path / "ws"
    state = ws / ".podkit"
    state.mkdir(parents=True)
    now = time.time()
    for step in range(1, 30):
        records.HISTORY.append(state, step, 0.1 * step, 1.0, now=now - 300 + step * 5)
    records.PROGRESS.write(state, {"kind": "areal", "step": 29, "time": now})
    records.TRAINER_LOOP.write(state, {"started": [now - 300], "ends": [
        {"time": now - 250, "by": "script-error", "family": "failure", "step": 10,
         "what": f"OSError: 401 for token {secret}", "new": True}]})
    cfg = config.load(None, environ={"PODKIT_WORKSPACE": str(ws), "PODKIT_RUN_DIR": str(tmp_path / "run")})
    body = page.Source(cfg, environ={"HF_TOKEN": secret}).page().decode()
    assert "<title>step 10: " in body and "OSError: 401 for token" in body, body[:3000]
    assert secret not in body


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
