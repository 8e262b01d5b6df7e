"""`podkit deploy`: the RunPod template from runpod/template.yaml, and a pod on A40s from it; `status`,
`stop`, `start`, `terminate`, `logs` and `watch` of a pod; `cluster` for an Instant Cluster.

Everything goes through RunPod's REST API v2 (podkit.runpod, the one client, which the pod's cost guard
shares): templates are created or updated (PATCH) by name, pods are created with v2's nested body (gpu
{id, count, minCudaVersion}, mounts), and every lifecycle change is one `POST /v2/pods/{id}/action`. The
API key is never printed. A pod's state is read through runpod.STATUSES, the one map of RunPod's statuses.
The layers, each importing only those above it:

    template.py    runpod/template.yaml read and checked; the container fields; an image RunPod can pull
    bodies.py      the request bodies (createPod, createCluster) and each pod's env
    pods.py        what RunPod's answers say about a pod or a cluster, and the lines that show it
    deployer.py    the RunPod calls: the template saved, a pod created exactly once, waited for, acted on
    watch.py       `podkit deploy watch`: the relaunch state machine, one watch per run
    verbs.py       the verbs, one function each (SUBCOMMANDS); main

What callers and tests use is named here.
"""

from podkit.deploy.bodies import (
    SHIPPED_CLUSTER_CONFIG,
    SHIPPED_CONFIG,
    SHIPPED_GPUS,
    STOP_AT_ENV,
    cluster_body,
    new_run,
    pod_body,
)
from podkit.deploy.deployer import Deployer
from podkit.deploy.pods import created_order
from podkit.deploy.template import default_template, load_template
from podkit.deploy.verbs import SUBCOMMANDS, main
from podkit.deploy.watch import Watch, relauncher

__all__ = ["SHIPPED_CLUSTER_CONFIG", "SHIPPED_CONFIG", "SHIPPED_GPUS", "STOP_AT_ENV", "SUBCOMMANDS", "Deployer",
           "Watch", "cluster_body", "created_order", "default_template", "load_template", "main", "new_run",
           "pod_body", "relauncher"]
