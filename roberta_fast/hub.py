"""Hugging Face Hub names wherever a model or tokenizer directory is expected.

`rf.RobertaModel.from_pretrained("FacebookAI/roberta-base")` works as it does in
`transformers`: a name that is not a local path is fetched with `huggingface_hub`
(`snapshot_download`) into the shared HF cache, so a model transformers has already
downloaded is found there offline, and HF_HUB_OFFLINE, HF_HOME, HF_TOKEN and HF_ENDPOINT
apply as usual. Only the files roberta_fast reads are fetched: safetensors weights
when the repository has them (else the PyTorch .bin), never the TF/Flax/ONNX copies, and
sbo.safetensors (RobertaForSpanBERT's span boundary head) when the repository has one.
"""
from __future__ import annotations

import glob
import os
import re

# owner/name or a legacy single name ("roberta-base"), as the Hub spells repository ids
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}(/[\w.-]{1,96})?")
_MODEL_FILES = (  # tried in order: the first set that yields weights wins
    ["config.json", "model.safetensors", "model.safetensors.index.json", "model-*.safetensors", "sbo.safetensors"],
    ["config.json", "pytorch_model.bin", "pytorch_model.bin.index.json", "pytorch_model-*.bin", "sbo.safetensors"],
)
_MODEL_WEIGHTS = ("model*.safetensors", "pytorch_model*.bin")  # the encoder's (sbo.safetensors is optional)
_TOKENIZER_FILES = (["tokenizer.json", "vocab.json", "merges.txt"],)


def model_dir(name_or_path, revision: str | None = None, **download) -> str:
    """A local directory with config.json and weights: `name_or_path` itself, or its Hub download
    (`download`: snapshot_download's cache_dir, force_download, local_files_only, token, proxies)."""
    return _local_dir(name_or_path, revision, _MODEL_FILES, _MODEL_WEIGHTS, download)


def config_dir(name_or_path, revision: str | None = None) -> str:
    """A local directory (or file) with config.json, fetched from the Hub if need be."""
    return _local_dir(name_or_path, revision, (["config.json"],), ("config.json",))


def tokenizer_dir(name_or_path, revision: str | None = None) -> str:
    """A local directory with tokenizer.json or vocab.json + merges.txt, fetched from the Hub if need be."""
    return _local_dir(name_or_path, revision, _TOKENIZER_FILES, ("tokenizer.json", "vocab.json"))


def is_repo_id(name: str) -> bool:
    return bool(_REPO_ID.fullmatch(name)) and ".." not in name


def _local_dir(name_or_path, revision, file_sets, wanted, download=None) -> str:
    path = os.fspath(name_or_path)
    if os.path.exists(path) or not is_repo_id(path):
        return path  # the caller reports what is missing in a local path
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise FileNotFoundError(
            f"{path!r} is not a local directory; to fetch it from the Hugging Face Hub, install "
            "huggingface_hub (`pip install huggingface_hub`)") from None
    try:
        for patterns in file_sets:
            local = snapshot_download(path, revision=revision, allow_patterns=patterns, **(download or {}))
            if any(glob.glob(os.path.join(local, pattern)) for pattern in wanted):
                return local
    except Exception as err:  # offline, unknown repository, revision or gated model: say which
        raise FileNotFoundError(
            f"{path!r} is neither a local directory nor a Hugging Face Hub repository that could be "
            f"fetched: {type(err).__name__}: {err}") from err
    return local  # the repository has none of the files: the caller names what is missing


def model_card(repo_id: str, tags: list[str] | None = None, token: bool | str | None = None):
    """The README.md that transformers' push_to_hub uploads beside the weights: the repository's
    own model card, or a new one from huggingface_hub's template when it has none, with `tags` added."""
    from huggingface_hub import ModelCard, ModelCardData
    from huggingface_hub.errors import EntryNotFoundError

    try:
        card = ModelCard.load(repo_id, token=token)
    except EntryNotFoundError:
        card = ModelCard.from_template(
            ModelCardData(tags=[], library_name="transformers"),
            model_description="This is the model card of a 🤗 transformers model that has been pushed on "
                              "the Hub by roberta_fast. This model card has been automatically generated.")
    card.data.tags = card.data.tags or []
    for tag in [tags] if isinstance(tags, str) else tags or []:
        if tag not in card.data.tags:
            card.data.tags.append(tag)
    return card
