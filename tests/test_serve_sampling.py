"""``kvcompile serve``'s per-request sampling (``kvcompile.sampling``) without a server: which requests sample
(``request_sampling``), and the processor list that picks each row's token (``RoutedProcessors``): greedy rows
their argmax, sampling rows a token their filters keep, seeded rows the same token whatever else is in the
batch; rows whose request asks for log probabilities record their token's and its alternatives'."""
from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig
from transformers.generation.continuous_batching.cb_logits_processors import ContinuousBatchingLogitsProcessorList
from transformers.generation.logits_process import (LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper,
                                                    TopPLogitsWarper)

from kvcompile.sampling import (NO_TOP_K, Asked, RequestOptions, Requests, RoutedProcessors, request_sampling,
                                seeded_draw)

GREEDY = {"greedy": 1, "temperature": 1.0, "top_p": 1.0, "top_k": NO_TOP_K, "seed": -1}


def sampled(**kw):
    return {"greedy": 0, "temperature": 1.0, "top_p": 1.0, "top_k": NO_TOP_K, "seed": -1, **kw}


@pytest.mark.parametrize("body, config, want", [
    ({}, {}, GREEDY),  # the model's config decodes greedily
    ({"temperature": 0, "seed": 3}, {"do_sample": True}, GREEDY),
    ({"temperature": 0.7}, {}, sampled(temperature=0.7)),
    ({"top_p": 0.9}, {}, sampled(top_p=0.9)),
    ({"top_k": 5}, {"top_k": 50}, sampled(top_k=5)),
    ({"top_k": 0, "temperature": 1}, {}, sampled()),
    ({"temperature": 1.2, "seed": 2**40 + 5}, {}, sampled(temperature=1.2, seed=5)),
    ({}, {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20},
     sampled(temperature=0.6, top_p=0.95, top_k=20)),
    ({"top_p": 0.5}, {"do_sample": True, "temperature": 0.6, "top_k": 50}, sampled(temperature=0.6, top_p=0.5,
                                                                                  top_k=50)),
])
def test_a_request_samples_as_generate_would_read_it(body, config, want):
    got = request_sampling(body, GenerationConfig(**config))
    assert got == want and all(type(got[k]) is type(want[k]) for k in want)  # CB checks the types


TABLE = Requests()  # a server's table of its requests' options, which the processors read per row


def processors():
    lst = RoutedProcessors(
        LogitsProcessorList([TemperatureLogitsWarper(0.5), TopKLogitsWarper(1), TopPLogitsWarper(0.5)]),
        per_request_processors=True, requests=TABLE)
    assert isinstance(lst, ContinuousBatchingLogitsProcessorList)
    return lst


_IDS: dict[int, str] = {}  # handle: request id


def opened(asked: Asked) -> int:
    """A request asking ``asked`` of its tokens, in the table: its handle."""
    rid = f"req-{len(_IDS)}"
    handle = TABLE.add(rid, RequestOptions(asked=asked)).handle
    _IDS[handle] = rid
    return handle


def closed(handle: int) -> None:
    TABLE.remove(_IDS.pop(handle))


def take(handle: int, start: int, stop: int) -> list:
    return TABLE.by_handle(handle).asked.take(start, stop)


def arguments(rows: list[dict], steps: list[int], handles=None) -> torch.Tensor:
    """The argument rows transformers fills: temperature, top_k, top_p, greedy, seed, step, record (a handle in
    ``TABLE``, -1: none)."""
    a = torch.empty(7, len(rows), dtype=torch.int32)
    a[0] = torch.tensor([r["temperature"] for r in rows], dtype=torch.float32).view(torch.int32)
    a[1] = torch.tensor([r["top_k"] for r in rows], dtype=torch.int32)
    a[2] = torch.tensor([r["top_p"] for r in rows], dtype=torch.float32).view(torch.int32)
    a[3] = torch.tensor([r["greedy"] for r in rows], dtype=torch.int32)
    a[4] = torch.tensor([r["seed"] for r in rows], dtype=torch.int32)
    a[5] = torch.tensor(steps, dtype=torch.int32)
    a[6] = torch.tensor(handles or [-1] * len(rows), dtype=torch.int32)
    return a


def picks(lst, scores, rows, steps, handles=None):
    out = lst(torch.zeros(len(rows), dtype=torch.long), scores.clone(), arguments(rows, steps, handles))
    assert torch.isinf(out).sum(1).tolist() == [scores.shape[1] - 1] * len(rows) and (out.amax(1) == 0).all()
    return out.argmax(1).tolist()  # the one token each row may draw


def test_each_row_picks_as_it_asks():
    torch.manual_seed(0)
    V = 1000
    scores = torch.randn(5, V) * 3
    scores[0, 7] = scores[0, 9] = scores[0].max() + 1  # a tie: the first index, as greedy decoding picks it
    rows = [GREEDY, sampled(top_k=3), sampled(seed=11, temperature=1.5), GREEDY, sampled(top_p=0.3)]
    got = picks(processors(), scores, rows, [0, 1, 2, 3, 4])
    assert got[0] == 7 and got[3] == int(scores[3].argmax())
    assert got[1] in scores[1].topk(3).indices.tolist()
    p = torch.softmax(scores[4], -1).sort(descending=True)
    keep = p.indices[: int((p.values.cumsum(0) < 0.3).sum()) + 1].tolist()
    assert got[4] in keep


def test_a_seeded_row_draws_the_same_token_in_any_batch():
    torch.manual_seed(1)
    V = 500
    row = torch.randn(V)
    ask = sampled(seed=42, temperature=2.0)
    alone = picks(processors(), row[None], [ask], [7])[0]
    others = torch.randn(3, V)
    batch = torch.cat([others[:2], row[None], others[2:]])
    torch.manual_seed(99)  # torch's generator draws the unseeded rows: it does not matter to the seeded one
    mixed = picks(processors(), batch, [sampled(), GREEDY, ask, sampled(seed=3)], [0, 0, 7, 0])
    assert mixed[2] == alone == seeded_draw(torch.softmax(row / 2.0, -1), 42, 7)
    draws = {seeded_draw(torch.softmax(row / 2.0, -1), 42, step) for step in range(20)}
    assert len(draws) > 5  # the step moves the draw on
    seeds = {seeded_draw(torch.softmax(row / 2.0, -1), seed, 7) for seed in range(20)}
    assert len(seeds) > 5  # and so does the seed


def test_a_seeded_draw_follows_the_distribution_and_never_takes_a_zero():
    probs = torch.tensor([0.0, 0.5, 0.0, 0.3, 0.2])
    counts = torch.bincount(torch.tensor([seeded_draw(probs, 5, s) for s in range(4000)]), minlength=5).double()
    assert counts[0] == counts[2] == 0
    assert torch.allclose(counts / 4000, probs.double(), atol=0.03)


def test_rows_that_ask_record_their_tokens_log_probabilities():
    """The chosen token's log probability and the ``top`` most likely tokens', under the model's own distribution
    (the raw scores: a sampling row's temperature does not change them), kept by the token's place in the reply;
    rows that do not ask record nothing."""
    torch.manual_seed(2)
    V = 300
    scores = torch.randn(4, V) * 2
    h3, h0, h5 = opened(Asked(top=3)), opened(Asked(top=0)), opened(Asked(top=5))
    try:
        rows = [GREEDY, sampled(seed=5, temperature=1.5), GREEDY, sampled(top_k=4)]
        got = picks(processors(), scores, rows, [4, 0, 9, 2], handles=[h3, h0, -1, h5])
        logp = torch.log_softmax(scores, -1)
        for row, handle, step, top in ((0, h3, 4, 3), (1, h0, 0, 0), (3, h5, 2, 5)):
            [(token, lp, alternatives)] = take(handle, step, step + 1)
            assert token == got[row] and lp == pytest.approx(float(logp[row, token]), abs=1e-6)
            want = logp[row].topk(top)
            assert [i for i, _ in alternatives] == want.indices.tolist()
            assert [v for _, v in alternatives] == pytest.approx(want.values.tolist(), abs=1e-6)
        assert alternatives[0][1] >= alternatives[-1][1]
        with pytest.raises(KeyError, match=r"tokens \[3\]"):
            take(h3, 3, 5)  # the token before was never picked
    finally:
        for h in (h3, h0, h5):
            closed(h)
    assert len(TABLE) == 0
    picks(processors(), scores[:1], [GREEDY], [5], handles=[h3])  # a closed record takes nothing
    assert len(TABLE) == 0


def test_penalties_and_a_logit_bias_adjust_a_rows_logits():
    """OpenAI's penalties over the tokens a request generated before (``logit - frequency * count - presence *
    (count > 0)``) and its logit bias change what the row picks, greedy or sampled, and not the log
    probabilities it reports (the model's own); rows of other requests are untouched."""
    V = 50
    scores = torch.zeros(2, V)
    scores[:, 10], scores[:, 11], scores[:, 12] = 3.0, 2.5, 2.0  # the same logits at every step
    steps = 4

    def run(asked, rows=(GREEDY, GREEDY)):
        h = opened(asked)
        try:
            picked = [picks(processors(), scores, list(rows), [k, k], handles=[h, -1]) for k in range(steps)]
            return [p[0] for p in picked], [p[1] for p in picked], asked
        finally:
            closed(h)

    mine, other, _ = run(Asked())
    assert mine == other == [10] * steps
    mine, other, _ = run(Asked(frequency=0.3))  # 10 once: 2.7 > 2.5; twice: 2.4 < 2.5 ...
    assert mine == [10, 10, 11, 10] and other == [10] * steps
    mine, _, _ = run(Asked(presence=1.2))  # 10 (3.0), 11 (2.5 > 1.8), 12 (2.0 > 1.8), 10 (1.8 > 1.3, 0.8)
    assert mine == [10, 11, 12, 10]
    mine, _, asked = run(Asked(bias={40: 5.0}, top=1))  # a bias lifts token 40 above all
    assert mine == [40] * steps
    [(token, lp, [(best, best_lp)])] = [asked.entries[0]]
    assert token == 40 and best == 10  # the reported log probabilities are the model's own
    assert lp == pytest.approx(float(torch.log_softmax(scores[0], -1)[40]))
    mine, _, _ = run(Asked(bias={10: -100.0}))
    assert mine == [11] * steps
    torch.manual_seed(0)
    mine, _, _ = run(Asked(bias={10: -100.0, 11: -100.0, 12: -100.0}),
                     rows=(sampled(top_k=1), GREEDY))  # sampled: drawn from the adjusted logits
    assert all(t not in (10, 11, 12) for t in mine)


def test_a_request_whose_token_picking_fails_ends_and_the_others_go_on():
    """An exception doing what one request asked (here its JSON constraint breaks) marks that request failed
    and ends it on the end token (its client gets an error), instead of stopping the engine: the other rows of
    the batch pick as before, now and at the next step."""
    class Broken:
        def mask_(self, logits):
            raise RuntimeError("broken constraint")

    torch.manual_seed(3)
    scores = torch.randn(3, 50)
    bad, fine = Asked(json_mode=True), Asked(top=1)
    bad.json, bad.eos = Broken(), 9
    hb, hf = opened(bad), opened(fine)
    try:
        for step in range(2):
            got = picks(processors(), scores, [GREEDY, GREEDY, GREEDY], [step] * 3, handles=[hb, hf, -1])
            assert got == [9, int(scores[1].argmax()), int(scores[2].argmax())]
        assert bad.failed == "RuntimeError: broken constraint"
        assert fine.failed is None and [e[0] for e in take(hf, 0, 2)] == [got[1]] * 2
    finally:
        closed(hb)
        closed(hf)


def json_row(tokenizer, schema, prefix: str) -> Asked:
    """A request in JSON mode (``kvcompile.json_mode`` over ``tokenizer``) whose reply so far is ``prefix``."""
    from kvcompile.json_mode import JsonConstraint, grammar, tokenizer_info

    asked = Asked(json_mode=True, json_schema=schema)
    asked.json = JsonConstraint(tokenizer_info(tokenizer, len(tokenizer), (tokenizer.eos_token_id,)), grammar(schema))
    for step, t in enumerate(tokenizer(prefix, add_special_tokens=False).input_ids):
        asked.took(step, t, torch.zeros(len(tokenizer)))
    return asked


def test_a_json_row_picks_from_the_tokens_that_keep_its_json(tiny_tokenizer):
    """A JSON-mode row among plain ones: greedy, the best of the tokens the constraint allows (the best of all is
    not one); sampled, a draw from the row's distribution restricted to them, in proportion (the request's
    temperature applied to what is left); seeded, the same token in any batch, ``seeded_draw`` of that restricted
    distribution. The plain rows pick as before."""
    schema = {"type": "object", "properties": {"k": {"enum": ["a", "b", "c", "d"]}}, "required": ["k"]}
    V = len(tiny_tokenizer)
    g = torch.Generator().manual_seed(4)
    scores = torch.randn(3, V, generator=g) * 2
    asked = json_row(tiny_tokenizer, schema, '{"k":')
    step = len(asked.tokens)
    allowed = asked.json.allowed()
    assert 2 <= int(allowed.sum()) < 10
    scores[0, ~allowed] += 5  # what the model likes best does not fit
    masked = scores[0].masked_fill(~allowed, float("-inf"))
    h = opened(asked)
    try:
        got = picks(processors(), scores, [GREEDY, GREEDY, sampled(top_k=2)], [step, 0, 0], handles=[h, -1, -1])
        assert got[0] == int(masked.argmax()) and got[1] == int(scores[1].argmax())
        assert got[2] in scores[2].topk(2).indices.tolist()
        restricted = torch.softmax(masked / 0.7, -1)
        torch.manual_seed(0)
        n = 1500
        counts = torch.bincount(torch.tensor([picks(processors(), scores[:1], [sampled(temperature=0.7)], [step],
                                                    handles=[h])[0] for _ in range(n)]), minlength=V).double()
        assert counts[~allowed].sum() == 0
        # each frequency within 4.5 standard deviations of its probability (a binomial's: at most 0.0129 here)
        assert ((counts / n - restricted.double()).abs() <= 4.5 * (0.25 / n) ** 0.5).all()
        seeded = sampled(seed=21, temperature=0.7)
        alone = picks(processors(), scores[:1], [seeded], [step], handles=[h])[0]
        mixed = picks(processors(), scores[[2, 0, 1]], [sampled(), seeded, GREEDY], [0, step, 0],
                      handles=[-1, h, -1])[1]
        assert alone == mixed == seeded_draw(restricted, 21, step)
    finally:
        closed(h)


def test_a_json_row_ends_on_the_end_token_once_its_object_is_whole(tiny_tokenizer):
    """Once the object is whole only the end token is allowed: the row picks it, greedy or sampled, however
    unlikely the model finds it."""
    asked = json_row(tiny_tokenizer, None, '{"a": 1}')
    scores = torch.zeros(1, len(tiny_tokenizer))
    scores[0, tiny_tokenizer.eos_token_id] = -30.0
    h = opened(asked)
    try:
        step = len(asked.tokens)
        for row in (GREEDY, sampled(), sampled(seed=1)):
            assert picks(processors(), scores, [row], [step], handles=[h]) == [tiny_tokenizer.eos_token_id]
    finally:
        closed(h)
