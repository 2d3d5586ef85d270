"""The GGUF converter checks what it writes against the GGUF's own metadata, for any shipped model."""

from __future__ import annotations

import json

import pytest

from sgl_entropic import model


def test_the_expected_config_comes_from_the_gguf_metadata(tmp_path):
    fields = model.gguf_fields(model.MODELS["smollm2-135m"].gguf(tmp_path))
    expected = model.expected_config(fields)
    assert expected == {
        "model_type": "llama",
        "vocab_size": 49152,
        "num_hidden_layers": 30,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
    }
    assert model.adds_bos(fields) is False  # SmolLM2's chat template carries its own start token
    folder = model.prepare_bundled_model()
    model._verify(folder, expected, chat=True, bos=False)  # the converted folder passes its own check
    for field, wrong in (("num_hidden_layers", 18), ("vocab_size", 262144), ("model_type", "gemma3_text")):
        with pytest.raises(RuntimeError, match=field):
            model._verify(folder, {**expected, field: wrong}, chat=True, bos=False)
    with pytest.raises(RuntimeError, match="BOS"):
        model._verify(folder, expected, chat=True, bos=True)


def test_a_folder_is_valid_only_while_its_config_matches_its_stamp(tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    assert not model.is_valid(folder)
    (folder / "config.json").write_text(json.dumps({"vocab_size": 49152, "num_hidden_layers": 30}))
    stamp = {"source": "x.gguf", "size": 1, "vocab_size": 49152, "num_hidden_layers": 30}
    (folder / model._STAMP).write_text(json.dumps(stamp))
    assert not model.is_valid(folder)  # an older converter's folder converts again
    (folder / model._STAMP).write_text(json.dumps({**stamp, "converter": model._CONVERTER}))
    assert model.is_valid(folder)
    (folder / "config.json").write_text(json.dumps({"vocab_size": 49152, "num_hidden_layers": 18}))
    assert not model.is_valid(folder)


def test_an_unknown_model_name_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        model.main(["llama-70b"])
    assert exit_info.value.code == 2 and "gemma3-270m" in capsys.readouterr().err
    with pytest.raises(ValueError, match="unknown model"):
        model.prepare_model("llama-70b")
