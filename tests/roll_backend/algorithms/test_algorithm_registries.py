"""Each registry is the one list of names: tuples match, every name resolves, unknown names list them all."""

import pytest

import roll_backend.algorithms as algorithms

REGISTRIES = [
    (
        algorithms.get_advantage_estimator,
        algorithms.ADVANTAGE_ESTIMATORS,
        algorithms.ADVANTAGE_ESTIMATOR_NAMES,
        "advantage estimator",
    ),
    (algorithms.get_policy_loss, algorithms.POLICY_LOSSES, algorithms.POLICY_LOSS_NAMES, "policy loss"),
    (algorithms.get_kl_estimator, algorithms.KL_ESTIMATORS, algorithms.KL_ESTIMATOR_NAMES, "KL estimator"),
    (algorithms.get_agg_mode, algorithms.AGG_MODES, algorithms.AGG_MODE_NAMES, "loss aggregation mode"),
]


@pytest.mark.parametrize("lookup, table, names, kind", REGISTRIES)
def test_names_tuple_is_the_registry_and_every_name_resolves(lookup, table, names, kind):
    assert names == tuple(table)
    for name in names:
        assert lookup(name) is table[name]


@pytest.mark.parametrize("lookup, table, names, kind", REGISTRIES)
def test_unknown_names_raise_with_every_known_option(lookup, table, names, kind):
    for bad in ("foo", "", None):
        with pytest.raises(ValueError) as err:
            lookup(bad)
        message = str(err.value)
        assert message.startswith(f"unknown {kind} {bad!r}; known: ")
        assert all(name in message for name in names)


def test_the_spec_names_are_public():
    spec_names = [
        "masked_sum", "masked_mean", "masked_var", "masked_whiten", "response_mask_from_eos",
        "logprobs_from_logits", "entropy_from_logits", "entropy_loss", "kl_estimate", "kl_penalized_rewards",
        "agg_loss", "gae", "grpo_advantage", "rloo_advantage", "reinforce_pp_advantage",
        "reinforce_pp_baseline_advantage", "remax_advantage", "ppo_policy_loss", "gspo_policy_loss", "value_loss",
    ]  # fmt: skip
    for name in spec_names:
        assert callable(getattr(algorithms, name))
        assert name in algorithms.__all__
