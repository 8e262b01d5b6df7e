"""Cost guards: on RunPod, a pod whose training finished, or that has waited in safe mode for
`guard.stop_pod_after_s`, stops itself, so a run that ended at 3 a.m. does not bill GPUs until someone
looks. Off outside RunPod (no RUNPOD_POD_ID) and with `guard.stop_pod_when_finished: never` /
`guard.stop_pod_after_s: 0`.

A stopped pod keeps its volume (checkpoints, logs, the repo) and bills only for disk; it restarts from
the console or `podkit deploy`. The call is RunPod's `podStop` mutation with the pod's own
RUNPOD_API_KEY (RunPod puts both variables in every pod), sent as the runpod SDK sends it (POST
<RUNPOD_API_BASE_URL>/graphql, Bearer key), with urllib: the image has no SDK.
"""

from __future__ import annotations

import json
import os
import re
import urllib.error
import urllib.request
from pathlib import Path

from podkit import log

_log = log.get("costguard")
POD_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def on_runpod(environ=None) -> bool:
    environ = os.environ if environ is None else environ
    return bool(environ.get("RUNPOD_POD_ID") and environ.get("RUNPOD_API_KEY"))


def stop_pod(reason: str, environ=None) -> bool:
    """podStop for this pod; True when RunPod accepted it. Never raises: a failure is logged."""
    environ = os.environ if environ is None else environ
    pod, key = environ.get("RUNPOD_POD_ID", ""), environ.get("RUNPOD_API_KEY", "")
    if not POD_ID.match(pod) or not key:
        _log.warn(f"cannot stop the pod ({reason}): RUNPOD_POD_ID {'is not a pod id' if pod else 'is not set'}"
                  f"{'' if key else ' and RUNPOD_API_KEY is not set'}")
        return False
    base = environ.get("RUNPOD_API_BASE_URL", "https://api.runpod.io").rstrip("/")
    query = f'mutation {{ podStop(input: {{ podId: "{pod}" }}) {{ id desiredStatus }} }}'
    req = urllib.request.Request(f"{base}/graphql", data=json.dumps({"query": query}).encode(), method="POST",
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}",
                                          "User-Agent": "podkit-costguard"})
    _log.info(f"stopping pod {pod}: {reason}")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            answer = json.loads(r.read(1 << 20) or b"{}")
    except urllib.error.HTTPError as e:
        _log.warn(f"RunPod refused to stop pod {pod}: HTTP {e.code}{' (RUNPOD_API_KEY)' if e.code == 401 else ''}")
        return False
    except (OSError, ValueError) as e:
        _log.warn(f"cannot reach RunPod to stop pod {pod}: {getattr(e, 'reason', None) or e}")
        return False
    if answer.get("errors"):
        msg = str((answer["errors"][0] or {}).get("message", answer["errors"][0]))[:300]
        _log.warn(f"RunPod refused to stop pod {pod}: {msg}")
        return False
    return True


def stop_pod_notified(reason: str, state_dir: Path | None, notify: bool = True) -> bool:
    """The `pod-stop` notification (given a moment to go out), then stop_pod. A retry of a refused stop
    passes notify=False: one notification per stop, not per attempt."""
    if notify:
        from podkit import notify as webhook

        t = webhook.send("pod-stop", f"stopping this pod: {reason}; the volume stays", state_dir)
        if t:
            t.join(15)
    return stop_pod(reason)
