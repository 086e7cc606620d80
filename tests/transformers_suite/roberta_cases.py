"""transformers' common model tests (ModelTesterMixin, from the transformers sdist) on
RoBERTa, run by tests/test_transformers_suite.py with every model patched.

The tester (tester.py) is transformers' RobertaModelTester with two differences: head size
32 (hidden 64 over 2 heads), so the fused attention kernel runs (transformers' tester uses 8,
which the patch hands to SDPA), and batch 3 instead of 13, as each kernel launch runs under
the Triton interpreter on a CPU (the batch-splitting tests still split it).
"""
import unittest

from transformers import RobertaForMaskedLM, RobertaForSequenceClassification, RobertaModel
from transformers.testing_utils import require_torch

from hf_tests.test_modeling_common import ModelTesterMixin
from tester import RobertaModelTester


@require_torch
class RobertaPatchedTest(ModelTesterMixin, unittest.TestCase):
    # Every class the patch changes something in: the encoder, the MLM head (patched too) and a
    # sentence head. The token, multiple-choice and QA heads are one Linear on the same patched
    # encoder (and would double the time under the Triton interpreter); RobertaForCausalLM is
    # a decoder, which patch() refuses (tests/test_dropin.py checks that).
    all_model_classes = (RobertaModel, RobertaForMaskedLM, RobertaForSequenceClassification)

    def setUp(self):
        self.model_tester = RobertaModelTester(self, batch_size=3, hidden_size=64, num_attention_heads=2)
