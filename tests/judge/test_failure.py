"""The user's exception in its own words (failure.py) and the import check before the wait for inference
(areal/precheck.py, run as the launcher runs it: a separate Python on a checkout)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest

from conftest import ROOT
from podkit.judge import failure
from podkit.views import doctor

pytestmark = pytest.mark.timeout(60)
PRECHECK = ROOT / "src" / "podkit" / "areal" / "precheck.py"


def raised(repo, source: str, call: str = "run"):
    """Run `call()` from a module written in `repo` (the user's code) and return what it raised."""
    path = repo / "user_code.py"
    path.write_text(textwrap.dedent(source))
    ns: dict = {}
    exec(compile(path.read_text(), str(path), "exec"), ns)  # noqa: S102 - the test's own source
    try:
        ns[call]()
    except Exception as e:  # noqa: BLE001
        return e
    raise AssertionError("did not raise")


def test_a_keyerror_on_a_row_names_the_rows_fields_from_the_users_frame(tmp_path):
    e = raised(tmp_path, """
        def prompt(row):
            return row["question"] + "?"
        def run():
            return [prompt(r) for r in [{"problem": "1+1", "answer": 2}]]
    """)
    err = failure.describe(e, [str(tmp_path)])
    assert err["type"] == "KeyError" and err["where"] == f"{tmp_path / 'user_code.py'}:3", err
    assert err["code"] == 'return row["question"] + "?"'
    assert err["hint"].startswith("`row` has no field 'question'; its fields are problem, answer"), err["hint"]
    assert failure.summary(err) == f"KeyError: 'question' at {tmp_path / 'user_code.py'}:3"


def test_the_exception_a_wrapper_raised_from_is_named_not_the_wrapper(tmp_path):
    """AReaL re-raises a background thread's exception as RuntimeError("Background thread failed") from it:
    only the cause went through the user's code."""
    repo, lib = tmp_path / "repo", tmp_path / "lib"
    repo.mkdir()
    lib.mkdir()
    (lib / "executor.py").write_text(
        "def run_task(fn, arg):\n"
        "    try:\n"
        "        fn(arg)\n"
        "    except ValueError as inner:\n"
        "        raise RuntimeError(f'Background thread failed: {inner}') from inner\n")
    (repo / "parse.py").write_text("def parse(a):\n    return int(a)\n")
    sys.path[:0] = [str(lib), str(repo)]
    try:
        import executor
        import parse

        try:
            executor.run_task(parse.parse, "n/a")
        except RuntimeError as e:
            err = failure.describe(e, [str(repo)])
    finally:
        del sys.path[:2]
        sys.modules.pop("executor", None)
        sys.modules.pop("parse", None)
    assert err["type"] == "ValueError" and err["where"] == f"{repo / 'parse.py'}:2", err


def test_a_dataloader_workers_exception_arriving_as_text_is_read_for_the_users_frame(tmp_path):
    user = tmp_path / "train.py"
    user.write_text("def to_prompt(batch):\n    return [int(a) for a in batch]\n")
    text = ("Caught ValueError in DataLoader worker process 0.\nOriginal Traceback (most recent call last):\n"
            '  File "/site-packages/torch/utils/data/_utils/worker.py", line 349, in _worker_loop\n'
            "    data = fetcher.fetch(index)\n"
            f'  File "{user}", line 2, in to_prompt\n'
            "    return [int(a) for a in batch]\n"
            "ValueError: invalid literal for int() with base 10: 'n/a'\n")
    err = failure.describe(ValueError(text), [str(tmp_path)])
    assert err["where"] == f"{user}:2" and err["code"] == "return [int(a) for a in batch]", err
    assert (err["type"], err["message"]) == ("ValueError", "invalid literal for int() with base 10: 'n/a'"), err


def test_a_main_that_takes_no_argument_is_named_at_its_def_with_how_podkit_calls_it(tmp_path):
    path = tmp_path / "entry.py"
    path.write_text("import sys\n\n\ndef main():\n    pass\n")
    ns: dict = {}
    exec(compile(path.read_text(), str(path), "exec"), ns)  # noqa: S102
    try:
        ns["main"](["--config", "x.yaml"])
    except TypeError as e:
        err = failure.describe(e, [str(tmp_path)], call=ns["main"])
    assert err["where"] == f"{path}:4" and "def main(argv=None)" in err["hint"], err


def test_a_hub_dataset_that_cannot_be_fetched_is_named_with_how_to_fill_its_cache(tmp_path):
    e = raised(tmp_path, """
        def load_dataset(path, name=None, split=None):  # as datasets' own: the frame doctor reads
            raise ConnectionError(f"Couldn't reach {path!r} on the Hub (LocalEntryNotFoundError)")
        def run():
            load_dataset("openai/gsm8k", "main", split="train")
    """)
    hint = failure.describe(e, [str(tmp_path)], workspace="/workspace")["hint"]
    assert "could not fetch dataset 'openai/gsm8k'" in hint and "HF_HOME=/workspace/hf" in hint, hint


def precheck(repo, entry: str) -> dict:
    r = subprocess.run([sys.executable, str(PRECHECK), entry, str(repo)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_the_import_check_finds_a_missing_module_a_missing_name_and_a_syntax_error_without_running_anything(
        tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "mod.py").write_text("import json\n\ndef reward(x):\n    return 1\n")
    (tmp_path / "side_effect.py").write_text("open('RAN', 'w').write('x')\n")
    (tmp_path / "train.py").write_text("import os\nimport side_effect\nfrom pkg.mod import reward\n"
                                       "from my_rewards import f\n")
    err = precheck(tmp_path, "train.py")
    assert err == {"type": "ModuleNotFoundError", "message": "No module named 'my_rewards'",
                   "where": f"{tmp_path / 'train.py'}:4", "code": "from my_rewards import f"}, err
    assert not (tmp_path / "RAN").exists(), "nothing of the user's code runs"
    (tmp_path / "train.py").write_text("from pkg.mod import reward, rewards\n")
    assert precheck(tmp_path, "train.py")["message"].startswith("cannot import name 'rewards' from 'pkg.mod'")
    (tmp_path / "train.py").write_text("def main(:\n")
    assert precheck(tmp_path, "train.py")["type"] == "SyntaxError"
    assert precheck(tmp_path, "pkg.mod:main")["message"] == "module 'pkg.mod' has no attribute 'main'"
    assert precheck(tmp_path, "pkg.mod:reward") == {}


def test_the_import_check_leaves_alone_what_it_cannot_tell(tmp_path):
    """Every one of these scripts runs: a working script is never refused. A sys.path change (in the entry or
    in a module it imports first), an import in a try, a vendored areal/ (the bootstrap ignores it), an
    extension module, names made by globals() or inside a match, an entry in a subdirectory."""
    (tmp_path / "areal").mkdir()
    (tmp_path / "areal" / "__init__.py").write_text("from nothing_here import x\n")
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "from_lib.py").write_text("X = 1\n")
    (tmp_path / "paths.py").write_text("import os, sys\nsys.path.insert(0, os.path.join(os.path.dirname(__file__), "
                                       "'lib'))\n")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "_ext.cpython-311-x86_64-linux-gnu.so").write_bytes(b"\x7fELF")
    (tmp_path / "conf.py").write_text("globals().update(LR=1e-5)\n")
    (tmp_path / "cfgmod.py").write_text("import sys\nmatch sys.platform:\n    case _:\n        X = 1\n")
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "helpers.py").write_text("def h():\n    pass\n")
    scripts = {"a.py": "import sys\nsys.path.insert(0, 'lib')\nimport from_lib\n",
               "b.py": "import paths\nimport from_lib\n",
               "c.py": "try:\n    import optional_dep\nexcept ImportError:\n    pass\nimport json\nimport areal\n",
               "d.py": "from pkg import _ext\n",
               "e.py": "from conf import LR\n",
               "f.py": "from cfgmod import X\n",
               "scripts/g.py": "from helpers import h\nimport pkg\n"}
    for name, text in scripts.items():
        (tmp_path / name).write_text(text)
        assert precheck(tmp_path, name) == {}, name


def test_doctor_names_a_script_that_never_trained_and_a_loop_bound_stop():
    pod = SimpleNamespace(progress={"stopped": {"by": "never-trained", "time": 1.0, "message": "train.py ended "
                                                "without calling PPOTrainer.train: nothing trained", "hint": "call it"}},
                          state=ROOT / "no-such-state-dir")
    f = doctor.check_trainer_config(pod, 0)
    assert f.id == "trainer_never_trained" and f.title.startswith("your script never trained") and f.fix == "call it"
    pod.progress["stopped"]["by"] = "crash-loop"
    assert doctor.check_trainer_config(pod, 0).id == "trainer_crash_loop"
    pod.progress["stopped"]["by"] = "SIGTERM"
    assert doctor.check_trainer_config(pod, 0) is None


def test_describing_a_hostile_exception_never_raises_and_never_hides_it(tmp_path):
    """It runs in the handler of the user's exception: an exception whose str() raises, a local whose
    attribute lookup raises, a huge message."""
    e = raised(tmp_path, """
        class Loud(Exception):
            def __str__(self):
                raise RuntimeError("no str for you")
        class Trap:
            def __getattr__(self, name):
                raise RuntimeError("no attributes either")
        def run():
            trap = Trap()
            raise KeyError("x" * 100000) if trap else Loud()
    """)
    err = failure.describe(e, [str(tmp_path)])
    assert err["type"] == "KeyError" and len(err["message"]) <= failure.MAX_MESSAGE, err
    e = raised(tmp_path, """
        class Loud(Exception):
            def __str__(self):
                raise RuntimeError("no str for you")
        def run():
            raise Loud()
    """)
    err = failure.describe(e, [str(tmp_path)])
    assert err["type"] == "Loud" and err["where"].endswith("user_code.py:6") and err["code"] == "raise Loud()", err


def test_a_reward_in_areals_process_pool_wrapped_by_the_rollout_thread_is_named_at_its_line(tmp_path):
    """AReaL runs the reward in a process pool (the worker's traceback comes back as text, under the exception)
    and raises a failed rollout thread's exception in the main thread as RuntimeError("Background thread
    failed") from it (episodes.py hands it over that way): two levels down, the user's line is still found."""
    from concurrent.futures.process import _RemoteTraceback

    reward = tmp_path / "my_reward.py"
    reward.write_text('def boxed_answer_reward(prompt, completions, answer, **_data):\n'
                      '    expected = _data["solution"]\n')
    inner = KeyError("solution")
    inner.__cause__ = _RemoteTraceback('\n"""\nTraceback (most recent call last):\n'
                                       '  File "/usr/lib/python3.11/concurrent/futures/process.py", line 256, in '
                                       '_process_worker\n    r = call_item.fn(*call_item.args, **call_item.kwargs)\n'
                                       f'  File "{reward}", line 2, in boxed_answer_reward\n'
                                       '    expected = _data["solution"]\nKeyError: \'solution\'\n"""')
    outer = RuntimeError(f"Background thread failed: {inner}")
    outer.__cause__ = inner
    for exc in (inner, outer):  # as episodes.py records it, and as the bootstrap sees it
        err = failure.describe(exc, [str(tmp_path)])
        assert (err["type"], err["message"], err["where"]) == ("KeyError", "'solution'", f"{reward}:2"), err
        assert err["code"] == 'expected = _data["solution"]', err


def test_a_reward_that_returns_none_is_named_though_areals_code_raises_the_error(tmp_path):
    """AReaL's RLVR workflow records float(reward): a reward returning None for some answers failed in AReaL's
    stats tracker with no frame of the user's. The hint names the reward function and where it is."""
    exc = raised(tmp_path, """
        def boxed_answer_reward(prompt, completions, **data):
            return None if "boxed" not in completions else 1.0

        class RLVRWorkflow:  # AReaL's method names, as the traceback has them
            reward_fn = staticmethod(boxed_answer_reward)

            def _collect_samples(self):
                reward = self.reward_fn("p", "no answer")
                return float(reward)

        def run():
            return RLVRWorkflow()._collect_samples()
        """)
    wrapped = RuntimeError("Background thread failed")
    wrapped.__cause__ = exc
    for e in (exc, wrapped):
        err = failure.describe(e, [str(tmp_path / "elsewhere")])  # the reward is not under the roots here
        assert err["hint"] == (f"the reward function boxed_answer_reward ({tmp_path / 'user_code.py'}:2) returned "
                               "None: return a number for every completion (0.0 for one that is wrong)"), err
    assert failure.describe(TypeError("unsupported operand type(s): 'NoneType'"), [])["hint"] == ""


def test_failed_episodes_on_record_are_read_as_data_by_status_and_doctor(tmp_path):
    """progress.json's episodes record (areal/episodes.py) is data: a rare failure is a note, one episode in ten
    a problem, a tripped streak a problem, and a planted record (wrong types, an escape sequence) shows as
    text or not at all, never raises."""
    from podkit.views import status

    def pod(ep):
        return SimpleNamespace(progress={"episodes": ep}, state=ROOT / "no-such-state-dir")

    last = {"type": "KeyError", "message": "'solution'", "where": "/ws/repo/my_reward.py:9",
            "code": 'expected = _data["solution"]', "hint": ""}
    rare = doctor.check_episodes(pod({"failed": 3, "succeeded": 997, "in_a_row": 1, "limit": 64, "last": last}), 0)
    assert rare.severity == "info" and "of 1000" in rare.title, rare.to_dict()
    biased = doctor.check_episodes(pod({"failed": 62, "succeeded": 552, "last": last}), 0)
    assert biased.severity == "problem" and "train on the episodes that did not fail" in biased.title
    tripped = doctor.check_episodes(pod({"failed": 8, "succeeded": 0, "in_a_row": 8, "limit": 8, "tripped": True,
                                         "last": last}), 0)
    assert tripped.severity == "problem" and "8 in a row" in tripped.title
    assert tripped.evidence[0] == "KeyError: 'solution' at /ws/repo/my_reward.py:9", tripped.evidence
    for planted in ({"failed": "lots"}, {"failed": True}, {"failed": -3}, [], "x", None, {"failed": 0}):
        assert doctor.check_episodes(pod(planted), 0) is None and status.failed_episodes({"episodes": planted}) is None
    # Every episode failed to reach inference: the server, named as such, not the workflow.
    down = "inference unreachable at 127.0.0.2:16345 (/generate: ClientConnectorError)"
    server = {"failed": 166, "succeeded": 0, "in_a_row": 166, "limit": 64, "tripped": True, "unreachable": down,
              "unreachable_failed": 166, "unreachable_in_a_row": 166,
              "last": {**last, "type": "RuntimeError", "message": "Failed after 5 retries each. ...",
                       "where": "/areal/infra/utils/http.py:219"}}
    f = doctor.check_episodes(pod(server), 0)
    assert f.id == "episodes_inference_unreachable" and f.severity == "problem" and down in f.title, f.to_dict()
    assert "not your code" in f.fix and "workflow" not in f.title, f.to_dict()
    line = status.describe_episodes(status.failed_episodes({"episodes": server}))
    assert down in line and "your workflow" not in line and "166 in a row" in line and "hint" not in line, line
    # The workflow's own failures, then one that never reached inference: still the workflow's, a problem.
    mixed = {"failed": 301, "succeeded": 600, "in_a_row": 1, "limit": 64, "unreachable": down,
             "unreachable_failed": 1, "unreachable_in_a_row": 1, "last": last}
    f = doctor.check_episodes(pod(mixed), 0)
    assert f.id == "episodes_failing" and f.severity == "problem" and f.title.startswith("300 "), f.to_dict()
    assert any("1 more never reached inference" in e for e in f.evidence), f.evidence
    line = status.describe_episodes(status.failed_episodes({"episodes": mixed}))
    assert "in your workflow: 300 of 901" in line and "1 more never reached inference" in line, line
    hostile = status.failed_episodes({"episodes": {"failed": 2, "succeeded": [], "last": {
        "type": "\x1b[2JError", "message": "x" * 10_000, "where": 7}}})
    line = status.describe_episodes(hostile)
    assert "\x1b" not in line and len(line) < 1000 and "of 2 since" in line and "at 7" in line, line
    line = status.describe_episodes(status.failed_episodes({"episodes": {"failed": 2, "unreachable": "\x1b[2J" * 500}}))
    assert "\x1b" not in line and len(line) < 1000, line
