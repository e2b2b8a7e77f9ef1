"""End-to-end: after every kind of request, parallel sampling (``n > 1``) among them, the server
holds no request state and no pool slot, and SIGTERM drains it to zero and ends it within a bound.

SGLang 0.5.16-0.5.21 kept ``n - 1`` request states per prompt of an ``n > 1`` request forever, so
a SIGTERM'd server waited for them without end and a request id could not be used twice; up to
0.5.19 a cut ``n > 1`` stream decoded its samples to ``max_new_tokens`` (``sglang_m3.parallel_sampling``
closes both). The signal goes to the server's main process only, as ``kill <pid>`` sends it: a
signal to the whole process group ends the scheduler too, and the server then exits through its
crash path, drained or not.
"""

import concurrent.futures
import http.client
import json
import os
import random
import re
import signal
import subprocess
import time
import urllib.request

import pytest

pytestmark = pytest.mark.slow

VOCAB = 2048  # configs/minimax-m3.1-tiny
CONTEXT = 8192  # its max_position_embeddings
EXIT_BOUND_S = 60  # SGLang's watchdog looks every 5 s, then gives its schedulers up to 15 s
IDLE_BOUND_S = 180
PROMPT = " ".join(random.Random(21).choice(["alpha", "beta", "gamma", "delta", "omega", "sigma"]) + str(i % 17)
                  for i in range(150))  # 150 words


@pytest.fixture(scope="module")
def server(server_factory):
    # --log-level info: the tokenizer manager's "Remaining number of requests" lines show up in the log
    return server_factory("shutdown", "--index-k-format", "mxfp4", "--log-level", "info").wait_ready()


def _loads(server) -> dict:
    with urllib.request.urlopen(server.url + "/v1/loads", timeout=30) as r:
        (load,) = json.loads(r.read())["loads"]
    return load


def free_tokens(server) -> int:
    """Pool slots free or held only by the radix cache (evictable): SGLang's
    ``max_total_num_tokens - num_used_tokens``; a leaked slot is neither."""
    load = _loads(server)
    return load["max_total_num_tokens"] - load["num_used_tokens"]


def wait_idle(server, free_at_start: int) -> float:
    """Seconds until the scheduler runs and queues nothing and the pool is back at ``free_at_start``."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < IDLE_BOUND_S:
        load = _loads(server)
        if (load["num_running_reqs"], load["num_waiting_reqs"]) == (0, 0) and free_tokens(server) == free_at_start:
            return time.monotonic() - t0
        time.sleep(1)
    raise AssertionError(f"not idle after {IDLE_BOUND_S} s: {load}, free {free_tokens(server)} != {free_at_start}")


def cut_stream(server, payload: dict, chunks: int = 2) -> int:
    """POST a streaming ``/generate``, read ``chunks`` events, then drop the connection; events read."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=300)
    conn.request("POST", "/generate", body=json.dumps({**payload, "stream": True}),
                 headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200, response.read()
    seen = 0
    while seen < chunks:
        line = response.fp.readline()
        assert line, "stream ended early"
        seen += line.startswith(b"data: {")
    conn.sock.close()
    conn.close()
    return seen


def sampling(n: int = 1, max_new_tokens: int = 3, **kw) -> dict:
    return {"n": n, "max_new_tokens": max_new_tokens, "temperature": 1.0, **kw}


def test_its_children_were_forked_from_the_launcher(server):
    """The test servers start with the OpenMP waits in their environment (``sglang_m3.server.server_env``), so the
    plugin forks the scheduler and detokenizer; every test here then runs on forked children, SIGTERM too."""
    assert "scheduler and detokenizer forked from the launcher" in server.log_tail(chars=1 << 24)


def test_every_request_kind_leaves_no_state_and_no_slot_behind(server):
    free_at_start = free_tokens(server)
    assert free_at_start == _loads(server)["max_total_num_tokens"]

    # Parallel sampling: one prompt, a batch of prompts, through /v1/completions, streamed.
    # ignore_eos: at temperature 1 a dummy-weight sample can draw the stop token inside 3 tokens (seen once)
    status, body = server.post("/generate", {"text": PROMPT, "sampling_params": sampling(n=4, ignore_eos=True)})
    assert status == 200 and len(body) == 4 and all(b["meta_info"]["completion_tokens"] == 3 for b in body), body
    status, body = server.post("/generate", {"text": [PROMPT, "a second prompt"], "sampling_params": sampling(n=2)})
    assert status == 200 and len(body) == 4, body
    status, body = server.post("/v1/completions", {"model": "default", "prompt": PROMPT, "n": 3, "max_tokens": 3})
    assert status == 200 and len(body["choices"]) == 3, body
    with urllib.request.urlopen(urllib.request.Request(
            server.url + "/generate", headers={"Content-Type": "application/json"},
            data=json.dumps({"text": PROMPT, "stream": True, "sampling_params": sampling(n=2)}).encode()),
            timeout=300) as r:
        events = [line for line in r.read().split(b"\n\n") if line.startswith(b"data: {")]
    assert {json.loads(e[6:])["index"] for e in events} == {0, 1}
    # A request id names one request at a time; once it is done, it may be used again.
    for _ in range(2):
        status, body = server.post("/generate", {"rid": "again", "text": PROMPT, "sampling_params": sampling(n=2)})
        assert status == 200 and len(body) == 2, body

    # The other kinds: client-cut streams (one sample and two), batched texts, log-probs, ids outside
    # the vocabulary, an over-long prompt, oversized max_new_tokens (alone and with n > 1).
    long_decode = sampling(max_new_tokens=200, ignore_eos=True)
    assert cut_stream(server, {"text": PROMPT, "sampling_params": long_decode}) == 2
    assert cut_stream(server, {"text": PROMPT, "sampling_params": {**long_decode, "n": 2}}) == 2
    status, body = server.post("/generate", {"text": ["one", "two", "three"], "sampling_params": sampling()})
    assert status == 200 and len(body) == 3, body
    # ignore_eos: three log-prob rows need three tokens (a sample drew the stop token first in CI, 2026-12-03)
    status, body = server.post("/generate", {"text": PROMPT, "sampling_params": sampling(ignore_eos=True),
                                             "return_logprob": True, "top_logprobs_num": 2})
    assert status == 200 and len(body["meta_info"]["output_top_logprobs"]) == 3, body
    status, body = server.post("/generate", {"input_ids": [5, VOCAB], "sampling_params": sampling(n=2)})
    assert status == 400 and str(VOCAB) in str(body), body
    status, body = server.post("/generate", {"input_ids": [5] * (CONTEXT + 100), "sampling_params": sampling()})
    assert status == 400, body
    for n in (1, 3):
        status, body = server.post("/generate", {"text": PROMPT,
                                                 "sampling_params": sampling(n=n, max_new_tokens=10**6)})
        assert status == 400 and "context length" in str(body), body
    # Concurrent parallel sampling.
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(lambda i: server.post("/generate", {"text": f"{i} {PROMPT}", "sampling_params":
                                                                    sampling(n=3)}), range(4)))
    assert all(status == 200 and len(body) == 3 for status, body in results), results

    print(f"idle {wait_idle(server, free_at_start):.1f} s after the last request")
    with urllib.request.urlopen(urllib.request.Request(server.url + "/flush_cache", method="POST"), timeout=60) as r:
        assert r.status == 200  # the radix cache let go of every page, so the pool is wholly free
    assert free_tokens(server) == free_at_start
    assert server.healthy()


def test_a_cut_parallel_stream_stops_its_samples(server):
    """Two samples of 4000 tokens would decode for a minute or more here; cut after two events,
    they are aborted (a cut single stream: SGLang aborts it 2 s after the cut)."""
    free_at_start = free_tokens(server)
    payload = {"text": PROMPT, "sampling_params": sampling(n=2, max_new_tokens=4000, ignore_eos=True)}
    assert cut_stream(server, payload) == 2
    idle = wait_idle(server, free_at_start)
    print(f"idle {idle:.1f} s after the cut")
    assert idle < 20


def _drain_counts(server) -> list[int]:
    """The tokenizer manager's "Remaining number of requests N" counts, in log order."""
    return [int(m) for m in re.findall(r"Remaining number of requests (\d+)", server.log_tail(chars=1 << 24))]


def test_sigterm_drains_to_zero_and_exits(server):
    # ignore_eos: at temperature 1 a dummy-weight sample can draw the stop token inside 3 tokens (seen once)
    status, body = server.post("/generate", {"text": PROMPT, "sampling_params": sampling(n=4, ignore_eos=True)})
    assert status == 200 and len(body) == 4, body
    t0 = time.monotonic()
    os.kill(server.proc.pid, signal.SIGTERM)  # the main process only, as `kill <pid>` does
    try:
        server.proc.wait(timeout=EXIT_BOUND_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"server still running {EXIT_BOUND_S} s after SIGTERM; remaining requests: {_drain_counts(server)}")
    print(f"exited {time.monotonic() - t0:.1f} s after SIGTERM")
    assert _drain_counts(server)[-1:] == [0], server.log_tail()


def test_a_group_stop_skips_the_crash_diagnostics(server_factory):
    """The harnesses stop a server by signalling its process group, which ends the scheduler before the main
    process; SGLang takes that for a crash and slept 5 s before its diagnostics. The launch environment
    (``sglang_m3.server.server_env``) turns them off, so the stop does not wait."""
    s = server_factory("group-stop", "--log-level", "info").wait_ready()  # info: the sleep's log line shows
    s.generate([5, 6, 7], 2)
    t0 = time.monotonic()
    s.stop()
    print(f"stopped in {time.monotonic() - t0:.1f} s")
    log = s.log_path.read_text(errors="replace")
    assert re.search(r"crashed with exit code|SIGTERM received", log), log[-3000:]  # the stop reached it
    assert "before crash diagnostics" not in log, log[-3000:]
