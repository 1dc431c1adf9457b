"""Passkey diagnostics behind the README's 2-bit passkey section (policies that are not ``kvcompile eval`` schemes).

    OMP_NUM_THREADS=1 python docs/eval.passkey_diag.py OUT.json LENGTH CHUNK NAME [NAME ...]

Runs ``kvcompile.evaluate.passkey_accuracy`` (20 random keys and stratified depths, seed 0: the same trials as
``kvcompile eval``) for each named policy below at one prompt length, the prompt prefilled in aligned chunks of
CHUNK tokens, and adds to OUT.json: accuracy, accuracy over the trials whose needle is in packed storage, exact
bytes/token at that length (bf16), the mean log-probability of the answer, and every trial.

docs/eval.passkey_diag.json holds the runs made before attention read the queries' own chunk in full
precision, with the harness of that time (a 1,024-token prompt, the five digits teacher-forced, "logprob"
the answer's log-probability): the evidence that led to that change. Run today, the same command measures
the current semantics and scoring ("logprob" is then that of the greedily generated tokens).
"""
import json, sys, time, torch
torch.set_num_threads(1)
from kvcompile import models, Policy, Quant
from kvcompile import evaluate as E
from kvcompile.accounting import bytes_per_token
from kvcompile.hf import model_shape

def kv(kf, kg, vf, vg, **kw):
    kw.setdefault("residual", 128)
    return Policy(Quant(kf, "channel", kg) if kf != "none" else Quant("none"),
                  Quant(vf, "token", vg) if vf != "none" else Quant("none"), **kw)

POL = {
  "full": Policy.full(),
  "base": Policy.kivi(2, sink=4, rotate=True),
  "kivi2": Policy.kivi(2),
  "k2only": kv("int2", 32, "none", None, sink=4, rotate=True),
  "v2only": kv("none", None, "int2", 32, sink=4, rotate=True),
  "k3g64v2g64": kv("int3", 64, "int2", 64, sink=4, rotate=True),
  "k2g64v3g64": kv("int2", 64, "int3", 64, sink=4, rotate=True),
  "k4g128v2h": kv("int4", 128, "int2", None, sink=4, rotate=True),
  "base_s16": Policy.kivi(2, sink=16, rotate=True),
  "base_g16": Policy.kivi(2, group=16, sink=4, rotate=True),
}
out, L, chunk = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
names = sys.argv[4:]
model, tok = models.load(log=lambda *a: None)
layers, kvh, hd = model_shape(model.config)
try:
    res = json.load(open(out))
except Exception:
    res = {}
for n in names:
    pol = POL[n]
    t0 = time.perf_counter()
    det = {}
    acc = E.passkey_accuracy(model, tok, pol, [L], 20, 0, chunk=chunk, details=det)
    d = det[L]
    pa, pn = E.packed_accuracy(d)
    bpt = bytes_per_token(pol, layers, kvh, hd, L)
    res[f"{n}@{L}c{chunk}"] = {"policy": str(pol), "acc": acc[L], "packed_acc": pa, "packed_n": pn, "bpt": bpt,
        "mean_lp": sum(x["logprob"] for x in d) / len(d), "detail": d, "s": time.perf_counter() - t0}
    print(f"{n:>12} L={L} chunk={chunk} acc={acc[L]:.2f} packed={pa} (n={pn}) B/tok={bpt:,.0f} "
          f"mean_lp={res[f'{n}@{L}c{chunk}']['mean_lp']:.2f} {time.perf_counter()-t0:.0f}s", flush=True)
    json.dump(res, open(out, "w"), indent=1)
