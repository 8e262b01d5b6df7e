"""podkit: boot, supervise and diagnose AReaL GRPO + SGLang on GPU pods."""

__version__ = "0.1.0"
