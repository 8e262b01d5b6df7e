"""podkit's AReaL layer: everything that knows AReaL, in one place, so a port to another AReaL is a
change here. The layers, each importing only those above it:

    userconf.py, identity.py    the user's AReaL YAML and overrides as data; the run's names
    command.py, heartbeat.py    torchrun's command, env and overrides; a cluster rank's heartbeat
    patches.py                  what podkit changes in AReaL 1.0.4, each change pinned by hash
    hooks.py                    supervision around PPOTrainer (progress, stops, config errors)
    bootstrap.py                torchrun's entry: the hooks, then the training script (trainer.entry)
    example/gsm8k_grpo.py       podkit's example script, run when no trainer.entry is named
    ray_node.py, ray_driver.py  a multi-node run's Ray node, and AReaL's Ray launcher as its driver
    cluster.py                  rank 0 of a multi-node run: the driver, watched
    launch.py                   `podkit run trainer` (trainer.kind areal): one pod, or a cluster's rank 0

Nothing here but userconf and identity (stdlib only: the preflight's checks and the reap stage read the
run's names) is imported on the boot path; hooks, bootstrap, ray_driver and the example import AReaL
and run only in the AReaL environment.
"""
