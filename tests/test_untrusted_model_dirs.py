"""Model directories someone else made: an index naming files elsewhere."""
import json
import os
import shutil

import pytest
import torch

import roberta_fast as rf

TINY = dict(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
            max_position_embeddings=40)


def _tiny_dir(path):
    rf.RobertaForMaskedLM(rf.RobertaConfig(**TINY)).save_pretrained(path)
    return path


def test_a_missing_head_is_still_initialised(tmp_path):
    model, info = rf.RobertaForSequenceClassification.from_pretrained(_tiny_dir(tmp_path / "m"), num_labels=3,
                                                                      output_loading_info=True)
    assert "classifier.out_proj.weight" in info["missing_keys"]
    assert not any(p.is_meta for p in model.parameters())
    assert model.classifier.out_proj.weight.shape == (3, 16)


@pytest.mark.parametrize("index_name", ["model.safetensors.index.json", "pytorch_model.bin.index.json"])
@pytest.mark.parametrize("escape", ["relative", "absolute"])
def test_an_index_naming_a_shard_outside_the_directory_is_refused(tmp_path, index_name, escape):
    elsewhere = _tiny_dir(tmp_path / "elsewhere")
    weights = "model.safetensors"
    if index_name.startswith("pytorch"):
        from safetensors.torch import load_file

        weights = "pytorch_model.bin"
        torch.save(load_file(elsewhere / "model.safetensors"), elsewhere / weights)
    received = tmp_path / "received"
    received.mkdir()
    shutil.copy(elsewhere / "config.json", received)
    shard = f"../elsewhere/{weights}" if escape == "relative" else str(elsewhere / weights)
    (received / index_name).write_text(json.dumps({"weight_map": {"roberta.embeddings.word_embeddings.weight": shard}}))
    with pytest.raises(ValueError, match="outside the model directory: shard names must be files in the model's"):
        rf.RobertaForMaskedLM.from_pretrained(received)


def test_shards_in_the_directory_still_load(tmp_path):
    directory = tmp_path / "m"
    model = rf.RobertaForMaskedLM(rf.RobertaConfig(**TINY))
    model.save_pretrained(directory, max_shard_size=2000)
    assert len([f for f in os.listdir(directory) if f.startswith("model-")]) > 1
    loaded = rf.RobertaForMaskedLM.from_pretrained(directory)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values()))
