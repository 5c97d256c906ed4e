"""The memo's classifier, with its traps fixed: a BERT body and a linear head on the [CLS] vector.

Differences from the memo (notebook 01 shows each trap): the hidden size comes from the config instead of a
hard-coded 768, the attention mask is passed so padding does not change the [CLS] vector, and no softmax is
applied: ``CrossEntropyLoss`` applies log-softmax itself.

``forward`` never uses BERT's pooler, so under DistributedDataParallel it gets no gradient and DDP stops on the
second step (notebook 06); ``pooler=False`` drops it, leaving what ``BertModel.from_pretrained(...,
add_pooling_layer=False)`` builds, without its warning about unused weights.
"""

from __future__ import annotations

from torch import nn

from helpers.models import ModelChoice, load_bert


class Net(nn.Module):
    """BERT + ``nn.Linear(hidden, num_labels)`` on the [CLS] vector; ``forward`` returns logits, not probabilities.
    ``pooler=False`` drops BERT's pooler: ``forward`` never uses it, and DDP stops on unused parameters (notebook 06's appendix)."""

    def __init__(self, model: str | ModelChoice | None = None, num_labels: int = 2, pooler: bool = True):
        super().__init__()
        self.bert = load_bert(model)
        if not pooler:
            self.bert.pooler = None
        self.linear = nn.Linear(self.bert.config.hidden_size, num_labels)

    def forward(self, input_ids, attention_mask=None):
        cls_vector = self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state[:, 0]
        return self.linear(cls_vector)
