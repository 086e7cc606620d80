"""transformers' common model tests (ModelTesterMixin, from the transformers sdist) on the six
drop-in classes themselves (rf.RobertaModel, ...ForMaskedLM, ...ForSequenceClassification,
...ForTokenClassification, ...ForQuestionAnswering, ...ForMultipleChoice), run by
tests/test_transformers_suite.py under the same policy as the patched models, with
transformers' own tester shape (tester.py). The drop-in classes take transformers'
RobertaConfig as it is.
"""
import unittest

from transformers.testing_utils import require_torch

import roberta_fast as rf
from hf_tests.test_modeling_common import ModelTesterMixin
from tester import RobertaModelTester


@require_torch
class RobertaDropinTest(ModelTesterMixin, unittest.TestCase):
    all_model_classes = (rf.RobertaModel, rf.RobertaForMaskedLM, rf.RobertaForSequenceClassification,
                         rf.RobertaForTokenClassification, rf.RobertaForQuestionAnswering, rf.RobertaForMultipleChoice)

    def setUp(self):
        self.model_tester = RobertaModelTester(self)
