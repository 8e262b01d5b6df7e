"""`podkit deploy watch`: the relaunch state machine. It follows one pod of a run on its network volume, or,
with a checkpoint.remote, in any data center, and, when RunPod says the pod is lost, stops it and starts a
replacement that resumes from the volume's checkpoints (or the remote's), never two pods of the run at once;
one watch per run on this machine (one_watch)."""

from __future__ import annotations

import contextlib
import os
import re
import time
from pathlib import Path

from podkit import log
from podkit import runpod as api
from podkit.deploy.bodies import new_run, pod_body
from podkit.deploy.deployer import Deployer
from podkit.deploy.pods import carried_stop_at, gpu_count, mounted_volumes, run_of, running
from podkit.errors import PodkitError
from podkit.host.pidlock import Busy, PidLock

_log = log.get("deploy")
BACKOFF_MAX_S = 900.0


class Watch:
    """Follows one pod through RunPod's API (v2 statuses: PROVISIONING, STARTING, RUNNING, EXITED, ERROR,
    TERMINATED, or no such pod; api.STATUSES: any other status says nothing). A pod that is gone
    (terminated, its host removed), in ERROR, running with zero GPUs (RunPod restarts a pod whose host has
    no free GPU with none), or not running for `lost_after_s` (host down; a pod never seen running gets
    `start_grace_s` more, for its image pull), each said in GONE_AFTER answers in a row, is replaced: the old one
    is stopped first (never terminated), then a new pod starts on the same network volume and resumes from its
    checkpoints. A run without a network volume (`remote`: its checkpoint.remote) gets its replacement in any
    data center RunPod has the GPUs in, and that pod restores the remote's newest whole checkpoint at boot.

    Never two pods of a run: before a replacement the watch lists the account's pods, and a live pod of the
    run (on its network volume, or by its run id anywhere when it has none; RunPod migrated the pod: a new pod
    with a new id and IP; or another watch replaced it) is followed instead of starting another.

    An EXITED pod was stopped on request: by its own cost guard (training finished, the maximum run time,
    a long safe mode) or by a person. That ends the watch, as does a maximum run time that has passed. A
    RunPod API that does not answer is waited out: it says nothing about the pod."""

    GONE_AFTER = 3  # answers in a row saying "no such pod": one could be the API's hiccup
    REFUSALS_MAX = 10  # 401/403 in a row: the API answers, and refuses

    def __init__(self, d: Deployer, pod_id: str, launch, *, volume_id: str = "", remote: str = "",
                 lost_after_s: float = 900, start_grace_s: float = 900, poll_s: float = 30, max_relaunches: int = 3,
                 backoff_s: float = 60, clock=time.monotonic, wall=time.time, state_dir=None) -> None:
        self.d, self.pod_id, self.launch, self.volume_id, self.remote = d, pod_id, launch, volume_id, remote
        self.lost_after_s, self.start_grace_s, self.poll_s = lost_after_s, start_grace_s, poll_s
        self.max_relaunches, self.backoff_s = max_relaunches, backoff_s
        self.clock, self.wall, self.state_dir = clock, wall, state_dir
        self.relaunches = 0
        # What a replacement keeps from the first pod: its image, name, GPU count, maximum run time.
        self.carry: dict = {}
        self.seen_running = False
        self.refusals = 0
        self.downs = 0  # answers in a row with a status RunPod documents as not running
        self.replaced: set[str] = set()  # the pods this watch replaced: never the run's pod again
        self.unstopped: set[str] = set()  # replaced pods whose stop failed (their host unreachable)
        self.said: set[str] = set()  # those of them named as running again, unstoppable (said once)

    def remember(self, pod: dict) -> None:
        if not self.carry:
            self.carry = {"imageName": pod.get("image") or "", "name": pod.get("name") or "",
                          "gpuCount": gpu_count(pod), "stop_at": carried_stop_at(pod), "run": run_of(pod)}
        elif not self.carry["gpuCount"]:
            self.carry["gpuCount"] = gpu_count(pod)

    def verdict(self, pod: dict | None, down_since: float | None, nones: int) -> tuple[str, str]:
        """(state, why): running | waiting | stopped | lost. Only what RunPod documents counts toward a loss
        (api.STATUSES), and only when it has said so `GONE_AFTER` times in a row: a status it does not
        document (none, null, a migration state) says nothing, and is waited out like an unreadable answer."""
        if pod is None and nones < self.GONE_AFTER:
            return "waiting", "RunPod does not know the pod (asking again)"
        state, status = api.pod_state(pod) if pod else "gone", (pod or {}).get("status")
        if state == "unknown":
            return "waiting", (f"RunPod reports the pod in a status it does not document ({status!r:.40}): that "
                               "says nothing about it; asking again")
        if state == "stopped":
            return "stopped", ("the pod was stopped on request: by its own cost guard (training finished, its "
                               "maximum run time, a long safe mode) or by a person")
        sure = pod is None or self.downs >= self.GONE_AFTER
        if state == "gone":
            if sure:
                return "lost", "the pod is gone (terminated, migrated, or its host was removed)"
            return "waiting", f"RunPod reports the pod {status} (asking again before it counts)"
        if state == "error":
            if sure:
                return "lost", "RunPod reports the pod in ERROR (its container could not start or run)"
            return "waiting", "RunPod reports the pod in ERROR (asking again before it counts)"
        rt = pod.get("runtime")
        if state == "running" and isinstance(rt, dict) and rt.get("gpus") == [] and self.carry.get("gpuCount"):
            return "lost", "the pod runs with zero GPUs (its host had none free when it restarted)"
        if running(pod):
            return "running", "running"
        down = self.clock() - down_since if down_since is not None else 0.0
        limit = self.lost_after_s + (0 if self.seen_running else self.start_grace_s)
        if down >= limit and sure:
            return "lost", f"the pod has not been running for {down:.0f} s (state {status}; host down or unreachable)"
        return "waiting", f"not running yet ({status})"

    def notify(self, event: str, text: str) -> None:
        from podkit import notify

        t = notify.send(event, text, self.state_dir)
        if t:
            t.join(10)

    def ask(self) -> tuple[bool, dict | None]:
        """(answered, the pod or None)."""
        try:
            pod = self.d.api.pod(self.pod_id)
            self.refusals = 0
            return True, pod
        except api.ApiError as e:
            if e.status in (401, 403):
                self.refusals += 1
                if self.refusals >= self.REFUSALS_MAX:
                    raise PodkitError(f"RunPod refused {self.REFUSALS_MAX} questions in a row about pod "
                                      f"{self.pod_id}: {e.message}", e.hint) from None
                why = f"refused the question (HTTP {e.status})"
            else:
                why = f"does not answer ({e.message})"
        _log.warn(f"RunPod's API {why}; asking again in {self.poll_s:g} s")
        return False, None

    def ours(self, pod: dict) -> bool:
        """The same run: its run id (a migration and a replacement keep the env), or without one its name."""
        if self.carry.get("run"):
            return run_of(pod) == self.carry["run"]
        return bool(self.carry.get("name")) and pod.get("name") == self.carry["name"]

    def keeps(self) -> str:
        """What holds the run's checkpoints while it has no pod."""
        return ("the network volume keeps the checkpoints" if self.volume_id else
                f"checkpoint.remote {self.remote} keeps the checkpoints")

    def of_run(self, pod: dict) -> bool:
        """A pod of this run where it trains: on its network volume; without one, anywhere, told by its run id
        only (a name alone is no proof: the watch would follow, or end, a pod of something else)."""
        if self.volume_id:
            return self.ours(pod) and self.volume_id in mounted_volumes(pod)
        return bool(self.carry.get("run")) and run_of(pod) == self.carry["run"]

    def successor(self) -> dict | None:
        """A live pod of this run other than the one followed (of_run). A live pod of anything else on its
        network volume (a pod opened to look at the checkpoints) holds the replacement back."""
        try:
            others = (self.d.pods_on(self.volume_id, but=self.pod_id) if self.volume_id
                      else self.d.live_pods(but=self.pod_id))
        except api.ApiError as e:
            raise _Unsure(f"cannot list your pods: {e.message}") from None
        mine = [p for p in others if self.of_run(p)]
        if mine:
            return mine[0]
        if others and self.volume_id:
            p = others[0]
            raise _Unsure(f"pod {p.get('id')} ({p.get('name')}, {p.get('status')}) is on network volume "
                          f"{self.volume_id} and is not this run's: no replacement beside it; stop it, and the watch "
                          "replaces the run's pod")
        return None

    def run(self) -> int:
        down_since, said, nones = None, "", 0
        while True:
            answered, pod = self.ask()
            if not answered:
                self.d.sleep(self.poll_s)
                continue
            nones = 0 if pod else nones + 1
            if pod:
                self.remember(pod)
            up = running(pod)
            self.seen_running = self.seen_running or up
            if pod is not None and api.pod_state(pod) == "unknown":
                down_since, self.downs = None, 0  # says nothing: a loss is counted afresh from what RunPod documents
            else:
                down_since = None if up else (down_since if down_since is not None else self.clock())
                self.downs = 0 if up else self.downs + 1
            if not self.seen_running and pod is not None:
                self.only_one(pod)
            if self.unstopped and not self.volume_id:
                self.stop_returned()
            state, why = self.verdict(pod, down_since, nones)
            if why != said:
                _log.info(f"pod {self.pod_id}: {why}")
                said = why
            if state == "stopped":
                _log.info("watch ends: a pod stopped on request is left stopped")
                return 0
            if state == "lost":
                try:
                    outcome = self.replace(why, pod)
                except _Unsure as e:
                    _log.warn(f"no replacement yet: {e}; asking again in {self.poll_s:g} s")
                    self.d.sleep(self.poll_s)
                    continue
                if outcome not in ("replaced", "followed"):
                    return 0 if outcome == "deadline" else 1
                down_since, said, nones, self.seen_running, self.downs = None, "", 0, False, 0
                continue
            self.d.sleep(self.poll_s)

    def stop_returned(self) -> None:
        """Without a network volume no workspace lease keeps a lost pod that comes back from training beside its
        replacement: a pod this watch replaced but could not stop is stopped once RunPod shows it running again."""
        try:
            pods = {p.get("id"): p for p in self.d.api.pods()}
        except api.ApiError:
            return  # asked again at the next poll
        for pid in sorted(self.unstopped):
            p = pods.get(pid)
            if p is None or api.pod_state(p) in ("stopped", "gone"):
                self.unstopped.discard(pid)
            elif running(p):
                try:
                    self.d.act(pid, "stop")
                except PodkitError as e:
                    if pid not in self.said:
                        self.said.add(pid)
                        _log.warn(f"pod {pid} runs again and cannot be stopped ({e.message}): stop or terminate it "
                                  f"yourself, or it trains this run beside pod {self.pod_id}; the watch goes on trying")
                    continue
                self.unstopped.discard(pid)
                _log.warn(f"pod {pid}, lost and replaced, runs again: stopped, so that it does not train this run "
                          f"beside pod {self.pod_id} (`podkit deploy terminate {pid}` when done with its disk)")

    def follow(self, other: dict, why: str) -> str:
        old, self.pod_id = self.pod_id, other["id"]
        where = f"on network volume {self.volume_id}" if self.volume_id else f"of run {self.carry.get('run')}"
        msg = (f"pod {old} is lost ({why}), and pod {other['id']} ({other.get('name')}, {other.get('status')}) is "
               f"{where}: RunPod migrated the pod (a new pod, new id and IP) or another watch replaced it; following "
               "it, not starting another")
        _log.info(msg)
        self.notify("relaunch", msg)
        return "followed"

    def replace(self, why: str, now: dict | None) -> str:
        """Stop the lost pod, then start its replacement, a failed start tried again after a back-off
        that doubles from the second attempt on: replaced | followed | deadline | gave-up."""
        old = self.pod_id
        self.replaced.add(old)
        if now and api.pod_state(now) not in ("stopped", "gone"):
            try:  # it may come back: it must not then train beside its replacement
                self.d.act(old, "stop")
                _log.info(f"pod {old} stopped (not terminated: `podkit deploy terminate {old}` when done with it)")
            except PodkitError as e:  # an unreachable host may refuse; the workspace lease still guards
                self.unstopped.add(old)
                _log.warn(f"could not stop pod {old} ({e.message}); if it comes back, " +
                          ("its replacement waits for the workspace lease to lapse" if self.volume_id else
                           "this watch stops it (no network volume: no workspace lease keeps the two apart)"))
        if other := self.successor():
            return self.follow(other, why)
        stop_at = self.carry.get("stop_at") or 0
        if stop_at and self.wall() >= stop_at:
            msg = (f"pod {old} is lost ({why}), and the run's maximum run time has passed: no replacement; "
                   f"{self.keeps()}")
            _log.info(msg)
            self.notify("relaunch-gave-up", msg)
            return "deadline"
        while True:
            if self.relaunches >= self.max_relaunches:
                msg = (f"pod {old} is lost ({why}); {self.relaunches} replacement attempt(s) spent "
                       f"(--max-relaunches {self.max_relaunches}): giving up; {self.keeps()}")
                _log.error(msg)
                self.notify("relaunch-gave-up", msg)
                return "gave-up"
            self.relaunches += 1
            n = self.relaunches
            if n > 1:
                delay = min(BACKOFF_MAX_S, self.backoff_s * 2 ** (n - 2))
                _log.info(f"waiting {delay:.0f} s before replacement attempt {n} of {self.max_relaunches}")
                self.d.sleep(delay)
                if other := self.successor():  # made meanwhile (a migration, another watch)
                    return self.follow(other, why)
            try:
                pod = self.launch(self.carry)
                new_id = pod["id"]
            except Exception as e:  # noqa: BLE001 - any failure to start one is a failed attempt, not the watch's end
                what = e.message if isinstance(e, PodkitError) else f"{type(e).__name__}: {self.d._redact(str(e))}"
                _log.error(f"replacement attempt {n} of {self.max_relaunches} for pod {old} failed: {what}")
                self.notify("relaunch", f"pod {old} is lost ({why}); replacement attempt {n} of "
                            f"{self.max_relaunches} failed: {what}")
                continue
            if rival := self.rival(pod, old):
                return self.follow(rival, why)
            self.pod_id = new_id
            where = ("on the same network volume, resuming from its checkpoints" if self.volume_id else
                     f"in data center {pod.get('dataCenterId') or '(RunPod did not say)'}, restoring the newest "
                     f"whole checkpoint from checkpoint.remote {self.remote} at its boot")
            msg = f"pod {old} is lost ({why}); replacement {n} of {self.max_relaunches} is pod {new_id} {where}"
            _log.info(msg)
            self.notify("relaunch", msg)
            return "replaced"


    def rival(self, ours: dict, old: str) -> dict | None:
        """Two watches that found the run lost at the same moment each start a pod (or one create of this
        watch was made twice): the one started first stays, the later ones are terminated at once (still
        starting: nothing of them is lost). The pod that stays when it is not `ours`."""
        if not self.volume_id and not self.carry.get("run"):
            return None  # nothing tells this run's pods from others
        first = self.d.only_one(ours, self.of_run, before=self.replaced | {old})
        return None if first["id"] == ours["id"] else first

    def only_one(self, pod: dict) -> None:
        """While the followed pod starts, a second pod of the run that shows up late (a create RunPod answered
        after podkit gave up on it) is terminated, or, created first, followed instead."""
        if (first := self.rival(pod, "")) is not None:
            _log.info(f"following pod {first['id']}, the run's pod created first, instead of pod {self.pod_id}")
            self.pod_id = first["id"]


class _Unsure(Exception):
    """No replacement now: the account's pods could not be listed, or a pod of something else is on the
    volume; a replacement might be a second pod on it."""


def relauncher(d: Deployer, tpl: dict, vol: dict | None, cloud: str, gpus: int, name: str | None,
               capacity_timeout_s: float, image: str | None = None):
    """Watch's `launch`: a replacement like the first pod watched (its image unless --image names one,
    its GPU count while it had GPUs, its name and maximum run time), with the template's env and secrets,
    on the network volume; without one (a run with a checkpoint.remote), in any data center of `cloud`."""
    def launch(carry: dict) -> dict:
        n = carry.get("gpuCount") or gpus
        t = dict(tpl, imageName=image or carry.get("imageName") or tpl["imageName"])
        d.save_template(t)
        return d.create_pod(pod_body(t, n, cloud, name or carry.get("name") or f"{t['name']}-{n}xa40", vol,
                                     carry.get("stop_at") or 0, carry.get("run") or new_run()), capacity_timeout_s)
    return launch


@contextlib.contextmanager
def one_watch(key: str, what: str = ""):
    """One watch per run on this machine: a lock on the run's network volume id (or, without one, its run id),
    held while it watches (two watches would each replace a lost pod). Watches on other machines meet on
    RunPod's pod list."""
    root = Path(os.environ.get("PODKIT_CACHE_DIR") or Path(os.environ.get("XDG_CACHE_HOME") or
                                                           Path.home() / ".cache") / "podkit")
    path = root / f"watch-{re.sub(r'[^A-Za-z0-9_-]', '_', key)[:64]}.lock"
    try:
        with PidLock(path):
            yield
    except Busy as e:
        raise PodkitError(f"another `podkit deploy watch` (pid {e.holder}) on this machine follows the run "
                          f"{what or f'on network volume {key}'}: one watch per run, or a lost pod would be replaced twice",
                          f"stop that one first, or let it do the watching ({path})") from None
