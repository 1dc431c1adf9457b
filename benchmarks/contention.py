"""Decode under CPU contention: kvcompile's C kernels against fp32 SDPA, alone and beside CPU-bound competitors.

    python benchmarks/contention.py                       # SmolLM2's 30-layer stack, 2K positions, KIVI int4
    python benchmarks/contention.py --projections         # + each layer's linear projections (torch's pool)
    python benchmarks/contention.py --context 8192 --competitors 1
    python benchmarks/contention.py --smoke               # tiny, a few seconds (run by the tests)

One decode step is, per layer: store the new token's keys and values, then attend one query token (9 query
heads over 3 kv heads, head_dim 64, as SmolLM2-135M) over everything stored. kvcompile's step is the C store
kernel and the C decode-attention kernel (``cpu_store.store`` + ``cpu.attention``) over the packed store; the
full-precision baseline writes into an fp32 cache of the same capacity and runs PyTorch's SDPA over the held
positions. ``--projections`` adds the layer's q/k/v/o and MLP matmuls (torch, fp32) to every contender.
Everything runs with the process's default torch threads unless ``--threads``. The kernels' own thread count
follows the cores other processes leave free (``cpu.available_threads``); the contender "kvcompile, torch's
threads" pins it to ``torch.get_num_threads()`` (``cpu.FIXED_THREADS``), as it was before 2026-12-01, so one
table shows both in the same conditions.

Each phase times blocks of ``--steps`` decode steps, round-robin between the contenders, and reports the
median rate. The contended phase first starts ``--competitors`` CPU-bound processes (a Python busy loop each,
in a session of its own like another user's job; default one per core this process may run on). The target's
measure is the ratio kvcompile / baseline, uncontended and contended (contended >= 0.8 x uncontended). Since
the baseline itself may collapse, each contender's own contended / uncontended rate is given too, beside the
same ratio of the CPU it used ("CPU": its CPU time over the wall time, in cores) and their quotient, the rate
per CPU-second: near 1 or above, the contender slowed down in proportion to the CPU it got; far below 1, it
burnt CPU without progress (threads spinning at a barrier while a teammate waits for a time slice): a
collapse. "background" is what other processes kept busy of this process's cores in the half second before
the phase (on a shared machine the uncontended phase is only as uncontended as that).
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
from tqdm import tqdm

from kvcompile.store import LayerSpec, attention_reference
from kvcompile.templates import cpu, cpu_store

try:
    from . import cpu_kernels as ck
except ImportError:  # run as a script: benchmarks/ is on the path
    import cpu_kernels as ck

TARGET = 0.8  # contended ratio / uncontended ratio at least this
BUSY_LOOP = "while True: pass"
BASELINE = "fp32 SDPA"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=2048, help="positions held when the timed steps start")
    ap.add_argument("--layers", type=int, default=30)
    ck.layer_args(ap, batch=1)
    ap.add_argument("--policy", default="KIVI int4", choices=list(ck.POLICIES))
    ap.add_argument("--steps", type=int, default=16, help="decode steps per timed block")
    ap.add_argument("--rounds", type=int, default=5, help="timed blocks per contender and phase")
    ap.add_argument("--competitors", type=int, default=None,
                    help="CPU-bound processes in the contended phase (default: one per core available)")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: left as it is)")
    ap.add_argument("--projections", action="store_true",
                    help="also run each layer's linear projections in torch (SmolLM2's q/k/v/o and MLP shapes, "
                         "fp32), in every contender: a whole decode step, torch's thread pool included")
    ap.add_argument("--hidden", type=int, default=576, help="model width (--projections)")
    ap.add_argument("--intermediate", type=int, default=1536, help="MLP width (--projections)")
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args(argv)
    if a.smoke:
        a.context, a.layers, a.steps, a.rounds = 256, 2, 4, 3
    if a.threads:
        torch.set_num_threads(a.threads)
    cores = len(os.sched_getaffinity(0))
    n_comp = cores if a.competitors is None else a.competitors
    B, H, G, D, L, S = a.batch, a.heads, a.gqa, a.head_dim, a.context, a.steps
    print(f"{a.layers} layers, B={B} kv heads={H} gqa={G} head_dim={D}, {L} positions + {S} steps per block, "
          f"{a.policy}{', with projections' if a.projections else ''}; {cores} cores available, torch threads "
          f"{torch.get_num_threads()}, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}, median of "
          f"{a.rounds} blocks")
    kvc = f"kvcompile {a.policy}"
    kvc_fixed = "kvcompile, torch's threads"
    proj = projections(B, H, G, D, a.hidden, a.intermediate) if a.projections else None
    step = kvcompile_stack(a.layers, a.policy, B, H, G, D, L, S, proj)
    steps = {BASELINE: baseline_stack(a.layers, B, H, G, D, L, S, proj), kvc: step,
             kvc_fixed: pinned(step, torch.get_num_threads())}
    rows = []
    bar = tqdm(total=2 * a.rounds * len(steps), desc="contention benchmark", leave=False)
    for phase in ("uncontended", "contended"):
        background = background_cores(0.5)
        procs = start_competitors(n_comp if phase == "contended" else 0)
        try:
            times = {n: [] for n in steps}
            cpus = {n: [] for n in steps}
            for fn in steps.values():
                fn()  # warm: caches, thread pools, the kernels' view of the load
            for r in range(a.rounds):
                for name, fn in list(steps.items())[:: 1 if r % 2 else -1]:
                    c0, t0 = time.process_time(), time.perf_counter()
                    fn()
                    t, c = time.perf_counter() - t0, time.process_time() - c0
                    times[name].append(t)
                    cpus[name].append(c / t)
                    bar.update()
        finally:
            stop_competitors(procs)
        for name in steps:
            t = statistics.median(times[name])
            rows.append({"phase": phase, "contender": name, "competitors": len(procs), "background": background,
                         "tok_s": S / t, "ms_per_token": t / S * 1e3, "cpu_cores": statistics.median(cpus[name])})
    bar.close()
    print(f"{'phase':<13}{'contender':<28}{'competitors':>12}{'background':>11}{'tok/s':>9}{'ms/token':>10}"
          f"{'CPU':>6}")
    for r in rows:
        print(f"{r['phase']:<13}{r['contender']:<28}{r['competitors']:>12}{r['background']:>11.2f}"
              f"{r['tok_s']:>9.1f}{r['ms_per_token']:>10.3f}{r['cpu_cores']:>6.2f}")
    summary = summarize(rows, [BASELINE, kvc, kvc_fixed])
    for name in (kvc, kvc_fixed):
        s = summary["ratios"][name]
        print(f"{name} / {BASELINE} rate: uncontended {s['uncontended']:.3f}, contended {s['contended']:.3f}; "
              f"contended / uncontended = {s['relative']:.3f} (target >= {TARGET}: "
              f"{'met' if s['relative'] >= TARGET else 'NOT met'})")
    print("contended / uncontended, own rate | CPU used | rate per CPU-second:")
    for n, s in summary["slowdown"].items():
        print(f"  {n:<28}{s['rate']:>7.3f} |{s['cpu']:>6.3f} |{s['per_cpu']:>6.3f}")
    return {"rows": rows, **summary["ratios"][kvc], "ratios": summary["ratios"], "slowdown": summary["slowdown"]}


def summarize(rows, names):
    """Each kvcompile contender's rate over the baseline's, per phase; every contender's contended /
    uncontended rate, CPU used, and rate per CPU-second."""
    by = {(r["phase"], r["contender"]): r for r in rows}
    rate = {k: r["tok_s"] for k, r in by.items()}
    base, *others = names
    ratios = {}
    for n in others:
        ru = rate["uncontended", n] / rate["uncontended", base]
        rc = rate["contended", n] / rate["contended", base]
        ratios[n] = {"uncontended": ru, "contended": rc, "relative": rc / ru}
    slowdown = {}
    for n in names:
        r = rate["contended", n] / rate["uncontended", n]
        c = by["contended", n]["cpu_cores"] / by["uncontended", n]["cpu_cores"]
        slowdown[n] = {"rate": r, "cpu": c, "per_cpu": r / c if c > 0 else float("nan")}
    return {"ratios": ratios, "slowdown": slowdown}


def baseline_stack(layers, B, H, G, D, L, S, proj=None):
    """A block of ``S`` decode steps over ``layers`` fp32 caches of capacity ``L + S``: per layer, write the
    token's keys and values at position p, SDPA over positions [0, p]. The caches start holding ``L``."""
    g = torch.Generator().manual_seed(1)
    caches = [torch.randn(2, B, H, L + S, D, generator=g) for _ in range(layers)]
    q = torch.randn(B, H * G, 1, D, generator=g)
    k1, v1 = torch.randn(2, B, H, D, generator=g)

    def block():
        for p in range(L, L + S):
            for c in caches:
                if proj:
                    proj()
                c[0, :, :, p] = k1
                c[1, :, :, p] = v1
                F.scaled_dot_product_attention(q, c[0, :, :, :p + 1], c[1, :, :, :p + 1], enable_gqa=G > 1)
    return block


def kvcompile_stack(layers, policy, B, H, G, D, L, S, proj=None):
    """The same block through kvcompile's CPU kernels: ``layers`` stores of ``policy`` with room for ``L + S``
    positions, ``L`` of them filled by the store kernel (the decode kernel checked against the reference on
    them), rewound to ``L`` held positions before each block (the block then rewrites the positions after)."""
    q, k, v = ck.random_layer(B, H, G, D, L, torch.Generator().manual_seed(0))
    spec = LayerSpec(ck.POLICIES[policy](), H, D)
    spec.register()
    st = spec.allocate(B, L + S)
    cpu_store.store(st, spec, k, v)
    if not torch.allclose(cpu.attention(q, st, spec, None, None), attention_reference(q, st, spec),
                          atol=1e-4, rtol=1e-4):
        raise AssertionError(f"{policy}: the decode kernel disagrees with the reference at {L} positions")
    states = [type(st)(*[t.clone() for t in st]) for _ in range(layers)]
    k1, v1 = torch.randn(2, B, H, 1, D, generator=torch.Generator().manual_seed(2))

    def block():
        for s in states:
            s.lengths.fill_(L)
        for _ in range(S):
            with cpu.capped_torch_threads():  # as kvcompile's forward runs a step: torch's threads capped too
                for s in states:
                    if proj:
                        proj()
                    cpu_store.store(s, spec, k1, v1)
                    cpu.attention(q, s, spec, None, None)
    return block


def projections(B, H, G, D, hidden, intermediate):
    """One layer's linear projections for one token, in torch (fp32): q, k, v, o and the gated MLP. Their
    outputs are discarded (the attention contenders use fixed inputs); only their time and threads count."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(B, hidden, generator=g)
    w_qkv = torch.randn(hidden, (H * G + 2 * H) * D, generator=g) / hidden ** 0.5
    w_o = torch.randn(H * G * D, hidden, generator=g) / (H * G * D) ** 0.5
    w_up = torch.randn(hidden, 2 * intermediate, generator=g) / hidden ** 0.5
    w_down = torch.randn(intermediate, hidden, generator=g) / intermediate ** 0.5

    def run():
        (x @ w_qkv)[:, :H * G * D] @ w_o
        gate, up = (x @ w_up).chunk(2, dim=-1)
        (F.silu(gate) * up) @ w_down
    return run


def pinned(fn, threads: int):
    """``fn`` run with the kernels' thread count fixed to ``threads`` (``cpu.FIXED_THREADS``)."""
    def block():
        before, cpu.FIXED_THREADS = cpu.FIXED_THREADS, threads
        try:
            fn()
        finally:
            cpu.FIXED_THREADS = before
    return block


def background_cores(seconds: float) -> float:
    """Cores of this process's affinity that other processes kept busy over ``seconds`` (this one idle);
    NaN without /proc/stat."""
    cpus = sorted(os.sched_getaffinity(0))
    b0, c0, t0 = cpu.busy_seconds(cpus), time.process_time(), time.perf_counter()
    time.sleep(seconds)
    b1, c1, t1 = cpu.busy_seconds(cpus), time.process_time(), time.perf_counter()
    if b0 is None or b1 is None:
        return float("nan")
    return max(0.0, (b1 - b0) - (c1 - c0)) / (t1 - t0)


def start_competitors(n: int) -> list:
    """``n`` CPU-bound processes (a Python busy loop each), running when this returns. Each is started in a
    session of its own, as another user's job or another shell's would be: where the kernel groups threads by
    session for fairness (autogroup, the default on desktop Linux), this process then gets a group's share
    however many threads it runs. Each competitor's group gets this process's group's nice value."""
    nice = autogroup_nice()
    code = (f"try: open('/proc/self/autogroup', 'w').write('{nice}')\nexcept OSError: pass\n"
            if nice is not None else "") + BUSY_LOOP
    procs = [subprocess.Popen([sys.executable, "-c", code], start_new_session=True) for _ in range(n)]
    time.sleep(0.3 if n else 0)  # the interpreters start and spin
    for p in procs:
        if p.poll() is not None:
            stop_competitors(procs)
            raise RuntimeError(f"a competitor process exited at once (exit status {p.returncode})")
    return procs


def autogroup_nice() -> int | None:
    """The nice value of this process's autogroup (None where the kernel has none)."""
    try:
        with open("/proc/self/autogroup") as f:
            return int(f.read().split("nice")[1])
    except (OSError, IndexError, ValueError):
        return None


def stop_competitors(procs: list) -> None:
    for p in procs:
        p.kill()
    for p in procs:
        p.wait()


if __name__ == "__main__":
    res = main()
    sys.exit(0 if math.isfinite(res["relative"]) else 1)
