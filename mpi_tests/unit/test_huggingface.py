"""Hugging Face models: what is refused and recognised before any rank exchanges."""

from __future__ import annotations

import pytest

from hvd_lowcomm.config import ConfigError
from hvd_lowcomm.methods.ab.factorized import factorize_model
from hvd_lowcomm.methods.sil import SIL

from test_huggingface import SEQ, VOCAB, build


def test_ab_keeps_a_tied_head_dense_even_when_full_rank_does_not_name_it():
    layers, kept = factorize_model(build("gpt2"), full_rank=[])
    assert kept == {"lm_head": "weight tied to another module's"} and len(layers) == 8


def test_sil_refuses_a_hugging_face_model_with_its_reason():
    with pytest.raises(ConfigError, match="nn.Sequential"):
        SIL(build("gpt2"), input_shape=(SEQ,), num_classes=VOCAB)
