"""The drop-in classes in the tools transformers users train with: transformers.Trainer, and
PEFT LoRA on the fused layout (target names `qkv`, `attn_out`, `ffn_in`, `ffn_out`), merged
and saved for transformers; a LoRA adapter trained on transformers' own model comes over merged."""
import json

import pytest
import torch

import roberta_fast as rf

transformers = pytest.importorskip("transformers")

FIELDS = dict(vocab_size=61, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=37,
              max_position_embeddings=24, type_vocab_size=1)


def classifier():
    """A transformers classifier with random weights, and the drop-in loaded from it."""
    torch.manual_seed(0)
    hf = transformers.RobertaForSequenceClassification(transformers.RobertaConfig(**FIELDS, num_labels=2))
    return hf, rf.RobertaForSequenceClassification.from_pretrained(hf, backend="reference")


def batch(seed=0, rows=8):
    """A padded batch whose label is whether token 5 occurs: learnable in a few steps."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(6, FIELDS["vocab_size"], (rows, 12), generator=g)
    labels = torch.arange(rows) % 2
    ids[labels == 1, 3] = 5
    mask = torch.ones_like(ids)
    mask[::3, 9:] = 0
    ids[mask == 0] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def losses(model, data, steps, lr):
    """Train `model` on `data` for `steps` AdamW steps; the losses."""
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    out = []
    for _ in range(steps):
        loss = model(**data).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


def test_transformers_trainer_trains_saves_and_reloads(tmp_path):
    from safetensors.torch import load_file

    _, model = classifier()
    model.train()
    rows = batch(rows=16)
    dataset = [{k: v[i] for k, v in rows.items()} for i in range(16)]
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "run"), max_steps=8, learning_rate=1e-2,
                                          per_device_train_batch_size=8, logging_steps=1, report_to=[],
                                          save_strategy="no", use_cpu=True, seed=0)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=dataset)
    trainer.train()
    logged = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(logged) == 8 and sum(logged[-3:]) < sum(logged[:3]), logged  # the loss falls
    trainer.save_model(str(tmp_path / "saved"))  # not a transformers PreTrainedModel: its state dict
    reloaded = rf.RobertaForSequenceClassification(model.config, backend="reference")
    reloaded.load_state_dict(load_file(tmp_path / "saved" / "model.safetensors"))
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded.eval()(**rows).logits, model(**rows).logits)


def test_transformers_trainer_accumulates_gradients_as_one_batch(tmp_path):
    """Two accumulated batches of 4 step as one batch of 8: the Trainer divides our (mean) loss by the
    accumulation steps, as accepts_loss_kwargs = False tells it to (a **kwargs forward alone would make it
    pass num_items_in_batch and skip the division, doubling the step)."""
    rows = batch(rows=8)
    dataset = [{k: v[i] for k, v in rows.items()} for i in range(8)]
    stepped = []
    for per_device, accumulation in ((8, 1), (4, 2)):
        hf, _ = classifier()
        model = rf.RobertaForSequenceClassification.from_pretrained(
            hf, backend="reference", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / str(accumulation)), max_steps=1, learning_rate=0.5, optim="sgd",
            lr_scheduler_type="constant", per_device_train_batch_size=per_device,
            gradient_accumulation_steps=accumulation, report_to=[], save_strategy="no", use_cpu=True, seed=0)
        transformers.Trainer(model=model, args=args, train_dataset=dataset).train()
        stepped.append(model.classifier.out_proj.weight.detach().clone())
    before = classifier()[1].classifier.out_proj.weight.detach()
    assert (stepped[0] - before).abs().max() > 1e-4  # the step moved the weights
    torch.testing.assert_close(stepped[1], stepped[0], rtol=1e-4, atol=1e-6)


def test_lora_on_the_fused_names_trains_merges_and_loads_in_transformers(tmp_path):
    peft = pytest.importorskip("peft", reason="LoRA needs peft: pip install peft")
    _, model = classifier()
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["qkv", "attn_out", "ffn_in", "ffn_out"],
                             modules_to_save=["classifier"])
    lora = peft.get_peft_model(model, config)
    trainable = {n for n, p in lora.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n or "classifier" in n for n in trainable)
    assert any(".ffn_in.lora_A" in n for n in trainable) and any(".qkv.lora_B" in n for n in trainable)
    data = batch()
    trace = losses(lora, data, steps=15, lr=1e-2)
    assert trace[-1] < 0.7 * trace[0], trace
    untrained = [n for n, p in lora.named_parameters() if "lora_B" in n and not p.detach().any()]
    assert not untrained, f"adapters that got no gradient (bypassed by the forward): {untrained}"
    lora.eval()
    for pack in (rf.quantize, rf.prepack):  # packing the base weights alone would drop the adapters silently
        with pytest.raises(ValueError, match=r"peft\.tuners\.lora\.layer\.Linear, not torch's nn.Linear.*merge"):
            pack(lora.base_model.model)
    with torch.no_grad():
        adapted = lora(**data).logits
        merged = lora.merge_and_unload()
        assert type(merged) is rf.RobertaForSequenceClassification
        torch.testing.assert_close(merged(**data).logits, adapted, rtol=1e-5, atol=1e-5)
        merged.save_pretrained(tmp_path)
        back = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path).eval()
        merged.roberta.unpad = False
        torch.testing.assert_close(back(**data).logits, merged(**data).logits, rtol=1e-5, atol=1e-5)


def test_a_saved_lora_adapter_names_the_base_model_directory_as_from_transformers(tmp_path):
    """PEFT writes the model's name_or_path (from_pretrained's path or Hub name, as transformers sets it)
    into adapter_config.json as the base model, which loading the adapter by itself reads; it was null."""
    peft = pytest.importorskip("peft", reason="LoRA needs peft: pip install peft")
    hf, _ = classifier()
    hf.save_pretrained(tmp_path / "base")
    written = {}
    for name, cls, targets in (("hf", transformers.RobertaForSequenceClassification, ["query", "value"]),
                               ("rf", rf.RobertaForSequenceClassification, ["qkv"])):
        model = cls.from_pretrained(tmp_path / "base")
        peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=targets)).save_pretrained(tmp_path / name)
        written[name] = json.loads((tmp_path / name / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert written["rf"] == written["hf"] == str(tmp_path / "base")
    assert rf.RobertaModel(rf.RobertaConfig(**FIELDS)).name_or_path == ""  # built from a config, as there


def test_a_lora_adapter_trained_on_transformers_model_comes_over_merged(tmp_path):
    """transformers' targets (query, value) name layers the fused model lacks: merge the adapter
    in transformers, save, and load that directory."""
    peft = pytest.importorskip("peft", reason="LoRA needs peft: pip install peft")
    hf, _ = classifier()
    lora = peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["query", "value"],
                                                   modules_to_save=["classifier"]))
    data = batch(seed=1)
    losses(lora, data, steps=3, lr=1e-2)
    merged = lora.merge_and_unload().eval()
    merged.save_pretrained(tmp_path)
    ours = rf.RobertaForSequenceClassification.from_pretrained(tmp_path, backend="reference")
    ours.roberta.unpad = False
    with torch.no_grad():
        torch.testing.assert_close(ours(**data).logits, merged(**data).logits, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """A byte-level BPE tokenizer of FIELDS' vocab size, saved where transformers' AutoTokenizer reads it."""
    path = tmp_path_factory.mktemp("tokenizer")
    text = ["the cat sat on the mat", "a much longer sentence with more words in it", "short"] * 20
    rf.RobertaTokenizer.train_from_iterator(text, vocab_size=300, min_frequency=1).save(path)
    return path


def twins(cls, tokenizer_dir, **extra):
    """transformers' `cls` with random weights (vocab sized to the tokenizer) and the drop-in loaded from it."""
    tok = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(0)
    hf = getattr(transformers, cls)(transformers.RobertaConfig(**{**FIELDS, "vocab_size": len(tok), **extra})).eval()
    return tok, hf, getattr(rf, cls).from_pretrained(hf, backend="reference").eval()


@pytest.mark.parametrize("task, cls, call", [
    ("fill-mask", "RobertaForMaskedLM", lambda p: p("the cat <mask> on the mat", top_k=3)),
    ("text-classification", "RobertaForSequenceClassification",
     lambda p: p(["short", "a much longer sentence"], batch_size=2, top_k=None)),
    ("feature-extraction", "RobertaModel", lambda p: p(["short", "a much longer sentence"], batch_size=2)),
])
def test_pipelines_take_the_dropin_as_transformers_model(tokenizer_dir, task, cls, call):
    """Pipelines assign into outputs, rebuild them from dicts per row (batch_size > 1) and read them by
    position: the outputs must be transformers' ModelOutputs, not only behave like them."""
    tok, hf, ours = twins(cls, tokenizer_dir)
    want, got = (call(transformers.pipeline(task, model=m, tokenizer=tok, device="cpu")) for m in (hf, ours))
    if task == "feature-extraction":  # at the real tokens (the unpadded path leaves zeros at pads)
        for text, g, w in zip(["short", "a much longer sentence"], got, want, strict=True):
            real = len(tok(text).input_ids)
            torch.testing.assert_close(torch.tensor(g)[:, :real], torch.tensor(w)[:, :real], rtol=1e-4, atol=1e-5)
        return
    flat = [r for rows in (want, got) for r in (rows if isinstance(rows[0], dict) else sum(rows, []))]
    half = len(flat) // 2
    assert [r["label" if "label" in r else "token"] for r in flat[:half]] == [
        r["label" if "label" in r else "token"] for r in flat[half:]]
    assert [r["score"] for r in flat[half:]] == pytest.approx([r["score"] for r in flat[:half]], rel=1e-4)


def test_trainer_predict_with_label_smoothing_returns_the_logits(tmp_path, tokenizer_dir):
    """With label smoothing the Trainer pops the labels, so the output has no loss; it then reads the
    logits from the output as a dict (it took out[1:] of a non-dict, which dropped them)."""
    _, hf, ours = twins("RobertaForSequenceClassification", tokenizer_dir, num_labels=3)
    rows = batch(rows=6)
    rows["labels"] %= 3
    dataset = [{k: v[i] for k, v in rows.items()} for i in range(6)]
    predictions = []
    for model in (hf, ours):
        args = transformers.TrainingArguments(output_dir=str(tmp_path), label_smoothing_factor=0.1, report_to=[],
                                              use_cpu=True, per_device_eval_batch_size=4)
        predictions.append(transformers.Trainer(model=model, args=args).predict(dataset).predictions)
    assert predictions[1].shape == (6, 3)
    torch.testing.assert_close(torch.as_tensor(predictions[1]), torch.as_tensor(predictions[0]), rtol=1e-4, atol=1e-5)


def test_trainer_with_gradient_checkpointing_trains_as_without(tmp_path):
    """TrainingArguments(gradient_checkpointing=True): transformers 5's Trainer calls
    activation_checkpointing_enable(..., every_n_layers=, offload=); the steps equal those without."""
    rows = batch(rows=8)
    dataset = [{k: v[i] for k, v in rows.items()} for i in range(8)]
    stepped = []
    for checkpointing in (False, True):
        _, model = classifier()
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / str(checkpointing)), max_steps=2, learning_rate=1e-2,
            per_device_train_batch_size=4, gradient_checkpointing=checkpointing, report_to=[], save_strategy="no",
            use_cpu=True, seed=0)
        transformers.Trainer(model=model, args=args, train_dataset=dataset).train()
        assert model.is_gradient_checkpointing == checkpointing
        stepped.append(model.classifier.out_proj.weight.detach().clone())
    torch.testing.assert_close(stepped[1], stepped[0], rtol=1e-5, atol=1e-6)
