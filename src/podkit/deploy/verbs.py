"""The verbs of `podkit deploy`, one function each, found by name in SUBCOMMANDS: create (the default:
the template saved, a pod started and waited for), status, stop, start, terminate, logs, watch, and an
Instant Cluster's cluster, cluster-status and cluster-delete. Each checks its own arguments before
anything is sent."""

from __future__ import annotations

import json
import os
import shlex
import sys
import time

from podkit import log
from podkit import runpod as api
from podkit.deploy import template
from podkit.deploy.bodies import (
    GPU_TYPE,
    REMOTE_ENV,
    check_cluster_image,
    check_cluster_shape,
    checkpoint_remote,
    cluster_body,
    cluster_env,
    config_for,
    new_run,
    parse_duration,
    pod_body,
)
from podkit.deploy.deployer import CLOUDS, Deployer, lost_answer
from podkit.deploy.pods import cluster_summary, how_to_reach, maybe_live, pod_line, run_of
from podkit.deploy.watch import Watch, one_watch, relauncher
from podkit.errors import ConfigError, PodkitError
from podkit.money import ledger
from podkit.money.costguard import POD_ID
from podkit.redact import Redactor, secret_name

_log = log.get("deploy")


def main(args) -> int:
    action = args.action or "create"
    if action not in SUBCOMMANDS:
        raise ConfigError("command line", "ACTION", f"unknown action {action!r}", " | ".join(SUBCOMMANDS))
    return SUBCOMMANDS[action](args)


def create(args) -> int:
    """The template saved (created, or PATCHed by name), then a pod on A40s from it, waited for until it runs."""
    tpl = template.from_args(args)
    check_cloud(args)
    if args.gpus < 1:
        raise ConfigError("command line", "--gpus", f"{args.gpus}: at least 1")
    config_for(tpl, args.gpus)  # refuse a GPU count without a pod config before anything is sent
    remote = checkpoint_remote(tpl, template_source(args))  # and a remote the pod could not reach
    stop_at = max_runtime_until(args)
    name = args.name or f"{tpl['name']}-{args.gpus}xa40"
    if args.dry_run:
        base = api.base_url()
        vol = {"id": args.network_volume, "dataCenter": "<its data center>"} if args.network_volume else None
        warn_unpullable(tpl)
        keyed = bool((os.environ.get("RUNPOD_API_KEY") or "").strip())
        if keyed:  # a read, said; without a key nothing goes out, and nothing is said of the price
            print(f"# {price_line(None, args)}; read from GET {base}/v2/catalog/gpus, this dry run's one request")
        print(f"# 1. GET {base}/v2/templates  (Authorization: Bearer $RUNPOD_API_KEY; finds {tpl['name']!r})")
        print(f"# 2. POST {base}/v2/templates  (PATCH {base}/v2/templates/<id> when one named {tpl['name']!r} exists)")
        print(json.dumps(template.template_body(tpl), indent=2, ensure_ascii=False))
        if vol:
            print(f"# 3. GET {base}/v2/network-volumes  (finds {vol['id']}'s data center)")
        print(f"# {4 if vol else 3}. GET {base}/v2/pods  (the run's pods already there, by its run id: a create "
              "whose answer is lost is looked for, not sent twice)")
        if remote and not vol:
            print(f"# no network volume: RunPod places the pod in any data center of {args.cloud} cloud with the "
                  f"GPUs; its checkpoints go to checkpoint.remote {remote}")
        print(f"# {5 if vol else 4}. POST {base}/v2/pods")
        print(json.dumps(pod_body(tpl, args.gpus, args.cloud, name, vol, stop_at, "<a new run id>"), indent=2,
                         ensure_ascii=False))
        print("# nothing was written (--dry-run)" if keyed else "# nothing was sent (--dry-run)")
        return 0
    template.check_image(tpl, args)
    d = Deployer()
    vol = d.network_volume(args.network_volume) if args.network_volume else None
    if vol and (busy := d.pods_on(vol["id"])):
        raise PodkitError(f"network volume {vol['id']} is in use by pod {busy[0]['id']} ({busy[0].get('name')}, "
                          f"{busy[0].get('status')}): two pods on one volume would train over each other",
                          f"stop it first (`podkit deploy stop {busy[0]['id']}`), or use another volume")
    interrupted_before(d, name)
    print(price_line(d, args), flush=True)  # what it will cost, before anything is made
    d.save_template(tpl)
    body = pod_body(tpl, args.gpus, args.cloud, name, vol, stop_at, new_run())
    run = body["env"].get(ledger.RUN_ENV, "")
    pending(name, run)  # before the create goes out: a deploy interrupted from here on is found by the next one
    made, sent = None, time.monotonic()
    try:
        try:
            pod = made = d.create_pod(body, args.capacity_timeout)
        except api.ApiError as e:
            if not lost_answer(e):
                pending(name, "")  # RunPod answered: refused, no pod of it to look for
            raise
        except PodkitError:
            pending(name, "")  # refused (no capacity, a bad body): RunPod made nothing
            raise
        if (cost := api.pod_cost(pod)) is not None:
            print(f"pod {pod['id']} created: RunPod bills it ${cost:.2f}/h (its cost)", flush=True)
        pending(name, "")
        if stop_at:
            _log.info(f"pod {pod['id']} stops itself at {time.strftime('%Y-%m-%d %H:%M %Z', time.localtime(stop_at))}"
                      " (--max-runtime), the trainer first with its checkpoint")
        pod = d.wait_running(pod["id"], args.wait_timeout, volume_id=vol["id"] if vol else "", sent=sent)
    except KeyboardInterrupt:
        print("podkit: interrupted after the pod create was sent: "
              + (f"pod {made['id']} bills until you stop it (`podkit deploy stop {made['id']}`), or follow it with "
                 f"`podkit deploy status {made['id']}`" if made else
                 f"RunPod may still make a pod of run {run} ({name!r}): `podkit deploy status` lists it, and a deploy "
                 "again looks for it first, so it never makes a second"), file=sys.stderr, flush=True)
        return 130
    print(f"pod {pod['id']} is running. Reach it with:")
    for line in how_to_reach(pod):
        print("  " + line)
    print(f"stop it: podkit deploy stop {pod['id']}   terminate: podkit deploy terminate {pod['id']}")
    same = "".join(f" {flag} {shlex.quote(str(v))}" for flag, v in (("--network-volume", vol and vol["id"]),
                   ("--template", args.template), ("--cloud", args.cloud if args.cloud != "SECURE" else None)) if v)
    if remote and not vol:
        print(f"its checkpoints go to checkpoint.remote {remote} as they are saved (no network volume): a pod of this "
              "run in any data center restores the newest whole one at boot")
    if vol or remote:
        print(f"relaunch it when it is lost: podkit deploy watch {pod['id']}{same}")
    else:
        print("its checkpoints live on the pod's own volume: a pod RunPod migrates or terminates takes them with it; "
              f"--network-volume, or {REMOTE_ENV} in the template's env (checkpoint.remote), keeps them apart from "
              "any one pod")
    return 0


# A create sent by a deploy that did not see its answer (Ctrl-C, a lost answer given up): the next deploy of that
# name looks for its pod first, so two deploys never make two pods
PENDING_S = 86400.0


def _pending_path():
    from pathlib import Path

    return Path(os.environ.get("PODKIT_CACHE_DIR") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
                / "podkit") / "deploys-pending.json"


def pending(name: str, run: str) -> None:
    """Note (run) or clear ("") the create of `name` under way. Never raises: a note is a help."""
    from podkit import records

    path = _pending_path()
    try:
        notes = records.Record(path.name, {}).read_owned(path.parent)
        notes = {k: v for k, v in notes.items() if isinstance(v, dict) and time.time() - (v.get("time") or 0) < PENDING_S}
        if run:
            notes[name] = {"run": run, "time": time.time()}
        else:
            notes.pop(name, None)
        records.write_json(path, notes, mode=0o600)
    except OSError:
        pass


def interrupted_before(d: Deployer, name: str) -> None:
    """A deploy of `name` interrupted after its create was sent: its pod, if RunPod made it, is followed by a
    person, never doubled. Looks for as long as that create could still show (Deployer.look_s); refuses while one
    is there."""
    from podkit import records

    path = _pending_path()
    note = records.Record(path.name, {}).read_owned(path.parent).get(name)
    if not isinstance(note, dict) or not isinstance(note.get("run"), str) or \
            not isinstance(note.get("time"), (int, float)) or time.time() - note["time"] >= PENDING_S:
        return
    run, when = note["run"], time.strftime("%H:%M", time.localtime(note["time"]))
    mine = lambda p: run_of(p) == run  # noqa: E731
    found = [p for p in d.api.pods() if mine(p)]
    if not found and time.time() - note["time"] < d.look_s():
        _log.info(f"the deploy of {name!r} interrupted at {when} sent a create whose answer it did not see: RunPod may "
                  "still make its pod")
        found = d.look_for(mine, set())
    live = [p for p in found if maybe_live(p)]
    if live:
        p = live[0]
        raise PodkitError(f"pod {p['id']} ({p.get('name')}, {p.get('status')}) was made by the deploy of {name!r} "
                          f"interrupted at {when}: deploying again would make a second pod",
                          f"follow it (`podkit deploy status {p['id']}`), or end it (`podkit deploy terminate "
                          f"{p['id']}`) and deploy again")
    pending(name, "")


def template_source(args) -> str:
    """Where the template came from, as a ConfigError names it."""
    return args.template or "runpod/template.yaml"


def price_line(d: Deployer | None, args) -> str:
    """What the pod will cost an hour, from RunPod's GPU catalogue (its list price x the GPUs), in a line."""
    what = f"{args.gpus}x {GPU_TYPE} in {args.cloud} cloud"
    try:
        price = (d or Deployer()).list_price(args.gpus, args.cloud)
    except api.ApiError as e:
        return f"price: unknown for {what} (RunPod's GPU catalogue did not answer: {e.message})"
    if price is None:
        return f"price: unknown: RunPod's GPU catalogue lists no price for {what}"
    return f"price: ${price:.2f}/h for {what} (RunPod's list price; the pod's own is shown once it is made)"


def warn_unpullable(tpl: dict) -> None:
    """A dry run shows the requests whatever the image (stdout stays the requests), and says on stderr
    what a real deploy would refuse."""
    if why := template.unpullable(tpl["imageName"]):
        print(f"podkit: warning: image {tpl['imageName']!r} {why}: a real deploy refuses it (--image names your "
              "registry's copy)", file=sys.stderr)


def status(args) -> int:
    """Every pod of the account, one line each; with POD, that pod and how to reach it."""
    if not args.pod:
        pods = Deployer().api.pods()
        if args.json:
            print(json.dumps(pods, indent=2))
        for pod in [] if args.json else pods:
            print(pod_line(pod))
        return 0
    pod_id = pod_arg(args)
    pod = Deployer().status(pod_id)
    print(json.dumps(pod, indent=2) if args.json else pod_line(pod))
    if not args.json:
        for line in how_to_reach(pod):
            print("  " + line)
    return 0


# What a pod action says once RunPod has taken it.
ACTED = {"stop": "stopped (its volume is kept; `podkit deploy start {pod}` resumes it)",
         "start": "starting (if its GPUs were taken meanwhile, RunPod offers to migrate it: a new pod with a new id "
                  "and IP, which `podkit deploy status` lists)",
         "terminate": "terminated"}


def act(args) -> int:
    """stop | start | terminate POD: one `POST /v2/pods/{id}/action`."""
    pod = pod_arg(args)
    Deployer().act(pod, args.action)
    _log.info(f"pod {pod} " + ACTED[args.action].format(pod=pod))
    return 0


def pod_arg(args, what: str = "pod") -> str:
    """The POD (or CLUSTER) argument, required and of RunPod's id shape."""
    if not args.pod:
        raise ConfigError("command line", what.upper(), f"`podkit deploy {args.action}` needs a {what} id")
    check_pod_id(args.pod, what)
    return args.pod


def logs(args) -> int:
    """`podkit deploy logs POD [--follow] [--system] [--tail N]`: the pod's log stream, secrets redacted."""
    pod = pod_arg(args)
    d = Deployer()
    if args.tail is not None and not 0 <= args.tail <= 5000:
        raise ConfigError("command line", "--tail", f"{args.tail}: 0..5000 lines (RunPod's limit)")
    scrub = Redactor({f"env {k}": v for k, v in os.environ.items() if secret_name(k)})
    source = "system" if args.system else "container"
    try:
        for event in d.api.logs(pod, source=source, tail=args.tail, follow=args.follow):
            print(scrub(d.api.redact(event["line"])), flush=True)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `| head`
        sys.stderr.close()
    return 0


def check_cloud(args) -> None:
    if args.cloud not in CLOUDS:
        raise ConfigError("command line", "--cloud", f"{args.cloud!r} is not one of {', '.join(CLOUDS)}",
                          hint="RunPod's REST API v2 places a pod in one cloud (SECURE by default)")
    if args.network_volume and args.cloud == "COMMUNITY":
        raise ConfigError("command line", "--cloud", "network volumes are in Secure Cloud only",
                          hint="--cloud SECURE (the default)")


def check_pod_id(pod: str, what: str = "pod") -> None:
    if not POD_ID.match(pod):  # it goes into a URL path
        raise ConfigError("command line", what.upper(), f"{pod!r} is not a RunPod {what} id")


def max_runtime_until(args) -> float:
    """--max-runtime as the Unix time to stop at; 0 without one."""
    return time.time() + parse_duration(args.max_runtime, "--max-runtime") if args.max_runtime else 0


def cluster_status(args) -> int:
    """The cluster, its nodes' states and rank 0's SSH; nodes beyond the run's named."""
    cid = pod_arg(args, "cluster")
    d = Deployer()
    c = d.cluster(cid)
    members = d.api.cluster_pods(cid)
    if args.json:
        print(json.dumps(dict(c, members=members), indent=2))
    else:
        print("\n".join(cluster_summary(c, members)))
    return 0


def cluster_delete(args) -> int:
    cid = pod_arg(args, "cluster")
    Deployer().delete_cluster(cid)
    _log.info(f"cluster {cid} deleted: every node terminated (the network volume is kept)")
    return 0


def cluster(args) -> int:
    """An Instant Cluster: --nodes x --gpus-per-node --gpu-type, every node on the run's network volume."""
    if args.pod:
        raise ConfigError("command line", "CLUSTER", f"`podkit deploy cluster` creates one and takes no id ({args.pod!r})",
                          hint="podkit deploy cluster-status CLUSTER | cluster-delete CLUSTER")
    if not args.network_volume:
        raise ConfigError("command line", "--network-volume", "a cluster needs a network volume: every node "
                          "mounts it at /workspace, where the run's checkpoints, logs and records are shared",
                          hint="create one under Storage in the cluster's data center; --network-volume ID")
    check_cluster_shape(args.nodes, args.gpus_per_node, args.gpu_type)
    tpl = template.from_args(args)
    check_cluster_image(tpl, template_source(args))
    cluster_env(tpl, args.nodes, args.gpus_per_node)  # refuse a shape without a cluster config before anything is sent
    stop_at = max_runtime_until(args)
    name = args.name or f"{tpl['name']}-{args.nodes}x{args.gpus_per_node}"
    if args.dry_run:
        vol = {"id": args.network_volume, "dataCenter": "<the network volume's data center>"}
        body = cluster_body(tpl, name, args.nodes, args.gpus_per_node, args.gpu_type, vol, stop_at)
        warn_unpullable(tpl)
        print(f"# 1. GET {api.base_url()}/v2/network-volumes  (Authorization: Bearer $RUNPOD_API_KEY; finds the "
              "volume's data center)")
        print(f"# 2. POST {api.base_url()}/v2/clusters")
        print(json.dumps(body, indent=2, ensure_ascii=False))
        print("# nothing was sent (--dry-run)")
        return 0
    template.check_image(tpl, args)
    d = Deployer()
    vol = d.network_volume(args.network_volume)
    c = d.create_cluster(cluster_body(tpl, name, args.nodes, args.gpus_per_node, args.gpu_type, vol, stop_at,
                                      new_run()))
    cid = c["id"]
    print(f"cluster {cid} created: {args.nodes} nodes x {args.gpus_per_node} {args.gpu_type.strip()}, network "
          f"volume {vol['id']} at /workspace ({vol['dataCenter']})")
    print(f"  watch it:  podkit deploy cluster-status {cid}   (rank 0's SSH once it runs; logs: "
          "/workspace/logs/trainer.log, other nodes' under /workspace/logs/node-<rank>)")
    print(f"  end it:    podkit deploy cluster-delete {cid}   (terminates every node; RunPod has no cluster stop; "
          "the network volume keeps the checkpoints)")
    if stop_at:
        print(f"  --max-runtime: the trainer stops with its checkpoint at "
              f"{time.strftime('%Y-%m-%d %H:%M %Z', time.localtime(stop_at))}; delete the cluster to end its billing")
    return 0


def watch(args) -> int:
    """Follow POD; when RunPod says it is lost, stop it and start a replacement on the run's network volume, or,
    with a checkpoint.remote in the template's env, in any data center with the GPUs."""
    if not args.pod:
        raise ConfigError("command line", "POD", "`podkit deploy watch` needs a pod id")
    tpl = template.from_args(args)
    remote = checkpoint_remote(tpl, template_source(args))
    if not args.network_volume and not remote:
        raise ConfigError("command line", "--network-volume", "a replacement pod resumes from the run's network "
                          "volume or its checkpoint.remote, and neither was named: on a new pod volume it would "
                          "start from nothing",
                          hint="deploy with `podkit deploy --network-volume ID` and watch with the same ID, or put "
                          f"{REMOTE_ENV} (s3://bucket/prefix) and its credentials in the template's env (--template)")
    for flag, value in (("--lost-after", args.lost_after), ("--poll", args.poll), ("--backoff", args.backoff)):
        if not 0 < value < float("inf"):
            raise ConfigError("command line", flag, f"{value}: a positive number of seconds")
    if args.max_relaunches < 0:
        raise ConfigError("command line", "--max-relaunches", f"{args.max_relaunches}: 0 or more")
    check_cloud(args)
    check_pod_id(args.pod)
    if args.image:  # the replacements' image (without it, the image the watched pod runs)
        template.check_image(tpl, args)
    d = Deployer()
    vol = d.network_volume(args.network_volume) if args.network_volume else None
    if not (pod := d.api.pod(args.pod)):
        raise PodkitError(f"RunPod knows no pod {args.pod!r}", "check the id: `podkit deploy status` lists your "
                          "pods; the watch replaces pods it has seen, never one it could not find")
    if not vol and not run_of(pod):  # its replacements and a second pod of it are told by nothing else
        raise PodkitError(f"pod {args.pod} has no run id ({ledger.RUN_ENV} in its env): without a network volume "
                          "the watch tells the run's pods in every data center by it, so it could neither follow a "
                          "migration nor end a second replacement", "deploy the run with `podkit deploy`, which "
                          "gives it one, or watch it with --network-volume")
    launch = relauncher(d, tpl, vol, args.cloud, args.gpus, args.name, args.capacity_timeout, args.image)
    where = (f"on network volume {vol['id']} ({vol['dataCenter']})" if vol else f"in any data center of "
             f"{args.cloud} cloud with the GPUs, each restoring from checkpoint.remote {remote}")
    _log.info(f"watching pod {args.pod} every {args.poll:g} s; lost after {args.lost_after:g} s not running; up to "
              f"{args.max_relaunches} replacement(s) {where}")
    w = Watch(d, args.pod, launch, volume_id=vol["id"] if vol else "", remote=remote, lost_after_s=args.lost_after,
              start_grace_s=args.wait_timeout, poll_s=args.poll, max_relaunches=args.max_relaunches,
              backoff_s=args.backoff)
    run = run_of(pod) or args.pod  # without a volume, one watch per run id (a pod of no run: per pod)
    with one_watch(vol["id"]) if vol else one_watch(f"run-{run}", f"{run} (no network volume)"):
        try:
            return w.run()
        except KeyboardInterrupt:
            _log.info(f"watch interrupted; the pod now followed is {w.pod_id}")
            return 130


# The verbs by name (argparse's choices for ACTION, in cli.py); create when none is named.
SUBCOMMANDS = {"create": create, "status": status, "stop": act, "start": act, "terminate": act,
               "logs": logs, "watch": watch, "cluster": cluster, "cluster-status": cluster_status,
               "cluster-delete": cluster_delete}
