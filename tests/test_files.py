"""What the package writes: the permissions a plain write gives (umask respected) for every
atomic writer, and exports whose tokenizer states the model's real length limit.

Each writer runs under umask 022 (files 0644, directories 0755: shareable on a cluster)
and 077 (owner only, as that user asked); before roberta_fast.files, temporary files from
mkstemp / mkdtemp made exports 0700 / 0600 whatever the umask.
"""
import json
import os
import stat
from pathlib import Path

import pytest
import torch

from roberta_fast import RobertaConfig, RobertaForMaskedLM, RobertaTokenizer
from roberta_fast.corpus import build_corpus, iter_documents
from roberta_fast.files import atomic_path, umask, write_text_atomic
from roberta_fast.sbo import RobertaForSpanBERT

SMALL = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)


@pytest.fixture(scope="module")
def tok():
    return RobertaTokenizer.train_from_iterator(iter_documents(max_bytes=60_000), vocab_size=400)


@pytest.fixture(params=[0o022, 0o077], ids=["umask022", "umask077"])
def mask(request):
    old = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(old)


def assert_plain_modes(root: Path, mask: int) -> int:
    """Every file under root (root included) has a plain write's mode; returns how many were checked."""
    wrong, n = [], 0
    for path in [root, *root.rglob("*")]:
        mode, want = stat.S_IMODE(path.stat().st_mode), (0o777 if path.is_dir() else 0o666) & ~mask
        n += 1
        if mode != want:
            wrong.append(f"{path.relative_to(root.parent)}: {oct(mode)} (want {oct(want)})")
    assert not wrong, wrong
    return n


def test_umask_is_read_without_changing_it(mask):
    assert umask() == mask and umask() == mask


def test_an_existing_file_keeps_its_mode_and_a_failed_write_leaves_nothing(tmp_path, mask):
    target = tmp_path / "notes.txt"
    write_text_atomic(target, "one")
    assert stat.S_IMODE(target.stat().st_mode) == 0o666 & ~mask
    target.chmod(0o640)  # as `open(target, "w")` would, a rewrite keeps the owner's choice
    write_text_atomic(target, "two")
    assert target.read_text() == "two" and stat.S_IMODE(target.stat().st_mode) == 0o640
    with pytest.raises(RuntimeError, match="half"):
        with atomic_path(target) as tmp:
            tmp.write_text("half")
            raise RuntimeError("half written")
    assert target.read_text() == "two" and os.listdir(tmp_path) == ["notes.txt"]


@pytest.mark.parametrize("model_class", [RobertaForMaskedLM, RobertaForSpanBERT])
def test_exports_are_shareable(tok, tmp_path, mask, model_class):
    """The directory train, finetune and `python -m roberta_fast.export` write (export_pretrained),
    exported twice (the second replaces the first)."""
    from roberta_fast.trainer import export_pretrained

    model = model_class(RobertaConfig.preset("tiny", vocab_size=tok.vocab_size, **SMALL))
    for _ in range(2):
        export_pretrained(model, tok, tmp_path / "final")
    assert {"model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"} <= set(
        os.listdir(tmp_path / "final"))
    assert assert_plain_modes(tmp_path / "final", mask) >= 8
    assert os.listdir(tmp_path) == ["final"]


def test_checkpoints_datasets_plots_and_configs(tok, tmp_path, mask):
    from roberta_fast.checkpoint import CheckpointManager
    from roberta_fast.metrics import plot_losses
    from roberta_fast.preprocess import preprocess
    from roberta_fast.train_config import TrainConfig

    CheckpointManager(tmp_path / "run" / "checkpoints").save(1, {"step": 1, "w": torch.zeros(3)})
    (tmp_path / "run" / "metrics.jsonl").write_text(json.dumps({"kind": "train", "step": 1, "loss": 2.0}) + "\n")
    assert plot_losses(tmp_path / "run" / "metrics.jsonl", tmp_path / "run" / "loss.png") is not None
    TrainConfig().save(tmp_path / "run" / "train_config.json")
    RobertaConfig.preset("tiny", **SMALL).save_pretrained(tmp_path / "run" / "model")
    build_corpus(tmp_path / "corpus" / "docs.jsonl", max_bytes=20_000)
    preprocess([tmp_path / "corpus"], tok, tmp_path / "data", progress=False, log=lambda msg: None)
    assert assert_plain_modes(tmp_path / "run", mask) >= 7
    assert assert_plain_modes(tmp_path / "corpus", mask) == 2
    assert assert_plain_modes(tmp_path / "data", mask) >= 14  # shards, indexes, markers, tokenizer, manifest


def test_benchmark_records_and_charts(tmp_path, mask, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import _common
    import plot

    _common.write_json(tmp_path / "out" / "r.json", {"device": "cpu"}, [])
    plot.atomic_write(tmp_path / "out" / "chart.svg", lambda p: p.write_text("<svg/>"))
    assert assert_plain_modes(tmp_path / "out", mask) == 3


# ---------------------------------------------------------------- the tokenizer's stated limit
def test_an_exported_tokenizer_truncates_to_the_models_positions(tok, tmp_path):
    """transformers truncates to tokenizer_config's model_max_length: with roberta-base's 512 a
    model of 34 positions (32 tokens) crashed in the fill-mask pipeline on a longer text."""
    transformers = pytest.importorskip("transformers")
    from roberta_fast.trainer import export_pretrained

    config = RobertaConfig.preset("tiny", vocab_size=tok.vocab_size, max_position_embeddings=34, **SMALL)
    export_pretrained(RobertaForMaskedLM(config), tok, tmp_path / "final")
    assert json.loads((tmp_path / "final" / "tokenizer_config.json").read_text())["model_max_length"] == 32
    text = "The <mask> of a module is its name. " + "It defines classes and functions. " * 40
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "final")
    assert len(hf_tok(text)["input_ids"]) > 200 and len(hf_tok(text, truncation=True)["input_ids"]) == 32
    fill = transformers.pipeline("fill-mask", model=str(tmp_path / "final"), device="cpu")
    out = fill(text, tokenizer_kwargs={"truncation": True}, top_k=3)
    assert len(out) == 3 and all(o["sequence"] and o["token"] < tok.vocab_size for o in out)


def test_a_converted_fairseq_model_states_its_limit(tmp_path):
    pytest.importorskip("transformers")
    from test_fairseq import SIZES, fairseq_state, hf_model, save_checkpoint

    from roberta_fast import fairseq

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 40 + "pack my box with five dozen jugs\n")
    gpt2 = RobertaTokenizer.train([str(corpus)], vocab_size=280)
    gpt2.save(tmp_path / "gpt2")
    encoder = {t: i for t, i in json.loads((tmp_path / "gpt2" / "vocab.json").read_text()).items()
               if t not in ("<s>", "<pad>", "</s>", "<unk>", "<mask>")}  # GPT-2's tokens, the byte "<" included
    (tmp_path / "encoder.json").write_text(json.dumps(encoder))
    (tmp_path / "dict.txt").write_text("".join(f"{i} 1\n" for i in encoder.values()))
    save_checkpoint(tmp_path / "ckpt.pt", fairseq_state(hf_model(4 + len(encoder) + 1)),
                    cfg={"model": {"encoder_attention_heads": 4}})
    fairseq.convert(tmp_path / "ckpt.pt", tmp_path / "hf", tmp_path / "dict.txt", tmp_path / "encoder.json",
                    tmp_path / "gpt2" / "merges.txt")
    config = json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())
    assert config["model_max_length"] == SIZES["max_position_embeddings"] - SIZES["pad_token_id"] - 1 == 32


@pytest.mark.parametrize("name, refusal", [
    ("../x.bin", "points outside"), ("a/../../x.bin", "points outside"), ("/etc/passwd", "is the absolute path"),
    ("", "not a file name"), (".", "not a file name"), ("a/..", "not a file name"), (7, "not a file name"),
])
def test_a_name_read_from_a_received_directory_must_stay_inside_it(tmp_path, name, refusal):
    from roberta_fast.files import inside

    with pytest.raises(ValueError, match=f"the entry .*{refusal}.*: the fix"):
        inside(tmp_path, name, "the entry", "the fix")
    assert inside(tmp_path, "train/00.bin", "the entry", "the fix") == tmp_path / "train" / "00.bin"
    assert inside(tmp_path, "a/../b.bin", "the entry", "the fix") == tmp_path / "a/../b.bin"
