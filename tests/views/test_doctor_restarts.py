"""Issue 48: `podkit doctor` showed the user's own `podkit ctl restart sglang` as a red PROBLEM, quoting SGLang's
"Capture cuda graph ... avail mem=0.00 GB" lines as its error evidence. A restart you asked for is a note, never a
problem, and error evidence is a line with an error's own marks, never a start-up or progress line. The smoke
stack (real supervisord, `podkit ctl`) and SGLang's own log text."""

from __future__ import annotations

import json
import subprocess
import time
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import PODKIT, wait_for
from podkit import records
from podkit.views import doctor

pytestmark = pytest.mark.timeout(120)

# SGLang 0.5's log of one start, as it writes it (scheduler.py, model_runner.py, cuda_graph_runner.py, uvicorn).
SGLANG_START = """\
[2026-11-25 14:37:02] server_args=ServerArgs(model_path='Qwen/Qwen3-8B', tp_size=1, mem_fraction_static=0.85)
[2026-11-25 14:37:09 TP0] Init torch distributed begin.
[2026-11-25 14:37:10 TP0] Load weight begin. avail mem=43.89 GB
[2026-11-25 14:37:48 TP0] Load weight end. type=Qwen3ForCausalLM, dtype=torch.bfloat16, avail mem=28.40 GB, mem usage=15.49 GB.
[2026-11-25 14:37:48 TP0] KV Cache is allocated. #tokens: 152344, K size: 10.46 GB, V size: 10.46 GB
[2026-11-25 14:37:48 TP0] Memory pool end. avail mem=6.75 GB
[2026-11-25 14:37:49 TP0] Capture cuda graph begin. This can take up to several minutes. avail mem=6.12 GB
Capturing batches (bs=160 avail_mem=6.02 GB):  43%|████▎     | 10/23 [00:02<00:02,  4.87it/s]
[2026-11-25 14:37:58 TP0] Capture cuda graph end. Time elapsed: 9.21 s. mem usage=0.62 GB. avail mem=0.00 GB.
[2026-11-25 14:37:59 TP0] max_total_num_tokens=152344, chunked_prefill_size=8192, max_prefill_tokens=16384, \
max_running_requests=2048, context_len=40960, available_gpu_mem=0.00 GB
[2026-11-25 14:38:00] INFO:     Started server process [812]
[2026-11-25 14:38:00] INFO:     Waiting for application startup.
[2026-11-25 14:38:00] INFO:     Uvicorn running on http://0.0.0.0:30000 (Press CTRL+C to quit)
[2026-11-25 14:38:01] INFO:     127.0.0.1:50412 - "GET /get_model_info HTTP/1.1" 200 OK
[2026-11-25 14:38:02 TP0] Prefill batch. #new-seq: 1, #new-token: 7, #cached-token: 0, token usage: 0.00, \
#running-req: 0, #queue-req: 0
[2026-11-25 14:38:03] The server is fired up and ready to roll!
[2026-11-25 15:02:11 TP0] Decode batch. #running-req: 64, #token: 30211, token usage: 0.20, cuda graph: True, \
gen throughput (token/s): 2961.35, #queue-req: 0
[2026-11-25 15:02:12] INFO:     127.0.0.1:50440 - "POST /generate HTTP/1.1" 500 Internal Server Error
[2026-11-25 15:02:13] WARNING:  Invalid HTTP request received.
[2026-11-25 15:02:14 TP0] Cache flushed successfully!
[podkit:run] starting sglang (pid 977)
""".splitlines()
SGLANG_CRASH = """\
[2026-11-25 15:10:41 TP0] Scheduler hit an exception: Traceback (most recent call last):
  File "/sgl-workspace/sglang/python/sglang/srt/managers/scheduler.py", line 2712, in run_scheduler_process
    scheduler.event_loop_overlap()
torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.95 GiB. GPU 0 has a total capacity of 44.35 GiB
RuntimeError: Not enough memory. Please try to increase --mem-fraction-static.
Killed
""".splitlines()


def test_sglangs_start_up_and_progress_lines_are_not_error_evidence_and_its_crash_lines_are():
    """Every line of an SGLang start and its serving (CUDA graphs with avail mem=0.00 GB, a 500 logged at INFO, a
    warning) is no error; a scheduler's traceback, CUDA's out of memory, an exception and a kill are."""
    assert [ln for ln in SGLANG_START if doctor.is_error(ln)] == []
    assert doctor.error_evidence(SGLANG_START + SGLANG_CRASH) == [
        SGLANG_CRASH[0], SGLANG_CRASH[3], SGLANG_CRASH[4], "Killed"]


STAMP = st.builds(lambda t, tp: f"[2026-11-25 {t // 3600 % 24:02d}:{t // 60 % 60:02d}:{t % 60:02d}{tp}]",
                  st.integers(0, 86399), st.sampled_from(["", " TP0", " TP3", " DP1 TP0"]))
GB = st.floats(0, 200, allow_nan=False).map(lambda v: f"{v:.2f}")
PROGRESS = st.one_of(
    st.builds(lambda m: f"Load weight begin. avail mem={m} GB", GB),
    st.builds(lambda a, b: f"Load weight end. type=Qwen3ForCausalLM, dtype=torch.bfloat16, avail mem={a} GB, "
              f"mem usage={b} GB.", GB, GB),
    st.builds(lambda m: f"Capture cuda graph begin. This can take up to several minutes. avail mem={m} GB", GB),
    st.builds(lambda s, a, b: f"Capture cuda graph end. Time elapsed: {s} s. mem usage={a} GB. avail mem={b} GB.",
              GB, GB, GB),
    st.builds(lambda n, t, u, g: f"Decode batch. #running-req: {n}, #token: {t}, token usage: {u}, cuda graph: "
              f"True, gen throughput (token/s): {g}, #queue-req: 0", st.integers(0, 4096), st.integers(0, 10**6),
              GB, GB),
    st.builds(lambda n, t: f"Prefill batch. #new-seq: {n}, #new-token: {t}, #cached-token: 0, token usage: 0.00, "
              "#running-req: 0, #queue-req: 0", st.integers(0, 512), st.integers(0, 10**6)))
FREE_TEXT = st.text(st.characters(blacklist_categories=("Cs", "Cc")), max_size=80)
EXCEPTION = st.from_regex(r"(torch\.|sglang\.srt\.)?[A-Z][a-z]{2,12}(Error|Exception)", fullmatch=True)
LEVELS = st.sampled_from(["INFO:    ", "INFO", "DEBUG", "WARNING:", "WARN"])


@given(stamp=STAMP, line=PROGRESS)
@settings(max_examples=300, deadline=None)
def test_no_progress_line_of_sglangs_is_error_evidence_whatever_its_numbers(stamp, line):
    """SGLang's start-up and serving lines, with any memory, batch and throughput figures (0.00 GB free after the
    CUDA graphs is normal), are never error evidence."""
    assert not doctor.is_error(f"{stamp} {line}")


@given(stamp=STAMP, level=LEVELS, text=FREE_TEXT)
@settings(max_examples=300, deadline=None)
def test_a_line_logged_below_error_level_is_not_error_evidence_whatever_it_says(stamp, level, text):
    """A line whose level tag (INFO, DEBUG, WARNING) comes first is not an error, even when what follows quotes
    an exception's name or CUDA."""
    assert not doctor.is_error(f"{stamp} {level} {text}"), text
    assert not doctor.is_error(f"{stamp} {level} request failed: RuntimeError {text}")


@given(stamp=STAMP, name=EXCEPTION, message=FREE_TEXT)
@settings(max_examples=300, deadline=None)
def test_an_exception_or_a_traceback_is_always_error_evidence(stamp, name, message):
    """Whatever its message: a raised exception's line, or a traceback's head behind SGLang's stamp."""
    assert doctor.is_error(f"{name}: {message}")
    assert doctor.is_error(f"{stamp} Scheduler hit an exception: Traceback (most recent call last):")
    assert doctor.error_evidence([f"{stamp} Capture cuda graph end. avail mem=0.00 GB.", f"{name}: {message}"]) == \
        [doctor.status.printable(f"{name}: {message}".strip(), 400)]


def restarted_pod(tmp_path, events: list[dict], starts: int, log: list[str]):
    """What doctor reads of inference restarted `starts - 1` times, with status's timeline events."""
    state = tmp_path / ".podkit"
    state.mkdir(exist_ok=True)
    records.CURRENT.write(state, {"started": time.time() - 3600})
    return SimpleNamespace(state=state, programs={"sglang": {"starts": starts, "state": "RUNNING"}},
                           st={"startup": {"events": events}}, log_tail=lambda program, n=400: log[-n:])


def restart(by_you: bool, asked: str = "", after_s: float = 18000.0) -> dict:
    return {"event": "inference_restarted", "program": "sglang", "at": 0.0, "after_s": after_s, "asked": asked,
            "by_you": by_you, **({} if asked else {"ended": "exited: exit status 1; not expected"})}


def test_your_restart_of_inference_is_a_note_and_a_crash_beside_it_is_the_problem_with_its_traceback(tmp_path):
    """Your `podkit ctl restart sglang`: a note with no error evidence and no "often an OOM". A crash beside it: a
    problem counting only the crash, quoting the crash's lines and not the start-up's."""
    mine = restart(True, "you (podkit ctl restart sglang)")
    f = doctor.check_restarts(restarted_pod(tmp_path, [mine], 2, SGLANG_START), 0, "sglang", "inference")
    assert f.severity == "info" and f.title == "inference restarted 1 time(s), each asked by you", f.to_dict()
    assert f.evidence == ["inference restarted at +5.0h (asked by you: podkit ctl restart sglang)"], f.evidence
    assert "OOM" not in f.fix
    f = doctor.check_restarts(restarted_pod(tmp_path, [mine, restart(False)], 3, SGLANG_START + SGLANG_CRASH), 0,
                              "sglang", "inference")
    assert f.severity == "problem" and f.title.startswith("inference restarted 1 time(s) (and 1 time(s) on your "
                                                          "request, not counted)"), f.title
    assert f.evidence[0].endswith("(nobody asked for it; exited: exit status 1; not expected)"), f.evidence
    assert "torch.OutOfMemoryError: CUDA out of memory." in " ".join(f.evidence), f.evidence
    assert not any("Capture cuda graph" in e or "avail mem" in e for e in f.evidence), f.evidence


@given(kinds=st.lists(st.sampled_from(["you", "watchdog", "crash"]), min_size=1, max_size=6))
@settings(max_examples=200, deadline=None)
def test_doctor_calls_restarts_a_problem_exactly_when_one_of_them_was_not_yours(tmp_path_factory, kinds):
    """For any mix of your restarts, the watchdog's and crashes: a problem when any was not yours (and it counts
    only those), else a note; never a problem for yours alone."""
    asked = {"you": "you (podkit ctl restart sglang)", "watchdog": "the watchdog (unhealthy for 300s)", "crash": ""}
    events = [restart(k == "you", asked[k]) for k in kinds]
    f = doctor.check_restarts(restarted_pod(tmp_path_factory.mktemp("pod"), events, len(kinds) + 1, SGLANG_START),
                              0, "sglang", "inference")
    theirs = sum(k != "you" for k in kinds)
    assert f.severity == ("problem" if theirs else "info"), (kinds, f.to_dict())
    assert f.title.startswith(f"inference restarted {theirs or len(kinds)} time(s)"), (kinds, f.title)
    assert not any("avail mem" in e for e in f.evidence), f.evidence


@pytest.mark.e2e
@pytest.mark.timeout(180)
def test_your_ctl_restart_of_inference_on_a_running_stack_is_no_problem_and_quotes_no_start_up_line(stack_factory):
    """The smoke stack trains; `podkit ctl restart sglang`; once the new server is up, `podkit doctor` has no
    inference_restarts problem, only a note naming your restart, and no stand-in start-up line as evidence."""
    s = stack_factory().start()
    s.wait_step(2)
    old = s.pid("sglang")
    r = subprocess.run([*PODKIT, "ctl", "--workspace", str(s.workspace), "restart", "sglang"], capture_output=True,
                       text=True, env=s.env, timeout=90)
    assert r.returncode == 0, r.stdout + r.stderr
    wait_for(lambda: s.pid("sglang") not in (0, old), 60, what="the new server")

    def finding():
        out = subprocess.run([*PODKIT, "doctor", "--json", "--workspace", str(s.workspace)], capture_output=True,
                             text=True, env=s.env, timeout=60)
        return next((f for f in json.loads(out.stdout)["findings"] if f["id"] == "inference_restarts"), None)
    # The listener counts the start asynchronously: the note appears once it has.
    f = wait_for(finding, 30, 0.5, what="the restart counted")
    assert f["severity"] == "info" and "each asked by you" in f["title"], f
    assert f["evidence"] and all("asked by you: podkit ctl restart sglang" in e for e in f["evidence"]), f
    assert not any("cuda graph" in e.lower() or "avail mem" in e for e in f["evidence"]), f
    assert s.stop() == 0
