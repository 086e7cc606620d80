"""Run by test_dropin.py in a fresh interpreter: the outputs without transformers installed."""
import pickle
import sys

sys.modules["transformers"] = None  # as if not installed: its import raises ImportError
import torch  # noqa: E402

import roberta_fast as rf  # noqa: E402
from roberta_fast.model import DictOutput  # noqa: E402

cfg = rf.RobertaConfig(vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                       max_position_embeddings=20)
model = rf.RobertaForMaskedLM(cfg, backend="reference").eval()
ids = torch.randint(3, 40, (2, 6))
out = model(ids)
assert isinstance(out, DictOutput) and list(out) == ["logits"] and len(out) == 1, type(out).__mro__
assert out[0] is out["logits"] is out.logits and out.get("loss") is None
out["loss"] = torch.tensor(0.0)
assert out.loss is out["loss"] and out.to_tuple()[1] is out.loss
assert list(type(out)({"logits": out.logits})) == ["logits"]
assert list(pickle.loads(pickle.dumps(out))) == ["loss", "logits"]
exported = torch.export.export(model, (ids,), strict=False)
torch.testing.assert_close(exported.module()(ids).logits, model(ids).logits)
print("ok")
