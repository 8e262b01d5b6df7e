"""Runs in the AReaL environment (tests/trainer/test_rehearsal.py) against a running generating stand-in started
with SGLANG_API_KEY: what AReaL relies on, checked against transformers' own forward of the same model.
    standin_check.py PORT MODEL_DIR KEY WORK_DIR   -> one JSON line of measurements"""

import asyncio
import json
import sys
import threading
import time
import urllib.error
import urllib.request

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

port, model_dir, key, work = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
base = f"http://127.0.0.1:{port}"
auth = {"Authorization": f"Bearer {key}"}
out: dict = {}


def call(path, body=None, headers=auth, timeout=120):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(base + path, data, {"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
            return r.status, json.loads(raw) if raw.strip().startswith(b"{") else raw.decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


out["health_without_key"] = call("/health", headers={})[0]
out["generate_without_key"] = call("/generate", {"input_ids": [1]}, headers={})[0]
out["model_info_without_key"] = call("/model_info", headers={})[0]
out["version_before"] = call("/model_info")[1]["weight_version"]

tok = AutoTokenizer.from_pretrained(model_dir)
ids = tok.apply_chat_template([{"role": "user", "content": "Tom has 3 apples and gets 5 more. How many?"}],
                              add_generation_prompt=True)["input_ids"]


def gen(temperature, n=24, **kw):
    sp = {"max_new_tokens": n, "temperature": temperature, "top_p": 1.0, "top_k": -1, "stop_token_ids": [],
          "ignore_eos": False, "skip_special_tokens": True, **kw}
    return call("/generate", {"input_ids": ids, "sampling_params": sp, "return_logprob": True})[1]


def gap(model, temperature, r):
    """max |stand-in log-prob - log_softmax(logits / T)| over the generated tokens (SGLang's sampler)."""
    got = r["output_ids"]
    lps = torch.tensor([x[0] for x in r["meta_info"]["output_token_logprobs"]])
    assert [x[1] for x in r["meta_info"]["output_token_logprobs"]] == got
    with torch.no_grad():
        logits = model(torch.tensor([ids + got])).logits[0, len(ids) - 1:-1].float()
    ref = torch.log_softmax(logits / (temperature or 1.0), -1)[torch.arange(len(got)), torch.tensor(got)]
    return float((ref - lps).abs().max())


m0 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
out["gaps"] = {str(t): gap(m0, t, gen(t)) for t in (1.0, 0.7, 0.0)}
r = gen(1.0, n=64, stop_token_ids=[tok.eos_token_id])
out["finish"] = r["meta_info"]["finish_reason"]
out["last_token"], out["eos"] = r["output_ids"][-1], tok.eos_token_id

# /pause_generation aborts what is in flight (partial output kept); a request sent while paused waits.
flight: list = [None] * 3


def long(i):
    flight[i] = gen(1.0, n=2000, ignore_eos=True)


threads = [threading.Thread(target=long, args=(i,)) for i in range(3)]
for t in threads:
    t.start()
time.sleep(1.0)
out["pause"] = call("/pause_generation", {})[0]
for t in threads:
    t.join(60)
out["aborted"] = [(f["meta_info"]["finish_reason"]["type"], len(f["output_ids"])) for f in flight]
waiting: list = [None]
waiter = threading.Thread(target=lambda: waiting.__setitem__(0, gen(1.0, n=4)))
waiter.start()
time.sleep(1.0)
out["waits_while_paused"] = waiter.is_alive()

# A weight update from disk loads before it answers and sets the version.
m1 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
with torch.no_grad():
    for p in m1.parameters():
        p.add_(torch.randn_like(p) * 0.5)
m1.save_pretrained(f"{work}/update_v7")
out["update"] = call("/update_weights_from_disk", {"model_path": f"{work}/update_v7", "abort_all_requests": True,
                                                   "weight_version": "7"})[1]
out["missing_update"] = call("/update_weights_from_disk", {"model_path": f"{work}/nope", "weight_version": "8"})[0]
call("/continue_generation", {})
waiter.join(60)
out["waited_version"] = waiting[0]["meta_info"]["weight_version"]
out["version_after"] = call("/model_info")[1]["weight_version"]
r = gen(1.0)
out["gap_new_weights"], out["gap_old_weights"] = gap(m1, 1.0, r), gap(m0, 1.0, r)

# An update without a pause waits for the requests in flight (SGLang's model_update_lock): they finish on
# the weights they started on, and say so; the update answers after them.
ended: dict = {}


def in_flight():
    ended["answer"] = gen(1.0, n=300, ignore_eos=True)
    ended["t"] = time.time()


flying = threading.Thread(target=in_flight)
flying.start()
time.sleep(0.5)
call("/update_weights_from_disk", {"model_path": model_dir, "weight_version": "9"})
updated = time.time()
flying.join(60)
out["in_flight"] = {"version": ended["answer"]["meta_info"]["weight_version"],
                    "tokens": len(ended["answer"]["output_ids"]), "gap": gap(m1, 1.0, ended["answer"]),
                    "gap_base": gap(m0, 1.0, ended["answer"]),
                    "update_after_it": updated >= ended["t"], "served": call("/model_info")[1]["weight_version"]}


# AReaL's own request helper against the key: refused as AReaL 1.0.4 sends it, accepted through podkit's patch.
async def areal_call():
    import aiohttp
    import areal.infra.remote_inf_engine as rie

    async def once():
        async with aiohttp.ClientSession(connector=rie.get_default_connector()) as s:
            try:
                await rie.arequest_with_retry(session=s, addr=f"127.0.0.1:{port}", endpoint="/continue_generation",
                                              payload={}, max_retries=1, timeout=10)
                return "ok"
            except RuntimeError as e:
                return str(e)

    before = await once()
    from podkit.areal import patches as areal_patches

    areal_patches.send_api_key(key)
    return before, await once()


out["areal_without_patch"], out["areal_with_patch"] = asyncio.run(areal_call())
print(json.dumps(out))
