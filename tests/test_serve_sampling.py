"""``kvcompile serve``'s per-request sampling without a server: which requests sample (``request_sampling``), and
the routed processor list (greedy rows skip the sampling processors) against transformers' own list."""
from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig
from transformers.generation.continuous_batching.cb_logits_processors import ContinuousBatchingLogitsProcessorList
from transformers.generation.logits_process import (LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper,
                                                    TopPLogitsWarper)

from kvcompile.serve import NO_TOP_K, _greedy_class, _routed_class, request_sampling

GREEDY = {"greedy": 1, "temperature": 1.0, "top_p": 1.0, "top_k": NO_TOP_K}


@pytest.mark.parametrize("body, config, want", [
    ({}, {}, GREEDY),  # the model's config decodes greedily
    ({"temperature": 0}, {"do_sample": True}, GREEDY),
    ({"temperature": 0.7}, {}, {"greedy": 0, "temperature": 0.7, "top_p": 1.0, "top_k": NO_TOP_K}),
    ({"top_p": 0.9}, {}, {"greedy": 0, "temperature": 1.0, "top_p": 0.9, "top_k": NO_TOP_K}),
    ({"top_k": 5}, {"top_k": 50}, {"greedy": 0, "temperature": 1.0, "top_p": 1.0, "top_k": 5}),
    ({"top_k": 0, "temperature": 1}, {}, {"greedy": 0, "temperature": 1.0, "top_p": 1.0, "top_k": NO_TOP_K}),
    ({}, {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20},
     {"greedy": 0, "temperature": 0.6, "top_p": 0.95, "top_k": 20}),
    ({"top_p": 0.5}, {"do_sample": True, "temperature": 0.6, "top_k": 50},
     {"greedy": 0, "temperature": 0.6, "top_p": 0.5, "top_k": 50}),
])
def test_a_request_samples_as_generate_would_read_it(body, config, want):
    got = request_sampling(body, GenerationConfig(**config))
    assert got == want and all(type(got[k]) is type(want[k]) for k in want)  # CB checks the types


def processors():
    lst = ContinuousBatchingLogitsProcessorList(
        LogitsProcessorList([TemperatureLogitsWarper(0.5), TopKLogitsWarper(1), TopPLogitsWarper(0.5)]),
        per_request_processors=True)
    lst.logits_processor.append(_greedy_class()())
    lst.tensors_required += 1
    return lst


def arguments(greedy: torch.Tensor) -> torch.Tensor:
    a = torch.empty(4, len(greedy), dtype=torch.int32)
    a[0] = torch.where(greedy, 1.0, 0.7).float().view(torch.int32)
    a[1] = torch.where(greedy, NO_TOP_K, 40).int()
    a[2] = torch.where(greedy, 1.0, 0.9).float().view(torch.int32)
    a[3] = greedy.int()
    return a


@pytest.mark.parametrize("mask", ["all", "some", "none"])
def test_greedy_rows_skip_the_sampling_processors_and_nothing_changes(mask):
    """The routed list gives exactly transformers' list's scores (every processor on every row), and a greedy
    row's scores are 0 at the model's argmax and -inf elsewhere (so the sampler draws the argmax)."""
    torch.manual_seed(0)
    B, V = 6, 1000
    scores = torch.randn(B, V)
    scores[1, 7] = scores[1, 9] = scores[1].max() + 1  # a tie: argmax's first index, as greedy decoding picks it
    greedy = {"all": torch.ones(B, dtype=torch.bool), "none": torch.zeros(B, dtype=torch.bool),
              "some": torch.arange(B) % 2 == 1}[mask]
    ids, args = torch.zeros(B, dtype=torch.long), arguments(greedy)
    want = processors()(ids, scores.clone(), args)
    routed = processors()
    routed.__class__ = _routed_class(type(routed))
    got = routed(ids, scores.clone(), args)
    assert torch.equal(got, want)
    for r in greedy.nonzero().flatten().tolist():
        top = int(scores[r].argmax())
        assert got[r, top] == 0 and torch.isinf(got[r]).sum() == V - 1
        assert int(torch.multinomial(torch.softmax(got[r], -1), 1)) == top
