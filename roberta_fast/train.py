"""`python -m roberta_fast.train`: the RoBERTa pretraining job (issue 6; in progress).

Until the trainer lands this entry point states what it will do and exits 0, so the
README's main-job line works on a fresh machine.
"""
import sys


def main(argv=None) -> int:
    print(
        "roberta_fast.train: the trainer is not built yet (issue 6). When it is, this command "
        "trains the tiny preset on the embedded default corpus (CPU or GPU), evaluates the "
        "validation MLM loss and exports a Hugging Face model.\n"
        "What works today: roberta_fast.RobertaForMaskedLM (reference backend), loading and "
        "saving Hugging Face checkpoints."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
