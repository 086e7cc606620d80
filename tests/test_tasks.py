"""The fine-tuning tasks (roberta_fast/tasks.py): readers of the official formats (tests/data/),
label alignment and doc-stride windows as transformers makes them, SQuAD's official scoring,
seqeval-style entity chunks, and `--task token|qa|choice` end to end into transformers' pipelines."""
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

import roberta_fast as rf
from roberta_fast.finetune import FinetuneConfig, Finetuner
from roberta_fast.tasks import (QAExample, answer_f1, best_answers, chunks, encode_choices, encode_words,
                                entity_scores, first_subtoken_labels, is_chunked, normalize_answer, pad, qa_features,
                                read_choices, read_squad, read_tagged, squad_scores)

DATA = Path(__file__).parent / "data"
CONLL, TABS, TAGS_JSONL = DATA / "conll2003_sample.txt", DATA / "tabs_sample.tsv", DATA / "tags_sample.jsonl"
SQUAD, RACE = DATA / "squad_v2_sample.json", DATA / "race_sample.jsonl"


def texts():
    """Every text of the sample files, for the test tokenizer."""
    out = [" ".join(words) for path in (CONLL, TABS, TAGS_JSONL) for words, _ in read_tagged(path)]
    out += [e.question + " " + e.context for e in read_squad(SQUAD)[0]]
    out += [e.article + " " + e.question + " " + " ".join(e.options) for e in read_choices(RACE)]
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A random-init tiny RoBERTa (64 positions) with a tokenizer trained on the sample files."""
    root = tmp_path_factory.mktemp("tasks") / "model"
    with pytest.warns(UserWarning, match="fewer than vocab_size"):
        tok = rf.RobertaTokenizer.train_from_iterator(texts() * 3, vocab_size=1000, min_frequency=1)
    cfg = rf.RobertaConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                           intermediate_size=64, max_position_embeddings=66)
    torch.manual_seed(0)
    rf.RobertaForMaskedLM(cfg).save_pretrained(root)
    tok.save(root)
    return root


@pytest.fixture(scope="module")
def tok(model_dir):
    return rf.RobertaTokenizer.from_pretrained(model_dir)


# ------------------------------------------------------------------ token classification
def test_tagged_readers():
    conll = read_tagged(CONLL)  # 4 columns, the NER tag last; -DOCSTART- lines skipped
    assert [len(w) for w, _ in conll] == [9, 2, 2, 7]
    assert conll[1] == (["Peter", "Blackburn"], ["B-PER", "I-PER"])
    assert read_tagged(TABS) == read_tagged(TAGS_JSONL)[:1] + [(["the", "EU"], ["O", "B-ORG"])]


def test_a_docstart_line_ends_the_sentence_before_it(tmp_path):
    """A -DOCSTART- line with no blank line around it merged the sentences of two documents."""
    path = tmp_path / "nodocsep.conll"
    path.write_text("-DOCSTART- -X- O\nEU B-ORG\n-DOCSTART- -X- O\nPeter B-PER\n")
    assert read_tagged(path) == [(["EU"], ["B-ORG"]), (["Peter"], ["B-PER"])]


def test_conll_columns_split_at_ascii_spaces_and_tabs_only(tmp_path):
    """A word holding a no-break or ideographic space stays whole (str.split() cut it and dropped the
    rest), as datasets' conll2003 loader splits on " "; a line of spaces and tabs is blank."""
    path = tmp_path / "nbsp.conll"
    path.write_text("gemäß\tO\n§\u00a0433  B-NORM\nBGB\tI-NORM\n \t \n東京\u3000都\tB-LOC\n", encoding="utf-8")
    assert read_tagged(path) == [(["gemäß", "§\u00a0433", "BGB"], ["O", "B-NORM", "I-NORM"]),
                                 (["東京\u3000都"], ["B-LOC"])]


def test_every_reader_skips_a_utf8_byte_order_mark(tmp_path):
    """Excel's "CSV UTF-8", pandas' utf-8-sig and Windows editors start files with a BOM."""
    from roberta_fast.tasks import delimited_rows, json_lines

    for source in (CONLL, TAGS_JSONL, SQUAD, RACE):
        with_bom = tmp_path / source.name
        with_bom.write_bytes(b"\xef\xbb\xbf" + source.read_bytes())
        reader = {SQUAD: read_squad, RACE: read_choices}.get(source, read_tagged)
        assert reader(with_bom) == reader(source), source.name
    csv_file = tmp_path / "rows.csv"
    csv_file.write_bytes("\ufefftext,label\nhello,pos\n".encode())
    assert [row for _, row in delimited_rows(csv_file, ",")] == [{"text": "hello", "label": "pos"}]
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_bytes('\ufeff{"text": "hello"}\n'.encode())
    assert [row for _, row in json_lines(jsonl)] == [{"text": "hello"}]


def test_every_reader_names_a_file_that_is_not_utf8(tmp_path):
    """CoNLL-2003's German files are ISO-8859-1: each reader names the file, the first bad line and the fix
    (the bad byte is past the reader's first chunk, where a decoder error cannot say which line)."""
    from roberta_fast.tasks import delimited_rows, json_lines

    for source, reader in ((CONLL, read_tagged), (TAGS_JSONL, read_tagged), (SQUAD, read_squad), (RACE, read_choices)):
        lines = "\n" * 20000 + source.read_text(encoding="utf-8").replace("the", "th\u00e9", 1)
        latin1 = tmp_path / source.name
        latin1.write_bytes(lines.encode("latin-1"))
        bad_line = lines[:lines.index("\u00e9")].count("\n") + 1
        with pytest.raises(ValueError, match=rf"{source.name}:{bad_line}: not UTF-8 \(byte 0xe9 at column \d+\); "
                                             r"convert the file to UTF-8 .* iconv -f latin1 -t utf-8"):
            reader(latin1)
    for name, rows in (("rows.csv", lambda p: delimited_rows(p, ",")), ("rows.tsv", lambda p: delimited_rows(p, "\t")),
                       ("rows.jsonl", json_lines)):
        latin1 = tmp_path / name
        body = '{"text": "caf\u00e9"}\n' if name.endswith("jsonl") else "text,label\n" + "hello,pos\n" * 5000 + "caf\u00e9,pos\n"
        latin1.write_bytes(body.encode("latin-1"))
        with pytest.raises(ValueError, match=rf"{name}:{body.count(chr(10))}: not UTF-8 \(byte 0xe9 at column \d+\)"):
            list(rows(latin1))


def test_a_csv_row_with_more_cells_than_the_header_is_refused(tmp_path):
    """An unquoted comma splits a text: which cell is the label is unknown, so the row is refused (as pandas
    and datasets do) instead of taking the text's second half as its label."""
    from roberta_fast.tasks import delimited_rows

    path = tmp_path / "comma.csv"
    path.write_text("text,label\ngood film,pos\nslow, but rewarding,pos\n")
    with pytest.raises(ValueError, match=r"comma.csv:3: 3 cells, the header has 2; quote a cell that holds a comma"):
        list(delimited_rows(path, ","))


def classify_config(**fields):
    return FinetuneConfig(**{"text_field": "text", "label_field": "label", **fields})


def test_regression_or_classes_is_decided_from_the_training_labels_as_pandas_reads_them(tmp_path):
    """" 1" and "+1" are integers (classes), a NaN label is a missing one, --valid's "0.0" does not make
    integer classes a regression (run_glue decides from the training column), and a typo among scores
    is refused instead of making every score a class."""
    from roberta_fast.tasks import ClassifyTask

    def task(train, valid=None, **fields):
        (tmp_path / "train.csv").write_text("text,label\n" + "".join(f"t{i},{x}\n" for i, x in enumerate(train)))
        if valid:
            (tmp_path / "dev.csv").write_text("text,label\n" + "".join(f"v{i},{x}\n" for i, x in enumerate(valid)))
        return ClassifyTask(classify_config(train=str(tmp_path / "train.csv"),
                                            valid=str(tmp_path / "dev.csv") if valid else None, **fields))

    assert task([" 1", " 0"] * 5).names == ["0", "1"]
    assert task(["+1", "-1"] * 5).names == ["-1", "1"]
    with pytest.raises(ValueError, match=r"dev.csv has labels that .*train.csv never has: '0.0' \(1x\)"):
        task(["1", "0"] * 5, ["0.0", "1"])
    with pytest.raises(ValueError, match=r"train.csv:4: the label \('label'\) is NaN on this line; fill it in"):
        task(["3.8", "1.2", "NaN", "0.5"])
    for missing in ("N/A", "NA", "None", "null", "NULL", "<NA>"):  # pandas (run_glue) reads these as NaN too:
        with pytest.raises(ValueError, match=rf"train.csv:6: the label \('label'\) is '{missing}' \(pandas: "
                                              r"missing\) on this line; fill it in"):  # not a class of their own
            task(["1", "01", "0", "0", missing, "1"])
    with pytest.raises(ValueError, match=r"dev.csv:3: the label \('label'\) is 'NA' \(pandas: missing\)"):
        task(["1", "0"] * 5, ["0", "NA"])
    with pytest.raises(ValueError, match=r"train.csv: label '4.1x' is not a finite number; most labels are scores "
                                         r"with a fraction \(a regression\): fix or remove the row whose label is not "
                                         r"a number \(line 3 '4.1x'\), or pass --problem-type single_label"):
        task(["3.8", "4.1x", "0.5", "2.5"])
    assert task(["3.8", "4.1", "0.5", "2"]).regression
    assert task(["3.8", "4.1x", "0.5", "2"], problem_type="single_label_classification").names[0] == "0.5"


def test_a_column_of_integers_reads_as_pandas_reads_it(tmp_path):
    """"+1", "01" and "1" in one .csv / .tsv column are one class, 1 (they were three), as pandas and datasets
    parse an integer column, in --train and --valid alike; a column that is not all integers keeps its strings."""
    from roberta_fast.tasks import ClassifyTask

    train, dev = tmp_path / "train.csv", tmp_path / "dev.tsv"
    train.write_text("text,label\n" + "".join(f"t{i},{x}\n" for i, x in enumerate(["+1", "1", "01", "0", "-0"] * 2)))
    dev.write_text("text\tlabel\na\t+1\nb\t00\n")
    task = ClassifyTask(classify_config(train=str(train), valid=str(dev)))
    assert task.names == ["0", "1"] and not task.regression
    assert [label for _, _, label in task.valid] == ["1", "0"]
    train.write_text("text,label\n" + "".join(f"t{i},{x}\n" for i, x in enumerate(["01", "1", "pos"] * 2)))
    assert ClassifyTask(classify_config(train=str(train))).names == ["01", "1", "pos"]


def test_a_label_that_is_not_a_score_is_named_by_its_line(tmp_path):
    """A regression's bad label is named by its file and line (or a table's row), not by its example number,
    which a blank JSONL line or a header row shifts."""
    from roberta_fast.tasks import ClassifyTask

    train, dev = tmp_path / "train.jsonl", tmp_path / "dev.csv"
    train.write_text("\n".join(json.dumps({"text": f"t{i}", "label": x}) for i, x in enumerate([3.8, 4.1, 0.5, 2])))
    dev.write_text("text,label\na,1.5\nb,n.a\n")
    with pytest.raises(ValueError, match=r"dev.csv: label 'n.a' is not a finite number; a regression needs a numeric "
                                         r"score on every row: fix or remove the row whose label is not a number "
                                         r"\(line 3 'n.a'\)"):
        ClassifyTask(classify_config(train=str(train), valid=str(dev)))
    train.write_text('{"text": "a", "label": 3.8}\n\n{"text": "b", "label": "x"}\n{"text": "c", "label": 0.5}\n')
    with pytest.raises(ValueError, match=r"train.jsonl: label 'x' .* \(line 3 'x'\)"):
        ClassifyTask(classify_config(train=str(train), problem_type="regression"))
    pa, parquet = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    parquet.write_table(pa.table({"text": ["a", "b", "c"], "label": ["3.8", "x", "0.5"]}), tmp_path / "t.parquet")
    with pytest.raises(ValueError, match=r"t.parquet: label 'x' .* \(row 1 'x'\)"):
        ClassifyTask(classify_config(train=str(tmp_path / "t.parquet"), problem_type="regression"))


@pytest.mark.parametrize("row, problem", [
    ({"text": "a", "label": [3, 5]}, r"'label' holds \[3, 5\], not a string or number; multi-label classification"),
    ({"text": ["a", "b"], "label": 1}, r"'text' holds \[\"a\", \"b\"\], not a string or number; give one string"),
    ({"text": "a", "label": {"x": 1}}, r"'label' holds \{\"x\": 1\}, not a string or number")],
    ids=["list-label", "list-text", "dict-label"])
def test_json_lists_and_objects_are_not_stringified_into_texts_or_classes(tmp_path, row, problem):
    """A list label (multi-label data) became the class '[3, 5]', a list text the text "['a', 'b']"."""
    from roberta_fast.tasks import read_examples

    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"text": "fine", "label": 0}) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(ValueError, match=r"rows.jsonl:2: " + problem):
        read_examples(path, classify_config())


def test_lone_surrogates_in_texts_are_replaced_and_said(tmp_path):
    """JSON may escape half of an emoji's surrogate pair ("\\ud83d"), which is no text: the tokenizer raised
    a bare TypeError naming no row. Replaced by U+FFFD, as preprocess does, with a note naming the line."""
    from roberta_fast.tasks import read_examples

    path = tmp_path / "rows.jsonl"
    path.write_text('{"text": "bad \\ud83d film", "label": "neg"}\n{"text": "fine", "label": "pos"}\n')
    notes = []
    examples = read_examples(path, classify_config(), notes=notes)
    assert examples == [("bad \ufffd film", None, "neg"), ("fine", None, "pos")]
    assert len(notes) == 1 and "lone surrogates" in notes[0] and "(line 1)" in notes[0]
    rf.RobertaTokenizer.train_from_iterator(["bad fine film"], vocab_size=300).encode(examples[0][0])


def test_a_null_tag_is_refused(tmp_path):
    """It became the tag 'None'."""
    path = tmp_path / "rows.jsonl"
    path.write_text('{"tokens": ["EU", "rejects"], "tags": ["B-ORG", null]}\n')
    with pytest.raises(ValueError, match=r"rows.jsonl:1: a tag is null; every tag must be a string"):
        read_tagged(path)


def test_a_training_file_of_one_class_is_refused(tmp_path):
    """One class trained a 1-output regression that could only say 'try a larger --lr'; usually the label
    column is the wrong one."""
    from roberta_fast.tasks import ClassifyTask

    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"text": f"t{i}", "label": "pos"}) + "\n" for i in range(4)))
    with pytest.raises(ValueError, match=r"train.jsonl: every row has the label 'pos', and a classifier needs at "
                                         r"least 2 classes; is --label-field 'label' the label column\?"):
        ClassifyTask(classify_config(train=str(path)))


def test_a_tsv_quoted_by_pandas_is_refused(tmp_path):
    """pandas' to_csv(sep="\\t") quotes a cell holding a quote; a .tsv is read unquoted (GLUE's), which kept the
    quotes in the text. A GLUE sentence with a lone quote character still reads as it is."""
    from roberta_fast.tasks import delimited_rows

    path = tmp_path / "pandas.tsv"
    path.write_text('text\tlabel\nit \'s a " charming journey\t1\n"He said ""great film"""\t1\n')
    with pytest.raises(ValueError, match=r"pandas.tsv:3: the cell .*great film.* is quoted, as pandas' to_csv.* save "
                                         r"the file as .csv \(read with quoting\) or .jsonl"):
        list(delimited_rows(path, "\t"))
    path.write_text('it \'s a " charming journey\t1\n"He said ""great film"""\t1\n')
    with pytest.raises(ValueError, match=r"pandas.tsv:2: the cell"):
        list(delimited_rows(path, "\t", header=False))


def test_common_mistakes_get_errors_that_say_what_to_do(tmp_path):
    """A UTF-16 file, datasets' -1 (unlabelled) test labels, a JSON array for JSON Lines, a choice answer
    given as the option's text, a header naming a column twice."""
    from roberta_fast.tasks import ClassifyTask, delimited_rows, json_lines

    path = tmp_path / "u16.tsv"
    path.write_text("text\tlabel\nhello\tpos\n", encoding="utf-16")
    with pytest.raises(ValueError, match=r"u16.tsv: UTF-16, not UTF-8 .* iconv -f utf-16 -t utf-8"):
        list(delimited_rows(path, "\t"))
    train, test = tmp_path / "train.csv", tmp_path / "test.csv"
    train.write_text("text,label\na,0\nb,1\n")
    test.write_text("text,label\nc,-1\n")
    with pytest.raises(ValueError, match=r"test.csv has labels .* '-1' \(1x\) \(-1 is datasets' mark of an unlabelled "
                                         r"example, as in GLUE's test splits: validate on the validation split\)"):
        ClassifyTask(classify_config(train=str(train), valid=str(test)))
    path = tmp_path / "rows.json"
    path.write_text('[\n  {"text": "a", "label": 0}\n]\n')
    with pytest.raises(ValueError, match=r"rows.json:1: a JSON array; expected JSON Lines, one object per line"):
        list(json_lines(path))
    path = tmp_path / "race.jsonl"
    path.write_text(json.dumps({"article": "a", "question": "q", "options": ["blue", "red"], "answer": "red"}) + "\n")
    with pytest.raises(ValueError, match=r"race.jsonl:1: answer 'red' is the text of an option; give its letter 'B' or "
                                         r"its index 1"):
        read_choices(path)
    path = tmp_path / "twice.csv"
    path.write_text("text,label,label\na,1,0\n")
    with pytest.raises(ValueError, match=r"twice.csv:1: the header names the column 'label' twice; rename one"):
        list(delimited_rows(path, ","))


def test_tagged_readers_name_the_bad_line(tmp_path):
    bad = tmp_path / "bad.conll"
    bad.write_text("Peter B-PER\nBlackburn\n")
    with pytest.raises(ValueError, match=r"bad.conll:2: 'Blackburn' has a word and no tag"):
        read_tagged(bad)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"tokens": ["a"], "tags": ["O"]}\n{"tokens": ["a", "b"], "tags": ["O"]}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: 2 tokens and 1 tags"):
        read_tagged(bad)
    bad.write_text('{"words": ["a"], "tags": ["O"]}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1: expected \{\"tokens\".*the object has \['tags', 'words'\]"):
        read_tagged(bad)


def test_words_encode_as_transformers_is_split_into_words(tok, model_dir):
    """Ids and word ids as RobertaTokenizerFast(add_prefix_space=True)(words, is_split_into_words=True),
    words that start with a space or are a special token's text included; the tag on each word's first
    sub-token, -100 elsewhere (run_ner's label_all_tokens=False)."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(model_dir, add_prefix_space=True)
    sentences = read_tagged(CONLL) + [(["Ünïcode", "1996-08-22", "U.S.", "'s"], ["O"] * 4),
                                      ([" x", "y", "\tz", "\u00a0w"], ["O"] * 4),
                                      (["<s>", "x", "<mask>", "a<s>b", " </s>"], ["O"] * 5)]
    ids, owners, truncated = encode_words(tok, sentences, max_len=64)
    assert truncated == 0
    for (words, _), x, owner in zip(sentences, ids, owners):
        want = hf(words, is_split_into_words=True)
        assert x.tolist() == want.input_ids
        assert owner.tolist() == [-1 if w is None else w for w in want.word_ids()]
    labels = first_subtoken_labels(np.array([-1, 0, 0, 1, 2, 2, 2, -1]), [5, 6, 7])
    assert labels.tolist() == [-100, 5, -100, 6, 7, -100, -100, -100]
    short, owner, truncated = encode_words(tok, sentences[:1], max_len=6)  # <s> + 4 tokens + </s>
    assert truncated == 1 and len(short[0]) == 6 and short[0][-1] == tok.eos_id and owner[0][-1] == -1


def test_a_token_export_adds_the_prefix_space_in_tokenizer_json_too(tok, tmp_path):
    """The export's tokenizer.json (pre-tokenizer and post-processor) says add_prefix_space as its
    tokenizer_config.json does, as transformers re-saves it: transformers, tokenizers.Tokenizer and our
    tokenizer then encode raw text alike, and as the words were encoded in training."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer

    from roberta_fast.tasks import TokenTask

    tok.save(tmp_path)
    TokenTask.after_export(tmp_path)
    saved = json.loads((tmp_path / "tokenizer.json").read_text())
    assert saved["pre_tokenizer"] == {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                                      "use_regex": True}
    assert saved["post_processor"]["type"] == "RobertaProcessing" and saved["post_processor"]["add_prefix_space"]
    words = ["Peter", "Blackburn", "visited", "BRUSSELS"]
    want = encode_words(tok, [(words, None)], 64)[0][0].tolist()
    assert transformers.AutoTokenizer.from_pretrained(tmp_path)(" ".join(words)).input_ids == want
    assert Tokenizer.from_file(str(tmp_path / "tokenizer.json")).encode(" ".join(words)).ids == want
    assert rf.RobertaTokenizer.from_pretrained(tmp_path).encode(" ".join(words)) == want


def test_entity_chunks_follow_seqeval():
    """seqeval's default (conlleval) rules: an I- after O or another type starts an entity,
    a change of type ends one, IOBES singletons and ends."""
    assert chunks(["I-PER", "I-PER", "O", "B-LOC", "I-ORG"]) == {("PER", 0, 1), ("LOC", 3, 3), ("ORG", 4, 4)}
    assert chunks(["B-PER", "B-PER", "I-PER"]) == {("PER", 0, 0), ("PER", 1, 2)}
    assert chunks(["S-LOC", "B-PER", "E-PER", "E-PER", "O"]) == {("LOC", 0, 0), ("PER", 1, 2), ("PER", 3, 3)}
    assert chunks(["O", "O"]) == set()
    gold = [["B-PER", "I-PER", "O", "B-LOC"], ["B-ORG", "O"]]
    predicted = [["B-PER", "O", "O", "B-LOC"], ["B-ORG", "B-ORG"]]  # 2 of 4 predicted right, 2 of 3 gold found
    scores = entity_scores(gold, predicted)
    assert scores["precision"] == 0.5 and scores["recall"] == pytest.approx(2 / 3)
    assert scores["f1"] == pytest.approx(2 * 0.5 * (2 / 3) / (0.5 + 2 / 3))
    assert entity_scores([["O"]], [["O"]]) == {"precision": 0.0, "recall": 0.0, "f1": 0.0}
    assert is_chunked(["O", "B-PER", "I-PER", "S-LOC"]) and not is_chunked(["NN", "VB", "O"])


# ------------------------------------------------------------------ question answering
def test_squad_reader():
    examples, v2 = read_squad(SQUAD)
    assert v2 and [e.id for e in examples] == ["n1", "n2", "n3", "r1", "r2"]
    assert examples[0].answers == [("France", 104), ("in France", 101)] and examples[2].answers == []


def test_squad_reader_names_the_bad_question(tmp_path):
    squad = json.loads(SQUAD.read_text())
    squad["data"][1]["paragraphs"][0]["qas"][0]["answers"][0]["answer_start"] = 18
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(squad))
    with pytest.raises(ValueError, match=r"bad.json: question 'r1': the answer 'the Swiss Alps' is not at "
                                         r"answer_start 18"):
        read_squad(bad)
    bad.write_text('{"data": [{"paragraphs": [{"context": "x", "qas": [{"id": "q", "question": "y?", '
                   '"answers": []}]}]}]}')
    with pytest.raises(ValueError, match=r"question 'q' has no answer and no \"is_impossible\": true"):
        read_squad(bad)


def test_squad_reader_takes_the_hubs_layout_as_json_lines_and_as_run_qa_reads_json(tmp_path):
    """datasets' to_json of squad / squad_v2 (one question per line, answers {text: [...], answer_start: [...]})
    was refused as "not a JSON file (Extra data ...)", and run_qa's JSON of such rows ({"data": [...]}, its
    load_dataset field="data") read as no questions: both read as the same questions as SQuAD's own JSON, as
    does a JSON array of those rows."""
    squad, v2 = read_squad(SQUAD)
    rows = [{"id": e.id, "title": "t", "question": e.question, "context": e.context,
             "answers": {"text": [a for a, _ in e.answers], "answer_start": [s for _, s in e.answers]}}
            for e in squad]
    lines, flat, one = tmp_path / "squad.jsonl", tmp_path / "flat.json", tmp_path / "one.jsonl"
    lines.write_text("".join(json.dumps(row) + "\n" for row in rows))
    flat.write_text(json.dumps({"version": "v2.0", "data": rows}, indent=2))
    one.write_text(json.dumps(rows[0]) + "\n")
    assert read_squad(lines) == (squad, v2) and read_squad(flat) == (squad, v2)
    flat.write_text(json.dumps(rows))  # an array of rows: to_json(lines=False), load_dataset("json") reads it
    assert read_squad(flat) == (squad, v2)
    assert read_squad(one)[0] == squad[:1]
    lines.write_text(json.dumps(rows[0]) + "\n" + json.dumps({**rows[1], "answers": ["x"]}) + "\n")
    with pytest.raises(ValueError, match=r"squad.jsonl:2: expected the Hub's squad columns id, question, context"):
        read_squad(lines)
    lines.write_text(json.dumps({**rows[0], "answers": {"text": ["a", "b"], "answer_start": [0]}}) + "\n" * 2)
    with pytest.raises(ValueError, match=r"squad.jsonl:1: 2 answer texts and 1 answer_start offsets"):
        read_squad(lines)


@pytest.mark.parametrize("change, problem", [
    ({"is_impossible": "False"}, r"\"is_impossible\" is 'False', not a JSON true or false; write it unquoted"),
    ({"is_impossible": True}, r"has \"is_impossible\": true and answers; remove the answers"),
    ({"answers": [{"text": "", "answer_start": 0}]}, r"the answer text '' is not a non-blank string"),
    ({"answers": [{"text": "the Swiss Alps", "answer_start": -84}]}, r"the answer .* is not at answer_start -84 of")],
    ids=["string-bool", "impossible-with-answers", "empty-answer", "negative-start"])
def test_squad_reader_refuses_ambiguous_answers(tmp_path, change, problem):
    """A string "False" is not false, an unanswerable question has no answers, an answer is a non-empty span at
    a real offset (an empty one was labelled on the first context token; a negative one counted from the end)."""
    squad = json.loads(SQUAD.read_text())
    qa = squad["data"][1]["paragraphs"][0]["qas"][0]
    assert qa["id"] == "r1" and qa["answers"][0]["text"] == "the Swiss Alps"
    qa.update(change)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(squad))
    with pytest.raises(ValueError, match=r"bad.json: question 'r1'.? " + problem):
        read_squad(bad)


@pytest.mark.parametrize("ids, problem", [(["n1", None], 'it has no "id"'), (["n1", "n1"], "its id 'n1' is used twice")])
def test_squad_questions_need_ids_of_their_own(tmp_path, ids, problem):
    """Predictions and scores are keyed by id: shared or missing ids would score one answer for all."""
    squad = json.loads(SQUAD.read_text())
    for qa, qid in zip(squad["data"][0]["paragraphs"][0]["qas"], ids):
        qa.pop("id")
        if qid is not None:
            qa["id"] = qid
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(squad))
    with pytest.raises(ValueError, match=rf"bad.json: question 2 \(.*\): {problem}\. Give every question an id"):
        read_squad(bad)


def test_doc_stride_windows_match_transformers_and_label_a_split_answer_at_cls(tok, model_dir):
    """Windows as transformers' tokenizer(question, context, truncation="only_second", stride=...,
    return_overflowing_tokens=True) makes them (run_qa); an answer whole in a window is labelled with
    the tokens that spell it, one cut by the window's edge points at <s> (position 0)."""
    transformers = pytest.importorskip("transformers")
    context = "The Rhine rises in the Swiss Alps and flows north through Germany and the Netherlands to the North Sea."
    example = QAExample("r1", "Where does the Rhine rise?", context, [("the Swiss Alps", 19)])
    max_len, stride = 16, 4  # windows (0, 28) and (29, 65) each hold part of the answer (19, 33)
    features = qa_features(tok, [example], max_len, stride)
    hf = transformers.AutoTokenizer.from_pretrained(model_dir)(
        example.question, context, truncation="only_second", max_length=max_len, stride=stride,
        return_overflowing_tokens=True, return_offsets_mapping=True)
    assert [f.ids.tolist() for f in features] == hf.input_ids
    whole = split = 0
    for f, offsets in zip(features, hf.offset_mapping):
        in_context = f.offsets[:, 0] >= 0
        assert np.array_equal(f.offsets[in_context], np.asarray(offsets)[in_context])
        first, last = f.offsets[in_context][0, 0], f.offsets[in_context][-1, 1]
        if first <= 19 and last >= 19 + len("the Swiss Alps"):
            assert context[f.offsets[f.start, 0]:f.offsets[f.end, 1]] == "the Swiss Alps"
            whole += 1
        else:
            assert (f.start, f.end) == (0, 0)
            split += first < 19 + len("the Swiss Alps") and last > 19  # part of the answer in this window
    assert whole >= 1 and split >= 1 and len(features) >= 3
    with pytest.raises(ValueError, match=r"question .r1. takes 6 tokens: .*--max-len 12 leaves 2 for the context, "
                                         r"not more than --doc-stride 6; use a larger --max-len or a smaller"):
        qa_features(tok, [example], 12, 6)


def test_squad_metric_follows_the_official_script():
    """Hand-computed with evaluate-v2.0.py's rules."""
    assert normalize_answer("The  Cat, sat!") == "cat sat" and normalize_answer("An apple a day") == "apple day"
    assert answer_f1("the cat sat", "a cat sat down") == pytest.approx(2 * (2 / 3) * 1 / (2 / 3 + 1))  # P 2/3, R 1
    assert answer_f1("cat cat", "cat") == pytest.approx(2 / 3)  # P 1, R 1/2: a bag of words, counts matter
    assert answer_f1("", "") == 1.0 and answer_f1("", "cat") == 0.0 and answer_f1("the", "") == 1.0
    examples = [QAExample("a", "q", "c", [("in France", 0), ("France", 3)]),  # best gold counts
                QAExample("b", "q", "c", []),  # v2.0: no answer, gold ""
                QAExample("c", "q", "c", [("10th century", 0)])]
    scores = squad_scores(examples, {"a": "france.", "b": "", "c": "the 10th"})
    assert scores["exact_match"] == pytest.approx(100 * 2 / 3)
    assert scores["f1"] == pytest.approx(100 * (1 + 1 + 2 * 1 * 0.5 / 1.5) / 3)
    assert squad_scores(examples[1:2], {"b": "something"}) == {"exact_match": 0.0, "f1": 0.0}


def test_squad_v1_runs_score_as_the_v1_1_script():
    """Where a gold answer normalizes to nothing ("The"), v2.0's script drops it (none left: the empty
    answer) and v1.1's keeps it, its F1 0 where no word overlaps (hand-computed with both scripts' rules)."""
    examples = [QAExample("t", "q", "c", [("The", 0)]), QAExample("e", "q", "c", [("The", 0), ("the end", 0)])]
    predictions = {"t": "", "e": "a"}
    assert squad_scores(examples, predictions, version_2=False) == {"exact_match": 100.0, "f1": 0.0}
    assert squad_scores(examples, predictions, version_2=True) == {"exact_match": 50.0, "f1": 50.0}
    assert answer_f1("", "", version_2=False) == 0.0 and answer_f1("the", "", version_2=True) == 1.0


def test_best_answers_and_the_v2_null_logic():
    """The best span (start + end logit) in the context, end >= start, at most max_answer_len
    tokens; v2.0 answers nothing when the null score (<s>) beats it by more than the threshold."""
    context = "Paris is big"
    example = QAExample("q", "?", context, [])
    offsets = np.array([[-1, -1], [0, 5], [6, 8], [9, 12], [-1, -1]])  # <s> Paris is big </s>
    feature = type("F", (), {"example": 0, "offsets": offsets})()
    start = np.array([1.0, 3.0, 0.0, 0.0, 9.0])  # the highest start is </s>: off the context
    end = np.array([1.0, 0.0, -1.0, 2.0, 9.0])
    kwargs = dict(examples=[example], features=[feature], start_logits=[start], end_logits=[end])
    assert best_answers(**kwargs, version_2=False) == {"q": "Paris is big"}  # 3 + 2
    assert best_answers(**kwargs, version_2=False, max_answer_len=2) == {"q": "Paris"}  # 3 + 0
    assert best_answers(**kwargs, version_2=True) == {"q": "Paris is big"}  # null 2 < 5
    assert best_answers(**kwargs, version_2=True, null_threshold=-3.5) == {"q": ""}  # 2 - 5 > -3.5
    null = [np.array([6.0, 3.0, 0, 0, 0]), np.array([6.0, 0, 0, 2.0, 0])]
    assert best_answers(**{**kwargs, "start_logits": null[:1], "end_logits": null[1:]}, version_2=True) == {"q": ""}
    # with two windows the null score is the lower of the two (run_qa's min_null_score)
    two = dict(examples=[example], features=[feature, feature], start_logits=[null[0], start],
               end_logits=[null[1], end])
    assert best_answers(**two, version_2=True) == {"q": "Paris is big"}


# -------------------------------------------------------------------- multiple choice
def test_race_reader_and_encoding(tok, tmp_path):
    examples = read_choices(RACE)  # two one-question lines and one RACE article with two questions
    assert [e.answer for e in examples] == [1, 2, 1, 0] and examples[3].options[0] == "Sunday"
    encoded = encode_choices(tok, examples[1:2], max_len=64)[0]
    assert len(encoded) == 4  # the ids of each option
    assert tok.decode(encoded[2], skip_special_tokens=True).endswith(
        "Tom rides to school with his sister .")  # the blank filled with the option
    short = encode_choices(tok, examples[:1], max_len=16)[0]
    assert [len(ids) for ids in short] == [16] * 4  # the article is cut, the question and option kept
    assert tok.decode(short[1], skip_special_tokens=True).endswith("What colour is Tom's bike? red")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"article": "a", "question": "q", "options": ["x", "y"], "answer": "C"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: answer 'C' is not one of the 2 options; give a letter "
                                         r"'A'..'B'"):
        read_choices(bad)
    article = {"article": "a", "questions": ["q1", "q2", "q3"], "options": [["x", "y"], ["x", "y", "z"], ["x", "y"]],
               "answers": ["A", "B", "A"]}  # the middle question, not only an article's last, is checked
    bad.write_text(json.dumps(article) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: question 'q2' has 3 options, the first question 2; every "
                                         r"question needs the same number"):
        read_choices(bad)


def test_tags_only_in_the_validation_file_are_refused(model_dir, tmp_path):
    """A tag --valid has and --train never does would be a head output never trained: refused, named."""
    dev = tmp_path / "dev.conll"
    dev.write_text("Peter B-PER\nvisited O\nParis B-PLACE\n")
    with pytest.raises(ValueError, match=r"dev.conll has tags that .*conll2003_sample.txt never has: 'B-PLACE' \(1x\)"):
        run_task(model_dir, tmp_path / "run", task="token", train=str(CONLL), valid=str(dev))


def test_batches_attend_to_a_literal_pad_token_in_the_text(tok, tmp_path):
    """A text's "<pad>" encodes to the pad id, and transformers' tokenizer gives it attention 1: every task's
    batches build the mask from each row's length, not from the ids, so training and the validation metrics
    see what the exported model sees in transformers."""
    from roberta_fast.tasks import ChoiceTask, ClassifyTask

    ids, mask = pad([np.array([0, 5, 1, 6, 2]), np.array([0, 7, 2])], pad_id=1)
    assert ids.tolist() == [[0, 5, 1, 6, 2], [0, 7, 2, 1, 1]] and mask.tolist() == [[1] * 5, [1, 1, 1, 0, 0]]
    ids, mask = pad([[np.array([0, 1, 2]), np.array([0, 2])]], pad_id=1)  # one question, two options
    assert ids.tolist() == [[[0, 1, 2], [0, 2, 1]]] and mask.tolist() == [[[1, 1, 1], [1, 1, 0]]]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"text": t, "label": str(i % 2)}) + "\n"
                            for i, t in enumerate(["the <pad> river", "a cat", "the river", "a dog"])))
    task = ClassifyTask(classify_config(train=str(path), valid=str(path)))
    task.encode(tok, 64)
    batch = next(task.batches(np.arange(4), 4, tok.pad_id))
    assert (batch["input_ids"][0] == tok.pad_id).sum() == 1  # the literal, inside the text
    assert batch["attention_mask"].sum(1).tolist() == [len(x) for x in task.train_ids]
    choice = object.__new__(ChoiceTask)
    choice.train = [read_choices(RACE)[0]]
    choice.train_ids = [[np.array([0, 1, 2]), np.array([0, 2])]]
    batch = next(choice.batches([0], 1, tok.pad_id))
    assert batch["attention_mask"].tolist() == [[[1, 1, 1], [1, 1, 0]]]


# ----------------------------------------------------------------------- end to end
def run_task(model_dir, out, **fields):
    fields = {"lr": 1e-3, **fields}
    cfg = FinetuneConfig(model=str(model_dir), out=str(out), device="cpu", precision="fp32", batch_size=4,
                         warmup_ratio=0.0, log_every=1, **fields)
    return Finetuner(cfg, log=lambda *_: None).run()


TASK_KINDS = ["classify", "regression", "token", "qa", "choice"]


def dropout_free_task(model_dir, tmp_path, task) -> dict:
    """FinetuneConfig fields for `task` on the sample data (--valid = --train) with model_dir's model,
    its dropout off (so that runs which split batches differently compute the same)."""
    import shutil

    model = tmp_path / "model"
    if not model.exists():
        shutil.copytree(model_dir, model)
        config = json.loads((model / "config.json").read_text())
        (model / "config.json").write_text(json.dumps({**config, "hidden_dropout_prob": 0.0,
                                                       "attention_probs_dropout_prob": 0.0}))
    if task in ("classify", "regression"):
        rows = ["text,label"] + [f"{text[:60]},{i % 3 if task == 'classify' else i * 0.37}"
                                 for i, text in enumerate(t.replace(",", " ") for t in texts()[:40])]
        (tmp_path / f"{task}.csv").write_text("\n".join(rows) + "\n")
        fields = dict(task="classify", train=str(tmp_path / f"{task}.csv"))
    else:
        fields = dict(task=task, train=str({"token": CONLL, "qa": SQUAD, "choice": RACE}[task]))
        fields.update(max_len=32, doc_stride=8) if task == "qa" else None
    return dict(model=str(model), device="cpu", precision="fp32", lr=1e-3, warmup_ratio=0.0, valid=fields["train"],
                **fields)


def recording_gradients(tuner, update: bool = True) -> list:
    """The gradients of each of tuner's optimizer steps, before clipping and Adam, as they are recorded;
    update=False leaves the weights as they are (Adam's first steps turn gradients of ~0 into steps of ±lr,
    so later steps would compare gradients at other weights)."""
    grads, step = [], tuner.optimizer.step

    def recorded_step(lr, scale):
        grads.append({name: p.grad.clone() for name, p in tuner.model.named_parameters() if p.grad is not None})
        return step(lr, scale) if update else (0.0, False)

    tuner.optimizer.step = recorded_step
    return grads


@pytest.mark.parametrize("task", TASK_KINDS)
def test_grad_accum_gives_the_whole_batchs_gradients(model_dir, tmp_path, task):
    """--grad-accum 3 runs each batch of 5 as micro-batches of 1, 2 and 2 rows: with dropout off, every
    step's gradients (before clipping and Adam) are the unsplit batch's: each micro-batch's mean loss is
    weighted by its share of the batch's loss terms (rows, scores, or labelled tokens)."""
    fields = dropout_free_task(model_dir, tmp_path, task)
    runs = []
    for accum in (1, 3):
        tuner = Finetuner(FinetuneConfig(out=str(tmp_path / f"accum{accum}"), batch_size=5, grad_accum=accum,
                                         stop_after=4, **fields), log=lambda *_: None)
        runs.append(recording_gradients(tuner))
        tuner.run()
    assert_same_gradients(*runs, steps=4)


def assert_same_gradients(whole_runs, split_runs, steps):
    assert len(whole_runs) == len(split_runs) == steps and whole_runs[0].keys() == split_runs[0].keys()
    for step, (whole, split) in enumerate(zip(whole_runs, split_runs)):
        for name, grad in whole.items():
            torch.testing.assert_close(split[name], grad, rtol=1e-4, atol=1e-7, msg=f"step {step + 1}, {name}")


def evaluate_and_step(cfg) -> tuple[dict, Finetuner]:
    """A fine-tuning job's validation metrics at its starting weights, then its gradients for its first
    batch of 5 and for that batch's first row alone (under torchrun a process then has no row), both at
    those weights."""
    tuner = Finetuner(cfg, log=lambda *_: None)
    grads = recording_gradients(tuner, update=False)
    metrics = tuner.evaluate()
    batch = next(tuner.task.batches(tuner.order(0), 5, tuner.pad_id))
    tuner.train_step(batch)
    tuner.train_step({k: v[:1] for k, v in batch.items()})
    return {"grads": grads, "eval": metrics}, tuner


def _split_worker(rank, world, port, cases, result):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    found, tuner = {}, None
    try:
        for task, cfg in cases.items():
            found[task], tuner = evaluate_and_step(cfg)
            tuner.lock and tuner.lock.release()  # (the process group stays for the next task)
        if rank == 0:
            torch.save(found, result)
        tuner.dist.barrier()
    finally:
        tuner and tuner.close()


def test_torchrun_processes_split_each_batch_and_the_evaluation(model_dir, tmp_path):
    """Under torchrun (2 gloo processes here) each step's batch is split over the processes, each
    micro-batch's loss weighted by its share of the batch's terms, and the gradients summed: every task's
    gradients equal one process's, also for a batch of one row (the other process has none: its parameters
    get zeros, not no gradient). Each process evaluates every second validation batch; the gathered outputs
    give every process one process's metrics (on one thread, as the workers: the same sums, bit for bit)."""
    import torch.multiprocessing as mp

    cases = {task: dropout_free_task(model_dir, tmp_path, task) for task in TASK_KINDS}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        single = {task: evaluate_and_step(FinetuneConfig(out=str(tmp_path / f"one-{task}"), batch_size=5,
                                                         **fields))[0]
                  for task, fields in cases.items()}
    finally:
        torch.set_num_threads(threads)
    split = {task: FinetuneConfig(out=str(tmp_path / f"two-{task}"), batch_size=5, grad_accum=2, **fields)
             for task, fields in cases.items()}
    result = tmp_path / "split.pt"
    mp.spawn(_split_worker, args=(2, free_port(), split, str(result)), nprocs=2)
    found = torch.load(result)
    for task in TASK_KINDS:
        assert_same_gradients(single[task]["grads"], found[task]["grads"], steps=2)
        assert found[task]["eval"] == single[task]["eval"], task


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("task", TASK_KINDS)
def test_the_best_epochs_validation_predictions_are_written_beside_its_export(model_dir, tmp_path, task):
    """OUT/predictions/valid.* holds the exported (best) epoch's prediction for every validation example, in
    the file's order and the format the task's tools read: GLUE's submission TSV, CoNLL lines, SQuAD's
    {id: answer} JSON, RACE's letters. The exported model, evaluated again, predicts the same."""
    fields = dropout_free_task(model_dir, tmp_path, task)
    tuner = Finetuner(FinetuneConfig(out=str(tmp_path / "run"), batch_size=4, epochs=2, **fields),
                      log=lambda *_: None)
    tuner.run()
    [path] = (tmp_path / "run" / "predictions").iterdir()
    text = path.read_text()
    valid = tuner.task.valid
    if task in ("classify", "regression"):
        lines = text.splitlines()
        assert path.name == "valid.tsv" and lines[0] == "index\tprediction" and len(lines) == len(valid) + 1
        assert [line.split("\t")[0] for line in lines[1:]] == [str(i) for i in range(len(valid))]
        values = [line.split("\t")[1] for line in lines[1:]]
        assert all(float(v) == float(v) for v in values) if task == "regression" else set(values) <= {"0", "1", "2"}
    elif task == "token":
        sentences = [s.splitlines() for s in text.split("\n\n") if s]
        assert path.name == "valid.conll" and len(sentences) == len(valid) and text.endswith("\n\n")
        for (words, _), lines in zip(valid, sentences):
            assert [line.split("\t")[0] for line in lines] == words
            assert {line.split("\t")[1] for line in lines} <= set(tuner.names) | {"_"}
    elif task == "qa":
        answers = json.loads(text)
        assert path.name == "valid.json" and list(answers) == [e.id for e in valid]
        assert all(answer in e.context for e, answer in zip(valid, answers.values()))
    else:
        rows = [json.loads(line) for line in text.splitlines()]
        assert path.name == "valid.jsonl" and [r["index"] for r in rows] == list(range(len(valid)))
        assert {r["answer"] for r in rows} <= {"A", "B", "C", "D"}
    best = tuner.task.model_class.from_pretrained(tmp_path / "run" / "model").eval()
    with torch.no_grad():
        tuner.task.evaluate(lambda batch: best(**batch), 4, tuner.pad_id)
    assert tuner.task.predictions_text()[1] == text
    tuner.close()


def without_labels(task, fields, tmp_path) -> Path:
    """The task's validation file with its labels, tags or answers removed (as a test set comes)."""
    import csv as csv_module

    source = Path(fields["valid"])
    out = tmp_path / f"unlabelled{source.suffix}"
    if task in ("classify", "regression"):
        with open(source, newline="") as f:
            rows = list(csv_module.DictReader(f))
        out.write_text("text\n" + "".join(f"{row['text']}\n" for row in rows))
    elif task == "token":  # the word column alone, blank and -DOCSTART- lines kept
        out.write_text("".join((line.split()[0] if line.strip() else "") + "\n"
                               for line in source.read_text().splitlines()))
    elif task == "qa":
        data = json.loads(source.read_text())
        for article in data["data"]:
            for paragraph in article["paragraphs"]:
                paragraph["qas"] = [{"id": qa["id"], "question": qa["question"]} for qa in paragraph["qas"]]
        out.write_text(json.dumps(data))
    else:
        rows = [json.loads(line) for line in source.read_text().splitlines()]
        out.write_text("".join(json.dumps({k: v for k, v in row.items() if k not in ("answer", "answers")}) + "\n"
                               for row in rows))
    return out


@pytest.mark.parametrize("task", TASK_KINDS)
def test_predict_writes_the_best_epochs_predictions_for_a_file_without_labels(model_dir, tmp_path, task):
    """--predict FILE (the format of --valid, labels optional: GLUE's test sets have none): the best epoch's
    predictions for it, OUT/predictions/predict.*, are what the labelled validation file's are. --eval-only
    on the exported model gives that epoch's metrics and predictions again."""
    fields = dropout_free_task(model_dir, tmp_path, task)
    unlabelled = without_labels(task, fields, tmp_path)
    tuner = Finetuner(FinetuneConfig(out=str(tmp_path / "run"), batch_size=4, epochs=1, predict=str(unlabelled),
                                     **fields), log=lambda *_: None)
    tuner.run()
    tuner.close()
    written = {p.stem: p for p in (tmp_path / "run" / "predictions").iterdir()}
    assert sorted(written) == ["predict", "valid"] and written["predict"].suffix == written["valid"].suffix
    assert written["predict"].read_text() == written["valid"].read_text()
    # --eval-only on the export: the best epoch's metrics and predictions again, without --train or training
    best = tuner.best
    fields.update(model=str(tmp_path / "run" / "model"), train="")
    again = Finetuner(FinetuneConfig(out=str(tmp_path / "again"), batch_size=4, eval_only=True,
                                     predict=str(unlabelled), **fields), log=lambda *_: None)
    result = again.run()
    again.close()
    assert result["last"] == pytest.approx({k: v for k, v in best.items() if k != "epoch"}, rel=1e-5, abs=1e-6)
    results = json.loads((tmp_path / "again" / "eval_results.json").read_text())
    assert results == {"model": str(tmp_path / "run" / "model"), "valid": fields["valid"], **result["last"]}
    for stem, path in written.items():
        assert (tmp_path / "again" / "predictions" / path.name).read_text() == path.read_text(), stem
    assert not (tmp_path / "again" / "checkpoints").exists() or not any((tmp_path / "again" / "checkpoints").iterdir())


def test_the_predictions_are_the_best_epochs_not_the_last(model_dir, tmp_path):
    """An epoch that scores worse than the best leaves the best epoch's predictions in place (its own, made
    to differ here, are not written)."""
    fields = dropout_free_task(model_dir, tmp_path, "classify")
    tuner = Finetuner(FinetuneConfig(out=str(tmp_path / "run"), batch_size=4, epochs=2, **fields),
                      log=lambda *_: None)
    evaluate = tuner.task.evaluate

    def second_epoch_worse(*args):
        result = evaluate(*args)
        if tuner.step == 2 * tuner.steps_per_epoch:
            tuner.task.predictions = (tuner.task.predictions + 1) % 3
            result["accuracy"] = -1.0
        return result

    tuner.task.evaluate = second_epoch_worse
    assert tuner.run()["best"]["epoch"] == 1
    best = tuner.task.model_class.from_pretrained(tmp_path / "run" / "model").eval()
    with torch.no_grad():
        evaluate(lambda batch: best(**batch), 4, tuner.pad_id)
    assert (tmp_path / "run" / "predictions" / "valid.tsv").read_text() == tuner.task.predictions_text()[1]
    tuner.close()


def test_token_task_end_to_end(model_dir, tmp_path):
    """Learns the sample's tags by heart, exports a model that transformers' token-classification
    pipeline runs with the tag names."""
    transformers = pytest.importorskip("transformers")
    result = run_task(model_dir, tmp_path / "run", task="token", train=str(CONLL), valid=str(CONLL), epochs=8,
                      lr=1e-2)
    assert result["best"]["accuracy"] >= 0.9 and result["best"]["f1"] >= 0.5, result
    exported = tmp_path / "run" / "model"
    words = ["Peter", "Blackburn", "visited", "BRUSSELS"]  # raw text encodes as the words did in training
    assert transformers.AutoTokenizer.from_pretrained(exported)(" ".join(words)).input_ids == \
        encode_words(rf.RobertaTokenizer.from_pretrained(exported), [(words, None)], 64)[0][0].tolist()
    nlp = transformers.pipeline("token-classification", model=str(exported))
    entities = nlp("Peter Blackburn visited BRUSSELS")
    assert entities and all(e["entity"] in {"B-PER", "I-PER", "B-LOC", "B-ORG", "B-MISC", "I-ORG", "O"}
                            for e in entities)


def test_a_fine_tuned_taggers_tag_order_is_kept_as_run_ner(model_dir, tmp_path):
    """--model a tagger whose id2label names the data's tags in another order: numbered in its order (its
    rows keep their tags, as run_ner), so its predictions score as they did, and the export keeps it."""
    import warnings

    tags = sorted({t for _, ts in read_tagged(CONLL) for t in ts}, reverse=True)
    with warnings.catch_warnings():  # the new head, the unused MLM head
        warnings.simplefilter("ignore")
        tagger = rf.RobertaForTokenClassification.from_pretrained(model_dir, id2label=dict(enumerate(tags)))
    with torch.no_grad():  # always the tag "O"
        tagger.classifier.weight.zero_()
        tagger.classifier.bias.copy_(torch.tensor([10.0 if t == "O" else -10.0 for t in tags]))
    tagger.save_pretrained(tmp_path / "tagger")
    rf.RobertaTokenizer.from_pretrained(model_dir).save(tmp_path / "tagger")
    cfg = FinetuneConfig(model=str(tmp_path / "tagger"), out=str(tmp_path / "run"), task="token", train=str(CONLL),
                         valid=str(CONLL), device="cpu", precision="fp32")
    tuner = Finetuner(cfg, log=lambda *_: None)
    assert tuner.names == tags and tuner.model.config.id2label == dict(enumerate(tags))
    words = [t for _, ts in read_tagged(CONLL) for t in ts]
    assert tuner.evaluate()["accuracy"] == pytest.approx(words.count("O") / len(words))


def same_logits_in_transformers(auto_class, ours_class, exported, inputs):
    """transformers' Auto class loads the export and computes our model's outputs."""
    hf = auto_class.from_pretrained(exported).eval()
    ours = ours_class.from_pretrained(exported).eval()
    inputs = {"input_ids": inputs, "attention_mask": (inputs != 1).long()}
    with torch.no_grad():
        want, got = hf(**inputs), ours(**inputs)
    for name in ("logits", "start_logits", "end_logits"):
        if name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6)


def test_qa_task_end_to_end(model_dir, tmp_path):
    """SQuAD v2.0 in windows of 32 tokens, scored with EM/F1; resume continues a stopped run; the
    export loads in AutoModelForQuestionAnswering (transformers 5 dropped its question-answering
    pipeline) with our start and end logits."""
    transformers = pytest.importorskip("transformers")
    fields = dict(task="qa", train=str(SQUAD), valid=str(SQUAD), epochs=2, max_len=32, doc_stride=8)
    stopped = run_task(model_dir, tmp_path / "run", **fields, stop_after=3)
    assert stopped["step"] == 3
    result = run_task(model_dir, tmp_path / "run", **fields)
    assert set(result["best"]) == {"epoch", "loss", "exact_match", "f1"}
    assert 0 <= result["best"]["f1"] <= 100
    exported = tmp_path / "run" / "model"
    features = qa_features(rf.RobertaTokenizer.from_pretrained(exported), read_squad(SQUAD)[0], 32, 8)
    x = torch.from_numpy(np.stack([f.ids for f in features[:2]]))  # (2, 32): full windows
    same_logits_in_transformers(transformers.AutoModelForQuestionAnswering, rf.RobertaForQuestionAnswering,
                                exported, x)


def test_choice_task_end_to_end(model_dir, tmp_path):
    """RACE-style questions; the export loads in AutoModelForMultipleChoice with our logits."""
    transformers = pytest.importorskip("transformers")
    result = run_task(model_dir, tmp_path / "run", task="choice", train=str(RACE), valid=str(RACE), epochs=2)
    assert set(result["best"]) == {"epoch", "loss", "accuracy"}
    exported = tmp_path / "run" / "model"
    x, _ = pad(encode_choices(rf.RobertaTokenizer.from_pretrained(exported), read_choices(RACE)[:1], 64), 1)
    same_logits_in_transformers(transformers.AutoModelForMultipleChoice, rf.RobertaForMultipleChoice, exported,
                                x)  # (1, num_choices, seqlen)


def test_a_task_checkpoint_exports_as_its_model_and_no_other_task_resumes_it(model_dir, tmp_path):
    """python -m roberta_fast.export makes a multiple-choice checkpoint a multiple-choice model;
    resuming it as another task is refused."""
    transformers = pytest.importorskip("transformers")
    from roberta_fast.export import main as export

    run_task(model_dir, tmp_path / "run", task="choice", train=str(RACE), valid=str(RACE), epochs=1, stop_after=1)
    assert export([str(tmp_path / "run"), "--out", str(tmp_path / "step1")]) == 0
    assert type(transformers.AutoModelForMultipleChoice.from_pretrained(tmp_path / "step1")).__name__ == \
        "RobertaForMultipleChoice"
    with pytest.raises(ValueError, match=r"is of --task choice, this run is --task token: use another --out"):
        run_task(model_dir, tmp_path / "run", task="token", train=str(CONLL), valid=str(CONLL), epochs=1)


# ------------------------------------------------------- Hub layouts, defaults, warnings
def test_every_task_reads_parquet_and_datasets_directories_in_the_hubs_layouts(tmp_path):
    """conll2003's tokens/ner_tags (ClassLabel ids), squad_v2's columns, race's, sst2's label ids: the
    same examples as the sample files, from .parquet and from a save_to_disk directory."""
    datasets = pytest.importorskip("datasets", reason="writing Hub-layout files needs datasets (the [data] extra)")
    from roberta_fast.tasks import read_examples

    def both(name, rows, features=None):
        ds = datasets.Dataset.from_list(rows, features=features)
        ds.to_parquet(str(tmp_path / f"{name}.parquet"))
        ds.save_to_disk(str(tmp_path / name))
        return tmp_path / f"{name}.parquet", tmp_path / name

    sentences = read_tagged(CONLL)
    tags = sorted({t for _, ts in sentences for t in ts})
    features = datasets.Features({"tokens": datasets.Sequence(datasets.Value("string")),
                                  "ner_tags": datasets.Sequence(datasets.ClassLabel(names=tags))})
    for path in both("conll", [{"tokens": w, "ner_tags": [tags.index(t) for t in ts]} for w, ts in sentences],
                     features):
        assert read_tagged(path) == sentences, path

    squad, v2 = read_squad(SQUAD)
    rows = [{"id": e.id, "title": "t", "question": e.question, "context": e.context,
             "answers": {"text": [a for a, _ in e.answers], "answer_start": [s for _, s in e.answers]}}
            for e in squad]
    for path in both("squad", rows):
        assert read_squad(path) == (squad, v2), path

    race = read_choices(RACE)
    rows = [{"example_id": str(i), "article": e.article, "question": e.question, "options": e.options,
             "answer": "ABCD"[e.answer]} for i, e in enumerate(race)]
    for path in both("race", rows):
        assert read_choices(path) == race, path

    cfg = FinetuneConfig(text_field="sentence", label_field="label")
    features = datasets.Features({"sentence": datasets.Value("string"),
                                  "label": datasets.ClassLabel(names=["negative", "positive"])})
    for path in both("sst2", [{"sentence": "a fine film", "label": 1}, {"sentence": "dull", "label": 0}], features):
        assert read_examples(path, cfg) == [("a fine film", None, "positive"), ("dull", None, "negative")], path


def test_a_datasets_classlabel_keeps_its_id_order_as_run_glue(tmp_path):
    """Logit i is ClassLabel i (MNLI's 0 entailment, 1 neutral, 2 contradiction; conll2003's O first), as
    run_glue / run_ner take features[...].names: the ids then match the dataset's and other checkpoints'."""
    datasets = pytest.importorskip("datasets", reason="writing Hub-layout files needs datasets (the [data] extra)")
    from roberta_fast.tasks import ClassifyTask, TokenTask

    names = ["entailment", "neutral", "contradiction"]
    features = datasets.Features({"premise": datasets.Value("string"), "label": datasets.ClassLabel(names=names)})
    mnli = datasets.Dataset.from_list([{"premise": f"sentence {i}", "label": i % 3} for i in range(30)], features=features)
    mnli.to_parquet(str(tmp_path / "mnli.parquet"))
    cfg = FinetuneConfig(train=str(tmp_path / "mnli.parquet"), text_field="premise", label_field="label")
    assert ClassifyTask(cfg).names == names
    # names with spaces are the dataset's, spaces and all (stripped, they matched no name and were sorted)
    features["label"] = datasets.ClassLabel(names=[" pos", "neg"])
    datasets.Dataset.from_list([{"premise": f"sentence {i}", "label": i % 2} for i in range(10)],
                               features=features).to_parquet(str(tmp_path / "spaced.parquet"))
    task = ClassifyTask(FinetuneConfig(train=str(tmp_path / "spaced.parquet"), text_field="premise",
                                       label_field="label"))
    assert task.names == [" pos", "neg"] and task.config_extra()["id2label"] == {"0": " pos", "1": "neg"}
    tags = ["O", "B-PER", "I-PER"]
    features = datasets.Features({"tokens": datasets.Sequence(datasets.Value("string")),
                                  "ner_tags": datasets.Sequence(datasets.ClassLabel(names=tags))})
    conll = datasets.Dataset.from_list([{"tokens": ["Ann", "Lee", "ran"], "ner_tags": [1, 2, 0]}] * 20, features=features)
    conll.save_to_disk(str(tmp_path / "conll"))
    assert TokenTask(FinetuneConfig(train=str(tmp_path / "conll"))).names == tags


def test_qa_runs_at_every_default_on_a_small_model(model_dir, tmp_path):
    """--doc-stride defaults to a third of --max-len (run_qa's 128 of 384): the model's 64 positions
    give windows of 64 tokens sharing 21, where a fixed 128 was refused."""
    from roberta_fast.tasks import doc_stride_for

    assert doc_stride_for(384) == 128 and doc_stride_for(64) == 21
    result = run_task(model_dir, tmp_path / "run", task="qa", train=str(SQUAD), valid=str(SQUAD), epochs=1)
    assert set(result["best"]) == {"epoch", "loss", "exact_match", "f1"}


def test_token_qa_and_choice_runs_that_learn_nothing_say_so():
    """The trivial answers: all-O entity F1 0 (or the majority tag), the null answer's EM/F1, chance or
    the most frequent option."""
    from roberta_fast.tasks import ChoiceTask, QATask, TokenTask

    token = object.__new__(TokenTask)
    token.chunked = True
    assert "entity F1 0" in token.baseline_warning({"f1": 0.0, "accuracy": 0.8})
    assert token.baseline_warning({"f1": 0.2, "accuracy": 0.8}) is None
    token.chunked, token.valid_labels = False, [np.array([-100, 0, 0, 1, -100]), np.array([0, 0])]
    assert "most frequent tag (0.8000)" in token.baseline_warning({"accuracy": 0.8})
    assert token.baseline_warning({"accuracy": 0.85}) is None

    qa = object.__new__(QATask)
    qa.valid, qa.version_2 = read_squad(SQUAD)
    null = squad_scores(qa.valid, {e.id: "" for e in qa.valid})
    assert 0 < null["f1"] < 100  # the sample has answerable and unanswerable questions
    assert "answering nothing to every question" in qa.baseline_warning({"f1": null["f1"]})
    assert qa.baseline_warning({"f1": null["f1"] + 1}) is None

    choice = object.__new__(ChoiceTask)
    choice.valid = read_choices(RACE)
    majority = max(0.25, np.bincount([e.answer for e in choice.valid]).max() / len(choice.valid))
    assert "no epoch beat chance" in choice.baseline_warning({"accuracy": majority})
    assert choice.baseline_warning({"accuracy": majority + 0.01}) is None
