"""Two deploys at once and a deploy interrupted (issue 56): against the RunPod stub (tests/runpod_stub.py) held to the
published OpenAPI document, the real `podkit deploy` as a person runs it. Two deploys on one network volume while the
pod list lags made two pods on it, both deploys exiting 0; a create whose answer was lost was looked for up to 420 s
in silence, Ctrl-C then exited 130 without a word, and deploying again made a second pod."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest
from test_deploy import IMAGE, KEY, VOLUME
from test_deploy import runpod_api as runpod_api  # noqa: F401 - the fixture

from conftest import wait_for

pytestmark = pytest.mark.timeout(120)


def deploy(stub, tmp_path, *args: str) -> subprocess.Popen:
    env = {"RUNPOD_API_BASE_URL": stub.url, "RUNPOD_API_KEY": KEY, "PATH": "/usr/bin:/bin", "HOME": "/nonexistent",
           "PODKIT_CACHE_DIR": str(tmp_path / "cache")}
    # SIGINT as a terminal gives it: a pytest-xdist worker ignores SIGINT, and an ignored signal is inherited
    return subprocess.Popen([sys.executable, "-m", "podkit", "deploy", *IMAGE, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def test_two_deploys_on_one_volume_past_a_lagging_pod_list_leave_one_pod_and_say_so(runpod_api, tmp_path):
    runpod_api.add_volume(VOLUME, "checkpoints", 200, "EU-SE-1")
    runpod_api.list_lag_s, runpod_api.polls_until_running = 15.0, 6
    a = deploy(runpod_api, tmp_path, "--network-volume", VOLUME, "--wait-timeout", "90")
    wait_for(lambda: "POST /v2/pods" in runpod_api.calls(), 30, what="the first deploy's create")
    time.sleep(2)  # the second deploy's look at the volume cannot see the first pod yet (the list lags 15 s)
    b = deploy(runpod_api, tmp_path, "--network-volume", VOLUME, "--wait-timeout", "90")
    out_a, err_a = a.communicate(timeout=110)
    out_b, err_b = b.communicate(timeout=110)
    assert runpod_api.calls().count("POST /v2/pods") == 2, "the second deploy's look could not see the first pod"
    live = [p for pid, p in runpod_api.pods.items() if pid not in runpod_api.terminated
            and p["status"] not in ("EXITED", "TERMINATED")]
    assert len(live) == 1, [(p["id"], p["status"]) for p in runpod_api.pods.values()]
    said_a, said_b = out_a + err_a, out_b + err_b
    assert a.returncode == 0, said_a
    assert b.returncode == 1 and f"network volume {VOLUME} is in use by pod {live[0]['id']}" in said_b, said_b
    assert "was ended, so one pod trains on the volume" in said_b and "second pod of network volume" in said_b


def test_a_deploy_interrupted_while_it_looks_for_a_lost_create_says_so_and_the_next_makes_no_second_pod(
        runpod_api, tmp_path):
    runpod_api.garble("POST", "/v2/pods", "drop")  # RunPod makes the pod; its answer is lost
    runpod_api.list_lag_s = 20.0  # the look is still on when Ctrl-C comes, however slow this machine is
    first = deploy(runpod_api, tmp_path, "--wait-timeout", "60")
    wait_for(lambda: "POST /v2/pods" in runpod_api.calls(), 30, what="the create")
    time.sleep(1.5)
    first.send_signal(signal.SIGINT)
    out, err = first.communicate(timeout=30)
    err = out + err
    assert first.returncode == 130, err
    assert "RunPod did not answer the pod create (" in err and "it may still make the pod" in err, err
    assert "interrupted after the pod create was sent" in err and "a deploy again looks for it first" in err, err
    (made,) = runpod_api.pods
    second = deploy(runpod_api, tmp_path, "--wait-timeout", "60")
    out, err = second.communicate(timeout=90)
    err = out + err
    assert second.returncode == 1 and f"pod {made} " in err and "deploying again would make a second pod" in err, err
    assert runpod_api.calls().count("POST /v2/pods") == 1 and list(runpod_api.pods) == [made]


def test_two_deploys_whose_pods_run_before_the_list_shows_either_still_leave_one_pod(runpod_api, tmp_path):
    """The adversarial pass: pods running at the first look while the list lags 15 s; each deploy looked only while
    its pod started. A deploy now keeps looking until the list shows its own pod."""
    runpod_api.add_volume(VOLUME, "checkpoints", 200, "EU-SE-1")
    runpod_api.list_lag_s, runpod_api.polls_until_running = 15.0, 1
    a = deploy(runpod_api, tmp_path, "--network-volume", VOLUME, "--wait-timeout", "90")
    wait_for(lambda: "POST /v2/pods" in runpod_api.calls(), 30, what="the first deploy's create")
    time.sleep(2)
    b = deploy(runpod_api, tmp_path, "--network-volume", VOLUME, "--wait-timeout", "90")
    said_a, said_b = "".join(a.communicate(timeout=110)), "".join(b.communicate(timeout=110))
    live = [p for pid, p in runpod_api.pods.items() if pid not in runpod_api.terminated
            and p["status"] not in ("EXITED", "TERMINATED")]
    assert len(live) == 1 and a.returncode == 0 and b.returncode == 1, (said_a, said_b)


def test_a_create_runpod_refused_leaves_nothing_for_the_next_deploy_to_wait_for(runpod_api, tmp_path):
    runpod_api.fail("POST", "/v2/pods", 400, times=1, body=b'{"error": "bad gpu"}')
    first = deploy(runpod_api, tmp_path, "--wait-timeout", "60")
    assert first.wait(60) == 1
    t0 = time.monotonic()
    second = deploy(runpod_api, tmp_path, "--wait-timeout", "60")
    out = "".join(second.communicate(timeout=90))
    assert second.returncode == 0 and "interrupted" not in out and time.monotonic() - t0 < 40, out
    runpod_api.errors.clear()  # the refused body was the test's


def test_pods_are_ordered_by_when_they_were_made_whatever_the_format_of_created_at():
    from podkit.deploy.pods import created_order

    pairs = [("2026-11-29T10:00:05Z", "2026-11-29 10:00:05.4 +0000 UTC"),  # as text, Go's sorts first
             ("2026-11-29T11:00:04+01:00", "2026-11-29T10:00:05Z"),
             ("2026-11-29T10:00:05Z", "2026-11-29T10:00:05.4Z")]
    for first, later in pairs:
        a, b = {"id": "z", "createdAt": first}, {"id": "a", "createdAt": later}
        assert created_order(a) < created_order(b), (first, later)
    go, rfc = {"id": "a", "createdAt": "2026-11-29 10:00:05 +0000 UTC"}, {"id": "b", "createdAt": "2026-11-29T09:00:00Z"}
    assert created_order(rfc) < created_order(go)
    assert created_order({"id": "a"}) > created_order(go), "a pod whose createdAt is missing comes after"
