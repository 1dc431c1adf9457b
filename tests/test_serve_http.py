"""``kvcompile serve`` as a client sees it: a subprocess on a free loopback port, talked to over HTTP with the
``openai`` client and httpx.

On the real SmolLM2 (slow): one chat completion streaming and one not, malformed JSON answered 4xx, the
server up afterwards, and the requests served by kvcompile's continuous-batching cache (its stats endpoint),
which has every block and slot back once they are done.

On the tiny random model (fast; one server for the module): a streaming client that disconnects mid-reply, and
a non-streaming client that times out, have their requests cancelled and their pages, blocks and slots back;
bad input of every kind answered 4xx in OpenAI's error shape, never 500, and the server answering a good
request afterwards."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import pytest
import torch
from tiers import slow_after

from benchmarks import serve_load
from benchmarks.serve_load import free_port

STARTUP_S = 180


def start_server(*args, launcher=()):
    """``kvcompile serve *args`` on a free loopback port, once it answers (``serve_load.launch``): ``(proc, base
    url)``; ``launcher``: the command that runs the module (default: this Python), e.g. torchrun's, with
    ``{port}`` standing for a free port of its own. Its own process group: ``stop_server`` ends torchrun's
    workers too."""
    def command(port):
        return [*([a.replace("{port}", str(free_port())) for a in launcher] or [sys.executable]), "-m",
                "kvcompile", "serve", *map(str, args), "--port", str(port)]

    try:
        proc, port, log = serve_load.launch(command, "/kvcompile/stats", "kvcompile serve", STARTUP_S,
                                            start_new_session=True)
    except RuntimeError as e:
        pytest.fail(str(e))
    proc.log = log
    return proc, f"http://127.0.0.1:{port}"


def stop_server(proc) -> str:
    """Stop the server (and any process it started); its output."""
    import signal

    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    except ProcessLookupError:
        pass
    try:  # workers left behind by a launcher that exited first
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.log.seek(0)
    out = proc.log.read()
    proc.log.close()
    return out


@pytest.fixture(scope="module")
def server():
    proc, base = start_server("--policy", "kivi:4", "--budget-mib", 64, "--max-requests", 4)
    try:
        models = httpx.get(f"{base}/v1/models", timeout=10).json()
        yield base, models
    finally:
        stop_server(proc)


def model_name(base) -> str:
    from kvcompile.models import resolve
    return str(resolve(None))


@pytest.mark.slow  # loads the real SmolLM2
def test_chat_completions_streaming_and_not_over_kvcompiles_cache(server):
    from openai import OpenAI

    base, _ = server
    client = OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=120)
    name = model_name(base)
    msg = [{"role": "user", "content": "Name three colors."}]
    out = client.chat.completions.create(model=name, messages=msg, max_tokens=12)
    text = out.choices[0].message.content
    assert isinstance(text, str) and text.strip() and out.usage.completion_tokens == 12
    chunks = list(client.chat.completions.create(model=name, messages=msg, max_tokens=12, stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed.strip() and len(chunks) > 2
    stats = httpx.get(f"{base}/kvcompile/stats", timeout=10).json()
    assert stats["manager"] == "KVCompileBatchingManager" and stats["cache"] == "PagedKVCompileCache"
    assert "kivi" in stats["policy"].lower() or "int4" in stats["policy"].lower()
    assert stats["prefix_sharing"] is False  # KIVI's window: its pages cannot be shared
    assert stats["allocated"] <= stats["budget"] == 64 * 2**20
    assert stats["free_blocks"] == stats["blocks"] and stats["requests"] == 0  # everything back


def test_the_server_does_not_log_as_ignored_the_fields_it_honours():
    """transformers' handlers log the request fields they ignore; kvcompile's server honours n, log
    probabilities, presence penalties, response formats, best_of and echo, so its log names only what it does
    ignore (here ``user``)."""
    import logging

    from transformers.utils import logging as hf_logging

    from kvcompile.openai_server import CheckedChatCompletionHandler, CheckedCompletionHandler

    seen = []

    class Catch(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    catch = Catch()
    hf_logging.get_logger("transformers").addHandler(catch)
    try:
        CheckedChatCompletionHandler(model_manager=None, generation_state=None)._validate_request(
            {"model": "m", "messages": [], "n": 2, "logprobs": True, "top_logprobs": 2, "presence_penalty": 0.5,
             "response_format": {"type": "json_object"}, "tool_choice": "none", "user": "u1"})
        CheckedCompletionHandler(model_manager=None, generation_state=None)._validate_request(
            {"model": "m", "prompt": "x", "n": 2, "best_of": 3, "echo": True, "logprobs": 1,
             "presence_penalty": 0.5})
    finally:
        hf_logging.get_logger("transformers").removeHandler(catch)
    ignored = [m for m in seen if "Ignoring unsupported fields" in m]
    assert ignored == ["Ignoring unsupported fields in the request: {'user'}"], seen


@pytest.mark.slow
def test_json_mode_on_the_real_model(server):
    """SmolLM2 asked for a JSON object: free, it wraps one in a Markdown fence and goes on talking (no JSON); in
    JSON mode the reply is the object alone, ended when it closes, greedy and sampled; with a schema, an
    object the schema takes."""
    base, _ = server
    ask = {"model": model_name(base), "max_tokens": 80,
           "messages": [{"role": "user", "content": "Describe a cat as a JSON object with fields name, age and color."}]}
    for kw in ({}, {"temperature": 0.7, "seed": 1}):
        r = httpx.post(f"{base}/v1/chat/completions", timeout=300,
                       json={**ask, **kw, "response_format": {"type": "json_object"}})
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "stop" and isinstance(json.loads(choice["message"]["content"]), dict)
    free = httpx.post(f"{base}/v1/chat/completions", timeout=300, json=ask).json()["choices"][0]["message"]["content"]
    with pytest.raises(ValueError):
        json.loads(free)
    import jsonschema
    cat = {"type": "object", "additionalProperties": False, "required": ["name", "age", "color"],
           "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                          "color": {"type": "string", "enum": ["black", "white", "ginger"]}}}
    r = httpx.post(f"{base}/v1/chat/completions", timeout=300, json={**ask, "response_format": {
        "type": "json_schema", "json_schema": {"name": "cat", "schema": cat, "strict": True}}})
    jsonschema.validate(json.loads(r.json()["choices"][0]["message"]["content"]), cat)


@pytest.mark.slow
def test_malformed_json_is_a_4xx_and_the_server_stays_up(server):
    base, _ = server
    r = httpx.post(f"{base}/v1/chat/completions", content=b'{"model": "x", "messages": [',
                   headers={"Content-Type": "application/json"}, timeout=30)
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    assert "Traceback" not in r.text
    r = httpx.post(f"{base}/v1/chat/completions", timeout=120,
                   json={"model": model_name(base), "messages": [{"role": "user", "content": "Hi"}],
                         "max_tokens": 4})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]


@pytest.mark.slow
def test_completions_and_an_unknown_model(server):
    from openai import BadRequestError, OpenAI

    base, _ = server
    client = OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=120)
    out = client.completions.create(model=model_name(base), prompt="The capital of France is", max_tokens=6)
    assert out.choices[0].text.strip() and out.usage.completion_tokens == 6
    with pytest.raises(BadRequestError):
        client.chat.completions.create(model="no/such-model", messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=4)
    stats = httpx.get(f"{base}/kvcompile/stats", timeout=10).json()
    assert stats["free_blocks"] == stats["blocks"] and stats["requests"] == 0


# --------------------------------------------------------------------------- the tiny model: faults and bad input
def stats(base) -> dict:
    return httpx.get(f"{base}/kvcompile/stats", timeout=10).json()


@pytest.fixture(scope="module")
def tiny_server(tiny_dir):
    """The tiny random model under KIVI 4-bit, 2 MiB of cache, 4 request slots."""
    proc, base = start_server("--model", tiny_dir, "--policy", "kivi:4", "--budget-mib", 2, "--max-requests", 4,
                              "--max-batch-tokens", 128)
    try:
        yield base, str(tiny_dir)
    finally:
        stop_server(proc)


def json_reply(tok, text: str, schema: dict | None = None) -> tuple[bool, bool]:
    """(``text`` is a prefix of a JSON object -- one that follows ``schema`` -- as llguidance reads its tokens under
    ``tok``, the object is whole)."""
    from kvcompile.json_mode import JsonConstraint, grammar, tokenizer_info

    c = JsonConstraint(tokenizer_info(tok, len(tok), (tok.eos_token_id,)), grammar(schema))
    for t in tok(text, add_special_tokens=False).input_ids:
        if not c.allowed()[t]:
            return False, False
        c.took(t)
    return True, c.complete


def chat(base, name, content="Hi", max_tokens=4, **kw):
    return httpx.post(f"{base}/v1/chat/completions", timeout=120,
                      json={"model": name, "messages": [{"role": "user", "content": content}],
                            "max_tokens": max_tokens, **kw})


@pytest.mark.slow
def test_a_request_id_already_running_is_refused(tiny_server):
    """A client's X-Request-ID names its request to the server (transformers' handlers take it as the request's
    id): a second request under the id of one still running is refused with a 400 saying so, and the id is free
    again once the first is done."""
    base, name = tiny_server
    # no max_tokens: the reply may take what the cache holds (thousands of tokens, tens of seconds on this model)
    body = {"model": name, "messages": [{"role": "user", "content": "Hi"}], "stream": True}
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", f"{base}/v1/chat/completions", json=body, headers={"X-Request-ID": "dup"}) as r:
            assert r.status_code == 200
            # the first is running: three pieces of its reply are out (its lines' iterator is kept: httpx closes
            # the stream when one is dropped)
            lines, chunks = r.iter_lines(), 0
            while chunks < 3:
                chunks += next(lines).startswith("data: {")
            second = httpx.post(f"{base}/v1/chat/completions", timeout=120, headers={"X-Request-ID": "dup"},
                                json={"model": name, "messages": [{"role": "user", "content": "Hi"}],
                                      "max_tokens": 4})
    assert second.status_code == 400 and second.json()["error"]["code"] == "duplicate_request_id", second.text
    t0 = time.time()
    while stats(base)["requests"] and time.time() - t0 < 30:
        time.sleep(0.2)
    again = httpx.post(f"{base}/v1/chat/completions", timeout=120, headers={"X-Request-ID": "dup"},
                       json={"model": name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
    assert again.status_code == 200, again.text


@pytest.mark.slow
def test_seeded_replies_to_long_prompts_are_the_same_alone_and_concurrent(tiny_dir):
    """A seed makes a sampled reply depend on the request alone, also when its prompt is longer than a forward
    (``--max-batch-tokens``): under a quantized policy each prompt is prefilled in pieces at fixed positions,
    whatever else runs (``kvcompile.scheduler``), and reads from shared pages (prefix sharing is on; the chat
    template makes the prompts begin alike) only what it would have computed itself: so six seeded requests with
    prompts of 60-odd tokens at 24 tokens a forward get the same replies one at a time and all at once, under a
    2-bit policy. (With transformers' own schedulers, which cut a prompt where the forward's room runs out, or
    with pages shared wherever they match, they differ: both checked.)"""
    import concurrent.futures

    proc, base = start_server("--model", tiny_dir, "--policy", "tok+rot:2", "--budget-mib", 4, "--max-requests", 6,
                              "--max-batch-tokens", 24)
    try:
        name = str(tiny_dir)
        words = "the quick brown fox jumps over a lazy dog while seven wise owls watch from an old oak".split()
        contents = [f"Story {i}: " + " ".join(words[(i + j) % len(words)] for j in range(45)) for i in range(6)]

        def reply(i):
            r = chat(base, name, content=contents[i], max_tokens=8, temperature=1.0, seed=1000 + i)
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["usage"]["prompt_tokens"] > 2 * 24, body["usage"]  # prefilled in pieces
            return body["choices"][0]["message"]["content"]

        alone = [reply(i) for i in range(6)]
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            together = list(pool.map(reply, range(6)))
        assert together == alone
        assert len(set(alone)) > 1  # replies that are not all one text, so a difference could be seen
    finally:
        stop_server(proc)


def test_concurrent_requests_each_get_their_own_options(tiny_server):
    """Each request's options travel in its own object (``sampling.RequestOptions``, in the server's table by request
    id): two requests running at once with different options -- one greedy with a logit bias that forces token 1234
    and 2 alternatives per token, one sampled with a seed, an extension field (``top_k``) and 4 alternatives --
    each get their own, streamed or not: the first all 1234, the second the same tokens as when it ran alone. The
    table holds both while they run and nothing once they are done or their clients have gone."""
    import concurrent.futures
    import contextlib

    from transformers import AutoTokenizer

    from kvcompile.serve import token_bytes

    base, name = tiny_server
    forced = list(token_bytes(AutoTokenizer.from_pretrained(name).backend_tokenizer, 1234))
    biased = {"logit_bias": {"1234": 100}, "logprobs": True, "top_logprobs": 2}
    seeded = {"temperature": 1.5, "seed": 99, "top_k": 40, "logprobs": True, "top_logprobs": 4}

    def entries(r) -> list:
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["logprobs"]["content"]

    def check(got: list, alone: list, fields: dict) -> None:
        """``got``: a reply's first tokens' entries (at least as many as ``alone``'s, its reply alone)."""
        got = got[:len(alone)]
        assert len(got) == len(alone) and all(len(e["top_logprobs"]) == fields["top_logprobs"] for e in got)
        if fields is biased:
            assert all(e["bytes"] == forced for e in got)
        else:  # seeded: its tokens depend on its seed alone (``seeded_draw``), not on what runs beside it
            assert [e["bytes"] for e in got] == [e["bytes"] for e in alone]

    alone = {id(f): entries(chat(base, name, content="Tell me a story", max_tokens=6, **f)) for f in (biased, seeded)}
    check(alone[id(biased)], alone[id(biased)], biased)
    assert [e["bytes"] for e in alone[id(seeded)]] != [forced] * 6  # the check below can fail
    # finished: both at once, not streamed
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        replies = [(f, pool.submit(chat, base, name, content="Tell me a story", max_tokens=6, **f))
                   for f in (biased, seeded)]
        for f, r in replies:
            check(entries(r.result()), alone[id(f)], f)
    idle = stats(base)
    assert idle["options_held"] == idle["records_open"] == 0 and idle["requests"] == 0, idle
    # running: both streamed at once, with no max_tokens (thousands of tokens: they run until their clients go)
    got, lines = {id(biased): [], id(seeded): []}, {}
    with httpx.Client(timeout=60) as client, contextlib.ExitStack() as open_:
        for f in (biased, seeded):
            body = {"model": name, "messages": [{"role": "user", "content": "Tell me a story"}], "stream": True, **f}
            r = open_.enter_context(client.stream("POST", f"{base}/v1/chat/completions", json=body))
            assert r.status_code == 200
            lines[id(f)] = r.iter_lines()  # kept until the end: httpx closes a stream whose iterator is dropped
        for key, it in lines.items():
            while len(got[key]) < 6:
                line = next(it)
                if line.startswith("data: {"):
                    got[key] += (json.loads(line[6:])["choices"][0].get("logprobs") or {}).get("content") or []
        held = stats(base)  # both still running
    del lines  # the clients have gone away (their streams closed)
    for f in (biased, seeded):
        check(got[id(f)], alone[id(f)], f)
    assert held["options_held"] == held["records_open"] == 2 and held["requests"] == 2, held
    wait_idle(base, idle, 30)
    now = stats(base)
    assert now["options_held"] == now["records_open"] == 0, now


@pytest.mark.parametrize("asks", slow_after(1, [{}, {"logprobs": True, "top_logprobs": 5}]))
def test_a_client_that_disconnects_mid_stream_frees_its_pages(tiny_server, asks):
    """A streaming client that disconnects mid-reply has its request cancelled: its pages and slot come back, and
    its record of log probabilities when it asked for them."""
    base, name = tiny_server
    assert chat(base, name).status_code == 200  # the manager and its cache exist from here on
    idle = stats(base)
    assert idle["max_batch_tokens"] == 128  # as the server was started
    assert idle["requests"] == 0 and idle["pages_held"] == 0 and idle["free_blocks"] == idle["blocks"]
    prompt = " ".join(f"word{i % 97}" for i in range(500))  # ~1000 tokens: blocks of the pool, not only the ring
    body = {"model": name, "messages": [{"role": "user", "content": prompt}], "stream": True, **asks}  # no max_tokens:
    # the reply may take what the cache holds (thousands of tokens, tens of seconds on this model)
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", f"{base}/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            chunks = 0
            for line in r.iter_lines():
                chunks += line.startswith("data: {")
                if chunks >= 6:
                    held = stats(base)  # while the stream is open (leaving the loop closes it: httpx)
                    break
        # the connection is closed here
    assert chunks >= 6
    assert held["requests"] == 1 and held["pages_held"] > 0 and held["free_blocks"] < held["blocks"], held
    assert held["records_open"] == (1 if asks else 0)
    t0, deadline = time.time(), time.time() + 30
    while True:  # transformers' handler cancels the request (its generator is closed), its cache comes back
        now = stats(base)
        if now["requests"] == 0 and now["pages_held"] == 0 and now["free_blocks"] == now["blocks"]:
            break
        assert time.time() < deadline, f"the disconnected request still holds cache after 30 s: {now}"
        time.sleep(0.1)
    # cancelled, not run to its end: the reply it was allowed (thousands of tokens) takes far longer than this
    assert time.time() - t0 < 10
    assert now["free_blocks"] == idle["free_blocks"] and now["active"] == now["waiting"] == 0
    assert now["records_open"] == 0
    r = chat(base, name, max_tokens=5)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5


def wait_idle(base, idle, bound_s):
    """Poll the stats until the cache is as ``idle`` (no request, no page, every block free; ``idle=None``: all of
    the pool's blocks): the seconds it took; fails past ``bound_s``."""
    t0 = time.time()
    while True:
        now = stats(base)
        free = now["blocks"] if idle is None else idle["free_blocks"]
        if (now["requests"] == 0 and now["pages_held"] == 0 and now["free_blocks"] == free
                and now["active"] == now["waiting"] == 0):
            return time.time() - t0
        assert time.time() - t0 < bound_s, f"the disconnected request still holds cache after {bound_s} s: {now}"
        time.sleep(0.1)


@pytest.mark.parametrize("endpoint", slow_after(1, ["chat", "completions"]))
def test_a_non_streaming_client_that_gives_up_has_its_request_cancelled(tiny_server, endpoint):
    """A non-streaming client that times out (its connection closed) has its request cancelled: its pages and
    slot come back long before the reply it was allowed would have been generated, and the server serves the
    next request."""
    import threading

    base, name = tiny_server
    assert chat(base, name).status_code == 200  # the manager and its cache exist from here on
    idle = stats(base)
    assert idle["requests"] == 0 and idle["pages_held"] == 0 and idle["free_blocks"] == idle["blocks"]
    prompt = " ".join(f"word{i % 97}" for i in range(500))  # ~1500 tokens: blocks of the pool, not only the ring
    # a reply of 2400 tokens (the cache holds 4096 for one request): ~25 s on this model, tens of ms a token
    if endpoint == "chat":
        url, body = f"{base}/v1/chat/completions", {"model": name, "messages": [{"role": "user", "content": prompt}],
                                                     "max_tokens": 2400}
    else:
        url, body = f"{base}/v1/completions", {"model": name, "prompt": prompt, "max_tokens": 2400}
    outcome = {}

    def client():
        try:
            with httpx.Client(timeout=httpx.Timeout(1.5, connect=10)) as c:
                outcome["response"] = c.post(url, json=body)
        except httpx.TimeoutException as e:
            outcome["timeout"] = e
        outcome["closed"] = time.time()  # the client and its connection are closed here

    t = threading.Thread(target=client, daemon=True)
    t.start()
    deadline, held = time.time() + 30, None
    while held is None and t.is_alive():  # the request generating, before the client gives up
        s = stats(base)
        if s["requests"] == 1 and s["pages_held"] > 0 and s["free_blocks"] < s["blocks"]:
            held = s
        assert time.time() < deadline
        time.sleep(0.05)
    t.join(timeout=60)
    assert not t.is_alive()
    assert "timeout" in outcome, outcome  # the reply was far from done after 1.5 s
    assert held is not None, "the request never held cache while its client waited"
    # cancelled, not run to its end: the 2400 tokens take far longer than this (before the server watched
    # non-streaming clients, such a request held its pages until its reply was done, nobody reading it)
    wait_idle(base, idle, 5)
    assert time.time() - outcome["closed"] < 5
    assert stats(base)["disconnected"] == idle["disconnected"] + 1  # by the server's disconnect watch
    r = chat(base, name, max_tokens=5)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
    assert wait_idle(base, idle, 10) < 10


GOOD = [{"role": "user", "content": "Hi"}]
BAD_CHAT = {  # what is wrong -> (body, the field the error names)
    "messages not a list": ({"messages": "notalist"}, "messages"),
    "messages empty": ({"messages": []}, "messages"),
    "message not an object": ({"messages": ["Hi"]}, "messages[0]"),
    "unknown role": ({"messages": [{"role": "wizard", "content": "Hi"}]}, "messages[0].role"),
    "no role": ({"messages": [{"content": "Hi"}]}, "messages[0].role"),
    "content a number": ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    "content part without type": ({"messages": [{"role": "user", "content": [{"text": "Hi"}]}]},
                                  "messages[0].content"),
    "content part an image": ({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://127.0.0.1/x.png"}}]}]}, "messages[0].content"),
    "model missing": ({"model": None}, "model"),
    "model not a string": ({"model": 3}, "model"),
    "max_tokens negative": ({"max_tokens": -3}, "max_tokens"),
    "max_tokens zero": ({"max_tokens": 0}, "max_tokens"),
    "max_tokens not an integer": ({"max_tokens": 2.5}, "max_tokens"),
    "max_tokens a string": ({"max_tokens": "ten"}, "max_tokens"),
    "max_completion_tokens negative": ({"max_completion_tokens": -1}, "max_completion_tokens"),
    "temperature a string": ({"temperature": "hot"}, "temperature"),
    "temperature out of range": ({"temperature": 7}, "temperature"),
    "top_p a list": ({"top_p": [1]}, "top_p"),
    "stream a string": ({"stream": "yes", "max_tokens": 4}, "stream"),
    "stop a number": ({"stop": 3}, "stop"),
    "prompt longer than the cache": ({"messages": [{"role": "user", "content": "hello " * 6000}]}, "messages"),
    "prompt longer than the cache, streaming": (
        {"messages": [{"role": "user", "content": "hello " * 6000}], "stream": True}, "messages"),
    "max_tokens beyond the cache": ({"max_tokens": 100000}, "max_tokens"),
}


def assert_openai_error(r, param=None):
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    assert "Traceback" not in r.text and 'File "' not in r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error", err
    assert isinstance(err["message"], str) and len(err["message"]) > 10
    if param is not None:
        assert err["param"] == param, err
    return err


@pytest.mark.slow
def test_bad_input_is_a_4xx_in_openais_shape_and_the_server_stays_up(tiny_server):
    from openai import BadRequestError, OpenAI

    base, name = tiny_server
    url = f"{base}/v1/chat/completions"
    for what, (fields, param) in BAD_CHAT.items():
        body = {"model": name, "messages": GOOD, "max_tokens": 4, **fields}
        body = {k: v for k, v in body.items() if v is not None}
        err = assert_openai_error(httpx.post(url, json=body, timeout=60), param)
        if "cache" in what:
            assert err["code"] == "context_length_exceeded" and "exceeds" in err["message"], err
            assert str(stats(base)["token_limit"]) in err["message"]
    for raw in (b'{"model": "x", "messages": [', b"[1, 2]", b"not json"):  # not JSON, not an object
        assert_openai_error(httpx.post(url, content=raw, headers={"Content-Type": "application/json"}, timeout=30))
    assert_openai_error(httpx.post(url, json={"model": "no/such-model", "messages": GOOD}, timeout=30))
    # the completions endpoint: its prompt must be a non-empty string or list of token ids, or a list of them
    for prompt in ([1, -2, 3], [1.5], [[]], {"a": 1}, None, "", 7, [True]):
        assert_openai_error(httpx.post(f"{base}/v1/completions", timeout=30,
                                       json={"model": name, "prompt": prompt, "max_tokens": 4}), "prompt")
    # the openai client sees the message
    client = OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=60, max_retries=0)
    with pytest.raises(BadRequestError, match="exceeds"):
        client.completions.create(model=name, prompt="hello " * 6000, max_tokens=4)
    # ... and the server is up and serving, its cache whole
    r = chat(base, name, max_tokens=6)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6
    out = client.completions.create(model=name, prompt="The capital of France is", max_tokens=3)
    assert out.usage.completion_tokens == 3
    s = stats(base)
    assert s["requests"] == 0 and s["pages_held"] == 0 and s["free_blocks"] == s["blocks"]
    assert httpx.get(f"{base}/health", timeout=10).json() == {"status": "ok"}


# Fields a client can send that the server once answered with a 500 (or worse), found by fuzzing every field
# with every kind of value: endpoint -> [(fields, the field the 400 names)]
FOUND = {
    "chat/completions": [
        ({"seed": 2**64}, "seed"), ({"seed": -2**63 - 1}, "seed"),  # torch.manual_seed's ValueError
        ({"seed": 2**64, "stream": True}, "seed"),
        ({"best_of": 10**30}, "best_of"),  # a completions field: 10**30 requests built in memory (18 GB), no answer
        ({"modalities": [[]]}, "modalities"),  # unhashable: TypeError
        ({"generation_config": '{"top_k": 3}'}, "generation_config"),  # silently not applied
        ({"generation_config": "[1]"}, "generation_config"),
        ({"parallel_tool_calls": "x"}, "parallel_tool_calls"),
    ],
    "completions": [({"seed": 2**64}, "seed"), ({"seed": 2**64, "stream": True}, "seed")],
    "responses": [
        ({"input": [{}]}, "input"),  # KeyError
        ({"input": [{"role": "user", "content": "Hi"}, {"type": "function_call"}]}, "input"),
        ({"text": 1}, "text"), ({"tools": 0}, "tools"),  # AttributeError, TypeError
        ({"parallel_tool_calls": 1}, "parallel_tool_calls"),  # pydantic's ValidationError
    ],
}
FINE = {  # and those it now serves
    "chat/completions": [{"top_k": 2**64, "temperature": 1.0}, {"chat_template_kwargs": None},  # top_k: the engine died
                         {"seed": 2**63 - 1, "n": 2, "temperature": 1.0}, {"seed": -2**63, "temperature": 1.0}],
    "completions": [{"prompt": ["The capital of France is"]}],  # a list of one string: TypeError
    "responses": [{"parallel_tool_calls": False}],
}


def test_every_field_that_cannot_be_honoured_is_a_4xx_naming_it(tiny_server):
    """Each field that once reached a 500 (or stopped the engine for every later request) is a 400 naming it, or
    served; the real openai client sees the 400; transformers' /reset (which unloaded the served model) is gone;
    and the server serves as before."""
    from openai import BadRequestError, OpenAI

    base, name = tiny_server
    good = {"chat/completions": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
            "completions": {"prompt": "Hi", "max_tokens": 2}, "responses": {"input": "Hi", "max_output_tokens": 2}}
    for endpoint, cases in FOUND.items():
        for fields, param in cases:
            r = httpx.post(f"{base}/v1/{endpoint}", timeout=60, json={"model": name, **good[endpoint], **fields})
            assert r.status_code == 400, (endpoint, fields, r.status_code, r.text)
            assert_openai_error(r, param)
    for endpoint, cases in FINE.items():
        for fields in cases:
            r = httpx.post(f"{base}/v1/{endpoint}", timeout=120, json={"model": name, **good[endpoint], **fields})
            assert r.status_code == 200, (endpoint, fields, r.text)
    client = OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=60, max_retries=0)
    with pytest.raises(BadRequestError, match="'seed' must be an integer from"):
        client.chat.completions.create(model=name, messages=good["chat/completions"]["messages"], max_tokens=2,
                                       seed=2**64)
    with pytest.raises(BadRequestError, match="'seed' must be an integer from"):
        list(client.completions.create(model=name, prompt="Hi", max_tokens=2, seed=2**64, stream=True))
    assert httpx.post(f"{base}/reset", timeout=30).status_code == 404
    assert chat(base, name, max_tokens=3).json()["usage"]["completion_tokens"] == 3


@pytest.mark.slow
def test_a_reply_without_max_tokens_is_capped_to_what_the_cache_holds(tiny_server):
    base, name = tiny_server
    assert chat(base, name).status_code == 200  # the cache exists from here on
    limit = stats(base)["token_limit"]
    r = httpx.post(f"{base}/v1/completions", timeout=120,  # ~limit - 200 tokens: " hello" is one token
                   json={"model": name, "prompt": " hello" * (limit - 200)})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert limit - 1024 < usage["prompt_tokens"] < limit  # transformers' default reply (1024 tokens) would not fit
    assert 0 < usage["completion_tokens"] <= limit - usage["prompt_tokens"]


# --------------------------------------------------------------------------- sampling and fields, per request
def reply(base, name, **kw) -> str:
    r = chat(base, name, content="Tell me a story", max_tokens=8, **kw)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


@pytest.mark.slow
def test_each_request_samples_as_it_asks(tiny_server):
    """transformers' continuous batching applies the first request's sampling to every request after it (a
    temperature asked later was dropped; a greedy request after a sampled first one sampled). Here each request
    decodes as it asks: greedy replies equal each other before and after sampled ones, streaming or not, and
    sampled replies at a high temperature differ from each other."""
    base, name = tiny_server
    greedy = reply(base, name)
    sampled = {reply(base, name, temperature=2.0) for _ in range(4)} | {reply(base, name, top_p=0.99)}
    assert len(sampled) >= 3, sampled
    assert reply(base, name, temperature=2.0, top_k=1) == greedy  # top_k (an extension): one token left
    assert len({reply(base, name, temperature=2.0, top_k=50) for _ in range(3)}) >= 2
    assert reply(base, name, temperature=0) == greedy
    assert reply(base, name) == greedy
    r = chat(base, name, content="Tell me a story", max_tokens=8, stream=True)
    streamed = "".join(json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                       for line in r.text.splitlines() if line.startswith("data: {"))
    assert streamed == greedy
    r = httpx.post(f"{base}/v1/completions", timeout=120, json={"model": name, "prompt": "Once", "max_tokens": 6})
    r2 = httpx.post(f"{base}/v1/completions", timeout=120, json={"model": name, "prompt": "Once", "max_tokens": 6,
                                                                  "temperature": 0.0})
    assert r.status_code == r2.status_code == 200 and r.json()["choices"][0]["text"] == r2.json()["choices"][0]["text"]


TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}}
UNSUPPORTED = {  # field: (value asking for what the server does not do, the endpoint)
    "n": (17, "chat/completions"), "response_format": ({"type": "xml"}, "chat/completions"),
    # transformers' handlers logged these as ignored and answered as if they had not been asked
    "tool_choice": ("required", "chat/completions"),
    "functions": ([TOOL["function"]], "chat/completions"), "function_call": ({"name": "f"}, "chat/completions"),
    "modalities": (["text", "audio"], "chat/completions"), "audio": ({"voice": "alloy", "format": "wav"},
                                                                     "chat/completions"),
    "web_search_options": ({}, "chat/completions"),
    "suffix": ("!", "completions"),  # transformers' handler appended it to the reply, unseen by the model
}


@pytest.mark.parametrize("field", sorted(UNSUPPORTED))
def test_a_field_the_server_would_ignore_is_refused(tiny_server, field):
    """A field that asks for what continuous batching does not do (transformers' handlers dropped it, or applied
    it to every later request) is a 400 naming it; its neutral value (OpenAI's default) is served."""
    base, name = tiny_server
    value, endpoint = UNSUPPORTED[field]
    body = {"model": name, "max_tokens": 3}
    body.update({"messages": [{"role": "user", "content": "Hi"}]} if endpoint.startswith("chat") else
                {"prompt": "Hi"})
    r = httpx.post(f"{base}/v1/{endpoint}", timeout=120, json={**body, field: value})
    err = assert_openai_error(r, field)
    assert "not supported" in err["message"]
    neutral = {"n": 1, "response_format": {"type": "text"}, "echo": False, "tool_choice": "auto",
               "functions": [], "function_call": "none", "modalities": ["text"], "audio": None, "suffix": ""}
    if field in neutral:
        r = httpx.post(f"{base}/v1/{endpoint}", timeout=120, json={**body, field: neutral[field]})
        assert r.status_code == 200, r.text


def test_tools_a_chat_template_never_shows_are_refused(tiny_server):
    """SmolLM2's chat template renders the same prompt with tools as without (the model never sees them):
    transformers' server answered as if they had been offered. Here they are a 400 naming them, chat and
    Responses API, unless the request says the reply calls none (``tool_choice: "none"``)."""
    base, name = tiny_server
    r = chat(base, name, tools=[TOOL])
    assert "never sees them" in assert_openai_error(r, "tools")["message"]
    r = httpx.post(f"{base}/v1/responses", timeout=60, json={"model": name, "input": "Hi", "max_output_tokens": 3,
                                                              "tools": [{"type": "function", "name": "get_weather",
                                                                         "parameters": {"type": "object"}}]})
    assert_openai_error(r, "tools")
    assert chat(base, name, tools=[TOOL], tool_choice="none").status_code == 200


def test_whether_a_chat_template_shows_tools(tiny_dir):
    """The check behind the refusal above: SmolLM2's template does not show tools; one that writes them into
    the prompt does; one that fails on them does not take them."""
    from transformers import AutoTokenizer

    from kvcompile.serve import template_shows_tools

    assert not template_shows_tools(AutoTokenizer.from_pretrained(tiny_dir))
    shows = AutoTokenizer.from_pretrained(tiny_dir)
    shows.chat_template = ("{% if tools %}Tools: {{ tools | tojson }}\n{% endif %}"
                           "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")
    assert template_shows_tools(shows)
    fails = AutoTokenizer.from_pretrained(tiny_dir)
    fails.chat_template = "{% if tools %}{{ raise_exception('no tools') }}{% endif %}{{ messages[0].content }}"
    assert not template_shows_tools(fails)


def test_a_greedy_reply_is_the_models_own(tiny_server):
    """The server's greedy decoding (a one-hot in a sampling batch) picks the tokens the unmodified model's
    ``generate`` picks: the prompt and reply fit KIVI's full-precision window, so the cache changes nothing."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base, name = tiny_server
    tok = AutoTokenizer.from_pretrained(name)
    model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32).eval()
    for prompt in ("Once upon a time", "The capital of France is"):
        ids = tok(prompt, return_tensors="pt").input_ids
        want = model.generate(ids, max_new_tokens=10, do_sample=False)[0, ids.shape[1]:]
        r = httpx.post(f"{base}/v1/completions", timeout=120, json={"model": name, "prompt": prompt, "max_tokens": 10,
                                                                    "temperature": 0.9})  # one sampled beside it
        assert r.status_code == 200
        r = httpx.post(f"{base}/v1/completions", timeout=120, json={"model": name, "prompt": prompt, "max_tokens": 10})
        assert r.json()["choices"][0]["text"] == tok.decode(want, skip_special_tokens=True)


def streamed_text(r) -> tuple[str, str | None]:
    """The text of a streamed chat or completion reply and its finish reason."""
    text, reason = "", None
    for line in r.text.splitlines():
        if line.startswith("data: {"):
            c = json.loads(line[6:])["choices"][0]
            text += (c.get("delta") or {}).get("content") or c.get("text") or ""
            reason = c.get("finish_reason") or reason
    return text, reason


@pytest.mark.parametrize("endpoint", slow_after(1, ["chat/completions", "completions"]))
def test_a_reply_ends_at_its_first_stop_string(tiny_server, endpoint):
    """``stop`` ends a reply before the first stop string (not sent), streaming or not, finish_reason "stop", and
    the request gives its pages back; a stop string that never appears, or an empty list, changes nothing."""
    base, name = tiny_server
    body = {"model": name, "max_tokens": 16}
    body.update({"messages": [{"role": "user", "content": "Tell me a story"}]} if endpoint.startswith("chat")
                else {"prompt": "Once upon a time"})

    def ask(**kw):
        r = httpx.post(f"{base}/v1/{endpoint}", timeout=120, json={**body, **kw})
        assert r.status_code == 200, r.text
        if kw.get("stream"):
            return streamed_text(r)
        c = r.json()["choices"][0]
        return (c["message"]["content"] if "message" in c else c["text"]), c["finish_reason"]

    whole, reason = ask()
    assert reason == "length" and len(whole) > 8, whole
    stop = next(whole[i:i + 2] for i in range(len(whole) // 2, len(whole) - 1) if whole[i:i + 2].strip())
    cut = whole.find(stop)
    assert ask(stop=stop) == (whole[:cut], "stop")
    assert ask(stop=["never appears in it", stop], stream=True) == (whole[:cut], "stop")
    assert ask(stop="never appears in it") == (whole, "length")
    assert ask(stop=[]) == ask(stop=[], stream=True) == (whole, "length")  # an empty list: no stop string
    wait_idle(base, None, 30)


@pytest.mark.parametrize("endpoint", slow_after(1, ["chat/completions", "completions"]))
def test_n_choices(tiny_server, endpoint):
    """``n`` choices, each a request of its own in the batch: sampled ones differ, greedy ones equal the one-choice
    reply, streamed or not; usage counts every choice's tokens and the prompt once."""
    base, name = tiny_server
    body = {"model": name, "max_tokens": 6}
    body.update({"messages": [{"role": "user", "content": "Tell me a story"}]} if endpoint.startswith("chat")
                else {"prompt": "Once upon a time"})

    def texts(r):
        assert r.status_code == 200, r.text
        out = r.json()
        assert [c["index"] for c in out["choices"]] == list(range(len(out["choices"])))
        return [c["message"]["content"] if "message" in c else c["text"] for c in out["choices"]], out["usage"]

    one, u1 = texts(httpx.post(f"{base}/v1/{endpoint}", timeout=120, json=body))
    greedy, u = texts(httpx.post(f"{base}/v1/{endpoint}", timeout=120, json={**body, "n": 2}))
    assert greedy == one * 2
    assert u["prompt_tokens"] == u1["prompt_tokens"] and u["completion_tokens"] == 2 * u1["completion_tokens"]
    sampled, _ = texts(httpx.post(f"{base}/v1/{endpoint}", timeout=120, json={**body, "n": 4, "temperature": 2.0}))
    assert len(sampled) == 4 and len(set(sampled)) >= 3, sampled
    r = httpx.post(f"{base}/v1/{endpoint}", timeout=120, json={**body, "n": 3, "stream": True})
    assert r.status_code == 200, r.text
    parts = {}
    for line in r.text.splitlines():
        if line.startswith("data: {"):
            for c in json.loads(line[6:])["choices"]:
                parts.setdefault(c["index"], []).append((c.get("delta") or {}).get("content") or c.get("text") or "")
    assert {i: "".join(p) for i, p in parts.items()} == {0: one[0], 1: one[0], 2: one[0]}
    wait_idle(base, None, 30)


@pytest.mark.slow
def test_best_of_returns_the_candidates_with_the_most_likely_tokens(tiny_server):
    """A completion's ``best_of``: that many candidates per prompt (sampled, seeded), of which the ``n`` with the
    highest mean log probability per generated token are the choices, best first -- the same candidates asked
    for one by one (seed, seed + 1, ...) and ranked here by their own log probabilities; usage counts every
    candidate's tokens; log probabilities only where asked. Streaming it, or fewer candidates than n, is a 400."""
    base, name = tiny_server
    body = {"model": name, "prompt": "Once upon a time", "max_tokens": 5, "temperature": 1.5, "seed": 11}

    def post(**kw):
        r = httpx.post(f"{base}/v1/completions", timeout=120, json={**body, **kw})
        assert r.status_code == 200, r.text
        return r.json()

    cands = [post(seed=11 + i, logprobs=0) for i in range(4)]
    scores = [sum(c["choices"][0]["logprobs"]["token_logprobs"]) / c["usage"]["completion_tokens"] for c in cands]
    assert len(set(scores)) == 4  # the candidates differ, so the ranking is a real choice
    order = sorted(range(4), key=lambda i: -scores[i])
    out = post(best_of=4, n=2)
    assert [c["text"] for c in out["choices"]] == [cands[i]["choices"][0]["text"] for i in order[:2]]
    assert [c["index"] for c in out["choices"]] == [0, 1] and all(c.get("logprobs") is None for c in out["choices"])
    assert out["usage"]["completion_tokens"] == sum(c["usage"]["completion_tokens"] for c in cands)
    assert out["usage"]["prompt_tokens"] == cands[0]["usage"]["prompt_tokens"]
    one = post(best_of=4, logprobs=1)
    assert [c["text"] for c in one["choices"]] == [cands[order[0]]["choices"][0]["text"]]
    assert len(one["choices"][0]["logprobs"]["top_logprobs"][0]) >= 1  # asked: given
    two = post(best_of=2, prompt=["Once upon a time", "Hello"])  # per prompt, in prompt order
    assert len(two["choices"]) == 2 and two["choices"][0]["text"] in [c["choices"][0]["text"] for c in cands[:2]]
    for bad in ({"best_of": 2, "stream": True}, {"best_of": 1, "n": 2}, {"best_of": 0}, {"best_of": 17}):
        r = httpx.post(f"{base}/v1/completions", timeout=60, json={**body, **bad})
        assert_openai_error(r, "best_of")
    wait_idle(base, None, 30)


def test_a_client_that_disconnects_from_n_streamed_choices_frees_them_all(tiny_server):
    base, name = tiny_server
    assert chat(base, name).status_code == 200
    idle = stats(base)
    body = {"model": name, "messages": [{"role": "user", "content": "Tell me a long story"}], "stream": True,
            "n": 3, "temperature": 1.0}  # no max_tokens: thousands of tokens each
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", f"{base}/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            seen = set()
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    seen |= {c["index"] for c in json.loads(line[6:])["choices"]}
                if len(seen) == 3:
                    held = stats(base)
                    break
    assert seen == {0, 1, 2} and held["requests"] == 3, held
    # every choice cancelled, none run to its end: run to the end, the three take about 70 s on this machine
    # unloaded (and longer beside other jobs); cancelled, their pages are back within seconds (11.6 s once,
    # under a full suite's load)
    wait_idle(base, idle, 30)


@pytest.mark.slow
def test_a_seed_gives_the_same_reply_whatever_runs_beside_it(tiny_server):
    """A seeded request's reply depends on its seed alone (``seeded_draw``): the same seed twice, once alone and
    once while other sampled requests stream beside it, gives the same reply; n seeded choices differ from each
    other and come back the same."""
    import concurrent.futures

    base, name = tiny_server
    first = reply(base, name, temperature=1.5, seed=1234)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        noise = [pool.submit(reply, base, name, temperature=1.5) for _ in range(3)]
        again = pool.submit(reply, base, name, temperature=1.5, seed=1234)
        assert again.result() == first
        [f.result() for f in noise]
    assert reply(base, name, temperature=1.5, seed=4321) != first

    def choices():
        r = chat(base, name, content="Tell me a story", max_tokens=8, temperature=1.5, seed=7, n=3)
        assert r.status_code == 200, r.text
        return [c["message"]["content"] for c in r.json()["choices"]]

    three = choices()
    assert len(set(three)) == 3 and choices() == three


@pytest.mark.slow
def test_a_shared_system_prompt_is_read_from_shared_pages(tiny_dir):
    """Chats that begin with the same system prompt read its pages from the first chat's instead of computing
    them (``prefix_tokens`` in the stats); under the full-precision store a chat asked again, most of it read
    from shared pages, gets exactly its first greedy reply. Finished chats' pages stay cached and count as
    free. (Quantized pages shared: tests/test_serving.py.)"""
    proc, base = start_server("--model", tiny_dir, "--policy", "full", "--budget-mib", 2, "--max-requests", 4)
    try:
        name = str(tiny_dir)
        system = "You answer in rhymes. " + " ".join(f"rule{k} w{(3 * k) % 40}" for k in range(120))

        def ask(user):
            r = httpx.post(f"{base}/v1/chat/completions", timeout=120,
                           json={"model": name, "max_tokens": 8, "temperature": 0,
                                 "messages": [{"role": "system", "content": system},
                                              {"role": "user", "content": user}]})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["message"]["content"], r.json()["usage"]["prompt_tokens"]

        first, n = ask("Tell me about the sea.")
        assert n > 2 * 64 and stats(base)["prefix_sharing"] is True and stats(base)["prefix_tokens"] == 0
        other, _ = ask("Tell me about the hills.")
        reused = stats(base)["prefix_tokens"]
        assert reused >= 2 * 64  # the system prompt's whole pages
        again, _ = ask("Tell me about the sea.")
        assert again == first
        assert stats(base)["prefix_tokens"] - reused >= (n - 1) // 64 * 64  # every whole page of the prompt
        s = stats(base)
        assert s["pages_cached"] > 0 and s["free_blocks"] == s["blocks"] and s["requests"] == 0
        # a prompt whose log probabilities are asked (echo) is computed whole, never read from shared pages
        score = {"model": name, "prompt": system, "max_tokens": 1, "logprobs": 0, "echo": True}
        before = stats(base)["prefix_tokens"]
        scored = [httpx.post(f"{base}/v1/completions", timeout=120, json=score).json() for _ in range(2)]
        assert stats(base)["prefix_tokens"] == before
        assert scored[0]["choices"][0]["logprobs"] == scored[1]["choices"][0]["logprobs"]
        assert None not in scored[0]["choices"][0]["logprobs"]["token_logprobs"][1:]
    finally:
        stop_server(proc)


@pytest.mark.slow
def test_a_sliding_window_model_is_served(tiny_dir, tmp_path):
    """A Gemma 3 (two of three layers over a 32-token window) served under KIVI 4-bit: a greedy chat's reply is
    kvcompile's own generate of the same prompt under the policy (the full-attention layer quantized in the
    pages, the sliding layers' windows in the slots' rings, as transformers keeps them), and the cache is all
    back afterwards."""
    import transformers

    from kvcompile.api import apply
    from kvcompile.evaluate import scheme_policy

    tok = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    torch.manual_seed(0)
    cfg = transformers.Gemma3TextConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=4096, sliding_window=32,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    transformers.Gemma3ForCausalLM(cfg).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    proc, base = start_server("--model", tmp_path, "--policy", "kivi:4", "--budget-mib", 2, "--max-requests", 4)
    try:
        content = "Tell me about the sea and the hills, " * 8  # longer than the window
        r = chat(base, str(tmp_path), content, max_tokens=16, temperature=0)
        assert r.status_code == 200, r.text
        reply = r.json()
        s = stats(base)
        assert s["cache"] == "PagedKVCompileCache" and s["requests"] == 0 and s["free_blocks"] == s["blocks"]
    finally:
        stop_server(proc)
    model = apply(transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa").eval(),
                  scheme_policy("kivi", 4))  # what --policy kivi:4 serves
    ids = tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    assert ids.shape[1] > 32 and reply["usage"]["prompt_tokens"] == ids.shape[1]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=16, do_sample=False)
    want = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert reply["choices"][0]["message"]["content"] == want


@pytest.mark.slow
def test_the_server_shares_pages_only_where_the_policy_allows(tiny_dir, monkeypatch):
    """``kvcompile serve`` turns transformers' prefix sharing on for a window-free policy, off for KIVI (whose
    window lives outside the pages) and off with ``--no-prefix-sharing``; the CLI passes the flag on."""
    from kvcompile import Policy, cli
    from kvcompile.openai_server import build_app

    for policy, share, want in ((Policy.full(), True, True), (Policy.int8(), False, False),
                                (Policy.kivi(4), True, False)):
        app, manager, state = build_app(str(tiny_dir), policy, prefix_sharing=share)
        try:
            assert app.state.prefix_sharing is want, (policy, share)
        finally:
            state.shutdown()
            manager.shutdown()
    seen = {}
    monkeypatch.setattr("kvcompile.openai_server.run", lambda *a, **kw: seen.update(kw))
    assert cli.main(["serve", "--model", str(tiny_dir), "--no-prefix-sharing"]) == 0
    assert seen["prefix_sharing"] is False
    assert cli.main(["serve", "--model", str(tiny_dir)]) == 0 and seen["prefix_sharing"] is True


# --------------------------------------------------------------------------- log probabilities
def streamed_logprobs(r) -> list:
    """The ``logprobs`` of every chunk of a streamed reply (chat: their ``content`` entries; completions: the
    objects), in order."""
    out = []
    for line in r.text.splitlines():
        if line.startswith("data: {"):
            lp = json.loads(line[6:])["choices"][0].get("logprobs")
            if lp is not None:
                out += lp["content"] if "content" in lp else [lp]
    return out


def test_log_probabilities_are_the_models_own(tiny_server):
    """A greedy completion with ``logprobs: 3``: each token's log probability is the unmodified model's
    log-softmax at that step (prompt and reply fit KIVI's full-precision window: the cache changes nothing), its
    alternatives the model's three most likely tokens with the chosen one among them, the text offsets add up
    the tokens; streamed, the chunks carry the same entries, offsets counted on across chunks."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvcompile.serve import token_bytes

    base, name = tiny_server
    tok = AutoTokenizer.from_pretrained(name)
    rust = tok.backend_tokenizer
    model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32).eval()
    prompt, new = "The capital of France is", 8
    ids = tok(prompt, return_tensors="pt").input_ids
    ref = model.generate(ids, max_new_tokens=new, do_sample=False, output_logits=True, return_dict_in_generate=True)
    want = ref.sequences[0, ids.shape[1]:].tolist()
    logp = [torch.log_softmax(x[0].float(), -1) for x in ref.logits]

    def text(i):
        return token_bytes(rust, i).decode("utf-8", errors="replace")

    body = {"model": name, "prompt": prompt, "max_tokens": new, "logprobs": 3}
    r = httpx.post(f"{base}/v1/completions", timeout=120, json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    assert lp["tokens"] == [text(i) for i in want] and r.json()["usage"]["completion_tokens"] == new
    assert lp["token_logprobs"] == pytest.approx([float(logp[k][i]) for k, i in enumerate(want)], abs=1e-4)
    for k, i in enumerate(want):
        top = logp[k].topk(3)
        alternatives = {text(j): float(v) for j, v in zip(top.indices.tolist(), top.values)}
        alternatives[text(i)] = float(logp[k][i])
        assert lp["top_logprobs"][k] == pytest.approx(alternatives, abs=1e-4)
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:k]) for k in range(new)]
    assert "".join(lp["tokens"]) == choice["text"]  # byte-level tokens of ASCII text: the reply's text, token by token

    r = httpx.post(f"{base}/v1/completions", timeout=120, json={**body, "stream": True})
    assert r.status_code == 200
    pieces = streamed_logprobs(r)
    assert len(pieces) > 1  # more than one chunk carried entries
    assert sum((p["tokens"] for p in pieces), []) == lp["tokens"]
    assert sum((p["text_offset"] for p in pieces), []) == lp["text_offset"]
    assert sum((p["token_logprobs"] for p in pieces), []) == pytest.approx(lp["token_logprobs"], abs=1e-4)
    assert stats(base)["records_open"] == 0


def test_chat_log_probabilities_through_the_openai_client(tiny_server):
    """``logprobs=True, top_logprobs=2`` through the ``openai`` client, as it parses them: one entry per generated
    token, the greedy choice the most likely one, the bytes those of the token's text; streamed, the same
    entries; ``n`` sampled choices each with their own; a reply cut at a stop string, streamed and not; no
    log probabilities without ``logprobs``; nothing left recorded afterwards."""
    import openai

    base, name = tiny_server
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120)
    ask = {"model": name, "messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 6}
    r = client.chat.completions.create(**ask, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 6
    for t in content:
        assert [a.logprob for a in t.top_logprobs] == sorted((a.logprob for a in t.top_logprobs), reverse=True)
        assert len(t.top_logprobs) == 2 and t.token == t.top_logprobs[0].token
        assert t.logprob == pytest.approx(t.top_logprobs[0].logprob) and t.logprob <= 0
        assert bytes(t.bytes).decode("utf-8", errors="replace") == t.token

    got = [t for chunk in client.chat.completions.create(**ask, logprobs=True, top_logprobs=2, stream=True)
           for c in chunk.choices if c.logprobs is not None for t in c.logprobs.content]
    assert [t.token for t in got] == [t.token for t in content]
    assert [t.logprob for t in got] == pytest.approx([t.logprob for t in content], abs=1e-4)

    r = client.chat.completions.create(**ask, logprobs=True, temperature=1.0, seed=5, n=2)
    assert [len(c.logprobs.content) for c in r.choices] == [6, 6] and r.usage.completion_tokens == 12
    assert all(t.top_logprobs == [] and t.logprob <= 0 for c in r.choices for t in c.logprobs.content)

    assert client.chat.completions.create(**ask).choices[0].logprobs is None

    # a stop string the greedy reply first meets at its token k (k >= 2): the reply is cut there
    texts = [t.token for t in content]
    k = next(k for k in range(2, 6)
             if texts[k].strip() and "".join(texts[:k + 1]).find(texts[k]) == len("".join(texts[:k])))
    r = client.chat.completions.create(**ask, logprobs=True, stop=[texts[k]])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content == "".join(texts[:k])
    assert len(r.choices[0].logprobs.content) == r.usage.completion_tokens >= k + 1
    got = [t for chunk in client.chat.completions.create(**ask, logprobs=True, stop=[texts[k]], stream=True)
           for c in chunk.choices if c.logprobs is not None for t in c.logprobs.content]
    assert [t.token for t in got[:k]] == texts[:k]  # the tokens of the text sent (the stop string's is not)
    assert stats(base)["records_open"] == 0


@pytest.mark.parametrize("endpoint, fields, param", [
    ("chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat/completions", {"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
    ("chat/completions", {"logprobs": "yes"}, "logprobs"),
    ("chat/completions", {"logprobs": 1}, "logprobs"),  # a number is the completions' spelling
    ("completions", {"logprobs": True}, "logprobs"),
    ("completions", {"logprobs": 21}, "logprobs"),
    ("completions", {"logprobs": -1}, "logprobs"),
    ("completions", {"top_logprobs": 2}, "top_logprobs"),
])
def test_bad_log_probability_fields_are_a_400(tiny_server, endpoint, fields, param):
    base, name = tiny_server
    body = {"model": name, "max_tokens": 3, **fields}
    body.update({"messages": [{"role": "user", "content": "Hi"}]} if endpoint.startswith("chat") else
                {"prompt": "Hi"})
    assert_openai_error(httpx.post(f"{base}/v1/{endpoint}", timeout=120, json=body), param)


@pytest.mark.slow
def test_penalties_and_a_logit_bias_as_openai_applies_them(tiny_server):
    """Greedy completions with ``frequency_penalty``, ``presence_penalty`` and ``logit_bias`` give the
    unmodified model's greedy tokens under OpenAI's formula (``logit + bias - frequency * count - presence *
    (count > 0)`` over the reply so far, computed here step by step), each a different reply from the plain
    greedy one; the log probabilities they report stay the model's own. Out-of-range values are a 400."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvcompile.serve import token_bytes

    base, name = tiny_server
    tok = AutoTokenizer.from_pretrained(name)
    model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32).eval()
    prompt, new = "Once upon a time", 8
    ids = tok(prompt, return_tensors="pt").input_ids

    def greedy(frequency=0.0, presence=0.0, bias=None):
        out, lps = [], []
        with torch.no_grad():
            for _ in range(new):
                logits = model(torch.cat([ids, torch.tensor([out], dtype=torch.long)], 1)).logits[0, -1].float()
                lps.append(torch.log_softmax(logits, -1))
                logits = logits.clone()
                for t, v in (bias or {}).items():
                    logits[t] += v
                for t in set(out):
                    logits[t] -= frequency * out.count(t) + presence
                out.append(int(logits.argmax()))
        return out, [float(lp[t]) for lp, t in zip(lps, out)]

    plain, _ = greedy()
    asks = [({"frequency_penalty": 1.5}, dict(frequency=1.5)), ({"presence_penalty": 2.0}, dict(presence=2.0)),
            ({"logit_bias": {str(plain[0]): -100}}, dict(bias={plain[0]: -100.0})),
            ({"logit_bias": {"1234": 30}, "frequency_penalty": 0.5}, dict(bias={1234: 30.0}, frequency=0.5))]
    for fields, kw in asks:
        want, want_lp = greedy(**kw)
        assert want != plain, fields  # the fields change this model's reply: the check below can fail
        r = httpx.post(f"{base}/v1/completions", timeout=120,
                       json={"model": name, "prompt": prompt, "max_tokens": new, "logprobs": 0, **fields})
        assert r.status_code == 200, r.text
        lp = r.json()["choices"][0]["logprobs"]
        assert lp["tokens"] == [token_bytes(tok.backend_tokenizer, t).decode("utf-8", "replace") for t in want], fields
        assert lp["token_logprobs"] == pytest.approx(want_lp, abs=1e-4)
    for fields, param in (({"logit_bias": {"999999": 1}}, "logit_bias"), ({"logit_bias": {"5": 101}}, "logit_bias"),
                          ({"logit_bias": {"-5": 1}}, "logit_bias"), ({"presence_penalty": 2.5}, "presence_penalty"),
                          ({"frequency_penalty": "high"}, "frequency_penalty")):
        r = httpx.post(f"{base}/v1/completions", timeout=120,
                       json={"model": name, "prompt": prompt, "max_tokens": 3, **fields})
        assert_openai_error(r, param)
    assert stats(base)["records_open"] == 0


# --------------------------------------------------------------------------- the Responses API
@pytest.mark.slow
def test_responses_through_the_openai_client(tiny_server):
    """``client.responses.create``: one JSON response unless asked to stream (OpenAI's default; transformers'
    handler streamed regardless), its greedy text the chat endpoint's for the same conversation, streamed the
    same text; a temperature samples (transformers' manager applied its first request's sampling to all); bad
    input and what the server cannot do are 400s naming the field."""
    import openai

    base, name = tiny_server
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120)
    r = client.responses.create(model=name, input="Tell me a story", max_output_tokens=8)
    assert r.status == "completed" and r.usage.output_tokens == 8
    greedy = r.output_text
    assert greedy == reply(base, name)  # the same conversation through chat completions
    events = list(client.responses.create(model=name, input=[{"role": "user", "content": "Tell me a story"}],
                                          max_output_tokens=8, stream=True))
    assert events[-1].type == "response.completed"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == greedy
    sampled = {client.responses.create(model=name, input="Tell me a story", max_output_tokens=8,
                                       temperature=2.0).output_text for _ in range(4)}
    assert len(sampled) >= 3, sampled
    assert client.responses.create(model=name, input="Tell me a story", max_output_tokens=8).output_text == greedy
    from transformers import AutoTokenizer
    text = client.responses.create(model=name, input="Tell me a story", max_output_tokens=8,
                                   text={"format": {"type": "json_object"}}).output_text
    assert text.startswith("{") and json_reply(AutoTokenizer.from_pretrained(name), text)[0]  # JSON mode: text.format
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    text = client.responses.create(model=name, input="Tell me a story", max_output_tokens=80, text={
        "format": {"type": "json_schema", "name": "answer", "schema": schema}}).output_text
    # the schema leaves no other object, and its whitespace runs are bounded: it closes within 80 tokens
    assert json.loads(text) in ({"ok": True}, {"ok": False}), text
    for fields, param in (({"input": ""}, "input"), ({"input": 5}, "input"),
                          ({"input": [{"role": "robot", "content": "Hi"}]}, "input"),
                          ({"max_output_tokens": 0}, "max_output_tokens"),
                          ({"max_output_tokens": 10**6}, "max_output_tokens"),
                          ({"previous_response_id": "resp_1"}, "previous_response_id"),
                          ({"prompt": {"id": "pmpt_1"}}, "prompt"),  # a stored prompt template
                          ({"top_logprobs": 2}, "top_logprobs"),
                          ({"text": {"format": {"type": "json_schema"}}}, "text"),
                          ({"text": {"format": {"type": "xml"}}}, "text")):
        body = {"model": name, "input": "Hi", "max_output_tokens": 4, **fields}
        assert_openai_error(httpx.post(f"{base}/v1/responses", timeout=120, json=body), param)
    assert stats(base)["requests"] == 0


# --------------------------------------------------------------------------- sharded over two processes
@pytest.mark.slow
def test_serving_sharded_over_two_processes(tiny_dir):
    """``torchrun --nproc_per_node 2 -m kvcompile serve``: the model sharded over two gloo ranks (each rank's
    cache its KV heads), rank 0 serving HTTP. Under ``Policy.full()`` greedy replies, asked at once, are the
    unmodified model's ``generate`` tokens, and a seeded sampled reply is the unsharded model's draw by the same
    rule (every rank must store the same tokens for that: a rank that stored others would corrupt the next
    step's attention); log probabilities come back; penalties, a logit bias and JSON mode, which rank 0 alone
    holds, decide every rank's tokens; the prompt's log probabilities (echo) are the unsharded model's."""
    from concurrent.futures import ThreadPoolExecutor

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvcompile.sampling import seeded_draw

    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                "--master_addr", "127.0.0.1", "--master_port", "{port}"]
    proc, base = start_server("--model", tiny_dir, "--policy", "full", "--budget-mib", 2, launcher=launcher)
    name = str(tiny_dir)
    try:
        tok = AutoTokenizer.from_pretrained(name)
        model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32).eval()
        prompts = ["Once upon a time", "The capital of France is", "def fib(n):", "Hello"]

        def complete(prompt, **kw):
            r = httpx.post(f"{base}/v1/completions", timeout=120,
                           json={"model": name, "prompt": prompt, "max_tokens": 8, **kw})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]

        with ThreadPoolExecutor(4) as pool:
            replies = list(pool.map(complete, prompts))
        for prompt, choice in zip(prompts, replies):
            ids = tok(prompt, return_tensors="pt").input_ids
            want = model.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1]:]
            assert choice["text"] == tok.decode(want, skip_special_tokens=True), prompt

        ids = tok(prompts[0], return_tensors="pt").input_ids[0].tolist()
        with torch.no_grad():
            for step in range(8):
                logits = model(torch.tensor([ids])).logits[0, -1].float()
                ids.append(seeded_draw(torch.softmax(logits / 0.8, -1), 7, step))
        sampled = complete(prompts[0], temperature=0.8, seed=7)["text"]
        assert sampled == tok.decode(ids[-8:], skip_special_tokens=True)

        # sampled without a seed, two at once: each reply's log probabilities (rank 0's logits) are the unsharded
        # model's over the reply's tokens (read by their bytes), which they are not once the ranks picked
        # different tokens
        from kvcompile.serve import token_bytes
        id_of = {bytes(token_bytes(tok.backend_tokenizer, i)): i for i in range(len(tok))}
        messages = [{"role": "user", "content": prompts[2]}]
        r = httpx.post(f"{base}/v1/chat/completions", timeout=120, json={
            "model": name, "messages": messages, "max_tokens": 8, "temperature": 1.0, "n": 2, "logprobs": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16, r.text
        for choice in r.json()["choices"]:
            ids = list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                               return_dict=True)["input_ids"])
            for entry in choice["logprobs"]["content"]:
                with torch.no_grad():
                    logits = model(torch.tensor([ids])).logits[0, -1].float()
                ids.append(id_of[bytes(entry["bytes"])])
                assert entry["logprob"] == pytest.approx(float(torch.log_softmax(logits, -1)[ids[-1]]), abs=1e-4)
        lp = complete(prompts[1], logprobs=2)["logprobs"]
        assert len(lp["tokens"]) == 8 and all(v <= 0 for v in lp["token_logprobs"])

        # what rank 0 alone holds (penalties, a logit bias, JSON mode) decides the tokens of every rank: the
        # reply is the unsharded model's under OpenAI's formula, and its log probabilities (rank 0's logits, over
        # the caches of both ranks) the unsharded model's over it, which they are not once a rank stored others
        ids = tok(prompts[0], return_tensors="pt").input_ids[0].tolist()
        bias, want, want_lp = {int(tok(" the").input_ids[-1]): 4.0}, [], []
        with torch.no_grad():
            for _ in range(8):
                logits = model(torch.tensor([ids + want])).logits[0, -1].float()
                want_lp.append(torch.log_softmax(logits, -1))
                adjusted = logits.clone()
                for t, v in bias.items():
                    adjusted[t] += v
                for t in set(want):
                    adjusted[t] -= 1.5 * want.count(t)
                want.append(int(adjusted.argmax()))
        got = complete(prompts[0], logprobs=0, frequency_penalty=1.5, logit_bias={str(t): v for t, v in bias.items()})
        assert got["logprobs"]["tokens"] == [token_bytes(tok.backend_tokenizer, t).decode("utf-8", "replace")
                                             for t in want]
        assert got["logprobs"]["token_logprobs"] == pytest.approx([float(lp[t]) for lp, t in zip(want_lp, want)],
                                                                  abs=1e-4)
        r = httpx.post(f"{base}/v1/chat/completions", timeout=120, json={
            "model": name, "messages": messages, "max_tokens": 12, "logprobs": True,
            "response_format": {"type": "json_object"}})
        assert r.status_code == 200, r.text
        assert json_reply(tok, r.json()["choices"][0]["message"]["content"])[0]
        ids = list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                           return_dict=True)["input_ids"])
        for entry in r.json()["choices"][0]["logprobs"]["content"]:
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits[0, -1].float()
            ids.append(id_of[bytes(entry["bytes"])])
            assert entry["logprob"] == pytest.approx(float(torch.log_softmax(logits, -1)[ids[-1]]), abs=1e-4)
        # the prompt's log probabilities (echo): every rank keeps the same rows of the head (which gathers the
        # ranks' columns) and computes every prompt token though its pages are shared from the request before;
        # beside a plain request in the same forwards, and as best_of's candidates
        long = tok(" ".join(f"word{i}" for i in range(120))).input_ids
        with torch.no_grad():
            want = torch.log_softmax(model(torch.tensor([long])).logits[0].float(), -1)
        want = want[torch.arange(len(long) - 1), torch.tensor(long[1:])]
        assert complete(long)["text"]  # its pages are cached for a prefix match
        asks = [{"prompt": long, "max_tokens": 2, "logprobs": 1, "echo": True}, {"prompt": prompts[3]},
                {"prompt": long, "max_tokens": 2, "logprobs": 1, "echo": True, "best_of": 2, "temperature": 1.0}]
        with ThreadPoolExecutor(3) as pool:
            echoed, plain, best = pool.map(lambda kw: complete(**kw), asks)
        for choice in (echoed, best):
            scored = torch.tensor(choice["logprobs"]["token_logprobs"][1:len(long)])
            assert (scored - want).abs().max() < 1e-4, (scored - want).abs().max()
        assert plain["text"] == replies[3]["text"]
        wait_idle(base, None, 30)
        assert stats(base)["requests"] == 0
    finally:
        out = stop_server(proc)
    assert "sharded over 2 ranks" in out


def test_a_completion_echoes_its_prompt(tiny_server):
    """``echo``: the prompt in front of the generated text, streamed (its first piece) or not, for each of ``n``
    choices; with ``logprobs`` it is a 400 (the prompt's log probabilities are not computed)."""
    base, name = tiny_server
    body = {"model": name, "prompt": "Once upon a time", "max_tokens": 6}
    plain = httpx.post(f"{base}/v1/completions", timeout=120, json=body).json()["choices"][0]["text"]
    r = httpx.post(f"{base}/v1/completions", timeout=120, json={**body, "echo": True})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "Once upon a time" + plain
    assert r.json()["usage"]["completion_tokens"] == 6
    r = httpx.post(f"{base}/v1/completions", timeout=120, json={**body, "echo": True, "stream": True})
    assert streamed_text(r) == ("Once upon a time" + plain, "length")
    r = httpx.post(f"{base}/v1/completions", timeout=120, json={**body, "echo": True, "n": 2})
    assert [c["text"] for c in r.json()["choices"]] == ["Once upon a time" + plain] * 2
    assert_openai_error(httpx.post(f"{base}/v1/completions", timeout=120, json={**body, "echo": "yes"}), "echo")


@pytest.mark.slow
def test_a_completion_echoes_its_prompts_log_probabilities(tiny_server):
    """``echo`` with ``logprobs``, as evaluation harnesses score a text (lm-evaluation-harness sends token ids and
    max_tokens 1): the prompt's tokens lead the reply's log probabilities, the first with none, each one the
    unmodified model's log-softmax at the place before (a prefill attends its own tokens in full precision),
    with its top alternatives; then the generated token's, as without echo. A prompt longer than one forward
    (prefilled in chunks that read the store) has every place too. ``max_tokens`` 0 gives the prompt alone,
    streamed too.
    Streamed, the prompt's piece comes first, once scored."""
    import openai
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base, name = tiny_server
    tok = AutoTokenizer.from_pretrained(name)
    model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32).eval()
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120)
    for text, tol in (("The capital of France is Paris, and the capital of Italy is", 1e-4),
                      (" ".join(f"word{i}" for i in range(150)), 0.05)):  # over --max-batch-tokens 128
        ids = tok(text).input_ids
        with torch.no_grad():
            want = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
        r = client.completions.create(model=name, prompt=ids, max_tokens=1, logprobs=2, echo=True)
        lp = r.choices[0].logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids) + 1
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        got = torch.tensor(lp.token_logprobs[1:len(ids)])
        ref = want[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
        assert (got - ref).abs().max() < tol, (got - ref).abs().max()
        assert all(len(t) >= 2 and tk in t for t, tk in zip(lp.top_logprobs[1:], lp.tokens[1:]))
        assert "".join(lp.tokens[:len(ids)]) == tok.decode(ids) and r.choices[0].text.startswith(tok.decode(ids))
        alone = client.completions.create(model=name, prompt=ids, max_tokens=1, logprobs=2).choices[0].logprobs
        assert lp.tokens[-1] == alone.tokens[0] and abs(lp.token_logprobs[-1] - alone.token_logprobs[0]) < 1e-5
        assert lp.text_offset[-1] == len(tok.decode(ids))
        # max_tokens 0: the prompt alone, scored (OpenAI's way to score a text)
        r0 = client.completions.create(model=name, prompt=ids, max_tokens=0, logprobs=2, echo=True)
        assert r0.choices[0].text == tok.decode(ids) and r0.usage.completion_tokens == 0
        assert r0.choices[0].logprobs.token_logprobs == lp.token_logprobs[:-1]
        assert r0.choices[0].logprobs.tokens == lp.tokens[:-1]
    # beside other requests in the same forwards: every reply as when alone (a prompt of one forward's chunk:
    # a longer one is chunked as the batch allows, and under a quantized policy a later chunk reads the earlier
    # ones as stored, so its scores depend on where the chunks fall)
    from concurrent.futures import ThreadPoolExecutor

    short = tok("The capital of France is Paris, and the capital of Italy is").input_ids
    asks = [{"prompt": "Once upon a time", "max_tokens": 12}, {"prompt": short, "max_tokens": 0, "logprobs": 2,
                                                                "echo": True}, {"prompt": "Hello", "max_tokens": 12}]

    def ask(body):
        r = httpx.post(f"{base}/v1/completions", timeout=120, json={"model": name, **body})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]

    alone = [ask(b) for b in asks]
    with ThreadPoolExecutor(3) as pool:
        together = list(pool.map(ask, asks))
    assert [c["text"] for c in together] == [c["text"] for c in alone]
    scored = [c["logprobs"]["token_logprobs"][1:] for c in (together[1], alone[1])]
    assert together[1]["logprobs"]["tokens"] == alone[1]["logprobs"]["tokens"]
    assert torch.allclose(torch.tensor(scored[0]), torch.tensor(scored[1]), atol=1e-4)
    # streamed: the prompt's piece first, sent once it is scored, then the reply's, as in one reply
    whole = ask({"prompt": short, "max_tokens": 6, "logprobs": 2, "echo": True})
    pieces = []
    with httpx.stream("POST", f"{base}/v1/completions", timeout=120, json={
            "model": name, "prompt": short, "max_tokens": 6, "logprobs": 2, "echo": True, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"]:
                pieces.append(json.loads(line[6:])["choices"][0])
    assert "".join(p["text"] for p in pieces) == whole["text"]
    streamed = {k: [v for p in pieces if p.get("logprobs") for v in p["logprobs"][k]] for k in whole["logprobs"]}
    assert streamed["tokens"] == whole["logprobs"]["tokens"] and streamed["text_offset"] == whole["logprobs"][
        "text_offset"]
    assert streamed["token_logprobs"][0] is None and streamed["top_logprobs"][0] is None
    assert torch.allclose(torch.tensor(streamed["token_logprobs"][1:]),
                          torch.tensor(whole["logprobs"]["token_logprobs"][1:]), atol=1e-4)
    assert pieces[0]["text"] == tok.decode(short) and len(pieces[0]["logprobs"]["tokens"]) == len(short)
    # the prompt alone, streamed (max_tokens 0), through the openai client: the unstreamed reply's text and
    # scores, then the end with its usage
    alone = client.completions.create(model=name, prompt=short, max_tokens=0, logprobs=2, echo=True)
    events = list(client.completions.create(model=name, prompt=short, max_tokens=0, logprobs=2, echo=True,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(e.choices[0].text for e in events if e.choices) == alone.choices[0].text == tok.decode(short)
    assert [lp for e in events if e.choices and e.choices[0].logprobs
            for lp in e.choices[0].logprobs.token_logprobs] == alone.choices[0].logprobs.token_logprobs
    assert events[-1].choices[0].finish_reason == "length" and events[-1].usage.completion_tokens == 0
    assert events[-1].usage.prompt_tokens == len(short)
    r = httpx.post(f"{base}/v1/completions", timeout=60, json={"model": name, "prompt": "Hi", "max_tokens": 0})
    assert_openai_error(r, "max_tokens")  # generating nothing needs echo
    wait_idle(base, None, 30)
    assert stats(base)["records_open"] == 0


def test_the_model_is_found_by_its_names(tiny_server):
    """The openai client's ``models.retrieve`` (transformers' server has no such route: a 404 for its own model)
    finds the served model by its id, slashes and all, and by its directory's last part, which a chat may also
    name; another name is a 404 in OpenAI's shape (``model_not_found``)."""
    import openai

    base, name = tiny_server
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=60)
    assert [m.id for m in client.models.list()] == [name]
    short = os.path.basename(name)
    assert client.models.retrieve(name).id == client.models.retrieve(short).id == name
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4o")
    assert e.value.code == "model_not_found" and name in e.value.message
    assert chat(base, short).json()["choices"][0]["message"]["content"] == chat(base, name).json()[
        "choices"][0]["message"]["content"]
    assert_openai_error(chat(base, "gpt-4o"), None)


@pytest.mark.slow
def test_served_model_names(tiny_dir):
    """``kvcompile serve --served-model-name tiny t2``: requests may name the model ``tiny`` or ``t2`` (or its
    directory), ``/v1/models`` lists ``tiny``."""
    from fastapi.testclient import TestClient

    from kvcompile import Policy
    from kvcompile.cli import build_parser
    from kvcompile.openai_server import build_app

    assert build_parser().parse_args(["serve", "--served-model-name", "tiny", "t2"]).served_model_name == ["tiny",
                                                                                                           "t2"]
    app, manager, state = build_app(str(tiny_dir), Policy.full(), budget=2**21, max_requests=2,
                                    served_names=["tiny", "t2"])
    try:
        with TestClient(app) as c:
            assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["tiny"]
            assert c.get("/v1/models/t2").json()["id"] == "tiny"
            texts = [c.post("/v1/completions", json={"model": m, "prompt": "Hi", "max_tokens": 3}).json()[
                "choices"][0]["text"] for m in ("tiny", "t2", str(tiny_dir))]
            assert texts[0] == texts[1] == texts[2]
            assert c.post("/load_model", json={"model": "t2"}).status_code == 200
    finally:
        state.shutdown()
        manager.shutdown()


def test_load_model_takes_only_the_served_model(tiny_server):
    """transformers' ``/load_model`` loads any model id it is given (from the hub: a hang without a network);
    here another model is a 400 at once, the served one answers that it is ready, audio transcription is a 400,
    and chats go on."""
    base, name = tiny_server
    r = httpx.post(f"{base}/load_model", timeout=30, json={"model": "gpt2"})
    assert_openai_error(r, "model")
    r = httpx.post(f"{base}/load_model", timeout=30, json={"model": name})
    assert r.status_code == 200 and '"ready"' in r.text
    r = httpx.post(f"{base}/v1/audio/transcriptions", timeout=30, files={"file": ("a.wav", b"RIFF", "audio/wav")},
                   data={"model": name})
    assert_openai_error(r, "model")  # a text model's server: a 400, not transformers' 500
    assert chat(base, name).status_code == 200


def test_a_completion_of_several_prompts(tiny_server):
    """``prompt`` as a list of strings (the OpenAI client's batch completions): ``n`` choices for each prompt,
    in prompt order, each the reply that prompt gets alone; usage sums the prompts and the completions;
    streamed, each choice's events carry its index."""
    import openai

    base, name = tiny_server
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120)
    prompts = ["Once upon a time", "Hello"]
    alone = [client.completions.create(model=name, prompt=p, max_tokens=5) for p in prompts]
    r = client.completions.create(model=name, prompt=prompts, max_tokens=5, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [alone[0].choices[0].text] * 2 + [alone[1].choices[0].text] * 2
    assert r.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone) and r.usage.completion_tokens == 20
    texts = {}
    for chunk in client.completions.create(model=name, prompt=prompts, max_tokens=5, stream=True):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert texts == {0: alone[0].choices[0].text, 1: alone[1].choices[0].text}
    for prompt in ([], ["ok", ""], ["x"] * 65, [[1]] * 65):
        r = httpx.post(f"{base}/v1/completions", timeout=30, json={"model": name, "prompt": prompt, "max_tokens": 2})
        assert_openai_error(r, "prompt")


def test_a_completion_of_token_ids(tiny_server):
    """``prompt`` as token ids (one list, or a list of lists: OpenAI's other two forms, which benchmark and
    evaluation clients send): generated from exactly those ids -- the ids of a text give that text's reply,
    and ids that spell a text otherwise than its tokenizer (one token per character) are the prompt as given
    (``usage.prompt_tokens``) -- streamed or not, with ``n`` and ``echo`` (the ids' decoding); an id past the
    vocabulary is a 400 naming the prompt."""
    import openai
    from transformers import AutoTokenizer

    base, name = tiny_server
    tok = AutoTokenizer.from_pretrained(name)
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120)
    texts = ["Once upon a time", "Hello"]
    ids = [tok(t).input_ids for t in texts]
    by_text = [client.completions.create(model=name, prompt=t, max_tokens=5) for t in texts]
    by_ids = client.completions.create(model=name, prompt=ids[0], max_tokens=5)
    assert by_ids.choices[0].text == by_text[0].choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids[0]) == by_text[0].usage.prompt_tokens
    r = client.completions.create(model=name, prompt=ids, max_tokens=5, n=2)
    assert [c.text for c in r.choices] == [by_text[0].choices[0].text] * 2 + [by_text[1].choices[0].text] * 2
    streamed = "".join(c.choices[0].text for c in client.completions.create(model=name, prompt=ids[1],
                                                                             max_tokens=5, stream=True) if c.choices)
    assert streamed == by_text[1].choices[0].text
    spelled = [tok.convert_tokens_to_ids(c) for c in "Hello"]  # five one-character tokens, not the text's one
    assert len(ids[1]) < 5 and tok.decode(spelled) == "Hello"
    r = client.completions.create(model=name, prompt=spelled, max_tokens=5, echo=True)
    assert r.usage.prompt_tokens == 5 and r.choices[0].text.startswith("Hello")
    vocab = len(tok)
    for prompt in ([1, 10**9], [[1, 2], [3, 10**9]]):
        r = httpx.post(f"{base}/v1/completions", timeout=30, json={"model": name, "prompt": prompt, "max_tokens": 2})
        assert "past the model's vocabulary" in assert_openai_error(r, "prompt")["message"]
    assert client.completions.create(model=name, prompt=[vocab - 1], max_tokens=2).usage.prompt_tokens == 1
    wait_idle(base, None, 30)  # every request's pages back


# --------------------------------------------------------------------------- JSON mode
@pytest.mark.slow
def test_json_mode_replies_with_one_json_object(tiny_server):
    """``response_format: {"type": "json_object"}``: every reply is a prefix of one JSON object (the random model
    left to itself rarely closes one within max_tokens), ended at the object's close with the end-of-sequence
    token (``finish_reason: "stop"``); pushed towards closing (a bias on '"' and '}'), the whole reply parses
    as an object, where without JSON mode the same request is no JSON; streamed, the same text; sampled too.
    On completions, and as a schema, it is a 400."""
    from transformers import AutoTokenizer

    base, name = tiny_server
    tok = AutoTokenizer.from_pretrained(name)
    closing = {str(tok.convert_tokens_to_ids(t)): 30 for t in ('"', "}")}
    json_mode = {"response_format": {"type": "json_object"}}

    def content(**kw):
        r = chat(base, name, content="Give me a JSON object.", **kw)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"], r.json()["choices"][0]["finish_reason"]

    text, reason = content(max_tokens=24, logit_bias=closing, **json_mode)
    assert isinstance(json.loads(text), dict) and reason == "stop", text
    free, _ = content(max_tokens=24, logit_bias=closing)
    with pytest.raises(ValueError):
        json.loads(free)
    for kw in ({}, {"temperature": 1.0, "seed": 3}, {"temperature": 1.0}):
        text, reason = content(max_tokens=16, **json_mode, **kw)
        prefix, whole = json_reply(tok, text)
        assert prefix and (reason == "length" or whole), (text, reason)
    r = chat(base, name, content="Give me a JSON object.", max_tokens=16, stream=True, **json_mode)
    assert streamed_text(r)[0] == content(max_tokens=16, **json_mode)[0]
    # a schema: the reply follows it (the bias on '}' closes the object once "age" has a digit)
    pet = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
           "properties": {"name": {"type": "string", "enum": ["cat", "dog"]}, "age": {"type": "integer"}}}
    schema_mode = {"response_format": {"type": "json_schema", "json_schema": {"name": "pet", "schema": pet}}}
    text, reason = content(max_tokens=40, logit_bias={str(tok.convert_tokens_to_ids("}")): 30}, **schema_mode)
    import jsonschema
    jsonschema.validate(json.loads(text), pet)
    assert reason == "stop"
    for endpoint, fields in (("completions", json_mode),
                             ("chat/completions", {"response_format": {"type": "json_schema", "json_schema": {}}}),
                             ("chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
                                 "name": "x", "schema": {"type": "object", "not": {}}}}})):
        body = {"model": name, "max_tokens": 3, **fields}
        body.update({"messages": [{"role": "user", "content": "Hi"}]} if endpoint.startswith("chat") else
                    {"prompt": "Hi"})
        assert_openai_error(httpx.post(f"{base}/v1/{endpoint}", timeout=60, json=body), "response_format")
    assert stats(base)["records_open"] == 0


def test_the_openai_clients_parse_fills_a_pydantic_model(tiny_server, pet_model):
    """``client.chat.completions.parse(response_format=<pydantic model>)``, the openai client's structured
    output: the schema it sends for the model (nested models as $defs and $ref, an Optional field as anyOf with
    null, Literal and Enum fields as const and enums of strings and integers, a dict as additionalProperties)
    is followed, and the client parses the reply into the model, greedy and sampled (a bias on the closing
    characters brings the random model's strings, lists and objects to an end)."""
    import openai
    from openai import OpenAI
    from pydantic import BaseModel
    from transformers import AutoTokenizer

    Pet = pet_model
    base, name = tiny_server
    tok = AutoTokenizer.from_pretrained(name)
    closing = {str(tok.convert_tokens_to_ids(t)): 30 for t in ('"', "}", "]")}
    client = OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=120)
    for kw in ({}, {"temperature": 1.0, "seed": 5}):
        out = client.chat.completions.parse(model=name, messages=[{"role": "user", "content": "A pet, please."}],
                                            response_format=Pet, max_tokens=120, logit_bias=closing, **kw)
        choice = out.choices[0]
        assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Pet), choice.message.content
        assert Pet.model_validate_json(choice.message.content) == choice.message.parsed
    with pytest.raises(openai.BadRequestError, match="uniqueItems"):  # a form it does not follow: a 400 naming it
        class Points(BaseModel):
            xy: set[tuple[int, int]]

        client.chat.completions.parse(model=name, messages=[{"role": "user", "content": "Points."}],
                                      response_format=Points, max_tokens=8)
    assert stats(base)["records_open"] == 0


@pytest.mark.slow
def test_the_openai_clients_parse_keeps_a_models_bounds(tiny_server, bounded_model):
    """A pydantic model whose fields bound their values (numbers with ge / lt, lengths, a pattern, a date, a
    datetime, a UUID, a discriminated union): the random model's reply, pushed to close its strings and
    containers, parses into it -- greedy, sampled, and streamed through the client's ``stream``."""
    from openai import OpenAI
    from transformers import AutoTokenizer

    base, name = tiny_server
    tok = AutoTokenizer.from_pretrained(name)
    # the random model's replies pushed to close strings and containers, and kept from padding with whitespace
    push = {str(i): -100 for i in range(len(tok)) if tok.decode([i]) and not tok.decode([i]).strip()}
    push.update({str(tok.convert_tokens_to_ids(t)): 30 for t in ("}", "]", ",")})
    push[str(tok.convert_tokens_to_ids('"'))] = 40  # a string closes first (not filled with brackets)
    client = OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=120)
    ask = dict(model=name, messages=[{"role": "user", "content": "Book it."}], response_format=bounded_model,
               max_tokens=200, logit_bias=push)
    parsed = []
    for kw in ({}, {"temperature": 1.0, "seed": 11}):
        choice = client.chat.completions.parse(**ask, **kw).choices[0]
        assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, bounded_model), \
            choice.message.content
        parsed.append(choice.message.parsed)
    with client.chat.completions.stream(**ask) as stream:  # greedy: the same reply
        assert stream.get_final_completion().choices[0].message.parsed == parsed[0]
    assert stats(base)["records_open"] == 0


@pytest.mark.slow
def test_a_request_whose_token_picking_fails_gets_an_error_and_the_server_goes_on(tiny_dir, monkeypatch):
    """In process (so that the JSON constraint can be broken for the test): the broken request's client gets a
    500 in OpenAI's shape naming the failure -- streamed, an error event at the end -- and the server answers
    the next requests, JSON mode's included once it works again."""
    from fastapi.testclient import TestClient

    from kvcompile import Policy
    from kvcompile.json_mode import JsonConstraint
    from kvcompile.openai_server import build_app

    app, manager, state = build_app(str(tiny_dir), Policy.full(), budget=2**21, max_requests=4)
    works = JsonConstraint.mask_

    def broken(self, logits):
        raise RuntimeError("broken constraint")

    body = {"model": str(tiny_dir), "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
            "response_format": {"type": "json_object"}}
    try:
        with TestClient(app) as client:
            monkeypatch.setattr(JsonConstraint, "mask_", broken)
            r = client.post("/v1/chat/completions", json=body)
            assert r.status_code == 500 and "broken constraint" in r.json()["error"]["message"], r.text
            r = client.post("/v1/chat/completions", json={**body, "stream": True})
            assert r.status_code == 200 and "broken constraint" in r.text.strip().splitlines()[-1]
            plain = {k: v for k, v in body.items() if k != "response_format"}
            assert client.post("/v1/chat/completions", json=plain).status_code == 200
            monkeypatch.setattr(JsonConstraint, "mask_", works)
            r = client.post("/v1/chat/completions", json=body)
            assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"].startswith("{")
            assert client.get("/kvcompile/stats").json()["records_open"] == 0
    finally:
        state.shutdown()
        manager.shutdown()
