"""What makes a pod config unable to train, found before supervisord starts a program in a loop.

Pure functions of the config (and the AReaL YAML it names): they import no program, so the preflight
stage, each program before its exec, and the tests all ask the same questions. Each problem is
(key, what is wrong, hint); preflight turns the first into `file: key: what` + hint.
"""

from __future__ import annotations

import ipaddress
import os
import re
import shlex
from collections import Counter
from collections.abc import Callable
from pathlib import Path

API_KEY_ENV = "SGLANG_API_KEY"  # a secret: from the env file / RunPod secret, never the YAML
SHARED_MEM_FRACTION = 0.5  # most SGLang may take of a GPU the trainer also uses

Problem = tuple[str, str, str]


def loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def backend_gpus(backend: str) -> int | None:
    """GPUs an AReaL backend string takes: 'fsdp:d3' -> 3, 'sglang:d1t2' -> 2 (the product of its
    parallel degrees). None when it is not of that form; AReaL's own parser has the last word."""
    _, _, dims = backend.partition(":")
    if not re.fullmatch(r"(?:[a-z]\d+)+", dims or ""):
        return None
    n = 1
    for degree in re.findall(r"\d+", dims):
        n *= int(degree)
    return n


def _shell_words(key: str, text: str) -> list[Problem]:
    try:
        shlex.split(text)
    except ValueError as e:
        return [(key, f"cannot be split like a shell line: {e}", "check the quoting")]
    return []


def sglang(cfg, environ: dict[str, str] | None = None) -> list[Problem]:
    """A setup where SGLang would fail or expose itself."""
    environ = os.environ if environ is None else environ
    inf, out = cfg.inference, []
    if not loopback(inf.host) and not environ.get(API_KEY_ENV):
        out.append(("inference.host", f"{inf.host} exposes SGLang beyond this machine without an API key",
                    f"set {API_KEY_ENV} (env file or RunPod secret), or bind 127.0.0.1"))
    n = len(cfg.gpus["inference"])
    if n != inf.tp:
        out.append(("inference.tp", f"is {inf.tp} but inference.gpus {inf.gpus!r} names {n} GPU(s)",
                    "SGLang runs one tensor-parallel rank per GPU; make them agree"))
    return (out + _shell_words("inference.extra_args", inf.extra_args) + _owned_flags(inf.extra_args)
            + _piecewise(inf.context_length, inf.extra_args) + sglang_version(cfg, installed_sglang()))


SGLANG_SUPPORTED = "0.5.10"  # AReaL 1.0.4's (and 2.0's) pin, and the image's base
# What changed in SGLang since, on the command line podkit writes (0.5.23's release notes and server_args).
SGLANG_CHANGES = ((0, 5, 23), "--cuda-graph-max-bs", "inference.cuda_graph_max_bs",
                  "0.5.23 removed --cuda-graph-max-bs (now set per phase, with no alias); it also needs torch 2.14 "
                  "and CUDA 13 (a host driver of 580 or later) and renamed its metrics")


def installed_sglang() -> str | None:
    """The SGLang of this environment (the image's), without importing it; None where there is none."""
    from importlib import metadata

    try:
        return metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return None


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", version.split("+")[0])[:3])


def sglang_version(cfg, version: str | None) -> list[Problem]:
    """An SGLang podkit's command line would fail on, refused by name rather than by its parser."""
    if not version or version.startswith(SGLANG_SUPPORTED):
        return []
    since, flag, key, what = SGLANG_CHANGES
    if _release(version) >= since and cfg.inference.cuda_graph_max_bs:
        return [(key, f"is passed as {flag}, which SGLang {version} (installed) does not have: {what}",
                 f"podkit supports SGLang {SGLANG_SUPPORTED} (what AReaL pins): use the image built from podkit's "
                 f"Dockerfile, or set {key}: 0 and pass the new per-phase flags in inference.extra_args")]
    return []


# SGLang 0.5.10 captures piecewise CUDA graphs (on by default for a text model on CUDA) for token counts up
# to piecewise_cuda_graph_max_tokens, which defaults to chunked_prefill_size: 4096 on a 48 GB GPU (the A40;
# server_args.py's memory table), 8192 from 60 GB (H100, A100 80 GB). Its warm-up fails when the context
# is shorter than the largest of them.
PIECEWISE_A40_MAX_TOKENS = 4096


def _piecewise(context_length: int, extra_args: str) -> list[Problem]:
    if not context_length:
        return []
    try:
        words = shlex.split(extra_args)
    except ValueError:
        return []  # reported as a quoting problem above
    flags = dict(_flag_values(words))
    if "--disable-piecewise-cuda-graph" in flags:
        return []
    raw = flags.get("--piecewise-cuda-graph-max-tokens") or flags.get("--chunked-prefill-size")
    largest = int(raw) if raw and raw.isdigit() else PIECEWISE_A40_MAX_TOKENS
    if context_length >= largest:
        return []
    return [("inference.context_length", f"{context_length} is below SGLang's largest piecewise CUDA graph "
             f"({largest} tokens{'' if raw else ' on an A40; 8192 on a GPU of 60 GB or more'}): its warm-up "
             "fails at start", f"raise context_length to {largest} or more, or add --disable-piecewise-cuda-graph "
             f"(or --piecewise-cuda-graph-max-tokens {context_length}) to inference.extra_args")]


def _flag_values(words: list[str]):
    """(flag, value or '') for each --flag of an argv, `--flag=value` and `--flag value` alike."""
    for i, w in enumerate(words):
        if not w.startswith("--"):
            continue
        name, eq, value = w.partition("=")
        if not eq and i + 1 < len(words) and not words[i + 1].startswith("--"):
            value = words[i + 1]
        yield name, value


# SGLang's flags that podkit sets from the pod config, in command-line order: (flag, other names SGLang's
# parser takes for it, where its value comes from, its value or None to leave it out). programs/sglang.py
# writes its argv from this table, and extra_args may not set any of these again (argparse takes the last,
# so `--host 0.0.0.0` there would undo the loopback/API-key rule). The rows without a value are set another
# way: the API key goes in the file that --config names (programs/sglang.py), never on the command line.
SGLANG_FLAGS: tuple[tuple[str, tuple[str, ...], str, Callable[[object], str | None] | None], ...] = (
    ("--api-key", (), "SGLANG_API_KEY (env)", None),
    ("--model-path", ("--model",), "inference.model", lambda cfg: cfg.inference.model),
    ("--host", (), "inference.host", lambda cfg: cfg.inference.host),
    ("--port", (), "inference.port", lambda cfg: str(cfg.inference.port)),
    ("--tp-size", ("--tp", "--tensor-parallel-size"), "inference.tp", lambda cfg: str(cfg.inference.tp)),
    ("--mem-fraction-static", (), "inference.mem_fraction_static",
     lambda cfg: f"{cfg.inference.mem_fraction_static:g}"),
    ("--attention-backend", (), "inference.attention_backend", lambda cfg: cfg.inference.attention_backend),
    # SGLang's sampling seed: with the trainer's seed, a restarted server samples as before.
    ("--random-seed", (), "trainer.seed", lambda cfg: str(cfg.trainer.seed)),
    ("--context-length", (), "inference.context_length",
     lambda cfg: str(cfg.inference.context_length) if cfg.inference.context_length else None),
    ("--cuda-graph-max-bs", (), "inference.cuda_graph_max_bs",
     lambda cfg: str(cfg.inference.cuda_graph_max_bs) if cfg.inference.cuda_graph_max_bs else None),
    ("--config", (), "the pod config (podkit builds SGLang's settings)", None),
)
OWNED_FLAGS = {name: key for flag, aliases, key, _ in SGLANG_FLAGS for name in (flag, *aliases)}


def sglang_flags(cfg) -> list[str]:
    """The owned flags that have a value in this config, as SGLang's command line takes them."""
    argv = []
    for flag, _, _, value in SGLANG_FLAGS:
        if value is not None and (v := value(cfg)) is not None:
            argv += [flag, v]
    return argv


def _owned_flags(extra_args: str) -> list[Problem]:
    try:
        words = shlex.split(extra_args)
    except ValueError:
        return []
    out = []
    for w in words:
        flag = w.split("=", 1)[0]
        if flag in OWNED_FLAGS:
            out.append(("inference.extra_args", f"sets {flag}, which podkit sets from {OWNED_FLAGS[flag]}",
                        f"set {OWNED_FLAGS[flag]} instead; extra_args is for flags podkit does not manage"))
        elif len(flag) > 2 and flag.startswith("--") and (owned := [f for f in OWNED_FLAGS if f.startswith(flag)]):
            # SGLang's argparse takes an unambiguous prefix as the flag (`--hos` is --host); no SGLang flag
            # that podkit leaves alone is a prefix of one it owns (tests/trainer/test_validate.py reads the parser).
            where = sorted({OWNED_FLAGS[f] for f in owned})
            out.append(("inference.extra_args", f"sets {flag}, which SGLang's parser reads as "
                        f"{' or '.join(owned)} (a prefix is taken for the flag), set by podkit from {', '.join(where)}",
                        f"set {', '.join(where)} instead, and write SGLang's flags in full"))
    return out


def in_checkout(cfg, path: str) -> bool:
    """A path the sync stage brings: it cannot be checked before the sync (preflight)."""
    return bool(cfg.repo.url) and os.path.realpath(path).startswith(os.path.realpath(cfg.repo.dest) + os.sep)


def entry(cfg, synced: bool = True) -> list[Problem]:
    """trainer.entry: a script in the checkout (or package.module:function)."""
    e = cfg.trainer.entry
    if not e:
        return []
    hint = "a path in the training repo (train.py), or package.module:function"
    if not cfg.repo.url and not os.path.isdir(cfg.repo.dest):
        return [("trainer.entry", f"is {e!r} but there is no training repo (repo.url is empty and {cfg.repo.dest} "
                 "does not exist)", "set repo.url to your training repo")]
    if ":" in e and not e.endswith(".py"):
        module, _, function = e.partition(":")
        if not module or not function or not all(p.isidentifier() for p in (*module.split("."), function)):
            return [("trainer.entry", f"{e!r} is not package.module:function", hint)]
        parts = module.split(".")
        path = os.path.join(*parts)  # the checkout is first on sys.path: its module is imported
        # ... after each package above it: their __init__.py files run first
        parents = tuple(os.path.join(*parts[:i], "__init__.py") for i in range(1, len(parts)))
        return _linked_out(cfg, e, (*parents, path + ".py", os.path.join(path, "__init__.py"))) if synced else []
    if os.path.isabs(e) or ".." in Path(e).parts:
        return [("trainer.entry", f"{e!r} is not a path inside the checkout", hint)]
    script = os.path.join(cfg.repo.dest, e)
    if synced and (out := _linked_out(cfg, e, (e,))):
        return out
    if synced and not os.path.isfile(script):
        return [("trainer.entry", f"{script} does not exist in the checkout of {cfg.repo.url or cfg.repo.dest} "
                 f"at {cfg.repo.ref}", hint)]
    return []


def _linked_out(cfg, e: str, paths: tuple[str, ...]) -> list[Problem]:
    """A file of the entry in the checkout that a link (its own, or a directory's on its way) leads out of
    it: the check above is lexical, and where the link leads is what would run."""
    top = os.path.realpath(cfg.repo.dest)
    for p in paths:
        real = os.path.realpath(os.path.join(cfg.repo.dest, p))
        if os.path.lexists(os.path.join(cfg.repo.dest, p)) and not real.startswith(top + os.sep):
            return [("trainer.entry", f"{e!r} leads to {real}, outside the checkout {cfg.repo.dest} (a link)",
                     "commit the code itself to the training repo, not a link out of it")]
    return []


def areal(cfg, synced: bool = True) -> list[Problem]:
    """A setup the AReaL trainer cannot train with. Before the sync (`synced` False), files that the
    checkout brings are not looked for: the render stage checks again after it."""
    t, out = cfg.trainer, entry(cfg, synced)
    later = not synced and t.areal_config and in_checkout(cfg, t.areal_config)
    if not t.areal_config:
        out.append(("trainer.areal_config", "empty: the AReaL trainer needs an experiment config",
                    "use a shipped pod config (configs/a40-4gpu.yaml) or set it to your AReaL YAML"))
    elif not later and not os.path.isfile(t.areal_config):
        out.append(("trainer.areal_config", f"{t.areal_config} does not exist",
                    "a relative path is read from the checkout with trainer.entry, else from the pod "
                    "config's directory"))
    if t.cpu_ranks and cfg.gpus["trainer"]:
        out.append(("trainer.cpu_ranks", f"is {t.cpu_ranks} (train on CPU) but trainer.gpus is {t.gpus!r}",
                    "CPU ranks are for the rehearsal without a GPU: set one of the two, not both"))
    elif not t.cpu_ranks and not cfg.gpus["trainer"]:
        out.append(("trainer.gpus", "empty: torchrun needs at least one training GPU",
                    "e.g. 1,2,3 on a 4-GPU pod with inference on 0 (trainer.cpu_ranks: the CPU rehearsal)"))
    shared = set(cfg.gpus["trainer"]) & set(cfg.gpus["inference"])
    if shared and cfg.inference.mem_fraction_static > SHARED_MEM_FRACTION:
        out.append(("trainer.gpus", f"GPU(s) {','.join(map(str, sorted(shared)))} also serve inference, which takes "
                    f"{cfg.inference.mem_fraction_static:g} of their memory",
                    f"give the trainer other GPUs, or share with inference.mem_fraction_static <= "
                    f"{SHARED_MEM_FRACTION} (configs/a40-1gpu.yaml)"))
    if cfg.inference.kind == "standin":
        out.append(("trainer.kind", "areal needs a server that generates, not inference.kind standin",
                    "inference.kind sglang on a pod, standin-lm for the CPU rehearsal (configs/cpu-rehearsal.yaml)"))
    out += _shell_words("trainer.overrides", t.overrides)
    if t.areal_config and not later and os.path.isfile(t.areal_config):
        out += _backends(cfg)
        from podkit.areal import identity  # the names as AReaL will read them: YAML, settings, overrides

        out += identity.names(cfg).problems()
    return out


def _areal_yaml(cfg):
    from podkit.areal import userconf  # on demand: podkit.areal is not on the boot path

    return userconf.areal_yaml(cfg)


def _backends(cfg) -> list[Problem]:
    data = _areal_yaml(cfg)
    if isinstance(data, Exception):
        return [("trainer.areal_config", f"cannot read {cfg.trainer.areal_config}: {data}", "fix the YAML")]
    if not isinstance(data, dict):
        return [("trainer.areal_config", f"{cfg.trainer.areal_config} is not a mapping of AReaL settings",
                 "an AReaL experiment config is a YAML mapping (configs/areal/ has examples)")]
    return settings(cfg, data)[1] + _lora(cfg, data)


AREAL_LORA_REFUSAL = "LoRA is only supported in single-controller mode"  # RLTrainer._init_rollout, AReaL 1.0.4


def _on(value) -> bool:
    """A boolean as OmegaConf reads it for a bool field: true/yes/y/on (any case), or a number that is not 0."""
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)):
        return value != 0
    text = str(value).strip().lower() if value is not None else ""
    if text in ("true", "yes", "y", "on"):
        return True
    try:
        return float(text) != 0
    except ValueError:
        return False


def _lora(cfg, data: dict) -> list[Problem]:
    """LoRA: AReaL 1.0.4 trains it only in its single-controller mode, where AReaL starts SGLang itself with
    the adapter preloaded. podkit runs SGLang as its own restartable program and AReaL in SPMD mode, where
    RLTrainer raises at its start ("LoRA is only supported in single-controller mode") after the model has
    loaded. Refused here instead, naming where it is set; a test reads AReaL's source for that refusal."""
    user = overridden(cfg.trainer.overrides)
    why = {"actor.use_lora": f"under torchrun AReaL refuses LoRA at start ({AREAL_LORA_REFUSAL!r})",
           "rollout.use_lora": "its rollout would ask SGLang for a LoRA adapter on every request, which podkit's "
                               "SGLang (no --enable-lora) refuses"}
    for key in ("actor.use_lora", "rollout.use_lora"):
        value = user[key] if key in user else _dotted(data, key)
        if _on(value):
            where, said = ("trainer.overrides", f"sets {key}={value}") if key in user else \
                ("trainer.areal_config", f"{cfg.trainer.areal_config} sets {key}: {value}")
            return [(where, f"{said}, but AReaL 1.0.4 trains LoRA adapters only in its "
                     "single-controller mode (it starts SGLang itself); podkit runs SGLang as its own "
                     f"restartable program and AReaL's trainer under torchrun, where {why[key]}",
                     "train full weights (set actor.use_lora and rollout.use_lora false, or drop them), or run "
                     "this YAML with AReaL's own launcher outside podkit")]
    return []


class Setting:
    """A setting of the AReaL config that podkit depends on: what the YAML says, what podkit sets, why."""

    def __init__(self, key: str, was, value: str, why: str) -> None:
        self.key, self.was, self.value, self.why = key, was, value, why

    def __str__(self) -> str:
        return f"{self.key} {self.was if self.was not in (None, '') else '(unset)'} -> {self.value} ({self.why})"


def config_error(cfg, problems: list[Problem]):
    """One ConfigError that names every problem (the first one's key and hint first): a user fixes them
    all in one round, not one boot each."""
    from podkit.errors import ConfigError

    (key, what, hint), rest = problems[0], problems[1:]
    for k, w, h in rest:
        what += f"\n  and {cfg.origin(k)}: {k}: {w} (fix: {h})"
    return ConfigError(cfg.origin(key), key, what, hint=hint)


def overridden(text: str) -> dict[str, str]:
    from podkit.areal import userconf

    return userconf.overridden(text)


def _dotted(data: dict, key: str):
    node = data
    for part in key.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def settings(cfg, data: dict | None = None) -> tuple[list[Setting], list[Problem]]:
    """What podkit sets in the AReaL config over the YAML (it depends on them: it resumes after every
    restart, restarts inference alone, and knows the pod's GPUs), and the problems where the user's own
    trainer.overrides contradict one on purpose (there podkit cannot decide for them). AReaL's own example
    YAMLs (recover disabled, xccl, backends for 8 GPUs) thus run as they are."""
    if data is None:
        data = _areal_yaml(cfg)
        data = data if isinstance(data, dict) else {}
    from podkit.areal import userconf

    user, gone = overridden(cfg.trainer.overrides), userconf.deleted(cfg.trainer.overrides)
    changes, problems = [], []
    for key, value, fits, why, pod_key in required(cfg, data):
        dropped = next((d for d in gone if key == d or key.startswith(d + ".")), None)
        if dropped:
            problems.append(("trainer.overrides", f"deletes {dropped} (~{dropped}), where podkit sets {key}={value}: "
                             f"{why}", f"drop ~{dropped} from trainer.overrides (podkit sets {value} itself)"))
            continue
        if key in user and not fits(user[key]):
            problems.append(("trainer.overrides", f"sets {key}={user[key]}, but podkit needs {value}: {why}",
                             f"drop {key} from trainer.overrides (podkit sets {value} itself)"
                             + (f", or change {pod_key} to match" if pod_key else "")))
            continue
        was = user.get(key, _dotted(data, key))
        if key in user or (was is not None and fits(was)):
            continue  # the user's own value, and it fits
        changes.append(Setting(key, was, value, why))
    return changes, problems


def required(cfg, data: dict) -> list[tuple]:
    """What podkit needs of AReaL's config: (key, the value podkit sets, fits(value), why, the pod setting that
    decides it or ""). Read at boot over the user's YAML and overrides (settings), and again by the trainer
    over the config AReaL will run, after every loader and the script's own changes (hooks.check_required)."""
    t = cfg.trainer
    wants = [("recover.mode", "auto", lambda v: v not in ("disabled", "off"),
              "podkit resumes every restart (a SIGTERM, stale weights, a crash) from the recover checkpoint", ""),
             ("actor.weight_update_mode", "disk", lambda v: v not in ("xccl", "nccl"),
              "an NCCL group ties the trainer to one SGLang process: it hangs when SGLang restarts alone", ""),
             # Only where the YAML leaves it to AReaL's default (flash_attention_2): the image has no flash-attn 2.
             ("actor.attn_impl", "sdpa", lambda v: True, "AReaL's default flash_attention_2 needs the flash-attn "
              "package, which the image does not have; sdpa is torch's own", "")]
    if not cfg.multi_node:  # a cluster's backends are AReaL's Ray launcher's (checks.cluster)
        ranks = t.cpu_ranks or len(cfg.gpus["trainer"])
        kind = str(_dotted(data, "actor.backend") or "fsdp:").partition(":")[0] or "fsdp"
        pod_key = f"trainer.cpu_ranks {t.cpu_ranks}" if t.cpu_ranks else f"trainer.gpus {t.gpus!r}"
        wants.append(("actor.backend", f"{kind}:d{ranks}", lambda v: backend_gpus(str(v)) == ranks,
                      f"{pod_key} gives the trainer {ranks} rank(s)", pod_key.split()[0]))
        tp = cfg.inference.tp if cfg.inference.kind == "sglang" else 1
        wants.append(("rollout.backend", f"sglang:d1t{tp}" if tp > 1 else "sglang:d1",
                      lambda v: str(v).startswith("sglang:") and backend_gpus(str(v)) == tp,
                      f"podkit runs one SGLang server on {tp} GPU(s) (inference.gpus {cfg.inference.gpus!r})"
                      if cfg.inference.kind == "sglang" else
                      f"podkit runs one server ({cfg.inference.kind}) that AReaL reaches as SGLang", "inference.gpus"))
    return wants


METRICS_KEY_ENV = "PODKIT_METRICS_KEY"  # a secret, like SGLANG_API_KEY


def usable_key(key: str) -> bool:
    """A bearer key an HTTP header carries as it is: visible ASCII, no spaces."""
    return bool(key) and all(0x21 <= ord(c) <= 0x7E for c in key)


def metrics(cfg, environ: dict[str, str] | None = None) -> list[Problem]:
    """/metrics beyond loopback only with a key; not on inference's port."""
    environ = os.environ if environ is None else environ
    m, out = cfg.metrics, []
    key = environ.get(METRICS_KEY_ENV, "")
    if m.port and key and not usable_key(key):
        out.append((METRICS_KEY_ENV, "has a character that is not visible ASCII (a space, a control or a "
                    "non-ASCII character): an HTTP header cannot carry it as it is",
                    "use letters, digits and punctuation only, e.g. the output of `openssl rand -hex 32`"))
    elif m.port and not loopback(m.host) and not key:
        out.append(("metrics.host", f"{m.host} exposes /metrics beyond this machine without a key",
                    f"set {METRICS_KEY_ENV} (env file or RunPod secret), or bind 127.0.0.1"))
    if m.port and m.port == cfg.inference.port:
        out.append(("metrics.port", f"is inference.port ({m.port}) too", "pick another port (default 9400), or 0: off"))
    return out


PAGE_TOKEN_ENV = "PODKIT_PAGE_TOKEN"  # a secret (a RunPod secret on a pod), never the YAML
PAGE_TOKEN_MIN = 16  # the page takes guesses from the internet through RunPod's proxy: no short password
PAGE_TOKEN_DISTINCT = 6  # `openssl rand -hex 8` has fewer once in ~10,000 draws; "aaaa..." and "abab..." 1-2
PAGE_TOKEN_RUN = 0.6  # more of the steps between neighbours alike than this: a run ("abcdef...", "13579...")


def page_token(environ) -> str:
    """The page's token as set, without the line end a pasted secret or `echo` into a file brings along."""
    return (environ.get(PAGE_TOKEN_ENV) or "").rstrip("\r\n")


def page_token_weakness(token: str) -> str | None:
    """Why the page must not stand behind this token, in words that follow its name; None when it may."""
    if not token:
        return "is not set"
    if "RUNPOD_SECRET_" in token:
        return "is RunPod's secret reference, not filled in (no RunPod secret of that name)"
    for i, c in enumerate(token):
        if not 0x21 <= ord(c) <= 0x7E:
            what = "a space" if c == " " else "a control character" if ord(c) < 0x20 or ord(c) == 0x7F else \
                f"a non-ASCII character ({ord(c):#x})"
            return f"has {what} at character {i + 1}: letters, digits and punctuation only"
    if len(token) < PAGE_TOKEN_MIN:
        return f"is {len(token)} characters; {PAGE_TOKEN_MIN} or more are needed"
    distinct = len(Counter(token))
    if distinct < PAGE_TOKEN_DISTINCT:
        return f"uses only {distinct} different character(s); a random one has many"
    steps = Counter(ord(b) - ord(a) for a, b in zip(token, token[1:], strict=False))
    if steps.most_common(1)[0][1] > PAGE_TOKEN_RUN * (len(token) - 1):
        return "is a run or a repetition (like abcdef... or 13579...); a random one is not"
    period = next(p for p in range(1, len(token) + 1) if all(token[i] == token[i + p] for i in range(len(token) - p)))
    if period <= PAGE_TOKEN_RUN * len(token):
        return f"repeats its first {period} characters (like passwordpassword); a random one does not"
    low = token.lower()
    pairs = list(zip(low, low[1:], strict=False))
    if sum(_neighbours(a, b) for a, b in pairs) > PAGE_TOKEN_RUN * len(pairs):
        return "walks the keyboard (like qwertyuiop... or 1qaz2wsx...); a random one does not"
    left = low.translate(_LEET)  # P@ssw0rd is password
    for word in _COMMON:
        left = left.replace(word, "")
    left = "".join(c for c in left if c.isalnum())
    if len(left) < PAGE_TOKEN_MIN // 2:
        return "is made of words anyone tries first (like changeme, password, podkit); a random one is not"
    return None


# Where each key sits on a QWERTY keyboard (row, column; the rows staggered as they are): a walk along a row, down a
# column or a diagonal is a person's, not a random draw. Shifted digits sit where their digit does.
_ROWS = (("`1234567890-=", 0.0), ("qwertyuiop[]\\", 1.5), ("asdfghjkl;'", 1.75), ("zxcvbnm,./", 2.25))
_KEY_AT = {c: (r, i + off) for r, (row, off) in enumerate(_ROWS) for i, c in enumerate(row)}
_KEY_AT.update({s: _KEY_AT[d] for s, d in zip("~!@#$%^&*()_+", "`1234567890-=", strict=True)})


def _neighbours(a: str, b: str) -> bool:
    pa, pb = _KEY_AT.get(a), _KEY_AT.get(b)
    return pa is not None and pb is not None and a != b and abs(pa[0] - pb[0]) <= 1 and abs(pa[1] - pb[1]) <= 1


_LEET = str.maketrans("@4310$5!7+", "aaeiossitt")
_COMMON = ("correcthorsebatterystaple", "password", "passwd", "changeme", "change", "secret", "podkit", "runpod",
           "admin", "letmein", "welcome", "qwerty", "token", "default", "login", "master", "monkey", "dragon",
           "iloveyou", "hello", "test", "pass", "root", "user", "page", "1234", "abc")


def page(cfg) -> list[Problem]:
    """The page on a port of its own. Its token is never an error (page_loopback_only warns): without a usable
    one the page stays on loopback."""
    p, out = cfg.page, []
    if not p.port:
        return out
    for key, port in (("inference.port", cfg.inference.port), ("metrics.port", cfg.metrics.port)):
        if p.port == port:
            out.append(("page.port", f"is {key} ({port}) too", "pick another port (default 9401), or 0: off"))
    return out


def page_loopback_only(cfg, environ: dict[str, str] | None = None) -> str | None:
    """Why the page is served on 127.0.0.1 only, or without a login: no token, RunPod's secret reference left
    unfilled, or a token a person could guess (ignored). A warning, not an error: the page's secret must never
    keep a pod from training."""
    environ = os.environ if environ is None else environ
    token = page_token(environ)
    if not cfg.page.port or not token and loopback(cfg.page.host) or page_token_ok(token):
        return None
    why = page_token_weakness(token) + (" (ignored)" if token else "")
    where = "without a login" if loopback(cfg.page.host) else f"on 127.0.0.1 only, not {cfg.page.host}"
    return (f"the page is served {where}: {PAGE_TOKEN_ENV} {why}; set it (e.g. from `openssl rand -hex 32`, a RunPod "
            "secret on a pod) to see the run through RunPod's proxy")


def page_token_ok(token: str) -> bool:
    """A token the page may stand behind: one a person cannot guess, not RunPod's unfilled secret reference."""
    return page_token_weakness(token) is None


SHAPE_KEYS = ("allocation_mode", "rollout.backend", "actor.backend", "cluster.n_nodes", "cluster.n_gpus_per_node")
POD_GPU_KEYS = ("trainer.gpus", "trainer.cpu_ranks", "inference.gpus")  # a cluster's GPUs are Ray's


def cluster_shape(cfg) -> dict:
    """What AReaL's Ray launcher places by: SHAPE_KEYS from the AReaL YAML, with trainer.overrides on top."""
    data = _areal_yaml(cfg)
    data = data if isinstance(data, dict) else {}
    out = {}
    for key in SHAPE_KEYS:
        node = data
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        out[key] = node
    out.update({k: v for k, v in overridden(cfg.trainer.overrides).items() if k in SHAPE_KEYS})
    for key in ("cluster.n_nodes", "cluster.n_gpus_per_node"):
        try:
            out[key] = int(out[key])
        except (TypeError, ValueError):
            out[key] = None
    return out


def cluster(cfg, synced: bool = True) -> list[Problem]:
    """A multi-node setup AReaL's Ray launcher would refuse, or place other than the pod config says.
    The launcher reads only the deprecated allocation_mode; the trainer reads the backends."""
    out = [p for p in areal(cfg, synced) if p[0] not in POD_GPU_KEYS]
    if cfg.trainer.kind != "areal":
        out.append(("trainer.kind", f"is {cfg.trainer.kind}; a multi-node run is AReaL's (its Ray launcher)",
                    "trainer.kind areal, or cluster.nodes 1"))
    if out or (not synced and in_checkout(cfg, cfg.trainer.areal_config)):  # the YAML comes with the sync
        return out
    shape, c, src = cluster_shape(cfg), cfg.cluster, cfg.trainer.areal_config
    mode, gen, train = (str(shape[k] or "") for k in ("allocation_mode", "rollout.backend", "actor.backend"))
    nodes, per_node = shape["cluster.n_nodes"], shape["cluster.n_gpus_per_node"]
    if mode != f"{gen}+{train}":
        out.append(("trainer.areal_config", f"{src}: allocation_mode is {mode or 'unset'!r} but rollout.backend + "
                    f"actor.backend say {gen}+{train!s}", "AReaL's Ray launcher places by allocation_mode and the "
                    f"trainer by the backends: set allocation_mode: {gen}+{train}"))
    if nodes != c.nodes:
        out.append(("cluster.nodes", f"is {c.nodes} but {src} has cluster.n_nodes {nodes}",
                    "make them agree (trainer.overrides can set cluster.n_nodes=N)"))
    if c.gpus and per_node and c.gpus != per_node:
        out.append(("cluster.gpus", f"is {c.gpus} but {src} has cluster.n_gpus_per_node {per_node}",
                    "each node gives Ray the GPUs AReaL places on it: make them agree"))
    g, t = backend_gpus(gen), backend_gpus(train)
    if out or g is None or t is None or not per_node or not nodes:
        return out
    if g + t != nodes * per_node:
        out.append(("trainer.areal_config", f"{src}: {gen} and {train} take {g + t} GPUs, the cluster has "
                    f"{nodes} x {per_node}", "AReaL's Ray launcher uses whole nodes: generation + training GPUs must "
                    "equal n_nodes x n_gpus_per_node"))
    elif g % per_node or g >= nodes * per_node:
        out.append(("trainer.areal_config", f"{src}: {gen} takes {g} GPUs; SGLang gets whole nodes of {per_node} "
                    "and the trainer at least one", f"e.g. sglang:d{per_node}+fsdp:d{(nodes - 1) * per_node}"))
    return out


def programs(cfg, environ: dict[str, str] | None = None, synced: bool = False) -> list[Problem]:
    """Everything that would make the configured programs fail at once (`synced`: after the sync stage,
    when the checkout's files can be looked for)."""
    out = metrics(cfg, environ) + page(cfg) + devices(cfg)
    if cfg.multi_node:  # AReaL's Ray launcher starts SGLang; rank 0 runs it
        if cfg.inference.kind == "standin-lm":
            out += standin_lm(cfg)
        return out + (cluster(cfg, synced) if cfg.cluster.rank == 0 else [])
    if cfg.inference.kind == "sglang":
        out += sglang(cfg, environ)
    if cfg.inference.kind == "standin-lm":
        out += standin_lm(cfg)
    if cfg.trainer.kind == "areal":
        out += areal(cfg, synced)
    elif cfg.inference.kind in ("sglang", "standin-lm"):
        out.append(("trainer.kind", f"fake pushes torch checkpoints, which {cfg.inference.kind} cannot load",
                    "use trainer.kind areal with it, or inference.kind standin (configs/smoke.yaml)"))
    return out


def devices(cfg) -> list[Problem]:
    """The reap stage stops every holder of what `devices` matches: GPU device files only."""
    from podkit.host import gpu

    refused = gpu.matches(cfg.devices)[1]
    if not refused:
        return []
    return [("devices", f"{cfg.devices} matches {len(refused)} file(s) that are not GPU device files (e.g. "
             f"{refused[0]}), whose holders the reap stage would stop",
             "a glob of NVIDIA's device files: /dev/nvidia* (the default); empty: no reap")]


def standin_lm(cfg) -> list[Problem]:
    """The generating stand-in loads a local model directory (nothing comes from a hub)."""
    model = cfg.inference.model
    if not os.path.isfile(os.path.join(model, "config.json")):
        return [("inference.model", f"{model!r} is not a local model directory (no config.json in it)",
                 "standin-lm serves a local tiny model: `make rehearse` builds one (rehearse/assets.py)")]
    return []
