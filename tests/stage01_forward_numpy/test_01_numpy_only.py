"""Stage 01 is NumPy only: the forward passes must run in a process where torch cannot be imported."""

import ast
import inspect
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import labkit
from labkit.impl import current
from labkit.testing import random_gpt2, random_llama, random_tokens

MODULES = ["gpt2_numpy", "llama_numpy", "sampling", "flops"]

# Runs in a fresh interpreter: torch is made unimportable before the learner's module is loaded.
CHILD = """
import json, sys
sys.modules["torch"] = None  # any `import torch` now raises ImportError
import numpy as np
from labkit.impl import load

module, kind, folder = sys.argv[1:4]
arrays = np.load(f"{folder}/params.npz")
params = json.loads(open(f"{folder}/scalars.json").read())
for key in arrays.files:  # "blocks/3/ln_1.weight" -> params["blocks"][3]["ln_1.weight"]
    if "/" in key:
        group, i, name = key.split("/")
        params.setdefault(group, {}).setdefault(int(i), {})[name] = arrays[key]
    else:
        params[key] = arrays[key]
for group in ("blocks", "layers"):
    if group in params:
        params[group] = [params[group][i] for i in sorted(params[group])]
mod = load(f"stage01_forward_numpy.{module}")
logits = getattr(mod, f"{kind}_forward")(params, np.load(f"{folder}/ids.npy"))
np.save(f"{folder}/logits.npy", logits)
"""


def gpt2_case():
    hf = random_gpt2(11, n_embd=60, n_head=5, n_layer=2)
    sd = {k.removeprefix("transformer."): v.numpy() for k, v in hf.state_dict().items()}
    arrays = {"wte": sd["wte.weight"], "wpe": sd["wpe.weight"], "lm_head": sd["lm_head.weight"]}
    arrays |= {k: sd[k] for k in ("ln_f.weight", "ln_f.bias")}
    arrays |= {f"blocks/{k[2:].split('.', 1)[0]}/{k.split('.', 2)[2]}": v for k, v in sd.items() if k.startswith("h.")}
    return hf, {"n_head": 5, "eps": hf.config.layer_norm_epsilon}, arrays


def llama_case():
    hf = random_llama(11, hidden_size=80, num_attention_heads=5, num_key_value_heads=1)
    sd = {k.removeprefix("model."): v.numpy() for k, v in hf.state_dict().items()}
    arrays = {
        "embed_tokens": sd["embed_tokens.weight"],
        "norm.weight": sd["norm.weight"],
        "lm_head": sd["lm_head.weight"],
    }
    for k, v in sd.items():
        if k.startswith("layers."):
            _, i, name = k.split(".", 2)
            arrays[f"layers/{i}/{name}"] = v if "norm" in name else v.T  # params hold linears as (in, out)
    c = hf.config
    scalars = {"n_heads": 5, "n_kv_heads": 1, "head_dim": c.head_dim, "eps": c.rms_norm_eps}
    return hf, scalars | {"rope_theta": c.rope_parameters["rope_theta"]}, arrays


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_numpy_forward_runs_without_torch(impl, kind, tmp_path):
    hf, scalars, arrays = gpt2_case() if kind == "gpt2" else llama_case()
    ids = random_tokens(11, 17, hf.config.vocab_size)
    np.savez(tmp_path / "params.npz", **arrays)
    (tmp_path / "scalars.json").write_text(json.dumps(scalars))
    np.save(tmp_path / "ids.npy", ids.numpy())
    env = os.environ | {"LABS_IMPL": current(), "PYTHONPATH": str(labkit.ROOT)}
    run = subprocess.run(
        [sys.executable, "-c", CHILD, f"{kind}_numpy", kind, str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, f"{kind}_forward failed in a process without torch:\n{run.stderr[-1500:]}"
    with torch.no_grad():
        expected = hf(ids[None]).logits[0].numpy()
    delta = np.abs(np.load(tmp_path / "logits.npy") - expected).max()
    assert delta < 1e-4, f"{kind}_forward without torch: max |Δlogits| = {delta:.2e} (seed=11)"
    for name in MODULES:
        tree = ast.parse(inspect.getsource(impl(f"stage01_forward_numpy.{name}")))
        imported = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        imported += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        assert not [m for m in imported if m.split(".")[0] == "torch"], f"{name}.py imports torch; use NumPy only"
