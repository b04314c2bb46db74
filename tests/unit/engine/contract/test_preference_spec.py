"""Stage dpo's spec fields: refused with the field named when they would do nothing or cannot run."""

import pytest
from pydantic import ValidationError

from engine.contract.spec import parse_spec

BASE = {"kind": "train", "data_path": "d", "train_iters": 3, "lr": 1e-3, "load": "ckpt"}
DPO = {**BASE, "stage": "dpo", "is_pairwise_dataset": True}


def test_dpo_spec_defaults_are_mindspeeds():
    spec = parse_spec(DPO)
    assert (spec.dpo_loss_type, spec.dpo_beta, spec.dpo_label_smoothing, spec.pref_ftx) == ("sigmoid", 0.1, 0.0, 0.0)
    assert spec.ref_model is None


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"stage": "sft", "dpo_beta": 0.2}, "dpo_beta"),
        ({"is_pairwise_dataset": True}, "is_pairwise_dataset"),
        ({**DPO, "is_pairwise_dataset": False}, "is_pairwise_dataset"),
        ({**DPO, "dpo_loss_type": "hinge", "dpo_label_smoothing": 0.1}, "dpo_label_smoothing"),
        ({**DPO, "dpo_label_smoothing": 0.6}, "dpo_label_smoothing"),
        ({**DPO, "simpo_gamma": 1.0}, "simpo_gamma"),
        ({**DPO, "dpo_loss_type": "orpo", "ref_model": "r"}, "ref_model"),
        ({**DPO, "lora_r": 8, "ref_model": "r"}, "ref_model"),
        (
            {**DPO, "pipeline_model_parallel_size": 2, "resources": {"nproc_per_node": 2}},
            "pipeline_model_parallel_size",
        ),
        (
            {
                **DPO,
                "pipeline_model_parallel_size": 2,
                "resources": {"nproc_per_node": 2},
                "ref_model": "r",
                "precompute_ref_log_probs": True,
            },
            "ref_model",
        ),
        ({**DPO, "dpo_loss_type": "simpo", "precompute_ref_log_probs": True}, "precompute_ref_log_probs"),
        ({**DPO, "dpo_loss_type": "kto"}, "dpo_loss_type"),
    ],
)
def test_bad_preference_fields_are_refused_by_name(extra, field):
    with pytest.raises(ValidationError, match=field):
        parse_spec({**BASE, **extra})
