"""Every kernel specialization the GPU benchmark and the tests lean on also compiles for a real GPU (sm_90).

The interpreter runs kernels as Python and accepts code Triton's compiler rejects, so this runs the same
launchers in a subprocess without TRITON_INTERPRET, with ``templates.common.compile_only`` turning each launch
into a full compile (TTIR -> PTX -> cubin through ptxas). No GPU is needed.
"""
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import torch
    from kvcompile import Policy, Quant
    from kvcompile.store import LayerSpec, Rope, rope_pairing
    from kvcompile.templates import common, launch

    log = []
    cases = [  # (policy, head_dim, dtype, gqa, n, mask, packed tokens per block, tiles[, kernel])
        (Policy.fp8(residual=0), 128, "bfloat16", 4, 1, None, None, None),
        (Policy.kivi(4, group=32, residual=16, sink=4), 128, "bfloat16", 4, 64, None, None, None),  # own chunk
        (Policy(Quant("int8", "token"), Quant("int8", "token"), residual=0), 128, "bfloat16", 4, 1, None, 16, None,
         "general"),
        (Policy(Quant("int4", "token"), Quant("int4", "token"), residual=0), 128, "bfloat16", 4, 1, None, None, None),
        (Policy(Quant("int2", "token"), Quant("int2", "token"), residual=0), 128, "bfloat16", 4, 1, None, None, None),
        (Policy.kivi(4, group=32, residual=128, sink=4), 128, "bfloat16", 8, 17, torch.ones(1, dtype=torch.bool),
         None, None),
        (Policy(Quant("int3", "token", 16, True), Quant("fp8_e5m2", "channel", 16), residual=5, rotate=True),
         64, "float16", 3, 1, torch.zeros(1), 16, None),
        (Policy.kivi(2, group=16, residual=8, sink=2), 64, "float32", 2, 1, None, 32, (1, 64, 3),
         "general"),  # tile cut to 32
        # the decode kernel (templates.decode; the four above too): scales on tiles (fp8, int4, int2), per group
        # (KIVI's values), per element (KIVI's per-channel keys, fp32 scales, per-channel values), the
        # full-precision program with the query's own token and masks, a tile over two blocks
        (Policy.kivi(4, group=32, residual=0), 128, "bfloat16", 8, 1, None, 256, None, "decode"),
        (Policy(Quant("int8", "token", 32, False, "float32"), Quant("fp8_e5m2", "token", 16), residual=4, sink=2),
         128, "bfloat16", 8, 1, torch.zeros(1), None, None, "decode"),
        (Policy(Quant("int4", "token", scale_dtype="fp8_e4m3"), Quant("int2", "channel", 32, scale_dtype="fp8_e4m3"),
                residual=0), 64,
         "float16", 2, 1, torch.ones(1, dtype=torch.bool), 32, (1, 64, 2), "decode"),  # a tile over 2 blocks
        # int4 keys as halfwords at head_dim 64 (decode.key_words; at 128 the cases above read words, halfwords)
        (Policy(Quant("int4", "token"), Quant("int4", "token"), residual=0), 64, "float16", 2, 1, None, None, None,
         "decode"),
        # KIVI int2: values in groups of 8 columns (GROUPS), 4 rows, the query scaled per group, a float mask
        (Policy.kivi(2, group=32, residual=8, sink=2), 128, "bfloat16", 4, 1, torch.zeros(1), None, None, "decode"),
        # values in a row per query head and group (ROWS) beside keys on tiles, a float mask
        (Policy(Quant("int4", "token"), Quant("int4", "token", 16), residual=8, sink=2), 128, "bfloat16", 2, 1,
         torch.zeros(1), None, None, "decode"),
        # pre-RoPE keys, rotated in the kernel: decode (sinks, codes, ring) and a prefill reading its own chunk
        (Policy.kivi(2, group=32, residual=16, sink=4, pre_rope=True), 128, "bfloat16", 4, 1, None, None, None),
        (Policy(Quant("int4", "channel", 32), Quant("int4", "token"), residual=16, sink=4, rotate=True,
                pre_rope=True), 128, "bfloat16", 4, 64, None, None, None),
        (Policy.fp8(residual=0, pre_rope=True), 64, "float16", 2, 1, torch.ones(1, dtype=torch.bool), 16, None),
        # fp8 with one fixed scale, none stored (axis="tensor"): the store's saturating cast and NaN codes, the decode
        # kernel's tiles (e4m3's NaN code selected) and the general kernel's prefill
        (Policy.fp8(residual=4, sink=2, axis="tensor", rotate=True), 128, "bfloat16", 4, 1, None, None, None, "decode"),
        (Policy.fp8("fp8_e5m2", residual=0, axis="tensor"), 64, "float16", 2, 5, None, 16, None),
        # padded heads (decode.padded_head): 8-bit codes masked (fp8 at 96), int4 words clamped (80), KIVI's groups
        # (3 of 4 at 96, CHAN keys), ROWS values (5 of 8 groups at 80), int2 at 32 (slots of 8 channels)
        (Policy.fp8(residual=4, sink=2), 96, "bfloat16", 1, 1, None, None, None, "decode"),
        (Policy(Quant("int4", "token"), Quant("int4", "token"), residual=0), 80, "bfloat16", 1, 1, None, None, None,
         "decode"),
        (Policy.kivi(4, residual=0), 96, "bfloat16", 4, 1, torch.zeros(1), None, None, "decode"),
        (Policy(Quant("int4", "token"), Quant("int4", "token", 16), residual=0), 80, "float16", 2, 1, None, None,
         None, "decode"),
        (Policy(Quant("int2", "token"), Quant("int2", "token"), residual=0), 32, "float16", 2, 1, None, None, None,
         "decode"),
        # KIVI at 80 beside one query head a KV head: CHAN keys beside ROWS values (8 rows, 5 groups real)
        (Policy.kivi(4, residual=8, sink=2), 80, "bfloat16", 1, 1, None, None, None, "decode"),
    ]
    with common.compile_only(90, log):
        for policy, D, dt, G, n, mask, block, tiles, *kernel in cases:
            spec = LayerSpec(policy, 2, D, dt, block)
            state = spec.allocate(2, 4096)
            k, v = torch.randn(2, 2, 2, n, D)
            rope = None
            if policy.pre_rope:
                perm, sign = rope_pairing("half", D, D)
                rope = Rope(torch.ones(8, D), torch.zeros(8, D), torch.tensor(perm, dtype=torch.int32),
                            torch.zeros(2, dtype=torch.int32))
            launch.store(state, spec, k, v)
            launch.attention(torch.randn(2, 2 * G, n, D), state, spec, mask, k_new=k, v_new=v, tiles=tiles, rope=rope,
                             kernel=kernel[0] if kernel else "auto")
        # row-invariant decode (kvcompile.pages: an engine's rows): the row's own splits, the merge in order; runs
        # of a sequence's rows a program (decode.run_rows), with each row's full-precision positions and a mask too
        for policy, mask in ((Policy(Quant("int4", "token"), Quant("int4", "token"), residual=0, rotate=True), None),
                             (Policy.kivi(4, group=32, residual=128, sink=4), None),
                             (Policy(Quant("int8", "token"), Quant("int8", "token"), residual=16, sink=4),
                              torch.zeros(2, 1, 1, 4096))):
            spec = LayerSpec(policy, 2, 128, "bfloat16", 64)
            state = spec.allocate(2, 4096)
            launch.store(state, spec, *torch.randn(2, 2, 2, 1, 128))
            launch.attention(torch.randn(2, 8, 1, 128), state, spec, mask, invariant=True)
            state.table[1] = state.table[0]  # the two rows one sequence's: a run
            state.lengths.copy_(torch.tensor([1, 2]))
            launch.attention(torch.randn(2, 8, 1, 128), state, spec, mask, invariant=True,
                             groups=torch.tensor([0, 2], dtype=torch.int32))
        # row-invariant rows of layouts the decode kernel does not serve (a key group inside a byte, int3): the
        # general kernel, a program a row, no splits; and of a padded head (80), the decode kernel's
        for policy, D in ((Policy(Quant("int4", "token", 1), Quant("int8", "token"), residual=0), 80),
                          (Policy.kivi(3, group=32, residual=16, sink=4), 96),
                          (Policy(Quant("int8", "token"), Quant("int8", "token"), residual=0), 80)):
            spec = LayerSpec(policy, 2, D, "bfloat16", 64)
            state = spec.allocate(2, 4096)
            launch.store(state, spec, *torch.randn(2, 2, 2, 1, D))
            launch.attention(torch.randn(2, 8, 1, D), state, spec, None, invariant=True)
        # the prefill path's past read back whole (templates.past): bf16 as bits, fp16, fp32 (pre-RoPE keys), with
        # the queries' own chunk, sinks and a ring, per-channel keys, fp8, int3
        from kvcompile.templates import past
        for policy, D, out, chunk in (
                (Policy.kivi(4, group=32, residual=16, sink=4), 128, torch.bfloat16, True),
                (Policy(Quant("int2", "token"), Quant("int2", "token"), residual=0), 128, torch.bfloat16, False),
                (Policy(Quant("int3", "token", 16, True), Quant("fp8_e5m2", "channel", 16), residual=5, rotate=True),
                 64, torch.float16, True),
                (Policy.fp8(residual=0, pre_rope=True), 128, torch.float32, False)):
            spec = LayerSpec(policy, 2, D, "bfloat16" if out == torch.float32 else str(out)[6:], 64)
            state = spec.allocate(2, 4096)
            launch.store(state, spec, *torch.randn(2, 2, 2, 100, D))
            past.launch_past(state, spec, 100, out, (torch.randn(2, 2, 100, D), torch.randn(2, 2, 100, D)) if chunk
                             else None)
        # the rotation (templates.rotate: what a rotating policy's store runs on CUDA), padded head sizes too
        from kvcompile.templates import rotate
        for D, dt in ((128, torch.bfloat16), (64, torch.float32), (80, torch.float16), (96, torch.float64)):
            rotate.rotate(torch.randn(3, 5, D, dtype=dt))
    names = sorted({name for name, _ in log})
    print("compiled", len(log), names, "chunk:", sum(bool(c.get("CHUNK")) for _, c in log),
          "rope:", sorted({(bool(c.get("CHUNK")), c["D"]) for n, c in log if n == "_attn_kernel" and c.get("ROPE")}),
          "blocks:", sorted({c["BS"] for _, c in log if "BS" in c}),
          "tiles:", sorted({(c["BS"], c["BLOCK_N"]) for n, c in log if n == "_attn_kernel"}),
          "decode:", sorted({(c["K_MODE"], c["V_MODE"], c["FULL"], c["CHUNK"], c["MASK_KIND"], c["BLOCK_N"] > c["BS"])
                             for n, c in log if n == "_decode_kernel"}),
          "words:", sorted({(c["K_W"], c["V_W"]) for n, c in log if n == "_decode_kernel"}),
          "padded:", sorted({(c["DR"], c["D"], c["K_MODE"], c["V_MODE"], c["K_W"], c["V_W"]) for n, c in log
                             if n == "_decode_kernel" and c["DR"] != c["D"]}),
          "invariant:", sum(bool(c.get("INVARIANT")) for n, c in log if n == "_decode_kernel"),
          sum(bool(c.get("IN_ORDER")) for n, c in log if n == "_merge_kernel"),
          "runs:", sorted({(c["RUN"], c["FULL"], c["MASK_KIND"]) for n, c in log if n == "_decode_kernel"
                           and c.get("INVARIANT")}),
          "rotate:", sorted((c["D"], c["OUT_F64"]) for n, c in log if n == "_rotate_kernel"),
          "general:", sorted({(c["D"], c["SPLIT"]) for n, c in log if n == "_attn_kernel"}),
          "past:", sorted({(c["OUT"], c["CHUNK"], c["S"] > 0, c["W"] > 0) for n, c in log if n == "_past_kernel"}),
          "fixed:", sorted({(n, c.get("E4M3", c.get("K_E4M3"))) for n, c in log
                            if 3 in (c.get("SFMT"), c.get("K_SFMT"), c.get("V_SFMT"))}))
""")


@pytest.mark.slow
def test_kernels_compile_for_sm90():
    try:
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except Exception as e:  # pragma: no cover - a Triton build without the NVIDIA backend
        pytest.skip(f"Triton's NVIDIA backend is not available: {e}")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "0"  # silences Triton 3.9's notice; launches pass enable_fp_fusion anyway
    r = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "compiled" in r.stdout and "_attn_kernel" in r.stdout and "_merge_kernel" in r.stdout, r.stdout
    assert "_flush_kernel" in r.stdout and "_copy_kernel" in r.stdout, r.stdout
    assert "chunk: 0" not in r.stdout, r.stdout  # the loop over the queries' own chunk compiles too
    assert "blocks: [16, 32, 64, 256]" in r.stdout, r.stdout  # paged layouts of 16 to 256 tokens per block
    assert "(32, 32)" in r.stdout and "(16, 16)" in r.stdout, r.stdout  # tiles cut to the block
    # pre-RoPE keys rotated in the kernel (tl.gather of the partner channels) lower, with and without the chunk's
    # loop (a decode with no residual reads its own token from the chunk)
    assert "rope: [(False, 128), (True, 64), (True, 128)]" in r.stdout, r.stdout
    # the decode kernel: (key mode, value mode, full-precision program, own token, mask kind, tile over blocks);
    # mode 0: scales on tiles, 1: per element, 2: per group, 3: the query scaled per group of tokens, 4: a row per
    # query head and value group
    decode = r.stdout.split("decode:")[1]
    # (whether the tile-scaled case's tile spans blocks is the tile table's choice, templates/decode_configs.json:
    # since the table, it does; a tile inside one block and one over several both compile in the other cases)
    assert "(0, 0, True, True, 0, " in decode, r.stdout
    for want in ("(3, 2, True, True, 0, False)", "(3, 2, True, False, 0, True)", "(1, 2, True, False, 2, False)",
                 "(0, 1, True, True, 1, True)", "(3, 2, True, False, 2, ", "(0, 4, True, False, 2, "):
        assert want in decode, r.stdout
    # codes read as words / halfwords: int4 at 128 (keys words, values halfwords; KIVI int4's values in GROUPS
    # halfwords), int2 at 128 and int4 at 64 (keys halfwords), the rest byte by byte
    assert "words: [(1, 1), (1, 2), (2, 1), (4, 2)]" in r.stdout, r.stdout
    assert "invariant: 7 7" in r.stdout, r.stdout  # row-invariant splits and the in-order merge lower too
    # padded heads: (head_dim, padded, key mode, value mode, key words, value words)
    assert ("padded: [(32, 64, 0, 0, 1, 1), (80, 128, 0, 0, 1, 1), (80, 128, 0, 0, 4, 2), (80, 128, 0, 4, 4, 2), "
            "(80, 128, 3, 4, 1, 2), (96, 128, 0, 0, 1, 1), (96, 128, 3, 2, 1, 2)]") in r.stdout, r.stdout
    # (RUN, full-precision program, mask kind): a row a program (decode steps), runs of 4 rows (a prompt's), each
    # row's sinks and ring, a mask
    assert "runs: [(1, False, 0), (1, True, 0), (1, True, 2), (4, False, 0), (4, True, 2)]" in r.stdout, r.stdout
    # the general kernel at head_dim 80 and 96 (padded to 128), without splits (the row-invariant rows above)
    general = r.stdout.split("general:")[1].split("]")[0]
    assert "(80, False)" in general and "(96, False)" in general, r.stdout
    # the rotation: fp32 out (the float32 rows), float64 out (bf16 / fp16 rows, for torch to round; float64 rows)
    assert "rotate: [(64, False), (80, True), (96, True), (128, True)]" in r.stdout, r.stdout
    # the past read back for the prefill path: (output dtype: fp32 0, bf16 bits 1, fp16 2; chunk; sinks; ring)
    assert ("past: [(0, False, False, False), (1, False, False, False), (1, True, True, True), "
            "(2, True, False, True)]") in r.stdout, r.stdout
    # one fixed scale, none stored (fp8 axis="tensor"): the store (both formats), the decode and the general kernel
    assert ("fixed: [('_attn_kernel', False), ('_decode_kernel', True), ('_flush_kernel', False), "
            "('_flush_kernel', True)]") in r.stdout, r.stdout
