"""Flax NNX BERT with HuggingFace checkpoint interchange."""

from jonebit.models.bert.config import BertConfig
from jonebit.models.bert.modeling import (
    BertForPreTraining,
    BertForPreTrainingOutput,
    BertForQuestionAnswering,
    BertModel,
    BertModelOutput,
    QuestionAnsweringOutput,
    pretraining_loss,
)
from jonebit.models.bert.params import (
    hf_state_dict,
    load_hf_checkpoint,
    position_embedding_mask,
    read_hf_checkpoint,
    save_hf_checkpoint,
)

__all__ = [
    "BertConfig",
    "BertForPreTraining",
    "BertForPreTrainingOutput",
    "BertForQuestionAnswering",
    "BertModel",
    "BertModelOutput",
    "QuestionAnsweringOutput",
    "hf_state_dict",
    "load_hf_checkpoint",
    "position_embedding_mask",
    "pretraining_loss",
    "read_hf_checkpoint",
    "save_hf_checkpoint",
]
