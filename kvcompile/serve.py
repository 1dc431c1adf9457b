"""``kvcompile serve``: transformers' OpenAI-compatible server (``transformers serve --continuous-batching``)
with continuous batching over kvcompile's packed cache.

transformers' own pieces, unchanged: its ``ModelManager`` (loading, the tokenizer), its chat-completion and
completion handlers (streaming and not, request validation), its FastAPI app and uvicorn. One piece is
ours: the model manager applies ``kvcompile.apply(model, policy)`` to each model it loads, so the
continuous-batching manager the handlers start (``model.init_continuous_batching``) is kvcompile's
(``kvcompile.serving``).

This module holds what the server checks and computes per request, and needs none of the server's dependencies
(the command line reads its defaults); the server itself -- transformers' classes extended, the app, uvicorn --
is ``kvcompile.openai_server``, which imports them.

What ``kvcompile serve`` adds in front of transformers' handlers (``openai_server.build_app``): requests are checked before they
reach them, so bad input is a 4xx in OpenAI's error shape (``{"error": {"message", "type", "param", "code"}}``) and
never a 500 or a dead worker -- message lists and their roles and content, ``model``, ``max_tokens``, sampling
fields; and a request whose prompt (counted in the tokens the cache would hold) plus ``max_tokens`` does not fit the
cache for one request is refused with 400 (transformers' scheduler, given a request larger than the whole cache,
stops its worker for good). Without ``max_tokens`` a reply is capped to what the cache holds. Each request decodes
as it asks (``kvcompile.sampling``: greedy or its temperature, top-p and top-k, in one batch with the others;
transformers' manager applied its first request's to all), and a field asking for what the server does not do
(``UNSUPPORTED``: a forced ``tool_choice`` ...) is a 400 rather than ignored. ``stop`` strings end a reply,
streaming or not (``StopAt``); ``n`` choices are ``n`` requests in the batch (``n_choices``), streamed as one stream
or not. Log probabilities, penalties, a logit bias and JSON mode (``kvcompile.json_mode``, on llguidance) are done
per request where its tokens are picked (``kvcompile.sampling``: each request's options in one
``RequestOptions``, kept in the server's ``Requests`` by request id while it runs); a completion's prompt may be
token ids (``prompt_inputs``), and its ``echo`` puts the prompt in front, with its log probabilities when asked
(the engine's cache records them as the prefill computes them). The Responses API (``/v1/responses``) is
checked (``check_response``) and sampled per request alike, and answers with one JSON object unless asked to
stream. Launched by torchrun with several processes, the model is sharded over them (``openai_server.run_tensor_parallel``).

A streaming client that disconnects has its request cancelled by transformers' handler (its generator is
closed), and the request's pages and slot come back; a non-streaming client that disconnects (gives up waiting,
times out) has its request cancelled here (``ClientConnection``, ``watch_client``): the
handler polls the connection while it waits for the reply, and the request's pages and slot come back within a
poll, not when the reply it will never read is done.

    kvcompile serve --policy kivi:4 --port 8000
    curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
        -d '{"model": "<the model path the server prints>", "messages": [{"role": "user", "content": "Hi"}]}'
"""
from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import time

from .errors import ArgumentError, KVCompileError, UnsupportedError
from .sampling import MAX_TOP_LOGPROBS, Asked, RequestOptions


SERVER_TRANSFORMERS = "5.24"  # the transformers release whose server (transformers.cli.serving) this module extends


def require_server_transformers() -> None:
    """Refuse, saying what to install, a transformers whose OpenAI-compatible server this module is not built on:
    it subclasses that server's handlers, model manager and generation state, which 5.25 rewrote."""
    import transformers

    found = transformers.__version__
    if ".".join(found.split(".")[:2]) != SERVER_TRANSFORMERS:
        raise UnsupportedError(
            f"kvcompile serve extends the OpenAI-compatible server of transformers {SERVER_TRANSFORMERS}; found "
            f"transformers {found}, whose server is built differently. Install the release it is built on: "
            f"pip install 'transformers=={SERVER_TRANSFORMERS}.*' (what pip install 'kvcompile[serve]' asks for).")


# --------------------------------------------------------------------------- clients that go away
DISCONNECT_POLL_S = 0.2  # how often a non-streaming request checks that its client is still connected


class ClientDisconnected(KVCompileError):
    """The client went away before its reply was ready; the request was cancelled. Answered 499 (nobody reads it)."""


async def watch_client(work: asyncio.Future, client, cancel, poll_s: float = DISCONNECT_POLL_S):
    """``work``'s result, while checking every ``poll_s`` that ``client`` (a Starlette ``Request``) is still
    connected. If it disconnects first, or this wait is itself cancelled (the server shutting down), ``cancel()``
    runs (it cancels the generation request) and ``work`` is cancelled; a disconnect raises
    ``ClientDisconnected``."""
    try:
        while True:
            done, _ = await asyncio.wait({work}, timeout=poll_s)
            if done:
                return work.result()
            if await client.is_disconnected():
                break
    except BaseException:
        if not work.done():
            cancel()
            work.cancel()
        raise
    if work.done():  # finished while we looked: nobody will read it, but it holds nothing any more
        return work.result()
    cancel()
    work.cancel()
    raise ClientDisconnected("the client disconnected before its reply was ready; the request was cancelled")


class ServerStopping(KVCompileError):
    """The server is shutting down (``openai_server.GracefulServer``): a request still running when its grace period ended, or
    one that came after. Answered 503 with OpenAI's error body (a stream: an error event, then its end)."""


# --------------------------------------------------------------------------- checking requests
class RequestError(ArgumentError):
    """A request the server will not run: answered ``status`` with OpenAI's error body."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400):
        super().__init__(message)
        self.message, self.param, self.code, self.status = message, param, code, status


def error_body(message: str, param=None, code=None, type_: str = "invalid_request_error") -> dict:
    """OpenAI's error shape, which its clients read (``openai.BadRequestError.message`` etc.)."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


ROLES = ("system", "developer", "user", "assistant", "tool")
TEXT_PARTS = ("text", "input_text", "output_text")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


SEEDS = (-2**63, 2**63 - 1)  # the seeds a request may give: a signed 64-bit integer (OpenAI's int64; vLLM's range)


def check_common(body: dict) -> None:
    """The fields both endpoints share, checked where transformers' handlers would take them as they come
    (``int(...)``, ``float(...)``: a 500 on a string, a negative ``max_tokens`` generating nothing)."""
    model = body.get("model")
    if model is None:
        raise RequestError("'model' is required (GET /v1/models lists the one this server serves)", "model")
    if not isinstance(model, str):
        raise RequestError(f"'model' must be a string, got {type(model).__name__}", "model")
    for name in ("max_tokens", "max_completion_tokens"):
        v = body.get(name)
        if v == 0 and name == "max_tokens" and body.get("echo") is True:
            continue  # a completion that echoes its prompt and generates nothing: scoring a text (_echoed)
        if v is not None and not (_is_int(v) and v >= 1):
            raise RequestError(f"'{name}' must be an integer >= 1, got {v!r}"
                               + (" (0 only with echo: the prompt alone)" if v == 0 else ""), name)
    for name, lo, hi, lo_open in (("temperature", 0, 2, False), ("top_p", 0, 1, True),
                                  ("frequency_penalty", -2, 2, False), ("presence_penalty", -2, 2, False)):
        v = body.get(name)
        if v is not None and not (_is_number(v) and (lo < v if lo_open else lo <= v) and v <= hi):
            side = "(" if lo_open else "["
            raise RequestError(f"'{name}' must be a number in {side}{lo}, {hi}], got {v!r}", name)
    seed = body.get("seed")
    if seed is not None and not (_is_int(seed) and SEEDS[0] <= seed <= SEEDS[1]):
        raise RequestError(f"'seed' must be an integer from {SEEDS[0]} to {SEEDS[1]} (64 bits), got {seed!r}"[:200],
                           "seed")
    for name in ("stream", "parallel_tool_calls", "store"):
        if body.get(name) is not None and not isinstance(body[name], bool):
            raise RequestError(f"'{name}' must be true or false, got {body[name]!r}"[:200], name)
    tk = body.get("top_k")
    if tk is not None and not (_is_int(tk) and tk >= 0):
        raise RequestError(f"'top_k' must be an integer >= 0 (0: no top-k filter), got {tk!r}", "top_k")
    stop = body.get("stop")
    if stop is not None and not (isinstance(stop, str) or (isinstance(stop, list)
                                                             and all(isinstance(x, str) and x for x in stop))):
        raise RequestError("'stop' must be a string or a list of non-empty strings (an empty list: none)", "stop")
    bias = body.get("logit_bias")
    if bias is not None and not (isinstance(bias, dict) and all(
            isinstance(k, str) and k.isdigit() and _is_number(v) and -100 <= v <= 100 for k, v in bias.items())):
        raise RequestError("'logit_bias' must map token ids (as strings) to numbers in [-100, 100]", "logit_bias")
    check_supported(body)
    check_generation_config(body.get("generation_config"))


# what transformers' continuous batching reads of a request's ``generation_config`` (transformers' extension: a JSON
# string): the rest of it was silently ignored (the engine samples as the request's own fields say)
GENERATION_CONFIG_FIELDS = ("max_new_tokens", "eos_token_id")


def check_generation_config(gc) -> None:
    if gc is None:
        return
    try:
        parsed = json.loads(gc) if isinstance(gc, str) else None
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict):
        raise RequestError("'generation_config' must be a JSON object written as a string, e.g. "
                           "'{\"max_new_tokens\": 16}'", "generation_config")
    others = sorted(k for k in parsed if k not in GENERATION_CONFIG_FIELDS)
    if others:
        raise RequestError(f"'generation_config' sets {', '.join(others)}"[:200]
                           + f", which this server does not apply (it takes {' and '.join(GENERATION_CONFIG_FIELDS)} "
                           f"from it); give the request's own fields instead (temperature, top_p, top_k, max_tokens, "
                           f"stop, ...)", "generation_config")
    m, eos = parsed.get("max_new_tokens"), parsed.get("eos_token_id")
    if m is not None and not (_is_int(m) and m >= 1):
        raise RequestError(f"'generation_config': max_new_tokens must be an integer >= 1, got {m!r}"[:200],
                           "generation_config")
    ids = eos if isinstance(eos, list) else [eos]
    if eos is not None and not (ids and all(_is_int(t) and 0 <= t < 2**31 for t in ids)):
        raise RequestError(f"'generation_config': eos_token_id must be a token id or a list of them, got {eos!r}"[:200],
                           "generation_config")


# What a request may ask that transformers' continuous batching would not do: its handlers take these fields
# (or ignore them) but its continuous-batching manager applies one generation config, made from the server's
# first request, to every request after it -- so they were silently dropped, or worse, applied to later
# requests. Each is refused (400) unless it asks for what the server does anyway. OpenAI's own defaults pass.
MAX_N = 16  # choices one request may ask for (each is a request of its own in the batch: n_choices)
UNSUPPORTED = {
    "n": (lambda v: _is_int(v) and 1 <= v <= MAX_N, f"n must be an integer in [1, {MAX_N}]"),
    "response_format": (lambda v: isinstance(v, dict) and v.get("type") in ("text", "json_object", "json_schema"),
                        "its type is 'text', 'json_object' or 'json_schema'"),
    # transformers' handlers ignore these (a warning in the server's log); each changes what the reply must be
    "tool_choice": (lambda v: v in ("auto", "none"), "a reply is never forced to call a tool: 'auto' or 'none'"),
    "functions": (lambda v: not v, "the deprecated 'functions': give them as 'tools'"),
    "function_call": (lambda v: v in ("auto", "none"), "a reply is never forced to call a function"),
    "modalities": (lambda v: isinstance(v, list) and all(x == "text" for x in v), "replies are text"),
    "audio": (lambda v: not v, "replies are text"),
    "web_search_options": (lambda v: False, "the model cannot search the web"),
}


def check_supported(body: dict) -> None:
    """Refuse (400) a field whose value asks for what this server does not do (``UNSUPPORTED``)."""
    for name, (fine, does) in UNSUPPORTED.items():
        v = body.get(name)
        if v is not None and not fine(v):
            raise RequestError(f"'{name}'={v!r} is not supported by this server ({does}); leave it out", name)


_TOOL_PROBE = {"type": "function", "function": {"name": "kvcompile_probe", "description": "probe",
                                                 "parameters": {"type": "object", "properties": {}}}}
_RENDERS_TOOLS: dict[int, tuple] = {}  # id of a tokenizer: (it, whether its chat template shows tools)


def template_shows_tools(tokenizer) -> bool:
    """Whether ``tokenizer``'s chat template puts tools in the prompt (some -- SmolLM2's -- render the same
    prompt with them as without: the model never sees them); worked out once per tokenizer."""
    key = id(tokenizer)
    if key not in _RENDERS_TOOLS:
        chat = [{"role": "user", "content": "x"}]
        try:
            shows = (tokenizer.apply_chat_template(chat, tools=[_TOOL_PROBE], tokenize=False,
                                                   add_generation_prompt=True)
                     != tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))
        except Exception:  # noqa: BLE001 -- a template that fails on tools does not take them
            shows = False
        _RENDERS_TOOLS[key] = (tokenizer, shows)
    return _RENDERS_TOOLS[key][1]


def logprobs_asked(body: dict, chat: bool) -> int | None:
    """How many alternatives each generated token's log-probability entry lists, or None when the request asks
    for no log probabilities. Chat completions: ``logprobs: true`` and ``top_logprobs`` (0 to
    ``MAX_TOP_LOGPROBS``; it needs ``logprobs``); completions: ``logprobs``, that number (OpenAI allows up to 5,
    vLLM and this server up to 20)."""
    lp, top = body.get("logprobs"), body.get("top_logprobs")
    if chat:
        if lp is not None and not isinstance(lp, bool):
            raise RequestError(f"'logprobs' must be true or false, got {lp!r}", "logprobs")
        if top is not None and not (_is_int(top) and 0 <= top <= MAX_TOP_LOGPROBS):
            raise RequestError(f"'top_logprobs' must be an integer in [0, {MAX_TOP_LOGPROBS}], got {top!r}",
                               "top_logprobs")
        if top and not lp:
            raise RequestError("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        return (top or 0) if lp else None
    if top is not None:
        raise RequestError("'top_logprobs' is a chat-completions field; completions take 'logprobs': <number of "
                           "alternatives>", "top_logprobs")
    if lp is not None and not (_is_int(lp) and 0 <= lp <= MAX_TOP_LOGPROBS):
        raise RequestError(f"'logprobs' must be an integer in [0, {MAX_TOP_LOGPROBS}] (alternatives per token), got "
                           f"{lp!r}", "logprobs")
    return lp


def check_chat(body: dict) -> None:
    """A chat completion's messages: a non-empty list of objects with an OpenAI role and text content (a
    string or text parts; this server's models are text-only)."""
    messages = body.get("messages")
    if messages is None:
        raise RequestError("'messages' is required", "messages")
    if not isinstance(messages, list):
        raise RequestError(f"'messages' must be a list of message objects, got {type(messages).__name__}",
                           "messages")
    if not messages:
        raise RequestError("'messages' must not be empty", "messages")
    for i, m in enumerate(messages):
        at = f"messages[{i}]"
        if not isinstance(m, dict):
            raise RequestError(f"{at} must be an object with 'role' and 'content', got {type(m).__name__}", at)
        if m.get("role") not in ROLES:
            raise RequestError(f"{at}.role must be one of {', '.join(ROLES)}; got {m.get('role')!r}", f"{at}.role")
        calls = m.get("tool_calls")
        if calls is not None:
            if not (isinstance(calls, list) and all(isinstance(c, dict) and isinstance(c.get("function", c), dict)
                                                    and isinstance(c.get("function", c).get("name"), str)
                                                    for c in calls)):
                raise RequestError(f"{at}.tool_calls must be a list of {{'function': {{'name', 'arguments'}}}}",
                                   f"{at}.tool_calls")
            for c in calls:
                args = c.get("function", c).get("arguments")
                if isinstance(args, str):
                    try:
                        args = json.loads(args)
                    except ValueError:
                        args = None
                if not isinstance(args, dict):
                    raise RequestError(f"{at}.tool_calls: 'arguments' must be a JSON object", f"{at}.tool_calls")
            continue  # transformers ignores the content of a message with tool calls
        content = m.get("content")
        if isinstance(content, str):
            continue
        if not isinstance(content, list):
            raise RequestError(f"{at}.content must be a string or a list of content parts, got "
                               f"{type(content).__name__}", f"{at}.content")
        for j, part in enumerate(content):
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise RequestError(f"{at}.content[{j}] must be an object with a 'type'", f"{at}.content")
            if part["type"] not in TEXT_PARTS:
                raise RequestError(f"{at}.content[{j}]: content of type {part['type']!r} is not supported (this "
                                   f"server's model reads text only)", f"{at}.content")
            if not isinstance(part.get("text"), str):
                raise RequestError(f"{at}.content[{j}].text must be a string", f"{at}.content")
    tools = body.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise RequestError("'tools' must be a list of tool objects", "tools")
    kw = body.get("chat_template_kwargs")
    if kw is not None and not isinstance(kw, dict):
        raise RequestError("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    logprobs_asked(body, chat=True)
    response_schema(body.get("response_format"))
    for name, neutral in (("best_of", (None, 1)), ("echo", (None, False)), ("suffix", (None, ""))):
        if body.get(name) not in neutral:  # completions' fields (best_of was taken as candidates per choice)
            raise RequestError(f"'{name}' is a field of completions (/v1/completions), not of chat completions; "
                               f"leave it out", name)


def response_schema(fmt, param: str = "response_format") -> dict | None:
    """The JSON schema a ``response_format`` (chat: ``{"type": "json_schema", "json_schema": {"name", "schema",
    "strict"}}``; Responses API: ``text.format``, with ``name`` and ``schema`` in it) asks the reply to follow,
    checked (``json_mode.grammar``: a keyword or format llguidance does not follow is a 400 naming it); None for
    another format."""
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        return None
    from .json_mode import SchemaError, grammar

    spec = fmt.get("json_schema", fmt)
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(schema, dict):
        raise RequestError(f"'{param}' of type 'json_schema' needs the schema: "
                           + ('{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}'
                              if param == "response_format" else
                              '{"format": {"type": "json_schema", "name": ..., "schema": {...}}}'), param)
    try:
        grammar(schema)
    except SchemaError as e:
        raise RequestError(f"'{param}': {e}", param) from None
    return schema


MAX_CHOICES = 64  # choices one request may ask for in all: prompts of a completion times n


def completion_prompts(prompt) -> list:
    """A completion's prompts, each a string or a list of token ids: ``prompt`` is one string, one list of token
    ids, or a list of either (OpenAI's four forms)."""
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        return [prompt]
    return prompt if isinstance(prompt, list) else [prompt]


def check_completion(body: dict) -> None:
    """A completion's ``prompt``: a non-empty string or list of token ids, or a list of them (a choice or ``n``
    for each, in one batch); token ids are checked against the vocabulary when the request is generated
    (``prompt_inputs``)."""
    prompt = body.get("prompt")
    prompts = completion_prompts(prompt)
    if not (prompts and all((isinstance(p, str) and p) or (isinstance(p, list) and p and all(
            _is_int(t) and t >= 0 for t in p)) for p in prompts)):
        raise RequestError("'prompt' must be a non-empty string, a non-empty list of token ids (integers >= 0), or "
                           f"a list of either, got {prompt!r}"[:240], "prompt")
    n = body.get("n") or 1
    if len(prompts) * (n if _is_int(n) else 1) > MAX_CHOICES:
        raise RequestError(f"{len(prompts)} prompts x n={n} choices is over {MAX_CHOICES} in one request; "
                           f"send fewer", "prompt")
    best = body.get("best_of")
    if best is not None:
        if not (_is_int(best) and 1 <= best <= MAX_N):
            raise RequestError(f"'best_of' must be an integer in [1, {MAX_N}], got {best!r}", "best_of")
        if _is_int(n) and best < n:
            raise RequestError(f"'best_of' ({best}) must be at least 'n' ({n}): the n best of best_of candidates",
                               "best_of")
        if best > 1 and body.get("stream"):
            raise RequestError("'best_of' > 1 cannot be streamed (the best candidates are known at their end)",
                               "best_of")
        if len(prompts) * best > MAX_CHOICES:
            raise RequestError(f"{len(prompts)} prompts x best_of={best} candidates is over {MAX_CHOICES} in one "
                               f"request; send fewer", "best_of")
    if body.get("suffix") is not None and not isinstance(body["suffix"], str):
        raise RequestError("'suffix' must be a string", "suffix")
    if body.get("suffix"):  # transformers' handler appended it to the reply: the model never saw it
        raise RequestError("'suffix' (a reply written to fit before it: insertion) is not supported by this server; "
                           "leave it out", "suffix")
    logprobs_asked(body, chat=False)
    if body.get("response_format") is not None:
        raise RequestError("'response_format' is a chat-completions field (JSON mode: /v1/chat/completions)",
                           "response_format")
    echo = body.get("echo")
    if echo is not None and not isinstance(echo, bool):
        raise RequestError(f"'echo' must be true or false, got {echo!r}", "echo")


def check_input_items(items: list) -> None:
    """A Responses API ``input`` list, as transformers' handler reads it: content parts of one user message when
    its first item has no ``role`` (checked as a chat message's), else messages (checked as chat messages) and
    the items of an earlier response (``function_call``, ``function_call_output``, ``reasoning``)."""
    def fail(what, at="input"):
        raise RequestError(what, at)

    if not all(isinstance(item, dict) for item in items):
        fail("'input' items must be objects")
    if "role" not in items[0]:  # one user message of these content parts
        try:
            check_chat({"messages": [{"role": "user", "content": items}]})
        except RequestError as e:
            fail(e.message.replace("messages[0].content", "input"))
        return
    strings = {"function_call": ("call_id", "name", "arguments"), "function_call_output": ("call_id", "output")}
    for i, item in enumerate(items):
        kind = item.get("type")
        if "role" in item:
            try:
                check_chat({"messages": [item]})
            except RequestError as e:
                fail(e.message.replace("messages[0]", f"input[{i}]"))
        elif kind in strings:
            missing = [k for k in strings[kind] if not isinstance(item.get(k), str)]
            if missing:
                fail(f"input[{i}] of type {kind!r} needs {', '.join(missing)} as strings")
        elif kind == "reasoning":
            parts = item.get("content") or []
            if not (isinstance(parts, list) and all(isinstance(c, dict) and isinstance(c.get("text"), str)
                                                    for c in parts)):
                fail(f"input[{i}] of type 'reasoning': its content must be a list of {{'text': ...}} parts")
        else:
            fail(f"input[{i}] must be a message (with 'role') or an item of type 'function_call', "
                 f"'function_call_output' or 'reasoning'; got type {kind!r}")


def check_response(body: dict) -> None:
    """A Responses API request (``/v1/responses``): its ``input`` (a string, or a list of items whose messages
    are checked as chat messages), ``instructions``, ``max_output_tokens``; what the server cannot do is a 400:
    ``previous_response_id`` (it stores no responses: send the conversation as ``input``), ``background``, log
    probabilities (``text.format`` ``json_object`` and ``json_schema`` are JSON mode)."""
    inp = body.get("input")
    if not ((isinstance(inp, str) and inp) or (isinstance(inp, list) and inp)):
        raise RequestError(f"'input' must be a non-empty string or list of input items, got {inp!r}"[:200], "input")
    if isinstance(inp, list):
        check_input_items(inp)
    if body.get("instructions") is not None and not isinstance(body["instructions"], str):
        raise RequestError("'instructions' must be a string", "instructions")
    v = body.get("max_output_tokens")
    if v is not None and not (_is_int(v) and v >= 1):
        raise RequestError(f"'max_output_tokens' must be an integer >= 1, got {v!r}", "max_output_tokens")
    text = body.get("text")
    if text is not None and not isinstance(text, dict):
        raise RequestError(f"'text' must be an object (e.g. {{\"format\": {{\"type\": \"json_object\"}}}}), got "
                           f"{type(text).__name__}", "text")
    tools = body.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise RequestError("'tools' must be a list of tool objects", "tools")
    fmt = (text or {}).get("format")
    for name, fine, does in (
            ("previous_response_id", body.get("previous_response_id") is None,
             "this server stores no responses; send the whole conversation as 'input'"),
            ("background", not body.get("background"), "replies are generated while the request waits"),
            ("prompt", body.get("prompt") is None, "this server stores no prompt templates; send the text as 'input'"),
            ("top_logprobs", not body.get("top_logprobs"), "log probabilities are given by /v1/chat/completions"),
            ("text", fmt is None or (isinstance(fmt, dict) and fmt.get("type") in ("text", "json_object",
                                                                                  "json_schema")),
             "its format's type is 'text', 'json_object' or 'json_schema'")):
        if not fine:
            raise RequestError(f"'{name}' is not supported by this server ({does}); leave it out", name)
    response_schema(fmt, "text")


def cache_token_limit(cb, model) -> int:
    """Tokens one request may hold: every page of the cache (transformers' scheduler reads and allocates at
    most that for one request), and no more than the model's positions."""
    from .serving import request_limit

    cfg = cb.continuous_batching_config
    limit = cfg.num_blocks * cfg.page_size
    positions = request_limit(model.config)
    return min(limit, positions) if positions else limit


def fit_to_cache(cb, model, inputs: dict, gen_config, options: RequestOptions) -> None:
    """Refuse (400) a request that the cache cannot hold whole; cap a reply whose length the client left open
    (``options.open_length``) to what the cache holds after its prompt."""
    n, param = len(inputs["input_ids"]), options.prompt_field
    limit = cache_token_limit(cb, model)
    if n == 0:
        raise RequestError("the prompt has no tokens", param)
    if n >= limit:
        raise RequestError(f"prompt of {n} tokens exceeds what this server's cache holds for one request "
                           f"({limit} tokens, prompt and reply together); shorten it", param,
                           code="context_length_exceeded")
    if options.open_length:
        gen_config.max_new_tokens = min(gen_config.max_new_tokens, limit - n)
    elif n + gen_config.max_new_tokens > limit:
        field = options.max_field
        raise RequestError(f"prompt of {n} tokens plus {field}={gen_config.max_new_tokens} exceeds what this "
                           f"server's cache holds for one request ({limit} tokens); lower {field} to at most "
                           f"{limit - n}", field, code="context_length_exceeded")


# --------------------------------------------------------------------------- stop strings
class StopAt:
    """Stands for a streamed reply's text queue (transformers' ``CBStreamer`` writes to it): passes the text on up
    to the first of ``stops``, holding back a tail that could begin one; at a stop string it ends the stream
    (the stop string itself is not sent, as OpenAI's API does) and calls ``cancel``, so that the request gives its
    pages back now rather than at max_tokens. Items that are not text (errors) pass through. Log probabilities
    that come with the text (``TokenText``) go on with the next text sent."""

    def __init__(self, queue, stops, cancel):
        self.queue, self.stops, self.cancel = queue, list(stops), cancel
        self.held, self.done = "", False
        self.tokens: list = []  # log-probability entries of the tokens whose text is held

    def _send(self, text: str) -> None:
        if text:
            if self.tokens:
                text = TokenText(text, self.tokens)
                self.tokens = []
            self.queue.put_nowait(text)

    def put_nowait(self, item) -> None:
        if self.done:
            return
        if item is None:  # the reply ended without a stop string
            self._send(self.held)
            self.done = True
            self.queue.put_nowait(None)
            return
        if not isinstance(item, str):
            self.queue.put_nowait(item)
            return
        self.tokens += getattr(item, "tokens", [])
        text = self.held + item
        hits = [i for i in (text.find(x) for x in self.stops) if i >= 0]
        if hits:
            self._send(text[:min(hits)])
            self.held, self.done = "", True
            self.cancel()
            self.queue.put_nowait(None)
            return
        keep = max((k for x in self.stops for k in range(min(len(x) - 1, len(text)), 0, -1)
                    if text.endswith(x[:k])), default=0)
        self._send(text[:len(text) - keep])
        self.held = text[len(text) - keep:]


# --------------------------------------------------------------------------- log probabilities
class TokenText(str):
    """A streamed piece of a reply with the log-probability entries of the tokens it was decoded from
    (``token_entries``), for the chunk that carries it."""

    def __new__(cls, text: str, tokens: list):
        out = super().__new__(cls, text)
        out.tokens = tokens
        return out


@functools.lru_cache(maxsize=1)
def _byte_level_alphabet() -> dict[str, int]:
    """Each character of the byte-level BPE alphabet (GPT-2's; SmolLM2's and most Llama-3-era tokenizers') back
    to the byte it stands for."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {c: b for b, c in bytes_to_unicode().items()}


def token_bytes(tokenizer, token_id: int) -> bytes:
    """The bytes a token stands for (``tokenizer``: a Rust ``tokenizers.Tokenizer``): exact for a byte-level
    BPE vocabulary, where one token may hold part of a character; otherwise its decoded text's UTF-8."""
    from tokenizers import decoders

    alphabet, piece = _byte_level_alphabet(), tokenizer.id_to_token(token_id)
    if isinstance(tokenizer.decoder, decoders.ByteLevel) and piece and all(c in alphabet for c in piece):
        return bytes(alphabet[c] for c in piece)
    return tokenizer.decode([token_id], skip_special_tokens=False).encode()


def token_entries(tokenizer, entries, offset: int = 0) -> list[dict]:
    """``Logprobs`` entries as the reply's tokens: ``{"id", "token", "bytes", "logprob", "top": [...],
    "offset"}`` (the token's text -- its bytes decoded, a partial character as U+FFFD -- and its alternatives
    alike; ``offset``: where the token's text starts in the reply's, counting the tokens' texts from
    ``offset``)."""
    def one(tid, lp):
        b = token_bytes(tokenizer, tid)
        return {"id": tid, "token": b.decode("utf-8", errors="replace"), "bytes": list(b), "logprob": lp}

    out = []
    for tid, lp, top in entries:
        out.append(dict(one(tid, lp), top=[one(i, v) for i, v in top], offset=offset))
        offset += len(out[-1]["token"])
    return out


def chat_logprobs(tokens: list[dict]) -> dict:
    """A chat choice's ``logprobs`` (OpenAI's ``ChoiceLogprobs``)."""
    def entry(t):
        return {"token": t["token"], "logprob": t["logprob"], "bytes": t["bytes"]}

    return {"content": [dict(entry(t), top_logprobs=[entry(a) for a in t["top"]]) for t in tokens],
            "refusal": None}


def completion_logprobs(tokens: list[dict]) -> dict:
    """A completion choice's ``logprobs`` (OpenAI's legacy ``Logprobs``): the tokens, their log probabilities,
    each one's alternatives with the chosen token among them (as OpenAI's API always returns it), and where each
    token's text starts in the reply."""
    return {"tokens": [t["token"] for t in tokens], "token_logprobs": [t["logprob"] for t in tokens],
            "top_logprobs": [{a["token"]: a["logprob"] for a in (*t["top"], t)} for t in tokens],
            "text_offset": [t["offset"] for t in tokens]}


def stream_with_logprobs(streamer, asked: Asked, offset: int = 0) -> None:
    """Make transformers' ``CBStreamer`` put ``TokenText`` on its queue: each piece of text with the
    log-probability entries of the tokens decoded into it (a token whose text the decoder holds back, part of a
    character, goes with the next piece). The decoding is the streamer's own (its decode stream, step by
    step); the replies it streams are text only (no response parser: ``generate_streaming`` refuses one).
    ``offset``: where the reply's text starts in what the client reads (after an echoed prompt)."""
    pending: list[int] = []

    def put(output) -> None:
        nonlocal offset
        start = streamer._prev_len
        new = output.generated_tokens[start:]
        streamer._prev_len = len(output.generated_tokens)
        for i, token_id in enumerate(new):
            streamer.total_tokens += 1
            pending.append(start + i)
            text = streamer._decode_stream.step(streamer._tokenizer, token_id)
            if text is None:
                continue
            entries = asked.take(pending[0], pending[-1] + 1)
            pending.clear()
            tokens = token_entries(streamer._tokenizer, entries, offset)
            offset = tokens[-1]["offset"] + len(tokens[-1]["token"])
            streamer._queue.put_nowait(TokenText(text, tokens))

    streamer.put = put


# --------------------------------------------------------------------------- n choices
async def n_choices(handle, body: dict, request_id: str, n: int, best: int = 1):
    """A request for ``n`` choices -- of each prompt, when a completion gives a list of prompts -- as that many
    requests of one choice each, run in one batch (``handle(body, id)``: transformers' handler), their replies
    merged: choice ``i`` from request ``i`` (prompt ``i // n``'s, as OpenAI orders them), usage summed over the
    completions and over the prompts (each counted once); streamed, their events interleaved as they come
    (``_merged_streams``). Each choice samples (or not) as the request asks; greedy choices of one prompt are
    equal, as OpenAI's are at temperature 0. ``best`` > ``n`` (a completion's ``best_of``): that many
    candidates per prompt, of which the ``n`` with the highest mean log probability per generated token are
    the choices (in that order; the usage counts every candidate's tokens, as OpenAI's does)."""
    from fastapi.responses import JSONResponse, StreamingResponse

    prompts = completion_prompts(body["prompt"]) if "prompt" in body else [None]
    seed = body.get("seed")
    per = max(best, n)  # requests per prompt
    asks = []
    for p in prompts:
        for _ in range(per):
            ask = {k: v for k, v in body.items() if k != "best_of"} | {"n": 1} | ({} if p is None else {"prompt": p})
            if per > n and ask.get("logprobs") is None:
                ask["logprobs"] = 0  # each candidate's own log probabilities rank it (not given back)
            if seed is not None:  # seeded choices take seed, seed + 1, ... (wrapping around the 64-bit range): the
                # same seed would give equal replies
                ask["seed"] = (seed + len(asks) - SEEDS[0]) % 2**64 + SEEDS[0]
            asks.append(ask)
    replies = await asyncio.gather(*(handle(b, f"{request_id}-{i}") for i, b in enumerate(asks)))
    if body.get("stream"):
        return StreamingResponse(_merged_streams([r.body_iterator for r in replies], request_id),
                                 media_type="text/event-stream")
    bad = next((r for r in replies if r.status_code != 200), None)
    if bad is not None:
        return bad
    bodies = [json.loads(r.body) for r in replies]
    out = dict(bodies[0], id=request_id, choices=[])
    for i in range(0, len(bodies), per):
        group = bodies[i:i + per]
        if per > n:
            group = sorted(group, key=lambda b: -_per_token_logprob(b))[:n]  # stable: ties keep their order
        for b in group:
            choice = b["choices"][0]
            if per > n and body.get("logprobs") is None:
                choice = dict(choice, logprobs=None)
            out["choices"].append(dict(choice, index=len(out["choices"])))
    usage = [b.get("usage") for b in bodies]
    if all(usage):
        done = sum(u["completion_tokens"] for u in usage)
        prompt = sum(u["prompt_tokens"] for u in usage[::per])
        out["usage"] = dict(usage[0], prompt_tokens=prompt, completion_tokens=done, total_tokens=prompt + done)
    return JSONResponse(out)


def _per_token_logprob(reply: dict) -> float:
    """A one-choice completion's mean log probability per generated token (its last ``completion_tokens``
    entries: an echoed prompt's come first); 0 when it generated none."""
    generated = reply["usage"]["completion_tokens"]
    scores = reply["choices"][0]["logprobs"]["token_logprobs"][-generated:] if generated else []
    return sum(scores) / len(scores) if scores else 0.0


async def _merged_streams(streams, request_id: str):
    """Server-sent events of ``n`` streamed replies as one stream: each event of stream ``i`` as it comes, its
    choices given index ``i`` and the request's id. A client that goes away closes every stream (transformers'
    generator then cancels its request)."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i, stream):
        try:
            async for part in stream:
                await queue.put((i, part))
        finally:
            await queue.put((i, None))

    tasks = [asyncio.ensure_future(pump(i, st)) for i, st in enumerate(streams)]
    try:
        open_ = len(streams)
        while open_:
            i, part = await queue.get()
            if part is None:
                open_ -= 1
                continue
            text = part.decode() if isinstance(part, bytes) else part
            out = []
            for event in text.split("\n\n"):
                if event.startswith("data: {"):
                    chunk = json.loads(event[6:])
                    if isinstance(chunk.get("choices"), list):
                        chunk["id"] = request_id
                        for c in chunk["choices"]:
                            c["index"] = i
                    event = "data: " + json.dumps(chunk)
                if event.strip():
                    out.append(event + "\n\n")
            if out:
                yield "".join(out)
    finally:
        for t in tasks:
            t.cancel()
        for st in streams:
            close = getattr(st, "aclose", None)
            if close is not None:
                try:
                    await close()
                except Exception:  # noqa: BLE001 -- a stream that already ended or failed
                    pass


EXTENSIONS = ("top_k",)  # request fields beyond OpenAI's that kvcompile serve reads (vLLM's spelling)
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "seed")  # what ``request_sampling`` reads of a request


def prompt_inputs(inputs, options: RequestOptions) -> None:
    """The request's input ids, as it is generated: a prompt of token ids (``options.prompt_ids``) in place of
    the tokenized text that transformers' handler made of its decoding; and, where the prompt's log
    probabilities are asked, the ids they are recorded for."""
    if options.prompt_ids is not None:
        inputs["input_ids"], inputs["attention_mask"] = list(options.prompt_ids), [1] * len(options.prompt_ids)
    a = options.asked
    if a is not None and a.prompt is not None:
        a.prompt = list(inputs["input_ids"])


ASKED_FIELDS = ("logprobs", "top_logprobs", "presence_penalty", "frequency_penalty", "logit_bias",
                "response_format")


def asked_of(body: dict, chat: bool) -> Asked | None:
    """What a request asks of its tokens beyond how they are drawn (log probabilities, penalties, a logit bias,
    JSON mode), or None when nothing."""
    asked = Asked(top=logprobs_asked(body, chat), presence=float(body.get("presence_penalty") or 0),
                  frequency=float(body.get("frequency_penalty") or 0),
                  bias={int(k): float(v) for k, v in (body.get("logit_bias") or {}).items()},
                  json_mode=(body.get("response_format") or {}).get("type") in ("json_object", "json_schema"),
                  json_schema=response_schema(body.get("response_format")))
    return asked if asked.top is not None or asked.adjusts or asked.json_mode else None


def prepare_asked(a: Asked | None, model, processor) -> None:
    """What a request asks of its tokens, for the model it runs on: a logit bias naming a token the model does
    not have is refused (400); JSON mode gets its constraint over the model's vocabulary, ending at its
    end-of-sequence token."""
    if a is None:
        return
    vocab = model.config.get_text_config().vocab_size
    bad = sorted(t for t in a.bias if t >= vocab)
    if bad:
        raise RequestError(f"'logit_bias' names token ids {bad[:5]} outside the model's vocabulary (ids 0 to "
                           f"{vocab - 1})", "logit_bias")
    eos = model.generation_config.eos_token_id
    stops = [t for t in (eos if isinstance(eos, (list, tuple)) else [eos]) if isinstance(t, int) and t >= 0]
    a.eos = stops[0] if stops else None  # where a request that fails ends (sampling.guarded)
    if a.json_mode and a.json is None:
        from .errors import UnsupportedError
        from .json_mode import JsonConstraint, SchemaError, grammar, tokenizer_info

        if not stops:
            raise RequestError("JSON mode ends a reply with the model's end-of-sequence token, and this model's "
                               "generation config has none", "response_format")
        try:  # (the schema was checked when the request came: what is left is llguidance's, over this vocabulary)
            a.json = JsonConstraint(tokenizer_info(getattr(processor, "tokenizer", processor), vocab, tuple(stops)),
                                    grammar(a.json_schema))
        except (UnsupportedError, SchemaError) as e:
            raise RequestError(f"'response_format': {e}", "response_format") from None


def with_choice(sse: str, **fields) -> str:
    """A streamed chunk (an SSE ``data:`` line of one choice) with ``fields`` set on its choice."""
    chunk = json.loads(sse.removeprefix("data: "))
    chunk["choices"][0].update(fields)
    return f"data: {json.dumps(chunk)}\n\n"


def echo_logprobs(tokenizer, asked: Asked) -> dict:
    """A completion's ``logprobs`` for its echoed prompt (``completion_logprobs``): the first token with none,
    as OpenAI's echo gives it."""
    lp = completion_logprobs(token_entries(tokenizer, [(asked.prompt[0], None, [])] + asked.take_prompt()))
    lp["top_logprobs"][0] = None
    return lp


def failure_body(failed: str) -> dict:
    """The error a client gets for a request whose token picking failed (``sampling.guarded``)."""
    return error_body(f"generation failed for this request ({failed}); the server goes on", type_="server_error")


class EvictionCounter(logging.Handler):
    """Requests transformers' continuous batching evicted to make room (soft reset: freed, re-queued, re-prefilled
    later), counted from the one line its offloading manager logs for them at INFO
    ("Offloaded N requests (...)") on its own ``ContinuousBatchingLogger``; that logger's other output is left
    at the level it had."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.evicted = 0
        cb_logger = logging.getLogger("ContinuousBatchingLogger")
        before = cb_logger.getEffectiveLevel()
        for h in cb_logger.handlers:
            if h.level == logging.NOTSET:
                h.setLevel(before)
        if before > logging.INFO:
            cb_logger.setLevel(logging.INFO)
        cb_logger.addHandler(self)

    def emit(self, record) -> None:
        words = record.getMessage().split()
        if len(words) > 1 and words[0] == "Offloaded" and words[1].isdigit():
            self.evicted += int(words[1])


def model_names(model_dir: str, served_names=()) -> list[str]:
    """The names a request may give the served model as: ``served_names`` (``--served-model-name``), then the
    model's directory as given and its last part (``SmolLM2-135M-Instruct``)."""
    names = [*served_names, model_dir, os.path.basename(os.path.normpath(model_dir))]
    return list(dict.fromkeys(n for n in names if n))


def start_engine(manager, state, model_dir: str) -> None:
    """Start the continuous-batching engine and build its cache now, not at the first request: a configuration
    that cannot serve one request (a budget that holds no block once the slots are paid, buffers for
    ``max_batch_tokens`` that do not fit in memory) is refused at start-up, saying why, instead of answering
    every request with a 500. The engine samples per request (``init_cb``), so the model's own generation
    config is what it starts with."""
    model, _ = manager.load_model_and_processor(model_dir)
    gen = state.get_manager(model_dir, use_cb=True)
    gen.init_cb(model, model.generation_config)
    first_request(gen._cb)


STARTUP_REQUEST_S = 900  # the first request builds the kernels (a second or two each; minutes on a loaded machine)


class Held(logging.Filter):
    """A logger's filter that holds back every record it is given (``records``), for its owner to handle later
    or drop."""

    def __init__(self):
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def filter(self, record) -> bool:
        self.records.append(record)
        return False


def first_request(cb, timeout_s: float = STARTUP_REQUEST_S) -> None:
    """Run one request of two tokens through the started engine ``cb``: the CPU kernels of every layer's store
    layout are built now (a missing C compiler, an unwritable kernel cache, a layout the kernels refuse are said at
    start-up), and none is built -- nor killed halfway by a stop signal sent to the process group -- while clients
    wait."""
    rid = "kvcompile-startup"
    # what the engine logs meanwhile: its traceback of an error kvcompile says in one line is dropped
    cb_logger, hold = logging.getLogger("ContinuousBatchingLogger"), Held()
    cb_logger.addFilter(hold)
    error = None
    try:
        cb.add_request([0, 0], request_id=rid, max_new_tokens=2, streaming=False)
        deadline = time.monotonic() + timeout_s
        while error is None:
            out = cb.get_result(request_id=rid, timeout=1)
            fatal = cb.background_thread_status.fatal_error
            if fatal is None and out is not None and out.error is not None:  # the engine's own error comes next
                stop = time.monotonic() + 5
                while cb.background_thread_status.fatal_error is None and cb.is_running() and time.monotonic() < stop:
                    time.sleep(0.05)
                fatal = cb.background_thread_status.fatal_error
            if fatal is not None or (out is not None and out.error is not None):
                error = fatal or out.error
            elif out is not None and out.is_finished():
                break
            elif time.monotonic() > deadline or not cb.is_running():
                error = f"no reply to a request of two tokens within {timeout_s} s"
    finally:
        cb_logger.removeFilter(hold)
        if not isinstance(error, KVCompileError):  # anything else keeps its log (a defect's traceback)
            for record in hold.records:
                cb_logger.handle(record)
    if error is not None:
        raise UnsupportedError(f"kvcompile serve: the engine could not serve a first request at start-up: "
                               + (str(error) if isinstance(error, (str, KVCompileError)) else
                                  f"{type(error).__name__}: {error}"))


SHUTDOWN_GRACE_S = 10.0  # default seconds requests in flight may take to finish once the server is told to stop


