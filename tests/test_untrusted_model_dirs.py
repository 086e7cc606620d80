"""Model directories someone else made: a config claiming a huge model, an index naming files elsewhere."""
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


class _AllocationLimit(torch.overrides.TorchFunctionMode):
    """Fails, before the memory is taken, once torch.empty (which nn.Linear, nn.Embedding and nn.LayerNorm
    allocate with) is asked for more than 50 M elements (200 MB in fp32) of real, not meta, tensors."""

    def __init__(self):
        super().__init__()
        self.elements = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.empty and torch.device(kwargs.get("device") or "cpu").type != "meta":
            self.elements += torch.Size(args[0] if len(args) == 1 and not isinstance(args[0], int) else args).numel()
            if self.elements > 50 * 2**20:
                raise AssertionError(f"allocating {self.elements} elements before checking the checkpoint")
        return func(*args, **kwargs)


@pytest.fixture
def allocation_limit():
    with _AllocationLimit():
        yield


def _claim(directory, **fields):
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, **fields}))


def test_config_claiming_a_huge_model_is_refused_before_allocating_it(tmp_path, allocation_limit):
    directory = _tiny_dir(tmp_path / "m")
    _claim(directory, num_hidden_layers=300, hidden_size=1024, intermediate_size=4096, num_attention_heads=16)
    with pytest.raises(ValueError, match=r"checkpoint lacks encoder weights: \['roberta.encoder.layer.1\."):
        rf.RobertaForMaskedLM.from_pretrained(directory)  # a 3.8 G-parameter (15 GB) claim


def test_a_mismatched_shape_is_refused_before_allocating_the_model(tmp_path, allocation_limit):
    directory = _tiny_dir(tmp_path / "m")
    _claim(directory, vocab_size=100_000_000)  # 6.4 GB of word embeddings, against the checkpoint's 50 rows
    with pytest.raises(ValueError, match=r"checkpoint weight \S+ has shape \(50,.*\), the config implies \(100000000,"):
        rf.RobertaForMaskedLM.from_pretrained(directory)


def test_a_missing_head_is_still_initialised(tmp_path):
    model, info = rf.RobertaForSequenceClassification.from_pretrained(_tiny_dir(tmp_path / "m"), num_labels=3,
                                                                      output_loading_info=True)
    assert "classifier.out_proj.weight" in info["missing_keys"]
    assert not any(p.is_meta for p in model.parameters())
    assert model.classifier.out_proj.weight.shape == (3, 16)


def test_loaded_weights_are_copies_and_only_missing_ones_are_initialised(tmp_path):
    """from_pretrained fills a shapes-only model with copies of the checkpoint's tensors: no random
    init of what it loads (the torch RNG is untouched), none of them left in the file's memory map
    (a file rewritten in place afterwards changes nothing) or shared with a transformers model given;
    what the checkpoint lacks starts as in a new model: a pooler N(0, initializer_range) with zero bias,
    a bare encoder's MLM head with LayerNorm at one and zero biases, in the asked dtype."""
    transformers = pytest.importorskip("transformers")
    directory = _tiny_dir(tmp_path / "m")
    torch.manual_seed(0)
    rng = torch.get_rng_state()
    model = rf.RobertaForMaskedLM.from_pretrained(directory)
    assert torch.equal(torch.get_rng_state(), rng)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    weights = directory / "model.safetensors"
    with open(weights, "r+b") as f:  # zeroed in place, as a writer that does not replace the file would
        f.write(bytes(weights.stat().st_size))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())

    hf = transformers.RobertaModel(transformers.RobertaConfig(**TINY), add_pooling_layer=False)
    model = rf.RobertaModel.from_pretrained(hf)  # no pooler there
    words = hf.embeddings.word_embeddings.weight
    assert not any(p.data_ptr() == words.data_ptr() for p in model.parameters())
    assert model.pooler.dense.weight.std().item() == pytest.approx(model.config.initializer_range, rel=0.5)
    assert not model.pooler.dense.bias.any() and all(p.requires_grad for p in model.parameters())
    encoder = tmp_path / "encoder"
    rf.RobertaModel(rf.RobertaConfig(**TINY)).save_pretrained(encoder)
    mlm = rf.RobertaForMaskedLM.from_pretrained(encoder, dtype=torch.float16)
    head = mlm.lm_head
    assert {p.dtype for p in mlm.parameters()} == {torch.float16}
    assert not head.bias.any() and bool((head.layer_norm.weight == 1).all()) and not head.layer_norm.bias.any()
    assert head.dense.weight.std().item() == pytest.approx(mlm.config.initializer_range, rel=0.5)


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
    refusal = "points outside" if escape == "relative" else "is the absolute path"
    with pytest.raises(ValueError, match=f"the shard of {index_name} .*{refusal}.*shard names must be files in the model's"):
        rf.RobertaForMaskedLM.from_pretrained(received)


def test_shards_in_the_directory_still_load(tmp_path):
    directory = tmp_path / "m"
    model = rf.RobertaForMaskedLM(rf.RobertaConfig(**TINY))
    model.save_pretrained(directory, max_shard_size=2000)
    assert len([f for f in os.listdir(directory) if f.startswith("model-")]) > 1
    loaded = rf.RobertaForMaskedLM.from_pretrained(directory)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values()))
