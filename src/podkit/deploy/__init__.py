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
"""
