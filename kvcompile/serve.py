"""``kvcompile serve``: transformers' OpenAI-compatible server (``transformers serve --continuous-batching``)
with continuous batching over kvcompile's packed cache.

transformers' own pieces, unchanged: its ``ModelManager`` (loading, the tokenizer), its chat-completion and
completion handlers (streaming and not, request validation), its FastAPI app and uvicorn. One piece is
ours: the model manager applies ``kvcompile.apply(model, policy)`` to each model it loads, so the
continuous-batching manager the handlers start (``model.init_continuous_batching``) is kvcompile's
(``kvcompile.serving``).

    kvcompile serve --policy kivi:4 --port 8000
    curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
        -d '{"model": "<the model path the server prints>", "messages": [{"role": "user", "content": "Hi"}]}'
"""
from __future__ import annotations

import torch


def openai_app(manager, state):
    """transformers' OpenAI-compatible FastAPI app (its handlers, as ``transformers serve`` builds them) over a
    model manager and a generation state."""
    from transformers.cli.serving.chat_completion import ChatCompletionHandler
    from transformers.cli.serving.completion import CompletionHandler
    from transformers.cli.serving.response import ResponseHandler
    from transformers.cli.serving.server import build_server
    from transformers.cli.serving.systemone import SystemOneHandler
    from transformers.cli.serving.transcription import TranscriptionHandler

    return build_server(
        manager, ChatCompletionHandler(model_manager=manager, generation_state=state),
        completion_handler=CompletionHandler(model_manager=manager, generation_state=state),
        response_handler=ResponseHandler(model_manager=manager, generation_state=state),
        transcription_handler=TranscriptionHandler(manager, state),
        systemone_handler=SystemOneHandler(model_manager=manager, generation_state=state),
        generation_state=state)


def build_app(model_dir: str, policy, *, budget: int | None = None, max_requests: int | None = None,
              max_batch_tokens: int = 256, dtype: torch.dtype = torch.float32):
    """The FastAPI app (and its model manager) serving ``model_dir`` (a local Hugging Face directory) with
    continuous batching over kvcompile's cache under ``policy``."""
    from transformers import ContinuousBatchingConfig
    from transformers.cli.serving.model_manager import ModelManager
    from transformers.cli.serving.utils import GenerationState

    from . import serving
    from .api import apply

    class KVCompileModelManager(ModelManager):
        """transformers' model manager; every model it loads is prepared by ``kvcompile.apply``."""

        def _load_model(self, *args, **kwargs):
            model = super()._load_model(*args, **kwargs)
            model = apply(model.eval(), policy)
            serving.configure(model, budget=budget, max_requests=max_requests)
            return model

    manager = KVCompileModelManager(device="cpu", dtype=str(dtype).removeprefix("torch."),
                                    attn_implementation="sdpa", continuous_batching=True, model_timeout=-1,
                                    force_model=model_dir)
    state = GenerationState(continuous_batching=True, compile=False,
                            cb_config=ContinuousBatchingConfig(max_batch_tokens=max_batch_tokens))
    app = openai_app(manager, state)

    @app.get("/kvcompile/stats")
    def stats():
        """The kvcompile cache behind the running continuous-batching manager (none before the first request)."""
        cb = getattr(getattr(state, "_cb_manager", None), "_cb", None)
        bp = getattr(cb, "batch_processor", None)
        cache = getattr(bp, "cache", None)
        if not isinstance(cache, serving.cache_class()):
            return {"manager": type(cb).__name__ if cb is not None else None, "cache": None}
        return {"manager": type(cb).__name__, "cache": type(cache).__name__, "policy": str(policy),
                "budget": cb.budget, "allocated": cache.allocated_nbytes, "blocks": cache.stores[0].blocks,
                "free_blocks": cache.free_blocks_count, "slots": cache.slots, "requests": len(cache.slot_of)}

    return app, manager, state


def run(model_dir: str, policy, host: str = "127.0.0.1", port: int = 8000, **kw) -> None:
    import uvicorn

    app, manager, state = build_app(model_dir, policy, **kw)
    print(f"kvcompile serve: {model_dir} under {policy} on http://{host}:{port}/v1 (model name: {model_dir!r})",
          flush=True)
    try:
        uvicorn.run(app, host=host, port=port, log_level="warning")
    finally:
        state.shutdown()
        manager.shutdown()
