"""Sampling per request in transformers' continuous batching, for ``kvcompile serve``.

transformers' server starts its continuous-batching manager with the first request's generation config and
applies that config's sampling to every later request (a temperature asked later did nothing; a greedy request
after a sampled first one sampled), and a ``seed`` only reset torch's global generator, which every request in
the batch draws from. Here the manager is started with transformers' per-request temperature, top-k and top-p
processors (``sampling_manager``), each request is added with its own values (``request_sampling``, passed
through ``request_context``), and the processor list picks every row's token itself (``add_request_args``):
greedy rows their argmax, sampling rows a draw from their filtered distribution, by their seed alone when they
give one (``seeded_draw``), handing transformers' sampler a one-hot. A request that asks for more of its tokens
(``Asked``: log probabilities, OpenAI's presence and frequency penalties, a logit bias, JSON mode) has them
adjusted and recorded as they are picked (``Records``); JSON mode is one more adjustment, the tokens that do not
keep the reply a JSON document's prefix at -inf (``kvcompile.json_mode``), before the row's greedy or sampled pick.
"""
from __future__ import annotations

import contextvars
import itertools
import logging
import threading

import torch
from .errors import ArgumentError, KeyNotFound, UnsupportedError

NO_TOP_K = 2**31 - 1  # a per-request top_k that keeps every token (transformers' warper clamps it to the vocabulary)
_SAMPLING: contextvars.ContextVar = contextvars.ContextVar("kvcompile_sampling", default=None)


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


class request_context:
    """Within the block, the continuous-batching manager adds requests with ``gen_config``'s sampling."""

    def __init__(self, gen_config):
        self.kw = getattr(gen_config, "_kvcompile_sampling", None)

    def __enter__(self):
        self.token = _SAMPLING.set(self.kw)

    def __exit__(self, *exc):
        _SAMPLING.reset(self.token)


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
            self.entries[step] = self._entry(token, logits)

    def took_prompt(self, place: int, logits: torch.Tensor) -> None:
        """The prompt's token at ``place`` (>= 1) has ``logits`` (the model's at the place before): its log
        probability and its top alternatives' (``top`` of them) are recorded."""
        self.prompt_entries[place] = self._entry(self.prompt[place], logits)

    def _entry(self, token: int, logits: torch.Tensor) -> tuple:
        """``(token, its log probability, [(id, log probability)] of the ``top`` most likely)`` under ``logits``."""
        logp = torch.log_softmax(logits.float(), -1)
        top = logp.topk(self.top) if self.top else None
        return token, float(logp[token]), list(zip(top.indices.tolist(), top.values.tolist())) if top else []


class Records:
    """What requests asked of their tokens (``Asked``), and what they generated, for the processor list that
    picks the tokens (``_routed_class``): a request that asks is added with a handle (``open``); each of its
    tokens is adjusted (bias, penalties) and recorded as it is picked, by its place in the reply, until the reply
    is built (``take``) and the handle closed. Log probabilities are the model's own distribution at that step
    (a log-softmax of its logits, before bias, penalties, temperature or top-k/top-p), as OpenAI's and vLLM's
    servers report them. Thread-safe: the batching thread records, the server's event loop reads."""

    def __init__(self):
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._open: dict[int, Asked] = {}
        self._prompts: dict[str, Asked] = {}  # request id: its record, while its prompt's entries are recorded

    def open(self, asked: Asked) -> int:
        with self._lock:
            h = next(self._ids) % 2**31
            self._open[h] = asked
            return h

    def close(self, handle: int) -> None:
        with self._lock:
            asked = self._open.pop(handle, None)
            for rid in [r for r, a in self._prompts.items() if a is asked]:
                del self._prompts[rid]

    def watch_prompt(self, request_id: str, asked: Asked) -> None:
        """Request ``request_id``'s prompt log probabilities go to ``asked`` (until its handle is closed)."""
        with self._lock:
            self._prompts[request_id] = asked

    def prompt_asked(self, request_id: str) -> Asked | None:
        """The record of a request whose prompt log probabilities are asked, or None."""
        with self._lock:
            return self._prompts.get(request_id)

    def take_prompt(self, handle: int) -> list:
        """The prompt's entries from its second token on, in order (a KeyError names a place the prefill did
        not record: a defect)."""
        with self._lock:
            a = self._open[handle]
            missing = [i for i in range(1, len(a.prompt)) if i not in a.prompt_entries]
            if missing:
                raise KeyNotFound(f"no log probabilities recorded for prompt tokens {missing[:8]}")
            return [a.prompt_entries[i] for i in range(1, len(a.prompt))]

    def get(self, handle: int) -> Asked | None:
        with self._lock:
            return self._open.get(handle)

    def take(self, handle: int, start: int, stop: int) -> list:
        """The log-probability entries of the reply's tokens ``start`` to ``stop`` (exclusive), in order; a
        KeyError names a token that has none (a defect: every token a request generates is recorded)."""
        with self._lock:
            entries = self._open[handle].entries
            missing = [i for i in range(start, stop) if i not in entries]
            if missing:
                raise KeyNotFound(f"no log probabilities recorded for tokens {missing} of the reply")
            return [entries[i] for i in range(start, stop)]

    def __len__(self) -> int:
        with self._lock:
            return len(self._open)


# a request's keyword: the number of its prompt's tokens whose log probabilities are asked (its first one has
# none): every one is computed (no prefix match) and the rows of their logits are kept (``serving.prompt_rows``)
PROMPT_ROWS = "prompt_rows"
RECORDS = Records()  # the server's one record (kvcompile serve runs one continuous-batching manager)
MAX_TOP_LOGPROBS = 20  # alternatives a token's entry may list (OpenAI's limit for chat completions; vLLM's default)
_DECIDER: list = []  # the process group whose first rank picks every token for all (``decide_on``)


def decide_on(group) -> None:
    """Under tensor parallelism (``kvcompile serve`` under torchrun) every rank's engine runs the processor list
    over the same batch, but only the driver (rank 0 of ``group``) holds what its requests asked (``RECORDS``:
    penalties, a logit bias, JSON mode) and draws by its own generator: the tokens it picks are sent to the
    other ranks, which take them, so that every rank stores and attends the same tokens."""
    _DECIDER[:] = [group]


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


def _arg_class():
    from transformers.generation.continuous_batching.cb_logits_processors import ContinuousBatchingLogitsProcessor

    class RequestArg(ContinuousBatchingLogitsProcessor):
        """One integer per request for ``Routed`` -- ``greedy``, ``seed``, ``record`` (its ``RECORDS`` handle; request
        kwargs) or ``step`` (tokens the request has generated) -- carried in the processors' argument rows,
        which transformers fills per batch with the batch's requests in the order of the logits' rows. It
        leaves the scores as they are."""
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

    return RequestArg


def seeded_draw(probs: torch.Tensor, seed: int, step: int) -> int:
    """A token drawn from ``probs [V]`` by the request's ``seed`` and the number of tokens it has generated
    (``step``) alone: the same request gives the same reply whatever else is in the batch. Inverse CDF of one
    uniform number from Python's generator seeded with both (all of their bits: torch's CPU generator keeps 32
    of a seed's), in float64; a token of probability 0 is never drawn."""
    import random

    u = random.Random(seed * 2**32 + step).random()
    cdf = probs.double().cumsum(0)
    return min(int(torch.searchsorted(cdf, u * cdf[-1], right=True)), probs.numel() - 1)


def _routed_class(base):
    """transformers' list of continuous-batching processors, which here also picks each row's token and hands the
    sampler a one-hot (0 at the token, -inf elsewhere: it draws that token with probability 1). A greedy row
    takes its argmax (the first of equal maxima, as transformers' greedy decoding) and skips the sampling
    processors (two sorts of the vocabulary a row and step: 13 ms a row on this CPU for a 49K vocabulary,
    against 0.1 ms for the argmax); a sampling row goes through them and is drawn from their distribution,
    by its seed (``seeded_draw``) when the request gave one, else by torch's generator."""
    from transformers.generation.continuous_batching.cb_logits_processors import ContinuousBatchingLogitsProcessor

    RequestArg = _arg_class()

    class Routed(base):
        def __call__(self, input_ids, scores, logits_processor_args):
            n = scores.size(0)
            rows_of = {id(q): i for i, q in enumerate(q for q in self.logits_processor
                                                      if isinstance(q, ContinuousBatchingLogitsProcessor))}
            arg = {q.name: logits_processor_args[rows_of[id(q)]][:n] for q in self.logits_processor
                   if isinstance(q, RequestArg)}
            raw = scores
            # rows whose request asked for more (``Records``): bias and penalties, log probabilities
            recorded = [(r, a, s) for r, h, s in zip(range(n), arg["record"].tolist(), arg["step"].tolist())
                        if h >= 0 and (a := RECORDS.get(h)) is not None]
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
            if _DECIDER:  # sharded: the driver's tokens, on every rank
                import torch.distributed as dist
                dist.broadcast(choice, src=dist.get_global_rank(_DECIDER[0], 0), group=_DECIDER[0])
            return torch.full_like(scores, float("-inf")).scatter_(-1, choice.unsqueeze(-1), 0.0)

    Routed.__name__ = Routed.__qualname__ = "Routed" + base.__name__
    Routed.RequestArg = RequestArg
    return Routed


def add_request_args(procs) -> None:
    """Make transformers' processor list ``procs`` pick tokens per request (``_routed_class``), with the
    per-request integers it reads."""
    routed = _routed_class(type(procs))
    for name, default, kwarg in (("greedy", 1, True), ("seed", -1, True), ("step", 0, False),
                                 ("record", -1, True)):
        procs.logits_processor.append(routed.RequestArg(name, default, kwarg))
        procs.tensors_required += 1
        if kwarg:
            procs.supported_keys[name] = int
    # no processor reads it: the engine's cache does (``serving.prompt_rows``)
    procs.supported_keys[PROMPT_ROWS] = int
    procs.do_processing = True
    procs.__class__ = routed


def sampling_manager(model, gen_config, cb_config):
    """A continuous-batching manager (not started) that samples per request: transformers' per-request
    temperature, top-k and top-p processors (``cb_config.per_request_processors`` is set here), routed by
    ``add_request_args``. Every request is added with its arguments (``request_sampling``, through
    ``_SAMPLING``); the manager's own values (which only make transformers create the processors) are never
    used."""
    import copy
    from dataclasses import replace

    if not getattr(cb_config, "per_request_processors", False):
        cb_config = replace(cb_config, per_request_processors=True)
    cfg = copy.deepcopy(gen_config)
    cfg.do_sample, cfg.temperature, cfg.top_k, cfg.top_p = True, 0.5, 1, 0.5
    cfg.stop_strings = cfg.sequence_bias = cfg.repetition_penalty = None  # refused per request (UNSUPPORTED)
    cb = model.init_continuous_batching(generation_config=cfg, continuous_batching_config=cb_config)
    procs = cb.logit_processor
    kinds = sorted(procs.supported_keys)
    if kinds != ["temperature", "top_k", "top_p"]:
        raise UnsupportedError(f"transformers' continuous batching made per-request processors for {kinds}, expected "
                           f"temperature, top_k and top_p: this transformers version samples differently")
    add_request_args(procs)
    add = cb.add_request

    def add_request(input_ids, *args, **kwargs):
        kwargs = {**(_SAMPLING.get() or {}), **kwargs}
        asked = RECORDS.get(kwargs.get("record", -1))
        if asked is not None and asked.prompt is not None:
            if kwargs.get("request_id") is None:
                raise ArgumentError("a request whose prompt log probabilities are asked needs its request_id")
            RECORDS.watch_prompt(kwargs["request_id"], asked)  # before the engine can schedule it
            # carried by the request to every rank's engine: each keeps the same rows of every forward
            kwargs[PROMPT_ROWS] = len(asked.prompt)
        return add(input_ids, *args, **kwargs)

    cb.add_request = add_request
    return cb
