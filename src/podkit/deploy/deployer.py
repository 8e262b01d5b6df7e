"""The RunPod calls `podkit deploy` makes, through podkit.runpod (the one REST API v2 client): the
template saved by name, network volumes, pods created exactly once (capacity refusals retried, a create
whose answer was lost looked for, never a second pod of a run left billing), waited for and acted on, and
Instant Clusters."""

from __future__ import annotations

import math
import random
import re
import time

from podkit import log
from podkit import runpod as api
from podkit.deploy.bodies import GPU_TYPE
from podkit.deploy.pods import created_order, maybe_live, mounted_volumes, run_of, running
from podkit.deploy.template import template_body
from podkit.errors import PodkitError
from podkit.money import ledger
from podkit.money.costguard import POD_ID

_log = log.get("deploy")
CLOUDS = ("SECURE", "COMMUNITY")  # v2's Cloud; there is no "ALL"
# How RunPod words "no machine for this now" (v1, GraphQL and v2 alike): retried, not a refusal.
CAPACITY = re.compile(r"no longer any instances available|not enough (free )?gpus|no (available )?instances|"
                      r"could not find any pods|insufficient capacity|no (gpu )?capacity", re.I)


class Deployer:
    """podkit's RunPod operations, each a few REST API v2 calls."""

    # How long a create podkit gave up waiting for may still be made and answered by RunPod: its edge holds
    # a request up to 100 s (Cloudflare's proxy read timeout), and its pod list may show the pod later still.
    CREATE_ANSWER_S = 120.0
    # How long RunPod's pod list may go on leaving out a pod it has made. RunPod publishes no bound; a list
    # that lagged past the look above had a create sent again and two pods billing (issue 48). Five minutes
    # is room, not a measured figure: a lost answer costs that much waiting, a second pod costs money.
    LIST_LAG_S = 300.0
    LOOK_EVERY_S = 5.0

    def __init__(self, client: api.Client | None = None, sleep=time.sleep, create_answer_s: float | None = None,
                 look_every_s: float | None = None, list_lag_s: float | None = None) -> None:
        self.api = client or api.Client(sleep=sleep)
        self.sleep = sleep
        self.create_answer_s = self.CREATE_ANSWER_S if create_answer_s is None else create_answer_s
        self.look_every_s = self.LOOK_EVERY_S if look_every_s is None else look_every_s
        self.list_lag_s = self.LIST_LAG_S if list_lag_s is None else list_lag_s

    def _redact(self, text: str) -> str:
        return self.api.redact(text)

    # -- template ---------------------------------------------------------------------------------------
    def save_template(self, tpl: dict) -> dict:
        """Create the template, or update the one of this name (PATCH); its id."""
        existing = next((t for t in self.api.templates() if t.get("name") == tpl["name"]), None)
        saved = self.api.save_template(template_body(tpl), existing["id"] if existing else None)
        if not isinstance(saved.get("id"), str):
            raise PodkitError(f"RunPod's answer to the template save has no id: {self._redact(str(saved))[:200]}")
        _log.info(f"template {tpl['name']!r} {'updated' if existing else 'created'} (id {saved['id']})")
        return saved

    def network_volume(self, volume_id: str) -> dict:
        """The network volume (id, dataCenter, type): a pod on it runs in its data center."""
        found = self.api.network_volumes()
        vol = next((v for v in found if v.get("id") == volume_id), None)
        if not vol or not vol.get("dataCenter"):
            raise PodkitError(f"no network volume {volume_id!r} in this RunPod account",
                              "yours: " + (", ".join(f"{v.get('id')} ({v.get('name')}, {v.get('dataCenter')})"
                                                     for v in found) or "none; create one under Storage"))
        return vol

    def live_pods(self, but=()) -> list[dict]:
        """The account's pods that may be live (ids in `but` aside): all but those RunPod documents as stopped,
        in error or gone; one in a status it does not document (a migration) may be live."""
        but = {but} if isinstance(but, str) else set(but)
        return [p for p in self.api.pods() if p.get("id") not in but and maybe_live(p)]

    def pods_on(self, volume_id: str, but=()) -> list[dict]:
        """The live_pods that mount this network volume (one in a status RunPod does not document may hold it)."""
        return [p for p in self.live_pods(but) if volume_id in mounted_volumes(p)]

    def list_price(self, count: int, cloud: str, gpu_type: str = GPU_TYPE) -> float | None:
        """USD per hour of `count` x `gpu_type` in `cloud`: RunPod's list price from its GPU catalogue (a read);
        None when the catalogue does not offer it there. ApiError when RunPod does not answer."""
        return api.gpu_price(self.api.gpu_types(), gpu_type, cloud, count)

    # -- clusters ----------------------------------------------------------------------------------------
    def create_cluster(self, body: dict) -> dict:
        """createCluster, sent once. A create whose answer is lost is looked for by name: a second cluster
        would bill beside the first."""
        before = {c.get("id") for c in self.api.clusters() if c.get("name") == body["name"]}
        try:
            c = self.api.create_cluster(body)
        except api.ApiError as e:
            if not lost_answer(e):
                raise
            self.sleep(5.0)
            made = [c for c in self.api.clusters() if c.get("name") == body["name"] and c.get("id") not in before]
            if not made:
                raise PodkitError(f"{e.message}; RunPod lists no new cluster named {body['name']!r} yet",
                                  "look under Instant Clusters in the console (or `podkit deploy cluster-status`) "
                                  "before creating another: it may still appear") from None
            _log.warn(f"RunPod made cluster {made[0].get('id')} although its answer was lost ({e.message})")
            c = made[0]
        if not c or not isinstance(c.get("id"), str) or not POD_ID.match(c["id"]):
            raise PodkitError(f"RunPod's answer to the cluster create has no cluster id: {self._redact(str(c))[:300]}",
                              "look in the console under Instant Clusters before creating another")
        comp = body["compute"]
        _log.info(f"cluster {c['id']} created ({comp['podCount']} nodes x {comp['gpuCountPerPod']} {comp['gpuTypeId']})")
        return c

    def cluster(self, cluster_id: str) -> dict:
        return self.api.cluster(cluster_id) or {}

    def delete_cluster(self, cluster_id: str) -> None:
        self.api.delete_cluster(cluster_id)

    # -- pods --------------------------------------------------------------------------------------------
    def create_pod(self, body: dict, capacity_timeout_s: float, mine=None, before=()) -> dict:
        """createPod, capacity refusals retried with back-off for a bounded time. A create RunPod may have
        made (no answer, 5xx, an answer cut short) is looked for among the run's pods for as long as such a
        pod could still appear (look_for), and sent again only after that; after any create exactly one pod
        of the run is left (only_one): a second pod would bill too. `mine` tells the run's pods (its run id
        in their env, else its name); `before`, pods of it that were there already."""
        name, run = body["name"], body["env"].get(ledger.RUN_ENV, "")
        mine = mine or (lambda p: run_of(p) == run if run else p.get("name") == name)
        before = set(before) | {p.get("id") for p in self.api.pods() if mine(p)}
        t0, delay, attempt, unsure = time.monotonic(), 5.0, 0, 0
        while True:
            attempt += 1
            try:
                pod = self.api.create_pod(body)
                _log.info(f"pod {pod['id']} created ({body['gpu']['count']}x {GPU_TYPE}, {body['cloud']} cloud)")
                return self.only_one(pod, mine, before)
            except api.ApiError as e:
                if lost_answer(e):
                    _log.warn(f"RunPod did not answer the pod create ({e.message}): it may still make the pod, so "
                              "podkit looks for it before it sends the create again")
                    made = self.look_for(mine, before)
                    if made:
                        _log.warn(f"RunPod made pod {made[0]['id']} although its answer was lost ({e.message}); "
                                  "following it, not creating another")
                        return self.only_one(made[0], mine, before)
                    unsure += 1
                    if unsure > 3:
                        raise
                    _log.warn(f"the pod create failed ({e.message}) and RunPod lists no pod of the run after "
                              f"{self.look_s():.0f} s, as long as it could make one ({self.create_answer_s:.0f} s) "
                              f"and its pod list leave it out ({self.list_lag_s:.0f} s): sending it again")
                    continue
                if not CAPACITY.search(f"{e.detail} {e.message}"):
                    raise PodkitError(f"RunPod refused the pod: {e.message}", e.hint) from None
                waited = time.monotonic() - t0
                if waited + delay > capacity_timeout_s:
                    other = [c for c in CLOUDS if c != body["cloud"]]
                    fewer = [n for n in (4, 2, 1) if n < body["gpu"]["count"]]
                    raise PodkitError(
                        f"no {body['gpu']['count']}x {GPU_TYPE} available in {body['cloud']} cloud after "
                        f"{attempt} attempt(s) over {waited:.0f}s: {e.detail or e.message}",
                        f"try another cloud (--cloud {' or --cloud '.join(other)})"
                        + (f", or fewer GPUs (--gpus {' or --gpus '.join(map(str, fewer))})" if fewer else "")
                        + ", or later") from None
                _log.warn(f"no capacity yet (attempt {attempt}): {e.detail or e.message}; retrying in {delay:.0f}s")
                self.sleep(delay)
                delay = min(60.0, delay * 2) * random.uniform(0.8, 1.2)

    def look_s(self) -> float:
        """How long a pod of a create whose answer was lost may take to show in RunPod's pod list: the create
        may still be made (`create_answer_s`), and the list may leave the pod out for `list_lag_s` after."""
        return self.create_answer_s + self.list_lag_s

    def look_for(self, mine, before) -> list[dict]:
        """The run's pods made since `before`, looked for every `look_every_s` for as long as one could
        still appear (look_s); [] when none came."""
        looks = max(1, math.ceil(self.look_s() / self.look_every_s))
        _log.info(f"looking for it every {self.look_every_s:g} s for up to {self.look_s():.0f} s (Ctrl-C stops "
                  "looking; a deploy again looks for it first)")
        said = 0
        for n in range(looks):
            if (n * self.look_every_s) // 60 > said:  # a line a minute: a silent deploy looks hung
                said = (n * self.look_every_s) // 60
                _log.info(f"still looking for the pod the create may have made ({n * self.look_every_s:.0f} s of "
                          f"{self.look_s():.0f} s)")
            self.sleep(self.look_every_s)  # a create that timed out may still be under way at RunPod
            try:
                made = [p for p in self.api.pods() if mine(p) and p.get("id") not in before]
            except api.ApiError as e:
                _log.warn(f"cannot list your pods to look for the pod just created ({e.message}); looking again")
                continue
            if made:
                return sorted(made, key=created_order)
        return []

    def only_one(self, pod: dict, mine, before=()) -> dict:
        """Exactly one pod of the run left: of `pod` and the run's other live pods made since `before`, the
        one created first stays (every look, here or in another podkit, picks the same one). Each other is
        named with its price and ended (end_extra). Returns the one that stays."""
        try:
            others = [p for p in self.api.pods() if mine(p) and maybe_live(p)
                      and p.get("id") not in set(before) | {pod["id"]}]
        except api.ApiError:
            return pod  # asked again at the next look (the watch, wait_running)
        if not others:
            return pod
        first = min([pod, *others], key=created_order)
        for extra in (p for p in [pod, *others] if p is not first):
            self.end_extra(extra, first)
        return first

    def end_extra(self, extra: dict, first: dict, of: str = "") -> None:
        """A second pod of the run, named with its price, is ended: terminated while it is still starting
        (nothing is on it yet, and a stopped pod would go on billing its disk), stopped once it has run (its
        GPUs stop billing; what it may have written stays on its disk until a person terminates it)."""
        cost = api.pod_cost(extra)
        run = run_of(extra)
        what = (f"pod {extra['id']} ({extra.get('name')}, {extra.get('status')}, "
                + (f"${cost:.2f}/h" if cost is not None else "its price unknown") + ")")
        action = "terminate" if api.pod_state(extra) == "starting" else "stop"
        _log.warn(f"{what} is a second pod of {of or (f'run {run}' if run else 'the run')} beside pod {first['id']} "
                  f"(created first, the one followed): "
                  + ("terminating it while it is still starting" if action == "terminate" else
                     f"stopping it; `podkit deploy terminate {extra['id']}` once you have looked at its disk"))
        try:
            self.act(extra["id"], action)
        except PodkitError as e:  # ApiError too
            _log.error(f"could not {action} {what} ({e.message}): it bills until you do "
                       f"(`podkit deploy {action} {extra['id']}`)")

    def wait_running(self, pod_id: str, timeout_s: float, poll_s: float = 5.0, volume_id: str = "",
                     sent: float | None = None) -> dict:
        """The pod once it runs. With `volume_id`, at each look (and once more at the end): another live pod on the
        network volume created before this one (a second deploy at once, past a lagging pod list) ends this one;
        every deploy goes by the same rule, so exactly one pod is left on the volume, the one made first."""
        t0 = time.monotonic()
        last = None
        while True:
            pod = self.api.pod(pod_id)
            if pod is None:
                raise PodkitError(f"pod {pod_id} is gone while starting (terminated, or RunPod removed it)",
                                  "`podkit deploy status` on its id; look in the console")
            if (run := run_of(pod)) and (first := self.only_one(pod, lambda p: run_of(p) == run))["id"] != pod_id:
                _log.info(f"following pod {first['id']}, the run's pod created first")
                pod_id, pod = first["id"], first
            if volume_id:
                self.first_on(volume_id, pod)
            state = pod.get("status")
            ready = running(pod)
            if state != last or ready:
                _log.info(f"pod {pod_id}: {state}{', runtime up' if ready else ''} ({time.monotonic() - t0:.0f}s)")
                last = state
            if ready:
                if volume_id:
                    self.settle_on(volume_id, pod, poll_s, t0 if sent is None else sent)
                return pod
            if api.pod_state(pod) == "error":
                raise PodkitError(f"pod {pod_id} is in ERROR (RunPod could not start its container)",
                                  f"`podkit deploy logs {pod_id} --system` tells why (an image pull, a CUDA the "
                                  "host's driver cannot run)")
            if time.monotonic() - t0 > timeout_s:
                raise PodkitError(f"pod {pod_id} not running after {timeout_s:.0f}s (state {state})",
                                  f"`podkit deploy logs {pod_id} --system`; `podkit deploy status {pod_id}`")
            self.sleep(poll_s)

    # How long after its create a running pod's deploy may keep looking at the volume for another deploy's pod (the
    # pod list's own lag, LIST_LAG_S, bounded): it stops as soon as the list shows its own pod, since a pod made
    # before it would show by then too
    VOLUME_SETTLE_S = 120.0

    def settle_on(self, volume_id: str, pod: dict, poll_s: float, sent: float) -> None:
        """first_on until RunPod's pod list shows this deploy's own pod (or the lag, bounded, has passed since it sent
        its create: `sent`, this machine's monotonic clock), counted in looks by self.sleep's clock."""
        left = sent + min(self.list_lag_s, self.VOLUME_SETTLE_S) - time.monotonic()
        looks = max(0, math.ceil(left / poll_s)) if poll_s > 0 else 0
        for n in range(looks + 1):
            if self.first_on(volume_id, pod):
                return
            if n == 0 and looks:
                _log.info(f"pod {pod['id']} runs; RunPod's pod list does not show it yet: looking at network volume "
                          f"{volume_id} for another deploy's pod until it does ({left:.0f} s at most)")
            if n < looks:
                self.sleep(poll_s)

    def first_on(self, volume_id: str, pod: dict) -> bool:
        """Raises once this deploy's `pod` has been ended because another live pod on the volume was made before
        it; never touches that other pod (it may be anyone's). True when the pod list shows this pod itself (what it
        says of the volume then holds)."""
        try:
            listed = self.api.pods()
        except api.ApiError:
            return False  # asked again at the next look
        others = [p for p in listed if p.get("id") != pod["id"] and maybe_live(p) and volume_id in mounted_volumes(p)]
        earlier = [p for p in others if created_order(p) < created_order(pod)]
        if not earlier:
            return any(p.get("id") == pod["id"] for p in listed)
        first = min(earlier, key=created_order)
        self.end_extra(pod, first, of=f"network volume {volume_id}")
        raise PodkitError(f"network volume {volume_id} is in use by pod {first['id']} ({first.get('name')}, "
                          f"{first.get('status')}), created before this deploy's pod {pod['id']} (two deploys at once, "
                          f"and RunPod's pod list showed neither to the other): pod {pod['id']} was ended, so one pod "
                          "trains on the volume", f"`podkit deploy status {first['id']}` follows that one; stop it "
                          "first to deploy again on this volume")

    def act(self, pod_id: str, action: str) -> dict | None:
        """start | stop | terminate. A stop of a pod already stopped, or a terminate of one gone, is done."""
        try:
            return self.api.action(pod_id, action)
        except api.ApiError as e:
            if e.status == 404 and action == "terminate":
                return None
            if e.status == 409:
                pod = self.api.pod(pod_id)
                if pod and action == "stop" and api.pod_state(pod) == "stopped":
                    return pod
                if pod and action == "start" and api.pod_state(pod) in ("starting", "running"):
                    return pod  # a start whose first answer was lost, sent again
                if pod and pod.get("locked") and action == "stop":
                    raise PodkitError(f"pod {pod_id} is locked: RunPod does not stop a locked pod",
                                      "unlock it in the console (or PATCH locked: false), then stop it") from None
                state = pod.get("status") if pod else "gone"
                raise PodkitError(f"RunPod cannot {action} pod {pod_id} while it is {state} (it allows: "
                                  f"{', '.join((pod or {}).get('actions') or []) or 'nothing'})") from None
            raise

    def status(self, pod_id: str) -> dict:
        pod = self.api.pod(pod_id)
        if not pod:
            raise PodkitError(f"RunPod has no pod {pod_id}", "it was terminated, or migrated to a new pod with a new "
                              "id: `podkit deploy status` lists your pods")
        return pod


def lost_answer(e: api.ApiError) -> bool:
    """RunPod may have acted on the request: no answer, a 5xx, or a 2xx that could not be read."""
    return e.status == 0 or e.status >= 500 or 200 <= e.status < 300
