"""A pod on RunPod as the tests see it: pod-abc123 on RunPod's stub (tests/runpod_stub.py), its key, its stop's
request, the env that puts a stack on it, and a webhook receiver (tests/webhook.py). The cost guards' tests
(tests/money/test_costguard.py) made them; the loop bound's, the fault tests and others stop pods with them."""

from __future__ import annotations

import pytest

from runpod_stub import RunPodV2Stub
from webhook import Receiver

KEY = "rpa_TESTKEY0123456789"
STOP = "POST /v2/pods/pod-abc123/action"


@pytest.fixture
def runpod_api(monkeypatch):
    stub = RunPodV2Stub(key=KEY)
    stub.add_pod(id="pod-abc123", name="podkit-run")
    monkeypatch.setenv("PODKIT_CACHE_DIR", stub.cache_dir)  # in-process verbs: this test's notes and locks
    yield stub
    assert stub.graphql == [] and stub.refused == []
    stub.assert_clean()
    stub.close()


@pytest.fixture
def receiver():
    r = Receiver()
    yield r
    r.close()


def on_runpod(api_url: str, **extra) -> dict[str, str]:
    return {"RUNPOD_POD_ID": "pod-abc123", "RUNPOD_API_KEY": KEY, "RUNPOD_API_BASE_URL": api_url, **extra}
