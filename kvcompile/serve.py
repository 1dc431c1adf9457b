"""``kvcompile serve``: transformers' OpenAI-compatible server (``transformers serve --continuous-batching``)
with continuous batching over kvcompile's packed cache.

transformers' own pieces, unchanged: its ``ModelManager`` (loading, the tokenizer), its chat-completion and
completion handlers (streaming and not, request validation), its FastAPI app and uvicorn. One piece is
ours: the model manager applies ``kvcompile.apply(model, policy)`` to each model it loads, so the
continuous-batching manager the handlers start (``model.init_continuous_batching``) is kvcompile's
(``kvcompile.serving``).

What ``kvcompile serve`` adds in front of transformers' handlers (``build_app``): requests are checked before they
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
stream. Launched by torchrun with several processes, the model is sharded over them (``run_tensor_parallel``).

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
import contextlib
import contextvars
import functools
import json
import logging
import os
import time

import torch

from .errors import ArgumentError, KVCompileError, UnsupportedError
from .sampling import MAX_TOP_LOGPROBS, Asked, RequestOptions, Requests, request_sampling, sampling_manager


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


def openai_app(manager, state, *, checked: bool = False):
    """transformers' OpenAI-compatible FastAPI app (its handlers, as ``transformers serve`` builds them) over a
    model manager and a generation state. ``checked``: the chat and completion handlers check each request
    first (``_checked_handlers``), and errors answer in OpenAI's shape."""
    require_server_transformers()
    from transformers.cli.serving.chat_completion import ChatCompletionHandler
    from transformers.cli.serving.completion import CompletionHandler
    from transformers.cli.serving.response import ResponseHandler
    from transformers.cli.serving.server import build_server
    from transformers.cli.serving.systemone import SystemOneHandler
    from transformers.cli.serving.transcription import TranscriptionHandler

    if checked:
        ChatCompletionHandler, CompletionHandler, ResponseHandler = _checked_handlers()
    app = build_server(
        manager, ChatCompletionHandler(model_manager=manager, generation_state=state),
        completion_handler=CompletionHandler(model_manager=manager, generation_state=state),
        response_handler=ResponseHandler(model_manager=manager, generation_state=state),
        transcription_handler=TranscriptionHandler(manager, state),
        systemone_handler=SystemOneHandler(model_manager=manager, generation_state=state),
        generation_state=state)
    if checked:
        _openai_errors(app)
        app.add_middleware(ClientConnection)
    return app


# --------------------------------------------------------------------------- clients that go away
DISCONNECT_POLL_S = 0.2  # how often a non-streaming request checks that its client is still connected

_CLIENT: contextvars.ContextVar = contextvars.ContextVar("kvcompile_client", default=None)


class ClientConnection:
    """ASGI middleware (outermost): each HTTP request runs with its connection at hand (``_CLIENT``: a Starlette
    ``Request`` over the server's own ``receive``; transformers' routes call its handlers without it). The
    handler puts it in the request's options (``RequestOptions.client``), where the generation manager finds it
    to tell whether the client is still there (``watch_client``)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        from starlette.requests import Request

        token = _CLIENT.set(Request(scope, receive))
        try:
            await self.app(scope, receive, send)
        finally:
            _CLIENT.reset(token)


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
    """The server is shutting down (``GracefulServer``): a request still running when its grace period ended, or
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


def _openai_errors(app) -> None:
    """Every error of the app in OpenAI's shape: ours, FastAPI's (a body that is not a JSON object), the
    handlers' ``HTTPException`` (an unknown model, unexpected fields), and anything else (a 500 without a
    traceback; the traceback goes to the server's log)."""
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException
    from transformers.cli.serving.utils import CBWorkerDeadError

    @app.exception_handler(RequestError)
    async def _ours(_request, exc: RequestError):
        return JSONResponse(error_body(exc.message, exc.param, exc.code), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _body(_request, exc: RequestValidationError):
        errs = exc.errors()
        if any(e.get("type") == "json_invalid" for e in errs):
            msg = "the request body is not valid JSON: " + "; ".join(
                str(e.get("ctx", {}).get("error", e.get("msg"))) for e in errs)
        else:
            msg = "the request body must be a JSON object: " + "; ".join(str(e.get("msg")) for e in errs)
        return JSONResponse(error_body(msg), status_code=400)

    @app.exception_handler(ClientDisconnected)
    async def _gone(_request, exc: ClientDisconnected):
        return JSONResponse(error_body(str(exc), code="client_disconnected", type_="client_disconnected"),
                            status_code=499)  # nginx's "client closed request"; the client is gone, nobody reads it

    @app.exception_handler(CBWorkerDeadError)
    async def _dead(_request, exc: CBWorkerDeadError):  # transformers' answers {"error": "..."}: OpenAI's shape here
        return JSONResponse(error_body(" ".join(str(exc).split())[:1000], code="engine_stopped", type_="server_error"),
                            status_code=503)

    @app.exception_handler(ServerStopping)
    async def _stopping(_request, exc: ServerStopping):
        return JSONResponse(error_body(str(exc), code="server_shutting_down", type_="server_error"),
                            status_code=503)

    @app.exception_handler(HTTPException)
    async def _http(_request, exc: HTTPException):
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return JSONResponse(error_body(str(exc.detail), type_=kind), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _other(_request, exc: Exception):
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}", type_="server_error"),
                            status_code=500)


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


async def _after(first, stream, scored: bool = False):
    """``first``, then the events of ``stream`` (closed with this stream: transformers' then cancels its
    request). ``scored``: ``first`` is a function whose piece needs the prompt scored by the prefill, called
    once the stream's first event has come; a request that ended before (a KeyError: nothing scored) streams
    without it."""
    def piece():
        try:
            return first()
        except KeyError:  # no prompt entries: the request failed or was cancelled before its prefill
            return None

    try:
        if not scored:
            yield first
        async for part in stream:
            if scored:
                scored, head = False, piece()
                if head is not None:
                    yield head
            yield part
        if scored and (head := piece()) is not None:
            yield head
    finally:
        close = getattr(stream, "aclose", None)
        if close is not None:
            await close()


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


async def _closing(stream, asked: Asked | None, release):
    """A streamed reply's events (and, if its token picking failed, an error event at its end); once it ends
    (or its client goes away) ``release()`` drops the request's options from the server's table and the reply's
    own stream is closed (transformers' stream then cancels its request)."""
    try:
        async for part in stream:
            yield part
        if asked is not None and asked.failed is not None:
            yield f"data: {json.dumps(failure_body(asked.failed))}\n\n"
    finally:
        release()
        close = getattr(stream, "aclose", None)
        if close is not None:
            await close()


# request fields transformers' handlers list as unused that this server reads and honours (or refuses a value of)
HANDLED_FIELDS = {"n", "logprobs", "top_logprobs", "presence_penalty", "response_format", "tool_choice", "best_of",
                  "echo"}


def _checked_handlers():
    """transformers' chat-completion and completion handlers, checking each request first (``check_*``) and
    marking its generation config for ``fit_to_cache``: which field holds the prompt, whether the client set
    the reply's length. A request that asks more of its tokens has it done (``_asked``)."""
    from fastapi.responses import JSONResponse, StreamingResponse
    from transformers.cli.serving.chat_completion import ChatCompletionHandler
    from transformers.cli.serving.completion import CompletionHandler
    from transformers.cli.serving.response import ResponseHandler

    def checked(handler_cls, check, prompt_field, max_fields, chat):
        logprobs_of = chat_logprobs if chat else completion_logprobs

        class Checked(handler_cls):
            async def handle_request(self, body: dict, request_id: str):
                # a field given as null is a field not given (OpenAI's reading; transformers' handlers took some
                # nulls as values: ``**None`` for chat_template_kwargs)
                body = {k: v for k, v in body.items() if v is not None}
                check_common(body)
                if body["model"] in getattr(self.model_manager, "kvcompile_names", ()):  # the served model's names
                    body = {**body, "model": self.model_manager.force_model}
                check(body)
                if chat and body.get("tools") and body.get("tool_choice") != "none":
                    processor = self._resolve_model(dict(body))[2]
                    if not template_shows_tools(getattr(processor, "tokenizer", processor)):
                        raise RequestError("'tools' would be ignored: this model's chat template does not put tools "
                                           "in its prompt, so the model never sees them; leave them out (or set "
                                           "'tool_choice': 'none'), or serve a model whose template takes tools",
                                           "tools")
                if handler_cls is ResponseHandler:
                    # OpenAI's Responses API answers with one JSON object unless asked to stream (transformers'
                    # handler streamed unless asked not to); its JSON mode is text.format
                    body = {**body, "stream": body.get("stream", False)}
                    fmt = (body.get("text") or {}).get("format") or {}
                    if fmt.get("type") in ("json_object", "json_schema"):
                        body = {k: v for k, v in body.items() if k != "text"}
                        return await self._asked({**body, "response_format": fmt}, request_id, RequestOptions())
                    return await self._run(body, request_id, RequestOptions())
                # fields of ours that transformers' handler would answer 422 (unexpected): read here, passed aside
                extensions = {k: body[k] for k in EXTENSIONS if k in body}
                body = {k: v for k, v in body.items() if k not in EXTENSIONS}
                n, best = body.get("n") or 1, body.get("best_of") or 1
                one = functools.partial(self._one_choice, extensions=extensions)
                if n == best == 1 and (chat or len(completion_prompts(body.get("prompt"))) == 1):
                    if not chat:  # one prompt: a string, or its token ids (not a list of one string)
                        body = {**body, "prompt": completion_prompts(body["prompt"])[0]}
                    return await one(body, request_id)
                return await n_choices(one, body, request_id, n, best=max(best, n))

            async def _one_choice(self, body: dict, request_id: str, extensions: dict):
                """One choice (its options start with the request's ``extensions``). A completion's prompt of token
                ids is generated from those ids (``prompt_inputs``); its text, for transformers' handler and the
                echo, is their decoding."""
                options = RequestOptions(fields=dict(extensions))
                if not chat and isinstance(body.get("prompt"), list):
                    ids = completion_prompts(body["prompt"])[0]
                    _, model, processor = self._resolve_model(dict(body))
                    vocab = model.get_input_embeddings().num_embeddings
                    if max(ids) >= vocab:
                        raise RequestError(f"'prompt' holds the token id {max(ids)}, past the model's vocabulary "
                                           f"(ids 0 to {vocab - 1})", "prompt")
                    body = {**body, "prompt": getattr(processor, "tokenizer", processor).decode(ids)}
                    options.prompt_ids = ids
                return await self._echoed(body, request_id, options)

            async def _echoed(self, body: dict, request_id: str, options: RequestOptions):
                """One choice (``_asked``); a completion asking for ``echo`` has its prompt in front of its text
                (streamed: the first piece), and with ``logprobs`` the prompt tokens' log probabilities in front
                of its own."""
                if chat or not body.get("echo"):
                    return await self._asked(body, request_id, options)
                prompt, nothing = body["prompt"], body.get("max_tokens") == 0
                if nothing and body.get("stream"):  # the prompt alone, as one reply's events
                    return await self._streamed_prompt(body, request_id, options)
                # max_tokens 0 (the prompt alone, as OpenAI scores a text): one token is generated, then dropped
                reply = await self._asked({k: v for k, v in body.items() if k != "echo"}
                                          | ({"max_tokens": 1} if nothing else {}), request_id, options,
                                          echo=body.get("logprobs") is not None)
                if isinstance(reply, StreamingResponse):
                    if body.get("logprobs") is None:  # with them, _asked streams the prompt once it is scored
                        first = self._build_chunk_sse(request_id, body["model"], text=prompt)
                        reply.body_iterator = _after(first, reply.body_iterator)
                    return reply
                if reply.status_code != 200:
                    return reply
                out = json.loads(reply.body)
                choice = out["choices"][0]
                if nothing:
                    choice["text"], choice["finish_reason"] = "", "length"
                    if choice.get("logprobs"):
                        choice["logprobs"] = {k: v[:-1] for k, v in choice["logprobs"].items()}
                    out["usage"].update(completion_tokens=0, total_tokens=out["usage"]["prompt_tokens"])
                choice["text"] = prompt + choice["text"]
                return JSONResponse(out)

            async def _streamed_prompt(self, body: dict, request_id: str, options: RequestOptions):
                """A streamed completion of the prompt alone (echo, ``max_tokens`` 0): the reply it gives
                unstreamed, sent as a stream's events -- the prompt (and its log probabilities), then the end
                with the usage."""
                from fastapi.responses import StreamingResponse
                from openai.types import CompletionUsage

                reply = await self._echoed({**body, "stream": False}, request_id, options)
                if reply.status_code != 200:
                    return reply
                out = json.loads(reply.body)
                choice = out["choices"][0]

                async def events():
                    yield with_choice(self._build_chunk_sse(request_id, body["model"], text=choice["text"]),
                                      logprobs=choice.get("logprobs"))
                    yield self._build_chunk_sse(request_id, body["model"], finish_reason=choice["finish_reason"],
                                                usage=CompletionUsage(**out["usage"]))

                return StreamingResponse(events(), media_type="text/event-stream")

            async def _asked(self, body: dict, request_id: str, options: RequestOptions, echo: bool = False):
                """One choice. A request that asks more of its tokens (``asked_of``: log probabilities,
                penalties, a logit bias, JSON mode) has them in its options (``RequestOptions.asked``): its tokens
                are adjusted and recorded as they are picked, and its log probabilities given in the reply --
                streamed, with each piece of text (``stream_with_logprobs``, ``_build_chunk_sse``); not, for
                every token of the reply (``usage.completion_tokens``). ``echo``: the prompt's log probabilities
                too, in front (recorded as the prefill computes them: ``engine.PagedKVCompileCache``)."""
                asked = options.asked = asked_of(body, chat)
                if echo:
                    asked.prompt = []  # its ids once the request is generated (prompt_inputs)
                    options.echo_offset = len(body["prompt"])
                # done here: transformers' handler would log them as ignored (or map them to config it never reads)
                body = {k: v for k, v in body.items() if k not in ASKED_FIELDS}
                reply = await self._run(body, request_id, options)
                if asked is None:
                    return reply
                if isinstance(reply, StreamingResponse):
                    if echo:
                        def prompt_chunk():
                            sse = self._build_chunk_sse(request_id, body["model"], text=body["prompt"])
                            return with_choice(sse, logprobs=echo_logprobs(options.tokenizer, asked))
                        reply.body_iterator = _after(prompt_chunk, reply.body_iterator, scored=True)
                    return reply
                if reply.status_code == 200 and asked.failed is not None:
                    return JSONResponse(failure_body(asked.failed), status_code=500)
                if reply.status_code != 200 or asked.top is None:
                    return reply
                out = json.loads(reply.body)
                tokens = token_entries(options.tokenizer, asked.take(0, out["usage"]["completion_tokens"]),
                                       options.echo_offset)
                lp = logprobs_of(tokens)
                if echo:  # the prompt's tokens first
                    lp = {k: v + lp[k] for k, v in echo_logprobs(options.tokenizer, asked).items()}
                out["choices"][0]["logprobs"] = lp
                return JSONResponse(out)

            async def _run(self, body: dict, request_id: str, options: RequestOptions):
                """transformers' handler for one request, its options kept in the server's table under its id
                (``sampling.Requests``: the generation manager, the engine and its processors read them there)
                until its reply is out: a streamed reply's end, or its client going away."""
                stop = body.get("stop")
                options.fields.update({k: body[k] for k in SAMPLING_FIELDS if k in body})
                options.stop = [stop] if isinstance(stop, str) else list(stop or ())
                options.open_length = all(body.get(f) is None for f in max_fields)
                options.max_field, options.prompt_field = max_fields[0], prompt_field
                options.client = _CLIENT.get()  # its connection (``ClientConnection``), watched while it waits
                requests = self.generation_state.requests
                if requests.of(request_id) is not None:
                    raise RequestError(f"a request with id {request_id!r} is running already: give each request its "
                                       f"own X-Request-ID", code="duplicate_request_id")
                requests.add(request_id, options)
                streams = False
                try:
                    reply = await super().handle_request(body, request_id)
                    if isinstance(reply, StreamingResponse):
                        reply.body_iterator = _closing(reply.body_iterator, options.asked,
                                                       functools.partial(requests.remove, request_id))
                        streams = True
                    return reply
                finally:
                    if not streams:
                        requests.remove(request_id)

            def _build_chunk_sse(self, *args, **kw):
                """transformers' streamed chunk; a piece of text with its tokens' log probabilities
                (``TokenText``) gives them as the chunk's ``logprobs``."""
                sse = super()._build_chunk_sse(*args, **kw)
                tokens = getattr(kw.get("content", kw.get("text")), "tokens", None)
                return sse if tokens is None else with_choice(sse, logprobs=logprobs_of(tokens))

        # transformers' handler logs the fields it ignores; those this server reads are not ignored
        Checked._unused_fields = set(handler_cls._unused_fields) - HANDLED_FIELDS
        Checked.__name__ = Checked.__qualname__ = "Checked" + handler_cls.__name__
        return Checked

    return (checked(ChatCompletionHandler, check_chat, "messages", ("max_tokens", "max_completion_tokens"), True),
            checked(CompletionHandler, check_completion, "prompt", ("max_tokens",), False),
            checked(ResponseHandler, check_response, "input", ("max_output_tokens",), True))


def checked_state(decider=None, **kw):
    """transformers' ``GenerationState`` whose continuous-batching generation manager samples per request and fits
    each request to the cache (``fit_to_cache``) before it is queued. Each request's options are in its
    ``requests`` (``sampling.Requests``), by request id, while it runs. ``decider``: under tensor parallelism, the
    process group whose first rank picks every token (``sampling.RoutedProcessors``)."""
    from transformers.cli.serving.utils import CBGenerateManager, GenerationState, _StreamError

    class Stopped(_StreamError):
        """Put on a stream's queue when the server stops its request (``end_all``): transformers' stream sends its
        message as an error event (``data: {"error": msg}``, so no quotes in it) and ends."""

    class CheckedCBGenerateManager(CBGenerateManager):
        def __init__(self, cb_config, requests: Requests, decider=None):
            super().__init__(cb_config)
            self.requests, self.decider = requests, decider
            self._open: dict = {}  # the requests in flight (``_in_flight``)
            self.stopping: str | None = None  # why the server is stopping (``end_all``); None: it serves
            self.disconnected = 0  # requests cancelled because their client went away

        def init_cb(self, model, gen_config) -> None:
            """transformers starts its continuous-batching manager with the first request's generation config and
            applies that config's sampling to every later request. Here it starts sampling per request
            (``sampling_manager``) and each request is added with its own (``RequestOptions.sampling``)."""
            if self._cb is None:
                cb = sampling_manager(model, gen_config, self._cb_config, self.requests, self.decider)
                # the cache is built here, not in the batching thread: what cannot be built is raised to the caller
                # (``start_engine``: at start-up) rather than left to fail every request
                cb.batch_processor = cb._create_batch_processor()
                cb.start()
                self._cb = cb

        # ---- requests in flight, which ``end_all`` ends when the server stops (``GracefulServer``)
        def _in_flight(self) -> dict:
            """Request id: ``(how to end it: a function of the reason, whether it streams)`` for the requests still
            running. A stream whose request is done (transformers dropped its result handler) is left out: it ends
            by itself; a reply waited for leaves when it resolves (``_ending``)."""
            open_ = self._open
            router = getattr(self._cb, "output_router", None)
            if router is not None:
                with router._lock:
                    running = set(router.result_handlers)
                for rid in [r for r, (_, streams) in open_.items() if streams and r not in running]:
                    del open_[rid]
            return open_

        def _refuse_if_stopping(self) -> None:
            if self.stopping is not None:
                raise ServerStopping(self.stopping)

        def end_all(self, why: str) -> int:
            """End every request in flight now, cleanly (the server is stopping): each is cancelled (its pages and
            slot come back); a stream gets an error event saying ``why`` and its end, a reply waited for a 503; a
            request that comes later is refused alike. How many were ended."""
            self.stopping = why
            ended = list(self._in_flight().values())
            for end, _ in ended:
                end(why)
            self._in_flight().clear()
            return len(ended)

        def _ending(self, request_id: str, work: asyncio.Future) -> asyncio.Future:
            """``work`` (a reply waited for) as a future that ``end_all`` may end first, with ``ServerStopping``."""
            out = asyncio.get_running_loop().create_future()

            def finished(w):
                self._in_flight().pop(request_id, None)
                if out.done():
                    return
                if w.cancelled():
                    out.cancel()
                elif w.exception() is not None:
                    out.set_exception(w.exception())
                else:
                    out.set_result(w.result())

            def end(why):
                if not out.done():
                    self.cancel(request_id)
                    work.cancel()
                    out.set_exception(ServerStopping(why))

            work.add_done_callback(finished)
            if not work.done():
                self._in_flight()[request_id] = (end, False)
            return out

        def _options(self, model, request_id: str) -> RequestOptions:
            """The request's options (a request from a handler of transformers' that kvcompile's do not wrap has
            none: it decodes as the manager's processors default, greedily), its sampling set from the model's
            generation config as ``generate`` reads it."""
            options = self.requests.of(request_id) or RequestOptions()
            options.sampling = request_sampling(options.fields, model.generation_config)
            return options

        def generate_streaming(self, model, processor, inputs, gen_config, request_id, **kw):
            self._refuse_if_stopping()
            options = self._options(model, request_id)
            prompt_inputs(inputs, options)
            fit_to_cache(self._cb, model, inputs, gen_config, options)
            asked = options.asked
            prepare_asked(asked, model, processor)
            logprobs = asked is not None and asked.top is not None
            for field, on in (("stop", options.stop), ("logprobs", logprobs)):
                if on and kw.get("response_parser") is not None:
                    raise RequestError(f"'{field}' is not supported for this model's replies (its chat template's "
                                       f"tool-call parser reads the reply as it streams); leave it out", field)
            queue, streamer = super().generate_streaming(model, processor, inputs, gen_config, request_id, **kw)
            # installed before the event loop (this thread) can deliver the request's first output
            if logprobs:
                options.tokenizer = streamer._tokenizer
                stream_with_logprobs(streamer, asked, options.echo_offset)
            if options.stop:
                streamer._queue = StopAt(queue, options.stop, lambda: self.cancel(request_id))

            def end(why):
                self.cancel(request_id)
                queue.put_nowait(Stopped(why))  # transformers' stream sends it as an error event, then ends

            self._in_flight()[request_id] = (end, True)
            return queue, streamer

        def _generate_until_stop(self, model, processor, inputs, gen_config, request_id) -> asyncio.Future:
            """A non-streaming reply with stop strings: streamed inside (``StopAt``; ``generate_streaming`` fits it
            to the cache) and gathered, so that the request ends at its first stop string, not at max_tokens."""
            queue, streamer = self.generate_streaming(model, processor, inputs, gen_config, request_id)
            ids: list[int] = []
            put = streamer.put

            def record(output):
                ids[:] = output.generated_tokens
                put(output)

            streamer.put = record  # before the event loop (this thread) can deliver the request's first output

            async def gathered():
                parts = []
                while (item := await queue.get()) is not None:
                    if isinstance(item, Stopped):
                        raise ServerStopping(item.msg)
                    if not isinstance(item, str):  # transformers' stream error
                        raise UnsupportedError(f"generation failed for {request_id}: {getattr(item, 'msg', item)}")
                    parts.append(item)
                return "".join(parts), len(inputs["input_ids"]), list(ids)

            return asyncio.ensure_future(gathered())

        async def generate_non_streaming(self, model, processor, inputs, gen_config, request_id):
            """transformers' non-streaming generation (it waits on a future its result handler resolves), with the
            client watched while it waits: a client that disconnects has its request cancelled (``watch_client``),
            as transformers' streaming handler does for a streaming one."""
            self._refuse_if_stopping()
            options = self._options(model, request_id)
            if options.asked is not None:  # the reply's log probabilities are read with it (_asked)
                options.tokenizer = getattr(processor, "tokenizer", processor)._tokenizer
            if options.stop:  # fitted and prepared as it is streamed
                work = self._generate_until_stop(model, processor, inputs, gen_config, request_id)
            else:
                prompt_inputs(inputs, options)
                fit_to_cache(self._cb, model, inputs, gen_config, options)
                prepare_asked(options.asked, model, processor)
                work = asyncio.ensure_future(
                    super().generate_non_streaming(model, processor, inputs, gen_config, request_id))
            reply = self._ending(request_id, work)  # which the server's stop may end first (end_all)
            client = options.client
            if client is None:  # not called from an HTTP request
                return await reply

            def gone():
                self.cancel_for_disconnect(request_id)
                work.cancel()

            return await watch_client(reply, client, gone)

        def cancel(self, request_id: str) -> None:
            """Cancel the request (the CB loop frees its pages and slot at its next step) and drop the result
            handler transformers registered for it: a cancelled request delivers no result that would remove it."""
            cb = self._cb
            cb.cancel_request(request_id)
            router = getattr(cb, "output_router", None)
            if router is not None:
                with router._lock:
                    router.result_handlers.pop(request_id, None)

        def cancel_for_disconnect(self, request_id: str) -> None:
            self.cancel(request_id)
            self.disconnected += 1

    class CheckedGenerationState(GenerationState):
        def __init__(self, **kw):
            super().__init__(**kw)
            self.requests = Requests()  # the options of the requests this server runs, by request id

        def get_manager(self, model_id: str, use_cb: bool = False):
            """transformers' manager per model; the continuous-batching one is ``CheckedCBGenerateManager``
            (made here, where transformers would make its own, so transformers' method returns it)."""
            if use_cb and (self._cb_manager is None or self._cb_model_id != model_id):
                if self._cb_manager is not None:
                    self._cb_manager.stop()
                self._cb_manager = CheckedCBGenerateManager(self._cb_config, self.requests, decider)
                self._cb_model_id = model_id
            return super().get_manager(model_id, use_cb=use_cb)

    return CheckedGenerationState(**kw)


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


def build_app(model_dir: str, policy, *, budget: int | None = None, max_requests: int | None = None,
              request_tokens: int | None = None, max_batch_tokens: int = 256, dtype: torch.dtype = torch.float32,
              prefix_sharing: bool = True, tensor_parallel: bool = False, served_names: list[str] | tuple = (),
              offload: int = 0):
    """The FastAPI app (and its model manager) serving ``model_dir`` (a local Hugging Face directory) with
    continuous batching over kvcompile's cache under ``policy``, sized as ``serving.configure`` takes ``budget``,
    ``max_requests`` and ``request_tokens``; ``prefix_sharing``: prompts that begin alike
    share pages where the policy allows it (``serving.shares_pages``); ``tensor_parallel``: the model is loaded
    sharded over the ranks of the initialized process group (``tp_plan="auto"``; ``run_tensor_parallel``);
    ``served_names``: names a request may give as its ``model`` besides the directory (``model_names``), the
    first of them the one ``/v1/models`` lists; ``offload``: bytes of host memory that hold the caches of
    requests evicted when pages run out, packed as they were, until they are scheduled again (0: an evicted
    request is prefilled again; ``serving.KVCompileOffloading``)."""
    require_server_transformers()
    from transformers import ContinuousBatchingConfig
    from transformers.cli.serving.model_manager import ModelManager, split_revision

    from . import serving
    from .api import apply

    cb_config = ContinuousBatchingConfig(max_batch_tokens=max_batch_tokens, cpu_offload_space=offload / 2 ** 30)

    class KVCompileModelManager(ModelManager):
        """transformers' model manager; every model it loads is prepared by ``kvcompile.apply``."""

        def _load_model(self, model_id_and_revision, *args, **kwargs):
            if tensor_parallel:  # transformers' manager loads onto one device; sharded, as from_pretrained does it
                from transformers import AutoModelForCausalLM

                model_id, revision = split_revision(model_id_and_revision)
                model = AutoModelForCausalLM.from_pretrained(model_id, revision=revision, dtype=self.dtype,
                                                             attn_implementation=self.attn_implementation,
                                                             tp_plan="auto")
            else:
                model = super()._load_model(model_id_and_revision, *args, **kwargs)
            model = apply(model.eval(), policy)
            serving.configure(model, budget=budget, max_requests=max_requests, request_tokens=request_tokens)
            # prompts that begin alike share pages where the policy's pages hold all their tokens
            cb_config.allow_block_sharing = prefix_sharing and serving.model_shares_pages(model)
            return model

    manager = KVCompileModelManager(device="cpu", dtype=str(dtype).removeprefix("torch."),
                                    attn_implementation="sdpa", continuous_batching=True, model_timeout=-1,
                                    force_model=model_dir)
    manager.kvcompile_names = names = model_names(model_dir, served_names)
    # sharded (torchrun): the first rank picks every token for all (sampling.RoutedProcessors)
    decider = torch.distributed.group.WORLD if tensor_parallel else None
    state = checked_state(decider, continuous_batching=True, compile=False, cb_config=cb_config)
    app = openai_app(manager, state, checked=True)
    app.state.prefix_sharing = cb_config.allow_block_sharing  # set when the model was loaded (force_model)
    app.state.cb_config = cb_config
    evictions = EvictionCounter()

    # transformers' /load_model would load any model id it is given (from the hub: a hang without a network);
    # this server serves its one model, which stays loaded
    load_route = next(r for r in app.router.routes if getattr(r, "path", None) == "/load_model")
    app.router.routes.remove(load_route)

    # transformers' /reset unloads every model: this server's one model, which every request after it needs (the
    # engine still running on it); there is nothing to reset
    app.router.routes[:] = [r for r in app.router.routes if getattr(r, "path", None) != "/reset"]

    # transformers' transcription route answered a text model's server with a 500 (or loaded audio it cannot read)
    app.router.routes[:] = [r for r in app.router.routes if getattr(r, "path", None) != "/v1/audio/transcriptions"]

    @app.post("/v1/audio/transcriptions")
    async def transcriptions():
        raise RequestError(f"this server's model ({model_dir!r}) reads text only: no audio transcriptions", "model")

    # the model is listed under its first name (the directory unless names were given) and found by any
    card = {"id": names[0], "object": "model", "created": 0, "owned_by": "local"}
    app.router.routes[:] = [r for r in app.router.routes if getattr(r, "path", None) != "/v1/models"]

    @app.get("/v1/models")
    def list_models():
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{model_id:path}")
    def retrieve_model(model_id: str):
        if model_id not in names:
            raise RequestError(f"no model {model_id!r} here: this server serves {names[0]!r}", "model",
                               code="model_not_found", status=404)
        return card

    @app.post("/load_model")
    async def load_model(body: dict):
        if body.get("model") not in names:
            raise RequestError(f"this server serves {model_dir!r} only (it is loaded); start another "
                               f"kvcompile serve --model for another model", "model", code="model_not_found")
        return await load_route.endpoint({**body, "model": model_dir})

    @app.get("/kvcompile/stats")
    def stats():
        """The kvcompile cache behind the running continuous-batching manager (none before the first request)."""
        cb = getattr(getattr(state, "_cb_manager", None), "_cb", None)
        bp = getattr(cb, "batch_processor", None)
        cache = getattr(bp, "cache", None)
        if not isinstance(cache, serving.cache_class()):
            return {"manager": type(cb).__name__ if cb is not None else None, "cache": None}
        sched = getattr(bp, "scheduler", None)
        return {"manager": type(cb).__name__, "cache": type(cache).__name__, "policy": str(policy),
                "budget": cb.budget, "allocated": cache.allocated_nbytes, "blocks": cache.blocks,
                "free_blocks": cache.free_blocks_count, "slots": cache.slots, "requests": len(cache.slot_of),
                # transformers' side: the pages its allocators hand out and hold, its scheduler's requests
                # (dict views copied at once: the batching thread changes them while this reads)
                "pages": cache.num_blocks, "pages_held": len({p for a in cache.cache_allocators.values()
                                                              for t in list(a.block_table.values()) for p in t}),
                # prefix sharing: whether on, the prompt tokens read from shared pages, the pages kept cached
                "prefix_sharing": cache.use_prefix_sharing, "prefix_tokens": cache.prefix_tokens,
                "pages_cached": sum(len(a.ledger.cached_blocks) for a in cache.cache_allocators.values()),
                "active": len(sched.active_requests) if sched is not None else None,
                "waiting": len(sched.waiting_requests) if sched is not None else None,
                "token_limit": cache_token_limit(cb, cb.model), "evicted": evictions.evicted,
                # evicted requests whose caches went to host memory and came back (--cpu-offload-mib)
                "offloaded": getattr(bp.offloading_manager, "offloaded", 0),
                "restored": getattr(bp.offloading_manager, "restored", 0),
                "max_batch_tokens": cb.continuous_batching_config.max_batch_tokens,
                # non-streaming requests cancelled because their client disconnected (watch_client)
                "disconnected": getattr(state._cb_manager, "disconnected", 0),
                # requests whose options the server holds (``sampling.Requests``: none once every reply is out
                # or its client gone), and those of them whose tokens are recorded (log probabilities, penalties)
                "options_held": len(state.requests), "records_open": state.requests.asking()}

    return app, manager, state


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


def first_request(cb, timeout_s: float = STARTUP_REQUEST_S) -> None:
    """Run one request of two tokens through the started engine ``cb``: the CPU kernels of every layer's store
    layout are built now (a missing C compiler, an unwritable kernel cache, a layout the kernels refuse are said at
    start-up), and none is built -- nor killed halfway by a stop signal sent to the process group -- while clients
    wait."""
    rid = "kvcompile-startup"
    held: list = []  # what the engine logs meanwhile: its traceback of an error kvcompile says in one line is dropped

    class Hold(logging.Filter):
        def filter(self, record):
            held.append(record)
            return False

    cb_logger, hold = logging.getLogger("ContinuousBatchingLogger"), Hold()
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
            for record in held:
                cb_logger.handle(record)
    if error is not None:
        raise UnsupportedError(f"kvcompile serve: the engine could not serve a first request at start-up: "
                               + (str(error) if isinstance(error, (str, KVCompileError)) else
                                  f"{type(error).__name__}: {error}"))


SHUTDOWN_GRACE_S = 10.0  # default seconds requests in flight may take to finish once the server is told to stop
ENDING_S = 2.0  # then, seconds the ended requests' last events and responses get to go out before the server exits


def serve_http(app, state, host: str, port: int, grace_s: float = SHUTDOWN_GRACE_S) -> None:
    """Serve ``app`` with uvicorn until SIGTERM or SIGINT, then stop as operators expect of a server: it stops
    accepting connections at once (uvicorn closes its sockets), lets the requests in flight finish for up to
    ``grace_s`` seconds, then ends those still running cleanly (``end_all``: a stream gets an error event and its
    end, a reply waited for a 503 in OpenAI's shape; their pages come back) and returns -- no reset connection,
    no traceback, and the caller exits 0. A second signal ends them at once. (uvicorn alone waits for every
    request without limit, ignores a second SIGTERM, and a second SIGINT drops the connections, logging a
    traceback for each request cut.)"""
    import signal

    import uvicorn

    class GracefulServer(uvicorn.Server):
        deadline: float | None = None  # monotonic time at which requests still in flight are ended

        @contextlib.contextmanager
        def capture_signals(self):
            # uvicorn's, but the signals are not raised again once the server has stopped (the process would die
            # by SIGTERM, or raise KeyboardInterrupt): a server stopped by a signal is a normal exit
            old = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in old.items():
                    signal.signal(sig, handler)

        def handle_exit(self, sig, frame) -> None:
            now = time.monotonic()
            if self.deadline is None:
                self.should_exit, self.deadline = True, now + grace_s
                print(f"kvcompile serve: stopping; requests in flight have {grace_s:g} s to finish (a second "
                      f"signal ends them now)", flush=True)
            else:
                self.deadline = min(self.deadline, now)

        async def shutdown(self, sockets=None):
            async def end_in_time():
                while time.monotonic() < (self.deadline or 0):
                    await asyncio.sleep(0.05)
                gen = getattr(state, "_cb_manager", None)
                ended = gen.end_all(f"the server is shutting down: this reply was ended before it was complete, "
                                    f"{grace_s:g} s after the server was told to stop") if gen is not None else 0
                if ended:
                    print(f"kvcompile serve: ended {ended} request(s) still running", flush=True)
                await asyncio.sleep(ENDING_S)
                self.force_exit = True  # uvicorn stops waiting for connections that are still open

            ender = asyncio.ensure_future(end_in_time())
            try:
                await super().shutdown(sockets)
            finally:
                ender.cancel()

    GracefulServer(uvicorn.Config(app, host=host, port=port, log_level="warning")).run()


def run(model_dir: str, policy, host: str = "127.0.0.1", port: int = 8000, grace_s: float = SHUTDOWN_GRACE_S,
        **kw) -> None:
    """Serve until stopped (``serve_http``: ``grace_s`` seconds for the requests in flight); launched by torchrun
    with several processes, sharded over them (``run_tensor_parallel``)."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return run_tensor_parallel(model_dir, policy, host, port, grace_s, **kw)
    app, manager, state = build_app(model_dir, policy, **kw)
    try:
        start_engine(manager, state, model_dir)
        sharing = app.state.prefix_sharing
        print(f"kvcompile serve: {model_dir} under {policy} on http://{host}:{port}/v1 (model name: "
              f"{manager.kvcompile_names[0]!r}; prefix sharing {'on' if sharing else 'off'})", flush=True)
        serve_http(app, state, host, port, grace_s)
    finally:
        state.shutdown()
        manager.shutdown()


def run_tensor_parallel(model_dir: str, policy, host: str, port: int, grace_s: float = SHUTDOWN_GRACE_S,
                        **kw) -> None:
    """``torchrun --nproc_per_node N -m kvcompile serve ...``: the model sharded over the N ranks (``tp_plan=
    "auto"``, each rank's cache holding its KV heads), transformers' continuous batching on every rank. Rank 0
    serves HTTP and is the engine's driver: the requests it adds reach the other ranks' engines at their next
    step (transformers broadcasts them), which step with it; every rank starts its engine at startup, with the
    same configuration. Rank 0 picks every token -- by its records: penalties, a logit bias, JSON mode, log
    probabilities -- and the other ranks take it (``sampling.RoutedProcessors``' decider). A request whose prompt's
    log probabilities are asked carries that to every rank, whose forwards keep the same rows for them
    (``engine.PagedKVCompileCache.prompt_rows``); rank 0 records them."""
    import torch.distributed as dist

    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    app = manager = state = None
    try:
        app, manager, state = build_app(model_dir, policy, tensor_parallel=True, **kw)
        model, _ = manager.load_model_and_processor(model_dir)
        if rank == 0:
            start_engine(manager, state, model_dir)
            print(f"kvcompile serve: {model_dir} under {policy}, sharded over {world} ranks, on "
                  f"http://{host}:{port}/v1 (model name: {manager.kvcompile_names[0]!r}; prefix sharing "
                  f"{'on' if app.state.prefix_sharing else 'off'})", flush=True)
            serve_http(app, state, host, port, grace_s)
        else:
            cb = sampling_manager(model, model.generation_config, app.state.cb_config, decider=dist.group.WORLD)
            cb.start()
            while cb.is_running():
                time.sleep(0.5)
    finally:
        if state is not None:
            state.shutdown()
        if manager is not None:
            manager.shutdown()
        dist.destroy_process_group()
