"""The RoBERTa tester of both gates (roberta_cases.py, dropin_cases.py): transformers' own
RobertaModelTester (tests/models/roberta, which the PyPI sdist does not ship), by default in
its shape: batch 13 of 7 tokens, hidden 32 over 4 heads (head dim 8), FFN 37, 16 token types,
random attention masks with padding, 4 choices.

Token ids start at 3, so input_ids hold no pad token: RoBERTa counts positions past pads,
which inputs_embeds cannot know, so ids with pads would make test_inputs_embeds_matches_input_ids
compare two different inputs (on transformers' own model too).
"""
from transformers import RobertaConfig

from hf_tests.test_modeling_common import ids_tensor, random_attention_mask


class RobertaModelTester:
    def __init__(self, parent, batch_size=13, seq_length=7, vocab_size=99, hidden_size=32,
                 num_hidden_layers=2, num_attention_heads=4, intermediate_size=37, type_vocab_size=16):
        self.parent, self.batch_size, self.seq_length = parent, batch_size, seq_length
        self.vocab_size, self.hidden_size, self.num_hidden_layers = vocab_size, hidden_size, num_hidden_layers
        self.num_attention_heads, self.intermediate_size = num_attention_heads, intermediate_size
        self.type_vocab_size, self.is_training, self.num_choices = type_vocab_size, True, 4

    def get_config(self):
        return RobertaConfig(vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                             num_hidden_layers=self.num_hidden_layers, num_attention_heads=self.num_attention_heads,
                             intermediate_size=self.intermediate_size, hidden_act="gelu",
                             hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1,
                             max_position_embeddings=512, type_vocab_size=self.type_vocab_size,
                             initializer_range=0.02)

    def prepare_config_and_inputs_for_common(self):
        shape = [self.batch_size, self.seq_length]
        input_ids = ids_tensor(shape, self.vocab_size - 3) + 3  # no <s>, <pad>, </s>
        inputs = {"input_ids": input_ids, "token_type_ids": ids_tensor(shape, self.type_vocab_size),
                  "attention_mask": random_attention_mask(shape)}
        return self.get_config(), inputs
