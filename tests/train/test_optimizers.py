"""The optimizer classes of ``jonebit.train.optimizers``: one dataclass per DeepSpeed type is the only source of
its keys, defaults and validation, and its ``build`` is the transform it claims to be.

* the registry: DeepSpeed's names and aliases, case-insensitive, and nothing else;
* each class's fields are exactly the keys ``load_config`` accepts (an unknown key is refused, naming it and
  listing the fields), with the fields' defaults filled in; its ignored keys are accepted with a warning;
* defaults that claim to be a transform's own (``onebit_adam``, ``zero_one_adam``, ``onebit_lamb``,
  ``OneBitAdamOptions``) are, read from their signatures;
* ``build`` of each class equals the transform built directly: bit-identical parameters after a few steps
  (the 1-bit family inside ``shard_map`` on 8 devices).
"""

from __future__ import annotations

import dataclasses
import inspect
import logging

import jax
import numpy as np
import optax
import pytest

import jonebit
from jonebit.experimental import OneBitAdamOptions
from jonebit.train import optimizers as O
from jonebit.train.config import ConfigError, load_config
from tests.train.test_config import N_DEV, SHAPES, run_optax, run_per_rank, run_sharded

CLASSES = {"Adam": O.Adam, "AdamW": O.AdamW, "Lamb": O.Lamb, "OneBitAdam": O.OneBitAdam,
           "ZeroOneAdam": O.ZeroOneAdam, "OneBitLamb": O.OneBitLamb}


def config_with(type_name, params):
    return {"train_batch_size": 8 * N_DEV, "optimizer": {"type": type_name, "params": params}}


def test_registry_holds_deepspeeds_names():
    assert set(O.OPTIMIZERS) == {name.lower() for name in CLASSES}  # the aliases differ only in case
    for name, cls in CLASSES.items():
        assert cls.NAME == name and O.OPTIMIZERS[name.lower()] is cls
    for alias, name in (("OnebitAdam", "OneBitAdam"), ("OnebitLamb", "OneBitLamb"), ("ADAMW", "AdamW"),
                        ("zerooneadam", "ZeroOneAdam")):
        assert load_config(config_with(alias, {})).optimizer.type == name
    assert set(O.ONEBIT_OPTIMIZERS) == {"OneBitAdam", "ZeroOneAdam", "OneBitLamb"}
    with pytest.raises(ValueError, match="registered twice"):
        O.register("adam")(type("Again", (), {}))


@pytest.mark.parametrize("name", sorted(CLASSES))
def test_fields_are_the_accepted_keys(name, caplog):
    cls = CLASSES[name]
    fields = dataclasses.fields(cls)
    assert all(f.metadata["doc"] and callable(f.metadata["parse"]) for f in fields)
    params = load_config(config_with(name, {})).optimizer.params
    assert tuple(params) == cls.keys() and dict(params) == cls.defaults()
    # Every field given explicitly (its default, as JSON) is accepted and changes nothing.
    as_json = {k: list(v) if isinstance(v, tuple) else v for k, v in cls.defaults().items()}
    assert load_config(config_with(name, as_json)).optimizer.params == params
    with pytest.raises(ConfigError, match="unknown key in 'optimizer.params'") as info:
        load_config(config_with(name, {"no_such_key": 1}))
    assert info.value.key == "optimizer.params.no_such_key"
    known = str(info.value).split("Known keys: ")[1].split(";")[0]
    assert known == ", ".join(sorted(cls.keys()))
    with caplog.at_level(logging.WARNING, logger="jonebit.train.config"):
        load_config(config_with(name, dict.fromkeys(cls.IGNORED, True)))
    for key in cls.IGNORED:
        assert f"'optimizer.params.{key}' is accepted but ignored: {cls.IGNORED[key]}" in caplog.text


def test_jonebit_only_keys():
    assert set(O.OneBitAdam.jonebit_keys()) == {"auto_freeze", "mask_unseen", "row_scales", "preconditioned",
                                                 "clip_ratio", "variance_refresh", "local_clip"}
    assert set(O.OneBitLamb.jonebit_keys()) == {"auto_freeze", "mask_unseen"}
    assert set(O.ZeroOneAdam.jonebit_keys()) == {"mask_unseen"}
    assert O.Adam.jonebit_keys() == O.AdamW.jonebit_keys() == O.Lamb.jonebit_keys() == ()
    # Research keys are OneBitAdamOptions' fields (but error_feedback, a study switch without a config key).
    options = {f.name: f.default for f in dataclasses.fields(OneBitAdamOptions)}
    assert set(O.OneBitAdam.experimental_keys()) == set(options) - {"error_feedback"}
    for key in O.OneBitAdam.experimental_keys():
        assert O.OneBitAdam.defaults()[key] == options[key], key


# Fields whose default is DeepSpeed's and deliberately not the transform's argument of the same name.
NOT_THE_TRANSFORMS = {
    "max_grad_norm",  # a DeepSpeed param the 1-bit optimizers ignore; onebit_adam's max_grad_norm is gradient_clipping
}


@pytest.mark.parametrize("cls,transform", [(O.OneBitAdam, jonebit.onebit_adam), (O.ZeroOneAdam, jonebit.zero_one_adam),
                                           (O.OneBitLamb, jonebit.onebit_lamb)], ids=lambda x: getattr(x, "NAME", ""))
def test_defaults_are_the_transforms(cls, transform):
    signature = {name: p.default for name, p in inspect.signature(transform).parameters.items()
                 if p.default is not inspect.Parameter.empty}
    defaults = cls.defaults()
    assert defaults["betas"] == (signature["b1"], signature["b2"])
    shared = (set(defaults) & set(signature)) - NOT_THE_TRANSFORMS
    assert {"eps", "weight_decay", "bias_correction", "mask_unseen"} <= shared
    for key in shared:
        assert defaults[key] == signature[key], key


def test_adam_and_lamb_defaults_are_optaxs():
    adam = inspect.signature(optax.adam).parameters
    for cls in (O.Adam, O.Lamb):
        d = cls.defaults()
        assert d["betas"] == (adam["b1"].default, adam["b2"].default) and d["eps"] == adam["eps"].default


@pytest.mark.parametrize("cls,params,direct", [
    (O.AdamW, {"lr": 2e-2, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.1},
     lambda: optax.adamw(2e-2, b1=0.8, b2=0.99, eps=1e-6, weight_decay=0.1)),
    (O.Adam, {"lr": 2e-2, "weight_decay": 0.1}, lambda: optax.adamw(2e-2, weight_decay=0.1)),
    (O.Adam, {"lr": 2e-2, "weight_decay": 0.1, "adam_w_mode": False},
     lambda: optax.chain(optax.add_decayed_weights(0.1), optax.adam(2e-2))),
    (O.Adam, {"lr": 2e-2}, lambda: optax.adam(2e-2)),
], ids=["adamw", "adam", "adam-l2", "adam-no-decay"])
def test_plain_build_equals_optax(cls, params, direct):
    rng = np.random.default_rng(0)
    start = {k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}
    grads = [{k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()} for _ in range(5)]
    got = run_optax(cls(**params).build(params["lr"], {}), start, grads)
    want = run_optax(direct(), start, grads)
    for k in got:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_lamb_build_is_optax_lamb_with_a_clamp():
    """With a clamp that never binds, Lamb is optax's LAMB (the norms are computed alike up to rounding)."""
    rng = np.random.default_rng(1)
    start = {k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}
    grads = [{k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()} for _ in range(5)]
    lamb = O.Lamb(lr=1e-2, weight_decay=0.01, max_coeff=1e30, min_coeff=0.0)
    got = run_optax(lamb.build(1e-2, {}), start, grads)
    want = run_optax(optax.lamb(1e-2, weight_decay=0.01), start, grads)
    # The two compute each leaf's trust ratio ||p|| / ||u|| from sums of at most N = 15 squares in another order:
    # each norm's relative error is at most N u (u = 6e-8, float32), the ratio's 2 N u = 1.8e-6. The ratio scales a
    # step of lr * |u| / ||u|| * ||p|| <= lr * ||p|| (~1e-2 * 2 here), so one step differs by <= 1.8e-6 * 2e-2 =
    # 3.6e-8 absolute and five by <= 1.8e-7 (plus a few ulps of |p| ~ 1, 1e-5 relative), inside atol 1e-6.
    for k in got:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)


def _problem(steps, seed):
    rng = np.random.default_rng(seed)
    params = {k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}
    grads = [{k: rng.normal(size=(N_DEV, *s)).astype(np.float32) for k, s in SHAPES.items()} for _ in range(steps)]
    return params, grads


STAGE0 = {"axis_name": "data", "fused": False, "zero_stage": 0}


def test_onebit_adam_build_equals_onebit_adam():
    """DeepSpeed's freeze_step F is onebit_adam's F - 1; the research keys become OneBitAdamOptions."""
    assert jax.device_count() == N_DEV
    params, grads = _problem(5, 2)
    options = O.OneBitAdam(freeze_step=3, betas=(0.85, 0.99), weight_decay=0.01, preconditioned=True,
                           clip_ratio=5.0, local_clip=True)
    got, _ = run_sharded(options.build(1e-2, STAGE0 | {"max_grad_norm": 1.0}), params, grads)
    want, _ = run_sharded(jonebit.onebit_adam(
        1e-2, freeze_step=2, b1=0.85, b2=0.99, weight_decay=0.01, max_grad_norm=1.0,
        experimental=OneBitAdamOptions(preconditioned=True, clip_ratio=5.0, local_clip=True)), params, grads)
    for k in got:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_zero_one_adam_build_equals_zero_one_adam():
    params, grads = _problem(6, 3)
    options = O.ZeroOneAdam(var_freeze_step=3, var_update_scaler=2, local_step_scaler=2, local_step_clipper=2)
    got, _ = run_per_rank(options.build(1e-2, STAGE0 | {"fused": True}), params, grads)
    want, _ = run_per_rank(jonebit.zero_one_adam(1e-2, var_freeze_step=3, var_update_scaler=2, local_step_scaler=2,
                                                 local_step_clipper=2, fused=True), params, grads)
    for k in got:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_onebit_lamb_build_equals_onebit_lamb():
    params, grads = _problem(5, 4)
    options = O.OneBitLamb(freeze_step=3, weight_decay=0.01, max_coeff=0.3, coeff_beta=0.5)
    got, _ = run_sharded(options.build(1e-2, STAGE0), params, grads)
    want, _ = run_sharded(jonebit.onebit_lamb(1e-2, freeze_step=2, weight_decay=0.01, max_coeff=0.3, coeff_beta=0.5),
                          params, grads)
    for k in got:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_cross_field_checks_are_methods():
    config = load_config({"train_batch_size": 8, "zero_optimization": {"stage": 1}})
    with pytest.raises(ConfigError, match=r"ZeroOneAdam runs at ZeRO stage 0 only"):
        O.ZeroOneAdam().check(config)
    with pytest.raises(ConfigError, match=r"max_coeff \(0\.1\) is below min_coeff \(0\.2\)"):
        O.OneBitLamb(freeze_step=3, max_coeff=0.1, min_coeff=0.2).check(load_config({"train_batch_size": 8}))
    with pytest.raises(ConfigError, match=r"\"auto\" is available at ZeRO stage 0 only"):
        O.OneBitAdam(freeze_step="auto").check(config)
    O.OneBitAdam(freeze_step=2).check(config)  # stage 1 is fine with an integer freeze_step


def test_inert_keys_warn_at_build(caplog):
    with caplog.at_level(logging.WARNING, logger="jonebit.train.config"):
        O.OneBitLamb(freeze_step=3, bias_correction=True, eps_inside_sqrt=True).build(1e-3, STAGE0)
    assert "optimizer.params.bias_correction: ignored, as DeepSpeed's OneBitLamb does" in caplog.text
    assert "optimizer.params.eps_inside_sqrt: ignored" in caplog.text
