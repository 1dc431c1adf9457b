"""The policy objects: validation at construction, presets, per-layer resolution."""
import re

import pytest

from kvcompile import Policy, PolicyError, Quant

NAMES = [f"model.layers.{i}.self_attn" for i in range(6)]


@pytest.mark.parametrize("kwargs, field", [
    (dict(format="int5"), "Quant.format"),
    (dict(axis="row"), "Quant.axis"),
    (dict(group=3), "Quant.group"),
    (dict(group=0), "Quant.group"),
    (dict(group=-4), "Quant.group"),
    (dict(axis="channel"), "Quant.group"),
    (dict(format="fp8_e4m3", symmetric=False), "Quant.symmetric"),
    (dict(scale_dtype="bfloat16"), "Quant.scale_dtype"),
    (dict(axis="channel", group=2**40), "Quant.group"),  # tokens per scale: a block of 2**40 tokens
    (dict(axis="token", group=2048), "Quant.group"),  # channels per scale: wider than any model's head
])
def test_quant_rejects_bad_fields(kwargs, field):
    with pytest.raises(PolicyError, match=field.replace(".", r"\.")) as e:
        Quant(**kwargs)
    assert repr(list(kwargs.values())[-1]) in str(e.value) or "None" in str(e.value)


@pytest.mark.parametrize("kwargs, field", [
    (dict(residual=-1), "Policy.residual"),
    (dict(sink=-2), "Policy.sink"),
    (dict(key="int4"), "Policy.key"),
    (dict(rotate=1), "Policy.rotate"),
    (dict(sink=10**9), "Policy.sink"),
    (dict(residual=10**12), "Policy.residual"),
])
def test_policy_rejects_bad_fields(kwargs, field):
    with pytest.raises(PolicyError, match=field.replace(".", r"\.")):
        Policy(**kwargs)


@pytest.mark.parametrize("where, value", [("sink", 10**9), ("residual", 10**12), ("key.group", 2**40),
                                          ("value.group", 4096)])
def test_sizes_past_any_model_are_refused_where_written_and_when_loaded(where, value, tmp_path):
    """A sink or window longer than any model's positions, a group wider than a head: refused by the constructor,
    and by ``Policy.load`` with the file and field named -- not later, as an allocator error."""
    from kvcompile.policy import MAX_HEAD_DIM, MAX_TOKENS

    d = Policy.kivi(4).to_dict()
    if "." in where:
        side, name = where.split(".")
        d[side][name] = value
    else:
        d[where] = value
    path = tmp_path / "p.json"
    path.write_text(__import__("json").dumps(d))
    limit = f"{MAX_HEAD_DIM}" if where == "value.group" else f"{MAX_TOKENS:,}"
    at, field = (f", at {where.split('.')[0]}", "Quant.group") if "." in where else ("", f"Policy.{where}")
    with pytest.raises(PolicyError, match=rf"^policy file '{re.escape(str(path))}'{at}: {field}={value} is not "
                                          rf"valid: expected .*{limit}"):
        Policy.load(path)
    # the largest values allowed are taken
    assert Policy.kivi(4, sink=MAX_TOKENS, residual=MAX_TOKENS).sink == MAX_TOKENS
    assert Quant("int4", "token", MAX_HEAD_DIM).group == MAX_HEAD_DIM


def test_defaults_and_symmetric_resolution():
    assert Quant("int4").symmetric is False
    assert Quant("fp8_e4m3").symmetric is True
    assert Quant("int4", symmetric=True).symmetric is True
    assert Quant("int3").bits == 3 and Quant("none").quantized is False


def test_presets():
    k = Policy.kivi(2)
    assert (k.key.format, k.key.axis, k.key.group) == ("int2", "channel", 32)
    assert (k.value.format, k.value.axis, k.value.group) == ("int2", "token", 32)
    assert k.residual == 128 and not k.key.symmetric
    f = Policy.fp8()
    assert f.key.format == "fp8_e4m3" and f.key.axis == "token" and f.key.group is None
    assert Policy.int8().key.format == "int8"
    assert not Policy.full().key.quantized and not Policy.full().value.quantized
    with pytest.raises(PolicyError, match="bits"):
        Policy.kivi(5)


def test_hashable_and_equal():
    a, b = Policy.kivi(4), Policy.kivi(4)
    assert a == b and hash(a) == hash(b)
    assert len({a, b, Policy.kivi(2)}) == 2
    assert a.override({0: None}) != a


def test_group_must_divide_head_dim_when_applied():
    p = Policy(Quant("int4", "token", 64), Quant("int4", "token", 64))
    p.check(128)
    with pytest.raises(PolicyError, match=r"group=64 does not divide head_dim=32"):
        p.check(32)
    Policy.kivi(4, rotate=True).check(96)  # heads that are not a power of two rotate in blocks (test_head_sizes)


def test_kivis_default_value_group_fits_the_head_and_says_so():
    """Policy.kivi's default group (32) fits a head it does not divide (Quant.fit: the largest power of two that
    does); the key's per-channel group (tokens) is untouched, a group given explicitly is never changed, and the
    fit travels through policy files."""
    p = Policy.kivi(4)
    assert (p.key.group, p.value.group, p.key.fit, p.value.fit) == (32, 32, False, True)
    assert [p.value.group_for(d) for d in (64, 80, 96, 112, 120, 128, 256)] == [32, 16, 32, 16, 8, 32, 32]
    assert p.value.key() == "int4.token.32~.asym.f16" and "v=int4.token.32~" in str(p)
    assert p.for_head_dim(80).value == Quant("int4", "token", 16) and p.for_head_dim(128).value.group == 32
    assert Policy.kivi(4, group=32) != p and not Policy.kivi(4, group=32).value.fit
    with pytest.raises(PolicyError, match=r"group=32 does not divide head_dim=80"):
        Policy.kivi(4, group=32).check(80)
    p.check(80)
    assert Policy.from_dict(p.to_dict()) == p and "fit" not in Policy.kivi(4, group=32).to_dict()["value"]
    with pytest.raises(PolicyError, match=r"Quant.fit=True is not valid"):
        Quant("int4", "channel", 32, fit=True)
    with pytest.raises(PolicyError, match=r"Quant.fit='yes' is not valid"):
        Quant("int4", "token", 32, fit="yes")


def test_override_resolution_order_and_selectors():
    base = Policy.kivi(4)
    p8, p2, full = Policy.int8(), Policy.kivi(2), Policy.full()
    pol = base.override({
        range(0, 3): p8,                 # layers 0, 1, 2
        -1: p2,                          # layer 5
        "model.layers.1": full,          # layer 1, later wins over the range
        "re:layers\\.[34]\\.": p2,        # layers 3, 4
        0: None,                         # None keeps full precision
    })
    got = pol.resolve(NAMES)
    assert got == [full, full, p8, p2, p2, p2]
    assert all(not g.overrides for g in got)


def test_override_matching_no_layer_is_an_error():
    for sel in (6, -7, range(10, 12), "model.layers.9", "re:nothing"):
        with pytest.raises(PolicyError, match="matches none of the 6 attention layers"):
            Policy.kivi(4).override({sel: Policy.int8()}).resolve(NAMES)


def test_override_rejects_bad_keys_and_values():
    with pytest.raises(PolicyError, match="override key"):
        Policy().override({1.5: Policy.int8()})
    with pytest.raises(PolicyError, match="override key"):
        Policy().override({"re:(": Policy.int8()})
    with pytest.raises(PolicyError, match="expected a kvcompile.Policy"):
        Policy().override({0: "int8"})


def test_flush_granularity():
    assert Policy.kivi(4, group=64).flush == 64
    assert Policy.int8().flush == 1
    assert Policy(Quant("int4", "channel", 16), Quant("int2", "channel", 64)).flush == 64


def test_key_str_spells_out_the_specialization():
    s = Policy.kivi(3, group=16, residual=64, sink=4, rotate=True).key_str()
    assert s == "k=int3.channel.16.asym.f16;v=int3.token.16.asym.f16;r=64;s=4;rot=1"


# --------------------------------------------------------------------------- wrong types fail where written
@pytest.mark.parametrize("kwargs, field", [
    (dict(symmetric="no"), "Quant.symmetric"),      # bool("no") is True: it would silently mean symmetric
    (dict(symmetric="false"), "Quant.symmetric"),
    (dict(symmetric=0), "Quant.symmetric"),
    (dict(format="int4", axis="channel", group=32, symmetric="float16"), "Quant.symmetric"),  # a shifted positional
    (dict(format=["int4"]), "Quant.format"),        # unhashable: a raw TypeError before
])
def test_quant_rejects_wrong_types(kwargs, field):
    with pytest.raises(PolicyError, match=field.replace(".", r"\.") + "=.* is not valid: expected"):
        Quant(**kwargs)


@pytest.mark.parametrize("kwargs, field", [
    (dict(overrides=123), "Policy.overrides"),
    (dict(overrides=[]), "Policy.overrides"),       # a list would make the frozen policy unhashable
    (dict(overrides=((("index", 0), "x"),)), "Policy.overrides value"),
    (dict(overrides=((0, Policy.int8()),)), "Policy.overrides selector"),  # not normalized
    (dict(overrides=((("index", 0), Policy.int8(), 1),)), "Policy.overrides entry"),
    (dict(overrides=((("index", True), Policy.int8()),)), "Policy.overrides selector"),
    (dict(overrides=((("range", 0, 4, 0), Policy.int8()),)), "Policy.overrides selector"),
    (dict(overrides=((("re", "("), Policy.int8()),)), "Policy.overrides selector"),
    (dict(overrides=((("layer", 0), Policy.int8()),)), "Policy.overrides selector"),
    (dict(overrides=((("index", 0), Policy.int8().override({1: None})),)), "Policy.overrides value"),
])
def test_policy_rejects_wrong_types_and_malformed_overrides(kwargs, field):
    with pytest.raises(PolicyError, match=field.replace(".", r"\.") + ".* is not valid: expected"):
        Policy(**kwargs)


def test_overrides_built_by_override_round_trip_through_the_constructor():
    pol = Policy.kivi(4).override({0: None, range(1, 3): Policy.int8(), "model.layers.3": Policy.kivi(2),
                                   "re:layers\\.[45]\\.": Policy.fp8()})
    again = Policy(pol.key, pol.value, pol.residual, pol.sink, pol.rotate, pol.overrides)
    assert again == pol and again.resolve(NAMES) == pol.resolve(NAMES)


@pytest.mark.parametrize("choices", [None, 123, [1], "ab", [(0, Policy.int8(), 1)]])
def test_override_rejects_what_is_not_a_mapping(choices):
    with pytest.raises(PolicyError, match=r"Policy\.override\(choices\)=.* is not valid: expected a dict"):
        Policy.kivi(4).override(choices)


def test_override_still_takes_pairs():
    assert Policy.kivi(4).override([(0, Policy.int8())]) == Policy.kivi(4).override({0: Policy.int8()})


@pytest.mark.parametrize("bits", [4.0, 2.0])  # 4.0 == 4: it reached Quant as format "int4.0"
def test_kivi_bits_must_be_an_int(bits):
    with pytest.raises(PolicyError, match=r"Policy\.kivi\(bits\)=.* is not valid: expected 2, 3, 4 or 8"):
        Policy.kivi(bits)


@pytest.mark.parametrize("head_dim", ["128", 0, -64, 64.0])
def test_check_rejects_a_bad_head_dim(head_dim):
    with pytest.raises(PolicyError, match=r"Policy\.check\(head_dim\)=.* is not valid"):
        Policy.kivi(4).check(head_dim)


# --------------------------------------------------------------------------- policies that quantize nothing
def test_packed_tokens_follows_the_store_boundary():
    from kvcompile.store import LayerSpec
    for pol in (Policy.kivi(4), Policy.kivi(2, group=64, residual=16, sink=4), Policy.fp8(), Policy.int8(sink=3)):
        spec = LayerSpec(pol, heads=1, head_dim=64)
        for n in (1, 3, 4, 20, 31, 127, 128, 129, 159, 160, 161, 200, 1000):
            assert pol.packed_tokens(n) == spec.boundary(n) - spec.sink, (pol, n)
    assert Policy.full().packed_tokens(1000) == 0


@pytest.mark.parametrize("policy, max_tokens, gist", [
    (Policy.kivi(4), 128, r"sink=0 \+ residual=128 >= 128"),                       # residual covers it all
    (Policy.fp8(residual=100, sink=28), 128, r"sink=28 \+ residual=100 >= 128"),  # sinks and residual together
    (Policy.int8(sink=8), 8, "use sink < 8"),
    (Policy.kivi(4), 159, "only 31 tokens ever leave the residual .* group of 32 tokens"),  # flush never happens
    (Policy.kivi(4, group=64, residual=0, sink=4), 60, "use fewer sinks or a smaller per-channel group"),
    (Policy.full().override({0: Policy.fp8()}), 100, "the override for 0"),       # the only quantizing layer
    (Policy.fp8().override({range(0, 2): Policy.int8(residual=200)}), 100, "the base policy .* range"),
])
def test_noop_reason_names_why_nothing_is_quantized(policy, max_tokens, gist):
    reason = policy.noop_reason(max_tokens)
    assert reason is not None and reason.startswith(f"this policy quantizes nothing for sequences of up to {max_tokens}")
    assert re.search(gist, reason), reason


@pytest.mark.parametrize("policy, max_tokens", [
    (Policy.kivi(4), 160),                           # exactly one group leaves the residual
    (Policy.fp8(), 129),
    (Policy.int8(), 1),
    (Policy.full(), 8),                              # full precision by request is not a no-op
    (Policy.full().override({0: None}), 8),
    (Policy.fp8().override({0: Policy.int8()}), 100),  # one layer still quantizes
    (Policy.kivi(4, sink=4, rotate=True), 8192),
])
def test_noop_reason_is_none_when_something_is_quantized(policy, max_tokens):
    assert policy.noop_reason(max_tokens) is None


def test_noop_reason_over_named_layers_reads_only_the_resolved_policies():
    # the quantizing base is used by no layer: unknown without the names, so no reason then (no false alarm)
    bad = Policy.int8().override({range(0, 6): Policy.fp8()})
    assert bad.noop_reason(100) is None
    reason = bad.noop_reason(100, NAMES)
    assert "layer model.layers.0.self_attn, layer model.layers.1.self_attn and 4 more" in reason
    assert "base policy" not in reason
    assert Policy.int8().override({range(0, 5): Policy.fp8()}).noop_reason(100, NAMES) is None  # layer 5 int8


@pytest.mark.parametrize("max_tokens", [0, -1, 8.0, "8192", None, True])
def test_noop_reason_rejects_a_bad_length(max_tokens):
    with pytest.raises(PolicyError, match=r"Policy\.noop_reason\(max_tokens\)=.* is not valid"):
        Policy.kivi(4).noop_reason(max_tokens)
