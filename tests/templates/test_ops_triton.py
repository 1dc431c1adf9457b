"""torch.ops.kvcompile.store / attention dispatched to the Triton kernels, under torch.compile(fullgraph=True),
equal the reference dispatch (store: bit for bit; attention: within the derived bound of float64)."""
import pytest
import torch
from tiers import slow_after

from kvcompile import Policy, Quant, ops, standin
from kvcompile.store import KVStore, LayerSpec
from kvcompile.templates import launch

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def triton_kernels():
    ops.set_kernels("triton")
    yield
    ops.set_kernels("auto")


def step(k_cache, v_cache, k, v, q, pos, name: str):
    tok = torch.ops.kvcompile.store(k_cache, v_cache, k, v, pos, name)
    return torch.ops.kvcompile.attention(q, k_cache, v_cache, tok, None, 0.125, name)


@pytest.mark.parametrize("policy", slow_after(1, [
    Policy.kivi(4, group=8, residual=4, sink=1),
    Policy(Quant("fp8_e4m3", "token"), Quant("int3", "token", 16), residual=3, rotate=True),
    Policy(Quant("fp8_e4m3", "tensor"), Quant("fp8_e5m2", "tensor"), residual=3, sink=1, rotate=True),
]))
def test_compiled_ops_with_triton_kernels_equal_reference(policy, triton_kernels, monkeypatch):
    calls = []  # proof that the ops reached the Triton launchers, not the reference
    for fn in ("store", "attention"):
        real = getattr(launch, fn)
        monkeypatch.setattr(launch, fn, lambda *a, _real=real, _fn=fn, **kw: calls.append(_fn) or _real(*a, **kw))
    B, H, G, D, C = 2, 2, 2, 32, 40
    spec = LayerSpec(policy, H, D, block_tokens=16)  # several blocks for 22 tokens
    name = spec.register()
    ref, got = KVStore(spec, B), KVStore(spec, B, DEV)
    k_cache, v_cache = (standin.make_standin((B, H, C, D), torch.float32, DEV) for _ in range(2))
    standin.register(k_cache, v_cache, got, "layer", owned=True)
    torch._dynamo.reset()  # each policy recompiles ``step`` per chunk length: start each one below Dynamo's limit
    compiled = torch.compile(step, fullgraph=True, dynamic=False)
    g = torch.Generator().manual_seed(0)
    L = 0
    for n in (13, 1, 1, 7):  # a prefill, two decode steps, a chunk: crosses the first flushes
        k, v = torch.randn(B, H, n, D, generator=g), torch.randn(B, H, n, D, generator=g)
        q = torch.randn(B, H * G, n, D, generator=g)
        pos = torch.arange(L, L + n)
        out = compiled(k_cache, v_cache, k.to(DEV), v.to(DEV), q.to(DEV), pos.to(DEV), name)
        ref.append(k, v)
        L += n
        for a, b in zip(ref.state, got.state):
            assert torch.equal(a, b.cpu())
        want, bound = launch.reference_and_bound(q, ref.state, spec, None, 0.125, device=DEV)
        assert ((out.cpu().double() - want).abs() <= bound).all()
    assert calls == ["store", "attention"] * 4


def test_too_old_interpreter_is_refused_with_a_clear_error():
    """Triton 3.6's interpreter hands loaded scalars to Python as one-element arrays, which the kernels' loop
    bounds reject deep inside the interpreter (seen here with triton 3.6.0); the launcher says so up front."""
    from kvcompile.templates.common import check_interpreter

    with pytest.raises(RuntimeError, match=r"Triton 3\.6\.0.*Triton >= 3\.7"):
        check_interpreter("3.6.0")
    for ok in ("3.7.0", "3.9.0", "3.10.1+git1234", "4.0.0"):
        check_interpreter(ok)
