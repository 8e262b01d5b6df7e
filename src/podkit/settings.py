"""Every setting of the pod config: its type, default, words, unit and bounds, one table (SCHEMA). config.py
loads, validates and renders against it; docs/configuration.md's table is rendered from it.

Boot-path module: stdlib only.
"""

from __future__ import annotations

# Every number has a ceiling: past a month a duration is a mistake, and 1e12 s overflows sleep; a count
# past a billion is one too. A setting that needs another states its own.
DURATION_MAX_S = 30 * 24 * 3600
COUNT_MAX = 10**9


class Field:
    __slots__ = ("type", "default", "doc", "unit", "choices", "minimum", "maximum")

    def __init__(self, type: type, default: object, doc: str, unit: str = "", choices: tuple = (),
                 minimum: float | None = None, maximum: float | None = None) -> None:
        if type in (int, float) and maximum is None:
            maximum = DURATION_MAX_S if unit == "s" else COUNT_MAX
        self.type, self.default, self.doc, self.unit = type, default, doc, unit
        self.choices, self.minimum, self.maximum = choices, minimum, maximum


# section -> key -> Field; top-level scalars live under "" (their env twin has no section part).
SCHEMA: dict[str, dict[str, Field]] = {
    "": {
        "workspace": Field(str, "/workspace", "the pod's volume: logs, checkpoints, repo, podkit state", "path"),
        "run_dir": Field(str, "", "sockets and pid files, on local disk (never the network volume); "
                         "empty: /tmp/podkit-<uid>-<hash of workspace>", "path"),
        "devices": Field(str, "/dev/nvidia*", "glob of the GPU device files the reap stage frees (files named "
                         "nvidia*; a glob that matches anything else is a config error)", "glob"),
        "log_level": Field(str, "info", "podkit's own log level", "", ("debug", "info", "warning", "error")),
        "stop_timeout_s": Field(float, 10.0, "the container's stop timeout, SIGTERM to SIGKILL (docker stop -t, "
                                "compose stop_grace_period; docker's and RunPod's: 10 s): the whole stop ends 1.5 s "
                                "before it, and the trainer's grace is cut to what is left", "s", minimum=4),
    },
    "reap": {
        "enabled": Field(str, "auto", "auto: only when podkit is the container's entrypoint (PID 1)",
                         "", ("auto", "always", "never")),
        "grace_s": Field(float, 5.0, "SIGTERM to SIGKILL grace for each holder", "s", minimum=0),
        "kill_wait_s": Field(float, 5.0, "how long to wait for a SIGKILLed holder to be gone", "s", minimum=0),
        "gpu_free_timeout_s": Field(float, 30.0, "wait for nvidia-smi to show the GPUs' memory freed", "s",
                                    minimum=0),
        "on_failure": Field(str, "safe-mode", "a holder that survives SIGKILL: stop in safe mode or go on",
                            "", ("safe-mode", "continue")),
    },
    "repo": {
        "url": Field(str, "", "training repo to sync; empty: no sync", "url"),
        "ref": Field(str, "main", "branch, tag or commit to check out"),
        "dest": Field(str, "", "checkout directory; empty: <workspace>/repo", "path"),
        "depth": Field(int, 1, "fetch depth; 0: full history", "commits", minimum=0),
        "timeout_s": Field(float, 300.0, "limit for one git network operation", "s", minimum=1),
        "retries": Field(int, 3, "attempts for a network operation, with exponential back-off", "", minimum=1,
                         maximum=20),
        "lock_timeout_s": Field(float, 600.0, "how long a second boot waits for the sync lock", "s", minimum=0),
        "setup": Field(str, "", "shell command run in the checkout to install its requirements (e.g. pip install -r "
                       "requirements.txt), once per change of its dependency files, into a venv on the volume "
                       "that inherits the image's packages; the trainer runs in it. Empty: the image's packages"),
        "setup_timeout_s": Field(float, 1800.0, "limit for repo.setup", "s", minimum=1),
    },
    "guard": {
        "max_boots": Field(int, 5, "crash-loop guard: more boots than this within window_s -> safe mode", "",
                           minimum=1),
        "window_s": Field(float, 600.0, "crash-loop guard: the window boots are counted in", "s", minimum=1),
        "lease_s": Field(float, 300.0, "one workspace, one pod: another pod's hold on the workspace lapses this "
                         "long after its last renewal (a pod on another host that died), and never before two of its "
                         "once-a-minute renewals were missed", "s", minimum=30),
        "stop_pod_when_finished": Field(str, "auto", "cost guard: auto stops the RunPod pod (RUNPOD_POD_ID) when "
                                        "training finishes, after its checkpoint and notification", "",
                                        choices=("auto", "never")),
        "stop_pod_after_s": Field(float, 3600.0, "cost guard: a RunPod pod that does not train this long (safe "
                                  "mode, a program FATAL, a trainer that supervisord will not start again and you did "
                                  "not stop) stops itself (the volume stays); 0: never", "s", minimum=0),
        "stop_pod_at": Field(float, 0.0, "cost guard: a RunPod pod stops itself at this Unix time, the trainer "
                             "first with its checkpoint (`podkit deploy --max-runtime` sets it); 0: never", "s",
                             minimum=0, maximum=4102444800),  # 2100-01-01
        "max_spend": Field(float, 0.0, "cost guard: once this run has cost this many US dollars on RunPod (its "
                           "pods' prices over time, corrected by the bill: cost.json), the trainer stops with its "
                           "checkpoint, then the pod; 0: no budget", "USD", minimum=0, maximum=1e6),
        "cost_every_s": Field(float, 60.0, "on RunPod, how often the pod reads its price and spend from RunPod's "
                              "API (.podkit/cost.json on the volume: podkit status, guard.max_spend)", "s", minimum=1),
        "network_volume": Field(str, "warn", "on RunPod, a pod without a network volume (no RUNPOD_VOLUME_ID): its "
                                "checkpoints die with the pod (terminated, or migrated to another host); warn, "
                                "refuse to train (safe mode), or off. With checkpoint.remote set, the remote is "
                                "durable and neither applies", "", choices=("warn", "refuse", "off")),
        "durable_within_s": Field(float, 3600.0, "durability guard, with checkpoint.remote: a notification (and a "
                                  "doctor problem) when the run trains and its last checkpoint on the remote is older "
                                  "than this while newer steps are at risk; 0: never", "s", minimum=0),
    },
    "cluster": {
        "nodes": Field(int, 1, "nodes of the run; more than 1: a Ray cluster running AReaL's own Ray launcher "
                       "(docs/runpod.md: Beyond one pod)", "", minimum=1, maximum=64),
        "rank": Field(int, -1, "this node's rank; 0 runs the Ray head and the launcher; -1: $NODE_RANK (RunPod "
                      "Instant Clusters; 0 on a single pod)", "", minimum=-1, maximum=63),
        "head": Field(str, "", "the head node's address (rank 0's node_addr); empty: $PRIMARY_ADDR or $MASTER_ADDR "
                      "(RunPod Instant Clusters)"),
        "node_addr": Field(str, "", "this node's address on the cluster network; empty: $NODE_ADDR, else the head's "
                           "on rank 0"),
        "ray_port": Field(int, 6379, "the Ray head's GCS port", "", minimum=1, maximum=65535),
        "ifname": Field(str, "", "NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME for every rank, set before Ray starts "
                        "(RunPod Instant Clusters: ens1, never eth0); empty: leave them"),
        "gpus": Field(int, 0, "GPUs each node gives Ray; 0: Ray counts them (a CPU test cluster declares 1)", "",
                      minimum=0),
        "join_timeout_s": Field(float, 900.0, "rank 0 waits this long for every node and its GPUs before it "
                                "explains which is missing; a worker node waits as long for the head", "s", minimum=1),
        "rank_timeout_s": Field(float, 600.0, "a trainer rank that has not said it is alive for this long is dead: "
                                "the run is restarted from its checkpoint (longer than AReaL's own recover run takes "
                                "to start new ranks: its SGLang servers first)", "s", minimum=5),
        "node_lost_s": Field(float, 60.0, "a node gone from Ray this long: the run is stopped and waits for it, "
                             "naming it", "s", minimum=1),
    },
    "metrics": {
        "port": Field(int, 9400, "the pod's Prometheus endpoint (/metrics); 0: off", "", minimum=0, maximum=65535),
        "host": Field(str, "127.0.0.1", "address /metrics binds; beyond loopback needs PODKIT_METRICS_KEY"),
    },
    "page": {
        "port": Field(int, 9401, "the run at a glance: a web page of the pod's run, drawn from the records "
                      "`podkit status` reads (podkit run page); 0: off", "", minimum=0, maximum=65535),
        "host": Field(str, "127.0.0.1", "address the page binds; beyond loopback needs PODKIT_PAGE_TOKEN (the "
                      "RunPod template binds 0.0.0.0 for RunPod's HTTP proxy)"),
    },
    "watchdog": {
        "interval_s": Field(float, 10.0, "how often the watchdog looks", "s", minimum=0.1),
        "trainer_stall_s": Field(float, 900.0, "no training step for this long while inference is ready: "
                                 "dump the trainer's stacks and restart it; before a run's first step, no CPU, "
                                 "I/O or log output from its ranks for this long (loading and preparing data "
                                 "are busy, not hung)", "s", minimum=1),
        "trainer_first_step_s": Field(float, 3600.0, "before a run's first step, busy or not, this long from the "
                                      "run's start is a hang (dumped and restarted as one); 0: no bound", "s",
                                      minimum=0),
        "inference_unhealthy_s": Field(float, 300.0, "inference up but not answering /health for this long: "
                                       "restart it", "s", minimum=1),
        "startup_deadline_s": Field(float, 1800.0, "longest inference start-up (loading weights, CUDA graph "
                                    "capture, warm-up) before it counts as stuck", "s", minimum=1),
        "generation_probe_s": Field(float, 300.0, "how often a real one-token generation (/health_generate) "
                                    "checks inference, one at a time and never during a weight update; "
                                    "/health is liveness only; 0: never", "s", minimum=0),
        "weight_update_deadline_s": Field(float, 0.0, "a weight update in flight this long counts as a hang "
                                          "(generation waits behind it, and the generation check waits for it): "
                                          "inference is restarted; 0: 5 x trainer.weight_update_timeout_s; else at least "
                                          "trainer.weight_update_timeout_s", "s",
                                          minimum=0),
    },
    "health": {
        "progress_timeout_s": Field(float, 1800.0, "unhealthy when the trainer has not stepped for this long "
                                    "(after its first step)", "s", minimum=1),
    },
    "inference": {
        "kind": Field(str, "sglang", "sglang: the real SGLang server; standin: podkit's stand-in for SGLang's HTTP "
                      "API (no GPU, no model: smoke stack only); standin-lm: podkit's generating stand-in, a tiny "
                      "local model on CPU (the CPU rehearsal, configs/cpu-rehearsal.yaml)", "",
                      ("sglang", "standin", "standin-lm")),
        "host": Field(str, "127.0.0.1", "address the server binds; beyond loopback needs SGLANG_API_KEY"),
        "port": Field(int, 30000, "HTTP port of the server", "", minimum=1, maximum=65535),
        "gpus": Field(str, "0", "CUDA_VISIBLE_DEVICES for inference"),
        "model": Field(str, "Qwen/Qwen2.5-0.5B-Instruct", "model served (and trained: the trainer's actor.path); "
                       "with standin-lm a local directory, ./ meaning the workspace"),
        "tp": Field(int, 1, "SGLang tensor-parallel size: must equal the number of inference GPUs", "",
                    minimum=1),
        "mem_fraction_static": Field(float, 0.85, "SGLang --mem-fraction-static: GPU memory for weights and KV "
                                     "cache", "", minimum=0.05, maximum=1),
        "attention_backend": Field(str, "flashinfer", "SGLang --attention-backend; fa3 is Hopper-only (not A40)",
                                   "", ("flashinfer", "triton", "torch_native", "fa3")),
        "context_length": Field(int, 0, "SGLang --context-length; 0: the model's", "tokens", minimum=0),
        "cuda_graph_max_bs": Field(int, 0, "SGLang --cuda-graph-max-bs; 0: SGLang's default", "", minimum=0),
        "extra_args": Field(str, "", "more SGLang flags, shell-quoted (checked by SGLang's parser in the tests)"),
        "startup_delay_s": Field(float, 3.0, "stand-in only: time spent in its fake start-up phases", "s",
                                 minimum=0),
        "standin_update_delay_s": Field(float, 0.0, "stand-in only: extra time each weight update takes "
                                        "(stages a slow update)", "s", minimum=0),
        "standin_probe_s": Field(float, 0.1, "stand-in only: how long a generation health probe takes (queued "
                                 "behind a weight update, as SGLang's one-token generation is)", "s", minimum=0),
        "ready_timeout_s": Field(float, 900.0, "how long the trainer waits for inference to be ready", "s",
                                 minimum=1),
        "gpu_free_timeout_s": Field(float, 60.0, "before (re)starting SGLang, wait this long for its GPUs' "
                                    "device files to be free of an old server's processes", "s", minimum=0),
        "stop_grace_s": Field(int, 20, "supervisord's stopwaitsecs for inference", "s", minimum=1),
    },
    "trainer": {
        "kind": Field(str, "areal", "areal: AReaL GRPO under torchrun (SPMD mode); fake: a real numpy training loop of a "
                      "tiny model on seeded random data (CPU, smoke stack)", "", ("areal", "fake")),
        "gpus": Field(str, "", "CUDA_VISIBLE_DEVICES for training"),
        "cpu_ranks": Field(int, 0, "AReaL trainer on CPU (the rehearsal): this many torchrun ranks and no GPU; "
                           "0: one rank per trainer.gpus", "", minimum=0, maximum=64),
        "entry": Field(str, "", "your AReaL training script in the synced checkout (train.py, or "
                       "package.module:function called with argv); empty: podkit's GSM8K example", "path"),
        "areal_config": Field(str, "", "AReaL experiment config (relative: to the checkout with trainer.entry, "
                              "else to the pod config's directory); empty: fake trainer only", "path"),
        "overrides": Field(str, "", "more AReaL config overrides, shell-quoted key=value pairs"),
        "checkpoint_every": Field(int, 10, "fake trainer: steps between checkpoints (and weight pushes)", "steps",
                                  minimum=1),
        "keep_checkpoints": Field(int, 3, "checkpoints kept by the fake trainer; 0: all", "", minimum=0),
        "step_interval_s": Field(float, 0.2, "fake trainer: minimum time per step, to pace it like a real one",
                                 "s", minimum=0),
        "max_steps": Field(int, 0, "stop (exit 0) after this step; 0: never", "steps", minimum=0),
        "seed": Field(int, 0, "seed of the fake data and model", minimum=0, maximum=2**32 - 1),
        "lr": Field(float, 0.01, "fake trainer: learning rate (a huge one makes the loss NaN, for doctor)", "",
                    minimum=0, maximum=1e38),  # float32's range
        "weight_update_timeout_s": Field(float, 120.0, "fake trainer: limit for one weight push to inference "
                                         "(AReaL's own wait is a fixed 120 s; doctor reads each trainer's "
                                         "limit)", "s", minimum=0.1),
        "stale_weights_check_s": Field(float, 30.0, "AReaL trainer: how often rank 0 asks inference which weights "
                                       "it serves (a restarted SGLang serves the base model)", "s", minimum=1),
        "on_inference_restart": Field(str, "reattach", "AReaL trainer: when inference restarts alone, reattach (the "
                                      "trainer goes on: rank 0 pushes its latest weights to the new server, generation "
                                      "waits for them; the latest version's weights stay on the run dir's disk for it: "
                                      "one model's size, two while the next is written) or restart (the trainer stops after its step and resumes). A cluster, a "
                                      "weight update that is not from disk, and a failed re-attach restart", "",
                                      choices=("reattach", "restart")),
        "experiment": Field(str, "", "AReaL experiment_name; empty: the AReaL YAML's own (podkit when it has "
                            "none). Names the run's directories"),
        "trial": Field(str, "", "AReaL trial_name; empty: the AReaL YAML's own (run when it has none). A new "
                       "trial name is a new run: its own checkpoints and W&B run"),
        "name_resolve_root": Field(str, "", "AReaL's name_resolve file root; empty: <run_dir>/name_resolve (private: a "
                                   "record planted in a shared /tmp would send the trainer to another server); boot "
                                   "clears <root>/<user>/<experiment>/<trial> (a dead server's address)", "path"),
        "stop_grace_s": Field(int, 7, "supervisord's stopwaitsecs for the trainer (its final checkpoint "
                              "must fit), cut to what stop_timeout_s leaves (7 s of the default 10)", "s", minimum=1),
        "max_failures": Field(int, 3, "loop bound: a trainer whose runs end this many times in a row without a new "
                              "step for one cause (its script's error, a hang, out of memory; three times this for a "
                              "cause outside the script: inference down, a network error, a kill) stays stopped "
                              "(status, doctor, a notification; the cost guard stops the pod); a stop you asked for "
                              "counts nothing; so does a cluster worker's `ray` that fails to join its head this many "
                              "times; 0: restart for ever", "", minimum=0, maximum=1000),
        "max_episode_failures": Field(int, 64, "AReaL trainer: rollout episodes (your workflow's arun_episode: "
                                      "generation and your reward function; your should_accept_fn) that fail in a "
                                      "row, none succeeding, before the trainer stops with the last one's "
                                      "exception, named with its file and line (the loop bound counts it); AReaL "
                                      "itself logs each and tries the next for ever. 0: never", "episodes",
                                      minimum=0, maximum=1_000_000),
        "episode_failure_window_s": Field(float, 60.0, "AReaL trainer: the failures in a row must also span this "
                                          "long before they stop the trainer: a judge or server out for a moment "
                                          "fails every episode in flight without being your code's", "s",
                                          minimum=0),
        "restart_delay_s": Field(float, 10.0, "loop bound: the wait before restarting a trainer that failed without "
                                 "a new step (or a worker's `ray` that did not join), doubled for each such failure "
                                 "in a row (at most 10 minutes)", "s",
                                 minimum=0, maximum=600),
    },
    "checkpoint": {
        "remote": Field(str, "", "a place off the pod for the run's checkpoints: s3://bucket/prefix (credentials from "
                        "AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL), any rclone remote name:path "
                        "(RCLONE_CONFIG_<NAME>_* env vars), or rclone's connection string :backend,option=value:path "
                        "(its secret options shown as <redacted>). Each whole checkpoint is uploaded in the background as "
                        "<remote>/<experiment>/<trial>/gen-<step>/ (a lineage begun by start-over: under "
                        "lineages/<id>/), and the boot restores the newest of the run's current lineage onto a volume "
                        "without it; the run's record (its lineages, pods, spend, guards) lives beside them, in run/; "
                        "empty: off", "url"),
        "remote_keep": Field(int, 3, "whole generations kept on the remote; an older one is removed only once a "
                             "newer one is whole", "", minimum=1, maximum=1000),
        "remote_poll_s": Field(float, 10.0, "how often the uploader looks for a new checkpoint", "s", minimum=0.1),
        "remote_every_s": Field(float, 60.0, "the shortest time between the starts of two background uploads: the "
                                "newest whole checkpoint goes up then (each upload's rclone starts are CPU beside "
                                "the trainer); 0: each one as soon as it is whole. The stop's upload never waits "
                                "for it", "s", minimum=0),
        "remote_timeout_s": Field(float, 3600.0, "limit for one upload or restore (rclone retries within it)", "s",
                                  minimum=1),
        "restore_timeout_s": Field(float, 300.0, "how long the boot's restore keeps trying a remote that does not "
                                   "answer (the run's record, the listing, a manifest: each read bounded, tried again "
                                   "with back-off); then the trainer starts from what the volume has, and status says "
                                   "the remote's newest was not restored. A download that moves is bounded by "
                                   "remote_timeout_s", "s", minimum=0),
        "remote_final_s": Field(float, 600.0, "limit for the upload of the last checkpoint when the pod stops "
                                "itself (a cost guard: the pod bills meanwhile, and stops after it); at a SIGTERM "
                                "(docker stop, RunPod's stop, podkit up's Ctrl-C) it gets at most what stop_timeout_s "
                                "leaves after the trainer's checkpoint. What could not be uploaded is named", "s",
                                minimum=0),
    },
}
