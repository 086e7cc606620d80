"""The drop-in classes under the transformers idioms users write: left-padded batches on the unpadded
path, config.problem_type / id2label set after loading, from_pretrained and save_pretrained keyword
arguments, broadcast (1, seqlen) position and token type ids, use_cache, parameter groups chosen by
transformers' parameter names. Each against transformers itself on a tiny config, or a clear refusal
where roberta_fast does not do what transformers would.
"""
import json
import warnings

import pytest
import torch

import roberta_fast as rf
from roberta_fast.hf import _hf_names

transformers = pytest.importorskip("transformers")

FIELDS = dict(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
              max_position_embeddings=66, type_vocab_size=2)


def hf_model(cls, **extra):
    torch.manual_seed(0)
    return getattr(transformers, cls)(transformers.RobertaConfig(**{**FIELDS, **extra})).eval()


def left_padded(rows=3, seqlen=10, pad=3, seed=0):
    """(ids, mask): row 0 full, the others left-padded by `pad` with different content."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, FIELDS["vocab_size"], (rows, seqlen), generator=g)
    ids[:, 0], ids[:, -1] = 0, 2
    mask = torch.ones_like(ids)
    ids[1:, :pad], mask[1:, :pad], ids[1:, pad] = 1, 0, 0
    return ids, mask


@pytest.mark.parametrize("cls", ["RobertaForSequenceClassification", "RobertaForMultipleChoice", "RobertaModel"])
def test_left_padding_on_the_unpadded_path_matches_transformers(cls):
    """Position 0 (read by the pooler and the classification head) is a pad token under left padding;
    the CPU's no-grad unpadded path once gave it a zero hidden state, so every left-padded row got
    the same logits. Such a batch runs padded, as transformers runs it."""
    hf = hf_model(cls)
    ours = getattr(rf, cls).from_pretrained(hf, backend="reference")
    ids, mask = left_padded(rows=4)
    if cls == "RobertaForMultipleChoice":
        ids, mask = ids.view(2, 2, -1), mask.view(2, 2, -1)
    with torch.no_grad():
        want, got = hf(input_ids=ids, attention_mask=mask), ours(ids, attention_mask=mask)
    key = "pooler_output" if cls == "RobertaModel" else "logits"
    torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6)


def test_label_fields_read_and_write_as_in_transformers(tmp_path):
    """config.num_labels / id2label / label2id / problem_type: transformers' defaults, the head's size,
    set after loading and honoured by the loss and by save_pretrained."""
    assert (rf.RobertaConfig(**FIELDS).id2label, rf.RobertaConfig(**FIELDS).problem_type) == (
        transformers.RobertaConfig().id2label, None)
    hf = hf_model("RobertaForSequenceClassification", num_labels=3)
    ours = rf.RobertaForSequenceClassification.from_pretrained(hf, backend="reference")
    for attr in ("num_labels", "id2label", "label2id", "problem_type"):
        assert getattr(ours.config, attr) == getattr(hf.config, attr), attr
    ids, labels = left_padded(rows=2)[0], torch.tensor([[1.0, 0, 1], [0, 1, 0]])
    names = {0: "neg", 1: "mid", 2: "pos"}
    for model in (hf, ours):
        model.config.problem_type = "regression"  # float labels: otherwise multi-label
        model.config.id2label, model.config.label2id = names, {v: k for k, v in names.items()}
    torch.testing.assert_close(ours(ids, labels=labels).loss, hf(input_ids=ids, labels=labels).loss)
    ours.save_pretrained(tmp_path)
    back = transformers.AutoConfig.from_pretrained(tmp_path)
    assert (back.problem_type, back.id2label, back.label2id) == ("regression", names, hf.config.label2id)
    assert rf.RobertaForSequenceClassification.from_pretrained(tmp_path).config.id2label == names
    with pytest.raises(ValueError, match="problem_type"):
        ours.config.problem_type = "regresion"


@pytest.mark.parametrize("num_labels, labels", [(1, [0.5, 2.0]), (3, [2, 0]), (3, [[1.0, 0, 1], [0, 1, 0]])])
def test_problem_type_is_inferred_once_and_kept_as_in_transformers(num_labels, labels, tmp_path):
    """With problem_type None, transformers infers it from the first labels and stores it in the
    config: later calls use it, and save_pretrained writes it."""
    hf = hf_model("RobertaForSequenceClassification", num_labels=num_labels)
    ours = rf.RobertaForSequenceClassification.from_pretrained(hf, backend="reference")
    ids, labels = left_padded(rows=2)[0], torch.tensor(labels)
    torch.testing.assert_close(ours(ids, labels=labels).loss, hf(input_ids=ids, labels=labels).loss)
    assert ours.config.problem_type == hf.config.problem_type is not None
    ours.save_pretrained(tmp_path)
    assert transformers.AutoConfig.from_pretrained(tmp_path).problem_type == hf.config.problem_type


def test_from_pretrained_keywords_as_in_transformers(tmp_path):
    """Config-attribute keywords set the loaded config, config= replaces it, options with no effect here
    are accepted; options whose effect is not implemented, and unknown keywords, are refused by name."""
    hf_model("RobertaForSequenceClassification", num_labels=3).save_pretrained(tmp_path)
    updates = dict(problem_type="multi_label_classification", classifier_dropout=0.3, hidden_dropout_prob=0.2,
                   id2label={0: "a", 1: "b", 2: "c"}, output_hidden_states=True)
    cls, ours = transformers.RobertaForSequenceClassification, rf.RobertaForSequenceClassification
    want, got = cls.from_pretrained(tmp_path, **updates).config, ours.from_pretrained(tmp_path, **updates).config
    for attr in [*updates, "num_labels", "label2id"]:
        assert getattr(got, attr) == getattr(want, attr), attr
    with pytest.warns(UserWarning, match="newly initialised"):
        resized = ours.from_pretrained(tmp_path, num_labels=5, ignore_mismatched_sizes=True)
    assert resized.classifier.out_proj.out_features == resized.config.num_labels == 5
    model = ours.from_pretrained(tmp_path, config=want, local_files_only=True, trust_remote_code=True,
                                 low_cpu_mem_usage=True, device_map="cpu", attn_implementation="sdpa")
    assert model.config.classifier_dropout == 0.3 and "hidden_states" in model(left_padded()[0])
    for bad in (dict(device_map="auto"), dict(attn_implementation="flash_attention_2"),
                dict(quantization_config={"load_in_8bit": True}), dict(subfolder="sub")):
        with pytest.raises(ValueError, match=next(iter(bad))):
            ours.from_pretrained(tmp_path, **bad)
    with pytest.raises(TypeError, match="colour"):
        ours.from_pretrained(tmp_path, colour="red")
    with pytest.raises(ValueError, match="problem_type"):
        ours.from_pretrained(tmp_path, problem_type="regresion")


def test_dtype_auto_loads_the_checkpoints_dtype_as_in_transformers(tmp_path):
    """dtype="auto" (or torch_dtype="auto") was once taken as fp32; as in transformers it is the config's
    dtype, else the first floating weight's. With no dtype the model stays fp32 (roberta_fast's default)."""
    hf_model("RobertaForSequenceClassification").to(torch.bfloat16).save_pretrained(tmp_path)
    ours = rf.RobertaForSequenceClassification
    for kwargs in (dict(dtype="auto"), dict(torch_dtype="auto")):
        assert ours.from_pretrained(tmp_path, **kwargs).dtype == torch.bfloat16, kwargs
    assert ours.from_pretrained(tmp_path).dtype == torch.float32
    config = json.loads((tmp_path / "config.json").read_text())
    del config["dtype"]  # no dtype in config.json: the weights say
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert ours.from_pretrained(tmp_path, dtype="auto").dtype == torch.bfloat16
    assert ours.from_pretrained(hf_model("RobertaModel").half(), dtype="auto").dtype == torch.float16
    with pytest.raises(ValueError, match="'fp16' is not a torch dtype"):
        ours.from_pretrained(tmp_path, dtype="fp16")


def test_save_pretrained_keywords_as_in_transformers(tmp_path):
    """is_main_process=False writes nothing, state_dict= is what is saved, max_shard_size shards with
    transformers' index (and a later unsharded save removes the shards); what is not written is refused."""
    hf = hf_model("RobertaForSequenceClassification", num_labels=3)
    ours = rf.RobertaForSequenceClassification.from_pretrained(hf, backend="reference")
    ids = left_padded()[0]
    ours.save_pretrained(tmp_path / "none", is_main_process=False)
    assert not (tmp_path / "none").exists()
    state = {k: v + 0.01 for k, v in ours.state_dict().items()}
    ours.save_pretrained(tmp_path / "d", state_dict=state, max_shard_size="20KB", safe_serialization=True)
    index = json.loads((tmp_path / "d" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1 and not (tmp_path / "d" / "model.safetensors").exists()
    ours.load_state_dict(state)
    back = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "d").eval()
    with torch.no_grad():
        torch.testing.assert_close(back(input_ids=ids).logits, ours(ids).logits)
        torch.testing.assert_close(type(ours).from_pretrained(tmp_path / "d")(ids).logits, ours(ids).logits)
    ours.save_pretrained(tmp_path / "d")
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["config.json", "model.safetensors"]
    for bad in (dict(safe_serialization=False), dict(push_to_hub=True)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            ours.save_pretrained(tmp_path / "e", **bad)
    with pytest.raises(TypeError, match="colour"):
        ours.save_pretrained(tmp_path / "e", colour="red")


@pytest.mark.parametrize("cls", ["RobertaForSequenceClassification", "RobertaForMultipleChoice"])
def test_one_row_of_position_and_token_type_ids_is_broadcast_as_in_transformers(cls):
    hf = hf_model(cls)
    ours = getattr(rf, cls).from_pretrained(hf, backend="reference")
    ids, mask = left_padded(rows=4, pad=0)
    mask[1, 7:] = 0  # right padding: the unpadded path packs the broadcast rows too
    if cls == "RobertaForMultipleChoice":
        ids, mask = ids.view(2, 2, -1), mask.view(2, 2, -1)
    rows = dict(position_ids=torch.arange(2, 12)[None], token_type_ids=(torch.arange(10)[None] >= 5).long())
    for grad in (True, False):
        with torch.set_grad_enabled(grad):
            want = hf(input_ids=ids, attention_mask=mask, **rows).logits
            torch.testing.assert_close(ours(ids, attention_mask=mask, **rows).logits, want)


@pytest.mark.parametrize("cls", ["RobertaModel", "RobertaForMaskedLM", "RobertaForSequenceClassification",
                                 "RobertaForTokenClassification", "RobertaForQuestionAnswering"])
def test_use_cache_is_ignored_and_decoder_inputs_refused(cls):
    """transformers' encoder ignores use_cache; a cache or encoder states would make it a decoder."""
    hf = hf_model(cls)
    ours = getattr(rf, cls).from_pretrained(hf, backend="reference")
    ids = left_padded()[0]
    with torch.no_grad():
        torch.testing.assert_close(ours(ids, use_cache=True)[0], hf(input_ids=ids, use_cache=True)[0])
        with pytest.raises(ValueError, match="encoder_hidden_states"):
            ours(ids, encoder_hidden_states=torch.zeros(3, 10, 32))
        with pytest.raises(TypeError, match="colour"):
            ours(ids, colour="red")


def test_question_answering_loss_unpadded_on_the_cpu_is_as_documented():
    """The docstring's claim: under no_grad on the CPU a right-padded batch runs unpadded, padded positions'
    logits are the qa_outputs bias and the loss differs from transformers'; unpad = False gives transformers'."""
    hf = hf_model("RobertaForQuestionAnswering")
    ours = rf.RobertaForQuestionAnswering.from_pretrained(hf, backend="reference")
    ids, mask = left_padded(rows=2, pad=0)
    mask[1, 6:] = 0
    positions = dict(start_positions=torch.tensor([1, 2]), end_positions=torch.tensor([3, 4]))
    with torch.no_grad():
        want = hf(input_ids=ids, attention_mask=mask, **positions)
        got = ours(ids, attention_mask=mask, **positions)
        assert (got.start_logits[1, 6:] == ours.qa_outputs.bias[0]).all() and not torch.isclose(got.loss, want.loss)
        ours.roberta.unpad = False
        torch.testing.assert_close(ours(ids, attention_mask=mask, **positions).loss, want.loss)


CLASSES = ["RobertaModel", "RobertaForMaskedLM", "RobertaForSequenceClassification",
           "RobertaForTokenClassification", "RobertaForQuestionAnswering", "RobertaForMultipleChoice"]
# Name-based parameter selections from transformers users' code: the no_decay lists of the BERT recipe and of
# transformers' no_trainer examples, every norm, layer-wise choices (freezing, layer-wise LR decay), embeddings
NAME_RECIPES = {
    "no_decay LayerNorm.weight": lambda n: any(nd in n for nd in ("bias", "LayerNorm.weight")),
    "no_decay layer_norm.weight": lambda n: any(nd in n for nd in ("bias", "layer_norm.weight")),
    "norms": lambda n: "LayerNorm" in n or "layer_norm" in n,
    "layer 1": lambda n: "encoder.layer.1." in n,
    "layer 0's norms": lambda n: "layer.0." in n and "LayerNorm" in n,
    "embeddings": lambda n: "embeddings" in n,
    "pooler": lambda n: "pooler.dense." in n,
    "all": lambda n: True,
}


@pytest.mark.parametrize("cls", CLASSES)
def test_name_based_parameter_groups_written_for_transformers_select_the_same_parameters(cls):
    """Weight decay groups, freezing or layer-wise learning rates chosen by transformers' parameter names
    select the same parameters here (a fused qkv counting as query, key and value): the layers sit at
    `encoder.layer.{i}` and the norms are named `LayerNorm` as there. With other names the classic
    `["bias", "LayerNorm.weight"]` list silently decayed every norm."""
    hf = getattr(transformers, cls)(transformers.RobertaConfig(**FIELDS))
    ours = getattr(rf, cls)(rf.RobertaConfig(**FIELDS))
    prefix = "" if cls == "RobertaModel" else "roberta."
    for recipe, chosen in NAME_RECIPES.items():
        want = {name for name, _ in hf.named_parameters() if chosen(name)}
        got = {hf_name for name, _ in ours.named_parameters() if chosen(name) for hf_name in _hf_names(name, prefix)}
        assert got == want, recipe
    assert len(ours.roberta.encoder.layer if prefix else ours.encoder.layer) == FIELDS["num_hidden_layers"]


@pytest.mark.parametrize("cls", ["RobertaModel", "RobertaForMaskedLM"])
def test_state_dicts_under_the_older_native_names_still_load(cls):
    """Training checkpoints and transformers.Trainer's save_model files written before the encoder took
    transformers' paths (`layers.{i}`, `attn_norm`, `ffn_norm`, `embeddings.layer_norm`, `pooler`) load,
    strictly, under the current names."""
    def older(name):
        for new, old in (("encoder.layer.", "layers."), ("attn_LayerNorm", "attn_norm"),
                         ("ffn_LayerNorm", "ffn_norm"), ("embeddings.LayerNorm", "embeddings.layer_norm"),
                         ("pooler.dense.", "pooler.")):
            name = name.replace(new, old)
        return name

    model = getattr(rf, cls)(rf.RobertaConfig(**FIELDS))
    state = {older(key): value + 1 for key, value in model.state_dict().items()}
    prefix = "" if cls == "RobertaModel" else "roberta."
    assert {f"{prefix}layers.1.attn_norm.weight", f"{prefix}embeddings.layer_norm.bias"} <= state.keys()
    assert cls != "RobertaModel" or "pooler.weight" in state
    fresh = getattr(rf, cls)(rf.RobertaConfig(**FIELDS))
    fresh.load_state_dict(state)
    for key, value in fresh.state_dict().items():
        torch.testing.assert_close(value, model.state_dict()[key] + 1, rtol=0, atol=0, msg=key)


@pytest.mark.parametrize("cls", CLASSES)
def test_load_state_dict_takes_a_transformers_state_dict(cls):
    """model.load_state_dict(transformers_model.state_dict()) (a pytorch_model.bin, as transformers users
    load one) loads strictly, query/key/value fused into qkv: the same outputs as from_pretrained. Before,
    strict=True named missing keys and strict=False silently kept the random encoder weights. An MLM
    whose decoder differs from its word embeddings is refused, as from_pretrained refuses it."""
    hf = hf_model(cls)
    state = hf.state_dict()
    ours = getattr(rf, cls)(hf.config).eval()  # transformers' config: its layer_norm_eps 1e-12 too
    ours.load_state_dict(state)
    loaded = getattr(rf, cls).from_pretrained(hf)
    ids, mask = left_padded()
    if cls == "RobertaForMultipleChoice":
        ids, mask = ids[None], mask[None]
    with torch.no_grad():
        got, want = ours(ids, attention_mask=mask), loaded(ids, attention_mask=mask)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    if cls == "RobertaForMaskedLM":
        untied = {**state, "lm_head.decoder.weight": state["lm_head.decoder.weight"] + 1}
        with pytest.raises(ValueError, match="an MLM decoder that is not its word embeddings"):
            ours.load_state_dict(untied)


def test_reentrant_gradient_checkpointing_on_frozen_embeddings_still_trains_the_layers():
    """gradient_checkpointing_enable({"use_reentrant": True}) with the embeddings frozen: the checkpointed
    layers get their gradients, as transformers gives them (it makes the embeddings' output require grad).
    Before, no encoder layer got a gradient, with only torch's warning."""
    hf = hf_model("RobertaForSequenceClassification")
    ours = rf.RobertaForSequenceClassification.from_pretrained(hf).train()
    ids, mask = left_padded()
    grads = {}
    for name, model in (("hf", hf.train()), ("ours", ours)):
        model.get_input_embeddings().requires_grad_(False)
        model.roberta.embeddings.requires_grad_(False)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's use_reentrant notices
            model(ids, attention_mask=mask, labels=torch.tensor([0, 1, 0])).loss.backward()
        grads[name] = {n for n, p in model.named_parameters() if p.grad is not None and "encoder.layer" in n}
    assert len(grads["ours"]) == 12 * FIELDS["num_hidden_layers"] and grads["hf"]


def test_ids_are_checked_against_the_word_embeddings_the_model_holds():
    """After set_input_embeddings with a larger table (config.vocab_size unchanged, as in transformers) an
    id past the config's vocabulary but inside the table runs, as there; one past the table is refused."""
    hf = hf_model("RobertaModel")
    ours = rf.RobertaModel.from_pretrained(hf)
    for model in (hf, ours):
        torch.manual_seed(1)
        model.set_input_embeddings(torch.nn.Embedding(FIELDS["vocab_size"] + 30, FIELDS["hidden_size"], padding_idx=1))
    ids = torch.tensor([[0, 120, 5, 2]])
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).last_hidden_state, hf(ids).last_hidden_state, rtol=1e-4, atol=1e-5)
        with pytest.raises(ValueError, match=r"input_ids holds values in \[0, 130\] but must lie in \[0, 130\)"):
            ours(torch.tensor([[0, 130, 2]]))


def test_get_memory_footprint_counts_as_transformers_and_the_packed_weights():
    """get_memory_footprint() is transformers' figure on the same weights (transformers adds its position
    and token-type id buffers); after rf.quantize it counts the int8 weights (and scales) the packed layers
    hold, which are no parameters, and the decoder's int8 copy."""
    hf = hf_model("RobertaForMaskedLM", hidden_size=128, intermediate_size=512, num_attention_heads=4)
    ours = rf.RobertaForMaskedLM.from_pretrained(hf)
    assert ours.get_memory_footprint() == hf.get_memory_footprint(return_buffers=False)  # (its position ids)
    quantized = rf.quantize(rf.RobertaForMaskedLM.from_pretrained(hf))
    unique = {t.data_ptr(): t.numel() * t.element_size() for t in quantized.state_dict().values()}
    assert quantized.get_memory_footprint() > sum(unique.values())  # + the decoder's int8 copy
    linears = sum(p.numel() * 4 for n, p in ours.named_parameters() if "encoder.layer" in n and p.dim() == 2)
    assert ours.get_memory_footprint() - quantized.get_memory_footprint() > 0.5 * linears


def test_set_output_embeddings_takes_the_tied_decoder_and_refuses_another():
    """set_output_embeddings(decoder) as transformers' code calls it after editing the decoder: tied to the
    word embeddings it is taken (its bias the head's); a decoder of its own is refused, as this MLM always
    reads the word embeddings (before: AttributeError)."""
    ours = rf.RobertaForMaskedLM.from_pretrained(hf_model("RobertaForMaskedLM"))
    ids, old_bias = torch.tensor([[0, 5, 2]]), ours.lm_head.bias.detach().clone()
    with torch.no_grad():
        before = ours(ids).logits
    decoder = ours.get_output_embeddings()
    decoder.bias = torch.nn.Parameter(torch.full_like(decoder.bias, 0.5))
    ours.set_output_embeddings(decoder)
    assert ours.lm_head.bias is decoder.bias
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits - before, (0.5 - old_bias).expand_as(before))
    with pytest.raises(ValueError, match="an MLM decoder that is not its word embeddings"):
        ours.set_output_embeddings(torch.nn.Linear(FIELDS["hidden_size"], FIELDS["vocab_size"]))


def test_config_architectures_and_no_split_modules_as_in_transformers(tmp_path):
    """config.architectures reads what config.json names (as transformers' config), and _no_split_modules,
    which accelerate's device maps take, names the same blocks as transformers' RobertaModel."""
    hf = hf_model("RobertaForSequenceClassification")
    hf.save_pretrained(tmp_path)
    ours = rf.RobertaForSequenceClassification.from_pretrained(tmp_path)
    assert ours.config.architectures == transformers.AutoConfig.from_pretrained(tmp_path).architectures
    assert rf.RobertaConfig.preset("tiny").architectures is None
    assert ours._no_split_modules == transformers.RobertaModel._no_split_modules
    assert {type(m).__name__ for m in ours.modules()} >= set(ours._no_split_modules)


def test_lm_head_decoder_is_the_tied_decoder_as_in_transformers():
    """model.lm_head.decoder, which transformers users read (and assign, as set_output_embeddings does),
    is the decoder tied to the word embeddings, also in a deep copy; assigning an untied one is refused
    (before: AttributeError)."""
    import copy

    ours = rf.RobertaForMaskedLM.from_pretrained(hf_model("RobertaForMaskedLM"))
    for model in (ours, copy.deepcopy(ours)):
        decoder = model.lm_head.decoder
        assert decoder.weight is model.roberta.embeddings.word_embeddings.weight and decoder.bias is model.lm_head.bias
    ours.lm_head.decoder = ours.get_output_embeddings()  # tied: taken
    assert "decoder" not in dict(ours.lm_head.named_children())
    with pytest.raises(ValueError, match="an MLM decoder that is not its word embeddings"):
        ours.lm_head.decoder = torch.nn.Linear(FIELDS["hidden_size"], FIELDS["vocab_size"])


def test_transformers_model_members_that_code_around_a_model_uses():
    """set_attn_implementation (eager / sdpa: the function computed here; others refused, as from_pretrained
    refuses them), get_encoder, dummy_inputs, get_parameter_or_buffer, config_class, as on transformers'
    model (they were AttributeErrors)."""
    hf = hf_model("RobertaForSequenceClassification")
    ours = rf.RobertaForSequenceClassification.from_pretrained(hf)
    ids = torch.tensor([[0, 5, 6, 2]])
    with torch.no_grad():
        before = ours(ids).logits
        for name in ("eager", "sdpa", {"": "sdpa"}):
            hf.set_attn_implementation(name)
            ours.set_attn_implementation(name)
        torch.testing.assert_close(ours(ids).logits, before, rtol=0, atol=0)
    for call in (lambda: ours.set_attn_implementation("flash_attention_2"),
                 lambda: rf.RobertaModel._from_config(ours.config, attn_implementation="flex_attention")):
        with pytest.raises(ValueError, match="not supported: roberta_fast computes the function"):
            call()
    assert type(ours.get_encoder()).__name__ == type(hf.get_encoder()).__name__ == "RobertaEncoder"
    assert ours.get_encoder() is ours.roberta.encoder
    assert ours.dummy_inputs.keys() == hf.dummy_inputs.keys()
    assert torch.equal(ours.dummy_inputs["input_ids"], hf.dummy_inputs["input_ids"])
    name = "roberta.embeddings.LayerNorm.weight"
    assert torch.equal(ours.get_parameter_or_buffer(name), hf.get_parameter_or_buffer(name))
    assert ours.config_class is rf.RobertaConfig and isinstance(ours.config, ours.config_class)
