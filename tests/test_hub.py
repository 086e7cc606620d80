"""Hub names in from_pretrained (roberta_fast.hub), offline against a hand-built HF cache.

The cache has the layout huggingface_hub writes (models--owner--name/refs/<branch> holding
a commit, snapshots/<commit>/<files>), so the same lookup that finds a model transformers
downloaded earlier is exercised without a network.
"""
import pytest
import torch

huggingface_hub = pytest.importorskip("huggingface_hub")

import roberta_fast as rf  # noqa: E402
from roberta_fast import hub  # noqa: E402

SMALL = dict(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
             max_position_embeddings=40)


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An offline HF cache; returns add(repo_id, revision) -> the snapshot directory to fill."""
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)

    def add(repo_id, branch="main", commit="a" * 40):
        repo = tmp_path / ("models--" + repo_id.replace("/", "--"))
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / branch).write_text(commit)
        snapshot = repo / "snapshots" / commit
        snapshot.mkdir(parents=True)
        return snapshot

    return add


def _weights(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_model_config_and_tokenizer_by_hub_name(hub_cache, tmp_path):
    torch.manual_seed(0)
    mlm = rf.RobertaForMaskedLM(rf.RobertaConfig(**SMALL), backend="reference")
    snapshot = hub_cache("acme/tiny-roberta")
    mlm.save_pretrained(snapshot)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog\n" * 50)
    rf.RobertaTokenizer.train([str(corpus)], vocab_size=300).save(snapshot)

    loaded = rf.RobertaForMaskedLM.from_pretrained("acme/tiny-roberta", backend="reference")
    for name, value in _weights(mlm).items():
        assert torch.equal(loaded.state_dict()[name], value), name
    with pytest.warns(UserWarning) as caught:  # an MLM checkpoint has no pooler, and a head the encoder drops
        encoder = rf.RobertaModel.from_pretrained("acme/tiny-roberta", backend="reference")
    assert any("pooler" in str(w.message) for w in caught)
    assert torch.equal(encoder.embeddings.word_embeddings.weight, mlm.roberta.embeddings.word_embeddings.weight)
    assert rf.RobertaConfig.from_pretrained("acme/tiny-roberta").hidden_size == SMALL["hidden_size"]
    tok = rf.RobertaTokenizer.from_pretrained("acme/tiny-roberta")
    assert tok.encode("the lazy dog")[0] == 0  # <s> first


def test_revision_picks_the_branch(hub_cache):
    torch.manual_seed(0)
    main, v1 = (rf.RobertaForMaskedLM(rf.RobertaConfig(**SMALL), backend="reference") for _ in range(2))
    main.save_pretrained(hub_cache("acme/tiny-roberta", "main", "a" * 40))
    v1.save_pretrained(hub_cache("acme/tiny-roberta", "v1", "b" * 40))
    got = rf.RobertaForMaskedLM.from_pretrained("acme/tiny-roberta", revision="v1", backend="reference")
    assert torch.equal(got.lm_head.bias, v1.lm_head.bias)
    assert not torch.equal(got.lm_head.dense.weight, main.lm_head.dense.weight)


def test_pytorch_bin_only_repository(hub_cache, tmp_path):
    """Repositories from before safetensors hold pytorch_model.bin only."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.RobertaForMaskedLM(transformers.RobertaConfig(**SMALL, pad_token_id=1)).eval()
    hf.save_pretrained(hub_cache("acme/old-roberta"), safe_serialization=False)
    ours = rf.RobertaForMaskedLM.from_pretrained("acme/old-roberta", backend="reference").eval()
    ids = torch.tensor([[0, 5, 6, 7, 2]])
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, hf(ids).logits, rtol=1e-5, atol=1e-5)


def test_unknown_names_and_missing_paths_say_what_was_tried(hub_cache, tmp_path):
    with pytest.raises(FileNotFoundError, match="acme/missing.*Hugging Face Hub"):
        rf.RobertaForMaskedLM.from_pretrained("acme/missing")
    with pytest.raises(FileNotFoundError, match="Hugging Face Hub"):
        rf.RobertaTokenizer.from_pretrained("acme/missing")
    # a path that cannot be a repository id is reported as a path, without asking the Hub
    missing = tmp_path / "runs" / "tiny" / "final"
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        rf.RobertaForMaskedLM.from_pretrained(missing)


@pytest.mark.parametrize("name, expected", [
    ("FacebookAI/roberta-base", True), ("roberta-base", True), ("org/name.v2", True),
    ("runs/tiny/final", False), ("../model", False), ("/abs/path", False), ("a/../b", False), ("", False),
])
def test_repo_id_shape(name, expected):
    assert hub.is_repo_id(name) is expected


def _fake_hub(monkeypatch, repo, snapshot):
    """snapshot_download that copies the files of `repo` matching allow_patterns into `snapshot`, as the
    Hub fetches only those; returns the list of the patterns asked for."""
    import fnmatch
    import shutil

    asked = []

    def snapshot_download(repo_id, revision=None, allow_patterns=(), **download):
        asked.append(allow_patterns)
        snapshot.mkdir(exist_ok=True)
        for path in repo.iterdir():
            if any(fnmatch.fnmatch(path.name, pattern) for pattern in allow_patterns):
                shutil.copy(path, snapshot / path.name)
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    return asked


def test_spanbert_head_by_hub_name(hub_cache, tmp_path, monkeypatch):
    """RobertaForSpanBERT.from_pretrained(name) fetches and loads the repository's sbo.safetensors (it
    looked in a local directory only, and the Hub download left the file out: the head was initialised
    anew); a repository without one still loads, warning."""
    from roberta_fast.sbo import RobertaForSpanBERT

    torch.manual_seed(0)
    spanbert = RobertaForSpanBERT(rf.RobertaConfig(**SMALL), backend="reference", max_offset=7)
    spanbert.save_pretrained(tmp_path / "repo")
    with monkeypatch.context() as patch:
        _fake_hub(patch, tmp_path / "repo", tmp_path / "snapshot")
        loaded = RobertaForSpanBERT.from_pretrained("acme/tiny-spanbert", backend="reference")
    for name, value in _weights(spanbert).items():
        assert torch.equal(loaded.state_dict()[name], value), name

    rf.RobertaForMaskedLM(rf.RobertaConfig(**SMALL), backend="reference").save_pretrained(
        hub_cache("acme/tiny-roberta"))
    with pytest.warns(UserWarning, match=r"newly initialised.*'sbo\."):
        RobertaForSpanBERT.from_pretrained("acme/tiny-roberta", backend="reference")


def test_sbo_weights_alone_do_not_stand_for_the_model_weights(tmp_path, monkeypatch):
    """A .bin-only repository with sbo.safetensors: the safetensors set fetches config.json and
    sbo.safetensors only, which must not end the search before pytorch_model.bin is fetched."""
    (tmp_path / "repo").mkdir()
    for name in ("config.json", "pytorch_model.bin", "sbo.safetensors"):
        (tmp_path / "repo" / name).write_text("x")
    asked = _fake_hub(monkeypatch, tmp_path / "repo", tmp_path / "snapshot")
    assert hub.model_dir("acme/old-spanbert") == str(tmp_path / "snapshot")
    assert len(asked) == 2 and (tmp_path / "snapshot" / "pytorch_model.bin").is_file()
