"""Every command line of the package documents itself: a description, and for every
option a help text that gives its default (required options and arguments excepted)."""
import argparse
import importlib

import pytest

CLIS = {"train": "roberta_fast.train_config", "finetune": "roberta_fast.finetune",
        "preprocess": "roberta_fast.preprocess", "fairseq": "roberta_fast.fairseq", "export": "roberta_fast.export"}


@pytest.mark.parametrize("name", sorted(CLIS))
def test_help_describes_every_option_and_its_default(name):
    parser = importlib.import_module(CLIS[name]).build_parser()
    assert parser.prog == f"python -m roberta_fast.{name}"
    assert parser.description and parser.description.strip()
    parser.format_help()  # every help text formats (a bare % in one breaks --help)
    undocumented, no_default = [], []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        flag = "/".join(action.option_strings) or action.dest
        if not (action.help or "").strip():
            undocumented.append(flag)
        elif action.option_strings and not action.required and "default" not in action.help:
            no_default.append(flag)
    assert not undocumented, f"options without a help text: {undocumented}"
    assert not no_default, f"optional flags whose help does not say the default: {no_default}"


@pytest.mark.parametrize("name", sorted(CLIS))
def test_help_exits_0(name, capsys):
    main = importlib.import_module(f"roberta_fast.{name}").main
    with pytest.raises(SystemExit) as exit:
        main(["--help"])
    assert exit.value.code == 0 and "usage: python -m roberta_fast." + name in capsys.readouterr().out
