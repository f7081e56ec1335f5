"""Framework presets: another framework's CISPO flags, by their names and defaults, as LossConfig keys.

    overrides = from_framework("nemo_rl", ratio_clip_min=1.0, ratio_clip_max=5.0)  # -> weight in [0, 6]
    cfg = from_dict(LossConfig, overrides)  # validates the values
    # YAML: loss: {preset: {framework: nemo_rl, ratio_clip_min: 1.0, ratio_clip_max: 5.0}}

Presets translate configuration, so they sit below config.py and import only schema: config.py's
`loss.preset` loader hook calls expand_preset and hands it LossConfig to validate against.

Every preset sets the same keys: policy_loss, cispo.{eps_low, eps_high, clip_min, clip_max, anchor}
and tis.{level, cap}; slime's also sets correction.{opsm, opsm_ref} (its --use-opsm). It reproduces
that framework's clamp and, where our formula is the same, its truncated IS (and slime's OPSM)
exactly; a flag value with no exact equivalent here is refused in one line. What no preset
reproduces (reductions, masks, -inf anchors) is in docs/mapping.md.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, Optional

from .schema import ConfigError, check_field_types, from_dict

_SEE = "no exact equivalent here; see docs/mapping.md for the closest setting"


def _loss(*, eps_low: float = 1.0, eps_high: float = 4.0, clip_min: Optional[float] = None,
          clip_max: Optional[float] = None, anchor: str = "old", tis_level: Optional[str] = None,
          tis_cap: float = 2.0) -> dict:
    """The LossConfig keys every preset sets (the ones not given keep LossConfig's defaults)."""
    return {"policy_loss": "cispo",
            "cispo": {"eps_low": eps_low, "eps_high": eps_high, "clip_min": clip_min, "clip_max": clip_max,
                      "anchor": anchor},
            "tis": {"level": tis_level, "cap": tis_cap}}


def _refuse(flag: str, value: Any, why: str) -> None:
    raise ValueError(f"{flag}={value!r}: {why}")


@dataclass(frozen=True, kw_only=True)
class SkyRL:
    """trainer.algorithm.cispo and .off_policy_correction (NovaSky-AI/SkyRL@a9564572,
    skyrl/backends/skyrl_train/utils/ppo_utils.py::compute_policy_loss_cispo,
    off_policy_correction_utils.py::compute_tis_ratio). Offsets: clamp(r, 1-low, 1+high)."""

    cispo_eps_clip_low: float = 1.0
    cispo_eps_clip_high: float = 4.0
    cispo_anchor: Literal["old", "rollout"] = "old"
    tis_ratio_type: Optional[Literal["token", "sequence"]] = None
    token_tis_ratio_clip_high: float = 2.0
    sequence_tis_ratio_clip_high: float = 5.0

    def __post_init__(self) -> None:
        check_field_types(self)

    def loss(self) -> dict:
        cap = self.sequence_tis_ratio_clip_high if self.tis_ratio_type == "sequence" else self.token_tis_ratio_clip_high
        return _loss(eps_low=self.cispo_eps_clip_low, eps_high=self.cispo_eps_clip_high, anchor=self.cispo_anchor,
                     tis_level=self.tis_ratio_type, tis_cap=cap)


@dataclass(frozen=True, kw_only=True)
class MsSwift:
    """--loss_type cispo (modelscope/ms-swift@3602360a, swift/rlhf_trainers/grpo_trainer.py; flags in
    swift/rlhf_trainers/args_mixin.py). Absolute cap: min(r, epsilon_high), no floor; epsilon_high
    unset falls back to epsilon (0.2)."""

    epsilon: float = 0.2
    epsilon_high: Optional[float] = None
    importance_sampling_level: Literal["token", "sequence", "sequence_token"] = "token"
    rollout_importance_sampling_mode: Optional[Literal[
        "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]] = None
    rollout_importance_sampling_threshold: float = 2.0

    def __post_init__(self) -> None:
        check_field_types(self)
        if self.importance_sampling_level != "token":
            _refuse("importance_sampling_level", self.importance_sampling_level,
                    "a sequence-level (GSPO) CISPO ratio has " + _SEE)
        if self.rollout_importance_sampling_mode not in (None, "token_truncate"):
            _refuse("rollout_importance_sampling_mode", self.rollout_importance_sampling_mode,
                    "ms-swift's masks keep weight rho and its sequence ratio is a geometric mean; " + _SEE)

    def loss(self) -> dict:
        cap = self.epsilon_high if self.epsilon_high is not None else self.epsilon
        level = "token" if self.rollout_importance_sampling_mode == "token_truncate" else None
        return _loss(clip_min=0.0, clip_max=cap, tis_level=level, tis_cap=self.rollout_importance_sampling_threshold)


@dataclass(frozen=True, kw_only=True)
class TRL:
    """GRPOConfig(loss_type="cispo") (huggingface/trl@f2cd5771, trl/trainer/grpo_trainer.py::_compute_loss
    and the vLLM IS block of _generate_and_score_completions; flags in trl/trainer/grpo_config.py).
    Absolute cap min(r, epsilon_high), epsilon_high unset -> epsilon (0.2). vLLM IS is on by default
    when use_vllm, as sequence_mask, which has no equivalent here."""

    epsilon: float = 0.2
    epsilon_high: Optional[float] = None
    importance_sampling_level: Literal["token", "sequence"] = "token"
    use_vllm: bool = False
    vllm_importance_sampling_correction: bool = True
    vllm_importance_sampling_mode: Literal[
        "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"] = "sequence_mask"
    vllm_importance_sampling_clip_min: Optional[float] = None
    vllm_importance_sampling_clip_max: Optional[float] = 3.0

    def __post_init__(self) -> None:
        check_field_types(self)
        if self.importance_sampling_level != "token":
            _refuse("importance_sampling_level", self.importance_sampling_level,
                    "a sequence-level (GSPO) CISPO ratio has " + _SEE)
        if not self._is_on():
            return
        if self.vllm_importance_sampling_mode not in ("token_truncate", "sequence_truncate"):
            _refuse("vllm_importance_sampling_mode", self.vllm_importance_sampling_mode,
                    "TRL's masks keep weight rho (on by default with use_vllm); " + _SEE +
                    ", or set vllm_importance_sampling_correction=False")
        if self.vllm_importance_sampling_clip_min not in (None, 0.0):
            _refuse("vllm_importance_sampling_clip_min", self.vllm_importance_sampling_clip_min,
                    "our TIS has no floor; " + _SEE)
        if self.vllm_importance_sampling_clip_max is None:
            _refuse("vllm_importance_sampling_clip_max", None, "an untruncated IS weight has " + _SEE)

    def _is_on(self) -> bool:
        return self.use_vllm and self.vllm_importance_sampling_correction

    def loss(self) -> dict:
        cap = self.epsilon_high if self.epsilon_high is not None else self.epsilon
        level = self.vllm_importance_sampling_mode.removesuffix("_truncate") if self._is_on() else None
        tis_cap = self.vllm_importance_sampling_clip_max if self._is_on() else 2.0
        return _loss(clip_min=0.0, clip_max=cap, tis_level=level, tis_cap=tis_cap)


@dataclass(frozen=True, kw_only=True)
class Verl:
    """actor_rollout_ref.actor.policy_loss.loss_mode=cispo and algorithm.rollout_correction.rollout_is
    (volcengine/verl@b178a3cd, verl/trainer/ppo/core_algos.py::compute_policy_loss_cispo,
    verl/trainer/ppo/rollout_corr_helper.py::compute_rollout_correction_weights). Offsets; a low
    offset > 1 (their example writes 10) is no floor. verl's CISPO anchors on old_log_prob."""

    clip_ratio: float = 0.2
    clip_ratio_low: Optional[float] = 0.2
    clip_ratio_high: Optional[float] = 0.2
    rollout_is: Optional[Literal["token", "sequence"]] = None
    rollout_is_threshold: float = 2.0
    rollout_is_batch_normalize: bool = False

    def __post_init__(self) -> None:
        check_field_types(self)
        if self.rollout_is_batch_normalize:
            _refuse("rollout_is_batch_normalize", True, "normalising IS weights to batch mean 1 has " + _SEE)

    def loss(self) -> dict:
        low = self.clip_ratio_low if self.clip_ratio_low is not None else self.clip_ratio
        high = self.clip_ratio_high if self.clip_ratio_high is not None else self.clip_ratio
        return _loss(eps_low=low, eps_high=high, tis_level=self.rollout_is, tis_cap=self.rollout_is_threshold)


@dataclass(frozen=True, kw_only=True)
class NemoRL:
    """loss_fn with use_cispo: true (NVIDIA-NeMo/RL@7ea279ab,
    nemo_rl/algorithms/loss/loss_functions.py::ClippedPGLossFn). Offsets: ratio_clip_max 5.0 is a
    cap of 6. IS is on with use_importance_sampling_correction; only its 'tis' type maps exactly."""

    ratio_clip_min: float = 0.2
    ratio_clip_max: float = 0.2
    use_importance_sampling_correction: bool = False
    truncated_importance_sampling_type: Optional[Literal["tis", "icepop", "seq-mask-tis"]] = None
    truncated_importance_sampling_ratio: Optional[float] = None
    truncated_importance_sampling_ratio_min: Optional[float] = None

    def __post_init__(self) -> None:
        check_field_types(self)
        if not self.use_importance_sampling_correction:
            if self.truncated_importance_sampling_type is not None:  # NeMo-RL asserts the same
                _refuse("truncated_importance_sampling_type", self.truncated_importance_sampling_type,
                        "needs use_importance_sampling_correction=True")
            return
        if self.truncated_importance_sampling_type != "tis" or self.truncated_importance_sampling_ratio is None:
            _refuse("truncated_importance_sampling_type", self.truncated_importance_sampling_type,
                    "with use_importance_sampling_correction=True only 'tis' with a "
                    "truncated_importance_sampling_ratio maps exactly (the untruncated weight and the masks have "
                    + _SEE + ")")
        if self.truncated_importance_sampling_ratio_min not in (None, 0.0):
            _refuse("truncated_importance_sampling_ratio_min", self.truncated_importance_sampling_ratio_min,
                    "our TIS has no floor; " + _SEE)

    def loss(self) -> dict:
        on = self.use_importance_sampling_correction
        return _loss(eps_low=self.ratio_clip_min, eps_high=self.ratio_clip_max, tis_level="token" if on else None,
                     tis_cap=self.truncated_importance_sampling_ratio if on else 2.0)


@dataclass(frozen=True, kw_only=True)
class Slime:
    """--advantage-estimator cispo (THUDM/slime@624b824a, slime/utils/ppo_utils.py::compute_cispo_loss
    and ::compute_opsm_mask, slime/backends/megatron_utils/loss.py::vanilla_tis_function and
    ::policy_loss_function; flags in slime/utils/arguments.py). Offsets; --eps-clip-high unset falls
    back to --eps-clip. --use-opsm tests mean_t log(pi_old / pi_theta), or pi_rollout's with
    --use-rollout-logprobs."""

    eps_clip: float = 0.2
    eps_clip_high: Optional[float] = None
    use_rollout_logprobs: bool = False
    use_tis: bool = False
    tis_clip: float = 2.0
    tis_clip_low: float = 0.0
    use_opsm: bool = False
    opsm_delta: float = 1e-4

    def __post_init__(self) -> None:
        check_field_types(self)
        if self.use_rollout_logprobs and self.use_tis:  # slime asserts the same
            _refuse("use_tis", True, "slime refuses it with use_rollout_logprobs (the anchor already divides "
                    "by pi_rollout)")
        if self.use_tis and self.tis_clip_low != 0.0:
            _refuse("tis_clip_low", self.tis_clip_low, "our TIS has no floor; " + _SEE)

    def loss(self) -> dict:
        high = self.eps_clip_high if self.eps_clip_high is not None else self.eps_clip
        anchor = "rollout" if self.use_rollout_logprobs else "old"
        loss = _loss(eps_low=self.eps_clip, eps_high=high, anchor=anchor,
                     tis_level="token" if self.use_tis else None, tis_cap=self.tis_clip)
        # slime hands compute_opsm_mask the ratio's own denominator: pi_old, or pi_rollout with
        # --use-rollout-logprobs (policy_loss_function's old_log_probs)
        opsm = {"opsm": self.opsm_delta, "opsm_ref": anchor} if self.use_opsm else {"opsm": None, "opsm_ref": "rollout"}
        return {**loss, "correction": opsm}


PRESETS: dict[str, type] = {"ms_swift": MsSwift, "nemo_rl": NemoRL, "skyrl": SkyRL, "slime": Slime, "trl": TRL,
                            "verl": Verl}


def _resolve(spec: Any, path: str) -> tuple[str, dict]:
    if not isinstance(spec, Mapping) or not isinstance(spec.get("framework"), str):
        raise ConfigError(f"{path}: expected a mapping with framework: {' | '.join(PRESETS)}, got {spec!r}")
    framework, flags = spec["framework"], {k: v for k, v in spec.items() if k != "framework"}
    if framework not in PRESETS:
        raise ConfigError(f"{path}.framework: unknown framework {framework!r}; known: {', '.join(PRESETS)}")
    return framework, from_dict(PRESETS[framework], flags, path).loss()


def from_framework(framework: str, **flags: Any) -> dict:
    """LossConfig keys (nested dict) for `framework`'s flags, by their names; unset flags take that
    framework's defaults. Raises ConfigError naming the flag for an unknown flag or framework, or a
    value with no exact equivalent; from_dict(LossConfig, ...) then checks the values themselves."""
    return _resolve({"framework": framework, **flags}, "preset")[1]


def expand_preset(spec: Any, rest: Mapping, path: str, *, schema: type) -> dict:
    """The loader hook of `loss.preset` (LossConfig.__loader_keys__): `rest` (the other keys of the
    loss mapping) with the preset's keys merged in. A key in both must hold the same value.
    schema: the class the preset's keys are checked against on their own (config.py passes
    LossConfig), so a flag value that class refuses is reported as the preset's."""
    framework, loss = _resolve(spec, path)
    try:  # a flag value our config refuses, e.g. a negative offset: say which preset produced it
        from_dict(schema, loss)
    except ConfigError as e:
        flags = {k: v for k, v in spec.items() if k != "framework"}
        raise ConfigError(f"{path}: {framework} flags {flags} give an invalid loss config: {e}") from None
    return _merge(dict(rest), loss, path.rpartition(".")[0], f"{path} (framework {framework})")


def _merge(explicit: dict, preset: dict, prefix: str, source: str) -> dict:
    for key, value in preset.items():
        where = f"{prefix}.{key}" if prefix else key
        if isinstance(value, dict) and isinstance(explicit.get(key), Mapping):
            explicit[key] = _merge(dict(explicit[key]), value, where, source)
        elif isinstance(value, dict) and explicit.get(key) is not None:
            raise ConfigError(f"{where}: expected a mapping, got {explicit[key]!r}")
        elif key in explicit and explicit[key] != value and not isinstance(value, dict):
            raise ConfigError(f"{where}: {explicit[key]!r} conflicts with {source}, which sets it to {value!r}; "
                              f"change it through the preset's flags, or drop one of the two")
        else:
            explicit[key] = value
    return explicit
