"""The kvcompile command: plan (published capacity figures), eval and demo on a tiny random model."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvcompile import Policy, cli


def test_plan_reproduces_the_textbook_counts(capsys):
    assert cli.main(["plan"]) == 0
    out = capsys.readouterr().out
    seqs = {line.split()[1]: int(line.split()[-2]) for line in out.splitlines() if line.startswith("ideal")}
    assert seqs == {"16-bit": 52, "8-bit": 104, "4-bit": 208, "2-bit": 416}


@pytest.mark.slow
def test_plan_70b_in_45_gib(capsys, tmp_path):
    cli.main(["plan", "--preset", "llama3-70b", "--available-gb", "45", "--gib", "--context", "4096",
              "--json", str(tmp_path / "p.json"), "--plot", str(tmp_path / "p.png")])
    rows = json.loads((tmp_path / "p.json").read_text())["rows"]
    assert rows[0]["bytes_per_token"] == 327680 and rows[0]["sequences"] == 36
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_plan_serving_prints_both_caches_and_writes_json(capsys, tmp_path):
    """plan --serving: transformers' pages and requests, then one row per policy (the defaults and --policy), the
    same numbers as JSON, and a plot of requests against their length; the model is kvcompile serve's default
    (SmolLM2-135M's shape)."""
    js, png = tmp_path / "s.json", tmp_path / "plots" / "s.png"
    assert cli.main(["plan", "--serving", "--budget-mib", "16", "--request-tokens", "512", "--policy",
                     "kivi+rot+sink:4", "--json", str(js), "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert png.read_bytes()[:4] == b"\x89PNG" and f"wrote {png}" in out
    assert "SmolLM2-135M: 30 layers x 3 KV heads x 64, bfloat16" in out
    # 16 MiB of bf16 pages of 256 tokens, 23,040 bytes a token: 2 pages, one 512-token request
    assert "transformers' PagedAttentionCache: 2 pages of 256 tokens (512 tokens), 2 pages a request: 1 request" in out
    data = json.loads(js.read_text())
    rows = {r["label"]: r for r in data["rows"]}
    assert {"tok+rot:4", "kivi+rot+sink:4", "KIVI 4-bit G32 R128"} <= set(rows)
    r = rows["tok+rot:4"]
    assert f"{r['slots']:>7,}{r['blocks']:>8,}{r['tokens']:>10,}{r['requests']:>10,}" in out
    assert r["tokens"] == r["blocks"] * r["block_tokens"] and r["nbytes"] <= 16 * 2**20
    assert data["transformers"]["requests"] == 1 and r["request_ratio"] == r["requests"]


def test_plan_serving_with_a_shared_system_prompt(capsys, tmp_path):
    """--shared-tokens: the prompt prefix every request shares is held once where the policy shares pages (the
    measured case of docs/results.md: 16 MiB, fp32 SmolLM2, ~580-token chats opening with the same 515 tokens:
    tok+rot:4 held all 16 clients at once), and not at all under KIVI (its window is outside the pages)."""
    js = tmp_path / "s.json"
    args = ["plan", "--serving", "--budget-mib", "16", "--dtype", "float32", "--request-tokens", "580",
            "--policy", "tok+rot:4", "--json", str(js)]
    assert cli.main(args) == 0
    alone = {r["label"]: r for r in json.loads(js.read_text())["rows"]}
    assert cli.main(args + ["--shared-tokens", "515"]) == 0
    out = capsys.readouterr().out
    assert "every request begins with the same 515-token prompt" in out
    data = json.loads(js.read_text())
    shared = {r["label"]: r for r in data["rows"]}
    assert data["shared_tokens"] == 515
    assert shared["tok+rot:4"]["requests"] == 16 and alone["tok+rot:4"]["requests"] == 4
    # read from shared pages: its whole 256-token pieces (a quantized prompt's pieces at the default 256 tokens
    # a forward: pool.shareable_tokens)
    assert shared["tok+rot:4"]["shared_tokens"] == 512 and shared["KIVI 4-bit G32 R128"]["shared_tokens"] == 0
    assert shared["KIVI 4-bit G32 R128"]["requests"] == alone["KIVI 4-bit G32 R128"]["requests"]


def test_plan_serving_per_gpu_under_tensor_parallelism(capsys, tmp_path):
    """--serving --tp N: one GPU's pool, its share of the KV heads, the budget per GPU; a GPU of 3 holds the
    requests one unsharded model's pool of a third of the heads holds (the same budget, a third of the bytes a
    token)."""
    js, one = tmp_path / "tp.json", tmp_path / "one.json"
    assert cli.main(["plan", "--serving", "--tp", "3", "--budget-mib", "32", "--request-tokens", "1024",
                     "--json", str(js)]) == 0
    out = capsys.readouterr().out
    assert "1 KV heads per GPU of 3" in out and "for the whole serving cache of each GPU" in out
    assert cli.main(["plan", "--serving", "--budget-mib", "96", "--request-tokens", "1024", "--json", str(one)]) == 0
    tp, whole = json.loads(js.read_text()), json.loads(one.read_text())
    assert tp["model"]["kv_heads"] == 1 and tp["model"]["tp"] == 3
    for a, b in zip(tp["rows"], whole["rows"]):
        assert a["label"] == b["label"] and a["block_tokens"] == b["block_tokens"]
        assert abs(a["requests"] - b["requests"]) <= max(1, b["requests"] // 20), (a, b)  # the tables' bytes


def test_plan_serving_from_a_config_without_weights(capsys, tmp_path):
    """A given serving budget needs no weights' size: a bare config.json plans (in the dtype asked for)."""
    from transformers import LlamaConfig
    LlamaConfig(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, hidden_size=256).save_pretrained(
        tmp_path)
    assert cli.main(["plan", "--serving", "--config", str(tmp_path), "--budget-mib", "8", "--request-tokens", "256",
                     "--dtype", "float32", "--max-requests", "4"]) == 0
    out = capsys.readouterr().out
    # fp32 pages of 256 tokens: 4 layers x 2 x 2 heads x 64 x 4 bytes x 256 = 1 MiB each, 8 in 8 MiB
    assert "4 layers x 2 KV heads x 64, float32 model" in out and "8 pages of 256 tokens" in out
    assert "slots: 4 (max_requests)" in out


def test_plan_from_a_config(capsys, tiny_dir):
    cli.main(["plan", "--config", str(tiny_dir), "--gpu-gb", "1", "--context", "1024"])
    assert "2 layers x 2 KV heads x 32" in capsys.readouterr().out


@pytest.mark.slow
def test_eval_writes_table_json_and_plot(capsys, tmp_path, tiny_dir):
    out = tmp_path / "res"
    cli.main(["eval", "--model", str(tiny_dir), "--entries", "kivi:2", "naive:4", "--window", "128", "--windows",
              "2", "--passkey", "full", "best:2", "--passkey-lengths", "256", "--trials", "2", "--out", str(out),
              "--no-progress"])
    res = json.loads((out / "eval.json").read_text())
    assert [(r["scheme"], r["bits"]) for r in res["rows"]] == [("full", 16), ("kivi", 2), ("naive", 4)]
    assert res["rows"][0]["loss_delta"] == 0 and len(res["rows"][1]["loss_delta_per_window"]) == 2
    assert set(res["passkey"]) == {"full:16", "kivi:2"} and res["passkey"]["kivi:2"]["trials"] == 2
    assert (out / "eval.png").read_bytes()[:4] == b"\x89PNG"
    assert "naive" in capsys.readouterr().out
    # merging runs re-renders without a model
    cli.main(["eval", "--merge", str(out / "eval.json"), str(out / "eval.json"), "--out", str(tmp_path / "m")])
    assert len(json.loads((tmp_path / "m" / "eval.json").read_text())["rows"]) == 3


@pytest.mark.slow
def test_eval_own_stored_is_recorded_and_measured(tmp_path, tiny_dir):
    common = ["eval", "--model", str(tiny_dir), "--entries", "naive:2", "--window", "64", "--windows", "1",
              "--passkey", "--no-progress"]
    rows = {}
    for own in ("full", "stored"):
        assert cli.main(common + ["--own", own, "--out", str(tmp_path / own)]) == 0
        res = json.loads((tmp_path / own / "eval.json").read_text())
        assert res["own"] == own
        rows[own] = {r["scheme"]: r["loss"] for r in res["rows"]}
    assert rows["full"]["full"] == rows["stored"]["full"]  # nothing stored quantized: one protocol
    assert rows["full"]["naive"] != rows["stored"]["naive"]


@pytest.mark.slow
def test_eval_of_a_policy_file_with_the_default_passkey(tmp_path, tiny_dir):
    """The obvious call, a policy file and nothing else: the default passkey entries are full precision and
    best:BITS only of the widths the run evaluates (a policy file is none of them), so it runs; best:2 picks
    among SCHEME:BITS entries, never a policy file (which it could not name as a scheme)."""
    pol = tmp_path / "mine.json"
    Policy.kivi(2, group=8, residual=16).save(pol)
    out = tmp_path / "res"
    assert cli.main(["eval", "--model", str(tiny_dir), "--entries", str(pol), "--window", "64", "--windows", "1",
                     "--passkey-lengths", "256", "--trials", "1", "--out", str(out), "--no-progress"]) == 0
    assert list(json.loads((out / "eval.json").read_text())["passkey"]) == ["full:16"]
    assert cli.main(["eval", "--model", str(tiny_dir), "--entries", str(pol), "naive:2", "--window", "64",
                     "--windows", "1", "--passkey", "best:2", "--passkey-lengths", "256", "--trials", "1", "--out",
                     str(out), "--no-progress"]) == 0
    assert list(json.loads((out / "eval.json").read_text())["passkey"]) == ["naive:2"]


@pytest.mark.slow
def test_eval_passkey_only_with_a_prefill_chunk(capsys, tmp_path, tiny_dir):
    out = tmp_path / "pk"
    cli.main(["eval", "--model", str(tiny_dir), "--entries", "none", "--passkey", "kivi+rot+sink:2",
              "--passkey-lengths", "256", "--passkey-chunk", "64", "--trials", "2", "--out", str(out),
              "--no-progress"])
    res = json.loads((out / "eval.json").read_text())
    assert res["rows"] == [] and list(res["passkey"]) == ["kivi+rot+sink:2@chunk64"]
    pk = res["passkey"]["kivi+rot+sink:2@chunk64"]
    assert pk["prefill_chunk"] == 64 and len(pk["trials_detail"]["256"]) == 2
    assert pk["bytes_per_token_bf16"]["256"] > 0 and "256" in pk["needle_packed_trials"]
    assert "kivi+rot+sink:2@chunk64" in capsys.readouterr().out


@pytest.mark.slow
def test_demo_prints_bytes_loss_speed_and_reply(capsys, tiny_dir):
    cli.main(["demo", "--model", str(tiny_dir), "--max-new-tokens", "4", "--capacity", "512", "--loss-window",
              "256", "--compiler", "eager"])
    out = capsys.readouterr().out
    full = int(out.split("full precision")[1].split("B")[0].replace(",", ""))
    quant = int(out.split("quantized")[1].split("B")[0].replace(",", ""))
    # the bytes of a 512-token conversation, as the stores count them (2 layers x 2 KV heads x 32, fp32)
    from kvcompile import cache_bytes
    names = [f"model.layers.{i}.self_attn" for i in range(2)]
    assert full == cache_bytes(Policy.full(), 2, 2, 32, 512, dtype=torch.float32, layer_names=names)
    assert quant == cache_bytes(cli.default_policy(), 2, 2, 32, 512, dtype=torch.float32, layer_names=names)
    assert quant < full / 2
    # the held-out loss it prints is the eager reference's, full precision and quantized
    from kvcompile.evaluate import heldout_loss, heldout_windows
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    W = heldout_windows(AutoTokenizer.from_pretrained(tiny_dir), 256, 1)
    base, q = heldout_loss(model, W, Policy.full())[0], heldout_loss(model, W, cli.default_policy())[0]
    assert f"{base:.4f} -> {q:.4f} nats/token, delta {q - base:+.4f}" in out
    assert re.search(r"decode speed, greedy, \d+ new tokens: .* [\d.]+ tok/s; .* [\d.]+ tok/s", out)
    assert "reply (quantized cache):" in out


def test_bad_policy_argument_is_refused(capsys):
    with pytest.raises(SystemExit):
        cli.main(["demo", "--policy", "fp8:4"])
    assert "no 4-bit policy" in capsys.readouterr().err


@pytest.mark.parametrize("typed, means", [
    ("full", "Policy.full()"), ("int8", "Policy.int8()"), ("fp8", "Policy.fp8()"), ("kivi4", "Policy.kivi(4)"),
    ("kivi2", "Policy.kivi(2)"), ("kivi:4", "Policy.kivi(4)"), ("default", "Policy.kivi(4, sink=4, rotate=True)"),
])
def test_a_policy_typed_the_short_way_is_the_preset(typed, means):
    """``--policy`` as the presets are written in prose (``kvcompile serve --policy kivi4|int8|fp8``)."""
    from kvcompile import Policy
    assert cli._policy_arg(typed) == eval(means)


def test_a_scheme_with_several_widths_needs_one(capsys):
    with pytest.raises(SystemExit):
        cli.main(["serve", "--policy", "kivi"])
    assert "'kivi' needs a width, as SCHEME:BITS: kivi:2, kivi:3, kivi:4, kivi:8" in capsys.readouterr().err


def test_python_dash_m_runs():
    """``python -m kvcompile`` is the command: its plan gives the textbook counts, as the function does."""
    r = subprocess.run([sys.executable, "-m", "kvcompile", "plan"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    seqs = {line.split()[1]: int(line.split()[-2]) for line in r.stdout.splitlines() if line.startswith("ideal")}
    assert seqs == {"16-bit": 52, "8-bit": 104, "4-bit": 208, "2-bit": 416}


# --------------------------------------------------------------------------- user errors: one line, exit status 2
# Each case is what a user might type; each must end in exit status 2 with one line on stderr that says what was
# wrong (the gist checked here) -- no traceback, nothing on stdout, nothing downloaded. Each runs the command's
# main() in this process (a process each would pay the ~5 s import 55 times); three also run as the command.
BAD_INPUTS = {
    # plan
    "plan_config_missing_file": ("plan --config /nonexistent/config.json", r"does not exist.*nothing is downloaded"),
    "plan_config_hub_id": ("plan --config some-org/some-model", r"'some-org/some-model' does not exist.*nothing is down"),
    "plan_config_folder_without_config": ("plan --config {tmp}/notmodel", "is a folder without a config.json"),
    "plan_config_not_json": ("plan --config {tmp}/bad.json", "is not a readable Hugging Face config .*not a valid JSON"),
    "plan_config_without_model_type": ("plan --config {tmp}/notype.json", "not a readable Hugging Face config.*model_type"),
    "plan_config_without_weights": ("plan --config {tmp}/noweights", r"weights' size is unknown; pass --weights-gb"),
    "plan_weights_exceed_gpu": ("plan --preset llama3-70b --gpu-gb 80", r"nothing is left for the cache: 72\.0 GB usable, "
                                r"141\.0 GB of weights.*--gpu-gb"),
    "plan_unknown_preset": ("plan --preset llama3-7b", r"argument --preset: invalid choice: 'llama3-7b'"),
    "plan_gpu_negative": ("plan --gpu-gb -1", r"argument --gpu-gb: '-1' is not a positive number of gigabytes"),
    "plan_gpu_nan": ("plan --gpu-gb nan", r"argument --gpu-gb: 'nan' is not a positive number"),
    "plan_gpu_overflow": ("plan --gpu-gb 1e300", r"--gpu-gb 1e\+300 is too large"),
    "plan_utilization_zero": ("plan --utilization 0", r"argument --utilization: '0' is not a fraction in \(0, 1\]"),
    "plan_utilization_above_one": ("plan --utilization 1.5", r"'1\.5' is not a fraction in \(0, 1\]"),
    "plan_available_zero": ("plan --available-gb 0", r"argument --available-gb: '0' is not a positive number"),
    "plan_weights_negative": ("plan --weights-gb -1", r"argument --weights-gb: '-1' is not a number of gigabytes >= 0"),
    "plan_context_zero": ("plan --context 0", r"argument --context/--request-tokens: '0' is not a positive whole number"),
    "plan_context_negative": ("plan --context -5", r"argument --context/--request-tokens: '-5' is not a positive whole number"),
    "plan_context_not_a_number": ("plan --context 8k", r"argument --context/--request-tokens: '8k' is not a positive whole number"),
    "plan_json_is_a_directory": ("plan --json {tmp}", r"--json '.*' is a directory: give a file name"),
    "plan_plot_under_a_file": ("plan --plot {tmp}/afile/p.png", r"--plot '.*afile/p\.png': '.*afile' is a file"),
    "plan_plot_unknown_format": ("plan --plot {tmp}/p.xyz", r"matplotlib cannot write '\.xyz' files; use \.png"),
    # plan --serving
    "plan_budget_without_serving": ("plan --budget-mib 64", r"--budget-mib sizes the serving pool .*add --serving"),
    "plan_serving_budget_too_small": ("plan --serving --budget-mib 1 --request-tokens 8192",
                                      r"no policy's serving pool holds a request: .*holds no request of 8,192 tokens "
                                      r"\(one takes [\d,]+ bytes.*raise the budget or shorten the requests"),
    "plan_serving_slots_too_many": ("plan --serving --budget-mib 8 --request-tokens 64 --max-requests 100000",
                                    r"does not hold one block after 100000 request slots .*lower max_requests"),
    "plan_serving_two_budgets": ("plan --serving --budget-mib 64 --available-gb 1", r"pass one of them"),
    "plan_serving_tp_split": ("plan --serving --tp 2", r"--tp 2: tensor parallelism over 2 GPUs: SmolLM2-135M has 3 KV "
                                                        r"heads, which 2 GPUs cannot split"),
    "plan_serving_budget_zero": ("plan --serving --budget-mib 0", r"argument --budget-mib: '0' is not a positive"),
    "plan_shared_without_serving": ("plan --shared-tokens 100", r"--shared-tokens sizes the serving pool .*add --serving"),
    "plan_shared_not_below_request": ("plan --serving --request-tokens 512 --shared-tokens 512",
                                      r"shared_tokens=512: expected a number of tokens from 0 to request_tokens - 1 = "
                                      r"511 .*--shared-tokens 512\)"),
    "plan_available_and_gpu": ("plan --available-gb 45 --gpu-gb 40", r"so --gpu-gb would have no effect"),
    "plan_config_and_preset": ("plan --preset llama3-70b --config {tiny}", "--config and --preset both name the model"),
    # eval
    "eval_model_missing": ("eval --model /nonexistent/model", r"'/nonexistent/model' is not a local Hugging Face model"),
    "eval_model_without_weights": ("eval --model {tmp}/noweights --entries kivi:4 --window 256 --passkey",
                                   r"--model '.*noweights': the model in .* could not be loaded"),
    "eval_entry_without_bits": ("eval --entries kivi", r"'kivi' needs a width, as SCHEME:BITS: kivi:2, kivi:3"),
    "eval_entry_unknown_scheme": ("eval --entries foo:4", r"unknown scheme 'foo': expected one of"),
    "eval_entry_width_missing": ("eval --entries fp8:4", r"scheme 'fp8' has no 4-bit policy: use fp8:8"),
    "eval_schemes_bits_give_nothing": ("eval --schemes fp8 --bits 4", r"--schemes fp8 at --bits 4 gives no policy"),
    "eval_unknown_scheme": ("eval --schemes foo", r"argument --schemes: invalid choice: 'foo'"),
    "eval_unknown_width": ("eval --bits 5", r"argument --bits: invalid choice: 5 \(choose from 2, 3, 4, 8\)"),
    "eval_entries_and_bits": ("eval --entries kivi:4 --bits 4", r"--entries replaces --schemes and --bits"),
    "eval_window_one": ("eval --window 1", r"argument --window: '1' is not a whole number of tokens >= 2"),
    "eval_window_longer_than_text": ("eval --model {tiny} --entries kivi:4 --window 1000000 --passkey",
                                     r"--window 1000000 is longer than the held-out text \([\d,]+ tokens"),
    "eval_windows_zero": ("eval --windows 0", r"argument --windows: '0' is not a positive whole number"),
    "eval_trials_zero": ("eval --trials 0", r"argument --trials: '0' is not a positive whole number"),
    "eval_passkey_best_not_evaluated": ("eval --entries kivi:4 --passkey best:2",
                                        r"--passkey best:2: .* none is evaluated \(widths evaluated: 4\)"),
    "eval_passkey_unknown_scheme": ("eval --passkey foo:2", r"--passkey foo:2: unknown scheme 'foo'"),
    "eval_passkey_length_too_short": ("eval --model {tiny} --entries none --passkey full --passkey-lengths 10",
                                      r"--passkey-lengths 10 is too short for the passkey prompt"),
    "eval_passkey_chunk_zero": ("eval --passkey-chunk 0", r"argument --passkey-chunk: '0' is not a positive whole"),
    "eval_nothing_to_evaluate": ("eval --entries none --passkey", r"evaluates nothing"),
    "eval_out_is_a_file": ("eval --out {tmp}/afile", r"--out '.*afile' is a file: give a directory"),
    "eval_merge_missing": ("eval --merge /nonexistent/eval.json", r"--merge '/nonexistent/eval\.json': no such file"),
    "eval_merge_not_json": ("eval --merge {tmp}/bad.json", r"--merge '.*bad\.json' is not readable JSON"),
    "eval_merge_not_an_eval": ("eval --merge {tmp}/norows.json", r"is not an eval\.json written by kvcompile eval"),
    "eval_merge_with_run_options": ("eval --merge {tmp}/norows.json --window 128",
                                    r"--merge re-renders earlier runs .*: --window would have no effect"),
    "eval_own_unknown": ("eval --own pages", r"argument --own: invalid choice: 'pages' \(choose from 'full', 'stored'\)"),
    "eval_own_stored_pre_rope": ("eval --entries int8:8 kivi+pre+sink:4 --own stored",
                                 r"--own stored: kivi\+pre\+sink:4 stores keys before the rotary embedding"),
    "eval_merge_two_protocols": ("eval --merge {tmp}/own_full.json {tmp}/own_stored.json",
                                 r"--merge: these runs measured the held-out loss under different protocols "
                                 r"\(own: full, stored\)"),
    "eval_merge_with_own": ("eval --merge {tmp}/own_full.json --own stored",
                            r"--merge re-renders earlier runs .*: --own would have no effect"),
    # demo
    "demo_model_not_a_model": ("demo --model {tmp}/notmodel", r"is not a local Hugging Face model directory"),
    "demo_policy_without_bits": ("demo --policy kivi", r"argument --policy: 'kivi' needs a width, as SCHEME:BITS"),
    "demo_policy_width_missing": ("demo --policy fp8:4", r"argument --policy: scheme 'fp8' has no 4-bit policy"),
    "demo_max_new_tokens_zero": ("demo --max-new-tokens 0", r"argument --max-new-tokens: '0' is not a positive"),
    "demo_capacity_below_prompt": ("demo --model {tiny} --capacity 16",
                                   r"--capacity 16 is too small: the prompt is \d+ tokens and --max-new-tokens 40 more"),
    "demo_loss_window_longer_than_text": ("demo --model {tiny} --capacity 512 --loss-window 1000000",
                                          r"--loss-window 1000000 is longer than the held-out text"),
    "demo_unknown_compiler": ("demo --compiler foo", r"argument --compiler: invalid choice: 'foo'"),
    # serve (said before anything is loaded or listened on)
    "serve_model_missing": ("serve --model /nonexistent/model --port 1",
                            r"'/nonexistent/model' is not a local Hugging Face model directory"),
    "serve_model_without_tokenizer": ("serve --model {tmp}/notokenizer --port 1",
                                      r"no tokenizer could be loaded from .*save the tokenizer next to the model"),
    "serve_two_slot_counts": ("serve --max-requests 4 --request-tokens 1024 --port 1",
                              r"argument --request-tokens: not allowed with argument --max-requests"),
    # the command itself
    "unknown_subcommand": ("frobnicate", r"invalid choice: 'frobnicate' \(choose from 'demo', 'eval', 'plan', 'calibrate', 'serve'\)"),
    "no_subcommand": ("", r"the following arguments are required"),
}


@pytest.fixture(scope="session")
def bad_files(tmp_path_factory, tiny_dir):
    """Things that are not what an option wants: a folder with no model, broken JSON, a config without a
    model_type, a model folder without weights (config and tokenizer only), one without a tokenizer (config and
    weights only), a plain file."""
    import shutil
    d = tmp_path_factory.mktemp("bad")
    (d / "notmodel").mkdir()
    (d / "notmodel" / "notes.txt").write_text("not a model")
    (d / "bad.json").write_text("{not json")
    (d / "norows.json").write_text(json.dumps({"a": 1}))
    row = {"scheme": "int8", "bits": 8, "bytes_per_token_bf16": 1, "ratio_to_bf16": 1, "loss": 1.0, "loss_delta": 0}
    (d / "own_full.json").write_text(json.dumps({"window": 64, "windows": 1, "rows": [row]}))  # before --own: full
    (d / "own_stored.json").write_text(json.dumps({"window": 64, "windows": 1, "rows": [row], "own": "stored"}))
    (d / "notype.json").write_text(json.dumps({"hidden_size": 8}))
    (d / "afile").write_text("a file")
    (d / "noweights").mkdir()
    (d / "notokenizer").mkdir()
    for f in tiny_dir.iterdir():
        if not f.name.endswith((".safetensors", ".bin")):
            shutil.copy(f, d / "noweights" / f.name)
        if f.name.endswith((".safetensors", ".bin")) or f.name in ("config.json", "generation_config.json"):
            shutil.copy(f, d / "notokenizer" / f.name)
    return d


def _run_case(case, bad_files, tiny_dir):
    """One BAD_INPUTS case through ``kvcompile.cli.main``, as the command runs it: (exit status, stdout,
    stderr). argparse's own refusals exit through SystemExit."""
    import contextlib
    import io
    import shlex

    cmd, _ = BAD_INPUTS[case]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(shlex.split(cmd.format(tmp=bad_files, tiny=tiny_dir)))
        except SystemExit as e:
            code = e.code
    return code, out.getvalue(), err.getvalue()


def _check_one_line(case, code, stdout, stderr):
    import re
    cmd, gist = BAD_INPUTS[case]
    assert "Traceback" not in stderr, stderr[-3000:]
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr[-3000:]
    assert code == 2, (code, lines)
    sub = cmd.split()[0] if cmd.split() and cmd.split()[0] in ("demo", "eval", "plan", "serve") else None
    assert lines[0].startswith(f"kvcompile {sub}: error: " if sub else "kvcompile: error: ")
    assert re.search(gist, lines[0]), lines[0]
    assert stdout == ""


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_user_error_is_one_line_and_exit_status_2(case, bad_files, tiny_dir, monkeypatch, tmp_path):
    """In this process (the cwd an empty folder: nothing a case might write lands in the checkout); the
    command's own process is checked below for a few cases."""
    monkeypatch.chdir(tmp_path)
    _check_one_line(case, *_run_case(case, bad_files, tiny_dir))


def test_serve_with_a_budget_that_holds_no_request_of_the_length_says_so(tiny_dir, capsys):
    """``kvcompile serve --request-tokens``: a budget that holds not one request of that length is said when the
    model is loaded, before the server listens (exit status 2, no traceback)."""
    assert cli.main(["serve", "--model", str(tiny_dir), "--budget-mib", "1", "--request-tokens", "100000",
                     "--port", "1"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith(
        "kvcompile serve: error: kvcompile serving: a budget of 1,048,576 bytes holds no request of 100,000 tokens")


def test_serve_on_another_transformers_release_says_which_to_install(tiny_dir, monkeypatch, capsys):
    """kvcompile serve extends one transformers release's server (5.25 rewrote it): on another, the command
    says which it found and what to install, before loading the model or listening."""
    import transformers
    monkeypatch.setattr(transformers, "__version__", "5.25.0")
    assert cli.main(["serve", "--model", str(tiny_dir), "--port", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kvcompile serve: error: "), err
    assert "found transformers 5.25.0" in err[0] and "pip install 'transformers==5.24.*'" in err[0], err


@pytest.mark.slow
def test_user_errors_through_the_command_itself(bad_files, tiny_dir, tmp_path):
    """``python -m kvcompile`` in its own process, offline variables unset (nothing may be downloaded): the same
    one line and exit status 2, for a parser error, a config that is a hub id, and a bad policy."""
    import os
    import shlex
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    root = str(Path(cli.__file__).resolve().parents[1])  # the checkout under test, not another install
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in [env.get("PYTHONPATH")] if p])
    for case in ("plan_context_not_a_number", "plan_config_hub_id", "demo_policy_width_missing"):
        argv = shlex.split(BAD_INPUTS[case][0].format(tmp=bad_files, tiny=tiny_dir))
        r = subprocess.run([sys.executable, "-m", "kvcompile", *argv], capture_output=True, text=True,
                           timeout=300, cwd=tmp_path, env=env)
        _check_one_line(case, r.returncode, r.stdout, r.stderr)


def test_every_option_has_help_that_shows_its_default():
    parser = cli.build_parser()
    subs = next(a for a in parser._actions if isinstance(a, __import__("argparse")._SubParsersAction)).choices
    assert set(subs) == {"demo", "eval", "plan", "calibrate", "serve"}
    missing = [f"{name} {a.option_strings[0]}" for name, sp in subs.items() for a in sp._actions
               if a.option_strings and a.dest != "help" and not a.required and "(default: " not in (a.help or "")]
    assert missing == []


def test_a_programming_error_keeps_its_traceback(monkeypatch):
    # only the user's mistakes become one line; anything else propagates (python -m prints its traceback)
    from kvcompile import plan as P
    monkeypatch.setattr(P, "plan", lambda *a, **k: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        cli.main(["plan"])
