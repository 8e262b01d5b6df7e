"""AReaL's own Ray launcher (areal.infra.launcher.ray, 1.0.4) as the driver of a cluster's run.

`python -m podkit.areal.ray_driver <entry> --config <areal yaml> key=value ...` is what the trainer
program on node rank 0 runs (cluster.py supervises it). It connects to the cluster's Ray head and calls
AReaL's `ray_main`, which places the SGLang servers and the FSDP trainer ranks on the nodes. What this
adds around it, each for a fact of areal 1.0.4's launcher (launcher/ray.py):

- a true exit code: `wait(check_status=(COMPLETED, FAILED))` raises JobException for the trainer job
  that completed, which ray_main re-raises, so a finished run exited 1. Here COMPLETED is 0;
- every worker of the job (every node) runs `setup_worker` first (Ray's worker_process_setup_hook):
  the SGLang server task registers `gethostip()` (the route to 8.8.8.8, which may be the pod's public
  interface, not the cluster's) while Ray places by the node's --node-ip-address; the hook makes them
  one. With PODKIT_RAY_STANDIN_LM=1 (CPU tests only) the server task's command runs podkit's generating
  stand-in for SGLang instead of SGLang (`SGLangConfig.build_cmd_from_args`, cli_args.py:1919);
- the job's env carries the pod config's env twins (PODKIT_*), so every rank reads rank 0's config.

Imports Ray and AReaL: this runs only in the AReaL environment.
"""

from __future__ import annotations

import os
import sys

STANDIN_ENV = "PODKIT_RAY_STANDIN_LM"
SETUP_HOOK = "podkit.areal.ray_driver.setup_worker"
EXIT_FAILED = 1


def standin_cmd(args: dict) -> list[str]:
    """The stand-in for SGLang (not SGLang) on the address and port AReaL chose for the server."""
    return [sys.executable, "-m", "podkit.programs.standin_lm", "--model", str(args["model_path"]),
            "--host", str(args["host"]), "--port", str(args["port"])]


def node_ip(*_args, **_kw) -> str:
    """This node's address in Ray (its --node-ip-address), where AReaL asks gethostip()."""
    import ray

    return ray.util.get_node_ip_address()


def setup_worker() -> None:
    """Ray's worker_process_setup_hook: runs in every worker process of the job before its task.
    gethostip is looked up by name from areal.utils.network when AReaL's launcher files are loaded
    (sglang_server.py by path, a fresh module each time) and by infra/utils/ray.py's placement master."""
    import areal.utils.network as network

    original = network.gethostip
    network.gethostip = node_ip
    for mod in list(sys.modules.values()):
        if getattr(mod, "gethostip", None) is original:
            mod.gethostip = node_ip
    if os.environ.get(STANDIN_ENV) == "1":
        from areal.api.cli_args import SGLangConfig

        SGLangConfig.build_cmd_from_args = staticmethod(standin_cmd)


def main(argv: list[str]) -> int:
    import ray
    from areal.api.cli_args import parse_cli_args
    from areal.infra.launcher import ray as launcher
    from areal.infra.utils.launcher import JobException, JobState

    env = {k: v for k, v in os.environ.items() if k.startswith("PODKIT_") or k in ("PYTHONPATH", "HF_HOME",
                                                                                  "WANDB_MODE")}
    ray.init(address=os.environ["PODKIT_RAY_ADDRESS"], logging_level="WARNING",
             runtime_env={"worker_process_setup_hook": SETUP_HOOK, "env_vars": env})
    config, _ = parse_cli_args(argv)
    sys.argv = [sys.argv[0], *argv]  # ray_main passes sys.argv[1:] on to the server and trainer tasks
    try:
        launcher.ray_main(config, run_id=0)
    except KeyboardInterrupt:  # podkit stopping it: AReaL has cancelled its tasks
        print("[podkit] AReaL's launcher stopped (SIGINT)", flush=True)
        return 130
    except JobException as e:
        if e.reason == JobState.COMPLETED and e.worker_type == "trainer":
            print("[podkit] AReaL's trainer job completed", flush=True)
            return 0
        print(f"[podkit] AReaL's launcher gave up: {e}", flush=True)
        return EXIT_FAILED
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
