"""HTTP load: ``kvcompile serve`` against transformers' own continuous-batching server, one byte budget, real
streaming clients.

    python benchmarks/serve_load.py --smoke                  # tiny: a few short requests per server (the tests)
    python benchmarks/serve_load.py --budget-mib 48 --concurrency 2 4 8 --new 32 \\
        --out benchmarks/results/serve_load.json

Each contender is a server subprocess on a free 127.0.0.1 port: kvcompile's (``kvcompile serve --policy P
--budget-mib B``) and transformers' own (its model manager, handlers and continuous batching, its paged cache
given as many pages as the same budget holds in full precision). For each concurrency level ``c`` the client
opens ``c`` streaming chat completions at once (httpx, one connection each) with prompts of mixed lengths and
reads them to the end. Reported per contender and level: requests completed and failed, generated tokens/s
(all requests' content chunks over the level's wall time), time to first token (median, p95), and the
server's peak RSS (``VmHWM``) after the level; for kvcompile also the most requests its cache held at once
(sampled from ``/kvcompile/stats`` every 50 ms) and the prompt tokens it read from shared pages.
``--system-words N`` gives every request the same system prompt of N words (prompts that begin alike: prefix
sharing); ``kvcompile-unshared`` is kvcompile's server with ``--no-prefix-sharing``. ``--fields JSON`` adds
request fields to every request (log probabilities, JSON mode, ...: what they cost).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from tqdm.auto import tqdm

STARTUP_S = 300
WORDS = ("the printing press carried movable type across the cities of europe and every page that followed "
         "bore the marks of the people who set it by hand in the workshops of the old town").split()


def free_port() -> int:
    """A loopback port free now. Another process may take it before the server binds it: ``listening`` tells
    whether the server that answers there is the one started."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_taken(output: str) -> bool:
    """Whether a server that exited says its port (or torchrun's) was taken before it bound it."""
    return "address already in use" in output.lower()


def listening(pid: int, port: int) -> bool:
    """Whether process ``pid``, or a process it started (torchrun's ranks), listens on ``port``."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return False
    for p in procs:
        try:
            if any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in p.net_connections("tcp")):
                return True
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return False


def launch(command, probe: str, what: str, startup_s: float = STARTUP_S, **popen):
    """Start ``command(port)`` (a server's argument list for a free loopback port; ``popen``: more of
    ``subprocess.Popen``'s arguments) and wait until it answers ``probe`` (a path) there and listens there itself;
    started again on another port when its port was taken before it bound it. ``(process, port, its output
    file)``; a RuntimeError with its output when it exits or does not answer within ``startup_s`` (then it and
    what it started are killed, as when the wait is interrupted)."""
    import psutil

    deadline = time.time() + startup_s
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    def kill(proc):
        try:
            root = psutil.Process(proc.pid)
            for p in [*root.children(recursive=True), root]:
                p.kill()
        except psutil.NoSuchProcess:
            pass
        proc.wait(timeout=10)

    for _ in range(3):
        port, late = free_port(), False
        log = tempfile.TemporaryFile("w+")  # a file, not a pipe: a server that logs much never blocks on it
        proc = subprocess.Popen(command(port), stdout=log, stderr=subprocess.STDOUT, text=True, env=env, **popen)
        try:
            while proc.poll() is None:
                try:
                    if (httpx.get(f"http://127.0.0.1:{port}{probe}", timeout=2).status_code == 200
                            and listening(proc.pid, port)):
                        return proc, port, log
                except httpx.HTTPError:
                    pass
                if time.time() > deadline:
                    kill(proc)
                    late = True
                    break
                time.sleep(1)
        except BaseException:  # interrupted while waiting: leave no server behind
            kill(proc)
            raise
        log.seek(0)
        out = log.read()
        log.close()
        if late or not port_taken(out):
            break
    why = f"did not answer within {startup_s} s" if late else f"exited with status {proc.returncode} before answering"
    # a refusal said early in a long log (vLLM's engine process, then its own traceback): kept beside the tail
    said = [line for line in out.splitlines() if "Refused: " in line or "cannot be kept in pages" in line]
    cause = f"\n(said before: {said[0].strip()})" if said and said[0] not in out[-3000:] else ""
    raise RuntimeError(f"{what} {why}:\n{out[-3000:]}{cause}")


# --------------------------------------------------------------------------- the servers
def serve_transformers(model_dir: str, port: int, budget: int, max_batch_tokens: int = 256) -> None:
    """transformers' own OpenAI-compatible server with continuous batching, its paged cache holding as many
    pages as ``budget`` bytes hold in full precision (fp32, the model's dtype here)."""
    import torch
    import uvicorn
    from transformers import AutoConfig, ContinuousBatchingConfig
    from transformers.cli.serving.model_manager import ModelManager
    from transformers.cli.serving.utils import GenerationState

    from kvcompile.openai_server import openai_app
    from kvcompile.serving import full_precision_bytes_per_token

    page = 256
    per_page = page * full_precision_bytes_per_token(AutoConfig.from_pretrained(model_dir), torch.float32)
    manager = ModelManager(device="cpu", dtype="float32", attn_implementation="sdpa", continuous_batching=True,
                           model_timeout=-1, force_model=model_dir)
    cbc = ContinuousBatchingConfig(num_blocks=budget // per_page, page_size=page, max_batch_tokens=max_batch_tokens,
                                   max_memory_percent=1.0)
    state = GenerationState(continuous_batching=True, compile=False, cb_config=cbc)
    app = openai_app(manager, state)
    print(f"transformers serve: {model_dir} on 127.0.0.1:{port}, {budget // per_page} pages of {page}", flush=True)
    try:
        uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")
    finally:
        state.shutdown()
        manager.shutdown()


class Server:
    """A server subprocess on a free loopback port; always stopped on exit."""

    def __init__(self, kind: str, model_dir: str, budget_mib: int, policy: str, max_requests: int):
        self.kind, self.model_dir, self.budget_mib = kind, model_dir, budget_mib
        self.policy, self.max_requests = policy, max_requests

    def command(self, port: int) -> list[str]:
        if self.kind.startswith("kvcompile"):
            cmd = [sys.executable, "-m", "kvcompile", "serve", "--model", self.model_dir, "--policy", self.policy,
                   "--port", str(port), "--budget-mib", str(self.budget_mib)]
            cmd += ["--max-requests", str(self.max_requests)] if self.max_requests else []
            return cmd + (["--no-prefix-sharing"] if self.kind == "kvcompile-unshared" else [])
        return [sys.executable, str(Path(__file__).resolve()), "--serve-transformers", self.model_dir,
                "--port", str(port), "--budget-mib", str(self.budget_mib)]

    def __enter__(self):
        self.proc, self.port, self.log = launch(self.command, "/v1/models", f"the {self.kind} server")
        self.base = f"http://127.0.0.1:{self.port}"
        return self

    def __exit__(self, *exc):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.log.close()

    def peak_rss_mib(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
        return float("nan")


# --------------------------------------------------------------------------- the clients
def prompt(i: int, words: int) -> str:
    return " ".join(WORDS[(i + j) % len(WORDS)] for j in range(words)) + ". Continue the story."


def system_prompt(words: int) -> str:
    """The system prompt every request shares (``--system-words``)."""
    return "You are a careful storyteller. " + " ".join(WORDS[(7 * j) % len(WORDS)] for j in range(words))


async def one_request(client: httpx.AsyncClient, base: str, model: str, text: str, new: int, timeout: float,
                      system: str | None = None, fields: dict | None = None) -> dict:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
    body = {"model": model, "messages": messages, "max_tokens": new, "stream": True, **(fields or {})}
    t0 = time.perf_counter()
    first, chunks = None, 0
    try:
        async with client.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=timeout) as r:
            if r.status_code != 200:
                return dict(ok=False, error=f"HTTP {r.status_code}", ttft=None, tokens=0)
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                delta = json.loads(line[6:]).get("choices", [{}])
                if delta and (delta[0].get("delta") or {}).get("content"):
                    chunks += 1
                    if first is None:
                        first = time.perf_counter() - t0
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        return dict(ok=False, error=type(e).__name__, ttft=first, tokens=chunks)
    return dict(ok=chunks > 0, error=None if chunks else "no content", ttft=first, tokens=chunks)


async def stats(client, server: Server) -> dict:
    """kvcompile's ``/kvcompile/stats`` ({} when it does not answer)."""
    try:
        return (await client.get(f"{server.base}/kvcompile/stats", timeout=5)).json()
    except (httpx.HTTPError, ValueError):
        return {}


async def level(server: Server, model: str, c: int, new: int, lengths: list[int], timeout: float,
                system: str | None = None, fields: dict | None = None) -> dict:
    most, ours = 0, server.kind.startswith("kvcompile")

    async def watch(client):
        nonlocal most
        while True:
            most = max(most, (await stats(client, server)).get("requests") or 0)
            await asyncio.sleep(0.05)

    limits = httpx.Limits(max_connections=c + 2)
    async with httpx.AsyncClient(limits=limits) as client:
        async def prefix_tokens():  # prompt tokens kvcompile's cache has read from shared pages so far
            return (await stats(client, server)).get("prefix_tokens") or 0

        reused = await prefix_tokens() if ours else None
        watcher = asyncio.create_task(watch(client)) if ours else None
        t0 = time.perf_counter()
        rs = await asyncio.gather(*(one_request(client, server.base, model, prompt(i, lengths[i % len(lengths)]),
                                                new, timeout, system, fields) for i in range(c)))
        wall = time.perf_counter() - t0
        if watcher:
            watcher.cancel()
            reused = await prefix_tokens() - reused
    ttfts = sorted(r["ttft"] for r in rs if r["ttft"] is not None)
    p95 = ttfts[min(len(ttfts) - 1, int(round(0.95 * (len(ttfts) - 1))))] if ttfts else None
    return dict(contender=server.kind, concurrency=c, completed=sum(r["ok"] for r in rs),
                failed=sum(not r["ok"] for r in rs), errors=sorted({r["error"] for r in rs if r["error"]}),
                tokens=sum(r["tokens"] for r in rs), wall_s=wall, tok_s=sum(r["tokens"] for r in rs) / wall,
                ttft_median_s=statistics.median(ttfts) if ttfts else None, ttft_p95_s=p95,
                peak_rss_mib=server.peak_rss_mib(), most_requests_held=most if ours else None,
                prefix_tokens_reused=reused)


def levels_arg(text: str) -> tuple[str, list[int]]:
    """``KIND=N[,N...]`` (``--levels``): a contender and its own concurrency levels."""
    kind, _, ns = text.partition("=")
    kinds = ("transformers", "kvcompile", "kvcompile-unshared")
    try:
        levels = [int(n) for n in ns.split(",")]
    except ValueError:
        levels = []
    if kind not in kinds or not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected KIND=N[,N...] with KIND one of {', '.join(kinds)} and "
                                         f"positive client counts, e.g. transformers=8")
    return kind, levels


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="a local Hugging Face model directory (default: the embedded SmolLM2)")
    ap.add_argument("--policy", default="kivi:4", help="kvcompile's policy, as kvcompile serve takes it (default: %(default)s)")
    ap.add_argument("--budget-mib", type=int, default=48, help="the cache budget of both servers, MiB (default: %(default)s)")
    ap.add_argument("--max-requests", type=int, default=None,
                    help="kvcompile serve --max-requests (default: kvcompile serve's own, sized to the budget)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[2, 4, 8], help="clients at once, per level")
    ap.add_argument("--levels", nargs="+", default=[], metavar="KIND=N[,N...]", type=levels_arg,
                    help="a contender's own levels instead of --concurrency, e.g. transformers=8 kvcompile=28: "
                         "each at the most its cache holds (default: --concurrency for every contender)")
    ap.add_argument("--new", type=int, default=32, help="tokens per reply (default: %(default)s)")
    ap.add_argument("--words", type=int, nargs="+", default=[40, 200, 600], help="prompt lengths in words (mixed)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds a request may take (default: %(default)s)")
    ap.add_argument("--system-words", type=int, default=0,
                    help="a system prompt of this many words shared by every request (default: none)")
    ap.add_argument("--contenders", nargs="+", default=["transformers", "kvcompile"],
                    choices=["transformers", "kvcompile", "kvcompile-unshared"])
    ap.add_argument("--fields", type=json.loads, default=None, metavar="JSON",
                    help='request fields added to every chat completion, e.g. \'{"logprobs": true}\' or '
                         '\'{"response_format": {"type": "json_object"}}\' (default: none)')
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    ap.add_argument("--smoke", action="store_true", help="two short requests per server (seconds once loaded)")
    ap.add_argument("--serve-transformers", default=None, metavar="MODEL_DIR", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve_transformers:
        serve_transformers(args.serve_transformers, args.port, args.budget_mib * 2 ** 20)
        return []
    from kvcompile.models import resolve
    model_dir = str(args.model or resolve(None))
    if args.smoke:
        args.concurrency, args.new, args.words, args.budget_mib, args.max_requests = [2], 4, [8, 30], 64, 4
    rows = []
    own = dict(args.levels)
    unknown = sorted(set(own) - set(args.contenders))
    if unknown:
        ap.error(f"--levels names {', '.join(unknown)}, which --contenders does not run ({' '.join(args.contenders)})")
    bar = tqdm(total=sum(len(own.get(k, args.concurrency)) for k in args.contenders), desc="serve load")
    for kind in args.contenders:
        bar.set_postfix_str(f"{kind}: starting")
        with Server(kind, model_dir, args.budget_mib, args.policy, args.max_requests) as server:
            for c in own.get(kind, args.concurrency):
                bar.set_postfix_str(f"{kind}: {c} clients")
                system = system_prompt(args.system_words) if args.system_words else None
                rows.append(asyncio.run(level(server, model_dir, c, args.new, args.words, args.timeout, system,
                                              args.fields)))
                bar.update()
    bar.close()
    print(f"budget {args.budget_mib} MiB, kvcompile {args.policy}, {args.new} new tokens, prompts {args.words} words"
          + (f", a shared system prompt of {args.system_words} words" if args.system_words else "")
          + (f", fields {json.dumps(args.fields)}" if args.fields else ""))
    print(f"{'contender':<19}{'clients':>8}{'done':>6}{'failed':>7}{'tok/s':>8}{'TTFT p50':>10}{'TTFT p95':>10}"
          f"{'RSS MiB':>9}{'held':>6}{'reused':>8}")
    for r in rows:
        f = lambda x: f"{x:10.2f}" if x is not None else f"{'-':>10}"  # noqa: E731
        g = lambda x, w: f"{x if x is not None else '-':>{w}}"  # noqa: E731
        print(f"{r['contender']:<19}{r['concurrency']:>8}{r['completed']:>6}{r['failed']:>7}{r['tok_s']:>8.2f}"
              f"{f(r['ttft_median_s'])}{f(r['ttft_p95_s'])}{r['peak_rss_mib']:>9.0f}"
              f"{g(r['most_requests_held'], 6)}{g(r['prefix_tokens_reused'], 8)}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(dict(args=vars(args), rows=rows), indent=1))
        print(f"wrote {args.out}")
    return rows


if __name__ == "__main__":
    main()
