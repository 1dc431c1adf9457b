"""How many concurrent sequences fit on a GPU: a symbolic planner over the exact cache layout.

The bytes one sequence's cache holds are written as a sympy expression of the context length ``C`` from
the store's layout (``kvcompile.store``): whole blocks of packed codes, scales and zero points, their block
table entries, the full-precision residual ring and sinks, and the per-sequence length counter. The
constants come from ``LayerSpec`` itself; tests check the expression against what a store holds after
``C`` tokens, so the planner and the cache cannot disagree. Then::

    sequences = floor((gpu_bytes * utilization - weight_bytes) / bytes_per_sequence(C))

``ideal(bits)`` is the textbook count published capacity estimates use: ``bits / 8`` bytes per element,
scales and residual ignored. Comparing the two shows what a real policy's overhead costs.

Units: the usual Llama 3 8B estimate is in decimal gigabytes (16.1 GB of weights on an 80 GB GPU); the usual
70B one in binary units (320 KB per token is 327,680 bytes, 1.25 GB per 4K conversation is 1.25 GiB). The
functions take bytes; the presets say which unit their source meant.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

import sympy as sp

from .accounting import full_precision_bytes_per_token
from .errors import KVCompileError, PlanError, WeightsUnknown
from .hf import model_shape, windowed_layers
from .policy import Policy
from .pool import (MAX_BATCH_TOKENS, check_shared_tokens, pages_for, request_limit, requests_held, shared_pages,
                   size_pool, specs_for, transformers_pages)
from .store import ROW_TOKENS, LayerSpec

GB = 10 ** 9
GiB = 2 ** 30
C = sp.Symbol("C", integer=True, nonnegative=True)  # context length (tokens per sequence)




@dataclass(frozen=True)
class ModelShape:
    """What the planner needs of a model: its cache geometry and its weights' bytes."""

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    weight_bytes: float
    dtype_bytes: int = 2  # the cache's full-precision dtype (bf16)
    # (layer index, window) of the layers attending over a sliding or chunked window only (kvcompile.hf)
    windows: tuple[tuple[int, int], ...] = ()
    tp: int = 1  # GPUs the model is sharded over (tensor parallelism): kv_heads and weight_bytes are one GPU's
    max_positions: int | None = None  # the model's positions: the most tokens one request holds (serving tables)

    def __post_init__(self):
        for f in ("layers", "kv_heads", "head_dim", "dtype_bytes", "tp"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise PlanError(f"ModelShape.{f}={v!r}: expected a positive integer")
        w = self.weight_bytes
        if not isinstance(w, (int, float)) or isinstance(w, bool) or not math.isfinite(w) or w < 0:
            raise PlanError(f"ModelShape.weight_bytes={w!r}: expected a finite number of bytes >= 0")


PRESETS = {
    # Meta Llama 3: 8B has 32 layers, 8 KV heads of 128; 70B has 80 layers, same heads. BF16 weights.
    "llama3-8b": ModelShape("Llama 3 8B", 32, 8, 128, 16.1 * GB, max_positions=8192),
    "llama3-70b": ModelShape("Llama 3 70B", 80, 8, 128, 141.0 * GB, max_positions=8192),
    # HuggingFaceTB SmolLM2-135M(-Instruct), the model kvcompile eval and kvcompile serve use by default: 30
    # layers, 3 KV heads of 64; 134.5M parameters in BF16; 8,192 positions.
    "smollm2-135m": ModelShape("SmolLM2-135M", 30, 3, 64, 0.269 * GB, max_positions=8192),
}


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def shard(shape: ModelShape, tp: int) -> ModelShape:
    """One GPU's share of ``shape`` under tensor parallelism over ``tp`` GPUs: its KV heads (each rank caches
    the heads its attention computes, ``kvcompile.tp``) and ``weight_bytes / tp`` (weights a plan keeps whole
    on every GPU, such as transformers' Llama embedding, are not counted: pass the weights' size if it
    matters). A sequence's cache is spread over all ``tp`` GPUs, so a GPU's sequences are the group's."""
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise PlanError(f"tp={tp!r}: expected a positive number of GPUs")
    if shape.tp != 1:
        raise PlanError(f"{shape.name} is already one GPU's share of {shape.tp}: shard the whole model's shape")
    if shape.kv_heads % tp:
        raise PlanError(
            f"tensor parallelism over {tp} GPUs: {shape.name} has {shape.kv_heads} KV heads, which {tp} GPUs cannot "
            f"split into whole heads (transformers shards the key projection by rows; kvcompile.apply refuses "
            f"such a model). Use a tensor-parallel size that divides {shape.kv_heads} ({_divisors(shape.kv_heads)})")
    return replace(shape, kv_heads=shape.kv_heads // tp, weight_bytes=shape.weight_bytes / tp, tp=tp)


def shape_from_config(path_or_config, weight_bytes: float | None = None, name: str | None = None) -> ModelShape:
    """A ``ModelShape`` from a Hugging Face config (a ``PretrainedConfig``, a ``config.json`` or its folder).

    ``weight_bytes`` defaults to the size of the folder's ``*.safetensors`` / ``*.bin`` files. A path is read
    from the local disk only (nothing is downloaded); a path that is not a readable config is a ``PlanError``.
    """
    folder = None
    cfg = path_or_config
    if isinstance(cfg, (str, Path)):
        cfg = _read_config(Path(cfg).expanduser())
        folder = Path(path_or_config).expanduser()
        folder = folder if folder.is_dir() else folder.parent
    try:
        layers, kv, hd = model_shape(cfg)
    except AttributeError as e:  # a config without the decoder fields (an encoder, a vision model ...)
        raise PlanError(f"the config of {getattr(cfg, 'model_type', None) or 'this model'!r} has no decoder "
                        f"attention shape ({e}); plan a decoder-only language model") from None
    if weight_bytes is None:
        files = list(folder.glob("*.safetensors")) + list(folder.glob("*.bin")) if folder else []
        if not files:
            raise WeightsUnknown("the weights' size is unknown: pass weight_bytes (--weights-gb) or a model "
                                 "folder that holds its *.safetensors files")
        weight_bytes = sum(f.stat().st_size for f in files)
    return ModelShape(name or getattr(cfg, "name_or_path", "") or "model", layers, kv, hd, float(weight_bytes),
                      windows=tuple(sorted(windowed_layers(cfg).items())), max_positions=request_limit(cfg))


def _read_config(p: Path):
    """A transformers config from a local ``config.json`` (any name) or a folder holding one; never a hub id."""
    if not p.exists():
        raise PlanError(f"{str(p)!r} does not exist: expected a local config.json or a model folder holding one "
                        f"(a model hub id is not looked up: nothing is downloaded)")
    if p.is_dir() and not (p / "config.json").is_file():
        raise PlanError(f"{str(p)!r} is a folder without a config.json: expected a Hugging Face model folder "
                        f"(saved with save_pretrained) or the path of its config.json")
    from transformers import AutoConfig
    try:
        return AutoConfig.from_pretrained(str(p), local_files_only=True)
    except (OSError, ValueError, KeyError) as e:  # not JSON, no/unknown model_type, unreadable
        msg = " ".join(str(e).split())
        raise PlanError(f"{str(p)!r} is not a readable Hugging Face config ({msg})") from None


# --------------------------------------------------------------------------- bytes per sequence
def layer_bytes_expr(policy: Policy, kv_heads: int, head_dim: int, dtype_bytes: int = 2, context=C):
    """Exact bytes of one layer's store for one sequence of ``context`` tokens, as sympy (``LayerSpec.nbytes``).

    The store's own numbers (``LayerSpec``: bytes of a block, of a sequence's window and sinks, tokens per
    block) times the symbolic count of blocks: ``ceil(packed / BS)`` with ``packed = Q(C) - S =
    floor(max(0, C - S - R) / F) * F``, plus one int32 block-table entry per block.
    """
    spec = LayerSpec(policy, kv_heads, head_dim, {2: "bfloat16", 4: "float32"}[dtype_bytes])
    S, R, F = spec.sink, policy.residual, spec.flush
    packed = sp.floor(sp.Max(0, context - S - R) / F) * F
    grown = sp.ceiling(context / ROW_TOKENS) * ROW_TOKENS  # the window and sinks as far as they have grown
    rows = spec.position_nbytes() * (sp.Min(spec.ring, grown) + sp.Min(S, grown)) + 4  # (LayerSpec.row_widths)
    return rows + sp.ceiling(packed / spec.block) * (spec.block_nbytes() + 4)


def ring_bytes_expr(shape: ModelShape, window: int, context=C):
    """Bytes of transformers' full-precision ring for one windowed layer: the last ``min(window, C)`` tokens."""
    dtype = {2: "bfloat16", 4: "float32"}[shape.dtype_bytes]
    return full_precision_bytes_per_token(1, shape.kv_heads, shape.head_dim, dtype) * sp.Min(window, context)


def sequence_bytes_expr(policy: Policy, shape: ModelShape, context=C):
    """Exact bytes of one sequence's whole cache (every layer, per-layer overrides resolved). A windowed layer
    holds its store or, where that is fewer bytes and the window is shorter than the context, transformers'
    ring of the window (as ``KVCompileCache`` chooses); under ``Policy.full()`` always the ring (the model's own
    layer)."""
    names = [f"model.layers.{i}.self_attn" for i in range(shape.layers)]
    windows = dict(shape.windows)
    terms = []
    for i, p in enumerate(policy.resolve(names)):
        store = layer_bytes_expr(p, shape.kv_heads, shape.head_dim, shape.dtype_bytes, context)
        if i in windows and p.exact:  # Policy.full(): the model's own sliding-window layer, which keeps the
            store = ring_bytes_expr(shape, windows[i] - 1, context)  # window's last tokens but one
        elif i in windows:
            w = windows[i]
            store = sp.Piecewise((store, context <= w), (sp.Min(store, ring_bytes_expr(shape, w, context)), True))
        terms.append(store)
    return sp.Add(*terms)


def ideal_sequence_bytes_expr(bits: float, shape: ModelShape, context=C):
    """The textbook count: ``bits / 8`` bytes per cached element, nothing else; a windowed layer caches at
    most its window."""
    windows = dict(shape.windows)
    tokens = sp.Add(*[sp.Min(windows[i], context) if i in windows else context for i in range(shape.layers)])
    return 2 * shape.kv_heads * shape.head_dim * sp.nsimplify(bits) / 8 * tokens


def sequences_expr(seq_bytes, available):
    """``floor(available / bytes_per_sequence)`` as a sympy expression (``available`` may be a symbol)."""
    return sp.floor(available / seq_bytes)


def available_bytes(gpu_bytes: float, utilization: float, weight_bytes: float) -> float:
    if not 0 < utilization <= 1:
        raise PlanError(f"utilization={utilization}: expected a fraction in (0, 1]")
    if not (math.isfinite(gpu_bytes) and gpu_bytes > 0):
        raise PlanError(f"gpu_bytes={gpu_bytes}: expected a finite number of bytes > 0")
    avail = gpu_bytes * utilization - weight_bytes
    if avail <= 0:
        raise PlanError(f"nothing is left for the cache: {gpu_bytes * utilization / GB:.1f} GB usable, "
                         f"{weight_bytes / GB:.1f} GB of weights; use a larger GPU or a smaller model")
    return avail


@dataclass(frozen=True)
class PlanRow:
    label: str
    bytes_per_token: float
    sequence_bytes: int
    sequences: int
    policy: str

    def as_dict(self):
        return dict(self.__dict__)


def plan_policy(label: str, policy_or_bits, shape: ModelShape, context: int, available: float) -> PlanRow:
    """One row: a ``Policy`` (exact layout) or a number of bits (ideal, overhead ignored)."""
    if isinstance(policy_or_bits, Policy):
        expr, desc = sequence_bytes_expr(policy_or_bits, shape), str(policy_or_bits)
    else:
        expr, desc = ideal_sequence_bytes_expr(policy_or_bits, shape), f"ideal {policy_or_bits} bits"
    seq = expr.subs(C, context)
    n = sequences_expr(seq, sp.Rational(int(available)) if float(available).is_integer() else available)
    return PlanRow(label, float(seq) / context, int(sp.ceiling(seq)), int(n), desc)


def default_policies() -> dict[str, object]:
    """The rows ``kvcompile plan`` shows: the ideal widths, then real policies."""
    return {
        "ideal 16-bit": 16, "ideal 8-bit": 8, "ideal 4-bit": 4, "ideal 2-bit": 2,
        "bf16 (kvcompile full)": Policy.full(),
        "int8 per token": Policy.int8(),
        "fp8 e4m3, R=128": Policy.fp8(),
        "KIVI 4-bit G32 R128": Policy.kivi(4),
        "KIVI 2-bit G32 R128": Policy.kivi(2),
        # the best 2-bit policy measured on SmolLM2 (docs/eval.json): KIVI + Hadamard rotation + 4 sinks
        "KIVI 2-bit +rot +sink4": Policy.kivi(2, sink=4, rotate=True),
    }


def plan(shape: ModelShape, context: int, gpu_bytes: float = 80 * GB, utilization: float = 0.9,
         available: float | None = None, policies: dict | None = None, tp: int = 1) -> list[PlanRow]:
    """Sequences per GPU for each policy (``available`` overrides gpu * utilization - weights). ``tp``: plan
    one GPU of ``tp`` under tensor parallelism (``shard``; gpu_bytes and available are per GPU)."""
    if not isinstance(context, int) or isinstance(context, bool) or context < 1:
        raise PlanError(f"context={context!r}: expected a positive number of tokens per sequence")
    shape = shard(shape, tp) if tp != 1 else shape
    avail = available if available is not None else available_bytes(gpu_bytes, utilization, shape.weight_bytes)
    if not (math.isfinite(avail) and avail > 0):
        raise PlanError(f"available={avail}: expected a finite number of bytes > 0 for the cache")
    return [plan_policy(k, v, shape, context, avail) for k, v in (policies or default_policies()).items()]


def format_table(rows: list[PlanRow], shape: ModelShape, context: int, available: float) -> str:
    base = next((r for r in rows if r.label.startswith("ideal 16")), rows[0])
    windowed = (f" ({len(shape.windows)} attending over a window of "
                f"{'/'.join(str(w) for w in sorted({w for _, w in shape.windows}))} tokens)" if shape.windows else "")
    heads = f"{shape.kv_heads} of {shape.kv_heads * shape.tp}" if shape.tp > 1 else f"{shape.kv_heads}"
    gpu = (f", per GPU of {shape.tp} (tensor parallel: a sequence's cache is split across all {shape.tp})"
           if shape.tp > 1 else "")
    lines = [f"{shape.name}{gpu}: {shape.layers} layers{windowed} x {heads} KV heads x {shape.head_dim}, "
             f"{context:,}-token sequences, {available / GB:.1f} GB ({available / GiB:.1f} GiB) for the cache",
             ]
    w = max([len("policy")] + [len(r.label) for r in rows]) + 2  # the longest label sets the first column
    lines.append(f"{'policy':<{w}}{'bytes/token':>13}{'GB/seq':>9}{'sequences':>11}{'vs 16-bit':>11}")
    for r in rows:
        lines.append(f"{r.label:<{w}}{r.bytes_per_token:>13,.0f}{r.sequence_bytes / GB:>9.3f}{r.sequences:>11}"
                     f"{r.sequences / max(base.sequences, 1):>10.2f}x")
    return "\n".join(lines)


def plot(shape: ModelShape, available: float, path, policies: dict | None = None,
         contexts=(1024, 2048, 4096, 8192, 16384, 32768)) -> Path:
    """Sequences per GPU vs context length, one line per policy (ideal widths dashed)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    policies = policies or default_policies()
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for label, pol in policies.items():
        ys = [plan_policy(label, pol, shape, c, available).sequences for c in contexts]
        ax.plot(contexts, ys, "--" if not isinstance(pol, Policy) else "-", marker="o", ms=3, label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("concurrent sequences")
    ax.set_title(f"{shape.name}: {available / GB:.1f} GB for the KV cache")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return _save(fig, path)


def _save(fig, path) -> Path:
    """Write ``fig`` as ``path`` (its folder made), close it, and return the path."""
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def to_json(rows: list[PlanRow], shape: ModelShape, context: int, available: float) -> str:
    return json.dumps({"model": shape.__dict__, "context": context, "available_bytes": available,
                       "rows": [r.as_dict() for r in rows]}, indent=2)


# --------------------------------------------------------------------------- the serving pool
# ``kvcompile serve`` / ``kvcompile.serving``: one byte budget for the whole continuous-batching cache. The
# sizes come from kvcompile.serving's own functions (``size_pool``, ``transformers_pages``), which are what
# the server allocates; here they are fed a ``ModelShape`` instead of a loaded model.
PAGE_SIZE = 256  # transformers' ContinuousBatchingConfig default page_size
_DTYPE_NAMES = {2: "bfloat16", 4: "float32"}


@dataclass(frozen=True)
class TransformersPool:
    """What transformers' own ``PagedAttentionCache`` holds for the budget: full-precision pages."""

    page_size: int
    pages: int
    pages_per_request: int
    nbytes: int  # its pages' bytes (its tensor also has two trash pages' worth of sectors)
    shared_tokens: int = 0  # a prompt prefix every request shares (its whole pages held once)

    @property
    def tokens(self) -> int:
        return self.pages * self.page_size

    @property
    def requests(self) -> int:
        return requests_held(self.pages, self.pages_per_request, shared_pages(self.shared_tokens, self.page_size))

    def as_dict(self):
        return dict(self.__dict__, tokens=self.tokens, requests=self.requests)


@dataclass(frozen=True)
class ServingRow:
    """kvcompile's serving pool under one policy, for the budget (``kvcompile.serving.PoolSize``)."""

    label: str
    policy: str
    block_tokens: int
    slots: int
    blocks: int
    pages_per_request: int
    requests: int
    nbytes: int  # allocated: the slots' rows, the pool, the block tables
    shared_tokens: int = 0  # the shared prompt prefix's tokens, where the policy shares pages (else 0)

    @property
    def tokens(self) -> int:
        return self.blocks * self.block_tokens

    def as_dict(self):
        return dict(self.__dict__, tokens=self.tokens)


def default_serving_policies() -> dict[str, Policy]:
    """The rows ``kvcompile plan --serving`` shows: the serving policies (no full-precision window per
    request: ``kvcompile.evaluate``'s serving schemes) and the policies with one, for comparison."""
    from .presets import scheme_policy
    return {
        "full precision (kvcompile)": Policy.full(),
        "int8 per token": Policy.int8(),
        "fp8 e4m3, R=0": Policy.fp8(residual=0),
        "fp8 e4m3, R=128": Policy.fp8(),
        "KIVI 4-bit G32 R128": Policy.kivi(4),
        "KIVI 2-bit G32 R128": Policy.kivi(2),
        **{f"{name}:{bits}": scheme_policy(name, bits) for name, bits in SERVING_SCHEMES},
        # fp8 scales (one byte per scale, an int8 zero point): fewer bytes, at some loss (docs/results.md)
        **{f"{name}:{bits}": scheme_policy(name, bits) for name, bits in (("kivi+rot+sink+fp8s", 4),
                                                                          ("kivi-g64+rot+sink+fp8s", 4),
                                                                          ("tok+rot+fp8s", 4))},
    }


SERVING_SCHEMES = (("tok+rot+sym", 8), ("tok+rot", 4), ("tok+rot", 2))  # the serving policies, by width


def _serving_shape(shape: ModelShape) -> str:
    """The model dtype's name, for a shape kvcompile serving takes (a sharded shape is one rank's: its KV heads,
    and the budget is that rank's)."""
    if shape.windows:
        raise PlanError(f"kvcompile plan --serving plans models whose every layer attends to every token; "
                        f"{shape.name} has {len(shape.windows)} layers attending over a sliding or chunked window "
                        f"(transformers' engine keeps those in pages of their own, which the planner does not model "
                        f"yet): plan its cache without --serving")
    return _DTYPE_NAMES[shape.dtype_bytes]


def _check_count(name: str, v, allow_none: bool = False) -> None:
    if v is None and allow_none:
        return
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise PlanError(f"{name}={v!r}: expected a positive whole number")


def _token_bytes(shape: ModelShape) -> int:
    """Bytes of one token in transformers' paged cache: every layer's keys and values in the model dtype."""
    return full_precision_bytes_per_token(shape.layers, shape.kv_heads, shape.head_dim, _serving_shape(shape))


def transformers_pool(shape: ModelShape, budget: int, request_tokens: int,
                      page_size: int = PAGE_SIZE, shared_tokens: int = 0) -> TransformersPool:
    """transformers' own paged cache for ``budget`` bytes: its pages (``kvcompile.serving.transformers_pages``)
    and the requests of ``request_tokens`` tokens they hold (``ceil(request_tokens / page_size)`` pages each;
    the whole pages of a ``shared_tokens`` prompt prefix once: ``kvcompile.serving.pages_held``)."""
    for name, v in (("budget", budget), ("request_tokens", request_tokens), ("page_size", page_size)):
        _check_count(name, v)
    _check_shared(shared_tokens, request_tokens)
    bpt = _token_bytes(shape)
    pages = transformers_pages(budget, page_size, bpt)
    return TransformersPool(page_size, pages, pages_for(request_tokens, page_size), pages * page_size * bpt,
                            shared_tokens)


def _check_shared(shared_tokens: int, request_tokens: int) -> None:
    try:
        check_shared_tokens(shared_tokens, request_tokens)
    except ValueError as e:
        raise PlanError(str(e).removeprefix("kvcompile serving: ")) from None


def serving_pool(label: str, policy: Policy, shape: ModelShape, budget: int, request_tokens: int,
                 max_requests: int | None = None, shared_tokens: int = 0,
                 max_batch_tokens: int = MAX_BATCH_TOKENS) -> ServingRow:
    """kvcompile's serving pool for ``budget`` bytes under ``policy``: its slots (``max_requests``, as
    ``kvcompile serve --max-requests``; None: the most requests of ``request_tokens`` tokens the budget
    holds), pool blocks (= the pages transformers' scheduler hands out), tokens, and concurrent requests
    (``shared_tokens`` shared as ``pool.shareable_tokens`` says, at ``max_batch_tokens`` a forward)."""
    for name, v in (("budget", budget), ("request_tokens", request_tokens)):
        _check_count(name, v)
    _check_count("max_requests", max_requests, allow_none=True)
    _check_shared(shared_tokens, request_tokens)
    if not isinstance(policy, Policy):
        raise PlanError(f"{label}: {policy!r} is not a kvcompile.Policy")
    dtype = _serving_shape(shape)
    names = [f"model.layers.{i}.self_attn" for i in range(shape.layers)]
    specs = specs_for(policy.resolve(names), shape.kv_heads, shape.head_dim, dtype)
    try:
        size = size_pool(specs, budget, request_tokens, max_requests, shared_tokens, shape.max_positions,
                         max_batch_tokens)
    except KVCompileError as e:
        raise PlanError(f"{label}: {str(e).removeprefix('kvcompile serving: ')}") from None
    if size.requests < 1:
        raise PlanError(f"{label}: with {size.slots} request slots the budget of {budget:,} bytes leaves "
                        f"{size.blocks} pool blocks of {size.block_tokens} tokens, fewer than the "
                        f"{size.pages_per_request} one request of {request_tokens:,} tokens takes; raise the budget, "
                        f"lower max_requests or shorten the requests")
    return ServingRow(label, str(policy), size.block_tokens, size.slots, size.blocks, size.pages_per_request,
                      size.requests, size.nbytes, size.shared_tokens)


def plan_serving(shape: ModelShape, budget: int, request_tokens: int, policies: dict | None = None,
                 max_requests: int | None = None, page_size: int = PAGE_SIZE, shared_tokens: int = 0,
                 max_batch_tokens: int = MAX_BATCH_TOKENS):
    """transformers' paged cache and kvcompile's serving pool under each policy, for one byte budget:
    ``(TransformersPool, rows, left_out)``; ``left_out``: ``(label, why)`` of the policies whose pool holds no
    request (a ``PlanError`` when that is every policy). ``shared_tokens``: every request begins with the
    same prompt of that many tokens, whose whole pages are held once where pages are shared."""
    theirs = transformers_pool(shape, budget, request_tokens, page_size, shared_tokens)
    rows, left_out = [], []
    for k, v in (policies or default_serving_policies()).items():
        try:
            rows.append(serving_pool(k, v, shape, budget, request_tokens, max_requests, shared_tokens,
                                     max_batch_tokens))
        except PlanError as e:
            left_out.append((k, str(e).removeprefix(f"{k}: ")))
    if not rows:
        raise PlanError(f"no policy's serving pool holds a request: {left_out[0][0]}: {left_out[0][1]}")
    return theirs, rows, left_out


def _n(n: int, what: str) -> str:
    return f"{n:,} {what}{'' if n == 1 else 's'}"


def _ratio(a: int, b: int) -> str:
    return f"{a / b:.2f}x" if b else "-"


def format_serving_table(theirs: TransformersPool, rows: list[ServingRow], shape: ModelShape, budget: int,
                         request_tokens: int, max_requests: int | None = None, left_out=()) -> str:
    dtype = _DTYPE_NAMES[shape.dtype_bytes]
    rank = (f" KV heads per GPU of {shape.tp} (tensor parallel: each GPU caches its heads of every request)"
            if shape.tp > 1 else " KV heads")
    lines = [f"{shape.name}: {shape.layers} layers x {shape.kv_heads}{rank} x {shape.head_dim}, {dtype} model; "
             f"one budget of {budget:,} bytes ({budget / 2**20:,.1f} MiB) for the whole serving cache"
             f"{' of each GPU' if shape.tp > 1 else ''}; requests of {request_tokens:,} tokens",
             f"transformers' PagedAttentionCache: {_n(theirs.pages, 'page')} of {theirs.page_size} tokens "
             f"({theirs.tokens:,} tokens), {_n(theirs.pages_per_request, 'page')} a request: "
             f"{_n(theirs.requests, 'request')}"]
    if theirs.shared_tokens:
        sharing = sorted({r.label for r in rows if r.shared_tokens})
        lines.append(f"every request begins with the same {theirs.shared_tokens:,}-token prompt, whose whole pages are "
                     f"held once (prefix sharing): by transformers, and by kvcompile under "
                     + ("; ".join(sharing) if sharing else "none of these policies")
                     + " (a policy with a full-precision window or sinks shares no pages; a quantized one reads "
                     "a shared prompt in whole pieces of --max-batch-tokens, so its reply is the one it gets "
                     "alone)")
    w = max([len("policy")] + [len(r.label) for r in rows]) + 2
    lines.append(f"{'policy':<{w}}{'block':>6}{'slots':>7}{'blocks':>8}{'tokens':>10}{'requests':>10}"
                 f"{'x tokens':>10}{'x requests':>12}{'bytes allocated':>18}")
    for r in rows:
        lines.append(f"{r.label:<{w}}{r.block_tokens:>6}{r.slots:>7,}{r.blocks:>8,}{r.tokens:>10,}{r.requests:>10,}"
                     f"{_ratio(r.tokens, theirs.tokens):>10}{_ratio(r.requests, theirs.requests):>12}"
                     f"{r.nbytes:>18,}")
    slots = (f"slots: {max_requests} (max_requests)" if max_requests else
             f"slots: the most requests of {request_tokens:,} tokens the budget holds")
    lines.append(f"{slots}; kvcompile's pages are its pool's blocks (a page per block, block tokens each) and "
                 f"'tokens' counts them; one request takes the blocks its packed tokens fill (a full-precision "
                 f"window and sinks stay in its slot, outside the pages). `kvcompile serve --budget-mib M --max-requests SLOTS` "
                 f"(kvcompile.serving.configure(model, budget=, max_requests=)) allocates exactly this pool"
                 + ("." if max_requests or theirs.shared_tokens else
                    f", as `--request-tokens {request_tokens}` (configure(..., request_tokens=)) sizes it."))
    lines += [f"not shown, {label}: {why}" for label, why in left_out]
    return "\n".join(lines)


SERVING_PLOT_TOKENS = (256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


def plot_serving(shape: ModelShape, budget: int, path, policies: dict | None = None,
                 request_tokens=SERVING_PLOT_TOKENS, page_size: int = PAGE_SIZE, max_requests: int | None = None,
                 shared_tokens: int = 0, max_batch_tokens: int = MAX_BATCH_TOKENS) -> Path:
    """Concurrent requests one byte budget holds against the request's length, for transformers' own paged
    cache and kvcompile's pool under each policy (left), and each policy's count over transformers' (right),
    sized as ``plan_serving`` sizes them; lengths up to the model's positions. A length at which a pool holds no
    request (or not above ``shared_tokens``) is left out of its line."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    nan = float("nan")

    def held(size):  # the requests a pool holds; NaN for none
        try:
            return size().requests or nan
        except PlanError:
            return nan

    def ratio(label, pol, n):  # at a budget of LARGE of transformers' requests: whole requests do not round it
        big = LARGE * transformers_pool(shape, 1, n, page_size).pages_per_request * page_size * token_bytes
        return (held(lambda: serving_pool(label, pol, shape, big, n, None, shared_tokens, max_batch_tokens))
                / held(lambda: transformers_pool(shape, big, n, page_size, shared_tokens)))

    LARGE, token_bytes = 1000, _token_bytes(shape)
    policies = policies or default_serving_policies()
    request_tokens = [n for n in request_tokens if shape.max_positions is None or n <= shape.max_positions]
    fig, (ax, rx) = plt.subplots(1, 2, figsize=(13, 4.8))
    for a in (ax, rx):  # 15 policies' lines told apart
        a.set_prop_cycle(linestyle=["-", "-.", ":"] * 5, color=plt.get_cmap("tab20").colors[:15])
    theirs = [held(lambda: transformers_pool(shape, budget, n, page_size, shared_tokens)) for n in request_tokens]
    ax.plot(request_tokens, theirs, "k--", marker="s", ms=3, label="transformers' PagedAttentionCache")
    for label, pol in policies.items():
        ours = [held(lambda: serving_pool(label, pol, shape, budget, n, max_requests, shared_tokens,
                                          max_batch_tokens))
                for n in request_tokens]
        ax.plot(request_tokens, ours, marker="o", ms=3, label=label)
        rx.plot(request_tokens, [ratio(label, pol, n) for n in request_tokens], marker="o", ms=3, label=label)
    for a in (ax, rx):
        a.set_xscale("log", base=2)
        a.set_xlabel("tokens per request")
        a.grid(alpha=0.3, which="both")
    ax.set_yscale("log", base=2)
    ax.set_ylabel("concurrent requests")
    rx.set_ylabel(f"x transformers' requests (at a budget of {LARGE:,} of them)")
    ax.set_title(f"{shape.name}: {budget / 2**20:,.0f} MiB of serving cache")
    rx.set_title("per byte, over transformers' own paged cache")
    fig.legend(*ax.get_legend_handles_labels(), fontsize=7, loc="center right")
    fig.tight_layout(rect=(0, 0, 0.8, 1))
    return _save(fig, path)


def serving_to_json(theirs: TransformersPool, rows: list[ServingRow], shape: ModelShape, budget: int,
                    request_tokens: int, max_requests: int | None = None, left_out=()) -> str:
    return json.dumps({"model": shape.__dict__, "budget_bytes": budget, "request_tokens": request_tokens,
                       "max_requests": max_requests, "shared_tokens": theirs.shared_tokens,
                       "transformers": theirs.as_dict(),
                       "left_out": [{"label": k, "why": v} for k, v in left_out],
                       "rows": [dict(r.as_dict(), token_ratio=r.tokens / theirs.tokens if theirs.tokens else None,
                                     request_ratio=r.requests / theirs.requests if theirs.requests else None)
                                for r in rows]}, indent=2)
