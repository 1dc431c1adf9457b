"""Stores and layouts shared by the attention kernels' tests (Triton: test_attention_kernel.py, C:
test_cpu_kernels.py)."""
import torch

from kvcompile import Policy, Quant
from kvcompile.store import LayerSpec

from store_checks import scrambled


def filled(policy, lengths, H, D, dtype="float32", seed=0, chunk=None, own=0, block=16):
    """A registered store of ``len(lengths)`` ragged rows filled by the reference with random keys (channel 3
    an outlier, as real keys have) and values, appended in chunks of ``chunk`` tokens (default: all at once),
    its blocks (``block`` packed tokens each: small, so that short rows span several) handed out in a
    scrambled order (``store_checks.scrambled``). Returns its ``KVState``.

    ``own > 0``: also return each row's last ``own`` tokens as ``k_new, v_new [B, H, own, D]`` (what an
    attention call of ``own`` queries passes as its chunk; zeros before a row's first token), so the call is
    ``(spec, state, k_new, v_new)``."""
    g = torch.Generator().manual_seed(seed)
    spec = LayerSpec(policy, H, D, dtype, max(block, policy.flush))
    spec.register()
    m = max(lengths)
    store = scrambled(spec, len(lengths), len(lengths) * (spec.blocks_for(m) + 1), seed)
    k = torch.randn(len(lengths), H, m, D, generator=g)
    k[..., 3] *= 8
    v = torch.randn(len(lengths), H, m, D, generator=g)
    k, v = k.to(spec.torch_dtype), v.to(spec.torch_dtype)  # what a model in that dtype stores
    chunk = chunk or m
    for s in range(0, m, chunk):
        n_new = torch.tensor([max(0, min(L - s, chunk)) for L in lengths])
        store.append(k[:, :, s:s + chunk], v[:, :, s:s + chunk], n_new)
    state = store.state
    if not own:
        return spec, state
    k_new, v_new = (torch.zeros(len(lengths), H, own, D, dtype=spec.torch_dtype) for _ in range(2))
    for b, L in enumerate(lengths):
        t = min(L, own)
        k_new[b, :, own - t:], v_new[b, :, own - t:] = k[b, :, L - t:L], v[b, :, L - t:L]
    return spec, state, k_new, v_new


# Keys per channel in groups of 16, residual 8, two sinks: Q(L) moves at L = 2 + 8 + 16 j.
MIXED = Policy(Quant("int4", "channel", 16), Quant("int2", "token", 32), residual=8, sink=2)
ROTATED = Policy(Quant("fp8_e4m3", "token"), Quant("int3", "channel", 16), residual=8, sink=2, rotate=True)
# lengths 1, group - 1, group + 1, around the first flush (25, 26, 27) and the second (42, 43): one batch
LENGTHS = [1, 15, 17, 25, 26, 27, 42, 43]


def one_wrong_code(flip: int = 1):
    """A store with one int8 key code off by ``flip`` steps, for showing that a kernel check is sharp enough to
    fail. Returns (spec, good state, bad state, query); the query looks at the corrupted channel."""
    spec, state = filled(Policy.kivi(8, group=8, residual=4), [40], 1, 16)
    q = torch.randn(1, 2, 1, 16, generator=torch.Generator().manual_seed(1))
    q[..., 3] = 1.5
    bad = type(state)(*[t.clone() for t in state])
    bad.k_codes[int(state.table[0, 0]), 0, 5, 3] ^= flip
    return spec, state, bad, q
