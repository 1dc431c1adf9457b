"""Sampling per request in transformers' continuous batching, for ``kvcompile serve``.

transformers' server starts its continuous-batching manager with the first request's generation config and
applies that config's sampling to every later request (a temperature asked later did nothing; a greedy request
after a sampled first one sampled), and a ``seed`` only reset torch's global generator, which every request in
the batch draws from. Here the manager is started with transformers' per-request temperature, top-k and top-p
processors (``sampling_manager``), each request is added with its own values (``request_sampling``), and the
processor list picks every row's token itself (``RoutedProcessors``): greedy rows their argmax, sampling rows a
draw from their filtered distribution, by their seed alone when they give one (``seeded_draw``), handing
transformers' sampler a one-hot. A request that asks for more of its tokens (``Asked``: log probabilities,
OpenAI's presence and frequency penalties, a logit bias, JSON mode) has them adjusted and recorded as they are
picked; JSON mode is one more adjustment, the tokens that do not keep the reply a JSON document's prefix at -inf
(``kvcompile.json_mode``), before the row's greedy or sampled pick.

A request's options travel in one object (``RequestOptions``: how it decodes, what it asks of its tokens, its
stop strings and length, its prompt of token ids), kept by request id in its server's table (``Requests``, one
per server, shared with the engine): the request is added to the engine with the few integers transformers'
processors carry per row (``RequestOptions.processor_kwargs``: greedy, seed, its handle in the table), and the
processor list and the cache find its options by that handle and by its id.
"""
from __future__ import annotations

import copy
import itertools
import logging
import random
import threading
from dataclasses import dataclass, field, replace

import torch
from transformers.generation.continuous_batching.cb_logits_processors import (ContinuousBatchingLogitsProcessor,
                                                                              ContinuousBatchingLogitsProcessorList)

from .errors import ArgumentError, KeyNotFound, UnsupportedError

NO_TOP_K = 2**31 - 1  # a per-request top_k that keeps every token (transformers' warper clamps it to the vocabulary)


def request_sampling(body: dict, defaults) -> dict:
    """How one request picks its tokens, as the logits-processor arguments it is added with: ``{"greedy": 1, ...}``
    for argmax decoding, else its ``temperature``, ``top_p``, ``top_k`` (``0``: none) and ``seed`` (``-1``: none;
    with one, the same request gives the same reply, whatever else the batch holds: ``seeded_draw``).

    As transformers' ``generate`` reads the model's generation config (``defaults``), with the request's fields
    over it: a ``temperature`` of 0 is greedy and one above 0 samples; without one, a request that gives
    ``top_p`` or ``top_k`` samples at the config's temperature, and one that gives neither decodes as the
    config says (greedy unless it sets ``do_sample``). Fields the request leaves out come from the config; where
    it has none, temperature 1 and no top-k or top-p filter, as ``generate`` samples then."""
    t, p, k = body.get("temperature"), body.get("top_p"), body.get("top_k")
    if t is not None:
        sample = t > 0
    else:
        sample = p is not None or k is not None or bool(getattr(defaults, "do_sample", False))
    if not sample:
        return {"greedy": 1, "temperature": 1.0, "top_p": 1.0, "top_k": NO_TOP_K, "seed": -1}
    t = float(t if t is not None else (defaults.temperature if defaults.temperature is not None else 1.0))
    p = float(p if p is not None else (defaults.top_p if defaults.top_p is not None else 1.0))
    k = int(k if k is not None else (defaults.top_k or 0))
    seed = body.get("seed")
    # every argument travels as an int32 of the processors' rows: a top_k past NO_TOP_K keeps every token too
    return {"greedy": 0, "temperature": t, "top_p": p, "top_k": min(k, NO_TOP_K) or NO_TOP_K,
            "seed": -1 if seed is None else seed % 2**31}


class Asked:
    """What one request asks of its tokens beyond how they are drawn: ``top`` (log probabilities of the chosen
    token and of that many alternatives; None: none), OpenAI's ``presence`` and ``frequency`` penalties and a
    ``bias`` per token id. Holds what it generated, by place in the reply: ``tokens`` and, asked, ``entries``
    (``(token id, log probability, [(id, log probability)] of the top alternatives)``)."""

    def __init__(self, top: int | None = None, presence: float = 0.0, frequency: float = 0.0,
                 bias: dict[int, float] | None = None, json_mode: bool = False, json_schema: dict | None = None):
        self.top, self.presence, self.frequency, self.bias = top, presence, frequency, dict(bias or {})
        self.json_mode = json_mode  # the reply is one JSON document: ``json`` (a ``json_mode.JsonConstraint``)
        self.json_schema = json_schema  # which the object follows (None: any object)
        self.eos = None  # the model's end-of-sequence token (set when the request is added): a failed one ends on it
        self.failed = None  # what went wrong doing what it asked (its reply is an error; the others go on)
        self.json = None  # which tokens may come next (set with the model's vocabulary when the request is added)
        self.tokens: dict[int, int] = {}
        self.counts: dict[int, int] = {}  # how often each token id was generated (for the penalties)
        self.entries: dict[int, tuple] = {}
        # the prompt's token ids when its log probabilities are asked (a completion's echo), and its entries by
        # place in the prompt (1 on: the first token has none), recorded as its prefill computes them
        self.prompt: list[int] | None = None
        self.prompt_entries: dict[int, tuple] = {}
        self._lock = threading.Lock()  # the batching thread records, the server's event loop reads

    @property
    def adjusts(self) -> bool:
        return bool(self.presence or self.frequency or self.bias or self.json is not None)

    def adjust(self, logits: torch.Tensor, step: int) -> None:
        """Apply the bias and the penalties, in place, to one row's ``logits`` picking the token at ``step``:
        OpenAI's ``logit - frequency * count - presence * (count > 0)`` over the tokens generated before it; then,
        in JSON mode, -inf for every token that may not come next (``JsonConstraint.mask_``): the row's argmax is
        the best allowed token, and its sampling processors and draw see the distribution restricted to them."""
        if self.bias:
            ids = torch.tensor(list(self.bias), device=logits.device)
            logits[ids] += torch.tensor(list(self.bias.values()), dtype=logits.dtype, device=logits.device)
        if self.presence or self.frequency:
            seen = list(self._counts_before(step).items())
            if seen:
                ids = torch.tensor([t for t, _ in seen], device=logits.device)
                n = torch.tensor([c for _, c in seen], dtype=logits.dtype, device=logits.device)
                logits[ids] -= self.frequency * n + self.presence
        if self.json is not None:
            self.json.mask_(logits)

    def _counts_before(self, step: int) -> dict[int, int]:
        if len(self.tokens) == step:  # the usual case: every earlier token recorded, none later
            return self.counts
        counts: dict[int, int] = {}
        for i, t in self.tokens.items():
            if i < step:
                counts[t] = counts.get(t, 0) + 1
        return counts

    def took(self, step: int, token: int, logits: torch.Tensor) -> None:
        """The reply's token at ``step`` is ``token``, picked from the model's ``logits`` for it; where the
        request asked, its log probability and its top alternatives' are recorded."""
        if step in self.tokens:
            return
        self.tokens[step] = token
        self.counts[token] = self.counts.get(token, 0) + 1
        if self.json is not None:
            self.json.took(token)
        if self.top is not None:
            entry = self._entry(token, logits)
            with self._lock:
                self.entries[step] = entry

    def took_prompt(self, place: int, logits: torch.Tensor) -> None:
        """The prompt's token at ``place`` (>= 1) has ``logits`` (the model's at the place before): its log
        probability and its top alternatives' (``top`` of them) are recorded."""
        entry = self._entry(self.prompt[place], logits)
        with self._lock:
            self.prompt_entries[place] = entry

    def take(self, start: int, stop: int) -> list:
        """The log-probability entries of the reply's tokens ``start`` to ``stop`` (exclusive), in order; a
        KeyError names a token that has none (a defect: every token a request generates is recorded)."""
        with self._lock:
            missing = [i for i in range(start, stop) if i not in self.entries]
            if missing:
                raise KeyNotFound(f"no log probabilities recorded for tokens {missing} of the reply")
            return [self.entries[i] for i in range(start, stop)]

    def take_prompt(self) -> list:
        """The prompt's entries from its second token on, in order (a KeyError names a place the prefill did
        not record: the request failed or was cancelled before its prefill)."""
        with self._lock:
            missing = [i for i in range(1, len(self.prompt)) if i not in self.prompt_entries]
            if missing:
                raise KeyNotFound(f"no log probabilities recorded for prompt tokens {missing[:8]}")
            return [self.prompt_entries[i] for i in range(1, len(self.prompt))]

    def _entry(self, token: int, logits: torch.Tensor) -> tuple:
        """``(token, its log probability, [(id, log probability)] of the ``top`` most likely)`` under ``logits``."""
        logp = torch.log_softmax(logits.float(), -1)
        top = logp.topk(self.top) if self.top else None
        return token, float(logp[token]), list(zip(top.indices.tolist(), top.values.tolist())) if top else []


@dataclass
class RequestOptions:
    """Everything one request asks of the engine beyond its prompt, in one object from the server's handler to
    the row its tokens are picked in (``Requests``).

    fields:       its sampling fields as given (``temperature``, ``top_p``, ``top_k``, ``seed``)
    sampling:     how it decodes (``request_sampling`` of ``fields`` over the model's generation config; set
                  when it is generated)
    asked:        what it asks of its tokens (log probabilities, penalties, a logit bias, JSON mode), and what
                  is recorded of them; None: nothing
    stop:         strings that end its reply
    open_length:  its client left the reply's length open (the reply takes what the cache holds)
    max_field:    the request field that sets the reply's length (named in errors)
    prompt_field: the request field that holds its prompt (named in errors)
    prompt_ids:   a prompt given as token ids, generated from them (not from its decoded text)
    echo_offset:  characters of an echoed prompt before the reply (its tokens' text offsets start there)
    tokenizer:    the model's tokenizer (``tokenizers.Tokenizer``), once generated: decodes the recorded tokens
    client:       the HTTP connection it came on (a Starlette ``Request``), watched for its client going away;
                  None: not from HTTP
    """

    fields: dict = field(default_factory=dict)
    sampling: dict | None = None
    asked: Asked | None = None
    stop: list = field(default_factory=list)
    open_length: bool = False
    max_field: str = "max_tokens"
    prompt_field: str | None = None
    prompt_ids: list | None = None
    echo_offset: int = 0
    tokenizer: object = None
    client: object = None
    handle: int = -1  # its handle in its server's ``Requests`` (what the processors read per row); -1: none

    def processor_kwargs(self) -> dict:
        """The integers (and floats) the request is added to the engine with: its sampling, its handle, and the
        count of its prompt's tokens whose log probabilities are asked (``PROMPT_ROWS``)."""
        out = dict(self.sampling or {}, record=self.handle)
        if self.asked is not None and self.asked.prompt is not None:
            out[PROMPT_ROWS] = len(self.asked.prompt)
        return out


class Requests:
    """The options of the requests one server runs (``RequestOptions``), by request id and by handle -- the
    integer each request carries to the processors that pick its tokens (``RoutedProcessors``): a request is
    added (``add``) before it reaches the engine and removed once its reply is out (``remove``). Log
    probabilities are the model's own distribution at that step (a log-softmax of its logits, before bias,
    penalties, temperature or top-k/top-p), as OpenAI's and vLLM's servers report them. Thread-safe: the
    server's event loop adds and removes, the batching thread reads. One per server (``kvcompile.serve``; an
    engine without a server has an empty one): never shared between servers."""

    def __init__(self):
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._by_id: dict[str, RequestOptions] = {}
        self._by_handle: dict[int, RequestOptions] = {}

    def add(self, request_id: str, options: RequestOptions) -> RequestOptions:
        """Keep ``options`` for request ``request_id``, with a handle of its own (set on them)."""
        with self._lock:
            if request_id in self._by_id:
                raise ArgumentError(f"request {request_id!r} is already running: its id is in the server's table; "
                                    f"give each running request an id of its own")
            options.handle = next(self._ids) % 2**31
            self._by_id[request_id] = self._by_handle[options.handle] = options
            return options

    def remove(self, request_id: str) -> None:
        with self._lock:
            options = self._by_id.pop(request_id, None)
            if options is not None:
                self._by_handle.pop(options.handle, None)

    def of(self, request_id: str) -> RequestOptions | None:
        with self._lock:
            return self._by_id.get(request_id)

    def by_handle(self, handle: int) -> RequestOptions | None:
        with self._lock:
            return self._by_handle.get(handle)

    def asking(self) -> int:
        """How many of the running requests ask for more of their tokens (``Asked``)."""
        with self._lock:
            return sum(o.asked is not None for o in self._by_id.values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_id)


# a request's keyword: the number of its prompt's tokens whose log probabilities are asked (its first one has
# none): every one is computed (no prefix match) and the rows of their logits are kept (``serving.prompt_rows``)
PROMPT_ROWS = "prompt_rows"
MAX_TOP_LOGPROBS = 20  # alternatives a token's entry may list (OpenAI's limit for chat completions; vLLM's default)


def guarded(asked: Asked, fn, *args):
    """``fn(*args)`` for one request's row; an exception marks that request failed (``Asked.failed``: its
    reply becomes an error and it ends) instead of stopping the engine every other request runs on. None when
    it failed, now or before."""
    if asked.failed is not None:
        return None
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 -- one request's failure, reported to its client
        logging.getLogger(__name__).exception("kvcompile serve: a request's token picking failed")
        asked.failed = f"{type(e).__name__}: {e}"
        return None


def adjust_rows(scores: torch.Tensor, rows: list[int], asked: list[Asked], steps: list[int]) -> torch.Tensor:
    """``scores`` with each of ``rows``' bias and penalties applied (a copy, when any row has some)."""
    if not any(a.adjusts for a in asked):
        return scores
    out = scores.clone()
    for r, a, step in zip(rows, asked, steps):
        if a.adjusts:
            guarded(a, a.adjust, out[r], step)
    return out


class RequestArg(ContinuousBatchingLogitsProcessor):
    """One integer per request for ``RoutedProcessors`` -- ``greedy``, ``seed``, ``record`` (its handle in its
    server's ``Requests``; request kwargs) or ``step`` (tokens the request has generated) -- carried in the
    processors' argument rows, which transformers fills per batch with the batch's requests in the order of the
    logits' rows. It leaves the scores as they are."""
    ignored_kwargs = ()

    def __init__(self, name: str, default: int, kwarg: bool = True):
        self.name, self.default, self.kwarg = name, default, kwarg
        self.supported_kwargs = {name: int} if kwarg else {}

    def value(self, request) -> int:
        if self.kwarg:
            return int(request.state.logit_processor_kwargs.get(self.name, self.default))
        return len(request.state.generated_tokens)

    def fill_defaults(self, int32_tensor):
        int32_tensor.fill_(self.default)

    def prepare_tensor_args(self, requests_with_new_token):
        return torch.tensor([self.value(r) for r in requests_with_new_token], dtype=torch.int32)

    def __call__(self, scores, tensor_arg):
        return scores


REQUEST_ARGS = (("greedy", 1, True), ("seed", -1, True), ("step", 0, False), ("record", -1, True))


def seeded_draw(probs: torch.Tensor, seed: int, step: int) -> int:
    """A token drawn from ``probs [V]`` by the request's ``seed`` and the number of tokens it has generated
    (``step``) alone: the same request gives the same reply whatever else is in the batch. Inverse CDF of one
    uniform number from Python's generator seeded with both (all of their bits: torch's CPU generator keeps 32
    of a seed's), in float64; a token of probability 0 is never drawn."""
    u = random.Random(seed * 2**32 + step).random()
    cdf = probs.double().cumsum(0)
    return min(int(torch.searchsorted(cdf, u * cdf[-1], right=True)), probs.numel() - 1)


class RoutedProcessors(ContinuousBatchingLogitsProcessorList):
    """transformers' list of continuous-batching processors, which here also picks each row's token and hands the
    sampler a one-hot (0 at the token, -inf elsewhere: it draws that token with probability 1). A greedy row
    takes its argmax (the first of equal maxima, as transformers' greedy decoding) and skips the sampling
    processors (two sorts of the vocabulary a row and step: 13 ms a row on this CPU for a 49K vocabulary,
    against 0.1 ms for the argmax); a sampling row goes through them and is drawn from their distribution,
    by its seed (``seeded_draw``) when the request gave one, else by torch's generator.

    requests: the server's table, where a row finds what its request asks (``record``: its handle).
    decider:  under tensor parallelism (``kvcompile serve`` under torchrun) every rank's engine runs this list
              over the same batch, but only the driver (rank 0 of ``decider``, a process group) holds what its
              requests asked and draws by its own generator: the tokens it picks are sent to the other ranks,
              which take them, so that every rank stores and attends the same tokens. None: one process."""

    def __init__(self, logits_processor, per_request_processors: bool = True, drop_unsupported_processors: bool = True,
                 *, requests: Requests | None = None, decider=None):
        super().__init__(logits_processor, per_request_processors, drop_unsupported_processors)
        self.requests = requests if requests is not None else Requests()
        self.decider = decider
        for name, default, kwarg in REQUEST_ARGS:
            self.logits_processor.append(RequestArg(name, default, kwarg))
            self.tensors_required += 1
            if kwarg:
                self.supported_keys[name] = int
        # no processor reads it: the engine's cache does (``engine.PagedKVCompileCache.prompt_rows``)
        self.supported_keys[PROMPT_ROWS] = int
        self.do_processing = True

    def __call__(self, input_ids, scores, logits_processor_args):
        n = scores.size(0)
        rows_of = {id(q): i for i, q in enumerate(q for q in self.logits_processor
                                                  if isinstance(q, ContinuousBatchingLogitsProcessor))}
        arg = {q.name: logits_processor_args[rows_of[id(q)]][:n] for q in self.logits_processor
               if isinstance(q, RequestArg)}
        raw = scores
        # rows whose request asked for more (``RequestOptions.asked``): bias and penalties, log probabilities
        recorded = [(r, a, s) for r, h, s in zip(range(n), arg["record"].tolist(), arg["step"].tolist())
                    if h >= 0 and (o := self.requests.by_handle(h)) is not None
                    and (a := o.asked) is not None]
        if recorded:
            scores = adjust_rows(scores, *map(list, zip(*recorded)))
        choice = scores.argmax(-1)
        rows = (arg["greedy"] == 0).nonzero().squeeze(1)  # the sampling rows
        if len(rows):
            sub, ids = scores[rows], input_ids[rows]
            for q in self.logits_processor:
                if isinstance(q, RequestArg):
                    continue
                if isinstance(q, ContinuousBatchingLogitsProcessor):
                    sub = q(sub, logits_processor_args[rows_of[id(q)]][rows])
                else:
                    sub = q(ids, sub)
            probs = torch.softmax(sub.float(), -1)
            drawn = torch.multinomial(probs, 1).squeeze(1)
            seeds, steps = arg["seed"][rows].tolist(), arg["step"][rows].tolist()
            for j, (seed, step) in enumerate(zip(seeds, steps)):
                if seed >= 0:
                    drawn[j] = seeded_draw(probs[j], seed, step)
            choice[rows] = drawn
        if recorded:
            for r, a, step in recorded:
                guarded(a, a.took, step, int(choice[r]), raw[r])
                if a.failed is not None and a.eos is not None:
                    choice[r] = a.eos  # a failed request ends now
        if self.decider is not None:  # sharded: the driver's tokens, on every rank
            import torch.distributed as dist
            dist.broadcast(choice, src=dist.get_global_rank(self.decider, 0), group=self.decider)
        return torch.full_like(scores, float("-inf")).scatter_(-1, choice.unsqueeze(-1), 0.0)


def sampling_manager(model, gen_config, cb_config, requests: Requests | None = None, decider=None):
    """A continuous-batching manager (not started) that samples per request: transformers' per-request
    temperature, top-k and top-p processors (``cb_config.per_request_processors`` is set here) in a
    ``RoutedProcessors`` over ``requests`` (the server's table; each request is added with its options'
    arguments: ``engine.KVCompileBatchingManager.add_request``); the manager's own values (which only make
    transformers create the processors) are never used. ``decider``: see ``RoutedProcessors``."""
    if not getattr(cb_config, "per_request_processors", False):
        cb_config = replace(cb_config, per_request_processors=True)
    cfg = copy.deepcopy(gen_config)
    cfg.do_sample, cfg.temperature, cfg.top_k, cfg.top_p = True, 0.5, 1, 0.5
    cfg.stop_strings = cfg.sequence_bias = cfg.repetition_penalty = None  # refused per request (UNSUPPORTED)
    cb = model.init_continuous_batching(generation_config=cfg, continuous_batching_config=cb_config)
    routed = RoutedProcessors(model._get_logits_processor(cfg), True,
                              cb.continuous_batching_config.drop_unsupported_processors,
                              requests=cb.requests if requests is None else requests, decider=decider)
    kinds = sorted(set(routed.supported_keys) - {name for name, _, kwarg in REQUEST_ARGS if kwarg} - {PROMPT_ROWS})
    if kinds != ["temperature", "top_k", "top_p"]:
        raise UnsupportedError(f"transformers' continuous batching made per-request processors for {kinds}, "
                               f"expected temperature, top_k and top_p: this transformers version samples differently")
    cb.logit_processor, cb.requests = routed, routed.requests
    return cb
