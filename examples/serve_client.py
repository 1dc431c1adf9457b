"""Serve a model with ``kvcompile serve`` and call it as any OpenAI client does.

    python examples/serve_client.py                                  # the embedded SmolLM2, serve's default policy
    python examples/serve_client.py --model DIR --policy tok+rot:4

Starts the server on a free loopback port, then: a chat, the same chat streamed, a reply parsed into a pydantic
model (structured output), a completion of token ids, and what the server's cache holds; then stops it.
"""
import argparse
import socket
import subprocess
import sys
import time
from typing import Literal, Optional

import httpx
import openai
from pydantic import BaseModel

ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
ap.add_argument("--model", default=None, help="a local Hugging Face model folder (default: the embedded SmolLM2)")
ap.add_argument("--policy", default=None, help="as kvcompile serve --policy takes it (default: serve's own)")
ap.add_argument("--max-tokens", type=int, default=48, help="tokens per reply at most (default: %(default)s)")
args = ap.parse_args()

with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
cmd = [sys.executable, "-m", "kvcompile", "serve", "--port", str(port), "--budget-mib", "64"]
cmd += ["--model", args.model] if args.model else []
server = subprocess.Popen(cmd + (["--policy", args.policy] if args.policy else []))
base = f"http://127.0.0.1:{port}"
try:
    for _ in range(600):  # loading the model takes a while
        try:
            if httpx.get(f"{base}/v1/models", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.5)
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused")
    model = client.models.list().data[0].id
    chat = [{"role": "user", "content": "Name three colors."}]

    reply = client.chat.completions.create(model=model, messages=chat, max_tokens=args.max_tokens)
    print("chat:    ", reply.choices[0].message.content)
    print("streamed:", "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=model, messages=chat, max_tokens=args.max_tokens, stream=True) if c.choices))

    class Cat(BaseModel):
        name: str
        age: Optional[int]
        color: Literal["black", "white", "ginger"]

    try:  # every token keeps the reply a prefix of a Cat; the client parses the whole
        cat = client.chat.completions.parse(model=model, response_format=Cat, max_tokens=args.max_tokens, messages=[
            {"role": "user", "content": "Describe a cat as JSON: name, age and color."}]).choices[0].message.parsed
        print("parsed:  ", repr(cat))
    except openai.LengthFinishReasonError:
        print("parsed:   (the object was still open at max_tokens)")

    ids = [1, 2, 3]  # a prompt of token ids, as evaluation harnesses send them
    print("ids:     ", repr(client.completions.create(model=model, prompt=ids, max_tokens=8).choices[0].text))
    stats = httpx.get(f"{base}/kvcompile/stats", timeout=10).json()
    print(f"cache:    {stats['cache']} under {stats['policy']}: {stats['allocated']:,} bytes, "
          f"{stats['free_blocks']} of {stats['blocks']} pages free, {stats['requests']} requests holding cache")
finally:
    server.terminate()
    server.wait(timeout=60)
