"""``kvcompile serve``'s server: transformers' OpenAI-compatible server (``transformers serve
--continuous-batching``, release ``serve.SERVER_TRANSFORMERS``) with its classes extended, and uvicorn stopping
gracefully. What each class adds is in ``kvcompile.serve``'s overview; the checks, request options and reply
shapes they call are there too, and need none of the server's dependencies.

- ``CheckedChatCompletionHandler``, ``CheckedCompletionHandler``, ``CheckedResponseHandler``: transformers'
  handlers, each request checked first and run with its own options (``CheckedHandler``);
- ``CheckedCBGenerateManager`` (in ``CheckedGenerationState``): transformers' continuous-batching manager,
  sampling per request, fitting each request to the cache, ending requests cleanly when the server stops;
- ``KVCompileModelManager``: transformers' model manager, every model it loads prepared by ``kvcompile.apply``;
- ``GracefulServer``: uvicorn's server, giving the requests in flight a grace period on SIGTERM or SIGINT.

Importing this module needs the serve extras (``pip install 'kvcompile[serve]'``); it checks the transformers
release first, so a wrong one is said with what to install rather than as an ImportError.
"""
# ruff: noqa: E402  (transformers' server modules are imported after its release is checked)
from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import json
import os
import signal
import time

import torch

from .errors import UnsupportedError
from .pool import MAX_BATCH_TOKENS
from .sampling import Asked, RequestOptions, Requests, request_sampling, sampling_manager
from .serve import (ASKED_FIELDS, EXTENSIONS, SAMPLING_FIELDS, SHUTDOWN_GRACE_S, ClientDisconnected, EvictionCounter,
                    RequestError, ServerStopping, StopAt, asked_of, cache_token_limit, check_chat, check_common,
                    check_completion, check_response, chat_logprobs, completion_logprobs, completion_prompts,
                    echo_logprobs, error_body, failure_body, fit_to_cache, model_names, n_choices, prepare_asked,
                    prompt_inputs, require_server_transformers, start_engine, stream_with_logprobs,
                    template_shows_tools, token_entries, watch_client, with_choice)

require_server_transformers()

import uvicorn
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from openai.types import CompletionUsage
from starlette.exceptions import HTTPException
from starlette.requests import Request
from transformers import AutoModelForCausalLM, ContinuousBatchingConfig
from transformers.cli.serving.chat_completion import ChatCompletionHandler
from transformers.cli.serving.completion import CompletionHandler
from transformers.cli.serving.model_manager import ModelManager, split_revision
from transformers.cli.serving.response import ResponseHandler
from transformers.cli.serving.server import build_server
from transformers.cli.serving.systemone import SystemOneHandler
from transformers.cli.serving.transcription import TranscriptionHandler
from transformers.cli.serving.utils import CBGenerateManager, CBWorkerDeadError, GenerationState, _StreamError

from . import serving
from .api import apply


def openai_app(manager, state, *, checked: bool = False):
    """transformers' OpenAI-compatible FastAPI app (its handlers, as ``transformers serve`` builds them) over a
    model manager and a generation state. ``checked``: the chat and completion handlers check each request
    first (``CheckedHandler``), and errors answer in OpenAI's shape."""
    require_server_transformers()  # at each call: the release may have changed since this module loaded
    chat, completion, response = ((CheckedChatCompletionHandler, CheckedCompletionHandler, CheckedResponseHandler)
                                  if checked else (ChatCompletionHandler, CompletionHandler, ResponseHandler))
    app = build_server(
        manager, chat(model_manager=manager, generation_state=state),
        completion_handler=completion(model_manager=manager, generation_state=state),
        response_handler=response(model_manager=manager, generation_state=state),
        transcription_handler=TranscriptionHandler(manager, state),
        systemone_handler=SystemOneHandler(model_manager=manager, generation_state=state),
        generation_state=state)
    if checked:
        _openai_errors(app)
        app.add_middleware(ClientConnection)
    return app


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
        token = _CLIENT.set(Request(scope, receive))
        try:
            await self.app(scope, receive, send)
        finally:
            _CLIENT.reset(token)


def _openai_errors(app) -> None:
    """Every error of the app in OpenAI's shape: ours, FastAPI's (a body that is not a JSON object), the
    handlers' ``HTTPException`` (an unknown model, unexpected fields), and anything else (a 500 without a
    traceback; the traceback goes to the server's log)."""
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


class CheckedHandler:
    """What kvcompile serve adds to each of transformers' handlers (mixed in before it): each request is checked
    first (``check``) and runs with its own options (``RequestOptions``), which record for ``fit_to_cache`` which
    field holds the prompt (``prompt_field``) and whether the client set the reply's length (``max_fields``). A
    request that asks more of its tokens has it done (``_asked``). ``chat``: the handler's prompts are messages,
    its log probabilities in ``logprobs_of``'s shape."""

    check: staticmethod  # the request's own checks (``check_chat`` ...), after ``check_common``
    logprobs_of: staticmethod  # tokens' entries as the reply's ``logprobs`` (``chat_logprobs`` ...)
    prompt_field: str
    max_fields: tuple[str, ...]  # the fields that set the reply's length, the one ``fit_to_cache`` names first
    chat: bool

    async def handle_request(self, body: dict, request_id: str):
        # a field given as null is a field not given (OpenAI's reading; transformers' handlers took some
        # nulls as values: ``**None`` for chat_template_kwargs)
        body = {k: v for k, v in body.items() if v is not None}
        check_common(body)
        if body["model"] in getattr(self.model_manager, "kvcompile_names", ()):  # the served model's names
            body = {**body, "model": self.model_manager.force_model}
        self.check(body)
        if self.chat and body.get("tools") and body.get("tool_choice") != "none":
            processor = self._resolve_model(dict(body))[2]
            if not template_shows_tools(getattr(processor, "tokenizer", processor)):
                raise RequestError("'tools' would be ignored: this model's chat template does not put tools "
                                   "in its prompt, so the model never sees them; leave them out (or set "
                                   "'tool_choice': 'none'), or serve a model whose template takes tools",
                                   "tools")
        if isinstance(self, ResponseHandler):
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
        if n == best == 1 and (self.chat or len(completion_prompts(body.get("prompt"))) == 1):
            if not self.chat:  # one prompt: a string, or its token ids (not a list of one string)
                body = {**body, "prompt": completion_prompts(body["prompt"])[0]}
            return await one(body, request_id)
        return await n_choices(one, body, request_id, n, best=max(best, n))

    async def _one_choice(self, body: dict, request_id: str, extensions: dict):
        """One choice (its options start with the request's ``extensions``). A completion's prompt of token
        ids is generated from those ids (``prompt_inputs``); its text, for transformers' handler and the
        echo, is their decoding."""
        options = RequestOptions(fields=dict(extensions))
        if not self.chat and isinstance(body.get("prompt"), list):
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
        if self.chat or not body.get("echo"):
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
        asked = options.asked = asked_of(body, self.chat)
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
        lp = self.logprobs_of(tokens)
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
        options.open_length = all(body.get(f) is None for f in self.max_fields)
        options.max_field, options.prompt_field = self.max_fields[0], self.prompt_field
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
        return sse if tokens is None else with_choice(sse, logprobs=self.logprobs_of(tokens))


class CheckedChatCompletionHandler(CheckedHandler, ChatCompletionHandler):
    """transformers' chat-completion handler (``/v1/chat/completions``), each request checked first."""

    check, logprobs_of = staticmethod(check_chat), staticmethod(chat_logprobs)
    prompt_field, max_fields, chat = "messages", ("max_tokens", "max_completion_tokens"), True
    # transformers' handler logs the fields it ignores; those this server reads are not ignored
    _unused_fields = set(ChatCompletionHandler._unused_fields) - HANDLED_FIELDS


class CheckedCompletionHandler(CheckedHandler, CompletionHandler):
    """transformers' completion handler (``/v1/completions``), each request checked first."""

    check, logprobs_of = staticmethod(check_completion), staticmethod(completion_logprobs)
    prompt_field, max_fields, chat = "prompt", ("max_tokens",), False
    _unused_fields = set(CompletionHandler._unused_fields) - HANDLED_FIELDS


class CheckedResponseHandler(CheckedHandler, ResponseHandler):
    """transformers' Responses API handler (``/v1/responses``), each request checked first."""

    check, logprobs_of = staticmethod(check_response), staticmethod(chat_logprobs)
    prompt_field, max_fields, chat = "input", ("max_output_tokens",), True
    _unused_fields = set(ResponseHandler._unused_fields) - HANDLED_FIELDS


class Stopped(_StreamError):
    """Put on a stream's queue when the server stops its request (``end_all``): transformers' stream sends its
    message as an error event (``data: {"error": msg}``, so no quotes in it) and ends."""

class CheckedCBGenerateManager(CBGenerateManager):
    """transformers' continuous-batching generation manager, sampling per request (``init_cb``), fitting each
    request to the cache before it is queued, watching a waiting client, and ending the requests in flight
    cleanly when the server stops (``end_all``)."""

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
    """transformers' ``GenerationState`` whose continuous-batching generation manager samples per request and fits
    each request to the cache (``fit_to_cache``) before it is queued (``CheckedCBGenerateManager``). Each request's
    options are in its ``requests`` (``sampling.Requests``), by request id, while it runs. ``decider``: under
    tensor parallelism, the process group whose first rank picks every token (``sampling.RoutedProcessors``)."""

    def __init__(self, decider=None, **kw):
        super().__init__(**kw)
        self.requests = Requests()  # the options of the requests this server runs, by request id
        self.decider = decider

    def get_manager(self, model_id: str, use_cb: bool = False):
        """transformers' manager per model; the continuous-batching one is ``CheckedCBGenerateManager``
        (made here, where transformers would make its own, so transformers' method returns it)."""
        if use_cb and (self._cb_manager is None or self._cb_model_id != model_id):
            if self._cb_manager is not None:
                self._cb_manager.stop()
            self._cb_manager = CheckedCBGenerateManager(self._cb_config, self.requests, self.decider)
            self._cb_model_id = model_id
        return super().get_manager(model_id, use_cb=use_cb)


class KVCompileModelManager(ModelManager):
    """transformers' model manager; every model it loads is prepared by ``kvcompile.apply(model, policy)`` and
    sized by ``serving.configure`` (``budget``, ``max_requests``, ``request_tokens``). ``tensor_parallel``: the
    model is loaded sharded over the process group's ranks; ``prefix_sharing``: prompts that begin alike share
    pages (``cb_config.allow_block_sharing``) where the loaded model's policy allows it."""

    def __init__(self, policy, cb_config, *, budget: int | None, max_requests: int | None,
                 request_tokens: int | None, prefix_sharing: bool, tensor_parallel: bool, **kw):
        # set before transformers' constructor, which loads the model it is given (force_model)
        self.policy, self.cb_config, self.prefix_sharing, self.tensor_parallel = (policy, cb_config, prefix_sharing,
                                                                                 tensor_parallel)
        self.budget, self.max_requests, self.request_tokens = budget, max_requests, request_tokens
        super().__init__(**kw)

    def _load_model(self, model_id_and_revision, *args, **kwargs):
        if self.tensor_parallel:  # transformers' manager loads onto one device; sharded, as from_pretrained does it
            model_id, revision = split_revision(model_id_and_revision)
            model = AutoModelForCausalLM.from_pretrained(model_id, revision=revision, dtype=self.dtype,
                                                         attn_implementation=self.attn_implementation,
                                                         tp_plan="auto")
        else:
            model = super()._load_model(model_id_and_revision, *args, **kwargs)
        model = apply(model.eval(), self.policy)
        serving.configure(model, budget=self.budget, max_requests=self.max_requests,
                          request_tokens=self.request_tokens)
        # prompts that begin alike share pages where the policy's pages hold all their tokens
        self.cb_config.allow_block_sharing = self.prefix_sharing and serving.model_shares_pages(model)
        return model


def build_app(model_dir: str, policy, *, budget: int | None = None, max_requests: int | None = None,
              request_tokens: int | None = None, max_batch_tokens: int = MAX_BATCH_TOKENS, dtype: torch.dtype = torch.float32,
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
    require_server_transformers()  # before loading the model
    cb_config = ContinuousBatchingConfig(max_batch_tokens=max_batch_tokens, cpu_offload_space=offload / 2 ** 30)

    manager = KVCompileModelManager(policy, cb_config, budget=budget, max_requests=max_requests,
                                    request_tokens=request_tokens, prefix_sharing=prefix_sharing,
                                    tensor_parallel=tensor_parallel, device="cpu",
                                    dtype=str(dtype).removeprefix("torch."), attn_implementation="sdpa",
                                    continuous_batching=True, model_timeout=-1, force_model=model_dir)
    manager.kvcompile_names = names = model_names(model_dir, served_names)
    # sharded (torchrun): the first rank picks every token for all (sampling.RoutedProcessors)
    decider = torch.distributed.group.WORLD if tensor_parallel else None
    state = CheckedGenerationState(decider, continuous_batching=True, compile=False, cb_config=cb_config)
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


ENDING_S = 2.0  # then, seconds the ended requests' last events and responses get to go out before the server exits


class GracefulServer(uvicorn.Server):
    """uvicorn's server, stopping as ``serve_http`` says: on SIGTERM or SIGINT the requests in flight get
    ``grace_s`` seconds, then those of ``state``'s generation manager still running are ended (``end_all``)."""

    deadline: float | None = None  # monotonic time at which requests still in flight are ended

    def __init__(self, config: uvicorn.Config, state, grace_s: float):
        super().__init__(config)
        self.state, self.grace_s = state, grace_s

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
            self.should_exit, self.deadline = True, now + self.grace_s
            print(f"kvcompile serve: stopping; requests in flight have {self.grace_s:g} s to finish (a second "
                  f"signal ends them now)", flush=True)
        else:
            self.deadline = min(self.deadline, now)

    async def shutdown(self, sockets=None):
        async def end_in_time():
            while time.monotonic() < (self.deadline or 0):
                await asyncio.sleep(0.05)
            gen = getattr(self.state, "_cb_manager", None)
            ended = gen.end_all(f"the server is shutting down: this reply was ended before it was complete, "
                                f"{self.grace_s:g} s after the server was told to stop") if gen is not None else 0
            if ended:
                print(f"kvcompile serve: ended {ended} request(s) still running", flush=True)
            await asyncio.sleep(ENDING_S)
            self.force_exit = True  # uvicorn stops waiting for connections that are still open

        ender = asyncio.ensure_future(end_in_time())
        try:
            await super().shutdown(sockets)
        finally:
            ender.cancel()


def serve_http(app, state, host: str, port: int, grace_s: float = SHUTDOWN_GRACE_S) -> None:
    """Serve ``app`` with uvicorn until SIGTERM or SIGINT, then stop as operators expect of a server: it stops
    accepting connections at once (uvicorn closes its sockets), lets the requests in flight finish for up to
    ``grace_s`` seconds, then ends those still running cleanly (``end_all``: a stream gets an error event and its
    end, a reply waited for a 503 in OpenAI's shape; their pages come back) and returns -- no reset connection,
    no traceback, and the caller exits 0. A second signal ends them at once. (uvicorn alone waits for every
    request without limit, ignores a second SIGTERM, and a second SIGINT drops the connections, logging a
    traceback for each request cut.)"""
    GracefulServer(uvicorn.Config(app, host=host, port=port, log_level="warning"), state, grace_s).run()


def run(model_dir: str, policy, host: str = "127.0.0.1", port: int = 8000, grace_s: float = SHUTDOWN_GRACE_S,
        **kw) -> None:
    """Serve until stopped (``serve_http``: ``grace_s`` seconds for the requests in flight); launched by torchrun
    with several processes, sharded over them (``run_tensor_parallel``)."""
    require_server_transformers()  # before loading the model or listening
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
