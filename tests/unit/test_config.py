"""LossConfig validation messages and the generic from_dict / to_dict / overrides / describe_fields."""
import dataclasses
from dataclasses import dataclass
from typing import Literal, Optional

import pytest
import yaml

from megatron_cispo.config import (
    CispoConfig,
    ConfigError,
    KLConfig,
    LossConfig,
    PPOConfig,
    RolloutISConfig,
    TISConfig,
    apply_overrides,
    config_field,
    describe_fields,
    from_dict,
    to_dict,
)


def test_defaults_are_scalerl_cispo_zero_to_five():
    cfg = LossConfig()
    assert (cfg.policy_loss, cfg.cispo.anchor, cfg.loss_agg) == ("cispo", "old", "token_mean")
    assert (1 - cfg.cispo.eps_low, 1 + cfg.cispo.eps_high) == (0.0, 5.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.policy_loss = "ppo"


@pytest.mark.parametrize("make,message", [
    (lambda: CispoConfig(eps_low=-0.1), r"CispoConfig.eps_low must be finite and >= 0 \(above 1: no floor\), got -0.1"),
    (lambda: CispoConfig(eps_low=float("inf")), r"CispoConfig.eps_low must be finite and >= 0 .*, got inf"),
    (lambda: CispoConfig(clip_min=-0.5), "CispoConfig.clip_min must be null or finite and >= 0, got -0.5"),
    (lambda: CispoConfig(clip_max=0.0), "CispoConfig.clip_max must be null or > 0, got 0.0"),
    (lambda: CispoConfig(clip_min=0.5, clip_max=0.2),
     r"CispoConfig: the weight range \[0.5, 0.2\] is empty; the floor \(clip_min, else max\(0, 1-eps_low\)\) "
     r"must be <= the cap \(clip_max, else 1\+eps_high\)"),
    (lambda: CispoConfig(eps_low=0.2, clip_max=0.5), r"CispoConfig: the weight range \[0.8, 0.5\] is empty"),
    (lambda: KLConfig(is_weight=True, estimator="k2"),
     r"KLConfig.is_weight=True needs estimator 'k3' or 'k1' .*, got estimator='k2'"),
    (lambda: CispoConfig(eps_high=-1.0), "CispoConfig.eps_high must be >= 0, got -1.0"),
    (lambda: CispoConfig(anchor="sampler"), r"CispoConfig.anchor: expected 'old' \| 'rollout', got str 'sampler'"),
    (lambda: CispoConfig(mask_eps_low=2.0), r"CispoConfig.mask_eps_low must be in \[0, 1\], got 2.0"),
    (lambda: CispoConfig(mask_eps_high=-0.1), "CispoConfig.mask_eps_high must be >= 0, got -0.1"),
    (lambda: PPOConfig(eps_low=1.2), r"PPOConfig.eps_low must be in \[0, 1\], got 1.2"),
    (lambda: PPOConfig(dual_clip=1.0), "PPOConfig.dual_clip must be None or > 1, got 1.0"),
    (lambda: RolloutISConfig(eps_high=-0.2), "RolloutISConfig.eps_high must be >= 0, got -0.2"),
    (lambda: TISConfig(level="batch"), r"TISConfig.level: expected 'token' \| 'sequence' \| None, got str 'batch'"),
    (lambda: TISConfig(cap=0.0), "TISConfig.cap must be > 0, got 0.0"),
    (lambda: KLConfig(coef=-1.0), "KLConfig.coef must be finite and >= 0, got -1.0"),
    (lambda: KLConfig(estimator="k4"), r"KLConfig.estimator: expected 'k1' \| 'k2' \| 'k3', got str 'k4'"),
    (lambda: LossConfig(loss_agg="mean"), r"LossConfig.loss_agg: expected 'token_mean' \| .*, got str 'mean'"),
    (lambda: LossConfig(max_len=0), "LossConfig.max_len must be None or > 0, got 0"),
    (lambda: LossConfig(loss_agg="seq_mean_token_sum_norm"),
     "LossConfig.max_len must be > 0 when loss_agg='seq_mean_token_sum_norm', got None"),
    (lambda: LossConfig(entropy_coef=float("nan")), "LossConfig.entropy_coef must be finite, got nan"),
    (lambda: LossConfig(policy_loss=""), "LossConfig.policy_loss must be a registered loss name, got ''"),
])
def test_bad_config_is_rejected_naming_field_and_value(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_rollout_anchor_without_tis_and_old_anchor_with_tis_are_fine():
    LossConfig(cispo=CispoConfig(anchor="rollout"))
    LossConfig(tis=TISConfig(level="token"))
    LossConfig(policy_loss="ppo", cispo=CispoConfig(anchor="rollout"), tis=TISConfig(level="token"))


def test_from_dict_builds_nested_config_with_int_to_float_promotion():
    cfg = from_dict(LossConfig, {"policy_loss": "ppo", "ppo": {"eps_high": 1, "dual_clip": 3},
                                 "tis": {"level": "sequence"}}, "loss")
    assert cfg.ppo == PPOConfig(eps_high=1.0, dual_clip=3.0)
    assert isinstance(cfg.ppo.eps_high, float) and cfg.tis.level == "sequence"


@pytest.mark.parametrize("data,message", [
    ({"cispo": {"eps_high": "abc"}}, "loss.cispo.eps_high: expected float, got str 'abc'"),
    ({"cispo": {"eps_hihg": 4.0}}, "loss.cispo.eps_hihg: unknown key; known keys: eps_low, eps_high, anchor"),
    ({"cispo": {"anchor": "new"}}, "loss.cispo.anchor: expected 'old' | 'rollout', got str 'new'"),
    ({"cispo": {"token_mask": 1}}, "loss.cispo.token_mask: expected bool, got int 1"),
    ({"cispo": {"eps_low": True}}, "loss.cispo.eps_low: expected float, got bool True"),
    ({"max_len": 4.5}, r"loss.max_len: expected int \| None, got float 4.5"),
    ({"max_len": False}, r"loss.max_len: expected int \| None, got bool False"),
    ({"tis": {"level": "tok"}}, r"loss.tis.level: expected 'token' \| 'sequence' \| None, got str 'tok'"),
    ({"kl": 0.1}, "loss.kl: expected a mapping for KLConfig, got float 0.1"),
    ({"cispo": {"eps_low": -2.0}}, r"loss.cispo: CispoConfig.eps_low must be finite and >= 0 .*, got -2.0"),
])
def test_from_dict_errors_name_the_full_key_path(data, message):
    with pytest.raises(ConfigError, match=message):
        from_dict(LossConfig, data, "loss")


@dataclass(frozen=True, kw_only=True)
class Inner:
    sizes: tuple[int, ...] = (1, 2)
    pair: tuple[str, float] = ("a", 1.0)
    names: list[str] = config_field(factory=list)


@dataclass(frozen=True, kw_only=True)
class Outer:
    name: str = config_field(doc="Run name.")  # required
    mode: Literal["a", "b"] = "a"
    extra: Optional[Inner] = None
    inner: Inner = config_field(factory=Inner, doc="Nested.")
    tags: dict[str, int] = config_field(factory=dict)


def test_from_dict_handles_tuples_lists_optionals_and_required_fields():
    o = from_dict(Outer, {"name": "x", "inner": {"sizes": [3, 4, 5], "pair": ["b", 2], "names": ["p"]},
                          "extra": {}, "tags": {"k": 1}})
    assert o.inner == Inner(sizes=(3, 4, 5), pair=("b", 2.0), names=["p"]) and o.extra == Inner()
    assert o.tags == {"k": 1}
    with pytest.raises(ConfigError, match=r"exp.inner.sizes.1: expected int, got str 'x'"):
        from_dict(Outer, {"name": "x", "inner": {"sizes": [1, "x"]}}, "exp")
    with pytest.raises(ConfigError, match=r"exp.inner.pair: expected tuple\[str, float\], got list \['a'\]"):
        from_dict(Outer, {"name": "x", "inner": {"pair": ["a"]}}, "exp")
    with pytest.raises(ConfigError, match=r"exp.name: required key missing \(str\)"):
        from_dict(Outer, {}, "exp")
    with pytest.raises(ConfigError, match="exp.tags.k: expected int, got str 'v'"):
        from_dict(Outer, {"name": "x", "tags": {"k": "v"}}, "exp")


def test_to_dict_round_trips_through_yaml():
    cfg = LossConfig(policy_loss="ppo", ppo=PPOConfig(dual_clip=2.0), tis=TISConfig(level="token"))
    data = yaml.safe_load(yaml.safe_dump(to_dict(cfg)))
    assert data["ppo"] == {"eps_low": 0.2, "eps_high": 0.2, "dual_clip": 2.0}
    assert from_dict(LossConfig, data) == cfg
    assert to_dict(Outer(name="n")) == {"name": "n", "mode": "a", "extra": None,
                                        "inner": {"sizes": [1, 2], "pair": ["a", 1.0], "names": []}, "tags": {}}


def test_apply_overrides_parses_yaml_values_and_does_not_mutate_input():
    data = {"loss": {"cispo": {"eps_high": 4.0, "anchor": "old"}}, "steps": 10, "tags": [1]}
    out = apply_overrides(data, ["loss.cispo.eps_high=5", "steps=2e3", "loss.cispo.anchor=rollout", "tags=[a, b]"])
    assert out == {"loss": {"cispo": {"eps_high": 5, "anchor": "rollout"}}, "steps": 2000.0, "tags": ["a", "b"]}
    assert data == {"loss": {"cispo": {"eps_high": 4.0, "anchor": "old"}}, "steps": 10, "tags": [1]}


def test_apply_overrides_without_schema_rejects_paths_missing_from_data():
    with pytest.raises(ConfigError, match=r"loss.cispo.anchor: unknown key in override 'loss.cispo.anchor=old'"):
        apply_overrides({"loss": {"cispo": {}}}, ["loss.cispo.anchor=old"])
    with pytest.raises(ConfigError, match="override 'loss.cispo' must look like a.b.c=value"):
        apply_overrides({"loss": {}}, ["loss.cispo"])


def test_apply_overrides_with_schema_allows_defaulted_keys_and_names_unknown_paths():
    out = apply_overrides({}, ["cispo.anchor=rollout", "kl.coef=1e-3", "tis.level=null"], schema=LossConfig)
    assert out == {"cispo": {"anchor": "rollout"}, "kl": {"coef": 0.001}, "tis": {"level": None}}
    assert from_dict(LossConfig, out).kl.coef == 0.001
    with pytest.raises(ConfigError, match="cispo.eps_hi: unknown key; known keys: eps_low, eps_high"):
        apply_overrides({}, ["cispo.eps_hi=3"], schema=LossConfig)
    with pytest.raises(ConfigError, match="cispo.eps_low.x: cannot set a key inside a value of type float"):
        apply_overrides({}, ["cispo.eps_low.x=3"], schema=LossConfig)


def test_overridden_wrong_type_is_reported_by_from_dict_with_its_path():
    out = apply_overrides({}, ["cispo.eps_high=five"], schema=LossConfig)
    with pytest.raises(ConfigError, match="loss.cispo.eps_high: expected float, got str 'five'"):
        from_dict(LossConfig, out, "loss")


def test_describe_fields_lists_every_leaf_with_type_default_and_doc():
    rows = {key: (tp, default, doc) for key, tp, default, doc in describe_fields(LossConfig)}
    assert rows["cispo.eps_high"][:2] == ("float", 4.0) and "cap" in rows["cispo.eps_high"][2]
    assert rows["cispo.anchor"][:2] == ("'old' | 'rollout'", "old")
    assert rows["tis.level"][:2] == ("'token' | 'sequence' | None", None)
    assert rows["max_len"][0] == "int | None"
    assert len(rows) == len(list(describe_fields(LossConfig)))
    assert all(doc for _, _, doc in rows.values())
    outer = {k: d for k, _, d, _ in describe_fields(Outer)}
    assert outer["name"] is dataclasses.MISSING and outer["inner.sizes"] == (1, 2)
