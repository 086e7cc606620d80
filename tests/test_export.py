"""python -m roberta_fast.export: a step checkpoint of a training run becomes the same
Hugging Face directory as the run's final export, and loads in transformers.

Export for serving: torch.export.export and torch.onnx.export of every drop-in class give
a program that computes what the eager model does (the ONNX one run in onnxruntime, with
dynamic batch and sequence length)."""
import inspect
import warnings

import pytest
import torch
from malicious_checkpoint import write_malicious_checkpoint

import roberta_fast as rf

from roberta_fast.checkpoint import atomic_torch_save
from roberta_fast.export import main
from roberta_fast.train_config import TrainConfig
from roberta_fast.trainer import Trainer

SMALL = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, seq_len=32,
             batch_size=4, max_steps=6, warmup_steps=2, lr=3e-3, eval_every=100, eval_batches=1, stop_at=3,
             progress=False, tensorboard=False, plot=False, device="cpu")


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory):
    """A run stopped at step 3 of 6 (so no final export), and its trainer holding the step-3 model."""
    from roberta_fast.corpus import default_dataset

    root = tmp_path_factory.mktemp("export")
    data = default_dataset(root / "corpus", vocab_size=1024, max_bytes=1_000_000)
    trainer = Trainer(TrainConfig.preset("tiny", data=str(data), out=str(root / "run"), **SMALL), log=lambda *a: None)
    try:
        trainer.run()
    finally:
        trainer.close()
    assert not (root / "run" / "final").exists()
    return root / "run", data, trainer


def test_a_step_checkpoint_exports_as_the_final_export_would(stopped_run, tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    run, _, trainer = stopped_run
    assert main([str(run / "checkpoints" / "step_00000003.pt"), "--out", str(tmp_path / "step3")]) == 0
    assert "exported step 3" in capsys.readouterr().out

    hf = transformers.AutoModelForMaskedLM.from_pretrained(tmp_path / "step3").eval()
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "step3")
    ids = tok(["The module defines a class.", "Return the value of <mask>."], padding=True, return_tensors="pt")
    trainer.model.eval()
    with torch.no_grad():
        expected = trainer.model(ids["input_ids"], attention_mask=ids["attention_mask"]).logits
        real = ids["attention_mask"].bool()  # ours runs unpadded on the CPU: zeros at padded positions
        torch.testing.assert_close(hf(**ids).logits[real], expected[real], rtol=1e-5, atol=1e-5)

    trainer.export(tmp_path / "final")  # what the run's own export writes at this step
    names = sorted(p.name for p in (tmp_path / "final").iterdir())
    assert sorted(p.name for p in (tmp_path / "step3").iterdir()) == names
    for name in names:
        assert (tmp_path / "step3" / name).read_bytes() == (tmp_path / "final" / name).read_bytes(), name


def test_a_run_directory_exports_its_latest_checkpoint(stopped_run, tmp_path, capsys):
    run, _, _ = stopped_run
    assert main([str(run), "--out", str(tmp_path / "latest" / "model")]) == 0
    assert (tmp_path / "latest" / "model" / "model.safetensors").is_file()
    assert "exported step 3" in capsys.readouterr().out


def test_refusals_name_the_problem(stopped_run, tmp_path, capsys):
    run, data, _ = stopped_run
    marker = tmp_path / "pwned"
    write_malicious_checkpoint(tmp_path / "evil" / "step_00000005.pt", marker)
    assert main([str(tmp_path / "evil" / "step_00000005.pt"), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "refusing to load checkpoint" in err and "--trust-checkpoint" in err
    assert not marker.exists(), "exporting ran the checkpoint's code"
    assert main([str(tmp_path / "nowhere.pt"), "--out", str(tmp_path / "o")]) == 2
    assert "does not exist" in capsys.readouterr().err

    state = torch.load(run / "checkpoints" / "step_00000003.pt", weights_only=True)
    state["config"]["data"] = str(tmp_path / "moved")  # the dataset is not where the run saw it
    atomic_torch_save(state, tmp_path / "step_00000003.pt")  # sealed, as roberta_fast writes them
    assert main([str(tmp_path / "step_00000003.pt"), "--out", str(tmp_path / "o")]) == 2
    assert "the run's dataset is not readable here" in capsys.readouterr().err
    argv = [str(tmp_path / "step_00000003.pt"), "--out", str(tmp_path / "o"), "--tokenizer", str(data / "tokenizer")]
    assert main(argv) == 0 and (tmp_path / "o" / "tokenizer.json").is_file()

    state = torch.load(run / "checkpoints" / "step_00000003.pt", weights_only=True)
    del state["model"]["roberta.embeddings.word_embeddings.weight"]  # another version's, or an edited one
    (tmp_path / "old").mkdir()
    atomic_torch_save(state, tmp_path / "old" / "step_00000003.pt")
    assert main([str(tmp_path / "old" / "step_00000003.pt"), "--out", str(tmp_path / "o2")]) == 2
    assert ("the checkpoint's model lacks ['roberta.embeddings.word_embeddings.weight']"
            in capsys.readouterr().err) and not (tmp_path / "o2").exists()


@pytest.mark.parametrize("edit, message", [
    (lambda s: s.update(config="oops"), "its 'config' is str"),
    (lambda s: s.update(model_config=[1, 2]), "its 'model_config' is list"),
    (lambda s: s.update(model=[1]), "its 'model' is list"),
    (lambda s: s["model"].update({"roberta.pooler": [1]}), "its model weight 'roberta.pooler' is list"),
    (lambda s: s.update(step="3"), "its 'step' is str"),
    (lambda s: s.update(labels=["a", "b"], task="evil"), "fine-tuning task 'evil', which this roberta_fast does not have"),
    (lambda s: s["config"].update(data=7), "names its tokenizer as 7, not a path"),
])
def test_a_checkpoint_with_wrong_typed_fields_is_refused_in_one_line(stopped_run, tmp_path, capsys, edit, message):
    """A checkpoint from someone else loads under weights_only with any plain containers in its fields:
    the export says which one is wrong (exit 2), not a KeyError / TypeError traceback."""
    run, _, _ = stopped_run
    state = torch.load(run / "checkpoints" / "step_00000003.pt", weights_only=True)
    edit(state)
    atomic_torch_save(state, tmp_path / "step_00000003.pt")  # sealed: it passes the checksum
    assert main([str(tmp_path / "step_00000003.pt"), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("error: ") and not (tmp_path / "o").exists()


def test_a_fine_tuning_checkpoint_naming_no_tokenizer_asks_for_one():
    from roberta_fast.export import run_tokenizer

    with pytest.raises(ValueError, match="names no model or tokenizer: pass --tokenizer"):
        run_tokenizer({"labels": ["a", "b"], "config": {"model": ""}})
    assert run_tokenizer({"labels": ["a", "b"], "config": {"model": "m", "tokenizer": None}}) == "m"


def test_an_out_holding_anything_but_an_export_is_refused_and_kept(stopped_run, tmp_path, capsys, monkeypatch):
    """The export replaces --out whole: the run directory itself (checkpoints, metrics), a file or the
    current directory once were deleted or replaced. Only a new, empty or earlier export's directory is."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(stopped_run[0], run)
    before = sorted(p.name for p in run.iterdir())
    assert main([str(run), "--out", str(run)]) == 2
    assert "holds checkpoints" in capsys.readouterr().err and sorted(p.name for p in run.iterdir()) == before
    (tmp_path / "notes.txt").write_text("mine")
    assert main([str(run), "--out", str(tmp_path / "notes.txt")]) == 2
    assert "is a file" in capsys.readouterr().err and (tmp_path / "notes.txt").read_text() == "mine"
    monkeypatch.chdir(tmp_path / "run" / "checkpoints")
    assert main([str(run), "--out", ".."]) == 2 and "current directory" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    for out in ("empty", "empty"):  # an empty directory, then the export it now holds
        assert main([str(run), "--out", str(tmp_path / out)]) == 0
    assert (tmp_path / "empty" / "model.safetensors").is_file()


def test_a_run_started_with_a_relative_data_path_exports_from_anywhere(stopped_run, tmp_path, monkeypatch):
    """Checkpoints record --data (and finetune's --model / --tokenizer) as absolute paths: export
    from another directory once could not find the dataset's tokenizer."""
    _, data, _ = stopped_run
    monkeypatch.chdir(data.parent)
    trainer = Trainer(TrainConfig.preset("tiny", data=data.name, out=str(tmp_path / "run"), **SMALL),
                      log=lambda *a: None)
    try:
        trainer.save_checkpoint()
    finally:
        trainer.close()
    monkeypatch.chdir(tmp_path)
    assert main([str(tmp_path / "run"), "--out", str(tmp_path / "model")]) == 0
    assert (tmp_path / "model" / "tokenizer.json").is_file()


def test_a_tokenizer_the_model_was_not_trained_with_is_refused(stopped_run, tmp_path, capsys):
    """The export never pairs the model with another tokenizer: one given by --tokenizer, the run's
    dataset remade with another tokenizer, or its tokenizer/ replaced. A checkpoint that records no
    tokenizer (an older roberta_fast's) is checked by its vocabulary size."""
    import shutil

    run, data, _ = stopped_run
    state = torch.load(run / "checkpoints" / "step_00000003.pt", weights_only=True)
    trained = state["tokenizer_hash"]
    assert trained == rf.RobertaTokenizer.from_pretrained(data / "tokenizer").tokenizer_hash
    other = tmp_path / "other"
    with warnings.catch_warnings():  # fewer ids than asked: as well
        warnings.simplefilter("ignore")
        rf.RobertaTokenizer.train_from_iterator(["other text entirely"] * 3, vocab_size=300).save(other)

    def export(state, *argv):
        atomic_torch_save(state, tmp_path / "step_00000003.pt")
        assert main([str(tmp_path / "step_00000003.pt"), "--out", str(tmp_path / "o"), *argv]) == 2
        return capsys.readouterr().err

    err = export(state, "--tokenizer", str(other))
    assert f"--tokenizer {str(other)!r} is tokenizer" in err and f"trained on ids of tokenizer {trained[:12]}" in err
    remade = {**state, "tokenizer_hash": "0" * 64}  # the dataset now holds another tokenizer's ids
    err = export(remade)
    assert f"the tokenizer of the run's dataset is tokenizer {trained[:12]}, but the checkpoint was trained on " \
           "ids of tokenizer 000000000000: the export would pair the model with a tokenizer it was not " \
           "trained with; pass --tokenizer" in err
    copy = tmp_path / "data"
    shutil.copytree(data, copy)
    shutil.rmtree(copy / "tokenizer")
    shutil.copytree(other, copy / "tokenizer")
    err = export({**state, "config": {**state["config"], "data": str(copy)}})
    assert "the run's dataset is not readable here" in err and "holds tokenizer" in err
    old = {k: v for k, v in state.items() if k != "tokenizer_hash"}
    err = export(old, "--tokenizer", str(other))
    assert f"ids, but the checkpoint's model has vocab_size {state['model_config']['vocab_size']}" in err
    assert not (tmp_path / "o").exists()


# ------------------------------------------------------------------ export for serving
DROPIN = ["RobertaModel", "RobertaForMaskedLM", "RobertaForSequenceClassification", "RobertaForTokenClassification",
          "RobertaForQuestionAnswering", "RobertaForMultipleChoice"]
TINY = dict(vocab_size=67, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=37,
            max_position_embeddings=20, type_vocab_size=3)


def serving_inputs(cls, batch=2, seqlen=7, seed=0):
    """(input_ids, {attention_mask, token_type_ids}) with a padded row; multiple choice gets 3 choices."""
    g = torch.Generator().manual_seed(seed)
    shape = (batch, 3, seqlen) if cls == "RobertaForMultipleChoice" else (batch, seqlen)
    ids = torch.randint(3, TINY["vocab_size"], shape, generator=g)
    mask = torch.ones(shape, dtype=torch.long)
    mask[-1, ..., seqlen - 2:] = 0
    ids[mask == 0] = 1
    return ids, dict(attention_mask=mask, token_type_ids=torch.randint(0, 3, shape, generator=g))


def exportable(cls):
    """A fused-backend model: export traces its reference ops (plain aten, which ONNX takes)."""
    return getattr(rf, cls)(rf.RobertaConfig(**TINY), backend="fused").eval()


def assert_equal_to_eager(model, got, ids, kwargs):
    """`got` (the exported program's outputs, flat) equals the eager model's (reference backend)."""
    model.backend = "reference"
    want = model(ids, **kwargs).to_tuple()
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cls", DROPIN)
def test_torch_export_equals_eager(cls):
    model = exportable(cls)
    ids, kwargs = serving_inputs(cls)
    got = torch.export.export(model, (ids,), kwargs).module()(ids, **kwargs)
    assert_equal_to_eager(model, got.to_tuple(), ids, kwargs)
    assert type(got) is type(model(ids, **kwargs))  # the output class comes back, not a flat tuple


@pytest.mark.parametrize("cls, dynamic", [(cls, cls in ("RobertaModel", "RobertaForMultipleChoice")) for cls in DROPIN])
def test_onnx_export_runs_in_onnxruntime_as_eager(cls, dynamic, tmp_path):
    """Every class exports; the encoder and multiple choice (the README's dims: choices are axis 1 there)
    with dynamic batch and sequence length run at another shape."""
    for package in ("onnx", "onnxscript", "onnxruntime"):
        pytest.importorskip(package, reason=f"ONNX export needs {package}: pip install -e .[export]")
    model = exportable(cls)
    ids, kwargs = serving_inputs(cls)
    dynamic_shapes = None
    if dynamic:
        # the README's dims: min=2 for torch < 2.10 (whose exporter fails on sizes that may be 1), max for
        # 2.6 (an unbounded batch fails there); the program still runs one row, and one token (below)
        batch = torch.export.Dim("batch", min=2, max=4096)
        seqlen = torch.export.Dim("seqlen", min=2, max=model.config.max_seq_len)
        dims = {0: batch, 1: torch.export.Dim("choices"), 2: seqlen} if cls == "RobertaForMultipleChoice" \
            else {0: batch, 1: seqlen}
        dynamic_shapes = {"input_ids": dims, **{k: dims for k in kwargs}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.onnx's notes on its own internals
        program = torch.onnx.export(model, (ids,), kwargs=kwargs, dynamo=True, verbose=False,
                                    dynamic_shapes=dynamic_shapes)
    program.save(tmp_path / "model.onnx")
    checks = [serving_inputs(cls, batch=b, seqlen=n, seed=1) for b, n in ((3, 11), (1, 5), (2, 1))] if dynamic \
        else [(ids, kwargs)]  # dynamic: other shapes than the traced one, one row and one token among them
    for ids, kwargs in checks:
        assert_equal_to_eager(model, program(ids, **kwargs), ids, kwargs)


@pytest.mark.parametrize("cls", DROPIN)
def test_torch_jit_trace_and_torchscript_onnx_export_equal_eager(cls, tmp_path):
    """Serving tools that still call torch.jit.trace or torch.onnx.export(dynamo=False) get every
    class: the trace returns the outputs' to_tuple() (TorchScript takes tuples), the ONNX graph, with
    dynamic axes, runs in onnxruntime at another shape (the LayerNorm once traced x.shape[-1], which
    the exporter refused); both trace the reference ops, whatever the backend."""
    model = exportable(cls)
    ids, kwargs = serving_inputs(cls)
    inputs = {"input_ids": ids, **kwargs}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tracer's notes on Python values it records as constants
        traced = torch.jit.trace(model, example_kwarg_inputs=inputs)
    assert_equal_to_eager(model, traced(**inputs), ids, kwargs)
    ort = pytest.importorskip("onnxruntime", reason="ONNX export needs onnxruntime: pip install -e .[export]")
    pytest.importorskip("onnx", reason="ONNX export needs onnx: pip install -e .[export]")
    model.backend = "fused"
    names = [n for n in inspect.signature(model.forward).parameters if n in inputs]  # the graph's input order
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (inputs,), tmp_path / "model.onnx", dynamo=False, input_names=names,
                          dynamic_axes={k: {i: f"{k}_{i}" for i in range(v.dim())} for k, v in inputs.items()})
    session = ort.InferenceSession(str(tmp_path / "model.onnx"), providers=["CPUExecutionProvider"])
    ids, kwargs = serving_inputs(cls, batch=3, seqlen=11, seed=1)  # another shape than the traced one
    got = session.run(None, {"input_ids": ids.numpy(), **{k: v.numpy() for k, v in kwargs.items()}})
    assert_equal_to_eager(model, [torch.from_numpy(g) for g in got], ids, kwargs)
