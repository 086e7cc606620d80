"""python -m roberta_fast.finetune: learns a small synthetic task, resumes, exports for transformers."""
import csv
import json
import random
import signal
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from malicious_checkpoint import write_malicious_checkpoint

import roberta_fast as rf
from roberta_fast.finetune import FinetuneConfig, Finetuner, accuracy_and_macro_f1, default_lr, encode, main

WORDS = "alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega river stone cloud".split()


def sentence(rng, label):
    """Random words with the class word ('sunny' or 'rainy') somewhere inside."""
    words = rng.choices(WORDS, k=rng.randint(3, 9))
    words.insert(rng.randint(0, len(words)), "sunny" if label == "pos" else "rainy")
    return " ".join(words)


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    """A random-init tiny RoBERTa checkpoint with its tokenizer, and train/valid files."""
    root = tmp_path_factory.mktemp("finetune")
    rng = random.Random(0)
    rows = [(sentence(rng, label), label) for label in ["pos", "neg"] * 120]
    tok = rf.RobertaTokenizer.train_from_iterator([t for t, _ in rows] * 3, vocab_size=600, min_frequency=1)
    cfg = rf.RobertaConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=1, num_attention_heads=1,
                           intermediate_size=64, max_position_embeddings=34)
    torch.manual_seed(0)
    rf.RobertaForMaskedLM(cfg).save_pretrained(root / "model")
    tok.save(root / "model")
    with open(root / "train.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["sentence", "label"])
        writer.writerows(rows[:200])
    with open(root / "valid.jsonl", "w") as f:
        for text, label in rows[200:]:
            f.write(json.dumps({"sentence": text, "label": label}) + "\n")
    return root


def config(task, out, **overrides):
    fields = dict(model=str(task / "model"), train=str(task / "train.csv"), valid=str(task / "valid.jsonl"),
                  out=str(out), text_field="sentence", max_len=32, epochs=6, batch_size=16, lr=2e-3,
                  warmup_ratio=0.1, device="cpu", precision="fp32", log_every=1)
    return FinetuneConfig(**{**fields, **overrides})


def test_learns_the_task_and_exports_for_transformers(task, tmp_path):
    transformers = pytest.importorskip("transformers")
    result = Finetuner(config(task, tmp_path / "run"), log=lambda *_: None).run()
    assert result["best"]["accuracy"] >= 0.9, result
    exported = tmp_path / "run" / "model"
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(exported).eval()
    assert hf.config.id2label == {0: "neg", 1: "pos"}
    hf_tok = transformers.AutoTokenizer.from_pretrained(exported)
    batch = hf_tok(["sunny river stone", "cloud rainy"], padding=True, return_tensors="pt")
    ours = rf.RobertaForSequenceClassification.from_pretrained(exported).eval()
    with torch.no_grad():
        torch.testing.assert_close(ours(batch["input_ids"], attention_mask=batch["attention_mask"]).logits,
                                   hf(**batch).logits, rtol=1e-5, atol=1e-6)
        assert hf(**batch).logits.argmax(-1).tolist() == [1, 0]


def plain_adamw_loop(task, cfg) -> float:
    """The loop a user writes by hand: torch.optim.AdamW, linear warmup and decay, shuffled
    padded batches, mean cross-entropy; best validation accuracy over the epochs."""
    tok = rf.RobertaTokenizer.from_pretrained(task / "model")
    with open(task / "train.csv", newline="") as f:
        train = [(tok.encode(r["sentence"]), int(r["label"] == "pos")) for r in csv.DictReader(f)]
    with open(task / "valid.jsonl") as f:
        valid = [(tok.encode(r["sentence"]), int(r["label"] == "pos")) for r in map(json.loads, f)]

    def batch(rows):
        x = torch.ones(len(rows), max(len(ids) for ids, _ in rows), dtype=torch.long)  # pad id 1
        for i, (ids, _) in enumerate(rows):
            x[i, :len(ids)] = torch.tensor(ids)
        return x, (x != 1).long(), torch.tensor([label for _, label in rows])

    torch.manual_seed(cfg.seed)
    with warnings.catch_warnings():  # the new head and the unused MLM head are expected
        warnings.simplefilter("ignore")
        model = rf.RobertaForSequenceClassification.from_pretrained(task / "model", num_labels=2)
    params = list(model.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
                             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                            lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    total = -(-len(train) // cfg.batch_size) * cfg.epochs
    warmup = round(cfg.warmup_ratio * total)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warmup if s < warmup else (total - s) / (total - warmup))
    best = 0.0
    for _ in range(cfg.epochs):
        model.train()
        order = torch.randperm(len(train)).tolist()
        for start in range(0, len(train), cfg.batch_size):
            x, mask, y = batch([train[i] for i in order[start:start + cfg.batch_size]])
            model(x, attention_mask=mask, labels=y).loss.backward()
            opt.step()
            sched.step()
            opt.zero_grad()
        model.eval()
        x, mask, y = batch(valid)
        with torch.no_grad():
            best = max(best, (model(x, attention_mask=mask).logits.argmax(-1) == y).float().mean().item())
    return best


def test_defaults_learn_as_well_as_a_plain_adamw_loop(task, tmp_path):
    """Issue 19: with only the data given, the CLI learned nothing on a small model (lr 2e-5 for
    3 epochs: chance, one class predicted). Its defaults must now learn this separable task,
    and as well as a hand-written AdamW loop on the same model, data and hyperparameters
    (those the CLI chose, and said it chose)."""
    lines = []
    job = Finetuner(FinetuneConfig(model=str(task / "model"), train=str(task / "train.csv"),
                                   valid=str(task / "valid.jsonl"), text_field="sentence", out=str(tmp_path / "run"),
                                   device="cpu"), log=lines.append)
    ours = job.run()["best"]["accuracy"]
    plain = plain_adamw_loop(task, job.cfg)
    assert plain >= 0.9, f"the plain loop reaches {plain} at the CLI's defaults: they do not suit a small model"
    assert ours >= plain - 0.05, f"the CLI reaches {ours}, a plain AdamW loop {plain}"
    assert any(line.startswith("--lr not given: 0.001 for hidden size 32") for line in lines), lines


def test_a_run_that_learns_nothing_says_so(task, tmp_path):
    lines = []
    Finetuner(config(task, tmp_path / "run", lr=1e-6, epochs=1), log=lines.append).run()
    assert any(line.startswith("warning: no epoch beat always predicting the most frequent class") and
               "larger --lr (this run: 1e-06)" in line for line in lines), lines


def test_default_lr_follows_the_paper_at_base_and_large():
    assert default_lr(768) == 2e-5
    assert 1e-5 <= default_lr(1024) <= 1.2e-5
    assert default_lr(128) == pytest.approx(7.2e-4) and default_lr(32) == 1e-3


def test_resume_mid_run_matches_an_uninterrupted_run(task, tmp_path):
    quiet = dict(log=lambda *_: None)
    full = Finetuner(config(task, tmp_path / "full", epochs=2), **quiet)
    full.run()
    stopped = Finetuner(config(task, tmp_path / "split", epochs=2, stop_after=17, keep_checkpoints=2), **quiet).run()
    assert stopped == {"stopped": "--stop-after", "step": 17, "signal": None}  # in epoch 2 (13 steps each)
    kept = sorted(p.name for p in (tmp_path / "split" / "checkpoints").glob("step_*.pt"))
    assert kept == ["step_00000013.pt", "step_00000017.pt"]  # --keep-checkpoints 2: epoch 1's end and the stop
    assert [p.name for p in (tmp_path / "full" / "checkpoints").glob("step_*.pt")] == ["step_00000026.pt"]
    resumed = Finetuner(config(task, tmp_path / "split", epochs=2), **quiet)
    resumed.run()
    assert resumed.step == full.step
    for key, value in full.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[key], value), key


@pytest.mark.parametrize("stop_after", [13, 26])  # the last step of epoch 1, of the whole run
def test_a_stop_on_an_epochs_last_step_evaluates_that_epoch_when_resumed(task, tmp_path, stop_after):
    quiet = dict(log=lambda *_: None)
    full = Finetuner(config(task, tmp_path / "full", epochs=2), **quiet).run()
    Finetuner(config(task, tmp_path / "split", epochs=2, stop_after=stop_after), **quiet).run()
    resumed = Finetuner(config(task, tmp_path / "split", epochs=2), **quiet).run()
    assert resumed == full  # the same best epoch and last evaluation
    evals = [r for r in rf.metrics.read_metrics(tmp_path / "split" / "metrics.jsonl") if r["kind"] == "eval"]
    assert [(r["step"], r["epoch"]) for r in evals] == [(13, 1), (26, 2)]
    assert (tmp_path / "split" / "model" / "config.json").is_file()


def test_resume_reads_the_checkpoint_onto_the_cpu(task, tmp_path, monkeypatch):
    """On a GPU the checkpoint must still be read onto the CPU: its RNG states must stay
    CPU ByteTensors (torch.set_rng_state and torch.cuda.set_rng_state refuse others);
    load_state_dict moves the weights and Adam moments to the model's device."""
    import roberta_fast.finetune as ft

    Finetuner(config(task, tmp_path / "run", epochs=1, stop_after=2), log=lambda *_: None).run()
    resumed = Finetuner(config(task, tmp_path / "run", epochs=1), log=lambda *_: None)
    resumed.device = torch.device("cuda")  # as on a GPU machine: nothing below runs on it
    seen = []

    class Loaded(Exception):
        pass

    def spy(path, map_location="cpu", **kwargs):
        seen.append(map_location)
        raise Loaded

    monkeypatch.setattr(ft, "load_checkpoint", spy)
    with pytest.raises(Loaded):
        resumed.run()
    assert len(seen) == 1 and torch.device(seen[0]).type == "cpu", seen


def test_resume_never_runs_code_from_a_checkpoint(task, tmp_path, capsys):
    marker = tmp_path / "pwned"
    write_malicious_checkpoint(tmp_path / "run" / "checkpoints" / "step_00000005.pt", marker)
    argv = ["--model", str(task / "model"), "--train", str(task / "train.csv"), "--valid", str(task / "valid.jsonl"),
            "--text-field", "sentence", "--max-len", "32", "--device", "cpu", "--out", str(tmp_path / "run")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "refusing to load checkpoint" in err and "--trust-checkpoint" in err
    assert not marker.exists(), "resuming ran the checkpoint's code"


def test_a_fine_tuned_model_with_another_head_needs_reinit_head(task, tmp_path):
    """--model a fine-tuned model whose head has another label count: refused with the CLI's fix
    (--reinit-head), which starts a new head as transformers' ignore_mismatched_sizes does."""
    three = tmp_path / "three.csv"
    three.write_text("sentence,label\n" + "".join(f"word{i} word,{'abc'[i % 3]}\n" for i in range(12)))
    two = rf.RobertaForSequenceClassification.from_pretrained(task / "model", num_labels=2)
    two.save_pretrained(tmp_path / "two")
    rf.RobertaTokenizer.from_pretrained(task / "model").save(tmp_path / "two")
    run = dict(model=str(tmp_path / "two"), train=str(three), valid=None)
    with pytest.raises(ValueError, match=r"task head does not fit this task \(3 classes .*\): checkpoint weight "
                                         r"classifier\.out_proj\.\w+ has shape \(2.*pass --reinit-head"):
        Finetuner(config(task, tmp_path / "a", **run), log=lambda *_: None)
    logged = []
    finetuner = Finetuner(config(task, tmp_path / "b", reinit_head=True, **run), log=logged.append)
    assert finetuner.model.num_labels == 3 and any("newly initialised" in line for line in logged), logged


def head_model(task, directory, id2label, bias):
    """A classifier of --model's encoder whose head names id2label and always predicts class `bias` (its id)."""
    with warnings.catch_warnings():  # the new head, the unused MLM head
        warnings.simplefilter("ignore")
        model = rf.RobertaForSequenceClassification.from_pretrained(task / "model", id2label=id2label)
    with torch.no_grad():
        model.classifier.out_proj.weight.zero_()
        model.classifier.out_proj.bias.copy_(torch.tensor([10.0 if i == bias else -10.0 for i in id2label]))
    model.save_pretrained(directory)
    rf.RobertaTokenizer.from_pretrained(task / "model").save(directory)
    return model


def test_a_fine_tuned_head_keeps_its_label_order_or_is_refused(task, tmp_path):
    """--model a classifier whose id2label names the data's labels in another order than sorted: its
    rows keep their classes (as run_glue), so it scores as before and exports its own id2label. A head
    naming other labels, though it fits, is refused (--reinit-head starts a new one); transformers'
    placeholder names LABEL_0, LABEL_1 keep the data's sorted order and the head."""
    only_pos = tmp_path / "pos.jsonl"
    with open(task / "valid.jsonl") as f:
        only_pos.write_text("".join(line for line in f if json.loads(line)["label"] == "pos"))
    quiet = dict(log=lambda *_: None)
    head_model(task, tmp_path / "swapped", {0: "pos", 1: "neg"}, bias=0)  # always "pos"
    tuner = Finetuner(config(task, tmp_path / "a", model=str(tmp_path / "swapped"), valid=str(only_pos)), **quiet)
    assert tuner.names == ["pos", "neg"] and tuner.model.config.id2label == {0: "pos", 1: "neg"}
    assert tuner.evaluate()["accuracy"] == 1.0
    cont = config(task, tmp_path / "e", model=str(tmp_path / "swapped"), valid=str(only_pos), epochs=1, lr=1e-12)
    Finetuner(FinetuneConfig(**{**cont.__dict__, "stop_after": 2}), **quiet).run()
    assert Finetuner(cont, **quiet).run()["best"]["accuracy"] == 1.0  # resumed: the same labels, the same order
    exported = json.loads((tmp_path / "e" / "model" / "config.json").read_text())
    assert exported["id2label"] == {"0": "pos", "1": "neg"}
    head_model(task, tmp_path / "other", {0: "good", 1: "bad"}, bias=0)
    with pytest.raises(ValueError, match=r"head was trained on the labels \['good', 'bad'\] .*this data has "
                                         r"\['neg', 'pos'\].*Pass --reinit-head"):
        Finetuner(config(task, tmp_path / "b", model=str(tmp_path / "other")), **quiet)
    logged = []
    tuner = Finetuner(config(task, tmp_path / "c", model=str(tmp_path / "other"), reinit_head=True), log=logged.append)
    assert tuner.names == ["neg", "pos"] and any("--reinit-head: a new head" in line for line in logged), logged
    assert tuner.model.classifier.out_proj.bias.abs().max() == 0  # initialised anew, not the saved +-10
    head_model(task, tmp_path / "placeholders", {0: "LABEL_0", 1: "LABEL_1"}, bias=1)
    tuner = Finetuner(config(task, tmp_path / "d", model=str(tmp_path / "placeholders"), valid=str(only_pos)), **quiet)
    assert tuner.names == ["neg", "pos"] and tuner.evaluate()["accuracy"] == 1.0


def test_wandb_project_without_wandb_is_refused_before_the_run(task, tmp_path, monkeypatch, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "wandb", None)  # not importable, whether or not it is installed
    argv = ["--model", str(task / "model"), "--train", str(task / "train.csv"), "--out", str(tmp_path / "run")]
    assert main([*argv, "--wandb-project", "rf"]) == 2
    assert "--wandb-project rf needs the wandb package: pip install wandb" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_bad_input_names_the_problem(task, tmp_path, capsys):
    bad = tmp_path / "bad.csv"
    bad.write_text("text,label\nhello,pos\n")
    with pytest.raises(ValueError, match=r"bad.csv:2: missing \['sentence'\]"):
        Finetuner(config(task, tmp_path / "x", train=str(bad)), log=lambda *_: None)
    assert main(["--model", str(task / "model"), "--train", str(tmp_path / "none.csv")]) == 2
    unlabeled = tmp_path / "unlabeled.csv"
    unlabeled.write_text("sentence,label\nsunny river,pos\ncloud rainy,\nstone,neg\n")
    with pytest.raises(ValueError, match=r"unlabeled.csv:3: the label \('label'\) is empty on this line"):
        Finetuner(config(task, tmp_path / "x", train=str(unlabeled)), log=lambda *_: None)
    blank = tmp_path / "blank.jsonl"  # a text column empty on every row: the wrong column
    blank.write_text('{"sentence": "", "label": "pos"}\n{"sentence": " ", "label": "neg"}\n')
    with pytest.raises(ValueError, match=r"blank.jsonl: the column 'sentence' is empty on every row"):
        Finetuner(config(task, tmp_path / "x", train=str(blank)), log=lambda *_: None)
    too_long = ["--model", str(task / "model"), "--train", str(task / "train.csv"), "--text-field", "sentence",
                "--max-len", "40", "--device", "cpu", "--out", str(tmp_path / "y")]
    assert main(too_long) == 2
    assert "--max-len 40 exceeds the model's 32 positions; use --max-len 32 or less" in capsys.readouterr().err


def test_labels_only_in_valid_a_one_example_file_and_empty_qa_answers_are_refused(task, tmp_path):
    """Each would train something other than asked, silently: a class the head never trains (a misspelt
    dev label), no training data left after the hold-out, QA settings under which every answer is empty."""
    dev = tmp_path / "dev.csv"
    dev.write_text("sentence,label\nsunny river,pos\ncloud stone,neutral\ncloud,neutral\n")
    with pytest.raises(ValueError, match=r"dev.csv has labels that .*train.csv never has: 'neutral' \(2x\); "
                                         r"the training data's are \['neg', 'pos'\]"):
        Finetuner(config(task, tmp_path / "a", valid=str(dev)), log=lambda *_: None)
    one = tmp_path / "one.csv"
    one.write_text("sentence,label\nsunny river,pos\n")
    with pytest.raises(ValueError, match=r"one.csv holds 1 example: too few to hold 10% out .* pass --valid"):
        Finetuner(config(task, tmp_path / "b", train=str(one), valid=None), log=lambda *_: None)
    for bad in (dict(n_best=0), dict(max_answer_len=0)):
        with pytest.raises(ValueError, match=r"need --n-best >= 1 and --max-answer-len >= 1"):
            Finetuner(config(task, tmp_path / "c", **bad), log=lambda *_: None)
    with pytest.raises(ValueError, match=r"--problem-type 'regresion': give one of auto, single_label_classification"):
        Finetuner(config(task, tmp_path / "d", problem_type="regresion"), log=lambda *_: None)


def scores_task(task, tmp_path, scores: dict) -> tuple[str, str]:
    """The fixture's sentences as a GLUE STS-B-style .tsv pair (train, dev): a score per class word."""
    paths = []
    for split, source in (("train", task / "train.csv"), ("dev", task / "valid.jsonl")):
        rows = (csv.DictReader(open(source, newline="")) if split == "train"
                else map(json.loads, open(source)))
        path = tmp_path / f"sts-{split}.tsv"
        path.write_text("index\tsentence1\tsentence2\tscore\n" + "".join(
            f"{i}\tcloud\t{r['sentence']}\t{scores[r['label']]}\n" for i, r in enumerate(rows)))
        paths.append(str(path))
    return paths


def test_numeric_scores_train_a_regression_as_run_glue(task, tmp_path):
    """GLUE's STS-B: scores such as "4.200" make a regression (run_glue decides so from the label column's
    type): one output trained on the MSE, Pearson and Spearman per epoch, exported with problem_type
    "regression" so that transformers computes the same loss and the pipeline returns the raw score."""
    transformers = pytest.importorskip("transformers")
    train, dev = scores_task(task, tmp_path, {"pos": "4.200", "neg": "0.800"})
    cfg = config(task, tmp_path / "run", train=train, valid=dev, text_field="sentence1", pair_field="sentence2",
                 label_field="score", epochs=6, lr=1e-2)
    tuner = Finetuner(cfg, log=lambda *_: None)
    assert tuner.task.regression and tuner.model.num_labels == 1
    batch = next(tuner.task.batches(np.arange(4), 4, tuner.pad_id))
    assert batch["labels"].dtype == torch.float32 and batch["labels"].tolist() == pytest.approx(
        [tuner.task.train_labels[i] for i in range(4)])
    result = tuner.run()
    assert set(result["last"]) == {"loss", "pearson", "spearman"}
    assert result["best"]["pearson"] >= 0.9 and result["best"]["spearman"] >= 0.8, result
    exported = tmp_path / "run" / "model"
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(exported).eval()
    assert hf.config.problem_type == "regression" and hf.config.num_labels == 1
    hf_tok = transformers.AutoTokenizer.from_pretrained(exported)
    inputs = hf_tok(["cloud", "cloud"], ["sunny river", "rainy stone"], padding=True, return_tensors="pt")
    labels = torch.tensor([4.2, 0.8])
    with torch.no_grad():
        expected = hf(**inputs, labels=labels)
        ours = rf.RobertaForSequenceClassification.from_pretrained(exported).eval()(**inputs, labels=labels)
    torch.testing.assert_close(ours.logits, expected.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours.loss, ((expected.logits[:, 0] - labels) ** 2).mean(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(expected.loss, ours.loss, rtol=1e-5, atol=1e-6)
    score = transformers.pipeline("text-classification", model=str(exported))({"text": "cloud", "text_pair": "sunny"})
    assert score["score"] == pytest.approx(float(expected.logits[0, 0]), abs=0.5)  # a raw score, not a softmax


def test_integer_labels_stay_classes_unless_problem_type_says_regression(task, tmp_path):
    from roberta_fast.tasks import ClassifyTask

    train, dev = scores_task(task, tmp_path, {"pos": "4", "neg": "1"})
    fields = dict(train=train, valid=dev, text_field="sentence1", pair_field="sentence2", label_field="score")
    assert ClassifyTask(config(task, tmp_path, **fields)).names == ["1", "4"]
    assert ClassifyTask(config(task, tmp_path, problem_type="regression", **fields)).regression
    train, dev = scores_task(task, tmp_path, {"pos": "4.5", "neg": "1.5"})
    fields.update(train=train, valid=dev)
    assert ClassifyTask(config(task, tmp_path, problem_type="single_label_classification", **fields)).names == [
        "1.5", "4.5"]
    with pytest.raises(ValueError, match=r"train.csv: label 'pos' is not a finite number; --problem-type "
                                         r"regression needs a numeric score on every row"):
        ClassifyTask(config(task, tmp_path, problem_type="regression", valid=None))


def test_correlations_follow_their_definitions():
    from roberta_fast.tasks import average_ranks, pearson, spearman

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=50), rng.normal(size=50)
    assert pearson(x, y) == pytest.approx(np.corrcoef(x, y)[0, 1])
    assert pearson(x, np.full(50, 3.0)) == 0.0  # undefined: never NaN (the best epoch compares with >)
    assert average_ranks(np.array([3.0, 1.0, 2.0, 2.0, 5.0])).tolist() == [3.0, 0.0, 1.5, 1.5, 4.0]
    assert spearman(x, np.exp(x)) == pytest.approx(1.0) and spearman(x, -x ** 3) == pytest.approx(-1.0)
    ties_x, ties_y = np.array([1.0, 2.0, 2.0, 3.0]), np.array([1.0, 3.0, 2.0, 4.0])
    assert spearman(ties_x, ties_y) == pytest.approx(np.corrcoef([0, 1.5, 1.5, 3], [0, 2, 1, 3])[0, 1])


def test_max_len_defaults_to_the_models_limit(task, tmp_path):
    """The model has 34 positions (32 tokens: positions start after the pad id), so a
    default --max-len of 256 would be refused; the default is the model's own limit."""
    job = Finetuner(config(task, tmp_path / "run", max_len=None, epochs=1), log=lambda *_: None)
    assert job.max_len == 32
    long_text = [(" ".join(["alpha"] * 100), None, "pos")]
    assert len(job.task.train_ids[0]) <= 32 and len(encode(job.tokenizer, long_text, job.max_len)[0]) == 32


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_an_interrupted_run_saves_and_exits_with_128_plus_the_signal(task, tmp_path, monkeypatch, sig):
    """Scripts and schedulers tell an interrupted run from a finished one by its status."""
    step = Finetuner.train_step

    def interrupted_step(self, *args):
        if self.step == 2:
            signal.raise_signal(sig)  # as a scheduler's SIGTERM or a Ctrl-C during step 3
        return step(self, *args)

    monkeypatch.setattr(Finetuner, "train_step", interrupted_step)
    argv = ["--model", str(task / "model"), "--train", str(task / "train.csv"), "--valid", str(task / "valid.jsonl"),
            "--text-field", "sentence", "--device", "cpu", "--out", str(tmp_path / "run")]
    assert main(argv) == 128 + sig
    assert (tmp_path / "run" / "checkpoints" / "step_00000003.pt").is_file()
    assert not (tmp_path / "run" / "model").exists()


def test_out_of_memory_names_grad_accum_which_resumes_with_the_same_schedule(task, tmp_path, monkeypatch, capsys):
    """A step that does not fit in the GPU's memory (faked) exits 1 naming --grad-accum; a run stopped
    at step 3 resumes under another --grad-accum (the same updates), and --grad-accum past the batch
    is refused."""
    step = Finetuner.train_step

    def out_of_memory(self, *args):
        if self.step == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB.")
        return step(self, *args)

    monkeypatch.setattr(Finetuner, "train_step", out_of_memory)
    argv = ["--model", str(task / "model"), "--train", str(task / "train.csv"), "--valid", str(task / "valid.jsonl"),
            "--text-field", "sentence", "--device", "cpu", "--epochs", "1", "--out", str(tmp_path / "run")]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "CUDA out of memory. Tried to allocate 1.00 GiB. A micro-batch of 16 examples does not fit in memory: " \
           "rerun with --grad-accum 2 (the same updates" in err and "--activation-checkpointing" in err, err
    monkeypatch.setattr(Finetuner, "train_step", step)
    assert main(argv + ["--grad-accum", "2", "--stop-after", "3"]) == 0
    assert (tmp_path / "run" / "checkpoints" / "step_00000003.pt").is_file()
    assert main(argv + ["--grad-accum", "4"]) == 0
    assert "resumed from" in capsys.readouterr().out and (tmp_path / "run" / "model").is_dir()
    assert main(argv + ["--grad-accum", "17", "--out", str(tmp_path / "other")]) == 2
    assert ("--grad-accum 17: each step's --batch-size 16 examples are split into --grad-accum micro-batches, so "
            "give --grad-accum 1 to 16\n") in capsys.readouterr().err


def dropout_free(task, directory):
    """task's model with its dropout off: runs that split batches differently then compute the same."""
    import shutil

    shutil.copytree(task / "model", directory)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "hidden_dropout_prob": 0.0,
                                                       "attention_probs_dropout_prob": 0.0}))
    return directory


def _torchrun_worker(rank, world, port, cfgs, logs):
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    lines, tuner = [], None
    try:
        for cfg in cfgs:  # one job after another, in one process group
            tuner = Finetuner(cfg, log=lines.append)
            tuner.run()
            tuner.lock and tuner.lock.release()
        (Path(logs) / f"rank{rank}.json").write_text(json.dumps(lines))
        tuner.dist.barrier()
    finally:
        tuner and tuner.close()


def train_losses(out):
    return [(r["step"], r["loss"]) for r in rf.metrics.read_metrics(out / "metrics.jsonl") if r["kind"] == "train"]


def test_torchrun_fine_tunes_as_one_process_and_resumes_at_any_process_count(task, tmp_path):
    """Two processes (gloo) with --batch-size 16 --grad-accum 2 (micro-batches of 4) compute one process's
    run: the same losses at every step and the same evaluations. Rank 0 alone writes the log, checkpoints and
    export, and speaks; a run stopped there resumes under two processes or under one (dropout streams then
    reseeded, said once)."""
    import shutil

    import torch.multiprocessing as mp

    model = dropout_free(task, tmp_path / "model")
    quiet = dict(log=lambda *_: None)
    one = Finetuner(config(task, tmp_path / "one", model=str(model), epochs=4), **quiet).run()
    two = [config(task, tmp_path / "two", model=str(model), epochs=4, grad_accum=2, stop_after=5),
           config(task, tmp_path / "two", model=str(model), epochs=4, grad_accum=2)]
    mp.spawn(_torchrun_worker, args=(2, free_port(), two[:1], str(tmp_path)), nprocs=2)
    shutil.copytree(tmp_path / "two", tmp_path / "then-one")
    mp.spawn(_torchrun_worker, args=(2, free_port(), two[1:], str(tmp_path)), nprocs=2)
    lines = json.loads((tmp_path / "rank0.json").read_text())
    assert json.loads((tmp_path / "rank1.json").read_text()) == []
    assert f"resumed from {tmp_path / 'two' / 'checkpoints' / 'step_00000005.pt'} at step 5" in lines
    assert any(line.startswith("best epoch") for line in lines)
    single = train_losses(tmp_path / "one")
    assert [step for step, _ in train_losses(tmp_path / "two")] == [step for step, _ in single] == list(range(1, 53))
    assert [loss for _, loss in train_losses(tmp_path / "two")] == pytest.approx([loss for _, loss in single],
                                                                                 rel=1e-5)
    evals = {run: [r for r in rf.metrics.read_metrics(tmp_path / run / "metrics.jsonl") if r["kind"] == "eval"]
             for run in ("one", "two")}
    assert [(r["step"], r["accuracy"]) for r in evals["two"]] == [(r["step"], r["accuracy"]) for r in evals["one"]]
    assert [r["loss"] for r in evals["two"]] == pytest.approx([r["loss"] for r in evals["one"]], rel=1e-5)
    assert evals["one"][-1]["accuracy"] == one["last"]["accuracy"] >= 0.9
    assert sorted(p.name for p in (tmp_path / "two" / "checkpoints").glob("*.pt")) == ["step_00000052.pt"]
    assert (tmp_path / "two" / "model" / "model.safetensors").is_file()
    lines = []
    Finetuner(config(task, tmp_path / "then-one", model=str(model), epochs=4), log=lines.append).run()
    assert "note: the checkpoint was written by 2 processes, this run has 1: dropout RNG streams are reseeded" \
        in lines
    assert [loss for _, loss in train_losses(tmp_path / "then-one")] == pytest.approx(
        [loss for _, loss in single], rel=1e-5)


def test_the_cli_under_torchrun_speaks_once(task, tmp_path):
    """`torchrun --nproc_per_node 2 -m roberta_fast.finetune` (CPU, gloo): one progress report and one export;
    a flag every rank refuses is said once, by rank 0."""
    import os
    import subprocess
    import sys

    def torchrun(*flags):
        argv = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                str(free_port()), "-m", "roberta_fast.finetune", "--model", str(task / "model"), "--train",
                str(task / "train.csv"), "--valid", str(task / "valid.jsonl"), "--text-field", "sentence",
                "--device", "cpu", "--epochs", "1", "--max-len", "32", "--out", str(tmp_path / "run"), *flags]
        return subprocess.run(argv, capture_output=True, text=True, timeout=300,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})

    bad = torchrun("--grad-accum", "9")
    assert bad.returncode != 0
    assert bad.stderr.count("--grad-accum 9 with 2 processes: each step's --batch-size 16 examples are split into "
                            "2 processes x --grad-accum micro-batches, so give --grad-accum 1 to 8") == 1, bad.stderr
    done = torchrun("--grad-accum", "2")
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("best epoch 1 (by accuracy)") == 1 and done.stdout.count("fine-tuning --task") == 1
    assert (tmp_path / "run" / "model" / "model.safetensors").is_file()


def _locked_out_worker(rank, world, port, cfg, result):
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    try:
        Finetuner(cfg, log=lambda *_: None).close()
        outcome = "started"
    except Exception as err:  # noqa: BLE001 -- recorded for the test
        outcome = f"{type(err).__name__}: {str(err)[:40]}"
    Path(result + f".{rank}").write_text(outcome)


def test_under_torchrun_rank_0_failing_to_start_stops_every_rank_and_a_typo_is_said_once(task, tmp_path):
    """--out held by another run: rank 0 alone takes the lock, and now every rank stops there (the others
    started, read --out's checkpoints and trained into a collective that broke off: gloo's 20-line
    traceback, a hang under NCCL). A mistyped flag is said once, not once per process."""
    import os
    import subprocess
    import sys

    import torch.multiprocessing as mp

    from roberta_fast.trainer import lock_out

    lock = lock_out(tmp_path / "run", lambda *_: None)  # another run's
    try:
        result = str(tmp_path / "outcome")
        mp.spawn(_locked_out_worker, args=(2, free_port(), config(task, tmp_path / "run"), result), nprocs=2)
    finally:
        lock.release()
    assert Path(result + ".0").read_text().startswith("ValueError: another run (pid")
    assert Path(result + ".1").read_text() == "PeerFailed: rank 0 stopped (its error says why)"
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
            "-m", "roberta_fast.finetune", "--model", str(task / "model"), "--batch-sise", "4"]
    typo = subprocess.run(argv, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert typo.stderr.count("unrecognized arguments: --batch-sise") == 1, typo.stderr


def _main_does_worker(rank, world, port, result):
    import os

    from roberta_fast.trainer import Dist, PeerFailed

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    d = Dist()
    d.init(torch.device("cpu"))
    seen = []
    assert d.main_does(lambda: "written") == ("written" if rank == 0 else None)
    for work in (lambda: 1 / 0, lambda: None):
        try:
            d.main_does(work)
            seen.append("went on")
        except (ZeroDivisionError, PeerFailed) as err:
            seen.append(type(err).__name__)
    if rank == 1:  # leaves, as a process killed would: rank 0's next collective breaks off
        Path(result + f".{rank}").write_text(json.dumps(seen))
        os._exit(0)  # (a return would tear down gloo under a live peer: an abort, as a crash might)
    try:
        d.all_reduce(torch.ones(1))
    except PeerFailed as err:
        seen.append(str(err)[:70])
    Path(result + f".{rank}").write_text(json.dumps(seen))
    d.close()


def test_main_does_stops_every_rank_when_rank_0_fails_and_a_broken_collective_is_peer_failed(tmp_path):
    """Dist.main_does: rank 0's error stops every rank (rank 0 raises it, the others PeerFailed), instead
    of the others waiting in a barrier rank 0 never reaches; a collective a process left breaks off as
    PeerFailed (one line in main), not gloo's traceback."""
    import torch.multiprocessing as mp

    result = str(tmp_path / "seen")
    mp.spawn(_main_does_worker, args=(2, free_port(), result), nprocs=2)
    assert json.loads(Path(result + ".1").read_text()) == ["PeerFailed", "went on"]
    rank0 = json.loads(Path(result + ".0").read_text())
    assert rank0[:2] == ["ZeroDivisionError", "went on"]
    assert rank0[2].startswith("another process of this torchrun job stopped (its error says why)"), rank0


def test_under_torchrun_a_gpu_index_and_a_batch_below_the_process_count_are_refused(task, tmp_path, monkeypatch,
                                                                                    capsys):
    """--device cuda:0 would put every process on GPU 0 (NCCL refuses that only at its first collective,
    naming no flag); --batch-size 1 with 2 processes cannot be split (it said "--grad-accum 1 to 0")."""
    from roberta_fast.trainer import resolve_device

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ValueError, match=r"--device cuda:0 under torchrun would put every process on GPU 0; use "
                                         r"--device cuda"):
        resolve_device("cuda:0", 1)
    argv = ["--model", str(task / "model"), "--train", str(task / "train.csv"), "--batch-size", "1",
            "--out", str(tmp_path / "run")]
    assert main(argv) == 2
    assert ("--batch-size 1 with 2 processes: each step's examples are split over the processes, so give a "
            "--batch-size of at least 2") in capsys.readouterr().err


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_eval_only_needs_a_fine_tuned_model_and_valid(task, tmp_path, capsys):
    """--eval-only evaluates --model's own head: a model without one (the pretrained MLM) would be scored
    on a random head, so it is refused, as are --reinit-head and a missing --valid; --train is not needed."""
    base = ["--model", str(task / "model"), "--valid", str(task / "valid.jsonl"), "--text-field", "sentence",
            "--device", "cpu", "--eval-only", "--out", str(tmp_path / "run")]
    assert main(base) == 2
    err = capsys.readouterr().err
    assert f"--eval-only evaluates a fine-tuned --model, and {task / 'model'} has no head for --task classify: " \
           "classifier.dense.bias" in err and "fine-tune it first (without --eval-only)" in err
    assert main(base + ["--reinit-head"]) == 2
    assert "--reinit-head would make it random" in capsys.readouterr().err
    assert main(base[:2] + base[4:]) == 2
    assert "--valid is required with --eval-only" in capsys.readouterr().err
    assert main([a for a in base if a != "--eval-only"]) == 2  # training needs --train
    assert "roberta_fast.finetune: error: --train is required" in capsys.readouterr().err


def test_resume_refuses_a_changed_lr_schedule(task, tmp_path):
    """A resumed run on other --epochs (so other total steps) would restart the decay mid-run:
    refused, naming the old and new values and --allow-schedule-change, which continues."""
    Finetuner(config(task, tmp_path / "run", epochs=2, stop_after=5), log=lambda *_: None).run()
    with pytest.raises(ValueError, match=r"another LR schedule \(steps \(from --epochs.*\) 26 -> 39, warmup "
                                         r"steps \(--warmup-ratio\) 3 -> 4\).*--allow-schedule-change"):
        Finetuner(config(task, tmp_path / "run", epochs=3), log=lambda *_: None).run()
    with pytest.raises(ValueError, match=r"--lr 0.002 -> 0.001"):
        Finetuner(config(task, tmp_path / "run", epochs=2, lr=1e-3), log=lambda *_: None).run()
    lines = []
    job = Finetuner(config(task, tmp_path / "run", epochs=3, allow_schedule_change=True, stop_after=6),
                    log=lines.append)
    assert job.run()["step"] == 6
    assert any(line.startswith("note: --allow-schedule-change: continuing on a new LR schedule") for line in lines)


def test_resume_with_changed_optimizer_flags_says_so(task, tmp_path):
    """A resume goes on with this run's --weight-decay / --eps (the optimizer keeps them over the
    checkpoint's), as train does; it did so without a word, where train prints a note."""
    Finetuner(config(task, tmp_path / "run", epochs=2, stop_after=3), log=lambda *_: None).run()
    lines = []
    Finetuner(config(task, tmp_path / "run", epochs=2, stop_after=4, weight_decay=0.01, eps=1e-8),
              log=lines.append).run()
    assert any(line.startswith("note: the optimizer goes on with this run's settings") and "--weight-decay 0.1 -> 0.01"
               in line and "--eps 1e-06 -> 1e-08" in line for line in lines), lines


def test_a_checkpoint_exports_as_a_classifier(task, tmp_path, capsys, monkeypatch):
    """python -m roberta_fast.export turns a mid-run fine-tuning checkpoint into the classifier
    of that step, with the labels and the model's tokenizer, as transformers loads it; from any
    directory, though the run named its --model relative to its own."""
    transformers = pytest.importorskip("transformers")
    from roberta_fast.export import main as export

    monkeypatch.chdir(task)
    job = Finetuner(config(task, tmp_path / "run", model="model", epochs=1, stop_after=3), log=lambda *_: None)
    job.run()
    monkeypatch.chdir(tmp_path)
    assert export([str(tmp_path / "run" / "checkpoints" / "step_00000003.pt"), "--out", str(tmp_path / "s3")]) == 0
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "s3").eval()
    assert hf.config.id2label == {0: "neg", 1: "pos"}
    batch = transformers.AutoTokenizer.from_pretrained(tmp_path / "s3")(["sunny river stone", "cloud rainy"],
                                                                         padding=True, return_tensors="pt")
    job.model.eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(**batch).logits, job.model(batch["input_ids"], batch["attention_mask"]).logits,
                                   rtol=1e-5, atol=1e-6)
    other = rf.RobertaTokenizer.train_from_iterator(["quite other words entirely"] * 20, vocab_size=300,
                                                    min_frequency=1)  # fewer ids than the model: a hash tells
    other.save(tmp_path / "other")
    capsys.readouterr()
    assert export([str(tmp_path / "run"), "--out", str(tmp_path / "bad"), "--tokenizer", str(tmp_path / "other")]) == 2
    assert "but the checkpoint was trained on ids of tokenizer" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()


def test_macro_f1():
    predictions, labels = np.array([0, 0, 1, 2]), np.array([0, 1, 1, 2])
    accuracy, f1 = accuracy_and_macro_f1(predictions, labels, 3)
    assert accuracy == 0.75
    assert f1 == pytest.approx(np.mean([2 / 3, 2 / 3, 1.0]))


def test_glue_metrics_binary_f1_and_matthews_correlation():
    """GLUE's MRPC / QQP F1 is the positive class's (id 1), CoLA's metric Matthews correlation, as sklearn's
    f1_score and matthews_corrcoef: checked against the confusion-matrix formulas by hand (and sklearn)."""
    from roberta_fast.tasks import classification_scores

    labels = np.array([1, 1, 1, 1, 1, 1, 0, 0, 0, 0])
    predictions = np.array([1, 1, 1, 1, 1, 0, 1, 1, 0, 0])  # tp 5, fn 1, fp 2, tn 2
    scores = classification_scores(predictions, labels, 2)
    assert list(scores) == ["accuracy", "f1", "macro_f1", "mcc"]
    assert scores["accuracy"] == 0.7 and scores["f1"] == pytest.approx(2 * 5 / (2 * 5 + 2 + 1))
    assert scores["macro_f1"] == pytest.approx((10 / 13 + 4 / 7) / 2)
    assert scores["mcc"] == pytest.approx((5 * 2 - 2 * 1) / np.sqrt(7 * 6 * 4 * 3))
    assert classification_scores(np.ones(10, dtype=int), labels, 2)["mcc"] == 0.0  # constant: sklearn's 0
    three_true, three_pred = np.array([0, 0, 1, 1, 2, 2, 2]), np.array([0, 1, 1, 1, 2, 0, 2])
    three = classification_scores(three_pred, three_true, 3)
    assert "f1" not in three
    confusion = np.array([[1, 1, 0], [0, 2, 0], [1, 0, 2]])  # rows true, columns predicted
    t, p, c, n = confusion.sum(1), confusion.sum(0), np.trace(confusion), confusion.sum()
    assert three["mcc"] == pytest.approx((c * n - t @ p) / np.sqrt((n * n - p @ p) * (n * n - t @ t)))
    try:
        from sklearn.metrics import f1_score, matthews_corrcoef
    except ImportError:
        return
    assert scores["f1"] == pytest.approx(f1_score(labels, predictions))
    assert scores["mcc"] == pytest.approx(matthews_corrcoef(labels, predictions))
    assert three["mcc"] == pytest.approx(matthews_corrcoef(three_true, three_pred))


def fake_evaluations(task, scores):
    """A stand-in for task.evaluate that returns these metrics in turn (and predicts class 0 throughout)."""
    scores = iter(scores)

    def evaluate(*_):
        task.predictions = np.zeros(len(task.valid_ids), dtype=int)
        return next(scores)
    return evaluate


def test_metric_chooses_the_best_epoch_and_is_recorded(task, tmp_path, monkeypatch):
    """--metric mcc: GLUE's CoLA picks by Matthews correlation, not accuracy (always answering the majority
    class scores the accuracy and an MCC of 0). The metric is in the log, metrics.jsonl and the result."""
    from roberta_fast.metrics import read_metrics

    epochs = [{"loss": 0.6, "accuracy": 0.672, "f1": 0.80, "macro_f1": 0.40, "mcc": 0.0},
              {"loss": 0.6, "accuracy": 0.652, "f1": 0.74, "macro_f1": 0.63, "mcc": 0.28}]
    for metric, best in ((None, 1), ("mcc", 2), ("macro_f1", 2)):
        lines = []
        tuner = Finetuner(config(task, tmp_path / str(metric), epochs=2, metric=metric), log=lines.append)
        monkeypatch.setattr(tuner.task, "evaluate", fake_evaluations(tuner.task, epochs))
        result = tuner.run()
        assert result["best"]["epoch"] == best and result["metric"] == (metric or "accuracy"), (metric, result)
        assert any(line.startswith(f"best epoch {best} (by {metric or 'accuracy'}): ") for line in lines), lines
        evals = [r for r in read_metrics(tmp_path / str(metric) / "metrics.jsonl") if r["kind"] == "eval"]
        assert [(r["best_metric"], r["best_epoch"]) for r in evals] == [(metric or "accuracy", 1),
                                                                        (metric or "accuracy", best)]
    with pytest.raises(ValueError, match=r"--metric 'pearson': this run \(--task classify, 2 classes \['neg', 'pos'\]\) "
                                         r"reports accuracy, f1, macro_f1, mcc; give one of them"):
        Finetuner(config(task, tmp_path / "bad", metric="pearson"), log=lambda *_: None)


def test_a_resume_under_another_metric_is_refused(task, tmp_path, monkeypatch):
    """The best epoch so far was chosen (and exported) by accuracy; a resume by --metric mcc would
    compare the next epochs against that epoch only, and export the wrong one as best: refused. The
    same metric (given or by default) resumes."""
    epochs = [{"loss": 0.6, "accuracy": 0.8, "f1": 0.8, "macro_f1": 0.8, "mcc": 0.1},
              {"loss": 0.6, "accuracy": 0.7, "f1": 0.7, "macro_f1": 0.7, "mcc": 0.5}]
    tuner = Finetuner(config(task, tmp_path / "run", epochs=2, stop_after=17), log=lambda *_: None)  # in epoch 2
    monkeypatch.setattr(tuner.task, "evaluate", fake_evaluations(tuner.task, epochs[:1]))
    tuner.run()
    tuner.close()
    with pytest.raises(ValueError, match=r"chose its best epoch so far by accuracy, this run asks for --metric mcc.*"
                                         r"Resume with --metric accuracy, or use another --out"):
        Finetuner(config(task, tmp_path / "run", epochs=2, metric="mcc"), log=lambda *_: None).run()
    resumed = Finetuner(config(task, tmp_path / "run", epochs=2, metric="accuracy"), log=lambda *_: None)
    monkeypatch.setattr(resumed.task, "evaluate", fake_evaluations(resumed.task, epochs[1:]))
    assert resumed.run()["best"]["epoch"] == 1


def test_glue_tsv_files_fine_tune_end_to_end(task, tmp_path):
    """GLUE's .tsv as shipped: a header, tabs, no quoting (SST-2 sentences hold lone quote characters),
    single sentences (SST-2) and pairs under GLUE's column names (RTE: index, sentence1, sentence2, label)."""
    from roberta_fast.tasks import read_examples

    with open(task / "train.csv", newline="") as f:
        train = [(r["sentence"], r["label"]) for r in csv.DictReader(f)]
    valid = [(r["sentence"], r["label"]) for r in map(json.loads, open(task / "valid.jsonl"))]
    for split, rows in (("train", train), ("dev", valid)):
        quoted = [(f'{text} " it \'s', label) for text, label in rows]  # an unbalanced quote on every line
        (tmp_path / f"sst2-{split}.tsv").write_text("sentence\tlabel\n" + "".join(
            f"{t}\t{int(lab == 'pos')}\n" for t, lab in quoted))
        (tmp_path / f"rte-{split}.tsv").write_text("index\tsentence1\tsentence2\tlabel\n" + "".join(
            f"{i}\tthe weather \" report\t{t}\t{lab}\n" for i, (t, lab) in enumerate(quoted)))
    single = read_examples(tmp_path / "sst2-train.tsv", config(task, tmp_path, text_field="sentence"))
    assert len(single) == len(train) and single[0] == (train[0][0] + ' " it \'s', None, str(int(train[0][1] == "pos")))
    pair_fields = dict(text_field="sentence1", pair_field="sentence2")
    pairs = read_examples(tmp_path / "rte-train.tsv", config(task, tmp_path, **pair_fields))
    assert len(pairs) == len(train) and pairs[1] == ('the weather " report', train[1][0] + ' " it \'s', train[1][1])
    for name, fields, epochs in [("sst2", dict(text_field="sentence"), 6), ("rte", pair_fields, 1)]:
        cfg = config(task, tmp_path / name, train=str(tmp_path / f"{name}-train.tsv"),
                     valid=str(tmp_path / f"{name}-dev.tsv"), epochs=epochs, **fields)
        result = Finetuner(cfg, log=lambda *_: None).run()
        assert result["best"]["accuracy"] >= (0.9 if epochs == 6 else 0.0), (name, result)  # (one epoch: it runs)
        assert (tmp_path / name / "model" / "config.json").is_file()


def test_a_tsv_without_header_row_reads_by_column_number(task, tmp_path):
    """GLUE's CoLA as shipped: no header row; source, label, the original judgement ("*" or empty),
    sentence. Columns named by number read it; column names point there instead of reading row 1 as names."""
    from roberta_fast.tasks import read_examples

    rows = [("gj04", "1", "", "Our friends won't buy this analysis, let alone the next one we propose."),
            ("gj04", "0", "*", 'They drank the pub " dry.'), ("bc01", "1", "", "Harry coughed.")]
    path = tmp_path / "train.tsv"
    path.write_text("".join("\t".join(row) + "\n" for row in rows) + "\n")  # and a trailing blank line
    examples = read_examples(path, config(task, tmp_path, text_field="3", label_field="1"))
    assert examples == [(sentence, None, label) for _, label, _, sentence in rows]
    with pytest.raises(ValueError, match=r"train.tsv:2: missing \['sentence', 'label'\].*--text-field 3 --label-field 1"):
        read_examples(path, config(task, tmp_path, text_field="sentence"))


def test_activation_checkpointing_finetunes_as_without(task, tmp_path):
    """--activation-checkpointing: the same steps (dropout replayed in the recompute), the same weights."""
    from roberta_fast.finetune import build_parser

    assert build_parser().parse_args(["--model", "m", "--train", "t", "--activation-checkpointing"]).activation_checkpointing
    quiet = dict(log=lambda *_: None)
    runs = []
    for enabled in (True, False):
        tuner = Finetuner(config(task, tmp_path / str(enabled), epochs=1, stop_after=3,
                                 activation_checkpointing=enabled), **quiet)
        tuner.run()
        assert tuner.model.is_gradient_checkpointing == enabled
        runs.append(tuner.model.state_dict())
    for key, value in runs[1].items():
        torch.testing.assert_close(runs[0][key], value, rtol=1e-6, atol=1e-7, msg=key)


def test_glue_tsv_rows_with_a_wrong_column_count_are_skipped_and_counted(task, tmp_path, capsys):
    """GLUE's QQP ships lines broken by a newline inside a question (fewer cells than the header, or more):
    skipped, as fairseq's RoBERTa recipe (awk NF==6) and datasets' glue loader, with a note naming them.
    A CSV row short of columns is still refused, saying so (not "empty")."""
    from roberta_fast.tasks import read_examples

    header = "id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate\n"
    good = [f"{i}\t{2 * i}\t{2 * i + 1}\tsunny river {i}?\tcloud rainy {i}?\t{i % 2}\n" for i in range(8)]
    broken = ["9\t18\t19\tHow can I develop android app?\t\n", "10\t20\t21\ta\tb\t0\textra\n"]
    path = tmp_path / "train.tsv"
    path.write_text(header + "".join(good[:3] + broken + good[3:]))
    fields = dict(text_field="question1", pair_field="question2", label_field="is_duplicate")
    notes = []
    examples = read_examples(path, config(task, tmp_path, **fields), notes)
    assert len(examples) == 8 and examples[3] == ("sunny river 3?", "cloud rainy 3?", "1")
    assert notes == [f"{path}: skipped 2 rows whose number of columns differs from the header's (lines 5, 6), "
                     "as GLUE's loaders do (fairseq's preprocess_GLUE_tasks.sh, datasets' glue)"]
    logged = []
    Finetuner(config(task, tmp_path / "run", train=str(path), valid=str(path), **fields), log=logged.append)
    assert sum("skipped 2 rows" in line for line in logged) == 2, logged  # one line per file
    with pytest.raises(ValueError, match=r"train.tsv: 2 row\(s\) have another number of columns than the header "
                                         r"\(line\(s\) 5, 6\); every row of a file to predict needs its prediction"):
        read_examples(path, config(task, tmp_path, **fields), labelled=False)  # --predict: none may be dropped
    empty = tmp_path / "empty.tsv"  # the right number of columns, an empty question: kept, as fairseq and datasets do
    empty.write_text(header + "1\t2\t3\t\tcloud?\t0\n" + good[0])
    notes = []
    assert read_examples(empty, config(task, tmp_path, **fields), notes)[0] == ("", "cloud?", "0")
    assert notes == [f"{empty}: kept 1 row whose text or pair text is empty (line 2), as GLUE's loaders do"]
    nulls = tmp_path / "nulls.jsonl"  # JSON null: an empty cell (no CSV columns to speak of)
    nulls.write_text('{"question1": null, "question2": "cloud?", "is_duplicate": 0}\n'
                     '{"question1": "sunny?", "question2": "rain?", "is_duplicate": 1}\n')
    notes = []
    assert read_examples(nulls, config(task, tmp_path, **fields), notes)[0] == ("", "cloud?", "0")
    assert notes == [f"{nulls}: kept 1 row whose text or pair text is empty (line 1), as GLUE's loaders do"]
    nulls.write_text('{"question1": "a?", "question2": "b?", "is_duplicate": null}\n')
    with pytest.raises(ValueError, match=r"nulls.jsonl:1: the label \('is_duplicate'\) is empty"):
        read_examples(nulls, config(task, tmp_path, **fields))
    empty.write_text(header + "1\t2\t3\tsunny?\tcloud?\t\n")  # an empty label stays an error
    with pytest.raises(ValueError, match=r"empty.tsv:2: the label \('is_duplicate'\) is empty on this line"):
        read_examples(empty, config(task, tmp_path, **fields))
    short = tmp_path / "short.csv"
    short.write_text("sentence,label\nsunny river,pos\ncloud rainy\n")
    with pytest.raises(ValueError, match=r"short.csv:3: the row has 1 of the header's 2 columns, no label \('label'\)"):
        read_examples(short, config(task, tmp_path))


def test_columns_named_by_number_refuse_a_header_row(task, tmp_path):
    """Columns named by number on a file with a header (GLUE's MRPC, STS-B): the header would be an example,
    'Quality' a class, 'score' would end the regression. Refused, with the names to use; a file without a
    header, whose first line is an example (CoLA), still reads."""
    from roberta_fast.tasks import read_examples

    mrpc = tmp_path / "mrpc.tsv"
    mrpc.write_text("\ufeffQuality\t#1 ID\t#2 ID\t#1 String\t#2 String\n" + "".join(
        f"{i % 2}\t{100 + i}\t{200 + i}\tsunny river {i}\tcloud {i}\n" for i in range(4)))
    numbered = dict(text_field="3", pair_field="4", label_field="0")
    with pytest.raises(ValueError, match=r"mrpc.tsv:1: this first line looks like a header row, not an example: "
                                         r"column 0 holds 'Quality' where every later row has a number\. Name the "
                                         r"columns by the header \(--text-field '#1 String' --pair-field '#2 String' "
                                         r"--label-field Quality\), or remove the header line"):
        read_examples(mrpc, config(task, tmp_path, **numbered))
    named = read_examples(mrpc, config(task, tmp_path, text_field="#1 String", pair_field="#2 String",
                                       label_field="Quality"))
    assert named[0] == ("sunny river 0", "cloud 0", "0")
    sts = tmp_path / "sts.csv"
    sts.write_text("sentence1,sentence2,score\n" + "".join(f"sunny {i},cloud {i},{i / 2 + 0.1:.3f}\n" for i in range(4)))
    with pytest.raises(ValueError, match=r"sts.csv:1: .* column 2 holds 'score' .*--text-field sentence1 "
                                         r"--pair-field sentence2 --label-field score"):
        read_examples(sts, config(task, tmp_path, text_field="0", pair_field="1", label_field="2"))
    cola = tmp_path / "cola.tsv"  # no header: the first line is an example, its label a number as the others'
    cola.write_text("gj04\t1\t\tOur friends won't buy this analysis.\ngj04\t0\t*\tThey drank the pub.\n"
                    "bc01\t1\t\tHarry coughed.\nbc01\t0\t*\tHarry coughed the cold.\n")
    assert len(read_examples(cola, config(task, tmp_path, text_field="3", label_field="1"))) == 4


def test_a_cell_past_the_csv_modules_limit_reads(task, tmp_path, monkeypatch):
    """A document of more than 131072 characters (the csv module's default cap on a cell) reads, in a CSV and
    a .tsv (it is truncated to --max-len later); another csv.Error is a ValueError naming the file and line."""
    import roberta_fast.tasks as tasks

    long_text = " ".join(["sunny"] * 30000)
    for name, sep in (("long.csv", ","), ("long.tsv", "\t")):
        path = tmp_path / name
        path.write_text(f"sentence{sep}label\nsunny river{sep}pos\n{long_text}{sep}pos\ncloud rainy{sep}neg\n")
        examples = tasks.read_examples(path, config(task, tmp_path))
        assert [len(text) for text, _, _ in examples] == [11, len(long_text), 11]
    monkeypatch.setattr(tasks, "raise_field_size_limit", lambda: None)
    previous = csv.field_size_limit(1000)
    try:
        with pytest.raises(ValueError, match=r"long.csv:3: not readable as CSV \(field larger than field limit "
                                             r"\(1000\)\); fix or remove the row"):
            tasks.read_examples(tmp_path / "long.csv", config(task, tmp_path))
    finally:
        csv.field_size_limit(previous)


def test_the_glue_column_names_in_the_hint_read_glues_tsv_files(task, tmp_path):
    """The message on a column not found names each GLUE task's columns as its .tsv as shipped has them (MRPC's
    '#1 String' / '#2 String' / Quality, MNLI's sentence1 / sentence2 / gold_label, QQP's question1 / question2 /
    is_duplicate), and the Hub's names apart; each task's names read a file with GLUE's header."""
    import re
    import shlex

    from roberta_fast.tasks import read_examples

    headers = {"SST-2": "sentence label", "MRPC": "Quality|#1 ID|#2 ID|#1 String|#2 String",
               "STS-B": "index genre filename year old_index source1 source2 sentence1 sentence2 score",
               "QQP": "id qid1 qid2 question1 question2 is_duplicate",
               "MNLI": "index promptID pairID genre sentence1_binary_parse sentence2_binary_parse sentence1_parse "
                       "sentence2_parse sentence1 sentence2 label1 gold_label",
               "QNLI": "index question sentence label", "RTE": "index sentence1 sentence2 label",
               "WNLI": "index sentence1 sentence2 label", "CoLA": None}
    mrpc = tmp_path / "MRPC.tsv"
    mrpc.write_text("\t".join(headers["MRPC"].split("|")) + "\n1\t1\t2\tsunny river\tsunny stone\n")
    with pytest.raises(ValueError, match="missing") as err:
        read_examples(mrpc, config(task, tmp_path, text_field="sentence1", pair_field="sentence2"))
    hint = str(err.value)
    assert "The Hub's glue datasets: sentence1/sentence2 (MRPC, STS-B, RTE, WNLI), question1/question2 (QQP), " \
           "premise/hypothesis (MNLI)" in hint
    for name, header in headers.items():
        flags = re.search(rf"\b{re.escape(name)} (--text-field .*?)(;|\()", hint)
        assert flags, (name, hint)
        args = shlex.split(flags.group(1))
        fields = {args[i][2:].replace("-", "_"): args[i + 1] for i in range(0, len(args), 2)}
        columns = header.split("|") if header and "|" in header else header.split() if header else ["gj04", "1", "", "x"]
        rows = [dict(zip(columns, columns))] if header else []
        for i in range(3):
            rows.append({c: str(i % 2) if c in (fields["label_field"], "1") else f"sunny {c} {i}" for c in columns})
        path = tmp_path / f"{name}.tsv"
        path.write_text("".join("\t".join(r.values()) + "\n" for r in rows))
        examples = read_examples(path, config(task, tmp_path, **fields))
        assert len(examples) == 3 and examples[1][2] == "1", (name, examples)
        assert (examples[0][1] is None) == (name in ("SST-2", "CoLA")), name


@pytest.mark.parametrize("bad, message", [
    (dict(valid=""), "--valid is empty"), (dict(tokenizer=" "), "--tokenizer is empty"), (dict(pair_field=""), "--pair-field is empty"),
    (dict(lr=float("inf")), "need finite values"), (dict(eps=float("inf")), "need finite values"),
    (dict(weight_decay=float("nan")), "need finite values"), (dict(beta2=1.0), "need finite values"),
    (dict(warmup_ratio=2.0), "need finite values"),
])
def test_empty_options_and_impossible_optimizer_values_are_refused(task, tmp_path, bad, message):
    """--valid "$DEV" with DEV unset once held 10% of --train out instead, --lr inf trained to NaN."""
    with pytest.raises(ValueError, match=message):
        Finetuner(config(task, tmp_path / "run", **bad), log=lambda *_: None)
