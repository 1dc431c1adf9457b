"""vLLM's own KV cache and kvcompile's policies inside vLLM, side by side at one KV memory size.

    MODEL=$(.venv/bin/python -c "from kvcompile import models; print(models.convert_default(log=lambda *a: None))")
    /path/to/vllm-env/bin/python benchmarks/vllm_side_by_side.py --model $MODEL --kv-mib 256 --eager \
        --calibrated benchmarks/results/calibrate/smollm2_cal2.json \
        --out benchmarks/results/vllm_side_by_side.json --plot docs/vllm_side_by_side.png

Run in the vLLM environment (docs/vllm.md). For each contender -- vLLM ``auto`` (the model's dtype), vLLM
``fp8``, and kvcompile policies named in ``additional_config`` -- three engines start:

- **capacity**, an ``LLM`` in this process, bf16 (``--capacity-dtype``), ``--kv-mib`` of KV memory, requests up to
  8K tokens: vLLM's own block count and the concurrency it reports for 8K-token requests; for 1K-token requests
  the same formula (blocks / pages per request);
- **quality**, an ``LLM`` in this process, fp32 (as ``kvcompile eval``): held-out loss on the texts ``kvcompile
  eval`` scores (``kvcompile.evaluate.heldout_windows``: windows of ``--window`` tokens from Python's own docs;
  the loss of the second half of each window, from vLLM's prompt log probabilities of one prefill), and passkey
  retrieval (``kvcompile.evaluate``'s prompts; greedy answers through vLLM);
- **serving**, vLLM's OpenAI server (``python -m vllm.entrypoints.openai.api_server``, vLLM's default processes),
  ``--serve-dtype`` (fp32: bf16 matmuls on a CPU without AVX-512 BF16 made a 2 x 1K-token prefill take 130 s
  here), ``--kv-mib`` of KV memory, requests of ``--prompt`` + ``--new`` tokens: as many streaming requests at once
  as vLLM reports it holds (``--max-concurrency`` caps it), each a different held-out window, read to the end with
  the ``openai`` client: generated tokens/s over the whole level, and decode tokens/s once every request has its
  first token.

A contender that vLLM or kvcompile refuses at start-up is reported with the reason (on this CPU vLLM's ``fp8``
needs AVX-512; what kvcompile refuses: docs/vllm.md).
kvcompile's own numbers for the same policies, where ``docs/eval.json`` has them, are put beside vLLM's; that
protocol feeds the second half in chunks of 64 and reads a chunk's own keys in full precision, where vLLM reads
every position from the pages (docs/vllm.md), so it is another measurement. ``kvcompile eval --own stored``
measures what vLLM computes; ``--quality-only --eval-stored EVAL_JSON`` runs only the quality engines and puts
that run's losses beside vLLM's:

    kvcompile eval --own stored --entries int8:8 tok+rot:4 --passkey --out /tmp/stored
    /path/to/vllm-env/bin/python benchmarks/vllm_side_by_side.py --model $MODEL --quality-only --passkey \
        --only "vLLM auto" "kvcompile int8" "kvcompile tok+rot:4" --eval-stored /tmp/stored/eval.json
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.serve_load import launch  # noqa: E402

CONTENDERS = [  # (label, kvcompile policy name or None, vLLM engine arguments)
    ("vLLM auto", None, {}),
    ("vLLM fp8", None, {"kv_cache_dtype": "fp8"}),
    ("kvcompile int8", "int8", {}),
    ("kvcompile int8 sym+rot", "tok+rot+sym:8", {}),  # one fp16 scale a token-head (vLLM's int8 layout)
    ("kvcompile fp8-r0", "fp8-r0", {}),
    ("kvcompile fp8-tensor", "fp8-tensor", {}),  # no scale stored: vLLM fp8's bytes and arithmetic
    ("kvcompile fp8-tensor+rot", "fp8-tensor+rot", {}),  # the same bytes, rotated first
    ("kvcompile tok+rot:4", "tok+rot:4", {}),
    ("kvcompile tok+rot:2", "tok+rot:2", {}),
    ("kvcompile kivi+rot:4", "kivi+rot:4", {}),  # a window of 128 tokens and key groups: a sliding window cache
    ("kvcompile kivi-r0+rot:4", "kivi-r0+rot:4", {}),  # KIVI's key groups alone: a ring for the pending group
    ("kvcompile kivi-r0+rot+fp8s:4", "kivi-r0+rot+fp8s:4", {}),
    # its ring fits a page of 256 tokens in bf16, of 512 in float32 (the quality engines and the servers)
    ("kvcompile kivi-r0+rot+fp8s:2", "kivi-r0+rot+fp8s:2", {"min_block": {"bfloat16": 256, "float32": 512}}),
    ("kvcompile kivi+rot+sink:4", "kivi+rot+sink:4", {}),  # KIVI's default preset: sinks in the first page
    ("kvcompile kivi+rot+sink+fp8s:4", "kivi+rot+sink+fp8s:4", {}),  # the same with one-byte scales
]


def reason(e: BaseException) -> str:
    """The refusal's own message: the first error in the chain that names kvcompile or vLLM's reason."""
    chain = []
    while e is not None and len(chain) < 10:
        chain.append(e)
        e = e.__cause__ or e.__context__
    for err in chain:
        if type(err).__module__.startswith("kvcompile") or isinstance(err, NotImplementedError):
            return f"{type(err).__name__}: {err}"
    return f"{type(chain[-1]).__name__}: {chain[-1]}"


def extra_args(policy, engine, dtype: str, block: int | None = None):
    """The engine arguments of a contender in ``dtype``: its own, its policy, and a block size of at least
    ``block`` (the phase's) and the contender's smallest page in that dtype (``min_block``)."""
    block = max(block or 0, engine.get("min_block", {}).get(dtype, 0)) or None
    own = {k: v for k, v in engine.items() if k != "min_block"}
    return {**own, **({"block_size": block} if block else {}),
            **({"additional_config": {"kvcompile": {"policy": policy}}} if policy else {})}


# --------------------------------------------------------------------------- quality
def quality(args, tok, policy, engine) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from kvcompile.evaluate import PASSKEY_NEW_TOKENS, heldout_windows, passkey_prompt, passkey_trials
    try:
        llm = LLM(model=args.model, dtype="float32", enforce_eager=True, max_model_len=max(args.passkey + [args.window + 1]),
                  seed=0, distributed_executor_backend="uni", kv_cache_memory_bytes=args.quality_kv_mib << 20,
                  **extra_args(policy, engine, "float32", args.quality_block))
    except Exception as e:  # noqa: BLE001  (a refusal at start-up: reported, the next contender runs)
        return {"refused": reason(e)}
    try:
        windows = heldout_windows(tok, args.window, args.windows)
        half = args.window // 2
        outs = llm.generate([TokensPrompt(prompt_token_ids=w.tolist()) for w in windows],
                            SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
        losses = []
        for w, o in zip(windows.tolist(), outs):
            lps = [o.prompt_logprobs[p][w[p]].logprob for p in range(half, len(w))]
            losses.append(-sum(lps) / len(lps))
        trials = passkey_trials(args.passkey, args.trials, seed=0)
        prompts = [TokensPrompt(prompt_token_ids=passkey_prompt(tok, t)[0]) for t in trials]
        answers = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=PASSKEY_NEW_TOKENS),
                               use_tqdm=False) if prompts else []
        found = {}
        for t, a in zip(trials, answers):
            found.setdefault(t.length, []).append(str(t.key) in a.outputs[0].text)
        return {"loss": sum(losses) / len(losses), "loss_per_window": losses,
                "passkey": {str(L): sum(v) / len(v) for L, v in found.items()}}
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


# --------------------------------------------------------------------------- capacity
def capacity(args, policy, engine) -> dict:
    """vLLM's own count for ``--kv-mib`` of KV memory in ``--capacity-dtype``: its KV tokens and the concurrency it
    reports for requests of ``--long`` (8K) tokens; 1K requests by the same formula (blocks / pages per request)."""
    from vllm import LLM
    try:
        llm = LLM(model=args.model, dtype=args.capacity_dtype, enforce_eager=True, max_model_len=args.long, seed=0,
                  distributed_executor_backend="uni", kv_cache_memory_bytes=args.kv_mib << 20,
                  **({"max_num_batched_tokens": args.max_num_batched_tokens} if args.max_num_batched_tokens else {}),
                  **extra_args(policy, engine, args.capacity_dtype))
    except Exception as e:  # noqa: BLE001
        return {"refused": reason(e)}
    try:
        cc = llm.llm_engine.vllm_config.cache_config  # what vLLM logs as its KV cache size and concurrency
        return {"dtype": args.capacity_dtype, "blocks": cc.num_gpu_blocks, "kv_tokens": cc.kv_cache_size_tokens,
                "max_num_batched_tokens": llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens,
                "concurrency_8k": cc.kv_cache_max_concurrency,
                "concurrency_1k": concurrency(llm, 1024)}
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def concurrency(llm, tokens: int) -> float:
    """The concurrency vLLM reports for requests of ``tokens`` tokens (its own formula over the engine's cache
    groups: a windowed policy's window cache counts as vLLM counts a sliding-window layer)."""
    import copy

    from vllm.v1.core.kv_cache_utils import get_max_concurrency_for_kv_cache_config
    cfg = copy.copy(llm.llm_engine.vllm_config)
    cfg.model_config = copy.copy(cfg.model_config)
    cfg.model_config.max_model_len = tokens
    kv = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config
    return get_max_concurrency_for_kv_cache_config(cfg, kv)


# --------------------------------------------------------------------------- serving
def server_command(args, policy, engine):
    def command(port):
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", args.model, "--host",
               "127.0.0.1", "--port", str(port), "--dtype", args.serve_dtype, "--max-model-len",
               str(args.prompt + args.new), "--kv-cache-memory-bytes", str(args.kv_mib << 20), "--seed", "0"]
        if args.eager:
            cmd.append("--enforce-eager")
        if engine.get("kv_cache_dtype"):
            cmd += ["--kv-cache-dtype", engine["kv_cache_dtype"]]
        block = extra_args(None, engine, args.serve_dtype, args.serve_block).get("block_size")
        if block:
            cmd += ["--block-size", str(block)]
        if policy:
            cmd += ["--additional-config", json.dumps({"kvcompile": {"policy": policy}})]
        return cmd
    return command


async def one_level(base, model, prompts, new) -> dict:
    from openai import AsyncOpenAI
    client = AsyncOpenAI(base_url=base, api_key="unused", timeout=3600, max_retries=0)
    firsts, ends, tokens = [], [], []

    async def one(p):
        n, first = 0, None
        stream = await client.completions.create(model=model, prompt=p, max_tokens=new, temperature=0, stream=True,
                                                 stream_options={"include_usage": True})
        async for chunk in stream:
            if chunk.choices and first is None:  # the first token (its text may be empty)
                first = time.perf_counter()
            if chunk.usage:
                n = chunk.usage.completion_tokens
        firsts.append(first)
        ends.append(time.perf_counter())
        tokens.append(n)

    t0 = time.perf_counter()
    async with client:  # closed inside this level's event loop (asyncio.run closes the loop after it)
        await asyncio.gather(*[one(p) for p in prompts])
    t1, all_first = max(ends), max(f for f in firsts if f is not None)
    total = sum(tokens)
    return {"requests": len(prompts), "generated_tokens": total, "seconds": t1 - t0,
            "tokens_per_s": total / (t1 - t0),
            "decode_tokens_per_s": (total - len(prompts)) / (t1 - all_first) if t1 > all_first else None,
            "time_to_first_token_s": sorted(f - t0 for f in firsts)[len(firsts) // 2]}


def serving(args, tok, policy, engine) -> dict:
    from kvcompile.evaluate import heldout_windows
    try:
        proc, port, log = launch(server_command(args, policy, engine), "/v1/models", "vllm server",
                                 startup_s=args.startup_s)
    except RuntimeError as e:
        text = str(e)
        m = re.search(r"(kvcompile[^\n]*cannot be kept in pages[^\n]*|Refused: [^\n]*|PolicyError: [^\n]*|"
                      r"NotImplementedError: [^\n]*)", text)
        return {"refused": m.group(1) if m else text[-500:]}
    try:
        log.seek(0)
        out = log.read()
        kv_tokens = int(re.search(r"KV cache size: ([\d,]+) tokens", out).group(1).replace(",", ""))
        reported = float(re.search(r"Maximum concurrency for [\d,]+ tokens per request: ([\d.,]+)x", out)
                         .group(1).replace(",", ""))
        res = {"dtype": args.serve_dtype, "kv_tokens": kv_tokens, "reported_concurrency": reported}
        c = max(1, min(int(reported), args.max_concurrency))
        windows = heldout_windows(tok, args.prompt, c)
        base = f"http://127.0.0.1:{port}/v1"
        res["level"] = asyncio.run(one_level(base, args.model, [w.tolist() for w in windows], args.new))
        return res
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except Exception:  # noqa: BLE001
            proc.kill()
        log.close()


# --------------------------------------------------------------------------- the table and the plot
def kvcompile_eval_loss(policy: str | None, path: Path = ROOT / "docs" / "eval.json"):
    """kvcompile's own eval of ``policy`` on SmolLM2 (``path``, an eval.json; by default docs/eval.json), where it
    is there: (loss, loss delta)."""
    if not path.exists():
        return None
    rows = json.loads(path.read_text())["rows"]
    from kvcompile.presets import spelled
    name, _, bits = (spelled(policy) if policy else "full:16").rpartition(":")  # a short form: int8 -> int8:8
    if policy and policy.endswith(".json"):
        name, bits = Path(policy).name, None
    for r in rows:
        if r["scheme"] == name and (bits is None or str(r["bits"]) == bits):
            return r["loss"], r["loss_delta"]
    return None


def eval_row(r: dict, path: Path | None = None):
    """kvcompile's eval of contender ``r``'s policy (``kvcompile_eval_loss``; vLLM ``auto``: full precision's), or
    None for one of vLLM's own quantized caches (``kv_cache_dtype``), which kvcompile's eval does not run."""
    if r["policy"] is None and r.get("engine", {}).get("kv_cache_dtype"):
        return None
    return kvcompile_eval_loss(r["policy"], path) if path else kvcompile_eval_loss(r["policy"])


def capacity_table(results) -> str:
    base = next((r["capacity"] for r in results if r["label"] == "vLLM auto"), {})
    lines = ["| contender | KV tokens | 1K requests | 8K requests | x vLLM auto |", "|---|---|---|---|---|"]
    for r in results:
        c = r["capacity"]
        if "refused" in c:
            lines.append(f"| {r['label']} | refused: {c['refused'][:200]} | | | |")
            continue
        ratio = f"{c['kv_tokens'] / base['kv_tokens']:.3f}" if "kv_tokens" in base else "-"
        lines.append(f"| {r['label']} | {c['kv_tokens']:,} | {c['concurrency_1k']:.2f} | {c['concurrency_8k']:.2f} "
                     f"| {ratio} |")
    return "\n".join(lines)


def quality_table(results, stored: Path | None) -> str:
    """Held-out loss through vLLM beside ``kvcompile eval`` of the same policy on the same windows: with
    ``--own stored`` (``stored``, an eval.json: every position read as stored, as vLLM's pages are read) and as
    docs/eval.json has it (each call's own tokens in full precision)."""
    base = next((r["quality"]["loss"] for r in results if r["label"] == "vLLM auto" and "loss" in r["quality"]), None)
    lines = ["| contender | loss through vLLM | delta | kvcompile eval --own stored | delta | vLLM - eval | "
             "kvcompile eval (own full) delta |", "|---|---|---|---|---|---|---|"]
    for r in results:
        q = r["quality"]
        if "loss" not in q:
            lines.append(f"| {r['label']} | refused: {q.get('refused', '?')[:160]} |" + " |" * 5)
            continue
        ev = eval_row(r, stored) if stored else None
        full = eval_row(r)
        delta = f"{q['loss'] - base:+.5f}" if base is not None else ""
        cells = [f"{ev[0]:.5f}", f"{ev[1]:+.5f}", f"{q['loss'] - ev[0]:+.5f}"] if ev else ["", "", ""]
        lines.append(f"| {r['label']} | {q['loss']:.5f} | {delta} | " + " | ".join(cells)
                     + f" | {'' if full is None else f'{full[1]:+.5f}'} |")
    return "\n".join(lines)


def serving_table(results) -> str:
    lines = ["| contender | KV tokens (serving dtype) | vLLM's concurrency | requests at once | generated tokens/s | "
             "decode tokens/s |", "|---|---|---|---|---|---|"]
    for r in results:
        s = r["serving"]
        if "level" not in s:
            lines.append(f"| {r['label']} | refused: {s.get('refused', '?')[:160]} | | | | |")
            continue
        lv = s["level"]
        decode = "" if lv["decode_tokens_per_s"] is None else f"{lv['decode_tokens_per_s']:.1f}"
        lines.append(f"| {r['label']} | {s['kv_tokens']:,} | {s['reported_concurrency']:.2f} | {lv['requests']} | "
                     f"{lv['tokens_per_s']:.1f} | {decode} |")
    return "\n".join(lines)


def table(results, stored: Path | None = None) -> str:
    """The whole run's table; the kvcompile eval column is ``stored``'s (``kvcompile eval --own stored``, what vLLM
    computes) when given, else docs/eval.json's (kvcompile's own protocol)."""
    base = next((r for r in results if r["label"] == "vLLM auto"), None)
    what = "kvcompile eval --own stored delta" if stored else "kvcompile eval delta"
    lines = ["| contender | KV tokens | 1K requests | 8K requests | x vLLM auto | held-out loss | delta | "
             f"{what} | passkey | tokens/s at max concurrency (requests) | decode tokens/s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        c, q, s = r["capacity"], r["quality"], r["serving"]
        why = c.get("refused") or q.get("refused") or s.get("refused")
        if why:
            lines.append(f"| {r['label']} | refused: {why[:200]} |" + " |" * 9)
            continue
        ratio = c["kv_tokens"] / base["capacity"]["kv_tokens"] if base and "kv_tokens" in base["capacity"] else float("nan")
        delta = q["loss"] - base["quality"]["loss"] if base and "loss" in base["quality"] else float("nan")
        ev = eval_row(r, stored)
        ev_delta = "" if ev is None else f"{ev[1]:+.4f}"
        lv = s["level"]
        pk = " ".join(f"{k}: {v:.2f}" for k, v in q["passkey"].items())
        decode = "" if lv["decode_tokens_per_s"] is None else f"{lv['decode_tokens_per_s']:.1f}"
        lines.append(f"| {r['label']} | {c['kv_tokens']:,} | {c['concurrency_1k']:.2f} | {c['concurrency_8k']:.2f} | "
                     f"{ratio:.2f} | {q['loss']:.4f} | {delta:+.4f} | {ev_delta} | {pk} | "
                     f"{lv['tokens_per_s']:.1f} ({lv['requests']}) | {decode} |")
    return "\n".join(lines)


def plot(results, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ok = [r for r in results if "kv_tokens" in r["capacity"] and "loss" in r["quality"] and "level" in r["serving"]]
    base = next(r for r in ok if r["label"] == "vLLM auto")
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    labels = [r["label"].replace("kvcompile ", "") for r in ok]
    axes[0].bar(labels, [r["capacity"]["kv_tokens"] / base["capacity"]["kv_tokens"] for r in ok])
    axes[0].set_title("tokens vLLM holds in the same KV memory, x vLLM auto")
    axes[1].bar(labels, [r["quality"]["loss"] - base["quality"]["loss"] for r in ok])
    axes[1].set_title("held-out loss - vLLM auto's (nats/token)")
    axes[2].bar(labels, [r["serving"]["level"]["decode_tokens_per_s"] or 0 for r in ok])
    axes[2].set_title("decode tokens/s at each one's max concurrency")
    for ax in axes:
        ax.tick_params(axis="x", rotation=35)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_capacity(results, path: Path, title: str = "") -> None:
    """``--capacity-only``'s plot: the tokens vLLM holds for each contender, x vLLM auto's."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ok = [r for r in results if "kv_tokens" in r["capacity"]]
    base = next(r for r in ok if r["label"] == "vLLM auto")["capacity"]["kv_tokens"]
    fig, ax = plt.subplots(figsize=(1.2 * len(ok) + 2, 4.5))
    x = [r["capacity"]["kv_tokens"] / base for r in ok]
    bars = ax.bar([r["label"].replace("kvcompile ", "") for r in ok], x)
    ax.bar_label(bars, labels=[f"{v:.2f}x" for v in x])
    ax.set_ylim(0, max(x) * 1.12)
    ax.set_title(f"tokens vLLM holds in the same KV memory, x vLLM auto{title}")
    ax.tick_params(axis="x", rotation=35)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_serving(results, path: Path) -> None:
    """``--serving-only``'s plot: requests each serves at once and the decode tokens/s it gets at that level."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ok = [r for r in results if "level" in r["serving"]]
    labels = [r["label"].replace("kvcompile ", "") for r in ok]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    axes[0].bar(labels, [r["serving"]["level"]["requests"] for r in ok])
    axes[0].set_title("streaming requests served at once")
    axes[1].bar(labels, [r["serving"]["level"]["decode_tokens_per_s"] or 0 for r in ok])
    axes[1].set_title("decode tokens/s at that level")
    fig.suptitle(f"vllm serve, {ok[0]['serving']['dtype'] if ok else ''}, the same KV memory")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a Hugging Face model directory vLLM loads")
    ap.add_argument("--kv-mib", type=int, default=256, help="KV memory of the capacity and serving engines (MiB)")
    ap.add_argument("--capacity-dtype", default="bfloat16", help="the model dtype vLLM's capacity is counted in")
    ap.add_argument("--serve-dtype", default="float32",
                    help="the server's dtype (bf16 matmuls are slow on a CPU without AVX-512 BF16)")
    ap.add_argument("--serve-block", type=int, help="the servers' block size (default: vLLM's, 128 on the CPU; in "
                                                      "float32 a KIVI ring fits only pages of 256 tokens)")
    ap.add_argument("--quality-kv-mib", type=int, default=512, help="KV memory of the quality engines (MiB)")
    ap.add_argument("--quality-block", type=int, default=128,
                    help="the quality engines' block size: a page's size changes no byte a policy stores, and in "
                         "float32 a KIVI ring fits only pages of 256 tokens")
    ap.add_argument("--long", type=int, default=8192, help="the long requests' tokens (vLLM's reported concurrency)")
    ap.add_argument("--window", type=int, default=2048)
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--passkey", type=int, nargs="*", default=[1024, 2048])
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--prompt", type=int, default=256, help="prompt tokens of each decode request")
    ap.add_argument("--new", type=int, default=32, help="tokens each decode request generates")
    ap.add_argument("--max-concurrency", type=int, default=64)
    ap.add_argument("--block", type=int, default=128, help="vLLM's block size (128 on the CPU)")
    ap.add_argument("--eager", action="store_true", help="serve with --enforce-eager")
    ap.add_argument("--max-num-batched-tokens", type=int,
                    help="vLLM's tokens per step, for the capacity engines (default: vLLM's; it bounds what vLLM "
                         "charges a sliding-window cache group, so a windowed policy's reported concurrency)")
    ap.add_argument("--calibrated", help="a policy file from `kvcompile calibrate`, as one more contender")
    ap.add_argument("--only", nargs="*", help="run only these contenders (labels)")
    ap.add_argument("--capacity-only", action="store_true",
                    help="vLLM's own capacity count alone (about a minute a contender; no quality or serving)")
    ap.add_argument("--quality-only", action="store_true",
                    help="only the quality engines (held-out loss, passkey): no capacity, no serving")
    ap.add_argument("--serving-only", action="store_true",
                    help="only the serving runs (vllm serve at each one's reported concurrency, streaming clients)")
    ap.add_argument("--eval-stored", type=Path,
                    help="an eval.json of `kvcompile eval --own stored` on the same model and windows, put beside "
                         "vLLM's losses")
    ap.add_argument("--startup-s", type=int, default=900)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--plot", type=Path)
    args = ap.parse_args()
    if sum((args.quality_only, args.capacity_only, args.serving_only)) > 1:
        ap.error("--quality-only, --capacity-only and --serving-only: choose one")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the quality engines, in this process
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(args.model)
    contenders = list(CONTENDERS) + ([(f"kvcompile calibrated ({Path(args.calibrated).name})", args.calibrated, {})]
                                     if args.calibrated else [])
    if args.only:
        contenders = [c for c in contenders if c[0] in args.only]
    results = []
    for label, policy, engine in contenders:
        t0 = time.time()
        if args.serving_only:
            cap = q = {"not_measured": "--serving-only"}
            s = serving(args, tok, policy, engine)
        elif args.quality_only:
            cap = s = {"not_measured": "--quality-only"}
            q = quality(args, tok, policy, engine)
        elif args.capacity_only:
            cap = capacity(args, policy, engine)
            q = s = {"not_measured": "--capacity-only"}
        else:
            cap = capacity(args, policy, engine)
            q = quality(args, tok, policy, engine) if "refused" not in cap else {"refused": cap["refused"]}
            s = serving(args, tok, policy, engine) if "refused" not in q else {"refused": q["refused"]}
        results.append({"label": label, "policy": policy, "engine": engine, "capacity": cap, "quality": q,
                        "serving": s, "seconds": time.time() - t0})
        print(f"{label}: {json.dumps({'capacity': cap, 'quality': q, 'serving': s})[:800]}", flush=True)
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps({"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d"),
                                            "results": results}, indent=1))
    print(capacity_table(results) if args.capacity_only else serving_table(results) if args.serving_only else
          quality_table(results, args.eval_stored) if args.quality_only else table(results, args.eval_stored))
    if args.plot:
        if args.capacity_only:
            plot_capacity(results, args.plot, f" ({args.kv_mib} MiB of KV memory)")
        else:
            (plot_serving if args.serving_only else plot)(results, args.plot)


if __name__ == "__main__":
    main()
