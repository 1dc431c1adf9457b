"""Prompt pieces that do not depend on the batch: transformers' schedulers, with a prompt cut at fixed positions.

A prompt longer than a forward's room is prefilled in pieces, each attending to itself in full precision and to the
earlier pieces as stored -- quantized, under a quantized policy. transformers' schedulers cut a prompt where the
forward's token budget runs out, which depends on how many other requests decode or prefill in that forward, so a
request's numbers (and then its reply) would depend on what else runs. Here a prompt is cut at multiples of the
forward's token budget (``max_batch_tokens``) counted from its first token: a prompt that fits one forward is
prefilled whole, a longer one in the same pieces whoever runs beside it -- the pieces of kvcompile's ``generate``
with ``prefill_chunk_size=max_batch_tokens``. A piece that does not fit the forward's room waits for the next
forward rather than being cut shorter.

To make room, the prompts' pieces are scheduled before the decode steps (as transformers' ``prefill_first``
scheduler does): a prompt's next piece can then always take the whole forward. A decode step left out of a forward
runs in the next one and computes what it would have (a decode row attends alone). When the cache is below
transformers' safety margin (few free pages), decode steps go first and a piece runs only in a forward with no
decode step (transformers' own rule there: past its first request it takes decode steps only), so that running
requests finish and free pages before prompts take more.

When no layer is quantized (``Policy.full()``; a sliding-window layer's ring is full precision) the engine keeps
transformers' own scheduler: the earlier pieces are read exactly, so where a prompt is cut changes nothing
kvcompile computes, and the engine stays transformers' own, scheduling included.
"""
from __future__ import annotations

from transformers.generation.continuous_batching.requests import RequestState, RequestStatus
from transformers.generation.continuous_batching.scheduler import FIFOScheduler, PrefillFirstScheduler, Scheduler

__all__ = ["SCHEDULERS", "FixedPieces"]


class FixedPieces(Scheduler):
    """A transformers scheduler whose prompts are prefilled in pieces at fixed positions (see the module)."""

    def piece_room(self, state: RequestState) -> int:
        """Tokens from the request's next prompt position to the end of its piece."""
        size = self.cache.max_batch_tokens
        return size - state.position_offset % size

    def _piece_bound(self, state: RequestState) -> int:
        """The most tokens the request's next piece can take (before a pending prompt looks for shared pages,
        which only moves its start on: its piece is then no longer than a whole one)."""
        size = self.cache.max_batch_tokens
        room = size if state.status == RequestStatus.PENDING else self.piece_room(state)
        return min(len(state.remaining_prefill_tokens), room)

    def _process_candidates(self, candidates, token_budget, cache_budget, request_ids_to_remove_from_waiting):
        decoding = [s for s in candidates if s.status == RequestStatus.DECODING]
        prefilling = [s for s in candidates if s.status != RequestStatus.DECODING]
        pieces, left = [], token_budget
        if self._try_to_meet_safety_margin():
            for state in prefilling:  # in the scheduler's order: the first one that does not fit waits, and so
                need = self._piece_bound(state)  # do the ones behind it (no prompt is passed by shorter ones)
                if need > left:
                    break
                pieces.append(state)
                left -= need
            ordered = pieces + decoding
        else:  # few free pages: the decode steps; the first piece, which transformers takes only if none decodes
            left -= sum(len(s.tokens_to_process) for s in decoding)
            if prefilling and self._piece_bound(prefilling[0]) <= left:
                pieces.append(prefilling[0])
            ordered = decoding + pieces
        # every piece kept fits the budget as counted here; transformers' pass may leave a request out (its cache
        # budget, a page it cannot allocate) but never takes more, so each piece it schedules is whole
        return super()._process_candidates(ordered, token_budget, cache_budget, request_ids_to_remove_from_waiting)

    def _infer_request_tokens(self, state, request_ids_to_remove_from_waiting):
        tokens = super()._infer_request_tokens(state, request_ids_to_remove_from_waiting)
        if state.status == RequestStatus.DECODING:
            return tokens
        return tokens[:self.piece_room(state)]

    def _schedule_request(self, state, request_tokens, token_budget, request_ids_to_remove_from_waiting):
        if state.status != RequestStatus.DECODING:  # the piece, cut from the whole remainder at its end
            token_budget = min(token_budget, len(request_tokens))
            request_tokens = state.remaining_prefill_tokens
        super()._schedule_request(state, request_tokens, token_budget, request_ids_to_remove_from_waiting)


class FixedPiecesFIFO(FixedPieces, FIFOScheduler):
    """transformers' ``fifo`` scheduler with prompts in fixed pieces."""


class FixedPiecesPrefillFirst(FixedPieces, PrefillFirstScheduler):
    """transformers' ``prefill_first`` scheduler with prompts in fixed pieces."""


# transformers' scheduler names (ContinuousBatchingConfig.scheduler_type), for a quantized policy's engine
SCHEDULERS = {"fifo": FixedPiecesFIFO, "prefill_first": FixedPiecesPrefillFirst}
