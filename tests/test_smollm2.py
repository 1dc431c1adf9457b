"""The generation modes on the real model: the embedded SmolLM2-135M-Instruct, applied as a user would.

Under ``Policy.full()`` every mode gives exactly the unmodified model's tokens; under 4-bit KIVI the chat
answer is still right. One applied model serves every test (its graphs are compiled once, as a user's
would be), with the default kernels (the C kernels on this CPU).
"""
import pytest
import torch
from transformers import TextIteratorStreamer, pipeline

import kvcompile
from kvcompile import Policy, models
from kvcompile.hf import KVCompileCache

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    torch._dynamo.reset()
    ref, tok = models.load()
    model, _ = models.load()
    kvcompile.apply(model, Policy.full())
    return ref, model, tok


def chat(tok, text):
    msgs = [{"role": "user", "content": text}]
    return tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)


def both(ref, model, tok, **kw):
    with torch.no_grad():
        torch.manual_seed(0)
        want = ref.generate(**kw, pad_token_id=tok.eos_token_id)
        torch.manual_seed(0)
        got = model.generate(**kw, pad_token_id=tok.eos_token_id)
    assert torch.equal(got, want), (tok.batch_decode(got), tok.batch_decode(want))
    return got


def test_modes_give_the_unmodified_models_tokens(smollm2):
    ref, model, tok = smollm2
    enc = chat(tok, "What is the capital of France?")
    out = both(ref, model, tok, **enc, max_new_tokens=12, do_sample=False)
    assert "Paris" in tok.decode(out[0, enc["input_ids"].shape[1]:])
    both(ref, model, tok, **enc, max_new_tokens=10, num_beams=2, num_return_sequences=2, do_sample=False)
    both(ref, model, tok, **enc, max_new_tokens=12, do_sample=True, top_p=0.9)
    both(ref, model, tok, **enc, max_new_tokens=16, prompt_lookup_num_tokens=4, do_sample=False)


def test_a_chat_continues_in_the_returned_cache(smollm2):
    ref, model, tok = smollm2
    enc = chat(tok, "Name a fruit.")
    gen = dict(max_new_tokens=8, do_sample=False, return_dict_in_generate=True, pad_token_id=tok.eos_token_id)
    with torch.no_grad():
        r1, m1 = ref.generate(**enc, **gen), model.generate(**enc, **gen)
        assert isinstance(m1.past_key_values, KVCompileCache)
        more = chat(tok, "And a vegetable?")["input_ids"]
        ids_r, ids_m = torch.cat([r1.sequences, more], 1), torch.cat([m1.sequences, more], 1)
        r2 = ref.generate(ids_r, past_key_values=r1.past_key_values, **gen)
        m2 = model.generate(ids_m, past_key_values=m1.past_key_values, **gen)
    assert torch.equal(m1.sequences, r1.sequences) and torch.equal(m2.sequences, r2.sequences)


def test_pipeline_and_text_streamer(smollm2):
    ref, model, tok = smollm2
    pipe = pipeline("text-generation", model=model, tokenizer=tok)
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    out = pipe(msgs, max_new_tokens=10, do_sample=False)
    assert "Paris" in out[0]["generated_text"][-1]["content"]
    streamer = TextIteratorStreamer(tok, skip_prompt=True)
    enc = chat(tok, "What is the capital of France?")
    with torch.no_grad():
        model.generate(**enc, max_new_tokens=10, do_sample=False, streamer=streamer, pad_token_id=tok.eos_token_id)
    assert "Paris" in "".join(streamer)


def test_continuous_batching_with_a_shared_system_prompt(smollm2):
    """transformers' continuous batching on the real model, chats that open with the same system prompt (their
    first pages shared, not computed again): under Policy.full() exactly transformers' own engine's tokens,
    which shares its pages the same way."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    ref, model, tok = smollm2
    system = ("You are a geography tutor. Answer in one short sentence, name the country, and never add "
              "anything else. ") * 6
    prompts = [tok.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": q}],
                                       add_generation_prompt=True, return_dict=True)["input_ids"]
               for q in ("What is the capital of France?", "What is the capital of Italy?",
                         "What is the capital of Japan?")]
    assert len(prompts[0]) > 128
    gen = GenerationConfig(max_new_tokens=10, do_sample=False, eos_token_id=-1, pad_token_id=tok.eos_token_id)
    cbc = dict(num_blocks=64, max_batch_tokens=128)
    with torch.no_grad():
        want = ref.generate_batch(prompts, gen, continuous_batching_config=ContinuousBatchingConfig(**cbc),
                                  progress_bar=False)
        manager = model.init_continuous_batching(gen, ContinuousBatchingConfig(**cbc))
        manager.start()
        try:
            ids = manager.add_requests(inputs=prompts, max_new_tokens=10)
            got = {}
            while len(got) < len(ids):
                r = manager.get_result(timeout=120)
                assert r is not None and r.error is None
                if r.is_finished():
                    got[r.request_id] = r.generated_tokens
            reused = manager.batch_processor.cache.prefix_tokens
        finally:
            manager.stop(block=True, timeout=60)
    assert [got[i] for i in ids] == [r.generated_tokens for r in want.values()]
    assert reused >= 2 * 64  # the later chats read the system prompt's pages
    assert "Paris" in tok.decode(got[ids[0]])


def test_four_bit_kivi_still_answers():
    model, tok = models.load()
    kvcompile.apply(model, Policy.kivi(4, group=16, residual=4))  # a short window: the prompt is really packed
    enc = chat(tok, "What is the capital of France?")
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=12, do_sample=False, pad_token_id=tok.eos_token_id,
                             return_dict_in_generate=True)
    assert "Paris" in tok.decode(out.sequences[0, enc["input_ids"].shape[1]:])
    cache = out.past_key_values
    assert cache.layers[0].store.used_blocks > 0  # tokens were quantized, not all kept in the window
