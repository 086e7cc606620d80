"""The fine-tuning tasks of `python -m roberta_fast.finetune --task classify|token|qa|choice`:
their file formats, encoding, batches and metrics. The training loop is finetune.py's.

- classify: CSV, GLUE .tsv (tab-separated, no quoting, as GLUE's loaders read it) or JSONL rows of
  a text, an optional pair text (GLUE's .tsv columns per task: GLUE_TSV_FIELDS; the Hub's differ)
  and a label, named by column or, for a file without a header row (CoLA), by column number;
  accuracy, macro-F1, Matthews correlation and, with two classes, the positive class's F1 (GLUE's
  CoLA and MRPC / QQP metrics). Numeric --train labels that are not all integers (GLUE's STS-B scores)
  are a regression, as run_glue decides from the training label column's type (or --problem-type): one
  output, MSE loss, Pearson and Spearman correlation. A NaN label is a missing one (refused), as
  is a .csv / .tsv cell pandas reads as missing ("N/A", "NA", "NULL", "None", ...).
- token: CoNLL-style files (`word<TAB or spaces>...tag` per line, the tag in the last
  column, a blank line between sentences, `-DOCSTART-` lines end one and are skipped) or JSONL
  `{"tokens": [...], "tags": [...]}`. Words are encoded as transformers'
  RobertaTokenizerFast(add_prefix_space=True) encodes `is_split_into_words` input: each word
  with a space before it (none when it starts with one; a special token's text is that token);
  the tag goes to its first sub-token, -100 to the others (as run_ner). Accuracy over words, and entity precision/recall/F1 with seqeval's default
  (conlleval) chunking of BIO / IOB2 / IOBES tags, when every tag is `O` or `X-TYPE`.
- qa: SQuAD v1.1 / v2.0 JSON, or the Hub's squad rows as JSON Lines (or JSON {"data": [rows]}, as run_qa
  reads). Long contexts are cut into windows of --max-len tokens that
  overlap by --doc-stride tokens (default: a third of --max-len, run_qa's 128 of 384); an answer outside a window, or an
  unanswerable v2.0 question, points at `<s>` (position 0). Predictions are run_qa's
  postprocessing (n best starts x ends, at most --max-answer-len tokens, v2.0: the empty
  answer when the null score beats the best span by more than --null-threshold), scored with
  the official scripts' exact match and F1 (x100): v2.0's, or v1.1's for a run without unanswerable
  questions (they differ where a gold answer normalizes to nothing, as "The").
- choice: RACE-style JSONL, `{"article", "question", "options": [...], "answer": "A"}` per
  question, or RACE's own per-article layout (`"questions"`, `"options"`, `"answers"` lists).
  Each option is encoded `<s> article </s></s> question option </s>` (an `_` in the question
  is replaced by the option, as fairseq's RACE preprocessing), the article truncated; accuracy.

Every task also reads Parquet / Arrow files and datasets save_to_disk directories in the Hub's
layouts (documents.table_rows; ClassLabel ids become their names): classify by the field flags,
token "tokens" + "tags" / "ner_tags", qa squad's columns, choice race's. A run whose best epoch
does no better than the trivial answer (the majority class or tag, tagging everything O,
answering nothing, chance among the options) says so at the end.

Bad input is a ValueError naming the file and line or row (or question id) and the fix.
"""
from __future__ import annotations

import collections
import copy
import csv
import json
import re
import shlex
import string
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .documents import _SURROGATE, is_table, table_label_names, table_rows
from .files import write_text_atomic
from .model import (RobertaForMultipleChoice, RobertaForQuestionAnswering, RobertaForSequenceClassification,
                    RobertaForTokenClassification)

IGNORE = -100  # label of the tokens the loss skips
# classify's --text-field / --pair-field / --label-field for GLUE's .tsv files as shipped (their header rows);
# the Hub's glue datasets name them otherwise (GLUE_HUB_FIELDS). CoLA's .tsv has no header: by column number.
GLUE_TSV_FIELDS = {"CoLA": ("3", None, "1"), "SST-2": ("sentence", None, "label"),
                   "MRPC": ("#1 String", "#2 String", "Quality"), "STS-B": ("sentence1", "sentence2", "score"),
                   "QQP": ("question1", "question2", "is_duplicate"), "MNLI": ("sentence1", "sentence2", "gold_label"),
                   "QNLI": ("question", "sentence", "label"), "RTE": ("sentence1", "sentence2", "label"),
                   "WNLI": ("sentence1", "sentence2", "label")}
GLUE_HUB_FIELDS = "sentence1/sentence2 (MRPC, STS-B, RTE, WNLI), question1/question2 (QQP), premise/hypothesis " \
                  "(MNLI), question/sentence (QNLI), sentence (CoLA, SST-2), and label"


def glue_fields_hint() -> str:
    """The GLUE column names, per task, for read_examples' message on a column it does not find."""
    def flags(text, pair, label):
        named = [("--text-field", text), ("--pair-field", pair), ("--label-field", label)]
        return " ".join(f"{flag} {shlex.quote(name)}" for flag, name in named if name is not None)
    return ("GLUE's .tsv files as shipped: " + "; ".join(f"{task} {flags(*names)}" for task, names in
                                                          GLUE_TSV_FIELDS.items())
            + f" (CoLA has no header row: columns by number). The Hub's glue datasets: {GLUE_HUB_FIELDS}")
PROBLEM_TYPES = ("auto", "single_label_classification", "regression")  # classify's --problem-type
# what pandas' read_csv (so run_glue's datasets) reads as a missing value by default (its STR_NA_VALUES)
PANDAS_MISSING = frozenset({"", "#N/A", "#N/A N/A", "#NA", "-1.#IND", "-1.#QNAN", "-NaN", "-nan", "1.#IND", "1.#QNAN",
                            "<NA>", "N/A", "NA", "NULL", "NaN", "None", "n/a", "nan", "null"})


# ------------------------------------------------------------------ shared helpers
def data_file(path) -> Path:
    path = Path(path)
    if not path.is_file() and not (path.is_dir() and is_table(path)):
        raise FileNotFoundError(f"no such data file: {path}" + (
            " (a directory: pass a datasets save_to_disk directory, or a file)" if path.is_dir() else ""))
    return path


def not_utf8(path: Path) -> ValueError:
    """The error for a file that is not UTF-8 (CoNLL-2003's German files are ISO-8859-1): its first bad
    line, found again line by line (the reader decodes in chunks, so it cannot say where). A UTF-16 file
    (Windows' "Unicode") is named as such by its byte order mark."""
    with open(path, "rb") as f:
        if f.read(2) in (b"\xff\xfe", b"\xfe\xff"):
            return ValueError(f"{path}: UTF-16, not UTF-8 (it starts with a UTF-16 byte order mark); convert it, "
                              f"e.g. iconv -f utf-16 -t utf-8 {shlex.quote(str(path))} > utf8-copy")
        f.seek(0)
        for number, line in enumerate(f, start=1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as err:
                return ValueError(f"{path}:{number}: not UTF-8 (byte {line[err.start]:#04x} at column "
                                  f"{err.start + 1}); convert the file to UTF-8 from its encoding, e.g. "
                                  f"iconv -f latin1 -t utf-8 {shlex.quote(str(path))} > utf8-copy")
    return ValueError(f"{path}: not UTF-8; convert it, e.g. iconv -f latin1 -t utf-8")


def json_lines(path: Path):
    """(location "file:line", object) of every non-blank line of a JSONL file."""
    try:
        with open(path, encoding="utf-8-sig") as f:
            for number, line in enumerate(f, start=1):
                if line.strip():
                    if line.lstrip().startswith("["):
                        raise ValueError(f"{path}:{number}: a JSON array; expected JSON Lines, one object per line "
                                         f"(convert it, e.g. jq -c '.[]' {shlex.quote(str(path))} > rows.jsonl)")
                    try:
                        row = json.loads(line)
                    except json.JSONDecodeError as err:
                        raise ValueError(f"{path}:{number}: not a JSON object ({err})") from err
                    if not isinstance(row, dict):
                        raise ValueError(f"{path}:{number}: a JSON {type(row).__name__}, expected an object")
                    yield f"{path}:{number}", row
    except UnicodeDecodeError:
        raise not_utf8(path) from None


def records(path: Path):
    """(location, row dict) of a JSONL file, or of a Parquet / Arrow file or datasets directory
    (documents.table_rows: ClassLabel ids as their names)."""
    return table_rows(path) if is_table(path) else json_lines(path)


def delimited_rows(path: Path, delimiter: str, header: bool = True, skipped: list | None = None):
    """(location "file:line", row dict) of a CSV (Excel quoting) or a GLUE .tsv: tab-separated with
    no quoting at all (csv.QUOTE_NONE, as GLUE's own loaders: SST-2 sentences hold quote characters).
    header=False: the file has no header row (GLUE's CoLA), and the columns are named "0", "1", ...
    A .tsv row with more or fewer cells than its header is skipped, its line number appended to
    `skipped`: GLUE's QQP ships such broken lines, which fairseq's RoBERTa recipe (awk NF==fields)
    and datasets' glue loader drop too. A CSV row with more cells than its header is refused (an unquoted
    comma: which cell is the label is unknown), as pandas and datasets refuse it; a short one is kept (it
    reads None: read_examples says so)."""
    quoting = csv.QUOTE_NONE if delimiter == "\t" else csv.QUOTE_MINIMAL
    raise_field_size_limit()
    reader = None
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:
            if header:
                reader = csv.DictReader(f, delimiter=delimiter, quoting=quoting)
                twice = [name for name, n in collections.Counter(reader.fieldnames or []).items() if n > 1 and name]
                if twice:  # DictReader would keep the last one's cells
                    raise ValueError(f"{path}:1: the header names the column {twice[0]!r} twice; rename one")
                for row in reader:
                    # DictReader puts the cells past the header under None, fills a short row with None
                    if delimiter == "\t" and skipped is not None and (None in row or None in row.values()):
                        skipped.append(reader.line_num)
                        continue
                    if None in row and delimiter != "\t":
                        cells = len(reader.fieldnames) + len(row[None])
                        raise ValueError(f"{path}:{reader.line_num}: {cells} cells, the header has "
                                         f"{len(reader.fieldnames)}; quote a cell that holds a comma "
                                         '("slow, but rewarding"), or remove the extra cells')
                    if quoting == csv.QUOTE_NONE:
                        refuse_quoted(f"{path}:{reader.line_num}", row.values())
                    yield f"{path}:{reader.line_num}", row
                return
            reader = csv.reader(f, delimiter=delimiter, quoting=quoting)
            for row in reader:
                if row:  # a blank line, as DictReader skips it
                    if quoting == csv.QUOTE_NONE:
                        refuse_quoted(f"{path}:{reader.line_num}", row)
                    yield f"{path}:{reader.line_num}", {str(i): cell for i, cell in enumerate(row)}
    except UnicodeDecodeError:
        raise not_utf8(path) from None
    except csv.Error as err:  # the line where the reader stopped (DictReader's own line_num lags a row behind)
        line = f":{getattr(reader, 'reader', reader).line_num}" if reader is not None else ""
        kind = "a tab-separated file" if delimiter == "\t" else "CSV"
        raise ValueError(f"{path}{line}: not readable as {kind} ({err}); fix or remove the row") from None


def refuse_quoted(where: str, cells) -> None:
    """Refuse a .tsv cell quoted as pandas' to_csv(sep="\\t") writes one holding a quote (in quotes, each
    quote doubled): a .tsv is read without quoting (as GLUE's), where the quotes would stay in the text."""
    for cell in cells:
        if isinstance(cell, str) and '""' in cell and cell[0] == '"' == cell[-1]:
            raise ValueError(f"{where}: the cell {cell[:60]!r} is quoted, as pandas' to_csv(sep='\\t') writes a "
                             "cell holding a quote; a .tsv is read without quoting, as GLUE's: save the file as "
                             ".csv (read with quoting) or .jsonl")


def is_scalar(value) -> bool:
    """Whether a JSON / table value is a string, number or bool (a text, a label, a tag), not a list, object
    or null, which str() would turn into a text or a class of its own ("[3, 5]", "None")."""
    return isinstance(value, (str, int, float, bool))


def shorten(value, width: int = 60) -> str:
    """A value as JSON, cut to `width` characters, for messages."""
    text = json.dumps(value, default=str)
    return text if len(text) <= width else text[:width - 3] + "..."


def raise_field_size_limit() -> None:
    """Lift the csv module's 131072-character cap on a cell (a long document is truncated to --max-len
    later anyway): to sys.maxsize, or the largest a C long holds where that overflows (Windows)."""
    limit = sys.maxsize
    while True:
        try:
            csv.field_size_limit(limit)
            return
        except OverflowError:
            limit //= 2


def skipped_note(path, skipped: list[int]) -> str:
    """The one line saying which rows delimited_rows skipped (the first 5 line numbers)."""
    lines = ", ".join(map(str, skipped[:5])) + (", ..." if len(skipped) > 5 else "")
    return (f"{path}: skipped {len(skipped)} row{'s' if len(skipped) > 1 else ''} whose number of columns "
            f"differs from the header's (line{'s' if len(skipped) > 1 else ''} {lines}), as GLUE's "
            "loaders do (fairseq's preprocess_GLUE_tasks.sh, datasets' glue)")


def place_in(where: str, path) -> str:
    """A location "file:12" as "line 12", "file@row3" (a table's row, 0-based as datasets indexes it) as
    "row 3", for a message that names the file once; a datasets directory's row keeps its shard's name."""
    rest = where[len(str(path)):].lstrip("/\\") if where.startswith(str(path)) else where
    return f"line {rest[1:]}" if rest.startswith(":") else rest.replace("@row", " row ").strip()


def hold_out(train: list, seed: int, path) -> tuple[list, list]:
    """(train, valid): a deterministic 10% of the examples held out, for runs without --valid."""
    if len(train) < 2:
        raise ValueError(f"{path} holds {len(train)} example: too few to hold 10% out for validation and "
                         "train on the rest; add examples, or pass --valid")
    held = set(np.random.default_rng(seed).permutation(len(train))[: max(1, len(train) // 10)].tolist())
    return [e for i, e in enumerate(train) if i not in held], [train[i] for i in sorted(held)]


def pad(rows, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention mask) of id arrays, or of equally long lists of them (a question's options), padded
    on the right to the longest: (n, longest) or (n, options, longest). The mask is 1 on each array's own
    tokens whatever their ids: a text's literal "<pad>" encodes to the pad id, and transformers attends to it."""
    nested = [row if isinstance(row, list) else [row] for row in rows]
    longest = max(len(x) for row in nested for x in row)
    ids = np.full((len(rows), len(nested[0]), longest), pad_id, dtype=np.int64)
    mask = np.zeros_like(ids)
    for i, row in enumerate(nested):
        for j, x in enumerate(row):
            ids[i, j, :len(x)], mask[i, j, :len(x)] = x, 1
    if not isinstance(rows[0], list):
        ids, mask = ids[:, 0], mask[:, 0]
    return torch.from_numpy(ids), torch.from_numpy(mask)


def label_names(labels, declared: list[str] | None = None) -> list[str]:
    """Class names in id order: a dataset's ClassLabel names (`declared`) when they hold every label,
    as run_glue keeps them; else numerically sorted when every label is an integer, else sorted."""
    names = set(labels)
    if declared and names <= set(declared):
        return list(declared)
    if all(map(is_integer, names)):
        return sorted(names, key=int)
    return sorted(names)


def check_known_labels(names, valid_labels, what: str, valid_path, train_path) -> None:
    """Refuse --valid labels that --train never has: the head would get an output never trained (and a
    misspelt label would count as a wrong answer), as run_glue takes its label list from the training data."""
    known = set(names)
    unseen = collections.Counter(label for label in valid_labels if label not in known)
    if unseen:
        listed = ", ".join(f"{label!r} ({n}x)" for label, n in sorted(unseen.items()))
        unlabelled = (" (-1 is datasets' mark of an unlabelled example, as in GLUE's test splits: validate on "
                      "the validation split)" if "-1" in unseen else "")
        raise ValueError(f"{valid_path} has {what} that {train_path} never has: {listed}{unlabelled}; the training "
                         f"data's are {names}. Fix the spelling, or add training examples of them")


def is_integer(label: str) -> bool:
    """Whether a label is an integer as pandas reads one ("-1", "+1")."""
    return re.fullmatch(r"[+-]?[0-9]+", label) is not None


def number(label: str) -> float | None:
    """The label as a finite float, else None."""
    try:
        value = float(label)
    except ValueError:
        return None
    return value if np.isfinite(value) else None


def is_regression(labels, places, problem_type: str, path) -> bool:
    """Whether classify's training labels are scores to regress: --problem-type regression, or (auto) every
    label is a number and some are not integers ("3.800", as GLUE's STS-B; run_glue decides from the
    training label column's type, which is float then). Integer labels stay classes; --problem-type says
    otherwise. Auto refuses mostly fractional scores with some labels that are not numbers (a typo would
    make every score a class)."""
    if problem_type == "single_label_classification":
        return False
    if problem_type == "regression":
        check_scores(labels, places, path, "--problem-type regression needs a numeric score on every row")
        return True
    fractional = sum(number(label) is not None and not is_integer(label) for label in labels)
    if fractional > len(labels) / 2:
        check_scores(labels, places, path, "most labels are scores with a fraction (a regression)",
                     ", or pass --problem-type single_label_classification if the labels are classes")
    return fractional > 0 and all(number(label) is not None for label in labels)


def check_scores(labels, places, path, why: str, hint: str = "") -> None:
    """Refuse regression labels that are not finite numbers, naming them and their lines or rows (`places`,
    read_examples')."""
    bad = [(place, label) for place, label in zip(places, labels) if number(label) is None]
    if bad:
        listed = ", ".join(f"{place} {label!r}" for place, label in bad[:5]) + (", ..." if len(bad) > 5 else "")
        raise ValueError(f"{path}: label {bad[0][1]!r} is not a finite number; {why}: fix or remove the "
                         f"row{'s' if len(bad) > 1 else ''} whose label is not a number ({listed}){hint}")


def pearson(x: np.ndarray, y: np.ndarray) -> float:
    """Pearson's r; 0 when either side is constant (undefined there, and never the best epoch's)."""
    x, y = x - x.mean(), y - y.mean()
    scale = np.sqrt((x * x).sum() * (y * y).sum())
    return float((x * y).sum() / scale) if scale > 0 else 0.0


def average_ranks(x: np.ndarray) -> np.ndarray:
    """0-based ranks, tied values sharing their mean rank (as scipy.stats.rankdata's default)."""
    ranks = np.empty(len(x))
    ranks[np.argsort(x, kind="stable")] = np.arange(len(x))
    _, tie_group, tie_count = np.unique(x, return_inverse=True, return_counts=True)
    return (np.bincount(tie_group, weights=ranks) / tie_count)[tie_group]


def spearman(x: np.ndarray, y: np.ndarray) -> float:
    """Spearman's rank correlation: Pearson's r of the average ranks."""
    return pearson(average_ranks(x), average_ranks(y))


class Task:
    """One task's data and metrics; finetune.Finetuner runs the loop.

    Subclasses read --train / --valid in __init__, set `names` (the labels a checkpoint must
    match), build the model's inputs in `encode(tokenizer, max_len)`, and give batches of
    model keyword arguments and the validation metrics (`best_metric`, one of `metrics`, picks the best
    epoch; every one is higher-better, and --metric may name any). evaluate() keeps its `predictions`,
    which `predictions_text()` formats for the task's tools; `read_unlabelled()` reads --predict's file."""

    name = model_class = best_metric = None
    metrics = ()  # what evaluate() reports besides the loss
    predictions = None  # the last evaluate()'s, per validation example, for write_predictions
    notes = ()  # lines about the data for the run's log (rows skipped), set by __init__
    max_len = 512  # default tokens per sequence, capped by the model's positions
    unit = "examples"  # what one training item is (len(task) counts them)

    def model_kwargs(self) -> dict:
        return {}

    def config_extra(self) -> dict:
        """Fields for the exported config.json (id2label for the pipelines)."""
        if not self.names:
            return {}
        return {"id2label": {str(i): n for i, n in enumerate(self.names)},
                "label2id": {n: i for i, n in enumerate(self.names)}}

    def describe(self) -> str:
        return f"{len(self.names)} labels {self.names}"

    def follow_head_labels(self, id2label: dict) -> bool:
        """Number the labels as the --model's kept head does (its config's id2label), as run_glue / run_ner
        do, so that each of its rows keeps meaning its class: True when the head names this data's labels
        (letter case aside, as run_glue compares them; the data's spelling is kept) or only has transformers'
        placeholders LABEL_0, LABEL_1, ... (no names: the data's order stays); False when it names others."""
        order = [str(id2label[i]) for i in sorted(id2label)]
        if not self.names or order == [f"LABEL_{i}" for i in range(len(order))]:
            return True
        spelt = {name.lower(): name for name in self.names}
        if len(spelt) != len(self.names) or sorted(n.lower() for n in order) != sorted(spelt):
            return False
        self.names = [spelt[n.lower()] for n in order]
        return True

    def valid_batches(self, batch_size: int, pad_id: int):
        """The validation batches evaluate() reads, in its order (finetune splits them over processes)."""
        return self.batches(np.arange(len(self.valid_ids)), batch_size, pad_id, train=False)

    def for_predictions(self, path, tokenizer, max_len: int) -> "Task":
        """A copy of this task whose validation split is the file at `path`, read as --valid is but with its
        labels (tags, answers) optional and unread: placeholders stand in, so evaluate() runs (its metrics
        mean nothing) and write_predictions() writes the file's predictions (finetune --predict)."""
        other = copy.copy(self)
        other.predictions = None
        other.read_unlabelled(path, tokenizer, max_len)
        return other

    def write_predictions(self, stem: Path) -> Path:
        """The last evaluate()'s predictions, one per validation example in its order, written (atomically)
        to `stem` with the task's suffix, in the format its tools read; returns the path."""
        suffix, text = self.predictions_text()
        path = stem.with_suffix(suffix)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, text)
        return path

    @staticmethod
    def after_export(directory: Path) -> None:
        """Adjust an exported model directory for this task (finetune's and roberta_fast.export's)."""

    def baseline_warning(self, best: dict) -> str | None:
        return None


# ------------------------------------------------------------- classification
def read_examples(path, cfg, notes: list | None = None, places: list | None = None, labelled: bool = True
                  ) -> list[tuple[str, str | None, str]]:
    """(text, pair or None, label as a string) of every row of a CSV or JSONL file or a table; the labels of a
    .csv / .tsv column of integers as pandas reads them ("+1", "01" and " 1" are "1"), a table's as the dataset
    has them (a ClassLabel's name, spaces and all: its declared names keep their order). Fields given
    as column numbers (0-based) read a .csv / .tsv that has no header row (GLUE's CoLA). The line
    saying which broken .tsv rows were skipped (delimited_rows) goes to `notes` (else it is printed); each
    example's line or row (place_in) to `places`, for messages about its label. labelled=False (--predict's
    file, GLUE's test sets): the label column is not read, and may be absent (label None)."""
    path = data_file(path)
    texts = [cfg.text_field] + ([cfg.pair_field] if cfg.pair_field else [])
    fields = texts + ([cfg.label_field] if labelled else [])  # labelled=False: --predict's file, labels unread
    suffix, table = path.suffix.lower(), is_table(path)
    skipped, numbered = [], False
    if suffix in (".csv", ".tsv"):
        numbered = all(str(name).isdigit() for name in fields)
        rows = delimited_rows(path, "," if suffix == ".csv" else "\t", header=not numbered, skipped=skipped)
    elif suffix in (".jsonl", ".json") or table:
        rows = records(path)
    else:
        raise ValueError(f"{path}: expected a .csv or .tsv (GLUE's, with a header row), a .jsonl, a Parquet or "
                         "Arrow file or a datasets save_to_disk directory")
    examples, first, numeric, empty_text, surrogates = [], None, {}, [], []
    for where, row in rows:
        if numbered:  # for header_row_error: which columns hold a number on every row after the first
            if first is None:
                first = where, row
            else:
                numeric.update({k: numeric.get(k, True) and number(v) is not None for k, v in row.items()})
        missing = [name for name in fields if name not in row]
        if missing:
            raise ValueError(f"{where}: missing {missing} (the row has {sorted(row)}); name the columns with "
                             "--text-field / --pair-field / --label-field, a .csv/.tsv without a header row by "
                             f"column number. {glue_fields_hint()}")
        odd = next((name for name in fields if row[name] is not None and not is_scalar(row[name])), None)
        if odd is not None:
            value = row[odd]
            fix = ("multi-label classification (a list of labels per row) is not supported: give one label per row"
                   if odd == cfg.label_field and isinstance(value, list) else "give one string or number")
            raise ValueError(f"{where}: {odd!r} holds {shorten(value)}, not a string or number; {fix}")
        short = [name for name in fields if row[name] is None]
        if short and suffix in (".csv", ".tsv"):  # a CSV row short of columns reads None (delimited_rows)
            what = {cfg.text_field: "text", cfg.pair_field: "pair text", cfg.label_field: "label"}
            cells = sum(value is not None for key, value in row.items() if key is not None)
            raise ValueError(f"{where}: the row has {cells} of the header's {len(row)} columns, no "
                             f"{' and no '.join(f'{what[n]} ({n!r})' for n in short)}; fix the line (a cell "
                             "holding the delimiter needs quotes) or remove the row")
        row = {**row, **{name: "" for name in short}}  # a JSON null, a Parquet null: an empty cell
        label = str(row[cfg.label_field]).strip() if labelled else None  # " 1" is 1, as pandas and datasets read it
        if labelled and (not label or label.lower() == "nan"
                         or (suffix in (".csv", ".tsv") and label in PANDAS_MISSING)):
            # NaN (pandas' and datasets' missing value), or a cell pandas reads as one ("N/A", "NULL", "None")
            shown = "empty" if not label else "NaN" if label.lower() == "nan" else f"{label!r} (pandas: missing)"
            raise ValueError(f"{where}: the label ({cfg.label_field!r}) is {shown} on this line; fill it in or "
                             "remove the row")
        if table and labelled:  # typed data: a ClassLabel's name (" neg") or a string is the dataset's, spaces and all
            label = str(row[cfg.label_field])
        if any(not str(row[name]).strip() for name in fields):  # kept, as GLUE's loaders keep QQP's empty questions
            empty_text.append(place_in(where, path))
        text, pair = str(row[cfg.text_field]), str(row[cfg.pair_field]) if cfg.pair_field else None
        if _SURROGATE.search(text + (pair or "")):  # JSON's "\ud83d" escapes: not encodable, as preprocess
            surrogates.append(place_in(where, path))  # replaces them (the tokenizer raised a bare TypeError)
            text, pair = _SURROGATE.sub("\ufffd", text), pair and _SURROGATE.sub("\ufffd", pair)
        examples.append((text, pair, label))
        if places is not None:
            places.append(place_in(where, path))
    if skipped and not labelled:  # a test set's row skipped would leave it without a prediction, and shift
        lines = ", ".join(map(str, skipped[:5])) + (", ..." if len(skipped) > 5 else "")  # the index after it
        raise ValueError(f"{path}: {len(skipped)} row(s) have another number of columns than the header (line(s) "
                         f"{lines}); every row of a file to predict needs its prediction: fix them (a cell holding "
                         "a tab needs quotes)")
    if first is not None and len(examples) >= 3:
        header_row_error(*first, numeric, cfg)
    if not examples:
        raise ValueError(f"{path} holds no examples" + (f": {skipped_note(path, skipped)}" if skipped else ""))
    if labelled and suffix in (".csv", ".tsv") and all(is_integer(label) for _, _, label in examples):
        # pandas (run_glue's datasets) reads such a column as integers: "+1", "01" and "1" are one class, 1
        examples = [(text, pair, str(int(label))) for text, pair, label in examples]
    for name in texts:
        if all(not text.strip() for text in (e[0] if name == cfg.text_field else e[1] for e in examples)):
            raise ValueError(f"{path}: the column {name!r} is empty on every row; name the text columns with "
                             f"--text-field / --pair-field. {glue_fields_hint()}")
    said = [skipped_note(path, skipped)] if skipped else []
    if empty_text:
        lines = ", ".join(empty_text[:5]) + (", ..." if len(empty_text) > 5 else "")
        said.append(f"{path}: kept {len(empty_text)} row{'s' if len(empty_text) > 1 else ''} whose text or pair "
                    f"text is empty ({lines}), as GLUE's loaders do")
    if surrogates:
        lines = ", ".join(surrogates[:5]) + (", ..." if len(surrogates) > 5 else "")
        said.append(f"{path}: lone surrogates (\\ud800-\\udfff escapes, half of an emoji's pair) in {len(surrogates)} "
                    f"row(s) ({lines}) are not text: replaced by U+FFFD, as preprocess does")
    for note in said:
        if notes is None:
            print(f"note: {note}")
        else:
            notes.append(note)
    return examples


def header_row_error(where: str, row: dict, numeric: dict, cfg) -> None:
    """Refuse a header row read as an example (columns named by number on a file that has one, as
    GLUE's MRPC: its header would become a class 'Quality', STS-B's 'score' would end the regression).
    The sign, which a file without header (CoLA, whose label column is numbers) never shows: a column
    that holds a number on every later row but not on the first (GLUE's index, ids, labels, scores)."""
    column = next((k for k, v in row.items() if numeric.get(k) and number(v) is None), None)
    if column is None:
        return
    flags = [("--text-field", cfg.text_field), ("--pair-field", cfg.pair_field), ("--label-field", cfg.label_field)]
    named = " ".join(f"{flag} {shlex.quote(row[str(n)])}" for flag, n in flags if n is not None and str(n) in row)
    raise ValueError(f"{where}: this first line looks like a header row, not an example: column {column} holds "
                     f"{row[column]!r} where every later row has a number. Name the columns by the header "
                     f"({named}), or remove the header line to name them by number")


def encode(tokenizer, examples, max_len: int) -> list[np.ndarray]:
    """Token ids per example, pairs as `<s> a </s></s> b </s>`, truncated to max_len."""
    backend = tokenizer.backend
    backend.enable_truncation(max_len, strategy="longest_first")
    try:
        inputs = [(t, p) if p is not None else t for t, p, _ in examples]
        return [np.asarray(e.ids, dtype=np.int64) for e in backend.encode_batch(inputs)]
    finally:
        backend.no_truncation()


def accuracy_and_macro_f1(predictions: np.ndarray, labels: np.ndarray, num_classes: int) -> tuple[float, float]:
    """Accuracy, and F1 averaged over the classes present in labels or predictions."""
    accuracy = float((predictions == labels).mean())
    f1s = []
    for c in range(num_classes):
        tp = np.sum((predictions == c) & (labels == c))
        fp = np.sum((predictions == c) & (labels != c))
        fn = np.sum((predictions != c) & (labels == c))
        if tp + fp + fn:
            f1s.append(2 * tp / (2 * tp + fp + fn))
    return accuracy, float(np.mean(f1s))


def matthews_corrcoef(predictions: np.ndarray, labels: np.ndarray, num_classes: int) -> float:
    """Matthews correlation (GLUE's CoLA metric), multi-class as sklearn.metrics.matthews_corrcoef:
    from the confusion matrix; 0 when a side is constant (sklearn's value there)."""
    confusion = np.zeros((num_classes, num_classes))
    np.add.at(confusion, (labels, predictions), 1)
    true, predicted, n = confusion.sum(1), confusion.sum(0), confusion.sum()
    covariance = np.trace(confusion) * n - predicted @ true
    scale = np.sqrt((n * n - predicted @ predicted) * (n * n - true @ true))
    return float(covariance / scale) if scale > 0 else 0.0


def classification_scores(predictions: np.ndarray, labels: np.ndarray, num_classes: int) -> dict:
    """Accuracy; with two classes GLUE's F1 (MRPC, QQP): of the positive class, id 1 (the second label in
    order: "1" of 0/1 labels), as sklearn's f1_score default; macro-F1; Matthews correlation (CoLA)."""
    accuracy, macro_f1 = accuracy_and_macro_f1(predictions, labels, num_classes)
    scores = {"accuracy": accuracy}
    if num_classes == 2:
        tp = np.sum((predictions == 1) & (labels == 1))
        wrong = np.sum(predictions != labels)
        scores["f1"] = float(2 * tp / (2 * tp + wrong)) if tp + wrong else 0.0
    return {**scores, "macro_f1": macro_f1, "mcc": matthews_corrcoef(predictions, labels, num_classes)}


class ClassifyTask(Task):
    """Sequence classification, or regression on numeric scores (is_regression: names is then [])."""

    name, model_class = "classify", RobertaForSequenceClassification

    def __init__(self, cfg):
        self.cfg, self.notes = cfg, []
        train_places, valid_places = [], []  # each example's line or row, for check_scores' messages
        train = read_examples(cfg.train, cfg, self.notes, train_places)
        valid = read_examples(cfg.valid, cfg, self.notes, valid_places) if cfg.valid else None
        self.regression = is_regression([e[2] for e in train], train_places, cfg.problem_type, cfg.train)
        classes = {e[2] for e in train}  # of the whole of --train, before a hold-out
        if self.regression and valid is not None:
            check_scores([e[2] for e in valid], valid_places, cfg.valid,
                         "a regression needs a numeric score on every row")
        if valid is None:
            train, valid = hold_out(train, cfg.seed, cfg.train)  # (refuses a one-example file first)
        if not self.regression and len(classes) < 2:
            raise ValueError(f"{cfg.train}: every row has the label {classes.pop()!r}, and a classifier needs at "
                             f"least 2 classes; is --label-field {cfg.label_field!r} the label column?")
        if cfg.valid and not self.regression:
            check_known_labels(label_names([e[2] for e in train]), [e[2] for e in valid], "labels",
                               cfg.valid, cfg.train)
        self.train, self.valid = train, valid
        declared = table_label_names(cfg.train).get(cfg.label_field) if is_table(cfg.train) else None
        self.names = [] if self.regression else label_names([e[2] for e in train + valid], declared)
        self.best_metric = "pearson" if self.regression else "accuracy"
        self.metrics = (("pearson", "spearman") if self.regression else
                        ("accuracy", "f1", "macro_f1", "mcc") if len(self.names) == 2 else ("accuracy", "macro_f1", "mcc"))

    def model_kwargs(self):
        return {"num_labels": 1 if self.regression else len(self.names)}

    def config_extra(self):
        return {"problem_type": "regression"} if self.regression else super().config_extra()

    def describe(self):
        if self.regression:
            scores = [float(e[2]) for e in self.train]
            return f"regression on scores from {min(scores):g} to {max(scores):g} (MSE; Pearson, Spearman)"
        return f"{len(self.names)} classes {self.names}"

    def encode(self, tokenizer, max_len):
        index = {name: i for i, name in enumerate(self.names)}
        label = float if self.regression else index.__getitem__
        self.train_ids, self.valid_ids = (encode(tokenizer, data, max_len) for data in (self.train, self.valid))
        self.train_labels = [label(e[2]) for e in self.train]
        self.valid_labels = [label(e[2]) for e in self.valid]

    def __len__(self):
        return len(self.train_ids)

    def batches(self, order, batch_size, pad_id, train=True):
        ids, labels = (self.train_ids, self.train_labels) if train else (self.valid_ids, self.valid_labels)
        for start in range(0, len(order), batch_size):
            chosen = order[start:start + batch_size]
            x, mask = pad([ids[i] for i in chosen], pad_id)
            yield {"input_ids": x, "attention_mask": mask,
                   "labels": torch.tensor([labels[i] for i in chosen],
                                          dtype=torch.float32 if self.regression else torch.long)}

    def evaluate(self, run, batch_size, pad_id):
        losses, outputs = [], []
        for batch in self.valid_batches(batch_size, pad_id):
            out = run(batch)
            losses.append(float(out.loss) * len(batch["labels"]))
            logits = out.logits.float().cpu()
            outputs.append((logits[:, 0] if self.regression else logits.argmax(-1)).numpy())
        outputs, labels = np.concatenate(outputs), np.asarray(self.valid_labels)
        self.predictions = outputs
        loss = sum(losses) / len(self.valid_ids)
        if self.regression:
            return {"loss": loss, "pearson": pearson(outputs, labels), "spearman": spearman(outputs, labels)}
        return {"loss": loss, **classification_scores(outputs, labels, len(self.names))}

    def read_unlabelled(self, path, tokenizer, max_len):
        self.valid = read_examples(path, self.cfg, self.notes, labelled=False)
        self.valid_ids = encode(tokenizer, self.valid, max_len)
        self.valid_labels = [0.0 if self.regression else 0] * len(self.valid)

    def predictions_text(self):
        """GLUE's submission format: a header, then `index<TAB>prediction` (the label's name, or the score)."""
        rows = (repr(float(x)) if self.regression else self.names[x] for x in self.predictions)
        return ".tsv", "index\tprediction\n" + "".join(f"{i}\t{row}\n" for i, row in enumerate(rows))

    def baseline_warning(self, best):
        if self.regression:  # the trivial answer: the training scores' mean, for every example
            constant = float(np.mean((np.asarray(self.valid_labels) - np.mean(self.train_labels)) ** 2))
            if best["loss"] >= constant:
                return (f"no epoch beat always predicting the training scores' mean (MSE {constant:.4f}): "
                        "the model has not learned the task")
            return None
        majority = max(np.bincount(self.valid_labels)) / len(self.valid_labels)
        if best["accuracy"] <= majority:
            return (f"no epoch beat always predicting the most frequent class ({majority:.4f}): "
                    "the model has not learned the task")
        return None


# --------------------------------------------------------- token classification
def read_tagged(path, labelled: bool = True) -> list[tuple[list[str], list[str] | None]]:
    """(words, tags) of every sentence of a CoNLL-style file, or of a JSONL file (by suffix .jsonl /
    .json), Parquet / Arrow file or datasets directory with "tokens" and "tags" (or "ner_tags").
    labelled=False (--predict's file): tags are not read and may be absent, CoNLL lines a word alone (tags None)."""
    path = data_file(path)
    sentences = []
    if path.suffix.lower() in (".jsonl", ".json") or is_table(path):
        for where, row in records(path):
            words, tags = row.get("tokens"), row.get("tags", row.get("ner_tags"))
            if not labelled and isinstance(words, list):
                tags = [None] * len(words)
            if not isinstance(words, list) or not isinstance(tags, list):
                raise ValueError(f"{where}: expected {{\"tokens\": [...], \"tags\": [...]}} "
                                 f"(the object has {sorted(row)})")
            if len(words) != len(tags) or not words:
                raise ValueError(f"{where}: {len(words)} tokens and {len(tags)} tags; "
                                 "give one tag per token, at least one token")
            if not all(isinstance(w, str) and w and not w.isspace() for w in words):
                raise ValueError(f"{where}: every token must be a non-blank string")
            odd = [t for t in tags if not is_scalar(t)] if labelled else []
            if odd:
                raise ValueError(f"{where}: a tag is {shorten(odd[0])}; every tag must be a string (or a ClassLabel id)")
            sentences.append((words, [str(t) for t in tags] if labelled else None))
    else:
        words, tags = [], []
        try:
            with open(path, encoding="utf-8-sig") as f:
                for number, line in enumerate(f, start=1):
                    # ASCII spaces and tabs only (as datasets' conll2003 splits on " "): str.split() would cut a
                    # word at a no-break or ideographic space ('§\u00a0433') and silently drop its rest
                    columns = [c for c in re.split(r"[ \t]+", line.rstrip("\r\n")) if c]
                    # a -DOCSTART- line ends a sentence as a blank line does (datasets' conll2003 loader), also
                    # when no blank line follows it
                    if not columns or columns[0] == "-DOCSTART-":
                        if words:
                            sentences.append((words, tags if labelled else None))
                        words, tags = [], []
                        continue
                    if len(columns) < 2 and labelled:
                        raise ValueError(f"{path}:{number}: {line.strip()!r} has a word and no tag; CoNLL lines "
                                         "are 'word<TAB or space>tag' (the tag in the last column), a blank line "
                                         "between sentences")
                    words.append(columns[0])
                    tags.append(columns[-1])
        except UnicodeDecodeError:
            raise not_utf8(path) from None
        if words:
            sentences.append((words, tags if labelled else None))
    if not sentences:
        raise ValueError(f"{path} holds no sentences")
    return sentences


def encode_words(tokenizer, sentences, max_len: int) -> tuple[list[np.ndarray], list[np.ndarray], int]:
    """(ids, word index per token (-1 on `<s>`, `</s>`), sentences truncated) for word lists.

    As RobertaTokenizerFast(add_prefix_space=True) with is_split_into_words=True, by the same means
    (tokenizers' pre-tokenized input): each word encoded alone with a space before it, none when it
    starts with one, and a word that is a special token's text (`<s>`) as that token; at most
    max_len tokens with `<s>` and `</s>`."""
    backend = with_prefix_space(tokenizer.backend)
    backend.no_truncation()
    backend.no_padding()
    encodings = backend.encode_batch([words for words, _ in sentences], is_pretokenized=True,
                                     add_special_tokens=False)
    ids, word_index, truncated = [], [], 0
    for encoding in encodings:
        tokens = [tokenizer.bos_id] + encoding.ids
        owner = [-1] + [-1 if w is None else w for w in encoding.word_ids]
        if len(tokens) + 1 > max_len:
            tokens, owner = tokens[:max_len - 1], owner[:max_len - 1]
            truncated += 1
        ids.append(np.asarray(tokens + [tokenizer.eos_id], dtype=np.int64))
        word_index.append(np.asarray(owner + [-1], dtype=np.int64))
    return ids, word_index, truncated


def with_prefix_space(backend):
    """A copy of a tokenizers.Tokenizer whose byte-level pre-tokenizer and RoBERTa post-processor (also
    inside a Sequence) add a space before the text, their other settings kept."""
    from tokenizers import Tokenizer

    def prefixed(part):
        if isinstance(part, dict):
            part = {key: [prefixed(p) for p in value] if key in ("pretokenizers", "processors") else value
                    for key, value in part.items()}
            if part.get("type") in ("ByteLevel", "RobertaProcessing"):
                part["add_prefix_space"] = True
        return part

    data = json.loads(backend.to_str())
    for key in ("pre_tokenizer", "post_processor"):
        data[key] = prefixed(data.get(key))
    return Tokenizer.from_str(json.dumps(data))


def first_subtoken_labels(word_index: np.ndarray, tag_ids) -> np.ndarray:
    """Each word's tag id on its first sub-token, -100 on the other sub-tokens and the special tokens."""
    first = (word_index >= 0) & np.r_[True, word_index[1:] != word_index[:-1]]
    labels = np.full(len(word_index), IGNORE, dtype=np.int64)
    labels[first] = np.asarray(tag_ids)[word_index[first]]
    return labels


def chunks(tags: list[str]) -> set[tuple[str, int, int]]:
    """(type, first, last) of the entities in one sentence's tags, as seqeval's default mode
    (conlleval): an I- or E- after O or another type starts an entity, a change of type ends one."""
    found, start, prev, prev_type = set(), 0, "O", ""
    for i, tag in enumerate(list(tags) + ["O"]):
        kind, entity = (tag[0], tag[2:]) if tag != "O" else ("O", "")
        ends = (prev in "ES" or (prev in "BI" and kind in "BSO")) or (prev != "O" and prev_type != entity)
        if ends and prev != "O":
            found.add((prev_type, start, i - 1))
        if (kind in "BS" or (prev in "ESO" and kind in "EI")) or (kind != "O" and prev_type != entity):
            start = i
        prev, prev_type = kind, entity
    return found


def is_chunked(names) -> bool:
    """Whether tags name entities (O, or B-/I-/E-/S- and a type) rather than, say, POS tags."""
    return all(n == "O" or re.fullmatch(r"[BIES]-.+", n) for n in names)


def entity_scores(gold: list[list[str]], predicted: list[list[str]]) -> dict:
    """Micro precision, recall and F1 of the entities (seqeval's classification_report 'micro avg')."""
    true = {(s, *c) for s, tags in enumerate(gold) for c in chunks(tags)}
    pred = {(s, *c) for s, tags in enumerate(predicted) for c in chunks(tags)}
    correct = len(true & pred)
    p = correct / len(pred) if pred else 0.0
    r = correct / len(true) if true else 0.0
    return {"precision": p, "recall": r, "f1": 2 * p * r / (p + r) if p + r else 0.0}


class TokenTask(Task):
    name, model_class = "token", RobertaForTokenClassification

    def __init__(self, cfg):
        train = read_tagged(cfg.train)
        valid = read_tagged(cfg.valid) if cfg.valid else None
        if valid is None:
            train, valid = hold_out(train, cfg.seed, cfg.train)
        else:
            check_known_labels(label_names([t for _, tags in train for t in tags]),
                               [t for _, tags in valid for t in tags], "tags", cfg.valid, cfg.train)
        self.train, self.valid = train, valid
        declared = table_label_names(cfg.train) if is_table(cfg.train) else {}
        self.names = label_names([t for _, tags in train + valid for t in tags],
                                 declared.get("tags", declared.get("ner_tags")))
        self.chunked = is_chunked(self.names)
        self.best_metric = "f1" if self.chunked else "accuracy"
        self.metrics = ("accuracy", "precision", "recall", "f1") if self.chunked else ("accuracy",)

    def model_kwargs(self):
        return {"num_labels": len(self.names)}

    def describe(self):
        return f"{len(self.names)} tags {self.names}" + ("" if self.chunked else " (not BIO: accuracy only)")

    @staticmethod
    def after_export(directory: Path) -> None:
        """add_prefix_space in tokenizer_config.json, so transformers (the token-classification
        pipeline) encodes raw text as the words were encoded in training, the first one with a
        space before it; run_ner saves RoBERTa's tokenizer so too. And in tokenizer.json's
        pre-tokenizer and post-processor, as transformers writes it when it saves such a tokenizer,
        for what reads that file alone (tokenizers.Tokenizer, RobertaTokenizer, TEI, Rust / JS)."""
        from tokenizers import Tokenizer

        path = Path(directory) / "tokenizer_config.json"
        config = json.loads(path.read_text(encoding="utf-8"))
        write_text_atomic(path, json.dumps({**config, "add_prefix_space": True}, indent=2))
        path = Path(directory) / "tokenizer.json"
        if path.is_file():
            write_text_atomic(path, with_prefix_space(Tokenizer.from_file(str(path))).to_str(pretty=True))

    def predictions_text(self):
        """CoNLL: `word<TAB>tag` per line, a blank line after each sentence (conlleval's input with the gold
        column added); a word past --max-len, which has no prediction, gets `_`."""
        lines = []
        for (words, _), tags in zip(self.valid, self.predictions):
            lines += [f"{word}\t{tag}" for word, tag in zip(words, [*tags, *["_"] * (len(words) - len(tags))])]
            lines.append("")
        return ".conll", "".join(line + "\n" for line in lines)

    def read_unlabelled(self, path, tokenizer, max_len):
        self.valid = [(words, [self.names[0]] * len(words)) for words, _ in read_tagged(path, labelled=False)]
        self.valid_ids, owners, _ = encode_words(tokenizer, self.valid, max_len)
        self.valid_labels = [first_subtoken_labels(o, [0] * len(words)) for o, (words, _) in zip(owners, self.valid)]

    def encode(self, tokenizer, max_len):
        index = {n: i for i, n in enumerate(self.names)}
        self.truncated = 0
        for split in ("train", "valid"):
            sentences = getattr(self, split)
            ids, owners, truncated = encode_words(tokenizer, sentences, max_len)
            labels = [first_subtoken_labels(o, [index[t] for t in tags]) for o, (_, tags) in zip(owners, sentences)]
            setattr(self, f"{split}_ids", ids)
            setattr(self, f"{split}_labels", labels)
            self.truncated += truncated

    def __len__(self):
        return len(self.train_ids)

    def batches(self, order, batch_size, pad_id, train=True):
        ids, labels = (self.train_ids, self.train_labels) if train else (self.valid_ids, self.valid_labels)
        for start in range(0, len(order), batch_size):
            chosen = order[start:start + batch_size]
            x, mask = pad([ids[i] for i in chosen], pad_id)
            yield {"input_ids": x, "attention_mask": mask, "labels": pad([labels[i] for i in chosen], IGNORE)[0]}

    def baseline_warning(self, best):
        if self.chunked:
            if best["f1"] <= 0:
                return ("no epoch found a single entity right (entity F1 0, what tagging every word O scores): "
                        "the model has not learned the task")
            return None
        words = np.concatenate([labels[labels != IGNORE] for labels in self.valid_labels])
        majority = np.bincount(words).max() / len(words)
        if best["accuracy"] <= majority:
            return (f"no epoch beat tagging every word with the most frequent tag ({majority:.4f}): "
                    "the model has not learned the task")
        return None

    def evaluate(self, run, batch_size, pad_id):
        """Loss, accuracy over the (untruncated) words, and entity scores when the tags are BIO-like."""
        loss, gold, predicted = 0.0, [], []
        for batch in self.valid_batches(batch_size, pad_id):
            out = run(batch)
            loss += float(out.loss) * len(batch["labels"])
            labels, guesses = batch["labels"].numpy(), out.logits.argmax(-1).cpu().numpy()
            for row, guess in zip(labels, guesses):
                kept = row != IGNORE
                gold.append([self.names[i] for i in row[kept]])
                predicted.append([self.names[i] for i in guess[kept]])
        words = sum(len(g) for g in gold)
        self.predictions = predicted
        result = {"loss": loss / len(self.valid_ids),
                  "accuracy": sum(a == b for g, p in zip(gold, predicted) for a, b in zip(g, p)) / words}
        if self.chunked:
            result.update(entity_scores(gold, predicted))
        return result


# ------------------------------------------------------------ question answering
@dataclass
class QAExample:
    id: str
    question: str
    context: str
    answers: list  # (text, start character) pairs; empty for a v2.0 unanswerable question


@dataclass
class QAFeature:
    """One window of one example: ids (seqlen,), each token's (start, end) character span in the
    context, (-1, -1) off the context; the answer's token positions (0, 0: `<s>`, no answer here)."""

    example: int
    ids: np.ndarray
    offsets: np.ndarray  # (seqlen, 2)
    start: int
    end: int


def _squad_article(where: str, row: dict) -> dict:
    """A row of the Hub's squad / squad_v2 layout as a SQuAD JSON article: one paragraph with one question."""
    answers = row.get("answers")
    if not isinstance(answers, dict) or not isinstance(answers.get("text"), list):
        raise ValueError(f"{where}: expected the Hub's squad columns id, question, context and answers "
                         f"({{text: [...], answer_start: [...]}}); the row has {sorted(row)}")
    starts = answers.get("answer_start") or []
    if len(starts) != len(answers["text"]):
        raise ValueError(f"{where}: {len(answers['text'])} answer texts and {len(starts)} answer_start offsets; "
                         "give one offset per answer text")
    return {"paragraphs": [{"context": row.get("context"), "qas": [{
        "id": row.get("id", where), "question": row.get("question"), "is_impossible": not answers["text"],
        "answers": [{"text": t, "answer_start": a} for t, a in zip(answers["text"], starts)]}]}]}


def squad_articles(path: Path) -> list:
    """The "data" list (articles) of a SQuAD JSON file; or the Hub's squad layout, one question per row (a
    Parquet / Arrow file or datasets directory, JSON Lines or a JSON array of rows as datasets' to_json writes
    them, or JSON whose "data" lists such rows, as run_qa's load_dataset("json", field="data") reads it), each
    row an article of its own."""
    if is_table(path):
        return [_squad_article(where, row) for where, row in table_rows(path)]
    try:
        with open(path, encoding="utf-8-sig") as f:
            text = f.read()
    except UnicodeDecodeError:
        raise not_utf8(path) from None
    try:
        squad = json.loads(text)
    except json.JSONDecodeError as err:
        if err.msg == "Extra data" and text.lstrip().partition("\n")[0].rstrip().endswith("}"):  # JSON Lines
            return [_squad_article(where, row) for where, row in json_lines(path)]
        raise ValueError(f"{path}: not a JSON file ({err}); --task qa reads SQuAD's JSON, or JSON Lines of the "
                         "Hub's squad columns") from err
    if isinstance(squad, dict) and "answers" in squad:  # JSON Lines of one row
        return [_squad_article(f"{path}:1", squad)]
    if isinstance(squad, list) and squad and all(isinstance(row, dict) and "answers" in row for row in squad):
        return [_squad_article(f"{path}: [{i}]", row) for i, row in enumerate(squad)]  # to_json(lines=False)
    if not isinstance(squad, dict) or not isinstance(squad.get("data"), list):
        raise ValueError(f"{path}: expected SQuAD's layout "
                         '{"data": [{"paragraphs": [{"context": ..., "qas": [...]}]}]}, or JSON Lines of the '
                         'Hub\'s squad columns {"id", "question", "context", "answers": {"text": [...], '
                         '"answer_start": [...]}} (or a JSON array of them)')
    return [_squad_article(f"{path}: data[{i}]", article) if isinstance(article, dict) and "answers" in article
            else article for i, article in enumerate(squad["data"])]


def read_squad(path, labelled: bool = True) -> tuple[list[QAExample], bool]:
    """The questions of a SQuAD v1.1 / v2.0 JSON file, or of the Hub's squad layout (id, question, context,
    answers: {text: [...], answer_start: [...]}; no answer: unanswerable) in a Parquet / Arrow file, datasets
    directory or JSON Lines file (squad_articles), and whether it has unanswerable ones (v2.0).
    labelled=False (--predict's file): answers are not read and may be absent."""
    path = data_file(path)
    examples, impossible, seen = [], False, set()
    for article in squad_articles(path):
        for paragraph in article.get("paragraphs", []):
            context = paragraph.get("context")
            for qa in paragraph.get("qas", []):
                qid = qa.get("id")
                key = str(qid)
                if not isinstance(qid, (str, int)) or isinstance(qid, bool) or key == "" or key in seen:
                    problem = f"its id {qid!r} is used twice" if key in seen else "it has no \"id\""
                    raise ValueError(f"{path}: question {len(examples) + 1} ({qa.get('question')!r}): {problem}. "
                                     "Give every question an id of its own: predictions and scores are keyed by it")
                seen.add(key)
                where = f"{path}: question {qid!r}"
                if not isinstance(context, str) or not isinstance(qa.get("question"), str):
                    raise ValueError(f"{where}: needs a context and a question (strings)")
                answers = []
                if not labelled:
                    examples.append(QAExample(str(qid), qa["question"], context, answers))
                    continue
                for a in qa.get("answers", []):
                    text, start = a.get("text"), a.get("answer_start")
                    if not isinstance(text, str) or not text.strip():
                        raise ValueError(f"{where}: the answer text {text!r} is not a non-blank string; give the "
                                         "answer's text, or mark an unanswerable question \"is_impossible\": true "
                                         "with no answers")
                    if (not isinstance(start, int) or isinstance(start, bool) or start < 0
                            or context[start:start + len(text)] != text):
                        raise ValueError(f"{where}: the answer {text!r} is not at answer_start {start!r} of the "
                                         "context; answer_start is its character offset in the context")
                    answers.append((text, start))
                unanswerable = qa.get("is_impossible", False)
                if not isinstance(unanswerable, bool):
                    raise ValueError(f"{where}: \"is_impossible\" is {unanswerable!r}, not a JSON true or false; "
                                     "write it unquoted")
                if unanswerable and answers:
                    raise ValueError(f"{where} has \"is_impossible\": true and answers; remove the answers "
                                     "(SQuAD v2.0 keeps them under \"plausible_answers\"), or make it false")
                if unanswerable:
                    impossible = True
                elif not answers:
                    raise ValueError(f"{where} has no answer and no \"is_impossible\": true (SQuAD v2.0's mark of "
                                     "an unanswerable question)")
                examples.append(QAExample(str(qid), qa["question"], context, answers))
    if not examples:
        raise ValueError(f"{path} holds no questions")
    return examples, impossible


def qa_features(tokenizer, examples: list[QAExample], max_len: int, doc_stride: int) -> list[QAFeature]:
    """Windows of `<s> question </s></s> context </s>` over each context, consecutive windows
    sharing doc_stride tokens, labelled with the first answer as run_qa's prepare_train_features."""
    questions = [e.question.lstrip() for e in examples]
    for e, ids in zip(examples, tokenizer.encode_batch(questions, add_special_tokens=False)):
        room = max_len - len(ids) - 4  # context tokens per window: <s> question </s></s> context </s>
        if room <= doc_stride:  # (tokenizers would panic)
            raise ValueError(f"question {e.id!r} takes {len(ids)} tokens: with the 4 special ones, --max-len "
                             f"{max_len} leaves {room} for the context, not more than --doc-stride {doc_stride}; "
                             "use a larger --max-len or a smaller --doc-stride")
    backend = tokenizer.backend
    backend.enable_truncation(max_len, stride=doc_stride, strategy="only_second")
    try:
        encodings = backend.encode_batch(list(zip(questions, (e.context for e in examples))))
    finally:
        backend.no_truncation()
    features = []
    for n, (example, first) in enumerate(zip(examples, encodings)):
        for enc in [first] + first.overflowing:
            in_context = np.asarray([s == 1 for s in enc.sequence_ids])
            offsets = np.where(in_context[:, None], np.asarray(enc.offsets, dtype=np.int64), -1)
            start = end = 0
            if example.answers:
                text, first_char = example.answers[0]
                last_char = first_char + len(text)
                inside = np.flatnonzero(in_context)
                if offsets[inside[0], 0] <= first_char and offsets[inside[-1], 1] >= last_char:
                    # the last context token starting at or before the answer; the first ending at or after it
                    start = inside[offsets[inside, 0] <= first_char][-1]
                    end = inside[offsets[inside, 1] >= last_char][0]
            features.append(QAFeature(n, np.asarray(enc.ids, dtype=np.int64), offsets, int(start), int(end)))
    return features


def best_answers(examples, features, start_logits, end_logits, *, version_2: bool, n_best: int = 20,
                 max_answer_len: int = 30, null_threshold: float = 0.0) -> dict[str, str]:
    """Answer text per question id from each feature's logits, as run_qa's postprocess_qa_predictions.

    Candidates: the n_best highest start and end logits of every window, both in the context,
    end >= start, at most max_answer_len tokens; scored start + end logit. v2.0: the null score
    is the lowest `<s>` start + end over the windows; the answer is empty when it exceeds the
    best span's score by more than null_threshold."""
    by_example = collections.defaultdict(list)
    for i, f in enumerate(features):
        by_example[f.example].append(i)
    answers = {}
    for n, example in enumerate(examples):
        spans, null = [], None
        for i in by_example[n]:
            s, e, offsets = start_logits[i], end_logits[i], features[i].offsets
            null = s[0] + e[0] if null is None else min(null, s[0] + e[0])
            for a in np.argsort(s)[::-1][:n_best]:
                for b in np.argsort(e)[::-1][:n_best]:
                    if offsets[a, 0] < 0 or offsets[b, 0] < 0 or b < a or b - a + 1 > max_answer_len:
                        continue
                    spans.append((s[a] + e[b], example.context[offsets[a, 0]:offsets[b, 1]]))
        spans.sort(key=lambda span: -span[0])
        best = next(((score, text) for score, text in spans[:n_best] if text), None)
        if best is None or (version_2 and null - best[0] > null_threshold):
            answers[example.id] = ""
        else:
            answers[example.id] = best[1]
    return answers


def normalize_answer(s: str) -> str:
    """The official SQuAD script's: lower case, no punctuation, no articles, single spaces."""
    s = "".join(ch for ch in s.lower() if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def answer_f1(gold: str, predicted: str, version_2: bool = True) -> float:
    """The official SQuAD v2.0 script's compute_f1 (bag-of-words overlap of the normalized texts), or the
    v1.1 script's f1_score: 0 where nothing overlaps, also when both are empty."""
    gold_tokens, pred_tokens = normalize_answer(gold).split(), normalize_answer(predicted).split()
    if version_2 and (not gold_tokens or not pred_tokens):  # no answer: right only if both are empty
        return float(gold_tokens == pred_tokens)
    same = sum((collections.Counter(gold_tokens) & collections.Counter(pred_tokens)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred_tokens), same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def squad_scores(examples: list[QAExample], predictions: dict[str, str], version_2: bool = True) -> dict:
    """exact_match and f1 (x100) as the official SQuAD v2.0 script: per question the best over its
    gold answers (those that normalize to nothing dropped; none left: the empty answer); or, version_2
    False, as the v1.1 script: every gold answer kept, F1 0 where nothing overlaps."""
    exact = f1 = 0.0
    for e in examples:
        golds = [text for text, _ in e.answers] or [""]  # (none only in --predict's unlabelled file: unscored)
        if version_2:
            golds = [text for text in golds if normalize_answer(text)] or [""]
        predicted = predictions[e.id]
        exact += max(float(normalize_answer(g) == normalize_answer(predicted)) for g in golds)
        f1 += max(answer_f1(g, predicted, version_2) for g in golds)
    return {"exact_match": 100 * exact / len(examples), "f1": 100 * f1 / len(examples)}


def doc_stride_for(max_len: int) -> int:
    """The default --doc-stride: run_qa's ratio, 128 tokens of 384, scaled to --max-len."""
    return max_len * 128 // 384


class QATask(Task):
    name, model_class, best_metric = "qa", RobertaForQuestionAnswering, "f1"
    metrics = ("exact_match", "f1")
    max_len = 384  # run_qa's default
    unit = "windows"

    def __init__(self, cfg):
        self.cfg = cfg
        train, v2_train = read_squad(cfg.train)
        valid, v2_valid = read_squad(cfg.valid) if cfg.valid else (None, False)
        if valid is None:
            train, valid = hold_out(train, cfg.seed, cfg.train)
        self.train, self.valid, self.version_2 = train, valid, v2_train or v2_valid
        self.names = []

    def describe(self):
        return f"SQuAD {'v2.0 (unanswerable questions)' if self.version_2 else 'v1.1'}"

    def encode(self, tokenizer, max_len):
        stride = self.cfg.doc_stride if self.cfg.doc_stride is not None else doc_stride_for(max_len)
        if not 0 <= stride < max_len:
            raise ValueError(f"--doc-stride {stride} must be at least 0 and below --max-len {max_len}")
        self.stride = stride
        self.train_features = qa_features(tokenizer, self.train, max_len, stride)
        self.valid_features = qa_features(tokenizer, self.valid, max_len, stride)

    def read_unlabelled(self, path, tokenizer, max_len):
        self.valid = read_squad(path, labelled=False)[0]
        self.valid_features = qa_features(tokenizer, self.valid, max_len, self.stride)

    def baseline_warning(self, best):
        null = squad_scores(self.valid, {e.id: "" for e in self.valid}, self.version_2)
        if best["f1"] <= null["f1"]:
            return (f"no epoch beat answering nothing to every question (exact match {null['exact_match']:.2f}, "
                    f"F1 {null['f1']:.2f}): the model has not learned the task")
        return None

    def __len__(self):
        return len(self.train_features)

    def valid_batches(self, batch_size, pad_id):
        return self.batches(np.arange(len(self.valid_features)), batch_size, pad_id, train=False)

    def batches(self, order, batch_size, pad_id, train=True):
        features = self.train_features if train else self.valid_features
        for start in range(0, len(order), batch_size):
            chosen = [features[i] for i in order[start:start + batch_size]]
            x, mask = pad([f.ids for f in chosen], pad_id)
            yield {"input_ids": x, "attention_mask": mask,
                   "start_positions": torch.tensor([f.start for f in chosen]),
                   "end_positions": torch.tensor([f.end for f in chosen])}

    def evaluate(self, run, batch_size, pad_id):
        loss, starts, ends = 0.0, [], []
        features = self.valid_features
        for start, batch in zip(range(0, len(features), batch_size), self.valid_batches(batch_size, pad_id)):
            out = run(batch)
            loss += float(out.loss) * len(batch["input_ids"])
            for f, s, e in zip(features[start:start + batch_size], out.start_logits.float().cpu().numpy(),
                               out.end_logits.float().cpu().numpy()):
                starts.append(s[:len(f.ids)])
                ends.append(e[:len(f.ids)])
        self.predictions = best_answers(self.valid, features, starts, ends, version_2=self.version_2,
                                        n_best=self.cfg.n_best, max_answer_len=self.cfg.max_answer_len,
                                        null_threshold=self.cfg.null_threshold)
        return {"loss": loss / len(features), **squad_scores(self.valid, self.predictions, self.version_2)}

    def predictions_text(self):
        """SQuAD's: a JSON object of each question's id and answer text ("" for none), what the official
        evaluation script reads."""
        return ".json", json.dumps(self.predictions, ensure_ascii=False, indent=1) + "\n"


# --------------------------------------------------------------- multiple choice
@dataclass
class ChoiceExample:
    article: str
    question: str
    options: list[str]
    answer: int


def _answer_index(answer, options: list[str], where: str) -> int:
    """'A'.. or 0.. -> the option's index."""
    if isinstance(answer, str) and len(answer) == 1 and answer.isalpha():
        index = ord(answer.upper()) - ord("A")
    elif isinstance(answer, int) and not isinstance(answer, bool):
        index = answer
    else:
        index = -1
    if not 0 <= index < len(options):
        if answer in options:
            raise ValueError(f"{where}: answer {answer!r} is the text of an option; give its letter "
                             f"{chr(ord('A') + options.index(answer))!r} or its index {options.index(answer)}")
        raise ValueError(f"{where}: answer {answer!r} is not one of the {len(options)} options; give a letter "
                         f"'A'..'{chr(ord('A') + len(options) - 1)}' or an index 0..{len(options) - 1}")
    return index


def read_choices(path, labelled: bool = True) -> list[ChoiceExample]:
    """The questions of a RACE-style JSONL file: one per line, or RACE's per-article objects.
    labelled=False (--predict's file): answers are not read and may be absent (answer 0 stands in)."""
    path = data_file(path)
    examples = []
    for where, row in records(path):
        if "questions" in row:  # RACE's own layout: an article with parallel lists
            qs, opts, answers = row.get("questions"), row.get("options"), row.get("answers")
            if not labelled and isinstance(qs, list):
                answers = [None] * len(qs)
            if not (isinstance(qs, list) and isinstance(opts, list) and isinstance(answers, list)
                    and len(qs) == len(opts) == len(answers)):
                raise ValueError(f"{where}: RACE's layout needs lists \"questions\", \"options\" and \"answers\" "
                                 "of equal length")
            items = zip(qs, opts, answers)
        else:
            items = [(row.get("question"), row.get("options"), row.get("answer"))]
        article = row.get("article")
        for question, options, answer in items:
            if not isinstance(article, str) or not isinstance(question, str):
                raise ValueError(f"{where}: expected {{\"article\", \"question\", \"options\", \"answer\"}} with "
                                 f"string article and question (the object has {sorted(row)})")
            if not (isinstance(options, list) and len(options) >= 2 and all(isinstance(o, str) for o in options)):
                raise ValueError(f"{where}: \"options\" must be a list of at least 2 strings")
            if examples and len(options) != len(examples[0].options):
                raise ValueError(f"{where}: question {question!r} has {len(options)} options, the first question "
                                 f"{len(examples[0].options)}; every question needs the same number")
            examples.append(ChoiceExample(article, question, options,
                                          _answer_index(answer, options, where) if labelled else 0))
    if not examples:
        raise ValueError(f"{path} holds no questions")
    return examples


def encode_choices(tokenizer, examples: list[ChoiceExample], max_len: int) -> list[list[np.ndarray]]:
    """Per question, the ids of each option: `<s> article </s></s> question option </s>`, the article truncated."""
    pairs = [(e.article, e.question.replace("_", o) if "_" in e.question else f"{e.question} {o}")
             for e in examples for o in e.options]
    backend = tokenizer.backend
    backend.enable_truncation(max_len, strategy="only_first")
    try:
        encodings = backend.encode_batch(pairs)
    except Exception as err:  # noqa: BLE001 -- tokenizers raises plain Exceptions
        raise ValueError(f"a question with an option does not fit in --max-len {max_len} ({err}); "
                         "use a larger --max-len") from None
    finally:
        backend.no_truncation()
    out, k = [], 0
    for e in examples:
        out.append([np.asarray(enc.ids, dtype=np.int64) for enc in encodings[k:k + len(e.options)]])
        k += len(e.options)
    return out


class ChoiceTask(Task):
    name, model_class, best_metric = "choice", RobertaForMultipleChoice, "accuracy"
    metrics = ("accuracy",)
    unit = "questions"

    def __init__(self, cfg):
        train = read_choices(cfg.train)
        valid = read_choices(cfg.valid) if cfg.valid else None
        if valid is None:
            train, valid = hold_out(train, cfg.seed, cfg.train)
        if len(valid[0].options) != len(train[0].options):
            raise ValueError(f"{cfg.valid}: {len(valid[0].options)} options per question, {cfg.train} has "
                             f"{len(train[0].options)}; both need the same number")
        self.train, self.valid, self.names = train, valid, []

    def describe(self):
        return f"{len(self.train[0].options)} options per question"

    def encode(self, tokenizer, max_len):
        self.train_ids, self.valid_ids = (encode_choices(tokenizer, d, max_len) for d in (self.train, self.valid))

    def read_unlabelled(self, path, tokenizer, max_len):
        self.valid = read_choices(path, labelled=False)
        if len(self.valid[0].options) != len(self.train[0].options):
            raise ValueError(f"{path}: {len(self.valid[0].options)} options per question, the training file has "
                             f"{len(self.train[0].options)}; both need the same number")
        self.valid_ids = encode_choices(tokenizer, self.valid, max_len)

    def __len__(self):
        return len(self.train_ids)

    def batches(self, order, batch_size, pad_id, train=True):
        ids, examples = (self.train_ids, self.train) if train else (self.valid_ids, self.valid)
        for start in range(0, len(order), batch_size):
            chosen = order[start:start + batch_size]
            x, mask = pad([ids[i] for i in chosen], pad_id)  # (batch, num_choices, longest)
            yield {"input_ids": x, "attention_mask": mask,
                   "labels": torch.tensor([examples[i].answer for i in chosen])}

    def baseline_warning(self, best):
        options = len(self.valid[0].options)
        majority = max(1 / options, np.bincount([e.answer for e in self.valid]).max() / len(self.valid))
        if best["accuracy"] <= majority:
            return (f"no epoch beat chance, or always picking the most frequent answer ({majority:.4f}, "
                    f"{options} options): the model has not learned the task")
        return None

    def evaluate(self, run, batch_size, pad_id):
        loss, chosen = 0.0, []
        for batch in self.valid_batches(batch_size, pad_id):
            out = run(batch)
            loss += float(out.loss) * len(batch["labels"])
            chosen.append(out.logits.argmax(-1).cpu().numpy())
        self.predictions = np.concatenate(chosen)
        right = int((self.predictions == np.asarray([e.answer for e in self.valid])).sum())
        return {"loss": loss / len(self.valid), "accuracy": right / len(self.valid)}

    def predictions_text(self):
        """JSON lines of each question's place in the file and the chosen option's letter, as RACE gives answers."""
        return ".jsonl", "".join(json.dumps({"index": i, "answer": chr(ord("A") + int(x))}) + "\n"
                                 for i, x in enumerate(self.predictions))


TASKS = {t.name: t for t in (ClassifyTask, TokenTask, QATask, ChoiceTask)}
