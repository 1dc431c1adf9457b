"""What JSON mode costs per token, in process: ``kvcompile.json_mode``'s two calls per constrained row and step
(``JsonConstraint.mask_``: llguidance's mask, unpacked, the other tokens' logits at -inf; ``took``: its matcher
advanced), timed over real replies.

    python benchmarks/json_mode_cost.py                      # SmolLM2, JSON mode and a bounded schema, 64 tokens
    python benchmarks/json_mode_cost.py --tokens 16 --random # a tiny random model over SmolLM2's tokenizer (seconds)

SmolLM2-135M (or ``--random``: a 2-layer random Llama over its tokenizer) writes each reply greedily under the
constraint from a story prompt, one token at a time through ``generate`` with the constraint as a logits
processor; the two calls are timed per token in CPU time of this thread (``time.thread_time``: what the call
computes, not the time other processes on a shared machine take from it) and reported as median and 90th
percentile microseconds, with the reply's tokens. One thread. The model's own forward is not timed.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

SCHEMA = Path(__file__).parent / "results" / "serve_fields_schema_request.json"  # serve_load's bounded schema


def replies(model, tok, schema, n: int) -> dict:
    """One greedy reply of ``n`` tokens at most under ``schema`` (None: JSON mode): the per-token times."""
    from transformers import LogitsProcessor, LogitsProcessorList

    from kvcompile.json_mode import JsonConstraint, grammar, tokenizer_info

    vocab = model.config.vocab_size
    c = JsonConstraint(tokenizer_info(tok, vocab, (tok.eos_token_id,)), grammar(schema))
    mask_s, took_s = [], []

    class Constrained(LogitsProcessor):
        def __call__(self, input_ids, scores):
            if input_ids.shape[1] > prompt_len:  # the token picked at the step before
                t0 = time.thread_time()
                c.took(int(input_ids[0, -1]))
                took_s.append(time.thread_time() - t0)
            t0 = time.thread_time()
            c.mask_(scores[0])
            mask_s.append(time.thread_time() - t0)
            return scores

    chat = [{"role": "user", "content": "Tell me a short story about a lighthouse keeper, as JSON."}]
    ids = tok.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    prompt_len = ids.shape[1]
    out = model.generate(ids, max_new_tokens=n, do_sample=False, logits_processor=LogitsProcessorList([Constrained()]),
                         pad_token_id=tok.eos_token_id)
    text = tok.decode(out[0, prompt_len:], skip_special_tokens=True)

    def us(xs):
        xs = sorted(xs)
        return {"median_us": round(statistics.median(xs) * 1e6, 1), "p90_us": round(xs[int(0.9 * (len(xs) - 1))] * 1e6, 1)}

    return {"tokens": out.shape[1] - prompt_len, "mask": us(mask_s), "took": us(took_s) if took_s else None,
            "reply": text}


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=64, help="tokens per reply (default: %(default)s)")
    ap.add_argument("--random", action="store_true", help="a tiny random model over SmolLM2's tokenizer")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    import transformers

    from kvcompile import models

    folder = models.convert_default(log=lambda *a: None)
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    if args.random:
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, eos_token_id=tok.eos_token_id))
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.eval()
    schema = json.loads(SCHEMA.read_text())["response_format"]["json_schema"]["schema"]
    rows = []
    with torch.no_grad():
        for name, s in (("JSON mode", None), ("the bounded schema", schema)):
            row = {"fields": name, **replies(model, tok, s, args.tokens)}
            rows.append(row)
            print(json.dumps(row, ensure_ascii=False))
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1, ensure_ascii=False) + "\n")
    return rows


if __name__ == "__main__":
    main()
