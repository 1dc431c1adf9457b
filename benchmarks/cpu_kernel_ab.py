"""Two versions of the CPU decode-attention template side by side, on one layer, interleaved call by call.

    python benchmarks/cpu_kernel_ab.py                        # HEAD's template vs the working tree's, 8K x 4
    python benchmarks/cpu_kernel_ab.py --base a8c814f --policies "KIVI int4" "KIVI int2" --repeats 61
    python benchmarks/cpu_kernel_ab.py --base-file old.c --new-file new.c
    python benchmarks/cpu_kernel_ab.py --smoke                # tiny, seconds

How a change to ``templates/cpu_attention.c`` is judged before it is kept. The base is the template at a git
revision (``--base``, default HEAD) or a file; the new one is the working tree's or a file. Both must read the
paged store and take the head counts as arguments (an older revision has another signature: refused). Per policy both
are built, the new one is checked against the reference (a fast wrong kernel measures nothing; ``--no-check``
skips that for a variant that changes the numerics on purpose, whose distance the table shows), and both run
on the same store, alternating (A B B A A B ...) for ``--repeats`` calls, one thread. Printed: the largest
difference between the two outputs (0 when the change is bit-identical), each version's median and minimum
time per (position, kv head), and new over base for both. On a shared machine the minimum is the steadier
figure; a difference smaller than the spread between two runs of this script is no difference.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
from pathlib import Path

from kvcompile.templates import cpu

try:
    from . import cpu_kernels as ck
except ImportError:  # run as a script: benchmarks/ is on the path
    import cpu_kernels as ck

ROOT = Path(__file__).resolve().parents[1]


def template_at(rev: str, dest: Path) -> Path:
    """``templates/cpu_attention.c`` as it is at git revision ``rev``, written under ``dest``."""
    try:
        text = subprocess.run(["git", "show", f"{rev}:templates/cpu_attention.c"], cwd=ROOT, check=True,
                              capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        err = getattr(e, "stderr", "") or str(e)
        raise SystemExit(f"cannot read templates/cpu_attention.c at revision {rev!r}: {err.strip()} "
                         f"(pass a revision of this repository, or --base-file)")
    if "kvc_attention" in text and "const int32_t *table" not in text:
        raise SystemExit(f"templates/cpu_attention.c at {rev!r} predates the paged store (it reads a capacity "
                         f"layout through another signature): pass a revision at or after 8903349")
    if "kvc_attention" in text and "int64_t B, int64_t H, int64_t G" not in text:
        raise SystemExit(f"templates/cpu_attention.c at {rev!r} takes the head counts as -D constants (another "
                         f"signature): pass a revision after the one that made them arguments")
    path = dest / f"cpu_attention_{rev.replace('/', '_')}.c"
    path.write_text(text)
    return path


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="HEAD", help="git revision whose template is the base")
    ap.add_argument("--base-file", type=Path, help="a template file as the base instead")
    ap.add_argument("--new-file", type=Path, default=cpu.SOURCE, help="the new template (default: the working tree's)")
    ap.add_argument("--policies", nargs="+", default=list(ck.SINGLE_LAYER_POLICIES), choices=list(ck.POLICIES))
    ck.single_layer_args(ap, repeats=41)
    ap.add_argument("--no-check", action="store_true",
                    help="time a new kernel that changes the numerics without the reference check (the max "
                         "difference column says how far it moved)")
    a = ap.parse_args(argv)
    B, H, G, D, L, q, k, v = ck.single_layer(a)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        base = a.base_file or template_at(a.base, Path(tmp))
        sources = {"base": base, "new": a.new_file}
        print(f"base {a.base_file or a.base}, new {a.new_file}; {B=} kv heads={H} gqa={G} head_dim={D} "
              f"positions={L}, 1 thread, {a.repeats} alternating calls each")
        print(f"{'policy':<20}{'max |new-base|':>16}{'median base':>13}{'new':>7}{'ratio':>7}"
              f"{'min base':>10}{'new':>7}{'ratio':>7}   (ns per position-head)")
        for name in a.policies:
            spec, st, _ = ck.checked_store(name, ck.POLICIES[name](), q, k, v,
                                           source=cpu.SOURCE if a.no_check else a.new_file)
            outs = {n: cpu.attention(q, st, spec, None, None, source=s) for n, s in sources.items()}
            diff = (outs["new"] - outs["base"]).abs().max().item()
            times = ck.time_sources(q, st, spec, sources, a.repeats)
            per = B * H * L / 1e9
            med = {n: statistics.median(ts) / per for n, ts in times.items()}
            low = {n: min(ts) / per for n, ts in times.items()}
            rows.append(dict(policy=name, max_diff=diff, median_ns=med, min_ns=low))
            print(f"{name:<20}{diff:16.3g}{med['base']:13.1f}{med['new']:7.1f}{med['new'] / med['base']:7.3f}"
                  f"{low['base']:10.1f}{low['new']:7.1f}{low['new'] / low['base']:7.3f}")
    return rows


if __name__ == "__main__":
    main()
