"""What the pass found in one graph, as ``kvcompile.explain`` prints it: each rewritten cache site (layer, write,
read, policy, bytes) and what it left alone, with the reason. Built by the backend (``site_reports``) for every
graph it compiles; ``kvcompile.explain`` merges and prints them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .accounting import full_precision_bytes_per_token
from .passes.kv_cache import Site, Skipped
from .store import LayerSpec


@dataclass
class SiteReport:
    layer: str
    write: str
    read: str
    policy: str
    bytes_per_token: float       # this layer's packed blocks per token (block table included), long-context rate
    fixed_bytes: int             # what each sequence holds besides its blocks: ring, sinks, length
    fp_bytes_per_token: int      # the same layer's full-precision cache
    gqa: int
    memory_saved: bool
    keys: str = "post-RoPE"      # how keys are stored: "pre-RoPE (half:64)", or post-RoPE (the keys written)


@dataclass
class Explanation:
    sites: list[SiteReport] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"kvcompile: {len(self.sites)} cache site(s) rewritten, {len(self.skipped)} not rewritten"]
        if self.sites:
            rows = [(s.layer, s.write, s.read, f"{s.bytes_per_token:.1f}", str(s.fp_bytes_per_token),
                     str(s.fixed_bytes), s.policy + ("" if s.memory_saved else "  [!]")
                     + (f"  keys {s.keys}" if ";pre=1" in s.policy else "")) for s in self.sites]
            head = ("layer", "write", "read", "B/token", "fp B/token", "B/sequence", "policy")
            w = [max(len(r[i]) for r in rows + [head]) for i in range(len(head))]
            right = {3, 4, 5}

            def fmt(r):
                return "  " + "  ".join(c.rjust(w[i]) if i in right else c.ljust(w[i]) for i, c in enumerate(r))
            lines += [fmt(head).rstrip()] + [fmt(r).rstrip() for r in rows]
            lines.append("  B/token: packed bytes per cached token at long context (codes, scales, zero points, "
                         "block table); B/sequence: what each sequence holds besides, its full-precision window "
                         "and sinks (which dominate a short sequence)")
        for k in self.skipped:
            lines.append(f"  not rewritten: {k.layer} ({k.node}): {k.reason}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def site_reports(sites: list[Site], specs: list[LayerSpec], owned: list[bool], skipped) -> Explanation:
    ex = Explanation(skipped=list(skipped))
    for s, spec, own in zip(sites, specs, owned):
        write = f"{s.k_write.node.name} ({s.k_write.idiom})"
        keys = "post-RoPE"
        if spec.policy.pre_rope:
            if s.rope is not None:
                keys = f"pre-RoPE ({s.rope.name})"
            else:
                ex.notes.append(f"{s.layer}: keys stored post-RoPE although the policy asks for pre_rope: {s.rope_why}")
        ex.sites.append(SiteReport(s.layer, write, f"{s.read.name} (sdpa)", spec.policy.key_str(),
                                   (spec.block_nbytes() + 4) / spec.block, spec.row_nbytes(),
                                   full_precision_bytes_per_token(1, spec.heads, spec.head_dim, spec.torch_dtype),
                                   s.gqa, own, keys))
    if not all(owned):
        ex.notes.append("[!] these caches were allocated in full precision by their owner (e.g. a transformers "
                        "StaticCache): kvcompile stores and reads them packed, but their full-precision memory is "
                        "still allocated. Use kvcompile.apply (or a KVCompileCache) to save it.")
    return ex
